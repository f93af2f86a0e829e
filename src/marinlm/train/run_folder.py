"""Run folders: the one a training run takes (`claim_run_folder`), and one made without training
(`save_run`: an import from Hugging Face, a merged fine-tune): its config, its tokenizer and the
weights as its step-0 checkpoint, as the trainer's checkpointer writes them, so that everything
that opens a run opens it."""

from __future__ import annotations

import shutil
from pathlib import Path

from marinlm.config import dump_config
from marinlm.data.inputs import refuse_other_output
from marinlm.train.checkpoint import CheckpointManager
from marinlm.train.config import TrainConfig
from marinlm.utils.io import lock_folder, write_text_atomic


def claim_run_folder(run_dir: Path, is_main: bool) -> Path | None:
    """Make `run_dir` and, on the main rank, refuse another kind of output there and lock it (one
    job at a time writes a run folder: a second `train` would interleave). Returns the outermost
    folder this made (runs/ of runs/tiny, where neither existed), for removal if the run fails."""
    if is_main:  # before it takes the folder; the other ranks would see its lock
        refuse_other_output(run_dir, "run")
    made = next((p for p in reversed([run_dir, *run_dir.parents]) if not p.exists()), None)
    run_dir.mkdir(parents=True, exist_ok=True)
    if is_main:
        lock_folder(run_dir)
    return made


def save_run(run_dir: Path, train: TrainConfig, state: dict, tokenizer, extra: dict) -> Path:
    """A run folder holding `state` as its step-0 checkpoint, with its config and tokenizer."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tok_dir = run_dir / "tokenizer"
    shutil.rmtree(tok_dir, ignore_errors=True)
    tokenizer.save(tok_dir, model_max_length=train.model.max_seq_len)
    write_text_atomic(run_dir / "config.yaml", dump_config(train))
    trainer_state = {"step": 0, "tokenizer_hash": tokenizer.hash, **extra}
    manager = CheckpointManager(run_dir / "checkpoints")
    return manager.save(0, {"model": state}, trainer_state, dump_config(train), tokenizer=tok_dir)
