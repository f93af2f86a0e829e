"""Progress bars that also read well in a log file.

On a terminal this is a plain `tqdm` bar, redrawn in place. Off a terminal (a Slurm job, CI, `make
quickstart > log`) tqdm would still redraw with carriage returns, many times a second, and a log
file fills with thousands of overwritten bars on one physical line. There the bar is printed as a
whole line instead, at most every `MARINLM_PROGRESS_INTERVAL` seconds (30 by default), plus the
final one. The line carries the same count, rate, ETA and postfix as the bar.
"""

from __future__ import annotations

import os
import sys
import threading

from tqdm import tqdm

INTERVAL_ENV = "MARINLM_PROGRESS_INTERVAL"
DEFAULT_LOG_INTERVAL = 30.0
# A bar drawn `quiet_start` shows only once its work has taken this long: a stage that may take
# minutes on a big model (export, import) says nothing when it is done, or has failed, at once.
QUIET_SECONDS = 2.0


class _Lines:
    """A stream wrapper that turns tqdm's in-place redraws into one line each."""

    def __init__(self, stream):
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line and line != self.last:  # close() redraws the final state once more
            self.stream.write(line + "\n")
            self.last = line

    def flush(self) -> None:
        self.stream.flush()


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def log_interval() -> float:
    raw = os.environ.get(INTERVAL_ENV, "")
    if not raw:
        return DEFAULT_LOG_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV}={raw!r}: expected a number of seconds >= 0") from None
    if value < 0:
        raise ValueError(f"{INTERVAL_ENV}={raw!r}: expected a number of seconds >= 0")
    return value


def progress_bar(*, file=None, quiet_start: bool = False, **kwargs) -> tqdm:
    """`tqdm(**kwargs)` on `file` (stderr by default); whole lines every few seconds off a terminal.
    With `quiet_start`, nothing until the work has taken `QUIET_SECONDS`."""
    stream = sys.stderr if file is None else file
    if quiet_start:
        kwargs.setdefault("delay", QUIET_SECONDS)
    if getattr(tqdm, "_lock", None) is None:
        # tqdm's default lock holds a multiprocessing semaphore, for bars shared across processes
        # (ours never are). A worker process that draws a bar (tokenizer training's child) leaves
        # it behind: "resource_tracker: There appear to be 1 leaked semaphore objects" at exit.
        tqdm.set_lock(threading.RLock())
    if kwargs.get("disable") or is_terminal(stream):
        return tqdm(file=stream, dynamic_ncols=True, **kwargs)
    interval = log_interval()
    # ncols: a log has no width to fit; a fixed one keeps the bar itself short.
    kwargs.setdefault("ncols", 100)
    return tqdm(file=_Lines(stream), mininterval=interval, maxinterval=max(interval, 10.0), **kwargs)


def resumed_line(desc: str, done: int, todo: int) -> str:
    """What a rerun of a resumable job says in place of a bar over only the work left (or none)."""
    left = f"resuming with the other {todo}" if todo else "nothing left to do"
    return f"{desc}: {done} of {done + todo} part(s) done by an earlier run of this job; {left}"
