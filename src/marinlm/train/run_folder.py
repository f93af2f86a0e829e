"""A run folder made without training (an import from Hugging Face, a merged fine-tune): its
config, its tokenizer and the weights as its step-0 checkpoint, as the trainer's checkpointer
writes them, so that everything that opens a run opens it."""

from __future__ import annotations

import shutil
from pathlib import Path

from marinlm.config import dump_config
from marinlm.train.checkpoint import CheckpointManager
from marinlm.train.config import TrainConfig
from marinlm.utils.io import write_text_atomic


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
