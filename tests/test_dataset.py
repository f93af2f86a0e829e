from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marinlm.config import ConfigError
from marinlm.data.records import original_id, repeat_id
from marinlm.dataset import DataConfig, ShardError, SourceConfig, TokenDataset, build_loader, validation_batches
from marinlm.dataset.loader import MixturePhaseConfig, TokenLoader, open_sources
from marinlm.dataset.packing import PackedSource
from marinlm.dataset.permutation import Permutation
from marinlm.dataset.tokenize import TokenizeConfig, fraction_holding_out_one, is_validation, split_key, tokenize
from marinlm.tokenizer import MarinTokenizer, train_bpe
from marinlm.utils.io import OutputInUseError

from conftest import SAMPLE_TEXTS, write_corpus


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    MarinTokenizer(train_bpe(SAMPLE_TEXTS * 40, vocab_size=700)).save(folder)
    return folder


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tok_dir):
    root = tmp_path_factory.mktemp("data")
    texts = write_corpus(root / "corpus", num_docs=300, num_files=3)
    with open(root / "corpus" / "part-bad.jsonl", "w") as f:
        f.write('{"id": "ok1", "text": "fine document"}\n{not json\n{"id": "x", "body": "no text field"}\n')
        f.write('{"id": "e", "text": ""}\n')  # nothing to tokenize
    manifest = tokenize(corpus_config(root, tok_dir, root / "tokens"), progress=False)
    return root, texts, manifest


def corpus_config(root, tok_dir, output_dir, **overrides) -> TokenizeConfig:
    """How the `dataset` fixture tokenizes its corpus, into `output_dir`."""
    settings = {"val_fraction": 0.1, "seed": 3, "workers": 2} | overrides
    return TokenizeConfig(inputs=[str(root / "corpus")], tokenizer=str(tok_dir), output_dir=str(output_dir), **settings)


@pytest.mark.slow
def test_tokenize_writes_exact_documents_and_manifest(dataset, tok_dir):
    root, texts, manifest = dataset
    tok = MarinTokenizer.load(tok_dir)
    assert manifest["tokenizer"]["hash"] == tok.hash
    assert MarinTokenizer.load(root / "tokens" / "tokenizer").hash == tok.hash  # the tokens carry their tokenizer
    assert manifest["train_docs"] + manifest["val_docs"] == 301  # 300 + the one good line of the bad file
    assert len(manifest["rejected"]) == 3
    reasons = {r["reason"].split(":")[0] for r in manifest["rejected"]}
    assert reasons == {"malformed JSON", "missing field 'text'", "empty document"}
    assert all("part-bad.jsonl:" in r["location"] for r in manifest["rejected"])
    assert manifest["rejected"][-1]["location"].endswith("part-bad.jsonl:4")
    decoded = set()
    for split in ("train", "val"):
        data = TokenDataset(root / "tokens", split, verify="full")
        assert data.dtype == np.uint16
        for i in range(data.num_docs):
            decoded.add(tok.decode(data.document(i).tolist()))
    assert decoded == set(texts) | {"fine document"}
    # The split is a pure function of (seed, id): about 10% held out.
    val = TokenDataset(root / "tokens", "val")
    assert 10 <= val.num_docs <= 50
    assert sum(is_validation(f"d{i}", 3, 0.1) for i in range(300)) == val.num_docs - is_validation("ok1", 3, 0.1)


def test_a_big_input_is_tokenized_in_parts_to_the_same_documents(dataset, tok_dir, tmp_path):
    """A big input file was one unit: the bar still until its end, and a rerun after a kill started it
    over. Now it is tokenized in parts (as curation reads it), to the same documents and split."""
    root, _, whole = dataset
    config = corpus_config(root, tok_dir, tmp_path / "parted", split_bytes=2_000, workers=1)
    parted = tokenize(config, progress=False)
    names = [entry["tokens"] for entry in parted["splits"]["train"]]
    assert len(names) > 10 and names[0] == "train/00000.0000.tokens" and names[-1] == "train/00003.tokens"
    for key in ("train_docs", "val_docs", "train_tokens", "val_tokens", "rejected"):
        assert parted[key] == whole[key], key
    for split in ("train", "val"):
        a, b = TokenDataset(root / "tokens", split), TokenDataset(tmp_path / "parted", split)
        assert a.num_docs == b.num_docs
        assert all(np.array_equal(a.document(i), b.document(i)) for i in range(a.num_docs))
    # A rerun redoes only the part whose output is gone, and comes to the same manifest.
    (tmp_path / "parted" / names[3]).unlink()
    again = tokenize(config, progress=False)
    assert again["inputs_tokenized"] == 1
    timing = ("seconds", "inputs_tokenized")
    assert {k: v for k, v in again.items() if k not in timing} == {k: v for k, v in parted.items() if k not in timing}
    # Cut otherwise, the same folder takes no marker of the earlier cut for a part of the new one.
    recut = tokenize(corpus_config(root, tok_dir, tmp_path / "parted", split_bytes=3_000, workers=1), progress=False)
    assert recut["inputs_tokenized"] > 0 and len(recut["splits"]["train"]) < len(names)
    assert [recut[key] for key in ("train_docs", "train_tokens")] == [
        whole[key] for key in ("train_docs", "train_tokens")
    ]


