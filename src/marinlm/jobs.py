"""The jobs behind `marinlm train` and `marinlm finetune`: build the trainer, attach the hooks it is
given from above (downstream evaluation, which lives in eval/ and reads runs through
marinlm.loading, so the trainer cannot import it), fit, and shut the process group down."""

from __future__ import annotations

import os

from marinlm.eval.hook import make_eval_hook
from marinlm.finetune.config import FinetuneConfig
from marinlm.finetune.trainer import finetune_trainer
from marinlm.parallel import shutdown_distributed
from marinlm.train.config import TrainConfig
from marinlm.train.trainer import Trainer


def attach_eval_hook(trainer: Trainer) -> None:
    """Score `eval.tasks` every `eval.every_n_steps` steps, when the config asks for it."""
    c = trainer.config.eval
    if c.every_n_steps and c.tasks:
        trainer.add_hook(make_eval_hook(trainer, c), every=c.every_n_steps)


def run_training(config: TrainConfig, resume: str = "auto", make_trainer=Trainer) -> dict:
    """Entry point for `marinlm train` and, with `finetune_trainer`, `marinlm finetune` (also under
    torchrun)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    trainer = None
    try:
        trainer = make_trainer(config, resume)
        attach_eval_hook(trainer)
        return trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()
        shutdown_distributed()


def run_finetune(config: FinetuneConfig, resume: str = "auto") -> dict:
    """Entry point for `marinlm finetune` (also under torchrun)."""
    return run_training(config, resume, finetune_trainer)
