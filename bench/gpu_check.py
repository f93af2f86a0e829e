"""One short GPU check for sessions that are lent an accelerator (CPU-only CI never runs it).

Parts, each in its own process (a CUDA fault in one cannot hide the others), about 4 minutes in
all on an H100/H200:
- kernels: measured bf16 matmul throughput (the MFU denominator) next to the datasheet peak; the
  expert kernels `grouped_mm` (the GPU path), `chunked`, padded `bmm` and the per-expert loop in
  bf16, values against the loop and speed.
- steps: bf16-autocast MuonH training steps of `small` and a wider hero-shaped model: tokens/s,
  MFU, and a profiler table of where the wider step spends its GPU time.
- packed: the `tiny` preset with packed documents (segment ids, ignored labels) on the GPU in bf16
  against the same batch on the CPU in fp32: loss and gradients.
- hf: bench/train_step.py on CUDA, marinlm against HF `Qwen3MoeForCausalLM`, same weights and batch.
- loss: bench/lm_loss.py on CUDA, the fused chunked LM-head loss against F.linear + F.cross_entropy.
- attention: bench/attention.py on CUDA, sliding-window attention block by block against one masked
  SDPA per row, for each block size (the data `band_block` needs to choose blocks on GPUs).
- torchrun: the trainer under torchrun + NCCL + FSDP2 for 20 steps with checkpoints, then resumed
  to 30 steps with FSDP2 CPU offload (the paths CPU CI cannot run).
- flex: FlexAttention against the reference attention on the GPU, values and gradients, fp32 and
  bf16, packed documents, global layers and windows shorter and longer than a document.
- mfu: bench/mfu.py, the MFU table: the ~1B hero-shaped and Qwen3-shaped models eager, compiled,
  compiled + CUDA graphs and FP8, and torchtitan's Qwen3 MoE on the same GPU (torchtitan installed).
- plan: `marinlm plan`'s activation estimate against a real bf16 forward of a ~1B hero-shaped model.
- ops: the op table for this GPU (plan/op_table.py, written to DIR/op_table.yaml), and the plan's
  step time and memory of a ~1B hero-shaped single-GPU bf16 step priced from it, against that step
  run eagerly here (seconds, allocator peak).
- offload: optimizer-only offload's device-memory saving in MuonH steps, and its losses.
- act_offload: `parallel.offload_activations` under full checkpointing: the device memory a forward
  leaves and a step's time with and without it, against the plan's bytes on the host and copy time.
- finetune: LoRA SFT on the GPU (grouped expert adapters on its grouped GEMM; QLoRA too where
  bitsandbytes is installed), then the peft adapter over the exported base against the merged model.

    python bench/gpu_check.py [--parts kernels,steps,...] [--out DIR]   # on the GPU host
    python bench/gpu_check.py --device cpu    # a small dry run of every part, to catch bugs first

Each part's full output goes to DIR/<part>.log; the summary lines are printed last. The exit status is 1
if a part failed, was stopped at --part-timeout, or found a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from train_step import HERO_SHAPED_1B, cuda_matmul_peak, sync  # bench/ is on the path when run

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, device: str, repeats: int = 10) -> float:
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def train_step_rate(config, peak: float, device: str, batch: int, seq: int, compile: bool = False):
    """tokens/s, MFU, peak GB, last loss and a fwd+bwd / optimizer split of bf16 MuonH steps.

    Also prints a profiler table of one step (top ops by device time) to the part's log.
    """
    from torch.profiler import ProfilerActivity, profile

    from marinlm.kernels import apply_kernels
    from marinlm.model import MarinForCausalLM
    from marinlm.model.summary import summarize
    from marinlm.optim import MarinOptimizerConfig, build_optimizer

    with torch.device("meta"):
        model = apply_kernels(MarinForCausalLM(config), device, "bf16")
    model.to_empty(device=device)
    model.init_weights(seed=0)
    if compile:  # regional, as parallel.compile does in training
        for block in model.layers:
            block.compile()
    opt = build_optimizer(model, MarinOptimizerConfig(), device)
    tokens = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    losses = []

    def forward_backward():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(tokens, labels=tokens, return_logits=False).loss
        loss.backward()
        losses.append(loss.detach())

    def step():
        forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = timed(step, device, 5)
    sync(device)
    t0 = time.perf_counter()
    forward_backward()
    sync(device)
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    t2 = time.perf_counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)
    flops = summarize(config, seq).flops_per_token * batch * seq
    memory = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else float("nan")
    split = f"fwd+bwd {(t1 - t0) * 1e3:.0f} ms, optimizer {(t2 - t1) * 1e3:.0f} ms, step {t * 1e3:.0f} ms"
    return batch * seq / t, flops / t / peak, memory, losses[-1].item(), split


def summary(line: str) -> None:
    print(f"SUMMARY {line}", flush=True)


def part_kernels(device: str, dry: bool) -> None:
    from marinlm.kernels.experts import FusedRoutedExperts
    from marinlm.utils.perf import matmul_peak_flops

    if dry:
        name, datasheet, measured = "cpu (dry run)", float("nan"), matmul_peak_flops(torch.float32)
    else:
        name = torch.cuda.get_device_name()
        datasheet, measured = matmul_peak_flops(torch.bfloat16, "cuda"), cuda_matmul_peak(torch.bfloat16)
    summary(
        f"device {name}, torch {torch.__version__}; bf16 matmul 8192^3 {measured / 1e12:.0f} TFLOP/s measured, "
        f"{datasheet / 1e12:.0f} datasheet"
    )
    # tokens x top-k assignments over 64 experts, 1024 -> 2048 -> 1024 SwiGLU
    n, e, d, h, k = (1024, 8, 64, 128, 2) if dry else (16384, 64, 1024, 2048, 4)
    x = torch.randn(n, d, device=device)
    ids = torch.randint(0, e, (n, k), device=device)
    w = torch.rand(n, k, device=device)
    experts = {}
    for impl in ("grouped_mm", "chunked", "bmm", "loop"):
        torch.manual_seed(0)  # the same weights for every kernel
        m = FusedRoutedExperts(e, d, h, 0.02, impl).to(device)
        m.reset_parameters()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=not dry):
            t = timed(lambda m=m: m(x, ids, w)[0].float().sum().backward(), device, 5)
            experts[impl] = (t, m(x, ids, w)[0].float())
    flops = 6 * n * k * 3 * d * h  # three matmuls per expert MLP, forward and backward
    ref = experts["loop"][1]
    for impl, (t, y) in experts.items():
        rel = ((y - ref).norm() / ref.norm()).item()
        summary(
            f"experts fwd+bwd bf16 {n}x{k} over {e}, {d}->{h}: {impl:<10} {t * 1e3:7.2f} ms "
            f"{flops / t / 1e12:6.1f} TFLOP/s, rel. diff to loop {rel:.1e}"
        )


def part_steps(device: str, dry: bool) -> None:
    from marinlm.config import load_config
    from marinlm.model import MarinConfig
    from marinlm.model.summary import summarize
    from marinlm.utils.perf import matmul_peak_flops

    if dry:
        datasheet = measured = matmul_peak_flops(torch.float32)
    else:
        datasheet, measured = matmul_peak_flops(torch.bfloat16, "cuda"), cuda_matmul_peak(torch.bfloat16)
    ladder = [
        ("small", [], 16, 1024, False),
        ("hero-shaped 1.1B", HERO_SHAPED_1B, 8, 4096, False),
        ("hero-shaped 1.1B, compiled blocks", HERO_SHAPED_1B, 8, 4096, True),
    ]
    for label, overrides, batch, seq, compile in ladder:
        if dry:
            batch, seq, overrides = 1, 64, []
        config = load_config(MarinConfig, ROOT / "configs" / "model" / "small.yaml", overrides)
        s = summarize(config)
        tok_s, mfu, memory, loss, profile = train_step_rate(config, measured, device, batch, seq, compile)
        summary(
            f"train step {label} ({s.total / 1e9:.2f}B total, {s.active / 1e9:.2f}B active), {batch}x{seq}, "
            f"bf16 autocast, MuonH: {tok_s:,.0f} tok/s, MFU {mfu:.1%} of measured "
            f"({mfu * measured / datasheet:.1%} of datasheet), max memory {memory:.1f} GB, "
            f"loss after 7 steps {loss:.3f}; {profile}"
        )


def part_packed(device: str, dry: bool) -> None:
    """Packed documents on the GPU (bf16) against the CPU (fp32): the trainer's batch layout."""
    from marinlm.config import load_config
    from marinlm.kernels import apply_kernels
    from marinlm.model import MarinConfig, MarinForCausalLM
    from marinlm.model.loss import IGNORE_INDEX

    config = load_config(MarinConfig, ROOT / "configs" / "model" / "tiny.yaml")
    g = torch.Generator().manual_seed(0)
    batch, seq = 8, 256
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    lengths = torch.randint(8, 120, (batch, seq), generator=g)
    segments = torch.stack([torch.repeat_interleave(torch.arange(seq), row)[:seq] for row in lengths])
    labels = ids.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    labels[segments != segments.roll(-1, 1)] = IGNORE_INDEX  # no prediction across a boundary
    with torch.device("meta"):
        reference = MarinForCausalLM(config)
    reference.to_empty(device="cpu")
    reference.init_weights(seed=0)  # on the CPU: the GPU's generator would draw other weights
    results = {}
    for name, where, dtype, kernels in (
        ("cpu fp32", "cpu", torch.float32, False),
        (f"{device} fp32", device, torch.float32, False),
        (f"{device} fp32 kernels", device, torch.float32, True),
        (f"{device} bf16", device, torch.bfloat16, False),
    ):
        model = copy.deepcopy(reference).to(where)
        if kernels:  # kernels.modules: auto, as training runs it
            apply_kernels(model, where, "fp32")
        with torch.autocast(where, dtype=dtype, enabled=dtype != torch.float32):
            out = model(ids.to(where), segments.to(where), labels.to(where), return_logits=False)
        out.lm_loss.backward()
        sync(where)
        grads = torch.cat([p.grad.float().flatten().cpu() for p in model.parameters() if p.grad is not None])
        results[name] = (out.lm_loss.item(), grads)
    ref_loss, ref_g = results["cpu fp32"]
    # bf16 is far from fp32 here on any device: the CPU presets' large init (see tiny.yaml) makes
    # this model sensitive to rounding (the CPU's own bf16 autocast gives the same spread).
    for name, (loss, grad) in list(results.items())[1:]:
        rel = ((grad - ref_g).norm() / ref_g.norm()).item()
        summary(
            f"packed tiny batch ({batch}x{seq}, up to {int(segments.max()) + 1} docs a row): {name} loss "
            f"{loss:.5f} vs cpu fp32 {ref_loss:.5f}; gradient rel. diff {rel:.1e}"
        )


