"""The device memory a step reserves: its allocations replayed through PyTorch's CUDA caching allocator.

PyTorch keeps freed device memory in pools of its own for reuse (c10/cuda/CUDACachingAllocator.cpp). What a
run holds from the driver (`torch.cuda.max_memory_reserved`) is the peak of those pools, more than the peak of
live tensors by each tensor's rounding and by the free pieces that no later request fits. The plan's memory
(plan/estimate.py) is the live peak; the reserved peak is that times the allocator's overhead on the step.

The fragmentation model, stated: torch's default rules (no `expandable_segments`, `max_split_size_mb` or
garbage-collection threshold; one stream), replayed on the step's allocations and frees in their order:
- a request is rounded up to a multiple of 512 bytes; up to 1 MiB it is served from the small pool, above from
  the large;
- it takes the smallest free block of its pool that holds it (the lowest address among equals), split when what
  is left is at least 512 bytes (small pool) or more than 1 MiB (large);
- failing that, a new segment from the driver: 2 MiB for a small request, 20 MiB for one under 10 MiB, else the
  request rounded up to 2 MiB;
- a freed block merges with free neighbours of its segment. Segments go back to the driver only when a request
  would pass the device's memory: then every wholly free segment is released and the request tried again.

The step's allocations are those of one forward and backward of the proxy (plan/activations.py's, at the
model's depth): every storage an operation creates, in order, and when it dies. Each is scaled to the rank as
its size reads: bytes a token of a width (a saved tensor's classes, times the rank's tokens), a weight's
elements (a gradient, a cast copy: times the rank's full weight), or kept as it is (a few bytes of scalars).
What the proxy does not run is not in the replay: parallel layouts' buffers (FSDP2's gathered blocks, the
all-to-all rows), the optimizer step, pipeline schedules and tensor-parallel shards. Their bytes are in the
live peak and take the step's overhead. tests/test_plan_allocator.py checks the rules, the recorder against
torch's MemTracker, and the trace scaled from the proxy against the trace of the real model at its own size.
"""

from __future__ import annotations

import bisect
import math
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MIN_BLOCK = 512
SMALL = 1 << 20  # the small pool's largest request
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20  # for large requests under MIN_LARGE
MIN_LARGE = 10 << 20
ROUND_LARGE = 2 << 20


class _Block:
    __slots__ = ("addr", "size", "free", "prev", "next", "small")

    def __init__(self, addr: int, size: int, small: bool, prev=None, next=None):
        self.addr, self.size, self.small, self.free, self.prev, self.next = addr, size, small, True, prev, next


