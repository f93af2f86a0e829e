"""One short GPU check for sessions that are lent an accelerator (nothing here runs on CPU-only CI).

Checks, in one run (about 3-5 minutes on an H100/H200):
1. CUDA visible; bf16 matmul throughput (the MFU peak used below is the device's datasheet bf16 peak).
2. Expert kernels in bf16: `grouped_mm` (the GPU path) against the per-expert loop, values and speed.
3. Training steps of the `small` preset and a wider hero-shaped model in bf16: tokens/s and MFU.
4. NCCL: `torchrun --nproc_per_node=1` training with FSDP2 and CPU offload (the paths CPU CI cannot run).

    python bench/gpu_check.py            # prints a summary to paste into the issue
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, repeats=10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def train_step_rate(config, peak: float, batch: int = 16, seq: int = 1024) -> tuple[float, float, float]:
    """tokens/s, MFU and peak GB of a bf16 MuonH training step of `config`."""
    from marinlm.model import MarinForCausalLM
    from marinlm.model.summary import summarize
    from marinlm.optim import MarinOptimizerConfig, build_optimizer

    model = MarinForCausalLM(config).cuda()
    model.init_weights(seed=0)
    opt = build_optimizer(model, MarinOptimizerConfig(), "cuda")
    tokens = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    t = timed(step, 5)
    flops = summarize(config, seq).flops_per_token * batch * seq
    return batch * seq / t, flops / t / peak, torch.cuda.max_memory_allocated() / 1e9


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: this check needs a GPU")
    from marinlm.config import load_config
    from marinlm.model import MarinConfig
    from marinlm.model.experts import RoutedExperts
    from marinlm.model.summary import summarize
    from marinlm.utils.perf import matmul_peak_flops

    name = torch.cuda.get_device_name()
    peak = matmul_peak_flops(torch.bfloat16, "cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    measured = 2 * 8192**3 / timed(lambda: a @ a)
    print(f"device {name}; bf16 matmul {measured / 1e12:.0f} TFLOP/s measured, {peak / 1e12:.0f} datasheet")

    experts = {}
    x = torch.randn(65536, 1024, device="cuda")
    ids = torch.randint(0, 64, (16384, 4), device="cuda")
    w = torch.rand(16384, 4, device="cuda")
    for impl in ("grouped_mm", "loop"):
        torch.manual_seed(0)  # the same weights for both kernels
        m = RoutedExperts(64, 1024, 2048, 0.02, impl).cuda()
        m.reset_parameters()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            experts[impl] = (
                timed(lambda m=m: m(x[:16384], ids, w)[0].float().sum().backward(), 5),
                m(x[:16384], ids, w)[0].float(),
            )
    diff = (experts["grouped_mm"][1] - experts["loop"][1]).abs().max().item()
    print(
        f"experts fwd+bwd bf16: grouped_mm {experts['grouped_mm'][0] * 1e3:.1f} ms, loop "
        f"{experts['loop'][0] * 1e3:.1f} ms ({experts['loop'][0] / experts['grouped_mm'][0]:.1f}x); max diff {diff:.3g}"
    )

    for label, overrides in (
        ("small", []),
        (
            "hero-shaped 1.5B-ish",
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
        ),
    ):
        config = load_config(MarinConfig, ROOT / "configs" / "model" / "small.yaml", overrides)
        tok_s, mfu, memory = train_step_rate(config, peak)
        print(
            f"train step {label} ({summarize(config).total / 1e6:.0f}M params): {tok_s:,.0f} tok/s, "
            f"MFU {mfu:.1%}, max memory {memory:.1f} GB"
        )

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
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=1",
            "-m",
            "marinlm.cli",
            "train",
            str(ROOT / "configs" / "train" / "tiny.yaml"),
            f"--data.sources=[{{path: {tmp}/tokens}}]",
            f"--run_dir={tmp}/run",
            "--train.steps=20",
            "--parallel.cpu_offload=true",
            "--train.device=cuda",
            "--logging.progress=false",
            "--resume=none",
        ]
        env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": "INFO"}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        status = "ok" if out.returncode == 0 else f"FAILED\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
        print(f"torchrun + NCCL + FSDP2 CPU offload, 20 tiny steps: {status}")


if __name__ == "__main__":
    main()