def run_bench(script: str, args: list[str], keep) -> None:
    """Run another benchmark script; its whole output goes to the log, `keep(line)` lines to the summary."""
    out = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=ROOT, capture_output=True, text=True)
    print(out.stdout, out.stderr, flush=True)
    for line in out.stdout.splitlines():
        if keep(line):
            summary(f"{script}: {line.strip()}")
    if out.returncode:
        summary(f"{script} FAILED (exit {out.returncode})")


def part_hf(device: str, dry: bool) -> None:
    args = ["--skip-bf16", "--batch", "1", "--seq", "32", "--steps", "1", "--compile"]
    if not dry:
        args = ["--device", "cuda", "--batch", "16", "--seq", "1024", "--steps", "10", "--compile"]
    run_bench("train_step.py", args, lambda line: any(k in line for k in ("tok/s", "marinlm /", "costs", "ceiling")))


def part_loss(device: str, dry: bool) -> None:
    args = ["--repeats", "1"] if dry else ["--device", "cuda", "--repeats", "5"]
    run_bench("lm_loss.py", args, lambda line: " x " in line and " ms " in line)


def part_attention(device: str, dry: bool) -> None:
    args = ["--repeats", "1", "--shapes", "1"] if dry else ["--device", "cuda", "--repeats", "10"]
    run_bench("attention.py", args, lambda line: "torch / ours" in line or " ms" in line or "window" in line)


