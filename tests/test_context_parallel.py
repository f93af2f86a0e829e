"""Context parallel's pieces: the head-tail cut, the exchanges, and attention and SConv on a rank's
chunks against the same operation on the whole row (gloo processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from marinlm.config import ConfigError
from marinlm.kernels.attention import FusedAttention
from marinlm.kernels.config import KernelConfig
from marinlm.kernels.layers import FusedSConv
from marinlm.model.attention import Attention
from marinlm.model.context import attention_mask, sconv_keep_masks
from marinlm.model.layers import SConv, doc_ids_and_positions
from marinlm.parallel.context_parallel import (
    ChunkLayout,
    ContextParallelAttention,
    ContextParallelContext,
    ContextParallelSConv,
    check_cut,
    exchange,
)

from conftest import ROOT, spawn_ranks


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_the_head_tail_cut_gives_every_rank_the_same_causal_work(size):
    """Each rank holds 2 chunks; the (query, key) pairs a causal mask allows over its queries
    differ between ranks by less than one chunk's own pairs (here they are equal)."""
    layout = ChunkLayout(16 * size, size)
    held = [layout.held(r) for r in range(size)]
    assert torch.equal(torch.sort(torch.cat(held)).values, torch.arange(16 * size))
    work = [int((h + 1).sum()) for h in held]  # query t attends to t + 1 keys
    c = layout.chunk
    assert max(work) - min(work) < c * (c + 1) // 2
    assert max(work) == min(work)


@pytest.mark.parametrize("size, reach", [(2, 3), (2, 5), (4, 3), (4, 1), (4, 10), (4, None), (3, 7)])
def test_an_exchange_gives_each_rank_what_it_reaches_and_nothing_else(size, reach):
    """For every rank, the tokens it sees are its own and exactly the `reach` tokens before each of
    its chunks (all earlier ones for None); what ranks send each other matches what they receive."""
    layout = ChunkLayout(8 * size, size)
    plans = [exchange(layout, r, reach) for r in range(size)]
    c = layout.chunk
    for r, plan in enumerate(plans):
        want = set(layout.held(r).tolist())
        for j in layout.chunks(r):
            want |= set(range(0 if reach is None else max(0, j * c - reach), j * c))
        assert plan.seen.tolist() == sorted(want)
        for other, size_sent in enumerate(plan.send_sizes):
            assert size_sent == plans[other].recv_sizes[r]
        for queries, keys in plan.spans:  # keys run from the reach's start to the chunk's end
            first = int(layout.held(r)[queries.start])
            assert int(plan.seen[keys.stop - 1]) == first + c - 1
            assert int(plan.seen[keys.start]) == (0 if reach is None else max(0, first - reach))


def test_a_cut_that_does_not_fit_names_the_key_and_the_valid_degrees():
    check_cut(64, 4)
    valid = "valid degrees for 60: 1, 2, 3, 5, 6, 10, 15, 30;"
    with pytest.raises(ConfigError, match=rf"parallel\.context_parallel.*8 equal chunks.*60 tokens.*{valid}"):
        check_cut(60, 4)


SEQ = 48  # 4 ranks: chunks of 6 tokens


