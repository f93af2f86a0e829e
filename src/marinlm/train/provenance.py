"""What a run records about where it ran and on what data, the tokenizer it keeps, and the start-up
check that it can run there at all."""

from __future__ import annotations

import contextlib
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

from marinlm.config import ConfigError
from marinlm.utils.device import available_memory
from marinlm.utils.io import copy_folder_atomic, sha256_file

# Bytes a parameter holds in training: fp32 weights and gradients, plus the optimizer's fp32 state
# (AdamW: two moments; Marin: MuonH keeps one momentum for the matrices, which are nearly all).
STATE_BYTES_PER_PARAM = {"adamw": 16, "marin": 12}


def software_environment() -> dict:
    """The git commit of the source (None outside a checkout), package versions, Python, platform."""
    packages = {}
    for name in ("torch", "numpy", "tokenizers", "safetensors", "marinlm", "transformers"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            packages[name] = metadata.version(name)
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    return {
        "git_commit": commit,
        "packages": packages,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def check_training_memory(total_params: int, optimizer: str, world_size: int, device: torch.device) -> None:
    """Refuse (a ConfigError naming train.memory_check) a model whose fp32 weights, gradients and
    optimizer state, sharded over the processes, exceed what one process has on `device`: a lower
    bound, activations not counted. Without it the run allocates until the out-of-memory killer."""
    per_param = STATE_BYTES_PER_PARAM.get(optimizer, 16)
    need = total_params * per_param / world_size
    available = available_memory(device)
    if need > available:
        raise ConfigError(
            "train.memory_check",
            f"the model's {total_params / 1e9:,.2f}B parameters need at least {need / 1e9:,.1f} GB per process "
            f"for fp32 weights, gradients and {optimizer} state ({per_param} bytes each, over {world_size} "
            f"process(es)), and {device.type} has {available / 1e9:,.1f} GB available per process. Train a "
            "smaller model, shard it over more processes (torchrun), or set train.memory_check=false to try anyway",
        )


def data_record(sources, epochs_planned: list[float]) -> list[dict]:
    """Each training source: its path, weight, the sha256 of its manifest, and its planned epochs."""
    return [
        {
            "path": source.path,
            "weight": source.weight,
            "manifest_sha256": sha256_file(Path(source.path) / "manifest.json"),
            "epochs": epochs,
        }
        for source, epochs in zip(sources, epochs_planned, strict=True)
    ]


def copy_tokenizer(source: str | None, run_dir: Path, manifest: Path) -> None:
    """Keep the run's tokenizer in RUN_DIR/tokenizer, so that generate and eval need nothing but the
    run folder. Copied under a temporary name first, so a killed copy is never taken for the
    tokenizer; a dataset whose manifest names no tokenizer folder that exists gets a warning."""
    target = run_dir / "tokenizer"
    if target.exists():
        return
    if source and Path(source).is_dir():
        copy_folder_atomic(source, target)  # the run folder is locked: one writer
    else:
        print(
            f"warning: {manifest} names no tokenizer folder that exists (tokenizer.path: {source!r}), and there "
            f"is no {manifest.parent / 'tokenizer'} (older token folders carry none); "
            f"copy the tokenizer to {target} for `marinlm generate` and `eval`",
            file=sys.stderr,
        )
