"""`marinlm finetune`: the trainer on SFT rows, from a base run's weights, with LoRA/QLoRA/freezing.

Everything else is the pre-training loop (train/trainer.py): checkpoints, exact resume, metrics,
progress, validation, torchrun with FSDP2. What differs is overridden here: the data (packed chat
examples, finetune/data.py), the model (the base run's weights, then finetune/adapters.py, before
the model is sharded), validation (the loss on held-out answers), and checkpoints, which keep only
the tensors that train (the frozen base is the base run's, named by path).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions

from marinlm.config import ConfigError
from marinlm.finetune.adapters import (
    VOCAB_ROWS,
    apply_method,
    freeze_router_biases,
    matches,
    peft_state,
    save_peft_adapter,
)
from marinlm.finetune.config import FinetuneConfig, check_processes
from marinlm.finetune.data import SFTLoader, load_sft
from marinlm.finetune.loading import base_fingerprint, load_base_weights, training_base
from marinlm.model.loss import IGNORE_INDEX
from marinlm.parallel.distributed import rank_and_world
from marinlm.parallel.pipeline_parallel import PipelinedModel
from marinlm.tokenizer import MarinTokenizer
from marinlm.train.checkpoint import checkpoint_tokenizer
from marinlm.train.model_part import FromScratch
from marinlm.train.trainer import Trainer
from marinlm.utils.io import write_text_atomic

# The template marinlm tokenizers carried before it marked the assistant turns: it renders the same
# text as today's CHAT_TEMPLATE, which therefore stands in for it.
LEGACY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def chat_template(config: FinetuneConfig, tokenizer: MarinTokenizer, tokenizer_dir: Path) -> tuple[str, str]:
    """(template, its name for messages): sft.chat_template's file, else the base tokenizer's own."""
    from marinlm.tokenizer import CHAT_TEMPLATE

    if config.sft.chat_template:
        path = Path(config.sft.chat_template)
        if not path.is_file():
            raise ConfigError("sft.chat_template", f"{path}: no such template file")
        return path.read_text(), str(path)
    if not tokenizer.chat_template:
        raise ConfigError("sft.chat_template", f"{tokenizer_dir}: the base tokenizer has no chat template; give one")
    if tokenizer.chat_template == LEGACY_CHAT_TEMPLATE:
        return (
            CHAT_TEMPLATE,
            "marinlm's chat template (configs/chat/marin.jinja; the base tokenizer's older copy renders alike)",
        )
    return tokenizer.chat_template, f"the chat_template of {tokenizer_dir / 'tokenizer_config.json'}"


def extended_tokenizer(base: MarinTokenizer, folder: Path, config: FinetuneConfig) -> MarinTokenizer:
    """sft.tokenizer, checked to extend the base run's: its embeddings must still mean the same tokens."""
    new = MarinTokenizer.load(folder)
    new_vocab = new.backend.get_vocab()
    changed = [t for t, i in base.backend.get_vocab().items() if new_vocab.get(t) != i]
    if changed:
        raise ConfigError("sft.tokenizer", f"{folder}: {len(changed)} base tokens have other ids, e.g. {changed[0]!r}")
    if new.vocab_size > config.model.vocab_size:
        room = -(-new.vocab_size // 128) * 128
        raise ConfigError(
            "sft.tokenizer",
            f"{folder}: {new.vocab_size} tokens, more than the model's vocab_size {config.model.vocab_size}; "
            f"--model.vocab_size={room} grows the embedding and the LM head to hold them (the new rows start at "
            "the mean of the base's)",
        )
    return new


def frozen_new_rows(added: int, config: FinetuneConfig) -> str | None:
    """A warning where the tokens sft.tokenizer adds keep their embedding and LM-head rows frozen."""
    lora = config.method in ("lora", "qlora") and not config.lora.train_embeddings
    frozen = config.method == "freeze" and not all(matches(n, config.freeze.patterns) for n in VOCAB_ROWS)
    if added <= 0 or not (lora or frozen):
        return None
    how = "lora.train_embeddings=true" if lora else "freeze.patterns=[embed.*, lm_head.*]"
    return (
        f"warning: sft.tokenizer adds {added} token(s) whose embedding and LM-head rows stay frozen; {how} trains them"
    )


class SFTData:
    """Fine-tuning's data, for the Trainer: `sft.train_files` rendered with the chat template, packed
    into rows whose loss falls on the answers, with the base run's tokenizer (or `sft.tokenizer`)."""

    def __init__(self, base_folder: Path):
        self.base_folder = base_folder
        self.tokenizer_manifest = base_folder / "trainer_state.json"

    def open(self, config: FinetuneConfig, info) -> None:
        self.config, self.info = config, info
        tokenizer_dir = checkpoint_tokenizer(self.base_folder)
        tokenizer = MarinTokenizer.load(tokenizer_dir)
        trained_with = json.loads((self.base_folder / "trainer_state.json").read_text()).get("tokenizer_hash")
        if trained_with is not None and trained_with != tokenizer.hash:
            raise ValueError(f"{tokenizer_dir}: not the tokenizer {self.base_folder} was trained with")
        if config.sft.tokenizer:
            base_size = tokenizer.vocab_size
            tokenizer_dir = Path(config.sft.tokenizer)
            tokenizer = extended_tokenizer(tokenizer, tokenizer_dir, config)
            if info.is_main and (warning := frozen_new_rows(tokenizer.vocab_size - base_size, config)):
                print(warning, flush=True)
        self.tokenizer_hash = tokenizer.hash
        self.tokenizer_source = str(tokenizer_dir)
        self.chat_template, template_name = chat_template(config, tokenizer, tokenizer_dir)
        self.rows, self.val, lines = load_sft(
            config.sft,
            tokenizer_dir,
            self.chat_template,
            template_name,
            config.data.seq_len,
            tokenizer.pad_id,
            config.data.seed,
        )
        if info.is_main:
            for line in lines:
                print(line, flush=True)

    def loader(self, rows_per_deal: int, rank: int, world: int, run_dir: Path):
        return SFTLoader(self.rows, rows_per_deal, rank, world, self.config.data.seed)

    def val_sources(self) -> dict:
        return {} if self.val is None else {"sft": self.val}

    def planned_epochs(self, loader) -> list[float]:
        c = self.config
        epochs = loader.planned_epochs(c.train.steps * c.train.global_batch)
        if self.info.is_main:
            print(f"{loader.num_rows} packed rows of {c.data.seq_len} tokens; {epochs[0]:.2f} epochs", flush=True)
        return epochs

    def record(self, loader, epochs: list[float]) -> list[dict]:
        return [{"sft_train_files": self.config.sft.train_files, "rows": loader.num_rows, "epochs": epochs[0]}]

    @torch.no_grad()
    def validate(self, model, val_sources: dict, rank: int, world: int, *, device, precision: str, group=None):
        """Mean loss on the held-out examples' assistant tokens (every rank runs every batch: a
        sharded model needs all of them in each forward)."""
        rows = self.val
        if rows is None:
            return None
        v = self.config.validation
        n = min(rows["input_ids"].shape[0], v.max_rows)
        was_training = model.training
        model.eval()
        total, tokens = 0.0, 0
        for start in range(0, n, v.batch_size):
            batch = {k: t[start : min(n, start + v.batch_size)].to(device) for k, t in rows.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                out = model(batch["input_ids"], batch["segment_ids"], batch["labels"], return_logits=False)
            counted = int((batch["labels"] != IGNORE_INDEX).sum())
            total += float(out.ce_loss) * counted
            tokens += counted
        model.train(was_training)
        return {"val/answer_loss": total / max(tokens, 1), "val/answer_tokens": float(tokens)}

    def write_extras(self, run_dir: Path) -> None:
        # The template fine-tuning rendered with travels with the run: `generate --chat` and the
        # export use it, not the base tokenizer's.
        write_text_atomic(run_dir / "tokenizer" / "chat_template.jinja", self.chat_template)


class Finetuning(FromScratch):
    """The Trainer's model part for fine-tuning: the base run's weights, adapted by `method`
    (LoRA, QLoRA, freezing) before sharding; checkpoints hold only the trained tensors and name
    the base; the base's held-out answer loss is logged before the first step, and a LoRA run's
    adapter is written in peft's format at the end."""

    # The frozen base is the base run's; a load checks the saved keys first (check_same_structure).
    state_dict_options = StateDictOptions(ignore_frozen_params=True, strict=False)

    def __init__(self, base_folder: Path):
        self.base_folder = base_folder
        self.base_sha256 = base_fingerprint(base_folder)

    def prepare(self, model: torch.nn.Module, config: FinetuneConfig, dims) -> torch.nn.Module:
        self.config = config
        check_processes(config, dims.world)
        load_base_weights(model, self.base_folder)
        total = sum(p.numel() for p in model.parameters())  # the base's, before 4-bit packing halves numel()
        self.adapt_info = apply_method(model, config)
        freeze_router_biases(model)
        self.trainable_parameters = trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if rank_and_world()[0] == 0:
            print(
                f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.3f}%), "
                f"method {config.method}",
                flush=True,
            )
        return model

    def trainer_state(self) -> dict:
        return {"base_checkpoint": str(self.base_folder), "base_sha256": self.base_sha256}

    def before_fit(self, trainer) -> None:
        if trainer.step == 0 and trainer.data.val is not None:  # the base model's answer loss, to compare with
            base = trainer.validate()
            if trainer.info.is_main:
                print(f"base model: held-out answer loss {base['val/answer_loss']:.4f}", flush=True)

    def after_fit(self, trainer, summary: dict) -> dict:
        summary["trainable_parameters"] = self.trainable_parameters
        if self.config.method in ("lora", "qlora"):  # every rank gathers its shards; the first writes
            state = peft_state(trainer.model)
            if isinstance(trainer.model, PipelinedModel):  # a pipeline rank holds its stages' layers only: the union
                pp_group = trainer.model.pp_group
                parts = [None] * torch.distributed.get_world_size(pp_group)
                torch.distributed.all_gather_object(parts, state, group=pp_group)
                state = {key: tensor for part in parts for key, tensor in part.items()}
            if trainer.info.is_main:
                save_peft_adapter(state, self.adapt_info, trainer.run_dir / "adapter", str(self.base_folder))
            summary["adapter"] = str(trainer.run_dir / "adapter")
        return summary


def finetune_trainer(config: FinetuneConfig, resume: str = "auto") -> Trainer:
    """A Trainer on the SFT data, with the base run's weights adapted by `method`."""
    if config.train.init == "sharded":
        raise ConfigError("train.init", "fine-tuning loads the base weights whole before sharding; use full or auto")
    base_folder = training_base(config, resume)
    return Trainer(config, resume, data=SFTData(base_folder), model_part=Finetuning(base_folder))
