"""LM head + next-token loss, forward and backward: our fused, chunked kernel against torch.

Peer: `F.linear` followed by `F.cross_entropy` (plus `torch.logsumexp` for the z-loss), which
materialises the [tokens, vocab] fp32 logits, as HF transformers does. Ours are the fused kernel
`marinlm.kernels.loss` (training with `kernels.modules: auto` and `kernels.loss_chunk_tokens > 0`) and the
reference model's checkpointed chunks (`marinlm.model.loss.NextTokenLoss`, `kernels.modules: reference`).
Each contender runs in a fresh process so its peak RSS is its own; the allocator is tuned in all
(utils/perf.py).

    python bench/lm_loss.py [--repeats 3] [--device cuda]

On CUDA both run in bf16 autocast, as in training, and memory is the peak allocated by the step.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import time

# (tokens, d_model, vocab, z-loss weight, what the shape stands for)
SHAPES = [
    (2048, 128, 4096, 1e-4, "the quickstart's tiny preset"),
    (1024, 384, 16384, 0.0, "bench/train_step.py's qwen3-moe-style batch"),
    (1024, 384, 16384, 1e-4, "the same with Marin's z-loss (the small preset)"),
    (4096, 128, 65536, 1e-4, "a small model with a large vocabulary"),
    (2048, 512, 128256, 1e-4, "Marin's 128k vocabulary, 2k tokens"),
]


def run(kind, tokens, dim, vocab, z_weight, repeats, chunk, queue, device="cpu") -> None:
    import torch

    from marinlm.kernels.loss import fused_chunked_loss
    from marinlm.model.loss import NextTokenLoss, reference_loss
    from marinlm.utils.perf import tune_cpu_allocator

    tune_cpu_allocator()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, dim, generator=g).to(device).requires_grad_()
    w = (torch.randn(vocab, dim, generator=g) / dim**0.5).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    cuda = device == "cuda"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**10
    best, loss = float("inf"), None
    for _ in range(repeats + cuda):  # on CUDA the first call is a warm-up
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            if kind == "torch":
                ce, z, _, _ = reference_loss(h @ w.t(), labels, z_weight)
                loss = ce + z
            elif kind == "reference":
                loss = NextTokenLoss(z_weight, chunk)(h, w, labels)[0]
            else:
                loss = fused_chunked_loss(h, w, labels, z_weight, chunk)[0]
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
        h.grad = w.grad = None
    after = torch.cuda.max_memory_allocated() / 2**10 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put((best, (after - before) / 2**20, loss.item()))


def measure(kind, shape, repeats, chunk, device):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=run, args=(kind, *shape[:4], repeats, chunk, queue, device))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    a = p.parse_args()
    print(f"LM head + cross-entropy + z-loss (weight z), fwd + bwd; best of {a.repeats}; fused chunk {a.chunk}")
    print(
        f"{'tokens x d x vocab, z':<30}{'torch':>18}{'marinlm fused':>20}{'speed':>8}{'memory':>9}"
        f"{'marinlm reference':>24}{'speed':>8}{'memory':>9}"
    )
    for shape in SHAPES:
        t_ref, m_ref, l_ref = measure("torch", shape, a.repeats, a.chunk, a.device)
        row = ""
        for kind in ("fused", "reference"):
            t_ours, m_ours, l_ours = measure(kind, shape, a.repeats, a.chunk, a.device)
            assert abs(l_ref - l_ours) < (1e-2 if a.device == "cuda" else 1e-4) * abs(l_ref), (kind, l_ref, l_ours)
            row += f"{t_ours * 1e3:9.0f} ms {m_ours:5.2f} GB{t_ref / t_ours:7.2f}x{m_ref / max(m_ours, 1e-3):8.1f}x"
        name = "{} x {} x {}, {:g}".format(*shape[:4])
        print(f"{name:<30}{t_ref * 1e3:8.0f} ms {m_ref:5.2f} GB{row}   ({shape[4]})")
    where = "peak GPU memory allocated" if a.device == "cuda" else "peak RSS added"
    print(f"speed and memory are torch / marinlm; memory is the {where} by the step")


if __name__ == "__main__":
    main()
