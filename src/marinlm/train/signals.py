"""Stop signals: catching them for the training loop, turning SIGTERM into an exception elsewhere,
and the exceptions they, or a diverged run, leave behind (light to import: the CLI catches them)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable


class StoppedBySignal(Exception):
    """Training ended early on SIGTERM/SIGINT after saving a checkpoint (`Trainer.fit()` reports it in
    its summary; the CLI and the quickstart raise this so the process exits 128 + the signal)."""

    def __init__(self, name: str, step: int, then: str = "the same command resumes from it"):
        super().__init__(f"stopped by {name} with a checkpoint at step {step}; {then}")
        self.name, self.step = name, step


class TrainingDiverged(RuntimeError):
    """Non-finite steps kept coming back after `train.max_rollbacks` rollbacks to one checkpoint,
    each past other batches: the run stops, with its last good checkpoint named, rather than roll
    back for ever."""


class OutOfMemory(RuntimeError):
    """A step ran out of memory and could not be retried smaller; the message names the settings."""


class Terminated(BaseException):
    """SIGTERM (a scheduler's preemption, `kill`) outside the training loop, raised in the main thread
    as Ctrl-C raises KeyboardInterrupt: the command's worker processes are stopped and its partial
    outputs cleaned up on the way out. Left to its default, SIGTERM ended the process on the spot
    and its curation or tokenization workers stayed behind, idle, for good."""


def raise_on_sigterm() -> Callable[[], None]:
    """Make SIGTERM raise `Terminated` in the main thread (off it Python allows no handler: nothing
    changes); returns the function that puts the previous handler back. The training loop's own
    handler (`catch_stop_signals`) takes over while it runs."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_sigterm(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)  # None: one not set from Python, the default here
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def catch_stop_signals(on_stop: Callable[[str], None]) -> dict:
    """SIGTERM (a scheduler's preemption, torchrun passing on Ctrl-C) and SIGINT call `on_stop(name)`,
    so the loop ends the step under way, then saves and stops, instead of losing the steps since the
    last checkpoint. A second SIGINT interrupts at once. Returns the handlers to put back (none off
    the main thread, where Python allows no handler)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def on_signal(signum, frame):
        on_stop(signal.Signals(signum).name)
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    return {signum: signal.signal(signum, on_signal) for signum in (signal.SIGTERM, signal.SIGINT)}
