"""Stop signals: catching them for the training loop, and the one exception they leave behind
(light to import: the CLI catches it)."""

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
