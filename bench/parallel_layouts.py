"""Each parallel layout against one process, pipeline schedules against no pipeline, and the expert
all-to-all's bytes against their minimum: the tiny model trained a few steps by `marinlm train`.

    python bench/parallel_layouts.py [--tokens runs/quickstart/tokens] [--steps 8]

On this machine the ranks are gloo processes sharing 2 CPU cores: the step times are for catching
regressions, not for choosing a layout on GPUs (`marinlm plan` does that). Printed:
- tokens/s of FSDP 4, HSDP 2x2, TP 2 x FSDP 2, EP 2 x FSDP 2, EP 4, PP 2 x FSDP 2 on 4 ranks, over
  the one-process rate (the peer);
- on 2 ranks, each pipeline schedule's step time over FSDP 2's (the same ranks without a pipeline),
  the measured bubble 1 - t(FSDP 2) / t(schedule) beside the analytic one;
- the all-to-all bytes a step under EP 2 and EP 4, over the minimum tokens x k x latent x bytes x
  (EP - 1) / EP x 2 (dispatch and combine) x MoE layers, and the hero's minimum per layer.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from train_throughput import make_tokens, step_records, train_command  # bench/ is on the path when run

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--model.attention.num_kv_heads=4", "--model.attention.num_global_kv_heads=2"]  # TP 2 divides them
FOUR = {
    "FSDP 4": [],
    "HSDP 2x2": ["--parallel.data_parallel_replicate=2"],
    "TP 2 x FSDP 2": ["--parallel.tensor_parallel=2"],
    "EP 2 x FSDP 2": ["--parallel.expert_parallel=2"],
    "EP 4": ["--parallel.expert_parallel=4"],
    "PP 2 x FSDP 2": ["--parallel.pipeline_parallel=2"],
}
SCHEDULES = {
    "1F1B": [],
    "Interleaved1F1B": ["--parallel.pipeline_schedule=Interleaved1F1B", "--parallel.stages_per_rank=2"],
    "ZBVZeroBubble": ["--parallel.pipeline_schedule=ZBVZeroBubble"],
    "DualPipeV": ["--parallel.pipeline_schedule=DualPipeV"],
}


def run(name: str, procs: int, extra: list[str], tokens: Path, steps: int, work: Path) -> dict:
    run_dir = work / name.replace(" ", "_")
    overrides = [
        f"--data.sources=[{{path: {tokens}}}]",
        f"--run_dir={run_dir}",
        f"--train.steps={steps}",
        "--train.global_batch=8",
        "--train.precision=fp32",
        "--data.seq_len=256",
        "--checkpoint.every_steps=0",
        "--validation.every_steps=0",
        "--logging.every_steps=1",
        "--logging.progress=false",
        "--logging.tensorboard=false",
        "--model.moe.capacity_factor=null",
        *MODEL,
        *extra,
    ]
    out = subprocess.run([sys.executable, *train_command(overrides, procs, port=29578)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{name}: " + out.stdout[-2000:] + out.stderr[-2000:])
    steady = [r for r in step_records(run_dir) if "perf/step_time_s" in r and r["step"] > 2]
    return {
        "step_s": statistics.median(r["perf/step_time_s"] for r in steady),
        "a2a_bytes": statistics.median(r["ep/a2a_bytes"] for r in steady) if "ep/a2a_bytes" in steady[0] else 0.0,
    }


def main() -> None:
    from marinlm.config import load_config
    from marinlm.model.config import MarinConfig
    from marinlm.parallel.pipeline_parallel import bubble_fraction

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default=str(ROOT / "runs" / "quickstart" / "tokens"))
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    tiny = load_config(MarinConfig, str(ROOT / "configs" / "model" / "tiny.yaml"), [])
    with tempfile.TemporaryDirectory(prefix="marinlm-layouts-") as tmp:
        work = Path(tmp)
        tokens = Path(a.tokens)
        if not (tokens / "manifest.json").exists():
            tokens = make_tokens(work)
        print(f"tiny (4 layers), global batch 8 x 256 tokens, fp32, {a.steps} steps a run; gloo on this CPU")
        one = run("one process", 1, [], tokens, a.steps, work)
        print(f"{'one process':<16}{one['step_s'] * 1e3:>9.0f} ms/step  (the peer)")
        results = {}
        for name, extra in FOUR.items():
            results[name] = r = run(name, 4, extra, tokens, a.steps, work)
            ratio = one["step_s"] / r["step_s"]
            print(f"{name:<16}{r['step_s'] * 1e3:>9.0f} ms/step  one process / layout {ratio:.2f}x")
        fsdp2 = run("FSDP 2", 2, [], tokens, a.steps, work)
        print(f"\non 2 ranks: FSDP 2 {fsdp2['step_s'] * 1e3:.0f} ms/step; 8 microbatches of one row")
        for name, extra in SCHEDULES.items():
            r = run(name, 2, ["--parallel.pipeline_parallel=2", *extra], tokens, a.steps, work)
            per_rank = 1 if name == "1F1B" else 2
            analytic = bubble_fraction(name, 2, 8, per_rank)
            measured = 1 - fsdp2["step_s"] / r["step_s"]
            print(
                f"  PP 2 {name:<16}{r['step_s'] * 1e3:>7.0f} ms/step, {r['step_s'] / fsdp2['step_s']:.2f}x FSDP 2's; "
                f"bubble measured {measured:.1%}, analytic {analytic:.1%}"
            )
        rows_per_rank = {"EP 2 x FSDP 2": 2, "EP 4": 2}  # 8 rows over 4 data-parallel ranks
        latent, k, moe_layers = tiny.moe.latent_dim, tiny.moe.top_k, tiny.num_moe_layers
        print(
            "\nexpert all-to-all, bytes a step (all ranks; dispatch, combine, forward, backward) against the minimum:"
        )
        for name, ep in (("EP 2 x FSDP 2", 2), ("EP 4", 4)):
            tokens_rank = rows_per_rank[name] * 256
            minimum = 4 * tokens_rank * k * latent * 4 * (ep - 1) / ep * 4 * moe_layers  # 4 ranks, fp32, 4 passes
            print(
                f"  {name}: {results[name]['a2a_bytes'] / 1e6:.2f} MB, minimum {minimum / 1e6:.2f} MB, "
                f"ratio {results[name]['a2a_bytes'] / minimum:.3f}"
            )
        hero = 16 * 4096 * 8 * 3072 * 2 * 63 / 64  # a GPU's tokens x k x latent x bf16 x (EP-1)/EP
        print(
            f"  hero (EP 64, 16 x 4,096 tokens a GPU, bf16): minimum {hero / 1e9:.2f} GB a layer each way a "
            f"forward, {4 * hero / 1e9:.2f} GB a layer a step with the backward; marinlm sends exactly the "
            "assignments (no padding), so its ratio is the routing's remote share over (EP-1)/EP"
        )


if __name__ == "__main__":
    main()
