"""Training throughput of the `tiny` and `small` presets: 1 process against FSDP2 on 2 processes.

Each configuration trains for a few steps through `marinlm train` (or torchrun) on the same token
shards and global batch; the report takes the median tokens/s and MFU of the steps after the first
(MFU against the matmul peak each run measures in its precision, times the number of processes;
`train.precision: auto` trains in bf16 on a CPU with bf16 units, fp32 on one without),
and the peak RSS of the largest process.

    python bench/train_throughput.py [--tokens runs/quickstart/tokens] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RSS_WRAPPER = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)"
)


def make_tokens(folder: Path) -> Path:
    """Token shards of the standard library sources (what the quickstart uses), if none given."""
    from marinlm.dataset.tokenize import TokenizeConfig, tokenize
    from marinlm.dataset.tokenizer_training import TokenizerTrainConfig, train_tokenizer
    from marinlm.quickstart import build_default_corpus

    build_default_corpus(folder / "raw")
    train_tokenizer(
        TokenizerTrainConfig(
            inputs=[str(folder / "raw")], output_dir=str(folder / "tok"), vocab_size=4096, max_bytes=20_000_000
        )
    )
    tokenize(
        TokenizeConfig(inputs=[str(folder / "raw")], tokenizer=str(folder / "tok"), output_dir=str(folder / "tokens")),
        progress=False,
    )
    return folder / "tokens"


def train_command(overrides: list[str], procs: int, port: int) -> list[str]:
    """The arguments after `python` of `marinlm train` on configs/train/tiny.yaml with `overrides`,
    under torchrun on `procs` gloo processes when there are several."""
    train = ["-m", "marinlm.cli", "train", str(ROOT / "configs" / "train" / "tiny.yaml"), *overrides, "--resume=none"]
    if procs > 1:
        train = ["-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={port}", *train]
    return train


def step_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(preset: str, procs: int, tokens: Path, steps: int, work: Path) -> dict:
    run_dir = work / f"{preset}-{procs}"
    overrides = [
        f"--model={ROOT / 'configs' / 'model' / f'{preset}.yaml'}",
        f"--data.sources=[{{path: {tokens}}}]",
        f"--run_dir={run_dir}",
        f"--train.steps={steps}",
        "--checkpoint.every_steps=0",
        "--validation.every_steps=0",
        "--validation.max_rows=8",
        "--logging.every_steps=1",
        "--logging.progress=false",
        "--logging.tensorboard=false",
        "--train.global_batch=8",
        "--data.seq_len=256",
    ]
    train = train_command(overrides, procs, port=29577)
    out = subprocess.run([sys.executable, "-c", RSS_WRAPPER, sys.executable, *train], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    peak = int(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("PEAK_RSS_KB")))
    steady = [r for r in step_records(run_dir) if "perf/tokens_per_s" in r and r["step"] > 1]
    return {
        "tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in steady),
        "mfu": statistics.median(r["perf/mfu"] for r in steady),
        "peak_rss_gb": peak / 1024 / 1024,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default=str(ROOT / "runs" / "quickstart" / "tokens"))
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="marinlm-train-bench-") as tmp:
        work = Path(tmp)
        tokens = Path(a.tokens)
        if not (tokens / "manifest.json").exists():
            tokens = make_tokens(work)
        print(f"global batch 8 x 256 tokens, {a.steps} steps per run, token shards {tokens}")
        print(f"{'preset':<8}{'processes':>10}{'tokens/s':>12}{'MFU':>8}{'peak RSS':>11}")
        for preset in ("tiny", "small"):
            base = None
            for procs in (1, 2):
                r = run(preset, procs, tokens, a.steps, work)
                base = base or r["tokens_per_s"]
                print(
                    f"{preset:<8}{procs:>10}{r['tokens_per_s']:>12,.0f}{r['mfu']:>8.1%}"
                    f"{r['peak_rss_gb']:>9.2f} GB   ({r['tokens_per_s'] / base:.2f}x the 1-process rate)"
                )


if __name__ == "__main__":
    main()
