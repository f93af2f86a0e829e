"""Peak memory and time of scoring without the [B, T, V] logits, against materialising them.

Three jobs on a `tiny`-shaped model with a 32k vocabulary (a larger vocabulary makes the logits
the dominant buffer, as Marin's 128k one does at scale):

- validation: 2 batches of 8 x 1,024 tokens, mean loss per token (`train.step.validate`);
- rolling log-likelihood: 16 windows of 1,024 tokens, 8 a batch (`Scorer.loglikelihood_rolling`,
  the `bpb:PATH` tasks and lm-eval-harness's `loglikelihood_rolling`);
- prefill: the next-token logits of 4 prompts of 4,096 tokens (`generate`'s first step).

Peer: the same model, its logits materialised and log-softmaxed in fp32, which is what
`transformers`' forward plus lm-evaluation-harness's `HFLM` do (and what marinlm did before).
Each contender runs in a fresh process; its peak RSS (`ru_maxrss`) is printed beside the RSS
after building the model, with the result, so that equal work is visible.

    python bench/scoring_memory.py
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import torch

JOBS = ("validation", "rolling", "prefill")
VOCAB = 32768


def _model(max_seq_len: int):
    from marinlm.config import load_config
    from marinlm.model import MarinConfig
    from marinlm.presets import preset
    from train_step import build_ours

    config = load_config(MarinConfig, preset("model", "tiny"))
    config.vocab_size, config.max_seq_len = VOCAB, max_seq_len
    return build_ours(config).eval()


def _ids(shape) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(0))


def _materialised_nll(model, ids, labels) -> torch.Tensor:
    logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
    return -logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1) * (labels != -100)


def run(job: str, ours: bool) -> dict:
    """One contender in this process: its result and seconds."""
    from marinlm.eval.lm import Scorer
    from marinlm.model import SamplingConfig
    from marinlm.model.generate import stream_generate
    from marinlm.train.step import validate

    model = _model(4096 if job == "prefill" else 1024)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with torch.no_grad():
        if job == "validation":
            ids = _ids((16, 1024))
            batches = [
                {
                    "input_ids": x,
                    "segment_ids": torch.zeros_like(x),
                    "labels": x.roll(-1, 1),
                    "byte_weights": torch.ones(x.shape),
                }
                for x in ids.split(8)
            ]
            if ours:
                result = validate(model, batches, device=torch.device("cpu"), precision="fp32")["val/loss"]
            else:
                nll = [_materialised_nll(model, b["input_ids"], b["labels"]) for b in batches]
                result = float(sum(n.double().sum() for n in nll)) / sum(n.numel() for n in nll)
        elif job == "rolling":
            ids = _ids((16 * 1024,)).tolist()
            if ours:

                class Tokens:  # a stand-in tokenizer whose text is already token ids
                    pad_id, bos_id, eos_id = 0, 1, 2

                    def encode(self, text):
                        return ids

                scorer = Scorer(model, Tokens(), max_length=1024, batch_size=8, start_id=1)
                ((ll, n),) = scorer.loglikelihood_rolling(["16k tokens"])
            else:  # the same disjoint windows, 8 rows a forward
                stream = [1, *ids]
                ll, n = 0.0, len(ids)
                for b in range(0, 16, 8):
                    inputs = torch.tensor([stream[w * 1024 : (w + 1) * 1024] for w in range(b, b + 8)])
                    targets = torch.tensor([ids[w * 1024 : (w + 1) * 1024] for w in range(b, b + 8)])
                    ll -= float(_materialised_nll(model, inputs, targets).double().sum())
            result = ll / n
        else:
            ids = _ids((4, 4096))
            if ours:
                result = float(next(stream_generate(model, ids, SamplingConfig(max_new_tokens=1, temperature=0)))[0])
            else:
                result = float(model(ids).logits[:, -1].argmax(-1)[0])
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"result": result, "seconds": seconds, "built_mb": built / 1024, "peak_mb": peak / 1024}


def main() -> None:
    if len(sys.argv) == 3:  # a child: one contender
        print(json.dumps(run(sys.argv[1], sys.argv[2] == "ours")))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny-shaped model, vocab {VOCAB}")
    print(f"{'job':<11} {'contender':<20} {'result':>12} {'seconds':>8} {'peak RSS':>10} {'after build':>12}")
    for job in JOBS:
        rows = {}
        for who in ("materialised", "ours"):
            child = subprocess.run(
                [sys.executable, __file__, job, who], capture_output=True, text=True, check=True
            ).stdout.splitlines()[-1]
            rows[who] = r = json.loads(child)
            name = "marinlm" if who == "ours" else "materialised logits"
            print(
                f"{job:<11} {name:<20} {r['result']:>12.6f} {r['seconds']:>8.2f} "
                f"{r['peak_mb']:>8.0f} MB {r['built_mb']:>9.0f} MB"
            )
        extra = [rows[w]["peak_mb"] - rows[w]["built_mb"] for w in ("materialised", "ours")]
        print(
            f"{'':<11} memory beyond the model: {extra[0]:.0f} MB -> {extra[1]:.0f} MB "
            f"({extra[0] / extra[1]:.1f}x less)"
        )


if __name__ == "__main__":
    main()
