from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from marinlm.config import load_config, save_config, to_dict
from marinlm.dataset.loader import source_names
from marinlm.jobs import run_training
from marinlm.train.checkpoint import CheckpointError, CheckpointManager, CheckpointMismatch, list_checkpoints, validate
from marinlm.train.config import TrainConfig
from marinlm.train.metrics import read_metrics
from marinlm.train.trainer import Trainer
from marinlm.utils.io import folder_lock

from conftest import ROOT, spawn_ranks, tiny_config, torchrun_command, train_config

# Every test here but a few trains a model: the whole file is the slow tier (`make test`).
pytestmark = pytest.mark.slow


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


def cli(config_path, *extra, env=None):
    cmd = [sys.executable, "-m", "marinlm", "train", str(config_path), *extra]
    return subprocess.Popen(
        cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def config_at(config_path, *overrides) -> TrainConfig:
    """The config `marinlm train config_path *overrides` runs."""
    return load_config(TrainConfig, str(config_path), list(overrides))


def torchrun_train(config_path) -> None:
    """`marinlm train` under torchrun with 2 gloo processes; fails the test with the output tail."""
    cmd = [*torchrun_command(2), "-m", "marinlm", "train", str(config_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_exact_resume_after_sigkill(token_data, tmp_path, precision):
    """Kill -9 mid-run, resume with --resume auto: every step's loss equals the uninterrupted run's,
    bitwise; also in the default precision and Newton-Schulz dtype (bf16 on a CPU with bf16 units)."""
    steps = 12
    for name in ("reference", "killed"):
        optim = {"ns_dtype": "auto"} if precision == "auto" else {}
        config = train_config(token_data, tmp_path / name, train={"steps": steps, "precision": precision}, optim=optim)
        save_config(config, tmp_path / f"{name}.yaml")
    ref = cli(tmp_path / "reference.yaml")
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out
    run = cli(tmp_path / "killed.yaml")

    def trained() -> int:
        try:
            return max(losses(tmp_path / "killed"), default=0)
        except json.JSONDecodeError:  # a line half written
            return 0

    # Killed once step 8 is logged: around its checkpoint's save, whatever the speed of a step
    # (a fixed delay after the first checkpoint outlasted all 12 steps in bf16).
    deadline = time.time() + 120
    while trained() < 8 and time.time() < deadline and run.poll() is None:
        time.sleep(0.01)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert run.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = max(losses(tmp_path / "killed"))
    assert killed_at < steps
    resumed = cli(tmp_path / "killed.yaml", "--resume", "auto")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert "resumed from" in out
    assert losses(tmp_path / "killed") == losses(tmp_path / "reference")  # bitwise, every step
    assert len(losses(tmp_path / "reference")) == steps
    val = [r["val/loss"] for r in read_metrics(tmp_path / "killed") if "val/loss" in r]
    assert val == [r["val/loss"] for r in read_metrics(tmp_path / "reference") if "val/loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("signum, workers", [(signal.SIGTERM, 2), (signal.SIGINT, 0)])
def test_a_stop_signal_saves_before_the_run_ends(token_data, tmp_path, signum, workers):
    """A scheduler's SIGTERM (or Ctrl-C) mid-run: the step under way ends, a checkpoint is saved, the
    exit status says which signal; a rerun resumes there. Before, every step since the last
    checkpoint was lost. The SIGTERM goes to the whole process group, as Slurm sends it: the data
    loader's workers must not die of it."""
    config = train_config(
        token_data,
        tmp_path / "run",
        train={"steps": 10_000},
        checkpoint={"every_steps": 0},
        data={"num_workers": workers},
    )
    save_config(config, tmp_path / "run.yaml")
    cmd = [sys.executable, "-m", "marinlm", "train", str(tmp_path / "run.yaml")]
    run = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    deadline = time.time() + 120
    while len(losses(tmp_path / "run")) < 3 and time.time() < deadline and run.poll() is None:
        time.sleep(0.05)
    os.killpg(run.pid, signum)
    out, _ = run.communicate(timeout=120)
    assert run.returncode == 128 + signum, out
    stopped = json.loads((tmp_path / "run" / "summary.json").read_text())["steps"]
    assert 3 <= stopped < 10_000
    assert f"stopped by {signal.Signals(signum).name} with a checkpoint at step {stopped}" in out
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == [f"step-{stopped:08d}"]
    resumed = cli(tmp_path / "run.yaml", f"--train.steps={stopped + 1}")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert f"resumed from {tmp_path / 'run' / 'checkpoints'}/step-{stopped:08d} at step {stopped}" in out


def test_corrupt_checkpoint_falls_back_to_previous(token_data, tmp_path, capsys):
    config = train_config(token_data, tmp_path / "run", train={"steps": 8})
    run_training(config)
    ckpts = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in ckpts] == ["step-00000008", "step-00000004"]
    shard = ckpts[0] / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    # Under torchrun the ranks split the hashing; the file's index in the listing says whose it is.
    index = sorted(json.loads((ckpts[0] / "COMPLETE.json").read_text())["files"]).index("__0_0.distcp")
    validate(ckpts[0], rank=(index + 1) % 2, world_size=2)  # the other rank's share: not read
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        validate(ckpts[0], rank=index % 2, world_size=2)
    (tmp_path / "run" / "checkpoints" / "step-00000012.tmp").mkdir()  # a half-written save: ignored
    shutil.copytree(tmp_path / "run", tmp_path / "copy")  # as it is before the resume sets step 8 aside
    trainer = Trainer(train_config(token_data, tmp_path / "run", train={"steps": 10}), resume="auto")
    assert trainer.step == 4
    assert "sha256 mismatch" in capsys.readouterr().out
    trainer.close()
    # The unusable step 8 is out of checkpoints/ (retention would keep it over the new saves), not deleted.
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000004"]
    [moved] = (tmp_path / "run" / "checkpoints-set-aside").glob("*/step-00000008")
    with open(moved / shard.name, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointManager(tmp_path / "run" / "checkpoints").load(moved, {})
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        Trainer(train_config(token_data, tmp_path / "run", train={"steps": 10}), resume=str(tmp_path / "typo"))
    # A mistyped step is told the steps there are (not the half-written step 12).
    typo = tmp_path / "run" / "checkpoints" / "step-00000009"
    with pytest.raises(
        CheckpointError, match=re.escape(f"{typo}: no such checkpoint folder; {typo.parent} holds step-00000004")
    ):
        Trainer(train_config(token_data, tmp_path / "run", train={"steps": 10}), resume=str(typo))
    # Every checkpoint broken: an error, not a silent start from step 0 in the same folder.
    (tmp_path / "copy" / "checkpoints" / ckpts[1].name / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"none of its 2 checkpoint\(s\) is usable"):
        Trainer(train_config(token_data, tmp_path / "copy", train={"steps": 10}), resume="auto")


def test_resume_accepts_a_run_folder_for_its_newest_good_checkpoint(token_data, tmp_path, capsys):
    """As `generate`, `eval` and `init_from` do; it was taken for a checkpoint without COMPLETE.json."""
    run_training(train_config(token_data, tmp_path / "run", train={"steps": 8}))
    (tmp_path / "run" / "checkpoints" / "step-00000008" / "COMPLETE.json").unlink()  # an unfinished save
    for run_dir, source in (("run", "run"), ("other", "run"), ("third", "run/checkpoints")):  # or its checkpoints/
        trainer = Trainer(
            train_config(token_data, tmp_path / run_dir, train={"steps": 10}), resume=str(tmp_path / source)
        )
        assert trainer.step == 4
        trainer.close()
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step-00000004'} at step 4" in capsys.readouterr().out


def test_resuming_an_earlier_step_sets_the_later_checkpoints_aside(token_data, tmp_path, capsys):
    """Resuming step 4 of a run that reached step 8 moves step 8 out of checkpoints/: left there,
    retention (which keeps the newest steps) pruned every new save and kept it, and `--resume auto`,
    `generate` and `eval` loaded it, the model of the abandoned branch."""
    run_training(train_config(token_data, tmp_path / "run", train={"steps": 8}))
    root = tmp_path / "run" / "checkpoints"
    capsys.readouterr()
    again = train_config(token_data, tmp_path / "run", train={"steps": 6}, checkpoint={"keep_last": 1})
    run_training(again, resume=str(root / "step-00000004"))
    assert [p.name for p in list_checkpoints(root)] == ["step-00000006"]
    [aside] = (tmp_path / "run" / "checkpoints-set-aside").glob("*/step-00000008")
    assert (aside / "COMPLETE.json").is_file()
    assert "its later checkpoints (step-00000008) are moved to" in capsys.readouterr().out
    trainer = Trainer(again, resume="auto")
    assert trainer.step == 6
    trainer.close()


def test_a_fresh_start_never_mixes_with_an_earlier_run(token_data, tmp_path):
    """--resume none over a run's checkpoints is refused (retention would keep the old run's newer
    steps for a later resume to pick up); a fresh start drops metrics an earlier attempt left."""
    run_training(train_config(token_data, tmp_path / "run", train={"steps": 4}))
    with pytest.raises(ValueError, match=r"holds checkpoints of an earlier run \(newest step-00000004\)"):
        Trainer(train_config(token_data, tmp_path / "run", train={"steps": 2}), resume="none")
    # While one job writes the run folder, a second `marinlm train` on it stops at once.
    save_config(train_config(token_data, tmp_path / "run", train={"steps": 6}), tmp_path / "run.yaml")
    with folder_lock(tmp_path / "run"):
        second = cli(tmp_path / "run.yaml")
        out, _ = second.communicate(timeout=300)
    assert second.returncode != 0 and "another marinlm job is writing here" in out
    assert max(losses(tmp_path / "run")) == 4  # it trained nothing
    # An attempt that died before its first checkpoint left metrics behind; the next start replaces them.
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    (attempt / "metrics.jsonl").write_text('{"step": 1, "train/loss": 99.0}\n{"step": 7, "train/loss": 98.0}\n')
    (attempt / ".marinlm.lock").write_text("pid 1 on a host\n")  # and its lock: no other job's outputs
    run_training(train_config(token_data, attempt, train={"steps": 2}), resume="auto")
    steps = [r["step"] for r in read_metrics(attempt) if "train/loss" in r]
    assert steps == sorted(set(steps)) and 99.0 not in losses(attempt).values() and 7 not in losses(attempt)


def test_a_run_folder_that_holds_another_kind_of_output_is_refused(token_data, tmp_path):
    """Checkpoints, metrics and config.yaml written among token shards (or a tokenizer, a curation,
    a quickstart's stages) would mix the two, and the run's resume would find the other's files."""
    from marinlm.quickstart import MARKER
    from marinlm.utils.io import OutputInUseError

    before = sorted(p.name for p in token_data.iterdir())
    with pytest.raises(OutputInUseError, match=r"holds token shards; writing a training run there would mix"):
        Trainer(train_config(token_data, token_data, train={"steps": 1}), resume="auto")
    assert sorted(p.name for p in token_data.iterdir()) == before  # nothing written, nothing removed
    (tmp_path / "qs").mkdir()
    (tmp_path / "qs" / MARKER).touch()
    with pytest.raises(OutputInUseError, match=r"qs: holds a quickstart's stages"):
        Trainer(train_config(token_data, tmp_path / "qs", train={"steps": 1}), resume="auto")


def test_resuming_with_a_length_before_the_checkpoint_is_refused_and_rewrites_nothing(token_data, tmp_path):
    """train.steps below the resumed step trained nothing, said "the run had already finished", and
    rewrote the run's config.yaml with the shorter length."""
    from marinlm.config import ConfigError

    run_training(train_config(token_data, tmp_path / "run", train={"steps": 4}))
    saved = (tmp_path / "run" / "config.yaml").read_text()
    with pytest.raises(
        ConfigError, match=r"^train.steps: 2 is before step 4, which the run resumes from .*step-00000004"
    ):
        Trainer(train_config(token_data, tmp_path / "run", train={"steps": 2}), resume="auto")
    assert (tmp_path / "run" / "config.yaml").read_text() == saved


def test_resume_into_another_model_or_optimizer_is_refused(token_data, tmp_path, capsys):
    """DCP loads only what the target asks for: a model with a layer fewer used to resume in silence."""
    run_training(train_config(token_data, tmp_path / "run", train={"steps": 4}))
    capsys.readouterr()
    cases = [
        (
            {"model": {"num_layers": 1}},
            r"entries only in the checkpoint, e\.g\. model\.layers\.1\..*model\.num_layers: 2 -> 1",
        ),
        ({"model": {"moe": {"expert_dim": 8}}}, r"model\.layers\.0\.mlp\.experts\.\w+ is \[.*\] in the checkpoint"),
        (
            {"optim": {"type": "adamw", "lr": 1e-3}},
            r"entries missing from it, e\.g\. optim\.state\..*exp_avg.*differs at optim\.type: 'marin' -> 'adamw'; ",
        ),
    ]
    for change, message in cases:
        with pytest.raises(CheckpointMismatch, match=message):
            Trainer(train_config(token_data, tmp_path / "run", train={"steps": 6}, **change), resume="auto")
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000004"]  # untouched
    # A setting that leaves every tensor's shape alone resumes, with a warning that names it.
    trainer = Trainer(
        train_config(token_data, tmp_path / "run", train={"steps": 6}, model={"attention": {"qk_mult": 2.0}}),
        resume="auto",
    )
    assert trainer.step == 4
    writer = trainer.sinks.tb
    trainer.close()  # a trainer never fit closes its sinks: its TensorBoard thread flushed into removed folders
    assert writer.all_writers is None and trainer.sinks.file.closed
    out = capsys.readouterr().out
    # Every change is named, the training loop's too (it used to be the first of model/optim/data only).
    assert (
        "resuming step-00000004 with changed settings: model.attention.qk_mult: 1.3 -> 2.0; train.steps: 4 -> 6" in out
    )


def test_a_key_newer_than_the_checkpoints_config_is_named_absent(token_data, tmp_path, capsys, monkeypatch):
    """The warning compared today's defaults for keys an older config.yaml lacks: a run from before
    data.shuffle_rows (rows drawn in sequence) read as `data.shuffle_rows: True -> False`."""
    import marinlm.train.checkpointing as resume_module  # where checkpoints are saved
    from marinlm.jobs import run_training
    from marinlm.train.trainer import Trainer

    written_before_the_key = resume_module.dump_config
    monkeypatch.setattr(
        resume_module, "dump_config", lambda c: written_before_the_key(c).replace("  shuffle_rows: true\n", "")
    )
    run_training(train_config(token_data, tmp_path / "run", train={"steps": 2}, checkpoint={"every_steps": 2}))
    monkeypatch.undo()
    capsys.readouterr()
    Trainer(train_config(token_data, tmp_path / "run", train={"steps": 2}), resume="auto")
    assert "resuming step-00000002 with changed setting: data.shuffle_rows: absent -> True\n" in capsys.readouterr().out


def test_a_corrupt_validation_split_is_an_error_and_a_missing_one_a_warning(token_data, tmp_path, capsys):
    """A corrupt val shard used to switch validation off with a log line."""
    import shutil

    from marinlm.dataset import ShardError
    from marinlm.dataset.tokenize import TokenizeConfig, tokenize

    copy = tmp_path / "tokens"
    shutil.copytree(token_data, copy)
    val_shard = next((copy / "val").glob("*.tokens"))
    with open(val_shard, "r+b") as f:
        f.truncate(val_shard.stat().st_size - 4)
    with pytest.raises(ShardError, match=rf"data\.sources\[0\]\.path: .*{val_shard.name}: .* truncated"):
        Trainer(train_config(copy, tmp_path / "run"), resume="none")
    with pytest.raises(ShardError, match=r"data\.sources\[0\]\.path: .*nowhere: no such folder"):
        Trainer(train_config(tmp_path / "nowhere", tmp_path / "run"), resume="none")
    assert not (tmp_path / "run").exists()  # a start that fails leaves no run folder (it held only a lock file)
    with pytest.raises(ShardError, match=r"nowhere: no such folder \(token shards are made by `marinlm tokenize`"):
        Trainer(train_config(tmp_path / "nowhere", tmp_path / "runs" / "tiny"), resume="none")
    assert not (tmp_path / "runs").exists()  # nor the parent folders it made for it
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    with pytest.raises(ShardError, match="no such folder"):
        Trainer(train_config(tmp_path / "nowhere", tmp_path / "kept"), resume="none")
    assert [p.name for p in (tmp_path / "kept").iterdir() if p.name != ".marinlm.lock"] == ["notes.txt"]
    manifest = json.loads((token_data / "manifest.json").read_text())
    no_val = tmp_path / "no-val"
    tokenize(
        TokenizeConfig(
            inputs=[s["path"] for s in manifest["sources"]],
            tokenizer=manifest["tokenizer"]["path"],
            output_dir=str(no_val),
            val_fraction=0.0,
            workers=1,
        ),
        progress=False,
    )
    trainer = Trainer(train_config(no_val, tmp_path / "run2", schedule={"warmup_steps": 20}), resume="none")
    assert trainer.val_sources == {} and trainer.validate() is None
    out = capsys.readouterr().out
    assert (
        "note: schedule.warmup_steps 20 is not shorter than the run's 8 steps (train.steps): the warmup is cut to 7 "
        "steps, so the learning rate rises all run, peaks at the last step and never decays"
    ) in out
    assert "split 'val' has no documents; validation is off" in out
    vocab = manifest["tokenizer"]["vocab_size"]  # the tiny model's 4,096 rows are too many: a note says so
    unused = 4096 - vocab
    assert (
        f"note: model.vocab_size 4,096 is larger than the tokenizer's {vocab:,}: {unused:,} rows of the embedding "
        f"and the output layer ({unused * 128 * 2 / 1e6:.2f}M parameters) are never used; set model.vocab_size={vocab}"
    ) in out
    trainer.close()
    # In a mixture, a source without one is left out of validation, and the others validate.
    mixture = {"sources": [{"path": str(no_val)}, {"path": str(token_data)}]}
    trainer = Trainer(train_config(no_val, tmp_path / "run3", data=mixture), resume="none")
    assert list(trainer.val_sources) == [token_data.name] and trainer.validate()["val/tokens"] > 0
    assert f"has no documents; validating on the others ({token_data.name})" in capsys.readouterr().out
    trainer.close()


def test_a_killed_jobs_half_written_save_is_cleaned_up(token_data, tmp_path):
    run_training(train_config(token_data, tmp_path / "run", train={"steps": 4}))
    stale = tmp_path / "run" / "checkpoints" / "step-00000006.tmp"  # killed mid-save, at a step never reached again
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"x" * 1000)
    run_training(train_config(token_data, tmp_path / "run", train={"steps": 8}))
    assert not stale.exists()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-00000004", "step-00000008"]


def test_malicious_checkpoint_metadata_is_refused(token_data, tmp_path):
    config = train_config(token_data, tmp_path / "run", train={"steps": 4})
    run_training(config)
    folder = list_checkpoints(tmp_path / "run" / "checkpoints")[0]

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    import pickle

    (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
    from marinlm.train.checkpoint import SafeFileSystemReader

    with pytest.raises(CheckpointError, match="not allowed"):
        SafeFileSystemReader(str(folder)).read_metadata()
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("async_save", [False, True])
def test_nan_steps_are_skipped_then_rolled_back(token_data, tmp_path, async_save):
    """Also with asynchronous saves: the roll-back completes the save in flight first (step 4's was
    still a .tmp folder at step 7, and the roll-back found no checkpoint)."""
    config = train_config(
        token_data,
        tmp_path / "run",
        train={"steps": 12, "max_consecutive_bad_steps": 2},
        checkpoint={"async_save": async_save},
    )
    trainer = Trainer(config, resume="none")
    poisoned = {3, 6, 7}

    def poison(module, args, output):  # each listed step's batch is bad once (as a real bad batch)
        if trainer.step + 1 in poisoned and output.ce_loss is not None:
            output.ce_loss = output.ce_loss * float("nan")
            poisoned.discard(trainer.step + 1)

    trainer.model.register_forward_hook(poison)
    params_before = {}

    def snapshot(result):
        if trainer.step == 2:
            params_before.update({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        if trainer.step == 3:
            for n, p in trainer.model.named_parameters():
                assert torch.equal(p, params_before[n]), f"{n} changed on a skipped step"

    trainer.add_hook(snapshot, every=1)
    summary = trainer.fit()
    kinds = [e["event"] for e in summary["events"]]
    assert kinds.count("nan_skip") == 3
    assert "rollback" in kinds
    rollback = next(e for e in summary["events"] if e["event"] == "rollback")
    assert rollback["step"] == 7 and rollback["to"].endswith("step-00000004")
    assert summary["steps"] == 12 and summary["final_loss"] == pytest.approx(summary["final_loss"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    # The redone steps are logged once (they were there twice: 1..7, 5, 6, 7, 8..12).
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "train/loss" in r] == list(range(1, 13))


def test_a_run_that_fails_again_after_each_rollback_stops_as_diverged(token_data, tmp_path):
    """A learning rate too high made every step after step 4 non-finite: the run rolled back to
    step 4 for ever (each time past other batches), and never ended."""
    import warnings

    from marinlm.train.signals import TrainingDiverged

    config = train_config(
        token_data, tmp_path / "run", train={"steps": 12, "max_consecutive_bad_steps": 2, "max_rollbacks": 2}
    )
    trainer = Trainer(config, resume="none")

    def poison(module, args, output):  # every step after the first checkpoint fails, whatever the batch
        if trainer.step >= 4 and output.ce_loss is not None:
            output.ce_loss = output.ce_loss * float("nan")

    trainer.model.register_forward_hook(poison)
    with pytest.raises(
        TrainingDiverged,
        match=r"^training diverged: 2 non-finite steps in a row at step 6, again after 2 rollback\(s\) in a row "
        r"\(the last to step-00000004\), .*\(train.max_rollbacks=2\); lower the learning rate \(optim.lr=0.02\) "
        r".*: --resume .*step-00000004$",
    ):
        trainer.fit()
    assert [e["event"] for e in trainer.state.events].count("rollback") == 2
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000004"]
    trainer.close()
    # Failing before the first checkpoint: the same error (it was a RuntimeError, a traceback in the CLI).
    trainer = Trainer(train_config(token_data, tmp_path / "early", train={"max_consecutive_bad_steps": 2}), "none")

    def poison_all(module, args, output):
        if output.ce_loss is not None:
            output.ce_loss = output.ce_loss * float("nan")

    trainer.model.register_forward_hook(poison_all)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TrainingDiverged, match=r"at step 2, and no checkpoint to roll back to; lower the learn"):
            trainer.fit()
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]  # torch's, on skipped first steps
    trainer.close()


def test_a_run_that_fails_keeps_its_asynchronous_save(token_data, tmp_path):
    """Step 4's asynchronous save was written in full but never renamed into place when the run
    failed at step 6, so a resume went back to the start."""
    config = train_config(token_data, tmp_path / "run", checkpoint={"async_save": True})
    trainer = Trainer(config, resume="none")

    def fail(result):
        if trainer.step == 6:
            raise OSError("the data disk went away")

    trainer.add_hook(fail, every=1)
    with pytest.raises(OSError, match="the data disk went away"):
        trainer.fit()
    trainer.close()
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000004"]
    validate(tmp_path / "run" / "checkpoints" / "step-00000004")


@pytest.mark.parametrize("chunk", [16, 0])
def test_validation_scores_through_the_fused_head_without_the_logits(chunk):
    from marinlm.train.step import validate as validate_loss

    from conftest import build, randomize_identity_inits, tiny_config

    model = build(tiny_config(), loss_chunk_tokens=chunk)
    randomize_identity_inits(model)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, model.config.vocab_size, (3, 40), generator=g)
        labels = ids.roll(-1, dims=1)
        labels[:, -1] = -100
        labels[0, 10:25] = -100  # masked positions, padding rows: not counted
        labels[2] = -100
        segments = (torch.arange(40) >= 17).long().expand(3, 40)  # two packed documents a row
        batches.append(
            {
                "input_ids": ids,
                "segment_ids": segments,
                "labels": labels,
                "byte_weights": torch.rand(3, 40, generator=g),
            }
        )
    nats = tokens = num_bytes = 0.0
    model.eval()  # no capacity drops
    with torch.no_grad():
        for b in batches:
            logp = torch.log_softmax(model(b["input_ids"], b["segment_ids"]).logits.double(), -1)
            kept = b["labels"] != -100
            nats -= logp.gather(-1, b["labels"].clamp_min(0).unsqueeze(-1)).squeeze(-1)[kept].sum().item()
            tokens += kept.sum().item()
            num_bytes += b["byte_weights"].double().sum().item()

    if chunk:  # the LM head's weight is read by the fused loss; the module itself never runs

        def no_logits(h):
            raise AssertionError("validation built the [B, T, V] logits")

        model.lm_head.forward = no_logits
    model.train()
    metrics = validate_loss(model, batches, device=torch.device("cpu"), precision="fp32")
    assert model.training
    assert metrics["val/tokens"] == tokens == 2 * (39 - 15 + 39)
    assert metrics["val/loss"] == pytest.approx(nats / tokens, rel=1e-5)
    assert metrics["val/bpb"] == pytest.approx(nats / (math.log(2) * num_bytes), rel=1e-5)


def test_gradient_accumulation_matches_one_big_batch(token_data, tmp_path):
    # Dropless: expert capacity is per forward, so with a capacity micro-batching changes the drops.
    dropless = {"moe": {"capacity_factor": None}}
    one = run_training(train_config(token_data, tmp_path / "one", train={"steps": 3}, model=dropless), resume="none")
    acc = run_training(
        train_config(token_data, tmp_path / "acc", train={"steps": 3, "micro_batch": 1}, model=dropless),
        resume="none",
    )
    a, b = losses(tmp_path / "one"), losses(tmp_path / "acc")
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=2e-5), step
    assert one["steps"] == acc["steps"] == 3


def test_run_outputs_and_router_state(token_data, tmp_path, capsys):
    config = train_config(
        token_data,
        tmp_path / "run",
        train={"steps": 4},
        profile={"start_step": 1, "num_steps": 2},
        logging={"activations_every": 2},
    )
    summary = run_training(config, resume="none")
    [trace] = (tmp_path / "run" / "profile").glob("*.pt.trace.json")  # the profiler's, named where it is
    assert f"profile: {trace} (open it in https://ui.perfetto.dev" in capsys.readouterr().out
    record = read_metrics(tmp_path / "run")
    keys = set().union(*record)
    for key in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/param_norm",
        "perf/tokens_per_s",
        "perf/mfu",
        "perf/data_wait_s",
        "mem/rss_gb",
        "router/layer_0/entropy",
        "router/layer_0/dropped_fraction",
        "router/layer_0/beta_std",
        "val/loss",
        "val/bpb",
    ):
        assert key in keys, key
    # Activation statistics on every second step only, for each layer's residual stream and branches.
    acts = {r["step"]: r for r in record if "act/layer_0/residual_rms" in r}
    assert sorted(acts) == [2, 4]
    for i in range(config.model.num_layers):
        for kind in ("residual", "attn", "mlp"):
            assert 0 < acts[2][f"act/layer_{i}/{kind}_rms"] <= acts[2][f"act/layer_{i}/{kind}_max_abs"]
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["packages"]["torch"].startswith("2.13") and info["data"][0]["manifest_sha256"]
    assert (tmp_path / "run" / "config.yaml").exists() and (tmp_path / "run" / "tokenizer" / "tokenizer.json").exists()
    assert list((tmp_path / "run" / "tensorboard").glob("events.*"))
    assert summary["validation"]["val/bpb"] > 0
    assert summary["median_tokens_per_s"] > 0 and 0 < summary["median_mfu"] < 1
    assert summary["loss_plot"] == str(tmp_path / "run" / "loss.png")
    assert (tmp_path / "run" / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # The QB bias computed at the last step is in the checkpoint, ready for the next step.
    trainer = Trainer(train_config(token_data, tmp_path / "run", train={"steps": 5}), resume="auto")
    bias = trainer.model.layers[0].mlp.router.bias
    assert trainer.step == 4 and bias.abs().sum() > 0
    assert info["data"][0]["epochs"] == pytest.approx(4 * 4 / trainer.loader.sources[0].rows_per_epoch)  # 4 x 4 rows


def test_a_resumed_runs_summary_times_its_own_steps(token_data, tmp_path, capsys):
    """The medians printed after a resume describe the steps just run, not a mix with the run's
    earlier steps, which may have run on other hardware or another number of processes."""
    run_training(train_config(token_data, tmp_path / "run", train={"steps": 4}))
    metrics = tmp_path / "run" / "metrics.jsonl"
    earlier = [json.loads(line) for line in metrics.read_text().splitlines()]
    for record in earlier:  # as if the first 4 steps had run on a much faster machine
        if "perf/tokens_per_s" in record:
            record["perf/tokens_per_s"], record["perf/mfu"] = 1e12, 0.99
    metrics.write_text("".join(json.dumps(r) + "\n" for r in earlier))
    capsys.readouterr()
    from marinlm.cli import main

    config = tmp_path / "resume.yaml"
    save_config(train_config(token_data, tmp_path / "run", train={"steps": 8}), config)
    assert main(["train", str(config)]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["first_step"], summary["steps"]) == (4, 8)
    assert 0 < summary["median_tokens_per_s"] < 1e9 and summary["median_mfu"] < 0.9
    assert "done: step 8 (4 from step 4) in " in out


def test_a_long_runs_mfu_is_against_the_higher_of_the_peaks_measured_at_its_start_and_end(
    token_data, tmp_path, monkeypatch
):
    """A start-up measurement on a busy host understates the peak (and overstates MFU): a run that
    lasts (here: any run, the threshold set to 0) measures again at its end and keeps the higher."""
    import marinlm.train.trainer as trainer_module

    peaks = iter([50e9, 200e9])  # the start's, then the end's
    calls = []
    monkeypatch.setattr(trainer_module, "matmul_peak_flops", lambda *a, **k: calls.append(a) or next(peaks))
    monkeypatch.setattr(trainer_module, "REMEASURE_PEAK_AFTER_S", 0.0)
    measured = {"every_steps": 1, "progress": False, "peak_flops": 0.0}
    trainer = Trainer(train_config(token_data, tmp_path / "run", train={"steps": 3}, logging=measured))
    summary = trainer.fit()
    assert len(calls) == 2 and summary["peak_flops"] == 200e9
    want = trainer.flops_per_token * summary["median_tokens_per_s"] / 200e9
    assert summary["median_mfu"] == pytest.approx(want)
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["median_mfu"] == pytest.approx(want) and saved["peak_flops"] == 200e9
    assert saved["peak_dtype"] == "fp32" and calls[0][0] == torch.float32  # an fp32 run's peak
    # The logged per-step MFU is live, against the start's peak: 4x the summary's here.
    logged = [r for r in read_metrics(tmp_path / "run") if "perf/mfu" in r]
    assert logged and all(
        r["perf/mfu"] == pytest.approx(trainer.flops_per_token * r["perf/tokens_per_s"] / 50e9) for r in logged
    )
    # A short run (under REMEASURE_PEAK_AFTER_S) measures once.
    monkeypatch.setattr(trainer_module, "REMEASURE_PEAK_AFTER_S", 3600.0)
    calls.clear()
    peaks = iter([50e9, 200e9])
    summary = Trainer(train_config(token_data, tmp_path / "short", train={"steps": 2}, logging=measured)).fit()
    assert len(calls) == 1 and summary["peak_flops"] == 50e9
    calls.clear()  # a given peak is used as it is
    given = {**measured, "peak_flops": 1e12}
    summary = Trainer(train_config(token_data, tmp_path / "given", train={"steps": 2}, logging=given)).fit()
    assert not calls and summary["peak_flops"] == 1e12 and summary["peak_source"] == "given"


@pytest.mark.parametrize("optim", ["marin", "adamw"])
def test_a_fresh_run_trains_alike_with_resume_auto_or_none(token_data, tmp_path, optim):
    """`--resume auto` with nothing to resume used to call get_state_dict() on the empty optimizer,
    which steps it once at lr 0: Adam's first real step then ran as step 2 (bias correction)."""
    runs = {}
    for resume in ("auto", "none"):
        config = train_config(token_data, tmp_path / resume, train={"steps": 3}, optim={"type": optim})
        trainer = Trainer(config, resume=resume)
        assert not trainer.optimizer.state
        trainer.fit()
        trainer.close()
        runs[resume] = losses(tmp_path / resume)
    assert runs["auto"] == runs["none"]  # bitwise


def test_continued_training_starts_from_another_runs_weights(token_data, tmp_path, capsys, monkeypatch):
    import marinlm.train.checkpoint as checkpoint_module
    from marinlm.loading import load_model

    run_training(train_config(token_data, tmp_path / "base", train={"steps": 4}), resume="none")
    hashed = []
    real_sha256 = checkpoint_module.sha256_file
    monkeypatch.setattr(checkpoint_module, "sha256_file", lambda path: hashed.append(path) or real_sha256(path))
    base = load_model(tmp_path / "base").model.state_dict()
    assert hashed and len(hashed) == len(set(hashed))  # each checkpoint file hashed once, not twice
    monkeypatch.undo()
    later = {"checkpoint": {"init_from": str(tmp_path / "base")}, "optim": {"lr": 0.01}}
    trainer = Trainer(train_config(token_data, tmp_path / "next", **later), resume="auto")
    # Fresh optimizer, schedule and data position.
    assert trainer.step == 0 and trainer.loader.rows_consumed == 0 and not trainer.optimizer.state
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, base[name]), name  # QB biases included
    trainer.fit()
    trainer.close()
    assert "model initialised from" in capsys.readouterr().out
    info = json.loads((tmp_path / "next" / "run_info.json").read_text())
    assert info["initialized_from"].endswith("step-00000004")
    # Its own checkpoints win from then on; another model's weights are refused.
    Trainer(train_config(token_data, tmp_path / "next", train={"steps": 9}, **later), resume="auto").close()
    assert "init_from is not used" in capsys.readouterr().out
    with pytest.raises(
        CheckpointMismatch,
        match=r"init_from: not a checkpoint of this model: .*; its config.yaml differs at model\.num_layers: 2 -> 3; "
        r"to train the checkpoint's own model, add --model=.*step-00000004/config\.yaml$",
    ):
        Trainer(train_config(token_data, tmp_path / "other", model={"num_layers": 3}, **later), resume="auto")


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_two_processes_match_one(token_data, tmp_path, capsys):
    """FSDP2 over 2 gloo processes vs 1 process (this one) on the same global batch: losses agree
    to 1e-9 (fp64)."""
    # Dropless: with a capacity factor each rank's capacity covers its own half of the tokens, so
    # drops (and losses) legitimately differ from one process; without it the two must agree.
    # The LM head and loss run fused and chunked, as in the hero preset, so the unsharded head
    # weight's gradient from model/loss.py goes through FSDP's reduce-scatter too.
    model, kernels = {"moe": {"capacity_factor": None}}, {"loss_chunk_tokens": 64}
    for name in ("single", "fsdp"):
        # fp64 (Newton-Schulz too): in fp32 an expert choice that flips on a near tie (step 6 here)
        # moves the loss by 3e-4, which says nothing about FSDP
        train = {"steps": 4, "precision": "fp64"}
        optim = {"ns_dtype": "float64"}
        config = train_config(token_data, tmp_path / name, train=train, model=model, kernels=kernels, optim=optim)
        save_config(config, tmp_path / f"{name}.yaml")
    run_training(config_at(tmp_path / "single.yaml"), resume="none")
    torchrun_train(tmp_path / "fsdp.yaml")
    a, b = losses(tmp_path / "single"), losses(tmp_path / "fsdp")
    assert len(a) == len(b) == 4
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-9), (step, a[step], b[step])
    ckpt = list_checkpoints(tmp_path / "fsdp" / "checkpoints")[0]
    assert {p.name for p in ckpt.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}  # sharded save
    # The two ranks hashed half the files each; the listing has them all (the resume below checks them).
    listed = json.loads((ckpt / "COMPLETE.json").read_text())["files"]
    on_disk = [str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "COMPLETE.json"]
    assert sorted(listed) == sorted(on_disk)
    # The 2-process run goes on in 1 process (DCP reshards; the data position is global), and stays
    # with the 1-process run carried on alike.
    capsys.readouterr()
    for name in ("single", "fsdp"):
        run_training(config_at(tmp_path / f"{name}.yaml", "--train.steps=6"), resume="auto")
    assert "(saved by 2 processes, resharded onto 1)" in capsys.readouterr().out
    a, b = losses(tmp_path / "single"), losses(tmp_path / "fsdp")
    assert len(a) == len(b) == 6
    for step in (5, 6):
        assert a[step] == pytest.approx(b[step], rel=1e-9), (step, a[step], b[step])


@pytest.mark.parametrize("mode", ["full", "every_n"])
def test_activation_checkpointing_gives_the_same_losses(token_data, tmp_path, mode):
    """...and the same activation statistics, although checkpointed blocks run forward twice."""
    log = {"activations_every": 1}
    base = run_training(train_config(token_data, tmp_path / "none", train={"steps": 2}, logging=log), resume="none")
    ac = run_training(
        train_config(
            token_data,
            tmp_path / mode,
            train={"steps": 2},
            parallel={"activation_checkpointing": mode, "checkpoint_every_n": 2},
            logging=log,
        ),
        resume="none",
    )
    a, b = losses(tmp_path / "none"), losses(tmp_path / mode)
    assert a == pytest.approx(b, rel=1e-5) and base["steps"] == ac["steps"]
    acts = [
        {f"{r['step']}:{k}": v for r in read_metrics(run) for k, v in r.items() if k.startswith("act/")}
        for run in (tmp_path / "none", tmp_path / mode)
    ]
    assert acts[0] and acts[0].keys() == acts[1].keys()
    for key, value in acts[0].items():
        assert acts[1][key] == pytest.approx(value, rel=1e-5), key


def test_bf16_async_checkpoint_and_wandb_offline(token_data, tmp_path, monkeypatch, capsys):
    from marinlm.utils.device import emulated_bf16

    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = train_config(
        token_data,
        tmp_path / "run",
        train={"steps": 2, "precision": "bf16"},
        checkpoint={"every_steps": 1, "async_save": True},
        logging={"wandb": True, "wandb_mode": "offline"},
    )
    summary = run_training(config, resume="none")
    assert all(math.isfinite(v) for v in losses(tmp_path / "run").values())
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000002", "step-00000001"]
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert summary["steps"] == 2
    # Where bf16 matmuls are emulated, the run says that fp32 is the faster choice.
    assert ("no bf16 matrix unit" in capsys.readouterr().out) == emulated_bf16("cpu")


def test_a_run_lengthened_mid_run_keeps_its_warmup_and_bends_its_decay(token_data, tmp_path):
    """`Trainer.set_total_steps` (the quickstart's re-plan): from 8 planned steps to 12 at step 3."""
    from marinlm.optim import ScheduleConfig, lr_multiplier

    config = train_config(token_data, tmp_path / "run", schedule={"warmup_fraction": 0.25})  # 2 of 8 steps
    trainer = Trainer(config, resume="none")
    next_lr = []

    def lengthen(result):
        if trainer.step == 3:
            trainer.set_total_steps(12)
            next_lr.append(trainer.optimizer.param_groups[0]["lr"])

    trainer.add_hook(lengthen, every=1)
    summary = trainer.fit()
    trainer.close()
    assert summary["steps"] == 12 and not summary["stopped_early"]
    with pytest.raises(ValueError, match="train.steps: the run is at step 12"):
        trainer.set_total_steps(12)
    lrs = {r["step"]: r["train/lr"] for r in read_metrics(tmp_path / "run") if "train/lr" in r}
    assert sorted(lrs) == list(range(1, 13))
    schedule = load_config(TrainConfig, tmp_path / "run" / "config.yaml").schedule
    assert schedule.warmup_steps == 2  # as 25% of 8 gave; 25% of 12 would be 3
    # Past warmup the linear decay bends where the run is: at 0-based step 3, at the multiplier
    # the 8-step plan gave it, then linearly to the floor at step 11.
    planned = ScheduleConfig(warmup_fraction=0.25)
    assert schedule.replan_step == 3 and schedule.replan_lr_ratio == pytest.approx(lr_multiplier(3, 8, planned))
    base = trainer.scheduler.base_lrs[0]
    # The lr logged at a step is the next step's; step 3's was logged before the change, which
    # also sets the next step's: the same lr, no jump.
    for step, lr in lrs.items():
        assert lr == pytest.approx(base * lr_multiplier(step, 8 if step <= 3 else 12, schedule), rel=1e-6), step
        if step <= 3:
            assert lr == pytest.approx(base * lr_multiplier(step, 8, planned), rel=1e-6), step
    assert next_lr == [pytest.approx(lrs[3], rel=1e-6)]
    decay = [lrs[step] for step in range(3, 12)]
    assert all(b < a for a, b in zip(decay, decay[1:]))
    assert lrs[11] == pytest.approx(base * schedule.min_lr_ratio, rel=1e-6)
    assert decay[1] - decay[2] == pytest.approx(decay[-2] - decay[-1], rel=1e-6)  # linear from the bend
    saved = load_config(TrainConfig, tmp_path / "run" / "checkpoints" / "step-00000012" / "config.yaml")
    assert saved.train.steps == 12 and saved.schedule.warmup_steps == 2 and saved.schedule.replan_step == 3


def test_a_run_shortened_mid_run_ends_its_schedule_at_the_new_length(token_data, tmp_path):
    """The quickstart's later re-plans shorten a run whose host slowed: from 12 planned steps to 6
    at step 4, the learning rate still decays to its floor, and the last checkpoint is step 6."""
    from marinlm.optim import lr_multiplier

    config = train_config(
        token_data, tmp_path / "run", train={"steps": 12}, schedule={"warmup_fraction": 0.25}
    )  # warmup 3 of 12 steps
    trainer = Trainer(config, resume="none")

    def shorten(result):
        if trainer.step == 4:
            trainer.set_total_steps(6)

    trainer.add_hook(shorten, every=1)
    summary = trainer.fit()
    trainer.close()
    assert summary["steps"] == 6 and not summary["stopped_early"]
    lrs = {r["step"]: r["train/lr"] for r in read_metrics(tmp_path / "run") if "train/lr" in r}
    assert sorted(lrs) == list(range(1, 7))
    base, schedule = trainer.scheduler.base_lrs[0], trainer.config.schedule
    assert schedule.warmup_steps == 3
    # The lr logged at a step is the next step's; step 4's was logged before the change. The last
    # step (0-based 5, logged at step 5) runs at the schedule's floor, as a run planned at 6 steps.
    assert lrs[4] == pytest.approx(base * lr_multiplier(4, 12, schedule), rel=1e-6)
    assert lrs[5] == pytest.approx(base * schedule.min_lr_ratio, rel=1e-6)
    assert [p.name for p in sorted((tmp_path / "run" / "checkpoints").glob("step-*"))][-1] == "step-00000006"


@pytest.mark.slow
def test_compiled_blocks_train_20_steps_without_recompiling(token_data, tmp_path):
    """`parallel.compile` for 20 bf16 steps of `tiny` (all four layers; block 0 checkpointed and
    compiled with its checkpoint, blocks 1-3 compiled without) on packed rows whose documents differ
    from step to step: no graph is compiled after step 2 (the metric counts torch._dynamo's compiled
    graphs), and the losses are eager's within bf16 tolerance: the first step's to 1%, and the run
    no farther from eager's than bf16 rounding moves a run (eager fp32 against eager bf16; 20 steps
    at lr 0.02 amplify any rounding difference to several percent)."""
    import torch._dynamo

    torch._dynamo.reset()
    every_4th = {"checkpoint_every_n": 4}  # block 0, which fills the forward's memo inside its checkpoint
    common = dict(
        model=to_dict(tiny_config(max_seq_len=64, attention={"sliding_window": 16})),
        checkpoint={"every_steps": 0},
        validation={"every_steps": 0},
    )
    for name, precision, compile in (("fp32", "fp32", False), ("eager", "bf16", False), ("compiled", "bf16", True)):
        config = train_config(
            token_data,
            tmp_path / name,
            train={"steps": 20, "precision": precision},
            parallel={"compile": compile, "activation_checkpointing": "every_n" if compile else "none", **every_4th},
            **common,
        )
        run_training(config, resume="none")
    graphs = {r["step"]: r["compile/graphs"] for r in read_metrics(tmp_path / "compiled") if "compile/graphs" in r}
    assert sorted(graphs) == list(range(1, 21)) and graphs[1] > 0
    assert graphs[20] == graphs[2], graphs
    fp32, eager, compiled = (losses(tmp_path / name) for name in ("fp32", "eager", "compiled"))
    assert sorted(compiled) == sorted(eager) == list(range(1, 21))

    def farthest(run):
        return max(abs(run[s] - eager[s]) / eager[s] for s in eager)

    assert compiled[1] == pytest.approx(eager[1], rel=1e-2)
    assert farthest(compiled) <= farthest(fp32), (compiled, eager, fp32)
    # Validation at the end runs the compiled blocks without grad (new graphs) and agrees too.
    val = [[r["val/loss"] for r in read_metrics(tmp_path / run) if "val/loss" in r] for run in ("eager", "compiled")]
    assert len(val[0]) == 1 and val[1] == pytest.approx(val[0], rel=0.1)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_options_zero2_sharded_init(token_data, tmp_path):
    """ZeRO-2-like resharding, init on shards and activation checkpointing, under 2 gloo processes.

    (CPU offload needs a GPU: on CPU it is refused with the key named.)"""
    with pytest.raises(ValueError, match="parallel.offload: all"):
        Trainer(train_config(token_data, tmp_path / "off", parallel={"offload": "all"}), resume="none")
    config = train_config(
        token_data,
        tmp_path / "run",
        train={"steps": 3, "init": "sharded"},
        parallel={"reshard_after_forward": False, "activation_checkpointing": "full"},
    )
    save_config(config, tmp_path / "run.yaml")
    torchrun_train(tmp_path / "run.yaml")
    values = losses(tmp_path / "run")
    assert len(values) == 3 and all(math.isfinite(v) for v in values.values())
    assert values[3] < values[1]


def test_a_model_that_cannot_fit_is_refused_before_allocating(token_data, tmp_path, monkeypatch):
    """`--model=configs/model/marin-535b-a23b.yaml` on one machine allocated until the out-of-memory
    killer came; now the weights, gradients and optimizer state are counted first."""
    import marinlm.train.provenance as provenance
    from marinlm.config import ConfigError
    from marinlm.model import MarinConfig

    from conftest import CONFIGS

    hero = load_config(MarinConfig, CONFIGS / "model" / "marin-535b-a23b.yaml")
    with pytest.raises(
        ConfigError, match=r"train\.memory_check: the model's 535\.48B parameters need at least 6,425\.7 GB"
    ):
        Trainer(train_config(token_data, tmp_path / "hero", model=to_dict(hero)), resume="none")
    monkeypatch.setattr(provenance, "available_memory", lambda device: 1_000_000)  # 1 MB free
    with pytest.raises(ConfigError, match=r"over 1 process\(es\)\), and cpu has 0\.0 GB available"):
        Trainer(train_config(token_data, tmp_path / "run"), resume="none")
    trainer = Trainer(train_config(token_data, tmp_path / "run", train={"memory_check": False}), resume="none")
    assert trainer.step == 0


def _dcp_failing_with(error):
    """A stand-in for dcp.save that writes part of a shard, then fails as DCP does on every rank."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    def save(state, checkpoint_id):
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"\0" * 4096)
        raise CheckpointException("write failed", {0: (error, traceback.StackSummary())})

    return save


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_that_fails_removes_its_partial_folder_and_says_why(tmp_path, monkeypatch, async_save):
    """A full disk while writing used to end training with DCP's traceback ('unexpected pos 704 vs
    598') and leave the half-written `.tmp` folder filling the disk."""
    import errno
    from concurrent.futures import Future

    import marinlm.train.checkpoint as ck

    manager = CheckpointManager(tmp_path / "ckpts", keep_last=2, async_save=async_save)
    state = {"model": {"w": torch.arange(10.0)}}
    manager.save(1, state, {"step": 1}, "x: 1\n")
    manager.finalize()
    full = OSError(errno.ENOSPC, "No space left on device", "/run/ckpts/__0_0.distcp")
    failing = _dcp_failing_with(full)
    monkeypatch.setattr(ck.dcp, "save", failing)

    def async_failing(state, checkpoint_id):
        future = Future()
        try:
            failing(state, checkpoint_id)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            future.set_exception(e)
        return future

    monkeypatch.setattr(ck.dcp, "async_save", async_failing)
    monkeypatch.setattr(ck, "free_bytes", lambda path: 3 << 20 if "ckpts" in str(path) else 0)
    with pytest.raises(ck.CheckpointWriteError) as caught:
        manager.save(2, state, {"step": 2}, "x: 1\n")
        manager.finalize()  # an asynchronous save fails when it is completed
    message = str(caught.value)
    assert "step-00000002.tmp: checkpoint at step 2 could not be written" in message
    assert "(rank 0: /run/ckpts/__0_0.distcp: No space left on device)" in message
    assert "3.1 MB were free when it failed: the disk is full" in message
    assert f"newest good checkpoint is {tmp_path / 'ckpts' / 'step-00000001'}" in message
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["step-00000001"]
    validate(tmp_path / "ckpts" / "step-00000001")


def test_a_save_without_room_writes_nothing(tmp_path, monkeypatch):
    import marinlm.train.checkpoint as ck

    manager = CheckpointManager(tmp_path / "ckpts")
    monkeypatch.setattr(ck, "free_bytes", lambda path: 500_000)
    with pytest.raises(
        ck.CheckpointWriteError,
        match=r"step 1 needs about 5\.0 MB and the disk has 0\.5 MB free; nothing was written\. The run has no",
    ):
        manager.save(1, {"model": {"w": torch.zeros(1_000_000)}}, {"step": 1}, "x: 1\n")
    assert not (tmp_path / "ckpts").exists()


@pytest.mark.parametrize(
    ("step", "last", "every", "keep_last", "existing", "need_mb", "keep_every", "minutes"),
    [
        (0, 30, 10, 2, 0, 30, 0, 0),  # saves at 10, 20, 30: two finished + one in flight, 10 MB each
        (0, 30, 10, 1, 0, 20, 0, 0),  # one finished + one in flight
        (0, 30, 0, 3, 0, 10, 0, 0),  # only the final save
        (20, 35, 10, 3, 0, 20, 0, 0),  # resumed at 20: saves at 30 and at the end, 35
        (0, 30, 10, 3, 2, 20, 0, 0),  # two there already: a third finished one + one in flight
        (0, 30, 10, 2, 2, 10, 0, 0),  # two there, keep_last 2: one in flight, then the oldest goes
        (30, 30, 10, 3, 0, 0, 0, 0),  # nothing left to train: nothing to save
        (0, 30, 10, 1, 0, 30, 10, 0),  # 10 and 20 are permanent: both stay while 30 is written
        (0, 30, 10, 3, 0, 40, 0, 5),  # timed saves may come at any step: keep_last 3 fill up
        (0, 30, 10, 1, 0, 40, 10, 5),  # ...and the permanent 10 and 20 stay beside the newest
        (20, 40, 10, 1, 2, 10, 20, 0),  # step 0 there is permanent, step 1 goes at the first save
    ],
)
def test_the_room_a_run_needs_for_its_checkpoints(
    tmp_path, monkeypatch, step, last, every, keep_last, existing, need_mb, keep_every, minutes
):
    import marinlm.train.checkpoint as ck
    from marinlm.config import ConfigError

    root = tmp_path / "ckpts"
    for n in range(existing):  # earlier checkpoints of 10 MB each (sparse files)
        folder = root / f"step-{n:08d}"
        folder.mkdir(parents=True)
        with open(folder / "__0_0.distcp", "wb") as f:
            f.truncate(10_000_000)
    manager = CheckpointManager(root, keep_last=keep_last, keep_every=keep_every)
    estimate = 10_000_000 - (1 << 20)  # the check adds a megabyte for the small files
    monkeypatch.setattr(ck, "free_bytes", lambda path: need_mb * 1_000_000)
    manager.check_room_for_run(step, last, every, estimate, every_minutes=minutes)  # exactly enough
    if need_mb:  # a megabyte less is refused, with both numbers
        monkeypatch.setattr(ck, "free_bytes", lambda path: (need_mb - 1) * 1_000_000)
        message = rf"checkpoint\.space_check: .* need about {need_mb}\.0 MB more .* has {need_mb - 1}\.0 MB free"
        with pytest.raises(ConfigError, match=message):
            manager.check_room_for_run(step, last, every, estimate, every_minutes=minutes)


def test_timed_and_permanent_checkpoints(token_data, tmp_path):
    """A long run saves every checkpoint.every_minutes as well (the hero saved hourly) and keeps the
    ones at multiples of keep_every_steps (every 6,000 steps) past keep_last."""
    from marinlm.config import ConfigError

    def saved_at(summary):
        return [e["step"] for e in summary["events"] if e["event"] == "checkpoint"]

    def on_disk(run):
        return [p.name for p in list_checkpoints(run / "checkpoints")]

    checkpoint = {"every_steps": 4, "keep_last": 1, "keep_every_steps": 4}
    # A save is due after every step: each one saves, and pruning keeps the newest and step 4.
    timed = run_training(
        train_config(token_data, tmp_path / "timed", checkpoint={**checkpoint, "every_minutes": 1e-9}), resume="none"
    )
    assert saved_at(timed) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert on_disk(tmp_path / "timed") == ["step-00000008", "step-00000004"]
    # Not yet due: only the step-based saves.
    hourly = run_training(
        train_config(token_data, tmp_path / "hourly", checkpoint={**checkpoint, "every_minutes": 60}), resume="none"
    )
    assert saved_at(hourly) == [4, 8]
    # The run carries on from the newest one, timed or not.
    again = run_training(train_config(token_data, tmp_path / "timed", train={"steps": 9}), resume="auto")
    assert again["steps"] == 9
    with pytest.raises(ConfigError, match=r"keep_every_steps: must be a multiple of every_steps \(4\)"):
        train_config(token_data, tmp_path / "x", checkpoint={"every_steps": 4, "keep_every_steps": 6})


def test_a_run_whose_checkpoints_cannot_fit_is_refused_before_training(token_data, tmp_path, monkeypatch):
    import marinlm.train.checkpoint as ck
    from marinlm.config import ConfigError

    monkeypatch.setattr(ck, "free_bytes", lambda path: 1_000_000)  # 1 MB
    with pytest.raises(ConfigError, match=r"checkpoint\.space_check: .* \(2 x [\d.]+ MB, with checkpoint\.keep_last=3"):
        Trainer(train_config(token_data, tmp_path / "run"), resume="none")
    # The disk fills up after the start: the save that finds no room writes nothing.
    monkeypatch.setattr(ck, "free_bytes", lambda path: 10**12)
    trainer = Trainer(train_config(token_data, tmp_path / "run2"), resume="none")
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1_000_000)
    with pytest.raises(ck.CheckpointWriteError, match=r"checkpoint at step 4 needs about .* 1\.0 MB free; nothing"):
        trainer.fit()
    trainer.close()
    assert not list_checkpoints(tmp_path / "run2" / "checkpoints")
    assert not list((tmp_path / "run2" / "checkpoints").glob("*.tmp"))
    # A filesystem whose free space reads wrong (some FUSE mounts): checkpoint.space_check=false.
    trainer = Trainer(train_config(token_data, tmp_path / "run3", checkpoint={"space_check": False}), resume="none")
    trainer.fit()
    trainer.close()
    assert [p.name for p in list_checkpoints(tmp_path / "run3" / "checkpoints")] == ["step-00000008", "step-00000004"]


