"""The MuonH optimizer step: Newton-Schulz batched over same-shaped matrices vs one at a time.

A/B/C in one process, interleaved, on `tiny`, `small` and (on GPU) a 1.1B hero-shaped model:

- batched: the optimizer as the trainer runs it;
- one at a time: the same with batching turned off, i.e. a per-parameter Muon loop;
- reference: one at a time, with each Newton-Schulz step spelled as in the reference Muon
  (`A = X·Xᵀ; B = b·A + c·A·A; X = a·X + B·X`) instead of our `X = (a·I + b·A + c·A²)·X`.

    python bench/muon_step.py [--device cuda] [--rounds 8]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import marinlm.optim.marin as marin
from marinlm.config import load_config
from marinlm.kernels import apply_kernels
from marinlm.model import MarinConfig, MarinForCausalLM
from marinlm.optim import MarinOptimizerConfig, build_optimizer
from marinlm.utils.perf import tune_cpu_allocator
from train_step import HERO_SHAPED_1B, sync

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"


def reference_newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype=torch.float32) -> torch.Tensor:
    """The reference Muon spelling of `marin.newton_schulz`: same coefficients, same math."""
    a, b, c = marin.NS_SCHEDULES["simple"][0]
    x = g.to(dtype)
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + eps)
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if transpose else x).to(g.dtype)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=8)
    a = p.parse_args()
    dev = a.device
    tune_cpu_allocator()  # as the trainer does
    batched, ours = marin.ns_batch_elements, marin.newton_schulz
    presets = [("tiny", "tiny.yaml", []), ("small", "small.yaml", [])]
    if dev == "cuda":
        presets.append(("hero-shaped 1.1B", "small.yaml", HERO_SHAPED_1B))
    for label, path, overrides in presets:
        config = load_config(MarinConfig, CONFIGS / path, overrides)
        with torch.device("meta"):
            model = apply_kernels(MarinForCausalLM(config), dev, "bf16")
        model.to_empty(device=dev)
        model.init_weights(seed=0)
        opt = build_optimizer(model, MarinOptimizerConfig(), dev)
        ids = torch.randint(0, config.vocab_size, (2, 128), device=dev)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            model(ids, labels=ids, return_logits=False).loss.backward()
        times: dict[str, list[float]] = {"batched": [], "one at a time": [], "reference": []}
        for _ in range(a.rounds + 1):  # the first round is a warm-up
            for name in times:
                marin.ns_batch_elements = batched if name == "batched" else (lambda device: 0)
                marin.newton_schulz = reference_newton_schulz if name == "reference" else ours
                sync(dev)
                start = time.perf_counter()
                opt.step()
                sync(dev)
                times[name].append(time.perf_counter() - start)
        marin.ns_batch_elements, marin.newton_schulz = batched, ours
        med = {k: sorted(v[1:])[len(v[1:]) // 2] * 1e3 for k, v in times.items()}
        print(
            f"{label}: optimizer step (MuonH + AdamH + Adam), median of {a.rounds}: batched "
            f"{med['batched']:.1f} ms, one at a time {med['one at a time']:.1f} ms, "
            f"{med['one at a time'] / med['batched']:.2f}x; reference spelling one at a time "
            f"{med['reference']:.1f} ms, {med['reference'] / med['batched']:.2f}x",
            flush=True,
        )
        del model, opt
        if dev == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
