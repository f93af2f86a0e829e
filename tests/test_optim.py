from __future__ import annotations

import pytest
import torch

from marinlm.config import ConfigError, load_config
from marinlm.optim import (
    MarinOptimizerConfig,
    ScheduleConfig,
    build_optimizer,
    lr_multiplier,
    marin_param_kinds,
    newton_schulz,
    newton_schulz_many,
)

from conftest import build, spawn_ranks, tiny_config


def test_newton_schulz_orthogonalises_each_matrix():
    torch.manual_seed(0)
    g = torch.randn(3, 32, 48)  # a stack of wide matrices, e.g. per-expert
    u = newton_schulz(g, steps=5)
    s = torch.linalg.svdvals(u)
    # quintic NS drives singular values into roughly [0.7, 1.2] (not exactly 1 by design)
    assert s.min() > 0.5 and s.max() < 1.3
    tall = newton_schulz(g.mT)
    torch.testing.assert_close(tall, u.mT, rtol=1e-4, atol=1e-5)  # transposition-equivariant
    single = newton_schulz(g[1])
    torch.testing.assert_close(single, u[1], rtol=1e-4, atol=1e-5)  # per matrix, not across the stack


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 24, 40), (2, 3, 40, 24)])
@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("schedule", ["simple", "quintic_schedule"])
def test_newton_schulz_is_the_quintic_iteration(shape, steps, schedule):
    """X <- a·X + b·(XXᵀ)X + c·(XXᵀ)²X on the wide orientation, from X/‖X‖_F, per matrix (fp64 ref),
    with step i's (a, b, c) the schedule's i-th triple, cycled."""
    from marinlm.optim.marin import NS_SCHEDULES

    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3
    flat = g.double().reshape(-1, *shape[-2:])
    expected = []
    for m in flat:
        x = m / m.norm()
        x = x.T if x.shape[0] > x.shape[1] else x
        for i in range(steps):
            a, b, c = NS_SCHEDULES[schedule][i % len(NS_SCHEDULES[schedule])]
            gram = x @ x.T
            x = a * x + b * gram @ x + c * gram @ gram @ x
        expected.append(x.T if m.shape[0] > m.shape[1] else x)
    expected = torch.stack(expected).reshape(shape).float()
    torch.testing.assert_close(newton_schulz(g, steps=steps, schedule=schedule), expected, rtol=1e-4, atol=1e-5)


def test_marins_quintic_schedule_is_levanters_and_lands_near_one():
    """Marin's hero MuonH runs levanter's "quintic" schedule (five triples, one per iteration) in
    bf16, not Keller Jordan's single triple. After 5 steps on a Gaussian 128 x 64 matrix its
    singular values lie in [0.97, 1.04] in bf16 and fp32; the single triple's spread over
    [0.68, 1.14]."""
    from marinlm.optim.marin import NS_SCHEDULES

    assert NS_SCHEDULES["quintic_schedule"] == (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    )
    for seed in range(3):
        g = torch.randn(128, 64, generator=torch.Generator().manual_seed(seed))
        for dtype in (torch.bfloat16, torch.float32):
            s = torch.linalg.svdvals(newton_schulz(g, 5, 1e-8, dtype, "quintic_schedule").double())
            assert s.min() >= 0.97 and s.max() <= 1.04, (seed, dtype, s.min(), s.max())
            s = torch.linalg.svdvals(newton_schulz(g, 5, 1e-8, dtype, "simple").double())
            assert s.min() < 0.7 and s.max() > 1.12


