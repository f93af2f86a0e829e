"""The curation report: what happened to every document, as JSON, markdown and an attrition chart."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from marinlm.data.filters import NO_LANGUAGE
from marinlm.utils.io import write_json_atomic, write_text_atomic


class AccountingError(RuntimeError):
    """Documents went missing: read != kept + dropped + rejected."""


def _merge(stage1: list[dict]) -> tuple[list[str], dict]:
    """Sum per-shard step stats; return step names in pipeline order and the merged stats."""
    order: list[str] = []
    merged: dict[str, dict] = {}
    for shard in stage1:
        for step, stats in shard["stats"].items():
            if step not in order:
                order.append(step)
            m = merged.setdefault(
                step,
                {
                    "docs_in": defaultdict(int),
                    "bytes_in": defaultdict(int),
                    "docs_out": defaultdict(int),
                    "bytes_out": defaultdict(int),
                    "dropped": defaultdict(lambda: defaultdict(int)),
                    "counters": defaultdict(int),
                },
            )
            for key in ("docs_in", "bytes_in", "docs_out", "bytes_out"):
                for source, v in stats[key].items():
                    m[key][source] += v
            for source, reasons in stats["dropped"].items():
                for reason, v in reasons.items():
                    m["dropped"][source][reason] += v
            for key, v in stats["counters"].items():
                m["counters"][key] += v
    return order, merged


def write_report(out: Path, config, tasks, stage1, summary, stage3, seconds: float, notes=(), fitted=None) -> dict:
    order, merged = _merge(stage1)
    sources = [s.name for s in config.sources]
    steps = []
    for name in order:
        m = merged[name]
        steps.append(
            {
                "step": name,
                "by_source": {
                    s: {
                        "docs_in": m["docs_in"].get(s, 0),
                        "docs_out": m["docs_out"].get(s, 0),
                        "bytes_in": m["bytes_in"].get(s, 0),
                        "bytes_out": m["bytes_out"].get(s, 0),
                        "dropped": dict(m["dropped"].get(s, {})),
                    }
                    for s in sources
                },
                "counters": dict(m["counters"]),
            }
        )
    dedup_dropped: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for shard in stage3:
        for source, reasons in shard["dropped"].items():
            for reason, v in reasons.items():
                dedup_dropped[source][reason] += v
    after_filters = {s: sum(sh["docs"] for sh in stage1 if sh["source"] == s) for s in sources}
    kept = {s: after_filters[s] - sum(dedup_dropped[s].values()) for s in sources}
    bytes_in = {s: sum(sh["bytes_in"].get(s, 0) for sh in stage3) for s in sources}
    bytes_kept = {s: sum(sh["bytes_kept"].get(s, 0) for sh in stage3) for s in sources}
    steps.append(
        {
            "step": "dedup",
            "by_source": {
                s: {
                    "docs_in": after_filters[s],
                    "docs_out": kept[s],
                    "bytes_in": bytes_in[s],
                    "bytes_out": bytes_kept[s],
                    "dropped": dict(dedup_dropped[s]),
                }
                for s in sources
            },
            "counters": {
                "exact_duplicates": summary["exact_duplicates"],
                "fuzzy_duplicates": summary["fuzzy_duplicates"],
                "paragraphs_removed": summary["paragraphs_removed"],
            },
        }
    )
    emitted = defaultdict(int)
    out_bytes = defaultdict(int)
    for shard in stage3:
        for source, v in shard["by_source"].items():
            emitted[source] += v["docs"]
            out_bytes[source] += v["bytes"]

    accounting, problems = {}, []
    for s in sources:
        read = next(st for st in steps if st["step"] == "read")["by_source"][s]
        rejected = sum(v for r, v in read["dropped"].items())
        dropped = sum(sum(st["by_source"][s]["dropped"].values()) for st in steps if st["step"] != "read")
        accounting[s] = {
            "in": read["docs_in"],
            "kept": kept[s],
            "dropped": dropped,
            "rejected": rejected,
            "output_documents": emitted[s],
            "output_bytes": out_bytes[s],
        }
        if read["docs_in"] != kept[s] + dropped + rejected:
            problems.append(f"{s}: in {read['docs_in']} != kept {kept[s]} + dropped {dropped} + rejected {rejected}")

    warnings = []
    for s, loss in summary["fuzzy_by_source"].items():
        if loss["fraction"] > config.dedup.warn_source_loss:
            warnings.append(
                f"fuzzy dedup removed {loss['fraction']:.0%} of source '{s}' ({loss['removed']} of "
                f"{loss['documents']} documents): templated text may be over-merged; check "
                f"dropped/dedup/ before trusting it"
            )
    warnings += _unjudged_warnings(config, steps)
    warnings += _empty_source_warnings(out, steps, accounting)
    report = {
        "seconds": round(seconds, 2),
        "sources": sources,
        "accounting": accounting,
        "steps": steps,
        "dedup": summary,
        "warnings": warnings,
        "shards": len(tasks),
        "input_files": len({task["path"] for task in tasks}),
        "input_notes": list(notes),  # files and folders skipped, big files read whole
    }
    fitted = fitted or {}
    if "quality" in fitted:
        report["classifier"] = {**fitted["quality"], "levels": summary["quality_levels"]}
    if "topics" in fitted:
        counts = summary["topics"] or {}
        clusters = [{**c, "documents": counts.get(str(c["topic"]), 0)} for c in fitted["topics"]["clusters"]]
        report["topics"] = {"sampled": fitted["topics"]["sampled"], "clusters": clusters}
    if summary.get("cells"):
        report["cells"] = summary["cells"]
    write_json_atomic(out / "report.json", report)
    write_text_atomic(out / "report.md", _markdown(report))
    _chart(out / "report.png", steps, sources)
    if problems:
        raise AccountingError("document accounting does not add up: " + "; ".join(problems))
    return report


# The config section that sets each step, for the warning about a source that kept nothing.
_STEP_SETTINGS = {
    "normalize": "min_doc_chars",
    "langid": "langid",
    "gopher_quality": "quality.gopher_quality",
    "gopher_repetition": "quality.gopher_repetition",
    "c4_lines": "quality.c4",
    "c4_document": "quality.c4",
    "fineweb_quality": "quality.fineweb",
    "decontaminate": "decontam",
    "quality_classifier": "classifier.threshold",
    "dedup": "dedup",
}


def _unjudged_warnings(config, steps: list[dict]) -> list[str]:
    """The quality filters judge only `quality.languages`; with langid off, documents may have no language."""
    unjudged = {st["step"]: st["counters"].get(NO_LANGUAGE, 0) for st in steps}
    unjudged = {name: n for name, n in unjudged.items() if n}
    if not unjudged:
        return []
    return [
        f"{', '.join(unjudged)} passed over {max(unjudged.values())} documents unjudged: they have no language "
        f"(langid is disabled and their records have no `language` field) and these filters judge only "
        f"quality.languages={config.quality.languages}; set quality.languages: [] to judge every document, or "
        f"enable langid"
    ]


def _empty_source_warnings(out: Path, steps: list[dict], accounting: dict) -> list[str]:
    """One warning per source that read documents and wrote none, naming the step that dropped the most."""
    warnings = []
    for s, a in accounting.items():
        if a["in"] == 0:
            warnings.append(f"source '{s}' read no documents: its input files hold no records")
            continue
        if a["output_documents"] > 0:
            continue
        if a["kept"] > 0:
            warnings.append(
                f"source '{s}' kept {a['kept']} documents but the mixture wrote none of them: check its "
                f"weight and tokens in the config"
            )
            continue
        dropped = {st["step"]: st["by_source"][s]["dropped"] for st in steps}
        step = max(dropped, key=lambda name: sum(dropped[name].values()))
        reasons = ", ".join(
            f"{r.removeprefix('rejected: ')}: {v}" for r, v in sorted(dropped[step].items(), key=lambda kv: -kv[1])
        )
        where = (
            f"{out / 'rejected'} names each record's file and line"
            if step == "read"
            else f"they are in {out / 'dropped' / step} with their reasons; relax or disable "
            f"`{_STEP_SETTINGS.get(step, step)}` in the config if you want them"
        )
        warnings.append(
            f"source '{s}' kept none of its {a['in']} documents: {step} {'rejected' if step == 'read' else 'dropped'} "
            f"{sum(dropped[step].values())} ({reasons}); {where}"
        )
    return warnings


def _markdown(report: dict) -> str:
    files, shards = report["input_files"], report["shards"]
    read_as = "" if shards == files else f", read in {shards} parts (`split_bytes`)"
    lines = ["# Curation report", "", f"{files} input file(s){read_as}, in {report['seconds']} s.", ""]
    if report.get("input_notes"):
        lines += [f"- Note: {n}" for n in report["input_notes"]] + [""]
    for w in report["warnings"]:
        lines.append(f"> **Warning:** {w}")
    lines += [
        "",
        "## Accounting (documents)",
        "",
        "| source | in | kept | dropped | rejected | output docs | output MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s, a in report["accounting"].items():
        lines.append(
            f"| {s} | {a['in']} | {a['kept']} | {a['dropped']} | {a['rejected']} | "
            f"{a['output_documents']} | {a['output_bytes'] / 1e6:.2f} |"
        )
    lines += [
        "",
        "Invariant: in = kept + dropped + rejected (checked). Nothing is lost: each dropped document is in "
        "`dropped/STEP/`, each rejected record (unreadable, with its file and line) in `rejected/`, with its reason.",
        "",
        "## Steps",
        "",
        "| step | source | docs in | docs out | MB in | MB out | dropped by reason |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for st in report["steps"]:
        for s, b in st["by_source"].items():
            reasons = ", ".join(f"{r}: {v}" for r, v in sorted(b["dropped"].items(), key=lambda kv: -kv[1]))
            mb_in, mb_out = b.get("bytes_in", 0) / 1e6, b.get("bytes_out", 0) / 1e6
            lines.append(
                f"| {st['step']} | {s} | {b['docs_in']} | {b['docs_out']} | {mb_in:.2f} | {mb_out:.2f} | {reasons} |"
            )
        if st["counters"]:
            counters = ", ".join(f"{k}: {v}" for k, v in st["counters"].items())
            lines.append(f"| {st['step']} | *counters* | | | | | {counters} |")
    lines += [
        "",
        "## Fuzzy dedup by source",
        "",
        "| source | documents | removed | share | clusters (size: count) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for s, f in report["dedup"]["fuzzy_by_source"].items():
        sizes = ", ".join(f"{k}: {v}" for k, v in f["clusters_by_size"].items()) or "-"
        lines.append(f"| {s} | {f['documents']} | {f['removed']} | {f['fraction']:.1%} | {sizes} |")
    if report["dedup"]["mixture"]:
        lines += [
            "",
            "## Mixture",
            "",
            "| source | available tokens | target | achieved | documents emitted |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for s, m in report["dedup"]["mixture"].items():
            lines.append(
                f"| {s} | {m['available_tokens']} | {m['target_tokens']} | {m['achieved_tokens']} | "
                f"{m['emitted_documents']} |"
            )
    lines += _model_sections(report)
    lines += ["", "![attrition](report.png)", ""]
    return "\n".join(lines)


def _model_sections(report: dict) -> list[str]:
    """The quality classifier, its levels, the topic clusters and the topic x quality cells."""
    lines = []
    if c := report.get("classifier"):
        lines += [
            "",
            "## Quality classifier (fastText)",
            "",
            f"Trained on {c['trained_on']} documents ({c['positive_documents']} high-quality, "
            f"{c['negative_documents']} from the {c['negative_from']}); held-out accuracy "
            f"**{c['held_out_accuracy']:.1%}** on {c['held_out']} documents it did not see.",
            "",
            "| level | score from | documents | mean score |",
            "| ---: | ---: | ---: | ---: |",
        ]
        levels = c["levels"]
        for q, n in enumerate(levels["documents"]):
            start = levels["edges"][q - 1] if q else 0.0
            mean = levels["mean_score"][q]
            lines.append(f"| {q} | {start:.3f} | {n} | {'-' if mean is None else f'{mean:.3f}'} |")
    if t := report.get("topics"):
        lines += [
            "",
            f"## Topics (k-means over TF-IDF, fitted on {t['sampled']} sampled documents)",
            "",
            "| topic | documents | top words |",
            "| ---: | ---: | --- |",
        ]
        lines += [f"| {c['topic']} | {c['documents']} | {', '.join(c['top_words'])} |" for c in t["clusters"]]
    if cells := report.get("cells"):
        planned = any("target_share" in v for v in cells.values())
        lines += ["", "## Cells (topic x quality)", ""]
        if planned:
            lines += ["| cell | documents | tokens | target share | realised share |"]
            lines += ["| --- | ---: | ---: | ---: | ---: |"]
            lines += [
                f"| {k} | {v['documents']} | {v['tokens']} | {v['target_share']:.2%} | {v['realised_share']:.2%} |"
                for k, v in cells.items()
            ]
        else:
            lines += ["| cell | documents | tokens |", "| --- | ---: | ---: |"]
            lines += [f"| {k} | {v['documents']} | {v['tokens']} |" for k, v in cells.items()]
    return lines


def _chart(path: Path, steps: list[dict], sources: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [st["step"] for st in steps]
    fig, ax = plt.subplots(figsize=(max(6, len(names) * 0.9), 4))
    for s in sources:
        start = max(1, steps[0]["by_source"][s]["docs_in"])
        remaining = [100.0] + [100.0 * st["by_source"][s]["docs_out"] / start for st in steps]
        ax.plot(["input"] + names, remaining, marker="o", label=f"{s} ({start} docs)")
    ax.set_ylabel("documents remaining (% of input)")
    ax.set_ylim(0, 105)
    ax.set_title("Attrition by step")
    ax.legend()
    ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
