"""The command line: overrides reach configs; commands without a config reject unknown flags."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from marinlm.cli import main

from conftest import CONFIGS, train_config


@pytest.mark.parametrize(
    "argv, named",
    [
        (["quickstart", "--bogus", "1"], "--bogus"),
        (["generate", "runs/x", "--prompt", "a", "--max_new_tokens", "3"], "--max_new_tokens"),
        (["eval", "runs/x", "--tasks", "val", "--limt", "3"], "--limt"),
        (["quickstart", "--minutes", "0"], "must be > 0"),
        (["quickstart", "--minutes", "ten"], "not a number"),
        (["model", "summary", str(CONFIGS / "model" / "tiny.yaml"), "--seq-len=-5"], "must be > 0"),
    ],
)
def test_bad_arguments_stop_before_any_work(argv, named, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert named in capsys.readouterr().err


def test_overrides_reach_the_config(capsys):
    assert main(["model", "summary", str(CONFIGS / "model" / "tiny.yaml")]) == 0
    full = capsys.readouterr().out
    assert main(["model", "summary", str(CONFIGS / "model" / "tiny.yaml"), "--num_layers=1"]) == 0
    one_layer = capsys.readouterr().out
    assert full != one_layer
    assert main(["model", "summary", str(CONFIGS / "model" / "tiny.yaml"), "--num_layerz=1"]) == 2
    assert "num_layerz" in capsys.readouterr().err


def test_model_summary_of_a_training_config_uses_its_model_and_seq_len(capsys):
    from marinlm.config import load_config
    from marinlm.train.config import TrainConfig

    train = load_config(TrainConfig, CONFIGS / "train" / "tiny.yaml", ["--data.seq_len=96"])
    assert main(["model", "summary", str(CONFIGS / "train" / "tiny.yaml"), "--data.seq_len=96"]) == 0
    out = capsys.readouterr().out
    assert train.model.max_seq_len != 96 and "at seq_len 96:" in out
    assert main(["model", "summary", str(CONFIGS / "train" / "tiny.yaml"), "--model.num_layers=1"]) == 0
    assert capsys.readouterr().out != out


def test_model_summary_of_a_run_folder_reads_its_config_and_other_commands_name_it(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    from marinlm.config import load_config, save_config
    from marinlm.train.config import TrainConfig

    save_config(load_config(TrainConfig, CONFIGS / "train" / "tiny.yaml"), run / "config.yaml")  # as a run saves it
    assert main(["model", "summary", str(CONFIGS / "train" / "tiny.yaml")]) == 0
    expected = capsys.readouterr().out
    assert main(["model", "summary", str(run)]) == 0 and capsys.readouterr().out == expected
    # A folder given where a config file goes: the folder is named, and its config.yaml if it has one.
    assert main(["train", str(run), "--print-config"]) == 2
    assert f"{run} is a folder, not a config file; its config file is {run / 'config.yaml'}" in capsys.readouterr().err
    assert main(["tokenize", str(tmp_path), "--print-config"]) == 2
    assert f"{tmp_path} is a folder, not a config file\n" in capsys.readouterr().err


def test_the_hero_training_config_is_the_runs_recipe(capsys):
    """configs/train/marin-535b-a23b.yaml against ../shared/docs/marin-535b-a23b.md: shape, optimizer,
    schedule, batch, length, precision and checkpoints; its summary gives the run's 18.0T tokens
    and about 2.70e24 FLOPs."""
    import re

    from marinlm.config import load_config
    from marinlm.model import MarinConfig
    from marinlm.train.config import TrainConfig

    path = CONFIGS / "train" / "marin-535b-a23b.yaml"
    hero = load_config(TrainConfig, path)
    assert hero.model == load_config(MarinConfig, CONFIGS / "model" / "marin-535b-a23b.yaml")
    o, s, t, c = hero.optim, hero.schedule, hero.train, hero.checkpoint
    assert type(o).__name__ == "MarinOptimizerConfig"
    # Marin's MoeHeuristic (experiments/grug/moe_hero_ep/heuristic.py) at the hero's budget, written out
    per_step = 11_264 * 4_096
    tokens = 390_251 * per_step
    adam_lr = 0.06602 * tokens**-0.395 * 6144**-0.15 * math.sqrt(per_step)
    assert o.adam_lr == pytest.approx(adam_lr, rel=1e-4) and o.lr == pytest.approx(13 / 3 * adam_lr, rel=1e-4)
    assert o.eps == pytest.approx(9.676e-18 * math.sqrt(tokens / per_step), rel=1e-4)
    assert tuple(o.betas) == (0.9062, max(0.95, min(0.9999, 0.999 ** (per_step / 131_072))))
    assert (o.newton_schulz, o.ns_dtype) == ("quintic_schedule", "bfloat16")
    assert hero.model.init_std == pytest.approx(0.5 / math.sqrt(6144), rel=1e-4)
    assert hero.model.attention.rope_pairs == "interleaved"
    assert (o.momentum, o.nesterov, o.ns_steps) == (0.95, True, 5)
    assert (s.kind, s.warmup_fraction, s.min_lr_ratio) == ("linear", 0.01, 0.05)
    assert (t.steps, t.global_batch, hero.data.seq_len, t.precision, t.grad_clip) == (
        390_251,
        11_264,
        4096,
        "bf16",
        None,
    )
    assert (c.every_steps, c.keep_every_steps, c.every_minutes) == (6000, 6000, 60)
    assert main(["model", "summary", str(path)]) == 0
    out = capsys.readouterr().out
    run = re.search(
        r"run: 390,251 steps x 11,264 sequences x 4,096 tokens = ([\d.e+]+) tokens, ([\d.e+]+) training FLOPs", out
    )
    assert run, out
    assert float(run[1]) == pytest.approx(18.0e12, rel=1e-3)  # 46.1M tokens a step
    assert float(run[2]) == pytest.approx(2.70e24, rel=0.02)


@pytest.mark.slow
def test_training_a_finished_run_again_reports_instead_of_crashing(token_data, tmp_path, capsys):
    from marinlm.config import save_config

    config = tmp_path / "train.yaml"
    save_config(train_config(token_data, tmp_path / "run", train={"steps": 2}), config)
    assert main(["train", str(config)]) == 0
    assert "final train loss" in capsys.readouterr().out
    assert main(["train", str(config)]) == 0  # resumes at step 2 of 2: nothing to train
    assert "no step left to train" in capsys.readouterr().out


def test_a_malformed_hf_source_is_named(capsys):
    assert main(["eval", "runs/x", "--tasks", "hellaswag", "--hf", "hellaswag_val.jsonl"]) == 2
    assert "--hf 'hellaswag_val.jsonl': expected FILE=NAME[:CONFIG]:SPLIT" in capsys.readouterr().err


def test_an_override_with_a_space_is_not_taken_for_the_config_file(tmp_path, capsys):
    # argparse treats "--inputs=[a, b]" (it has a space) as a positional: it must still be an override.
    text, missing = tmp_path / "a.txt", tmp_path / "missing"
    text.write_text("some text to train on")
    argv = ["tokenizer", "train", f"--inputs=[{text}, {missing}]", f"--output_dir={tmp_path}/o"]
    assert main(argv) == 2
    assert f"inputs: input path does not exist: {missing}" in capsys.readouterr().err  # the key, the path


def test_a_diverged_run_ends_with_its_message_and_no_traceback(monkeypatch, capsys):
    import marinlm.jobs as trainer
    from marinlm.train.signals import TrainingDiverged

    def diverge(config, resume):
        raise TrainingDiverged("training diverged: ... --resume runs/x/checkpoints/step-00000004")

    monkeypatch.setattr(trainer, "run_training", diverge)
    assert main(["train", str(CONFIGS / "train" / "tiny.yaml")]) == 1
    assert capsys.readouterr().err == "error: training diverged: ... --resume runs/x/checkpoints/step-00000004\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["tokenizer", "train", "--inputs=[a.txt]", "--output_dir=''"],
        ["tokenize", "--inputs=[a]", "--tokenizer=t", "--output_dir=''"],
        ["data", "run", "--sources=[{name: a, inputs: [a.txt]}]", "--output_dir=''"],
        ["train", str(CONFIGS / "train" / "tiny.yaml"), "--run_dir=''"],
    ],
)
def test_an_empty_output_folder_is_refused(argv, capsys):
    assert main(argv) == 2  # it used to mean the current directory
    assert "must name a folder" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    "command",
    [
        ["generate", "runs/x", "--prompt", "a", "--device", "cuda"],
        ["eval", "runs/x", "--tasks", "val", "--device", "cuda"],
        ["train", str(CONFIGS / "train" / "tiny.yaml"), "--train.device=cuda"],
    ],
)
def test_asking_for_cuda_on_a_cpu_machine_is_a_clear_error(command, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(command) == 2  # it used to be torch's AssertionError traceback
    err = capsys.readouterr().err
    assert "device 'cuda': no CUDA device on this machine" in err
    assert command[0] != "train" or "config error: train.device: device 'cuda'" in err  # the key named
    assert list(tmp_path.iterdir()) == []  # no run folder left behind


def test_a_reader_that_leaves_ends_the_command_quietly(monkeypatch, capsys):
    """`marinlm generate ... | head -1` printed a BrokenPipeError traceback."""
    import os
    import sys

    import marinlm.cli as cli

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone
    with os.fdopen(write_end, "w") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        monkeypatch.setattr(cli, "_model_summary", lambda args, overrides: print("x" * 100_000, flush=True))
        assert main(["model", "summary", str(CONFIGS / "model" / "tiny.yaml")]) == 141
        monkeypatch.undo()
    assert "Traceback" not in capsys.readouterr().err


def test_print_config_shows_every_key_resolved_and_reloads(tmp_path, capsys):
    from marinlm.config import load_config
    from marinlm.train.config import TrainConfig

    path = CONFIGS / "train" / "tiny.yaml"
    assert main(["train", "--print-config", str(path), "--optim.lr=0.125", "--model.num_layers=2"]) == 0
    text = capsys.readouterr().out
    assert "max_consecutive_bad_steps: 3" in text  # a default the file does not set
    (tmp_path / "resolved.yaml").write_text(text)
    assert load_config(TrainConfig, tmp_path / "resolved.yaml") == load_config(
        TrainConfig, path, ["--optim.lr=0.125", "--model.num_layers=2"]
    )
    assert main(["data", "run", str(CONFIGS / "data" / "python-corpus.yaml"), "--print-config", "--workerz=2"]) == 2
    assert "workerz" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out.startswith("marinlm ")
    # `python -m marinlm` is the command too (and `torchrun -m marinlm train ...`)
    run = subprocess.run([sys.executable, "-m", "marinlm", "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("marinlm "), run.stderr


def test_a_process_imports_the_compiler_and_dtensor_only_when_it_runs_them():
    """Every command, and each process torchrun starts, imports marinlm first. `marinlm --version`
    imported DTensor to catch one exception class, and every training process torch's compiler to
    read one counter: seconds of start-up each, in every launch."""
    probe = (
        "import sys, marinlm.cli; a = {m for m in ('torch._dynamo', 'torch.distributed.tensor') if m in sys.modules}; "
        "import marinlm.jobs; print(sorted(a), 'torch._dynamo' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.stdout.split("\n")[0] == "[] False", run.stdout + run.stderr


@pytest.mark.slow
def test_an_output_path_through_a_file_is_an_error_before_any_work(token_data, tmp_path, capsys, monkeypatch):
    """`--run_dir`/`--output_dir` naming a file was a FileExistsError traceback; `marinlm eval --output`
    under a file failed only when writing, after all the scoring."""
    import marinlm.eval.runner

    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    text = tmp_path / "a.txt"
    text.write_text("some text to train on")
    commands = [
        [
            "train",
            str(CONFIGS / "train" / "tiny.yaml"),
            f"--run_dir={afile}",
            f"--data.sources=[{{path: {token_data}}}]",
        ],
        ["tokenize", f"--inputs=[{text}]", f"--tokenizer={token_data.parent / 'tokenizer'}", f"--output_dir={afile}"],
        ["tokenizer", "train", f"--inputs=[{text}]", f"--output_dir={afile}"],
        ["data", "run", f"--sources=[{{name: a, inputs: [{text}]}}]", f"--output_dir={afile}"],
    ]
    for argv in commands:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"error: {afile}: File exists (a file stands where a folder must go)" in err and "Traceback" not in err

    from marinlm.config import save_config

    config = tmp_path / "train.yaml"
    save_config(train_config(token_data, tmp_path / "run", train={"steps": 1}), config)
    assert main(["train", str(config)]) == 0
    capsys.readouterr()
    scored = []
    monkeypatch.setattr(marinlm.eval.runner, "run_eval", lambda *a, **k: scored.append(1))
    assert main(["eval", str(tmp_path / "run"), "--tasks", "val", "--output", f"{afile}/eval.json"]) == 2
    assert f"error: {afile}: File exists" in capsys.readouterr().err and not scored


def test_the_command_freezes_what_is_left_before_its_process_exits(monkeypatch):
    """`marinlm` (and `python -m marinlm`, torchrun's workers) returns main's code with the objects
    left frozen, so the interpreter's exit does not sweep all of torch's for cycles."""
    import gc

    import marinlm.__main__ as command

    monkeypatch.setattr(command, "main", lambda: 3)
    try:
        assert command.entry() == 3 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_plan_and_model_summary_say_what_a_file_of_another_command_is(capsys):
    """`marinlm train` named the command a model config is for; `plan` and `model summary` only
    listed the unknown key."""
    for argv, kind in [
        (["plan", str(CONFIGS / "model" / "tiny.yaml"), "--hardware", "h100-sxm"], "a model config"),
        (["model", "summary", str(CONFIGS / "data" / "python-corpus.yaml")], "a data curation config"),
    ]:
        assert main(argv) == 2
        assert f"that file is {kind}" in capsys.readouterr().err, argv


def main_failing_with(error: BaseException, monkeypatch, capsys) -> tuple[int, str]:
    """`marinlm model summary`'s exit code and stderr when the command raises `error`."""
    import marinlm.cli as cli

    def fail(args, overrides):
        raise error

    monkeypatch.setattr(cli, "_model_summary", fail)
    code = main(["model", "summary", str(CONFIGS / "model" / "tiny.yaml")])
    return code, capsys.readouterr().err


def test_a_path_that_cannot_be_made_is_one_line_naming_it(monkeypatch, capsys):
    """An OSError of a path (`marinlm plan --out` under /proc, where no folder can be made) printed
    Python's "[Errno 2] No such file or directory: '...'"; a message of our own prints whole."""
    import errno

    for error, printed in [
        (FileNotFoundError(errno.ENOENT, "No such file or directory", "/proc/plan"), "/proc/plan: No such file"),
        (FileNotFoundError("runs/x: no usable checkpoint"), "runs/x: no usable checkpoint"),
    ]:
        code, err = main_failing_with(error, monkeypatch, capsys)
        assert code == 2
        assert err.startswith(f"error: {printed}")


def test_a_full_disk_is_one_line_naming_the_path(monkeypatch, capsys):
    """Curation, tokenization or training that runs out of disk space ended in a traceback."""
    import errno

    from marinlm.train.checkpoint import CheckpointWriteError

    for error, printed in [
        (OSError(errno.ENOSPC, "No space left on device", "/data/shard-00001.zst"), "/data/shard-00001.zst: No space"),
        (OSError(errno.EDQUOT, "Disk quota exceeded", "runs/x/metrics.jsonl"), "runs/x/metrics.jsonl: Disk quota"),
        (CheckpointWriteError("runs/x/checkpoints/step-00000010.tmp: checkpoint at step 10"), "at step 10"),
    ]:
        code, err = main_failing_with(error, monkeypatch, capsys)
        assert code == 1
        assert err.startswith("error: ") and printed in err and "Traceback" not in err
    # Any other OSError is a bug or an unexpected failure: its traceback stays.
    with pytest.raises(ConnectionResetError):
        main_failing_with(ConnectionResetError(), monkeypatch, capsys)


def test_a_mistyped_run_folder_is_named_as_missing(tmp_path, capsys):
    """It read 'no usable checkpoint (looked in TYPO/checkpoints)', as if the run were broken."""
    for command in (
        ["generate", str(tmp_path / "typo"), "--prompt", "x"],
        ["eval", str(tmp_path / "typo"), "--tasks", "val"],
    ):
        assert main(command) == 2
        assert f"error: {tmp_path / 'typo'}: no such run or checkpoint folder\n" in capsys.readouterr().err
    # A mistyped step is told the steps there are.
    (tmp_path / "run" / "checkpoints" / "step-00000004").mkdir(parents=True)
    assert main(["generate", str(tmp_path / "run" / "checkpoints" / "step-4"), "--prompt", "x"]) == 2
    assert "checkpoints holds step-00000004\n" in capsys.readouterr().err


def test_a_folder_of_runs_names_the_runs_inside(tmp_path, capsys):
    """`marinlm generate runs/quickstart` read 'no usable checkpoint', though its run is in train/."""
    from marinlm.train.checkpoint import STEP_PREFIX

    (tmp_path / "train" / "checkpoints" / f"{STEP_PREFIX}00000010").mkdir(parents=True)
    (tmp_path / "tokens").mkdir()
    for command in (["generate", str(tmp_path), "--prompt", "x"], ["eval", str(tmp_path), "--tasks", "val"]):
        assert main(command) == 2
        assert (
            f"error: {tmp_path}: not a run folder; the runs inside it: {tmp_path / 'train'}" in capsys.readouterr().err
        )
    # A run whose checkpoints are all gone is still reported as such, not searched below.
    (tmp_path / "train" / "checkpoints" / f"{STEP_PREFIX}00000010").rmdir()
    assert main(["generate", str(tmp_path / "train"), "--prompt", "x"]) == 2
    assert "no usable checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_the_readme_stage_by_stage_commands_chain_through_their_configs(tmp_path, monkeypatch, capsys):
    """The stages' default configs did not meet: `data run` wrote runs/curated-shared and
    `tokenizer train` ./tokenizer, where the next stage did not look. And the block's first stage read
    ../shared/data, which a user's machine does not have, although the README said nothing in it
    needed it. Runs the README's lines as written, in a folder with no ../shared beside it, but for
    the training's length: 20 steps of the config's 300 (the rest of its minute trains alike)."""
    import re
    import shlex

    from conftest import ROOT

    block = re.search(r"## Stage by stage\n.*?```\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert [c[1] for c in commands] == ["data", "data", "tokenizer", "tokenize", "train", "generate", "eval"]
    (tmp_path / "work").mkdir()
    assert not (tmp_path / "shared").exists()
    monkeypatch.delenv("MARINLM_EVAL_DATA", raising=False)
    monkeypatch.chdir(tmp_path / "work")  # no configs/ here: the package's own copies are read
    for program, *argv in commands:
        assert program == ".venv/bin/marinlm"
        assert main(argv + ["--train.steps=20"] * (argv[0] == "train")) == 0, argv
    out = capsys.readouterr().out
    assert "def read_config(path):" in out and "| val | loss |" in out
    manifest = json.loads(Path("runs/tokens/manifest.json").read_text())
    assert manifest["tokenizer"]["vocab_size"] == 4096 and Path("runs/tiny/checkpoints/step-00000020").is_dir()
    # Each stage's line says how well the tokenizer compresses: on its sample, then on all the data.
    report = json.loads(Path("runs/tokenizer/train_report.json").read_text())
    assert f"; {report['bytes_per_token']:.2f} bytes a token on 256 of them\n" in out
    text_bytes = sum(e["num_bytes"] for split in manifest["splits"].values() for e in split)
    compression = text_bytes / (manifest["train_tokens"] + manifest["val_tokens"])
    assert f" ({compression:.2f} bytes of text a token); " in out and 2.5 < compression < 6
    # Run again, tokenize has nothing left to do, and says so (it showed an empty bar and the old time alone).
    assert main(commands[3][1:]) == 0
    said = capsys.readouterr()
    assert f"rejected input records; done by an earlier run in {manifest['seconds']} s\n" in said.out
    assert said.err.endswith("part(s) done by an earlier run of this job; nothing left to do\n")


@pytest.mark.parametrize(
    "command, argv, says",
    [
        (
            "_data_run",
            ["data", "run", "x.yaml"],
            "interrupted; the same command carries on from the last finished unit",
        ),
        ("_quickstart", ["quickstart"], "interrupted; the same command carries on from the last finished unit"),
        ("_train", ["train", "x.yaml"], "interrupted; the same command carries on from the last finished unit"),
        ("_generate", ["generate", "run", "--prompt", "a"], "interrupted"),
        ("marinlm.commands.eval:_eval", ["eval", "run", "--tasks", "val"], "interrupted"),
        (
            "marinlm.commands.finetune:_finetune",
            ["finetune", "x.yaml"],
            "interrupted; the same command carries on from the last finished unit",
        ),
    ],
)
def test_ctrl_c_outside_training_exits_130_and_says_whether_a_rerun_carries_on(
    command, argv, says, monkeypatch, capsys
):
    """Ctrl-C in `generate` said the same command would carry on 'curation and tokenization'. Which
    commands resume comes from the command table (marinlm/commands.py)."""
    import importlib

    module, _, name = command.rpartition(":")
    owner = importlib.import_module(module or "marinlm.cli")

    def interrupted(args, overrides):
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted)
    assert main(argv) == 130
    assert capsys.readouterr().err.strip() == says


def test_sigterm_outside_training_exits_143_and_puts_the_handler_back(monkeypatch, capsys):
    """Raised as an exception (so workers and partial outputs are cleaned up: test_data_pipeline's
    test_sigterm_stops_the_worker_processes_too), reported like Ctrl-C, with a shell's exit code."""
    import signal

    import marinlm.cli as cli

    def terminated(args, overrides):
        assert callable(signal.getsignal(signal.SIGTERM))  # else the signal would end pytest itself
        signal.raise_signal(signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli, "_tokenize", terminated)
    assert main(["tokenize", "x.yaml"]) == 143
    assert capsys.readouterr().err.strip() == "terminated; the same command carries on from the last finished unit"
    assert signal.getsignal(signal.SIGTERM) == before


def saved_run(run):
    """A one-layer tiny run with one checkpoint of random weights (nothing trained)."""
    from dataclasses import replace

    from marinlm.tokenizer import MarinTokenizer, train_bpe
    from marinlm.train.config import TrainConfig
    from marinlm.train.run_folder import save_run

    from conftest import SAMPLE_TEXTS, build, tiny_config

    config = tiny_config(num_layers=1)
    tokenizer = MarinTokenizer(train_bpe(SAMPLE_TEXTS * 10, 300))
    save_run(run, replace(TrainConfig(model=config), run_dir=str(run)), build(config).state_dict(), tokenizer, {})
    return run


def test_misspellings_get_a_did_you_mean(tmp_path, capsys):
    """A misspelt key, shipped config or task names the closest valid one, not only the list."""
    assert main(["train", "configs/train/tiny.yaml", "--train.stpes=5", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "train.stpes: unknown key for LoopConfig; valid keys: [" in err and "]; did you mean 'steps'?" in err
    assert main(["train", "configs/train/tiyn.yaml", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "config file not found: configs/train/tiyn.yaml (shipped" in err
    assert err.rstrip().endswith("; did you mean 'configs/train/tiny.yaml'?"), err
    run = saved_run(tmp_path / "run")
    text = tmp_path / "text.txt"
    text.write_text("some text to score\n" * 10)
    # --tasks takes commas as `marinlm lm-eval` does: the misspelt task is found in the list
    assert main(["eval", str(run), "--tasks", f"hellaswg,bpb:{text}", "--limit", "2"]) == 2
    assert "unknown task 'hellaswg'; did you mean 'hellaswag'?" in capsys.readouterr().err


def test_finetune_prints_its_resolved_config(tmp_path, capsys):
    """`marinlm finetune CONFIG --print-config` was refused ("override has no value") while `train` took it."""
    import yaml

    run = saved_run(tmp_path / "base")
    args = ["finetune", "configs/finetune/gsm8k-lora.yaml", f"--base={run}", "--lora.r=4", "--print-config"]
    assert main(args) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["base"] == str(run) and printed["lora"]["r"] == 4 and printed["model"]["num_layers"] == 1
