"""The Marin MoE transformer; nothing here imports torch.distributed. `marinlm export` pastes these
modules into one remote-code file, so marinlm imports sit at a module's top, name only what a module
pasted before defines, and no top-level name is defined twice (tests/test_hf_export.py)."""

from marinlm.model.config import (
    AttentionConfig,
    AuxFreeRouterConfig,
    MarinConfig,
    MoEConfig,
    QBRouterConfig,
    RouterConfig,
    SConvConfig,
    SoftmaxTopKRouterConfig,
)
from marinlm.model.generate import SamplingConfig, generate, stream_generate
from marinlm.model.loss import IGNORE_INDEX
from marinlm.model.router import RouterStats
from marinlm.model.transformer import CausalLMOutput, MarinForCausalLM

__all__ = [
    "IGNORE_INDEX",
    "AttentionConfig",
    "AuxFreeRouterConfig",
    "CausalLMOutput",
    "MarinConfig",
    "MarinForCausalLM",
    "MoEConfig",
    "QBRouterConfig",
    "RouterConfig",
    "RouterStats",
    "SConvConfig",
    "SamplingConfig",
    "SoftmaxTopKRouterConfig",
    "generate",
    "stream_generate",
]
