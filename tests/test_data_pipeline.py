from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marinlm.config import ConfigError, from_dict, load_config, save_config
from marinlm.data.pipeline import PipelineConfig, read_records, run_pipeline
from marinlm.data.readers import Document, Rejected, read_documents, read_hf_dataset
from marinlm.utils.io import OutputInUseError

from conftest import ROOT, SHARED_DATA, shared_data

_RNG = random.Random(1234)
# Pseudo-words: distinct documents share few character 5-grams, as real distinct documents do.
WORDS = ["".join(_RNG.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(_RNG.randint(3, 9))) for _ in range(3000)]


def synthetic_docs(n: int, seed: int, words: int = 150) -> list[str]:
    rng = random.Random(seed)
    return [f"Record {seed}-{i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) + "." for i in range(n)]


def near_duplicate(text: str, rng: random.Random, edits: int = 3) -> str:
    words = text.split()
    for _ in range(edits):
        words[rng.randrange(2, len(words))] = rng.choice(WORDS)
    return " ".join(words)


def write_jsonl(path: Path, texts: list[str], prefix: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": f"{prefix}{i}", "text": t}) + "\n")


def bare_config(out: Path, sources: list[dict], **overrides) -> PipelineConfig:
    """Only the steps a test is about: filters off unless turned on."""
    base = {
        "output_dir": str(out),
        "workers": 1,
        "progress": False,
        "sources": sources,
        "langid": {"enabled": False},
        "pii": {"enabled": False},
        "decontam": {"enabled": False},
        "quality": {
            "gopher_quality": {"enabled": False},
            "gopher_repetition": {"enabled": False},
            "c4": {"enabled": False},
            "fineweb": {"enabled": False},
        },
    }
    from marinlm.config import merge

    return from_dict(PipelineConfig, merge(base, overrides))


def test_dedup_finds_planted_duplicates(tmp_path):
    rng = random.Random(0)
    originals = synthetic_docs(300, seed=1)
    exact = [originals[i] for i in range(0, 40)]
    near = [near_duplicate(originals[i], rng) for i in range(40, 80)]
    write_jsonl(tmp_path / "in" / "a.jsonl", originals[:150], "a")
    write_jsonl(tmp_path / "in" / "b.jsonl", originals[150:] + exact + near, "b")
    report = run_pipeline(
        bare_config(tmp_path / "out", [{"name": "web", "inputs": [str(tmp_path / "in")]}], dedup={"paragraphs": False})
    )
    dropped = [json.loads(line) for line in (tmp_path / "out" / "dropped" / "dedup" / "00001.jsonl").open()]
    found = {d["id"] for d in dropped}
    planted = {f"b{150 + i}" for i in range(80)}
    recall = len(found & planted) / len(planted)
    precision = len(found & planted) / max(1, len(found))
    assert recall >= 0.95 and precision == 1.0, (recall, precision)
    reasons = {d["id"]: d["reason"] for d in dropped}
    assert all(reasons[f"b{150 + i}"] == "exact_duplicate" for i in range(40))
    assert report["dedup"]["fuzzy_duplicates"] >= 38
    assert report["accounting"]["web"] == {**report["accounting"]["web"], "in": 380, "kept": 380 - len(found)}


def test_fuzzy_dedup_over_merging_is_reported(tmp_path):
    template = "Dear customer, your order number {} has shipped and will arrive soon. " * 6
    write_jsonl(tmp_path / "in" / "t.jsonl", [template.replace("{}", str(i)) for i in range(50)], "t")
    write_jsonl(tmp_path / "in2" / "u.jsonl", synthetic_docs(50, seed=2), "u")
    report = run_pipeline(
        bare_config(
            tmp_path / "out",
            [
                {"name": "templated", "inputs": [str(tmp_path / "in")]},
                {"name": "prose", "inputs": [str(tmp_path / "in2")]},
            ],
        )
    )
    loss = report["dedup"]["fuzzy_by_source"]["templated"]
    assert loss["fraction"] > 0.9 and loss["clusters_by_size"]
    assert any("templated" in w and "over-merged" in w for w in report["warnings"])
    assert report["dedup"]["fuzzy_by_source"]["prose"]["removed"] == 0
    assert "Warning" in (tmp_path / "out" / "report.md").read_text()


REPETITIVE = [f"Doc {i}. " + "The quick brown fox jumps over the lazy dog by the river. " * 20 for i in range(6)]


def test_documents_without_a_language_are_not_judged_silently(tmp_path):
    """With langid off, the English filters judge only records that carry a `language` field."""
    write_jsonl(tmp_path / "plain" / "p.jsonl", REPETITIVE, "p")
    (tmp_path / "tagged").mkdir()
    lines = [json.dumps({"id": f"t{i}", "text": t, "language": "en"}) for i, t in enumerate(REPETITIVE)]
    (tmp_path / "tagged" / "t.jsonl").write_text("\n".join(lines) + "\n")
    sources = [{"name": "plain", "inputs": [str(tmp_path / "plain")]}]
    sources.append({"name": "tagged", "inputs": [str(tmp_path / "tagged")]})
    quality = {"gopher_repetition": {"enabled": True}}
    report = run_pipeline(bare_config(tmp_path / "out", sources, quality=quality, dedup={"fuzzy": False}))
    assert report["accounting"]["tagged"]["output_documents"] == 0  # judged: all repetitive
    assert report["accounting"]["plain"]["output_documents"] == 6  # passed over
    unjudged = [w for w in report["warnings"] if "unjudged" in w]
    assert len(unjudged) == 1 and unjudged[0].startswith("gopher_repetition passed over 6 documents unjudged")
    assert "quality.languages: []" in unjudged[0]

    quality["languages"] = []
    report = run_pipeline(bare_config(tmp_path / "out2", sources, quality=quality, dedup={"fuzzy": False}))
    assert report["accounting"]["plain"]["output_documents"] == 0
    assert not [w for w in report["warnings"] if "unjudged" in w]


def test_a_source_that_keeps_nothing_is_told_which_step_dropped_it(tmp_path):
    write_jsonl(tmp_path / "rep" / "r.jsonl", REPETITIVE, "r")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "b.jsonl").write_text('{"text": "cut off\n{also bad\n')
    write_jsonl(tmp_path / "prose" / "p.jsonl", synthetic_docs(6, seed=5), "p")
    repetition = {"enabled": True}
    report = run_pipeline(
        bare_config(
            tmp_path / "out",
            [
                {"name": "repeats", "inputs": [str(tmp_path / "rep")]},
                {"name": "broken", "inputs": [str(tmp_path / "bad")]},
                {"name": "prose", "inputs": [str(tmp_path / "prose")]},
            ],
            quality={"languages": [], "gopher_repetition": repetition},
            dedup={"fuzzy": False},
        )
    )
    assert report["accounting"]["prose"]["output_documents"] == 6
    assert len(report["warnings"]) == 2, report["warnings"]
    repeats, broken = report["warnings"]
    assert "'repeats' kept none of its 6 documents: gopher_repetition dropped 6" in repeats
    assert str(tmp_path / "out" / "dropped" / "gopher_repetition") in repeats
    assert "`quality.gopher_repetition`" in repeats
    assert "'broken' kept none of its 2 documents: read rejected 2 (malformed JSON: 2)" in broken
    assert str(tmp_path / "out" / "rejected") in broken
    assert repeats in (tmp_path / "out" / "report.md").read_text()


def test_paragraph_dedup_removes_repeated_boilerplate(tmp_path):
    boiler = "Subscribe to our newsletter for weekly updates about gardening and home repair."
    docs = [f"{t}\n\n{boiler}" for t in synthetic_docs(5, seed=3)]
    write_jsonl(tmp_path / "in" / "p.jsonl", docs, "p")
    report = run_pipeline(
        bare_config(tmp_path / "out", [{"name": "web", "inputs": [str(tmp_path / "in")]}], dedup={"fuzzy": False})
    )
    out = read_records(tmp_path / "out" / "shards" / "00000.jsonl.zst")
    assert sum(boiler in r["text"] for r in out) == 1 and len(out) == 5
    assert report["dedup"]["paragraphs_removed"] == 4


def test_decontamination_finds_planted_benchmark_passages(tmp_path):
    evals = tmp_path / "eval"
    evals.mkdir()
    lambada = [" ".join(synthetic_docs(1, seed=10 + i, words=40)) for i in range(5)]
    write_jsonl(evals / "lambada.jsonl", lambada, "l")
    with open(evals / "arc.jsonl", "w") as f:
        f.write(
            json.dumps(
                {
                    "query": "Question: Which gas do plants absorb from the air to make food?",
                    "choices": ["oxygen", "carbon dioxide"],
                    "gold": 1,
                }
            )
            + "\n"
        )
    clean = synthetic_docs(10, seed=99)
    planted = [
        clean[0] + " " + lambada[2] + " " + clean[1],
        "Homework help: which gas do plants absorb from the air to make food? Carbon dioxide.",
        clean[2].upper() + " " + lambada[4].upper(),
    ]  # case does not hide it
    write_jsonl(tmp_path / "in" / "c.jsonl", clean[3:] + planted, "c")
    src = [{"name": "web", "inputs": [str(tmp_path / "in")]}]
    report = run_pipeline(bare_config(tmp_path / "drop", src, decontam={"enabled": True, "eval_paths": [str(evals)]}))
    step = next(s for s in report["steps"] if s["step"] == "decontaminate")
    assert step["counters"] == {"contaminated_lambada": 2, "contaminated_arc": 1}
    assert report["accounting"]["web"]["kept"] == 7
    spans = run_pipeline(
        bare_config(
            tmp_path / "span", src, decontam={"enabled": True, "eval_paths": [str(evals)], "mode": "remove_span"}
        )
    )
    out = {r["id"]: r["text"] for r in read_records(tmp_path / "span" / "shards" / "00000.jsonl.zst")}
    assert lambada[2].split()[10] not in out["c7"].split()[160:] and clean[0][:50] in out["c7"]
    assert spans["accounting"]["web"]["kept"] == 10


def test_bad_input_is_rejected_by_file_and_line(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    good = synthetic_docs(3, seed=4)
    (raw / "mixed.jsonl").write_bytes(
        (json.dumps({"id": "g0", "text": good[0]}) + "\n").encode()
        + b'{"id": "broken", "text": "unterminated\n'
        + b'{"id": "bad-utf8", "text": "\xff\xfe"}\n'
        + (json.dumps({"id": "no-text", "body": "x"}) + "\n").encode()
        + (json.dumps({"id": "num", "text": 42}) + "\n").encode()
        + (json.dumps({"id": "null", "text": None}) + "\n").encode()
        + (json.dumps({"id": "empty", "text": "   "}) + "\n").encode()
        + (json.dumps({"id": "huge", "text": "word " * 3000}) + "\n").encode()
    )
    payload = "".join(json.dumps({"id": f"z{i}", "text": t}) + "\n" for i, t in enumerate(good)).encode()
    (raw / "cut.jsonl.gz").write_bytes(gzip.compress(payload)[:-30])
    import zstandard

    (raw / "cut.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(payload * 50)[:-40])
    report = run_pipeline(
        bare_config(
            tmp_path / "out",
            [{"name": "raw", "inputs": [str(raw)]}],
            max_doc_bytes=10_000,
            dedup={"exact": False, "fuzzy": False},
        )
    )
    rejected = [json.loads(line) for p in sorted((tmp_path / "out" / "rejected").glob("*.jsonl")) for line in p.open()]
    reasons = " | ".join(f"{r['location']} {r['reason']}" for r in rejected)
    for expected in (
        "mixed.jsonl:2 malformed JSON",
        "mixed.jsonl:3 invalid UTF-8",
        "mixed.jsonl:4 missing field",
        "mixed.jsonl:5 field 'text' is int",
        "mixed.jsonl:6 field 'text' is null",
        "empty document",
        "document too large",
        "cut.jsonl.gz",
        "cut.jsonl.zst",
    ):
        assert expected in reasons, (expected, reasons)
    a = report["accounting"]["raw"]
    assert a["in"] == a["kept"] + a["dropped"] + a["rejected"]
    assert a["rejected"] == len(rejected) == 9
    assert (
        "each rejected record (unreadable, with its file and line) in `rejected/`"
        in (tmp_path / "out" / "report.md").read_text()
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_a_lone_surrogate_and_deep_nesting_in_valid_json_lose_nothing_else(tmp_path, workers):
    """Two lines found by fault injection: a lone surrogate escaped in valid JSON aborted the whole
    curation with an encoding error naming no file (the size check encoded the text before
    normalize), and a line nested 200,000 deep aborted it with a RecursionError. The first is
    kept with U+FFFD in its place, the second rejected by file and line; the rest is curated."""
    raw = tmp_path / "raw"
    raw.mkdir()
    good = synthetic_docs(3, seed=5)
    lines = [json.dumps({"id": f"g{i}", "text": t}) for i, t in enumerate(good)]
    lines.insert(1, '{"id": "surrogate", "text": "' + good[0][:200] + ' \\ud800 end"}')
    lines.insert(3, "[" * 200_000 + "]" * 200_000)
    (raw / "hostile.jsonl").write_text("\n".join(lines) + "\n")
    config = bare_config(
        tmp_path / "out",
        [{"name": "raw", "inputs": [str(raw)]}],
        workers=workers,
        dedup={"exact": False, "fuzzy": False},
    )
    report = run_pipeline(config)
    rejected = [json.loads(line) for p in sorted((tmp_path / "out" / "rejected").glob("*.jsonl")) for line in p.open()]
    assert [r["location"].rsplit("/", 1)[-1] for r in rejected] == ["hostile.jsonl:4"]
    assert "nested too deeply" in rejected[0]["reason"]
    shards = sorted((tmp_path / "out" / "shards").glob("*.jsonl.zst"))
    kept = [r for shard in shards for r in read_records(shard) if r["id"] == "surrogate"]
    assert kept and "\ufffd end" in kept[0]["text"]
    a = report["accounting"]["raw"]
    assert a["in"] == 5 and a["in"] == a["kept"] + a["dropped"] + a["rejected"] and a["rejected"] == 1


def test_an_empty_jsonl_source_is_warned_of_as_an_empty_txt_one(tmp_path):
    (tmp_path / "good").mkdir()
    write_jsonl(tmp_path / "good" / "a.jsonl", synthetic_docs(3, seed=6), "g")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "nothing.jsonl").write_text("")
    sources = [
        {"name": "good", "inputs": [str(tmp_path / "good")]},
        {"name": "empty", "inputs": [str(tmp_path / "empty")]},
    ]
    report = run_pipeline(bare_config(tmp_path / "out", sources, dedup={"exact": False, "fuzzy": False}))
    assert any(w.startswith("source 'empty' read no documents") for w in report["warnings"]), report["warnings"]
    assert not any("'good'" in w for w in report["warnings"])


def parquet_with_a_corrupt_row_group(path: Path, texts: list[str]) -> bytes:
    """`texts` as a parquet file in row groups of 3, the second group's data overwritten; returns its bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), path, row_group_size=3, compression="none")
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data[start : start + chunk.total_compressed_size] = b"\xff" * chunk.total_compressed_size
    path.write_bytes(data)
    return bytes(data)


def test_malformed_files_of_every_format_are_rejected_by_place_and_lose_nothing_else(tmp_path):
    texts = [f"parquet document {i}" for i in range(9)]
    data = parquet_with_a_corrupt_row_group(tmp_path / "a.parquet", texts)
    items = list(read_documents(tmp_path / "a.parquet"))
    assert [d.text for d in items if isinstance(d, Document)] == texts[:3] + texts[6:]  # groups 0 and 2 kept
    [bad] = [r for r in items if isinstance(r, Rejected)]
    assert bad.location == f"{tmp_path / 'a.parquet'}:4-6" and "row group 1" in bad.reason

    (tmp_path / "b.parquet").write_bytes(data[: len(data) // 2])  # no footer
    [cut] = read_documents(tmp_path / "b.parquet")
    assert cut.location == str(tmp_path / "b.parquet") and "unreadable parquet" in cut.reason
    [other] = read_documents(tmp_path / "a.parquet", text_field="content")
    assert other.reason == "missing column 'content' (its columns are 'text')"

    (tmp_path / "c.txt").write_bytes(b"fine text\n\xc3(\n")
    [txt] = read_documents(tmp_path / "c.txt")
    assert txt.location == str(tmp_path / "c.txt") and txt.reason == "invalid UTF-8 at byte 10"

    (tmp_path / "d.json").write_text(json.dumps([{"text": ["line one", "line two"]}, "a bare text", 42, None]))
    doc, bare, odd, null = read_documents(tmp_path / "d.json")
    assert null.reason.endswith("got null") and null.raw == "null"  # JSON's words, not Python's NoneType
    assert doc.text == "line one\nline two"
    assert (bare.text, bare.id) == ("a bare text", f"{tmp_path / 'd.json'}:1")  # a list of texts is documents
    assert (
        odd.location == f"{tmp_path / 'd.json'}:2"
        and "expected a JSON object (a record) or a string (a text), got a number" in odd.reason
    )
    (tmp_path / "e.json").write_text(json.dumps({"text": "an object, not a list"}))
    [whole] = read_documents(tmp_path / "e.json")
    assert whole.reason == "a .json input must hold a list of records or texts, got an object with keys ['text']"


def test_a_byte_order_mark_is_not_taken_for_text(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + b'{"text": "first"}\r\n{"text": "second"}\r\n')
    (tmp_path / "b.json").write_bytes(bom + json.dumps([{"text": "listed"}]).encode())
    (tmp_path / "c.txt").write_bytes(bom + b"plain")
    (tmp_path / "d.txt").write_bytes(bom + b"one\n\ntwo")
    texts = {
        name: [d.text for d in read_documents(tmp_path / name, split_pattern="\n\n" if name == "d.txt" else "")]
        for name in ("a.jsonl", "b.json", "c.txt", "d.txt")
    }
    assert texts == {"a.jsonl": ["first", "second"], "b.json": ["listed"], "c.txt": ["plain"], "d.txt": ["one", "two"]}


def test_a_text_file_with_windows_line_ends_is_cut_at_its_paragraphs(tmp_path):
    """A CRLF file was one document under split_pattern "\\n\\n", and chunk_chars found no paragraph break."""
    (tmp_path / "win.txt").write_bytes(b"first line\r\nstill first\r\n\r\nsecond\r\n\r\nthird")
    assert [d.text for d in read_documents(tmp_path / "win.txt", split_pattern="\n\n")] == [
        "first line\nstill first",
        "second",
        "third",
    ]
    pieces = [d.text for d in read_documents(tmp_path / "win.txt", chunk_chars=30)]
    assert pieces == ["first line\nstill first\n\n", "second\n\nthird"]
    # A whole file's bad byte is counted as on disk, CRs included.
    (tmp_path / "bad.txt").write_bytes(b"a\r\nb\r\n\xff")
    [bad] = read_documents(tmp_path / "bad.txt")
    assert bad.reason == "invalid UTF-8 at byte 6"


def test_compressed_text_files_read_as_the_text_they_hold(tmp_path):
    """.txt.gz and .txt.zst (a common form of text dumps) were not inputs: a folder of them was skipped."""
    import zstandard

    from marinlm.data.inputs import expand_inputs

    data = b"first line\r\nstill first\r\n\r\nsecond\r\n\r\nthird \xc3\xa9"
    (tmp_path / "a.txt").write_bytes(data)
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(data))
    (tmp_path / "a.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    assert expand_inputs([str(tmp_path)]) == [tmp_path / n for n in ("a.txt", "a.txt.gz", "a.txt.zst")]
    texts = {n: [d.text for d in read_documents(tmp_path / n, split_pattern="\n\n")] for n in ("a.txt.gz", "a.txt.zst")}
    assert texts["a.txt.gz"] == texts["a.txt.zst"] == ["first line\nstill first", "second", "third é"]
    [doc] = read_documents(tmp_path / "a.txt.gz")
    assert (doc.id, doc.source, doc.text) == (
        str(tmp_path / "a.txt.gz"),
        "a",
        "first line\nstill first\n\nsecond\n\nthird é",
    )
    zst = (tmp_path / "a.txt.zst").read_bytes()
    (tmp_path / "bad.txt.zst").write_bytes(zst[:4] + bytes(b ^ 0xFF for b in zst[4:]))  # zstandard's own error
    for name in ("a.txt.gz", "a.txt.zst", "bad.txt.zst"):  # truncated or corrupt: a rejected record, not an exception
        (tmp_path / f"cut-{name}").write_bytes((tmp_path / name).read_bytes()[:20])
        [bad] = read_documents(tmp_path / f"cut-{name}")
        assert isinstance(bad, Rejected) and bad.location == str(tmp_path / f"cut-{name}")
        assert bad.reason.startswith("truncated or corrupt stream: "), bad.reason


def test_invalid_utf8_in_a_cut_text_file_rejects_only_its_document(tmp_path):
    (tmp_path / "book.txt").write_bytes(b"chapter one\n\nchapter \xff two\n\nchapter three")
    first, bad, third = read_documents(tmp_path / "book.txt", split_pattern="\n\n")
    assert (first.text, third.text) == ("chapter one", "chapter three")
    assert isinstance(bad, Rejected) and bad.location == f"{tmp_path / 'book.txt'}#1"
    assert bad.reason == "invalid UTF-8 at byte 8 of this document" and bad.raw == "chapter \ufffd two"
    pieces = list(read_documents(tmp_path / "book.txt", chunk_chars=16))
    assert [p.text for p in pieces if isinstance(p, Document)] == ["chapter one\n\n", "chapter three"]


def test_missing_input_and_bad_config_fail_fast(tmp_path):
    write_jsonl(tmp_path / "corpus" / "a.jsonl", synthetic_docs(3, seed=1), "a-")
    sources = [
        {"name": "x", "inputs": [str(tmp_path / "corpus")]},
        {"name": "y", "inputs": [str(tmp_path / "nope.jsonl")]},
    ]
    with pytest.raises(FileNotFoundError, match=r"sources\[1\]\.inputs: input path does not exist: .*nope\.jsonl"):
        run_pipeline(bare_config(tmp_path / "o", sources))
    assert not (tmp_path / "o").exists()  # nothing written before the inputs check out
    with pytest.raises(ValueError, match=r"output_dir .*corpus/curated is inside input folder .*corpus of source 'x'"):
        run_pipeline(
            bare_config(tmp_path / "corpus" / "curated", [{"name": "x", "inputs": [str(tmp_path / "corpus")]}])
        )
    assert not (tmp_path / "corpus" / "curated").exists()
    with pytest.raises(ConfigError) as info:
        load_config(PipelineConfig, None, ["--dedup.num_bands=27"])
    assert info.value.key == "dedup.num_bands"
    with pytest.raises(ConfigError) as info:
        load_config(PipelineConfig, None, ["--decontam.mode=mask"])
    assert info.value.key == "decontam.mode"
    for source, key in [({"split_pattern": "(["}, "sources[0].split_pattern"), ({"tokens": -5}, "sources[0].tokens")]:
        with pytest.raises(ConfigError) as info:  # at load, not in a worker halfway through the run
            load_config(PipelineConfig, None, [f"--sources=[{dict(name='x', inputs=['a.txt'], **source)}]"])
        assert info.value.key == key


def test_mixture_meets_token_budgets(tmp_path):
    write_jsonl(tmp_path / "a" / "a.jsonl", synthetic_docs(40, seed=5), "a")
    write_jsonl(tmp_path / "b" / "b.jsonl", synthetic_docs(10, seed=6), "b")
    report = run_pipeline(
        bare_config(
            tmp_path / "out",
            [
                {"name": "big", "inputs": [str(tmp_path / "a")], "weight": 1.0},
                {"name": "small", "inputs": [str(tmp_path / "b")], "weight": 1.0},
            ],
            mixture={"enabled": True, "total_tokens": 10_000, "bytes_per_token": 4.0},
            dedup={"fuzzy": False},
        )
    )
    mix = report["dedup"]["mixture"]
    per_doc = mix["small"]["available_tokens"] / mix["small"]["documents"]
    for source in ("big", "small"):
        assert mix[source]["target_tokens"] == 5_000
        assert 0 <= mix[source]["achieved_tokens"] - 5_000 < 1.5 * per_doc  # overshoot under one document
    assert mix["small"]["emitted_documents"] > 10  # up-sampled: repeats
    assert mix["big"]["emitted_documents"] < 40  # down-sampled
    out = read_records(tmp_path / "out" / "shards" / "00001.jsonl.zst")
    assert any("#repeat" in r["id"] for r in out)


def _run_cli(config_path: Path):
    return subprocess.Popen(
        [sys.executable, "-m", "marinlm", "data", "run", str(config_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the workers it spawns can be found (and killed)
    )


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_progress_has_a_total_so_a_rate_and_an_eta(tmp_path, capsys, monkeypatch):
    """The curation bars counted documents with no total: no ETA, however long the job."""
    from tqdm import tqdm

    monkeypatch.setenv("MARINLM_PROGRESS_INTERVAL", "1000")  # off a terminal: the final line only
    write_jsonl(tmp_path / "in" / "a.jsonl", synthetic_docs(30, seed=1), "a")
    write_jsonl(tmp_path / "in" / "b.jsonl", synthetic_docs(90, seed=2) + synthetic_docs(10, seed=2), "b")
    config = bare_config(tmp_path / "out", [{"name": "web", "inputs": [str(tmp_path / "in")]}], progress=True)
    run_pipeline(config)
    lines = capsys.readouterr().err.splitlines()
    filter_line = next(line for line in lines if line.startswith("curate: filter: 100%"))
    write_line = next(line for line in lines if line.startswith("curate: write: 100%"))
    size = sum(p.stat().st_size for p in (tmp_path / "in").iterdir())
    total = tqdm.format_sizeof(size)
    assert f"| {total}/{total} [" in filter_line, filter_line  # the input bytes, all read
    assert "docs_out=130" in filter_line and "docs_out=120" in write_line  # 10 exact duplicates go at write
    # The global dedup between the two has no units to count: it says what runs and how long it took.
    assert lines.index("curate: dedup and mixture plan over 130 documents") < lines.index(write_line)
    assert any(re.fullmatch(r"curate: dedup and mixture plan done in [\d.]+ s", line) for line in lines)


@pytest.mark.slow
def test_resume_after_kill_gives_identical_output(tmp_path):
    for i in range(6):
        write_jsonl(tmp_path / "in" / f"part{i}.jsonl", synthetic_docs(150, seed=20 + i, words=400), f"p{i}-")
    configs = {}
    for name in ("reference", "killed"):
        configs[name] = tmp_path / f"{name}.yaml"
        save_config(
            bare_config(
                tmp_path / name,
                [{"name": "web", "inputs": [str(tmp_path / "in")]}],
                langid={"enabled": True},
                workers=1,
                progress=True,
            ),
            configs[name],
        )
    ref = _run_cli(configs["reference"])
    assert ref.wait(timeout=300) == 0, ref.stdout.read()
    run = _run_cli(configs["killed"])
    marker_dir = tmp_path / "killed" / ".work" / "stage1"
    deadline = time.time() + 120
    while time.time() < deadline and not list(marker_dir.glob("*.done.json")) and run.poll() is None:
        time.sleep(0.02)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert run.returncode == -signal.SIGKILL, "finished before the kill"
    done_before = len(list(marker_dir.glob("*.done.json")))
    assert 1 <= done_before < 6
    resumed = _run_cli(configs["killed"])
    assert resumed.wait(timeout=300) == 0, resumed.stdout.read()
    said = f"curate: filter: {done_before} of 6 part(s) done by an earlier run of this job; resuming with the other"
    assert f"{said} {6 - done_before}\n" in resumed.stdout.read()
    a = json.loads((tmp_path / "reference" / "manifest.json").read_text())
    b = json.loads((tmp_path / "killed" / "manifest.json").read_text())
    assert a["shards"] == b["shards"]  # same files, same sha256
    assert not list((tmp_path / "killed").rglob("*.tmp"))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_or_killed_command_leaves_no_worker_processes(tmp_path, signum):
    """A scheduler's SIGTERM ended `data run` on the spot, and SIGKILL (the out-of-memory killer)
    always does: both left the spawned workers behind, idle, for good. Now SIGTERM stops them on
    the way out (exit 143, saying a rerun carries on) and the workers end when their parent is gone."""
    for i in range(4):
        write_jsonl(tmp_path / "in" / f"part{i}.jsonl", synthetic_docs(150, seed=20 + i, words=400), f"p{i}-")
    config = bare_config(tmp_path / "out", [{"name": "web", "inputs": [str(tmp_path / "in")]}], workers=2)
    save_config(config, tmp_path / "c.yaml")
    run = _run_cli(tmp_path / "c.yaml")
    try:
        marker_dir = tmp_path / "out" / ".work" / "stage1"
        deadline = time.time() + 120
        while time.time() < deadline and not list(marker_dir.glob("*.done.json")) and run.poll() is None:
            time.sleep(0.02)
        run.send_signal(signum)
        run.wait(timeout=60)
        deadline = time.time() + 10
        while time.time() < deadline and _group_alive(run.pid):
            time.sleep(0.1)
        assert not _group_alive(run.pid), "worker processes outlived the command"
        output = run.stdout.read()
        done = len(list(marker_dir.glob("*.done.json")))
        if signum == signal.SIGTERM:
            assert run.returncode == 143, output
            assert "terminated; the same command carries on from the last finished unit" in output
            assert "Traceback" not in output
            assert 1 <= done < 4  # stopped part way: the workers were stopped, not left to finish
        else:
            # Until they see their parent gone the workers may finish what was already queued to
            # them (each input's output is kept whole), then end instead of waiting for good.
            assert run.returncode == -signal.SIGKILL and 1 <= done <= 4
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)


def test_ray_executor_without_ray_is_a_config_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"executor: 'ray' needs Ray installed"):
        bare_config(tmp_path / "out", [{"name": "web", "inputs": [str(tmp_path)]}], executor="ray")
    assert not (tmp_path / "out").exists()  # refused before any output folder is made


@pytest.mark.slow
def test_ray_address_is_checked_before_ray_waits_for_a_missing_head(tmp_path, monkeypatch):
    """`ray_address` naming a host:port where no Ray head runs left `ray.init` retrying for
    minutes with GCS warnings; a malformed one reached Ray."""
    import socket

    from marinlm.data.executors import ray_map

    with pytest.raises(ConfigError, match=r"ray_address: must be '' \(Ray on this machine\), 'auto', HOST:PORT"):
        bare_config(tmp_path / "out", [{"name": "web", "inputs": [str(tmp_path)]}], ray_address="headnode")
    for address in ("", "auto", "10.0.0.5:6379", "ray://head:10001", "[::1]:6379"):
        bare_config(tmp_path / "out", [{"name": "web", "inputs": [str(tmp_path)]}], ray_address=address)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh `marinlm data run`
    start = time.monotonic()
    with pytest.raises(ConfigError, match=rf"ray_address: no Ray head answers at 127.0.0.1:{port} .*ray start --head"):
        next(ray_map(str, [1], address=f"127.0.0.1:{port}"))
    assert time.monotonic() - start < 10


@pytest.mark.slow
def test_ray_executor_matches_local(tmp_path):
    pytest.importorskip("ray")
    for i in range(3):
        write_jsonl(tmp_path / "in" / f"p{i}.jsonl", synthetic_docs(30, seed=40 + i), f"r{i}-")
    src = [{"name": "web", "inputs": [str(tmp_path / "in")]}]
    local = run_pipeline(bare_config(tmp_path / "local", src, workers=2))
    try:
        ray_report = run_pipeline(bare_config(tmp_path / "ray", src, executor="ray", workers=2))
    finally:
        import ray

        ray.shutdown()
    a = json.loads((tmp_path / "local" / "manifest.json").read_text())
    b = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]
    assert local["accounting"] == ray_report["accounting"]


@pytest.mark.slow
def test_parquet_in_and_out_and_hf_datasets_reader(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = synthetic_docs(5, seed=7)
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(5)], "content": texts}), tmp_path / "in.parquet")
    items = list(read_documents(tmp_path / "in.parquet", text_field="content"))
    assert [d.text for d in items] == texts and all(isinstance(d, Document) for d in items)
    assert isinstance(next(read_documents(tmp_path / "in.parquet", text_field="body")), Rejected)
    run_pipeline(
        bare_config(
            tmp_path / "out",
            [{"name": "pq", "inputs": [str(tmp_path / "in.parquet")], "text_field": "content"}],
            output={"format": "parquet"},
        )
    )
    table = pq.read_table(tmp_path / "out" / "shards" / "00000.parquet")
    assert table.column("text").to_pylist() == texts
    write_jsonl(tmp_path / "hf" / "d.jsonl", texts, "h")
    pytest.importorskip("datasets")
    docs = list(read_hf_dataset("json", data_files=str(tmp_path / "hf" / "d.jsonl")))
    assert [d.text for d in docs] == texts and docs[0].id == "h0"


@pytest.mark.slow
def test_real_corpora_english_chinese_code(tmp_path):
    shared_data("corpus", "wikitext2_valid.txt")
    import sysconfig

    config = load_config(
        PipelineConfig,
        ROOT / "configs" / "data" / "shared-corpus.yaml",
        [
            f"--output_dir={tmp_path / 'out'}",
            "--progress=false",
            "--workers=2",
            f"--decontam.eval_paths=[{SHARED_DATA / 'eval'}]",
        ],
    )
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    config.sources = [s for s in config.sources if s.name != "shakespeare"]
    for s in config.sources:
        s.inputs = [str(SHARED_DATA / "corpus" / Path(p).name) for p in s.inputs]
    from marinlm.data.pipeline import SourceSpec

    config.sources.append(SourceSpec(name="python", inputs=[str(stdlib / "json"), str(stdlib / "http")]))
    report = run_pipeline(config)
    acc = report["accounting"]
    assert acc["songci"]["kept"] >= 0.9 * acc["songci"]["in"]  # Chinese is not judged by English rules
    assert acc["python"]["kept"] >= 0.8 * acc["python"]["in"]  # neither is code
    wiki_quality = next(s for s in report["steps"] if s["step"] == "gopher_quality")["by_source"]["wikitext"]
    assert wiki_quality["dropped"]  # but English prose is, with reasons
    out = [r for p in sorted((tmp_path / "out" / "shards").glob("*.zst")) for r in read_records(p)]
    langs = {r["metadata"]["language"] for r in out}
    assert {"en", "zh", "code"} <= langs
    assert os.path.getsize(tmp_path / "out" / "report.png") > 1000


def test_provenance_never_overwrites_record_fields(tmp_path):
    from marinlm.data.normalize import LangIdConfig, LanguageId

    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps({"id": "a", "text": "x = compute(1)\nprint('done')", "path": "pkg/tool.py"}) + "\n")
    doc = next(read_documents(path))
    assert doc.metadata["path"] == "pkg/tool.py"  # the record's own field
    assert doc.metadata["file"] == str(path) and doc.metadata["line"] == 1  # where it came from
    assert LanguageId(LangIdConfig()).decide(doc) is None and doc.metadata["language"] == "code"


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab \n", max_size=400), max_chars=st.integers(1, 60))
def test_chunked_text_joins_back_exactly_in_bounded_pieces(text, max_chars):
    from marinlm.data.readers import chunk_text

    chunks = chunk_text(text, max_chars)
    assert "".join(chunks) == text
    assert all(0 < len(c) <= max_chars for c in chunks) or chunks == [""]
    start = 0
    for c in chunks[:-1]:  # each cut is after the window's last blank line when one lies past its first quarter
        window = text[start : start + max_chars]
        if window.rfind("\n\n") >= max_chars // 4:
            assert c == window[: window.rfind("\n\n") + 2], (window, c)
        start += len(c)


def test_a_big_text_file_is_cut_into_documents_at_paragraph_breaks(tmp_path):
    """One book-sized .txt file was one document, which the Gopher rules drop as too long."""
    paragraphs = [f"Paragraph {i}. " + "word " * (i % 40 + 5) for i in range(400)]
    text = "\n\n".join(paragraphs) + "\n"
    (tmp_path / "book.txt").write_text(text)
    whole = list(read_documents(tmp_path / "book.txt"))
    assert [d.id for d in whole] == [str(tmp_path / "book.txt")]
    docs = list(read_documents(tmp_path / "book.txt", chunk_chars=2000))
    assert len(docs) > 10 and "".join(d.text for d in docs) == text
    assert all(len(d.text) <= 2000 for d in docs) and all(d.text.endswith("\n\n") for d in docs[:-1])
    assert docs[3].id == f"{tmp_path / 'book.txt'}#3" and docs[3].metadata["part"] == 3


def test_a_big_file_is_read_in_parts_that_curate_as_the_whole_file_does(tmp_path, capsys):
    """One big .jsonl or .parquet file was one task: one worker busy, the bar still until the end
    (a 40 MB file: 2 min 44 s at 0%), no resume within it. Now it is read in parts that start at a
    line (or a row group) and number lines and rows as the whole file does."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    from marinlm.data.pipeline import _tasks
    from marinlm.data.readers import input_parts

    texts = synthetic_docs(40, seed=31, words=60)
    lines = [json.dumps({"text": t}) for t in texts]  # no id field: ids are "path:line"
    lines[7] = '{"text": "unterminated'
    lines[12] = json.dumps({"text": texts[3]})  # an exact duplicate of an earlier line
    lines[20] = json.dumps({"text": " ".join(texts[20:28])})  # one line longer than a part
    lines[30] = ""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "big.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    pq.write_table(pa.table({"text": synthetic_docs(30, seed=32, words=60)}), raw / "big.parquet", row_group_size=4)

    data = (raw / "big.jsonl").read_bytes()
    parts = input_parts(raw / "big.jsonl", 2_000)
    assert len(parts) > 5 and parts[0]["start"] == 0 and parts[-1]["end"] == len(data)
    for before, after in zip(parts, parts[1:]):
        assert before["end"] == after["start"] and data[after["start"] - 1 : after["start"]] == b"\n"
        assert after["line"] == data[: after["start"]].count(b"\n") + 1
    row_parts = input_parts(raw / "big.parquet", (raw / "big.parquet").stat().st_size // 3)
    assert [p["groups"] for p in row_parts] == [[0, 3], [3, 6], [6, 8]] and [p["row"] for p in row_parts] == [0, 12, 24]
    assert input_parts(raw / "big.parquet", 0) == [None]
    # A compressed stream is cut into runs of lines, counted in one pass.
    import zstandard

    def jsonl(seed, bad=None):
        rows = [json.dumps({"text": t}) for t in synthetic_docs(20, seed=seed, words=60)]
        if bad is not None:
            rows[bad] = "{not json"
        return ("\n".join(rows) + "\n").encode()

    (raw / "big.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(33)))
    (raw / "more.jsonl.gz").write_bytes(gzip.compress(jsonl(34, bad=4)))
    line_parts = input_parts(raw / "more.jsonl.gz", 2_000)
    assert 3 <= len(line_parts) <= 16 and line_parts[0]["lines"][0] == 1 and line_parts[-1]["lines"][1] == 21
    assert all(a["lines"][1] == b["lines"][0] for a, b in zip(line_parts, line_parts[1:]))

    # What cannot be cut is read whole, and a note says what would let it be.
    (tmp_path / "whole").mkdir()
    (tmp_path / "whole" / "texts.json").write_text(json.dumps(texts))
    (tmp_path / "whole" / "cut.jsonl.gz").write_bytes(gzip.compress(jsonl(35), compresslevel=0)[:-30])
    kept = []  # for the report
    for folder in ("whole", "raw"):
        inputs = [{"name": "a", "inputs": [str(tmp_path / folder)]}]
        _tasks(bare_config(tmp_path / "x", inputs, split_bytes=2000), tmp_path, kept)
    notes = capsys.readouterr().err.splitlines()
    assert notes == [f"note: {n}" for n in kept]
    sizes = {
        n: tqdm.format_sizeof((tmp_path / "whole" / n).stat().st_size, "B") for n in ("texts.json", "cut.jsonl.gz")
    }
    assert notes == [
        f"note: {tmp_path / 'whole' / 'cut.jsonl.gz'} ({sizes['cut.jsonl.gz']}) is read whole, by one worker: its "
        "compressed stream could not be read to the end (`rejected/` says where it breaks); repair it, to have it "
        "read in parts of split_bytes=2,000 on every worker",
        f"note: {tmp_path / 'whole' / 'texts.json'} ({sizes['texts.json']}) is read whole, by one worker: only .jsonl "
        "and .parquet files are read in parts; split it into several files, or convert it to .jsonl, to have it "
        "read in parts of split_bytes=2,000 on every worker",
    ]  # and none for the files that are cut

    def curate(name, split_bytes):
        report = run_pipeline(
            bare_config(tmp_path / name, [{"name": "web", "inputs": [str(raw)]}], split_bytes=split_bytes)
        )
        docs = [(r["id"], r["text"]) for p in sorted((tmp_path / name / "shards").glob("*")) for r in read_records(p)]
        rejected = [json.loads(x) for p in sorted((tmp_path / name / "rejected").glob("*")) for x in p.open()]
        return report, docs, [(r["location"], r["reason"]) for r in rejected]

    whole, parted = curate("out-whole", 0), curate("out-parted", 2_000)
    assert whole[0]["shards"] == 4 and parted[0]["shards"] > 14
    assert (
        f"4 input file(s), read in {parted[0]['shards']} parts" in (tmp_path / "out-parted" / "report.md").read_text()
    )
    # less the bad, duplicate and blank lines of big.jsonl, and the bad line of more.jsonl.gz
    assert parted[1] == whole[1] and len(whole[1]) == 40 - 3 + 20 + 30 + 20 - 1
    assert parted[1][0][0] == f"{raw / 'big.jsonl'}:1" and parted[1][-1][0] == f"{raw / 'more.jsonl.gz'}:20"
    assert (
        parted[2]
        == whole[2]
        == [
            (f"{raw / 'big.jsonl'}:8", "malformed JSON: Invalid control character at column 23"),
            (
                f"{raw / 'more.jsonl.gz'}:5",
                "malformed JSON: Expecting property name enclosed in double quotes at column 2",
            ),
        ]
    )


def test_rerun_resumes_only_the_same_curation(tmp_path, capsys):
    """Other settings or changed inputs in the same output folder are refused (resuming used to
    return the old curation as if it were the new one); how the work runs may change."""
    write_jsonl(tmp_path / "in" / "a.jsonl", synthetic_docs(40, seed=1, words=60), "a-")
    sources = [{"name": "web", "inputs": [str(tmp_path / "in")]}]
    out = tmp_path / "out"
    first = run_pipeline(bare_config(out, sources))
    capsys.readouterr()
    again = run_pipeline(bare_config(out, sources, workers=2, progress=True))  # same job, other worker count: resumes
    assert again["accounting"] == first["accounting"]
    assert first["units_run"] == 3 and again["units_run"] == 0  # map + reduce + write; then nothing left
    # Said in a line per stage, not as empty bars ("curate: filter: 0.00B [00:00, ?B/s]").
    assert capsys.readouterr().err.splitlines() == [
        f"curate: {stage}: 1 of 1 part(s) done by an earlier run of this job; nothing left to do"
        for stage in ("filter", "write")
    ]
    manifest = (out / "manifest.json").read_text()
    with pytest.raises(OutputInUseError, match=r"out: .*\(config.min_doc_chars: 1 -> 500\)"):
        run_pipeline(bare_config(out, sources, min_doc_chars=500))
    write_jsonl(tmp_path / "in" / "a.jsonl", synthetic_docs(30, seed=2, words=60), "a-")  # the corpus changed
    with pytest.raises(OutputInUseError, match=r"inputs\[0\] \(/.*/in/a\.jsonl\)\.(size|mtime_ns)"):  # the file named
        run_pipeline(bare_config(out, sources))
    assert (out / "manifest.json").read_text() == manifest  # nothing was lost
    restarted = run_pipeline(bare_config(out, sources), restart=True)
    assert restarted["accounting"]["web"]["in"] == 30
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a curation")
    with pytest.raises(OutputInUseError, match=r"mine: is not empty and has no \.marinlm-job\.json"):
        run_pipeline(bare_config(tmp_path / "mine", sources))


@pytest.mark.parametrize(
    "name, content, message",
    [
        (
            "a.jsonl",
            b'{"q": "fine"}\n{"q": "open\n',
            r"a.jsonl:2: malformed JSON in a decontamination eval file: Unterminated string starting at column 7$",
        ),
        ("b.json", b'[{"q": "x"},\n oops]', r"b.json:2: malformed JSON in a decontamination eval file"),
        ("c.csv", b"q,a\n\xff,b\n", r"c.csv:2: decontamination eval file is not UTF-8"),
    ],
)
def test_a_malformed_decontamination_file_names_file_and_line(tmp_path, name, content, message):
    """It was a bare 'Expecting value: line 1 column 1 (char 0)'."""
    from marinlm.data.decontam import NgramIndex

    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        NgramIndex.build([str(tmp_path / name)])


def test_a_folder_skips_hidden_files_and_names_the_types_it_does_not_read(tmp_path, capsys):
    """A folder's `.csv` or `.txt.bz2` files beside its `.txt` ones used to be skipped without a word;
    hidden files and folders (`.git/`, `.DS_Store`) are no inputs at all."""
    from marinlm.data.inputs import expand_inputs

    for name in ("a.txt", "sub/b.jsonl", "t.csv", "sub/u.csv", "sub/c.txt.bz2", "README", ".DS_Store", ".git/x.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("some text\n")
    assert expand_inputs([str(tmp_path)], "sources[1].inputs") == [tmp_path / "a.txt", tmp_path / "sub" / "b.jsonl"]
    err = capsys.readouterr().err
    assert f"note: sources[1].inputs: skipping 4 file(s) under {tmp_path} of types not read " in err
    assert f"(.csv: 2, (no suffix): 1, .txt.bz2: 1; e.g. {tmp_path / 'README'}); the types read are .jsonl," in err
    assert expand_inputs([str(tmp_path)], quiet=True) and capsys.readouterr().err == ""
    assert expand_inputs([str(tmp_path / "sub")]) and "skipping 2 file(s)" in capsys.readouterr().err


def test_a_curation_folder_as_input_means_its_shards(tmp_path):
    """Pointing tokenize or the tokenizer trainer at a curation folder used to read its rejected/ and
    dropped/ side outputs as documents too (twice the documents on the quickstart corpus)."""
    from marinlm.data.inputs import expand_inputs
    from marinlm.dataset.tokenizer_training import iter_training_texts

    docs = synthetic_docs(20, seed=3, words=60)
    write_jsonl(tmp_path / "in" / "a.jsonl", docs + docs[:5], "a-")  # 5 exact duplicates get dropped
    out = tmp_path / "curated"
    report = run_pipeline(bare_config(out, [{"name": "web", "inputs": [str(tmp_path / "in")]}]))
    assert list((out / "dropped").rglob("*.jsonl*"))  # the side output exists ...
    shards = [out / s["path"] for s in json.loads((out / "manifest.json").read_text())["shards"]]
    assert expand_inputs([str(out)]) == shards  # ... and is not an input
    assert len(list(iter_training_texts([str(out)], "text", 0))) == report["accounting"]["web"]["kept"] == 20
    shards[0].unlink()
    with pytest.raises(FileNotFoundError, match=r"00000.* listed in .*manifest.json but missing"):
        expand_inputs([str(out)])
    # Unfinished (no manifest yet), its report, dropped/ and rejected/ files were read as documents.
    (out / "manifest.json").unlink()
    with pytest.raises(ValueError, match=rf"^sources\[0\].inputs: {out} is a curation that has not finished"):
        expand_inputs([str(out)], "sources[0].inputs")
    (out / ".marinlm-job.json").write_text('{"job": "tokenize"}')
    with pytest.raises(ValueError, match=rf"^inputs: {out} holds token shards written by `marinlm tokenize`"):
        expand_inputs([str(out)])


def test_a_file_name_that_is_not_utf8_is_named_before_any_work(tmp_path):
    """`marinlm data run` on a folder holding `caf\\xe9.txt` (a Latin-1 name) failed part way with
    "'utf-8' codec can't encode character '\\udce9'", naming no file."""
    from marinlm.data.inputs import expand_inputs

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "fine.txt").write_text("A text. " * 50)
    with open(os.fsencode(tmp_path / "in") + b"/caf\xe9.txt", "wb") as f:
        f.write(b"Some text here. " * 50)
    message = r"^sources\[0\]\.inputs: 1 file name\(s\) not valid UTF-8: b'.*/in/caf\\xe9\.txt'; rename them"
    with pytest.raises(ValueError, match=message):
        expand_inputs([str(tmp_path / "in")], "sources[0].inputs")
    with pytest.raises(ValueError, match=message):
        run_pipeline(bare_config(tmp_path / "out", [{"name": "a", "inputs": [str(tmp_path / "in")]}]))
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_folder_holding_marinlm_outputs_reads_a_curation_as_its_shards_and_skips_the_others(tmp_path, capsys):
    """A data folder that also held a token folder, a training run or a curation read their manifests,
    metrics.jsonl and reports as documents (and a curation's dropped/ and rejected/ files too)."""
    from marinlm.data.inputs import expand_inputs
    from marinlm.tokenizer import MarinTokenizer, train_bpe

    root = tmp_path / "data"
    write_jsonl(root / "raw" / "a.jsonl", synthetic_docs(6, seed=1, words=40), "a-")
    run_pipeline(bare_config(root / "curated", [{"name": "web", "inputs": [str(root / "raw")]}]))
    shards = [root / "curated" / s["path"] for s in json.loads((root / "curated/manifest.json").read_text())["shards"]]
    for name, job in (("tokens", "tokenize"), ("old/unfinished", "curate")):
        (root / name).mkdir(parents=True)
        (root / name / ".marinlm-job.json").write_text(json.dumps({"job": job}))
        (root / name / "report.md").write_text("# not a document\n")
    (root / "run" / "checkpoints").mkdir(parents=True)
    (root / "run" / ".marinlm.lock").write_text("pid 1\n")
    (root / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (root / "notes.txt").write_text("a text of mine\n")
    MarinTokenizer(train_bpe(["a text to learn a few merges from"] * 4, vocab_size=300)).save(root / "tokenizer")
    capsys.readouterr()
    assert expand_inputs([str(root)]) == [*shards, root / "notes.txt", root / "raw" / "a.jsonl"]
    err = capsys.readouterr().err
    assert err.startswith(f"note: inputs: skipping 4 folder(s) under {root} of outputs, not text: ")
    assert f"{root / 'old/unfinished'} is a curation that has not finished" in err
    assert f"{root / 'run'} is a training run's folder" in err
    assert f"{root / 'tokenizer'} holds a tokenizer (tokenizer.json), not text; and 1 more\n" in err  # no documents
    # A glob's folders are read as folders (they were dropped without a word), outputs skipped alike.
    assert expand_inputs([f"{root}/*"], quiet=True) == expand_inputs([str(root)], quiet=True)
    assert expand_inputs([f"{root}/**/*.jsonl"], quiet=True) == [root / "raw" / "a.jsonl"]  # none in outputs
    with pytest.raises(FileNotFoundError, match=r"input glob matched no file to read: .*/data/tok\*$"):
        expand_inputs([f"{root}/tok*"], quiet=True)
    with pytest.raises(ValueError, match=rf"^inputs: {root / 'tokens'} holds token shards written by `marinlm"):
        expand_inputs([str(root / "tokens")])
    with pytest.raises(ValueError, match=rf"^inputs: {root / 'tokenizer'} holds a tokenizer \(tokenizer.json\), not"):
        expand_inputs([str(root / "tokenizer")])
    assert expand_inputs([str(root)], quiet=True) and capsys.readouterr().err == ""
    report = run_pipeline(bare_config(tmp_path / "again", [{"name": "web", "inputs": [str(root)]}]))
    assert report["accounting"]["web"]["in"] == 6 + 1 + 6  # the curation's shards, notes.txt, raw/a.jsonl
    assert report["input_notes"] == [err.strip().removeprefix("note: ").replace("inputs:", "sources[0].inputs:")]
    assert f"- Note: {report['input_notes'][0]}" in (tmp_path / "again" / "report.md").read_text()
    with pytest.raises(ValueError, match=rf"^inputs: {root / 'run'} is a training run's folder"):
        expand_inputs([str(root / "run")])  # given itself, as a curation or token folder is refused
    # A quickstart's folder holds its corpus and its curation of it: read whole, each text came twice.
    (root / "qs" / "raw").mkdir(parents=True)
    (root / "qs" / ".marinlm-quickstart").touch()
    with pytest.raises(
        ValueError, match=rf"^inputs: {root / 'qs'} is a quickstart's folder, .* e.g. {root}/qs/curated"
    ):
        expand_inputs([str(root / "qs")])
