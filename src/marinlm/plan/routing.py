"""What the router's imbalance costs a step, under the capacity rule the model applies.

A routing histogram is each MoE layer's share of assignments by expert: read off a run's logged
loads, one histogram a logged step (`marinlm train` writes `router/layer_i/load`, counted before
capacity drops, to TensorBoard; the skew moves from step to step, and a sum over steps would
smooth it away), or a stated skew (`skew=S`: shares falling as rank^-S, placed on the experts in
a seeded random order; `balanced` is S = 0). For each layer, a forward's counts are drawn (per
sender shard under `receiver_pooled`, over the expert group under `per_expert`): from each logged
step without replacement, so that a forward the size of the logged step gets the step's own
counts back; from a stated skew multinomially, `DRAWS` times. They are cut by the model's own
rule (`group_capacity`, `pooled_accept`), which gives:

- the share of assignments dropped;
- the rows that cross the all-to-all: under `receiver_pooled` only kept rows travel; under
  `per_expert` every row travels and the receiver drops (its zero rows still come back);
- the slowest receiver: the expert-parallel rank whose experts keep the most rows of a forward
  (`ep/kept_rows_max_over_mean` in a run's metrics). Every rank waits for it at the combine, so a
  layer's expert GEMMs take its rows, not the mean rank's.

The draws split a step's assignments at random: where an expert group routes a part of the step's
rows, a row's tokens routing alike make it drop more and its busiest rank fuller than this says.
Without a histogram the plan keeps balanced load and no drops (`expert_rows`).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from marinlm.config import ConfigError

DRAWS = 4  # forwards drawn a layer from a stated skew


@dataclass(frozen=True)
class RoutingLoads:
    shares: np.ndarray  # [MoE layers, histograms (a logged step each), E], each [l, s] sums to 1
    source: str
    counts: np.ndarray | None = None  # the logged steps' assignments, int64 like `shares`; None: stated


@dataclass(frozen=True)
class Routed:
    """A forward's routing, averaged over layers and draws."""

    dropped: float  # share of assignments the capacity rule drops
    worst_layer: float  # the layer dropping the largest share
    slowest: float  # the busiest expert-parallel rank's kept rows over the mean rank's (1: one rank)
    travels: float  # share of assignments whose rows cross the all-to-all (kept ones under receiver_pooled)
    source: str

    def to_json(self) -> dict:
        return asdict(self)


def stated_skew(num_experts: int, exponent: float, seed: int = 0) -> RoutingLoads:
    """Shares falling as (rank + 1)^-exponent, placed on the experts in a random order (`seed`)."""
    shares = np.arange(1, num_experts + 1, dtype=np.float64) ** -exponent
    shares = np.random.default_rng(seed).permutation(shares / shares.sum())
    what = "balanced" if exponent == 0 else f"stated skew {exponent:g} (shares ~ rank^-{exponent:g}, seed {seed})"
    return RoutingLoads(shares[None, None, :], what)


