"""Turn a device name from a config or the command line into a `torch.device`, or a clear error;
and how much memory a device has free."""

from __future__ import annotations

import contextlib
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


# --- bf16 hardware probes ----------------------------------------------------------------------
# Probed once at import: inside a compiled block a probe (a torch op returning a bool) would be a
# graph break at every call; a module constant is folded in.


def _probe_bf16_gemm() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # the check moved: assume the kernels are there
        return True


def _probe_bf16_units() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # the checks moved: assume no bf16 unit, as fp32 is never the slow choice
        return False


_CPU_BF16_GEMM = _probe_bf16_gemm()
_CPU_BF16_UNITS = _probe_bf16_units()


def _cpu_has_bf16_gemm() -> bool:
    return _CPU_BF16_GEMM


def native_bf16(device: torch.device | str) -> bool:
    """True where bf16 matmuls run on bf16 hardware, several times faster than fp32: GPUs, and
    CPUs with AVX512-BF16 or AMX (measured by `bench/cpu_bf16.py`). What `train.precision: auto`
    and the Marin optimizer's `ns_dtype: auto` pick bf16 on; other CPUs keep fp32."""
    device = torch.device(device)
    if device.type == "cpu":
        return _CPU_BF16_UNITS
    return device.type != "meta"


def emulated_bf16(device: torch.device | str) -> bool:
    """True on a CPU whose bf16 matmuls would be torch's reference loops (no oneDNN bf16 GEMM)."""
    return torch.device(device).type == "cpu" and not _cpu_has_bf16_gemm()


def gemm_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype to run a GEMM of `dtype` operands in: fp32 for bf16 where bf16 is emulated (the
    caller rounds operands and results to bf16), otherwise `dtype` itself."""
    return torch.float32 if dtype == torch.bfloat16 and emulated_bf16(device) else dtype


def resolve_precision(precision: str, device: torch.device) -> str:
    """`train.precision` as a run computes: `auto` is bf16 where matmuls have bf16 hardware
    (`native_bf16`: GPUs, CPUs with AVX512-BF16 or AMX), fp32 elsewhere."""
    if precision == "auto":
        return "bf16" if native_bf16(device) else "fp32"
    return precision


def autocast_context(device: torch.device, precision: str, cache: bool = True):
    """bf16 autocast for a `precision` of bf16 (else nothing); `cache`: whether autocast keeps its
    bf16 copy of each weight for the whole region (`parallel.autocast_caches_weights`)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()
