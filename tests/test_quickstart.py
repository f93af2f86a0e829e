from __future__ import annotations

import re

import pytest

from marinlm.quickstart import build_default_corpus, run_quickstart

from conftest import write_corpus


def test_default_corpus_ships_with_python(tmp_path):
    counts = build_default_corpus(tmp_path)
    assert counts["python_code"] > 500 and counts["python_docs"] > 50
    assert (tmp_path / "python-docs.jsonl").stat().st_size > 100_000


@pytest.mark.slow
def test_quickstart_smoke_run(tmp_path):
    write_corpus(tmp_path / "corpus", num_docs=300, num_files=2)
    report = run_quickstart(str(tmp_path / "run"), corpus=[str(tmp_path / "corpus")], minutes=1.5)
    text = report.read_text()
    before = float(re.search(r"validation, before training \| ([\d.]+)", text).group(1))
    after = float(re.search(r"validation, after training \| ([\d.]+)", text).group(1))
    assert after < before - 1.0  # it learned something
    for stage in ("corpus", "curation", "tokenizer", "tokenize", "training", "evaluation", "sample"):
        assert f"| {stage} |" in text
    assert (tmp_path / "run" / "loss.png").stat().st_size > 5000
    assert list((tmp_path / "run" / "train" / "checkpoints").glob("step-*"))
