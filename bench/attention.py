"""Attention, forward and backward, against torch's SDPA: local (sliding-window) layers, and on CPU
the kernel of global layers, in fp32 and (where the CPU has bf16 GEMMs) in bf16.

Local layers. Peer: `F.scaled_dot_product_attention` with the layer's boolean mask over the whole
row (packed documents, causal, sliding window), as the model ran local layers before
`banded_attention`: it computes all T x T scores (a mask stops the flash kernel from skipping
blocks). Ours is `marinlm.model.attention.banded_attention`, which computes T x (window + block).
Every block size listed is timed, and `band_block`'s choice is marked; the ratio is the peer's
time over ours at that choice.

Global layers on CPU, in fp32, and in bf16 where the CPU has bf16 GEMMs. Peer:
`F.scaled_dot_product_attention` (torch's CPU flash kernel), causal (`is_causal`, where it skips
the blocks above the diagonal) and with a packed-documents mask. Ours is the model's kernel,
`marinlm.kernels.cpu_attention.scaled_dot_product_attention`: batched GEMMs in blocks of queries, or
torch's SDPA itself where its kept probabilities would pass MAX_SCORES (printed). Timings are the
best of `--repeats` interleaved rounds.

    python bench/attention.py [--repeats 7] [--device cuda] [--shapes N]

On CUDA the local layers run in bf16 (`band_block` keeps the whole-row SDPA there until this is
measured), and the global layers' CPU kernel is not timed.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from marinlm.kernels import cpu_attention
from marinlm.kernels.attention import band_block, banded_attention, banded_mask
from marinlm.model.context import attention_mask
from marinlm.model.layers import doc_ids_and_positions
from marinlm.utils.device import emulated_bf16

# (batch, query heads, kv heads, tokens, head dim, window, what the shape stands for)
SHAPES = [
    (8, 4, 2, 256, 32, 64, "the quickstart's tiny preset"),
    (2, 6, 2, 1024, 64, 256, "the small preset at its 1,024 tokens"),
    (1, 4, 2, 4096, 64, 2048, "the hero's 4,096 tokens and window of 2,048, 4 heads"),
]
BLOCKS = [16, 32, 64, 128, 256, 512]
# Global (causal, full-row) layers: (batch, query heads, kv heads, tokens, head dim, what it stands for)
GLOBAL_SHAPES = [
    (4, 6, 2, 256, 64, "bench/train_step.py's default rows"),
    (1, 6, 2, 1024, 64, "the qwen3-moe-style config at its 1,024 tokens"),
    (2, 6, 2, 1024, 64, "two such rows"),
    (1, 4, 2, 4096, 64, "the hero's 4,096 tokens, 4 heads"),
]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_shape(shape, device: torch.device, dtype: torch.dtype, repeats: int) -> None:
    B, H, K, T, Dh, window, what = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, Dh, generator=g).to(device, dtype).requires_grad_() for n in (H, K, K))
    dy = torch.randn(B, H, T, Dh, generator=g).to(device, dtype)
    doc, pos = (t.to(device) for t in packed_documents(B, T, g))
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


def packed_documents(B: int, T: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Doc ids and positions of rows packed with documents of ~300 tokens."""
    return doc_ids_and_positions(torch.cumsum(torch.rand(B, T, generator=g) < 1 / 300, dim=1))


def bench_global(shape, repeats: int, dtype: torch.dtype) -> None:
    B, H, K, T, Dh, what = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, Dh, generator=g).to(dtype).requires_grad_() for n in (H, K, K))
    dy = torch.randn(B, H, T, Dh, generator=g).to(dtype)
    doc, pos = packed_documents(B, T, g)
    print(f"\n{B} x {T} tokens, {H} heads ({K} KV) of {Dh}, global layer, {dtype}: {what}")
    for name, mask in (("causal", None), ("packed documents", attention_mask(doc, pos, doc, pos, None))):

        def torch_sdpa(mask=mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)

        def ours(mask=mask):
            return cpu_attention.scaled_dot_product_attention(q, k, v, mask, is_causal=mask is None, enable_gqa=True)

        err = (ours().float() - torch_sdpa().float()).abs().max().item()
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-4), f"{name}: max error {err}"
        spans = cpu_attention.query_blocks(T, T, mask, is_causal=mask is None, dtype=dtype)
        taken = cpu_attention.use_short_attention(q, k, mask, spans)
        how = f"{len(spans)} block(s) of queries" if taken else "torch's SDPA: past MAX_SCORES kept probabilities"
        best = {"torch": float("inf"), "ours": float("inf")}
        for step in (torch_sdpa, ours):
            step().backward(dy)  # warm-up
        for _ in range(repeats):
            for who, step in (("torch", torch_sdpa), ("ours", ours)):
                start = time.perf_counter()
                step().backward(dy)
                best[who] = min(best[who], time.perf_counter() - start)
        print(
            f"  {name:17s} torch SDPA {best['torch'] * 1e3:8.2f} ms, ours {best['ours'] * 1e3:8.2f} ms ({how}); "
            f"torch / ours: {best['torch'] / best['ours']:.2f}x"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shapes", type=int, default=None, help="time the first N shapes of each list only")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.device}, {dtype}")
    for shape in SHAPES[: args.shapes]:
        bench_shape(shape, device, dtype, args.repeats)
    if args.device != "cpu":
        return
    dtypes = [torch.float32]
    if emulated_bf16("cpu"):
        print("\nglobal layers in bf16: this CPU has no bf16 GEMMs, so the model runs them through torch's SDPA")
    else:
        dtypes.append(torch.bfloat16)
    for dtype in dtypes:
        for shape in GLOBAL_SHAPES[: args.shapes]:
            bench_global(shape, args.repeats, dtype)


if __name__ == "__main__":
    main()
