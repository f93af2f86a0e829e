"""bf16 autocast on a CPU without a bf16 GEMM: kernels/bf16.py against torch's own bf16 kernels.

Peer: torch's bf16 `F.linear` and `F.scaled_dot_product_attention` under CPU autocast, which HF
transformers' models call. Ours computes the same bf16-rounded products with fp32 GEMMs. Each op
runs forward + backward; the error is the largest elementwise difference from an fp64 computation
on the same bf16 operands, relative to the largest output magnitude.

    python bench/cpu_bf16.py [--repeats 3]

On a CPU that has a bf16 GEMM (AVX512 or AMX), marinlm uses torch's kernels and there is nothing to
compare; the script says so and stops.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from marinlm.kernels import bf16 as cpu_bf16

BF16 = torch.bfloat16
# (name, tokens, in, out): bench/train_step.py's qwen3-moe-style attention projections and a
# slice of its 16,384-word LM head (torch's kernel would take ~40 s for the full head).
LINEARS = [("q/o projection", 1024, 384, 384), ("k/v projection", 1024, 384, 128), ("LM head", 128, 384, 16384)]
# (name, batch, query heads, kv heads, length, head dim)
ATTENTION = [("qwen3-moe-style layer", 4, 6, 2, 256, 64)]


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).abs().max() / exact.abs().max()).item()


def bench_linear(tokens, d_in, d_out, repeats):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d_in, generator=g).requires_grad_()
    w = (torch.randn(d_out, d_in, generator=g) / d_in**0.5).requires_grad_()
    grad = torch.randn(tokens, d_out, generator=g)
    exact = x.detach().to(BF16).double() @ w.detach().to(BF16).double().t()
    results = {}
    for name, fn in (("torch bf16", F.linear), ("marinlm", cpu_bf16._Bf16Linear.apply)):

        def step(fn=fn):
            with torch.autocast("cpu", dtype=BF16):
                y = fn(x, w)
            y.backward(grad)
            return y

        y = step()
        results[name] = (best_time(step, repeats), relative_error(y, exact))
    return 3 * 2 * tokens * d_in * d_out, results


def bench_attention(batch, heads, kv_heads, length, head_dim, repeats):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, length, head_dim, generator=g).to(BF16).requires_grad_()
    k = torch.randn(batch, kv_heads, length, head_dim, generator=g).to(BF16).requires_grad_()
    v = torch.randn(batch, kv_heads, length, head_dim, generator=g).to(BF16).requires_grad_()
    grad = torch.randn(batch, heads, length, head_dim, generator=g).to(BF16)
    kwargs = dict(is_causal=True, enable_gqa=True)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kwargs)
    results = {}
    contenders = (("torch bf16", F.scaled_dot_product_attention), ("marinlm", cpu_bf16.scaled_dot_product_attention))
    for name, fn in contenders:

        def step(fn=fn):
            y = fn(q, k, v, **kwargs)
            y.backward(grad)
            return y

        y = step()
        results[name] = (best_time(step, repeats), relative_error(y, exact))
    # Causal: half the score matrix; forward two products, backward four.
    return 6 * 2 * batch * heads * length * length * head_dim // 2, results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}"
    )
    if not cpu_bf16.emulated_bf16("cpu"):
        print("this CPU has a bf16 GEMM: marinlm uses torch's bf16 kernels here, nothing to compare")
        return
    print("forward + backward, best of", a.repeats, "| error: max |out - fp64| / max |fp64|, same bf16 operands")
    cases = [(f"linear {n} {t}x{i}->{o}", bench_linear(t, i, o, a.repeats)) for n, t, i, o in LINEARS]
    cases += [
        (f"SDPA {n} {b}x{h}/{kv}x{t}x{d}", bench_attention(b, h, kv, t, d, a.repeats))
        for n, b, h, kv, t, d in ATTENTION
    ]
    for label, (flops, results) in cases:
        print(f"\n{label}")
        for name, (seconds, error) in results.items():
            print(f"  {name:<11} {seconds * 1e3:9.1f} ms  {flops / seconds / 1e9:7.1f} GFLOP/s  error {error:.1e}")
        speedup = results["torch bf16"][0] / results["marinlm"][0]
        print(f"  marinlm / torch bf16: {speedup:.1f}x")


if __name__ == "__main__":
    main()
