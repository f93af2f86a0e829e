"""The `marinlm` command line. Thin: every command calls an importable function.

Commands that read a YAML config take extra `--a.b=value` (or `--a.b value`) arguments as overrides
of it, e.g. `--workers 4`; the others reject arguments they do not know.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
from pathlib import Path

from marinlm.commands import COMMANDS, config_classes, config_kinds, help_of
from marinlm.config import ConfigError
from marinlm.train.signals import OutOfMemory, StoppedBySignal, Terminated, TrainingDiverged, raise_on_sigterm
from marinlm.utils.errors import LighthouseLost
from marinlm.utils.pool import WorkerDied


def config_class_for(path: str | Path) -> type:
    """The config class a shipped YAML file holds, from its folder under configs/."""
    classes = config_classes()
    folder = Path(path).resolve().parent.name
    if folder not in classes:
        raise ValueError(f"{path}: no config class for folder {folder!r}; known: {sorted(classes)}")
    return classes[folder]


def _load(cls, path, overrides):
    from marinlm.config import load_config

    return load_config(cls, path, overrides, kinds=config_kinds())


def _tokenizer_train(args, overrides) -> int:
    from marinlm.dataset.tokenizer_training import TokenizerTrainConfig, train_tokenizer

    _, report = train_tokenizer(_load(TokenizerTrainConfig, args.config, overrides), in_child=True)
    print(
        f"tokenizer: vocab {report['vocab_size']} from {report['documents']} documents "
        f"({report['bytes'] / 1e6:.1f} MB) in {report['seconds']} s -> {report['output_dir']}; "
        f"{report['bytes_per_token']:.2f} bytes a token on {report['bytes_per_token_sample']['documents']} of them"
    )
    if report["vocab_size"] < report["vocab_size_requested"]:
        print(f"note: {report['vocab_size_requested']} asked; the corpus supports no more merges (add text)")
    if report["rejected"]:
        print(f"note: {report['rejected']} input record(s) rejected, e.g. {report['rejected_examples'][0]}")
    return 0


def _tokenizer_template(args, overrides) -> int:
    from marinlm.tokenizer import with_chat_template

    template = Path(args.template).read_text() if args.template else None
    tok = with_chat_template(args.tokenizer, args.out, template, args.add_special_tokens)
    added = (
        f", {len(args.add_special_tokens)} special tokens added (vocab {tok.vocab_size})"
        if args.add_special_tokens
        else ""
    )
    print(f"{args.out}: tokenizer {tok.hash[:12]}…{added}; chat template {'set' if template else 'kept'}")
    return 0


def _tokenize(args, overrides) -> int:
    from marinlm.dataset.tokenize import TokenizeConfig, split_note, tokenize

    config = _load(TokenizeConfig, args.config, overrides)
    manifest = tokenize(config)
    tokens = manifest["train_tokens"] + manifest["val_tokens"]
    text_bytes = sum(e["num_bytes"] for split in manifest["splits"].values() for e in split)
    print(
        f"tokens: train {manifest['train_tokens']:,} in {manifest['train_docs']:,} docs, "
        f"val {manifest['val_tokens']:,} in {manifest['val_docs']:,} docs"
        + (f" ({text_bytes / tokens:.2f} bytes of text a token)" if tokens else "")
        + f"; {manifest['rejected_count']:,} rejected input records; "
        + ("done by an earlier run in " if manifest["inputs_tokenized"] == 0 else "")
        + f"{manifest['seconds']} s"
    )
    note = split_note(config, manifest)
    if note:
        print(note)
    return 0


def _train(args, overrides) -> int:
    from marinlm.jobs import run_training
    from marinlm.train.config import TrainConfig
    from marinlm.train.replicas import replica_report

    config = _load(TrainConfig, args.config, overrides)
    summary = run_training(config, resume=args.resume)
    if int(os.environ.get("RANK", "0")) == 0:
        val = summary.get("validation") or {}
        rows = config.validation.max_rows
        scored = (
            f" on {int(val['val/tokens']):,} tokens of "
            + (f"at most {rows} validation rows" if rows else "the whole validation split")
            + (f"; `marinlm eval {config.run_dir} --tasks val` scores the whole split" if rows else "")
            if val
            else ""
        )
        trained = (
            f"final train loss {summary['final_loss']:.4f}"
            if summary["final_loss"] is not None
            else "no step left to train (the run had already finished)"
        )
        steps, first = summary["steps"], summary["first_step"]
        done = f"step {steps} ({steps - first} from step {first})" if first else f"{steps} steps"
        print(
            f"done: {done} in {summary['seconds']:.0f} s, {trained}"
            + (f", val loss {val['val/loss']:.4f}, val bpb {val['val/bpb']:.4f}{scored}" if val else "")
        )
        if summary.get("median_tokens_per_s"):
            print(
                f"median {summary['median_tokens_per_s']:,.0f} tokens/s, MFU {100 * summary['median_mfu']:.1f}% "
                f"of the {summary.get('peak_source', 'measured')} {summary['peak_dtype']} matmul peak "
                f"({summary['peak_flops'] / 1e9:,.0f} GFLOP/s); "
                f"loss curve {summary['loss_plot']}"
            )
        if "fault_tolerance" in summary:
            print(replica_report(summary["fault_tolerance"]))
    if summary.get("signal"):
        raise StoppedBySignal(summary["signal"], summary["steps"])
    return 0


def _generate(args, overrides) -> int:
    from marinlm.loading import generate_text, load_model
    from marinlm.model import SamplingConfig

    loaded = load_model(args.run, device=args.device)
    sampling = SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    if not args.chat:
        sys.stdout.write(args.prompt)
    generate_text(loaded, args.prompt, sampling, stream=sys.stdout, chat=args.chat)
    sys.stdout.write("\n")
    return 0


def _data_corpus(args, overrides) -> int:
    from marinlm.quickstart import build_default_corpus

    counts = build_default_corpus(Path(args.out_dir))
    print(
        f"{counts['python_code']:,} standard-library source files and {counts['python_docs']:,} pydoc topics "
        f"in {args.out_dir}"
    )
    return 0


def _data_run(args, overrides) -> int:
    from marinlm.data.pipeline import PipelineConfig, run_pipeline

    config = _load(PipelineConfig, args.config, overrides)
    report = run_pipeline(config)
    for source, a in report["accounting"].items():
        print(
            f"{source}: {a['in']} in, {a['kept']} kept, {a['dropped']} dropped, {a['rejected']} rejected "
            f"-> {a['output_documents']} output documents"
        )
    for warning in report["warnings"]:
        print(f"warning: {warning}")
    print(f"report: {Path(config.output_dir) / 'report.md'}")
    return 0


def _quickstart(args, overrides) -> int:
    from marinlm.quickstart import run_quickstart

    run_quickstart(args.run_dir, args.corpus, args.minutes, args.seed, args.text_field, args.languages, args.steps)
    return 0


def _model_summary(args, overrides) -> int:
    from marinlm.config import read_yaml
    from marinlm.model.config import MarinConfig
    from marinlm.model.summary import summarize
    from marinlm.presets import find_config
    from marinlm.train.config import TrainConfig

    seq_len, train = args.seq_len, None
    if (Path(args.config) / "config.yaml").is_file():  # a run or checkpoint folder: the model it trains
        args.config = str(Path(args.config) / "config.yaml")
    if "model" in read_yaml(find_config(args.config)):  # a training config (or a run's config.yaml): its model
        train = _load(TrainConfig, args.config, overrides)
        config, seq_len = train.model, seq_len or train.data.seq_len
    else:
        config = _load(MarinConfig, args.config, overrides)
    summary = summarize(config, seq_len)
    print(summary.table())
    if train is not None:  # the whole run: its tokens and training FLOPs at the data's sequence length
        t = train.train
        tokens = t.steps * t.global_batch * train.data.seq_len
        at_data_length = summary if seq_len == train.data.seq_len else summarize(config, train.data.seq_len)
        run_flops = tokens * at_data_length.flops_per_token
        print(
            f"run: {t.steps:,} steps x {t.global_batch:,} sequences x {train.data.seq_len:,} tokens = "
            f"{tokens:.4g} tokens, {run_flops:.4g} training FLOPs"
        )
    return 0


def _plan(args, overrides) -> int:
    from marinlm.finetune.loading import is_finetune_config
    from marinlm.plan import run_plan
    from marinlm.presets import find_config
    from marinlm.train.config import TrainConfig

    if is_finetune_config(find_config(args.config)):  # the base run's model, what the method trains
        from marinlm.commands.finetune import load_finetune_config

        train = load_finetune_config(args.config, overrides)
    else:
        train = _load(TrainConfig, args.config, overrides)
    run_plan(train, args.hardware, args.layout, args.search, Path(args.out), args.gpus, args.routing)
    return 0


def _positive(cast, what: str):
    """An argparse `type` that accepts a number > 0 of the given type."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
        return value

    return parse


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("marinlm")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _add_print_config(command: argparse.ArgumentParser, kind: str) -> None:
    command.add_argument(
        "--print-config",
        action="store_const",
        const=kind,
        default=None,
        help="print the resolved config (the file, then the overrides, then the defaults) and exit; every key "
        "shown can be set with --key=value",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="marinlm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    summary = model.add_parser("summary", help=help_of("model summary"))
    summary.add_argument(
        "config",
        help="model YAML (e.g. configs/model/marin-535b-a23b.yaml), a training config, or a run or checkpoint "
        "folder (its config.yaml)",
    )
    summary.add_argument(
        "--seq-len", type=_positive(int, "an integer"), default=None, help="sequence length for attention FLOPs"
    )
    summary.set_defaults(func=_model_summary, takes_overrides=True)

    plan = commands.add_parser("plan", help=help_of("plan"))
    plan.add_argument("config", help="a training or fine-tuning config, e.g. configs/train/marin-535b-a23b.yaml")
    plan.add_argument("--hardware", required=True, help="a profile in configs/hardware/ (gb200-nvl72, h100-sxm, ...)")
    plan.add_argument(
        "--layout", default=None, help="override the config's parallel section: dp_replicate=11,dp_shard=64,ep=64,..."
    )
    plan.add_argument("--search", action="store_true", help="also rank other layouts of the same number of GPUs")
    plan.add_argument("--gpus", type=_positive(int, "an integer"), default=None, help="GPUs to search over")
    plan.add_argument(
        "--routing",
        default=None,
        help="price drops and the slowest expert receiver from a run's logged expert loads (its folder), "
        "skew=S (shares ~ rank^-S) or balanced; default: balanced load, no drops",
    )
    plan.add_argument("--out", default="runs/plan", help="folder for plan.md, plan.json and plan.png")
    plan.set_defaults(func=_plan, takes_overrides=True)

    quick = commands.add_parser(
        "quickstart",
        help=help_of("quickstart"),
        description="Corpus, curation, tokenizer, token shards, training, evaluation, a sample and "
        "RUN_DIR/report.md. Stopped part way (Ctrl-C, a kill), the same command carries on: finished "
        "stages are kept and training resumes from its last checkpoint. After a finished run it trains again.",
    )
    quick.add_argument(
        "--corpus",
        nargs="+",
        default=None,
        help="your own files/folders/globs instead of the "
        "built-in corpus (Python's standard library sources and documentation topics)",
    )
    quick.add_argument(
        "--minutes",
        type=_positive(float, "a number of minutes"),
        default=None,
        help="a time budget for the whole quickstart instead of its fixed steps: training gets what the data "
        "stages leave (at least 1 min), as many steps as the measured step time fits (fewer on a slow host)",
    )
    quick.add_argument(
        "--steps",
        type=_positive(int, "a number of steps"),
        default=None,
        help="train exactly this many steps, however long they take (default: 2,000, with the time they take "
        "measured and said before training)",
    )
    quick.add_argument("--run-dir", default="runs/quickstart", help="where every stage writes (default: %(default)s)")
    quick.add_argument("--seed", type=int, default=0)
    quick.add_argument(
        "--text-field",
        default="text",
        help="with --corpus: the JSON records' field holding the text (a list of strings is joined by lines)",
    )
    quick.add_argument(
        "--languages",
        nargs="+",
        default=None,
        metavar="LANG",
        help="languages curation keeps (ISO 639-1 codes, and `code`; default: en code), e.g. --languages zh en",
    )
    quick.set_defaults(func=_quickstart)

    data = commands.add_parser("data", help="data curation").add_subparsers(dest="data_command", required=True)
    data_run = data.add_parser("run", help=help_of("data run"))
    data_run.add_argument("config", nargs="?", help="YAML (PipelineConfig), e.g. configs/data/python-corpus.yaml")
    _add_print_config(data_run, "data")
    data_run.set_defaults(func=_data_run, takes_overrides=True)
    data_corpus = data.add_parser(
        "corpus",
        help=help_of("data corpus"),
        description="The quickstart's corpus, which ships with every Python: its standard library's .py files "
        "and pydoc's documentation topics, as .jsonl files in OUT_DIR (configs/data/python-corpus.yaml reads "
        "runs/raw). Files already there with the same text are left as they are.",
    )
    data_corpus.add_argument("out_dir", help="where the .jsonl files go, e.g. runs/raw")
    data_corpus.set_defaults(func=_data_corpus)

    tokenizer = commands.add_parser("tokenizer", help="tokenizer training").add_subparsers(
        dest="tokenizer_command", required=True
    )
    train_tok = tokenizer.add_parser("train", help=help_of("tokenizer train"))
    train_tok.add_argument("config", nargs="?", help="YAML (TokenizerTrainConfig); or give --inputs=[...] etc.")
    _add_print_config(train_tok, "tokenizer")
    train_tok.set_defaults(func=_tokenizer_train, takes_overrides=True)
    chat_tok = tokenizer.add_parser("template", help=help_of("tokenizer template"))
    chat_tok.add_argument(
        "tokenizer", help="a tokenizer folder (a run's tokenizer/, or marinlm tokenizer train's output)"
    )
    chat_tok.add_argument("--template", default=None, help="a Jinja chat template file, e.g. configs/chat/marin.jinja")
    chat_tok.add_argument("--add-special-tokens", nargs="+", default=[], metavar="TOKEN")
    chat_tok.add_argument("--out", required=True, help="the folder to write (the original is left as it is)")
    chat_tok.set_defaults(func=_tokenizer_template)

    train = commands.add_parser("train", help=help_of("train"))
    train.add_argument("config", nargs="?", help="YAML (TrainConfig), e.g. configs/train/tiny.yaml")
    train.add_argument(
        "--resume",
        default="auto",
        help="auto (the newest good checkpoint, or a fresh start when there is none), none (a fresh start; "
        "the run folder must hold no checkpoint), a checkpoint folder, or a run folder (its newest good "
        "checkpoint)",
    )
    _add_print_config(train, "train")
    train.set_defaults(func=_train, takes_overrides=True)

    gen = commands.add_parser("generate", help=help_of("generate"))
    gen.add_argument("run", help="run folder (newest good checkpoint) or a checkpoint folder")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=50)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 1 makes tokens already seen less likely (1 = off)"
    )
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user turn under the run's chat template (a fine-tuned run's own); print the answer",
    )
    gen.add_argument("--device", default="cpu")
    gen.set_defaults(func=_generate)

    from marinlm.commands.eval import add_commands as add_eval_commands

    add_eval_commands(commands)
    from marinlm.commands.hf import add_commands as add_hf_commands

    add_hf_commands(commands)
    from marinlm.commands.finetune import add_commands as add_finetune_commands

    add_finetune_commands(commands)

    tok = commands.add_parser("tokenize", help=help_of("tokenize"))
    tok.add_argument("config", nargs="?", help="YAML (TokenizeConfig); or give --inputs=[...] --tokenizer=...")
    _add_print_config(tok, "tokenize")
    tok.set_defaults(func=_tokenize, takes_overrides=True)
    return parser


