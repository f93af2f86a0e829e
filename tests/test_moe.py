from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from marinlm.kernels import experts as experts_module
from marinlm.kernels.experts import FusedRoutedExperts, resolve_impl
from marinlm.model import AuxFreeRouterConfig, QBRouterConfig, RouterStats, SoftmaxTopKRouterConfig
from marinlm.model.experts import RoutedExperts, expert_capacity
from marinlm.model.router import AuxFreeRouter, QBRouter, SoftmaxTopKRouter
from marinlm.utils.device import emulated_bf16

from conftest import build, tiny_config


def make_experts(*, impl: str, **kwargs) -> RoutedExperts:
    """`ref-IMPL` is the reference model's experts, any other impl a kernel (marinlm.kernels)."""
    if impl.startswith("ref-"):
        return RoutedExperts(impl=impl[4:], **kwargs)
    return FusedRoutedExperts(impl=impl, **kwargs)


def naive_experts(module: RoutedExperts, x, experts, weights, keep=None):
    """One token, one assignment at a time."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(experts.shape[1]):
            if keep is not None and not keep[n, j]:
                continue
            e = experts[n, j]
            h = F.silu(x[n] @ module.gate_proj[e]) * (x[n] @ module.up_proj[e])
            out[n] += weights[n, j] * (h @ module.down_proj[e])
    return out


@pytest.mark.parametrize("impl", ["grouped_mm", "chunked", "chunked-of-3", "bmm", "loop", "ref-grouped_mm", "ref-loop"])
def test_expert_kernels_match_naive_loop_with_grads(impl, monkeypatch):
    if impl == "chunked-of-3":  # experts span several chunks, the last one part padding
        monkeypatch.setattr(experts_module, "CHUNK_ROWS", (3,))
        monkeypatch.setattr(experts_module, "CHUNK_COST_ROWS", 0)
        impl = "chunked"
    torch.manual_seed(0)
    module = make_experts(num_experts=6, dim=8, hidden=12, init_std=0.2, impl=impl)
    module.reset_parameters()
    x = torch.randn(20, 8, requires_grad=True)
    experts = torch.randint(0, 5, (20, 2))  # expert 5 gets nothing: empty groups must work
    weights = torch.rand(20, 2, requires_grad=True)
    got, dropped = module(x, experts, weights)
    assert dropped == 0
    want = naive_experts(module, x, experts, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, [x, weights, module.gate_proj, module.up_proj, module.down_proj], g)
    ref = torch.autograd.grad(want, [x, weights, module.gate_proj, module.up_proj, module.down_proj], g)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["grouped_mm", "chunked", "bmm", "loop", "ref-grouped_mm", "ref-loop"])
def test_no_tokens_give_an_empty_output(impl):
    """An empty batch (an expert-parallel rank can be sent none) is not an error."""
    module = make_experts(num_experts=4, dim=8, hidden=16, init_std=0.2, impl=impl)
    module.reset_parameters()
    x = torch.randn(0, 8, requires_grad=True)
    y, dropped = module(x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert y.shape == (0, 8) and dropped == 0
    y.sum().backward()
    assert x.grad.shape == (0, 8)


@pytest.mark.parametrize("full", [0, 3])  # the first or the last expert overflows
@pytest.mark.parametrize("impl", ["grouped_mm", "chunked", "chunked-of-4", "bmm", "loop", "ref-grouped_mm", "ref-loop"])
def test_capacity_drops_later_tokens_and_counts_them(impl, full, monkeypatch):
    if impl == "chunked-of-4":
        monkeypatch.setattr(experts_module, "CHUNK_ROWS", (4,))
        monkeypatch.setattr(experts_module, "CHUNK_COST_ROWS", 0)
        impl = "chunked"
    torch.manual_seed(2)
    module = make_experts(num_experts=4, dim=8, hidden=4, init_std=0.2, impl=impl)
    module.reset_parameters()
    N, k = 12, 2
    others = (full + torch.randint(1, 4, (N,))) % 4
    experts = torch.stack([torch.full((N,), full), others], 1)  # every token picks expert `full`
    weights = torch.rand(N, k, requires_grad=True)
    capacity = expert_capacity(N, k, 4, 1.0)  # 6 slots per expert
    assert capacity == 6
    x = torch.randn(N, 8, requires_grad=True)
    got, dropped = module(x, experts, weights, capacity)
    counts = torch.bincount(experts.reshape(-1), minlength=4)
    assert dropped.item() == (counts - capacity).clamp_min(0).sum().item()
    # Within each expert, assignments keep token order and the first `capacity` survive.
    want = naive_experts(module, x, experts, weights, keep_first(experts, capacity, 4))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Dropped assignments get no gradient; kept ones the naive loop's.
    params = [x, weights, module.gate_proj, module.up_proj, module.down_proj]
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def keep_first(experts, capacity, num_experts):
    """Which assignments survive a capacity: the first `capacity` of each expert in token order."""
    keep = torch.ones(experts.shape, dtype=torch.bool)
    if capacity is None:
        return keep
    seen = [0] * num_experts
    for n in range(experts.shape[0]):
        for j in range(experts.shape[1]):
            e = experts[n, j].item()
            keep[n, j] = seen[e] < capacity
            seen[e] += 1
    return keep


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    impl=st.sampled_from(["grouped_mm", "chunked", "bmm", "loop", "ref-grouped_mm", "ref-loop"]),
    tokens=st.integers(1, 40),
    num_experts=st.integers(1, 7),
    top_k=st.integers(1, 3),
    skew=st.floats(0.0, 4.0),
    capacity=st.one_of(st.none(), st.integers(1, 12)),
    chunk_rows=st.lists(st.integers(1, 9), min_size=1, max_size=3, unique=True),
    chunk_cost=st.sampled_from([0, 2, 48]),
    seed=st.integers(0, 2**16),
)
def test_expert_kernels_match_the_naive_loop_for_any_routing(
    impl, tokens, num_experts, top_k, skew, capacity, chunk_rows, chunk_cost, seed
):
    """Any loads (empty experts, one expert taking most, capacity drops) and any chunk plan the
    `chunked` kernel may choose give the naive loop's output and gradients."""
    top_k = min(top_k, num_experts)
    g = torch.Generator().manual_seed(seed)
    popularity = torch.randn(num_experts, generator=g) * skew
    scores = torch.rand(tokens, num_experts, generator=g).log().neg().log().neg() + popularity
    experts = scores.topk(top_k, dim=-1).indices  # distinct experts per token, skewed loads
    module = make_experts(num_experts=num_experts, dim=8, hidden=12, init_std=0.2, impl=impl)
    torch.manual_seed(seed)
    module.reset_parameters()
    x = torch.randn(tokens, 8, generator=g, requires_grad=True)
    weights = torch.rand(tokens, top_k, generator=g, requires_grad=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(experts_module, "CHUNK_ROWS", tuple(sorted(chunk_rows)))
        mp.setattr(experts_module, "CHUNK_COST_ROWS", chunk_cost)
        got, dropped = module(x, experts, weights, capacity=capacity)
    keep = keep_first(experts, capacity, num_experts)
    assert dropped.item() == (~keep).sum().item()
    want = naive_experts(module, x, experts, weights, keep)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    params = [x, weights, module.gate_proj, module.up_proj, module.down_proj]
    grad = torch.randn(got.shape, generator=g)
    for a, b in zip(torch.autograd.grad(got, params, grad), torch.autograd.grad(want, params, grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_mm_rejects_unaligned_widths_clearly():
    module = make_experts(num_experts=2, dim=6, hidden=4, init_std=0.2, impl="grouped_mm")
    module.reset_parameters()
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        module(torch.randn(3, 6), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))
    module.impl = "auto"  # auto falls back to a kernel without the alignment rule
    module(torch.randn(3, 6), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))


def test_cpu_autocast_dtype_follows_torch_policy_per_kernel():
    """Under CPU bf16 autocast, `grouped_mm` experts stay fp32 (as torch leaves `_grouped_mm`),
    while the `chunked`, `bmm` and `loop` kernels are cast like any autocast matmul."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probe = torch._grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 8), offs=torch.tensor([2, 4], dtype=torch.int32))
    assert probe.dtype == torch.float32, "torch's CPU autocast now casts _grouped_mm: revisit compute_dtype"
    torch.manual_seed(0)
    x, experts, weights = torch.randn(20, 8), torch.randint(0, 4, (20, 2)), torch.rand(20, 2)
    for impl, dtype in [
        ("grouped_mm", torch.float32),
        ("chunked", torch.bfloat16),
        ("bmm", torch.bfloat16),
        ("loop", torch.bfloat16),
    ]:
        module = make_experts(num_experts=4, dim=8, hidden=16, init_std=0.2, impl=impl)
        module.reset_parameters()
        want, _ = module(x, experts, weights)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, _ = module(x, experts, weights)
        assert got.dtype == dtype, impl
        tol = 0 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_auto_kernel_is_chunked_only_for_native_cpu_bf16():
    """`chunked` where oneDNN has bf16 GEMMs (bf16 batched products at full speed, whatever the
    loads); `grouped_mm` in fp32, on GPUs and where bf16 is emulated."""
    cpu, dims = torch.device("cpu"), (64, 128)
    assert resolve_impl("auto", cpu, dims, torch.float32) == "grouped_mm"
    want = "grouped_mm" if emulated_bf16(cpu) else "chunked"
    assert resolve_impl("auto", cpu, dims, torch.bfloat16) == want
    assert resolve_impl("auto", torch.device("cuda"), dims, torch.bfloat16) == "grouped_mm"
    assert resolve_impl("auto", cpu, (6, 4), torch.float32) == "bmm"  # unaligned for grouped_mm


def test_chunk_plan_weighs_padding_against_gathered_chunks():
    plan = experts_module._chunk_plan
    # Near balance (largest 149): one chunk per expert, 160 rows wide (32-row steps; 5,120 rows),
    # no matrices gathered, though 64-row chunks would pad less (72 chunks, 4,608 rows).
    balanced = torch.tensor([112, 149, 120, 128] * 8)
    rows, chunks, gathered = plan(balanced)
    assert (rows, chunks.tolist(), gathered) == (160, [1] * 32, False)
    # Skewed as at initialisation (largest 297): 128-row chunks, gathered.
    skewed = torch.tensor([297, 55] + [128] * 30)
    rows, chunks, gathered = plan(skewed)
    assert (rows, chunks.tolist(), gathered) == (128, [3, 1] + [1] * 30, True)
    # Loads of 700 and one of 2,000: 256-row chunks (25,600 rows, 100 chunks) over 512-row (33,280,
    # 65) and 128-row (25,472, 199).
    rows, chunks, gathered = plan(torch.tensor([2000, 300] + [700] * 30))
    assert (rows, chunks.tolist(), gathered) == (256, [8, 2] + [3] * 30, True)
    # Every expert fits one chunk of some size: that size, nothing gathered.
    rows, chunks, gathered = plan(torch.tensor([200, 256, 250, 180] * 8))
    assert (rows, chunks.tolist(), gathered) == (256, [1] * 32, False)
    # bmm: one chunk per expert, as wide as the capacity.
    rows, chunks, gathered = plan(skewed, capacity=200, one_per_expert=True)
    assert (rows, chunks.tolist(), gathered) == (200, [1] * 32, False)


def test_as_many_chunks_as_experts_still_gathers_each_chunks_matrices(monkeypatch):
    """Loads [100, 0, 50, 50] in 64-row chunks: 4 chunks for 4 experts, but the second chunk is
    expert 0's, not expert 1's. (Until 2026-12-02 the kernel took C == E to mean one chunk per
    expert, and multiplied it by expert 1's matrices.)"""
    monkeypatch.setattr(experts_module, "CHUNK_ROWS", (64,))
    monkeypatch.setattr(experts_module, "CHUNK_COST_ROWS", 0)
    torch.manual_seed(0)
    module = make_experts(num_experts=4, dim=8, hidden=16, init_std=0.2, impl="chunked")
    module.reset_parameters()
    experts = torch.tensor([0] * 100 + [2] * 50 + [3] * 50).view(-1, 1)
    rows, chunks, gathered = experts_module._chunk_plan(torch.bincount(experts.flatten(), minlength=4))
    assert (rows, chunks.tolist(), gathered) == (64, [2, 0, 1, 1], True)
    x = torch.randn(200, 8, requires_grad=True)
    weights = torch.rand(200, 1)
    got, _ = module(x, experts, weights)
    want = naive_experts(module, x, experts, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(got)
    params = [x, module.gate_proj, module.up_proj, module.down_proj]
    for a, b in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def identity_router(cls, config, num_experts, top_k):
    router = cls(config, num_experts, num_experts, top_k, 0.02)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts))
        router.bias.zero_()
    return router


def test_qb_hand_computed_example():
    """Selection on biased logits, sigmoid weights summing to 2.5, beta and the bias replacement."""
    s = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 1.5, -0.5, 0.0], [0.0, 0.0, 3.0, 1.0], [1.0, -1.0, 0.5, 2.0]])
    router = identity_router(QBRouter, QBRouterConfig(weight_sum=2.5, estimator="topk"), 4, 2)
    with torch.no_grad():
        router.bias.copy_(torch.tensor([0.0, 0.0, -1.0, 0.0]))
    routing = router(s)
    assert [sorted(r) for r in routing.experts_NK.tolist()] == [[0, 1], [0, 1], [2, 3], [0, 3]]
    sig = torch.sigmoid(torch.tensor([2.0, 1.0]))
    expected_t0 = 2.5 * sig / sig.sum()
    torch.testing.assert_close(routing.weights_NK[0], expected_t0)
    torch.testing.assert_close(routing.weights_NK.sum(-1), torch.full((4,), 2.5))
    # alpha = 3rd largest biased logit per token: [-1, 0, 0, -0.5]; margins = s - alpha;
    # beta_e = the N*k/E = 2nd largest margin of each expert.
    torch.testing.assert_close(routing.stats.beta, torch.tensor([1.5, 1.5, 1.0, 1.0]))
    router.update_bias(routing.stats)
    torch.testing.assert_close(router.bias, torch.tensor([-0.25, -0.25, 0.25, 0.25]))
    # A replacement, not an accumulation: the same stats give the same bias again.
    router.update_bias(routing.stats)
    torch.testing.assert_close(router.bias, torch.tensor([-0.25, -0.25, 0.25, 0.25]))


