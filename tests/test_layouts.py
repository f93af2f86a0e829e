"""Parallel layouts: the degrees checked against the ranks and the model, and loss parity of each
layout against one process (gloo, 4 processes), in float64 over 6 steps and fp32 over 3."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from marinlm.config import ConfigError, load_config, save_config
from marinlm.jobs import run_training
from marinlm.parallel import ParallelConfig
from marinlm.parallel.mesh import ParallelDims
from marinlm.train.config import TrainConfig
from marinlm.train.metrics import read_metrics

from conftest import ROOT, tiny_config, torchrun_command, train_config


def dims(world: int, **degrees) -> ParallelDims:
    return ParallelDims.resolve(ParallelConfig(**degrees), world)


def test_degrees_fill_the_world_and_name_the_key_when_they_cannot():
    assert dims(4) == ParallelDims(dp_replicate=1, dp_shard=4, tp=1, ep=1, pp=1)
    assert dims(8, data_parallel_replicate=2, tensor_parallel=2).dp_shard == 2
    assert dims(4, data_parallel_replicate=2).dp == 4
    with pytest.raises(
        ConfigError, match=r"^parallel: .* does not divide the 4 ranks; valid tensor_parallel.*\[1, 2, 4\]"
    ):
        dims(4, tensor_parallel=3)
    with pytest.raises(ConfigError, match="makes 6 ranks, but 4 were launched"):
        dims(4, data_parallel_shard=3, tensor_parallel=2)
    with pytest.raises(
        ConfigError,
        match="parallel.expert_parallel: 4 must divide data_parallel_shard x context_parallel x tensor_parallel = 2",
    ):
        dims(4, data_parallel_replicate=2, expert_parallel=4)
    with pytest.raises(ConfigError, match="data_parallel_shard: must be >= 1, or -1"):
        ParallelConfig(data_parallel_shard=0)


def test_context_parallel_degrees_fill_the_world_and_bad_ones_name_the_key():
    """cp ranks come out of the world beside dp_shard (experts may borrow them); a degree that does not
    divide the ranks, a row it cannot cut into 2 x cp chunks, or a capacity that drops
    (which depends on the whole row) each name the key and what would be valid."""
    assert dims(4, context_parallel=2) == ParallelDims(dp_replicate=1, dp_shard=2, tp=1, ep=1, pp=1, cp=2)
    assert dims(8, context_parallel=2, expert_parallel=4).efsdp == 2  # 4 x 2 / 4
    assert dims(4, context_parallel=2).describe() == "pp 1 x dp_replicate 1 x dp_shard 2 x cp 2 x tp 1"
    with pytest.raises(ConfigError, match=r"^parallel.context_parallel: .* does not divide the 4 ranks.*\[1, 2, 4\]"):
        dims(4, context_parallel=3)
    with pytest.raises(ConfigError, match="context_parallel: must be >= 1, got 0"):
        ParallelConfig(context_parallel=0)
    layout = dims(4, context_parallel=4)
    with pytest.raises(ConfigError, match=r"parallel.context_parallel: 4 cuts each row into 8 .* 36 tokens"):
        layout.check_model(tiny_config(), 36)
    with pytest.raises(ConfigError, match="rows hold 4 tokens"):  # too short for 2 x cp chunks
        layout.check_model(tiny_config(), 4)
    layout.check_model(tiny_config(), 64)
    with pytest.raises(ConfigError, match="model.moe.capacity_factor: 1.25: context parallel .* capacity_factor: null"):
        layout.check_capacity(tiny_config(moe={"capacity_factor": 1.25}))
    layout.check_capacity(tiny_config(moe={"capacity_factor": None}))


def test_degrees_that_do_not_split_the_model_name_the_key():
    model = tiny_config()  # 4 heads, 2 KV heads (1 in global layers), 16 experts
    layout = dims(4, tensor_parallel=2)
    with pytest.raises(
        ConfigError, match=r"parallel.tensor_parallel: 2 must divide model.attention.num_global_kv_heads"
    ):
        layout.check_model(model)
    with pytest.raises(ConfigError, match=r"parallel.expert_parallel: 3 must divide model.moe.num_experts = 16"):
        ParallelDims(1, 3, 1, 3, 1).check_model(model)
    dims(4).check_model(model)


def torchrun(config_path, nproc: int, *extra) -> None:
    out = subprocess.run(
        [*torchrun_command(nproc), "-m", "marinlm", "train", str(config_path), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def curves(run_dir) -> dict[int, tuple[float, float, tuple]]:
    """Per step: loss, gradient norm and each layer's dropped fraction."""

    def dropped(r):
        return {k: v for k, v in r.items() if k.startswith("router/") and k.endswith("/dropped_fraction")}

    return {
        r["step"]: (r["train/loss"], r["train/grad_norm"], dropped(r))
        for r in read_metrics(run_dir)
        if "train/loss" in r
    }


