"""`marinlm plan`: local shards read under a fake process group equal a real gloo run's, the shard
rules of --search equal them too, the activation estimate against MemTracker, and the hero plan."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from marinlm.config import ConfigError, load_config
from marinlm.kernels.config import KernelConfig
from marinlm.parallel import ParallelConfig

from conftest import ROOT, spawn_ranks, tiny_config

REFERENCE = KernelConfig(modules="reference")  # the modules CUDA runs
LAYOUTS = {
    "tp-2xfsdp-2": {"tensor_parallel": 2},
    "ep-2xfsdp-2": {"expert_parallel": 2},
    "hsdp-2x2": {"data_parallel_replicate": 2},
    "pp-2xfsdp-2": {"pipeline_parallel": 2},
    "ep-2xtp-2": {"expert_parallel": 2, "tensor_parallel": 2},
    "pp-2xtp-2": {"pipeline_parallel": 2, "tensor_parallel": 2},
}


def plan_model():
    """Heads that split 4 ways, 4 layers (a pipeline needs a layer a stage), 16 experts."""
    return tiny_config(
        num_layers=4,
        max_seq_len=64,
        attention={"sliding_window": 16, "num_heads": 8, "head_dim": 16, "num_kv_heads": 8, "num_global_kv_heads": 4},
    )


def _real_shards(rank: int, store: str, results) -> None:
    from torch.distributed.tensor import DTensor

    from marinlm.model import MarinForCausalLM
    from marinlm.parallel import parallelize
    from marinlm.parallel.mesh import ParallelDims

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    try:
        for name, layout in LAYOUTS.items():
            parallel = ParallelConfig(**layout)
            dims = ParallelDims.resolve(parallel, 4).build_mesh("cpu")
            with torch.device("meta"):
                model = MarinForCausalLM(plan_model())
            model = parallelize(model, parallel, dims, rows=4, seq_len=64)
            results[(name, rank)] = {
                n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape) for n, p in model.named_parameters()
            }
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_planned_shards_equal_a_real_gloo_run_and_the_search_rules(tmp_path):
    from marinlm.plan.search import rule_shards
    from marinlm.plan.shards import local_shards

    real = mp.Manager().dict()
    spawn_ranks(_real_shards, (str(tmp_path / "store"), real), 4)
    for name, layout in LAYOUTS.items():
        for rank in range(4):
            planned = local_shards(plan_model(), ParallelConfig(**layout), 4, rank, 4, 64)
            assert {n: s["shape"] for n, s in planned.items()} == real[(name, rank)], (name, rank)
            ruled = rule_shards(plan_model(), ParallelConfig(**layout), 4, rank, 4, 64)
            assert {n: s["shape"] for n, s in ruled.items()} == real[(name, rank)], (name, rank)


def _measured_activations(config, rows: int, seq_len: int, precision: str) -> float:
    from torch.distributed._tools.mem_tracker import MemTracker

    from marinlm.model import MarinForCausalLM
    from marinlm.plan.op_table import packed_segments

    with torch.device("meta"):
        model = MarinForCausalLM(config)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    ids = torch.randint(0, config.vocab_size, (rows, seq_len))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):  # packed, as a step
        model(ids, packed_segments(rows, seq_len), labels=ids, return_logits=False).loss.backward()
    peaks = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return next(v for k, v in peaks.items() if "ACT" in str(k))


@pytest.mark.slow
@pytest.mark.parametrize("preset, precision", [("tiny", "fp32"), ("tiny", "bf16"), ("small", "fp32")])
def test_the_activation_estimate_is_within_15_percent_of_memtracker(preset, precision):
    """The reference modules (what CUDA runs), on the CPU: estimated from a small proxy of the same
    structure, measured by MemTracker in a real forward and backward."""
    from marinlm.model import MarinForCausalLM
    from marinlm.model.config import MarinConfig
    from marinlm.plan.activations import activation_bytes, inventory

    config = load_config(MarinConfig, str(ROOT / "configs" / "model" / f"{preset}.yaml"), [])
    config.moe.capacity_factor = None
    rows, seq_len = 2, 128
    with torch.device("meta"):
        weights = sum(p.numel() for p in MarinForCausalLM(config).parameters() if p.ndim >= 2)
    estimate = sum(
        activation_bytes(
            inventory(config, precision, REFERENCE), config, rows * seq_len, seq_len, weights=weights
        ).values()
    )
    measured = _measured_activations(config, rows, seq_len, precision)
    assert estimate == pytest.approx(measured, rel=0.15)


@pytest.mark.slow
def test_the_hero_plan_shows_six_experts_a_rank_and_a_verdict(tmp_path, capsys):
    """`marinlm plan configs/train/marin-535b-a23b.yaml --hardware gb200-nvl72` with the config's
    own layout (704 ranks, 11 replicas of a 64-way expert group, optimizer state on the host)."""
    from marinlm.plan import run_plan
    from marinlm.plan.allocator import reserved_bytes
    from marinlm.train.config import TrainConfig

    train = load_config(TrainConfig, str(ROOT / "configs" / "train" / "marin-535b-a23b.yaml"), [])
    content = run_plan(train, "gb200-nvl72", None, False, tmp_path)
    chosen = content["chosen"]
    assert chosen["world"] == 704 and chosen["ranks"][0]["local_experts"] == 6
    assert chosen["ranks"][0]["host"]["optimizer_state"] > 0 and "optimizer_state" not in chosen["ranks"][0]["device"]
    assert 0 < chosen["mfu"] < 1 and chosen["step"]["total"] > 0
    # A rank holds 1/64 of every weight (dense ones by FSDP over dp_shard, experts by ep), fp32.
    with torch.device("meta"):
        from marinlm.model import MarinForCausalLM

        total = sum(p.numel() for p in MarinForCausalLM(train.model).parameters())
    rank0 = chosen["ranks"][0]
    assert rank0["local_parameters"] == pytest.approx(total / 64, rel=1e-3)
    assert rank0["device"]["weights"] == rank0["device"]["gradients"] == 4 * rank0["local_parameters"]
    assert rank0["host"]["optimizer_state"] >= rank0["device"]["weights"]  # MuonH 1 copy, Adam 2
    # The verdict is the number behind it: the fullest rank's reserved bytes (its weights and optimizer state,
    # and the rest of its live bytes times the allocator's overhead on the step) against the GPU's.
    factor = chosen["allocator_overhead"]
    assert 1.0 < factor < 2.0
    fullest = max(reserved_bytes(r["device"], factor) for r in chosen["ranks"])
    live = max(sum(r["device"].values()) for r in chosen["ranks"])
    assert chosen["reserved_bytes"] == pytest.approx(fullest, rel=1e-9) and fullest > live
    assert chosen["fits"] == (fullest <= 186e9) and chosen["headroom_bytes"] == pytest.approx(186e9 - fullest, rel=1e-3)
    out = capsys.readouterr().out
    verdict = "fits" if chosen["fits"] else "does not fit"
    assert f"{verdict}: {fullest / 2**30:,.1f} GiB reserved ({live / 2**30:,.1f} GiB live)" in out
    for name in ("plan.md", "plan.json", "plan.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_activation_checkpointing_repeats_the_expert_all_to_alls():
    """A checkpointed block's recomputed forward exchanges the counts, dispatches and combines
    again: 5 all-to-alls a MoE layer and forward without, 8 with, and the rows' bytes 6/4."""
    from dataclasses import replace

    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware
    from marinlm.train.config import TrainConfig

    train = load_config(TrainConfig, str(ROOT / "configs" / "train" / "marin-535b-a23b.yaml"), [])
    plans = {}
    for ac in ("none", "full", "every_n"):  # every_n: every 2nd block
        parallel = replace(train.parallel, activation_checkpointing=ac, checkpoint_every_n=2)
        plans[ac] = plan_layout(train, parallel, 704, load_hardware("gb200-nvl72"), Efficiency())
    forwards = 48 * train.train.global_batch // (11 * 64) // (train.train.micro_batch or 1)  # layers x micro-batches
    calls = {ac: plan.all_to_all_calls / forwards for ac, plan in plans.items()}
    assert calls == {"none": 5, "full": 8, "every_n": 6.5}
    a2a = {ac: plan.step["expert_all_to_all"] for ac, plan in plans.items()}
    assert a2a["full"] == pytest.approx(a2a["none"] * 6 / 4, rel=1e-4)  # the counts' bytes are tiny
    assert a2a["every_n"] == pytest.approx(a2a["none"] * 5 / 4, rel=1e-4)


