"""Cutting a big .jsonl(.gz/.zst) or .parquet file into parts read as separate tasks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from marinlm.data.readers.base import _open_lines

# A compressed stream cannot be entered in the middle: each part decompresses (and skips) every line
# before its own, so a compressed file gets at most this many parts, which bounds that waste to
# about half the file's decompression per part (cheap beside the filters' cost per byte).
MAX_COMPRESSED_PARTS = 16


def input_parts(path: Path, split_bytes: int) -> list[dict | None]:
    """The parts to read `path` in, about `split_bytes` each: `[None]` (the whole file) unless it is
    a .jsonl(.gz/.zst) or a .parquet file bigger than that. A .jsonl part is `{"start", "end",
    "line"}`: a byte range starting at a line, and that line's number; a compressed one is
    `{"lines": [first, end]}`; a .parquet part is `{"groups": [first, end], "row"}`: row groups,
    and the rows before them. Each has its `bytes` on disk, for progress."""
    size = path.stat().st_size
    if split_bytes <= 0:
        return [None]
    if path.name.endswith((".jsonl.gz", ".jsonl.zst")):
        return _compressed_parts(path, size, split_bytes)
    if size <= split_bytes:
        return [None]
    count = -(-size // split_bytes)
    if path.name.endswith(".jsonl"):
        return _jsonl_parts(path, size, count)
    if path.name.endswith(".parquet"):
        return _parquet_parts(path, size, count)
    return [None]


def whole_file_reason(path: Path) -> str:
    """Why `input_parts` reads `path` whole however big it is, and what would let it be cut."""
    if path.name.endswith((".jsonl.gz", ".jsonl.zst")):
        return "its compressed stream could not be read to the end (`rejected/` says where it breaks); repair it"
    if path.name.endswith(".parquet"):
        return "it has a single row group; write it with smaller row groups (pyarrow's row_group_size)"
    return "only .jsonl and .parquet files are read in parts; split it into several files, or convert it to .jsonl"


def _jsonl_parts(path: Path, size: int, count: int) -> list[dict]:
    starts = [0]
    with open(path, "rb") as f:
        for k in range(1, count):
            f.seek(size * k // count - 1)
            f.readline()  # to the end of the line that holds the byte before the cut
            if f.tell() > starts[-1] and f.tell() < size:
                starts.append(f.tell())
        # One pass counts the lines before each start (a line too long for one part spans several cuts).
        lines, newlines, pos = [], 0, 0
        f.seek(0)
        for start in starts:
            while pos < start:
                chunk = f.read(min(1 << 24, start - pos))
                newlines += chunk.count(b"\n")
                pos += len(chunk)
            lines.append(newlines + 1)
    ends = [*starts[1:], size]
    return [{"start": s, "end": e, "line": n, "bytes": e - s} for s, e, n in zip(starts, ends, lines, strict=True)]


def _parquet_parts(path: Path, size: int, count: int) -> list[dict] | list[None]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception:
        return [None]  # unreadable: the reader rejects it, whole
    groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
    if len(groups) < 2:
        return [None]
    total = sum(g.total_byte_size for g in groups) or 1
    parts, row, before = [], 0, 0
    for g, group in enumerate(groups):
        if not parts or before * count // total >= len(parts):  # this group begins the next part
            parts.append({"groups": [g, g + 1], "row": row, "bytes": 0})
        parts[-1]["groups"][1] = g + 1
        parts[-1]["bytes"] += group.total_byte_size
        row += group.num_rows
        before += group.total_byte_size
    for part in parts:  # progress counts the file's bytes on disk
        part["bytes"] = size * part["bytes"] // total
    return parts


def _compressed_parts(path: Path, size: int, split_bytes: int) -> list[dict] | list[None]:
    """Parts of equal line counts, from one pass that counts the lines and their bytes."""
    if size * 20 <= split_bytes:  # text rarely compresses 20-fold: too small to count
        return [None]
    lines = raw = 0
    try:
        for line in _open_lines(path):
            lines += 1
            raw += len(line)
    except Exception:  # truncated or corrupt: read whole, the reader rejects it where it breaks
        return [None]
    count = min(-(-raw // split_bytes), MAX_COMPRESSED_PARTS, lines)
    if count <= 1:
        return [None]
    firsts = [1 + lines * k // count for k in range(count)]
    ends = [*firsts[1:], lines + 1]
    return [{"lines": [a, b], "bytes": size * (b - a) // lines} for a, b in zip(firsts, ends, strict=True)]


def _jsonl_range_lines(path: Path, start: int, end: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        while start < end:
            line = f.readline()
            if not line:
                return
            start += len(line)
            yield line
