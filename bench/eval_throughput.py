"""HellaSwag scoring throughput on the `small` preset: batched against one request at a time.

Batched = requests grouped by context, each context computed once with the KV cache, longest
first, 32 rows per forward. Naive = one (context + ending) forward per request, as a first
implementation would do it. Both must give the same log-likelihoods; the largest difference is
printed. Needs ../shared/data/eval/hellaswag_val.jsonl.

    python bench/eval_throughput.py [--items 100]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from marinlm.config import load_config
from marinlm.eval.lm import Scorer
from marinlm.eval.tasks import subset, task_registry
from marinlm.kernels import apply_kernels
from marinlm.model import MarinConfig, MarinForCausalLM
from marinlm.presets import preset
from marinlm.tokenizer import MarinTokenizer, train_bpe
from marinlm.utils.perf import tune_cpu_allocator

from corpus import SHARED, english, python_code


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--items", type=int, default=100)
    a = p.parse_args()
    tune_cpu_allocator()
    data_dir = SHARED.parent / "eval"
    items = subset(task_registry()["hellaswag"].load(Path(data_dir)), a.items)
    requests = [r for item in items for r in item.requests]
    tok = MarinTokenizer(train_bpe(english()[:3000] + python_code(1_000_000), vocab_size=8192))
    config = load_config(MarinConfig, preset("model", "small"))
    model = apply_kernels(MarinForCausalLM(config), "cpu", "fp32")
    model.init_weights(seed=0)
    model.eval()
    runs = {}
    for name, scorer in (
        ("batched (32, shared contexts)", Scorer(model, tok, batch_size=32)),
        ("one request at a time", Scorer(model, tok, batch_size=1, share_context=False)),
    ):
        scorer.loglikelihood(requests[:8])  # warm-up
        start = time.perf_counter()
        results = scorer.loglikelihood(requests)
        runs[name] = (time.perf_counter() - start, results)
    (t_batched, r_batched), (t_naive, r_naive) = runs.values()
    diff = max(abs(x[0] - y[0]) for x, y in zip(r_batched, r_naive))
    print(
        f"hellaswag, {len(items)} items ({len(requests)} requests), small preset "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), {torch.get_num_threads()} threads"
    )
    for name, (t, _) in runs.items():
        print(f"  {name:<32} {len(items) / t:7.2f} items/s  ({t:.1f} s)")
    print(f"  ratio batched / naive: {t_naive / t_batched:.2f}x; largest log-likelihood difference {diff:.2e}")


if __name__ == "__main__":
    main()