def part_flex(device: str, dry: bool) -> None:
    """FlexAttention (compiled) against the reference attention, values and gradients, fp32 and
    bf16: global layers and windows shorter and longer than the packed documents."""
    import copy

    from marinlm.kernels.flex_attention import FlexAttention
    from marinlm.model.attention import Attention
    from marinlm.model.config import AttentionConfig
    from marinlm.model.context import ForwardContext
    from marinlm.model.layers import doc_ids_and_positions

    if dry:
        summary(
            "flex: skipped on CPU (torch has no FlexAttention backward there; tests/test_compile.py checks the forward)"
        )
        return
    B, T, D = 2, 1000, 256
    g = torch.Generator().manual_seed(0)
    seg = torch.cumsum(torch.rand(B, T, generator=g) < 1 / 48, dim=1).to(device)
    doc, pos = doc_ids_and_positions(seg)
    for precision in ("fp32", "bf16"):
        for window, is_global in ((None, True), (16, False), (256, False)):
            config = AttentionConfig(
                num_heads=8,
                num_kv_heads=2,
                head_dim=32,
                sliding_window=window or 256,
                qk_norm=True,
                xsa=True,
                head_gate=True,
            )
            torch.manual_seed(0)
            attn = Attention(config, D, is_global=is_global, sconv_sites=["k", "v"], sconv_kernel=4, init_std=0.05)
            attn.reset_parameters()
            with torch.no_grad():
                attn.gate.weight.normal_(0, 0.3)
                for conv in (attn.sconv_k, attn.sconv_v):
                    conv.weight.normal_(0, 0.5)
            attn.to(device)
            flex = copy.deepcopy(attn)
            flex.__class__ = FlexAttention
            x = torch.randn(B, T, D, device=device)
            results = []
            for module in (attn, torch.compile(flex, fullgraph=True)):
                xi = x.clone().requires_grad_()
                ctx = ForwardContext(doc, pos, packed=True, decoding=False, derived=True, window=config.sliding_window)
                with torch.autocast(device, torch.bfloat16, enabled=precision == "bf16"):
                    y = module(xi, ctx)
                y.float().square().mean().backward()
                results.append([y.float(), xi.grad, *(p.grad.clone() for p in module.parameters())])
                module.zero_grad()
            worst = max(
                ((b - a).abs().max() / a.abs().max().clamp_min(1e-6)).item() for a, b in zip(*results, strict=True)
            )
            limit = 1e-4 if precision == "fp32" else 3e-2
            verdict = "ok" if worst <= limit else "MISMATCH"
            kind = "global" if is_global else f"window {window}"
            summary(f"flex {precision} {kind}: values and gradients within {worst:.1e} of the reference ({verdict})")