def _ep_config(token_data, folder, ac: str):
    from conftest import train_config

    return train_config(
        token_data,
        folder / f"ep-{ac}",
        train={"steps": 3},
        parallel={"expert_parallel": 2, "activation_checkpointing": ac},
        checkpoint={"every_steps": 0},
        validation={"every_steps": 0},
    )


@pytest.fixture(scope="module")
def ep_runs(token_data, tmp_path_factory):
    """EP 2 runs of 3 steps on 2 gloo ranks, without and with full activation checkpointing, trained
    one after the other in one launch."""
    from marinlm.config import save_config
    from test_layouts import train_each

    folder = tmp_path_factory.mktemp("ep-runs")
    for ac in ("none", "full"):
        save_config(_ep_config(token_data, folder, ac), folder / f"ep-{ac}.yaml")
    failed = train_each(folder, ["ep-none", "ep-full"], 2)
    assert failed is None, failed
    return folder


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ac", ["none", "full"])
def test_the_planned_expert_all_to_alls_are_those_a_real_run_makes(token_data, ep_runs, ac, monkeypatch):
    """EP 2 on 2 gloo ranks, 3 steps: the all-to-all calls a step the plan counts equal those the
    run makes (counted where they run, the gradients' in the backward), and its bytes equal the
    run's given the run's routing (the share of assignments whose expert sits on the other rank);
    at the plan's default share ((ep - 1) / ep, every rank routing alike) within 10%. (Timings,
    which the counts and bytes do not use, stated rather than measured.)"""
    from dataclasses import replace

    from marinlm.parallel.mesh import ParallelDims
    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware
    from marinlm.plan.routing import logged_loads, route
    from marinlm.train.metrics import read_metrics

    _stated_costs(monkeypatch, {"short_step": 0.3, "optimizer": 0.1, "units": []})
    config = _ep_config(token_data, ep_runs, ac)
    logged = [r for r in read_metrics(ep_runs / f"ep-{ac}") if "ep/a2a_bytes" in r]
    assert [r["step"] for r in logged] == [1, 2, 3]
    hardware, parallel = load_hardware("cpu"), replace(config.parallel, data_parallel_shard=2)
    dims = ParallelDims.resolve(parallel, 2)
    balanced = plan_layout(config, parallel, 2, hardware, Efficiency())
    layers = config.model.num_layers
    assert balanced.all_to_all_calls == (8 if ac == "full" else 5) * layers
    for r in logged:
        planned = plan_layout(config, parallel, 2, hardware, Efficiency(), remote_share=r["ep/remote_share"])
        assert r["ep/a2a_calls"] == planned.all_to_all_calls
        assert r["ep/a2a_bytes"] == pytest.approx(2 * planned.all_to_all_bytes, rel=1e-12)
        assert r["ep/a2a_bytes"] == pytest.approx(2 * balanced.all_to_all_bytes, rel=0.1)
    # The load imbalance the run logs is the one `--routing` plans from its logged loads: the step's
    # whole group of assignments, each layer's busiest rank's kept rows over the mean rank's.
    routed = route(config.model.moe, logged_loads(ep_runs / f"ep-{ac}", config.model.moe.num_experts), 128, dims)
    imbalance = [r["ep/kept_rows_max_over_mean"] for r in logged]
    assert routed.slowest == pytest.approx(sum(imbalance) / len(imbalance), rel=1e-9) and routed.slowest > 1


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_proxy_counts_the_operations_and_bytes_a_full_size_step_runs(precision):
    """The step-time model's memory-bound work (plan/ops.py), traced on a small proxy and scaled by
    width, against the same trace of `tiny` itself at 2 x 256 tokens: per layer kind and pass the
    operations agree within 10% and their bytes within 20%; the trainer's own work (norms and
    clipping per weight tensor, router statistics per MoE layer) within 20%. Dropping a layer's
    operations, as a broken estimate would, misses by far more."""
    from marinlm.plan.activations import widths
    from marinlm.plan.ops import _trace_ops, trace_ops
    from marinlm.train.config import TrainConfig

    config = load_config(TrainConfig, str(ROOT / "configs" / "train" / "tiny.yaml"), [])
    model, rows, seq = config.model, 2, 256
    proxy = trace_ops(model, config.optim, precision, config.kernels)
    full = _trace_ops(model, config.optim, precision, config.kernels, full_size=(rows, seq))
    width = widths(model, seq) | {"vocab": model.vocab_size}
    kinds = ["global" if model.is_global_layer(i) else "local" for i in range(model.num_layers)]

    def megabytes(inv, label):
        return rows * seq * sum(u * width.get(k, 1.0) for k, u in inv.bytes_per_token.get(label, {}).items()) / 1e6

    for label in [f"{kind}/{p}" for kind in ("local", "global", "outside") for p in ("forward", "backward")]:
        layers = kinds.count(label.split("/")[0]) or 1
        assert proxy.calls[label] * layers == pytest.approx(full.calls[label], rel=0.1), label
        assert megabytes(proxy, label) * layers == pytest.approx(megabytes(full, label), rel=0.2), label
        if layers > 1:
            assert proxy.calls[label] * (layers - 1) != pytest.approx(full.calls[label], rel=0.1), label
    moe = model.num_layers / proxy.moe_layers
    assert proxy.calls["step_layers"] * moe == pytest.approx(full.calls["step_layers"], rel=0.2)
    tensors = full.tensors / proxy.tensors
    assert proxy.calls["step_tensors"] * tensors == pytest.approx(full.calls["step_tensors"], rel=0.2)
    assert proxy.optimizer_calls_per_tensor == pytest.approx(full.optimizer_calls_per_tensor, rel=0.2)
    assert proxy.optimizer_bytes_per_weight == pytest.approx(full.optimizer_bytes_per_weight, rel=0.05)


