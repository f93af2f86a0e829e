"""`marinlm finetune CONFIG` and `marinlm finetune merge RUN`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from marinlm.commands import help_of


def load_finetune_config(path: str | None, overrides: list[str]):
    """The FinetuneConfig of a YAML file and `--a.b=c` overrides; the model section is the base
    run's (keys given under `model:` change it, e.g. model.z_loss_weight)."""
    from marinlm.config import ConfigError, from_dict, load_config, merge, parse_overrides, read_yaml, to_dict
    from marinlm.config.files import file_sections, origin, resolve_file_refs
    from marinlm.finetune.config import FinetuneConfig
    from marinlm.presets import find_config
    from marinlm.train.checkpoint import resolve_checkpoint
    from marinlm.train.config import TrainConfig

    data, base_dir, over = {}, Path.cwd(), {}
    if path is not None:
        found = find_config(path)
        data, base_dir = read_yaml(found), found.parent
    model_file = ("model",) in file_sections(data)
    data = resolve_file_refs(data, base_dir, FinetuneConfig)
    if overrides:
        try:
            over = parse_overrides(overrides)
            model_file = model_file or ("model",) in file_sections(over)
            data = merge(data, resolve_file_refs(over, Path.cwd(), FinetuneConfig))
        except ConfigError as e:
            raise ConfigError(e.key, e.reason + " (set on the command line)") from None
    if not data.get("base"):
        raise ConfigError("base", "name the run or checkpoint to fine-tune (--base=RUN)")
    if not model_file:  # `model: FILE` stands alone: a model other than the base's (`marinlm plan` of one)
        base = load_config(TrainConfig, resolve_checkpoint(data["base"]) / "config.yaml")
        data["model"] = merge(to_dict(base.model), data.get("model") or {})
    try:
        return from_dict(FinetuneConfig, data)
    except ConfigError as e:
        raise ConfigError(e.key, e.reason + origin(e.key, over, path)) from None


def add_commands(commands) -> None:
    ft = commands.add_parser(
        "finetune",
        allow_abbrev=False,  # `--base=RUN` is the config key, not short for --base-checkpoint
        help=help_of("finetune"),
        description="`marinlm finetune CONFIG [--key=value ...]` fine-tunes (configs/finetune/*.yaml); "
        "`marinlm finetune merge RUN [--out DIR]` folds a LoRA run's adapters into plain weights.",
    )
    ft.add_argument("config", help="a fine-tuning YAML, or `merge`")
    ft.add_argument("run", nargs="?", help="with merge: the fine-tuning run")
    ft.add_argument("--resume", default="auto", help="auto, none, or a checkpoint or run folder")
    ft.add_argument("--out", default=None, help="with merge: the folder of the merged run (default RUN/merged)")
    ft.add_argument(
        "--base-checkpoint",
        default=None,
        metavar="STEP|FOLDER",
        help="which checkpoint of the base run a new fine-tune starts from (default: its newest good one); "
        "a resumed fine-tune always keeps the one it began on",
    )
    ft.add_argument(
        "--print-config",
        dest="print_finetune_config",  # resolved here, with the base run's model, not by the generic loader
        action="store_true",
        help="print the resolved config (the file, the base run's model, then the overrides) and exit",
    )
    ft.set_defaults(func=_finetune, takes_overrides=True)


def _finetune(args: argparse.Namespace, overrides) -> int:
    if args.config == "merge":
        from marinlm.finetune.loading import merge_run

        if not args.run:
            raise ValueError("finetune merge: name the fine-tuning run")
        saved = merge_run(args.run, args.out)
        print(f"merged run: {saved.parent.parent} (generate, eval and export take it)")
        return 0
    from marinlm.jobs import run_finetune

    if args.base_checkpoint is not None:
        overrides = [*overrides, f"--base_checkpoint={args.base_checkpoint}"]
    config = load_finetune_config(args.config, list(overrides))
    if args.print_finetune_config:
        from marinlm.config import dump_config

        print(dump_config(config), end="")
        return 0
    summary = run_finetune(config, resume=args.resume)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun the first rank reports
        return 0
    if summary.get("validation"):
        print(f"held-out answer loss {summary['validation']['val/answer_loss']:.4f}")
    if summary.get("adapter"):
        print(f"adapter (peft format): {summary['adapter']}")
    return 0
