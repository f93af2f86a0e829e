"""Local worker processes: the embedded default executor of curation and tokenization."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterable, Iterator


def process_map(
    fn: Callable, tasks: Iterable, workers: int, initializer: Callable | None = None, initargs: tuple = ()
) -> Iterator:
    """Yield `fn(task)` for every task, in completion order, from `workers` spawned processes (in this
    process when workers <= 1).

    The pool is closed and joined when every result is in, and terminated when the caller stops
    early (a task's exception, Ctrl-C, or leaving the loop), so no worker outlives the job.
    """
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, tasks)
        return
    pool = mp.get_context("spawn").Pool(workers, initializer=initializer, initargs=initargs)
    try:
        yield from pool.imap_unordered(fn, tasks)
    except BaseException:  # also GeneratorExit: the caller left the loop
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()