def val_losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["val/loss"] for r in read_metrics(run_dir) if "val/loss" in r}


def router_biases(run_dir) -> list[torch.Tensor]:
    from marinlm.loading import load_model

    model = load_model(run_dir).model  # one process, resharding the layout's checkpoint
    return [m.router.bias.clone() for m in model.modules() if hasattr(m, "router")]


LAYOUTS = {
    "fsdp-4": {},
    "hsdp-2x2": {"data_parallel_replicate": 2},
    "tp-2xfsdp-2": {"tensor_parallel": 2},
    "tp-4": {"tensor_parallel": 4},
    "tp-2xhsdp-2x1": {"tensor_parallel": 2, "data_parallel_replicate": 2},
    "ep-2xfsdp-2": {"expert_parallel": 2},
    "ep-4": {"expert_parallel": 4},
    "ep-2xhsdp-2x2": {"expert_parallel": 2, "data_parallel_replicate": 2},
    "ep-2xtp-2": {"expert_parallel": 2, "tensor_parallel": 2},
    "pp-2": {"pipeline_parallel": 2},
    "pp-2xfsdp-2": {"pipeline_parallel": 2},
    "pp-2-interleaved-4-stages": {"pipeline_parallel": 2, "pipeline_schedule": "Interleaved1F1B", "stages_per_rank": 2},
    "pp-2-zbv": {"pipeline_parallel": 2, "pipeline_schedule": "ZBVZeroBubble"},
    "pp-2xtp-2": {"pipeline_parallel": 2, "tensor_parallel": 2},
    "pp-2xep-2": {"pipeline_parallel": 2, "expert_parallel": 2},
    "cp-2": {"context_parallel": 2},
    "cp-4": {"context_parallel": 4},
    "cp-2xfsdp-2": {"context_parallel": 2},
    "cp-2xtp-2": {"context_parallel": 2, "tensor_parallel": 2},
    "cp-2xep-2": {"context_parallel": 2, "expert_parallel": 2},
    "cp-2xpp-2": {"context_parallel": 2, "pipeline_parallel": 2},
}
# the rest run on 4; CP 2 x EP 2 on 2 borrows the experts' ranks from the cp ranks
PROCESSES = {"pp-2": 2, "pp-2-interleaved-4-stages": 2, "pp-2-zbv": 2, "cp-2": 2, "cp-2xep-2": 2}


def layers_of(layout: str) -> int:
    """Pipelines need a layer a stage: those with 4 stages (and the one process they are checked
    against) use 4 layers; 2 stages split the usual 2."""
    return 4 if layout in ("pp-2-interleaved-4-stages", "pp-2-zbv") else 2