def test_a_fraction_that_holds_out_no_document_is_raised_to_hold_out_one():
    """A few dozen documents at 2% often held out none, and the quickstart stopped for want of a
    validation document; the raised fraction holds out exactly the one with the lowest key."""
    ids = [f"doc-{i}" for i in range(5)]
    assert not any(is_validation(i, 0, 0.02) for i in ids)  # the case: 2% of 5 holds out none
    raised = fraction_holding_out_one(ids, 0, 0.02)
    held = [i for i in ids if is_validation(i, 0, raised)]
    assert held == [min(ids, key=lambda i: split_key(i, 0))] and 0.02 < raised < 1
    assert float(f"{raised:.2g}") == raised  # a short decimal: the value a note prints is the value used
    # Where the fraction holds out one already, or there is no document to spare, it is kept.
    many = [f"doc-{i}" for i in range(500)]
    assert fraction_holding_out_one(many, 0, 0.02) == 0.02
    assert fraction_holding_out_one(ids[:1], 0, 0.02) == 0.02 and fraction_holding_out_one([], 0, 0.02) == 0.02


def test_a_mixtures_repeated_copies_are_held_out_with_their_original(tmp_path, tok_dir):
    """Curation's mixture upsamples a source by writing copies `ID#repeatK`. Their ids hashed apart,
    so most held-out documents had a copy in training (20 of 21 on the shared corpora): validation
    scored text the model had seen. All copies now fall on the side of their original."""
    copies = 3
    with open(tmp_path / "mixed.jsonl", "w") as f:
        for i in range(60):
            for k in range(copies):
                doc_id = repeat_id(f"d{i}", k) if k else f"d{i}"
                f.write(
                    json.dumps({"id": doc_id, "text": f"document {i}: " + SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)]}) + "\n"
                )
    config = TokenizeConfig(
        inputs=[str(tmp_path / "mixed.jsonl")],
        tokenizer=str(tok_dir),
        output_dir=str(tmp_path / "tokens"),
        val_fraction=0.2,
        workers=1,
    )
    manifest = tokenize(config, progress=False)
    held = sum(is_validation(f"d{i}", 0, 0.2) for i in range(60))
    assert 0 < held < 60 and manifest["val_docs"] == copies * held
    assert original_id("d7#repeat2") == "d7" and original_id("d7#repeat") == "d7#repeat"
    # A small corpus's raised fraction holds out the lowest document with its copies, and stays short.
    ids = [f"doc-{i}" for i in range(5)]
    lowest = min(ids, key=lambda i: split_key(i, 0))
    ids += [repeat_id(lowest, 1), repeat_id(lowest, 2)]
    raised = fraction_holding_out_one(ids, 0, 0.02)
    assert [i for i in ids if is_validation(i, 0, raised)] == [lowest, repeat_id(lowest, 1), repeat_id(lowest, 2)]
    assert float(f"{raised:.2g}") == raised


def test_the_fraction_that_holds_out_one_is_short_but_never_holds_out_two(monkeypatch):
    import marinlm.dataset.tokenize as tokenize_module

    keys = {"a": 0.4123456781, "b": 0.4123456789, "c": 0.9}  # the two lowest agree to 9 digits
    monkeypatch.setattr(tokenize_module, "split_key", lambda doc_id, seed: keys[doc_id])
    raised = fraction_holding_out_one(keys, 0, 0.02)
    assert keys["a"] < raised <= keys["b"] and raised == 0.4123456782
    keys["b"] = keys["a"]  # a tie: no fraction holds out one alone; the next float above holds out both
    assert keys["a"] < fraction_holding_out_one(keys, 0, 0.02) <= keys["a"] + 1e-15


def test_tokenize_says_when_no_document_is_held_out_and_which_fraction_holds_out_one(tmp_path, tok_dir, capsys):
    from marinlm.cli import main

    write_corpus(tmp_path / "corpus", num_docs=3, num_files=1)
    config = tmp_path / "tok.yaml"
    tokenizer_file = tok_dir / "tokenizer.json"  # a file, not a folder: the tokens carry a saved copy
    config.write_text(f"inputs: [{tmp_path / 'corpus'}]\ntokenizer: {tokenizer_file}\nval_fraction: 0.01\nworkers: 1\n")
    assert main(["tokenize", str(config), f"--output_dir={tmp_path / 'a'}"]) == 0
    note = capsys.readouterr().out.splitlines()[-1]
    assert note.startswith("note: val_fraction 0.01 holds out none of the 3 documents")
    fraction = note.split("--val_fraction=")[1].split()[0]
    assert main(["tokenize", str(config), f"--output_dir={tmp_path / 'b'}", f"--val_fraction={fraction}"]) == 0
    assert "val 0" not in capsys.readouterr().out
    assert TokenDataset(tmp_path / "b", "val").num_docs == 1 and TokenDataset(tmp_path / "b", "train").num_docs == 2
    assert MarinTokenizer.load(tmp_path / "b" / "tokenizer").hash == MarinTokenizer.load(tokenizer_file).hash
    # One document (a single .txt, its path the id) cannot be split: where its hash keeps it in
    # train, the note says to cut it; where it falls below the fraction (1 path in 100), that
    # everything was held out. The paths are chosen by the hash, so either case runs every time.
    paths = [tmp_path / f"one-{i}.txt" for i in range(2000)]
    kept = next(p for p in paths if not is_validation(str(p), 0, 0.01))
    held = next(p for p in paths if is_validation(str(p), 0, 0.01))
    for path, out, says in (
        (kept, "c", "note: one document cannot be split into train and val, so training on these tokens runs without"),
        (held, "d", "note: val_fraction 0.01 held out every document (a document is held out when the hash of"),
    ):
        path.write_text("a single long text\n" * 50)
        assert main(["tokenize", str(config), f"--inputs=[{path}]", f"--output_dir={tmp_path / out}"]) == 0
        assert capsys.readouterr().out.splitlines()[-1].startswith(says), path


