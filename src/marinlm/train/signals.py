"""The one exception a stop signal leaves behind (light to import: the CLI catches it)."""

from __future__ import annotations


class StoppedBySignal(Exception):
    """Training ended early on SIGTERM/SIGINT after saving a checkpoint (`Trainer.fit()` reports it in
    its summary; the CLI and the quickstart raise this so the process exits 128 + the signal)."""

    def __init__(self, name: str, step: int, then: str = "the same command resumes from it"):
        super().__init__(f"stopped by {name} with a checkpoint at step {step}; {then}")
        self.name, self.step = name, step
