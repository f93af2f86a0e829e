"""Parallel layouts: the degrees checked against the ranks and the model, and loss parity of each
layout against one process (gloo, 4 processes), in float64 over 10 steps and fp32 over 3."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from marinlm.config import ConfigError, save_config
from marinlm.parallel import ParallelConfig
from marinlm.parallel.mesh import ParallelDims
from marinlm.train.metrics import read_metrics
from marinlm.train.run import run_training

from conftest import ROOT, tiny_config, train_config


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
        ConfigError, match="parallel.expert_parallel: 4 must divide data_parallel_shard x tensor_parallel = 2"
    ):
        dims(4, data_parallel_replicate=2, expert_parallel=4)
    with pytest.raises(ConfigError, match="data_parallel_shard: must be >= 1, or -1"):
        ParallelConfig(data_parallel_shard=0)


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


def torchrun(config_path, nproc: int, port: int, *extra) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}"]
    out = subprocess.run(
        [*cmd, "-m", "marinlm.cli", "train", str(config_path), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def curves(run_dir) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["train/loss"], r["train/grad_norm"]) for r in read_metrics(run_dir) if "train/loss" in r}


def router_biases(run_dir) -> list[torch.Tensor]:
    from marinlm.train.inference import load_model

    model = load_model(run_dir).model  # one process, resharding the layout's checkpoint
    return [m.router.bias.clone() for m in model.modules() if hasattr(m, "router")]


LAYOUTS = {"fsdp-4": {}, "hsdp-2x2": {"data_parallel_replicate": 2}}
CASES = [("fp64", 10, 1e-9, "fsdp-4"), ("fp64", 10, 1e-9, "hsdp-2x2"), ("fp32", 3, 1e-5, "hsdp-2x2")]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("precision, steps, rel, layout", CASES, ids=[f"{c[3]}-{c[0]}" for c in CASES])
def test_a_layout_trains_as_one_process(token_data, tmp_path, precision, steps, rel, layout):
    """The same seed (every rank initialises the whole model, then shards it), the same global batch
    of 8 rows: losses, gradient norms and the QB router biases of one process. Dropless experts,
    so that capacity (per forward's rows) does not depend on the layout. AdamW in fp64, whose
    update is exact there; MuonH rounds its Newton-Schulz in fp32."""
    optim = {"type": "adamw", "lr": 3e-3} if precision == "fp64" else {}
    model = tiny_config(
        num_layers=2,
        max_seq_len=64,
        attention={"sliding_window": 16},
        moe={"capacity_factor": None},
        kernels="reference" if precision == "fp64" else "auto",
    )
    from marinlm.config import to_dict

    runs = {}
    for name, parallel in (("single", {}), (layout, LAYOUTS[layout])):
        config = train_config(
            token_data,
            tmp_path / name,
            model=to_dict(model),
            optim=optim,
            parallel=parallel,
            train={"steps": steps, "global_batch": 8, "precision": precision, "init": "full"},
            checkpoint={"every_steps": 0},
            validation={"every_steps": 0},
        )
        save_config(config, tmp_path / f"{name}.yaml")
        if name == "single":
            run_training(config, resume="none")
        else:
            torchrun(tmp_path / f"{name}.yaml", 4, 29541 + len(tmp_path.name) % 50)
        runs[name] = curves(tmp_path / name)
    assert sorted(runs["single"]) == sorted(runs[layout]) == list(range(1, steps + 1))
    for step, (loss, grad_norm) in runs["single"].items():
        assert runs[layout][step][0] == pytest.approx(loss, rel=rel), ("loss", step)
        assert runs[layout][step][1] == pytest.approx(grad_norm, rel=max(rel, 1e-9)), ("grad norm", step)
    for a, b in zip(router_biases(tmp_path / "single"), router_biases(tmp_path / layout), strict=True):
        torch.testing.assert_close(b, a, rtol=rel, atol=rel)


@pytest.mark.parametrize("layout, shard", [({}, 4), ({"data_parallel_replicate": 2}, 2)], ids=["fsdp-4", "hsdp-2x2"])
def test_each_rank_holds_its_share_of_the_weights_and_optimizer_state(layout, shard):
    """On a fake process group of 4 ranks (no real collectives): after parallelize, every parameter
    is a DTensor whose local shard is 1/shard of it on dim 0 (torch.chunk's split), and so is each
    AdamW moment after a step."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from marinlm.model import MarinForCausalLM
    from marinlm.parallel import parallelize
    from marinlm.parallel.distributed import DistributedInfo

    rank = 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        config = tiny_config(num_layers=2)
        layout_dims = dims(4, **layout)
        info = DistributedInfo(rank, 4, rank, torch.device("cpu"), layout_dims.build_mesh("cpu"))
        with torch.device("meta"):
            model = MarinForCausalLM(config)
        full = {name: tuple(p.shape) for name, p in model.named_parameters()}
        parallelize(model, ParallelConfig(**layout), info)
        model.to_empty(device="cpu")
        shard_rank = rank % shard  # the rank's place on the dp_shard axis
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), name
            expected = torch.empty(full[name][0]).chunk(shard)
            rows = expected[shard_rank].numel() if shard_rank < len(expected) else 0
            assert tuple(p.to_local().shape) == (rows, *full[name][1:]), name
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        optimizer.step()
        for p in model.parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                assert optimizer.state[p][key].to_local().shape == p.to_local().shape
    finally:
        dist.destroy_process_group()