def test_tokenize_rerun_skips_done_shards_and_redoes_damaged_ones(dataset, tok_dir, capsys):
    root, _, manifest = dataset
    parts = len(manifest["sources"])
    out = root / "tokens"
    # Simulate a crash in shard 1: its marker never got written and its output is half there.
    (out / ".done" / "00001.json").unlink()
    with open(out / "train" / "00001.tokens", "r+b") as f:
        f.truncate(10)
    before = {p: p.stat().st_mtime_ns for p in (out / "train").glob("0000[02].tokens")}
    capsys.readouterr()
    again = tokenize(corpus_config(root, tok_dir, out, workers=1))
    err = capsys.readouterr().err.splitlines()
    assert (
        err[0]
        == f"tokenize: {parts - 1} of {parts} part(s) done by an earlier run of this job; resuming with the other 1"
    )
    assert again["splits"] == manifest["splits"]  # byte-identical outputs (sha256 in the manifest)
    assert again["inputs_tokenized"] == 1  # only the damaged one
    assert {p: p.stat().st_mtime_ns for p in before} == before  # finished shards were not rewritten
    assert not list(out.rglob("*.tmp"))
    # With nothing left to do, manifest.json stays byte for byte what it was (its time included):
    # a training run records the data it used by the file's sha256.
    written = (out / "manifest.json").read_bytes()
    time.sleep(0.05)
    third = tokenize(corpus_config(root, tok_dir, out, workers=1))
    assert third["inputs_tokenized"] == 0 and third["seconds"] == again["seconds"]
    # Said in a line, not as an empty bar ("tokenize: 0.00B [00:00, ?B/s]").
    err = capsys.readouterr().err.splitlines()
    assert err == [f"tokenize: {parts} of {parts} part(s) done by an earlier run of this job; nothing left to do"]
    assert (out / "manifest.json").read_bytes() == written


def test_tokenize_into_a_folder_made_with_another_tokenizer_is_refused(dataset, tok_dir, tmp_path):
    """It used to skip every input as done and relabel the old shards with the new tokenizer."""
    root, _, _ = dataset
    other = tmp_path / "other-tok"
    MarinTokenizer(train_bpe([t.upper() for t in SAMPLE_TEXTS] * 40, vocab_size=700)).save(other)
    out = root / "tokens"
    manifest = (out / "manifest.json").read_text()
    config = corpus_config(root, other, out, workers=1)
    with pytest.raises(OutputInUseError, match=r"tokens: .*\(tokenizer.hash: "):
        tokenize(config, progress=False)
    config.tokenizer, config.seed = str(tok_dir), 4
    with pytest.raises(OutputInUseError, match=r"\(seed: 3 -> 4\)"):
        tokenize(config, progress=False)
    assert (out / "manifest.json").read_text() == manifest


def test_tokenize_with_nothing_readable_is_an_error(tok_dir, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"body": "a"}\n{"body": "b"}\n')
    config = TokenizeConfig(inputs=[str(tmp_path / "in.jsonl")], tokenizer=str(tok_dir), output_dir=str(tmp_path / "t"))
    with pytest.raises(
        ValueError, match=r"no document was tokenized .* 2 record\(s\) rejected \(first: .*in.jsonl:1: "
    ):
        tokenize(config, progress=False)
    assert len(json.loads((tmp_path / "t" / "manifest.json").read_text())["rejected"]) == 2  # kept for a look
    assert len((tmp_path / "t" / "rejected.jsonl").read_text().splitlines()) == 2
    (tmp_path / "empty.txt").write_text("")  # a document, but no text: nothing to train on either
    config.inputs, config.output_dir = [str(tmp_path / "empty.txt")], str(tmp_path / "t2")
    with pytest.raises(ValueError, match=r"no document was tokenized .* \(first: .*empty.txt: empty document\)"):
        tokenize(config, progress=False)