def part_mfu(device: str, dry: bool) -> None:
    args = ["--device", "cpu"] if dry else ["--steps", "5"]
    run_bench("mfu.py", args, lambda line: "MFU" in line or "marinlm" in line or "torchtitan" in line or "peak" in line)


def part_torchrun(device: str, dry: bool) -> None:
    from marinlm.dataset.tokenize import TokenizeConfig, tokenize
    from marinlm.dataset.tokenizer_training import TokenizerTrainConfig, train_tokenizer
    from marinlm.quickstart import build_default_corpus

    with tempfile.TemporaryDirectory() as tmp:
        build_default_corpus(Path(tmp) / "raw")
        train_tokenizer(
            TokenizerTrainConfig(inputs=[f"{tmp}/raw"], output_dir=f"{tmp}/tok", vocab_size=4096, max_bytes=5_000_000)
        )
        tokenize(
            TokenizeConfig(inputs=[f"{tmp}/raw"], tokenizer=f"{tmp}/tok", output_dir=f"{tmp}/tokens"), progress=False
        )
        train = [
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
            "--checkpoint.every_steps=10",
            "--validation.every_steps=10",
            "--logging.progress=false",
            f"--train.device={device}",
        ]
        offload = [] if dry else ["--parallel.offload=all"]
        runs = (
            ("FSDP2, 20 steps with checkpoints", ["--train.steps=20", "--resume=none"]),
            ("resumed at 20 to 30 steps" + (" with CPU offload" if offload else ""), ["--train.steps=30", *offload]),
        )
        backend = "gloo" if dry else "NCCL"
        for label, extra in runs:
            out = subprocess.run([*train, *extra], cwd=ROOT, capture_output=True, text=True)
            print(out.stdout, out.stderr, flush=True)
            result = [line for line in out.stdout.splitlines() if line.startswith(("done:", "resumed"))]
            status = "ok" if out.returncode == 0 else f"FAILED (exit {out.returncode})"
            summary(f"torchrun + {backend}, tiny, {label}: {status}; {' / '.join(result)}")
        eval_under_torchrun(Path(tmp), device, backend)


