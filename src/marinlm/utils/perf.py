"""Measured hardware peaks, so MFU is against this machine, not a datasheet."""

from __future__ import annotations

import functools
import math
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


@functools.cache  # a process setting: once is enough (finding libc runs a subprocess)
def tune_cpu_allocator() -> bool:
    """Keep large freed blocks in glibc's heap instead of returning them to the OS.

    By default glibc serves blocks over ~32 MB with mmap and unmaps them on free, so every
    training step page-faults its activations in again, which makes a large allocation, and the
    first work that touches it, several times slower.
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
    # mallopt takes a C int: 2**31 would wrap to a negative number.
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, (1 << 31) - 1))


# Leaf ops by what they are, for `time_breakdown`. Anything not named here counts as "elementwise
# and other" (norms, activations, softmax, reductions, the loss's exp/log, small index ops).
_GEMMS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"}
# torch's fused attention ops, and kernels/cpu_attention.py's kernel (its forward and backward ranges):
# every op under one of these, its GEMMs too, is attention, as the fused kernels' own products are.
_ATTENTION = (
    "aten::_scaled_dot_product_flash_attention",
    "aten::_flash_attention",
    "aten::_efficient_attention",
    "_ShortAttention",
)
_OPTIMIZER = ("aten::_fused_adam", "aten::_foreach_", "Optimizer.")  # the last: its Python, as a range
_MOVES = {
    "aten::index_select", "aten::index", "aten::index_add_", "aten::index_put_", "aten::gather",
    "aten::scatter", "aten::scatter_", "aten::scatter_add_", "aten::copy_", "aten::cat", "aten::clone",
    "aten::fill_", "aten::zero_", "aten::embedding_dense_backward",
    "aten::_grouped_mm",  # on CPU its own time is splitting the groups; its products are aten::mm
}  # fmt: skip
CATEGORIES = (
    "expert GEMMs",
    "other GEMMs",
    "attention kernel",
    "optimizer",
    "gathers and copies",
    "elementwise and other",
)


def gemm_operands(name: str, shapes: list[list[int]]) -> tuple[list[int], list[int]]:
    """The two multiplied operands' shapes among a GEMM call's profiled input shapes."""
    if name in ("aten::addmm", "aten::addmm_", "aten::baddbmm"):
        return shapes[1], shapes[2]  # (self, mat1, mat2, beta, alpha)
    return shapes[0], shapes[1]  # (self, mat2[, out])


def time_breakdown(fn, steps: int = 2, expert_dims: tuple[int, ...] = ()) -> dict[str, tuple[float, float]]:
    """Where the CPU time of `fn()` goes: {category: (seconds per call, GEMM FLOPs per call)}.

    Each op's self time is counted once, under its own category (CATEGORIES), so the categories
    add up to the profiled total. An op inside an attention kernel is attention, whatever it is:
    torch's fused kernels hide their products, and ours (kernels/cpu_attention.py) is made of
    visible ones, so both sides of a comparison count alike. The other GEMMs are split into the
    experts' and the rest by shape: a product with one of `expert_dims` among its sizes is an
    expert's (pass the expert width, and twice it where gate and up are one product, only where no
    other width of the model is equal).
    `fn` should be warm; it is run `steps` times under the profiler.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            fn()
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    flops = dict.fromkeys(CATEGORIES, 0.0)
    for event in prof.events():
        name, spent = event.name, event.self_cpu_time_total / 1e6
        if _inside(event, _ATTENTION):
            category = "attention kernel"
        elif name in _GEMMS:
            a, b = gemm_operands(name, event.input_shapes)
            category = "expert GEMMs" if set(expert_dims) & {*a, *b} else "other GEMMs"
            flops[category] += 2 * math.prod(a) * b[-1]  # 2·M·K·N
        elif name.startswith(_OPTIMIZER):
            category = "optimizer"
        elif name in _MOVES:
            category = "gathers and copies"
        else:  # also autograd nodes and custom ops: their own time is dispatch overhead
            category = "elementwise and other"
        seconds[category] += spent
    return {c: (seconds[c] / steps, flops[c] / steps) for c in CATEGORIES}


def _inside(event, prefixes: tuple[str, ...]) -> bool:
    """Whether a profiled op, or one of the ops or ranges it was called from, is named by `prefixes`."""
    while event is not None:
        if event.name.startswith(prefixes):
            return True
        event = event.cpu_parent
    return False