def test_the_manifest_keeps_examples_of_rejected_records_and_rejected_jsonl_all(tok_dir, tmp_path):
    """Every rejected record was listed in manifest.json, which every training rank reads."""
    lines = ['{"id": "ok", "text": "a fine document"}'] + [f'{{"id": "{i}", "body": "x"}}' for i in range(150)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    config = TokenizeConfig(inputs=[str(tmp_path / "in.jsonl")], tokenizer=str(tok_dir), output_dir=str(tmp_path / "t"))
    manifest = tokenize(config, progress=False)
    saved = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["rejected_count"] == saved["rejected_count"] == 150 and len(saved["rejected"]) == 100
    rejected = [json.loads(line) for line in (tmp_path / "t" / "rejected.jsonl").read_text().splitlines()]
    assert len(rejected) == 150 and rejected[149]["location"].endswith("in.jsonl:151")


def test_corruption_and_mismatch_are_reported_by_file(dataset, tmp_path):
    import shutil

    root, _, _ = dataset
    copy = tmp_path / "tokens"
    shutil.copytree(root / "tokens", copy)
    with pytest.raises(ShardError, match="tokenizer"):
        TokenDataset(copy, tokenizer_hash="0" * 64)
    with pytest.raises(ShardError, match="vocab_size 100 is smaller"):
        TokenDataset(copy, model_vocab_size=100)
    tokens_file = copy / "train" / "00000.tokens"
    data = bytearray(tokens_file.read_bytes())
    data[5] ^= 0xFF
    tokens_file.write_bytes(bytes(data))
    TokenDataset(copy)  # same size: the cheap check passes ...
    with pytest.raises(ShardError, match=r"00000\.tokens: sha256 differs"):
        TokenDataset(copy, verify="full")  # ... the full check catches it
    with open(tokens_file, "r+b") as f:
        f.truncate(len(data) - 2)
    with pytest.raises(ShardError, match=r"00000\.tokens: \d+ bytes on disk.*truncated"):
        TokenDataset(copy)
    (copy / "manifest.json").write_text("{broken")
    with pytest.raises(ShardError, match="corrupt manifest"):
        TokenDataset(copy)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.__setitem__((0, 0), -1), "document offsets are inconsistent"),
        (lambda d: d.__setitem__((-1, 0), d[-1, 0] + 5), "document offsets are inconsistent"),
        (lambda d: d.__setitem__((0, 1), -7), "negative byte count for document 0"),
    ],
)
def test_a_corrupt_document_index_is_reported(dataset, tmp_path, edit, message):
    """Same-sized edits to the index that the size check cannot see."""
    import shutil

    root, _, _ = dataset
    copy = tmp_path / "tokens"
    shutil.copytree(root / "tokens", copy)
    docs_file = copy / "train" / "00000.docs.npy"
    docs = np.load(docs_file)
    edit(docs)
    np.save(docs_file, docs)
    with pytest.raises(ShardError, match=rf"00000\.docs\.npy: {message}"):
        TokenDataset(copy)


def reconstruct(source: PackedSource, rows: int) -> list[list[int]]:
    """Stitch consecutive rows back into documents using segment ids and BOS/EOS."""
    from marinlm.dataset.packing import build_batch

    batch = build_batch([source], [(0, r) for r in range(rows)], cross_document_loss=False)
    stream = torch.cat([batch["input_ids"].reshape(-1), batch["labels"][-1, -1:]]).tolist()
    docs, current = [], []
    for t in stream:
        current.append(t)
        if t == source.data.eos_id:
            docs.append(current)
            current = []
    return docs


def test_packing_boundaries_masks_and_segments(dataset):
    root, _, _ = dataset
    config = DataConfig(sources=[SourceConfig(path=str(root / "tokens"))], seq_len=64, seed=1)
    source = open_sources(config)[0]
    data = source.data
    docs = reconstruct(source, source.rows_per_epoch)
    complete = [d for d in docs if d[0] == data.bos_id]
    for d in complete:  # every complete document is [BOS] + one stored document + [EOS]
        assert d[-1] == data.eos_id and data.bos_id not in d[1:]
    stored = {tuple(data.document(i).tolist()) for i in range(data.num_docs)}
    assert {tuple(d[1:-1]) for d in complete} <= stored
    assert len(complete) >= data.num_docs - 1  # only the epoch's tail remainder is cut

    from marinlm.dataset.packing import build_batch

    batch = build_batch([source], [(0, r) for r in range(10)], cross_document_loss=False)
    ids, labels, seg, mask = batch["input_ids"], batch["labels"], batch["segment_ids"], batch["loss_mask"]
    assert ids.shape == labels.shape == seg.shape == (10, 64)
    assert torch.equal(ids[:, 1:][mask[:, :-1]], labels[:, :-1][mask[:, :-1]])  # labels are next tokens
    eos = ids == data.eos_id
    assert torch.all(labels[eos] == -100)  # never predict the next document's BOS
    assert torch.all(~mask[eos])
    starts = ids == data.bos_id
    assert torch.all(seg[:, 1:][starts[:, 1:]] == seg[:, :-1][starts[:, 1:]] + 1)  # BOS opens a new segment
    assert torch.all((seg[:, 1:] - seg[:, :-1]) >= 0)
    crossing = build_batch([source], [(0, r) for r in range(10)], cross_document_loss=True)
    assert torch.all(crossing["labels"] != -100)


def collect(loader: TokenLoader, n: int) -> list[dict]:
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            return out
    return out


@pytest.mark.parametrize("workers_before, workers_after", [(0, 2), (2, 0)])
def test_exact_resume_across_worker_counts(dataset, workers_before, workers_after):
    root, _, _ = dataset
    config = DataConfig(
        sources=[SourceConfig(path=str(root / "tokens"))], seq_len=256, seed=5, num_workers=workers_before
    )
    reference = collect(build_loader(config, global_batch=4), 60)  # several epochs
    loader = build_loader(config, global_batch=4)
    first = collect(loader, 23)
    state = json.loads(json.dumps(loader.state_dict()))  # survives a JSON round trip
    config.num_workers = workers_after
    resumed = build_loader(config, global_batch=4)
    resumed.load_state_dict(state)
    rest = collect(resumed, 37)
    for a, b in zip(first + rest, reference):
        for key in a:
            assert torch.equal(a[key], b[key]), key
    assert reference[0]["input_ids"].shape == (4, 256)
    assert source_epochs(config) < 60 * 4  # the run crossed at least one epoch boundary


def source_epochs(config) -> int:
    return open_sources(config)[0].rows_per_epoch