def run_on_two_ranks(fn, args: tuple, timeout: float, hang: str) -> None:
    """Spawn `fn(rank, port, *args)` on 2 processes (`port` free for their gloo group); fail the test
    with `hang` if they have not all ended within `timeout` seconds."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = spawn_ranks(fn, (port, *args), 2, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(hang)


def _save_on_two_ranks(rank: int, port: int, root: str, failing_rank: int) -> None:
    """One rank of a 2-process gloo save in which `failing_rank` cannot write its RNG file."""
    import errno

    import torch.distributed as dist

    import marinlm.train.checkpoint as ck

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == failing_rank:
            real = torch.save

            def full_disk(obj, f, *args, **kwargs):
                if "rng" in str(f):
                    raise OSError(errno.ENOSPC, "No space left on device", str(f))
                return real(obj, f, *args, **kwargs)

            torch.save = full_disk
        manager = ck.CheckpointManager(Path(root) / "ckpts", rank=rank, world_size=2)
        try:
            manager.save(1, {"model": {"w": torch.arange(4.0) + rank}}, {"step": 1}, "x: 1\n")
        except ck.CheckpointWriteError as e:
            (Path(root) / f"error-{rank}.txt").write_text(str(e))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_rank_that_cannot_write_fails_every_rank_instead_of_hanging(tmp_path, failing_rank):
    """A rank whose small files failed (a full disk) raised alone, and the others waited forever in
    DCP's collectives."""
    run_on_two_ranks(
        _save_on_two_ranks,
        (str(tmp_path), failing_rank),
        timeout=120,
        hang="a rank hung after another failed to write its checkpoint files",
    )
    for rank in (0, 1):
        message = (tmp_path / f"error-{rank}.txt").read_text()
        assert f"rank-{failing_rank:05d}.pt: No space left on device" in message
    assert list((tmp_path / "ckpts").iterdir()) == []  # the partial folder is gone


