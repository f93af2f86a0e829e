"""Downstream evaluation as a training hook: `eval.every_n_steps`, `eval.tasks`, `eval.limit`."""

from __future__ import annotations

from marinlm.eval.runner import EvalOptions, prepare, run_eval


class _Live:
    """What run_eval needs from a loaded model, taken from the running trainer."""

    def __init__(self, trainer):
        from marinlm.tokenizer import MarinTokenizer
        from marinlm.train.step import unwrap

        self.model = unwrap(trainer.model)
        self.tokenizer = MarinTokenizer.load(trainer.run_dir / "tokenizer")
        self.config = trainer.config
        self.checkpoint = f"{trainer.run_dir} (live, step {trainer.step})"
        self.tokenizer_hash = trainer.data.tokenizer_hash


def make_eval_hook(trainer, config):
    """Every N steps: score the tasks and log `eval/<task>/<metric>` (rank 0).

    Under torchrun the scoring batches (and validation rows) are dealt across the ranks and the
    scores gathered (eval/lm.py): each rank does its share, and every forward of the FSDP model has
    every rank in it. The scores equal those of `marinlm eval` on one process.
    """
    options = EvalOptions(tasks=list(config.tasks), data_dir=config.data_dir, limit=config.limit)
    # Read and check the task files now: a missing or malformed one must stop the run before its
    # first step, not at step N with the steps since the last checkpoint lost.
    prepared = prepare(options)

    def hook(result=None):
        was_training = trainer.model.training
        report = run_eval(_Live(trainer), options, val_sources=trainer.val_sources, prepared=prepared)
        trainer.model.train(was_training)
        if trainer.sinks is not None:
            scalars = {
                f"eval/{task}/{name}": value
                for task, metrics in report["results"].items()
                for name, value in metrics.items()
                if isinstance(value, float)
            }
            trainer.sinks.log(trainer.step, scalars)
        return report

    return hook
