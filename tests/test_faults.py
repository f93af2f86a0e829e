"""The fault-injection harness, small and fast: random SIGKILLs during training and during saves
resumed bitwise; every class of bad input data through `marinlm data run` with the accounting
checked; every class of broken checkpoint through `--resume auto`, `generate` and `eval`."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fault_inject import POINTS
from marinlm.cli import main as marinlm
from marinlm.config import save_config
from marinlm.jobs import run_training
from marinlm.train.checkpoint import list_checkpoints, validate
from marinlm.train.metrics import read_metrics
from marinlm.train.trainer import Trainer
from test_data_pipeline import parquet_with_a_corrupt_row_group, synthetic_docs

from conftest import ROOT, train_config

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent


def run_cli(*args, fault: tuple[str, int] | None = None) -> subprocess.CompletedProcess:
    """`marinlm ARGS` in a fresh process, killed by itself at `fault` (point, step) if given."""
    entry = [str(TESTS / "fault_inject.py"), *map(str, fault)] if fault else ["-m", "marinlm"]
    command = [sys.executable, *entry, *map(str, args)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def step_records(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in read_metrics(run_dir) if "train/loss" in r]


# --- SIGKILL at random points of training and of saves ---------------------------------------------------


@pytest.mark.parametrize("seed", [0])
def test_random_kills_during_steps_and_saves_resume_bitwise(token_data, tmp_path, seed):
    """Four SIGKILLs at points drawn from `seed` (inside a step, or at each stage of a save: before
    the tensors, before the completion marker, before the rename, before pruning), each followed by
    `--resume auto`: the run ends with every step's loss and gradient norm equal to an unbroken
    run's, bitwise, each step logged once, no half-written folder left and every checkpoint valid."""
    steps = 12
    rng = random.Random(seed)
    faults, at = [], 1
    for point in rng.sample(POINTS, 4):
        at = rng.randrange(at + 1, at + 3)
        if point != "step":
            at += at % 2  # saves come every 2 steps
        faults.append((point, at))
    print("faults:", faults)
    configs = {}
    for name in ("reference", "killed"):
        config = train_config(
            token_data, tmp_path / name, train={"steps": steps}, checkpoint={"every_steps": 2, "keep_last": 2}
        )
        save_config(config, tmp_path / f"{name}.yaml")
        configs[name] = tmp_path / f"{name}.yaml"
    out = run_cli("train", configs["reference"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for i, fault in enumerate(faults):
        out = run_cli("train", configs["killed"], *(["--resume", "auto"] if i else []), fault=fault)
        assert out.returncode == -signal.SIGKILL, (fault, out.stdout[-2000:] + out.stderr[-2000:])
    out = run_cli("train", configs["killed"], "--resume", "auto")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from" in out.stdout
    reference, killed = step_records(tmp_path / "reference"), step_records(tmp_path / "killed")
    assert [s for s, _, _ in killed] == list(range(1, steps + 1))  # each step once
    assert killed == reference  # bitwise
    root = tmp_path / "killed" / "checkpoints"
    assert not list(root.glob("*.tmp"))
    for folder in list_checkpoints(root):
        validate(folder)


# --- bad input data ---------------------------------------------------------------------------------------


def _record(i: str, text: str) -> str:
    return json.dumps({"id": i, "text": text})


def _bad_inputs(raw: Path, good: list[str]) -> tuple[dict[str, str], set[str]]:
    """Writes one file or line of each class of bad input among good documents under `raw`.
    Returns what `rejected/` must hold ({location: reason start}) and the ids that must be kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    texts = iter(good)
    lines = [  # (class, line, expected reason or None if the document is kept)
        ("unterminated string", '{"id": "u", "text": "no end', "malformed JSON"),
        ("data after the record", _record("tg", next(texts)) + " trailing", "malformed JSON: Extra data"),
        ("a list, not a record", "[1, 2, 3]", "expected a JSON object (a record) or a string (a text), got a list"),
        ("a number, not a record", "42", "expected a JSON object (a record) or a string (a text), got a number"),
        ("no text field", json.dumps({"id": "m", "body": next(texts)}), "missing field 'text'"),
        ("text is a number", json.dumps({"id": "i", "text": 42}), "field 'text' is int, not a string"),
        ("text is null", json.dumps({"id": "n", "text": None}), "field 'text' is null"),
        ("text is an object", json.dumps({"id": "o", "text": {"a": 1}}), "field 'text' is dict, not a string"),
        ("text is a list of numbers", json.dumps({"id": "l", "text": [1, 2]}), "field 'text' is list, not a string"),
        ("whitespace only", json.dumps({"id": "w", "text": " \n\t "}), "empty document"),
        ("too large", _record("big", "word " * 3000), "document too large"),
        ("a lone surrogate", '{"id": "s", "text": "' + next(texts)[:300] + ' \\ud800 end"}', None),
        ("nested 100,000 deep", "[" * 100_000 + "]" * 100_000, "malformed JSON: nested too deeply to parse"),
        ("a NUL character", json.dumps({"id": "nul", "text": next(texts)[:300] + "\u0000 zero"}), None),
        ("an id that is null", json.dumps({"id": None, "text": next(texts)}), None),
    ]
    expected, kept = {}, {"s", "nul", "bom", "crlf1", "crlf2", "last", "z0"}
    with open(raw / "lines.jsonl", "wb") as f:
        for number, (_, line, reason) in enumerate(lines, start=1):
            f.write(line.encode() + b"\n")
            if reason:
                expected[f"lines.jsonl:{number}"] = reason
        f.write(b"\n")  # a blank line: no record
        f.write(b'{"id": "bad-utf8", "text": "\xff\xfe abc"}\n')
        expected[f"lines.jsonl:{len(lines) + 2}"] = "invalid UTF-8"
        f.write(_record("last", next(texts)).encode())  # no final newline
    (raw / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + _record("bom", next(texts)).encode() + b"\n")
    crlf = _record("crlf1", next(texts)) + "\r\n" + _record("crlf2", next(texts)) + "\r\n"
    (raw / "crlf.jsonl").write_bytes(crlf.encode())
    payload = "".join(_record(f"z{i}", next(texts)) + "\n" for i in range(3)).encode()
    (raw / "cut.jsonl.gz").write_bytes(gzip.compress(payload)[:-30])
    expected["cut.jsonl.gz:3"] = "truncated or corrupt stream"  # the records before the cut are kept
    kept |= {"z1"}

    (raw / "cut.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(payload * 50)[:-40])
    expected["cut.jsonl.zst:1"] = "truncated or corrupt stream"
    (raw / "plain.jsonl.gz").write_bytes(payload)  # not gzip at all
    expected["plain.jsonl.gz:1"] = "truncated or corrupt stream: Not a gzipped file"
    noise = random.Random(0)
    (raw / "noise.jsonl").write_bytes(bytes(noise.randrange(128, 256) for _ in range(3000)))
    expected["noise.jsonl:1"] = "invalid UTF-8 at byte 0"
    (raw / "empty.txt").write_text("")
    expected["empty.txt"] = "empty document"
    (raw / "empty.jsonl").write_text("")  # no record, nothing to reject
    (raw / "bad.txt").write_bytes(b"fine text\n\xc3(\n")
    expected["bad.txt"] = "invalid UTF-8 at byte 10"
    (raw / "object.json").write_text(json.dumps({"text": "an object"}))
    expected["object.json"] = "a .json input must hold a list of records or texts, got an object"
    (raw / "list.json").write_text(json.dumps([{"id": "j0", "text": next(texts)}, 42, None]))
    expected["list.json:1"] = "expected a JSON object (a record) or a string (a text), got a number"
    expected["list.json:2"] = "expected a JSON object (a record) or a string (a text), got null"
    kept |= {"j0"}
    data = parquet_with_a_corrupt_row_group(raw / "groups.parquet", [next(texts) for _ in range(9)])
    expected["groups.parquet:4-6"] = "corrupt parquet data (row group 1, rows 4-6)"
    (raw / "footless.parquet").write_bytes(data[: len(data) // 2])
    expected["footless.parquet"] = "unreadable parquet"
    pq.write_table(pa.table({"content": ["x"]}), raw / "other-column.parquet")
    expected["other-column.parquet"] = "missing column 'text' (its columns are 'content')"
    (raw / ".hidden.jsonl").write_text("not read")
    (raw / "notes.docx").write_bytes(b"PK\x03\x04")
    return expected, kept


def test_every_class_of_bad_input_is_rejected_by_place_and_the_accounting_holds(tmp_path):
    """27 classes of bad input (broken JSON and records of every wrong shape, bad encodings, cut or
    mislabelled compression, broken parquet, empty files, hostile nesting, surrogates, NUL bytes,
    BOMs, CRLF) through `marinlm data run` with 2 workers: each bad record rejected with its file
    and line (or rows), the good ones kept, nothing lost: in = kept + dropped + rejected."""
    raw = tmp_path / "raw"
    raw.mkdir()
    expected, kept = _bad_inputs(raw, synthetic_docs(30, seed=11))
    config = {
        "output_dir": str(tmp_path / "out"),
        "workers": 2,
        "progress": False,
        "max_doc_bytes": 10_000,
        "sources": [{"name": "raw", "inputs": [str(raw)]}],
        "langid": {"enabled": False},
        "pii": {"enabled": False},
        "decontam": {"enabled": False},
        "dedup": {"exact": False, "fuzzy": False},
        "quality": {k: {"enabled": False} for k in ("gopher_quality", "gopher_repetition", "c4", "fineweb")},
    }
    (tmp_path / "curate.json").write_text(json.dumps(config))
    out = run_cli("data", "run", tmp_path / "curate.json")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "notes.docx" in out.stdout + out.stderr  # named as a type not read
    rejected = {}
    for path in sorted((tmp_path / "out" / "rejected").glob("*.jsonl")):
        for line in path.open():
            record = json.loads(line)
            rejected[os.path.relpath(record["location"], raw)] = record["reason"]
    assert sorted(rejected) == sorted(expected)
    for location, reason in expected.items():
        assert rejected[location].startswith(reason), (location, rejected[location])
    from marinlm.data.pipeline import read_records

    ids = {r["id"] for shard in (tmp_path / "out" / "shards").glob("*.jsonl.zst") for r in read_records(shard)}
    assert kept <= ids, kept - ids
    assert not any(".hidden" in i for i in ids)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    a = report["accounting"]["raw"]
    assert a["in"] == a["kept"] + a["dropped"] + a["rejected"] and a["rejected"] == len(expected)


# --- broken checkpoints -------------------------------------------------------------------------------------


def _flip_a_byte(folder: Path) -> None:
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def _plant_pickle(folder: Path) -> None:
    """Optimizer state holding a pickle that would create a file, its hashes made consistent."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from marinlm.train.checkpoint import file_listing

    tensors = _load_state_dict_from_keys(checkpoint_id=str(folder))

    class Payload:
        def __reduce__(self):
            return (os.system, ("touch " + str(folder.parent.parent / "pwned"),))

    def plant(tree) -> bool:
        for key, value in tree.items():
            if isinstance(value, dict) and plant(value):
                return True
            if not isinstance(value, (dict, torch.Tensor)):
                tree[key] = Payload()
                return True
        return False

    assert plant(tensors["optim"])
    dcp.save(tensors, checkpoint_id=str(folder))
    (folder / "COMPLETE.json").write_text(json.dumps({"files": file_listing(folder), "world_size": 1}))


def _marker(text: str):
    return lambda folder: (folder / "COMPLETE.json").write_text(text)


def _drop_sha(folder: Path) -> None:
    marker = json.loads((folder / "COMPLETE.json").read_text())
    for entry in marker["files"].values():
        entry.pop("sha256")
    (folder / "COMPLETE.json").write_text(json.dumps(marker))


def _truncate(folder: Path) -> None:
    with open(folder / "__0_0.distcp", "r+b") as f:
        f.truncate(100)


BREAKS = {
    "a flipped byte in a shard": _flip_a_byte,
    "a truncated shard": _truncate,
    "a missing shard": lambda f: (f / "__0_0.distcp").unlink(),
    "a missing metadata file": lambda f: (f / ".metadata").unlink(),
    "no completion marker": lambda f: (f / "COMPLETE.json").unlink(),
    "a marker that is not JSON": _marker('{"files": {'),
    "a marker that is null": _marker("null"),
    "a marker with a list of files": _marker('{"files": []}'),
    "a marker that is a list": _marker("[1, 2]"),
    "a marker without hashes": _drop_sha,
    "a broken trainer state": lambda f: (f / "trainer_state.json").write_text("{not json"),
    "a missing config": lambda f: (f / "config.yaml").unlink(),
    "an empty folder": lambda f: [shutil.rmtree(p) if p.is_dir() else p.unlink() for p in list(f.iterdir())],
    "a crafted pickle": _plant_pickle,
}


@pytest.fixture(scope="module")
def two_checkpoints(token_data, tmp_path_factory) -> Path:
    """A 4-step run with good checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("faults") / "run"
    run_training(train_config(token_data, run, train={"steps": 4}, checkpoint={"every_steps": 2, "keep_last": 3}))
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000004", "step-00000002"]
    return run


@pytest.mark.parametrize("name", list(BREAKS))
def test_a_broken_newest_checkpoint_is_skipped_by_resume_generate_and_eval(
    token_data, two_checkpoints, tmp_path, capsys, name
):
    """The newest checkpoint broken one way: `generate` and `eval` on the run load step 2 and say
    which checkpoint they skipped; `--resume auto` resumes from step 2; nothing planted runs, and no
    message suggests `weights_only=False`."""
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    newest = run / "checkpoints" / "step-00000004"
    BREAKS[name](newest)
    text = tmp_path / "eval.txt"
    text.write_text("A short text for the bits-per-byte task.\n" * 20)
    assert marinlm(["generate", str(run), "--prompt", "The", "--max-new-tokens", "4"]) == 0
    result = tmp_path / "eval.json"
    assert marinlm(["eval", str(run), "--tasks", f"bpb:{text}", "--limit", "2", "--output", str(result)]) == 0
    assert json.loads(result.read_text())["config"]["checkpoint"].endswith("step-00000002")
    trainer = Trainer(train_config(token_data, run, train={"steps": 6}, checkpoint={"every_steps": 2}), resume="auto")
    assert trainer.step == 2
    trainer.close()
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert out.count("skipping unusable checkpoint") >= 3 and str(newest) in out, out[-3000:]
    assert "weights_only" not in out and "Traceback" not in out
    assert not (run / "pwned").exists()


# --- outputs that would destroy inputs, fine-tunes that stay on their base --------------------------------


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """A run with one checkpoint (random tiny weights), written without training: a base to export,
    import and fine-tune."""
    from dataclasses import replace

    from marinlm.tokenizer import MarinTokenizer, train_bpe
    from marinlm.train.config import TrainConfig
    from marinlm.train.run_folder import save_run

    from conftest import SAMPLE_TEXTS, build, tiny_config

    root = tmp_path_factory.mktemp("small_run")
    tok = MarinTokenizer(train_bpe(SAMPLE_TEXTS * 20 + ["What is 2 + 3? It is 5."] * 20, 500))
    config = tiny_config(num_layers=2, vocab_size=512, moe={"capacity_factor": None})
    model = build(config, seed=0)
    save_run(root / "run", replace(TrainConfig(model=config), run_dir=str(root / "run")), model.state_dict(), tok, {})
    return root / "run"


def test_export_overwrite_refuses_a_folder_holding_the_run_it_exports(small_run, tmp_path, capsys):
    """`export DIR/src/train DIR --overwrite` deleted the run it exported; now every command that
    replaces a folder refuses one that is, holds or lies inside one of its inputs, naming both."""
    run = tmp_path / "dir" / "src" / "train"
    shutil.copytree(small_run, run)
    assert marinlm(["export", str(run), str(tmp_path / "dir"), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the export folder") and "holds the checkpoint" in err and str(run) in err, err
    assert list_checkpoints(run / "checkpoints")  # the run is still there
    assert marinlm(["export", str(run), str(run / "checkpoints" / "step-00000000" / "hf")]) == 2
    assert "lies inside the checkpoint" in capsys.readouterr().err
    hf = tmp_path / "hf"
    assert marinlm(["export", str(run), str(hf)]) == 0
    assert marinlm(["import", str(hf), str(tmp_path), "--overwrite"]) == 2
    assert "holds the model folder" in capsys.readouterr().err and (hf / "config.json").is_file()


def test_export_files_are_readable_by_the_team_and_a_full_disk_leaves_nothing(small_run, tmp_path, capsys, monkeypatch):
    """model.safetensors got mode 0600 (safetensors' own) where every other file got 0644; a full
    disk while writing it printed safetensors' traceback and left an empty `.exp.tmp-PID` folder."""
    import safetensors.torch

    hf = tmp_path / "exp"
    assert marinlm(["export", str(small_run), str(hf)]) == 0
    modes = {p.name: p.stat().st_mode & 0o777 for p in hf.iterdir() if p.is_file()}
    assert len(set(modes.values())) == 1, modes
    capsys.readouterr()

    def full_disk(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    assert marinlm(["export", str(small_run), str(tmp_path / "full")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "No space left on device" in err and str(tmp_path / "full") in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no temporary folder left


def test_import_reads_the_files_its_index_names_and_names_a_broken_one(small_run, tmp_path, capsys):
    """A stray `zz-old.safetensors` of zeros beside an export was loaded after it and won: the model
    imported as all zeros. A truncated file or a broken header was a SafetensorError traceback."""
    from safetensors.torch import load_file, save_file

    from marinlm.train.checkpoint import resolve_checkpoint

    hf = tmp_path / "hf"
    assert marinlm(["export", str(small_run), str(hf), "--max-shard-size=200KB"]) == 0
    assert (hf / "model.safetensors.index.json").is_file()
    shard = sorted(hf.glob("model-*.safetensors"))[0]
    zeros = {k: v.zero_() for k, v in load_file(str(shard)).items()}
    save_file(zeros, str(hf / "zz-old.safetensors"))
    assert marinlm(["import", str(hf), str(tmp_path / "imported")]) == 0
    capsys.readouterr()

    ours, theirs = (
        checkpoint_weights(resolve_checkpoint(small_run)),
        checkpoint_weights(resolve_checkpoint(tmp_path / "imported")),
    )
    assert all(bool((ours[k] == theirs[k]).all()) for k in ours)
    shard.write_bytes(shard.read_bytes()[:1000])
    assert marinlm(["import", str(hf), str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {shard}: not a readable safetensors file"), err
    (hf / "model.safetensors.index.json").unlink()
    assert marinlm(["import", str(hf), str(tmp_path / "again")]) == 2
    assert "no model.safetensors and no model.safetensors.index.json" in capsys.readouterr().err


def checkpoint_weights(folder: Path) -> dict:
    """The model tensors of a plain (not fine-tuning) checkpoint folder."""
    import torch

    from marinlm.config import load_config
    from marinlm.model import MarinForCausalLM
    from marinlm.train.checkpoint import load_tensors
    from marinlm.train.config import TrainConfig

    with torch.device("meta"):
        keys = MarinForCausalLM(load_config(TrainConfig, folder / "config.yaml").model).state_dict()
    tensors = {"model": {k: torch.empty(v.shape, dtype=v.dtype) for k, v in keys.items()}}
    load_tensors(folder, tensors)
    return tensors["model"]


def _sft_file(path: Path, n: int = 24) -> Path:
    lines = [json.dumps({"question": f"What is {i} + {i}?", "answer": f"It is {2 * i}."}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _finetune(base: Path, run: Path, data: Path, steps: int, *extra: str) -> int:
    return marinlm(
        [
            "finetune",
            str(ROOT / "configs" / "finetune" / "gsm8k-lora.yaml"),
            f"--base={base}",
            f"--run_dir={run}",
            f"--sft.train_files=[{data}]",
            "--sft.val_files=[]",
            "--data.seq_len=64",
            f"--train.steps={steps}",
            "--train.global_batch=4",
            "--validation.every_steps=0",
            "--checkpoint.every_steps=2",
            "--checkpoint.keep_last=3",
            "--logging.every_steps=1",
            "--logging.tensorboard=false",
            "--logging.progress=false",
            "--logging.peak_flops=1e11",
            *extra,
        ]
    )


def test_a_resumed_finetune_keeps_its_base_and_a_broken_base_is_refused(small_run, tmp_path, capsys):
    """Fine-tune on base step 0, stop after step 2, give the base a newer checkpoint, resume: the run
    took the newest base silently and its steps 3-4 differed from an unbroken run's. Now it keeps the
    base it began on (steps equal), a new fine-tune can pick a base step (`base_checkpoint`), and a
    base changed under a fine-tune, or corrupt, is refused by resume, generate, eval and export."""
    from marinlm.train.checkpoint import CheckpointManager

    base = tmp_path / "base"
    shutil.copytree(small_run, base)
    data = _sft_file(tmp_path / "sft.jsonl")
    assert _finetune(base, tmp_path / "straight", data, 4) == 0
    # A fine-tune killed after its step-2 save: that checkpoint alone in a run folder.
    shutil.copytree(
        tmp_path / "straight" / "checkpoints" / "step-00000002", tmp_path / "broken" / "checkpoints" / "step-00000002"
    )
    # The base trains on: a newer checkpoint, other weights.
    step0 = base / "checkpoints" / "step-00000000"
    state = json.loads((step0 / "trainer_state.json").read_text())
    tensors = {"model": {k: v * 1.5 if v.is_floating_point() else v for k, v in checkpoint_weights(step0).items()}}
    CheckpointManager(base / "checkpoints", keep_last=5).save(
        5, tensors, {**state, "step": 5}, (step0 / "config.yaml").read_text(), tokenizer=step0 / "tokenizer"
    )
    assert _finetune(base, tmp_path / "broken", data, 4) == 0

    def losses(run):
        return {r["step"]: r["train/loss"] for r in read_metrics(run) if "train/loss" in r}

    straight = losses(tmp_path / "straight")
    assert losses(tmp_path / "broken") == {3: straight[3], 4: straight[4]}
    # A new fine-tune takes the newest base unless told which; told step 0, it trains as the first.
    assert _finetune(base, tmp_path / "newest", data, 1) == 0
    assert _finetune(base, tmp_path / "chosen", data, 1, "--base_checkpoint=0") == 0
    assert losses(tmp_path / "newest")[1] != straight[1]
    assert losses(tmp_path / "chosen")[1] == straight[1]
    capsys.readouterr()
    # The base it began on, corrupted: every command that needs it says so, naming the file.
    _flip_a_byte(step0)
    assert marinlm(["generate", str(tmp_path / "broken"), "--prompt", "What", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "its base checkpoint is unusable" in err and str(step0) in err, err
    assert marinlm(["export", str(tmp_path / "broken"), str(tmp_path / "exp")]) == 2
    assert "its base checkpoint is unusable" in capsys.readouterr().err
    text = tmp_path / "eval.txt"
    text.write_text("What is 2 + 3? It is 5.\n" * 20)
    assert marinlm(["eval", str(tmp_path / "broken"), "--tasks", f"bpb:{text}", "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "its base checkpoint is unusable" in err and "Traceback" not in err, err
    assert _finetune(base, tmp_path / "broken", data, 6) == 2
    err = capsys.readouterr().err
    assert "its base checkpoint is unusable" in err and str(tmp_path / "broken") in err, err
    assert "Traceback" not in err


# --- token shards checked against their manifest --------------------------------------------------------


def _copy_tokens(token_data: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "tokens"
    shutil.copytree(token_data, folder)
    return folder


@pytest.mark.parametrize("dtype", ["uint8", "uint32", "float32", "int64"])
def test_a_manifest_dtype_that_is_not_the_shards_is_refused_naming_the_file(token_data, tmp_path, dtype):
    """`"dtype": "uint8"` on uint16 shards trained on garbage, even under verify=full; uint32 and
    float32 failed with numpy's "not a multiple of the data-type size", naming no file."""
    from marinlm.dataset.shards import ShardError, TokenDataset

    folder = _copy_tokens(token_data, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16"
    manifest["dtype"] = dtype
    (folder / "manifest.json").write_text(json.dumps(manifest))
    for verify in ("size", "full"):
        with pytest.raises(ShardError) as caught:
            TokenDataset(folder, "train", verify=verify)
        message = str(caught.value)
        if dtype == "uint32":  # a token dtype, but 4 bytes a token where the shards hold 2
            assert message.startswith(str(folder / "train")) and "not 4 bytes a token" in message, message
        else:
            assert message.startswith(f"{folder / 'manifest.json'}: dtype '{dtype}' is not a token dtype"), message


def test_ids_beyond_the_vocabulary_are_named_by_shard_when_read(token_data, tmp_path, capsys):
    """Shards of 0xFFFF under the default verify=size died in the embedding with `IndexError: index out
    of range in self`, naming no shard; now the read names the shard and the document."""
    folder = _copy_tokens(token_data, tmp_path)
    for shard in (folder / "train").glob("*.tokens"):
        shard.write_bytes(b"\xff" * shard.stat().st_size)  # the size the manifest lists: verify=size passes
    config = train_config(token_data, tmp_path / "run", train={"steps": 2})
    config.data.sources[0].path = str(folder)
    save_config(config, tmp_path / "run.yaml")
    assert marinlm(["train", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {folder / 'train'}") and "token id 65535, not below the vocabulary size" in err


# --- a disk that fills between saves --------------------------------------------------------------------


class _FullDisk:
    """A file whose next write stores half of what it is given, then fails as a full disk does."""

    def __init__(self, file):
        self.file = file

    def write(self, text):
        self.file.write(text[: len(text) // 2])
        self.file.flush()
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.file, name)


def _comparable(records: list[dict]) -> list[dict]:
    """Every logged key except the host's own measurements (time, rates, memory), which no two runs share."""
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "mem/"))} for r in records]


def test_a_disk_that_fills_between_saves_leaves_a_run_that_resumes_exactly(token_data, tmp_path, capsys, monkeypatch):
    """The run stopped with "[Errno 28] No space left on device" naming no file (the error from
    closing the sinks replaced the one naming metrics.jsonl), left half a line in metrics.jsonl, and
    `--resume auto` then failed to parse it. Now the error names metrics.jsonl, no half line stays (and
    one left by a crash is dropped with a note), and the resumed run logs what an unbroken one does,
    key for key."""
    from marinlm.train.metrics import MetricSinks

    for name in ("straight", "filled"):
        config = train_config(token_data, tmp_path / name, train={"steps": 6}, checkpoint={"every_steps": 2})
        save_config(config, tmp_path / f"{name}.yaml")
    assert marinlm(["train", str(tmp_path / "straight.yaml")]) == 0
    log = MetricSinks.log

    def fill_at_step_3(self, step, scalars, *args, **kwargs):
        if step == 3 and "train/loss" in scalars:
            self.file = _FullDisk(self.file)
        return log(self, step, scalars, *args, **kwargs)

    monkeypatch.setattr(MetricSinks, "log", fill_at_step_3)
    capsys.readouterr()
    assert marinlm(["train", str(tmp_path / "filled.yaml")]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"error: {tmp_path / 'filled' / 'metrics.jsonl'}: No space left on device", err
    monkeypatch.undo()
    metrics = tmp_path / "filled" / "metrics.jsonl"
    assert metrics.read_text().endswith("}\n")
    with open(metrics, "a") as f:  # and what a crash mid-write leaves
        f.write('{"step": 3, "train/loss": 6.1, "train/gr')
    assert marinlm(["train", str(tmp_path / "filled.yaml"), "--resume", "auto"]) == 0
    assert "dropped its torn last line" in capsys.readouterr().out
    assert _comparable(read_metrics(tmp_path / "filled")) == _comparable(read_metrics(tmp_path / "straight"))
    # Run again once finished: nothing trains, and the final validation is not logged a second time.
    assert marinlm(["train", str(tmp_path / "filled.yaml"), "--resume", "auto"]) == 0
    assert _comparable(read_metrics(tmp_path / "filled")) == _comparable(read_metrics(tmp_path / "straight"))


@pytest.mark.distributed
def test_every_logged_key_after_a_resume_under_expert_parallel_equals_an_unbroken_runs(token_data, tmp_path):
    """`ep/a2a_bytes` on the first step after a resume was divided by the absolute step (53,350 for
    ~266,752), and the step after each validation counted validation's all-to-all traffic (794,112
    against ~260,000), the load imbalance (then `ep/rows_received_max_over_mean`) likewise. EP 2 on
    gloo, resumed from the step-4 checkpoint, with validation at steps 2, 4 and 6."""
    from test_train import torchrun_train

    config = train_config(
        token_data,
        tmp_path / "straight",
        train={"steps": 6},
        checkpoint={"every_steps": 2},
        validation={"every_steps": 2, "max_rows": 8, "batch_size": 4},
        parallel={"expert_parallel": 2},
    )
    save_config(config, tmp_path / "straight.yaml")
    torchrun_train(tmp_path / "straight.yaml")
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step-00000004", resumed / "checkpoints" / "step-00000004")
    shutil.copy(tmp_path / "straight" / "metrics.jsonl", resumed / "metrics.jsonl")  # steps 5-6 go on resume
    config.run_dir = str(resumed)
    save_config(config, tmp_path / "resumed.yaml")
    torchrun_train(tmp_path / "resumed.yaml")
    straight, again = read_metrics(tmp_path / "straight"), read_metrics(resumed)
    a2a = [r["ep/a2a_bytes"] for r in straight if "ep/a2a_bytes" in r]
    assert len(a2a) == 6 and max(a2a) < 1.2 * min(a2a), a2a  # per step, validation's traffic not in it
    assert _comparable(again) == _comparable(straight)


# --- SFT files: every class of bad data, named by file ----------------------------------------------------

GOOD = {"question": "What is 2 + 3?", "answer": "It is 5."}


def _jsonl(*records) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


SFT_BAD = {
    "malformed JSON": (b'{"question": "What is 2 + 3?", "answer": \n', "sft.jsonl:1: not valid JSON"),
    "wrong types": (_jsonl({"question": 5, "answer": ["It is 5."]}), "sft.jsonl:1: no 'messages' list"),
    "empty answers": (
        _jsonl(*[{"question": "What is 2 + 3?", "answer": " "}] * 4),
        "4 of 4 examples in sft.train_files have an empty",
    ),
    "over-long": (_jsonl(*[{"question": "What is 2 + 3? " * 200, "answer": "5"}] * 4), "the answer starts past"),
    "missing fields": (_jsonl({"question": "What is 2 + 3?"}), "sft.jsonl:1: no 'messages' list and no string"),
    "message without content": (
        _jsonl({"messages": [{"role": "user"}, {"role": "assistant", "content": "5"}]}),
        "sft.jsonl:1: message 0 needs a role",
    ),
    "not a list": (_jsonl({"messages": "What is 2 + 3?"}), "sft.jsonl:1: 'messages' must be a non-empty list"),
    "corrupt parquet": (b"PAR1 this is not parquet PAR1", "sft.parquet: not a readable parquet file"),
    "bad UTF-8": (_jsonl(GOOD) + b'{"question": "caf\xe9", "answer": "5"}\n', "sft.jsonl:2: invalid UTF-8"),
    "a JSON object, not a list": (b'{"question": "What?"}', "sft.json: expected a JSON list of examples"),
}


def _template(text: str, tmp_path: Path) -> Path:
    path = tmp_path / "chat.jinja"
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", [*SFT_BAD, "template without generation", "template using a missing field"])
def test_every_class_of_bad_sft_data_is_refused_naming_the_file(small_run, tmp_path, capsys, case):
    """Each class of bad fine-tuning data or template ends `marinlm finetune` with exit 2 and one line
    that starts with "error:" and names the file (and line) at fault: no traceback."""
    from marinlm.tokenizer import CHAT_TEMPLATE

    extra = []
    if case in SFT_BAD:
        data, expected = SFT_BAD[case]
        suffix = ".parquet" if "parquet" in case else ".json" if "JSON object" in case else ".jsonl"
        path = tmp_path / f"sft{suffix}"
        path.write_bytes(data)
    else:
        path = _sft_file(tmp_path / "sft.jsonl")
        if case == "template without generation":
            text = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
            expected = "chat.jinja: the chat template has no {% generation %} block"
        else:
            text = CHAT_TEMPLATE.replace("message['content']", "message['content'] + message['name'].upper()", 1)
            expected = "chat.jinja: the chat template fails on"
        extra = [f"--sft.chat_template={_template(text, tmp_path)}"]
    assert _finetune(small_run, tmp_path / "run", path, 1, *extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_sft_files_with_a_bom_or_raw_line_separators_are_read_as_curation_reads_them(small_run, tmp_path):
    """Valid JSON lines with a raw U+2028, U+2029 or U+0085 inside a string were split there and
    refused (`Unterminated string`); a file opening with a UTF-8 byte-order mark was refused."""
    from marinlm.finetune.data import read_records

    texts = ["It is\u20285.", "It is\u20295.", "It is\u00855."]
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + _jsonl(*[{"question": "What is 2 + 3?", "answer": t} for t in texts * 8]))
    records = read_records(path)
    assert [r["answer"] for _, r in records] == texts * 8 and records[1][0] == f"{path}:2"
    array = tmp_path / "odd.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps([GOOD]).encode())
    assert [r for _, r in read_records(array)] == [GOOD]
    assert _finetune(small_run, tmp_path / "run", path, 1) == 0


# --- small things --------------------------------------------------------------------------------------


def test_links_that_lead_nowhere_in_curation_input_are_noted(tmp_path):
    from marinlm.data.inputs import expand_inputs

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("some text\n")
    (tmp_path / "in" / "gone.txt").symlink_to(tmp_path / "missing.txt")
    (tmp_path / "in" / "loop.txt").symlink_to(tmp_path / "in" / "loop.txt")
    notes = []
    assert expand_inputs([str(tmp_path / "in")], quiet=True, notes=notes) == [tmp_path / "in" / "a.txt"]
    assert len(notes) == 1 and "skipping 2 symbolic link(s)" in notes[0] and "dangling or looping" in notes[0]


def test_a_failed_save_says_truly_whether_its_partial_folder_is_gone(tmp_path):
    """When rank 0 died in a save, rank 1 said "The partial folder was removed" while `step-N.tmp`
    stayed (only rank 0 removes it)."""
    from marinlm.train.checkpoint import CheckpointManager

    tmp = tmp_path / "step-00000004.tmp"
    tmp.mkdir()
    error = CheckpointManager(tmp_path, rank=1, world_size=2)._write_failed(4, tmp, OSError(5, "I/O error"))
    assert "The partial folder is left, ignored; the run's next save removes it" in str(error)
    error = CheckpointManager(tmp_path, rank=0, world_size=2)._write_failed(4, tmp, OSError(5, "I/O error"))
    assert "The partial folder was removed" in str(error) and not tmp.exists()
