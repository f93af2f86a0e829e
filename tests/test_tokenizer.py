from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tqdm import tqdm

from marinlm.dataset.tokenizer_training import TokenizerTrainConfig, iter_training_texts, train_tokenizer
from marinlm.tokenizer import EOS, SPECIAL_TOKENS, MarinTokenizer, train_bpe
from marinlm.utils.io import OutputInUseError

from conftest import SAMPLE_TEXTS, shared_data, stdlib_python_texts


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> tuple[MarinTokenizer, str]:
    texts = SAMPLE_TEXTS * 50 + stdlib_python_texts(300_000)
    tok = MarinTokenizer(train_bpe(texts, vocab_size=1200))
    folder = tmp_path_factory.mktemp("tok")
    tok.save(folder)
    return tok, str(folder)


unicode_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=300)
tricky = st.sampled_from(
    ["\t\t  \n\n   ", "🚀🔥👩‍👩‍👧", "\x00\x01\x7f\u200b", "中文English混合123456", " " * 40, "\r\n\r\n"]
)


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.one_of(unicode_text, tricky), max_size=4).map("".join))
def test_decode_encode_round_trip(tokenizer, text):
    tok, _ = tokenizer
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_and_chat_template_match_transformers(tokenizer):
    transformers = pytest.importorskip("transformers")
    tok, folder = tokenizer
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    for text in SAMPLE_TEXTS + ["<|user|>\nhi<|end|>", "a <|eos|>b<|bos|>", "  leading spaces", "x" * 500]:
        # transformers maps special-token strings to their ids; marinlm does so only when asked
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text, allow_special=True)
        assert hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] == tok.encode(text)
        assert hf.decode(tok.encode(text)) == text == hf.decode(tok.encode(text, allow_special=True))
    assert hf.bos_token_id == tok.bos_id and hf.eos_token_id == tok.eos_id and hf.pad_token_id == tok.pad_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == tok.apply_chat_template(messages, add_generation_prompt=True)
    assert tok.encode(EOS, allow_special=True) == [tok.eos_id]
    assert all(len(tok.encode(t, allow_special=True)) == 1 for t in SPECIAL_TOKENS)
    # In data, a special token's text is ordinary text: no EOS in the middle of a document.
    for t in SPECIAL_TOKENS:
        assert not set(tok.encode(f"see {t} here")) & set(tok.special_ids.values())
        assert not set(tok.encode_batch([f"see {t} here"])[0]) & set(tok.special_ids.values())


def test_pretokenizer_splits_digits_cjk_and_indentation(tokenizer):
    tok, _ = tokenizer
    pieces = [tok.decode([i]) for i in tok.encode("x = 1234567 + 89\n        return 中文abc")]
    digit_pieces = [p for p in pieces if p.strip().isdigit()]
    assert all(len(p.strip()) <= 3 for p in digit_pieces) and "".join(digit_pieces).replace(" ", "") == "123456789"
    assert not any(
        any("\u4e00" <= c <= "\u9fff" for c in p) and any(c.isascii() and c.isalpha() for c in p) for p in pieces
    ), pieces  # no token mixes CJK and Latin letters
    assert any(p.strip() == "" and len(p) >= 4 for p in pieces), pieces  # indentation groups


def test_code_compresses_on_stdlib_sources(tokenizer):
    tok, _ = tokenizer
    held_out = stdlib_python_texts(700_000)[-5:]
    text = "\n".join(held_out)
    ratio = len(text.encode()) / len(tok.encode(text))
    assert ratio > 2.5, ratio  # bytes per token on code the tokenizer did not train on


def test_chinese_corpus_tokenizes_sensibly(tmp_path):
    songci = json.loads(shared_data("corpus", "zh_songci300.json").read_text())
    poems = ["".join(p["paragraphs"]) for p in songci]
    tok = MarinTokenizer(train_bpe(poems[:250] * 3, vocab_size=2000))
    held_out = "".join(poems[250:])
    ids = tok.encode(held_out)
    assert tok.decode(ids) == held_out
    assert len(held_out.encode()) / len(ids) > 2.5  # raw bytes would be 1.0; a CJK character is 3 bytes
    from collections import Counter

    common = [c for c, _ in Counter("".join(poems[:250])).most_common(50)]
    assert all(len(tok.encode(c)) == 1 for c in common)  # frequent characters are whole tokens


