"""End-to-end `marinlm tokenize` throughput against bare HF `tokenizers` encode_batch.

(Not named bench/tokenize.py: run as a script, that name would shadow the standard library's
`tokenize` module.)

Both tokenize the same documents with the same tokenizer. The bare call reads nothing and writes
nothing: its texts are already in memory, so it is the practical limit. Ours reads jsonl shards,
splits train/val, writes token shards and indexes, hashes every file and writes a manifest.

    python bench/tokenize_throughput.py [--workers 2] [--shards 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from marinlm.dataset.tokenize import TokenizeConfig, tokenize
from marinlm.tokenizer import MarinTokenizer, train_bpe

from corpus import chinese, english, python_code


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3, help="copies of the corpus (more text, steadier timing)")
    a = p.parse_args()
    texts = (english() + chinese() + python_code()) * a.repeat
    total_bytes = sum(len(t.encode()) for t in texts)
    work = Path(tempfile.mkdtemp(prefix="marinlm-bench-"))
    try:
        tok = MarinTokenizer(train_bpe(texts[: len(texts) // a.repeat], vocab_size=16384))
        tok.save(work / "tok")
        for s in range(a.shards):
            with open(work / f"shard-{s}.jsonl", "w") as f:
                for i in range(s, len(texts), a.shards):
                    f.write(json.dumps({"id": str(i), "text": texts[i]}) + "\n")

        start = time.perf_counter()
        encodings = tok.backend.encode_batch(texts, add_special_tokens=False)
        bare_s = time.perf_counter() - start
        bare_tokens = sum(len(e.ids) for e in encodings)
        del encodings
        start = time.perf_counter()
        tok.backend.encode_batch_fast(texts, add_special_tokens=False)
        fast_s = time.perf_counter() - start

        config = TokenizeConfig(
            inputs=[str(work / f"shard-{s}.jsonl") for s in range(a.shards)],
            tokenizer=str(work / "tok"),
            output_dir=str(work / "out"),
            workers=a.workers,
        )
        start = time.perf_counter()
        manifest = tokenize(config, progress=False)
        ours_s = time.perf_counter() - start
        ours_tokens = manifest["train_tokens"] + manifest["val_tokens"]
        assert ours_tokens == bare_tokens, (ours_tokens, bare_tokens)

        cores = os.cpu_count()
        print(f"corpus: {len(texts)} documents, {total_bytes / 1e6:.1f} MB, {bare_tokens:,} tokens; {cores} cores")
        print(
            f"HF tokenizers encode_batch (in memory, Rust threads on {cores} cores): "
            f"{bare_tokens / bare_s:12,.0f} tok/s  ({bare_s:.2f} s)"
        )
        print(
            f"HF tokenizers encode_batch_fast (no offsets; what marinlm calls):     "
            f"{bare_tokens / fast_s:12,.0f} tok/s  ({fast_s:.2f} s)"
        )
        print(
            f"marinlm tokenize ({min(a.workers, a.shards)} worker processes, jsonl in, shards out):"
            f" {ours_tokens / ours_s:12,.0f} tok/s  ({ours_s:.2f} s)"
        )
        ratio = bare_s / ours_s
        print(
            f"ratio: {ratio:.1%} of bare encode_batch (target >= 90%): {'met' if ratio >= 0.9 else 'MISSED'}; "
            f"{fast_s / ours_s:.1%} of bare encode_batch_fast"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