def test_the_mixture_changes_at_its_phase_step(token_data, tmp_path, capsys):
    """data.mixture_phases start at optimizer steps, whatever the micro-batching: here a step is two
    micro-batches of 2 rows, and from step 2 on only the second source is drawn. The run says so,
    and logs each source's share of the rows and the passes read over it."""
    config = train_config(
        token_data,
        tmp_path / "run",
        data={
            "sources": [{"path": str(token_data)}, {"path": str(token_data)}],
            "mixture_phases": [{"start_step": 2, "weights": [0, 1]}],
        },
        train={"steps": 4, "micro_batch": 2},
        logging={"every_steps": 1},
    )
    trainer = Trainer(config, resume="none")
    summary = trainer.fit()
    trainer.close()
    assert trainer.loader.state_dict()["counts"] == [4, 12]  # 1:1 over steps 0-1, then 0:1
    a, b = source_names(config.data)
    said = f"[step 2] data: the mixture of data.mixture_phases[0] from here on: {a} 0%, {b} 100%"
    assert said in capsys.readouterr().out
    assert [e for e in summary["events"] if e["event"] == "mixture_phase"] == [
        {"step": 2, "event": "mixture_phase", "phase": 1, "weights": [0.0, 1.0]}
    ]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    shares = [(m[f"data/{a}/share"], m[f"data/{b}/share"]) for m in logged if f"data/{a}/share" in m]
    assert shares == [(0.5, 0.5), (0.5, 0.5), (0.0, 1.0), (0.0, 1.0)]
    rows = trainer.loader.sources[0].rows_per_epoch
    assert [m[f"data/{b}/epochs"] for m in logged if f"data/{b}/epochs" in m][-1] == 12 / rows