def eval_under_torchrun(tmp: Path, device: str, backend: str) -> None:
    """`marinlm eval` of the run above under torchrun (FSDP2-sharded load, scoring dealt over ranks)
    against the same eval in one plain process: a multiple-choice task, bits per byte and `val`."""
    import json
    import random

    words = (tmp / "raw").rglob("*")
    text = " ".join(f.read_text(errors="ignore") for f in sorted(words) if f.is_file())[:200_000].split()
    rng = random.Random(0)
    tasks = tmp / "tasks"
    tasks.mkdir()
    with open(tasks / "hellaswag_val.jsonl", "w") as f:
        for _ in range(40):
            at = rng.randrange(len(text) - 60)
            endings = [" ".join(text[at + 20 : at + 30])] + [" ".join(rng.sample(text, 10)) for _ in range(3)]
            f.write(json.dumps({"ctx": " ".join(text[at : at + 20]), "endings": endings, "label": 0}) + "\n")
    (tasks / "texts.jsonl").write_text(
        "".join(json.dumps({"text": " ".join(text[i : i + 400])}) + "\n" for i in (0, 5000))
    )
    specs = ["hellaswag", f"bpb:{tasks / 'texts.jsonl'}", "val"]
    reports = {}
    for label, launcher in (
        ("one process", [sys.executable, "-m", "marinlm.cli"]),
        (
            f"torchrun + {backend}",
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "-m", "marinlm.cli"],
        ),
    ):
        output = tmp / f"eval-{len(reports)}.json"
        cmd = [*launcher, "eval", str(tmp / "run"), "--tasks", *specs, "--data-dir", str(tasks)]
        out = subprocess.run(
            [*cmd, "--device", device, "--output", str(output)], cwd=ROOT, capture_output=True, text=True
        )
        print(out.stdout, out.stderr, flush=True)
        if out.returncode:
            summary(f"eval, {label}: FAILED (exit {out.returncode})")
            return
        reports[label] = json.loads(output.read_text())
    (one, report), (dist, other) = reports.items()
    values = {
        "hellaswag acc": lambda r: r["results"]["hellaswag"]["acc"],
        "bpb": lambda r: r["results"][specs[1]]["bits_per_byte"],
        "val loss": lambda r: r["results"]["val"]["loss"],
    }
    shown = ", ".join(f"{k} {get(report):.4f} / {get(other):.4f}" for k, get in values.items())
    worst = max(abs(get(report) - get(other)) / max(abs(get(report)), 1e-9) for get in values.values())
    status = "ok" if worst < 1e-2 and other["config"]["processes"] == 1 else "MISMATCH"
    summary(f"eval of the tiny run, {one} / {dist}: {shown}; largest rel. diff {worst:.1e}: {status}")


def part_plan(device: str, dry: bool) -> None:
    """`marinlm plan`'s activation estimate against a real forward of a ~1B hero-shaped model: the
    memory a bf16-autocast forward leaves allocated (what autograd saved) at 8 x 4,096 tokens."""
    from marinlm.config import load_config
    from marinlm.kernels import apply_kernels
    from marinlm.kernels.config import KernelConfig
    from marinlm.model import MarinConfig, MarinForCausalLM
    from marinlm.plan.activations import activation_bytes, inventory

    overrides = [] if dry else HERO_SHAPED_1B
    rows, seq = (1, 64) if dry else (8, 4096)
    small = ROOT / "configs" / "model" / "small.yaml"
    config = load_config(MarinConfig, small, [*overrides, "--moe.capacity_factor=null"])
    with torch.device("meta"):
        model = MarinForCausalLM(config)
    weights = sum(p.numel() for p in model.parameters() if p.ndim >= 2)
    for kernels in ("reference", "auto"):
        with torch.device("meta"):
            model = MarinForCausalLM(config)
        apply_kernels(model, device, "bf16", KernelConfig(modules=kernels))
        model.to_empty(device=device)
        model.init_weights(seed=0)
        ids = torch.randint(0, config.vocab_size, (rows, seq), device=device)
        sync(device)
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(ids, labels=ids, return_logits=False)
        sync(device)
        measured = (torch.cuda.memory_allocated() if device == "cuda" else 0) - before
        out.loss.backward()
        estimate = sum(
            activation_bytes(
                inventory(config, "bf16", kernels_device="cuda"), config, rows * seq, seq, weights=weights, gpu=True
            ).values()
        )
        summary(
            f"plan activation estimate, hero-shaped {weights / 1e9:.2f}B, {rows}x{seq} bf16, kernels {kernels}: "
            f"estimated {estimate / 2**30:.2f} GiB, measured after forward {measured / 2**30:.2f} GiB "
            f"(estimate / measured {estimate / max(measured, 1):.3f})"
        )
        del model, out
        if device == "cuda":
            torch.cuda.empty_cache()


