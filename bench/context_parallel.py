"""Context parallel's global attention: our gather of the keys each chunk reaches, against a ring.

    python bench/context_parallel.py [--seq 8192] [--ranks 2 4] [--rounds 5]

One row of `--seq` tokens, the `tiny` model's global layer (4 query heads, 1 KV head, head dim 32),
cut head-tail over N gloo ranks. Timed on every rank, the slowest rank's median of `--rounds`:
- ours: `ContextParallelAttention.attend` on the CPU attention kernel, as training runs it (one
  all_to_all_single of the keys and values each chunk reaches, then the kernel chunk by chunk with
  the mask), forward and backward;
- the peer, a ring (Liu et al. 2023, torch's `_templated_ring_attention`, Megatron's CP): N steps,
  each attending to the K/V block the ring brings and passing it on with isend/irecv while the
  next block computes, partial results merged by their log-sum-exp (online softmax). Forward only:
  it is written here as the peer and has no backward, so ours is timed forward-only beside it too.
torch's own ring does not run here: on a CPU, SDPA dispatches to an op with no context-parallel
sharding rule ("_scaled_dot_product_flash_attention_for_cpu ... does not have a sharding strategy").
Both on rows of one document (plain causal: the ring's blocks need no mask) and on packed
documents of 1,000 tokens (every block masked by document ids, as training rows are).
Printed: each one's time and the ring's over ours, per degree. The ranks share 2 cores on this
machine, so the times say which does less work and waiting here, not what a GPU cluster would do.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HEADS, KV_HEADS, HEAD_DIM = 4, 1, 32
DOCUMENT = 1000  # tokens a packed document


def pass_on(block: torch.Tensor, rank: int, size: int):
    """Send `block` to the next rank and receive the previous rank's: (the buffer, the requests)."""
    incoming = torch.empty_like(block)
    ops = [dist.P2POp(dist.isend, block, (rank + 1) % size), dist.P2POp(dist.irecv, incoming, (rank - 1) % size)]
    return incoming, dist.batch_isend_irecv(ops)


def wait(incoming: torch.Tensor, requests) -> torch.Tensor:
    for request in requests:
        request.wait()
    return incoming


