"""The commands of `marinlm`, in one place: what each is called, its help line, the config class it
reads (and the folder of configs/ that holds its YAML files), and whether it carries on where it
stopped when run again. The CLI builds its parser, `--print-config`, the "that file is a ... config"
hints and its interruption message from this table. The package's modules are the command-line
side of the bigger commands (`eval.py`, `finetune.py`, `hf.py`); only `marinlm.cli` and they import
the table, which sits above every package whose work it names."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    config: str | None = None  # "module:Class" of its config, imported when asked for
    folder: str | None = None  # configs/FOLDER/ holds YAML files of that class
    kind: str = ""  # how a config file of this command is named in hints
    resumes: bool = False  # run again after an interruption, it carries on from the last finished unit

    def config_class(self) -> type:
        module, name = self.config.split(":")
        return getattr(importlib.import_module(module), name)


COMMANDS: dict[str, Command] = {
    c.name: c
    for c in [
        Command(
            "data run",
            "curate raw documents into deduplicated, decontaminated shards",
            "marinlm.data.config:PipelineConfig",
            "data",
            "a data curation config (for `marinlm data run`)",
            resumes=True,
        ),
        Command(
            "data corpus",
            "write the built-in corpus (Python's standard library sources and documentation topics) as .jsonl",
        ),
        Command(
            "tokenizer train",
            "train a byte-level BPE tokenizer",
            "marinlm.dataset.tokenizer_training:TokenizerTrainConfig",
            "tokenizer",
            "a tokenizer training config (for `marinlm tokenizer train`)",
        ),
        Command("tokenizer template", "give a trained tokenizer a chat template and/or new special tokens"),
        Command(
            "tokenize",
            "curated shards -> token shards with a train/val split",
            "marinlm.dataset.tokenize:TokenizeConfig",
            "tokenize",
            "a tokenize config (for `marinlm tokenize`)",
            resumes=True,
        ),
        Command(
            "train",
            "train a model (one process, or under torchrun)",
            "marinlm.train.config:TrainConfig",
            "train",
            "a training config (for `marinlm train`)",
            resumes=True,
        ),
        Command(
            "finetune",
            "SFT from a run: full, LoRA (experts included), QLoRA or the last layers; `finetune merge RUN`",
            "marinlm.finetune.config:FinetuneConfig",
            "finetune",
            "a fine-tuning config (for `marinlm finetune`)",
            resumes=True,
        ),
        Command(
            "model summary",
            "count parameters and FLOPs on the meta device",
            "marinlm.model.config:MarinConfig",
            "model",
            "a model config (for `marinlm model summary`, or `model:` in a training config)",
        ),
        Command(
            "plan",
            "a training layout's memory per rank and step time on a simulated cluster",
            "marinlm.plan.hardware:Hardware",
            "hardware",
            "a hardware profile (for `marinlm plan --hardware`)",
        ),
        Command("quickstart", "the whole recipe end to end on this machine (~10 min)", resumes=True),
        Command("generate", "stream a continuation from a trained run or checkpoint"),
        Command("eval", "score a run or checkpoint on downstream tasks / perplexity"),
        Command(
            "lm-eval", "lm-evaluation-harness's command line, with the marinlm model and the local tasks registered"
        ),
        Command("export", "write a run or checkpoint as a Hugging Face model folder"),
        Command("import", "turn a Hugging Face model folder into a marinlm run"),
    ]
}


def config_classes() -> dict[str, type]:
    """The config class of each folder under configs/ (and of the command of that name)."""
    return {c.folder: c.config_class() for c in COMMANDS.values() if c.folder}


def config_kinds() -> list[tuple[type, str]]:
    """(config class, how to name a file of it), for the hint given when a file goes to the wrong
    command; a class whose fields include another's comes after it."""
    return [(c.config_class(), c.kind) for c in COMMANDS.values() if c.config]


def help_of(name: str) -> str:
    return COMMANDS[name].help
