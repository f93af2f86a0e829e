"""Expert kernels on this machine: grouped_mm, chunked, padded bmm and a per-expert loop, forward+backward.

Also times a naive per-token loop as the peer a reader would write first. Routing is realistic:
a random router over normalised activations, so loads are uneven as at initialisation.

    python bench/experts.py [--tokens 8192] [--experts 32] [--top-k 4] [--dim 192] [--hidden 192]
"""

from __future__ import annotations

import argparse
import time

import torch

from marinlm.kernels.experts import FusedRoutedExperts


def time_step(module, x, experts, weights, dtype, repeats=5) -> float:
    def step():
        module.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y, _ = module(x, experts, weights)
        y.float().pow(2).mean().backward()

    step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--hidden", type=int, default=192)
    a = p.parse_args()
    torch.manual_seed(0)
    x = torch.randn(a.tokens, a.dim, requires_grad=True)
    router = torch.randn(a.dim, a.experts) * 0.02
    weights, experts = torch.topk(torch.softmax(x.detach() @ router, -1), a.top_k, -1)
    load = torch.bincount(experts.reshape(-1), minlength=a.experts)
    flops = 3 * 2 * 3 * a.tokens * a.top_k * a.dim * a.hidden  # fwd+bwd, three matrices
    print(
        f"tokens={a.tokens} experts={a.experts} top_k={a.top_k} {a.dim}->{a.hidden}; max/mean load "
        f"{load.max().item() / load.float().mean().item():.2f}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        results = {}
        for impl in ("grouped_mm", "chunked", "bmm", "loop"):
            module = FusedRoutedExperts(a.experts, a.dim, a.hidden, 0.02, impl)
            module.reset_parameters()
            results[impl] = time_step(module, x, experts, weights, dtype)
        base = results["loop"]
        line = ", ".join(
            f"{k} {v * 1e3:.1f} ms ({flops / v / 1e9:.0f} GFLOP/s, {base / v:.2f}x loop)" for k, v in results.items()
        )
        print(f"{str(dtype):>15}: {line}")


if __name__ == "__main__":
    main()
