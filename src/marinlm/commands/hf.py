"""`marinlm export` and `marinlm import`: the command-line side of Hugging Face interop."""

from __future__ import annotations

import argparse

from marinlm.commands import help_of


def add_commands(commands) -> None:
    ex = commands.add_parser("export", help=help_of("export"))
    ex.add_argument("run", help="run folder (newest good checkpoint) or a checkpoint folder")
    ex.add_argument("out_dir", help="folder to write (must not exist or be empty, unless --overwrite)")
    ex.add_argument(
        "--format",
        default="auto",
        choices=["auto", "native", "remote"],
        help="native: a transformers class (Qwen3-MoE configs); remote: modeling_marin.py with trust_remote_code "
        "(every config); auto: native where it is exact, else remote",
    )
    ex.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="weights dtype (default: as saved)")
    ex.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard (huggingface_hub syntax)")
    ex.add_argument("--overwrite", action="store_true")
    ex.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA/QLoRA fine-tuning run: its base model plus OUT_DIR/adapter for peft, instead of the merged model",
    )
    ex.add_argument(
        "--check",
        action="store_true",
        help="load the export in transformers and compare it with marinlm: logits, KL divergence, greedy decoding",
    )
    ex.set_defaults(func=_export)

    im = commands.add_parser("import", help=help_of("import"))
    im.add_argument("hf_dir", help="folder with config.json, *.safetensors and the tokenizer")
    im.add_argument("run_dir", help="the run folder to write")
    im.add_argument("--overwrite", action="store_true")
    im.set_defaults(func=_import)


def _export(args: argparse.Namespace, overrides) -> int:
    from marinlm.hf.adapter import export_adapter
    from marinlm.hf.export import export

    report = (export_adapter if args.adapter else export)(
        args.run,
        args.out_dir,
        fmt=args.format,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
    )
    print(
        f"exported {report.checkpoint} -> {report.out_dir} ({report.format}): {report.tensors} tensors, "
        f"{report.bytes / 1e6:.1f} MB in {report.shards} shard(s); held at most {report.peak_tensor_bytes / 1e6:.1f} MB"
    )
    load = f"AutoModelForCausalLM.from_pretrained({str(report.out_dir)!r}, trust_remote_code=True)"
    if args.adapter:
        print(f"load it with PeftModel.from_pretrained({load}, {str(report.out_dir / 'adapter')!r})")
    elif report.format == "remote":
        print(f"load it with {load}")
    if args.check:
        from marinlm.hf.export import parity_check

        check = parity_check(report.out_dir, report.checkpoint, adapter=args.adapter)
        same = "the same" if check["greedy_equal"] else "DIFFERENT"
        print(
            f"check ({check['hf_class']} in transformers vs marinlm, fp32): max |logit diff| "
            f"{check['max_abs_logit_diff']:.2e}, max next-token KL {check['max_kl']:.2e}, greedy decoding "
            f"{same} for {check['greedy_tokens']} tokens"
        )
        if not check["greedy_equal"] or check["max_kl"] > 1e-6:
            return 1
    return 0


def _import(args: argparse.Namespace, overrides) -> int:
    from marinlm.hf.importer import import_hf

    folder = import_hf(args.hf_dir, args.run_dir, overwrite=args.overwrite)
    print(f"imported {args.hf_dir} -> {folder}; use it with generate, eval, export or train --checkpoint.init_from")
    return 0
