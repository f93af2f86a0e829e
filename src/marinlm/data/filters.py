"""Heuristic quality filters with the published thresholds as defaults.

- Gopher quality and repetition: Rae et al. 2021, "Scaling Language Models", Appendix A
  (https://arxiv.org/abs/2112.11446).
- C4: Raffel et al. 2020, section 2.2, plus the rules in its reference code (c4_utils.py).
- FineWeb's extra rules: Penedo et al. 2024 (https://arxiv.org/abs/2406.17557).

Words are split with one regex (runs of non-space) and stripped of surrounding punctuation where a
rule asks about letters; this is much faster than a full word tokenizer and matches whitespace
languages, which is what these English-prose rules were designed for. The filters only apply to
the languages listed in `languages` (code and Chinese pass through).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from marinlm.data.steps import Filter, Transform, language_of

_WORDS = re.compile(r"\S+")
_PARAGRAPHS = re.compile(r"\n{2,}")
_LINES = re.compile(r"\n+")
_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
PUNCTUATION = set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~…–—‘’“”«»¿¡、。，．！？：；")
STOP_WORDS = {"the", "be", "to", "of", "and", "that", "have", "with"}


def words_of(text: str) -> list[str]:
    return _WORDS.findall(text)


NO_LANGUAGE = "passed_over_without_language"


class _LanguageScoped:
    """A step with its config `c` that applies only to documents in `languages` (all if empty)."""

    def __init__(self, config, languages: list[str]):
        self.c, self.languages = config, languages

    def applies_to(self, doc) -> bool:
        return not self.languages or language_of(doc) in self.languages

    def passed_over(self, doc, ctx) -> None:
        if language_of(doc) == "unknown":  # langid off and no `language` field: the report warns
            ctx.stats[self.name].counters[NO_LANGUAGE] += 1


@dataclass(kw_only=True)
class GopherQualityConfig:
    enabled: bool = True
    min_doc_words: int = 50
    max_doc_words: int = 100_000
    min_avg_word_length: float = 3.0
    max_avg_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1  # '#' and ellipses per word
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    min_alpha_words_ratio: float = 0.8  # share of words with at least one letter
    min_stop_words: int = 2


class GopherQuality(_LanguageScoped, Filter):
    name = "gopher_quality"

    def decide(self, doc):
        c, text = self.c, doc.text
        words = words_of(text)
        n = len(words)
        if n == 0:
            return "gopher_no_words"
        content = [w for w in words if not all(ch in PUNCTUATION for ch in w)]
        if len(content) < c.min_doc_words:
            return "gopher_short_doc"
        if len(content) > c.max_doc_words:
            return "gopher_long_doc"
        mean_len = sum(map(len, content)) / len(content)
        if mean_len < c.min_avg_word_length:
            return "gopher_short_words"
        if mean_len > c.max_avg_word_length:
            return "gopher_long_words"
        if text.count("#") / n > c.max_symbol_word_ratio:
            return "gopher_too_many_hashes"
        if (text.count("...") + text.count("…")) / n > c.max_symbol_word_ratio:
            return "gopher_too_many_ellipses"
        lines = text.splitlines() or [""]
        if sum(line.lstrip().startswith(("•", "-", "*")) for line in lines) / len(lines) > c.max_bullet_lines_ratio:
            return "gopher_too_many_bullets"
        if sum(line.rstrip().endswith(("...", "…")) for line in lines) / len(lines) > c.max_ellipsis_lines_ratio:
            return "gopher_too_many_end_ellipses"
        if sum(any(ch.isalpha() for ch in w) for w in words) / n < c.min_alpha_words_ratio:
            return "gopher_too_few_alpha_words"
        lowered = {w.strip("".join(PUNCTUATION)).lower() for w in words}
        if len(STOP_WORDS & lowered) < c.min_stop_words:
            return "gopher_too_few_stop_words"
        return None


@dataclass(kw_only=True)
class GopherRepetitionConfig:
    enabled: bool = True
    max_dup_line_frac: float = 0.30
    max_dup_para_frac: float = 0.30
    max_dup_line_char_frac: float = 0.20
    max_dup_para_char_frac: float = 0.20
    top_ngram_char_frac: dict[int, float] = field(default_factory=lambda: {2: 0.20, 3: 0.18, 4: 0.16})
    dup_ngram_char_frac: dict[int, float] = field(
        default_factory=lambda: {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}
    )


def _duplicates(items: list[str]) -> tuple[int, int]:
    """(duplicate items, characters in duplicate items), counting every repeat after the first."""
    seen, count, chars = set(), 0, 0
    for item in items:
        if item in seen:
            count += 1
            chars += len(item)
        else:
            seen.add(item)
    return count, chars


class GopherRepetition(_LanguageScoped, Filter):
    """Duplicate lines/paragraphs and repeated n-grams, as fractions of the document's characters."""

    name = "gopher_repetition"

    def decide(self, doc):
        c, text = self.c, doc.text
        if not text:
            return "empty"
        length = len(text)
        paragraphs = _PARAGRAPHS.split(text.strip())
        dup, chars = _duplicates(paragraphs)
        if dup / len(paragraphs) > c.max_dup_para_frac:
            return "dup_para_frac"
        if chars / length > c.max_dup_para_char_frac:
            return "dup_para_char_frac"
        lines = _LINES.split(text)
        dup, chars = _duplicates(lines)
        if dup / len(lines) > c.max_dup_line_frac:
            return "dup_line_frac"
        if chars / length > c.max_dup_line_char_frac:
            return "dup_line_char_frac"
        words = words_of(text)
        # Work on integer word ids: n-grams become tuples of ints, far cheaper than joined strings.
        vocab: dict[str, int] = {}
        ids = [vocab.setdefault(w, len(vocab)) for w in words]
        id_length = [len(w) for w in vocab]  # dicts keep insertion order: index = id
        lengths = [len(w) for w in words]
        for n, limit in c.top_ngram_char_frac.items():
            if len(ids) < n:
                continue
            grams = Counter(zip(*(ids[i:] for i in range(n))))
            gram, count = grams.most_common(1)[0]
            # characters of the top n-gram (words joined with single spaces) times its count
            gram_chars = sum(id_length[g] for g in gram) + n - 1
            if gram_chars * count / length > limit:
                return f"top_{n}_gram"
        for n, limit in sorted(c.dup_ngram_char_frac.items()):
            if self._duplicated_ngram_chars(ids, lengths, n) / length > limit:
                return f"duplicated_{n}_grams"
        return None

    @staticmethod
    def _duplicated_ngram_chars(ids: list[int], lengths: list[int], n: int) -> int:
        """Characters covered by n-grams seen earlier, scanning left to right and skipping past each
        repeat so overlapping repeats are not double-counted (Gopher's definition)."""
        seen, total, i = set(), 0, 0
        while i <= len(ids) - n:
            gram = tuple(ids[i : i + n])
            if gram in seen:
                total += sum(lengths[i : i + n])
                i += n
            else:
                seen.add(gram)
                i += 1
        return total


