"""Compression (UTF-8 bytes per token) of our byte-level BPE against SentencePiece BPE.

Both train on the same text with the same vocabulary size and are scored on held-out English
prose, Chinese and Python code. Training time of each is reported. Higher bytes/token is better.

    python bench/tokenizer_quality.py [--vocab 16384]
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
    p.add_argument("--vocab", type=int, default=16384)
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

    start = time.perf_counter()
    ours = MarinTokenizer(train_bpe(train, vocab_size=a.vocab))
    ours_s = time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "train.txt"
        # SentencePiece reads lines; keep each line as a sentence, as its docs recommend.
        corpus.write_text("\n".join(train))
        start = time.perf_counter()
        spm.SentencePieceTrainer.train(
            input=str(corpus),
            model_prefix=str(Path(tmp) / "sp"),
            vocab_size=a.vocab,
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
        f"trained on {train_bytes / 1e6:.1f} MB, vocab {a.vocab}: marinlm BPE {ours_s:.1f} s, "
        f"SentencePiece BPE {sp_s:.1f} s ({sp_s / ours_s:.1f}x ours)"
    )
    print(f"{'held-out':<10}{'bytes':>12}{'marinlm B/tok':>16}{'sentencepiece B/tok':>22}{'ratio':>8}  round trip")
    for name, text in test.items():
        n = len(text.encode())
        ours_ids, sp_ids = ours.encode(text), sp.encode(text)
        exact = ours.decode(ours_ids) == text
        sp_exact = sp.decode(sp_ids) == text
        print(
            f"{name:<10}{n:>12,}{n / len(ours_ids):>16.3f}{n / len(sp_ids):>22.3f}"
            f"{len(sp_ids) / len(ours_ids):>8.3f}  marinlm {exact}, sentencepiece {sp_exact}"
        )


if __name__ == "__main__":
    main()