def test_ranks_partition_the_global_batch(dataset):
    root, _, _ = dataset
    config = DataConfig(sources=[SourceConfig(path=str(root / "tokens"))], seq_len=32, seed=2)
    whole = collect(build_loader(config, global_batch=6), 5)
    parts = [collect(build_loader(config, global_batch=6, rank=r, world_size=3), 5) for r in range(3)]
    for step in range(5):  # dealt round the ranks: rank r holds rows r, r + 3; no overlap, no gap
        stitched = torch.stack([parts[r][step]["input_ids"] for r in range(3)], 1).flatten(0, 1)
        assert torch.equal(stitched, whole[step]["input_ids"])
    with pytest.raises(ValueError, match="not divisible"):
        build_loader(config, global_batch=6, world_size=4)


def test_mixture_proportions_and_seeds(dataset, tmp_path, tok_dir):
    root, _, _ = dataset
    write_corpus(tmp_path / "other", num_docs=80, num_files=1, seed=9)
    tokenize(
        TokenizeConfig(
            inputs=[str(tmp_path / "other")],
            tokenizer=str(tok_dir),
            output_dir=str(tmp_path / "tok2"),
            val_fraction=0.0,
        ),
        progress=False,
    )
    config = DataConfig(
        sources=[
            SourceConfig(path=str(root / "tokens"), weight=3.0),
            SourceConfig(path=str(tmp_path / "tok2"), weight=1.0),
        ],
        seq_len=16,
        seed=0,
    )
    loader = build_loader(config, global_batch=8)
    collect(loader, 25)
    counts = loader.state_dict()["counts"]
    assert counts == [150, 50]  # exactly 3:1 over 200 rows
    other_seed = DataConfig(sources=config.sources, seq_len=16, seed=1)
    a = collect(build_loader(config, global_batch=8), 1)[0]["input_ids"]
    b = collect(build_loader(other_seed, global_batch=8), 1)[0]["input_ids"]
    assert not torch.equal(a, b)

    # A second phase from step 10 at 1:3. The loader deals micro-batches of 8 rows, two to a step
    # of 16, so the phase begins at row 160; from there it tracks its own weights, batch by batch,
    # instead of making up for phase 0's 3:1 (which would give source 1 every row for a while).
    phase = MixturePhaseConfig(start_step=10, weights=[1.0, 3.0])
    phased = DataConfig(sources=config.sources, seq_len=16, mixture_phases=[phase])
    loader = build_loader(phased, global_batch=8, rows_per_step=16)
    counts, batches = [], iter(loader)
    for _ in range(25):
        next(batches)
        counts.append(loader.state_dict()["counts"])
    assert counts[19] == [120, 40]  # 160 rows of phase 0 at 3:1
    assert [b[1] - a[1] for a, b in zip(counts[19:], counts[20:])] == [6] * 5  # 2:6 in every batch after
    assert counts[-1] == [130, 70]
    # A source may wait at weight 0 for a later phase (a recipe's top levels); all at 0 is an error.
    waiting = DataConfig(
        sources=[SourceConfig(path=s.path, weight=w) for s, w in zip(config.sources, [1.0, 0.0])],
        seq_len=16,
        mixture_phases=[phase],
    )
    waits = build_loader(waiting, global_batch=8, rows_per_step=16)
    assert collect(waits, 20) and waits.state_dict()["counts"] == [160, 0]
    with pytest.raises(ConfigError, match=r"sources: the weights must have a positive sum, got \[0.0, 0.0\]"):
        DataConfig(sources=[SourceConfig(path=s.path, weight=0.0) for s in config.sources])
    # What the trainer plans (the epochs it reports and records) follows the phases too.
    assert loader.planned_rows(200).tolist() == [130, 70]
    assert loader.planned_rows(400).tolist() == [180, 220]  # 3:1 over 160 rows, then 1:3 over 240
    # Resuming in either phase gives the same batches as the run that never stopped.
    reference = collect(build_loader(phased, global_batch=8, rows_per_step=16), 25)
    for stop in (15, 22):
        loader = build_loader(phased, global_batch=8, rows_per_step=16)
        first = collect(loader, stop)
        resumed = build_loader(phased, global_batch=8, rows_per_step=16)
        resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
        for a, b in zip(first + collect(resumed, 25 - stop), reference):
            assert torch.equal(a["input_ids"], b["input_ids"]), stop


def test_resume_refuses_changed_data(dataset):
    root, _, _ = dataset
    config = DataConfig(sources=[SourceConfig(path=str(root / "tokens"))], seq_len=32)
    loader = build_loader(config, global_batch=2)
    collect(loader, 2)
    state = loader.state_dict()
    other = build_loader(DataConfig(sources=config.sources, seq_len=48), global_batch=2)
    with pytest.raises(ValueError, match=r"the data changed \(data.sources or data.seq_len\).*--checkpoint.init_from"):
        other.load_state_dict(state)
    # A position saved when rows were drawn in sequence (also: before the row order was saved)
    # continues only in sequence; in another order it would repeat and skip rows of the epoch.
    sequential = DataConfig(sources=config.sources, seq_len=32, shuffle_rows=False)
    reference = collect(build_loader(sequential, global_batch=2), 4)
    old = build_loader(sequential, global_batch=2)
    collect(old, 2)
    state = old.state_dict()
    del state["shuffle_rows"]
    with pytest.raises(ValueError, match=r"data.shuffle_rows: .* saved with false, this run has true"):
        build_loader(config, global_batch=2).load_state_dict(state)
    resumed = build_loader(sequential, global_batch=2)
    resumed.load_state_dict(state)
    for a, b in zip(collect(resumed, 2), reference[2:], strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])


