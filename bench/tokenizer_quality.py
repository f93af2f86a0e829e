"""Compression (UTF-8 bytes per token) of our byte-level BPE against SentencePiece BPE and HF's
plain ByteLevel BPE (GPT-2's pre-tokenizer, `tokenizers`).

All train on the same text with the same vocabulary size and are scored on held-out English
prose, Chinese and Python code. Training time of each is reported. Higher bytes/token is better.
The last line is the smallest ratio of ours to the best peer over domains and vocabularies.

    python bench/tokenizer_quality.py [--vocab 8192 32768]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from marinlm.tokenizer import MarinTokenizer, train_bpe

from corpus import chinese, english, python_code


def split(texts: list[str], held_out: float = 0.1) -> tuple[list[str], list[str]]:
    cut = int(len(texts) * (1 - held_out))
    return texts[:cut], texts[cut:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, nargs="+", default=[8192, 32768])
    a = p.parse_args()
    import sentencepiece as spm

    domains = {"english": english(), "chinese": chinese(), "python": python_code(6_000_000)}
    domains = {k: v for k, v in domains.items() if v}
    train, test = [], {}
    for name, texts in domains.items():
        tr, te = split(texts)
        train += tr
        test[name] = "\n".join(te)
    train_bytes = sum(len(t.encode()) for t in train)

    smallest = float("inf")
    for vocab in a.vocab:
        smallest = min(smallest, compare(train, test, vocab, train_bytes, spm))
    print(f"smallest ratio to the best peer: {smallest:.3f}")


def bytelevel_bpe(train: list[str], vocab: int):
    """HF `tokenizers` BPE with GPT-2's ByteLevel pre-tokenizer and decoder, nothing else."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(train, trainer=trainer)
    return tok


def compare(train, test, vocab, train_bytes, spm) -> float:
    start = time.perf_counter()
    ours = MarinTokenizer(train_bpe(train, vocab_size=vocab))
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    plain = bytelevel_bpe(train, vocab)
    plain_s = time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "train.txt"
        # SentencePiece reads lines; keep each line as a sentence, as its docs recommend.
        corpus.write_text("\n".join(train))
        start = time.perf_counter()
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(Path(tmp) / "sp"),
            vocab_size=vocab,
            model_type="bpe",
            character_coverage=0.9995,
            byte_fallback=True,
            max_sentence_length=1 << 16,
            input_sentence_size=0,
            num_threads=2,
            minloglevel=2,
            split_digits=True,
            remove_extra_whitespaces=False,
            normalization_rule_name="identity",
        )
        sp_s = time.perf_counter() - start
        sp = spm.SentencePieceProcessor(model_file=str(Path(tmp) / "sp.model"))

    print(
        f"\ntrained on {train_bytes / 1e6:.1f} MB, vocab {vocab}: marinlm BPE {ours_s:.1f} s, ByteLevel BPE "
        f"{plain_s:.1f} s, SentencePiece BPE {sp_s:.1f} s"
    )
    print(
        f"{'held-out':<10}{'bytes':>12}{'marinlm':>10}{'ByteLevel':>11}{'SentPiece':>11}{'ours/best':>11}  round trip"
    )
    smallest = float("inf")
    for name, text in test.items():
        n = len(text.encode())
        ours_ids, plain_ids, sp_ids = ours.encode(text), plain.encode(text).ids, sp.encode(text)
        exact = ours.decode(ours_ids) == text
        best = max(n / len(plain_ids), n / len(sp_ids))
        ratio = (n / len(ours_ids)) / best
        smallest = min(smallest, ratio)
        print(
            f"{name:<10}{n:>12,}{n / len(ours_ids):>10.3f}{n / len(plain_ids):>11.3f}{n / len(sp_ids):>11.3f}"
            f"{ratio:>11.3f}  marinlm {exact}"
        )
    return smallest


if __name__ == "__main__":
    main()
