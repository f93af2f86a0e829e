"""Byte-level BPE tokenizer: its definition in HF `tokenizers`, and the wrapper the rest of marinlm
uses. Training one on documents (`marinlm tokenizer train`) is marinlm.dataset.tokenizer_training.

The saved folder holds `tokenizer.json`, `tokenizer_config.json` (with the chat template) and
`special_tokens_map.json`, so `transformers.AutoTokenizer.from_pretrained(folder)` loads it and
produces the same ids. There is no normaliser: `decode(encode(x)) == x` for any Unicode string.

Pre-tokenisation (a regex split, then bytes), GPT-2's pattern with four changes:
- runs of CJK characters (Han, kana, Hangul) form their own pre-tokens, apart from Latin letters,
  and keep the full-width punctuation that closes them;
- digits split into groups of at most 3 (the first may take the space before it);
- punctuation keeps the line break after it when the next line is not indented (prose's ".\n");
- a line break and the next line's indentation are one pre-token, less the indentation's last
  space: code's "):\n    if" is `):` `\n   ` ` if`, so BPE learns newline-plus-indent tokens.
Letters take at most a space before them, not any punctuation mark (GPT-4's `(self`, `.append`):
those variants spend a vocabulary that prose and CJK need (`bench/tokenizer_quality.py`).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from marinlm.utils.io import sha256_bytes, write_text_atomic
from marinlm.utils.progress import is_terminal

CJK = r"\p{Han}\p{Hiragana}\p{Katakana}\p{Hangul}"
# Full-width punctuation (、。，「」 ...) that closes a CJK run joins it: a clause and its comma.
CJK_PUNCT = r"[\p{P}&&[\u3001-\u303f\uff00-\uffef]]"
SPLIT_PATTERN = (
    rf"[{CJK}]+{CJK_PUNCT}*"
    r"|(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    rf"| ?[\p{{L}}\p{{M}}&&[^{CJK}]]+"
    r"| ?\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+(?:\r?\n(?!\s))?"
    r"|\s*[\r\n]+(?:[ \t]*(?=[ \t]\S)|[ \t]*)"
    r"|\s+(?!\S)"
    r"|\s+"
)

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_ROLES = ("system", "user", "assistant")
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, *(f"<|{r}|>" for r in CHAT_ROLES), END_OF_TURN]

# Jinja, as transformers renders it: <|bos|><|user|>\n{content}<|end|>\n ... <|assistant|>\n. Each
# assistant turn's content and its <|end|> sit in {% generation %}: the tokens fine-tuning learns
# (transformers' `return_assistant_tokens_mask`); the markers render no text.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\\n' }}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def new_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE; every byte is in the base vocabulary, so nothing is ever unknown."""
    tok = new_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=is_terminal(sys.stderr),  # off a terminal its bar prints only blank lines
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


