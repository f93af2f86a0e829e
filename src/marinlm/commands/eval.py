"""`marinlm eval` and `marinlm lm-eval`: their arguments and what they run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from marinlm.commands import help_of


def add_commands(commands) -> None:
    ev = commands.add_parser("eval", help=help_of("eval"))
    ev.add_argument("run", help="run folder (newest good checkpoint) or a checkpoint folder")
    ev.add_argument(
        "--tasks",
        nargs="+",
        required=True,
        help=(
            "hellaswag arc_easy arc_challenge piqa winogrande lambada_openai mmlu val bpb:PATH, space- or comma-"
            "separated (bpb:PATH: a text file, or "
            "a .jsonl(.gz/.zst), .json or .parquet file of records with a 'text' field, such as a curated shard)"
        ),
    )
    ev.add_argument(
        "--data-dir",
        default="",
        help="folder with the task files (default: $MARINLM_EVAL_DATA, else ../shared/data/eval beside the source)",
    )
    ev.add_argument(
        "--limit",
        type=int,
        default=None,
        help=(
            "score the first N items of each task, as lm-eval's --limit does (val: N rows; bpb: a .jsonl(.gz/.zst), "
            ".json or .parquet file's first N texts, a text file's first N windows of the model's context, cut at "
            "a line end)"
        ),
    )
    ev.add_argument(
        "--sample",
        type=int,
        default=None,
        help="score N items of each multiple-choice or lambada task drawn with a fixed seed (a subset spread over "
        "the whole file, which the first N may not be)",
    )
    ev.add_argument("--batch-size", type=int, default=32)
    ev.add_argument("--num-fewshot", type=int, default=0, help="MMLU: dev examples in the prompt")
    ev.add_argument("--predictions", action="store_true", help="also write per-item predictions")
    ev.add_argument(
        "--hf",
        nargs="+",
        default=[],
        metavar="FILE=NAME[:CONFIG]:SPLIT",
        help="read a task file from HF datasets, e.g. hellaswag_val.jsonl=org/hellaswag-marinlm:validation",
    )
    ev.add_argument(
        "--output",
        default=None,
        help="results JSON, or a folder (an existing one, or a path ending in /) for eval.json (default: "
        "RUN/eval/STEP.json, or CHECKPOINT/eval.json for a checkpoint outside a run); in a folder never over an "
        "earlier result: then eval-2.json, eval-3.json, ...",
    )
    ev.add_argument("--device", default="cpu")
    ev.set_defaults(func=_eval)
    harness = commands.add_parser(
        "lm-eval",
        help=help_of("lm-eval"),
        description="Everything after `lm-eval` goes to lm_eval, e.g. `marinlm lm-eval --model marinlm "
        "--model_args pretrained=RUN --tasks local_hellaswag --limit 100`, or `--model hf --model_args "
        "pretrained=EXPORT,trust_remote_code=True`. The local tasks (local_hellaswag, local_arc_easy, local_piqa, "
        "local_winogrande, local_lambada_openai) read --data-dir.",
    )
    harness.add_argument(
        "--data-dir", default=None, help="the eval files (default: $MARINLM_EVAL_DATA, else ../shared/data/eval)"
    )
    harness.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    harness.set_defaults(func=_lm_eval, takes_overrides=True)


def _lm_eval(args, overrides) -> int:
    """Reached only for `marinlm lm-eval --help`-style parsing; `main` hands the arguments over as given."""
    from marinlm.eval.harness import run_cli

    return run_cli(args.lm_eval_args + list(overrides), data_dir=args.data_dir)


def lm_eval_passthrough(argv: list[str]) -> int:
    """`marinlm lm-eval ARGS`: ARGS go to lm-eval's parser untouched (ours would reorder its flags),
    less our `--data-dir`."""
    from marinlm.eval.harness import run_cli

    data_dir, rest = None, []
    it = iter(argv)
    for arg in it:
        if arg == "--data-dir":
            data_dir = next(it, None)
        elif arg.startswith("--data-dir="):
            data_dir = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return run_cli(rest, data_dir=data_dir)


def _hf_source(spec: str) -> tuple[str, str]:
    file, sep, source = spec.partition("=")
    if not (sep and file and source):
        raise ValueError(
            f"--hf {spec!r}: expected FILE=NAME[:CONFIG]:SPLIT, e.g. hellaswag_val.jsonl=org/hellaswag:validation"
        )
    return file, source


def _eval(args, overrides) -> int:
    from marinlm.eval.runner import EvalOptions, markdown_table, run_eval
    from marinlm.loading import load_model
    from marinlm.parallel.distributed import shutdown_distributed

    main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun: the ranks share the work, rank 0 reports
    # Space- or comma-separated, as `marinlm lm-eval` takes them (a bpb:PATH keeps its commas)
    tasks = [t for spec in args.tasks for t in ([spec] if spec.startswith("bpb:") else spec.split(",")) if t]
    options = EvalOptions(
        tasks=tasks,
        data_dir=args.data_dir,
        limit=args.limit,
        sample=args.sample,
        batch_size=args.batch_size,
        num_fewshot=args.num_fewshot,
        predictions=args.predictions,
        hf_datasets=dict(_hf_source(spec) for spec in args.hf),
        progress=main_rank,
    )
    try:
        loaded = load_model(args.run, device=args.device)
        output = Path(args.output) if args.output else _default_eval_output(loaded.checkpoint)
        if args.output and (output.is_dir() or args.output.endswith(("/", os.sep))):  # like `cp FILE DIR/`
            output = _unused_result_path(output, "eval")
        # Results are written once, at the end: a folder that cannot be made must fail now, not after
        # the scoring.
        if main_rank:
            output.parent.mkdir(parents=True, exist_ok=True)
        report = run_eval(loaded, options, output if main_rank else None)
    finally:
        shutdown_distributed()
    if main_rank:
        print(markdown_table(report))
        print(f"results: {output}")
    return 0


def _default_eval_output(checkpoint: Path) -> Path:
    """RUN/eval/step-N.json for a run's checkpoint: a checkpoint folder is deleted by retention
    (checkpoint.keep_last) while training goes on, and results kept in it would go with it.
    CHECKPOINT/eval.json for a checkpoint outside a run. Never over an earlier result: -2, -3, ..."""
    if checkpoint.parent.name == "checkpoints":
        return _unused_result_path(checkpoint.parent.parent / "eval", checkpoint.name)
    return _unused_result_path(checkpoint, "eval")


def _unused_result_path(folder: Path, stem: str) -> Path:
    """FOLDER/STEM.json, or the first of STEM-2.json, STEM-3.json, ... not taken (nor its .md)."""
    path, n = folder / f"{stem}.json", 2
    while path.exists() or path.with_suffix(".md").exists():
        path, n = folder / f"{stem}-{n}.json", n + 1
    return path