def _train_on_two_ranks(rank: int, port: int, config: str, out: str) -> None:
    """One rank of a 2-process gloo run in which rank 1's clock runs two minutes a reading ahead."""
    import marinlm.train.trainer as trainer_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    if rank == 1:
        readings = iter(range(10**6))

        class FastClock:
            @staticmethod
            def perf_counter() -> float:
                return time.perf_counter() + 120 * next(readings)

        trainer_module.time = FastClock
    summary = run_training(load_config(TrainConfig, config), resume="none")
    saved = [e["step"] for e in summary["events"] if e["event"] == "checkpoint"]
    Path(out, f"saved-{rank}.json").write_text(json.dumps(saved))


@pytest.mark.distributed
def test_timed_checkpoints_are_agreed_by_every_rank(token_data, tmp_path):
    """Each rank reads its own clock: a rank that alone found a timed save due would save alone and
    wait forever in the checkpoint's collectives. The first rank to find it due decides for all."""
    config = train_config(token_data, tmp_path / "run", checkpoint={"every_steps": 4, "every_minutes": 1})
    save_config(config, tmp_path / "run.yaml")
    run_on_two_ranks(
        _train_on_two_ranks,
        (str(tmp_path / "run.yaml"), str(tmp_path)),
        timeout=240,
        hang="the ranks hung: a timed checkpoint was not agreed",
    )
    for rank in (0, 1):
        assert json.loads((tmp_path / f"saved-{rank}.json").read_text()) == [1, 2, 3, 4, 5, 6, 7, 8]


