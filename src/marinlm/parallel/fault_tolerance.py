"""Fault-tolerant replica groups on torchft: the `dp_replicate` axis as groups that come and go.

With `parallel.fault_tolerance.groups: N`, N torchrun jobs (replica groups) train one model. Each
is a whole layout of its own (FSDP2, TP, EP, PP, CP inside, over its own process group) and reads
its own share of every global batch. Across groups, a torchft `Manager` takes a quorum each step
with the groups that are alive, averages gradients (and the loss sums and router statistics) over
them, and commits the step only where the whole quorum agrees (`should_commit`). A group that is
gone for a step leaves its share of that step's rows untrained (skipped, not read by another);
the loss is normalised over the rows that were trained. A group that comes back joins the next
quorum and is sent the model, optimizer state, router biases, schedule and data position by a
live peer (torchft's HTTP checkpoint transport), rank by rank: group rank r of one group holds the
same shards as group rank r of any other.

The groups find each other through torchft's lighthouse (`torchft_lighthouse`, in its wheel); see
docs/distributed.md. Step by step, in `Trainer.fit`: `begin_step` (quorum, and healing if behind),
the micro-batches, `train_step(..., replicas=...)`, which calls `all_reduce_`, `average_gradients`
and `should_commit` here.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from marinlm.parallel.distributed import reduce_together
from marinlm.utils.errors import LighthouseLost

_OPS = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN, "avg": ReduceOp.AVG}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_state(model: torch.nn.Module, optimizer) -> dict:
    """This rank's shards of the model's state (weights and buffers: the router biases among them)
    and of the optimizer's, as plain tensors keyed by name: what a peer at the same group rank,
    under the same layout, loads bitwise (`load_local_state`)."""
    names = {p: n for n, p in model.named_parameters()}
    # Not copied: torchft serves them until the step's commit vote, and nothing changes them before it.
    return {
        "model": {k: _local(v).detach() for k, v in model.state_dict().items()},
        "optim": {
            names[p]: {k: _local(v).detach() for k, v in s.items()} for p, s in optimizer.state.items() if p in names
        },
    }


@torch.no_grad()
def load_local_state(model: torch.nn.Module, optimizer, state: dict) -> None:
    """Copy a peer's `local_state` into this rank's shards; optimizer state not made yet (a group
    that has not stepped) is made as the optimizer would make it, then filled."""
    own = model.state_dict()
    if own.keys() != state["model"].keys():
        missing, extra = own.keys() - state["model"].keys(), state["model"].keys() - own.keys()
        raise ValueError(f"a peer's model state differs: missing {sorted(missing)[:5]}, extra {sorted(extra)[:5]}")
    for k, t in own.items():
        _local(t).copy_(state["model"][k])
    params = dict(model.named_parameters())
    optimizer.state.clear()
    for name, saved in state["optim"].items():
        p = params[name]
        slot = optimizer.state[p]
        for k, v in saved.items():
            shaped = v.dim() > 0 and v.shape == _local(p).shape
            slot[k] = torch.zeros_like(p, dtype=v.dtype) if shaped else torch.empty_like(v)
            _local(slot[k]).copy_(v)


def _manager(config, lighthouse: str, rank: int, world: int, state_dict, load_state_dict):
    """torchft's Manager for this rank of group `config.group` (torchft is imported only here: it is
    an optional dependency, `pip install marinlm[ft]`)."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.http_transport import HTTPTransport

    timeout = timedelta(seconds=config.timeout_s)
    return Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=config.min_groups,
        use_async_quorum=False,  # a recovering group is healed before its first forward
        timeout=timeout,
        quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
        connect_timeout=timeout,
        rank=rank,
        world_size=world,
        lighthouse_addr=lighthouse,
        replica_id=f"marinlm_group_{config.group}",
        checkpoint_transport=HTTPTransport(timeout=timeout, num_chunks=0),
        init_sync=True,  # at step 0 every group takes one group's weights
    )


