"""Where curation and tokenization run their tasks: local worker processes (the embedded default)
or a Ray cluster, beyond one machine."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

EXECUTORS = ("local", "ray")


def check_executor(executor: str, ray_address: str = "") -> None:
    """A config's `executor` is known and, for Ray, installed, and its `ray_address` has a form Ray
    takes (a ConfigError naming the key)."""
    from marinlm.config import check

    check(executor in EXECUTORS, "executor", f"must be local or ray, got {executor!r}")
    check(
        executor != "ray" or importlib.util.find_spec("ray") is not None,
        "executor",
        "'ray' needs Ray installed: `pip install 'marinlm[ray]'`, or use 'local'",
    )
    check(
        ray_address in ("", "auto", "local") or _ray_head(ray_address) is not None,
        "ray_address",
        f"must be '' (Ray on this machine), 'auto', HOST:PORT or ray://HOST:PORT, got {ray_address!r}",
    )


def _ray_head(address: str) -> tuple[str, int] | None:
    """(host, port) of a HOST:PORT or ray://HOST:PORT address; None for any other form."""
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    host = host.strip("[]")  # [::1]:6379
    return (host, int(port)) if sep and host and port.isdigit() else None


def check_ray_head_reachable(address: str, timeout: float = 5.0) -> None:
    """Raise a ConfigError naming `ray_address` where a HOST:PORT head does not accept a TCP
    connection within `timeout` seconds. Without this, `ray.init` against a head that is not
    running retries for minutes, printing only GCS connection warnings."""
    import socket

    from marinlm.config import ConfigError

    head = _ray_head(address)
    if head is None:
        return
    try:
        socket.create_connection(head, timeout=timeout).close()
    except OSError as e:
        raise ConfigError(
            "ray_address",
            f"no Ray head answers at {head[0]}:{head[1]} ({e.strerror or e}); start one there with "
            f"`ray start --head --port {head[1]}`, or leave ray_address empty to run Ray on this machine",
        ) from None


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


def ray_map(fn: Callable, tasks: Iterable, address: str = "", num_cpus: int | None = None, env: dict | None = None):
    """Yield `fn(task)` for every task, in completion order, from Ray tasks of one CPU each.

    Args:
        address: "" starts Ray on this machine (with `num_cpus`); "auto" or host:port joins a cluster.
        env: environment variables of the Ray workers (e.g. a thread count read at import).
    When the caller stops early (a task's exception, Ctrl-C, leaving the loop) the tasks still
    pending are cancelled.
    """
    import ray

    if not ray.is_initialized():
        check_ray_head_reachable(address)
        ray.init(
            address=address or None,
            include_dashboard=False,
            log_to_driver=False,
            num_cpus=None if address else num_cpus,
        )
    remote = ray.remote(num_cpus=1)(fn)
    if env:
        remote = remote.options(runtime_env={"env_vars": env})
    pending = [remote.remote(task) for task in tasks]
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
