"""Hardware profiles (`configs/hardware/NAME.yaml`) and the efficiency factors of the step-time model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from marinlm.config import ConfigError, load_config

HARDWARE_DIR = Path(__file__).resolve().parents[1] / "configs" / "hardware"


@dataclass(kw_only=True)
class Hardware:
    """One accelerator and the machine around it; bandwidths are bytes/s one way, per GPU."""

    name: str
    peak_bf16_flops: float
    memory_bytes: float
    memory_bandwidth: float
    nvlink_bandwidth: float
    gpus_per_nvlink_domain: int
    network_bandwidth: float
    gpus_per_node: int
    host_memory_bytes: float
    host_link_bandwidth: float


@dataclass(kw_only=True)
class Efficiency:
    """The fractions of peak the step-time model assumes: one set for every layout and machine.

    Chosen so that the two public Marin runs come out within their stated error (docs/distributed.md
    shows the comparison): with two runs to fit, these are a calibration, not a prediction.
    """

    compute: float = 0.40  # model FLOPs over peak bf16 FLOPs in the GEMMs and attention
    all_to_all: float = 0.45  # expert all-to-all over the link's one-way bandwidth (not overlapped)
    collectives: float = 0.70  # FSDP all-gather / reduce-scatter, TP, HSDP all-reduce, pipeline sends
    overlap: float = 0.80  # the share of FSDP/HSDP traffic hidden behind compute
    host_link: float = 0.70  # optimizer-state copies to and from host memory (not overlapped)


def hardware_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(name: str) -> Hardware:
    """A shipped profile by name, or a YAML file of the same keys."""
    path = Path(name)
    if not path.suffix:
        path = HARDWARE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("--hardware", f"{name!r} is not a hardware profile; shipped: {', '.join(hardware_names())}")
    return load_config(Hardware, str(path), [])
