"""Fault-tolerant replica groups (parallel/fault_tolerance.py, train/replicas.py): the state a peer
sends, the config's checks, and two groups under a real torchft lighthouse, one of them killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from marinlm.config import ConfigError, from_dict, save_config
from marinlm.optim import MarinOptimizerConfig, build_optimizer
from marinlm.parallel import FaultToleranceConfig, ParallelConfig
from marinlm.parallel.fault_tolerance import load_local_state, local_state
from marinlm.train.metrics import read_metrics

from conftest import ROOT, build, tiny_config, torchrun_command, train_config


def _step(model, optimizer, seed: int) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_peer_state_makes_a_fresh_group_bitwise_the_same_and_it_steps_alike():
    config = tiny_config(num_layers=2, max_seq_len=16)
    live, joiner = build(config, seed=0), build(config, seed=1)
    opt_live = build_optimizer(live, MarinOptimizerConfig(lr=0.02, adam_lr=0.003, ns_dtype="float32"))
    opt_joiner = build_optimizer(joiner, MarinOptimizerConfig(lr=0.02, adam_lr=0.003, ns_dtype="float32"))
    for seed in range(2):
        _step(live, opt_live, seed)
    assert not opt_joiner.state  # never stepped: its state is made from the peer's
    load_local_state(joiner, opt_joiner, local_state(live, opt_live))
    for (name, a), b in zip(live.state_dict().items(), joiner.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert len(opt_joiner.state) == len(opt_live.state)
    _step(live, opt_live, 7)
    _step(joiner, opt_joiner, 7)
    for (name, a), b in zip(live.state_dict().items(), joiner.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # the optimizer state took: the same update, bit for bit


def test_a_peer_state_for_another_model_is_refused_by_name():
    live, other = build(tiny_config(num_layers=2)), build(tiny_config(num_layers=3))
    opt = build_optimizer(other, MarinOptimizerConfig())
    with pytest.raises(ValueError, match="missing.*layers.2"):
        load_local_state(other, opt, local_state(live, build_optimizer(live, MarinOptimizerConfig())))


def test_fault_tolerance_settings_are_checked_by_key():
    with pytest.raises(ConfigError, match="group"):
        FaultToleranceConfig(groups=2, group=2)
    with pytest.raises(ConfigError, match="min_groups"):
        FaultToleranceConfig(groups=2, min_groups=3)
    with pytest.raises(ConfigError, match="data_parallel_replicate"):
        ParallelConfig(data_parallel_replicate=2, fault_tolerance=FaultToleranceConfig(groups=2))
    assert from_dict(ParallelConfig, {"fault_tolerance": {"groups": 2, "group": 1}}).fault_tolerance.group == 1


def _launch(config: Path, procs: int, log: Path, *extra) -> subprocess.Popen:
    cmd = [*torchrun_command(procs), "-m", "marinlm", "train", str(config), "--resume=auto", *extra]
    # Two one-rank torchruns share the cores: one thread each (torchrun sets it only for several ranks)
    env = os.environ | {"RUST_LOG": "error", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("a"), stderr=subprocess.STDOUT, env=env)


def _lighthouse(port: int) -> subprocess.Popen:
    """torchft's lighthouse on `port`: a dead group is dropped after 2 s without heartbeats."""
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas=1", "--join_timeout_ms=10000"]
        + ["--heartbeat_timeout_ms=2000", f"--bind=[::]:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _done(proc: subprocess.Popen, log: Path) -> None:
    assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]