def test_a_dataset_whose_manifest_names_no_tokenizer_folder_trains_with_a_warning(token_data, tmp_path, capsys):
    """A token folder moved from another machine (tokenizer.path gone) or written by another tool
    ended the start-up in a KeyError traceback; the tokenizer copy is a convenience for generate."""
    import shutil

    from marinlm.tokenizer import MarinTokenizer

    shutil.copytree(token_data, tmp_path / "tokens")
    manifest = tmp_path / "tokens" / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["tokenizer"]["path"]
    manifest.write_text(json.dumps(data))
    # Token folders carry a copy of their tokenizer (tokenize writes it): the run takes that one.
    trainer = Trainer(train_config(tmp_path / "tokens", tmp_path / "run0", train={"steps": 1}), resume="none")
    trainer.close()
    assert MarinTokenizer.load(tmp_path / "run0" / "tokenizer").hash == data["tokenizer"]["hash"]
    assert "names no tokenizer folder" not in capsys.readouterr().err
    # One written before they did: a warning, and the run has no tokenizer copy.
    shutil.rmtree(tmp_path / "tokens" / "tokenizer")
    trainer = Trainer(train_config(tmp_path / "tokens", tmp_path / "run", train={"steps": 1}), resume="none")
    trainer.close()
    assert "names no tokenizer folder that exists (tokenizer.path: None)" in capsys.readouterr().err
    assert not (tmp_path / "run" / "tokenizer").exists()


