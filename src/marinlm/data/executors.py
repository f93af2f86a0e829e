"""Where curation and tokenization run their tasks: local worker processes (`process_map`, in
marinlm.utils.pool) or a Ray cluster, beyond one machine (`ray_map`); and the check of a config's
`executor` and `ray_address`."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable

from marinlm.config import ConfigError, check

EXECUTORS = ("local", "ray")


def check_executor(executor: str, ray_address: str = "") -> None:
    """A config's `executor` is known and, for Ray, installed, and its `ray_address` has a form Ray
    takes (a ConfigError naming the key)."""
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