class CachingAllocator:
    """The rules above, as a ledger of bytes. `capacity`: the device's memory (infinite: never release)."""

    def __init__(self, capacity: float = math.inf):
        self.capacity = capacity
        self.pools: dict[bool, list] = {True: [], False: []}  # free blocks, sorted by (size, address)
        self.live: dict = {}
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.out_of_memory = 0  # requests the device could not hold even after releasing
        self._top = 0

    def malloc(self, key, nbytes: int) -> None:
        size = max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)
        small = size <= SMALL
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        block = pool.pop(i)[2] if i < len(pool) else self._segment(size, small)
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL:
            tail = _Block(block.addr + size, rest, small, block, block.next)
            if block.next:
                block.next.prev = tail
            block.next, block.size = tail, size
            bisect.insort(pool, (tail.size, tail.addr, tail))
        block.free = False
        self.live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key) -> None:
        block = self.live.pop(key)
        self.allocated -= block.size
        block.free = True
        pool = self.pools[block.small]
        for side in (block.prev, block.next):
            if side is not None and side.free:
                pool.remove((side.size, side.addr, side))
                if side is block.prev:
                    side.size += block.size
                    side.next = block.next
                    if block.next:
                        block.next.prev = side
                    block = side
                else:
                    block.size += side.size
                    block.next = side.next
                    if side.next:
                        side.next.prev = block
        bisect.insort(pool, (block.size, block.addr, block))

    def _segment(self, size: int, small: bool) -> _Block:
        grant = SMALL_SEGMENT if small else LARGE_SEGMENT if size < MIN_LARGE else -(-size // ROUND_LARGE) * ROUND_LARGE
        if self.reserved + grant > self.capacity:
            for pool in self.pools.values():  # release every wholly free segment, then try again
                whole = [entry for entry in pool if entry[2].prev is None and entry[2].next is None]
                for entry in whole:
                    pool.remove(entry)
                    self.reserved -= entry[0]
            self.out_of_memory += self.reserved + grant > self.capacity
        block = _Block(self._top, grant, small)
        self._top += grant
        self.reserved += grant
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block


def replay(events, capacity: float = math.inf) -> CachingAllocator:
    """`events`: ("alloc", key, bytes) and ("free", key), in order."""
    allocator = CachingAllocator(capacity)
    for event in events:
        if event[0] == "alloc":
            allocator.malloc(event[1], int(event[2]))
        elif event[1] in allocator.live:
            allocator.free(event[1])
    return allocator


class Recorder(TorchDispatchMode):
    """Every storage an operation creates while the mode is on (not a view of its inputs', nor one that existed
    before), with its size and element count, and when it dies: `events`, ("alloc", key, bytes, elements,
    element size) and ("free", key)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple] = []
        self._keys = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in inputs or getattr(storage, "_recorded", False):
                continue
            storage._recorded = True
            key, self._keys = self._keys, self._keys + 1
            self.events.append(("alloc", key, storage.nbytes(), t.numel(), t.element_size()))
            weakref.finalize(storage, self.events.append, ("free", key))
        return out


def record_step(model, ids: torch.Tensor, segments: torch.Tensor, precision: str) -> list[tuple]:
    """The allocations of one training forward and backward of `model` (parameters existing before)."""
    for p in [*model.parameters(), *model.buffers()]:
        p.untyped_storage()._recorded = True
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with Recorder() as recorder:
        with autocast:
            out = model(ids, segments, labels=ids, return_logits=False)
        out.loss.backward()
        del out
        return list(recorder.events)  # the gradients' frees, later, are not the step's


@dataclass
class StepTrace:
    """A step's allocations, each as bytes a token of a width class, bytes an element of a weight (by
    `weight_key`), or bytes as they are: ("alloc", key, how, amount) with `how` the class ("width:NAME",
    "weight:NAME" or "fixed"), and ("free", key)."""

    events: list[tuple]

    def at(self, table: dict[str, float], tokens: float, weights: dict[str, int]) -> list[tuple]:
        """The events with sizes for a rank of `tokens` tokens a forward, weight elements `weights` and widths
        `table` (`rank_widths`)."""
        sized = []
        for event in self.events:
            if event[0] == "free":
                sized.append(event)
                continue
            _, key, how, amount = event
            kind, _, name = how.partition(":")
            if name == "loss_chunk":  # a chunk of the loss's tokens, whatever the rank's count
                scale = min(table["loss_chunk_tokens"] or tokens, tokens) * table["vocab"]
            else:
                scale = table[name] * tokens if kind == "width" else weights.get(name, 0) if kind == "weight" else 1
            sized.append(("alloc", key, amount * scale))
        return sized


def step_trace(
    config, precision: str, kernels=None, kernels_device: str = "cpu", checkpointing: str = "none", every_n: int = 2
) -> StepTrace:
    """The allocations of a training forward and backward of `config`'s proxy at its depth, its blocks
    checkpointed as `checkpointing` says, each filed by what its size is a multiple of (`StepTrace`)."""
    from marinlm.parallel.activation_checkpoint import apply_activation_checkpointing
    from marinlm.plan.activations import build_proxy, packed_segments, weight_key, width_class, widths

    model, c, T = build_proxy(config, precision, kernels, kernels_device, depth=True)
    apply_activation_checkpointing(model, checkpointing, every_n)
    B = 2
    N, table = B * T, dict(widths(c, T), vocab=c.vocab_size)  # logits: a token's, or a loss chunk's
    chunk = getattr(model.loss, "chunk_tokens", 0) * c.vocab_size
    ids = torch.randint(0, c.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    numels = {}
    for name, p in model.named_parameters():
        numels.setdefault(p.numel(), weight_key(name))
    events = []
    for event in record_step(model, ids, packed_segments(B, T), precision):
        if event[0] == "free":
            events.append(event)
            continue
        _, key, nbytes, elements, size = event
        name = width_class(elements, nbytes / size, B, T, table, c.sconv.kernel_size)
        if name is not None:
            events.append(("alloc", key, f"width:{name}", nbytes / N / table[name]))
        elif chunk and elements % chunk == 0 and elements // chunk <= 4:
            events.append(("alloc", key, "width:loss_chunk", nbytes / chunk))
        elif nbytes // size in numels:
            events.append(("alloc", key, f"weight:{numels[nbytes // size]}", size))
        else:
            events.append(("alloc", key, "fixed", nbytes))
    return StepTrace(events)


def rank_widths(config, seq_len: int, loss_chunk_tokens: int) -> dict[str, float]:
    """The widths a trace's sizes are multiples of, for `config` at `seq_len` with the loss in chunks of
    `loss_chunk_tokens` tokens (0: whole)."""
    from marinlm.plan.activations import widths

    return dict(widths(config, seq_len), vocab=config.vocab_size, loss_chunk_tokens=loss_chunk_tokens)


def weight_elements(config) -> dict[str, int]:
    """{weight_key: elements} of `config`'s weights (a block's as layers.#.*)."""
    from marinlm.model import MarinForCausalLM
    from marinlm.plan.activations import weight_key

    with torch.device("meta"):
        model = MarinForCausalLM(config)
    return {weight_key(name): p.numel() for name, p in model.named_parameters()}


