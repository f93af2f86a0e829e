"""`parallel.offload_activations`: the checkpointed blocks' inputs in host memory between forward
and backward, as the trainer runs it and as `marinlm plan` counts it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as checkpoint_wrapper
from torch.autograd.graph import save_on_cpu

from marinlm.config import ConfigError
from marinlm.parallel import ParallelConfig, parallelize
from marinlm.parallel.mesh import ParallelDims

from conftest import build, tiny_config


class _Counting(save_on_cpu):
    """torch's `save_on_cpu`, recording the bytes of every tensor it packs."""

    packed: list[torch.Tensor] = []

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
        super().__init__(pin_memory, device_type)
        pack = self.pack_hook

        def counted(t):
            _Counting.packed.append(t)
            return pack(t)

        self.pack_hook = counted


def _train_config(precision: str):
    from marinlm.train.config import TrainConfig

    train = dataclasses.replace(TrainConfig(), model=tiny_config())
    train = dataclasses.replace(train, data=dataclasses.replace(train.data, seq_len=64))
    return dataclasses.replace(train, train=dataclasses.replace(train.train, global_batch=2, precision=precision))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offload_keeps_the_checkpointed_blocks_inputs_on_the_host_as_the_plan_counts(monkeypatch, precision):
    """What torch's offload hooks pack in a step is each checkpointed block's input, nothing else,
    and as many bytes as the plan moves from the device's activations to the host's; losses,
    gradients and state-dict names are those of checkpointing alone."""
    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware

    monkeypatch.setattr(checkpoint_wrapper, "save_on_cpu", _Counting)
    train = _train_config(precision)
    ids = torch.randint(0, train.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    results = {}
    for offload in (False, True):
        _Counting.packed = []
        parallel = ParallelConfig(activation_checkpointing="full", offload_activations=offload)
        model = parallelize(build(train.model), parallel, ParallelDims.resolve(parallel, 1))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(ids, labels=ids, return_logits=False).loss
        packed = list(_Counting.packed)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        results[offload] = (loss.detach(), grads, list(model.state_dict()), packed)
    (loss, grads, names, none), (offloaded_loss, offloaded_grads, offloaded_names, packed) = results.values()
    assert none == [] and torch.equal(loss, offloaded_loss) and names == offloaded_names
    assert all(torch.equal(a, b) for a, b in zip(grads, offloaded_grads, strict=True))
    layers, width = train.model.num_layers, train.model.d_model
    assert [tuple(t.shape) for t in packed] == [(2, 64, width)] * layers  # the residual stream, a block each
    host_bytes = sum(t.numel() * t.element_size() for t in packed)

    h100, eff = load_hardware("h100-sxm"), Efficiency()
    base = ParallelConfig(data_parallel_shard=1, activation_checkpointing="full")
    kept = plan_layout(train, base, 1, h100, eff)
    planned = plan_layout(train, dataclasses.replace(base, offload_activations=True), 1, h100, eff)
    assert planned.ranks[0].host["activations"] == host_bytes
    assert kept.ranks[0].device["activations"] - planned.ranks[0].device["activations"] == host_bytes
    moved = 2 * host_bytes  # out in forward, back in backward, one forward a step
    assert planned.step["activation_offload"] == pytest.approx(moved / (h100.host_link_bandwidth * eff.host_link))
    assert planned.traffic["host"] - kept.traffic["host"] == pytest.approx(moved)
    assert planned.layout["offload_activations"] is True and "activation_offload" not in kept.step


def test_offloading_activations_needs_checkpointing_and_a_layout_says_it_plainly():
    from marinlm.plan import parse_layout

    with pytest.raises(ConfigError, match="offload_activations: needs activation_checkpointing full or every_n"):
        ParallelConfig(offload_activations=True)
    parallel = parse_layout("dp_shard=2,ac=full,offload_activations=1", ParallelConfig())
    assert parallel.offload_activations is True and parallel.activation_checkpointing == "full"
    assert parse_layout("offload_activations=0", ParallelConfig()).offload_activations is False
    with pytest.raises(ConfigError, match="--layout: 'offload_activations=yes': give offload_activations=1 or 0"):
        parse_layout("offload_activations=yes", ParallelConfig())


def test_the_search_offloads_activations_where_a_layout_fits_only_so():
    """With device memory between what the layouts reserve with their blocks' inputs on the device and
    on the host, only offloaded layouts fit, and the search finds them."""
    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware
    from marinlm.plan.search import candidates, rule_shards, search_layouts

    train = _train_config("bf16")
    train = dataclasses.replace(train, train=dataclasses.replace(train.train, global_batch=4))
    h100, eff = load_hardware("h100-sxm"), Efficiency()
    fullest = {False: [], True: []}
    for layout in candidates(train.model, 4, h100):
        for offload in (False, True):
            parallel = dataclasses.replace(train.parallel, **layout, offload_activations=offload)
            try:
                plan = plan_layout(train, parallel, 4, h100, eff, shards_of=rule_shards)
            except (ConfigError, ValueError):
                continue
            fullest[offload].append(plan.reserved_bytes)  # what the verdict weighs
    assert min(fullest[True]) < min(fullest[False])
    tight = dataclasses.replace(h100, memory_bytes=(min(fullest[True]) + min(fullest[False])) / 2)
    found = search_layouts(train, 4, tight, eff, None)
    assert found and all(p.fits and p.layout["offload_activations"] for p in found)
    assert all("activation_offload" in p.step for p in found)
