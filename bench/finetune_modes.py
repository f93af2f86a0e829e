"""Fine-tuning modes side by side on GSM8K: full, LoRA, QLoRA and the last 2 layers.

Each mode runs `marinlm finetune configs/finetune/gsm8k-MODE.yaml` from the same base run in its own
process, and the table gives what it trained, its peak memory (the process's max RSS), its median
step time, and the held-out answer loss (the mean loss on the assistant tokens of the first
`--val` GSM8K test items) before and after. Peer: full fine-tuning, the reference every adapter
method is measured against.

    python bench/finetune_modes.py runs/quickstart/train [--steps 100] [--val 64]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("full", "lora", "qlora", "last2")


def run_mode(mode: str, base: str, out: Path, steps: int, val: int) -> dict:
    cmd = [
        sys.executable, "-m", "marinlm.cli", "finetune", str(ROOT / "configs" / "finetune" / f"gsm8k-{mode}.yaml"),
        f"--base={base}", f"--run_dir={out}", f"--train.steps={steps}", f"--sft.max_val_examples={val}",
        "--checkpoint.every_steps=0", "--validation.every_steps=0", "--logging.progress=false",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{mode} failed:\n{output[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    times = sorted(m["perf/step_time_s"] for m in metrics if "perf/step_time_s" in m)
    return {
        "trainable": int(re.search(r"trainable parameters: ([\d,]+)", output).group(1).replace(",", "")),
        "total": int(re.search(r"trainable parameters: [\d,]+ of ([\d,]+)", output).group(1).replace(",", "")),
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "step_s": times[len(times) // 2] if times else float("nan"),
        "base_loss": float(re.search(r"base model: held-out answer loss ([\d.]+)", output).group(1)),
        "final_loss": summary["validation"]["val/answer_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the run to fine-tune (e.g. runs/quickstart/train)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--val", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            rows[mode] = run_mode(mode, str(Path(args.base).resolve()), Path(tmp) / mode, args.steps, args.val)
            print(f"{mode}: {rows[mode]}", file=sys.stderr, flush=True)
    print(f"\n{args.base}, {args.steps} steps of 8 x 256 tokens, held-out answer loss on {args.val} GSM8K test items")
    print(f"{'mode':<7} {'trainable':>12} {'share':>7} {'peak RSS MB':>11} {'step s':>7} {'base loss':>9} {'after':>7}")
    for mode, r in rows.items():
        share = 100 * r["trainable"] / r["total"]
        print(
            f"{mode:<7} {r['trainable']:>12,} {share:>6.2f}% {r['peak_rss_mb']:>11.0f} {r['step_s']:>7.3f} "
            f"{r['base_loss']:>9.4f} {r['final_loss']:>7.4f}"
        )


if __name__ == "__main__":
    main()
