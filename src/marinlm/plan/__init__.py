"""`marinlm plan`: a training config's layout planned on a simulated cluster before anyone pays for it.

    marinlm plan configs/train/marin-535b-a23b.yaml --hardware gb200-nvl72
    marinlm plan CONFIG --hardware h100-sxm --layout dp_shard=8,ep=8,pp=24,microbatches=32,ac=full
    marinlm plan CONFIG --hardware gb200-nvl72 --search
    marinlm plan CONFIG --hardware gb200-nvl72 --routing runs/NAME   (or skew=1.0, balanced)

The config's model is built on `meta` under a fake process group of the cluster's size and sharded
by the real `parallelize()` (plan/shards.py); memory and step time follow (plan/estimate.py). The
layout is the config's `parallel` section unless `--layout` overrides it; `--search` ranks others.
`--routing` prices the capacity rule's drops and the slowest receiver from a routing histogram
(plan/routing.py); without it the experts' load is balanced.
Writes plan.json and plan.md (with a chart of per-rank memory) to `--out`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from marinlm.config import ConfigError

LAYOUT_KEYS = {
    "dp_replicate": "data_parallel_replicate",
    "dp_shard": "data_parallel_shard",
    "tp": "tensor_parallel",
    "cp": "context_parallel",
    "ep": "expert_parallel",
    "pp": "pipeline_parallel",
    "schedule": "pipeline_schedule",
    "microbatches": "microbatches",
    "stages_per_rank": "stages_per_rank",
    "offload": "offload",
    "offload_activations": "offload_activations",  # 1 or 0: the checkpointed blocks' inputs on the host
    "ac": "activation_checkpointing",
    "ft": "fault_tolerance",  # replica groups on torchft, planned as HSDP's replicas plus what torchft adds
}


def parse_layout(text: str, base):
    """`base` (a ParallelConfig) with `key=value,...` applied; keys as LAYOUT_KEYS."""
    changes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key not in LAYOUT_KEYS or not value:
            raise ConfigError("--layout", f"{item!r}: give key=value with keys {', '.join(LAYOUT_KEYS)}")
        field = LAYOUT_KEYS[key]
        if field == "offload_activations":
            if value not in ("0", "1", "true", "false"):
                raise ConfigError("--layout", f"{item!r}: give offload_activations=1 or 0")
            changes[field] = value in ("1", "true")
        elif field in ("pipeline_schedule", "offload", "activation_checkpointing"):
            changes[field] = value
        else:
            changes[field] = int(value)
    if "fault_tolerance" in changes:
        from marinlm.parallel import FaultToleranceConfig

        changes["fault_tolerance"] = FaultToleranceConfig(groups=changes["fault_tolerance"])
    return dataclasses.replace(base, **changes)


def world_of(parallel) -> int:
    """The ranks a layout asks for; data_parallel_shard must be given (not -1)."""
    if parallel.data_parallel_shard < 1:
        raise ConfigError("--layout", "give dp_shard (the plan has no launched world to fill): e.g. dp_shard=64")
    return (
        parallel.data_parallel_replicate
        * max(parallel.fault_tolerance.groups, 1)
        * parallel.data_parallel_shard
        * parallel.context_parallel
        * parallel.tensor_parallel
        * parallel.pipeline_parallel
    )


def run_plan(
    train, hardware_name: str, layout: str | None, search: bool, out: Path, gpus: int | None = None, routing=None
) -> dict:
    """Plan `train` (a TrainConfig) and write the report; returns plan.json's content."""
    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency, load_hardware
    from marinlm.plan.report import write_report
    from marinlm.plan.routing import parse_routing
    from marinlm.plan.search import search_layouts

    hardware = load_hardware(hardware_name)
    efficiency = Efficiency()
    parallel = parse_layout(layout, train.parallel) if layout else train.parallel
    world = world_of(parallel)
    loads = parse_routing(routing, train.model.moe.num_experts)
    chosen = plan_layout(train, parallel, world, hardware, efficiency, routing=loads)
    alternatives = search_layouts(train, gpus or world, hardware, efficiency, chosen, routing=loads) if search else []
    return write_report(train, hardware, efficiency, chosen, alternatives, out)
