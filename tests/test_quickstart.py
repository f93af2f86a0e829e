from __future__ import annotations

import os
import re
import signal
from types import SimpleNamespace

import pytest

from marinlm.config import load_config
from marinlm.optim import ScheduleConfig
from marinlm.presets import preset
from marinlm.quickstart import MARKER, build_default_corpus, corpus_prompt, run_quickstart
from marinlm.quickstart.plan import (
    OVERHEAD,
    REFERENCE_STEP_SECONDS,
    STEPS,
    Replan,
    TrainingPlan,
    interrupted_training,
    median_step_seconds,
)
from marinlm.quickstart.report import USUAL_VAL_LOSS, above_baseline_verdict, plan_note, range_note
from marinlm.train.checkpoint import list_checkpoints, step_of
from marinlm.train.config import TrainConfig
from marinlm.train.metrics import read_metrics
from marinlm.train.signals import StoppedBySignal
from marinlm.train.trainer import Trainer
from marinlm.utils.device import native_bf16

from conftest import write_corpus


@pytest.mark.slow
def test_default_corpus_ships_with_python(tmp_path):
    counts = build_default_corpus(tmp_path)
    assert counts["python_code"] > 500 and counts["python_docs"] > 50
    assert (tmp_path / "python-docs.jsonl").stat().st_size > 100_000
    # A rerun leaves unchanged files alone, so the quickstart's curation resumes rather than restarts.
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert build_default_corpus(tmp_path) == counts
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps


@pytest.mark.slow
def test_step_time_is_measured_over_a_window_not_a_few_slow_steps():
    """A host busy for the first calls (the warm-up and two more) and idle after: the planned step
    time is the idle one, because the median runs over a window of seconds."""
    import time

    calls = []

    def step():
        calls.append(None)
        time.sleep(0.15 if len(calls) <= 3 else 0.01)

    seconds = median_step_seconds(step, min_seconds=0.5)
    assert seconds < 0.05 and len(calls) > 10
    calls.clear()
    # With no window, 4 steps of which 2 are slow: the median is dragged up (as the old 4-step calibration was).
    assert median_step_seconds(step, min_seconds=0.0) > 0.05
    calls.clear()
    median_step_seconds(step, min_seconds=100.0, max_steps=12)
    assert len(calls) == 13  # the warm-up and at most max_steps


class _FakeTrainer:
    """What `Replan` reads of a Trainer: the step, the planned length, the schedule."""

    def __init__(self, steps: int):
        self.step = 0
        self.config = SimpleNamespace(train=SimpleNamespace(steps=steps), schedule=ScheduleConfig(warmup_fraction=0.03))
        self.lengths = []

    def set_total_steps(self, steps: int) -> None:
        assert steps > self.step
        self.config.train.steps = steps
        self.lengths.append((self.step, steps))


def _train_under(replan_trainer, step_seconds, minutes, monkeypatch):
    """Run a fake training of `step_seconds(step)` per step under `Replan` and a time budget, as
    Trainer.fit does; returns (steps done, seconds used)."""
    import marinlm.quickstart as quickstart

    clock = [0.0]
    monkeypatch.setattr(quickstart.time, "perf_counter", lambda: clock[0])
    trainer = replan_trainer
    hook = Replan(trainer, minutes)
    while trainer.step < trainer.config.train.steps and clock[0] < minutes * 60:
        clock[0] += step_seconds(trainer.step + 1)
        trainer.step += 1
        hook(None)
    return trainer.step, clock[0]