def test_validation_pass_covers_every_token_once(dataset):
    root, _, _ = dataset
    config = DataConfig(sources=[SourceConfig(path=str(root / "tokens"))], seq_len=40)
    source = open_sources(config, "val")[0]
    predicted, weight = 0, 0.0
    for batch in validation_batches(source, batch_size=3):
        predicted += int(batch["loss_mask"].sum())
        weight += float(batch["byte_weights"].sum())
    data = source.data
    assert predicted == data.num_tokens + data.num_docs  # each doc's tokens + EOS, nothing else
    assert weight == pytest.approx(data.num_bytes, rel=1e-5)  # bits-per-byte denominators add up


def test_bad_inputs_fail_fast(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tokenize(
            TokenizeConfig(inputs=[str(tmp_path / "nope")], tokenizer=str(tok_dir), output_dir=str(tmp_path / "o")),
            progress=False,
        )
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ShardError, match="no manifest"):
        TokenDataset(tmp_path / "empty")


def test_stored_epochs_give_the_same_rows_and_are_built_once(dataset, tmp_path, monkeypatch):
    """With index_dir, shuffled epochs are built by one process, stored, and memory-mapped by the
    others (ranks, loader workers); the rows are those of the in-memory path."""
    import marinlm.dataset.packing as packing_module

    root, _, _ = dataset
    config = DataConfig(sources=[SourceConfig(path=str(root / "tokens"))], seq_len=256, seed=5)
    reference = collect(build_loader(config, global_batch=4), 60)  # several epochs, in memory
    epochs = 60 * 4 // source_epochs(config) + 1
    assert epochs >= 3
    config.num_workers = 2
    monkeypatch.setattr(packing_module, "_CHUNK", 7)  # the stream ends summed in chunks, carried over
    stored = collect(build_loader(config, global_batch=4, index_dir=tmp_path / "index"), 60)
    for a, b in zip(stored, reference):
        for key in a:
            assert torch.equal(a[key], b[key]), key
    (folder,) = (tmp_path / "index").iterdir()
    kept = sorted(p.name for p in folder.glob("*.npy"))
    assert kept == [f"epoch-{e:06d}.{part}.npy" for e in (epochs - 2, epochs - 1) for part in ("ends", "order")]

    # Another process (a rank, a resume) maps the stored epochs and builds nothing.
    monkeypatch.setattr(PackedSource, "_build_epoch", lambda self, epoch: pytest.fail(f"rebuilt epoch {epoch}"))
    loader = build_loader(config, global_batch=4, index_dir=tmp_path / "index")
    loader.load_state_dict({**loader.state_dict(), "rows_consumed": 50 * 4, "counts": [50 * 4]})
    for a, b in zip(collect(loader, 10), reference[50:]):
        assert torch.equal(a["input_ids"], b["input_ids"])
    monkeypatch.undo()

    # A stored epoch that is not this dataset's (damaged, or a stale file) is rebuilt, not trusted.
    np.save(folder / f"epoch-{epochs - 1:06d}.order.npy", np.arange(3))
    loader = build_loader(config, global_batch=4, index_dir=tmp_path / "index")
    loader.load_state_dict({**loader.state_dict(), "rows_consumed": 55 * 4, "counts": [55 * 4]})
    for a, b in zip(collect(loader, 5), reference[55:]):
        assert torch.equal(a["input_ids"], b["input_ids"])


