"""HF `datasets` as a source of documents."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from marinlm.data.readers.base import Document, Rejected, _from_record


def read_hf_dataset(
    name: str, split: str = "train", text_field: str = "text", id_field: str | None = "id", **kwargs
) -> Iterator[Document | Rejected]:
    """Stream documents from HF `datasets` (a hub name, or a local builder like "json" with
    data_files=...). Needs network for hub datasets; tested on local files."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"HF dataset {name!r}: needs HF datasets; `pip install datasets`") from None

    ds = datasets.load_dataset(name, split=split, streaming=True, **kwargs)
    source = kwargs.get("data_files") and Path(str(kwargs["data_files"])).stem or name.replace("/", "_")
    for i, record in enumerate(ds):
        yield _from_record(record, f"{name}:{split}:{i}", text_field, id_field, source, {"dataset": name, "index": i})
