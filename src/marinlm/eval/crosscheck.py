"""`marinlm eval` against lm-evaluation-harness's `hf` backend on the exported model.

Both tools score the first N items of each local task (`--limit`), the harness through the task
YAMLs in eval/lm_eval_tasks/ and `transformers` on the `marinlm export` folder, marinlm on its own
checkpoint. Accuracy and every item's log-likelihoods are compared.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from marinlm.eval.lm_eval_tasks import TASKS, write_task_dir


def harness_scores(export_dir, tasks, limit: int, data_dir, batch_size: int = 16) -> dict:
    """{task: (accuracy, [per-item log-likelihoods])} from lm-eval's hf backend."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        manager = TaskManager(include_path=str(write_task_dir(data_dir, tmp)))
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={export_dir},trust_remote_code=True,dtype=float32",
            tasks=[f"local_{t}" for t in tasks],
            limit=limit,
            log_samples=True,
            device="cpu",
            batch_size=batch_size,
            task_manager=manager,
        )
    scores = {}
    for task in tasks:
        samples = sorted(out["samples"][f"local_{task}"], key=lambda s: s["doc_id"])
        lls = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
        scores[task] = (out["results"][f"local_{task}"]["acc,none"], lls)
    return scores


def marinlm_scores(run, tasks, limit: int, data_dir, batch_size: int = 16, kernels: bool = True) -> dict:
    from marinlm.eval.runner import EvalOptions, run_eval
    from marinlm.loading import load_model

    options = EvalOptions(
        tasks=list(tasks), data_dir=str(data_dir), limit=limit, predictions=True, batch_size=batch_size
    )
    report = run_eval(load_model(run, kernels=kernels), options)
    scores = {}
    for task in tasks:
        preds = report["predictions"][task]
        lls = [p["loglikelihoods"] if "loglikelihoods" in p else [p["loglikelihood"]] for p in preds]
        scores[task] = (report["results"][task]["acc"], lls)
    return scores


def crosscheck(
    run, export_dir, data_dir: str | Path, tasks=TASKS, limit: int = 100, kernels: bool = True
) -> list[dict]:
    """One row a task: items, both accuracies, the largest per-item log-likelihood difference.
    `kernels=False` scores marinlm's side on the reference modules, the code the export runs."""
    ours = marinlm_scores(run, tasks, limit, data_dir, kernels=kernels)
    theirs = harness_scores(export_dir, tasks, limit, Path(data_dir))
    rows = []
    for task in tasks:
        (acc_a, lls_a), (acc_b, lls_b) = ours[task], theirs[task]
        if len(lls_a) != len(lls_b) or any(len(a) != len(b) for a, b in zip(lls_a, lls_b)):
            raise AssertionError(f"{task}: the two tools scored different items or choices")
        diff = max(abs(x - y) for a, b in zip(lls_a, lls_b) for x, y in zip(a, b))
        rows.append(
            {"task": task, "items": len(lls_a), "marinlm_acc": acc_a, "lm_eval_acc": acc_b, "max_ll_diff": diff}
        )
    return rows
