"""Measured hardware peaks, so MFU is against this machine, not a datasheet."""

from __future__ import annotations

import time

import torch

# Dense bf16 peaks (no sparsity) for accelerators we know; anything else is measured.
_GPU_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "GB200": 2500e12, "A100": 312e12}


def matmul_peak_flops(dtype: torch.dtype = torch.float32, device: str = "cpu", size: int = 2048, seconds=1.0) -> float:
    """Best sustained FLOP/s of a square matmul on `device` over about `seconds`.

    Emulated dtypes (bf16 on CPUs without AVX512-BF16/AMX) are timed on a smaller matrix so the
    measurement stays short.
    """
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, peak in _GPU_PEAK_BF16.items():
            if key in name:
                return peak if dtype in (torch.bfloat16, torch.float16) else peak / 2
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    start = time.perf_counter()
    a @ b
    if time.perf_counter() - start > 0.5:  # emulated dtype: a smaller product, still past cache sizes
        size = 1024
        a, b = a[:size, :size].contiguous(), b[:size, :size].contiguous()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * size**3 / (time.perf_counter() - t))
        if time.perf_counter() > deadline:
            return best


def tune_cpu_allocator() -> bool:
    """Keep large freed blocks in glibc's heap instead of returning them to the OS.

    By default glibc serves blocks over ~32 MB with mmap and unmaps them on free, so every
    training step page-faults its activations in again; on the 2-core VMs we develop on that
    made a 64 MB `torch.zeros` 10x slower (33 ms vs 3.4 ms) and cross-entropy 2.5x slower.
    Returns False where glibc's mallopt is unavailable (macOS, musl).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, 1 << 31))