def test_layout_overrides_and_errors_name_the_key():
    from marinlm.plan import parse_layout, world_of
    from marinlm.plan.hardware import load_hardware

    parallel = parse_layout("dp_shard=8,ep=8,pp=24,ac=full,offload=optimizer", ParallelConfig())
    assert (parallel.expert_parallel, parallel.pipeline_parallel, world_of(parallel)) == (8, 24, 192)
    assert parallel.activation_checkpointing == "full"
    with pytest.raises(ConfigError) as info:
        parse_layout("experts=8", ParallelConfig())
    assert info.value.key == "--layout"
    with pytest.raises(ConfigError) as info:
        world_of(ParallelConfig())
    assert info.value.key == "--layout"
    with pytest.raises(ConfigError, match="gb200-nvl72"):
        load_hardware("tpu-v9")
    hero = load_hardware("gb200-nvl72")
    assert hero.gpus_per_nvlink_domain == 72 and math.isclose(hero.peak_bf16_flops, 2.5e15)


def test_a_fine_tuning_plan_counts_gradients_and_optimizer_state_of_what_trains_only():
    """LoRA keeps the base's weights but not their gradients or Adam moments; QLoRA stores its linear
    layers and the experts in NF4; freeze trains its patterns; the rows of a step must
    divide among the data-parallel ranks (a batch of 8 over 64 ranks crashed the plan)."""
    from dataclasses import replace

    from marinlm.dataset import DataConfig
    from marinlm.finetune.config import FinetuneConfig, SFTDataConfig
    from marinlm.model import MarinForCausalLM
    from marinlm.model.summary import summarize
    from marinlm.optim import AdamWConfig
    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.finetune import NF4_BYTES, training
    from marinlm.plan.hardware import Efficiency, load_hardware

    model = plan_model()
    sft = SFTDataConfig(train_files=["x.jsonl"])
    base = FinetuneConfig(base="base-run", model=model, sft=sft, data=DataConfig(seq_len=64), optim=AdamWConfig())
    h100, eff = load_hardware("h100-sxm"), Efficiency()

    def rank0(method, world=2, **changes):
        config = replace(base, method=method, **changes)
        return plan_layout(config, ParallelConfig(data_parallel_shard=world), world, h100, eff).ranks[0]

    total = summarize(model).total
    full, lora = rank0("full"), rank0("lora")
    assert full.device["gradients"] == full.device["weights"] == pytest.approx(4 * total / 2, rel=0.05)
    assert full.device["optimizer_state"] == pytest.approx(2 * full.device["gradients"])
    adapters = training(replace(base, method="lora")).adapter_parameters
    assert 0 < adapters < total / 2
    # The LoRA factors, sharded with the model: this rank's share of them, their gradients, two moments.
    share = adapters * lora.local_parameters / total
    assert lora.device["weights"] == pytest.approx(full.device["weights"] + 4 * share)
    assert lora.device["gradients"] == pytest.approx(4 * share)
    assert lora.device["optimizer_state"] == pytest.approx(8 * share)
    with pytest.raises(ConfigError, match="method: qlora runs in one process, not 2"):
        rank0("qlora")
    qlora, lora_alone = rank0("qlora", world=1), rank0("lora", world=1)
    assert qlora.device["gradients"] == lora_alone.device["gradients"] == pytest.approx(4 * adapters)
    with torch.device("meta"):  # NF4 linear layers (not the head) and experts, the rest fp32
        modules = dict(MarinForCausalLM(model).named_modules())
    linear = sum(m.weight.numel() for n, m in modules.items() if type(m) is torch.nn.Linear and n != "lm_head")
    experts = sum(p.numel() for n, p in modules[""].named_parameters() if p.ndim == 3)
    stored = (linear + experts) * NF4_BYTES + 4 * (total - linear - experts) + 4 * adapters
    assert qlora.device["weights"] == pytest.approx(stored, rel=0.02) and stored < 0.6 * lora_alone.device["weights"]
    last = rank0("freeze", freeze=replace(base.freeze, last_layers=1))
    assert 0 < last.device["gradients"] < full.device["gradients"] / 2
    embeddings = rank0("lora", lora=replace(base.lora, train_embeddings=True))
    assert embeddings.device["gradients"] > lora.device["gradients"] + 4 * model.vocab_size * model.d_model / 2 * 0.9
    with pytest.raises(ConfigError, match="train.global_batch: 8 rows do not divide among 64"):
        plan_layout(base, ParallelConfig(data_parallel_shard=64), 64, h100, eff)


