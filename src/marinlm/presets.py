"""The shipped configs (also at configs/ in a checkout): usable from a plain `pip install`."""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def preset(kind: str, name: str) -> Path:
    """Path of a shipped YAML, e.g. preset("model", "tiny")."""
    path = CONFIG_DIR / kind / f"{name}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in (CONFIG_DIR / kind).glob("*.yaml"))
        raise FileNotFoundError(f"no {kind} preset {name!r}; available: {available}")
    return path
