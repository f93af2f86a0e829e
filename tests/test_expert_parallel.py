"""Expert-parallel dispatch and combine on 4 gloo processes: identity experts give the input back
exactly, edge cases of the routing, and receiver capacity against its one-process spelling."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from marinlm.parallel.expert_parallel import combine, dispatch, receiver_keep

from conftest import spawn_ranks

WORLD = 4
N, D = 12, 8


def routing(case: str, source: int, num_experts: int, k: int) -> torch.Tensor:
    """[N, k] distinct expert ids of one source rank, the same on every rank for a given source."""
    g = torch.Generator().manual_seed(100 * source + len(case))
    if case == "all_to_one_rank":  # every assignment to the experts rank 1 owns
        local = num_experts // WORLD
        scores = torch.rand(N, local, generator=g)
        return scores.topk(k, dim=1).indices + local
    scores = torch.rand(N, num_experts, generator=g)
    if case == "an_expert_unused":
        scores[:, 0] = -1.0  # expert 0 never chosen
    return scores.topk(k, dim=1).indices


CASES = {  # name: (routing case, experts, k, capacity factor)
    "uneven": ("uneven", 16, 2, None),
    "an_expert_unused": ("an_expert_unused", 16, 2, None),
    "all_to_one_rank": ("all_to_one_rank", 16, 2, None),
    "top_k_is_every_expert": ("top_k_is_every_expert", 8, 8, None),
    "capacity-0.5": ("uneven", 16, 2, 0.5),
    "capacity-1.0": ("uneven", 16, 2, 1.0),
    "capacity-1.15": ("uneven", 16, 2, 1.15),
}


def _ranks(rank: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        for name, (case, num_experts, k, factor) in CASES.items():
            experts_NK = routing(case, rank, num_experts, k)
            x_ND = torch.randn(N, D, generator=torch.Generator().manual_seed(rank), dtype=torch.float64) + 5.0
            priority_N = torch.randperm(N, generator=torch.Generator().manual_seed(7 + rank))
            group = dist.group.WORLD
            x_KD, plan = dispatch(x_ND, experts_NK, num_experts, group, priority_N, factor)
            y_AD = combine(x_KD, plan, group)  # identity experts
            sent = x_ND[plan.slot_A // k]
            kept_A = (y_AD != 0).all(1)
            assert torch.equal(y_AD[kept_A], sent[kept_A])  # what comes back is exactly what was sent
            kept_NK = torch.zeros(N * k, dtype=torch.bool)
            kept_NK[plan.slot_A] = kept_A
            results[(name, rank)] = (kept_NK.view(N, k), float(plan.dropped), plan.num_received, priority_N)
        _pooled(rank, results)
    finally:
        dist.destroy_process_group()


POOLED = dict(factor=0.9, groups=4, domains=2, chunks=2)  # 8 sender shards: 2 a rank on 4 ranks
ROWS, T, E_POOLED, K_POOLED = 16, 3, 16, 2


def pooled_routing() -> torch.Tensor:
    """[ROWS, T, k] a skewed routing of one forward's rows (the same on every rank)."""
    g = torch.Generator().manual_seed(5)
    skew = torch.rand(E_POOLED, generator=g) ** 2 + 0.05
    return torch.stack([torch.multinomial(skew, K_POOLED, generator=g) for _ in range(ROWS * T)]).view(ROWS, T, -1)


def _pooled(rank: int, results) -> None:
    """The receiver-pooled rule on 4 data ranks, each holding rows rank, rank + 4, ... of one
    forward: the drops each rank decides, and what EP 4 and EP 2 bring back when sent."""
    from marinlm.model.experts import RoutedExperts
    from marinlm.parallel.expert_parallel import DataParallelRows

    experts = RoutedExperts(E_POOLED, D, 4, 0.1)
    experts.rows = DataParallelRows(None, rank, WORLD)
    mine = pooled_routing()[rank::WORLD].reshape(-1, K_POOLED)
    keep = experts.keep_pooled(
        mine, ROWS // WORLD, POOLED["factor"], POOLED["groups"], POOLED["domains"], POOLED["chunks"]
    )
    x_ND = torch.randn(mine.shape[0], D, generator=torch.Generator().manual_seed(rank), dtype=torch.float64) + 5.0
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    for name, group in (("ep-4", dist.group.WORLD), ("ep-2", pairs[rank // 2])):
        x_KD, plan = dispatch(x_ND, mine, E_POOLED, group, keep_NK=keep)
        y_AD = combine(x_KD, plan, group)
        assert torch.equal(y_AD, x_ND[plan.slot_A // K_POOLED])  # only kept rows travel, all come back
        sent = torch.zeros(mine.numel(), dtype=torch.bool)
        sent[plan.slot_A] = True
        results[(f"pooled-{name}", rank)] = (sent.view_as(keep), float(plan.dropped))
    results[("pooled", rank)] = keep


@pytest.fixture(scope="module")
def dispatched(tmp_path_factory) -> dict:
    """Every case of CASES through `dispatch` and `combine` on 4 gloo processes (one spawn)."""
    results = mp.Manager().dict()
    spawn_ranks(_ranks, (str(tmp_path_factory.mktemp("ep") / "store"), results), WORLD)
    return dict(results)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", ["uneven", "an_expert_unused", "all_to_one_rank", "top_k_is_every_expert"])
def test_dispatch_then_combine_with_identity_experts_returns_the_input(dispatched, case):
    for rank in range(WORLD):
        kept, dropped, _, _ = dispatched[(case, rank)]
        assert kept.all() and dropped == 0, rank  # dropless: every assignment comes back
    if case == "all_to_one_rank":
        assert [dispatched[(case, r)][2] for r in range(WORLD)] == [0, WORLD * N * 2, 0, 0]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.15])
def test_receiver_capacity_drops_what_the_one_process_rule_drops(dispatched, factor):
    name = f"capacity-{factor}"
    experts = [routing("uneven", r, 16, 2) for r in range(WORLD)]
    expected = receiver_keep(experts, [dispatched[(name, r)][3] for r in range(WORLD)], 16, factor)
    for rank in range(WORLD):
        assert torch.equal(dispatched[(name, rank)][0], expected[rank]), rank
    total_dropped = sum(dispatched[(name, r)][1] for r in range(WORLD))
    assert total_dropped == sum(int((~e).sum()) for e in expected)
    if factor < 1:
        assert total_dropped > 0  # the case exercises dropping


@pytest.mark.slow
@pytest.mark.distributed
def test_pooled_capacity_drops_the_same_assignments_on_4_ranks_ep_4_and_ep_2_as_one_process(dispatched):
    """One process over the forward's 16 rows (row i in sender shard i mod 8) keeps exactly what the
    4 data ranks keep between them, and EP 4 and EP 2 send exactly those."""
    from marinlm.model.experts import RoutedExperts

    whole = pooled_routing()
    one = (
        RoutedExperts(E_POOLED, D, 4, 0.1)
        .keep_pooled(
            whole.reshape(-1, K_POOLED), ROWS, POOLED["factor"], POOLED["groups"], POOLED["domains"], POOLED["chunks"]
        )
        .view(ROWS, T, K_POOLED)
    )
    assert 0 < int((~one).sum()) < one.numel() // 2
    for rank in range(WORLD):
        keep = dispatched[("pooled", rank)]
        assert torch.equal(keep, one[rank::WORLD].reshape(-1, K_POOLED)), rank
        for name in ("ep-4", "ep-2"):
            sent, dropped = dispatched[(f"pooled-{name}", rank)]
            assert torch.equal(sent, keep) and dropped == int((~keep).sum()), (name, rank)
