"""bench/gpu_check.py runs only where a GPU is lent, for minutes of scarce device time: its dry run on
CPU keeps it from rotting in between (the cheap parts here; every part with `--device cpu`). Also the
profile breakdown that bench/train_step.py prints."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from marinlm.kernels.cpu_attention import short_attention
from marinlm.utils.device import emulated_bf16
from marinlm.utils.perf import CATEGORIES, time_breakdown

from conftest import ROOT

GPU_CHECK = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu"]


@pytest.mark.slow
def test_gpu_check_dry_run_compares_kernels_packed_batches_and_attention(tmp_path):
    out = subprocess.run(
        [*GPU_CHECK, "--parts", "kernels,packed,attention", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    summary = out.stdout.split("# summary")[1]
    for impl in ("grouped_mm", "chunked", "bmm", "loop"):  # fp32 on CPU: every kernel equals the loop
        assert f"{impl}" in summary
    assert summary.count("rel. diff to loop 0.0e+00") == 4, summary
    assert "packed tiny batch" in summary and "cpu bf16 loss" in summary
    assert "banded, blocks of 32" in summary and "torch / ours: " in summary  # bench/attention.py ran
    if not emulated_bf16("cpu"):  # and timed the global layers' bf16 kernel against torch's SDPA
        assert "1 block(s) of queries" in summary, summary
    assert (tmp_path / "kernels.log").is_file() and (tmp_path / "packed.log").is_file()


@pytest.mark.slow
def test_gpu_check_stops_a_part_at_its_timeout_and_fails(tmp_path):
    start = time.perf_counter()
    out = subprocess.run(
        [*GPU_CHECK, "--parts", "torchrun", "--part-timeout", "3", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert time.perf_counter() - start < 30  # the torchrun part alone takes over a minute
    assert out.returncode == 1
    assert "part torchrun FAILED (stopped after 3 s)" in out.stdout


def test_gpu_check_rejects_unknown_parts(tmp_path):
    out = subprocess.run(
        [*GPU_CHECK, "--parts", "kernels,kernal", "--out", str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "unknown part(s) kernal" in out.stderr and "kernels" in out.stderr
    assert not list(tmp_path.iterdir())  # refused before any part ran


def test_time_breakdown_sorts_each_ops_time_and_counts_gemm_flops_by_shape():
    a, b, w_expert = torch.randn(64, 48), torch.randn(48, 32), torch.randn(48, 24)
    x, y = torch.randn(2, 64, 48), torch.randn(2, 48, 32)
    q = torch.randn(1, 2, 16, 8)
    q_grad = q.clone().requires_grad_()
    p = torch.nn.Parameter(torch.randn(1000))
    p.grad = torch.randn(1000)
    opt = torch.optim.AdamW([p], fused=True)

    def step():
        a @ b  # mm
        torch.addmm(torch.zeros(32), a, b)
        torch.bmm(x, y)
        a @ w_expert  # the one product of expert width 24
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        # Ours is batched GEMMs around a softmax: all of it, forward and backward, is attention.
        short_attention(q_grad, q_grad, q_grad, is_causal=True).sum().backward()
        opt.step()
        torch.index_select(a, 0, torch.tensor([3, 1]))
        torch.relu(a)

    parts = time_breakdown(step, steps=3, expert_dims=(24,))
    assert list(parts) == list(CATEGORIES)
    seconds = {c: s for c, (s, _) in parts.items()}
    flops = {c: f for c, (_, f) in parts.items()}
    assert flops["expert GEMMs"] == 2 * 64 * 48 * 24  # per call, not summed over the three
    assert flops["other GEMMs"] == 2 * (2 * 64 * 48 * 32) + 2 * 2 * 64 * 48 * 32
    assert all(f == 0 for c, f in flops.items() if "GEMM" not in c)
    assert all(s > 0 for s in seconds.values()), seconds
    assert time_breakdown(step, steps=1)["expert GEMMs"] == (0.0, 0.0)  # no expert widths: all other

    big = torch.nn.Parameter(torch.randn(1 << 20))
    big.grad = torch.randn(1 << 20)
    adam = torch.optim.AdamW([big], fused=True)
    adam.step()  # its state made
    parts = time_breakdown(adam.step, steps=3)
    assert parts["optimizer"][0] > 0.5 * sum(s for s, _ in parts.values())  # the fused kernel, not its step count


def test_interleaved_rounds_time_every_contender_each_round_in_shuffled_orders():
    """bench/train_step.py: each contender warmed up twice, then timed once a round, the rounds
    aligned (the within-round ratios pair them), and no contender always run after the same one."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from train_step import interleaved_times
    finally:
        sys.path.remove(str(ROOT / "bench"))
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    times = interleaved_times(steps, rounds=12)
    assert calls[:8] == ["a", "a", "b", "b", "c", "c", "d", "d"]  # the warm-ups, in order
    rounds = [calls[8 + 4 * r : 12 + 4 * r] for r in range(12)]
    assert len(calls) == 8 + 4 * 12 and all(sorted(r) == list("abcd") for r in rounds)
    assert {name: len(t) for name, t in times.items()} == dict.fromkeys("abcd", 12)
    assert len({tuple(r) for r in rounds}) > 1
    # Every contender runs right after at least two different ones (or first) over the rounds.
    before = {name: {r[r.index(name) - 1] if r.index(name) else None for r in rounds} for name in "abcd"}
    assert all(len(b) >= 2 for b in before.values()), before
    assert interleaved_times(dict(steps), rounds=12) and calls[-48:] == calls[8 : 8 + 48]  # seeded: repeatable
