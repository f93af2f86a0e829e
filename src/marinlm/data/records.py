"""Record files between the curation stages: documents as JSON lines or Parquet, written atomically."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from marinlm.data.readers import Document
from marinlm.utils.io import atomic_path

REPEAT = re.compile(r"#repeat\d+$")


def repeat_id(doc_id: str, k: int) -> str:
    """The id of the k-th extra copy of a document that the mixture upsamples."""
    return f"{doc_id}#repeat{k}"


def original_id(doc_id: str) -> str:
    """The id a repeated copy was made from: the train/val split keys on it, so that every copy of a
    document falls on the same side and validation never scores text that training saw."""
    return REPEAT.sub("", doc_id)


def doc_record(doc: Document) -> dict:
    return {"id": doc.id, "text": doc.text, "source": doc.source, "metadata": doc.metadata}


def write_records(path: Path, records: list[dict], fmt: str) -> None:
    with atomic_path(path) as tmp:
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.table(
                {
                    "id": [r["id"] for r in records],
                    "text": [r["text"] for r in records],
                    "source": [r["source"] for r in records],
                    "metadata": [json.dumps(r["metadata"], ensure_ascii=False) for r in records],
                }
            )
            pq.write_table(table, tmp)
        else:
            import zstandard

            with open(tmp, "wb") as raw, zstandard.ZstdCompressor(level=3).stream_writer(raw) as z:
                for r in records:
                    z.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))


def read_records(path: Path) -> list[dict]:
    import zstandard

    with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as z:
        return [json.loads(line) for line in io.TextIOWrapper(z, encoding="utf-8") if line.strip()]