def test_the_runs_tokenizer_copy_is_never_a_partial_one(token_data, tmp_path):
    """The copy went straight to RUN/tokenizer: one killed midway was taken for the tokenizer by
    every later start (it is copied only when absent)."""
    source = Path(json.loads((token_data / "manifest.json").read_text())["tokenizer"]["path"])
    (tmp_path / "run" / ".tokenizer.tmp").mkdir(parents=True)  # what a killed copy left
    (tmp_path / "run" / ".tokenizer.tmp" / "tokenizer.json").write_text("{")
    Trainer(train_config(token_data, tmp_path / "run", train={"steps": 1}), resume="none").close()
    copied = tmp_path / "run" / "tokenizer"
    assert sorted(p.name for p in copied.iterdir()) == sorted(p.name for p in source.iterdir())
    assert (copied / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert not (tmp_path / "run" / ".tokenizer.tmp").exists()


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**62), 2**62) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)


@st.composite
def _state_dicts(draw):
    """A DCP state dict like the trainer's: model tensors, and optimizer state nested per parameter."""

    def tensor():
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        dtype = draw(st.sampled_from(_DTYPES))
        seed = draw(st.integers(0, 2**31 - 1))
        raw = torch.randint(
            0,
            256,
            (math.prod(shape) * dtype.itemsize,),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(seed),
        )
        # Any bit pattern, NaN payloads and infinities included; bools must be 0 or 1.
        return (raw % 2).bool().reshape(shape) if dtype == torch.bool else raw.view(dtype).reshape(shape)

    names = draw(
        st.lists(
            st.from_regex(r"[a-z]{1,4}(\.[a-z0-9]{1,3}){0,2}", fullmatch=True), min_size=1, max_size=4, unique=True
        )
    )
    model = {name: tensor() for name in names}
    optim = {
        "state": {name: {"exp_avg": tensor(), "step": tensor()} for name in names[:2]},
        "param_groups": [{"lr": draw(st.floats(0, 1)), "params": names[:2]}],
    }
    return {"model": model, "optim": optim}


