"""A .json file holding a list of records or of plain texts."""

from __future__ import annotations

import json
from pathlib import Path

from marinlm.data.readers.base import Rejected, _from_record, _json_kind
from marinlm.utils.io import strip_bom


def read_json_array(path: Path, text_field, id_field, source):
    try:
        records = json.loads(strip_bom(path.read_bytes()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        yield Rejected(source, str(path), f"unreadable JSON file: {e}")
        return
    except RecursionError:
        yield Rejected(source, str(path), "unreadable JSON file: nested too deeply to parse")
        return
    if not isinstance(records, list):
        got = _json_kind(records)
        yield Rejected(source, str(path), f"a .json input must hold a list of records or texts, got {got}")
        return
    for i, record in enumerate(records):
        yield _from_record(record, f"{path}:{i}", text_field, id_field, source, {"file": str(path), "index": i})
