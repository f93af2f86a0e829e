"""Sliding-window attention, forward and backward: ours block by block against torch's SDPA per row.

Peer: `F.scaled_dot_product_attention` with the layer's boolean mask over the whole row (packed
documents, causal, sliding window), as the model ran local layers before `banded_attention`: it
computes all T x T scores (a mask stops the flash kernel from skipping blocks). Ours is
`marinlm.model.attention.banded_attention`, which computes T x (window + block). Every block size
listed is timed, and `band_block`'s choice is marked; the ratio is the peer's time over ours at
that choice. Timings are the best of `--repeats` interleaved rounds.

    python bench/attention.py [--repeats 7] [--device cuda] [--shapes N]

On CUDA both run in bf16 (`band_block` keeps the whole-row SDPA there until this is measured).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from marinlm.model.attention import attention_mask, band_block, banded_attention, banded_mask
from marinlm.model.layers import doc_ids_and_positions

# (batch, query heads, kv heads, tokens, head dim, window, what the shape stands for)
SHAPES = [
    (8, 4, 2, 256, 32, 64, "the quickstart's tiny preset"),
    (2, 6, 2, 1024, 64, 256, "the small preset at its 1,024 tokens"),
    (1, 4, 2, 4096, 64, 2048, "the hero's 4,096 tokens and window of 2,048, 4 heads"),
]
BLOCKS = [16, 32, 64, 128, 256, 512]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_shape(shape, device: torch.device, dtype: torch.dtype, repeats: int) -> None:
    B, H, K, T, Dh, window, what = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, Dh, generator=g).to(device, dtype).requires_grad_() for n in (H, K, K))
    dy = torch.randn(B, H, T, Dh, generator=g).to(device, dtype)
    seg = torch.cumsum(torch.rand(B, T, generator=g) < 1 / 300, dim=1).to(device)  # ~300-token documents
    doc, pos = doc_ids_and_positions(seg)
    whole = attention_mask(doc, pos, doc, pos, window)
    steps = {"torch SDPA, whole row": lambda: F.scaled_dot_product_attention(q, k, v, whole, enable_gqa=True)}
    for block in BLOCKS:
        if block < window * 2:
            mask = banded_mask(doc, pos, window, block)
            steps[f"banded, blocks of {block}"] = lambda mask=mask: banded_attention(q, k, v, mask)
    want = steps["torch SDPA, whole row"]().float()
    best = {}
    for name, step in steps.items():
        err = (step().float() - want).abs().max().item()
        assert err < (1e-2 if dtype == torch.bfloat16 else 1e-4), f"{name}: max error {err}"
        step().backward(dy)  # warm-up
        best[name] = float("inf")
    for _ in range(repeats):
        for name, step in steps.items():
            sync(device.type)
            start = time.perf_counter()
            step().backward(dy)
            sync(device.type)
            best[name] = min(best[name], time.perf_counter() - start)
    chosen = f"banded, blocks of {band_block(T, window, torch.device('cpu'))}"
    print(f"\n{B} x {T} tokens, {H} heads ({K} KV) of {Dh}, window {window}: {what}")
    for name, seconds in best.items():
        mark = "  <- band_block's choice on CPU" if name == chosen else ""
        print(f"  {name:24s} {seconds * 1e3:9.2f} ms{mark}")
    if chosen in best:
        print(f"  torch / ours: {best['torch SDPA, whole row'] / best[chosen]:.2f}x")
    else:
        print("  band_block keeps the whole-row SDPA at this shape")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shapes", type=int, default=len(SHAPES), help="time the first N shapes only")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}, {dtype}")
    for shape in SHAPES[: args.shapes]:
        bench_shape(shape, device, dtype, args.repeats)


if __name__ == "__main__":
    main()
