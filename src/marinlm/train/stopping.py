"""When the training loop stops early or saves on a timer, decided by every rank together."""

from __future__ import annotations

import torch

from marinlm.parallel.distributed import all_reduce_


def agree_to_stop(signal_name: str | None, over_budget: bool, save_due: bool, world: int, device):
    """After a step: the stop signal, whether the time budget is spent and whether a timed save is
    due, agreed by every rank in one collective: ranks that stopped or saved at different steps
    would hang in mismatched collectives (the checkpoint's against the next step's). Each rank's
    clock differs a little; the first one to call a save due decides for all. A rank that got no
    signal takes another's as SIGTERM (torchrun sends every worker the same)."""
    code = 2 if signal_name else int(over_budget)
    if world > 1:
        flags = torch.tensor([code, int(save_due)], dtype=torch.int32, device=device)
        code, save_due = (int(v) for v in all_reduce_(flags, op="max").tolist())
        if code == 2 and signal_name is None:
            signal_name = "SIGTERM"
    return signal_name, code == 1, bool(save_due)