def _hero_step(dry: bool):
    """(train config, rows, sequence, hardware profile) of a ~1B hero-shaped single-GPU bf16 step,
    dropless, at 4 x 4,096 tokens (a dry run: 2 x 128), on this GPU's profile."""
    import dataclasses

    from marinlm.config import load_config
    from marinlm.plan.hardware import load_hardware
    from marinlm.train.config import TrainConfig
    from mfu import model_config

    rows, seq = (2, 128) if dry else (4, 4096)
    model = dataclasses.replace(model_config("hero", dry), max_seq_len=seq)
    model.moe.capacity_factor = None
    overrides = ["--train.precision=bf16", f"--data.seq_len={seq}", f"--train.global_batch={rows}"]
    train = load_config(
        TrainConfig, ROOT / "configs" / "train" / "tiny.yaml", [*overrides, f"--model.max_seq_len={seq}"]
    )
    hardware = load_hardware("cpu" if dry else ("h200" if "H200" in torch.cuda.get_device_name() else "h100-sxm"))
    return dataclasses.replace(train, model=model), rows, seq, hardware


def part_ops(device: str, dry: bool) -> None:
    """The op table of this GPU, and the plan's single-GPU step priced from it against a real one."""
    import dataclasses

    import yaml

    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency
    from marinlm.plan.op_table import MeasuredTable
    from mfu import marinlm_step, time_steps

    train, rows, seq, hardware = _hero_step(dry)
    model = train.model
    table = MeasuredTable(model, "bf16", train.kernels, device=device)
    parallel = dataclasses.replace(train.parallel, data_parallel_shard=1)
    plan = plan_layout(train, parallel, 1, hardware, Efficiency(), table=table)
    out = Path(os.environ.get("OUT", "gpu_check_logs"))
    out.mkdir(parents=True, exist_ok=True)
    entries = table.entries()
    (out / "op_table.yaml").write_text(yaml.safe_dump({"device": table.name, "entries": entries}))
    ids = torch.randint(0, model.vocab_size, (rows, seq), device=device)
    step = marinlm_step(model, "eager", device, ids, None)
    seconds, peak = time_steps(step, device, warmup=2, steps=3 if dry else 10)
    reserved = torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else float("nan")
    planned, memory, held = plan.step["total"], plan.ranks[0].device_total / 2**30, plan.reserved_bytes / 2**30
    summary(
        f"plan of a hero-shaped {rows}x{seq} bf16 single-{device} step from the op table ({len(entries)} ops): "
        f"{planned * 1e3:.0f} ms against {seconds * 1e3:.0f} ms run ({planned / seconds:.3f}); memory planned "
        f"{memory:.2f} GiB live, {held:.2f} reserved (plan/allocator.py) against allocator peak {peak:.2f} GiB "
        f"allocated, {reserved:.2f} reserved ({held / reserved:.3f})"
    )


def part_offload(device: str, dry: bool) -> None:
    """parallel.offload: optimizer: the device memory it saves in MuonH steps of a ~1B hero-shaped
    model, and the same losses as without it."""
    from marinlm.config import load_config
    from marinlm.model import MarinConfig, MarinForCausalLM
    from marinlm.optim import MarinOptimizerConfig, build_optimizer
    from marinlm.parallel.offload import OffloadedOptimizer

    overrides = [] if dry else HERO_SHAPED_1B
    rows, seq = (1, 64) if dry else (4, 2048)
    config = load_config(MarinConfig, ROOT / "configs" / "model" / "small.yaml", overrides)
    results = {}
    for offload in (False, True):
        with torch.device("meta"):
            model = MarinForCausalLM(config)
        model.to_empty(device=device)
        model.init_weights(seed=0)
        optimizer = build_optimizer(model, MarinOptimizerConfig(), device)
        stepper = OffloadedOptimizer(optimizer, torch.device(device)) if offload else optimizer
        torch.manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (rows, seq)).to(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        losses = []
        for _ in range(4):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=not dry):
                loss = model(ids, labels=ids, return_logits=False).loss
            loss.backward()
            stepper.step()
            stepper.zero_grad(set_to_none=True)
            losses.append(loss.item())
        sync(device)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        resident = torch.cuda.memory_allocated() if device == "cuda" else 0
        results[offload] = (peak, resident, losses)
        del model, optimizer, stepper
        if device == "cuda":
            torch.cuda.empty_cache()
    (p0, r0, l0), (p1, r1, l1) = results[False], results[True]
    same = max(abs(a - b) / abs(a) for a, b in zip(l0, l1))
    summary(
        f"optimizer offload, hero-shaped {rows}x{seq} bf16 MuonH, 4 steps: "
        f"peak {p0 / 2**30:.2f} -> {p1 / 2**30:.2f} GiB, "
        f"resident between steps {r0 / 2**30:.2f} -> {r1 / 2**30:.2f} GiB; losses {l0[-1]:.4f} / {l1[-1]:.4f} "
        f"(largest rel. diff {same:.1e})"
    )