class MarinTokenizer:
    """The tokenizer as marinlm uses it: ids, special ids, a content hash, save/load."""

    def __init__(self, tokenizer: Tokenizer, names: dict[str, str] | None = None):
        """`names`: the bos/eos/pad token strings of a tokenizer from elsewhere (an imported HF
        model); marinlm's own (<|bos|>, <|eos|>, <|pad|>) by default."""
        self.backend = tokenizer
        vocab = tokenizer.get_vocab()
        self.names = {"bos": BOS, "eos": EOS, "pad": PAD, **(names or {})}
        ours = names is None
        missing = [t for t in (SPECIAL_TOKENS if ours else self.names.values()) if t not in vocab]
        if missing:
            hint = "was it trained by marinlm?" if ours else "its tokenizer_config.json names tokens it lacks"
            raise ValueError(f"tokenizer lacks special tokens {missing}; {hint}")
        self.bos_id, self.eos_id, self.pad_id = (vocab[self.names[k]] for k in ("bos", "eos", "pad"))
        # The Jinja chat template saved with the tokenizer (tokenizer_config.json), as transformers
        # reads it; `load` takes a folder's own (a fine-tuning template, or an imported model's).
        self.chat_template: str | None = CHAT_TEMPLATE if ours else None
        self.special_ids = {t: vocab[t] for t in [*SPECIAL_TOKENS, *self.names.values()] if t in vocab}
        for i, token in sorted(tokenizer.get_added_tokens_decoder().items()):  # e.g. `tokenizer template`'s
            if token.special:
                self.special_ids.setdefault(token.content, i)
        # Text is text: a document that happens to contain "<|eos|>" must not end there. (Not
        # saved with the tokenizer, so the hash and what transformers loads are unchanged.)
        self.backend.encode_special_tokens = True
        self._special_split = re.compile("(" + "|".join(re.escape(t) for t in self.special_ids) + ")")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    @property
    def hash(self) -> str:
        """sha256 of the canonical tokenizer.json; token shards record it."""
        return sha256_bytes(self.backend.to_str().encode())

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in it are ordinary text unless `allow_special`
        (for markup such as a rendered chat template), which maps each to its id as transformers does."""
        if not allow_special:
            return self.backend.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for piece in self._special_split.split(text):
            if piece in self.special_ids:
                ids.append(self.special_ids[piece])
            elif piece:
                ids.extend(self.backend.encode(piece, add_special_tokens=False).ids)
        return ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text (special-token strings are text), on all cores."""
        return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The same string transformers renders from CHAT_TEMPLATE."""
        parts = [BOS] + [f"<|{m['role']}|>\n{m['content']}{END_OF_TURN}\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)

    def save(self, folder: str | Path, model_max_length: int = 4096) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(folder / "tokenizer.json", self.backend.to_str(pretty=True))
        bos, eos, pad = self.names["bos"], self.names["eos"], self.names["pad"]
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": eos,
            "pad_token": pad,
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            **({"chat_template": self.chat_template} if self.chat_template else {}),
            "additional_special_tokens": [t for t in self.special_ids if t not in (bos, eos, pad)],
        }
        write_text_atomic(folder / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
        special = {
            "bos_token": bos,
            "eos_token": eos,
            "pad_token": pad,
            "additional_special_tokens": config["additional_special_tokens"],
        }
        write_text_atomic(folder / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> MarinTokenizer:
        path = Path(folder) / "tokenizer.json" if Path(folder).is_dir() else Path(folder)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {folder}{_copies_inside(Path(folder))}")
        try:
            backend = Tokenizer.from_file(str(path))
        except Exception as e:
            raise ValueError(f"{path}: not a valid tokenizers file: {e}") from None
        config_path = path.parent / "tokenizer_config.json"
        ours = all(t in backend.get_vocab() for t in SPECIAL_TOKENS)
        tok = cls(backend) if ours else cls(backend, _foreign_names(config_path))
        template = path.parent / "chat_template.jinja"
        if template.is_file():
            tok.chat_template = template.read_text()
        elif config_path.is_file():
            tok.chat_template = json.loads(config_path.read_text()).get("chat_template") or tok.chat_template
        return tok


def with_chat_template(
    folder: str | Path, out: str | Path, template: str | None = None, add_special_tokens: list[str] = ()
) -> MarinTokenizer:
    """A copy of tokenizer `folder` in `out` with a chat template and extra special tokens. New tokens
    get the next ids, so every existing id means what it did: a model trained with the original
    keeps its embeddings, and its vocab_size must exceed the new ids (fine-tuning checks)."""
    from tokenizers import AddedToken

    tok = MarinTokenizer.load(folder)
    if template is not None:
        if "{{" not in template and "{%" not in template:
            raise ValueError("--template: that file is not a Jinja template")
        tok.chat_template = template
    if add_special_tokens:
        known = [t for t in add_special_tokens if t in tok.backend.get_vocab()]
        if known:
            raise ValueError(f"--add-special-tokens: {known} already in the vocabulary")
        tok.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in add_special_tokens])
        tok = MarinTokenizer(tok.backend, None if tok.names == {"bos": BOS, "eos": EOS, "pad": PAD} else tok.names)
        tok.chat_template = template or MarinTokenizer.load(folder).chat_template
    out = Path(out)
    if out.resolve() == Path(folder).resolve():
        raise ValueError("--out: write a new folder; runs and token shards name the original by its hash")
    tok.save(out)
    if tok.chat_template:
        write_text_atomic(out / "chat_template.jinja", tok.chat_template)
    return tok


def _foreign_names(config_path: Path) -> dict[str, str]:
    """bos/eos/pad of a tokenizer marinlm did not train, from its tokenizer_config.json: one
    without BOS starts documents with EOS (GPT-2's convention), one without PAD pads with EOS."""
    if not config_path.is_file():
        raise ValueError(f"{config_path.parent}: no marinlm special tokens, and no tokenizer_config.json")
    config = json.loads(config_path.read_text())

    def name(key):
        value = config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    eos = name("eos_token")
    if not eos:
        raise ValueError(f"{config_path}: eos_token: a tokenizer from elsewhere needs one")
    return {"bos": name("bos_token") or eos, "eos": eos, "pad": name("pad_token") or eos}


def _copies_inside(folder: Path) -> str:
    """A hint naming the tokenizers a folder of marinlm outputs holds (a run, its checkpoints, token
    shards and the quickstart each keep a copy in a `tokenizer/` folder); empty if it holds none."""
    if not folder.is_dir():
        return " (no such folder)" if not folder.exists() else ""
    found = [str(p.parent) for p in [*folder.glob("*/tokenizer.json"), *folder.glob("*/*/tokenizer.json")]]
    if not found:
        return ""
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return f"; the tokenizers inside it: {', '.join(sorted(found)[:3])}{more}"