def test_the_run_is_replanned_from_its_step_time_and_shortened_when_the_host_slows(monkeypatch, capsys):
    def blips(step):  # a validation every 60 steps, a checkpoint every 150
        return (1.0 if step % 60 == 0 else 0.0) + (2.0 if step % 150 == 0 else 0.0)

    # Calibrated at 0.8 s/step (600 steps for 10 min), trains at 0.5 s/step, then the host slows
    # to 0.8 s/step from step 200: first lengthened, then shortened to end inside the budget.
    trainer = _FakeTrainer(600)
    steps, seconds = _train_under(trainer, lambda step: (0.5 if step < 200 else 0.8) + blips(step), 10.0, monkeypatch)
    out = capsys.readouterr().out
    assert trainer.lengths[0] == (30, 1083)  # 30 + 0.9 * (600 - 15 s) / 0.5 s
    assert "[step 30] 0.50 s/step over steps 2-30: re-planned from 600 to 1083 steps" in out
    assert len(trainer.lengths) > 1 and all(200 < at <= 270 for at, _ in trainer.lengths[1:])  # soon after
    # Measured over the last 3 checks' 90 steps; then, from the new plan on, over the steps since it.
    assert "[step 210] the host slowed to 0.57 s/step over steps 121-210: shortened from 1083 to 978 steps" in out
    assert "[step 240] the host slowed to 0.83 s/step over steps 211-240: shortened from 978 to 738 steps" in out
    assert steps == trainer.config.train.steps and seconds < 600  # the schedule ran to its end in time
    # A host that gets faster later: the run is lengthened, on a rate measured over three checks
    # (90 steps) since the last plan, and uses its budget.
    trainer = _FakeTrainer(600)
    steps, seconds = _train_under(trainer, lambda step: (0.5 if step < 200 else 0.3) + blips(step), 10.0, monkeypatch)
    out = capsys.readouterr().out
    assert [at for at, _ in trainer.lengths] == [30, 240, 330], trainer.lengths
    assert "[step 240] the host sped up to 0.43 s/step over steps 151-240: lengthened from 1083 to 1246 steps" in out, (
        out
    )
    assert steps == trainer.config.train.steps == trainer.lengths[-1][1] and 540 < seconds < 600
    # A slowdown that passes (0.5 s/step, 0.7 over steps 200-350, then 0.5 again): shortened while
    # it lasts, lengthened after, and the run ends in time with little of its budget unused.
    trainer = _FakeTrainer(600)
    steps, seconds = _train_under(
        trainer, lambda step: (0.7 if 200 <= step < 350 else 0.5) + blips(step), 10.0, monkeypatch
    )
    out = capsys.readouterr().out
    assert "shortened" in out and "lengthened" in out, out
    assert steps == trainer.config.train.steps and 540 < seconds < 600, (trainer.lengths, seconds)
    # A steady host: one re-plan, validations and checkpoints are not taken for a slowdown, and the
    # schedule ends with little of the budget unused.
    trainer = _FakeTrainer(600)
    steps, seconds = _train_under(trainer, lambda step: 0.6 + blips(step), 10.0, monkeypatch)
    assert len(trainer.lengths) == 1 and steps == trainer.config.train.steps and 550 < seconds < 600
    # A run resumed at step 400 of 600 keeps its plan: never lengthened (its learning rate is past
    # its peak), but shortened, measured from the resumed steps, when the rest would not fit.
    trainer = _FakeTrainer(600)
    trainer.step = 400
    steps, seconds = _train_under(trainer, lambda step: 0.5, 5.0, monkeypatch)
    assert trainer.lengths == [] and steps == 600 and seconds == 100
    trainer = _FakeTrainer(600)
    trainer.step = 400
    steps, seconds = _train_under(trainer, lambda step: 0.5, 1.5, monkeypatch)
    assert trainer.lengths == [(430, 565)] and steps == 565 and seconds < 90  # 430 + 0.9 * (90 - 15 s) / 0.5 s


