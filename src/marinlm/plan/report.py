"""The plan's outputs: a table on the console, plan.json, and plan.md with a chart of per-rank memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from marinlm.plan.allocator import reserved_bytes
from marinlm.utils.io import write_json_atomic, write_text_atomic

GiB = 2**30


def layout_name(plan) -> str:
    d = plan.layout
    parts = [f"{k} {d[k]}" for k in ("dp_replicate", "dp_shard", "cp", "tp", "ep", "pp") if d.get(k, 1) > 1]
    extra = [f"offload {d['offload']}"] if d["offload"] != "none" else []
    extra += [f"AC {d['activation_checkpointing']}"] if d["activation_checkpointing"] != "none" else []
    return " x ".join(parts or ["1 process"]) + (", " + ", ".join(extra) if extra else "")


def verdict(plan, hardware) -> str:
    """The fullest rank's reserved peak against the device's memory (its live peak, where they differ)."""
    live = max(r.device_total for r in plan.ranks)
    room, held = plan.headroom_bytes / GiB, plan.reserved_bytes / GiB
    reserved = "" if plan.allocator_overhead == 1 else f" reserved ({live / GiB:,.1f} GiB live)"
    device = (
        f"fits: {held:,.1f} GiB{reserved} of {hardware.memory_bytes / GiB:,.1f} GiB on the fullest rank, "
        f"{room:,.1f} GiB headroom"
        if plan.fits
        else f"does not fit: {held:,.1f} GiB{reserved} on the fullest rank, "
        f"{-room:,.1f} GiB over the {hardware.memory_bytes / GiB:,.1f} GiB"
    )
    host = f"host {plan.host_per_node_bytes / GiB:,.1f} of {hardware.host_memory_bytes / GiB:,.1f} GiB a node" + (
        "" if plan.host_fits else " (over)"
    )
    return f"{device}; {host}"


def table(plan, hardware) -> str:
    lines = [f"layout: {layout_name(plan)} on {plan.world} x {hardware.name}"]
    for r in plan.ranks:
        experts = f", {r.local_experts} experts" if r.local_experts else ""
        lines.append(f"  rank {r.rank} (stage {r.stage}{experts}): {r.local_parameters / 1e9:,.2f}B parameters")
        for name, value in r.device.items():
            lines.append(f"    device {name:<26}{value / GiB:>10,.2f} GiB")
        lines.append(f"    device {'TOTAL':<26}{r.device_total / GiB:>10,.2f} GiB")
        if plan.allocator_overhead != 1:
            reserved = reserved_bytes(r.device, plan.allocator_overhead)
            lines.append(f"    device {'reserved by the allocator':<26}{reserved / GiB:>10,.2f} GiB")
        for name, value in r.host.items():
            lines.append(f"    host   {name:<26}{value / GiB:>10,.2f} GiB")
    lines.append("  step time:")
    for name, value in plan.step.items():
        lines.append(f"    {name:<33}{value:>10,.2f} s")
    lines.append(f"  {plan.tokens_per_s:,.0f} tokens/s, MFU {100 * plan.mfu:.2f}%")
    traffic = ", ".join(f"{k} {v / 1e9:,.1f} GB" for k, v in plan.traffic.items() if v)
    lines.append(f"  traffic a step per rank: {traffic or 'none'}")
    lines.append(f"  {verdict(plan, hardware)}")
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def chart(plans, path: Path) -> None:
    """Stacked bars of the fullest rank's device memory, one bar a layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = sorted({k for p in plans for r in p.ranks for k in r.device})
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(plans), 4.5))
    bottoms = [0.0] * len(plans)
    for category in categories:
        values = [max(p.ranks, key=lambda r: r.device_total).device.get(category, 0.0) / GiB for p in plans]
        ax.bar(range(len(plans)), values, bottom=bottoms, label=category)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_xticks(range(len(plans)), [layout_name(p).replace(", ", "\n") for p in plans], fontsize=7)
    ax.set_ylabel("GiB on the fullest rank")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(train, hardware, efficiency, chosen, alternatives, out: Path) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plans = [chosen, *alternatives]
    print(table(chosen, hardware), flush=True)
    for i, alt in enumerate(alternatives, 1):
        print(
            f"\nsearch #{i}: {layout_name(alt)}: {alt.step['total']:,.2f} s a step, MFU {100 * alt.mfu:.2f}%; "
            f"{reason(alt, chosen)}",
            flush=True,
        )
    chart(plans, out / "plan.png")
    content = {
        "hardware": dataclasses.asdict(hardware),
        "efficiency": dataclasses.asdict(efficiency),
        "chosen": chosen.to_json(),
        "search": [a.to_json() for a in alternatives],
    }
    write_json_atomic(out / "plan.json", content)
    md = [
        f"# Plan: {train.run_dir} on {chosen.world} x {hardware.name}",
        "",
        "```",
        table(chosen, hardware),
        "```",
        "",
        "![per-rank memory](plan.png)",
        "",
        "Efficiency factors: " + ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(efficiency).items()),
    ]
    if alternatives:
        header = "| layout | step (s) | MFU | fullest rank, reserved (GiB) | why |"
        md += ["", "## Search", "", header, "| --- " * 5 + "|"]
        for alt in alternatives:
            fullest = alt.reserved_bytes / GiB
            md.append(
                f"| {layout_name(alt)} | {alt.step['total']:,.2f} | {100 * alt.mfu:.2f}% | {fullest:,.1f} | "
                f"{reason(alt, chosen)} |"
            )
    write_text_atomic(out / "plan.md", "\n".join(md) + "\n")
    print(f"\nwrote {out / 'plan.md'}, {out / 'plan.json'}, {out / 'plan.png'}", flush=True)
    return content


def reason(alt, chosen) -> str:
    """What separates a layout's step from the chosen one's: the parts that differ most."""
    if alt.layout == chosen.layout:
        return "the configured layout"

    def gap(k):
        return abs(alt.step.get(k, 0.0) - chosen.step.get(k, 0.0))

    parts = sorted((k for k in {*alt.step, *chosen.step} - {"total"} if gap(k) > 0.005), key=gap, reverse=True)[:2]
    said = [f"{k} {alt.step.get(k, 0.0):,.2f} s against {chosen.step.get(k, 0.0):,.2f} s" for k in parts]
    return "; ".join(said)