@pytest.mark.slow
def test_fault_tolerant_groups_are_planned_as_hsdp_plus_what_torchft_adds():
    """The hero's 11 racks as torchft replica groups: the same shards and all-reduce bytes as HSDP
    11, the all-reduce not hidden behind backward, and a flat gradient copy on each rank."""
    from marinlm.plan import parse_layout, world_of
    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware
    from marinlm.train.config import TrainConfig

    train = load_config(TrainConfig, str(ROOT / "configs" / "train" / "marin-535b-a23b.yaml"), [])
    hsdp = train.parallel
    ft = parse_layout(f"dp_replicate=1,ft={hsdp.data_parallel_replicate}", hsdp)
    assert world_of(ft) == world_of(hsdp) == 704
    hardware, eff = load_hardware("gb200-nvl72"), Efficiency()
    a, b = plan_layout(train, hsdp, 704, hardware, eff), plan_layout(train, ft, 704, hardware, eff)
    assert b.traffic == a.traffic
    assert b.step["ft_all_reduce"] == pytest.approx(a.step["hsdp_all_reduce"] / (1 - eff.overlap))
    gradients = a.ranks[0].device["gradients"]
    assert b.ranks[0].device["ft_gradient_buffer"] == gradients > 0
    assert b.ranks[0].device_total == pytest.approx(a.ranks[0].device_total + gradients)
    assert any("fault tolerance (11 replica groups)" in n for n in b.notes)


ACTIVATION_LAYOUTS = {
    "FSDP 4": {"data_parallel_shard": 4},
    "HSDP 2x2": {"data_parallel_replicate": 2, "data_parallel_shard": 2},
    "TP 2 x FSDP 2": {"tensor_parallel": 2, "data_parallel_shard": 2},
    "EP 2 x FSDP 2": {"expert_parallel": 2, "data_parallel_shard": 4},
    "EP 4": {"expert_parallel": 4, "data_parallel_shard": 4},
}
ACTIVATION_CASES = [("tiny", n, p, ac) for n in ACTIVATION_LAYOUTS for p in ("fp32", "bf16") for ac in ("none", "full")]
ACTIVATION_CASES += [("small", "FSDP 4", "bf16", ac) for ac in ("none", "full")]
# `small`'s wider heads split by tensor parallel, and its experts sent by expert parallel
ACTIVATION_CASES += [
    ("small", n, p, ac) for n in ("TP 2 x FSDP 2", "EP 2 x FSDP 2") for p in ("fp32", "bf16") for ac in ("none", "full")
]


def _activation_config(preset: str, precision: str, ac: str, layout: str):
    from dataclasses import replace

    from marinlm.train.config import TrainConfig

    overrides = [f"--model={ROOT / 'configs' / 'model' / preset}.yaml"]
    overrides += ["--train.global_batch=8", "--data.seq_len=128", f"--train.precision={precision}"]
    overrides += ["--model.moe.capacity_factor=null", f"--parallel.activation_checkpointing={ac}"]
    if layout.startswith("TP"):  # two tensor-parallel ranks split the heads (`small` has 6, 2 KV)
        kv = 4 if preset == "tiny" else 2
        overrides += [f"--model.attention.num_kv_heads={kv}", "--model.attention.num_global_kv_heads=2"]
    overrides += ["--kernels.modules=reference"]  # what CUDA runs, as the GPU plan assumes
    config = load_config(TrainConfig, str(ROOT / "configs" / "train" / "tiny.yaml"), overrides)
    return config, replace(config.parallel, **ACTIVATION_LAYOUTS[layout])


