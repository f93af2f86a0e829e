"""`marinlm export`: a run or checkpoint as a Hugging Face model folder.

Two formats:
- native: configs that Qwen3MoeForCausalLM or MixtralForCausalLM express exactly (hf/qwen3_moe.py)
  become that class;
- remote: every config (the hero included) becomes `modeling_marin.py` + `configuration_marin.py`,
  assembled from the reference model's source (hf/remote_code.py), loaded with trust_remote_code.

The weights are read from the DCP checkpoint a few tensors at a time, one output shard at a time
(shards planned by huggingface_hub on meta tensors), so the export holds at most one shard plus
the tensors being converted: never the whole model, whatever layout wrote the checkpoint.

The folder also carries what other tools need to score the model as marinlm does: the token each
training document began with (`bos_token_id`, prepended by the tokenizer's post-processor), the
context length, the chat template, and a checksum manifest.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from marinlm.config import load_config, to_dict
from marinlm.hf import qwen3_moe
from marinlm.hf.remote_code import configuration_source, modeling_source
from marinlm.model.config import MarinConfig
from marinlm.train.config import TrainConfig
from marinlm.train.safe_load import CheckpointError, SafeFileSystemReader, SafeLoadPlanner
from marinlm.utils.io import make_shareable, os_error_in, refuse_overlap, sha256_file, write_json_atomic
from marinlm.utils.progress import progress_bar

FORMATS = ("auto", "native", "remote")
MANIFEST = "marinlm_export.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class CheckpointTensors:
    """The model tensors of one DCP checkpoint folder, read on demand (any layout: DCP reshards)."""

    def __init__(self, folder: Path):
        self.folder = folder
        metadata = SafeFileSystemReader(str(folder)).read_metadata().state_dict_metadata
        self.specs = {
            k[len("model.") :]: v for k, v in metadata.items() if k.startswith("model.") and hasattr(v, "size")
        }

    def names(self) -> list[str]:
        return list(self.specs)

    def meta(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        return torch.empty(tuple(spec.size), dtype=spec.properties.dtype, device="meta")

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        missing = [n for n in names if n not in self.specs]
        if missing:
            raise CheckpointError(f"{self.folder}: the checkpoint has no model tensor {missing[0]}")
        wanted = {f"model.{n}": torch.empty_like(self.meta(n), device="cpu") for n in names}
        dcp.load(wanted, storage_reader=SafeFileSystemReader(str(self.folder)), planner=SafeLoadPlanner())
        return {n: wanted[f"model.{n}"] for n in names}


@dataclass
class ExportReport:
    out_dir: Path
    format: str
    checkpoint: Path
    tensors: int
    shards: int
    bytes: int
    peak_tensor_bytes: int  # the largest shard: what the export held at most, besides one tensor group


def choose_format(model: MarinConfig, wanted: str) -> str:
    if wanted not in FORMATS:
        raise ValueError(f"--format: must be one of {FORMATS}, got {wanted!r}")
    if wanted == "remote":
        return "remote"
    try:
        qwen3_moe.native_family(model)
        return "native"
    except ValueError as e:
        if wanted == "native":
            raise ValueError(f"--format native: {e}; use --format remote (or auto)") from None
        return "remote"


def tensor_plan(model: MarinConfig, fmt: str, names: list[str]) -> list[qwen3_moe.HFTensor]:
    if fmt == "native":
        return qwen3_moe.hf_tensor_plan(model)
    # lm_head shares the embedding's tensor when tied; transformers ties it back on load.
    skip = {"lm_head.weight"} if model.tie_embeddings else set()
    return [qwen3_moe.HFTensor(f"model.{n}", (n,), qwen3_moe._same) for n in names if n not in skip]


def hf_config(model: MarinConfig, fmt: str, ids: dict, dtype: torch.dtype):
    if fmt == "native" and qwen3_moe.native_family(model) == "mixtral":
        config = qwen3_moe.mixtral_hf_config(model)
        config.architectures = ["MixtralForCausalLM"]
    elif fmt == "native":
        config = qwen3_moe.qwen3_moe_hf_config(model)
        config.architectures = ["Qwen3MoeForCausalLM"]
    else:
        from marinlm.hf.configuration_marin import MarinHFConfig

        config = MarinHFConfig(marin=to_dict(model))
        config.architectures = ["MarinHFForCausalLM"]
        config.auto_map = {
            "AutoConfig": "configuration_marin.MarinHFConfig",
            "AutoModelForCausalLM": "modeling_marin.MarinHFForCausalLM",
        }
    config.bos_token_id, config.eos_token_id, config.pad_token_id = ids["bos"], ids["eos"], ids["pad"]
    config.dtype = dtype
    if fmt == "native" and model.attention.rope_pairs == "interleaved":
        # The q/k weights are permuted to transformers' split-half RoPE (qwen3_moe.half_pair_order);
        # `marinlm import` reads this key and permutes them back, to the same model bit for bit.
        config.marinlm_rope_pairs = "interleaved"
    return config


def write_tokenizer(source: Path, out: Path, start_token: str, add_bos: bool, max_len: int) -> None:
    """The run's tokenizer, its post-processor prepending the document-start token (what
    `marinlm eval` and `generate` put first), with the context length and the chat template."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    start_id = tok.token_to_id(start_token)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{start_token} $A", pair=f"{start_token} $A $B:1", special_tokens=[(start_token, start_id)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.update(bos_token=start_token, add_bos_token=True, model_max_length=max_len)
    config["marinlm_data_add_bos"] = add_bos  # the training convention the start token comes from
    template = source / "chat_template.jinja"
    if template.is_file():
        config["chat_template"] = template.read_text()
    write_json_atomic(out / "tokenizer_config.json", config)
    special = source / "special_tokens_map.json"
    if special.is_file():
        mapping = json.loads(special.read_text())
        mapping["bos_token"] = start_token
        write_json_atomic(out / "special_tokens_map.json", mapping)


def export(
    source: str | Path,
    out_dir: str | Path,
    *,
    fmt: str = "auto",
    dtype: str | None = None,
    max_shard_size: str | int = "2GB",
    overwrite: bool = False,
    quiet: bool = False,
) -> ExportReport:
    """Write the newest good checkpoint of run `source` (or checkpoint `source`) to `out_dir`."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from marinlm.tokenizer import BOS, EOS, PAD
    from marinlm.train.checkpoint import checkpoint_tokenizer, resolve_checkpoint

    out_dir = Path(out_dir)
    folder = resolve_checkpoint(source)
    from marinlm.finetune.loading import base_of_checkpoint, is_finetune_config, merge_run

    base = base_of_checkpoint(folder) if is_finetune_config(folder / "config.yaml") else None
    inputs = {"the checkpoint": folder, **({"its base checkpoint": base} if base else {})}
    refuse_overlap(out_dir, inputs, "the export folder")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ValueError(f"{out_dir}: exists and is not empty; pass --overwrite to replace it")
    if base is not None:
        # A fine-tuning checkpoint holds only what trained: fold it into the base weights first (in
        # memory: the whole model), then export that plain checkpoint.
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            merged = merge_run(folder, Path(tmp) / "merged", base)
            report = export(
                merged, out_dir, fmt=fmt, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, quiet=quiet
            )
        manifest = json.loads((report.out_dir / MANIFEST).read_text())
        manifest.update(checkpoint=str(folder.resolve()), merged_from_finetune=True)
        write_json_atomic(report.out_dir / MANIFEST, manifest)
        report.checkpoint = folder
        return report
    train = load_config(TrainConfig, folder / "config.yaml")
    model = train.model
    fmt = choose_format(model, fmt)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype: must be one of {sorted(DTYPES)}, got {dtype!r}")
    reader = CheckpointTensors(folder)
    plan = tensor_plan(model, fmt, reader.names())
    by_name = {t.name: t for t in plan}

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # Plan the shards from shapes alone, then fill one at a time.
        def out_meta(t: qwen3_moe.HFTensor) -> torch.Tensor:
            built = t.build(*(reader.meta(s) for s in t.sources)) if fmt == "native" else reader.meta(t.sources[0])
            return built.to(DTYPES[dtype]) if dtype else built

        metas = {t.name: out_meta(t) for t in plan}
        split = split_torch_state_dict_into_shards(metas, max_shard_size=max_shard_size)
        largest = 0
        total = sum(t.numel() * t.element_size() for t in metas.values())
        bar = progress_bar(
            total=total, desc="export: weights", unit="B", unit_scale=True, disable=quiet, quiet_start=True
        )
        for filename, names in split.filename_to_tensors.items():
            sources = sorted({s for n in names for s in by_name[n].sources})
            loaded = reader.read(sources)
            shard = {}
            for n in names:
                tensor = by_name[n].build(*(loaded[s] for s in by_name[n].sources))
                shard[n] = (tensor.to(DTYPES[dtype]) if dtype else tensor).contiguous()
            del loaded
            largest = max(largest, sum(t.numel() * t.element_size() for t in shard.values()))
            try:
                save_file(shard, str(tmp / filename), metadata={"format": "pt"})
            except Exception as e:  # safetensors names neither the file nor the OS error's kind
                raise os_error_in(e, out_dir / filename) from None
            make_shareable(tmp / filename)
            bar.update(sum(metas[n].numel() * metas[n].element_size() for n in names))
            del shard
        bar.close()
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            write_json_atomic(tmp / "model.safetensors.index.json", index)

        start_token = BOS if train.data.add_bos else EOS
        tokenizer_dir = checkpoint_tokenizer(folder)
        write_tokenizer(tokenizer_dir, tmp, start_token, train.data.add_bos, model.max_seq_len)
        vocab = json.loads((tmp / "tokenizer.json").read_text())["model"]["vocab"]
        added = {t["content"]: t["id"] for t in json.loads((tmp / "tokenizer.json").read_text())["added_tokens"]}
        vocab = {**vocab, **added}
        ids = {"bos": vocab[start_token], "eos": vocab[EOS], "pad": vocab[PAD]}
        weight_dtype = DTYPES[dtype] if dtype else next(iter(metas.values())).dtype
        hf_config(model, fmt, ids, weight_dtype).to_json_file(str(tmp / "config.json"))
        GenerationConfig(
            bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"], do_sample=False
        ).save_pretrained(str(tmp))
        if fmt == "remote":
            from marinlm import __version__

            (tmp / "modeling_marin.py").write_text(modeling_source(__version__))
            (tmp / "configuration_marin.py").write_text(configuration_source())

        files = {p.name: manifest_entry(p) for p in sorted(tmp.iterdir())}
        state = json.loads((folder / "trainer_state.json").read_text())
        manifest = {"format": fmt, "checkpoint": str(folder.resolve()), "step": state.get("step"), "files": files}
        write_json_atomic(tmp / MANIFEST, manifest)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        replaced = out_dir.with_name(f".{out_dir.name}.replaced-{os.getpid()}")
        if out_dir.exists():  # the old export goes only once the new one stands in its place
            out_dir.rename(replaced)
        tmp.rename(out_dir)
        shutil.rmtree(replaced, ignore_errors=True)
    except BaseException as e:  # a full disk, Ctrl-C: nothing half-written stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise os_error_in(e, out_dir) from None
    total = sum(f["bytes"] for n, f in files.items() if n.endswith(".safetensors"))
    return ExportReport(out_dir, fmt, folder, len(plan), len(split.filename_to_tensors), total, largest)


def manifest_entry(path: Path) -> dict:
    """A file's line in the export's checksum manifest."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def verify(out_dir: str | Path) -> list[str]:
    """Files of an export that are missing or differ from its manifest (empty: intact)."""
    out_dir = Path(out_dir)
    manifest = json.loads((out_dir / MANIFEST).read_text())
    bad = []
    for name, info in manifest["files"].items():
        path = out_dir / name
        if not path.is_file() or path.stat().st_size != info["bytes"] or sha256_file(path) != info["sha256"]:
            bad.append(name)
    return bad


def parity_check(
    out_dir: str | Path,
    source: str | Path | None = None,
    *,
    adapter: bool = False,
    new_tokens: int = 32,
    seed: int = 0,
) -> dict:
    """Load the export in `transformers` (`adapter`: under peft, with its `adapter/`) and compare it
    with marinlm's model of the checkpoint it came from (torchtitan's conversion check): the largest
    logit difference and the next-token KL divergence on a left-padded batch of three documents of
    different lengths, and whether greedy generate() gives the same tokens for `new_tokens` steps."""
    from transformers import AutoModelForCausalLM

    from marinlm.loading import load_model
    from marinlm.model import SamplingConfig, generate

    out_dir = Path(out_dir)
    source = source or json.loads((out_dir / MANIFEST).read_text())["checkpoint"]
    ours = load_model(source).model
    hf = AutoModelForCausalLM.from_pretrained(str(out_dir), trust_remote_code=True, dtype=torch.float32).eval()
    hf_class = type(hf).__name__
    if adapter:
        import warnings

        from peft import PeftModel

        with warnings.catch_warnings():  # peft reads a property transformers has renamed
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            hf = PeftModel.from_pretrained(hf, str(out_dir / "adapter")).eval()
        hf_class = f"PeftModel({hf_class})"
    vocab = min(ours.config.vocab_size, hf.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    lengths = [min(n, ours.config.max_seq_len - new_tokens) for n in (48, 31, 17)]
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, doc in enumerate(docs):
        ids[row, width - len(doc) :], mask[row, width - len(doc) :] = doc, 1
    worst, kl = 0.0, 0.0
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask).logits.float()
        for row, doc in enumerate(docs):
            mine = ours(doc[None]).logits[0].float()
            other = theirs[row, width - len(doc) :]
            worst = max(worst, float((mine - other).abs().max()))
            logp, logq = mine.double().log_softmax(-1), other.double().log_softmax(-1)
            kl = max(kl, float((logp.exp() * (logp - logq)).sum(-1).max()))
        sampling = SamplingConfig(max_new_tokens=new_tokens, temperature=0)
        mine_gen = generate(ours, ids, sampling, attention_mask=mask)
        hf_gen = hf.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    return {
        "max_abs_logit_diff": worst,
        "max_kl": kl,
        "greedy_equal": bool(torch.equal(mine_gen, hf_gen)),
        "greedy_tokens": new_tokens,
        "hf_class": hf_class,
    }
