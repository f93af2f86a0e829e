"""Model-based curation: the fastText quality classifier and its levels, topic clusters, the topic x
quality cell mixture, and cells as training sources switched by `data.mixture_phases`."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from marinlm.config import ConfigError
from marinlm.data.pipeline import read_records, run_pipeline
from test_data_pipeline import WORDS, bare_config, synthetic_docs, write_jsonl

pytestmark = pytest.mark.slow


def planted_low_quality(n: int, seed: int) -> list[str]:
    """Boilerplate, keyword lists and machine-generated repetition, a third each."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            docs.append(
                " ".join(
                    rng.choice(
                        [
                            "Home",
                            "About us",
                            "Contact",
                            "Login",
                            "Subscribe now",
                            "Cookie policy",
                            "Privacy",
                            "Terms of use",
                            "All rights reserved",
                            "Share on Facebook",
                            "Click here",
                            "Next page",
                        ]
                    )
                    for _ in range(60)
                )  # fmt: skip
            )
        elif kind == 1:
            docs.append(", ".join(rng.choice(WORDS[:40]) for _ in range(80)))
        else:
            sentence = " ".join(rng.choice(WORDS) for _ in range(8)) + "."
            docs.append(" ".join([sentence] * 25))
    return docs


def classifier_config(out: Path, raw: Path, positive: Path, **overrides):
    settings = {
        "dedup": {"exact": False, "fuzzy": False},
        # Few hashed n-gram rows: at fastText's default every test would write a model of some 0.5 GB.
        "classifier": {"enabled": True, "positive": [str(positive)], "sample_docs": 400, "epochs": 25, "dim": 32}
        | {"bucket": 100_000},
    }
    settings.update(overrides)
    return bare_config(out, [{"name": "web", "inputs": [str(raw)]}], **settings)


def test_planted_low_quality_documents_land_in_the_bottom_level(tmp_path):
    good = synthetic_docs(170, seed=21)
    bad = planted_low_quality(30, seed=22)
    mixed = good + bad
    order = random.Random(3).sample(range(len(mixed)), len(mixed))
    write_jsonl(tmp_path / "raw" / "web.jsonl", [mixed[i] for i in order], "d")
    bad_ids = {f"d{k}" for k, i in enumerate(order) if i >= len(good)}
    write_jsonl(tmp_path / "reference" / "good.jsonl", synthetic_docs(200, seed=23), "r")
    report = run_pipeline(classifier_config(tmp_path / "out", tmp_path / "raw", tmp_path / "reference"))
    records = [r for shard in sorted((tmp_path / "out" / "shards").glob("*.jsonl.zst")) for r in read_records(shard)]
    level = {r["id"]: r["metadata"]["quality_level"] for r in records}
    score = {r["id"]: r["metadata"]["quality_score"] for r in records}
    bottom = sum(level[i] == 0 for i in bad_ids)
    print(f"planted documents in the bottom level: {bottom} of {len(bad_ids)}")
    assert bottom >= 0.8 * len(bad_ids)
    assert np.mean([score[i] for i in bad_ids]) < np.mean([score[i] for i in level if i not in bad_ids])
    levels = report["classifier"]["levels"]
    assert len(levels["documents"]) == 5 and sum(levels["documents"]) == len(records) == 200
    assert 0.0 <= report["classifier"]["held_out_accuracy"] <= 1.0
    assert (tmp_path / "out" / "quality.bin").is_file()
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Quality classifier (fastText)" in md and "held-out accuracy" in md


def test_a_threshold_drops_and_the_accounting_counts_it(tmp_path):
    """Against a named negative set, boilerplate and keyword lists score under 0.03 and are dropped.
    A sentence repeated 25 times scores as its words do (a bag of n-grams does not count repeats):
    that is the repetition heuristics' case (`quality.gopher_repetition`), not the classifier's."""
    write_jsonl(tmp_path / "raw" / "web.jsonl", synthetic_docs(60, seed=31) + planted_low_quality(30, seed=32), "d")
    write_jsonl(tmp_path / "reference" / "good.jsonl", synthetic_docs(100, seed=33), "r")
    write_jsonl(tmp_path / "spam" / "bad.jsonl", planted_low_quality(100, seed=34), "s")  # a named negative set
    config = classifier_config(tmp_path / "out", tmp_path / "raw", tmp_path / "reference")
    config.classifier.negative, config.classifier.threshold = [str(tmp_path / "spam")], 0.5
    report = run_pipeline(config)
    assert report["classifier"]["negative_from"] == "classifier.negative"
    assert report["classifier"]["held_out_accuracy"] >= 0.9
    a = report["accounting"]["web"]
    step = next(s for s in report["steps"] if s["step"] == "quality_classifier")
    dropped = step["by_source"]["web"]["dropped"].get("quality score below threshold", 0)
    assert dropped == 20 and a["in"] == a["kept"] + a["dropped"] + a["rejected"] == 90
    side = (tmp_path / "out" / "dropped" / "quality_classifier").glob("*.jsonl")
    assert sum(1 for path in side for _ in path.open()) == dropped
    # A rerun resumes: nothing is fitted or scored again.
    model = tmp_path / "out" / ".work" / "quality.bin"
    fitted_at = model.stat().st_mtime_ns
    again = run_pipeline(config)
    assert again["units_run"] == 0 and model.stat().st_mtime_ns == fitted_at
    assert again["accounting"] == report["accounting"]