@pytest.mark.slow
def test_quickstart_smoke_run_stopped_and_resumed(tmp_path, capsys, monkeypatch):
    """The whole quickstart at a fixed 60 steps (`steps`: no time budget, so a busy host trains the
    same run, only slower), stopped by a SIGTERM after step 40 and run again: the finished stages are
    kept, training resumes at step 40 to the same 60 steps, and the report says so."""
    write_corpus(tmp_path / "corpus", num_docs=300, num_files=2)
    root = tmp_path / "run"
    stale = root / "train" / "checkpoints" / "step-99999999"  # an earlier quickstart's run
    stale.mkdir(parents=True)
    (root / MARKER).touch()
    planned = 60
    hooked = Trainer.add_hook

    def sigterm_at_step_40(trainer, fn, every):  # a scheduler's preemption, or Ctrl-C, in the middle of training
        hooked(trainer, fn, every)
        if every == trainer.config.logging.every_steps and fn == trainer.report.log:

            def stop(result):
                if trainer.step == 40:
                    os.kill(os.getpid(), signal.SIGTERM)

            hooked(trainer, stop, 1)

    monkeypatch.setattr(Trainer, "add_hook", sigterm_at_step_40)
    with pytest.raises(StoppedBySignal, match="at step 40; the same command resumes from it"):
        run_quickstart(str(root), corpus=[str(tmp_path / "corpus")], steps=planned)
    monkeypatch.undo()
    out = capsys.readouterr().out
    assert f"{planned} steps, as --steps asks (no time budget)" in out
    assert not stale.exists()  # replaced, so evaluation and `generate` read this run's model
    assert "re-planned" not in out and "s/step measured" not in out

    # The same command again keeps the finished stages and trains on from step 40, to the same plan.
    report = run_quickstart(str(root), corpus=[str(tmp_path / "corpus")], steps=planned)
    out = capsys.readouterr().out
    assert f"resuming the training that was stopped at step 40 of {planned}" in out, out[-2000:]
    assert "replacing the earlier training run" not in out and "s/step measured" not in out
    assert "shortened" not in out and "lengthened" not in out
    text = report.read_text()
    precision, passes, tokens = re.search(
        rf"Training \((.+?)\): {planned} steps, resumed at step 40, ([\d.]+) passes over the ([\d,]+) ", text
    ).groups()
    # auto: bf16 on a CPU with bf16 units, with MFU against the bf16 peak; fp32 elsewhere
    want = "bf16" if native_bf16("cpu") else "fp32"
    assert precision == {"bf16": "bf16 autocast, fp32 master weights", "fp32": "fp32"}[want]
    assert f"against this machine's measured {want} matmul peak" in text
    assert "far fewer than" not in text  # asked for its steps: no note on a short run
    batch, seq = map(int, re.search(rf"\| training \| [\d.]+ \| {planned} steps x (\d+) x (\d+) tokens", text).groups())
    assert float(passes) * int(tokens.replace(",", "")) == pytest.approx(planned * batch * seq, rel=0.05)
    # Each number names its data: the rows training validates on, before and after, and the whole split.
    rows, subset_tokens = re.search(
        r"\| (\d+) validation rows \(([\d,]+) tokens\), as training validates \| before", text
    ).groups()
    before = float(re.search(r"\| before training \| ([\d.]+)", text).group(1))
    same = float(re.search(r"\| the same rows \| after training \| ([\d.]+)", text).group(1))
    whole, after = re.search(
        r"\| whole validation split \(([\d,]+) tokens\) \| after training \| ([\d.]+)", text
    ).groups()
    after = float(after)
    # This corpus holds out fewer than the 48 rows training validates on: here both score all of it.
    assert whole == subset_tokens and int(rows) < 48
    last = [r for r in read_metrics(root / "train") if "val/loss" in r][-1]
    assert last["step"] == planned and same == round(last["val/loss"], 3)
    assert f"On the same {rows} rows the validation loss fell by {before - same:.3f}" in text
    assert "Resumed a stopped run, to its own plan of 60 steps; trained to step 60." in text
    first = next(r for r in read_metrics(root / "train") if "val/loss" in r)
    assert first["step"] == 0 and before == round(first["val/loss"], 3)  # the first run's, before any step
    assert after < before - 1.0  # it learned something
    for stage in ("corpus", "curation", "tokenizer", "tokenize", "training", "evaluation", "sample"):
        assert f"| {stage} |" in text
    assert "Temperature 0.7, top-k 40, repetition penalty 1.2, seed 0" in text  # the sample's settings
    assert (root / "loss.png").stat().st_size > 5000
    assert f"resumed from {root / 'train' / 'checkpoints' / 'step-00000040'} at step 40" in out
    assert step_of(list_checkpoints(root / "train" / "checkpoints")[0]) == planned

    # A finished quickstart (its report written after its newest checkpoint), another job, or other
    # token shards start over; the same job whose quickstart never got to its report goes on.
    fresh = load_config(TrainConfig, preset("train", "quickstart"), [f"--run_dir={root / 'train'}"])
    fresh.data.sources[0].path = str(root / "tokens")
    assert interrupted_training(root / "train", fresh) is None
    newest = list_checkpoints(root / "train" / "checkpoints")[0]
    os.utime(newest, (report.stat().st_mtime + 1,) * 2)
    config, step, before_training = interrupted_training(root / "train", fresh)
    assert step == planned and config.train.steps == planned and before_training == first
    fresh.model.num_layers += 1
    assert interrupted_training(root / "train", fresh) is None
    fresh.model.num_layers -= 1
    manifest = root / "tokens" / "manifest.json"
    manifest.write_text(manifest.read_text() + "\n")
    assert interrupted_training(root / "train", fresh) is None


