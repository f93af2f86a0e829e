"""Entry points that run a Trainer: `run_training` for `marinlm train`, and the hooks a caller
attaches (downstream evaluation lives in marinlm.eval, which reads checkpoints through train/, so it
is attached from here rather than imported by the trainer)."""

from __future__ import annotations

import os

from marinlm.train.config import TrainConfig
from marinlm.train.trainer import Trainer


def attach_eval_hook(trainer: Trainer) -> None:
    """Score `eval.tasks` every `eval.every_n_steps` steps, when the config asks for it."""
    c = trainer.config.eval
    if c.every_n_steps and c.tasks:
        from marinlm.eval.hook import make_eval_hook

        trainer.add_hook(make_eval_hook(trainer, c), every=c.every_n_steps)


def run_training(config: TrainConfig, resume: str = "auto", trainer_class: type[Trainer] = Trainer) -> dict:
    """Entry point for `marinlm train` and, with its trainer class, `marinlm finetune` (also under
    torchrun)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    trainer = None
    try:
        trainer = trainer_class(config, resume)
        attach_eval_hook(trainer)
        return trainer.fit()
    finally:
        from marinlm.parallel import shutdown_distributed

        if trainer is not None:
            trainer.close()
        shutdown_distributed()
