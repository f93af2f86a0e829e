"""The reserved peak (plan/allocator.py): the caching allocator's rules, the step's recorded allocations against
torch's MemTracker, and the proxy's trace scaled to a model against that model's own."""

from __future__ import annotations

import pytest
import torch

from marinlm.config import load_config
from marinlm.kernels import apply_kernels
from marinlm.kernels.config import KernelConfig
from marinlm.model import MarinConfig, MarinForCausalLM
from marinlm.plan.activations import packed_segments
from marinlm.plan.allocator import (
    CachingAllocator,
    rank_widths,
    record_step,
    replay,
    reserved_bytes,
    step_trace,
    weight_elements,
)

from conftest import CONFIGS

MiB = 2**20


def test_small_requests_round_to_512_bytes_and_pack_into_2_mib_segments():
    a = CachingAllocator()
    for i in range(4096):
        a.malloc(i, 100 if i % 2 else 512)
    assert a.allocated == 4096 * 512 and a.reserved == 2 * MiB
    a.malloc("one more", 1)
    assert a.reserved == 4 * MiB
    a.free(0)
    a.malloc("reused", 300)
    assert a.reserved == 4 * MiB  # the freed block, not a new segment


def test_large_requests_share_20_mib_segments_under_10_mib_and_round_to_2_mib_above():
    a = CachingAllocator()
    a.malloc("a", 5 * MiB)
    a.malloc("b", 5 * MiB)  # split from the first segment's 15 MiB rest
    assert a.reserved == 20 * MiB and a.allocated == 10 * MiB
    a.malloc("c", 12 * MiB + 1)  # rounded to 12 MiB + 512: a segment of 14 MiB
    assert a.reserved == 34 * MiB
    a.malloc("d", MiB + 512)  # c's rest (2 MiB - 512) is the smallest that holds it: taken whole
    assert a.reserved == 34 * MiB and a.allocated == 10 * MiB + 14 * MiB
    a.malloc("e", 3 * MiB)  # from the first segment's 10 MiB rest, split
    assert a.reserved == 34 * MiB and a.allocated == 27 * MiB


def test_a_block_is_split_only_when_more_than_1_mib_would_be_left_in_the_large_pool():
    a = CachingAllocator()
    a.malloc("big", 12 * MiB)
    a.free("big")
    a.malloc("x", 11 * MiB)  # exactly 1 MiB left: not split, the whole block is allocated
    assert a.allocated == 12 * MiB
    a.free("x")
    a.malloc("y", 10 * MiB + 512)  # 2 MiB - 512 left: split
    assert a.allocated == 10 * MiB + 512
    a.malloc("z", 1 * MiB + 512)  # fits in the split rest
    assert a.reserved == 12 * MiB


def test_freed_neighbours_merge_and_holes_too_small_take_new_segments():
    a = CachingAllocator()
    for k in "abcd":
        a.malloc(k, 5 * MiB)
    a.free("a")
    a.free("b")
    a.malloc("merged", 9 * MiB)  # a and b merged into 10 MiB
    assert a.reserved == 20 * MiB
    for k in range(4):
        a.malloc(("big", k), 12 * MiB)
    a.free(("big", 0))
    a.free(("big", 2))  # 24 MiB free in two holes of 12
    a.malloc("wide", 16 * MiB)
    assert a.reserved == 20 * MiB + 4 * 12 * MiB + 16 * MiB
    assert a.peak_reserved == a.reserved and a.peak_allocated > a.allocated


def test_at_the_devices_memory_wholly_free_segments_go_back_and_then_it_is_out_of_memory():
    a = CachingAllocator(capacity=36 * MiB)
    a.malloc("a", 12 * MiB)
    a.malloc("b", 12 * MiB)
    a.free("a")
    a.malloc("c", 14 * MiB)  # a's free 12 MiB does not hold it, and 38 MiB would pass 36: it is released
    assert a.reserved == 26 * MiB and a.out_of_memory == 0
    a.malloc("d", 20 * MiB)
    assert a.out_of_memory == 1


def _tiny(precision: str, name: str = "tiny", kernels: KernelConfig | None = None):
    config = load_config(MarinConfig, CONFIGS / "model" / f"{name}.yaml")
    with torch.device("meta"):
        model = MarinForCausalLM(config)
    apply_kernels(model, "cpu", precision, kernels or KernelConfig())
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return config, model


def test_the_recorded_step_peaks_where_torchs_memtracker_says():
    """The storages a forward and backward create (recorded as they are made and as they die), with the
    weights, peak at MemTracker's total to 0.1%."""
    from torch.distributed._tools.mem_tracker import MemTracker

    config, model = _tiny("fp32")
    ids = torch.randint(0, config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    segments = packed_segments(2, 128)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        out = model(ids, segments, labels=ids, return_logits=False)
        out.loss.backward()
        del out
    expected = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    model.zero_grad(set_to_none=True)
    live = peak = 0
    sizes = {}
    for event in record_step(model, ids, segments, "fp32"):
        if event[0] == "alloc":
            sizes[event[1]] = event[2]
            live += event[2]
            peak = max(peak, live)
        else:
            live -= sizes.pop(event[1])
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak + weights == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize(
    "name, precision, rows, seq", [("tiny", "fp32", 8, 256), ("tiny", "bf16", 8, 256), ("small", "bf16", 2, 512)]
)
def test_the_proxys_step_scaled_to_a_model_allocates_and_reserves_what_the_models_own_step_does(
    name, precision, rows, seq
):
    """The proxy's allocations scaled to the model (`StepTrace.at`) against the model's own, recorded in its
    step and replayed alike, both with the reference modules (what a GPU plan stands for, `kernels_device`
    cuda): the allocated and reserved peaks within 3%, and their ratio (what the plan uses) within 3%. The
    proxy's scaled to half the tokens misses by far."""
    kernels = KernelConfig()
    config, model = _tiny(precision, name, kernels.reference())
    ids = torch.randint(0, config.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(0))
    real = [e if e[0] == "free" else e[:3] for e in record_step(model, ids, packed_segments(rows, seq), precision)]
    own = replay(real)
    trace = step_trace(config, precision, kernels, "cuda")
    table, weights = rank_widths(config, seq, kernels.loss_chunk_tokens), weight_elements(config)
    scaled = replay(trace.at(table, rows * seq, weights))
    assert scaled.peak_allocated == pytest.approx(own.peak_allocated, rel=0.03)
    assert scaled.peak_reserved == pytest.approx(own.peak_reserved, rel=0.03)
    ratio = scaled.peak_reserved / scaled.peak_allocated
    assert ratio == pytest.approx(own.peak_reserved / own.peak_allocated, rel=0.03)
    half = replay(trace.at(table, rows * seq / 2, weights))
    assert half.peak_reserved != pytest.approx(own.peak_reserved, rel=0.25)


def test_the_reserved_peak_adds_the_overhead_to_what_the_step_allocates_only():
    device = {"weights": 10.0, "optimizer_state": 5.0, "gradients": 10.0, "activations": 30.0}
    assert reserved_bytes(device, 1.0) == 55.0
    assert reserved_bytes(device, 1.5) == 15.0 + 40.0 * 1.5