def test_muonh_and_adamh_step_in_float64():
    """MuonH stopped in `_frobenius` on float64 weights (a norm forced to fp32), so no fp64 layout
    parity could use the hero's optimizer. Now both steps run in fp64, Newton-Schulz included, and
    agree with the step written out in fp64 to 1e-12."""
    from marinlm.optim.marin import MarinOptimizer

    g = torch.Generator().manual_seed(6)
    w = torch.nn.Parameter(torch.randn(8, 12, generator=g, dtype=torch.float64))
    head = torch.nn.Parameter(torch.randn(6, 4, generator=g, dtype=torch.float64))
    grads = [torch.randn(8, 12, generator=g, dtype=torch.float64), torch.randn(6, 4, generator=g, dtype=torch.float64)]
    opt = MarinOptimizer(
        [{"params": [w], "kind": "muonh"}, {"params": [head], "kind": "adamh"}],
        lr=0.1,
        adam_lr=0.01,
        ns_dtype=torch.float64,
        ns_schedule="quintic_schedule",
    )
    w0, head0 = w.detach().clone(), head.detach().clone()
    w.grad, head.grad = grads[0].clone(), grads[1].clone()
    opt.step()
    assert w.dtype == head.dtype == torch.float64
    u = newton_schulz(grads[0] + 0.95 * grads[0], 5, 1e-7, torch.float64, "quintic_schedule")
    torch.testing.assert_close(w.detach(), hyperball(w0, u, 0.1), rtol=1e-12, atol=1e-12)
    direction = (0.1 * grads[1] / 0.1) / ((0.05 * grads[1] ** 2 / 0.05).sqrt() + 1e-8)
    torch.testing.assert_close(head.detach(), hyperball(head0, direction, 0.1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("max_elements", [None, 0, 3000, 1 << 30])
def test_batched_newton_schulz_equals_one_matrix_at_a_time(max_elements):
    """Same-shaped matrices are stacked into shared calls (in batches of at most max_elements)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(32, 48), (3, 32, 48), (48, 32), (32, 48), (16, 16), (2, 48, 32), (5, 16, 16)]
    matrices = [torch.randn(*s, generator=g) * (i + 1) for i, s in enumerate(shapes)]
    many = newton_schulz_many(matrices, steps=5, max_elements=max_elements)
    for m, u in zip(matrices, many):
        assert u.shape == m.shape
        torch.testing.assert_close(u, newton_schulz(m, steps=5), rtol=1e-4, atol=1e-5)


def test_param_kinds_follow_the_recipe():
    model = build(tiny_config())
    kinds = {k: {n for n, _ in v} for k, v in marin_param_kinds(model).items()}
    assert kinds["adamh"] == {"lm_head.weight"}
    assert "embed.weight" in kinds["adam"]
    assert "layers.0.mlp.router.weight" in kinds["adam"]
    assert "layers.0.attn.gate.weight" in kinds["adam"]
    assert "layers.0.attn.sconv_k.weight" in kinds["adam"]
    assert "layers.0.attn_norm.0.weight" in kinds["adam"]  # RMSNorm gain
    for name in (
        "layers.0.attn.q_proj.weight",
        "layers.0.mlp.experts.gate_proj",
        "layers.0.mlp.shared.0.up_proj.weight",
        "layers.0.mlp.latent_down.weight",
        "layers.0.attn_norm.1.down.weight",
    ):
        assert name in kinds["muonh"], name
    assert sum(len(v) for v in kinds.values()) == len(list(model.parameters()))


def test_muonh_and_adamh_keep_every_matrix_norm():
    torch.manual_seed(1)
    model = build(tiny_config())
    opt = build_optimizer(model, MarinOptimizerConfig(lr=0.05, adam_lr=0.01))
    kinds = marin_param_kinds(model)
    hyper = [(n, p) for k in ("muonh", "adamh") for n, p in kinds[k]]
    before = {n: torch.linalg.vector_norm(p.detach(), dim=(-2, -1)).clone() for n, p in hyper}
    adam_before = {n: p.detach().clone() for n, p in kinds["adam"]}
    for _ in range(3):
        ids = torch.randint(0, 4096, (2, 32))
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    for n, p in hyper:
        after = torch.linalg.vector_norm(p.detach(), dim=(-2, -1))  # per expert for [E, in, out]
        torch.testing.assert_close(after, before[n], rtol=1e-5, atol=1e-6, msg=n)
        assert not torch.equal(p.detach(), hyper[0][1].detach()) or n == hyper[0][0]
    moved = [n for n, p in kinds["adam"] if not torch.equal(p.detach(), adam_before[n])]
    assert "embed.weight" in moved and "layers.0.mlp.router.weight" in moved


def test_muonh_windows_and_batches_do_not_change_the_step(monkeypatch):
    """Small gather windows and one-matrix batches give the same update as the defaults (in fp32:
    bf16's rounding of batched and single products may differ by an ulp, which the quintic
    schedule's larger coefficients carry into the next step)."""
    import marinlm.optim.marin as marin

    torch.manual_seed(3)
    models = [build(tiny_config()) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    ids = torch.randint(0, 4096, (2, 32))
    for i, model in enumerate(models):
        opt = build_optimizer(model, MarinOptimizerConfig(lr=0.05, adam_lr=0.01, ns_dtype="float32"))
        if i == 1:
            monkeypatch.setattr(marin.MarinOptimizer, "WINDOW_ELEMENTS", 5000)
            monkeypatch.setattr(marin, "ns_batch_elements", lambda device: 0)
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_muonh_step_matches_the_formula():
    """One MuonH step on a lone matrix, against the spec written out by hand."""
    torch.manual_seed(2)
    w = torch.nn.Parameter(torch.randn(8, 12))
    g = torch.randn(8, 12)
    from marinlm.optim.marin import MarinOptimizer

    opt = MarinOptimizer([{"params": [w], "kind": "muonh"}], lr=0.1, adam_lr=0.0, momentum=0.95, nesterov=True)
    w0 = w.detach().clone()
    w.grad = g.clone()
    opt.step()
    buf = g  # zero momentum buffer: buf = 0.95*0 + g
    direction = g + 0.95 * buf  # Nesterov
    u = newton_schulz(direction)
    stepped = w0 - 0.1 * u * w0.norm() / u.norm()
    expected = stepped * w0.norm() / stepped.norm()
    torch.testing.assert_close(w.detach(), expected, rtol=1e-5, atol=1e-6)


def hyperball(w, u, lr):
    """The hyperball step per matrix (per expert for [E, in, out]), written out."""
    norm = lambda t: torch.linalg.vector_norm(t, dim=(-2, -1), keepdim=True)  # noqa: E731
    stepped = w - lr * u * norm(w) / norm(u)
    return stepped * norm(w) / norm(stepped)


@pytest.mark.parametrize("nesterov", [True, False])
def test_muonh_momentum_over_steps_matches_the_formula(nesterov):
    """Three MuonH steps on a matrix and on stacked experts, against the momentum written out by hand."""
    from marinlm.optim.marin import MarinOptimizer

    torch.manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(3, 12, 8))]
    opt = MarinOptimizer([{"params": params, "kind": "muonh"}], lr=0.1, adam_lr=0.0, nesterov=nesterov)
    expected = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            bufs[i] = 0.95 * bufs[i] + g
            direction = g + 0.95 * bufs[i] if nesterov else bufs[i]
            expected[i] = hyperball(expected[i], newton_schulz(direction), 0.1)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)


def test_adam_and_adamh_groups_match_torch_adam():
    """The `adam` group steps as torch.optim.Adam, a parameter that missed a step keeping its own
    bias correction; `adamh` takes the same direction through the hyperball step."""
    from marinlm.optim.marin import MarinOptimizer

    torch.manual_seed(5)
    params = [
        torch.nn.Parameter(torch.randn(5, 3)),
        torch.nn.Parameter(torch.randn(4)),
        torch.nn.Parameter(torch.randn(6, 4)),
    ]
    peers = [torch.nn.Parameter(p.detach().clone()) for p in params[:2]]
    opt = MarinOptimizer(
        [{"params": params[:2], "kind": "adam"}, {"params": params[2:], "kind": "adamh"}], lr=0.2, adam_lr=0.01
    )
    peer = torch.optim.Adam(peers, lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    head = params[2].detach().clone()
    m, v = torch.zeros_like(head), torch.zeros_like(head)
    for step in range(1, 5):
        grads = [torch.randn_like(p) for p in params]
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if (i == 1 and step == 2) else g.clone()  # the vector misses step 2
        for p, q in zip(peers, params):
            p.grad = None if q.grad is None else q.grad.clone()
        opt.step()
        peer.step()
        m, v = 0.9 * m + 0.1 * grads[2], 0.95 * v + 0.05 * grads[2] ** 2
        direction = (m / (1 - 0.9**step)) / ((v / (1 - 0.95**step)).sqrt() + 1e-8)
        head = hyperball(head, direction, 0.2)
    for p, q in zip(params[:2], peers):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)
    assert opt.state[params[1]]["step"].item() == 3
    torch.testing.assert_close(params[2].detach(), head, rtol=1e-5, atol=1e-6)


def reference_muon(params, grads_per_step, lr, wd, momentum=0.95):
    """Plain Muon as Moonshot spells it (arXiv 2502.16982, Algorithm 1): Nesterov momentum,
    Newton-Schulz, decoupled weight decay, update scaled by 0.2 * sqrt(max(A, B)); one matrix (or
    expert) at a time."""
    weights = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(w) for w in weights]
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            bufs[i] = momentum * bufs[i] + g
            direction = g + momentum * bufs[i]
            matrices = direction.reshape(-1, *direction.shape[-2:])
            update = torch.stack([newton_schulz(m) for m in matrices]).reshape(direction.shape)
            scale = 0.2 * max(direction.shape[-2:]) ** 0.5
            weights[i] = weights[i] * (1 - lr * wd) - lr * scale * update
    return weights


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_plain_muon_matches_its_reference_spelling(wd):
    """`matrix_update: muon`: three steps on a matrix and on stacked experts, against Muon written out."""
    from marinlm.optim.marin import MarinOptimizer

    torch.manual_seed(6)
    params = [torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(3, 12, 8))]
    steps = [[torch.randn_like(p) for p in params] for _ in range(3)]
    expected = reference_muon(params, steps, lr=0.05, wd=wd)
    opt = MarinOptimizer([{"params": params, "kind": "muon"}], lr=0.05, adam_lr=0.0, weight_decay=wd)
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-6)


