"""What a run records about where it ran, and the start-up check that it can run there at all."""

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