def test_a_missing_corpus_fails_before_anything_is_written(tmp_path):
    (tmp_path / "empty").mkdir()
    for corpus, why in (("nope.jsonl", "input path does not exist"), ("empty", "input directory has no")):
        with pytest.raises(FileNotFoundError, match=f"--corpus: {why}"):
            run_quickstart(str(tmp_path / "run"), corpus=[str(tmp_path / corpus)], minutes=1)
        assert not (tmp_path / "run").exists()


def test_too_little_text_stops_with_what_is_missing(tmp_path):
    (tmp_path / "one.txt").write_text("hello world. this is text\n")
    with pytest.raises(ValueError, match=r"curation kept none of the 1 documents .* needs more \(or longer\) text"):
        run_quickstart(str(tmp_path / "a"), corpus=[str(tmp_path / "one.txt")], minutes=1)
    write_corpus(tmp_path / "one", num_docs=1, num_files=1)  # curated, but one document cannot be split in two
    with pytest.raises(ValueError, match=r"validation documents; the quickstart needs at least one of each"):
        run_quickstart(str(tmp_path / "b"), corpus=[str(tmp_path / "one")], minutes=1)


def test_a_small_corpus_still_holds_out_a_validation_document(tmp_path, monkeypatch, capsys):
    """4 documents (60 kB of tinyshakespeare.txt) at 2% held out none, and the quickstart stopped
    with "give it more documents"; now it holds out one and goes on to train."""
    import json

    import marinlm.quickstart as quickstart
    from marinlm.dataset.shards import TokenDataset

    texts = write_corpus(tmp_path / "src", num_docs=7, num_files=1)
    (tmp_path / "few").mkdir()
    with open(tmp_path / "few" / "docs.jsonl", "w") as f:  # not d0: 2% holds out d0, and none of the others
        f.writelines(json.dumps({"id": f"d{i}", "text": texts[i]}) + "\n" for i in range(1, 7))

    def stop(*args):
        raise KeyboardInterrupt("reached training")

    monkeypatch.setattr(quickstart, "calibrate_step_seconds", stop)
    with pytest.raises(KeyboardInterrupt, match="reached training"):
        run_quickstart(str(tmp_path / "run"), corpus=[str(tmp_path / "few")], minutes=1)
    out = capsys.readouterr().out
    kept = int(re.search(r"2% of the (\d+) curated documents holds out none", out).group(1))
    tokens = tmp_path / "run" / "tokens"
    assert TokenDataset(tokens, "val").num_docs == 1 and TokenDataset(tokens, "train").num_docs == kept - 1