def _rows(dtype):
    """Two rows: one document; packed documents of 7, 13, 2, 20 and 6 tokens (edges cross chunks)."""
    g = torch.Generator().manual_seed(0)
    segments = torch.stack(
        [torch.zeros(SEQ, dtype=torch.long), torch.repeat_interleave(torch.arange(5), torch.tensor([7, 13, 2, 20, 6]))]
    )
    q = torch.randn(2, 4, SEQ, 8, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(2, 2, SEQ, 8, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(2, 2, SEQ, 8, generator=g, dtype=torch.float64).to(dtype)
    x = torch.randn(2, SEQ, 5, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(2, 4, SEQ, 8, generator=g, dtype=torch.float64)
    return segments, q, k, v, x, w


def _whole_row(dtype, window):
    segments, q, k, v, x, w = _rows(dtype)
    doc, pos = doc_ids_and_positions(segments)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(doc, pos, doc, pos, window), enable_gqa=True)
    (y.double() * w).sum().backward()
    return y.detach(), q.grad, k.grad, v.grad


class _Attention(ContextParallelAttention, Attention):
    """The reference's per-chunk attention (SDPA) under context parallel, without weights."""

    def __init__(self, window):
        nn.Module.__init__(self)
        self.window, self.is_global = window, window is None


class _KernelAttention(ContextParallelAttention, FusedAttention):
    """The same through the CPU attention kernel."""

    __init__ = _Attention.__init__


class _SConv(ContextParallelSConv, FusedSConv):  # the kernel, which the reference is tested equal to
    pass


def _ranks(rank: int, size: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        layout = ChunkLayout(SEQ, size)
        held = layout.held(rank)
        for dtype in (torch.float32, torch.bfloat16):
            segments, q, k, v, x, w = _rows(dtype)
            doc, pos = doc_ids_and_positions(segments)
            where = dict(layout=layout, rank=rank, group=dist.group.WORLD, row_doc=doc, row_pos=pos)
            ctx = ContextParallelContext(doc[:, held], pos[:, held], window=None, **where)
            for window in (None, 4, 6, 11):  # global; windows shorter than, as long as and longer than a chunk
                mine = [t[:, :, held].clone().requires_grad_() for t in (q, k, v)]
                y = _Attention(window).attend(*mine, ctx, None)
                (y.double() * w[:, :, held]).sum().backward()
                results[("attention", size, str(dtype), window, rank)] = (y.detach(), *(t.grad for t in mine))
                # The first row alone, one document: the banded mask of one-document rows.
                one = ContextParallelContext(doc[:1, held], pos[:1, held], window=None, **where, packed=False)
                one.row_doc, one.row_pos = doc[:1], pos[:1]
                mine = [t[:1, :, held].clone().requires_grad_() for t in (q, k, v)]
                y = _Attention(window).attend(*mine, one, None)
                (y.double() * w[:1, :, held]).sum().backward()
                results[("one-document", size, str(dtype), window, rank)] = (y.detach(), *(t.grad for t in mine))
                mine = [t[:, :, held].clone().requires_grad_() for t in (q, k, v)]  # through the kernel
                y = _KernelAttention(window).attend(*mine, ctx, None)
                (y.double() * w[:, :, held]).sum().backward()
                results[("kernel", size, str(dtype), window, rank)] = (y.detach(), *(t.grad for t in mine))
            torch.manual_seed(0)
            conv = _SConv(5, 4).to(dtype)
            with torch.no_grad():
                conv.weight.normal_()
            x_mine = x[:, held].clone().requires_grad_()
            y, _ = conv(x_mine, ctx)
            (y.double() * w[:, 0, held, :5]).sum().backward()
            results[("sconv", size, str(dtype), rank)] = (y.detach(), x_mine.grad, conv.weight.grad)
        results[("peak", size, rank)] = _activation_peak(_memory_config(), size)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict:
    results = mp.Manager().dict()
    for size in (2, 4):
        store = tmp_path_factory.mktemp(f"cp{size}") / "store"
        spawn_ranks(_ranks, (size, str(store), results), size)
    return dict(results)


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 4, 6, 11], ids=["global", "window-4", "window-6", "window-11"])
@pytest.mark.parametrize("size", [2, 4])
def test_attention_on_a_ranks_chunks_is_attention_on_the_whole_row(collected, size, window, dtype):
    """Values and the gradients of queries, keys and values, each rank's tokens against the same
    tokens of one SDPA over the whole row, with packed documents crossing chunk edges; for a row
    of one document alone (its mask a band, not compared ids); and through the CPU kernel."""
    whole = _whole_row(dtype, window)
    layout = ChunkLayout(SEQ, size)
    for rank in range(size):
        held = layout.held(rank)
        got = collected[("attention", size, str(dtype), window, rank)]
        for name, a, b in zip(("values", "dq", "dk", "dv"), got, whole):
            torch.testing.assert_close(a.float(), b[:, :, held].float(), **TOLERANCE[dtype], msg=name)
        got = collected[("one-document", size, str(dtype), window, rank)]  # the first row alone
        for name, a, b in zip(("values", "dq", "dk", "dv"), got, whole):
            torch.testing.assert_close(a.float(), b[:1, :, held].float(), **TOLERANCE[dtype], msg=name)
        got = collected[("kernel", size, str(dtype), window, rank)]  # the CPU attention kernel per chunk
        for name, a, b in zip(("values", "dq", "dk", "dv"), got, whole):
            torch.testing.assert_close(a.float(), b[:, :, held].float(), **TOLERANCE[dtype], msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("size", [2, 4])
def test_sconv_on_a_ranks_chunks_reads_the_inputs_before_them(collected, size, dtype):
    """SConv (kernel 4) on each rank's chunks, with the 3 inputs before each chunk from their ranks
    and taps stopped at document edges, equals the convolution of the whole row (values, input
    gradients, and the weight gradient summed over the ranks)."""
    segments, _, _, _, x, w = _rows(dtype)
    doc, _ = doc_ids_and_positions(segments)
    torch.manual_seed(0)
    conv = SConv(5, 4).to(dtype)
    with torch.no_grad():
        conv.weight.normal_()
    x = x.clone().requires_grad_()
    y = conv.convolve(x, sconv_keep_masks(doc, 4))
    (y.double() * w[:, 0, :, :5]).sum().backward()
    layout = ChunkLayout(SEQ, size)
    weight_grad = 0
    for rank in range(size):
        held = layout.held(rank)
        y_mine, dx, dw = collected[("sconv", size, str(dtype), rank)]
        torch.testing.assert_close(y_mine.float(), y[:, held].detach().float(), **TOLERANCE[dtype])
        torch.testing.assert_close(dx.float(), x.grad[:, held].float(), **TOLERANCE[dtype])
        weight_grad = weight_grad + dw.float()
    torch.testing.assert_close(weight_grad, conv.weight.grad.float(), **TOLERANCE[dtype])


MEMORY_SEQ = 512


def _memory_config():
    from marinlm.config import load_config
    from marinlm.model.config import MarinConfig

    config = load_config(MarinConfig, str(ROOT / "configs" / "model" / "tiny.yaml"), [])
    config.moe.capacity_factor, config.max_seq_len = None, MEMORY_SEQ
    return config


def _activation_peak(config, size: int) -> float:
    """MemTracker's activation peak of one forward and backward of a row of MEMORY_SEQ tokens, in
    one process (`size` 1) or on this rank of `size` gloo processes under context parallel."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh

    from marinlm.model import MarinForCausalLM
    from marinlm.parallel.context_parallel import apply_context_parallel
    from marinlm.plan.op_table import packed_segments

    with torch.device("meta"):
        model = MarinForCausalLM(config)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    if size > 1:
        apply_context_parallel(model, init_device_mesh("cpu", (size,), mesh_dim_names=("cp",)))
    ids = torch.randint(0, config.vocab_size, (1, MEMORY_SEQ), generator=torch.Generator().manual_seed(0))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:  # packed documents, as a training step passes them
        model(ids, packed_segments(1, MEMORY_SEQ), labels=ids, return_logits=False).loss.backward()
    peaks = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return next(v for k, v in peaks.items() if "ACT" in str(k))


@pytest.mark.distributed
def test_a_cp_rank_holds_a_1_over_n_share_of_the_activations_and_the_plan_predicts_it(collected):
    """The `tiny` model on a row of 512 tokens: MemTracker's activation peak on each rank of CP 2
    and CP 4 (gloo) is at most one process's / N plus the halo the plan counts (gathered keys and
    values, masks, SConv inputs), and the plan's estimate is within 5% of the busiest rank's."""
    from marinlm.model import MarinForCausalLM
    from marinlm.plan.activations import activation_bytes, inventory

    config = _memory_config()
    one = _activation_peak(config, 1)
    with torch.device("meta"):
        weights = sum(p.numel() for p in MarinForCausalLM(config).parameters() if p.ndim >= 2)
    inv = inventory(config, "fp32", KernelConfig(modules="reference"))
    for size in (2, 4):
        plan = activation_bytes(inv, config, MEMORY_SEQ // size, MEMORY_SEQ, weights=weights, cp=size)
        busiest = max(collected[("peak", size, r)] for r in range(size))
        assert busiest <= one / size + plan["context_halo"] + plan["masks"], size
        assert sum(plan.values()) == pytest.approx(busiest, rel=0.05), size