# Float64 runs take 6 steps (every run in the suite's time; drops, QB biases and Muon's state all
# move by then). Their parity is checked by test_a_checkpoint_moves_between_layouts for these, whose
# uninterrupted run of the same steps (with a checkpoint half-way) is compared with one process there.
STEPS = 6
RESHARDED = ("tp-2xfsdp-2", "ep-2xfsdp-2", "pp-2xfsdp-2", "cp-2xfsdp-2")
CASES = [("fp64", STEPS, 1e-9, name) for name in LAYOUTS if name not in RESHARDED] + [
    ("fp32", 3, 1e-5, "tp-2xfsdp-2"),
    ("fp32", 3, 1e-5, "ep-2xfsdp-2"),
    ("fp32", 3, 1e-5, "pp-2xfsdp-2"),
    # Under bf16 autocast the stages' hidden states stay fp32: validation must send what a stage holds.
    # 4 microbatches of 2 rows round differently from one of 8: 0.3% in loss, 1.5% in grad norm by step 3.
    ("bf16", 3, 5e-2, "pp-2xfsdp-2"),
]


# Rows in one forward over all data ranks: the step's 8, or a pipeline microbatch (a row a data rank).
FORWARD_ROWS = {
    "pp-2": 1,
    "pp-2xfsdp-2": 2,
    "pp-2-interleaved-4-stages": 1,
    "pp-2-zbv": 1,
    "pp-2xtp-2": 1,
    "pp-2xep-2": 2,
    "cp-2xpp-2": 1,
}
# tp ranks each route part of a row there, and so do cp ranks: the pooled rule does not run
DROPLESS = ("ep-2xtp-2", "cp-2", "cp-4", "cp-2xfsdp-2", "cp-2xtp-2", "cp-2xep-2", "cp-2xpp-2")


def layout_model(precision: str, num_layers: int = 2, capacity: bool = True):
    """A tiny hero-shaped model whose heads split 4 ways: 8 query and 8 KV heads, of which the
    global layer reads 4 (as the hero's read 6 of 12), so tensor parallel fetches other ranks'
    KV heads there; the hero's adjacent-pairs RoPE and live-range QB histogram, and its
    receiver-pooled capacity over 4 sender shards (2 chunks of 2 experts for each of 4 receivers)
    at a factor that drops: a forward's rows decide its drops whatever the layout."""
    moe = {"capacity": "receiver_pooled", "capacity_groups": 4, "capacity_chunks": 2, "capacity_factor": 1.0}
    return tiny_config(
        num_layers=num_layers,
        max_seq_len=64,
        attention={
            "sliding_window": 16,
            "num_heads": 8,
            "head_dim": 16,
            "num_kv_heads": 8,
            "num_global_kv_heads": 4,
            "rope_pairs": "interleaved",  # the hero's
        },
        moe=moe if capacity else {"capacity_factor": None},
    )


def layout_run(
    token_data,
    folder,
    name: str,
    parallel: dict | None,
    precision: str,
    steps: int,
    *,
    nproc: int = 4,
    checkpoint_every: int = 0,
    fresh: bool = True,
    num_layers: int = 2,
    micro: int = 0,
    capacity: bool = True,
):
    """Train `layout_model` from the same seed on the same global batch of 8 rows: one process
    when `parallel` is None, else `nproc` gloo ranks under torchrun, `micro` rows a forward on each
    (0: all a rank's rows at once). `fresh=False` resumes the run folder's last checkpoint."""
    config = layout_config(
        token_data, folder, name, parallel, precision, steps, checkpoint_every, num_layers, micro, capacity
    )
    if parallel is None:
        run_training(config, resume="none" if fresh else "auto")
    else:
        resume = [] if fresh else ["--resume=auto"]
        torchrun(folder / f"{name}.yaml", nproc, *resume)
    return curves(folder / name)