class ReplicaGroups:
    """This rank's view of the replica groups: the torchft Manager and what the trainer asks of it.

    `state_dict`/`load_state_dict`: what a recovering peer receives and how it is applied (the
    trainer's, called by torchft on the main thread before the step that needs it)."""

    def __init__(self, config, rank: int, world: int, state_dict, load_state_dict):
        self.config = config
        lighthouse = config.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise ValueError(
                "parallel.fault_tolerance.lighthouse: give the lighthouse's address (http://HOST:PORT), or set "
                "TORCHFT_LIGHTHOUSE; start one with `torchft_lighthouse --min_replicas 1` (docs/distributed.md)"
            )
        self.lighthouse = lighthouse
        self.quorum_s = 0.0  # time in quorum and recovery, this step
        self.quorum_total_s = 0.0  # and over the run
        self.committed_steps = 0  # steps this group committed
        self.failure: dict | None = None  # the last step not committed, until the next quorum's time is added
        self._pending_heal = False
        self._taken = False

        def load(state):
            load_state_dict(state)
            self._pending_heal = True

        try:
            self.manager = _manager(config, lighthouse, rank, world, state_dict, load)
        except RuntimeError as e:  # rank 0's manager server could not reach the lighthouse
            raise LighthouseLost(
                f"parallel.fault_tolerance.lighthouse: no lighthouse answered at {lighthouse} ({e}); start one "
                "(`torchft_lighthouse --min_replicas 1`, docs/distributed.md) or give its address"
            ) from None

    def join(self) -> bool:
        """The first quorum, taken as the run is set up and kept for its first step; True when live
        peers were ahead and this group now holds their state (nothing to resume from storage)."""
        healed = self.begin_step()
        # A fresh start (or the whole job restarting) waits for every group, so that each trains
        # from the same first step; the lighthouse forms a new quorum as each one arrives.
        deadline = time.monotonic() + self.config.quorum_timeout_s
        while self.manager.current_step() == 0 and self.participants < self.config.groups:
            if time.monotonic() > deadline:
                print(
                    f"note: {self.participants} of {self.config.groups} replica groups joined within "
                    f"{self.config.quorum_timeout_s:g} s; training with them, the others join when they come",
                    flush=True,
                )
                break
            time.sleep(0.5)
            healed = self.begin_step() or healed
        self._taken = True
        return healed and self.manager.current_step() > 0

    def resumed(self, step: int) -> None:
        """The run resumed from its own checkpoint at `step` (every group did, after the whole job
        stopped): the manager counts from there, and the first step takes a quorum of its own."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self._taken = False

    def begin_step(self) -> bool:
        """The quorum for the next step (blocking); True when this group was behind and has just
        been given a peer's state (model, optimizer, schedule, data position)."""
        if self._taken:  # the quorum `join` took
            self._taken = False
            return False
        t0 = time.perf_counter()
        try:
            self.manager.start_quorum()
        except Exception as e:  # the lighthouse gone, or no quorum within quorum_timeout_s
            raise LighthouseLost(
                f"no quorum of replica groups through the lighthouse at {self.lighthouse} within "
                f"{self.config.quorum_timeout_s:g} s ({type(e).__name__}: {e}): the run stops here; its last "
                "checkpoint resumes exactly with --resume auto once a lighthouse is up"
            ) from None
        self.quorum_s = time.perf_counter() - t0
        self.quorum_total_s += self.quorum_s
        healed, self._pending_heal = self._pending_heal, False
        return healed

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place over the groups in this step's quorum (a failed peer leaves garbage here and
        makes `should_commit` answer False, so nothing reduced in a failed step is applied)."""
        self.manager.allreduce(tensor, reduce_op=_OPS[op]).wait()
        return tensor

    def average_gradients(self, params: list[torch.Tensor]) -> None:
        """Each gradient (this rank's shard) averaged over the groups: one flat buffer a dtype."""
        reduce_together([_local(p.grad) for p in params], lambda flat: self.all_reduce_(flat, "avg"))

    def should_commit(self) -> bool:
        committed = self.manager.should_commit()
        self.committed_steps += committed
        return committed

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
