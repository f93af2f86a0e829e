"""Parquet, read row group by row group."""

from __future__ import annotations

from pathlib import Path

from marinlm.data.readers.base import Rejected, _from_record


def read_parquet(path: Path, text_field, id_field, source, part: dict | None = None):
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as e:
        yield Rejected(source, str(path), f"unreadable parquet: {e}")
        return
    if text_field not in table.schema_arrow.names:
        names = ", ".join(repr(n) for n in table.schema_arrow.names)  # a parenthesis: the report groups the rest
        yield Rejected(source, str(path), f"missing column {text_field!r} (its columns are {names})")
        return
    # A row group at a time: a corrupt one costs its own rows, not the rest of the file.
    row = part["row"] if part else 0
    for group in range(*(part["groups"] if part else [0, table.num_row_groups])):
        end = row + table.metadata.row_group(group).num_rows
        try:
            for batch in table.iter_batches(row_groups=[group]):
                for record in batch.to_pylist():
                    row += 1
                    provenance = {"file": str(path), "row": row}
                    yield _from_record(record, f"{path}:{row}", text_field, id_field, source, provenance)
        except Exception as e:
            where = f"{path}:{row + 1}-{end}"
            yield Rejected(source, where, f"corrupt parquet data (row group {group}, rows {row + 1}-{end}): {e}")
        row = end