def write_synthetic_tokens(folder, num_docs: int, shards: int = 2, max_len: int = 50):
    """A token folder of `num_docs` documents of 1 to `max_len` tokens (sparse token files)."""
    rng = np.random.default_rng(0)
    entries = []
    for s in range(shards):
        (folder / "train").mkdir(parents=True, exist_ok=True)
        lengths = rng.integers(1, max_len, num_docs // shards)
        index = np.stack([np.cumsum(lengths), lengths * 4], 1).astype(np.int64)
        np.save(folder / f"train/{s:05d}.docs.npy", index)
        with open(folder / f"train/{s:05d}.tokens", "wb") as f:
            f.truncate(int(index[-1, 0]) * 2)
        entries.append(
            {
                "tokens": f"train/{s:05d}.tokens",
                "docs": f"train/{s:05d}.docs.npy",
                "num_docs": len(index),
                "num_tokens": int(index[-1, 0]),
                "tokens_bytes": int(index[-1, 0]) * 2,
                "docs_bytes": (folder / f"train/{s:05d}.docs.npy").stat().st_size,
            }
        )
    tokenizer = {"hash": "synthetic", "vocab_size": 1000, "bos_id": 1, "eos_id": 2}
    manifest = {"tokenizer": tokenizer, "dtype": "uint16", "splits": {"train": entries, "val": []}}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_loader_memory_does_not_grow_with_the_number_of_documents(tmp_path, capsys, monkeypatch):
    """Opening a dataset held ~44 bytes a document in every process (concatenated per-document
    tables), and each epoch 16 more per process and loader worker; at 10^9 documents, tens of GB
    per rank. Now the index is memory-mapped and stored epochs are shared."""
    import tracemalloc

    write_synthetic_tokens(tmp_path / "tokens", num_docs=1_000_000)
    config = DataConfig(sources=[SourceConfig(path=str(tmp_path / "tokens"))], seq_len=64, seed=1)
    build_loader(config, global_batch=8, index_dir=tmp_path / "index")._specs()  # warm imports
    tracemalloc.start()
    try:
        data = TokenDataset(tmp_path / "tokens")
        held_open = tracemalloc.get_traced_memory()[0]
        loader = build_loader(config, global_batch=8, index_dir=tmp_path / "index")
        batches = collect(loader, 3)  # builds epoch 0 (transient memory), then maps it
        held_loader = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert data.num_docs == 1_000_000 and len(batches) == 3
    assert "shuffled and stored (1,000,000 documents" in capsys.readouterr().err  # the pause is explained
    assert held_open < 1_000_000, held_open  # bytes: about one byte a document is too much
    assert held_loader < 2_000_000, held_loader
    # Lookups agree with the index files.
    index = np.load(tmp_path / "tokens" / "train" / "00001.docs.npy")
    docs = np.array([500_000, 500_001, 999_999])
    assert data.doc_len(docs).tolist() == [index[0, 0], index[1, 0] - index[0, 0], index[-1, 0] - index[-2, 0]]
    assert data.doc_bytes(docs).tolist() == index[[0, 1, -1], 1].tolist()
    lengths = data.all_doc_lens()
    assert lengths.dtype == np.int32 and lengths.sum(dtype=np.int64) == data.num_tokens  # 4 bytes a document
    import marinlm.dataset.shards as shards_module

    monkeypatch.setattr(shards_module, "_CHUNK", 1000)  # read in chunks across shard boundaries
    assert np.array_equal(data.all_doc_lens(), lengths)
    assert lengths[500_000] == index[0, 0] and lengths[-1] == index[-1, 0] - index[-2, 0]


@pytest.mark.slow
def test_tokenize_on_ray_writes_what_local_processes_write(dataset, tok_dir, tmp_path):
    """Tokenization ran only on local processes: a corpus beyond one machine had no way through."""
    pytest.importorskip("ray")
    import ray

    root, _, _ = dataset
    try:
        on_ray = tokenize(corpus_config(root, tok_dir, tmp_path / "ray", executor="ray"), progress=False)
    finally:
        ray.shutdown()
    local = json.loads((root / "tokens" / "manifest.json").read_text())  # the fixture's local run
    for split in ("train", "val"):
        files = [(e["tokens_sha256"], e["docs_sha256"]) for e in local["splits"][split]]
        assert [(e["tokens_sha256"], e["docs_sha256"]) for e in on_ray["splits"][split]] == files
    assert on_ray["rejected_count"] == local["rejected_count"] == 3


def test_a_full_disk_while_storing_an_epoch_is_an_error_naming_the_file(dataset, tmp_path, monkeypatch):
    """The stored epoch is written through a memory map of a sparse file: on a full disk the first
    write into an unbacked page killed the training process with SIGBUS (measured on a 100 MB
    tmpfs with 40M documents). The file's blocks are now reserved first."""
    import errno
    import os

    root, _, _ = dataset
    config = DataConfig(sources=[SourceConfig(path=str(root / "tokens"))], seq_len=256, seed=5)
    calls = []

    def full_disk(fd, offset, length):
        calls.append(length)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full_disk, raising=False)
    loader = build_loader(config, global_batch=4, index_dir=tmp_path / "index")
    with pytest.raises(OSError, match=r"No space left on device") as caught:
        collect(loader, 1)
    assert caught.value.filename.endswith("epoch-000000.ends.npy") and calls and calls[0] > 0
    assert not [p for p in (tmp_path / "index").rglob("*") if p.is_file() and not p.name.endswith(".lock")]

    def unsupported(fd, offset, length):  # a filesystem that cannot preallocate: written as before
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported, raising=False)
    assert len(collect(build_loader(config, global_batch=4, index_dir=tmp_path / "index"), 2)) == 2


def test_a_malformed_manifest_names_the_file_and_key(dataset, tmp_path):
    import json
    import shutil

    root, _, _ = dataset
    shutil.copytree(root / "tokens", tmp_path / "tokens")
    manifest = tmp_path / "tokens" / "manifest.json"
    good = json.loads(manifest.read_text())
    for edit, message in [
        (lambda m: m.pop("dtype"), r"manifest\.json: missing key 'dtype'"),
        (lambda m: m["tokenizer"].pop("vocab_size"), r"manifest\.json: missing key 'vocab_size'"),
        (lambda m: m["splits"].update(train=[{"tokens": "train/x.tokens"}]), r"manifest\.json: missing key 'num_docs'"),
        (lambda m: m.update(tokenizer=["not", "a", "dict"]), r"manifest\.json: malformed"),
    ]:
        broken = json.loads(json.dumps(good))
        edit(broken)
        manifest.write_text(json.dumps(broken))
        with pytest.raises(ShardError, match=message):
            TokenDataset(tmp_path / "tokens")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32))
