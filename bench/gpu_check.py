"""One short GPU check for sessions that are lent an accelerator (CPU-only CI never runs it).

Checks, in one run (about 4 minutes on an H100/H200):
1. CUDA visible; measured bf16 matmul throughput (the MFU denominator) next to the datasheet peak.
2. Expert kernels in bf16: `grouped_mm` (the GPU path), padded `bmm` and the per-expert loop,
   values against the loop and speed.
3. Training steps (bf16 autocast, MuonH) of the `small` preset and a wider hero-shaped model:
   tokens/s and MFU.
4. bench/train_step.py on CUDA: marinlm against HF `Qwen3MoeForCausalLM`, same weights and batch.
5. bench/lm_loss.py on CUDA: the fused chunked LM-head loss against F.linear + F.cross_entropy.
6. torchrun + NCCL: the trainer under FSDP2 for 20 steps with a checkpoint, then resumed to 30
   steps with FSDP2 CPU offload (the paths CPU CI cannot run).

    python bench/gpu_check.py                 # on the GPU host; prints a summary for the issue
    python bench/gpu_check.py --device cpu    # a small dry run of every code path, to catch bugs first
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int = 10) -> float:
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def train_step_rate(config, peak: float, device: str, batch: int, seq: int) -> tuple[float, float, float, float]:
    """tokens/s, MFU, peak GB and final loss of bf16-autocast MuonH training steps of `config`."""
    from marinlm.model import MarinForCausalLM
    from marinlm.model.summary import summarize
    from marinlm.optim import MarinOptimizerConfig, build_optimizer

    with torch.device("meta"):
        model = MarinForCausalLM(config)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    opt = build_optimizer(model, MarinOptimizerConfig(), device)
    tokens = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    losses = []

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(tokens, labels=tokens, return_logits=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = timed(step, device, 5)
    flops = summarize(config, seq).flops_per_token * batch * seq
    memory = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else float("nan")
    return batch * seq / t, flops / t / peak, memory, losses[-1].item()


def run_logged(label: str, cmd: list[str], timeout: float, env: dict | None = None) -> str:
    """Run a sub-benchmark; return its output (or the failure) so one broken part never hides the rest."""
    print(f"\n## {label}\n$ {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired as e:
        text = f"TIMED OUT after {timeout:.0f} s\n{(e.stdout or b'')[-3000:]!r}"
        print(text, flush=True)
        return text
    status = "ok" if out.returncode == 0 else f"FAILED (exit {out.returncode})"
    text = f"{out.stdout[-6000:]}{out.stderr[-3000:] if out.returncode else ''}"
    print(f"{text}\n-> {status} in {time.perf_counter() - start:.0f} s", flush=True)
    return status


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = p.parse_args()
    device = a.device
    dry = device == "cpu"
    if not dry and not torch.cuda.is_available():
        sys.exit("no CUDA device: this check needs a GPU (or --device cpu for a dry run)")
    from marinlm.config import load_config
    from marinlm.model import MarinConfig
    from marinlm.model.experts import RoutedExperts
    from marinlm.model.summary import summarize
    from marinlm.utils.perf import matmul_peak_flops

    summary: list[str] = []
    sys.path.insert(0, str(ROOT / "bench"))
    if dry:
        name, datasheet = "cpu (dry run)", float("nan")
        measured = matmul_peak_flops(torch.float32)
    else:
        from train_step import cuda_matmul_peak

        name = torch.cuda.get_device_name()
        datasheet = matmul_peak_flops(torch.bfloat16, "cuda")
        measured = cuda_matmul_peak(torch.bfloat16)
    line = (
        f"device {name}, torch {torch.__version__}; bf16 matmul 8192^3 {measured / 1e12:.0f} TFLOP/s measured, "
        f"{datasheet / 1e12:.0f} datasheet"
    )
    print(line, flush=True)
    summary.append(line)

    # Expert kernels: tokens x top-k assignments over 64 experts, 1024 -> 2048 -> 1024 SwiGLU.
    n, e, d, h, k = (1024, 8, 64, 128, 2) if dry else (16384, 64, 1024, 2048, 4)
    x = torch.randn(n, d, device=device)
    ids = torch.randint(0, e, (n, k), device=device)
    w = torch.rand(n, k, device=device)
    experts = {}
    for impl in ("grouped_mm", "bmm", "loop"):
        torch.manual_seed(0)  # the same weights for every kernel
        m = RoutedExperts(e, d, h, 0.02, impl).to(device)
        m.reset_parameters()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=not dry):
            t = timed(lambda m=m: m(x, ids, w)[0].float().sum().backward(), device, 5)
            experts[impl] = (t, m(x, ids, w)[0].float())
    flops = 6 * n * k * 3 * d * h  # three matmuls per expert MLP, forward and backward
    ref = experts["loop"][1]
    for impl, (t, y) in experts.items():
        rel = ((y - ref).norm() / ref.norm()).item()
        line = (
            f"experts fwd+bwd bf16 {n}x{k} over {e}, {d}->{h}: {impl:<10} {t * 1e3:7.2f} ms "
            f"{flops / t / 1e12:6.1f} TFLOP/s, rel. diff to loop {rel:.1e}"
        )
        print(line, flush=True)
        summary.append(line)

    ladder = [("small", [], 16, 1024)]
    if not dry:
        ladder.append(
            (
                "hero-shaped ~2B",
                [
                    "--d_model=2048",
                    "--num_layers=8",
                    "--attention.num_heads=16",
                    "--attention.head_dim=128",
                    "--moe.latent_dim=1024",
                    "--moe.expert_dim=1024",
                    "--moe.shared_expert_dim=1024",
                    "--init_std=0.035",
                ],
                8,
                4096,
            )
        )
    for label, overrides, batch, seq in ladder:
        if dry:
            batch, seq = 1, 64
        config = load_config(MarinConfig, ROOT / "configs" / "model" / "small.yaml", overrides)
        tok_s, mfu, memory, loss = train_step_rate(config, measured, device, batch, seq)
        line = (
            f"train step {label} ({summarize(config).total / 1e9:.2f}B total, "
            f"{summarize(config).active / 1e9:.2f}B active), {batch}x{seq}, bf16 autocast, MuonH: "
            f"{tok_s:,.0f} tok/s, MFU {mfu:.1%} of measured ({mfu * measured / datasheet:.1%} of datasheet), "
            f"max memory {memory:.1f} GB, loss after 6 steps {loss:.3f}"
        )
        print(line, flush=True)
        summary.append(line)

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    py = sys.executable
    if dry:
        bench_args = ["--skip-bf16", "--batch", "1", "--seq", "32", "--steps", "1"]
    else:
        bench_args = ["--device", "cuda", "--batch", "16", "--seq", "1024", "--steps", "10"]
    summary.append("bench/train_step.py: " + run_logged("HF comparison", [py, "bench/train_step.py", *bench_args], 240))
    loss_args = ["--repeats", "1"] if dry else ["--device", "cuda", "--repeats", "5"]
    summary.append("bench/lm_loss.py: " + run_logged("fused LM loss", [py, "bench/lm_loss.py", *loss_args], 200))

    with tempfile.TemporaryDirectory() as tmp:
        from marinlm.dataset.tokenize import TokenizeConfig, tokenize
        from marinlm.quickstart import build_default_corpus
        from marinlm.tokenizer import TokenizerTrainConfig, train_tokenizer

        build_default_corpus(Path(tmp) / "raw")
        train_tokenizer(
            TokenizerTrainConfig(inputs=[f"{tmp}/raw"], output_dir=f"{tmp}/tok", vocab_size=4096, max_bytes=5_000_000)
        )
        tokenize(
            TokenizeConfig(inputs=[f"{tmp}/raw"], tokenizer=f"{tmp}/tok", output_dir=f"{tmp}/tokens"), progress=False
        )
        train = [
            py,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=1",
            "-m",
            "marinlm.cli",
            "train",
            str(ROOT / "configs" / "train" / "tiny.yaml"),
            f"--data.sources=[{{path: {tmp}/tokens}}]",
            f"--run_dir={tmp}/run",
            "--checkpoint.every_steps=10",
            "--validation.every_steps=10",
            "--logging.progress=false",
            f"--train.device={device}",
        ]
        first = run_logged("torchrun, FSDP2, 20 steps", [*train, "--train.steps=20", "--resume=none"], 180, env)
        offload = [] if dry else ["--parallel.cpu_offload=true"]
        resumed = run_logged(
            "torchrun, FSDP2 + CPU offload, resumed to 30 steps",
            [*train, "--train.steps=30", "--resume=auto", *offload],
            180,
            env,
        )
        backend = "gloo" if dry else "NCCL"
        summary.append(f"torchrun + {backend} + FSDP2, 20 tiny steps with checkpoints: {first}")
        summary.append(f"resumed from step 20 to 30 with {'offload' if offload else 'no offload'}: {resumed}")

    print("\n# summary")
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
