"""lm-evaluation-harness task YAMLs for the local eval files (`local_hellaswag`, `local_arc_easy`,
`local_piqa`, `local_winogrande`, `local_lambada_openai`), scored as `marinlm eval` scores them.

They name the data folder as @DATA_DIR@; `write_task_dir` fills it in (lm-eval has no variables in
task YAMLs) and the result goes to lm-eval's `--include_path`.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS = ("hellaswag", "arc_easy", "piqa", "winogrande", "lambada_openai")


def write_task_dir(data_dir: str | Path, out_dir: str | Path) -> Path:
    """The task files with `data_dir` filled in, written to `out_dir` (returned)."""
    data_dir, out_dir = Path(data_dir).resolve(), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for source in [*HERE.glob("local_*.yaml"), HERE / "utils.py"]:
        (out_dir / source.name).write_text(source.read_text().replace("@DATA_DIR@", str(data_dir)))
    return out_dir