def test_qb_histogram_beta_is_the_global_quantile_and_split_invariant():
    torch.manual_seed(5)
    E, k, N = 8, 2, 4000
    config = QBRouterConfig(estimator="histogram", hist_bins=10_000, hist_range=8.0, hist_bounds="fixed")
    router = QBRouter(config, 16, E, k, 0.3)
    router.reset_parameters()
    x = torch.randn(N, 16)
    whole = router(x).stats
    halves = RouterStats.merge([router(x[: N // 2]).stats, router(x[N // 2 :]).stats])
    assert torch.equal(whole.hist, halves.hist)  # counts add: the estimate ignores how the batch was split
    exact_router = QBRouter(QBRouterConfig(estimator="topk"), 16, E, k, 0.3)
    exact_router.load_state_dict(router.state_dict())
    exact = exact_router(x).stats.beta  # the N*k/E-th largest margin over the whole batch
    estimate = router.beta_from_histogram(whole.hist, whole.num_tokens)
    width = 2 * 8.0 / 10_000
    assert (estimate - exact).abs().max() <= 2 * width
    router.update_bias(halves)
    torch.testing.assert_close(router.bias, -halves.beta + halves.beta.mean())


def test_qb_balances_a_skewed_router_over_steps():
    torch.manual_seed(3)
    E, k = 16, 2
    router = QBRouter(QBRouterConfig(), 32, E, k, 0.02)
    router.reset_parameters()
    x = torch.randn(4096, 32)
    with torch.no_grad():  # a router that strongly prefers high-numbered experts
        x[:, 0] = 1.0
        router.weight[:, 0] = torch.linspace(-2, 2, E)

    def relative_load():
        routing = router(x)
        return routing, routing.stats.load / routing.stats.load.mean()

    routing, before = relative_load()
    for _ in range(3):
        router.update_bias(routing.stats)
        routing, after = relative_load()
    assert before.max() > 3.0
    assert after.max() < 1.3 and after.min() > 0.7


def test_aux_free_bias_nudges_towards_balance():
    router = identity_router(AuxFreeRouter, AuxFreeRouterConfig(bias_update_rate=0.01), 4, 1)
    stats = RouterStats(
        load=torch.tensor([10.0, 2.0, 4.0, 4.0]),
        z_loss=torch.tensor(0.0),
        dropped=torch.tensor(0.0),
        num_tokens=torch.tensor(20.0),
    )
    router.update_bias(stats)
    torch.testing.assert_close(router.bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    routing = router(torch.tensor([[3.0, 1.0, 0.0, 0.0]]))
    torch.testing.assert_close(routing.weights_NK.sum(-1), torch.ones(1))


def test_softmax_topk_aux_loss_matches_hf_mixtral():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(4)
    router = SoftmaxTopKRouter(SoftmaxTopKRouterConfig(aux_loss_weight=1.0), 16, 8, 2, 0.5)
    router.reset_parameters()
    x = torch.randn(64, 16)
    routing = router(x)
    hf = load_balancing_loss_func((router.logits(x),), num_experts=8, top_k=2)
    torch.testing.assert_close(routing.aux_loss, hf)
    assert transformers is not None


@pytest.mark.parametrize("bounds", ["fixed", "live"])
def test_router_stats_merge_and_model_update(bounds):
    config = tiny_config(moe={"router": {"hist_bounds": bounds}})
    model = build(config)
    ids = torch.randint(0, config.vocab_size, (2, 64))
    stats = [model(ids[:1]).router_stats, model(ids[1:]).router_stats]
    merged = [RouterStats.merge([a, b]) for a, b in zip(*stats)]
    assert merged[0].load.sum() == 2 * 64 * config.moe.top_k
    if bounds == "fixed":  # histogram estimator
        torch.testing.assert_close(merged[0].hist, stats[0][0].hist + stats[1][0].hist)
    else:  # each forward's margins, binned once the step's range is known
        assert [m.shape[0] for m in merged[0].margins] == [64, 64]
    assert 0 < merged[0].entropy <= math.log(config.moe.num_experts) + 1e-6
    model.update_router_biases(merged)
    bias = model.layers[0].mlp.router.bias
    assert merged[0].beta is not None  # computed from the summed histogram at update time
    torch.testing.assert_close(bias, -merged[0].beta + merged[0].beta.mean())
    assert "layers.0.mlp.router.bias" in model.state_dict()
    with pytest.raises(ValueError, match="MoE layers"):
        model.update_router_biases(merged[:1])


def test_training_mode_reports_capacity_drops():
    config = tiny_config(moe={"capacity_factor": 0.5})
    model = build(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 64))
    stats = model(ids).router_stats
    assert all(s.dropped > 0 for s in stats)
    assert all(0 < s.dropped_fraction < 1 for s in stats)
    model.eval()
    assert all(s.dropped == 0 for s in model(ids).router_stats)


def test_incremental_merge_equals_merging_all():
    torch.manual_seed(6)
    router = QBRouter(QBRouterConfig(estimator="topk"), 8, 4, 1, 0.3)
    router.reset_parameters()
    parts = [router(torch.randn(32, 8)).stats for _ in range(3)]
    running = parts[0]
    for i, s in enumerate(parts[1:], start=1):
        running = RouterStats.merge([running, s], [i, 1])
    whole = RouterStats.merge(parts)
    for name in ("load", "z_loss", "dropped", "num_tokens", "beta"):
        torch.testing.assert_close(getattr(running, name), getattr(whole, name))


@pytest.mark.slow
@pytest.mark.parametrize(
    "moe",
    [
        {"capacity_factor": 0.5},  # QB with its margin histogram; capacity drops
        {"capacity_factor": None, "router": {"type": "softmax_topk"}},  # dropless
    ],
)
def test_the_model_compiles_as_one_graph_forward_and_backward(moe):
    """Routing, counting, capacity drops and the grouped experts have shapes fixed by the batch,
    not by the routing: no host sync, and no graph break when torch.compile traces a block
    (torch.bincount and boolean indexing each broke the graph, 23 breaks in the 2-layer model).
    Counted without fullgraph=True, as training compiles: fullgraph traces bincount."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")  # aot_eager traces the backward too
    config = tiny_config(num_layers=2, max_seq_len=32, attention={"sliding_window": 8}, moe=moe)
    eager = build(config, kernels=True)
    compiled = build(config, kernels=True)
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    segments = torch.arange(32).div(12, rounding_mode="floor").expand(2, 32)  # packed documents
    outs = []
    for model in (eager, torch.compile(compiled, backend=backend)):
        model.train()
        out = model(ids, segment_ids=segments)
        out.logits.float().square().mean().backward()
        outs.append(out)
    assert backend.frame_count == 1, f"{backend.frame_count} graphs"
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(outs[0].router_stats, outs[1].router_stats):
        torch.testing.assert_close(b.load, a.load)
        torch.testing.assert_close(b.dropped, a.dropped)
    assert (sum(s.dropped for s in outs[0].router_stats) > 0) == (config.moe.capacity_factor is not None)


def test_the_live_range_histogram_is_within_a_bin_of_the_exact_quantile_however_the_batch_is_split():
    """Marin's hero bins the QB margins over their live [min, max] (10,000 bins), not a fixed
    [-32, 32]: its beta lands within one (live) bin width of the exact (1 - k/E) upper quantile, the
    fixed grid's bins are far wider, and the counts are those of the whole step whether its tokens
    came as one forward or as micro-batches on several ranks (binned once the range is known)."""
    from marinlm.model.router import bin_live, margin_range

    torch.manual_seed(7)
    E, k, N, bins = 16, 2, 6000, 10_000
    router = QBRouter(QBRouterConfig(hist_bins=bins), 16, E, k, 0.3)
    router.reset_parameters()
    x = torch.randn(N, 16)
    exact_router = QBRouter(QBRouterConfig(estimator="topk"), 16, E, k, 0.3)
    exact_router.load_state_dict(router.state_dict())
    exact = exact_router(x).stats.beta

    whole = router(x).stats
    bin_live(whole, *margin_range(whole.margins))
    estimate = router.beta_from_histogram(whole.hist, whole.num_tokens, whole.hist_lo, whole.hist_hi)
    width = float((whole.hist_hi - whole.hist_lo) / bins)
    assert (estimate - exact).abs().max() <= width
    assert 2 * 32.0 / bins > 5 * width  # the fixed grid's bins, at these margins

    # Three micro-batches on each of two "ranks": the range across ranks, then each rank's counts.
    ranks = [RouterStats.merge([router(part).stats for part in half.chunk(3)]) for half in x.chunk(2)]
    lows, highs = zip(*(margin_range(r.margins) for r in ranks))
    lo, hi = torch.stack(lows).min(), torch.stack(highs).max()
    for r in ranks:
        bin_live(r, lo, hi)
    assert torch.equal(ranks[0].hist + ranks[1].hist, whole.hist)