def logged_loads(run_dir: Path, num_experts: int, last: int = 20) -> RoutingLoads:
    """Each MoE layer's loads of each of the last `last` steps a run logged to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import HISTOGRAMS, EventAccumulator

    folder = Path(run_dir) / "tensorboard"
    if not Path(run_dir).is_dir():
        raise ConfigError("--routing", f"{run_dir}: not a folder; give a run folder `marinlm train` wrote, or skew=S")
    if not folder.is_dir():
        raise ConfigError("--routing", f"{run_dir}: no tensorboard/ in it, so not a run folder `marinlm train` wrote")
    events = EventAccumulator(str(folder), size_guidance={HISTOGRAMS: 0})
    events.Reload()
    tags = [t for t in events.Tags()[HISTOGRAMS] if re.fullmatch(r"router/layer_\d+/load", t)]
    if not tags:
        raise ConfigError("--routing", f"{folder}: no router/layer_i/load histograms (a dense model, or no step yet)")
    layers = []
    for tag in sorted(tags, key=lambda t: int(t.split("_")[1].split("/")[0])):
        steps = []
        for event in events.Histograms(tag)[-last:]:
            counts = np.asarray(event.histogram_value.bucket, dtype=np.float64)
            if len(counts) != num_experts or counts.sum() <= 0:
                raise ConfigError(
                    "--routing",
                    f"{folder}: {tag} at step {event.step} holds {len(counts)} experts' loads, {counts.sum():g} "
                    f"assignments; the model has {num_experts} experts",
                )
            steps.append(counts)
        layers.append(steps)
    if len({len(steps) for steps in layers}) > 1:
        raise ConfigError("--routing", f"{folder}: its layers logged different numbers of steps' loads")
    counts = np.rint(np.array(layers)).astype(np.int64)
    source = f"{run_dir}: {len(layers)} MoE layers' loads at each of its last {len(layers[0])} logged steps"
    return RoutingLoads(counts / counts.sum(-1, keepdims=True), source, counts)


def parse_routing(text: str | None, num_experts: int) -> RoutingLoads | None:
    """`--routing`: `balanced`, `skew=S` (S >= 0) or a run's folder; None: not given."""
    if text is None:
        return None
    if text == "balanced":
        return stated_skew(num_experts, 0.0)
    if text.startswith("skew="):
        try:
            exponent = float(text[5:])
        except ValueError:
            exponent = -1.0
        if not exponent >= 0:
            raise ConfigError("--routing", f"{text!r}: give skew=S with S a number >= 0 (0 is balanced)")
        return stated_skew(num_experts, exponent)
    return logged_loads(Path(text), num_experts)


def route(moe, loads: RoutingLoads, tokens: int, dims, seed: int = 0) -> Routed:
    """Drops, travelling rows and the slowest receiver for a forward of `tokens` tokens a data rank."""
    import torch

    from marinlm.model.experts import pooled_accept
    from marinlm.parallel.expert_parallel import group_capacity

    rng = np.random.default_rng(seed)
    E, k = moe.num_experts, moe.top_k
    group = dims.ep * tokens * k  # assignments an expert group's ranks send a forward
    pooled = moe.capacity_factor is not None and moe.capacity == "receiver_pooled"
    if pooled:
        G, S = moe.capacity_groups, moe.capacity_groups * moe.capacity_domains
        shard, _ = _pooled_receiver(moe, tokens * k, dims)
    cap = math.inf if moe.capacity_factor is None else group_capacity(moe.capacity_factor, group, E)
    layers, slowest = [], []
    for layer in range(loads.shares.shape[0]):
        dropped, draws = 0.0, DRAWS if loads.counts is None else loads.shares.shape[1]  # each logged step once
        for draw in range(draws):
            if pooled:
                counts_SE = _forward_counts(rng, loads, layer, draw, shard, S)
                kept_SE = pooled_accept(torch.from_numpy(counts_SE), G, moe.capacity_chunks, moe.capacity_factor, shard)
                kept_SE = kept_SE.double().numpy()
                # the expert group's ranks send ep / dp of the forward's shards (any of them: drawn alike)
                received = kept_SE[: max(round(S * dims.ep / dims.dp), 1)].sum(0)
                kept, total = kept_SE.sum(), counts_SE.sum()
            else:
                counts_E = _forward_counts(rng, loads, layer, draw, group, 1)[0]
                received = np.minimum(counts_E, cap).astype(np.float64)
                kept, total = received.sum(), group
            dropped += 1 - kept / total
            per_rank = received.reshape(dims.ep, -1).sum(1)
            slowest.append(per_rank.max() / max(per_rank.mean(), 1e-9))
        layers.append(dropped / draws)
    mean_dropped = float(np.mean(layers))
    return Routed(
        dropped=mean_dropped,
        worst_layer=float(max(layers)),
        slowest=float(np.mean(slowest)),
        travels=1 - mean_dropped if pooled else 1.0,
        source=loads.source,
    )


