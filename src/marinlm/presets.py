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


def find_config(path: str | Path) -> Path:
    """A config path as given, or else the shipped copy: `configs/train/tiny.yaml` (the README's
    spelling), `train/tiny.yaml` or `train/tiny` work from any folder with a plain `pip install`.

    A file that exists as given always wins; a path that is found nowhere is returned unchanged, for
    the caller's "not found" error (which `shipped_configs()` can complete)."""
    path = Path(path)
    if path.is_file() or path.is_absolute():
        return path
    return shipped_config(path) or path


def shipped_config(path: str | Path) -> Path | None:
    """The shipped config that a relative `path` names (`configs/train/tiny.yaml`, `train/tiny.yaml`
    or `train/tiny`), or None."""
    path = Path(path)
    parts = path.parts[1:] if path.parts[:1] == ("configs",) else path.parts
    if not parts or path.is_absolute():
        return None
    shipped = CONFIG_DIR.joinpath(*parts)
    return next((c for c in (shipped, shipped.with_name(shipped.name + ".yaml")) if c.is_file()), None)


def shipped_configs() -> list[str]:
    """The shipped configs as `kind/name.yaml`."""
    return sorted(str(p.relative_to(CONFIG_DIR)) for p in CONFIG_DIR.rglob("*.yaml"))