def test_cells_split_the_output_and_the_mixture_meets_their_shares(tmp_path):
    """Topics x quality levels: shards in a folder per cell, quality weights [0, 1, 1, 1, 3] leave
    the bottom level out and triple the top one; the report shows each cell's target and realised share."""
    write_jsonl(tmp_path / "raw" / "web.jsonl", synthetic_docs(150, seed=41) + planted_low_quality(30, seed=42), "d")
    write_jsonl(tmp_path / "reference" / "good.jsonl", synthetic_docs(150, seed=43), "r")
    config = classifier_config(
        tmp_path / "out",
        tmp_path / "raw",
        tmp_path / "reference",
        topic={"enabled": True, "num_clusters": 3, "sample_docs": 180},
        mixture={"enabled": True, "quality_weights": [0, 1, 1, 1, 3]},
        output={"split_by": "cell"},
    )
    report = run_pipeline(config)
    folders = sorted(p.name for p in (tmp_path / "out" / "shards").iterdir())
    assert folders and all(len(f.split("-")) == 2 and f.startswith("t") for f in folders)
    assert not any(f.endswith("-q0") for f in folders)  # weight 0: nothing written
    cells = report["cells"]
    for name, cell in cells.items():
        assert cell["realised_share"] == pytest.approx(cell["target_share"], abs=0.02), name
    top = sum(c["achieved_tokens"] for n, c in cells.items() if n.endswith("q4"))
    top_available = sum(c["available_tokens"] for n, c in cells.items() if n.endswith("q4"))
    assert top == pytest.approx(3 * top_available * sum(c["achieved_tokens"] for c in cells.values()) / sum(
        c["available_tokens"] * w for c, w in ((c, [0, 1, 1, 1, 3][int(n[-1])]) for n, c in cells.items())
    ), rel=0.05)  # fmt: skip
    assert len(report["topics"]["clusters"]) == 3 and all(c["top_words"] for c in report["topics"]["clusters"])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {Path(s["path"]).parent.name for s in manifest["shards"]} == set(folders)


def test_model_settings_that_cannot_work_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="classifier.positive"):
        bare_config(tmp_path, [{"name": "a", "inputs": ["x"]}], classifier={"enabled": True})
    with pytest.raises(ConfigError, match="output.split_by: quality needs classifier.enabled"):
        bare_config(tmp_path, [{"name": "a", "inputs": ["x"]}], output={"split_by": "quality"})
    with pytest.raises(ConfigError, match="mixture.quality_weights"):
        bare_config(
            tmp_path,
            [{"name": "a", "inputs": ["x"]}],
            classifier={"enabled": True, "positive": ["p"]},
            mixture={"quality_weights": [1, 2]},
        )


def test_two_phases_over_quality_cells_switch_the_training_mix_at_the_phase_step(tmp_path):
    """Curated shards split by quality level, each tokenized into a training source: phase 0 draws
    the top and bottom levels 3:1, and from step 5 on only the bottom one, batch by batch."""
    from marinlm.dataset import DataConfig, SourceConfig, build_loader
    from marinlm.dataset.loader import MixturePhaseConfig
    from marinlm.dataset.tokenize import TokenizeConfig, tokenize
    from marinlm.tokenizer import MarinTokenizer, train_bpe

    from conftest import SAMPLE_TEXTS

    write_jsonl(tmp_path / "raw" / "web.jsonl", synthetic_docs(150, seed=51) + planted_low_quality(50, seed=52), "d")
    write_jsonl(tmp_path / "reference" / "good.jsonl", synthetic_docs(150, seed=53), "r")
    split = {"split_by": "quality"}
    config = classifier_config(tmp_path / "out", tmp_path / "raw", tmp_path / "reference", output=split)
    run_pipeline(config)
    MarinTokenizer(train_bpe(SAMPLE_TEXTS * 20, vocab_size=400)).save(tmp_path / "tokenizer")
    sources = []
    for level in ("q4", "q0"):
        assert (tmp_path / "out" / "shards" / level).is_dir()
        tokens = tmp_path / f"tokens-{level}"
        tokenize(
            TokenizeConfig(
                inputs=[str(tmp_path / "out" / "shards" / level)],
                tokenizer=str(tmp_path / "tokenizer"),
                output_dir=str(tokens),
                val_fraction=0.0,
                workers=1,
            ),
            progress=False,
        )
        sources.append(SourceConfig(path=str(tokens), weight=3.0 if level == "q4" else 1.0))
    phased = DataConfig(
        sources=sources, seq_len=32, mixture_phases=[MixturePhaseConfig(start_step=5, weights=[0.0, 1.0])]
    )
    loader = build_loader(phased, global_batch=8, rows_per_step=8)
    counts, batches = [], iter(loader)
    for _ in range(10):
        next(batches)
        counts.append(loader.state_dict()["counts"])
    assert counts[4] == [30, 10]  # steps 0-4: 3:1
    assert all(b[0] == counts[4][0] for b in counts[5:])  # from step 5: the bottom level only
    assert counts[-1] == [30, 50]