def ring_attention(q_BHTD, k_BKTD, v_BKTD, layout, rank: int, size: int, doc=None, pos=None):
    """Causal attention of this rank's chunks over the whole row, with the K/V blocks passed round;
    with `doc` and `pos` (the row's document ids and positions), within documents only."""
    attend = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    c = layout.chunk
    mine = layout.chunks(rank)
    out = lse = None
    kv = torch.stack([k_BKTD, v_BKTD]).contiguous()
    for step in range(size):
        owner = (rank - step) % size
        if step < size - 1:  # pass the block on while this one computes
            incoming, pending = pass_on(kv, rank, size)
        for qi, a in enumerate(mine):
            for ki, b in enumerate(layout.chunks(owner)):
                if b > a:
                    continue  # a later chunk: nothing a causal query sees
                q = q_BHTD[:, :, qi * c : (qi + 1) * c]
                k = kv[0][:, :, ki * c : (ki + 1) * c].repeat_interleave(HEADS // KV_HEADS, 1)
                v = kv[1][:, :, ki * c : (ki + 1) * c].repeat_interleave(HEADS // KV_HEADS, 1)
                if doc is None:
                    o, s = attend(q, k, v, is_causal=a == b)[:2]
                else:  # a block's mask from the ids; a query may see none of its keys
                    bias = _block_bias(doc, pos, a, b, c)
                    o, s = attend(q, k, v, attn_mask=bias)[:2]
                    seen = (bias == 0).any(-1, keepdim=True)  # [B, 1, T, 1]
                    o, s = o.masked_fill(~seen, 0.0), s.masked_fill(~seen[..., 0], -torch.inf)
                s = s.unsqueeze(-1)
                if out is None:
                    out = torch.zeros_like(q_BHTD)
                    lse = torch.full((*q_BHTD.shape[:3], 1), -torch.inf)
                part = slice(qi * c, (qi + 1) * c)
                new = torch.logaddexp(lse[:, :, part], s)
                keep = torch.nan_to_num(torch.exp(lse[:, :, part] - new))  # -inf - -inf: nothing seen yet
                out[:, :, part] = out[:, :, part] * keep + o * torch.nan_to_num(torch.exp(s - new))
                lse[:, :, part] = new
        if step < size - 1:
            kv = wait(incoming, pending)
    return out, lse[..., 0]


def _block_bias(doc, pos, a: int, b: int, c: int):
    """Chunk a's queries against chunk b's keys: the additive mask and which queries see a key."""
    from marinlm.model.context import attention_mask

    qs, ks = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
    allowed = attention_mask(doc[:, qs], pos[:, qs], doc[:, ks], pos[:, ks], None)
    return torch.zeros(allowed.shape).masked_fill_(~allowed, -torch.inf)


def ring_attention_backward(dout, q_BHTD, k_BKTD, v_BKTD, out, lse, layout, rank: int, size: int, doc=None, pos=None):
    """The gradients of `ring_attention` for this rank's chunks: the K/V blocks go round again, each
    with the gradient accumulated for it so far, which reaches the block's owner after the last
    step (Liu et al.'s ring backward). Each block pair's gradients come from torch's flash backward
    given the row's final output and log-sum-exp, so the partial softmaxes need no merging."""
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    c, G = layout.chunk, HEADS // KV_HEADS
    mine = layout.chunks(rank)
    dq = torch.zeros_like(q_BHTD)
    kv = torch.stack([k_BKTD, v_BKTD]).contiguous()
    dkv = torch.zeros_like(kv)
    for step in range(size):
        owner = (rank - step) % size
        if step < size - 1:  # the next block travels while this one computes
            incoming, pending = pass_on(kv, rank, size)
        for qi, a in enumerate(mine):
            part = slice(qi * c, (qi + 1) * c)
            for ki, b in enumerate(layout.chunks(owner)):
                if b > a:
                    continue
                block = slice(ki * c, (ki + 1) * c)
                k = kv[0][:, :, block].repeat_interleave(G, 1)
                v = kv[1][:, :, block].repeat_interleave(G, 1)
                mask = None if doc is None else _block_bias(doc, pos, a, b, c)
                gq, gk, gv = backward(
                    dout[:, :, part].contiguous(),
                    q_BHTD[:, :, part].contiguous(),
                    k,
                    v,
                    out[:, :, part].contiguous(),
                    lse[:, :, part].contiguous(),
                    0.0,
                    doc is None and a == b,
                    attn_mask=mask,
                )
                dq[:, :, part] += gq
                B, _, T, D = gk.shape
                dkv[0][:, :, block] += gk.view(B, KV_HEADS, G, T, D).sum(2)
                dkv[1][:, :, block] += gv.view(B, KV_HEADS, G, T, D).sum(2)
        if step < size - 1:
            kv = wait(incoming, pending)
        # The block's gradient so far follows the block: to the next rank, or home after the last step.
        dkv = wait(*pass_on(dkv, rank, size))
    return dq, dkv[0], dkv[1]


def ring_forward_backward(q, k, v, layout, rank: int, size: int, doc=None, pos=None):
    out, lse = ring_attention(q, k, v, layout, rank, size, doc, pos)
    return ring_attention_backward(torch.ones_like(out), q, k, v, out, lse, layout, rank, size, doc, pos)


def _rank(rank: int, size: int, seq: int, rounds: int, store: str, results) -> None:
    from torch import nn

    from marinlm.kernels.attention import FusedAttention
    from marinlm.model.layers import doc_ids_and_positions
    from marinlm.parallel.context_parallel import ChunkLayout, ContextParallelAttention, ContextParallelContext

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    layout = ChunkLayout(seq, size)
    held = layout.held(rank)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, seq, HEAD_DIM, generator=g)[:, :, held].contiguous()
    k = torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=g)[:, :, held].contiguous()
    v = torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=g)[:, :, held].contiguous()
    one = doc_ids_and_positions(torch.zeros(1, seq, dtype=torch.long))
    packed = doc_ids_and_positions(torch.arange(seq).div(DOCUMENT, rounding_mode="floor")[None])

    class Global(ContextParallelAttention, FusedAttention):  # the CPU attention kernel, as training runs it
        def __init__(self):
            nn.Module.__init__(self)
            self.window, self.is_global = None, True

    def ours(backward: bool, rows):
        doc, pos = rows
        where = dict(layout=layout, rank=rank, group=dist.group.WORLD, row_doc=doc, row_pos=pos)
        ctx = ContextParallelContext(doc[:, held], pos[:, held], window=None, packed=rows is packed, **where)
        qq, kk, vv = (t.clone().requires_grad_(backward) for t in (q, k, v))
        y = Global().attend(qq, kk, vv, ctx, None)
        if backward:
            y.sum().backward()
            return qq.grad, kk.grad, vv.grad
        return y

    contenders = {
        "ours, forward": lambda: ours(False, one),
        "ring, forward": lambda: ring_attention(q, k, v, layout, rank, size),
        "ours, forward + backward": lambda: ours(True, one),
        "ring, forward + backward": lambda: ring_forward_backward(q, k, v, layout, rank, size),
        "ours, forward, packed": lambda: ours(False, packed),
        "ring, forward, packed": lambda: ring_attention(q, k, v, layout, rank, size, *packed),
        "ours, forward + backward, packed": lambda: ours(True, packed),
        "ring, forward + backward, packed": lambda: ring_forward_backward(q, k, v, layout, rank, size, *packed),
    }
    with torch.no_grad():
        torch.testing.assert_close(contenders["ring, forward"]()[0], ours(False, one), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(contenders["ring, forward, packed"]()[0], ours(False, packed), rtol=1e-4, atol=1e-4)
    for tail, rows in (("", one), (", packed", packed)):  # the ring's gradients are ours
        for a, b in zip(contenders["ring, forward + backward" + tail](), ours(True, rows), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    times = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
            times[name].append(float(elapsed))
    if rank == 0:
        results[size] = {name: statistics.median(t) for name, t in times.items()}
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = mp.Manager().dict()
    for size in args.ranks:
        with tempfile.TemporaryDirectory() as work:
            mp.spawn(_rank, args=(size, args.seq, args.rounds, f"{work}/store", results), nprocs=size)
    print(f"global attention of one row of {args.seq:,} tokens, cut over N gloo ranks (median of {args.rounds})")
    head = f"{'N':>3} {'rows':>22} {'ours fwd':>10} {'ring fwd':>10} {'ring / ours':>12}"
    print(head + f" {'ours fwd+bwd':>13} {'ring fwd+bwd':>13} {'ring / ours':>12}")
    for size in args.ranks:
        r = results[size]
        for rows, tail in (("one document", ""), (f"documents of {DOCUMENT:,}", ", packed")):
            ours, ring = r["ours, forward" + tail], r["ring, forward" + tail]
            ours2, ring2 = r["ours, forward + backward" + tail], r["ring, forward + backward" + tail]
            line = f"{size:>3} {rows:>22} {ours * 1e3:>8.1f}ms {ring * 1e3:>8.1f}ms {ring / ours:>11.2f}x"
            print(line + f" {ours2 * 1e3:>11.1f}ms {ring2 * 1e3:>11.1f}ms {ring2 / ours2:>11.2f}x")


if __name__ == "__main__":
    main()
