from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from marinlm.config import load_config
from marinlm.model import MarinConfig, MarinForCausalLM

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SHARED_DATA = Path(os.environ.get("MARINLM_SHARED_DATA", ROOT.parent / "shared" / "data"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def shared_data(*parts: str) -> Path:
    """Path under ../shared/data, skipping the test when it is absent (e.g. on a user's machine)."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared data not available: {path}")
    return path


def tiny_config(**overrides) -> MarinConfig:
    config = load_config(MarinConfig, CONFIGS / "model" / "tiny.yaml")
    if overrides:
        from marinlm.config import from_dict, merge, to_dict

        config = from_dict(MarinConfig, merge(to_dict(config), overrides))
    return config


def build(config: MarinConfig, seed: int = 0) -> MarinForCausalLM:
    with torch.device("meta"):
        model = MarinForCausalLM(config)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def randomize_identity_inits(model: MarinForCausalLM, seed: int = 1) -> None:
    """Give SConv taps, head gates and router biases non-trivial values so tests exercise them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sconv" in name or ".gate." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in model.named_buffers():
            if name.endswith("router.bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
