"""`marinlm export RUN OUT --adapter`: a LoRA or QLoRA fine-tuning run as a Hugging Face base model
and a peft adapter for it, instead of one merged model (to swap adapters over one base, or serve
several).

The base is the model the adapters were trained on: the base run's weights, for QLoRA dequantised
from NF4 as training computed with them. It is exported in the remote-code format, which keeps
marinlm's module names under the wrapper's `model.`: the adapter's keys are peft's for that tree,
and the routed experts' grouped adapters load as peft's `target_parameters` LoRA. (Native
Qwen3-MoE renames the modules and splits the experts into a linear layer each.) Routers or norms
that the run trained (`lora.train_router`, `lora.train_norms`) travel in the adapter, as peft's
`modules_to_save`; the base keeps the base run's.

    base = AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)
    model = PeftModel.from_pretrained(base, f"{OUT}/adapter")
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from marinlm.hf.export import MANIFEST, ExportReport, export, manifest_entry
from marinlm.utils.io import refuse_overlap, write_json_atomic

ADAPTER_DIR = "adapter"
PREFIX = "base_model.model."  # peft's name for the model it wraps
HF_PREFIX = "model."  # where MarinHFForCausalLM holds marinlm's model


def export_adapter(source: str | Path, out_dir: str | Path, *, fmt: str = "auto", **options) -> ExportReport:
    """Write the base of fine-tuning run (or checkpoint) `source` to `out_dir` and its adapter to
    `out_dir/adapter`, both listed in the export's checksum manifest. `options`: `export`'s."""
    from marinlm.finetune.adapters import (
        dequantize_base,
        merge_adapters,
        peft_state,
        save_peft_adapter,
        whole_trained_modules,
    )
    from marinlm.finetune.loading import (
        adapted_model,
        base_of_checkpoint,
        is_finetune_config,
        restore_base,
        save_plain_run,
    )
    from marinlm.train.checkpoint import resolve_checkpoint

    folder = resolve_checkpoint(source)
    if not is_finetune_config(folder / "config.yaml"):
        raise ValueError(f"--adapter: {folder} is not a fine-tuning checkpoint; export it without --adapter")
    if fmt not in ("auto", "remote"):
        raise ValueError(
            f"--adapter: the base is exported as remote code, whose module names the adapter uses; --format {fmt} "
            "renames them (export the merged model with --format native instead)"
        )
    base = base_of_checkpoint(folder)  # validated once, here
    refuse_overlap(out_dir, {"the checkpoint": folder, "its base checkpoint": base}, "the export folder")
    model, config, info = adapted_model(folder, base)
    if config.method not in ("lora", "qlora"):
        raise ValueError(
            f"--adapter: {folder} was fine-tuned with method {config.method!r}, which trains no adapter; "
            "export it merged, without --adapter"
        )
    state = {PREFIX + HF_PREFIX + key.removeprefix(PREFIX): t for key, t in peft_state(model).items()}
    trained_whole = whole_trained_modules(model)
    merge_adapters(model, fold=False)
    dequantize_base(model)
    restore_base(model, base, trained_whole)  # the routers or norms it trained: in the adapter
    with tempfile.TemporaryDirectory() as tmp:
        plain = save_plain_run(model.float(), config, folder, Path(tmp) / "base", "adapter_base_of")
        report = export(plain, out_dir, fmt="remote", **options)
    staging = report.out_dir / f".{ADAPTER_DIR}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    targets = [HF_PREFIX + name for name in info["lora_targets"]]
    save_peft_adapter(state, info, staging, str(report.out_dir), target_modules=targets)
    staging.rename(report.out_dir / ADAPTER_DIR)
    manifest = json.loads((report.out_dir / MANIFEST).read_text())
    for path in sorted((report.out_dir / ADAPTER_DIR).iterdir()):
        manifest["files"][f"{ADAPTER_DIR}/{path.name}"] = manifest_entry(path)
    manifest.update(checkpoint=str(folder.resolve()), adapter=ADAPTER_DIR, method=config.method)
    write_json_atomic(report.out_dir / MANIFEST, manifest)
    report.checkpoint = folder
    return report
