"""`python tests/fault_inject.py POINT STEP marinlm-args...`: run a marinlm command that SIGKILLs
itself at POINT of step STEP, as a crash or `kill -9` would, for the fault-injection tests.

Points: `step` (after step STEP's update, before it is logged or saved), and points in the save of
checkpoint STEP: `save_start` (the folder and the RNG files written, nothing else), `save_shards`
(the tensors written, no completion marker), `save_marker` (COMPLETE.json written, the folder not yet
renamed), `save_prune` (renamed, older checkpoints not yet pruned). Test-only: the product has no
hook for this; the functions are wrapped here, in the process that runs the command."""

from __future__ import annotations

import os
import signal
import sys

POINTS = ("step", "save_start", "save_shards", "save_marker", "save_prune")


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _saving(path) -> int | None:
    """The step of a checkpoint folder being written (`step-00000006.tmp`), else None."""
    name = os.path.basename(os.fspath(path))
    if name.startswith("step-") and name.endswith(".tmp"):
        return int(name[len("step-") : -len(".tmp")])
    return None


def install(point: str, step: int) -> None:
    from marinlm.train import checkpoint
    from marinlm.train.step import StepWithinMemory

    if point == "step":
        original = StepWithinMemory.__call__

        def step_then_die(self, micro, number, on_retry):
            result = original(self, micro, number, on_retry)
            if number == step:
                _die()
            return result

        StepWithinMemory.__call__ = step_then_die
    elif point in ("save_start", "save_shards"):
        original_save = checkpoint.dcp.save

        def save(tensors, *, checkpoint_id, **kwargs):
            if _saving(checkpoint_id) == step and point == "save_start":
                _die()
            out = original_save(tensors, checkpoint_id=checkpoint_id, **kwargs)
            if _saving(checkpoint_id) == step:
                _die()
            return out

        checkpoint.dcp.save = save
    elif point == "save_marker":
        original_write = checkpoint.write_json_atomic

        def write(path, data, *args, **kwargs):
            original_write(path, data, *args, **kwargs)
            if os.path.basename(path) == "COMPLETE.json" and _saving(os.path.dirname(path)) == step:
                _die()

        checkpoint.write_json_atomic = write
    elif point == "save_prune":
        original_prunable = checkpoint.CheckpointManager._prunable

        def prunable(self):
            if checkpoint.step_dir(self.root, step).is_dir():
                _die()
            return original_prunable(self)

        checkpoint.CheckpointManager._prunable = prunable
    else:
        raise SystemExit(f"unknown fault point {point!r}; the points are {', '.join(POINTS)}")


if __name__ == "__main__":
    install(sys.argv[1], int(sys.argv[2]))
    from marinlm.cli import main

    sys.exit(main(sys.argv[3:]))
