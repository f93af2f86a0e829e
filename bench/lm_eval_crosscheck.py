"""`marinlm eval` against lm-evaluation-harness's `hf` backend on the same run, item by item.

Peer: lm-eval 0.4's `hf` backend (transformers) on the `marinlm export` folder of the run, through
the local task YAMLs in src/marinlm/eval/lm_eval_tasks/. Both take the first N items of each task.
Prints per task: items, the two accuracies, and the largest per-item log-likelihood difference.

    python bench/lm_eval_crosscheck.py runs/quickstart/train [--limit 100] [--data-dir ../shared/data/eval]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from marinlm.eval.crosscheck import crosscheck
from marinlm.hf.export import export

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "eval"))
    parser.add_argument(
        "--reference", action="store_true", help="score marinlm's side on the reference modules, as the export runs"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = export(args.run, Path(tmp) / "hf", quiet=True)
        start = time.perf_counter()
        rows = crosscheck(
            report.checkpoint, Path(tmp) / "hf", args.data_dir, limit=args.limit, kernels=not args.reference
        )
    side = "reference modules" if args.reference else "kernels"
    took = time.perf_counter() - start
    print(
        f"\n{report.checkpoint} ({report.format} export; marinlm on its {side}), first {args.limit} items, {took:.0f} s"
    )
    print(f"{'task':<16} {'items':>5} {'marinlm acc':>11} {'lm-eval acc':>11} {'max |d loglik|':>14}")
    for r in rows:
        accs = f"{r['marinlm_acc']:>11.3f} {r['lm_eval_acc']:>11.3f}"
        print(f"{r['task']:<16} {r['items']:>5} {accs} {r['max_ll_diff']:>14.2e}")


if __name__ == "__main__":
    main()
