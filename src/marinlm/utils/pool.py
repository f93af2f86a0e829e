"""Local worker processes for curation and tokenization (`process_map`), and one call in a child
process (`call_in_child`). Ray, for work beyond one machine, is in marinlm.data.executors."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool


class WorkerDied(RuntimeError):
    """A worker process ended abruptly (the out-of-memory killer, a crash in native code)."""


def process_map(
    fn: Callable,
    tasks: Iterable,
    workers: int,
    initializer: Callable | None = None,
    initargs: tuple = (),
    spawn: bool = False,
) -> Iterator:
    """Yield `fn(task)` for every task, in completion order, from `workers` spawned processes (in this
    process when workers <= 1, unless `spawn`).

    A worker that dies mid-task is a WorkerDied error at once (multiprocessing.Pool would wait
    for that task forever). When the caller stops early (a task's exception, Ctrl-C, leaving the
    loop) the workers are stopped too, so none outlives the job.
    """
    if workers <= 1 and not spawn:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, tasks)
        return
    executor = ProcessPoolExecutor(
        max(workers, 1),
        mp_context=mp.get_context("spawn"),
        initializer=_start_worker,
        initargs=(os.getpid(), initializer, initargs),
    )
    try:
        futures = [executor.submit(fn, task) for task in tasks]
        for done, future in enumerate(as_completed(futures)):
            try:
                result = future.result()
            except BrokenProcessPool:
                raise WorkerDied(
                    f"a worker process died abruptly (killed, e.g. by the out-of-memory killer?) with "
                    f"{len(futures) - done} of {len(futures)} tasks unfinished; finished work is kept, and "
                    "the same command resumes (fewer workers use less memory)"
                ) from None
            yield result
    except BaseException:  # also GeneratorExit: the caller left the loop
        _stop(executor)
        raise
    executor.shutdown(wait=True)


def _start_worker(parent: int, initializer: Callable | None, initargs: tuple) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="marinlm-parent-watch").start()
    if initializer is not None:
        initializer(*initargs)


def _exit_with_parent(parent: int, every: float = 0.5) -> None:
    """End this worker once its parent is gone. A parent killed outright (SIGKILL, the out-of-memory
    killer) runs no clean-up, and its spawned workers waited for tasks that never came, for good."""
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(1)


def _stop(executor: ProcessPoolExecutor) -> None:
    """Cancel what has not started and end the workers now, not after their current task."""
    # No public handle on the workers before Python 3.14 (terminate_workers).
    processes = list((getattr(executor, "_processes", None) or {}).values())
    manager = getattr(executor, "_executor_manager_thread", None)
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    if manager is not None:  # it sees the workers end, reaps them and closes its queues
        manager.join(timeout=30)
    for process in processes:
        process.join(timeout=10)


def call_in_child(fn: Callable, arg):
    """`fn(arg)` in one spawned process, for native code that holds the main thread and lets Python
    see no signal until it returns (HF tokenizers' training): this process waits in Python, so
    Ctrl-C reaches it at once, and it ends the child."""
    results = process_map(fn, [arg], 1, spawn=True)
    try:
        return next(results)
    finally:
        results.close()  # the worker is stopped now, not when the generator is collected