def _where(e: Exception) -> str:
    """An OSError's path and reason (plainer than its "[Errno 2] ..."); any other error's message."""
    return f"{e.filename}: {e.strerror}" if getattr(e, "filename", None) else str(e)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["lm-eval"] and not {"-h", "--help"} & set(argv[1:2]):
        from marinlm.commands.eval import lm_eval_passthrough

        return lm_eval_passthrough(argv[1:])
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    config = getattr(args, "config", None)
    if config is not None and config.startswith("--"):
        # argparse reads an unknown `--a.b=value` whose value has a space as a positional argument:
        # it is an override, and the command was given no config file.
        args.config = None
        rest.insert(0, config)
    if rest and not getattr(args, "takes_overrides", False):
        # quickstart, eval and generate have no config to override: a misspelt flag is an error.
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest and not rest[0].startswith("--"):
        parser.error(f"unrecognized arguments: {' '.join(rest)} (config overrides look like --a.b=value)")
    restore_sigterm = raise_on_sigterm()
    try:
        if kind := getattr(args, "print_config", None):
            from marinlm.config import dump_config

            sys.stdout.write(dump_config(_load(config_classes()[kind], args.config, rest)))
            return 0
        return args.func(args, rest)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:  # bad input: say what and where, no traceback
        print(f"error: {_where(e)}", file=sys.stderr)
        return 2
    except (FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        # An output path that runs into a file (`--run_dir` naming one) or may not be written.
        collides = isinstance(e, (FileExistsError, NotADirectoryError))
        print(f"error: {_where(e)}" + (" (a file stands where a folder must go)" if collides else ""), file=sys.stderr)
        return 2
    except (WorkerDied, TrainingDiverged, OutOfMemory, LighthouseLost) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except StoppedBySignal as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(e, file=sys.stderr)
        return 128 + signal.Signals[e.name].value  # what a shell reports for a job the signal ended
    except (KeyboardInterrupt, Terminated) as e:  # outside a training loop (which saves and stops): no traceback
        # Curation and tokenization resume input by input, training (--resume auto) from its newest
        # checkpoint; the quickstart keeps finished stages. The other commands have nothing to carry on.
        name = " ".join(p for p in (args.command, getattr(args, f"{args.command}_command", None)) if p)
        resumable = name in COMMANDS and COMMANDS[name].resumes
        print(
            ("terminated" if isinstance(e, Terminated) else "interrupted")
            + ("; the same command carries on from the last finished unit" if resumable else ""),
            file=sys.stderr,
        )
        return 128 + (signal.SIGTERM if isinstance(e, Terminated) else signal.SIGINT)
    except BrokenPipeError:  # `marinlm generate ... | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail
        return 141  # 128 + SIGPIPE, as a shell tool reports it
    except OSError as e:  # a full disk or quota, a read-only or failing filesystem: say where, no traceback
        from marinlm.train.checkpoint import CheckpointWriteError

        disk = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)
        if not (disk or isinstance(e, CheckpointWriteError)):
            raise
        print(f"error: {_where(e)}", file=sys.stderr)
        return 1
    finally:
        restore_sigterm()


if __name__ == "__main__":
    sys.exit(main())
