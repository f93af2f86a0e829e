"""Benchmark corpora: the shared corpora when present, else text every Python installation ships."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus"


def english() -> list[str]:
    """Prose: tinyshakespeare + wikitext (shared data), else pydoc's bundled topic texts."""
    if (SHARED / "tinyshakespeare.txt").exists():
        text = (SHARED / "tinyshakespeare.txt").read_text() + (SHARED / "wikitext2_valid.txt").read_text()
        return [p for p in text.split("\n\n") if p.strip()]
    from pydoc_data.topics import topics

    return list(topics.values())


def chinese() -> list[str]:
    if not (SHARED / "zh_songci300.json").exists():
        return []
    poems = json.loads((SHARED / "zh_songci300.json").read_text())
    lunyu = json.loads((SHARED / "zh_lunyu.json").read_text())
    return ["".join(p["paragraphs"]) for p in poems] + ["".join(c["paragraphs"]) for c in lunyu]


def python_code(limit_bytes: int = 8_000_000) -> list[str]:
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return texts