def test_decoupled_weight_decay_of_the_adam_group_matches_torch_adamw():
    """With `weight_decay` the Adam group's matrices step as torch.optim.AdamW; its gains take none."""
    from marinlm.optim.marin import MarinOptimizer

    torch.manual_seed(7)
    matrix, gain = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))
    peer_matrix, peer_gain = (torch.nn.Parameter(p.detach().clone()) for p in (matrix, gain))
    opt = MarinOptimizer([{"params": [matrix, gain], "kind": "adam"}], lr=0.0, adam_lr=0.01, weight_decay=0.1)
    peers = torch.optim.AdamW(
        [{"params": [peer_matrix], "weight_decay": 0.1}, {"params": [peer_gain], "weight_decay": 0.0}],
        lr=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for _ in range(4):
        for p, q in ((matrix, peer_matrix), (gain, peer_gain)):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        peers.step()
    torch.testing.assert_close(matrix.detach(), peer_matrix.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gain.detach(), peer_gain.detach(), rtol=1e-5, atol=1e-7)


def test_the_config_picks_plain_muon_for_the_matrices():
    model = build(tiny_config(num_layers=1))
    opt = build_optimizer(model, MarinOptimizerConfig(matrix_update="muon", weight_decay=0.1), "cpu")
    kinds = {g["kind"] for g in opt.param_groups}
    assert kinds == {"muon", "adamh", "adam"} and all(g["weight_decay"] == 0.1 for g in opt.param_groups)
    with pytest.raises(ConfigError, match="matrix_update: must be muonh or muon"):
        MarinOptimizerConfig(matrix_update="sgd")


@pytest.mark.parametrize(
    "kind, checks",
    [
        ("linear", {0: 1 / 11, 9: 10 / 11, 10: 1.0, 99: 0.05, 55: 1 - 0.95 * 45 / 89}),
        ("cosine", {0: 1 / 11, 10: 1.0, 99: 0.05}),
        ("wsd", {10: 1.0, 79: 1.0, 99: 0.05}),
    ],
)
def test_schedules_at_boundary_steps(kind, checks):
    config = ScheduleConfig(kind=kind, warmup_fraction=0.1, min_lr_ratio=0.05, decay_fraction=0.2)
    for step, value in checks.items():
        assert lr_multiplier(step, 100, config) == pytest.approx(value), (kind, step)
    values = [lr_multiplier(s, 100, config) for s in range(100)]
    assert max(values) == pytest.approx(1.0) and min(values) == pytest.approx(0.05)
    if kind == "wsd":
        assert lr_multiplier(80, 100, config) < 1.0


def test_hero_schedule_shape():
    config = ScheduleConfig(kind="linear", warmup_fraction=0.01, min_lr_ratio=0.05)
    total = 390_251
    warmup = round(0.01 * total)
    assert lr_multiplier(warmup, total, config) == 1.0
    assert lr_multiplier(warmup - 1, total, config) < 1.0
    assert lr_multiplier(total - 1, total, config) == pytest.approx(0.05)


def test_a_replanned_linear_schedule_bends_at_the_replan_without_a_jump():
    """A run of 100 steps (warmup 10) given 150 at step 40: the decay bends at step 40, from the
    multiplier the 100-step plan gave it, to the floor at step 149."""
    planned = ScheduleConfig(warmup_steps=10, min_lr_ratio=0.05)
    at = lr_multiplier(40, 100, planned)
    bent = ScheduleConfig(warmup_steps=10, min_lr_ratio=0.05, replan_step=40, replan_lr_ratio=at)
    for step in range(41):  # up to the replan: the earlier plan, warmup included
        assert lr_multiplier(step, 150, bent) == pytest.approx(lr_multiplier(step, 100, planned)), step
    assert lr_multiplier(41, 150, bent) == pytest.approx(at - (at - 0.05) / 109)
    assert lr_multiplier(95, 150, bent) == pytest.approx(at - (at - 0.05) * 55 / 109)
    assert lr_multiplier(149, 150, bent) == pytest.approx(0.05)
    # Shortened to end at the replan's own step: that step is the last, at the floor.
    assert lr_multiplier(40, 41, bent) == pytest.approx(0.05)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["--schedule.replan_step=40"], "schedule.replan_lr_ratio"),  # the one missing
        (["--schedule.replan_lr_ratio=0.5"], "schedule.replan_step"),
        (
            ["--schedule.kind=cosine", "--schedule.replan_step=40", "--schedule.replan_lr_ratio=0.5"],
            "schedule.replan_step",
        ),
        (["--schedule.replan_step=40", "--schedule.replan_lr_ratio=0.01"], "schedule.replan_lr_ratio"),
        (["--schedule.replan_step=-1", "--schedule.replan_lr_ratio=0.5"], "schedule.replan_step"),
    ],
)
def test_replan_fields_are_checked_and_named(overrides, key):
    from marinlm.train.config import TrainConfig

    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, overrides)
    assert info.value.key == key


