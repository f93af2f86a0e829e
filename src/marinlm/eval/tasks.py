"""Evaluation tasks, scored as lm-evaluation-harness scores them.

Conventions (lm-eval-harness v0.4):
- Multiple choice (hellaswag, arc_*, piqa, mmlu): each choice is a continuation after the context
  with a single-space target delimiter; `acc` takes the argmax of the summed log-likelihood,
  `acc_norm` the argmax of log-likelihood divided by the choice's length in characters.
  Prompts: ARC `Question: ...\\nAnswer:`; PIQA `Question: {goal}\\nAnswer:`; HellaSwag the cleaned
  context; MMLU `The following are multiple choice questions (with answers) about {subject}.\\n\\n`,
  then k dev examples and the question, each `question\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:`,
  scored on " A".." D".
- lambada_openai: context = the text without its last word, target " " + last word; `acc` = the
  target is the greedy continuation, `perplexity` = exp(-mean log-likelihood of the target).
- winogrande: partial scoring: the shared continuation " " + rest-of-sentence under each of the
  two contexts; the higher log-likelihood wins.
Standard errors of means (acc, acc_norm) are the sample standard deviation over items / sqrt(n);
LAMBADA's perplexity, not a mean, has lm-eval's bootstrap standard error (`bootstrap_stderr`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from marinlm.eval.lm import Request
from marinlm.utils.io import json_error, read_utf8

SEED = 1234  # deterministic --sample subsets


class TaskDataError(ValueError):
    """A task file that is missing, malformed or inconsistent; the message names file and line."""


class TaskFileMissing(TaskDataError):
    """A task file that is not on disk (and not given as an HF datasets source)."""


@dataclass
class Item:
    requests: list[Request]
    gold: int | str | None = None
    choice_lengths: list[int] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


# Task files may come from HF `datasets` instead of disk: {file name: "NAME[:CONFIG]:SPLIT"}, where
# the rows carry the same fields as the local file (for the "json"/"csv"/"parquet" builders, CONFIG
# is the data file). Set by the runner from EvalOptions.hf_datasets.
HF_SOURCES: dict[str, str] = {}


def _hf_rows(spec: str, name: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"hf source for {name}: needs HF datasets; `pip install datasets`") from None

    parts = spec.split(":")
    if len(parts) not in (2, 3):
        raise TaskDataError(f"hf source for {name}: expected NAME[:CONFIG]:SPLIT, got {spec!r}")
    dataset, config, split = parts if len(parts) == 3 else (parts[0], None, parts[1])
    try:
        if dataset in ("json", "csv", "parquet"):
            ds = datasets.load_dataset(dataset, data_files=config, split=split)
        else:
            ds = datasets.load_dataset(dataset, config, split=split)
    except ConnectionError as e:  # offline, or the Hub unreachable: a message, not a traceback
        raise TaskDataError(
            f"hf source for {name} ({spec}): {e}; this machine cannot reach the Hugging Face Hub. "
            f"Put {name} in a folder given by --data-dir instead, or read it from a local HF cache "
            "(HF_DATASETS_OFFLINE=1)"
        ) from None
    return [dict(row) for row in ds]


class StrList:
    """Field type: a list of strings (choices, endings, context options)."""


def read_text(path: Path, data: bytes | None = None) -> str:
    """The file (or its decompressed `data`) as UTF-8; a bad byte is a TaskDataError naming the file and line."""
    return read_utf8(path, error=TaskDataError, data=data)


def _type_error(value, tp: type) -> str | None:
    """Why `value` is not of field type `tp` (bool is not an int here), or None when it is."""
    if tp is StrList:
        if not isinstance(value, list):
            return f"should be a list of strings, got {type(value).__name__}"
        bad = [i for i, v in enumerate(value) if not isinstance(v, str)]
        if bad:
            return f"should be a list of strings, element {bad[0]} is {type(value[bad[0]]).__name__}"
        return None
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        return f"should be {tp.__name__}, got {type(value).__name__}"
    return None


def _jsonl(path: Path, required: dict[str, type]) -> list[dict]:
    if path.name in HF_SOURCES:
        raw = [
            (f"{HF_SOURCES[path.name]}[{i}]", row) for i, row in enumerate(_hf_rows(HF_SOURCES[path.name], path.name))
        ]
    elif not path.is_file():
        raise TaskFileMissing(f"{path}: task file not found (point --data-dir at the evaluation data)")
    else:
        raw = []
        for n, line in enumerate(read_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                raw.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise TaskDataError(f"{path}:{n}: malformed JSON: {json_error(e)}") from None
    rows = []
    for where, row in raw:
        if not isinstance(row, dict):
            raise TaskDataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key, tp in required.items():
            if key not in row:
                raise TaskDataError(f"{where}: missing field {key!r}")
            if (problem := _type_error(row[key], tp)) is not None:
                raise TaskDataError(f"{where}: field {key!r} {problem}")
        row["_where"] = where
        rows.append(row)
    return rows


def _check_gold(gold, n_choices: int, where: str) -> int:
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < n_choices:
        raise TaskDataError(f"{where}: label {gold!r} is not a valid index into {n_choices} choices")
    return gold


def multiple_choice(context: str, choices: list[str], gold: int) -> Item:
    return Item([Request(context, " " + c) for c in choices], gold, [len(c) for c in choices])


class Task(ABC):
    name = ""
    files: tuple[str, ...] = ()
    kind = "multiple_choice"

    @abstractmethod
    def load(self, data_dir: Path) -> list[Item]: ...


class HellaSwag(Task):
    name, files = "hellaswag", ("hellaswag_val.jsonl",)

    def load(self, data_dir):
        rows = _jsonl(data_dir / self.files[0], {"ctx": str, "endings": StrList, "label": int})
        return [
            multiple_choice(r["ctx"], r["endings"], _check_gold(r["label"], len(r["endings"]), r["_where"]))
            for r in rows
        ]


class Arc(Task):
    def __init__(self, name: str, file: str):
        self.name, self.files = name, (file,)

    def load(self, data_dir):
        rows = _jsonl(data_dir / self.files[0], {"query": str, "choices": StrList, "gold": int})
        items = []
        for r in rows:
            query = r["query"] if r["query"].startswith("Question:") else f"Question: {r['query']}"
            items.append(
                multiple_choice(
                    f"{query}\nAnswer:", r["choices"], _check_gold(r["gold"], len(r["choices"]), r["_where"])
                )
            )
        return items


class Piqa(Task):
    name, files = "piqa", ("piqa_valid.jsonl", "piqa_valid_labels.lst")

    def load(self, data_dir):
        rows = _jsonl(data_dir / self.files[0], {"goal": str, "sol1": str, "sol2": str})
        labels_path = data_dir / self.files[1]
        if not labels_path.is_file():
            raise TaskDataError(f"{labels_path}: label file not found")
        labels = read_text(labels_path).split()
        if len(labels) != len(rows):
            raise TaskDataError(f"{labels_path}: {len(labels)} labels for {len(rows)} questions")
        items = []
        for r, label in zip(rows, labels):
            gold = _check_gold(
                int(label) if label.isascii() and label.isdigit() else label, 2, f"{labels_path} (for {r['_where']})"
            )
            items.append(multiple_choice(f"Question: {r['goal']}\nAnswer:", [r["sol1"], r["sol2"]], gold))
        return items


class Winogrande(Task):
    name, files = "winogrande", ("winogrande.jsonl",)

    def load(self, data_dir):
        rows = _jsonl(data_dir / self.files[0], {"context_options": StrList, "continuation": str, "gold": int})
        return [
            Item(
                [Request(c, " " + r["continuation"]) for c in r["context_options"]],
                _check_gold(r["gold"], len(r["context_options"]), r["_where"]),
            )
            for r in rows
        ]


class Lambada(Task):
    name, files, kind = "lambada_openai", ("lambada_openai_test.jsonl",), "lambada"

    def load(self, data_dir):
        items = []
        for r in _jsonl(data_dir / self.files[0], {"text": str}):
            context, _, word = r["text"].rpartition(" ")
            if not context:
                raise TaskDataError(f"{r['_where']}: text has no last word to predict")
            items.append(Item([Request(context, " " + word)]))
        return items


class MMLU(Task):
    name, kind = "mmlu", "mmlu"
    LETTERS = ("A", "B", "C", "D")

    def __init__(self, num_fewshot: int = 0):
        self.num_fewshot = num_fewshot
        self.files = ("mmlu/dev", "mmlu/test")

    @staticmethod
    def _rows(path: Path) -> list[tuple[str, list[str], int, str]]:
        rows = []
        with io.StringIO(read_text(path), newline="") as f:
            for n, row in enumerate(csv.reader(f), start=1):
                if len(row) != 6 or row[5] not in MMLU.LETTERS:
                    raise TaskDataError(f"{path}:{n}: expected question, 4 choices and an answer letter A-D")
                rows.append((row[0], row[1:5], MMLU.LETTERS.index(row[5]), f"{path}:{n}"))
        return rows

    @classmethod
    def format(cls, question: str, choices: list[str]) -> str:
        return question.strip() + "".join(f"\n{l}. {c}" for l, c in zip(cls.LETTERS, choices)) + "\nAnswer:"

    def load(self, data_dir):
        test_dir, dev_dir = data_dir / "mmlu" / "test", data_dir / "mmlu" / "dev"
        if not test_dir.is_dir():
            raise TaskDataError(f"{test_dir}: MMLU test folder not found")
        paths = sorted(test_dir.glob("*_test.csv"))
        if not paths:
            raise TaskDataError(f"{test_dir}: no SUBJECT_test.csv files in the MMLU test folder")
        items = []
        for path in paths:
            subject = path.name[: -len("_test.csv")]
            header = (
                f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
            )
            shots = ""
            if self.num_fewshot:
                dev = dev_dir / f"{subject}_dev.csv"
                if not dev.is_file():
                    raise TaskDataError(f"{dev}: dev file needed for {self.num_fewshot}-shot MMLU")
                examples = self._rows(dev)[: self.num_fewshot]
                if len(examples) < self.num_fewshot:
                    raise TaskDataError(
                        f"{dev}: {len(examples)} dev examples, fewer than the {self.num_fewshot} shots asked for"
                    )
                shots = "".join(f"{self.format(q, c)} {self.LETTERS[g]}\n\n" for q, c, g, _ in examples)
            for q, choices, gold, _ in self._rows(path):
                prompt = header + shots + self.format(q, choices)
                items.append(
                    Item([Request(prompt, " " + l) for l in self.LETTERS], gold, [1] * 4, {"subject": subject})
                )
        return items


def task_registry(num_fewshot: int = 0) -> dict[str, Task]:
    tasks = [
        HellaSwag(),
        Arc("arc_easy", "arc_easy.jsonl"),
        Arc("arc_challenge", "arc_challenge.jsonl"),
        Piqa(),
        Winogrande(),
        Lambada(),
        MMLU(num_fewshot),
    ]
    return {t.name: t for t in tasks}


def subset(items: list[Item], limit: int | None = None, sample: int | None = None) -> list[Item]:
    """The first `limit` items, as lm-evaluation-harness's `--limit` takes them (so both tools score
    the same items), or `sample` items of a seeded shuffle, in original order (a subset that
    represents the whole file)."""
    if sample is not None and sample < len(items):
        items = [items[i] for i in sorted(random.Random(SEED).sample(range(len(items)), sample))]
    return items if limit is None else items[:limit]


def _mean_stderr(values: list[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=np.float64)
    if len(arr) < 2:
        return float(arr.mean()) if len(arr) else float("nan"), float("nan")
    return float(arr.mean()), float(arr.std(ddof=1) / math.sqrt(len(arr)))


BOOTSTRAP_ITERS = 100_000  # lm-eval's default `bootstrap_iters`
BOOTSTRAP_CHUNK = 1_000  # resamples per seed, as lm-eval draws them


def bootstrap_stderr(values: list[float], statistic, iters: int = BOOTSTRAP_ITERS) -> float:
    """lm-evaluation-harness's bootstrap standard error of `statistic` over `values`, with its very
    resamples: chunk i of `BOOTSTRAP_CHUNK` draws from `random.Random(i)`, each resample
    `choices(values, k=n)`, and the sample standard deviation of the statistics. Python's `random()`
    and numpy's `random_sample()` are the same Mersenne Twister doubles, so numpy draws them, all of
    a chunk at once; `statistic` maps an (resamples, n) array to one value a row."""
    xs = np.asarray(values, dtype=np.float64)
    n, chunk = len(xs), min(BOOTSTRAP_CHUNK, iters)
    stats = []
    for i in range(iters // chunk):
        *key, pos = random.Random(i).getstate()[1]
        state = np.random.RandomState()
        state.set_state(("MT19937", np.array(key, dtype=np.uint32), pos, 0, 0.0))
        picks = np.floor(state.random_sample((chunk, n)) * n).astype(np.int64)
        stats.append(statistic(xs[picks]))
    return float(np.std(np.concatenate(stats), ddof=1))


def score(task: Task, items: list[Item], results: list[list[tuple[float, bool]]]) -> tuple[dict, list[dict]]:
    """Metrics (with `_stderr`) and per-item predictions for one task."""
    preds = []
    if task.kind == "lambada":
        lls = [r[0][0] for r in results]
        accs = [float(r[0][1]) for r in results]
        acc, acc_se = _mean_stderr(accs)
        ppl = math.exp(-float(np.mean(lls)))
        ppl_se = bootstrap_stderr(lls, lambda ll: np.exp(-ll.mean(axis=1))) if len(lls) > 1 else float("nan")
        preds = [{"loglikelihood": ll, "greedy": bool(a)} for ll, a in zip(lls, accs)]
        return {"acc": acc, "acc_stderr": acc_se, "perplexity": ppl, "perplexity_stderr": ppl_se}, preds
    accs, norms = [], []
    for item, res in zip(items, results):
        lls = [ll for ll, _ in res]
        pick = int(np.argmax(lls))
        accs.append(float(pick == item.gold))
        entry = {"gold": item.gold, "pred": pick, "loglikelihoods": lls, **item.meta}
        if item.choice_lengths:
            pick_norm = int(np.argmax([ll / max(n, 1) for ll, n in zip(lls, item.choice_lengths)]))
            norms.append(float(pick_norm == item.gold))
            entry["pred_norm"] = pick_norm
        preds.append(entry)
    acc, acc_se = _mean_stderr(accs)
    metrics = {"acc": acc, "acc_stderr": acc_se}
    if norms and task.kind != "mmlu":  # single-letter MMLU choices make acc_norm identical to acc
        metrics["acc_norm"], metrics["acc_norm_stderr"] = _mean_stderr(norms)
    if task.kind == "mmlu":
        by_subject: dict[str, list[float]] = {}
        for p, a in zip(preds, accs):
            by_subject.setdefault(p["subject"], []).append(a)
        metrics["acc_micro"] = acc
        metrics["acc_macro"] = float(np.mean([np.mean(v) for v in by_subject.values()]))
        metrics["subjects"] = {s: {"acc": float(np.mean(v)), "n": len(v)} for s, v in sorted(by_subject.items())}
    return metrics, preds