@settings(max_examples=25, deadline=None)
@given(tensors=_state_dicts(), trainer_state=st.dictionaries(st.text(max_size=8), _JSON, max_size=4))
def test_checkpoint_save_then_load_is_bitwise(tmp_path_factory, tensors, trainer_state):
    """Property: whatever the tensors (dtypes, empty or 0-d shapes, any bit pattern) and whatever
    JSON the trainer state holds, a checkpoint loads back exactly what was saved."""
    root = tmp_path_factory.mktemp("ckpt")
    manager = CheckpointManager(root, keep_last=1, check_space=False)
    manager.save(7, tensors, trainer_state, "run_dir: x\n")
    target = torch.utils._pytree.tree_map(lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t, tensors)
    loaded_state = manager.load(list_checkpoints(root)[0], target)
    assert loaded_state == trainer_state
    saved, got = torch.utils._pytree.tree_leaves(tensors), torch.utils._pytree.tree_leaves(target)
    for a, b in zip(saved, got, strict=True):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape
            bits = (lambda t: t.reshape(-1).view(torch.uint8)) if a.dtype != torch.bool else (lambda t: t)
            assert torch.equal(bits(a), bits(b))  # bitwise: NaN payloads too
        else:
            assert a == b


@pytest.mark.parametrize("bf16_units", [True, False])
def test_auto_precision_is_bf16_only_where_matmuls_have_bf16_units(bf16_units, token_data, tmp_path, monkeypatch):
    """`train.precision: auto` and the Marin optimizer's `ns_dtype: auto` pick bf16 on a CPU with
    AVX512-BF16 or AMX (and on GPUs), fp32 on one without; the quickstart's step-time calibration
    runs in the precision its training will use."""
    from marinlm.quickstart import plan
    from marinlm.utils import device as cpu_bf16

    monkeypatch.setattr(cpu_bf16, "_CPU_BF16_UNITS", bf16_units)
    want = "bf16" if bf16_units else "fp32"
    config = train_config(token_data, tmp_path / "run", train={"precision": "auto"}, optim={"ns_dtype": "auto"})
    trainer = Trainer(config, resume="none")
    assert trainer.precision == want
    # MFU is against the bf16 peak, or fp32's where this CPU's bf16 GEMMs are emulated as fp32 ones
    assert trainer.peak_dtype == (cpu_bf16.gemm_dtype(torch.bfloat16, "cpu") if bf16_units else torch.float32)
    assert {g["ns_dtype"] for g in trainer.optimizer.param_groups} == {torch.bfloat16 if bf16_units else torch.float32}
    trainer.close()

    calibrated = []

    def one_step(step, **window):
        step()
        return 1.0

    def recording(device, precision):
        calibrated.append(precision)
        return real_autocast(device, precision)

    from marinlm.utils import device as device_module

    real_autocast = device_module.autocast_context
    monkeypatch.setattr(device_module, "autocast_context", recording)
    monkeypatch.setattr(plan, "median_step_seconds", one_step)
    plan.calibrate_step_seconds(config)
    assert calibrated == [want]
    for explicit in ("fp32", "bf16"):  # a precision that is named is kept
        assert device_module.resolve_precision(explicit, torch.device("cpu")) == explicit
    assert device_module.resolve_precision("auto", torch.device("cuda")) == "bf16"


def test_a_run_resumed_where_auto_means_another_precision_says_so(token_data, tmp_path, capsys, monkeypatch):
    """`train.precision: auto` started in fp32 (a CPU without bf16 units) and resumed where it means
    bf16: the config is unchanged, so only the checkpoint's own record can tell."""
    from marinlm.utils import device as cpu_bf16

    config = train_config(token_data, tmp_path / "run", train={"steps": 4, "precision": "auto"})
    monkeypatch.setattr(cpu_bf16, "_CPU_BF16_UNITS", False)
    run_training(config, resume="none")
    capsys.readouterr()
    monkeypatch.setattr(cpu_bf16, "_CPU_BF16_UNITS", True)
    trainer = Trainer(
        train_config(token_data, tmp_path / "run", train={"steps": 6, "precision": "auto"}), resume="auto"
    )
    assert trainer.step == 4 and trainer.precision == "bf16"
    out = capsys.readouterr().out
    assert "note: " in out and "step-00000004 trained in fp32, this run goes on in bf16 (train.precision auto)" in out
    assert "set train.precision=fp32 to keep the precision it started with" in out
    trainer.close()
    monkeypatch.setattr(cpu_bf16, "_CPU_BF16_UNITS", False)  # the same precision as the checkpoint: no note
    Trainer(train_config(token_data, tmp_path / "run", train={"steps": 6, "precision": "auto"}), resume="auto").close()
    assert "trained in" not in capsys.readouterr().out


ALIKE = [("dense", "fp32", 50, 1e-5), ("moe", "fp64", 50, 1e-9), ("moe", "bf16", 3, 1e-2)]