def layout_config(token_data, folder, name, parallel, precision, steps, checkpoint_every, num_layers, micro, capacity):
    """The config of `layout_run`, saved as `folder`/`name`.yaml."""
    from marinlm.config import to_dict

    # The hero's optimizer; in fp64 its Newton-Schulz too (the quintic schedule, as Marin's).
    optim = {"ns_dtype": "float64", "newton_schulz": "quintic_schedule"} if precision == "fp64" else {}
    config = train_config(
        token_data,
        folder / name,
        model=to_dict(layout_model(precision, num_layers, capacity)),
        kernels={"modules": "reference" if precision == "fp64" else "auto"},
        optim=optim,
        parallel=parallel or {},
        train={"steps": steps, "global_batch": 8, "micro_batch": micro, "precision": precision, "init": "full"},
        checkpoint={"every_steps": checkpoint_every},
        validation={"every_steps": steps},  # once, at the end: the evaluation path of the layout
    )
    save_config(config, folder / f"{name}.yaml")
    return config


# Runs the configs it is given one after another in one process group: what `marinlm train` runs
# for each (a trainer, its fit), without the start-up of a launch each. The first argument: resume.
TRAIN_EACH = """
import gc
import sys
from marinlm.config import load_config
from marinlm.parallel import shutdown_distributed
from marinlm.train.config import TrainConfig
from marinlm.train.trainer import Trainer
for path in sys.argv[2:]:
    trainer = Trainer(load_config(TrainConfig, path, []), sys.argv[1])
    try:
        trainer.fit()
    finally:
        trainer.close()
shutdown_distributed()
gc.freeze()  # as the marinlm command ends (marinlm/__main__.py)
"""


