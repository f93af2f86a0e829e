"""The trainer's side of fault-tolerant replica groups (parallel/fault_tolerance.py): what a
recovering group is sent, how it takes it, and what the run reports of its groups.

A group's run folder is `RUN/replica-G`: each keeps its own checkpoints, metrics and lock (a
group resumes from its own folder after the whole job stopped; a group that dies alone is healed
by a live peer instead, and reads nothing from storage).
"""

from __future__ import annotations

import time

from marinlm.parallel.fault_tolerance import ReplicaGroups, load_local_state, local_state


def join_replica_groups(trainer) -> ReplicaGroups:
    """The trainer's `ReplicaGroups`, with the state a peer sends: this rank's shards of the
    model and optimizer, the step, the schedule's position and the data position (the loader's
    position counts the global batch's rows, the same in every group)."""

    def state() -> dict:
        return local_state(trainer.model, trainer.optimizer) | {
            "trainer": {
                "step": trainer.step,
                "bad_steps": trainer.state.bad_steps,
                "scheduler": trainer.scheduler.state_dict(),
                "loader": trainer.loader.state_dict(),
            }
        }

    def load(state: dict) -> None:
        load_local_state(trainer.model, trainer.optimizer, state)
        t = state["trainer"]
        trainer.step, trainer.state.bad_steps = t["step"], t["bad_steps"]
        trainer.checkpointing.load_schedule_position(t["scheduler"])
        trainer.loader.load_state_dict(t["loader"])
        if t["step"]:
            trainer.state.events.append({"step": t["step"], "event": "healed_from_peer"})
            trainer.report.event(f"group {trainer.config.parallel.fault_tolerance.group} took a live peer's state")

    info = trainer.info
    if not info.launched:
        raise ValueError(
            "parallel.fault_tolerance: a replica group runs under torchrun (even with one rank), whose store "
            "the groups' manager uses; launch each group with torchrun (docs/distributed.md)"
        )
    return ReplicaGroups(trainer.config.parallel.fault_tolerance, info.rank, info.world_size, state, load)


def count_step(trainer, result, started: float) -> bool:
    """Count a step the replica groups ran (from `started`); False when it was not committed (a
    group failed in it: nothing applied, its batch skipped). A failure costs its own step's time
    and the next quorum's, in which the groups regroup without the lost one."""
    replicas = trainer.replicas
    if replicas.failure is not None:
        replicas.failure["seconds"] += replicas.quorum_s
        replicas.failure = None
    if result.committed:
        return True
    failure = {"step": trainer.step + 1, "event": "not_committed", "seconds": time.perf_counter() - started}
    trainer.state.events.append(failure)
    replicas.failure = failure
    trainer.report.event(
        f"step {trainer.step + 1} not committed by the replica groups (one failed): its batch is skipped"
    )
    return False


def replica_scalars(trainer, result) -> dict[str, float]:
    """Each step's record: the groups that trained it, the rows they contributed and the time the
    quorum (and any recovery) took."""
    rows = trainer.micro_batch * trainer.accum * trainer.data_world
    return {
        "ft/groups": result.groups,
        "ft/rows": rows * result.groups,
        "ft/quorum_s": trainer.replicas.quorum_s,
        "ft/wall_time": time.time(),  # the groups' step logs side by side (gaps, goodput)
    }


def replica_summary(trainer, seconds: float) -> dict:
    """The run's goodput (committed steps per wall-clock hour), each failure's step and the
    seconds it cost this group, the steps at which it was healed, and its time in quorums."""
    events = trainer.state.events
    return {
        "goodput_steps_per_hour": trainer.replicas.committed_steps / max(seconds, 1e-9) * 3600,
        "committed_steps": trainer.replicas.committed_steps,
        "failures": [{"step": e["step"], "seconds": e["seconds"]} for e in events if e["event"] == "not_committed"],
        "healed_at_steps": [e["step"] for e in events if e["event"] == "healed_from_peer"],
        "quorum_seconds": trainer.replicas.quorum_total_s,
    }


def replica_report(summary: dict) -> str:
    """The run's closing line about its replica group (`replica_summary`)."""
    failures = "; ".join(f"step {f['step']} cost {f['seconds']:.1f} s" for f in summary["failures"]) or "none"
    healed = ", ".join(map(str, summary["healed_at_steps"])) or "never"
    return (
        f"replica group: {summary['committed_steps']} committed steps, goodput "
        f"{summary['goodput_steps_per_hour']:,.0f} steps/h; failures: {failures}; healed from a peer at step: "
        f"{healed}; {summary['quorum_seconds']:.1f} s in quorums"
    )