@dataclass(kw_only=True)
class C4Config:
    enabled: bool = True
    remove_citations: bool = True  # [1], [edit], [citation needed]
    min_words_per_line: int = 3
    max_word_length: int = 1000
    min_sentences: int = 5
    require_terminal_punct: bool = True
    filter_javascript_lines: bool = True
    filter_policy_lines: bool = True
    filter_lorem_ipsum: bool = True
    filter_curly_bracket: bool = True


_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")
_TERMINAL = (".", "?", "!", '"', "'")
_POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")


class C4Lines(_LanguageScoped, Transform):
    """C4's line rules: keep lines that end in terminal punctuation, have enough words, no giant
    word, no 'javascript' and no cookie/terms boilerplate. Counts removed lines."""

    name = "c4_lines"

    def apply(self, doc, ctx):
        c = self.c
        kept = []
        removed = 0
        for raw in doc.text.splitlines():
            line = raw.strip()
            words = line.split()
            if any(len(w) > c.max_word_length for w in words):
                removed += 1
                continue
            if c.remove_citations:
                line = _CITATION.sub("", line)
            lowered = line.lower()
            if (
                (c.require_terminal_punct and (not line.endswith(_TERMINAL) or line.endswith("...")))
                or len(words) < c.min_words_per_line
                or (c.filter_javascript_lines and "javascript" in lowered)
                or (c.filter_policy_lines and any(p in lowered for p in _POLICY))
            ):
                removed += 1
                continue
            kept.append(line)
        ctx.stats[self.name].counters["lines_removed"] += removed
        return "\n".join(kept)


class C4Document(_LanguageScoped, Filter):
    """C4's document rules: drop pages with lorem ipsum, a curly bracket, or too few sentences."""

    name = "c4_document"

    def decide(self, doc):
        c, text = self.c, doc.text
        if c.filter_lorem_ipsum and "lorem ipsum" in text.lower():
            return "lorem_ipsum"
        if c.filter_curly_bracket and "{" in text:
            return "curly_bracket"
        if len(_SENTENCE_END.findall(text)) < c.min_sentences:
            return "too_few_sentences"
        return None


@dataclass(kw_only=True)
class FineWebConfig:
    enabled: bool = True
    min_line_punct_ratio: float = 0.12
    max_short_line_ratio: float = 0.67
    short_line_length: int = 30
    max_char_duplicates_ratio: float = 0.01
    max_newline_ratio: float = 0.3


class FineWebQuality(_LanguageScoped, Filter):
    name = "fineweb_quality"

    def decide(self, doc):
        c, text = self.c, doc.text
        lines = [line for line in text.split("\n") if line.strip()]
        if not lines:
            return "empty"
        if sum(line.endswith(_TERMINAL + ("…",)) for line in lines) / len(lines) < c.min_line_punct_ratio:
            return "line_punct_ratio"
        if sum(len(line) <= c.short_line_length for line in lines) / len(lines) > c.max_short_line_ratio:
            return "short_line_ratio"
        if _duplicates(lines)[1] / max(1, len(text.replace("\n", ""))) > c.max_char_duplicates_ratio:
            return "char_dup_ratio"
        if text.count("\n") / max(1, len(words_of(text))) > c.max_newline_ratio:
            return "list_ratio"
        return None


@dataclass(kw_only=True)
class QualityConfig:
    languages: list[str] = field(default_factory=lambda: ["en"])  # documents these filters judge
    gopher_quality: GopherQualityConfig = field(default_factory=GopherQualityConfig)
    gopher_repetition: GopherRepetitionConfig = field(default_factory=GopherRepetitionConfig)
    c4: C4Config = field(default_factory=C4Config)
    fineweb: FineWebConfig = field(default_factory=FineWebConfig)


def quality_steps(config: QualityConfig) -> list:
    steps = []
    if config.gopher_repetition.enabled:
        steps.append(GopherRepetition(config.gopher_repetition, config.languages))
    if config.gopher_quality.enabled:
        steps.append(GopherQuality(config.gopher_quality, config.languages))
    if config.c4.enabled:
        steps += [C4Lines(config.c4, config.languages), C4Document(config.c4, config.languages)]
    if config.fineweb.enabled:
        steps.append(FineWebQuality(config.fineweb, config.languages))
    return steps
