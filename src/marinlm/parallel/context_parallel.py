"""Context parallelism over the `cp` mesh axis: each row's sequence split across N ranks.

Shape legend: B batch, T tokens a rank holds, S tokens it sees (its own and those it received),
H query heads, K KV heads, Dh head dim, C channels.

A row of L tokens is cut into 2N chunks of L/2N; rank r holds chunks r and 2N−1−r, in that order
(head–tail, as torchtitan and Megatron-Core cut for causal masks). Under a causal mask chunk j
attends to j + 1 chunks of keys, so each rank's pair attends to (r + 1) + (2N − r) = 2N + 1
chunks: the same work on every rank.

Every operation that mixes tokens reads, from the other ranks, the tokens it can reach and no
more, through one exchange (`Exchange`): for a reach h, each rank needs the h tokens before each
of its chunks that it does not hold, and the ranks holding them send them in one
`all_to_all_single`, whose backward returns the gradients the same way.

- global attention reaches every earlier token: each rank receives the keys and values before
  its chunks (an all-gather of K/V that skips what causality never reads), then attends chunk by
  chunk to the keys up to the chunk's end;
- local (sliding-window) attention reaches `window − 1` tokens: a halo from the neighbours;
- SConv reaches `kernel − 1` inputs.

Masks come from each token's document id and position inside its document (model/context.py),
computed on the whole row and carried with the tokens, so the causal, window and document rules
hold across chunk edges whatever order the keys arrive in; XSA and the head gate act on a rank's
own tokens as on one process. The losses of each rank's tokens are summed over the cp ranks, so
every rank reports the row's mean; FSDP2 averages gradients over dp_shard × cp.

Gather, not ring: the keys and values are small beside the queries (grouped-query attention), so
one exchange moves as many bytes as a ring's N − 1 steps, in one collective, and needs no
online-softmax merge of partial results: each chunk differentiates through the attention's own
backward, with one mask a chunk for documents and windows. `bench/context_parallel.py` times a
ring with its own backward against it (docs/distributed.md, "Context parallel", weighs the two,
also at the hero's 262,144 tokens).
torch's `context_parallel` wraps SDPA alone; the hero's document masks, windows, XSA and SConv are
outside what it knows, so this is our own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from marinlm.config import ConfigError
from marinlm.model.attention import Attention
from marinlm.model.context import ForwardContext, attention_mask, sconv_keep_masks
from marinlm.model.layers import SConv, doc_ids_and_positions
from marinlm.parallel.tensor_parallel import _waited


def check_cut(seq_len: int, size: int) -> None:
    """Raise ConfigError where rows of `seq_len` tokens cannot be cut into 2 x `size` equal chunks."""
    if seq_len % (2 * size):
        valid = [n for n in range(1, seq_len // 2 + 1) if seq_len % (2 * n) == 0][:12]
        raise ConfigError(
            "parallel.context_parallel",
            f"{size} cuts each row into {2 * size} equal chunks, but rows hold {seq_len} tokens "
            f"(data.seq_len); valid degrees for {seq_len}: {', '.join(map(str, valid))}; rows are not padded",
        )


@dataclass(frozen=True)
class ChunkLayout:
    """Where a row's tokens live: `seq_len` tokens cut into 2 x `size` chunks, head-tail."""

    seq_len: int
    size: int

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.size)

    def chunks(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.size - 1 - rank

    def owner(self, index: torch.Tensor) -> torch.Tensor:
        j = index // self.chunk
        return torch.minimum(j, 2 * self.size - 1 - j)

    def held(self, rank: int) -> torch.Tensor:
        """The row positions `rank` holds, in its order (increasing)."""
        c = self.chunk
        return torch.cat([torch.arange(j * c, (j + 1) * c) for j in self.chunks(rank)])

    def local_index(self, rank: int, index: torch.Tensor) -> torch.Tensor:
        """Where row positions held by `rank` sit in its tokens."""
        c = self.chunk
        j = index // c
        return torch.where(j == rank, index - rank * c, c + index - j * c)

    def before(self, rank: int, reach: int | None) -> torch.Tensor:
        """Row positions `rank` needs and does not hold: up to `reach` before each of its chunks (None: all)."""
        c = self.chunk
        starts = [j * c for j in self.chunks(rank)]
        wanted = torch.cat([torch.arange(0 if reach is None else max(0, s - reach), s) for s in starts])
        wanted = torch.unique(wanted)
        return wanted[self.owner(wanted) != rank]


@dataclass(frozen=True)
class Exchange:
    """One rank's part in an exchange of reach h (see the module docstring)."""

    send_index: torch.Tensor  # local positions to send, grouped by receiving rank
    send_sizes: list[int]
    recv_sizes: list[int]
    order: torch.Tensor  # sorts [own tokens, received tokens] by row position
    seen: torch.Tensor  # the row position of each of the S tokens after sorting
    own: torch.Tensor  # where each own token sits among the S
    spans: list[tuple[slice, slice]]  # per own chunk: its queries (local), the keys it reaches (of S)


@functools.lru_cache(maxsize=64)
def exchange(layout: ChunkLayout, rank: int, reach: int | None) -> Exchange:
    send, send_sizes, received, recv_sizes = [], [], [], []
    for other in range(layout.size):
        theirs = layout.before(other, reach)
        mine = theirs[layout.owner(theirs) == rank]
        send.append(layout.local_index(rank, mine))
        send_sizes.append(len(mine))
        mine_from_them = layout.before(rank, reach)
        got = mine_from_them[layout.owner(mine_from_them) == other]
        received.append(got)
        recv_sizes.append(len(got))
    positions = torch.cat([layout.held(rank), *received])
    seen, order = torch.sort(positions)
    own = torch.searchsorted(seen, layout.held(rank))
    spans = []
    c = layout.chunk
    for k, j in enumerate(layout.chunks(rank)):
        lo = 0 if reach is None else max(0, j * c - reach)
        keys = slice(int(torch.searchsorted(seen, lo)), int(torch.searchsorted(seen, (j + 1) * c)))
        spans.append((slice(k * c, (k + 1) * c), keys))
    return Exchange(torch.cat(send), send_sizes, recv_sizes, order, seen, own, spans)


@dataclass(frozen=True)
class Reach:
    """What an exchange of one reach costs the busiest rank (the one receiving most): tokens it
    receives a row, and the keys its two chunks attend to, summed over its queries (mask and
    score elements a row)."""

    received: int
    seen: int  # own and received tokens: the gathered tensor's length
    pairs: int


def reach_cost(seq_len: int, size: int, reach: int | None) -> Reach:
    """The busiest rank's `Reach` for rows of `seq_len` over `size` cp ranks (`marinlm plan`)."""
    layout = ChunkLayout(seq_len, size)
    plans = [exchange(layout, r, reach) for r in range(size)]
    busiest = max(plans, key=lambda p: sum(p.recv_sizes))
    pairs = max(sum((q.stop - q.start) * (k.stop - k.start) for q, k in p.spans) for p in plans)
    return Reach(sum(busiest.recv_sizes), len(busiest.seen), pairs)


def gather_reach(x_BT_: torch.Tensor, plan: Exchange, group) -> torch.Tensor:
    """`x` [B, T, ...] of this rank's tokens, with the tokens it reaches from other ranks: [B, S, ...]
    in row order. Differentiable: backward sends each received token's gradient to its owner."""
    send_TB_ = x_BT_[:, plan.send_index].transpose(0, 1).contiguous()
    recv_TB_ = _waited(funcol.all_to_all_single_autograd(send_TB_, plan.recv_sizes, plan.send_sizes, group))
    return torch.cat([x_BT_, recv_TB_.transpose(0, 1)], dim=1)[:, plan.order]


class ContextParallelContext(ForwardContext):
    """The forward context of a rank's tokens, with the whole row's document ids and positions
    and the cp group, for the exchanges."""

    def __init__(self, doc_BT, pos_BT, *, window, layout: ChunkLayout, rank: int, group, row_doc, row_pos, packed=True):
        super().__init__(doc_BT, pos_BT, packed=packed, decoding=False, derived=False, window=window)
        self.layout, self.rank, self.group = layout, rank, group
        self.row_doc, self.row_pos = row_doc, row_pos

    def plan(self, reach: int | None) -> Exchange:
        return exchange(self.layout, self.rank, reach)

    def gather(self, x_BT_: torch.Tensor, reach: int | None) -> tuple[torch.Tensor, Exchange]:
        plan = self.plan(reach)
        return gather_reach(x_BT_, plan, self.group), plan

    def seen_ids(self, plan: Exchange) -> tuple[torch.Tensor, torch.Tensor]:
        """Document ids and positions [B, S] of the tokens an exchange gives this rank."""
        index = plan.seen.to(self.row_doc.device)
        return self.row_doc[:, index], self.row_pos[:, index]


class ContextParallelAttention:
    """Mixed into an `Attention` (or its kernel): attention over the keys each chunk reaches."""

    def layer_mask(self, ctx):
        return None  # built per chunk in `attend`

    def attend(self, q_BHTD, k_BKTD, v_BKTD, ctx: ContextParallelContext, mask) -> torch.Tensor:
        reach = None if self.window is None else self.window - 1
        kv_BT2KD = torch.stack([k_BKTD.transpose(1, 2), v_BKTD.transpose(1, 2)], dim=2)  # one exchange for both
        kv_BS2KD, plan = ctx.gather(kv_BT2KD, reach)
        k_BKSD, v_BKSD = kv_BS2KD[:, :, 0].transpose(1, 2), kv_BS2KD[:, :, 1].transpose(1, 2)
        doc_BS, pos_BS = ctx.seen_ids(plan)
        outs = []
        for j, (queries, keys) in enumerate(plan.spans):  # each chunk against the keys it reaches
            T, S = queries.stop - queries.start, keys.stop - keys.start
            if not ctx.packed and self.window is None and int(plan.own[queries.start]) - keys.start == S - T:
                # One document, every key up to the chunk's end: no mask to build or apply.
                outs.append(self.attend_causal_tail(q_BHTD[:, :, queries], k_BKSD[:, :, keys], v_BKSD[:, :, keys]))
                continue
            allowed = ctx.memo(  # one mask a chunk for all the layers of a kind
                ("cp_mask", self.window, j),
                lambda q=queries, k=keys: (
                    attention_mask(ctx.doc_BT[:, q], ctx.pos_BT[:, q], doc_BS[:, k], pos_BS[:, k], self.window)
                    if ctx.packed
                    else band_mask(q, k, plan, self.window, q_BHTD.device)
                ),
            )
            # The attention of the module's own class (the reference's SDPA, or a kernel's) on the chunk.
            view = _ChunkView(ctx, j)
            outs.append(super().attend(q_BHTD[:, :, queries], k_BKSD[:, :, keys], v_BKSD[:, :, keys], view, allowed))
        return torch.cat(outs, dim=2)


class _ChunkView:
    """The forward context as one chunk's attention sees it: what a kernel memoises (a mask's
    bias, say) is kept per chunk, shared by the layers of a kind."""

    decoding = False

    def __init__(self, ctx: ForwardContext, chunk: int):
        self.ctx, self.chunk = ctx, chunk

    def memo(self, key, build):
        return self.ctx.memo(("cp_chunk", self.chunk, key), build)


def band_mask(queries: slice, keys: slice, plan: Exchange, window: int | None, device) -> torch.Tensor:
    """The [1, 1, T, S] mask of a chunk of one-document rows: its keys are the row positions
    seen[keys], contiguous, so query i sees key m iff 0 <= i + offset - m < window (one `tril`
    where the general rule would compare T x S document ids and positions)."""
    offset = int(plan.own[queries.start]) - keys.start  # the first query's place among the keys
    allowed = torch.ones(queries.stop - queries.start, keys.stop - keys.start, dtype=torch.bool, device=device)
    allowed = allowed.tril(offset)
    if window is not None:
        allowed &= torch.ones_like(allowed).triu(offset - window + 1)
    return allowed[None, None]


class ContextParallelSConv:
    """Mixed into an `SConv` (or its kernel): the inputs before each chunk come from their ranks."""

    def forward(self, x_BTC, ctx, state=None):
        if state is not None or not isinstance(ctx, ContextParallelContext):
            return super().forward(x_BTC, ctx, state)
        x_BSC, plan = ctx.gather(x_BTC, self.kernel_size - 1)
        keep = None
        if ctx.packed:  # taps stop at document edges (one document a row: none to stop at)
            keep = ctx.memo(
                ("cp_sconv_keep", self.kernel_size), lambda: sconv_keep_masks(ctx.seen_ids(plan)[0], self.kernel_size)
            )
        y_BSC = self.convolve(x_BSC, keep)
        return y_BSC[:, plan.own.to(y_BSC.device)], None


class _RowCut:
    """What the model and its pipeline stages share: this rank's place on the cp axis, and the
    context of a forward's rows cut into its chunks."""

    cp_group = None
    cp_rank, cp_size = 0, 1
    _cp_context = None

    def _cut_rows(self, segment_ids, B: int, L: int, device) -> tuple[ChunkLayout, torch.Tensor]:
        """Set this forward's context from the whole rows' segment ids (None: one document a
        row); return the cut and the row positions this rank holds."""
        check_cut(L, self.cp_size)
        layout = ChunkLayout(L, self.cp_size)
        if segment_ids is None:
            row_doc = torch.zeros(B, L, dtype=torch.long, device=device)
            row_pos = torch.arange(L, device=device).expand(B, L)
        else:
            row_doc, row_pos = doc_ids_and_positions(segment_ids)
        held = layout.held(self.cp_rank).to(device)
        where = dict(layout=layout, rank=self.cp_rank, group=self.cp_group, row_doc=row_doc, row_pos=row_pos)
        where["packed"] = segment_ids is not None
        window = self.config.attention.sliding_window
        self._cp_context = ContextParallelContext(row_doc[:, held], row_pos[:, held], window=window, **where)
        return layout, held

    def context(self, input_ids, segment_ids, caches, doc_ids, positions) -> ForwardContext:
        return self._cp_context


def rows_in_order(x_BT: torch.Tensor, layout: ChunkLayout, group) -> torch.Tensor:
    """Every cp rank's [B, T] values of its chunks (no gradient), as [B, L] in row order."""
    gathered_BL = _waited(funcol.all_gather_single(x_BT.detach().contiguous(), gather_dim=1, group=group))
    order = torch.cat([layout.held(r) for r in range(layout.size)]).to(gathered_BL.device)
    return torch.empty_like(gathered_BL).index_copy_(1, order, gathered_BL)


class ContextParallelModel(_RowCut):
    """Mixed into the `MarinForCausalLM`: takes whole rows, runs this rank's chunks, and returns
    the row's loss (and per-token losses for scoring) as one process would."""

    def forward(self, input_ids, segment_ids=None, labels=None, *, return_logits=True, logits_to_keep=0, **decoding):
        if any(v is not None for v in decoding.values()) or logits_to_keep:
            raise ValueError(
                "parallel.context_parallel: decoding and logits_to_keep need whole rows on one rank; "
                "load the model without context parallel to generate"
            )
        B, L = input_ids.shape
        layout, held = self._cut_rows(segment_ids, B, L, input_ids.device)
        try:
            mine = None if labels is None else labels[:, held]
            out = super().forward(input_ids[:, held], None, mine, return_logits=return_logits)
        finally:
            self._cp_context = None
        if labels is None:
            return out
        return self._row_loss(out, layout)

    def _row_loss(self, out, layout: ChunkLayout):
        """The row's losses from each rank's token means: sums and counts over the cp ranks.

        Each rank's loss reads as the row's mean, and backpropagates cp x its own tokens' share
        of it: FSDP2 averages gradients over the cp ranks, and the average of those is the
        gradient of the row's mean (the house's "value + (other - value).detach()" split)."""
        group, size = self.cp_group, self.cp_size
        count = out.num_tokens if torch.is_tensor(out.num_tokens) else torch.tensor(float(out.num_tokens))
        count = count.to(out.lm_loss.dtype)
        parts = torch.stack([out.lm_loss.detach(), out.ce_loss.detach(), out.z_loss.detach(), count.new_ones(())])
        sums = _waited(funcol.all_reduce(torch.cat([parts[:3] * count, parts[3:] * count]), "sum", group))
        total = sums[3].clamp_min(1)
        mine = out.lm_loss * count * size / total
        out.lm_loss = mine + (sums[0] / total - mine).detach()
        out.ce_loss, out.z_loss = sums[1] / total, sums[2] / total
        aux_mean = _waited(funcol.all_reduce(out.aux_loss.detach(), "sum", group)) / size
        out.aux_loss = out.aux_loss + (aux_mean - out.aux_loss).detach()
        out.loss, out.num_tokens = out.lm_loss + out.aux_loss, sums[3]
        if out.token_ce is not None:  # every rank's tokens, back in row order
            out.token_ce = rows_in_order(out.token_ce, layout, group)
        out.logits = None  # each rank's would cover its chunks only
        return out


class ContextParallelStage(_RowCut):
    """Mixed into a pipeline `StageModel`: the first stage cuts the token ids, every stage builds
    the context of its chunks from the whole rows' segment ids, which travel between stages."""

    def forward(self, x, segment_ids):
        B, L = segment_ids.shape
        _, held = self._cut_rows(segment_ids, B, L, segment_ids.device)
        try:
            return super().forward(x[:, held] if self.embed is not None else x, segment_ids)
        finally:
            self._cp_context = None


_CLASSES: dict[tuple[type, type], type] = {}


def _mixed(mixin: type, cls: type) -> type:
    if issubclass(cls, mixin):
        return cls
    if (mixin, cls) not in _CLASSES:
        _CLASSES[(mixin, cls)] = type(f"ContextParallel{cls.__name__}", (mixin, cls), {})
    return _CLASSES[(mixin, cls)]


def apply_context_parallel(model: nn.Module, cp_mesh, *, stage: bool = False) -> None:
    """Make `model` (a MarinForCausalLM, or with `stage` a pipeline stage of one, on meta or
    initialised) take whole rows and compute on this rank's chunks of them over the 1-D `cp_mesh`,
    in place."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.__class__ = _mixed(ContextParallelAttention, type(module))
        elif isinstance(module, SConv):
            module.__class__ = _mixed(ContextParallelSConv, type(module))
    mixin = ContextParallelStage if stage else ContextParallelModel
    model.__class__ = _mixed(mixin, type(model))
    model.cp_group = cp_mesh.get_group()
    model.cp_rank, model.cp_size = cp_mesh.get_local_rank(), cp_mesh.size()
