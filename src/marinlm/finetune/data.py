"""SFT data: chat examples rendered by the tokenizer's template, packed into training rows.

Rendering is transformers' own `apply_chat_template(..., return_assistant_tokens_mask=True)` on the
run's tokenizer folder, so the ids and the loss mask are the ones HF tools compute: the mask is 1
on the tokens inside the template's `{% generation %}` blocks (the assistant turns).

Packing puts whole examples one after another into rows of `seq_len` tokens; each example is its
own segment, so attention, SConv and positions restart at every example, and no label crosses from
one example into the next. Row t's label is token t+1 where token t+1 is trainable, else -100: the
first assistant token is predicted from the token before it.
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from marinlm.finetune.config import SFTDataConfig
from marinlm.model.loss import IGNORE_INDEX
from marinlm.utils.io import json_error, read_utf8

GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
ROLES = ("system", "user", "assistant")


class SFTDataError(ValueError):
    """Unusable fine-tuning data or template; the message names the file, line or template."""


def read_records(path: str | Path) -> list[tuple[str, dict]]:
    """(where, record) of every example in a .jsonl, .json (a list) or .parquet file.

    Text files are read as curation reads them: UTF-8, a leading byte-order mark dropped, a bad
    byte named by line; JSON lines end at a newline only (U+2028, U+2029 and U+0085 are characters
    that may stand raw inside a JSON string, not line breaks)."""
    path = Path(path)
    if not path.is_file():
        raise SFTDataError(f"{path}: no such file of examples")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise SFTDataError(f"{path}: not a readable parquet file ({e})") from None
        return [(f"{path}[{i}]", row) for i, row in enumerate(rows)]
    text = read_utf8(path, "invalid UTF-8", SFTDataError)
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SFTDataError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
        if not isinstance(data, list):
            raise SFTDataError(f"{path}: expected a JSON list of examples")
        return [(f"{path}[{i}]", r) for i, r in enumerate(data)]
    records = []
    for n, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                records.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise SFTDataError(f"{path}:{n}: not valid JSON: {json_error(e)}") from None
    return records


def to_messages(record: dict, config: SFTDataConfig, where: str) -> list[dict]:
    """The chat of one record: its `messages`, or a user prompt and an assistant completion."""
    if not isinstance(record, dict):
        raise SFTDataError(f"{where}: an example must be a JSON object")
    use_messages = config.format == "messages" or (config.format == "auto" and config.messages_field in record)
    if use_messages:
        messages = record.get(config.messages_field)
        if not isinstance(messages, list) or not messages:
            raise SFTDataError(f"{where}: {config.messages_field!r} must be a non-empty list of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise SFTDataError(f"{where}: message {i} needs a role in {list(ROLES)} and a string content")
        return messages
    missing = [f for f in (config.prompt_field, config.completion_field) if not isinstance(record.get(f), str)]
    if missing:
        raise SFTDataError(
            f"{where}: no {config.messages_field!r} list and no string {missing[0]!r} (set sft.format and the "
            "sft.*_field keys to this data's field names)"
        )
    messages = [
        {"role": "user", "content": record[config.prompt_field]},
        {"role": "assistant", "content": record[config.completion_field]},
    ]
    if config.system_prompt:
        messages.insert(0, {"role": "system", "content": config.system_prompt})
    return messages


class ChatRenderer:
    """Token ids and assistant mask of a chat, as transformers renders them with `template`."""

    def __init__(self, tokenizer_dir: str | Path, template: str, template_name: str):
        from transformers import AutoTokenizer

        if not GENERATION_TAG.search(template):
            raise SFTDataError(
                f"{template_name}: the chat template has no {{% generation %}} block around the assistant turns, "
                "so no token could be marked for the loss; wrap each assistant message in "
                "{% generation %}...{% endgeneration %} (see configs/chat/marin.jinja)"
            )
        self.template, self.template_name = template, template_name
        self.hf = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        # Examples are cut to seq_len after rendering and counted in the report: not the tokenizer's
        # "longer than the maximum sequence length" warning.
        self.hf.model_max_length = int(1e30)

    def render(self, messages: list[dict], where: str = "an example") -> tuple[list[int], list[int]]:
        from jinja2 import TemplateError

        try:
            out = self.hf.apply_chat_template(
                messages,
                chat_template=self.template,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
        except TemplateError as e:  # a field the template uses that the messages lack, a syntax error
            raise SFTDataError(f"{self.template_name}: the chat template fails on {where}: {e}") from None
        return list(out["input_ids"]), list(out["assistant_masks"])


@dataclass
class Examples:
    """Rendered examples and what was left out, with the reason."""

    ids: list[list[int]]
    masks: list[list[int]]
    empty: int = 0  # no trainable token under the template: skipped
    blank: int = 0  # every assistant answer empty (or only white space): skipped, nothing to learn
    first_blank: str = ""  # where the first of those is
    cut_off: int = 0  # trainable tokens only past seq_len: skipped
    truncated: int = 0  # longer than seq_len, trainable tokens within it: cut to it

    def report(self, name: str) -> str:
        left_out = (
            f"{self.empty} skipped with no trainable token, {self.blank} with an empty answer, {self.cut_off} whose "
            f"answer starts past seq_len, {self.truncated} cut to seq_len"
        )
        return f"{name}: {len(self.ids)} examples, {left_out}"


def render_all(records, config: SFTDataConfig, renderer: ChatRenderer, seq_len: int, name: str) -> Examples:
    out = Examples([], [])
    for where, record in records:
        messages = to_messages(record, config, where)
        if not any(m["content"].strip() for m in messages if m["role"] == "assistant"):
            out.blank += 1
            out.first_blank = out.first_blank or where
            continue
        ids, mask = renderer.render(messages, where)
        if not any(mask[1:]):  # the first token is never predicted
            out.empty += 1
            continue
        if len(ids) > seq_len:  # the answer's end is lost, its start still trains
            ids, mask = ids[:seq_len], mask[:seq_len]
            if not any(mask[1:]):
                out.cut_off += 1
                continue
            out.truncated += 1
        out.ids.append(ids)
        out.masks.append(mask)
    total = out.empty + out.blank + out.cut_off + len(out.ids)
    if total and out.blank / total > config.max_empty_fraction:
        raise SFTDataError(
            f"{out.first_blank}: {out.blank} of {total} examples in {name} have an empty answer, this the first: "
            f"nothing to learn from them (sft.max_empty_fraction {config.max_empty_fraction})"
        )
    if total and out.empty / total > config.max_empty_fraction:
        raise SFTDataError(
            f"{name}: {out.empty} of {total} examples have no trainable token under the chat template "
            f"{renderer.template_name}: its {{% generation %}} blocks do not cover the assistant turns "
            f"(sft.max_empty_fraction {config.max_empty_fraction})"
        )
    if total and out.cut_off / total > config.max_empty_fraction:
        raise SFTDataError(
            f"{name}: in {out.cut_off} of {total} examples the answer starts past data.seq_len={seq_len} tokens; "
            "raise data.seq_len (up to the model's max_seq_len) or shorten the prompts"
        )
    if not out.ids:
        raise SFTDataError(f"{name}: no usable example ({out.report(name)})")
    return out


def pack(examples: Examples, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Rows [R, seq_len] of whole examples in order: input_ids, labels, segment_ids, loss_mask."""
    rows: list[list[int]] = [[]]
    used = 0
    for i, ids in enumerate(examples.ids):
        if used + len(ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += len(ids)
    R = len(rows)
    inputs = np.full((R, seq_len), pad_id, dtype=np.int64)
    labels = np.full((R, seq_len), IGNORE_INDEX, dtype=np.int64)
    segments = np.zeros((R, seq_len), dtype=np.int64)
    for r, members in enumerate(rows):
        pos = 0
        for seg, i in enumerate(members):
            ids, mask = np.asarray(examples.ids[i]), np.asarray(examples.masks[i], dtype=bool)
            n = len(ids)
            inputs[r, pos : pos + n] = ids
            segments[r, pos : pos + n] = seg
            labels[r, pos : pos + n - 1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
            pos += n
        segments[r, pos:] = len(members)  # padding: a segment of its own
    labels_t = torch.from_numpy(labels)
    return {
        "input_ids": torch.from_numpy(inputs),
        "labels": labels_t,
        "segment_ids": torch.from_numpy(segments),
        "loss_mask": labels_t != IGNORE_INDEX,
    }


def load_sft(
    config: SFTDataConfig, tokenizer_dir: Path, template: str, template_name: str, seq_len: int, pad_id: int, seed: int
):
    """(train rows, val rows or None, report lines)."""
    renderer = ChatRenderer(tokenizer_dir, template, template_name)
    train = [r for f in config.train_files for r in read_records(f)]
    random.Random(seed).shuffle(train)
    val = [r for f in config.val_files for r in read_records(f)]
    if not val and config.val_fraction:
        cut = max(1, int(len(train) * config.val_fraction))
        val, train = train[:cut], train[cut:]
    if config.max_examples:
        train = train[: config.max_examples]
    if config.max_val_examples:
        val = val[: config.max_val_examples]
    train_ex = render_all(train, config, renderer, seq_len, "sft.train_files")
    lines = [train_ex.report("train")]
    val_rows = None
    if val:
        val_ex = render_all(val, config, renderer, seq_len, "sft.val_files")
        lines.append(val_ex.report("validation"))
        val_rows = pack(val_ex, seq_len, pad_id)
    return pack(train_ex, seq_len, pad_id), val_rows, lines


class SFTLoader:
    """Micro-batches of packed rows in a seeded order, a new one each epoch; resumable exactly.

    Each call of `next` gives this rank's share of `rows_per_micro` rows (all ranks together)."""

    def __init__(self, rows: dict, rows_per_micro: int, rank: int, world: int, seed: int):
        self.rows, self.rows_per_micro, self.rank, self.world, self.seed = rows, rows_per_micro, rank, world, seed
        self.num_rows = rows["input_ids"].shape[0]
        self.rows_consumed = 0
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        return self._orders[epoch]

    def planned_epochs(self, total_rows: int) -> list[float]:
        return [total_rows / self.num_rows]

    def __iter__(self):
        while True:
            idx = np.arange(self.rows_consumed, self.rows_consumed + self.rows_per_micro)
            epoch, within = np.divmod(idx, self.num_rows)
            picked = np.array([self._order(int(e))[w] for e, w in zip(epoch, within)])
            mine = picked[self.rank :: self.world]  # dealt round the ranks, as the pretraining loader does
            self.rows_consumed += self.rows_per_micro
            yield {k: v[mine] for k, v in self.rows.items()}

    def state_dict(self) -> dict:
        return {"rows_consumed": self.rows_consumed, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_rows") != self.num_rows:
            raise ValueError(
                f"loader state is for {state.get('num_rows')} packed rows, this run's SFT data packs into "
                f"{self.num_rows}: the data or data.seq_len changed; start a new run_dir to fine-tune on other data"
            )
        self.rows_consumed = int(state["rows_consumed"])


def print_report(lines: list[str]) -> None:
    for line in lines:
        print(line, file=sys.stderr, flush=True)