def _held_activations(rank: int, store: str, out: str) -> None:
    """Each case's activations a rank holds at the end of a forward (FSDPMemTracker's, in the
    autocast region, before backward), the model built and sharded as training builds it."""
    import json

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from marinlm.kernels import apply_kernels
    from marinlm.model import MarinForCausalLM
    from marinlm.parallel import _parallelize, autocast_caches_weights
    from marinlm.parallel.mesh import ParallelDims
    from marinlm.plan.op_table import packed_segments
    from marinlm.utils.device import autocast_context

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    held, weights, meshes = {}, {}, {}
    for preset, name, precision, ac in ACTIVATION_CASES:
        config, parallel = _activation_config(preset, precision, ac, name)
        if name not in meshes:  # one mesh a layout: each mesh adds process groups that later cases pay for
            meshes[name] = ParallelDims.resolve(parallel, 4).build_mesh("cpu")
        dims = meshes[name]
        with torch.device("meta"):
            model = MarinForCausalLM(config.model)
        apply_kernels(model, torch.device("cpu"), precision, config.kernels)
        model.to_empty(device="cpu")
        key = repr(config.model)  # initialised once a model (small's truncated normals take seconds)
        if key not in weights:
            model.init_weights(seed=0)
            weights[key] = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(weights[key])
        _parallelize(model, parallel, dims)
        rows = config.train.global_batch // dims.dp
        ids = torch.randint(0, config.model.vocab_size, (rows, 128), generator=torch.Generator().manual_seed(rank))
        segments = packed_segments(rows, 128)  # packed documents, as the loader gives them
        tracker = FSDPMemTracker(model, None)
        with tracker, autocast_context(torch.device("cpu"), precision, autocast_caches_weights(model)):  # as a step
            loss = model(ids, segments, labels=ids, return_logits=False).loss
            current = next(iter(tracker.get_tracker_snapshot("current").values()))
        held[f"{preset}|{name}|{precision}|{ac}"] = next(v for k, v in current.items() if "ACT" in str(k))
        del loss  # no backward: what a forward holds is measured
    with open(f"{out}.{rank}", "w") as f:
        json.dump(held, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_the_planned_activations_are_within_5_percent_of_real_gloo_layouts(tmp_path):
    """`tiny` on 4 gloo ranks, 2 rows of 128 tokens a data-parallel rank, each layout with and
    without full activation checkpointing, fp32 and bf16 (and `small` in bf16 under FSDP 4, and
    under TP 2 x FSDP 2 and EP 2 x FSDP 2 in both precisions, with and without checkpointing): the
    activations the plan says a rank holds when its forward ends (saved tensors, checkpointed
    blocks' inputs, autocast's weight copies, saved and cached) against what the real sharded
    model holds then (the mean over ranks: routing moves a few tokens between expert-parallel
    ranks), within 5%; one block fewer misses."""
    import json

    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware

    spawn_ranks(_held_activations, (str(tmp_path / "store"), str(tmp_path / "held")), 4)
    held = [json.loads((tmp_path / f"held.{rank}").read_text()) for rank in range(4)]
    for preset, name, precision, ac in ACTIVATION_CASES:
        key = f"{preset}|{name}|{precision}|{ac}"
        config, parallel = _activation_config(preset, precision, ac, name)
        device = plan_layout(config, parallel, 4, load_hardware("h100-sxm"), Efficiency()).ranks[0].device
        real = sum(h[key] for h in held) / 4
        assert device["activations"] == pytest.approx(real, rel=0.05), key
        assert device["activations"] - device["temporaries"] != pytest.approx(real, rel=0.05), key


PIPELINE_CASES = [(p, ac) for p in ("fp32", "bf16") for ac in ("none", "full")]


def _pipeline_config(precision: str, ac: str):
    from dataclasses import replace

    config, _ = _activation_config("tiny", precision, ac, "FSDP 4")
    return config, replace(config.parallel, pipeline_parallel=2, data_parallel_shard=2)


def _sample_alive(created, samples: list, excluded, *_) -> None:
    samples.append(sum(s.nbytes() for s in list(created.storages.keys()) if s.data_ptr() not in excluded()))


def _then(fn, after, *args):
    result = fn(*args)
    after()
    return result


def _held_by_pipeline_stages(rank: int, store: str, out: str) -> None:
    """Each case's peak, over a step's 1F1B schedule, of what this rank's stage holds at the end of
    each of its forwards (and, on the last stage, each loss): the storages the step's operations
    created that are still alive (as FSDPMemTracker counts activations, which cannot follow the
    schedule), less the weights, gradients and FSDP2's gathered weights and unsharded gradients.
    The second step is measured (the first also infers the stages' shapes)."""
    import json

    from torch.distributed.fsdp import FSDPModule
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.weak import WeakIdKeyDictionary

    from marinlm.kernels import apply_kernels
    from marinlm.model import MarinForCausalLM
    from marinlm.parallel import parallelize
    from marinlm.parallel.mesh import ParallelDims
    from marinlm.plan.op_table import packed_segments

    class Created(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.storages = WeakIdKeyDictionary()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in tree_leaves(result):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                    self.storages[t.untyped_storage()] = True
            return result

    def model_storages(pipelined) -> set:
        tensors = [t for p in pipelined.parameters() for t in (p, p.grad) if t is not None]
        for module in pipelined.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            for fsdp_param in group.fsdp_params if group else ():
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                tensors += [unsharded, getattr(unsharded, "grad", None), fsdp_param.unsharded_accumulated_grad]
        return {getattr(t, "_local_tensor", t).untyped_storage().data_ptr() for t in tensors if t is not None}

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    cpu, held, dims = torch.device("cpu"), {}, None
    for precision, ac in PIPELINE_CASES:
        config, parallel = _pipeline_config(precision, ac)
        if dims is None:  # one mesh for every case: they differ in precision and checkpointing only
            dims = ParallelDims.resolve(parallel, 4).build_mesh("cpu")
        with torch.device("meta"):
            model = MarinForCausalLM(config.model)
        apply_kernels(model, cpu, precision, config.kernels)
        rows = config.train.global_batch // dims.dp
        pipelined = parallelize(model, parallel, dims, device=cpu, rows=rows, seq_len=128)
        for stage in pipelined.stages:
            stage.to_empty(device="cpu")
            stage.init_weights(seed=0)
        ids = torch.randint(0, config.model.vocab_size, (rows, 128), generator=torch.Generator().manual_seed(rank))
        batches = [
            {"input_ids": ids[i : i + 1], "segment_ids": packed_segments(1, 128), "labels": ids[i : i + 1]}
            for i in range(rows)
        ]
        created, samples = Created(), []
        sample = functools.partial(_sample_alive, created, samples, functools.partial(model_storages, pipelined))
        for stage in pipelined.stages:
            stage.register_forward_hook(sample)
        pipelined.schedule._loss_fn = functools.partial(_then, pipelined.schedule._loss_fn, sample)
        for _ in range(2):
            samples.clear()
            with created:
                pipelined.forward_backward(
                    batches, device=cpu, precision=precision, global_tokens=8 * 128, world_size=dims.dp
                )
            pipelined.zero_grad(set_to_none=True)
        held[f"{precision}|{ac}"] = max(samples)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(held, f)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_the_planned_pipeline_stages_hold_what_real_gloo_stages_hold(tmp_path):
    """`tiny` under PP 2 x FSDP 2 (1F1B, 4 microbatches of one row of 128 tokens), fp32 and bf16,
    with and without full activation checkpointing: the plan's activations, pipeline buffers and
    router margins of each stage against the peak of what its real ranks hold through a step."""
    import json

    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware

    spawn_ranks(_held_by_pipeline_stages, (str(tmp_path / "store"), str(tmp_path / "held")), 4)
    held = [json.loads((tmp_path / f"held.{rank}").read_text()) for rank in range(4)]
    for precision, ac in PIPELINE_CASES:
        config, parallel = _pipeline_config(precision, ac)
        plan = plan_layout(config, parallel, 4, load_hardware("h100-sxm"), Efficiency())
        for stage in (0, 1):
            device = plan.ranks[stage].device
            planned = device["activations"] + device["pipeline_buffers"] + device["router_margins"]
            real = sum(held[rank][f"{precision}|{ac}"] for rank in (2 * stage, 2 * stage + 1)) / 2
            print(f"PP stage {stage} {precision} {ac}: planned {planned / 1e6:.3f} MB, real {real / 1e6:.3f}")
            assert planned == pytest.approx(real, rel=0.05), (stage, precision, ac)
            one_fewer = planned - device["activations"] / (2 - stage)  # a microbatch fewer in flight
            assert one_fewer != pytest.approx(real, rel=0.05), (stage, precision, ac)


def _stated_costs(monkeypatch, layout: dict) -> None:
    """The plan's timings stated, so that its arithmetic is checked whatever the host's speed: the
    layout's short step, a step's operations (0.5 s; the short row's 0.02 s), the ranks slowing
    each other 2x (a short row 1.5x), gloo's latency and bandwidth."""
    import marinlm.plan.cpu_step as cpu_step
    import marinlm.plan.estimate as estimate

    monkeypatch.setattr(estimate, "measure_here", lambda *args: layout)
    monkeypatch.setattr(estimate, "measured_compute", lambda train, *a, **k: 0.02 if train.data.seq_len == 8 else 0.5)
    monkeypatch.setattr(
        estimate, "measure_contention", lambda train, world, rows: 1.0 if world == 1 else 1.5 + 0.5 * (rows > 1)
    )
    monkeypatch.setattr(cpu_step, "measure_gloo", lambda world: (1e-4, 1e9))


def test_a_gloo_layout_is_priced_from_its_real_step_on_a_short_row(monkeypatch):
    """`--hardware cpu` under FSDP 2: what the layout adds is the real step (`train_step`: FSDP2's
    gathers, reductions and hooks, the reductions, the optimizer) timed in two gloo processes
    holding the model sharded by the real `parallelize`, on a row of `SHORT_TOKENS` tokens, less
    that row's own compute priced as the step's is; the optimizer as timed alone. (Each FSDP2
    unit's gather and reduction are timed too: pipeline stages are priced from them.) The timings
    vary with the host's load, so the plan's sums are checked on stated ones."""
    from dataclasses import replace

    from marinlm.plan.cpu_step import SHORT_TOKENS, measure_layout
    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware
    from marinlm.train.config import TrainConfig

    overrides = ["--train.global_batch=4", "--data.seq_len=64", "--train.precision=fp32"]
    overrides += ["--model.vocab_size=1001"]  # shards of unequal size (FSDP2 pads them): one reduction
    config = load_config(TrainConfig, str(ROOT / "configs" / "train" / "tiny.yaml"), overrides)
    parallel = replace(config.parallel, data_parallel_shard=2)
    layout = measure_layout(config, parallel, 2, rows=2)
    layers = config.model.num_layers
    assert [resharded for _, _, resharded in layout["units"]] == [False] + [True] * layers  # the root first
    assert all(gather > 0 and reduce > 0 for gather, reduce, _ in layout["units"])
    assert layout["short_step"] > 0 and layout["optimizer"] > 0
    assert SHORT_TOKENS == 8
    _stated_costs(monkeypatch, {"short_step": 0.3, "optimizer": 0.1, "units": layout["units"]})
    plan = plan_layout(config, parallel, 2, load_hardware("cpu"), Efficiency())
    assert "fsdp" not in plan.step and "optimizer_collectives" not in plan.step
    # The step's operations slowed 2x; the short row's own compute (0.02 s slowed 1.5x) taken off.
    assert plan.step["compute"] == 0.5 * 2.0 and plan.step["optimizer"] == 0.1
    assert plan.step["layout"] == pytest.approx(0.3 - 0.1 - 0.02 * 1.5)
    assert plan.step["total"] == pytest.approx(1.0 + 0.3 - 0.02 * 1.5)


def test_one_process_is_priced_with_its_host_work_timed_on_a_short_row(monkeypatch):
    """`--hardware cpu`, one process, its blocks checkpointed: the operations priced from the table,
    the optimizer's step timed, and the host's work beside the operations (Python, autograd, the
    trainer's own) as the real step on a row of `SHORT_TOKENS` tokens less that row's own compute
    (the plan's sums on stated timings, as above)."""
    from dataclasses import replace

    from marinlm.plan.cpu_step import measure_alone
    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware
    from marinlm.train.config import TrainConfig

    overrides = ["--train.global_batch=2", "--data.seq_len=64", "--train.precision=fp32"]
    config = load_config(TrainConfig, str(ROOT / "configs" / "train" / "tiny.yaml"), overrides)
    parallel = replace(config.parallel, activation_checkpointing="full")
    layout = measure_alone(config, parallel, rows=2)
    assert layout["short_step"] > 0 and layout["optimizer"] > 0
    _stated_costs(monkeypatch, {"short_step": 0.3, "optimizer": 0.1})
    plan = plan_layout(config, parallel, 1, load_hardware("cpu"), Efficiency())
    assert plan.step["optimizer"] == 0.1 and "layout" not in plan.step
    assert plan.step["compute"] == 0.5 and plan.step["host"] == pytest.approx(0.3 - 0.1 - 0.02)
    assert plan.step["total"] == pytest.approx(0.5 + 0.3 - 0.02)
    assert "host's work beside them" in " ".join(plan.notes)


def test_the_ranks_contention_is_timed_on_the_steps_own_forward_and_backward(monkeypatch, tmp_path):
    """`measure_contention` times the trainer's forward and backward of a micro-batch of the run's
    model (its rows, sequence and precision), alone and on every rank at once, and returns their
    ratio, never under the ranks over the cores; one rank is 1 and nothing is timed. Timings and the
    group's result are stated here, so nothing depends on this host's speed."""
    import os

    from marinlm.plan import contention, op_table
    from marinlm.train import step as train_step_module
    from marinlm.train.config import TrainConfig

    overrides = ["--train.global_batch=4", "--data.seq_len=32", "--train.precision=bf16"]
    config = load_config(TrainConfig, str(ROOT / "configs" / "train" / "tiny.yaml"), overrides)
    seen = []
    monkeypatch.setattr(
        train_step_module, "forward_backward", lambda model, batches, **how: seen.append((model, batches, how))
    )
    contention._micro_step(config, 3)()
    ((model, batches, how),) = seen
    assert model.config == config.model and how["precision"] == "bf16" and how["global_tokens"] == 3 * 32
    assert [tuple(batches[0][k].shape) for k in ("input_ids", "labels", "loss_mask")] == [(3, 32)] * 3

    spawned = []

    def spawn(fn, args, nprocs):
        assert fn is contention._worker and nprocs == args[0] == 4 and args[3] is config and args[4] == 2
        spawned.append(nprocs)
        with open(args[2], "w") as f:
            f.write(repr(stated["together"]))

    monkeypatch.setattr(torch.multiprocessing, "spawn", spawn)
    monkeypatch.setattr(op_table, "best_seconds", lambda fn: stated["alone"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    floor = max(4 / cores, 1.0)
    monkeypatch.setattr(contention, "_MEASURED", {})
    stated = {"alone": 0.5, "together": 0.5 * (floor + 1.5)}
    assert contention.measure_contention(config, 4, 2) == pytest.approx(floor + 1.5)
    stated["together"] = 0.1  # faster together than alone: the floor
    assert contention.measure_contention(config, 4, 2) == pytest.approx(floor + 1.5)  # measured once
    monkeypatch.setattr(contention, "_MEASURED", {})
    assert contention.measure_contention(config, 4, 2) == pytest.approx(floor)
    assert contention.measure_contention(config, 1, 2) == 1.0 and spawned == [4, 4]


def test_on_shared_cores_the_pipeline_bubble_computes_at_its_stage_ranks_contention(monkeypatch):
    """`--hardware cpu`, PP 2 on 2 gloo ranks: the step's compute is slowed as much as all its ranks
    slow each other on these cores, but in the schedule's bubble one stage idles and leaves the cores
    to the other's ranks: the bubble's compute is priced at the contention of world / pp ranks. Here
    the ranks are stated to slow each other 3x together and not at all alone."""
    from dataclasses import replace

    from marinlm.parallel.pipeline_parallel import bubble_fraction
    from marinlm.plan import estimate
    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware
    from marinlm.train.config import TrainConfig

    overrides = ["--train.global_batch=4", "--data.seq_len=64", "--train.precision=fp32"]
    config = load_config(TrainConfig, str(ROOT / "configs" / "train" / "tiny.yaml"), overrides)
    parallel = replace(config.parallel, pipeline_parallel=2, data_parallel_shard=1)
    steps = {}
    for together in (3.0, 1.0):
        slowed = {2: together, 1: 1.0}
        monkeypatch.setattr(estimate, "measure_contention", lambda train, w, rows, s=slowed: s[w])
        steps[together] = plan_layout(config, parallel, 2, load_hardware("cpu"), Efficiency()).step
    bubble = bubble_fraction(parallel.pipeline_schedule, 2, 4, 1)
    for together, step in steps.items():
        busy = sum(v for k, v in step.items() if k not in ("optimizer", "pipeline_bubble", "total"))
        idle = busy - step["compute"] * (1 - 1 / together)
        assert step["pipeline_bubble"] == pytest.approx(idle * bubble / (1 - bubble))
    assert steps[3.0]["compute"] == pytest.approx(3 * steps[1.0]["compute"])
    assert steps[3.0]["pipeline_bubble"] < 3 * steps[1.0]["pipeline_bubble"]


def test_a_tensor_parallel_layout_is_priced_from_its_collectives_timed_in_its_group(monkeypatch):
    """`--hardware cpu` under TP 2: its sequence gathers, reduce-scatters and the replicated
    weights' gradient all-reduce are timed in the tp group (what a pipeline stage's exchanges are
    priced from: each block's two a forward, as many in backward and again in a checkpointed block's
    recomputed forward, and the head's); without stages, the real step on a short row plus those
    exchanges' time at the micro-batch's size beyond the latency the short row's paid; the compute
    is the op-priced share of a tp rank (a tp-th of the heads and hidden widths), not the roofline,
    and a checkpointed forward is priced again."""
    from dataclasses import replace

    from marinlm.plan import estimate
    from marinlm.plan.cpu_step import measure_gloo, measure_layout, tensor_parallel_share
    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware
    from marinlm.train.config import TrainConfig

    overrides = ["--train.global_batch=2", "--data.seq_len=64", "--train.precision=fp32"]
    overrides += ["--model.attention.num_kv_heads=4", "--model.attention.num_global_kv_heads=2"]
    config = load_config(TrainConfig, str(ROOT / "configs" / "train" / "tiny.yaml"), overrides)
    share = tensor_parallel_share(config.model, 2)
    assert share.attention.num_heads * 2 == config.model.attention.num_heads
    assert (
        share.moe.expert_dim * 2 == config.model.moe.expert_dim and share.moe.latent_dim == config.model.moe.latent_dim
    )
    compute, counted = {}, []
    parts = estimate.short_step_parts
    monkeypatch.setattr(estimate, "short_step_parts", lambda *args: counted.append(args[4]) or parts(*args))
    for ac in ("none", "full"):
        parallel = replace(config.parallel, tensor_parallel=2, data_parallel_shard=1, activation_checkpointing=ac)
        layout = measure_layout(config, parallel, 2, rows=2)
        gather, scatter, replicated = layout["tensor_parallel"]
        assert gather > 0 and scatter > 0 and replicated > 0
        plan = plan_layout(config, parallel, 2, load_hardware("cpu"), Efficiency())
        assert plan.step["total"] > layout["short_step"] > 0
        exchanges = config.model.num_layers * 2 * (3 if ac == "full" else 2) + 1  # one micro-batch
        latency = measure_gloo(2)[0]
        assert counted[-1] == exchanges
        assert plan.step["tensor_parallel"] == pytest.approx(exchanges * max(gather + scatter - 2 * latency, 0))
        assert any("priced from costs measured here" in note for note in plan.notes)
        compute[ac] = plan.step["compute"]
    # the recomputed forward: about a third more (a forward of the blocks, not of the head and loss)
    assert 1.1 * compute["none"] < compute["full"] < 1.5 * compute["none"]


def test_autocast_keeps_no_weight_copies_where_fsdp_or_checkpointing_frees_them():
    """A step's autocast caches its bf16 weight copies for the forward only where nothing frees a
    block's weights or activations after it: not with checkpointed blocks (nor FSDP2 units)."""
    from marinlm.model import MarinForCausalLM
    from marinlm.parallel import autocast_caches_weights
    from marinlm.parallel.activation_checkpoint import apply_activation_checkpointing

    model = MarinForCausalLM(tiny_config())
    assert autocast_caches_weights(model)
    apply_activation_checkpointing(model, "full", 1)
    assert not autocast_caches_weights(model)


def test_the_experts_are_timed_as_each_layout_runs_them(monkeypatch):
    """The op table times the fused kernel for a rank holding every expert, and what
    `ExpertParallelExperts` runs for one holding a share (`run_experts` on the rows it received),
    each on a new routing a call after warm-up routings: a step's counts are new."""
    from marinlm.model.experts import RoutedExperts
    from marinlm.plan.op_table import WARM_ROUTINGS, MeasuredTable
    from marinlm.train.config import TrainConfig

    config = load_config(TrainConfig, str(ROOT / "configs" / "train" / "tiny.yaml"), [])
    counts = []
    run_experts = RoutedExperts.run_experts
    monkeypatch.setattr(
        RoutedExperts,
        "run_experts",
        lambda self, x, c, impl: counts.append(c.tolist()) or run_experts(self, x, c, impl),
    )
    E = config.model.moe.num_experts
    MeasuredTable(config.model, "fp32", config.kernels, experts_local=E).experts(256)
    assert counts == []  # the fused kernel, every expert here
    MeasuredTable(config.model, "fp32", config.kernels, experts_local=E // 2).experts(256)
    assert len(counts) > WARM_ROUTINGS and all(
        len(c) == E // 2 and sum(c) == 256 * config.model.moe.top_k for c in counts
    )
    assert len({tuple(c) for c in counts}) == len(counts)  # a new routing each call


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_blocks_timed_memory_work_is_what_the_op_trace_files_and_is_charged_a_pass(monkeypatch, precision):
    """On a CPU the blocks' memory-bound work is timed as a block runs it (`MeasuredTable.block_memory`):
    with a clock that ticks once a reading, what it times in one block of each kind, forward and
    backward, is the operations the op trace of a full-size step files under that kind and pass
    (GEMMs, views, attention's core and the routed experts left out of both); `price_step` charges a
    block's forward once, twice when the block is checkpointed, and its backward once."""
    import itertools

    from marinlm.plan.activations import layer_kind
    from marinlm.plan.op_table import MeasuredTable
    from marinlm.plan.ops import _KernelTimer, _trace_ops, price_step
    from marinlm.train.config import TrainConfig

    overrides = ["--train.global_batch=2", "--data.seq_len=64", f"--train.precision={precision}"]
    config = load_config(TrainConfig, str(ROOT / "configs" / "train" / "tiny.yaml"), overrides)
    model, rows, seq = config.model, 2, 64
    full = _trace_ops(model, config.optim, precision, config.kernels, full_size=(rows, seq))
    kinds = [layer_kind(model, i) for i in range(model.num_layers)]
    ticks = itertools.count()
    monkeypatch.setattr(_KernelTimer, "clock", staticmethod(lambda: next(ticks)))
    table = MeasuredTable(model, precision, config.kernels)
    for i in range(model.num_layers):  # a block keeps its kind in the model the table cuts after it
        assert layer_kind(table._model(i).config, i) == kinds[i]
    for kind in set(kinds):
        forward, backward = table.block_memory(kind, rows, seq)
        # The forward's context (RoPE tables, masks) is built once a forward, in its first block: not a block's
        assert forward * kinds.count(kind) == pytest.approx(full.calls[f"{kind}/forward"], rel=0.1), kind
        assert forward * (kinds.count(kind) - 1) < 0.9 * full.calls[f"{kind}/forward"]
        assert backward * kinds.count(kind) == full.calls[f"{kind}/backward"], kind
    monkeypatch.undo()
    for kind in set(kinds):  # stated seconds: a forward 1, a backward 100
        table._cache[("block_memory", kind, rows, seq)] = (1.0, 100.0)
    charged = {}
    for recompute in (0.0, 1.0):
        part = price_step(
            config, table, full, rows=rows, forwards=1, layers=range(model.num_layers), recompute=recompute
        )
        charged[recompute] = part["memory"]
    assert charged[1.0] - charged[0.0] == pytest.approx(model.num_layers * 1.0)
    assert charged[0.0] > model.num_layers * 101.0
