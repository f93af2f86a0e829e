"""FP8 GEMMs in the dense projections, through torchao (`train.fp8`), off by default.

torchao's `Float8Linear` keeps the weight (and its state-dict key) and casts the input, the weight
and the output gradient to FP8 per tensor with dynamic scaling in each GEMM (e4m3 forward, e5m2 for
gradients), as torchtitan's float8 converter does. Converted: the attention projections (q, k, v,
o), the latent MoE's down and up projections, the shared experts and dense FFNs. Kept as they are:
the router (its scores pick the experts), the head gate, GatedNorm's low-rank projections, the LM
head (its loss is the most sensitive to rounding) and the routed experts, whose grouped GEMMs
torchao's float8 linear does not cover. A projection whose dims are not multiples of 16 (FP8
GEMMs need them) is kept too.

FP8 tensor cores are on sm89+ GPUs (Ada, Hopper, Blackwell); on a CPU torch runs the same FP8
GEMMs in software (slow, for tests: `tests/test_compile.py` trains `tiny` with it against bf16).
"""

from __future__ import annotations

import torch
from torch import nn

from marinlm.config import ConfigError

FP8_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "latent_down",
    "latent_up",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def takes_fp8(module: nn.Module, fqn: str) -> bool:
    """Whether `apply_fp8` converts the module at `fqn`."""
    return (
        isinstance(module, nn.Linear)
        and fqn.rsplit(".", 1)[-1] in FP8_PROJECTIONS
        and all(d % 16 == 0 for d in module.weight.shape)
    )


def apply_fp8(model: nn.Module, device: torch.device, precision: str, tensor_parallel: int = 1) -> int:
    """Swap torchao's `Float8Linear` into the projections `takes_fp8` names, in place (on meta or
    initialised, before `parallelize`). Returns how many were converted."""
    if precision == "fp64":
        raise ConfigError("train.fp8", "FP8 GEMMs with train.precision fp64: use bf16 (or fp32)")
    if tensor_parallel > 1:
        raise ConfigError("train.fp8", "not with parallel.tensor_parallel > 1 (torchao's float8 needs its own TP plan)")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError(
            "train.fp8", f"needs FP8 tensor cores (sm89+: Ada, Hopper, Blackwell); this GPU is sm{major}{minor}"
        )
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        raise ConfigError("train.fp8", "needs torchao: pip install 'marinlm[fp8]'") from None
    convert_to_float8_training(model, module_filter_fn=takes_fp8)
    return sum(type(module).__name__ == "Float8Linear" for module in model.modules())