@pytest.mark.slow
@pytest.mark.parametrize("ffn, precision, steps, rel", ALIKE, ids=[f"{c[0]}-{c[1]}" for c in ALIKE])
def test_a_run_trains_alike_on_the_reference_model_and_the_kernels(token_data, tmp_path, ffn, precision, steps, rel):
    """Runs under `kernels.modules: auto` and `reference` from one seed give the same losses.

    The kernels round at other points (fused nodes round once; the experts scale hidden rows
    before the down projection), so the losses agree to summation order. With dense FFNs that
    holds in fp32 for all 50 steps (measured: 1.2e-6 at most). With routed experts, in fp32 a
    difference of one rounding eventually tips a near-tied token to another expert and the curves
    part (6e-7 over the first 3 steps, then apart from step 4, as between one process and FSDP);
    in float64 (AdamW, whose update is exact there) the tiny MoE agrees over all 50 steps. bf16:
    3 steps within 1% (measured 2e-3; over 50 dense steps 5.4e-3)."""
    runs = {}
    moe = {"first_k_dense": 2, "dense_ffn_dim": 128} if ffn == "dense" else {}
    optim = {"type": "adamw", "lr": 3e-3} if precision == "fp64" else {}
    for kernels in ("auto", "reference"):
        model = tiny_config(num_layers=2, max_seq_len=64, attention={"sliding_window": 16}, moe=moe)
        run_training(
            train_config(
                token_data,
                tmp_path / kernels,
                model=to_dict(model),
                kernels={"modules": kernels},
                optim=optim,
                train={"steps": steps, "precision": precision},
                checkpoint={"every_steps": 0},
                validation={"every_steps": 0},
            ),
            resume="none",
        )
        runs[kernels] = losses(tmp_path / kernels)
    assert sorted(runs["auto"]) == sorted(runs["reference"]) == list(range(1, steps + 1))
    worst = max(abs(runs["auto"][s] - runs["reference"][s]) / runs["reference"][s] for s in runs["auto"])
    print(f"{ffn} {precision}: largest relative loss difference over {steps} steps {worst:.2e}")
    assert worst < rel, worst


def _two_checkpoints(token_data, run_dir):
    """A 4-step run with checkpoints at steps 2 and 4; returns the config (of a 6-step run on it)."""
    run_training(train_config(token_data, run_dir, train={"steps": 4}, checkpoint={"every_steps": 2, "keep_last": 3}))
    return train_config(token_data, run_dir, train={"steps": 6}, checkpoint={"every_steps": 2, "keep_last": 3})


@pytest.mark.parametrize("marker", ["null", '{"files": []}', '{"files": {"config.yaml": {"size": 1}}}', "[1, 2]"])
def test_a_completion_marker_of_the_wrong_shape_falls_back(token_data, tmp_path, capsys, marker):
    """Valid JSON of the wrong shape in the newest COMPLETE.json crashed `--resume auto` and
    `generate` (TypeError, AttributeError, KeyError); now both skip it for the previous checkpoint."""
    from marinlm.loading import load_model

    config = _two_checkpoints(token_data, tmp_path / "run")
    newest = list_checkpoints(tmp_path / "run" / "checkpoints")[0]
    (newest / "COMPLETE.json").write_text(marker)
    assert load_model(tmp_path / "run").checkpoint.name == "step-00000002"
    assert "skipping unusable checkpoint" in capsys.readouterr().err
    trainer = Trainer(config, resume="auto")
    assert trainer.step == 2 and f"skipping unusable checkpoint: {newest / 'COMPLETE.json'}" in capsys.readouterr().out
    trainer.close()


def test_a_crafted_pickle_in_the_optimizer_state_runs_nothing_and_the_run_falls_back(token_data, tmp_path, capsys):
    """A checkpoint whose hashes are consistent but whose optimizer state holds a pickle that runs a
    command: refused (nothing runs), the message names the checkpoint and never suggests
    `weights_only=False`, and `--resume auto` falls back to the good checkpoint. DCP's
    CheckpointException derives from BaseException and escaped `except Exception`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from marinlm.train.checkpoint import file_listing

    config = _two_checkpoints(token_data, tmp_path / "run")
    newest = list_checkpoints(tmp_path / "run" / "checkpoints")[0]
    tensors = _load_state_dict_from_keys(checkpoint_id=str(newest))

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    def plant(tree):  # the first non-tensor leaf of the optimizer state becomes the payload
        for key, value in tree.items():
            if isinstance(value, dict):
                if plant(value):
                    return True
            elif not isinstance(value, torch.Tensor):
                tree[key] = Evil()
                return True
        return False

    assert plant(tensors["optim"])
    dcp.save(tensors, checkpoint_id=str(newest))
    (newest / "COMPLETE.json").unlink()
    (newest / "COMPLETE.json").write_text(json.dumps({"files": file_listing(newest), "world_size": 1}))
    assert (tmp_path / "pwned").exists() is False
    trainer = Trainer(config, resume="auto")
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert trainer.step == 2 and not (tmp_path / "pwned").exists()
    assert f"skipping unusable checkpoint: {newest}" in out and "nothing in it was run" in out
    assert "weights_only" not in out
    trainer.close()


@pytest.mark.parametrize("every", [1, 2])
def test_a_diverging_run_stops_whatever_its_checkpoint_interval(token_data, tmp_path, every):
    """AdamW at lr 1e25 with a checkpoint every step (or two): checkpoints were saved on skipped
    steps, each rollback landed on one of the bad streak, `max_rollbacks` (then counted per
    checkpoint) never triggered, and the run ended 'done' with exit 0. Now the CLI exits non-zero
    naming the learning rate, and every kept checkpoint holds finite weights."""
    from marinlm.loading import load_model

    config = train_config(
        token_data,
        tmp_path / "run",
        optim={"type": "adamw", "lr": 1e25},
        train={"steps": 16},
        checkpoint={"every_steps": every, "keep_last": 3},
    )
    save_config(config, tmp_path / "run.yaml")
    proc = cli(tmp_path / "run.yaml")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    assert "training diverged" in out and "optim.lr=1e+25" in out, out[-2000:]
    for folder in list_checkpoints(tmp_path / "run" / "checkpoints"):
        model = load_model(folder).model
        assert all(torch.isfinite(p).all() for p in model.parameters()), folder


def test_a_resume_with_other_rows_per_forward_says_the_capacity_drops_change(token_data, tmp_path, capsys):
    """Capacity is computed per forward, so a resume with another number of rows per forward (another
    world size, with the default micro_batch 0) follows another path: said in one line, with the
    setting that keeps the numbers."""
    run_training(train_config(token_data, tmp_path / "run", train={"steps": 4, "micro_batch": 2}))
    capsys.readouterr()
    trainer = Trainer(train_config(token_data, tmp_path / "run", train={"steps": 6}), resume="auto")
    out = capsys.readouterr().out
    assert "ran 2 rows per forward (over all data-parallel ranks), this run 4" in out and "set train.micro_batch" in out
    trainer.close()
    capsys.readouterr()
    trainer = Trainer(train_config(token_data, tmp_path / "run", train={"steps": 6, "micro_batch": 2}), resume="auto")
    assert "rows per forward" not in capsys.readouterr().out
    trainer.close()


def test_a_cut_short_write_is_said_in_words():
    """A disk that filled mid-save surfaced as torch's 'RuntimeError: [enforce fail at
    inline_container.cc:672] . unexpected pos 704 vs 598'."""
    from marinlm.train.checkpoint import _root_cause

    cause = _root_cause(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))
    assert cause == "a file was cut short while being written (torch's writer: unexpected pos 704 vs 598)"


def test_a_step_out_of_memory_is_retried_with_fewer_rows_and_trains_as_before(token_data, tmp_path):
    """From step 3 a forward of more than one row runs out of memory (raised from a hook): with
    train.oom_retry the step is abandoned and redone at 2 and then 1 row per forward, the same
    global batch, so the losses are those of an unchanged run; without it, or at one row, the run
    stops naming the settings to try."""
    from marinlm.train.signals import OutOfMemory

    model = {"moe": {"capacity_factor": None}}  # capacity depends on the rows per forward
    base = train_config(token_data, tmp_path / "base", model=model, train={"steps": 5}, checkpoint={"every_steps": 0})
    run_training(base, resume="none")

    def oom_from_step_3(trainer):
        def hook(module, args, output):
            if module.training and trainer.step >= 2 and args[0].shape[0] > 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        trainer.model.register_forward_hook(hook)

    config = train_config(
        token_data,
        tmp_path / "retry",
        model=model,
        train={"steps": 5, "oom_retry": True},
        checkpoint={"every_steps": 0},
    )
    trainer = Trainer(config, resume="none")
    oom_from_step_3(trainer)
    trainer.fit()
    trainer.close()
    a, b = losses(tmp_path / "base"), losses(tmp_path / "retry")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    assert [(e["step"], e["rows"]) for e in trainer.state.events if e["event"] == "oom_retry"] == [(3, 4), (3, 2)]
    trainer = Trainer(train_config(token_data, tmp_path / "stop", model=model, train={"steps": 5}), resume="none")
    oom_from_step_3(trainer)
    with pytest.raises(OutOfMemory, match=r"out of memory in step 3 at 4 rows per forward \(train.micro_batch auto, "):
        trainer.fit()
    trainer.close()


def test_out_of_memory_inside_the_optimizer_update_stops_without_a_save(token_data, tmp_path):
    """An update that runs out of memory part-way may have changed some weights: it is not retried
    (fewer rows would not help, and redoing it would apply it twice), the run stops naming the
    settings that shrink the optimizer's memory, and no checkpoint holds the half-updated weights."""
    from marinlm.train.signals import OutOfMemory

    config = train_config(
        token_data, tmp_path / "run", train={"steps": 5, "oom_retry": True}, checkpoint={"every_steps": 2}
    )
    trainer = Trainer(config, resume="none")
    original = trainer.optimizer.step

    def step_out_of_memory(*args, **kwargs):
        if trainer.step == 2:
            with torch.no_grad():
                next(trainer.model.parameters()).add_(1.0)  # the part of the update that happened
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(*args, **kwargs)

    trainer.optimizer.step = step_out_of_memory
    with pytest.raises(OutOfMemory, match=r"out of memory in the optimizer update of step 3: .*parallel.offload"):
        trainer.fit()
    trainer.close()
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-00000002"]
    assert sorted(losses(tmp_path / "run")) == [1, 2]
    assert not any(e["event"] == "oom_retry" for e in trainer.state.events)
