"""Marin's receiver-pooled capacity (`moe.capacity: receiver_pooled`) against a written-out spelling
of the rule, in one process, in the fast kernels and under expert parallelism on gloo."""

from __future__ import annotations

import math

import pytest
import torch

from marinlm.model.experts import RoutedExperts, pooled_accept, pooled_keep

from conftest import tiny_config


def _written_out(experts, shards, E, groups, chunks, factor, shard_assignments, num_experts=None):
    """The rule as levanter's grug ragged all-to-all states it, one loop per level: for each domain
    of `groups` sender shards, each receiver (a block of E/groups experts), each chunk of its
    experts; within a chunk whole queues are accepted by local expert, then sender shard, each
    queue in token order, until the chunk's capacity is used."""
    E = num_experts or E
    El = E // groups
    S = max(shards) + 1
    Q = -(-S // groups)
    keep = [[False] * len(row) for row in experts]
    for q in range(Q):
        senders = range(q * groups, (q + 1) * groups)
        A = sum(len(experts[n]) for n in range(len(experts)) if shards[n] in senders)
        physical = max(El, math.ceil(factor * shard_assignments))
        capacity = min(max(math.ceil(A * factor / groups), El), physical)
        per_chunk = max(-(-capacity // chunks), El // chunks)
        for receiver in range(groups):
            for chunk in range(chunks):
                used = 0
                for local in range(chunk * El // chunks, (chunk + 1) * El // chunks):
                    e = receiver * El + local
                    queue = []  # every assignment to e from this domain, by sender, then token
                    for sender in senders:
                        queue += [
                            (n, j)
                            for n in range(len(experts))
                            if shards[n] == sender
                            for j in range(len(experts[n]))
                            if experts[n][j] == e
                        ]
                    # levanter accepts an expert's whole total first, then deals it to senders in order
                    take = min(len(queue), per_chunk - used)
                    for n, j in queue[:take]:
                        keep[n][j] = True
                    used += take
    return torch.tensor(keep, dtype=torch.bool)


def vectorised(experts_NK, shard_N, *, groups, domains, chunks, factor, shard_assignments, num_experts):
    S = groups * domains
    counts = torch.zeros(S, num_experts, dtype=torch.long)
    for n in range(experts_NK.shape[0]):
        for e in experts_NK[n].tolist():
            counts[int(shard_N[n]), e] += 1
    accepted = pooled_accept(counts, groups, chunks, factor, shard_assignments)
    return pooled_keep(experts_NK, shard_N, accepted)


def check(experts, shards, *, groups, domains=1, chunks, factor, shard_assignments, num_experts):
    experts_NK, shard_N = torch.tensor(experts), torch.tensor(shards)
    got = vectorised(
        experts_NK,
        shard_N,
        groups=groups,
        domains=domains,
        chunks=chunks,
        factor=factor,
        shard_assignments=shard_assignments,
        num_experts=num_experts,
    )
    want = _written_out(experts, shards, num_experts, groups, chunks, factor, shard_assignments, num_experts)
    assert torch.equal(got, want), (got, want)
    return got


def test_an_overloaded_chunk_fills_with_its_first_expert_in_sender_then_token_order():
    # 2 groups of 4 experts (2 chunks of 2), 2 sender shards of 4 tokens, top-1, factor 1:
    # A = 8, capacity = clip(ceil(8 / 2), 4, max(4, 4)) = 4, a chunk 2 rows. Receiver 0's chunk 0
    # (experts 0, 1) is sent 5: expert 0's first two (shard 0's tokens 0 and 2) fill it.
    experts = [[0], [1], [0], [4], [1], [0], [1], [6]]
    shards = [0, 0, 0, 0, 1, 1, 1, 1]
    keep = check(experts, shards, groups=2, chunks=2, factor=1.0, shard_assignments=4, num_experts=8)
    assert keep.view(-1).tolist() == [True, False, True, True, False, False, False, True]


def test_an_overloaded_sender_takes_a_receiver_whole_and_the_later_sender_is_cut():
    # 2 groups of 2 experts, one chunk: capacity = clip(ceil(8 / 2), 2, 4) = 4. Shard 0 sends all
    # four tokens to expert 0, which fills receiver 0: shard 1's two for expert 1 are dropped.
    experts = [[0]] * 4 + [[1], [1], [2], [2]]
    shards = [0] * 4 + [1] * 4
    keep = check(experts, shards, groups=2, chunks=1, factor=1.0, shard_assignments=4, num_experts=4)
    assert keep.view(-1).tolist() == [True] * 4 + [False, False, True, True]


def test_ties_go_to_the_lower_sender_then_the_earlier_token():
    # Both shards send expert 0 three tokens; receiver 0's 4 rows take shard 0's three, then shard 1's first.
    experts = [[0]] * 3 + [[2]] + [[0]] * 3 + [[3]]
    shards = [0, 0, 0, 0, 1, 1, 1, 1]
    keep = check(experts, shards, groups=2, chunks=1, factor=1.0, shard_assignments=4, num_experts=4)
    assert keep.view(-1).tolist() == [True, True, True, True, True, False, False, True]


@pytest.mark.parametrize("seed", range(6))
def test_random_routings_match_the_written_out_rule(seed):
    g = torch.Generator().manual_seed(seed)
    groups, domains, chunks, E, k = [(2, 1, 2, 8, 2), (4, 2, 1, 8, 3), (2, 3, 2, 12, 2)][seed % 3]
    shards, rows, T = groups * domains, 2 * groups * domains, 5
    skew = torch.rand(E, generator=g) ** 3 + 0.05  # some experts much busier than others
    experts = torch.stack([torch.multinomial(skew, k, generator=g) for _ in range(rows * T)])
    shard_N = (torch.arange(rows) % shards).repeat_interleave(T)
    factor = [0.6, 1.0, 1.25][seed % 3]
    keep = check(
        experts.tolist(),
        shard_N.tolist(),
        groups=groups,
        domains=domains,
        chunks=chunks,
        factor=factor,
        shard_assignments=(rows // shards) * T * k,
        num_experts=E,
    )
    assert 0 < keep.sum() < keep.numel()


def test_the_moe_layer_drops_what_the_rule_drops_in_the_reference_and_the_kernels():
    """A tiny hero-shaped model in training mode: forward row i is sender shard i mod (groups x
    domains); the reference experts and the fused kernels drop the same assignments, and their
    outputs agree."""
    from marinlm.kernels.experts import FusedRoutedExperts

    torch.manual_seed(0)
    config = tiny_config(
        moe={
            "capacity": "receiver_pooled",
            "capacity_groups": 2,
            "capacity_domains": 2,
            "capacity_chunks": 2,
            "capacity_factor": 0.8,
        }
    )
    from marinlm.model.moe import MoE

    moe = MoE(config.moe, config.d_model, config.norm_eps, config.init_std).double().train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    m = torch.randn(8, 6, config.d_model, dtype=torch.float64)
    out, routing = moe(m)
    experts_NK = routing.experts_NK
    shard_N = (torch.arange(8) % 4).repeat_interleave(6)
    k = config.moe.top_k
    want = _written_out(experts_NK.tolist(), shard_N.tolist(), 16, 2, 2, 0.8, 2 * 6 * k, 16)
    assert routing.stats.dropped == (~want).sum() > 0
    fused = FusedRoutedExperts(16, config.moe.latent_dim, config.moe.expert_dim, 0.1, "loop").double()
    fused.load_state_dict(moe.experts.state_dict())
    x = torch.randn(48, config.moe.latent_dim, dtype=torch.float64)
    ref, ref_dropped = moe.experts(x, experts_NK, routing.weights_NK, keep_NK=want)
    got, got_dropped = fused(x, experts_NK, routing.weights_NK, keep_NK=want)
    torch.testing.assert_close(got, ref)
    assert ref_dropped == got_dropped == (~want).sum()
    dropless, _ = moe.experts(x, experts_NK, routing.weights_NK)
    assert not torch.allclose(dropless, ref)


def test_hero_geometry_pooled_drops_fewer_than_per_expert():
    """E 384, top-8, 64 capacity groups, 16,384 tokens of skewed routing at factor 1.15: the hero's
    receiver-pooled rule drops a fraction of what GShard's per-expert cap drops."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    E, k, groups, N = 384, 8, 64, 16384
    skew = 1.0 + 0.9 * torch.rand(E, generator=g)
    scores = torch.log(skew) + torch.distributions.Gumbel(0.0, 1.0).sample((N, E))
    experts = scores.topk(k, dim=1).indices
    load = torch.bincount(experts.reshape(-1), minlength=E).float()
    shard_N = torch.arange(N) // (N // groups)
    counts = torch.zeros(groups, E, dtype=torch.long).index_put_(
        (shard_N.repeat_interleave(k), experts.reshape(-1)), torch.ones(N * k, dtype=torch.long), accumulate=True
    )
    pooled = pooled_keep(experts, shard_N, pooled_accept(counts, groups, 2, 1.15, N // groups * k))
    per_expert_cap = math.ceil(1.15 * N * k / E)
    per_expert = torch.clamp(load - per_expert_cap, min=0).sum() / (N * k)
    pooled_drop = float((~pooled).sum()) / (N * k)
    assert load.max() / load.mean() > 1.3
    assert pooled_drop < per_expert / 2, (pooled_drop, float(per_expert))


def test_a_pooled_rule_that_cannot_split_over_the_layout_names_the_key():
    from marinlm.config import ConfigError
    from marinlm.parallel import ParallelConfig
    from marinlm.parallel.mesh import ParallelDims

    config = tiny_config(moe={"capacity": "receiver_pooled", "capacity_groups": 4, "capacity_chunks": 2})
    ParallelDims.resolve(ParallelConfig(), 4).check_capacity(config)
    with pytest.raises(ConfigError, match=r"model.moe.capacity_groups: .* 4 sender shards must be a multiple of the 8"):
        ParallelDims.resolve(ParallelConfig(), 8).check_capacity(config)
    with pytest.raises(ConfigError, match="model.moe.capacity: receiver_pooled capacity under tensor x expert"):
        ParallelDims.resolve(ParallelConfig(tensor_parallel=2, expert_parallel=2), 4).check_capacity(config)
    with pytest.raises(ConfigError, match="capacity_chunks: 3 must divide the 4 experts"):
        tiny_config(moe={"capacity": "receiver_pooled", "capacity_groups": 4, "capacity_chunks": 3})
    assert isinstance(RoutedExperts.rows.sum(torch.ones(2)), torch.Tensor)


def test_the_plan_sizes_the_experts_receive_buffers_by_the_same_rule():
    """At Marin's layout (a rack of 64 expert-parallel GPUs, one sender shard each) a rank receives
    at most its receiver's 2 chunks, ceil(ceil(1.15 x its assignments) / 2) rows each; GShard's rule
    its experts' caps; dropless its fair share."""
    import dataclasses

    from marinlm.config import load_config
    from marinlm.model.config import MarinConfig
    from marinlm.parallel.mesh import ParallelDims
    from marinlm.plan.routing import expert_rows

    from conftest import ROOT

    moe = load_config(MarinConfig, ROOT / "configs/model/marin-535b-a23b.yaml").moe
    dims = ParallelDims(dp_replicate=11, dp_shard=64, tp=1, ep=64, pp=1)
    tokens = 4096
    sent = tokens * 8
    assert expert_rows(moe, tokens, dims) == (sent, 2 * math.ceil(math.ceil(1.15 * sent) / 2))
    per_expert = dataclasses.replace(moe, capacity="per_expert")
    assert expert_rows(per_expert, tokens, dims) == (sent, 6 * math.ceil(1.15 * tokens * 64 * 8 / 384))
    assert expert_rows(dataclasses.replace(moe, capacity_factor=None), tokens, dims) == (sent, sent)