def test_optimizer_config_errors_name_the_key():
    from marinlm.train.config import TrainConfig

    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, ["--optim.type=marin", "--optim.momentum=1.5"])
    assert info.value.key == "optim.momentum"
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, ["--schedule.kind=exponential"])
    assert info.value.key == "schedule.kind"
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, ["--data.seq_len=4096"])
    assert info.value.key == "data.seq_len" and "max_seq_len" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, ["--parallel.tensor_parallel=0"])
    assert info.value.key == "parallel.tensor_parallel"


def _gathered_on_ranks(rank: int, store: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from marinlm.optim.marin import _gather_many

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    try:
        torch.manual_seed(0)  # the same matrices on every rank
        shapes = [(10, 3), (7, 5), (1, 4), (4, 4), (6, 2, 3)]  # rows that do not divide, fewer than ranks
        whole = [torch.randn(*s, dtype=torch.float64 if i % 2 else torch.float32) for i, s in enumerate(shapes)]
        fsdp, hsdp = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
        params = [distribute_tensor(t, fsdp, [Shard(0)]) for t in whole]
        params += [distribute_tensor(t, hsdp, [Replicate(), Shard(0)]) for t in whole]
        params.append(distribute_tensor(whole[0], fsdp, [Shard(1)]))  # another cut: gathered on its own
        calls, gather = [], dist.all_gather_single
        dist.all_gather_single = lambda *a, **k: calls.append(1) or gather(*a, **k)
        try:
            gathered = _gather_many([p.to_local() for p in params], params)
        finally:
            dist.all_gather_single = gather
        assert len(calls) == 4  # two dtypes, two groups of ranks
        for got, p in zip(gathered, params, strict=True):
            assert torch.equal(got, p.full_tensor()), (p.shape, p.placements)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_muon_gathers_a_windows_sharded_matrices_in_one_all_gather_exactly(tmp_path):
    """FSDP2 and HSDP shards (dim 0, uneven, some ranks empty) of matrices of two dtypes come back
    whole through one all-gather a dtype and group, equal to DTensor's own gather; a matrix cut
    another way is gathered alone."""
    spawn_ranks(_gathered_on_ranks, (str(tmp_path / "store"),), 4)
