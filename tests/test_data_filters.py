"""Each curation step's decision on hand-written documents."""

from __future__ import annotations

import pytest

from marinlm.data.filters import (
    C4Config,
    C4Document,
    C4Lines,
    FineWebConfig,
    FineWebQuality,
    GopherQuality,
    GopherQualityConfig,
    GopherRepetition,
    GopherRepetitionConfig,
)
from marinlm.data.normalize import LangIdConfig, LanguageId, Normalize, NormalizeConfig
from marinlm.data.pii import MaskPII, PIIConfig
from marinlm.data.readers import Document
from marinlm.data.steps import ShardContext

GOOD_PROSE = (
    "The river rose slowly through the night, and by morning the village had moved its animals to the hill. "
    "Farmers said that the water had not been this high since their grandparents were young. "
    "Children watched from the church steps as boats carried bread and blankets to the houses near the bridge. "
    "By evening the rain stopped, and the people began to clean the mud from their floors with brooms and buckets. "
    "Nobody was hurt, and the mayor thanked everyone who had helped their neighbours during the long, cold day."
)


def doc(text: str, language: str = "en", path: str = "") -> Document:
    return Document(id="t", text=text, source="test", metadata={"language": language, "path": path})


def run(step, text, language="en", path=""):
    ctx = ShardContext("s")
    out = list(step([doc(text, language, path)], ctx))
    return (out[0].text if out else None), ctx


def reason(step, text, language="en"):
    ctx = ShardContext("s")
    list(step([doc(text, language)], ctx))
    reasons = [r for per_source in ctx.stats[step.name].dropped.values() for r in per_source]
    return reasons[0] if reasons else None


GQ = GopherQuality(GopherQualityConfig(), ["en"])


@pytest.mark.parametrize(
    "text, expected",
    [
        (GOOD_PROSE, None),
        ("Too short to be a page.", "gopher_short_doc"),
        (GOOD_PROSE + " #tag" * 40, "gopher_too_many_hashes"),
        ("\n".join(f"- item number {i} of the list with the and to of" for i in range(60)), "gopher_too_many_bullets"),
        (" ".join(["12345 67890 24680 13579 99999"] * 15) + " the and", "gopher_too_few_alpha_words"),
        (" ".join(["table chair window garden lamp"] * 20), "gopher_too_few_stop_words"),
        (" ".join(["a b c"] * 40) + " the and of", "gopher_short_words"),
    ],
)
def test_gopher_quality(text, expected):
    assert reason(GQ, text) == expected


def test_gopher_filters_skip_other_languages():
    assert reason(GQ, "短文。", language="zh") is None
    assert reason(GQ, "x = 1", language="code") is None


GR = GopherRepetition(GopherRepetitionConfig(), ["en"])


@pytest.mark.parametrize(
    "text, expected",
    [
        (GOOD_PROSE, None),
        ("\n\n".join(["Buy now and save big on everything you need today."] * 5 + [GOOD_PROSE]), "dup_para_frac"),
        ("\n".join(["Click here to subscribe."] * 6 + GOOD_PROSE.split(". ")), "dup_line_frac"),
        (GOOD_PROSE + " " + "lorem ipsum " * 200, "top_2_gram"),
        (GOOD_PROSE + " " + " ".join(f"one two three four five w{i % 7}" for i in range(40)), "top_3_gram"),
    ],
)
def test_gopher_repetition(text, expected):
    assert reason(GR, text) == expected


def test_c4_lines_and_document_rules():
    c4 = C4Config()
    text = (
        "Home | About | Contact\n"
        "This line ends well and has words.\n"
        "Enable JavaScript to view this page properly.\n"
        "We use cookies, see our privacy policy for more.\n"
        "Another proper sentence with enough words [1].\n"
        "ok.\n"
    )
    cleaned, ctx = run(C4Lines(c4, ["en"]), text)
    assert cleaned == "This line ends well and has words.\nAnother proper sentence with enough words ."
    assert ctx.stats["c4_lines"].counters["lines_removed"] == 4
    doc_rule = C4Document(c4, ["en"])
    five = " ".join(f"Sentence number {i} is here." for i in range(5))
    assert reason(doc_rule, five) is None
    assert reason(doc_rule, "One sentence. Two sentences.") == "too_few_sentences"
    assert reason(doc_rule, five + " Lorem ipsum dolor sit amet.") == "lorem_ipsum"
    assert reason(doc_rule, five + " function() { return 1; }") == "curly_bracket"


def test_fineweb_rules():
    fw = FineWebQuality(FineWebConfig(), ["en"])
    assert reason(fw, GOOD_PROSE) is None
    assert reason(fw, "\n".join(f"menu item {i}" for i in range(30))) == "line_punct_ratio"
    short_lines = "\n".join(["Short one."] * 3 + [f"Tiny {i}." for i in range(10)] + [GOOD_PROSE])
    assert reason(fw, short_lines) == "short_line_ratio"


def test_pii_masking_counts_and_spares_lookalikes():
    text = (
        "Write to jane.doe@example.com or call +1 (415) 555-0134 / 020 7946 0958. Server 93.184.216.34 "
        "is up; localhost 127.0.0.1 stays; version 1.2.3.4.5 stays; order 1234567890 stays; ::1 stays"
    )
    masked, ctx = run(MaskPII(PIIConfig()), text)
    assert "<EMAIL>" in masked and "jane.doe" not in masked
    assert masked.count("<PHONE_NUMBER>") == 2
    assert "<IP_ADDRESS>" in masked and "93.184" not in masked
    for kept in ("127.0.0.1", "1.2.3.4.5", "1234567890"):
        assert kept in masked
    counters = ctx.stats["pii"].counters
    assert (counters["email"], counters["phone_number"], counters["ip_address"]) == (1, 2, 1)


def test_normalize_repairs_encoding_nfc_controls_and_whitespace():
    text = "cafÃ©\u0000 and cafe\u0301 \r\nline with trailing   \r\n\n\n\n\nnext\u00a0word\x07"
    out, ctx = run(Normalize(NormalizeConfig()), text)
    assert out == "café and café\nline with trailing\n\nnext word"
    assert ctx.stats["normalize"].counters["encoding_repaired"] == 1
    code, _ = run(Normalize(NormalizeConfig()), "def f():\n    return 1   \n", language="code")
    assert code == "def f():\n    return 1"  # indentation kept, trailing spaces gone


def test_language_id_english_chinese_code_and_others():
    lid = LanguageId(LangIdConfig(allowed=["en", "zh", "code"], threshold=0.5))
    chinese = "学而时习之，不亦说乎？有朋自远方来，不亦乐乎？人不知而不愠，不亦君子乎？"
    code = "import os\n\ndef main():\n    for x in range(3):\n        print(x)\n\nmain()\n"
    for text, lang in [(GOOD_PROSE, "en"), (chinese, "zh"), (code, "code")]:
        d = doc(text, language="")
        assert lid.decide(d) is None, text
        assert d.metadata["language"] == lang
    assert lid.decide(doc("x = 1", path="tool.py")) is None  # suffix says code
    assert lid.decide(doc("Le chat dort sur la table de la cuisine depuis ce matin.")) == "language_fr"