_TRACES: dict = {}  # a process plans many layouts of one model


def overhead(config, precision: str, kernels, kernels_device: str, tokens: float, seq_len: int, parallel) -> float:
    """Reserved peak over allocated peak of `config`'s step (`step_trace`, checkpointed as `parallel` says) at
    a rank's `tokens` a forward, its weights whole (as FSDP2 gathers them) but its experts 1/ep of them."""
    from marinlm.kernels.config import KernelConfig

    kernels = kernels or KernelConfig()
    ep, checkpointing = parallel.expert_parallel, (parallel.activation_checkpointing, parallel.checkpoint_every_n)
    key = (repr(config), precision, repr(kernels), kernels_device, checkpointing)
    if key not in _TRACES:
        trace = step_trace(config, precision, kernels, kernels_device, *checkpointing)
        _TRACES[key] = (trace, weight_elements(config), {})
    trace, weights, factors = _TRACES[key]
    if (tokens, seq_len, ep) not in factors:  # a search's layouts share a few rank shapes
        weights = {name: n / ep if ".experts." in name else n for name, n in weights.items()}
        allocator = replay(trace.at(rank_widths(config, seq_len, kernels.loss_chunk_tokens), tokens, weights))
        factors[tokens, seq_len, ep] = allocator.peak_reserved / max(allocator.peak_allocated, 1)
    return factors[tokens, seq_len, ep]


PERSISTENT = ("weights", "optimizer_state")  # allocated once, before any step: packed without holes


def reserved_bytes(device: dict[str, float], factor: float) -> float:
    """A rank's reserved peak: its persistent tensors, and the rest of its live peak times the step's `factor`."""
    persistent = sum(device.get(name, 0.0) for name in PERSISTENT)
    return persistent + (sum(device.values()) - persistent) * factor
