"""Loading fine-tuning checkpoints: the base run's weights, the method's adapters with the trained
tensors, folded together, for `generate`, `eval`, `export` and `finetune merge`."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from marinlm.config import dump_config
from marinlm.finetune.adapters import VOCAB_ROWS, apply_method, dequantize_base, merge_adapters
from marinlm.finetune.config import FinetuneConfig
from marinlm.tokenizer import MarinTokenizer
from marinlm.train.checkpoint import checkpoint_tokenizer, load_tensors, resolve_checkpoint, validate
from marinlm.train.safe_load import CheckpointError
from marinlm.utils.io import refuse_overlap, sha256_file


def base_checkpoint(config: FinetuneConfig) -> Path:
    """The checkpoint a new fine-tune starts from: `base_checkpoint` (a step of the base run, or a
    checkpoint folder) where given, else the base run's newest good one; validated."""
    choice = config.base_checkpoint
    if not choice:
        return resolve_checkpoint(config.base).resolve()
    if choice.isdigit():
        from marinlm.train.checkpoint import step_dir

        run = Path(config.base)
        root = run / "checkpoints" if (run / "checkpoints").is_dir() else run
        return resolve_checkpoint(step_dir(root, int(choice))).resolve()
    return resolve_checkpoint(choice).resolve()


def training_base(config: FinetuneConfig, resume: str) -> Path:
    """The base checkpoint a fine-tune trains on: the one recorded in the checkpoint it resumes
    (`resume`: auto, none, or a checkpoint or run folder), else `base_checkpoint(config)`. A resumed
    fine-tune never moves to a newer base: its trained tensors were fitted to the old one."""
    resumed = None
    if resume != "none":
        with contextlib.suppress(FileNotFoundError, CheckpointError):  # nothing to resume: a new fine-tune
            resumed = resolve_checkpoint(Path(config.run_dir) if resume == "auto" else Path(resume))
    state = json.loads((resumed / "trainer_state.json").read_text()) if resumed is not None else {}
    if not state.get("base_checkpoint"):
        return base_checkpoint(config)
    base = pinned_base(state, resumed)
    if config.base_checkpoint:
        chosen = base_checkpoint(config)
        if chosen != base.resolve():
            raise ValueError(
                f"base_checkpoint: {resumed} was fine-tuned on {base}, not {chosen}; resume it on its own base "
                "(leave base_checkpoint empty), or start a new run_dir on the other"
            )
    return base


def base_fingerprint(folder: Path) -> str:
    """The content hash of checkpoint `folder`: the sha256 of its COMPLETE.json, which lists the
    size and sha256 of every file in it."""
    return sha256_file(folder / "COMPLETE.json")


def pinned_base(state: dict, where: Path) -> Path:
    """The base checkpoint recorded in fine-tuning trainer state `state` (of checkpoint `where`),
    validated and, where its hash was recorded, unchanged since the fine-tune began: the frozen
    weights that the trained tensors were fitted to. A missing, corrupt or replaced base raises,
    naming both folders."""
    base = Path(state["base_checkpoint"])
    if not base.is_dir():
        raise FileNotFoundError(f"{where}: its base checkpoint {base} is gone; the fine-tuned tensors need it")
    try:
        validate(base)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: its base checkpoint is unusable: {e}") from None
    recorded = state.get("base_sha256")
    if recorded is not None and base_fingerprint(base) != recorded:
        raise CheckpointError(
            f"{where}: its base checkpoint {base} has changed since the fine-tune began (the sha256 of its "
            f"COMPLETE.json is {base_fingerprint(base)[:12]}…, recorded {recorded[:12]}…); the trained tensors "
            "belong to the old weights"
        )
    return base


def base_vocab_size(folder: Path) -> int:
    """The rows of the embedding in base checkpoint `folder`."""
    from marinlm.train.safe_load import SafeFileSystemReader

    metadata = SafeFileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return next(metadata[f"model.{key}"].size[0] for key in VOCAB_ROWS if f"model.{key}" in metadata)


@torch.no_grad()
def read_base(folder: Path, targets: dict[str, torch.Tensor], vocab_size: int) -> None:
    """Base checkpoint `folder`'s model tensors into `targets` (a model's state dict, in place). A
    model with a larger `vocab_size` (room for the special tokens fine-tuning adds) takes the base's
    rows, and each new row of the embedding and the LM head starts at the mean of the base's rows,
    as transformers' `resize_token_embeddings` starts them: a neutral input, a logit near the average."""
    base_rows = base_vocab_size(folder)
    if vocab_size < base_rows:
        raise ValueError(f"model.vocab_size {vocab_size} is smaller than the base's {base_rows}")
    grown = {k: v for k, v in targets.items() if k in VOCAB_ROWS and v.shape[0] != base_rows}
    tensors = {"model": {k: v.new_empty(base_rows, *v.shape[1:]) if k in grown else v for k, v in targets.items()}}
    load_tensors(folder, tensors)
    for key, target in grown.items():
        rows = tensors["model"][key]
        target[:base_rows] = rows
        target[base_rows:] = rows.float().mean(0).to(target.dtype)


