"""The Marin MoE transformer; nothing here imports torch.distributed. `marinlm export` pastes these
modules into one remote-code file, so marinlm imports sit at a module's top, name only what a module
pasted before defines, and no top-level name is defined twice (tests/test_hf_export.py).

What the layers above rely on, the model's only concessions to them (plain structure, no switch):
a pipeline stage (parallel/pipeline_parallel.py) keeps `layers` as a ModuleDict keyed by the whole
model's indices (`named_blocks`) and drops `embed` or `lm_head` (`init_weights` skips what is
absent); tensor parallel shards `HeadSlice` among the projections; peft reads
`RoutedExperts.is_transposed`; `marinlm.kernels.apply_kernels` changes modules' classes and sets
`RoutedExperts.impl` and `NextTokenLoss.chunk_tokens` from a run's `kernels:` section."""

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