def part_act_offload(device: str, dry: bool) -> None:
    """`parallel.offload_activations`, a ~1B hero-shaped model with every block checkpointed, bf16:
    what a forward leaves allocated and a step's time with and without the blocks' inputs on the
    host, against the plan's bytes moved to the host and its time for their copies."""

    from marinlm.model import MarinForCausalLM
    from marinlm.parallel import ParallelConfig, parallelize
    from marinlm.parallel.mesh import ParallelDims
    from marinlm.plan.estimate import plan_layout
    from marinlm.plan.hardware import Efficiency

    train, rows, seq, hardware = _hero_step(dry)
    model_cfg = train.model
    ids = torch.randint(0, model_cfg.vocab_size, (rows, seq), device=device)
    measured = {}
    for offload in (False, True):
        parallel = ParallelConfig(data_parallel_shard=1, activation_checkpointing="full", offload_activations=offload)
        with torch.device("meta"):
            model = MarinForCausalLM(model_cfg)
        model = parallelize(model, parallel, ParallelDims.resolve(parallel, 1))
        model.to_empty(device=device)
        model.init_weights(seed=0)

        def step(model=model):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=not dry):
                loss = model(ids, labels=ids, return_logits=False).loss
            loss.backward()
            model.zero_grad(set_to_none=True)

        step()
        sync(device)
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        with torch.autocast(device, dtype=torch.bfloat16, enabled=not dry):
            loss = model(ids, labels=ids, return_logits=False).loss
        sync(device)
        left = (torch.cuda.memory_allocated() if device == "cuda" else 0) - before
        loss.backward()
        model.zero_grad(set_to_none=True)
        measured[offload] = (left, timed(step, device, repeats=2 if dry else 5), loss.item())
        del model, loss
        if device == "cuda":
            torch.cuda.empty_cache()
    plan = plan_layout(train, parallel, 1, hardware, Efficiency())  # the loop's last layout: offloaded
    (kept, t0, l0), (left, t1, l1) = measured[False], measured[True]
    host = plan.ranks[0].host["activations"]
    summary(
        f"activation offload, hero-shaped {rows}x{seq} bf16, AC full: forward leaves {kept / 2**30:.2f} -> "
        f"{left / 2**30:.2f} GiB (saved {(kept - left) / 2**30:.2f}, planned {host / 2**30:.2f} "
        f"on the host); step {t0 * 1e3:.0f} -> {t1 * 1e3:.0f} ms (+{(t1 - t0) * 1e3:.0f}, planned copies "
        f"{plan.step['activation_offload'] * 1e3:.0f} ms); loss {l0:.4f} / {l1:.4f}"
    )


