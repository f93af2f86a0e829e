"""Open a run for use: `load_model` builds the model of a training or fine-tuning run (or of one
of its checkpoints) with its tokenizer, for evaluation, generation and export; `generate_text`
samples from it. Above train/ and finetune/, whose runs it opens; below eval/ and hf/."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from marinlm.config import load_config
from marinlm.finetune.loading import finetuned_model, is_finetune_config
from marinlm.kernels import apply_kernels
from marinlm.model import MarinForCausalLM, SamplingConfig, stream_generate
from marinlm.parallel.distributed import init_distributed
from marinlm.parallel.fsdp import apply_fsdp
from marinlm.parallel.mesh import ParallelDims
from marinlm.tokenizer import MarinTokenizer
from marinlm.train.checkpoint import CheckpointError, checkpoint_tokenizer, load_tensors, resolve_checkpoint
from marinlm.train.config import TrainConfig


@dataclass
class LoadedModel:
    model: MarinForCausalLM
    tokenizer: MarinTokenizer
    config: TrainConfig
    checkpoint: Path
    tokenizer_hash: str


def load_model(path: str | Path, device: str = "cpu", kernels: bool = True) -> LoadedModel:
    """Build the model of a run on `device` and load the model tensors of its checkpoint.

    Under torchrun the model is sharded over all ranks with FSDP2 (built on meta, then each rank
    loads its shards through DCP): a model too big for one device can be evaluated. Every rank
    then takes part in each forward. `kernels=False` keeps the reference modules (the code an export
    runs in transformers), whatever the run's `kernels.modules`.
    """
    info = init_distributed(device)
    folder = resolve_checkpoint(path, info.rank, info.world_size)
    dims = ParallelDims.data_parallel(info.world_size)  # every rank holds a shard of the model
    if info.launched:
        dims = dims.build_mesh(info.device.type)
    if is_finetune_config(folder / "config.yaml"):  # base weights + trained tensors, merged
        model, config = finetuned_model(folder, info.device, kernels=kernels)
        if dims.launched:
            apply_fsdp(model, dims.fsdp_mesh)
    else:
        config = load_config(TrainConfig, folder / "config.yaml")
        with torch.device("meta"):
            model = MarinForCausalLM(config.model)
        # Evaluation and generation run fp32 on CPU and bf16 autocast on GPU (eval/runner.py).
        chosen = config.kernels if kernels else config.kernels.reference()
        apply_kernels(model, info.device, "fp32" if info.device.type == "cpu" else "bf16", chosen)
        if dims.launched:
            apply_fsdp(model, dims.fsdp_mesh)
        model.to_empty(device=info.device)
        model.init_weights(seed=0)  # every tensor is overwritten by the load below
        state = {"model": get_model_state_dict(model)}
        load_tensors(folder, state)  # its config.yaml must still describe its tensors
        set_model_state_dict(model, state["model"])
    model.eval()
    tokenizer_dir = checkpoint_tokenizer(folder)
    tokenizer = MarinTokenizer.load(tokenizer_dir)
    trained_with = json.loads((folder / "trainer_state.json").read_text()).get("tokenizer_hash")
    if trained_with is not None and tokenizer.hash != trained_with:
        raise CheckpointError(
            f"{tokenizer_dir}: tokenizer {tokenizer.hash[:12]}… (vocab {tokenizer.vocab_size}) is not the one "
            f"{folder.name} was trained with ({trained_with[:12]}…); text would be encoded with the wrong vocabulary"
        )
    return LoadedModel(model, tokenizer, config, folder, tokenizer.hash)


def document_start_id(loaded: LoadedModel) -> int:
    """The token each training document began with, which scoring and generation put first: BOS,
    or with `data.add_bos` false the EOS that ended the document before (GPT-2's convention); a
    BOS the model never saw in training would be noise at position 0."""
    tok = loaded.tokenizer
    return tok.bos_id if loaded.config.data.add_bos else tok.eos_id


def chat_prompt_ids(loaded: LoadedModel, prompt: str) -> list[int]:
    """`prompt` as one user turn under the run's chat template (the one fine-tuning trained with),
    ready for the assistant's answer; rendered by transformers, as training rendered it."""
    from transformers import AutoTokenizer

    tok = loaded.tokenizer
    if not tok.chat_template:
        raise ValueError(f"{loaded.checkpoint}: the run's tokenizer has no chat template; --chat needs one")
    hf = AutoTokenizer.from_pretrained(str(checkpoint_tokenizer(loaded.checkpoint)))
    messages = [{"role": "user", "content": prompt}]
    return list(
        hf.apply_chat_template(
            messages, chat_template=tok.chat_template, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )


def generate_text(loaded: LoadedModel, prompt: str, sampling: SamplingConfig, stream=None, chat: bool = False) -> str:
    """Generate a continuation of `prompt` (with `chat`, the assistant's answer to it, which ends at
    the end-of-turn token); write text to `stream` as tokens arrive."""
    tok = loaded.tokenizer
    prompt_ids = chat_prompt_ids(loaded, prompt) if chat else [document_start_id(loaded), *tok.encode(prompt)]
    ids = torch.tensor([prompt_ids], device=next(loaded.model.parameters()).device)
    stops = {tok.eos_id}
    if chat and "<|end|>" in tok.special_ids:
        stops.add(tok.special_ids["<|end|>"])
    limit = loaded.model.config.max_seq_len
    if ids.shape[1] + sampling.max_new_tokens > limit:
        print(
            f"warning: the prompt ({ids.shape[1]} tokens) plus {sampling.max_new_tokens} new ones pass the model's "
            f"max_seq_len {limit}; positions beyond it are extrapolated",
            file=sys.stderr,
            flush=True,
        )
    generated: list[int] = []
    shown = ""
    for token in stream_generate(loaded.model, ids, sampling, eos_token_id=tok.eos_id, vocab_size=tok.vocab_size):
        if int(token[0]) in stops:
            break
        generated.append(int(token[0]))
        text = tok.decode(generated)
        if stream is not None and not text.endswith("\ufffd"):  # wait for a whole UTF-8 character
            stream.write(text[len(shown) :])
            stream.flush()
            shown = text
    text = tok.decode(generated)
    if stream is not None and len(text) > len(shown):
        stream.write(text[len(shown) :])
        stream.flush()
    return text