def train_each(folder, names: list[str], procs: int, resume: str = "none") -> str | None:
    """Train the configs `folder`/<name>.yaml one after another in one torchrun launch of `procs`
    processes (one: here); the launch's output if it failed."""
    if procs == 1:
        for name in names:
            run_training(load_config(TrainConfig, str(folder / f"{name}.yaml"), []), resume=resume)
        return None
    (folder / "train_each.py").write_text(TRAIN_EACH)
    cmd = [*torchrun_command(procs), str(folder / "train_each.py"), resume]
    out = subprocess.run(
        [*cmd, *(str(folder / f"{name}.yaml") for name in names)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    return None if out.returncode == 0 else out.stdout[-3000:] + out.stderr[-3000:]


_BATCHES: dict = {}


def batched_runs(token_data, tmp_path_factory, precision: str, steps: int, procs: int):
    """The folder holding a run of every case of `CASES` with this precision, steps and processes,
    each in its own run folder: trained one after another in one torchrun launch, once a session
    (a launch's start-up, a few seconds of 4 processes importing torch, paid once)."""
    key = (precision, steps, procs)
    if key not in _BATCHES:
        folder = tmp_path_factory.mktemp(f"layouts-{precision}-{procs}")
        names = [c[3] for c in CASES if c[:2] == (precision, steps) and PROCESSES.get(c[3], 4) == procs]
        for name in names:
            capacity = name not in DROPLESS
            layout_config(token_data, folder, name, LAYOUTS[name], precision, steps, 0, layers_of(name), 0, capacity)
        _BATCHES[key] = train_each(folder, names, procs) or folder
    if isinstance(_BATCHES[key], str):  # each case of a failed launch fails with its output, once run
        pytest.fail(f"the launch training {key} failed:\n{_BATCHES[key]}")
    return _BATCHES[key]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("precision, steps, rel, layout", CASES, ids=[f"{c[3]}-{c[0]}" for c in CASES])
def test_a_layout_trains_as_one_process(token_data, tmp_path_factory, precision, steps, rel, layout):
    """The same seed (every rank initialises the whole model, then shards it), the same global batch
    of 8 rows: losses, gradient norms and the QB router biases of one process, with the hero's
    optimizer (MuonH, AdamH, Adam), whose Newton-Schulz runs in fp64 in the fp64 cases."""
    folder = batched_runs(token_data, tmp_path_factory, precision, steps, PROCESSES.get(layout, 4))
    rows, capacity = FORWARD_ROWS.get(layout, 8), layout not in DROPLESS
    assert_as_one_process(
        curves(folder / layout),
        folder / layout,
        token_data,
        tmp_path_factory,
        precision,
        steps,
        rel,
        layers_of(layout),
        rows,
        capacity,
    )


def assert_as_one_process(
    curve, run_dir, token_data, tmp_path_factory, precision, steps, rel, layers, rows=8, capacity=True
):
    """`curve` (a layout's losses, gradient norms and dropped fractions) and its run's final QB
    router biases equal one process's on the same seed and batches, `rows` rows a forward."""
    single, single_biases, single_val = one_process(
        token_data, tmp_path_factory, precision, steps, layers, rows, capacity
    )
    assert sorted(single) == sorted(curve) == list(range(1, steps + 1))
    for step, (loss, grad_norm, dropped) in single.items():
        assert curve[step][0] == pytest.approx(loss, rel=rel), ("loss", step)
        assert curve[step][1] == pytest.approx(grad_norm, rel=max(rel, 1e-9)), ("grad norm", step)
        if precision == "fp64":  # the same assignments dropped (bf16 rounding may flip near-tied choices)
            # (a pipeline logs its first stage's layers)
            assert curve[step][2] and curve[step][2] == {k: dropped[k] for k in curve[step][2]}, ("dropped", step)
    if capacity:
        assert any(sum(d.values()) > 0 for _, _, d in single.values()), "the capacity factor never dropped"
    val = val_losses(run_dir)
    assert sorted(val) == sorted(single_val) == [steps]
    assert val[steps] == pytest.approx(single_val[steps], rel=rel), ("validation loss", val, single_val)
    for a, b in zip(single_biases, router_biases(run_dir), strict=True):
        if precision == "bf16":
            # A QB bias is an order statistic of router margins: where rounding reorders two tokens'
            # margins it moves by their gap. Measured on an AMX CPU: mean 0.014, max 0.058 (|b| <= 0.41).
            assert (b - a).abs().mean() <= 0.03 and (b - a).abs().max() <= 0.15, ("router biases", a, b)
        else:
            torch.testing.assert_close(b, a, rtol=rel, atol=rel)


_ONE_PROCESS: dict = {}


def one_process(token_data, tmp_path_factory, precision: str, steps: int, layers: int, rows: int, capacity: bool):
    """The one-process run every layout of the same precision, steps, depth, rows a forward and
    capacity is checked against: trained once a session (its curves and final router biases)."""
    key = (precision, steps, layers, rows, capacity)
    if key not in _ONE_PROCESS:
        folder = tmp_path_factory.mktemp("one-process")
        curve = layout_run(
            token_data, folder, "single", None, precision, steps, num_layers=layers, micro=rows, capacity=capacity
        )
        _ONE_PROCESS[key] = (curve, router_biases(folder / "single"), val_losses(folder / "single"))
    return _ONE_PROCESS[key]


# Which dim tensor parallelism splits, by parameter name (written out here, apart from the plan).
TP_SPLITS = {
    r"embed\.weight|lm_head\.weight|attn\.[qkv]_proj\.weight|attn\.gate\.weight": 0,
    r"attn\.o_proj\.weight|attn\.sconv_[kv]\.weight|shared\.\d+\.down_proj\.weight|experts\.down_proj": 1,
    r"shared\.\d+\.(gate|up)_proj\.weight": 0,
    r"experts\.(gate|up)_proj": 2,
}


def tp_split_dim(name: str) -> int | None:
    import re

    return next((dim for pattern, dim in TP_SPLITS.items() if re.search(pattern, name)), None)


@pytest.mark.parametrize(
    "layout, shard, tp",
    [({}, 4, 1), ({"data_parallel_replicate": 2}, 2, 1), ({"tensor_parallel": 2}, 2, 2)],
    ids=["fsdp-4", "hsdp-2x2", "tp-2xfsdp-2"],
)
def test_each_rank_holds_its_share_of_the_weights_and_optimizer_state(layout, shard, tp):
    """On a fake process group of 4 ranks (no real collectives): after parallelize, every parameter
    is a DTensor whose local shard is 1/tp of it along the dim tensor parallel splits (for those it
    splits), then 1/shard on dim 0 (torch.chunk's split), and so is each AdamW moment after a step."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from marinlm.model import MarinForCausalLM
    from marinlm.parallel import parallelize

    rank = 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        config = layout_model("fp64")
        layout_dims = dims(4, **layout)
        built = layout_dims.build_mesh("cpu")
        with torch.device("meta"):
            model = MarinForCausalLM(config)
        full = {name: list(p.shape) for name, p in model.named_parameters()}
        parallelize(model, ParallelConfig(**layout), built)
        model.to_empty(device="cpu")
        shard_rank = (rank // tp) % shard  # the rank's place on the dp_shard axis (tp is the last axis)
        split = 0
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), name
            shape = full[name]
            if tp > 1 and (dim := tp_split_dim(name)) is not None:
                shape[dim] //= tp
                split += 1
            chunks = torch.empty(shape[0]).chunk(shard)
            rows = chunks[shard_rank].numel() if shard_rank < len(chunks) else 0
            assert list(p.to_local().shape) == [rows, *shape[1:]], name
        # Embedding and head, then per layer q/k/v/gate/o, the K and V SConvs, 3 expert stacks, 2 x 3 shared.
        assert split == (0 if tp == 1 else 2 + config.num_layers * (5 + 2 + 3 + 2 * 3))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        optimizer.step()
        for p in model.parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                assert optimizer.state[p][key].to_local().shape == p.to_local().shape
    finally:
        dist.destroy_process_group()


RESHARDS = {  # saved under -> resumed under (layout, processes, rows a forward on each); None is one process
    "tp-2xfsdp-2": [("fsdp-2", {}, 2, 0), ("one", None, 1, 8)],
    "ep-2xfsdp-2": [("ep-4", {"expert_parallel": 4}, 4, 0), ("one", None, 1, 8)],
    # the pipeline's forward is a microbatch of 2 rows (a row on each of 2 data ranks): so is theirs
    "pp-2xfsdp-2": [("one", None, 1, 2), ("fsdp-2", {}, 2, 1)],
    "one": [("pp-2xfsdp-2", {"pipeline_parallel": 2}, 4, 0)],
    "cp-2xfsdp-2": [("one", None, 1, 8), ("ep-2", {"expert_parallel": 2}, 2, 0)],
}


_RESHARDS: dict = {}


def reshard_layers(saved: str) -> int:
    """Layers of a `RESHARDS` case: a layer a stage of every layout it moves between."""
    return max(layers_of(n) for n in (saved, *(n for n, _, _, _ in RESHARDS[saved])))


def reshard_runs(token_data, tmp_path_factory):
    """The folder holding every case of `RESHARDS`, once a session: each saved run (a checkpoint
    half-way) as `saved`, then each resumed run as `saved`-to-`name` (a copy of the saved run
    without its last checkpoint); a launch for each phase and count of processes."""
    if not _RESHARDS:
        folder = tmp_path_factory.mktemp("reshards")
        saved, resumed = {}, {}  # processes -> run names
        for first, targets in RESHARDS.items():
            how = dict(precision="fp64", steps=STEPS, num_layers=reshard_layers(first), capacity=first not in DROPLESS)
            micro = 2 if first == "one" else 0  # as the pipeline it moves to
            layout_config(
                token_data, folder, first, LAYOUTS.get(first), checkpoint_every=STEPS // 2, micro=micro, **how
            )
            saved.setdefault(PROCESSES.get(first, 4) if first in LAYOUTS else 1, []).append(first)
            for name, parallel, procs, micro in targets:
                layout_config(
                    token_data, folder, f"{first}-to-{name}", parallel, checkpoint_every=0, micro=micro, **how
                )
                resumed.setdefault(procs, []).append(f"{first}-to-{name}")
        errors = [train_each(folder, names, procs) for procs, names in saved.items()]
        for run in (run for runs in resumed.values() for run in runs):
            shutil.copytree(folder / run.split("-to-")[0], folder / run)
            shutil.rmtree(folder / run / "checkpoints" / f"step-{STEPS:08d}")
        errors += (
            [train_each(folder, names, procs, "auto") for procs, names in resumed.items()] if not any(errors) else []
        )
        _RESHARDS["folder"] = next((e for e in errors if e), folder)
    if isinstance(_RESHARDS["folder"], str):
        pytest.fail(f"a launch of the reshard runs failed:\n{_RESHARDS['folder']}")
    return _RESHARDS["folder"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("saved", list(RESHARDS))
def test_a_checkpoint_moves_between_layouts(token_data, tmp_path_factory, saved):
    """Saved half-way under one layout, resumed under others with other world sizes: each carries
    on with the losses of the uninterrupted run, in float64. The uninterrupted run of a parallel
    layout is also its float64 parity check against one process (`STEPS` steps, 1e-9)."""
    folder = reshard_runs(token_data, tmp_path_factory)
    whole, half = curves(folder / saved), STEPS // 2
    if saved in RESHARDED:
        rows, capacity = FORWARD_ROWS.get(saved, 8), saved not in DROPLESS
        assert_as_one_process(
            whole,
            folder / saved,
            token_data,
            tmp_path_factory,
            "fp64",
            STEPS,
            1e-9,
            reshard_layers(saved),
            rows,
            capacity,
        )
    for name, _, _, _ in RESHARDS[saved]:
        run = folder / f"{saved}-to-{name}"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["first_step"] == half, (name, summary)  # resumed, not trained again from the start
        resumed = curves(run)
        for step in range(half + 1, STEPS + 1):
            assert resumed[step][0] == pytest.approx(whole[step][0], rel=1e-9), (name, step)


def test_pipeline_splits_and_errors_name_the_key():
    """Stages balanced by FLOPs (the head is heavy), placed as each schedule needs; a split or a
    schedule the pipeline cannot run fails before anything is built, naming the key."""
    from marinlm.parallel.pipeline_parallel import layer_costs, pipeline_layout, split_layers, stage_ids

    model = layout_model("fp64", num_layers=4)
    costs, head = layer_costs(model, 64)
    assert head > costs[0]  # the LM head outweighs a tiny block, so the last stage gets fewer layers
    assert [len(r) for r in split_layers(costs, head, 2)] == [3, 1]
    assert [len(r) for r in split_layers([1.0] * 6, 0.0, 3)] == [2, 2, 2]
    assert stage_ids(0, 2, "ZBVZeroBubble", 2) == [0, 3] and stage_ids(1, 2, "Interleaved1F1B", 2) == [1, 3]

    def layout(rows=8, **parallel):
        return pipeline_layout(model, ParallelConfig(pipeline_parallel=2, **parallel), 2, rows, 64)

    assert layout(layers_per_stage=[2, 2]).stages == [range(0, 2), range(2, 4)]
    assert layout(pipeline_schedule="DualPipeV").per_rank == 2
    for parallel, key in (
        ({"pipeline_schedule": "Bogus"}, "parallel.pipeline_schedule"),
        ({"pipeline_schedule": "Interleaved1F1B", "stages_per_rank": 3}, "parallel.pipeline_parallel"),  # 6 > 4
        ({"microbatches": 1}, "parallel.microbatches"),  # fewer than the 2 stages
        ({"microbatches": 3}, "parallel.microbatches"),  # does not divide the 8 rows
        ({"pipeline_schedule": "Interleaved1F1B", "microbatches": 3}, "parallel.microbatches"),
        ({"layers_per_stage": [3, 2]}, "parallel.layers_per_stage"),
    ):
        with pytest.raises(ConfigError) as info:
            layout(rows=6 if parallel.get("microbatches") == 3 and "pipeline_schedule" in parallel else 8, **parallel)
        assert info.value.key == key, parallel
    with pytest.raises(ConfigError, match="Bogus.*1F1B"):
        layout(pipeline_schedule="Bogus")
