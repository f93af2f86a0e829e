"""FSDP2 wiring checked in one process (a single-rank gloo group): what CPU CI can see of it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from marinlm.config import load_config
from marinlm.model import MarinConfig, MarinForCausalLM
from marinlm.parallel.fsdp import apply_fsdp

from conftest import ROOT


@pytest.fixture
def single_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_root_unit_stays_gathered_from_forward_to_backward(single_rank_group):
    """Blocks reshard after forward; the root (embedding, final norm, LM head) must not.

    Backward starts with the root's weights, and FSDP2 only regathers a resharded unit when its
    pre-backward hook finds the unit's output tensors. torch 2.11 does not look inside our output
    dataclass, so a resharded root made the final norm's backward read freed memory (an illegal
    memory access on an H200). Here the root's weights must still be plain tensors after forward.
    """
    config = load_config(MarinConfig, ROOT / "configs" / "model" / "tiny.yaml", ["--num_layers=2"])
    with torch.device("meta"):
        model = MarinForCausalLM(config)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    apply_fsdp(model, single_rank_group, reshard_after_forward=True)
    ids = torch.randint(0, config.vocab_size, (2, 32))
    out = model(ids, labels=ids, return_logits=False)
    assert not isinstance(model.lm_head.weight, DTensor)
    assert not isinstance(model.final_norm[0].weight, DTensor)
    assert all(isinstance(p, DTensor) for p in model.layers[0].parameters())  # resharded after forward
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad.full_tensor()).all() for p in model.parameters())