def load_base_weights(model: torch.nn.Module, folder: Path) -> None:
    """The base run's model tensors into the (plain, unsharded) model (`read_base`)."""
    state = get_model_state_dict(model)
    read_base(folder, state, model.config.vocab_size)
    set_model_state_dict(model, state)


def base_of(folder: Path, config: FinetuneConfig) -> Path:
    """The base checkpoint that fine-tuning checkpoint `folder` was trained from (`pinned_base`)."""
    state = json.loads((folder / "trainer_state.json").read_text())
    if not state.get("base_checkpoint"):  # saved before checkpoints recorded their base
        return base_checkpoint(config)
    return pinned_base(state, folder)


def base_of_checkpoint(folder: Path) -> Path:
    """`base_of` a fine-tuning checkpoint folder, reading its own config."""
    from marinlm.config import load_config

    return base_of(folder, load_config(FinetuneConfig, folder / "config.yaml"))


@torch.no_grad()
def restore_base(model: torch.nn.Module, folder: Path, modules: list[str]) -> None:
    """Every tensor of `modules` (parameters and buffers) of a plain model back to base checkpoint
    `folder`'s values (grown vocabulary rows: as `read_base` starts them). The load reads a copy of
    the whole model: DCP's structure check wants every entry."""
    if not modules:
        return
    state = get_model_state_dict(model)
    copies = {k: v.clone() for k, v in state.items()}
    read_base(folder, copies, model.config.vocab_size)
    for key, tensor in state.items():
        if key.rpartition(".")[0] in modules:
            tensor.copy_(copies[key])


def is_finetune_config(path: Path) -> bool:
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    return isinstance(data, dict) and "method" in data and "base" in data


def adapted_model(folder: Path, base: Path | None = None):
    """(model, config, what apply_method did) of a fine-tuning checkpoint on the CPU: the base
    weights under the method's adapters, which hold this checkpoint's trained tensors, not merged.
    `base`: its base checkpoint where the caller has it already (`base_of`, validated)."""
    from marinlm.config import load_config
    from marinlm.model import MarinForCausalLM

    config = load_config(FinetuneConfig, folder / "config.yaml")
    base = base or base_of(folder, config)
    with torch.device("meta"):
        model = MarinForCausalLM(config.model)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    load_base_weights(model, base)
    info = apply_method(model, config)
    options = StateDictOptions(ignore_frozen_params=True)
    tensors = {"model": get_model_state_dict(model, options=options)}
    load_tensors(folder, tensors)
    set_model_state_dict(model, tensors["model"], options=StateDictOptions(ignore_frozen_params=True, strict=False))
    return model, config, info


def finetuned_model(folder: Path, device: torch.device | str = "cpu", kernels: bool = True, base: Path | None = None):
    """(plain merged model, config) of a fine-tuning checkpoint: the base weights, the method's
    adapters with this checkpoint's trained tensors, folded together."""
    from marinlm.kernels import apply_kernels

    model, config, _ = adapted_model(folder, base)
    merge_adapters(model)
    dequantize_base(model)
    for p in model.parameters():
        p.requires_grad_(True)
    model = model.float()
    chosen = config.kernels if kernels else config.kernels.reference()
    apply_kernels(model, torch.device(device), "fp32" if torch.device(device).type == "cpu" else "bf16", chosen)
    return model.to(device).eval(), config


def merge_run(run: str | Path, out_dir: str | Path | None = None, base: Path | None = None) -> Path:
    """`marinlm finetune merge RUN`: the newest checkpoint with its adapters folded in, written as a
    plain run (OUT_DIR, default RUN/merged) that needs neither the base run nor peft. `base`: the
    checkpoint's base where the caller has validated it already."""
    folder = resolve_checkpoint(run)
    out_dir = Path(out_dir) if out_dir else Path(run) / "merged"
    base = base or base_of_checkpoint(folder)
    refuse_overlap(out_dir, {"the checkpoint": folder, "its base checkpoint": base}, "--out")
    model, config = finetuned_model(folder, base=base)
    saved = save_plain_run(model, config, folder, out_dir, "merged_from")
    print(f"merged {folder} -> {saved}", file=sys.stderr)
    return saved


def save_plain_run(model: torch.nn.Module, config: FinetuneConfig, folder: Path, out_dir: Path, key: str) -> Path:
    """`model` (plain modules) as the step-0 checkpoint of a training run in `out_dir`, with the
    fine-tuning checkpoint `folder`'s tokenizer; `key` names `folder` in its trainer state."""
    from marinlm.train.config import TrainConfig
    from marinlm.train.run_folder import save_run

    if (out_dir / "checkpoints").exists():
        raise ValueError(f"{out_dir}: already holds a run; remove it or give another folder")
    plain = {k: v for k, v in vars(config).items() if k in TrainConfig.__dataclass_fields__}
    train = TrainConfig(**{**plain, "run_dir": str(out_dir)})
    train.checkpoint.init_from = None
    tokenizer = MarinTokenizer.load(checkpoint_tokenizer(folder))
    step = json.loads((folder / "trainer_state.json").read_text())["step"]
    saved = save_run(out_dir, train, model.state_dict(), tokenizer, {key: str(folder), "finetune_step": step})
    (out_dir / "config.yaml").write_text(dump_config(train))
    return saved