def part_finetune(device: str, dry: bool) -> None:
    """LoRA SFT on the device (bf16, the grouped expert adapters on the GPU's grouped GEMM), and
    QLoRA where bitsandbytes is installed; then the peft adapter over the exported base against the
    merged model (`export --adapter --check`)."""
    import json
    import random
    from dataclasses import replace

    from marinlm.config import load_config
    from marinlm.model import MarinForCausalLM
    from marinlm.presets import preset
    from marinlm.tokenizer import MarinTokenizer, train_bpe
    from marinlm.train.config import TrainConfig
    from marinlm.train.run_folder import save_run

    rng = random.Random(0)
    pairs = [(a, b) for a, b in ((rng.randint(1, 99), rng.randint(1, 99)) for _ in range(400))]
    examples = [{"prompt": f"What is {a} + {b}?", "completion": f"{a} + {b} = {a + b}."} for a, b in pairs]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, part in (("train", examples[:360]), ("test", examples[360:])):
            (tmp / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in part))
        tok = MarinTokenizer(train_bpe([e["prompt"] + " " + e["completion"] for e in examples] * 4, 512))
        config = load_config(TrainConfig, preset("train", "tiny"), [f"--run_dir={tmp / 'base'}"])
        config.model = replace(config.model, vocab_size=512)
        with torch.device("meta"):
            model = MarinForCausalLM(config.model)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)  # an untrained base: the answer loss starts near ln(512)
        save_run(tmp / "base", config, model.state_dict(), tok, {})
        methods = ["lora"]
        try:
            import bitsandbytes  # noqa: F401

            methods.append("qlora")
        except ImportError:
            summary("finetune: qlora skipped, bitsandbytes is not installed here")
        for method in methods:
            run = tmp / method
            cmd = [
                *(
                    sys.executable,
                    "-m",
                    "marinlm.cli",
                    "finetune",
                    str(ROOT / "configs" / "finetune" / "gsm8k-lora.yaml"),
                ),
                *(f"--base={tmp / 'base'}", f"--run_dir={run}", f"--method={method}", f"--train.device={device}"),
                *(f"--sft.train_files=[{tmp / 'train.jsonl'}]", f"--sft.val_files=[{tmp / 'test.jsonl'}]"),
                *("--sft.prompt_field=prompt", "--sft.completion_field=completion", "--data.seq_len=128"),
                *(f"--train.steps={10 if dry else 60}", "--train.precision=auto", "--logging.progress=false"),
            ]
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            print(out.stdout, out.stderr, flush=True)
            losses = [line for line in out.stdout.splitlines() if "answer loss" in line]
            status = "ok" if out.returncode == 0 else f"FAILED (exit {out.returncode})"
            summary(f"finetune {method} on {device}: {status}; {' / '.join(losses)}")
            if out.returncode:
                continue
            check = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "marinlm.cli",
                    "export",
                    str(run),
                    str(tmp / f"{method}-hf"),
                    "--adapter",
                    "--check",
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            print(check.stdout, check.stderr, flush=True)
            found = [line for line in check.stdout.splitlines() if line.startswith("check")]
            status = "ok" if check.returncode == 0 else f"MISMATCH (exit {check.returncode})"
            summary(f"finetune {method}: export --adapter --check: {status}; {' / '.join(found)}")


PARTS = {
    "kernels": part_kernels,
    "steps": part_steps,
    "packed": part_packed,
    "hf": part_hf,
    "loss": part_loss,
    "attention": part_attention,
    "flex": part_flex,
    "mfu": part_mfu,
    "torchrun": part_torchrun,
    "plan": part_plan,
    "ops": part_ops,
    "offload": part_offload,
    "act_offload": part_act_offload,
    "finetune": part_finetune,
}


def run_part(cmd: list[str], log, env: dict, timeout: float) -> str:
    """Run one part in its own process group; '' if it passed, else why not. A part that outlives
    `timeout` is stopped with everything it started (a benchmark script, torchrun's workers)."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return f"stopped after {timeout:.0f} s"
    return f"exit {code}" if code else ""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_check_logs"), help="folder for each part's log")
    p.add_argument("--part-timeout", type=float, default=300, help="seconds before a part is stopped")
    p.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one part in this process
    a = p.parse_args()
    dry = a.device == "cpu"
    if not dry and not torch.cuda.is_available():
        sys.exit("no CUDA device: this check needs a GPU (or --device cpu for a dry run)")
    if a.part:
        PARTS[a.part](a.device, dry)
        return
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    parts = a.parts.split(",")
    if unknown := [name for name in parts if name not in PARTS]:
        p.error(f"--parts: unknown part(s) {', '.join(unknown)}; the parts are {', '.join(PARTS)}")
    lines = []
    for name in parts:
        start = time.perf_counter()
        log = out_dir / f"{name}.log"
        cmd = [sys.executable, __file__, "--device", a.device, "--part", name]
        with open(log, "w") as f:
            failure = run_part(cmd, f, env, a.part_timeout)
        found = [line.removeprefix("SUMMARY ") for line in log.read_text().splitlines() if line.startswith("SUMMARY ")]
        if failure:
            tail = "\n    ".join(log.read_text().splitlines()[-15:])
            found.append(f"part {name} FAILED ({failure}); log {log}; last lines:\n    {tail}")
        print(f"[{name}: {time.perf_counter() - start:.0f} s]", *found, sep="\n", flush=True)
        lines += found
    print("\n# summary", *lines, sep="\n")
    if any("FAILED" in line or "MISMATCH" in line for line in lines):
        sys.exit(1)


if __name__ == "__main__":
    main()