def _logged(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {r["step"]: r for r in map(json.loads, lines) if "train/loss" in r}


def _state(run_dir: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    dcp_to_torch_save(newest, run_dir / "state.pt")
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(run_dir / "state.pt", weights_only=False))
    return flat


@pytest.mark.slow
@pytest.mark.distributed
def test_two_groups_train_as_hsdp_and_a_killed_group_rejoins_from_its_peer(token_data, tmp_path):
    """Two groups of one rank under a lighthouse against HSDP 2 x 1 on the same seed and batches;
    group 1 is SIGKILLed after step 3 and started again 3 s later: group 0 never stops, group 1 takes its
    state (weights, optimizer, QB biases, step, data position) and both end bitwise equal."""
    steps, compared = 100, 6  # group 0 alone takes several times group 1's restart to finish
    common = dict(
        schedule={"kind": "wsd", "warmup_steps": 2, "decay_fraction": 0.1},  # steps 1-6 alike at 8 and 100 steps
        checkpoint={"every_steps": steps, "keep_last": 1},
        validation={"every_steps": 0},
        logging={"every_steps": 1, "progress": False, "tensorboard": False, "peak_flops": 1e11},
    )
    train = {"global_batch": 8, "precision": "fp32", "init": "full"}
    hsdp = train_config(
        token_data, tmp_path / "hsdp", parallel={"data_parallel_replicate": 2}, train=train | {"steps": 8}, **common
    )
    save_config(hsdp, tmp_path / "hsdp.yaml")
    reference = subprocess.run(
        [*torchrun_command(2), "-m", "marinlm", "train", str(tmp_path / "hsdp.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    ft = {"groups": 2, "lighthouse": "http://localhost:29519", "timeout_s": 20, "quorum_timeout_s": 60}
    groups = train_config(
        token_data, tmp_path / "ft", parallel={"fault_tolerance": ft}, train=train | {"steps": steps}, **common
    )
    save_config(groups, tmp_path / "ft.yaml")
    lighthouse = _lighthouse(29519)
    try:
        logs = [tmp_path / f"group{g}.log" for g in (0, 1)]
        procs = [_launch(tmp_path / "ft.yaml", 1, logs[g], f"--parallel.fault_tolerance.group={g}") for g in (0, 1)]
        while max(_logged(tmp_path / "ft" / "replica-1"), default=0) < 3:
            assert procs[1].poll() is None, logs[1].read_text()[-3000:]
            time.sleep(0.05)
        for p in [*psutil.Process(procs[1].pid).children(recursive=True), psutil.Process(procs[1].pid)]:
            p.send_signal(signal.SIGKILL)
        procs[1].wait()
        killed_at = max(_logged(tmp_path / "ft" / "replica-1"))
        time.sleep(3.0)  # past the lighthouse's heartbeat timeout: group 0 goes on alone first
        procs[1] = _launch(tmp_path / "ft.yaml", 1, logs[1], "--parallel.fault_tolerance.group=1")
        for proc, log in zip(procs, logs):
            _done(proc, log)
    finally:
        lighthouse.kill()
    hsdp_log = {r["step"]: r for r in read_metrics(tmp_path / "hsdp") if "train/loss" in r}
    group0, group1 = _logged(tmp_path / "ft" / "replica-0"), _logged(tmp_path / "ft" / "replica-1")
    assert sorted(group0) == list(range(1, steps + 1))  # group 0 logged every step: it never stopped
    for step in range(1, min(killed_at, compared) + 1):  # both groups trained, as HSDP's two replicas
        assert group0[step]["ft/groups"] == group1[step]["ft/groups"] == 2
        assert group0[step]["train/loss"] == pytest.approx(hsdp_log[step]["train/loss"], rel=1e-5), step
        assert group0[step]["train/loss"] == group1[step]["train/loss"]
    alone = [s for s, r in group0.items() if r["ft/groups"] == 1]
    assert alone, "group 0 never trained alone: the kill came too late"
    rejoined = [s for s, r in group1.items() if s > killed_at]
    assert rejoined and all(group1[s]["train/loss"] == group0[s]["train/loss"] for s in rejoined)
    assert "took a live peer's state" in logs[1].read_text()
    a, b = _state(tmp_path / "ft" / "replica-0"), _state(tmp_path / "ft" / "replica-1")
    assert a.keys() == b.keys() and any("optim" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    summary = json.loads((tmp_path / "ft" / "replica-0" / "summary.json").read_text())["fault_tolerance"]
    assert summary["committed_steps"] == steps and summary["goodput_steps_per_hour"] > 0


@pytest.mark.distributed
def test_a_group_without_a_lighthouse_stops_with_a_message_and_leaves_no_run_folder(token_data, tmp_path):
    ft = {"groups": 2, "lighthouse": "http://localhost:29518", "timeout_s": 2}  # nothing listens there
    save_config(train_config(token_data, tmp_path / "run", parallel={"fault_tolerance": ft}), tmp_path / "ft.yaml")
    log = tmp_path / "group0.log"
    proc = _launch(tmp_path / "ft.yaml", 1, log)
    assert proc.wait(timeout=300) == 1
    assert "error: parallel.fault_tolerance.lighthouse: no lighthouse answered at http://localhost:29518" in (
        log.read_text()
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_lost_lighthouse_stops_the_groups_and_they_resume_exactly(token_data, tmp_path):
    """The lighthouse SIGKILLed mid-run: both groups stop with a message naming it, their
    checkpoints intact; with a new lighthouse, `--resume auto` replays the lost steps bit for bit."""
    ft = {"groups": 2, "lighthouse": "http://localhost:29516", "timeout_s": 5, "quorum_timeout_s": 5}
    config = train_config(
        token_data,
        tmp_path / "ft",
        parallel={"fault_tolerance": ft},
        train={"steps": 200, "global_batch": 8, "precision": "fp32"},
        schedule={"kind": "wsd", "warmup_steps": 2, "decay_fraction": 0.01},  # a constant rate past step 2
        checkpoint={"every_steps": 4, "keep_last": 2},
        validation={"every_steps": 0},
        logging={"every_steps": 1, "progress": False, "tensorboard": False, "peak_flops": 1e11},
    )
    save_config(config, tmp_path / "ft.yaml")

    def groups(*extra):
        logs = [tmp_path / f"group{g}.log" for g in (0, 1)]
        group = "--parallel.fault_tolerance.group="
        return [_launch(tmp_path / "ft.yaml", 1, logs[g], f"{group}{g}", *extra) for g in (0, 1)], logs

    first = _lighthouse(29516)
    procs, logs = groups()
    while max(_logged(tmp_path / "ft" / "replica-0"), default=0) < 5:
        assert procs[0].poll() is None, logs[0].read_text()[-3000:]
        time.sleep(0.05)
    first.kill()
    for proc, log in zip(procs, logs):
        assert proc.wait(timeout=300) == 1
        assert "error: no quorum of replica groups through the lighthouse at http://localhost:29516" in log.read_text()
    before = _logged(tmp_path / "ft" / "replica-0")
    saved = sorted(p.name for p in (tmp_path / "ft" / "replica-0" / "checkpoints").glob("step-*"))
    assert saved and not list((tmp_path / "ft" / "replica-0" / "checkpoints").glob("*.tmp"))
    last = int(saved[-1].split("-")[1])
    second = _lighthouse(29516)
    try:
        procs, logs = groups(f"--train.steps={last + 3}")
        for proc, log in zip(procs, logs):
            _done(proc, log)
    finally:
        second.kill()
    after = [_logged(tmp_path / "ft" / f"replica-{g}") for g in (0, 1)]
    assert f"resumed from {tmp_path / 'ft' / 'replica-0' / 'checkpoints' / saved[-1]} at step {last}" in (
        logs[0].read_text()
    )
    assert sorted(after[0]) == sorted(after[1]) == list(range(1, last + 4))
    for step in range(last + 1, last + 4):  # the groups agree after the resume
        assert after[0][step]["train/loss"] == after[1][step]["train/loss"], step
    # Steps trained after the last save (none when the lighthouse went just after one) come out
    # the same, bit for bit, at the same learning rate (the first two: the schedule's end differs).
    replayed = [s for s in before if last < s <= last + 2]
    assert replayed or max(before) == last
    for step in replayed:
        assert after[0][step]["train/loss"] == before[step]["train/loss"], step
