"""Turn a device name from a config or the command line into a `torch.device`, or a clear error;
and how much memory a device has free."""

from __future__ import annotations

import os

import torch


def resolve_device(name: str) -> torch.device:
    """The device for `name`: auto (CUDA when available, else CPU), cpu, cuda or cuda:N.

    Raises ValueError naming the device when it is malformed or not on this machine, instead of
    the assertion or missing-attribute error torch gives deep inside the first CUDA call.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ValueError(f"device {name!r}: no CUDA device on this machine (torch {torch.__version__}, {build})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise ValueError(f"device {name!r}: expected auto, cpu, cuda or cuda:N")
    return device


def available_memory(device: torch.device) -> int:
    """Bytes one process may use on `device`: the GPU's free memory, or the host's available memory
    shared by the processes torchrun started on this machine (LOCAL_WORLD_SIZE)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
