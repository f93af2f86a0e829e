"""One replica group lost mid-run: fault-tolerant replica groups (torchft) against the peer,
restart-from-checkpoint, on the same 4 gloo ranks and the same tiny model.

    python bench/fault_tolerance.py [--tokens runs/quickstart/tokens] [--steps 30] [--every 10] [--inside fsdp|ep]

Four runs of `marinlm train`, each `--steps` steps of 32 rows x 256 tokens (steps long enough that a
restarted group, ~15 s to start here, finds group 0 still training):
1. HSDP 2 x 2 (`data_parallel_replicate: 2`), no failure: the reference time and losses;
2. two replica groups of 2 ranks under a lighthouse, no failure: losses against run 1;
3. the same, every rank of group 1 SIGKILLed at a random step (seeded) and its torchrun started
   again 5 s later: group 0's longest gap between steps, group 1's rejoin, and both groups' final
   checkpoints compared tensor by tensor (weights, router biases, optimizer state: bitwise);
4. HSDP 2 x 2 with a checkpoint every `--every` steps, every rank SIGKILLed at the same step and the
   job started again with `--resume auto`.
Printed: wall-clock lost to the failure (run 3 - run 2, run 4 - run 1) and their ratio. The ranks
share 2 CPU cores: the seconds are this machine's, the lost time's parts (detection, restart, replay)
are what carries over.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from train_throughput import make_tokens  # bench/ is on the path when run

ROOT = Path(__file__).resolve().parents[1]
LIGHTHOUSE_PORT = 29510


def overrides(tokens: Path, run_dir: Path, steps: int, every: int, inside: str) -> list[str]:
    return [
        f"--data.sources=[{{path: {tokens}}}]",
        f"--run_dir={run_dir}",
        f"--train.steps={steps}",
        "--train.global_batch=32",
        "--train.precision=fp32",
        "--data.seq_len=256",
        f"--checkpoint.every_steps={every}",
        "--checkpoint.keep_last=2",
        "--validation.every_steps=0",
        "--logging.every_steps=1",
        "--logging.progress=false",
        "--logging.tensorboard=false",
        "--logging.peak_flops=1e11",
        "--model.moe.capacity_factor=null",
        *(["--parallel.expert_parallel=2"] if inside == "ep" else []),
    ]


def launch(args: list[str], procs: int, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={port}"]
    cmd += ["-m", "marinlm.cli", "train", str(ROOT / "configs" / "train" / "tiny.yaml"), *args]
    env = os.environ | {"RUST_LOG": "warn"}
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env
    )


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in records(run_dir) if "train/loss" in r}


def wait(proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    if proc.wait(timeout=timeout):
        raise RuntimeError(f"{log}: exit {proc.returncode}\n" + log.read_text()[-3000:])


def kill_at(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    """SIGKILL `proc` and every process under it once `run_dir` logged `step`."""
    while max(losses(run_dir), default=0) < step:
        if proc.poll() is not None:
            raise RuntimeError(f"{run_dir}: finished before step {step}")
        time.sleep(0.05)
    # torchrun's workers run in process groups of their own: kill the whole tree, the workers first
    for child in psutil.Process(proc.pid).children(recursive=True)[::-1]:
        child.send_signal(signal.SIGKILL)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def ft_args(group: int, extra: list[str]) -> list[str]:
    ft = "--parallel.fault_tolerance."
    return [
        *extra,
        f"{ft}groups=2",
        f"{ft}group={group}",
        f"{ft}lighthouse=http://localhost:{LIGHTHOUSE_PORT}",
        f"{ft}timeout_s=20",
        "--resume=auto",
    ]


def fault_tolerant(base: list[str], kill_step: int | None, work: Path) -> float:
    lighthouse = subprocess.Popen(
        [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas=1", "--join_timeout_ms=10000"]
        + ["--heartbeat_timeout_ms=2000", f"--bind=[::]:{LIGHTHOUSE_PORT}"],
        stdout=(work / "lighthouse.log").open("w"),
        stderr=subprocess.STDOUT,
        env=os.environ | {"RUST_LOG": "warn"},
    )
    try:
        t0 = time.perf_counter()
        procs = {g: launch(ft_args(g, base), 2, 29600 + 10 * g, work / f"group{g}.log") for g in (0, 1)}
        if kill_step is not None:
            kill_at(procs[1], work / "run" / "replica-1", kill_step)
            time.sleep(5.0)
            procs[1] = launch(ft_args(1, base), 2, 29620, work / "group1-restarted.log")
        for g, p in procs.items():
            wait(p, work / f"group{g}.log")
        seconds = time.perf_counter() - t0
    finally:
        lighthouse.kill()
    return seconds


def hsdp(base: list[str], kill_step: int | None, work: Path) -> float:
    args = [*base, "--parallel.data_parallel_replicate=2"]
    t0 = time.perf_counter()
    proc = launch([*args, "--resume=none"], 4, 29640, work / "hsdp.log")
    if kill_step is not None:
        kill_at(proc, work / "run", kill_step)
        time.sleep(5.0)  # as the replica group waits: the same restart delay
        proc = launch([*args, "--resume=auto"], 4, 29650, work / "hsdp-restarted.log")
    wait(proc, work / "hsdp.log")
    return time.perf_counter() - t0


def checkpoint_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's tensors (model and optimizer), whole, by name."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    newest = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    out = run_dir.parent / f"{run_dir.name}.pt"
    dcp_to_torch_save(newest, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


def trained_rows(run_dir: Path) -> float:
    """Rows the replica groups trained over the run (committed steps' `ft/rows`)."""
    return sum(r["ft/rows"] for r in records(run_dir) if "ft/rows" in r)


def gaps(run_dir: Path) -> float:
    """The longest wall-clock gap between two consecutive logged steps of a group (`ft/wall_time`)."""
    times = sorted(r["ft/wall_time"] for r in records(run_dir) if "ft/wall_time" in r)
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default=str(ROOT / "runs" / "quickstart" / "tokens"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    p.add_argument("--inside", choices=("fsdp", "ep"), default="fsdp", help="the layout inside each group")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    kill_step = random.Random(args.seed).randint(4, max(4, args.steps // 3))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokens = Path(args.tokens) if Path(args.tokens).exists() else make_tokens(work / "data")
        result = {}
        for name, kill in (("hsdp", None), ("ft", None), ("ft_failure", kill_step), ("hsdp_failure", kill_step)):
            folder = work / name
            folder.mkdir()
            base = overrides(tokens, folder / "run", args.steps, args.every, args.inside)
            run = fault_tolerant if name.startswith("ft") else hsdp
            result[name] = run(base, kill, folder)  # seconds end to end
            print(f"{name}: {result[name]:.1f} s", flush=True)
        reference = losses(work / "hsdp" / "run")
        ft0, ft1 = (losses(work / "ft" / "run" / f"replica-{g}") for g in (0, 1))
        worst = max(abs(ft0[s] - reference[s]) / abs(reference[s]) for s in reference)
        print(
            f"no failure: FT group 0 vs HSDP losses, worst relative difference {worst:.2e} over {len(reference)} steps"
        )
        print(f"no failure: FT groups 0 and 1 log the same losses: {ft0 == ft1}")
        failed = work / "ft_failure" / "run"
        if "took a live peer's state" not in (work / "ft_failure" / "group1-restarted.log").read_text():
            raise SystemExit(
                f"group 1 did not rejoin before group 0 finished its {args.steps} steps: nothing here measures "
                "fault tolerance; give more --steps"
            )
        a, b = checkpoint_tensors(failed / "replica-0"), checkpoint_tensors(failed / "replica-1")
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        print(f"failure at step {kill_step}: group 0's longest gap between steps {gaps(failed / 'replica-0'):.1f} s")
        print(f"after rejoining, the final checkpoints of groups 0 and 1 are bitwise equal ({len(a)} tensors): {same}")
        # The groups' run trains fewer rows with a failure (group 1's shares while it was gone): its
        # time is compared at equal rows, the time the no-failure run took for the rows it trained.
        # (Group 0 alone also has both cores here, which this cancels to first order.)
        rows = {name: trained_rows(work / name / "run" / "replica-0") for name in ("ft", "ft_failure")}
        fraction = rows["ft_failure"] / rows["ft"]
        lost_ft = result["ft_failure"] - result["ft"] * fraction
        lost_ckpt = result["hsdp_failure"] - result["hsdp"]
        print(
            f"rows trained: {rows['ft_failure']:.0f} of {rows['ft']:.0f} with the failure (group 1's rows skipped as "
            f"it was gone); end to end {result['ft_failure']:.1f} s, {result['ft']:.1f} s without"
        )
        print(
            f"wall-clock lost to one failure: fault-tolerant groups {lost_ft:.1f} s (at equal rows), restart from a "
            f"checkpoint every {args.every} steps {lost_ckpt:.1f} s: ratio {lost_ckpt / lost_ft:.2f}x"
        )


if __name__ == "__main__":
    main()