def test_the_row_permutation_is_a_bijection(n, seed):
    order = Permutation(n, seed)
    drawn = order(np.arange(n))
    assert np.array_equal(np.sort(drawn), np.arange(n))
    assert order(n // 2) == drawn[n // 2] and isinstance(order(0), int)
    with pytest.raises(IndexError):
        order(n)


def test_the_row_permutation_scatters_neighbours_and_depends_on_the_seed():
    n = 10_000
    a, b = Permutation(n, [0, 0])(np.arange(n)), Permutation(n, [0, 1])(np.arange(n))
    assert np.mean(a == b) < 0.01 and np.mean(a == np.arange(n)) < 0.01
    assert np.median(np.abs(np.diff(a))) > n / 10  # consecutive draws land far apart


def test_batches_mix_documents_and_an_epoch_draws_every_row_once(tmp_path):
    """Consecutive packed rows are a stretch of the document stream: with long documents, 8 of them
    were mostly one document (72% of the quickstart's batches). Rows are drawn in a shuffled order."""
    write_synthetic_tokens(tmp_path / "long", num_docs=40, max_len=2000)

    def docs_per_batch(shuffle_rows: bool) -> float:
        config = DataConfig(sources=[SourceConfig(path=str(tmp_path / "long"))], seq_len=32, shuffle_rows=shuffle_rows)
        loader = build_loader(config, global_batch=8)
        source = loader.sources[0]
        counts, drawn = [], []
        for _, (rows, _) in zip(range(source.rows_per_epoch // 8 + 3), loader._specs()):
            indexes = [index for _, index in rows]
            drawn += indexes
            counts.append(len({d for index in indexes for d in source.row(index)[1].tolist() if d >= 0}))
        epoch = source.rows_per_epoch
        assert sorted(drawn[:epoch]) == list(range(epoch))  # each row of an epoch once
        assert all(epoch <= index < 2 * epoch for index in drawn[epoch:])  # then the next epoch's rows
        return float(np.mean(counts))

    assert docs_per_batch(shuffle_rows=False) < 2
    assert docs_per_batch(shuffle_rows=True) > 6


def test_validation_on_max_rows_covers_many_documents(tmp_path, monkeypatch):
    write_synthetic_tokens(tmp_path / "long", num_docs=40, max_len=2000)
    source = open_sources(DataConfig(sources=[SourceConfig(path=str(tmp_path / "long"))], seq_len=32))[0]
    import marinlm.dataset.loader as loader_module

    validated = []
    real_build_batch = loader_module.build_batch
    monkeypatch.setattr(
        loader_module,
        "build_batch",
        lambda sources, rows, **kw: validated.extend(rows) or real_build_batch(sources, rows, **kw),
    )
    for _ in validation_batches(source, batch_size=4, max_rows=8):
        pass
    assert len(validated) == 8
    assert len({d for _, index in validated for d in source.row(index)[1].tolist() if d >= 0}) >= 6


def test_a_folder_that_is_not_token_shards_says_what_it_is_and_what_to_give(dataset, tok_dir, tmp_path):
    """Each used to read `FOLDER/manifest.json: no manifest` or `missing key 'tokenizer'`."""
    from marinlm.utils.io import JOB_FILE, LOCK_FILE

    root, _, _ = dataset
    curation = tmp_path / "curated"
    (curation / "shards").mkdir(parents=True)
    (curation / "shards" / "00000.jsonl.zst").write_bytes(b"")
    (curation / "manifest.json").write_text(json.dumps({"shards": [{"path": "shards/00000.jsonl.zst"}]}))
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / LOCK_FILE).touch()  # as every run folder has
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / JOB_FILE).write_text(json.dumps({"job": "tokenize"}))
    (tmp_path / "curating" / "shards").mkdir(parents=True)
    (tmp_path / "curating" / JOB_FILE).write_text(json.dumps({"job": "curate"}))
    (tmp_path / "file.jsonl").write_text("{}\n")
    tokenize_hint = r"tokenize it first: marinlm tokenize \S+ --inputs='\[{}\]' --tokenizer=TOKENIZER"
    cases = {
        tmp_path / "nowhere": "no such folder",
        tmp_path / "file.jsonl": "is a file, not a folder of token shards",
        curation: r"is a curation \(`marinlm data run`\), not token shards; " + tokenize_hint.format(curation),
        root / "corpus": "holds text, not token shards; " + tokenize_hint.format(root / "corpus"),
        tmp_path / "run": r"is a training run's folder, not token shards \(its own data sources are in .*config.yaml\)",
        tok_dir: "holds a tokenizer, not token shards",
        root: f"holds no token shards itself; the token folders inside it: {root / 'tokens'}$",
        tmp_path / "unfinished": r"holds an unfinished `marinlm tokenize` \(no manifest.json yet\): rerun it",
        tmp_path / "curating": r"holds an unfinished curation \(no manifest.json yet\): rerun its `marinlm data run`",
    }
    for folder, message in cases.items():
        with pytest.raises(ShardError, match=f"^{folder}: {message}"):
            TokenDataset(folder)


class _FlakyTokens:
    """A shard's tokens whose reads fail with EIO `failures` times, as network storage may."""

    def __init__(self, tokens, failures: int):
        self.tokens, self.failures, self.reads = tokens, failures, 0

    def __getitem__(self, key):
        self.reads += 1
        if self.failures:
            self.failures -= 1
            raise OSError(5, "Input/output error")
        return self.tokens[key]

    def __len__(self):
        return len(self.tokens)


def test_a_transient_read_error_is_retried_and_a_lasting_one_names_the_shard(token_data, monkeypatch):
    import marinlm.dataset.shards as shards_module

    waits = []
    monkeypatch.setattr(shards_module.time, "sleep", waits.append)
    data = TokenDataset(token_data, "train")
    want = np.array(data.document(0))
    flaky = _FlakyTokens(data.shards[0].tokens, failures=2)
    data.shards[0].tokens = flaky
    assert np.array_equal(data.document(0), want) and flaky.reads == 3
    assert waits == [0.5, 1.0]  # backoff doubles
    data.read_retries = 2
    flaky.failures = 3
    with pytest.raises(ShardError, match=rf"{data.shards[0].path}: reading document 0 failed 3 times"):
        data.document(0)