def test_train_tokenizer_command_writes_loadable_folder(tmp_path, capsys):
    from conftest import write_corpus

    write_corpus(tmp_path / "corpus", num_docs=60)
    config = TokenizerTrainConfig(inputs=[str(tmp_path / "corpus")], output_dir=str(tmp_path / "tok"), vocab_size=600)
    tok, report = train_tokenizer(config)
    assert report["documents"] == 60 and report["vocab_size"] == tok.vocab_size <= 600
    # Off a terminal HF tokenizers shows nothing for what may be hours: our bar over the inputs' bytes does.
    err = capsys.readouterr().err.splitlines()
    size = tqdm.format_sizeof(sum(p.stat().st_size for p in (tmp_path / "corpus").rglob("*") if p.is_file()))
    assert any(line.startswith("tokenizer: read: 100%") and f"| {size}/{size} [" in line for line in err), err
    assert err[-1] == "tokenizer: computing the merges"
    texts = list(iter_training_texts(config.inputs, "text", 0))  # all 60 are the sample (<= 256, short)
    assert max(map(len, texts)) < 16_384 and report["bytes_per_token_sample"]["documents"] == 60
    compression = sum(len(t.encode()) for t in texts) / sum(len(tok.encode(t)) for t in texts)
    assert report["bytes_per_token"] == round(compression, 3) and 2.0 < compression < 6.0
    again = MarinTokenizer.load(tmp_path / "tok")
    assert again.hash == tok.hash
    assert json.loads((tmp_path / "tok" / "train_report.json").read_text())["hash"] == tok.hash
    with pytest.raises(FileNotFoundError, match=r"no tokenizer.json at \S+nothing \(no such folder\)$"):
        MarinTokenizer.load(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer.json at \S+corpus$"):  # text: nothing to name
        MarinTokenizer.load(tmp_path / "corpus")
    # A run, token shards or the quickstart's folder, given for the tokenizer they keep a copy of.
    with pytest.raises(
        FileNotFoundError, match=rf"no tokenizer.json at {tmp_path}; the tokenizers inside it: {tmp_path / 'tok'}$"
    ):
        MarinTokenizer.load(tmp_path)
    # A second training run into the same folder would orphan shards made with the first tokenizer.
    with pytest.raises(OutputInUseError, match=r"tok: already holds a tokenizer \(sha256 "):
        train_tokenizer(TokenizerTrainConfig(inputs=config.inputs, output_dir=config.output_dir, vocab_size=300))
    assert MarinTokenizer.load(tmp_path / "tok").hash == tok.hash
    replaced, _ = train_tokenizer(config, replace=True)
    assert replaced.hash == tok.hash  # training is deterministic


def test_train_tokenizer_reports_rejects_and_refuses_to_train_on_nothing(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello world, hello tokenizer"}\n{broken\n{"body": "no text"}\n')
    config = TokenizerTrainConfig(inputs=[str(corpus)], output_dir=str(tmp_path / "tok"), vocab_size=600)
    _, report = train_tokenizer(config)
    assert report["documents"] == 1 and report["rejected"] == 2
    assert report["rejected_examples"][0].startswith(f"{corpus}:2: malformed JSON")
    assert report["vocab_size"] < report["vocab_size_requested"] == 600  # a tiny corpus: fewer merges
    # A wrong text field rejects every record: an error, and no bytes-only tokenizer is written.
    wrong = TokenizerTrainConfig(inputs=[str(corpus)], output_dir=str(tmp_path / "tok2"), text_field="content")
    with pytest.raises(ValueError, match=r"no document to train on .* 3 record\(s\) rejected \(first: .*:1: "):
        train_tokenizer(wrong)
    assert not (tmp_path / "tok2").exists()
    # Into a folder that holds another kind of output (token shards, a curation, a run): refused.
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / ".marinlm-job.json").write_text('{"job": "tokenize"}')
    into_shards = TokenizerTrainConfig(inputs=[str(corpus)], output_dir=str(tmp_path / "shards"), vocab_size=600)
    with pytest.raises(OutputInUseError, match=r"shards: holds token shards; writing a tokenizer there would mix"):
        train_tokenizer(into_shards)
    assert [p.name for p in (tmp_path / "shards").iterdir()] == [".marinlm-job.json"]
    # Empty files are documents without text: no tokenizer either.
    (tmp_path / "empty.txt").write_text("")
    empty = TokenizerTrainConfig(inputs=[str(tmp_path / "empty.txt")], output_dir=str(tmp_path / "tok3"))
    with pytest.raises(ValueError, match=r"no text \(1 empty document\(s\)\) to train on"):
        train_tokenizer(empty)
    assert not (tmp_path / "tok3").exists()


def test_the_command_line_trains_in_a_child_with_a_clean_log(tmp_path):
    """Its child drew the new progress bar with tqdm's default lock, a multiprocessing semaphore, and
    left it: "resource_tracker: There appear to be 1 leaked semaphore objects" ended the log."""
    import subprocess
    import sys

    from conftest import ROOT, write_corpus

    write_corpus(tmp_path / "corpus", num_docs=30)
    argv = ["tokenizer", "train", f"--inputs=[{tmp_path / 'corpus'}]", f"--output_dir={tmp_path / 'tok'}"]
    out = subprocess.run(
        [sys.executable, "-m", "marinlm", *argv, "--vocab_size=400"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "tokenizer: read: 100%" in out.stderr and "leaked" not in out.stderr, out.stderr


@pytest.mark.slow
def test_ctrl_c_stops_tokenizer_training_at_once(tmp_path):
    """HF tokenizers' training holds the main thread and Python sees no signal until it ends: Ctrl-C
    took effect only after the whole training (8 s later on this corpus; hours on a real one)."""
    import random
    import signal
    import string
    import subprocess
    import sys
    import time

    from conftest import ROOT

    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 12))) for _ in range(300_000)]
    with open(tmp_path / "corpus.txt", "w") as f:
        for _ in range(30_000):  # 51 MB: about 9 s of training on 2 cores
            f.write(" ".join(rng.choices(words, k=200)) + "\n")
    cmd = [sys.executable, "-m", "marinlm", "tokenizer", "train", f"--inputs=[{tmp_path / 'corpus.txt'}]"]
    child = subprocess.Popen(
        [*cmd, f"--output_dir={tmp_path / 'tok'}", "--vocab_size=30000"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not ignored, as in a terminal
    )
    time.sleep(4)  # imports, the spawn, and into the training
    sent = time.perf_counter()
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130, err[-2000:]
    assert time.perf_counter() - sent < 3, "Ctrl-C waited for the training to end"
    assert not (tmp_path / "tok" / "tokenizer.json").exists()


def test_a_byte_budget_samples_every_input_file(tmp_path):
    """Curated shards hold one source each. With max_bytes, the tokenizer's text came from the first
    files alone, so a later source (here: Chinese) was left out of the vocabulary."""
    from marinlm.dataset.tokenizer_training import iter_training_texts

    for name, line in [("00000", "def parse(value): return value"), ("00001", "中文的句子和更多的汉字")]:
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i in range(200):
                f.write(json.dumps({"text": f"{line} {i}"}) + "\n")
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    texts = list(iter_training_texts([str(tmp_path)], "text", max_bytes=total // 4))
    english = sum(len(t.encode()) for t in texts if t.startswith("def"))
    chinese = sum(len(t.encode()) for t in texts if t.startswith("中文"))
    assert english > 0.1 * total / 4 and chinese > 0.1 * total / 4
    assert english + chinese < total / 3  # about the budget, not everything
    assert len(list(iter_training_texts([str(tmp_path)], "text", max_bytes=0))) == 400  # 0 = all
