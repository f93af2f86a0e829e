"""`marinlm plan --hardware cpu` against real runs on this machine: the step time it predicts
(compute priced from operations measured here on the spot, plan/op_table.py; communication at the
cpu profile's bandwidths) beside the median step time `marinlm train` logs, one process and each
4-rank gloo layout of bench/parallel_layouts.py (tiny, 8 x 256 tokens, fp32).

    python bench/plan_accuracy.py [--tokens runs/quickstart/tokens] [--steps 8] [--layouts "FSDP 4,EP 4"] \
        [--set=--train.precision=bf16 --set=--parallel.activation_checkpointing=full]

Printed: per layout, the plan's compute and total, the real step, and plan / real.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from parallel_layouts import FOUR, MODEL, ROOT, run  # bench/ is on the path when run
from train_throughput import make_tokens


def planned(extra: list[str], procs: int) -> dict:
    from marinlm.config import load_config
    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware
    from marinlm.train.config import TrainConfig

    overrides = ["--train.global_batch=8", "--train.precision=fp32", "--data.seq_len=256"]
    overrides += ["--model.moe.capacity_factor=null", *MODEL, *extra]
    train = load_config(TrainConfig, str(ROOT / "configs" / "train" / "tiny.yaml"), overrides)
    shard = procs // (train.parallel.data_parallel_replicate * train.parallel.tensor_parallel)
    shard //= train.parallel.pipeline_parallel
    parallel = dataclasses.replace(train.parallel, data_parallel_shard=shard)
    plan = plan_layout(train, parallel, procs, load_hardware("cpu"), Efficiency())
    return plan.step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default=str(ROOT / "runs" / "quickstart" / "tokens"))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layouts", default="", help="comma-separated names of bench/parallel_layouts.py's FOUR")
    p.add_argument("--set", action="append", default=[], help="an override for the plan and the runs alike")
    a = p.parse_args()
    chosen = {"one process": (a.set, 1)} | {name: (extra + a.set, 4) for name, extra in FOUR.items()}
    if a.layouts:
        chosen = {name: chosen[name] for name in a.layouts.split(",")}
    with tempfile.TemporaryDirectory(prefix="marinlm-plan-accuracy-") as tmp:
        work, tokens = Path(tmp), Path(a.tokens)
        if not (tokens / "manifest.json").exists():
            tokens = make_tokens(work)
        named = dict(s.split("=", 1) for s in a.set if "=" in s)
        model, precision = named.get("--model", "tiny"), named.get("--train.precision", "fp32")
        print(f"{model}, 8 x 256 tokens, {precision}, {' '.join(a.set)}, {a.steps} steps a run; gloo on this CPU")
        print(f"{'layout':<16}{'plan compute':>14}{'plan step':>11}{'real step':>11}{'plan / real':>13}")
        for name, (extra, procs) in chosen.items():
            step = planned(extra, procs)
            real = run(name, procs, extra, tokens, a.steps, work)["step_s"]
            print(
                f"{name:<16}{step['compute'] * 1e3:>11.0f} ms{step['total'] * 1e3:>8.0f} ms{real * 1e3:>8.0f} ms"
                f"{step['total'] / real:>13.2f}"
            )


if __name__ == "__main__":
    main()