def test_the_shared_corpora_report_the_classifier_its_levels_and_the_topics(tmp_path):
    """English prose, Shakespeare, Chinese poems and Python stdlib sources, with WikiText's
    validation articles as the high-quality set: the report shows the held-out accuracy, five
    levels with their counts, the topic clusters with their top words, and the accounting holds
    (run_pipeline raises otherwise)."""
    import sysconfig

    from conftest import SHARED_DATA, shared_data

    shared_data("corpus", "wikitext2_valid.txt")
    corpus = SHARED_DATA / "corpus"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [
        {"name": "wikitext", "inputs": [str(corpus / "wikitext2_test.txt")], "split_pattern": "\\n(?= = [^=])"},
        {"name": "shakespeare", "inputs": [str(corpus / "tinyshakespeare.txt")], "chunk_chars": 4000},
        {"name": "songci", "inputs": [str(corpus / "zh_songci300.json")], "text_field": "paragraphs"},
        {"name": "python", "inputs": [str(stdlib / "json"), str(stdlib / "http"), str(stdlib / "email")]},
    ]
    config = bare_config(
        tmp_path / "out",
        sources,
        workers=2,
        dedup={"exact": True, "fuzzy": False},
        classifier={"enabled": True, "positive": [str(corpus / "wikitext2_valid.txt")], "sample_docs": 2000}
        | {"bucket": 200_000},
        topic={"enabled": True, "num_clusters": 8, "sample_docs": 2000},
    )
    report = run_pipeline(config)
    classifier = report["classifier"]
    print(f"held-out accuracy {classifier['held_out_accuracy']:.3f} on {classifier['held_out']} documents")
    assert classifier["held_out_accuracy"] > 0.6  # a quarter of the negatives are WikiText articles too
    kept = sum(a["kept"] for a in report["accounting"].values())
    assert len(classifier["levels"]["documents"]) == 5 and sum(classifier["levels"]["documents"]) == kept
    clusters = report["topics"]["clusters"]
    assert len(clusters) == 8 and all(len(c["top_words"]) == 8 for c in clusters)
    assert sum(c["documents"] for c in clusters) == kept
    md = (tmp_path / "out" / "report.md").read_text()
    for heading in ("## Quality classifier (fastText)", "## Topics", "## Cells (topic x quality)"):
        assert heading in md
    print(md[md.index("## Quality classifier") :])


def test_the_model_steps_score_the_same_on_ray_as_on_the_process_pool(tmp_path):
    """Quality scoring and topic assignment are map-stage steps: on Ray they give the same records."""
    pytest.importorskip("ray")
    write_jsonl(tmp_path / "raw" / "web.jsonl", synthetic_docs(80, seed=51) + planted_low_quality(15, seed=52), "d")
    write_jsonl(tmp_path / "reference" / "good.jsonl", synthetic_docs(80, seed=53), "r")
    models = {"topic": {"enabled": True, "num_clusters": 3, "sample_docs": 95}, "output": {"split_by": "cell"}}
    local = run_pipeline(classifier_config(tmp_path / "local", tmp_path / "raw", tmp_path / "reference", **models))
    try:
        on_ray = run_pipeline(
            classifier_config(
                tmp_path / "ray", tmp_path / "raw", tmp_path / "reference", executor="ray", workers=2, **models
            )
        )
    finally:
        import ray

        ray.shutdown()
    assert on_ray["accounting"] == local["accounting"] and on_ray["cells"] == local["cells"]

    def records(root: Path) -> dict[str, tuple]:
        return {
            r["id"]: (r["metadata"]["quality_score"], r["metadata"]["quality_level"], r["metadata"]["topic"])
            for path in sorted((root / "shards").rglob("*.jsonl.zst"))
            for r in read_records(path)
        }

    scored = records(tmp_path / "local")
    assert len(scored) == local["accounting"]["web"]["kept"] and scored == records(tmp_path / "ray")
