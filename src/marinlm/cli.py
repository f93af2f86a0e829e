"""The `marinlm` command line. Thin: every command calls an importable function.

Extra `--a.b=value` arguments are config overrides.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from marinlm.config import ConfigError


def config_class_for(path: str | Path) -> type:
    """The config class a shipped YAML file holds, from its folder under configs/."""
    from marinlm.model.config import MarinConfig

    classes = {"model": MarinConfig}
    folder = Path(path).resolve().parent.name
    if folder not in classes:
        raise ValueError(f"{path}: no config class for folder {folder!r}; known: {sorted(classes)}")
    return classes[folder]


def _model_summary(args, overrides) -> int:
    from marinlm.config import load_config
    from marinlm.model.config import MarinConfig
    from marinlm.model.summary import summarize

    config = load_config(MarinConfig, args.config, overrides)
    print(summarize(config, args.seq_len).table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marinlm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    summary = model.add_parser("summary", help="count parameters and FLOPs on the meta device")
    summary.add_argument("config", help="model YAML, e.g. configs/model/marin-535b-a23b.yaml")
    summary.add_argument("--seq-len", type=int, default=None, help="sequence length for attention FLOPs")
    summary.set_defaults(func=_model_summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a)]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)} (config overrides look like --a.b=value)")
    try:
        return args.func(args, rest)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
