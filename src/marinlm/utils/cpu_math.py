"""Settle oneMKL's choice of math kernels on one thread, before any parallel call.

torch's CPU builds with MKL compute cos, exp, log, tanh and other elementwise functions through
oneMKL's vector math library (VML), which picks each function's kernel on its first call. With
oneMKL 2024.2 (torch 2.13's wheels) intra-op threads that make that first call together can run
a low-accuracy kernel on one thread's share (pytorch/pytorch#188792): in a few processes of many,
the first cos of the RoPE tables was off by about 1e-4 in part of the table, so a resumed run's
first step did not repeat the uninterrupted run's. A one-element call runs on the calling thread
alone; one per function and precision, as the upstream fix does, leaves no first call for the
threads to race on.
"""

from __future__ import annotations

import torch

# The functions torch 2.13 sends to VML (aten/src/ATen/cpu/vml.h), each in fp32 and fp64.
VML_FUNCTIONS = (
    torch.acos,
    torch.asin,
    torch.atan,
    torch.cos,
    torch.erf,
    torch.erfc,
    torch.erfinv,
    torch.exp,
    torch.log,
    torch.log10,
    torch.sin,
    torch.tan,
    torch.tanh,
)

_done = False


def warm_up_vml() -> None:
    """Call each VML function once, on one element and this thread; later calls do nothing."""
    global _done
    if _done:
        return
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for fn in VML_FUNCTIONS:
            fn(x)
    _done = True