def _forward_counts(rng, loads: RoutingLoads, layer: int, draw: int, need: int, shards: int) -> np.ndarray:
    """[shards, E] assignment counts of a forward, `need` a shard: from a stated skew, drawn
    (multinomial); from logged steps, drawn without replacement from one step's assignments, or
    from it and the steps after it pooled when the forward is larger, so that a forward the size of
    the logged one gets back exactly the logged counts."""
    if loads.counts is None:
        return rng.multinomial(need, loads.shares[layer, 0], size=shards)
    steps = loads.counts[layer]
    pool, after = steps[draw % len(steps)].copy(), draw
    while pool.sum() < need * shards:
        after += 1
        pool += steps[after % len(steps)]
    out = np.empty((shards, pool.shape[0]), dtype=np.int64)
    for s in range(shards):
        out[s] = rng.multivariate_hypergeometric(pool, need)
        pool -= out[s]
    return out


def routing_note(routed: Routed, ep: int) -> str:
    receiver = f"; the slowest of {ep} expert ranks keeps {routed.slowest:.3f}x the mean rank's rows" if ep > 1 else ""
    whose = "the slowest receiver's kept rows" if ep > 1 else "the kept rows"
    return (
        f"routing ({routed.source}): {100 * routed.dropped:.3f}% of assignments dropped a forward (worst layer "
        f"{100 * routed.worst_layer:.3f}%){receiver}; the experts' GEMMs priced at {whose}"
    )


def capacity_notes(moe, tokens: int, dims) -> list[str]:
    """What the capacity rule keeps on this layout, and whether the rule can run on it."""
    if moe.capacity_factor is None or moe.capacity != "receiver_pooled":
        return []
    G, shards = moe.capacity_groups, moe.capacity_groups * moe.capacity_domains
    shard, chunk = _pooled_receiver(moe, tokens * moe.top_k, dims)
    notes = [
        f"capacity (receiver_pooled, factor {moe.capacity_factor}): {shards} sender shards of {shard:,} "
        f"assignments a layer; each of a domain's {G} receivers keeps up to {moe.capacity_chunks} x {chunk:,} "
        f"rows ({moe.num_experts // G} experts), dropping once its load passes {moe.capacity_factor}x its fair share"
    ]
    if shards % dims.dp:
        notes.append(
            f"to train on this layout, set model.moe.capacity_domains so that {G} x domains is a multiple of the "
            f"{dims.dp} data-parallel ranks (each rank holds whole sender shards)"
        )
    return notes


def _pooled_receiver(moe, sent: int, dims) -> tuple[int, int]:
    """Under receiver_pooled, with each data rank sending `sent` assignments a forward: a sender
    shard's assignments, and the rows a chunk of a receiver keeps at balanced load."""
    from marinlm.model.experts import pooled_chunk_rows

    G = moe.capacity_groups
    shard = max(-(-sent * dims.dp // (G * moe.capacity_domains)), 1)
    return shard, int(pooled_chunk_rows(shard * G, moe.num_experts, G, moe.capacity_chunks, moe.capacity_factor, shard))


def expert_rows(moe, tokens: int, dims) -> tuple[int, int]:
    """Rows a rank sends to the experts and receives from other ranks in one forward of `tokens`
    tokens, each way (dispatch, then combine back), under the model's capacity rule at balanced
    load: a rank sends each assignment once; it receives its experts' fair share, at most what
    the rule keeps (receiver_pooled: its receivers' chunks, `pooled_chunk_rows`; per_expert: the
    per-expert cap), or the fair share itself, dropless."""
    from marinlm.model.experts import expert_capacity

    sent = tokens * moe.top_k
    local = moe.num_experts // dims.ep
    if moe.capacity_factor is None:
        return sent, sent
    if moe.capacity == "per_expert":
        kept = local * expert_capacity(tokens * dims.ep, moe.top_k, moe.num_experts, moe.capacity_factor)
        return sent, min(dims.ep * sent, kept)
    # The expert group's ranks send ep x sent assignments: that many sender shards' worth, so many
    # domains' worth; each of the rank's receivers (local / El of them) keeps its chunks from each.
    G, El = moe.capacity_groups, moe.num_experts // moe.capacity_groups
    shard, chunk = _pooled_receiver(moe, sent, dims)
    domains = max(dims.ep * sent / (shard * G), 1.0)
    return sent, min(dims.ep * sent, math.ceil(max(local / El, 1) * moe.capacity_chunks * chunk * domains))
