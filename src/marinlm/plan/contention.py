"""How much gloo ranks of one thread each slow each other's compute on this machine's shared cores,
measured on the step's own work: the trainer's forward and backward (train/step.py's
`forward_backward`) of a micro-batch, timed alone in this process and then on every rank of a group
at once from a barrier, till the last is done. A synthetic probe that fits in a core's cache
understates it: when ranks take turns on a core each evicts the others' weights and activations,
so a larger model slows more than the ranks over the cores."""

from __future__ import annotations

import os


def _micro_step(train, rows: int):
    """A function running one forward and backward of `rows` rows of the run's model as the trainer
    does (its precision and kernels; rows of packed documents, as the planner's tables time them)."""
    import torch

    from marinlm.plan.cpu_step import _built
    from marinlm.plan.op_table import packed_segments
    from marinlm.train.step import forward_backward

    model, precision = _built(train)
    seq = train.data.seq_len
    ids = torch.randint(0, train.model.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(rows, seq)}
    batch["segment_ids"] = packed_segments(rows, seq)
    how = dict(device=torch.device("cpu"), precision=precision, global_tokens=rows * seq, world_size=1)
    return lambda: forward_backward(model, [batch], **how)


def _group_best_seconds(fn, tries: int = 3) -> float:
    """The best of `tries` runs of `fn()` on every rank of the default group after a warm-up, each
    from a barrier till its slowest rank is done (`op_table.best_seconds` times one process alone)."""
    import time

    import torch
    import torch.distributed as dist

    fn()
    best = float("inf")
    for _ in range(tries):
        dist.barrier()
        start = time.perf_counter()
        fn()
        seconds = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        best = min(best, seconds.item())
    return best


def _worker(rank: int, world: int, store: str, result: str, train, rows: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as torchrun runs each rank
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        seconds = _group_best_seconds(_micro_step(train, rows))
        if rank == 0:
            with open(result, "w") as f:
                f.write(repr(seconds))
    finally:
        dist.destroy_process_group()


_MEASURED: dict[str, float] = {}


def measure_contention(train, world: int, rows: int) -> float:
    """How many times longer one rank's forward and backward of `rows` rows of `train.model` takes
    while `world` gloo ranks of one thread run it at once than alone in this process with one
    thread; never less than `world` over the cores (a rank of one thread runs at most that share
    of the time) nor than 1. Measured once a process for a model, precision and shape."""
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from marinlm.plan.op_table import best_seconds

    if world <= 1:
        return 1.0
    key = repr((train.model, train.kernels, train.train.precision, train.data.seq_len, world, rows))
    if key not in _MEASURED:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            alone = best_seconds(_micro_step(train, rows))
        finally:
            torch.set_num_threads(threads)
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(world, f"{tmp}/store", f"{tmp}/result", train, rows), nprocs=world)
            with open(f"{tmp}/result") as f:
                together = float(f.read())
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        _MEASURED[key] = max(together / alone, world / cores, 1.0)
    return _MEASURED[key]
