"""Normalisation and language identification."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

from marinlm.config import check
from marinlm.data.steps import Filter, Transform

# C0/C1 controls except tab and newline; also lone surrogates and the BOM/zero-width no-break space.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufeff]")
_TRAILING_SPACE = re.compile(r"[ \t\u00a0\u3000]+$", re.M)
_BLANK_RUNS = re.compile(r"\n{3,}")
_ODD_SPACES = re.compile(r"[\u00a0\u2000-\u200a\u202f\u205f]")


@dataclass(kw_only=True)
class NormalizeConfig:
    enabled: bool = True
    fix_encoding: bool = True  # repair mojibake with ftfy (e.g. "cafÃ©" -> "café")
    nfc: bool = True
    remove_control: bool = True
    whitespace: bool = True  # \r\n -> \n, exotic spaces -> space, trailing spaces, >2 blank lines


class Normalize(Transform):
    name = "normalize"

    def __init__(self, config: NormalizeConfig):
        self.config = config

    def apply(self, doc, ctx):
        c, text = self.config, doc.text
        if c.fix_encoding:
            import ftfy

            # Only repair encodings; leave quotes, ligatures and width alone (they are content).
            fixed = ftfy.fix_text(
                text,
                unescape_html=False,
                uncurl_quotes=False,
                fix_latin_ligatures=False,
                fix_character_width=False,
                normalization=None,
                fix_line_breaks=False,
                remove_terminal_escapes=True,
            )
            if fixed != text:
                ctx.stats[self.name].counters["encoding_repaired"] += 1
                text = fixed
        if c.nfc:
            text = unicodedata.normalize("NFC", text)
        if c.remove_control:
            text, n = _CONTROL.subn("", text)
            ctx.stats[self.name].counters["control_chars_removed"] += n
        if c.whitespace:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
            if doc.metadata.get("language") != "code":
                text = _ODD_SPACES.sub(" ", text)
            text = _TRAILING_SPACE.sub("", text)
            text = _BLANK_RUNS.sub("\n\n", text).strip("\n")
        return text


@dataclass(kw_only=True)
class LangIdConfig:
    enabled: bool = True
    allowed: list[str] = field(default_factory=lambda: ["en", "zh", "code"])  # ISO 639-1 codes, or "code"
    threshold: float = 0.5  # minimum langid probability for natural-language documents
    code_threshold: float = 0.35  # share of lines that look like code to call a document code

    def __post_init__(self):
        check(0 <= self.threshold <= 1, "threshold", f"must be in [0, 1], got {self.threshold}")


_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import|#include|return\b|if .*:$|for .*:$|while .*:$|elif |else:|try:|"
    r"except\b|public |private |function |var |let |const |package |fn |func |#!|@\w+)"
    r"|[;{}]\s*$|^\s{4,}\S|^\s*(#|//)"
)
CODE_SUFFIXES = (".py", ".js", ".ts", ".c", ".h", ".cc", ".cpp", ".java", ".go", ".rs", ".rb", ".sh", ".php")


def looks_like_code(text: str, threshold: float) -> bool:
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return False
    return sum(bool(_CODE_LINE.search(line)) for line in lines) / len(lines) >= threshold


class LanguageId(Filter):
    """Label `metadata.language` (py3langid, whose model ships in the package) and drop documents
    outside `allowed` or below `threshold`. Code is recognised first, by file suffix or by the share
    of code-like lines, since language identifiers read code as noise."""

    name = "langid"

    def __init__(self, config: LangIdConfig):
        import py3langid

        self.config = config
        langid = py3langid.langid
        self.identifier = langid.LanguageIdentifier.from_model_file(langid.MODEL_FILE, norm_probs=True)

    def decide(self, doc):
        c = self.config
        path = str(doc.metadata.get("path") or doc.metadata.get("file", ""))  # a record's own path, else its file
        if path.endswith(CODE_SUFFIXES) or looks_like_code(doc.text[:20000], c.code_threshold):
            lang, prob = "code", 1.0
        else:
            lang, prob = self.identifier.classify(doc.text[:20000])
        doc.metadata["language"], doc.metadata["language_score"] = lang, round(float(prob), 4)
        if lang not in c.allowed:
            return f"language_{lang}"
        if prob < c.threshold:
            return "language_low_confidence"
        return None
