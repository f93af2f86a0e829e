"""Plain text: a file is one document, or several cut at a pattern or at paragraph breaks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from marinlm.data.readers.base import (
    _UNDECODABLE,
    TEXT_SUFFIXES,
    Document,
    Rejected,
    _clip,
    decompressed,
)
from marinlm.utils.io import strip_bom


def chunk_text(text: str, max_chars: int) -> list[str]:
    """`text` in consecutive pieces of at most `max_chars` characters that join back to it exactly,
    each cut after a blank line where one falls in the window, else after a line end, else hard."""
    chunks = []
    while len(text) > max_chars:
        window, floor = text[:max_chars], max_chars // 4  # a cut leaves at least a quarter of a piece
        cut = next((window.rfind(sep) + len(sep) for sep in ("\n\n", "\n") if window.rfind(sep) >= floor), max_chars)
        chunks.append(text[:cut])
        text = text[cut:]
    return [*chunks, text] if text or not chunks else chunks


def read_text_file(
    path: Path, source: str, split_pattern: str = "", chunk_chars: int = 0
) -> Iterator[Document | Rejected]:
    """A .txt(.gz/.zst) file as one document (its path is the id), or several when `split_pattern` (a
    regex) is given; with `chunk_chars`, a longer one is cut at paragraph breaks (`chunk_text`)."""
    name = path.name
    try:
        data = path.read_bytes() if name.endswith(TEXT_SUFFIXES) else decompressed(path)
    except ValueError as e:
        yield Rejected(source, str(path), str(e).removeprefix(f"{path}: "))
        return
    # Undecodable bytes are carried as lone surrogates, so that a file cut into documents loses
    # only the documents that hold them.
    raw = strip_bom(data).decode("utf-8", errors="surrogateescape")
    # Windows line ends read as "\n", as Python's text mode reads them: `split_pattern` and the
    # paragraph breaks that `chunk_chars` cuts at see the same text whatever wrote the file.
    text = raw.replace("\r\n", "\n")
    parts = re.split(split_pattern, text) if split_pattern else [text]
    if chunk_chars:
        parts = [chunk for part in parts for chunk in chunk_text(part, chunk_chars)]
    whole = len(parts) == 1
    for i, part in enumerate(parts):
        where = str(path) if whole else f"{path}#{i}"
        if _UNDECODABLE.search(part):
            within = raw if whole else part  # a whole file: the offset on disk
            at = len(within[: _UNDECODABLE.search(within).start()].encode("utf-8", errors="surrogateescape"))
            of = "" if whole else " of this document"
            yield Rejected(
                source, where, f"invalid UTF-8 at byte {at}{of}", _clip(part.encode(errors="surrogateescape"))
            )
        elif whole or part.strip():
            metadata = {"file": str(path)} if whole else {"file": str(path), "part": i}
            yield Document(id=where, text=part, source=source, metadata=metadata)