def test_a_run_that_ends_above_the_unigram_baseline_is_told_why():
    """A 60 kB corpus read 14 times over ended 1.3 nats above the baseline, and the report said only
    that; the README calls such a run broken, which it was not."""
    assert above_baseline_verdict(3.6, 6.8, 0.16, 3.5) == ""
    overfit = above_baseline_verdict(7.778, 6.512, 14.1, 2.345)
    assert "read its training tokens 14 times over" in overfit and "training loss is 2.345" in overfit
    assert "too little text" in overfit and "read its training tokens 150 times" in above_baseline_verdict(
        9, 8, 150.4, 1
    )
    short = above_baseline_verdict(7.0, 6.8, 0.02, 7.1)
    assert "at most once (0.02 passes)" in short and "too few steps" in short and "too little" not in short


@pytest.mark.slow
def test_a_corpus_nothing_of_which_is_kept_names_the_reason_and_the_flag(tmp_path):
    """A user's JSON records with another text field, or text in another language, ended in "kept
    none ... needs more text", with the reasons one file away and no way to change either."""
    import json

    records = [{"body": f"Document {i}: " + "plain English words about many things " * 20} for i in range(30)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    corpus = [str(tmp_path / "docs.jsonl")]
    with pytest.raises(ValueError, match=r"missing field 'text' \(30\); --text-field names the records' text field"):
        run_quickstart(str(tmp_path / "a"), corpus=corpus, minutes=1)
    # A big .txt file (tinyshakespeare.txt) is cut into documents at paragraph breaks, not kept whole.
    assert "chunk_chars: 16000" in (tmp_path / "a" / "curation.yaml").read_text()
    with pytest.raises(ValueError, match=r"language_en \(30\); --languages lists the languages to keep \(now zh\)"):
        run_quickstart(str(tmp_path / "b"), corpus=corpus, minutes=1, text_field="body", languages=["zh"])
    # A .parquet file without a 'text' column: its reason was cut to "columns (1)", with no flag named.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": [r["body"] for r in records]}), tmp_path / "docs.parquet")
    with pytest.raises(ValueError, match=r"missing column 'text' \(1\); --text-field names the records' text field"):
        run_quickstart(str(tmp_path / "c"), corpus=[str(tmp_path / "docs.parquet")], minutes=1)


def test_a_user_corpus_is_sampled_from_a_prompt_in_its_own_style(token_data):
    from marinlm.dataset.shards import TokenDataset
    from marinlm.tokenizer import MarinTokenizer

    tokenizer = MarinTokenizer.load(token_data.parent / "tokenizer")
    prompt = corpus_prompt(token_data, tokenizer, max_chars=20)
    first = tokenizer.decode(TokenDataset(token_data, "val").document(0).tolist(), skip_special_tokens=True)
    assert prompt and 0 < len(prompt) <= 20 and "\n" not in prompt
    assert first.lstrip().startswith(prompt)


def test_a_folder_the_quickstart_did_not_make_is_left_alone(tmp_path):
    """It replaces its own earlier training run, so `--run-dir runs` must not reach a real runs/train."""
    (tmp_path / "runs" / "train").mkdir(parents=True)
    (tmp_path / "runs" / "train" / "precious.txt").write_text("a week of training")
    with pytest.raises(ValueError, match=r"runs: exists and was not made by the quickstart"):
        run_quickstart(str(tmp_path / "runs"), minutes=1)
    assert (tmp_path / "runs" / "train" / "precious.txt").read_text() == "a week of training"
    assert not (tmp_path / "runs" / MARKER).exists()


def test_a_slow_or_short_run_says_so_in_its_report():
    """A busy host's time-planned quickstart trained 60 steps and reported 5.32 nats/token against
    the README's ~2.8-3.0 with no word of why. Now the report states the steps planned and trained,
    the host's pace against the reference host, the time estimated and taken, and why a result
    lands outside the documented range."""
    slow = TrainingPlan("default", STEPS, step_seconds=3 * REFERENCE_STEP_SECONDS)
    note = plan_note(slow, STEPS, 3 * slow.train_estimate_minutes * 60, 0.9)
    assert f"Planned {STEPS:,} steps (the default) and trained {STEPS:,}" in note
    assert f"measured {3 * REFERENCE_STEP_SECONDS:.2f} s/step, 3.0x the reference" in note
    assert "the host slowed during training (a median 0.90 s/step), so it took longer, but trained every" in note
    on_time = plan_note(slow, STEPS, slow.train_estimate_minutes * 60, 0.6)
    assert "slowed" not in on_time and f"took {slow.train_estimate_minutes:.1f} min" in on_time
    budget = TrainingPlan("minutes", 300, step_seconds=1.9, train_minutes=8.5)
    assert "Planned by a 8.5 min training budget (`--minutes`)" in plan_note(budget, 60, 510, 1.9)
    assert "as `--steps` asked" in plan_note(TrainingPlan("steps", 60), 60, 30, None)

    low, high = USUAL_VAL_LOSS
    assert "because it trained only 60 steps, not because something is broken" in range_note(5.32, 60, True)
    assert "something differs from the documented runs" in range_note(high + 0.5, STEPS, True)
    assert "below the" in range_note(low - 0.1, STEPS, True)
    assert range_note((low + high) / 2, STEPS, True) == "" and range_note(5.32, 60, built_in=False) == ""


def test_a_slow_host_hears_before_training_that_the_quickstart_takes_longer(tmp_path, monkeypatch, capsys):
    """A host 3x slower than the reference still trains every planned step; it is told so, with the
    time it will take and how to shorten it, before training starts (faked: a slow calibration)."""
    import marinlm.quickstart as quickstart
    from marinlm.train import trainer as trainer_module

    write_corpus(tmp_path / "corpus", num_docs=120, num_files=1)
    slow = 3 * REFERENCE_STEP_SECONDS
    monkeypatch.setattr(quickstart, "calibrate_step_seconds", lambda config: (slow, 1e-5))

    def stop(*args, **kwargs):
        raise KeyboardInterrupt("reached training")

    monkeypatch.setattr(trainer_module, "Trainer", stop)
    with pytest.raises(KeyboardInterrupt, match="reached training"):
        run_quickstart(str(tmp_path / "run"), corpus=[str(tmp_path / "corpus")])
    out = capsys.readouterr().out
    assert f"{STEPS:,} steps; {slow:.2f} s/step measured here against {REFERENCE_STEP_SECONDS:.2f}" in out
    minutes = STEPS * slow * (1 + OVERHEAD) / 60
    assert f"about {minutes:.1f} min of training" in out
    assert "note: this host runs the training step 3.0x slower than the reference host" in out
    assert f"It trains all {STEPS:,} steps" in out and "--minutes 10" in out

    # At the reference pace there is nothing to warn of.
    monkeypatch.setattr(quickstart, "calibrate_step_seconds", lambda config: (REFERENCE_STEP_SECONDS, 1e-5))
    with pytest.raises(KeyboardInterrupt, match="reached training"):
        run_quickstart(str(tmp_path / "run"), corpus=[str(tmp_path / "corpus")])
    assert "slower than the reference" not in capsys.readouterr().out


def test_a_corpus_inside_a_folder_the_quickstart_replaces_is_refused(tmp_path):
    """The quickstart empties its stages' folders when their inputs change: a --corpus inside one
    of them would be deleted, so it is refused before anything is written; one beside or above
    the run folder is read as usual."""
    root = tmp_path / "run"
    corpus = root / "curated" / "mine"
    write_corpus(corpus, num_docs=4, num_files=1)
    with pytest.raises(ValueError, match=r"the quickstart's curated folder .* holds --corpus"):
        run_quickstart(str(root), corpus=[str(corpus)], minutes=1)
    assert sorted(p.name for p in root.iterdir()) == ["curated"]
