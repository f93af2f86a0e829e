"""LoRA on the routed experts: our grouped LoRA against peft's `target_parameters`.

Peer: peft 0.21's `LoraConfig(target_parameters=[experts.gate_proj, experts.up_proj,
experts.down_proj])`, which adds the whole delta stack B·A ([E, in, out] per projection) to the
weights in every forward. Ours (finetune/adapters.GroupedLoraExperts) applies x·A·B to each expert's
rows through the same grouped GEMM. Both run one forward and backward of the same experts, routing
and adapters, with the base frozen; each in its own process, so that its peak memory (the
high-water mark of its RSS during the steps, above the RSS before them) is its own. Prints time,
peak memory and the ratio.

    python bench/expert_lora.py [--experts 64] [--dim 1024] [--hidden 512] [--tokens 2048] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one(args) -> dict:
    import torch

    import marinlm.finetune  # noqa: F401  (quiets bitsandbytes' import-time warning)
    from marinlm.finetune.adapters import ExpertsBox, GroupedLoraExperts, peft_twin
    from marinlm.model.experts import RoutedExperts

    torch.manual_seed(0)
    experts = RoutedExperts(args.experts, args.dim, args.hidden, 0.02, impl="auto")
    experts.reset_parameters()
    experts.__class__ = GroupedLoraExperts
    experts.add_lora(args.rank, 2.0 * args.rank, 0.0)
    for name, p in experts.named_parameters():
        p.requires_grad_("lora_" in name)  # the base frozen, as fine-tuning (and peft) leaves it
    box = ExpertsBox(experts)
    model = box if args.variant == "grouped" else peft_twin(box)
    x = torch.randn(args.tokens, args.dim)
    experts = torch.stack([torch.randperm(args.experts)[: args.top_k] for _ in range(args.tokens)])
    weights = torch.rand(args.tokens, args.top_k)
    times = []
    # The high-water mark restarts here (Linux: "5" to clear_refs), or set-up's peak would hide the step's.
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kb("VmRSS")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        model(x.requires_grad_(), experts, weights).square().mean().backward()
        times.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(times), "peak_mb": (_status_kb("VmHWM") - before) / 1024}


def _status_kb(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", choices=["grouped", "peft"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(one(args)))
        return
    results = {}
    for variant in ("grouped", "peft"):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
        results[variant] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    g, p = results["grouped"], results["peft"]
    delta_mb = 3 * args.experts * args.dim * args.hidden * 4 / 2**20
    print(
        f"experts E={args.experts} D={args.dim} F={args.hidden}, {args.tokens} tokens x top-{args.top_k}, rank "
        f"{args.rank}, fp32 forward+backward (the three delta stacks peft builds: {delta_mb:.0f} MB)"
    )
    print(f"{'':<10} {'seconds':>8} {'peak MB':>8}")
    print(f"{'grouped':<10} {g['seconds']:>8.3f} {g['peak_mb']:>8.0f}")
    print(f"{'peft':<10} {p['seconds']:>8.3f} {p['peak_mb']:>8.0f}")
    memory = p["peak_mb"] / max(g["peak_mb"], 1)
    print(f"peft / grouped: time {p['seconds'] / g['seconds']:.2f}x, peak memory {memory:.2f}x")


if __name__ == "__main__":
    main()
