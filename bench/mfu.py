"""One MFU table for a single GPU: marinlm eager, compiled, compiled + CUDA graphs (and FP8 where
the GPU has it), against torchtitan's Qwen3 MoE on the same GPU, same batch and sequence.

Models, both ~1B parameters:
- hero: the hero's shape (every Marin element: GatedNorm, SConv, XSA, head gate, local/global
  layers, QB routing with its histogram, shared experts) at 1.1B total (bench/train_step.py's
  HERO_SHAPED_1B on configs/model/small.yaml);
- qwen3: configs/model/qwen3-moe-style.yaml scaled to ~1B (QWEN3_1B below); torchtitan's
  `Qwen3Model` is built with the same dimensions, so one FLOP count serves both.

Each step is a full training step: forward, backward, optimizer (ours: the hero recipe's MuonH and
Adam; torchtitan's: fused AdamW, its default) and, for ours, the QB bias update; bf16 autocast (ours)
or bf16 weights with fp32 master-free AdamW (torchtitan: its `mixed_precision_param` is FSDP's, which
one GPU without FSDP does not use, so it runs under the same bf16 autocast). Rows are packed from
documents of random lengths (mean 1,024 tokens), the same for both. Compiled: every block with
`fullgraph=True` (ours: parallel/compile.py, FlexAttention on the GPU; torchtitan: its own
`apply_compile`). MFU = model FLOPs (6 x active matmul parameters + attention, model/summary.py) x
tokens/s over the datasheet bf16 peak (the convention of torchtitan and Marin); the measured
matmul peak is printed beside it.

    python bench/mfu.py                     # on a GPU; torchtitan's row needs `pip install torchtitan`
    python bench/mfu.py --device cpu        # a tiny dry run of every row, to catch bugs first
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from marinlm.config import load_config
from marinlm.kernels import apply_kernels
from marinlm.kernels.fp8 import apply_fp8
from marinlm.model import MarinConfig, MarinForCausalLM
from marinlm.model.summary import summarize
from marinlm.optim import MarinOptimizerConfig, build_optimizer
from marinlm.parallel.compile import apply_compile
from marinlm.plan.hardware import load_hardware
from train_step import HERO_SHAPED_1B, cuda_matmul_peak  # bench/ is on the path when run

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"
QWEN3_1B = [
    "--d_model=1024",
    "--num_layers=12",
    "--attention.num_heads=16",
    "--attention.head_dim=128",
    "--attention.num_kv_heads=4",
    "--moe.num_experts=64",
    "--moe.top_k=8",
    "--moe.expert_dim=384",
    "--max_seq_len=4096",
]
DRY = [
    "--d_model=64",
    "--num_layers=2",
    "--vocab_size=512",
    "--moe.num_experts=8",
    "--moe.top_k=2",
    "--moe.expert_dim=32",
    "--attention.num_heads=4",
    "--attention.head_dim=16",
    "--attention.num_kv_heads=2",
]


def model_config(name: str, dry: bool) -> MarinConfig:
    base, overrides = (
        ("small", HERO_SHAPED_1B + ["--max_seq_len=4096"]) if name == "hero" else ("qwen3-moe-style", QWEN3_1B)
    )
    if dry:
        overrides = overrides + DRY
        overrides += ["--moe.latent_dim=32", "--moe.shared_expert_dim=32"] if name == "hero" else []
    return load_config(MarinConfig, CONFIGS / f"{base}.yaml", overrides)


def packed_batch(batch: int, seq: int, vocab: int, device: str, seed: int = 0):
    """Token ids, segment ids and positions of rows packed from documents of random lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    starts = torch.rand(batch, seq, generator=g) < 1 / min(1024, seq // 2)
    starts[:, 0] = True
    segments = torch.cumsum(starts.long(), 1)
    index = torch.arange(seq).expand(batch, seq)
    first = torch.where(starts, index, 0).cummax(1).values
    positions = index - first
    return ids.to(device), segments.to(device), positions.to(device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(step, device: str, warmup: int, steps: int) -> tuple[float, float]:
    """(seconds a step, peak GiB) over `steps` steps after `warmup` (compiling, capturing)."""
    for _ in range(warmup):
        step()
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    elapsed = (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return elapsed, peak


def fp8_supported(device: str) -> str | None:
    """None where FP8 training GEMMs run here, else why not."""
    if device != "cuda":
        return "no GPU"
    if torch.cuda.get_device_capability() < (8, 9):
        return "needs sm89+ (Ada, Hopper, Blackwell)"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "torchao not installed"
    return None


def marinlm_step(config: MarinConfig, mode: str, device: str, ids, segments):
    """A closure running one training step of ours, and the model."""
    compiled = mode != "eager"
    with torch.device("meta"):
        model = MarinForCausalLM(config)
    apply_kernels(model, device, "bf16", compiled=compiled)
    if mode == "fp8":  # as train.fp8 does: the dense projections (routed experts stay bf16)
        apply_fp8(model, torch.device(device), "bf16")
    model.to_empty(device=device)
    model.init_weights(seed=0)
    if compiled:
        apply_compile(model, fullgraph=True, cuda_graphs=mode == "cudagraph")
    optimizer = build_optimizer(model, MarinOptimizerConfig(), device)

    def step():
        with torch.autocast(device, torch.bfloat16):
            out = model(ids, segments, ids.roll(-1, 1), return_logits=False)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.update_router_biases([s.detach() for s in out.router_stats])

    return step


def torchtitan_step(config: MarinConfig, device: str, ids, positions, compiled: bool):
    """One training step of torchtitan's Qwen3 MoE with `config`'s dimensions, or why it cannot run."""
    try:
        from torchtitan.models.common import CosSinRoPE, Embedding, Linear
        from torchtitan.models.qwen3 import _build_qwen3_moe_layers, _qwen3_norm
        from torchtitan.models.qwen3.model import Qwen3Model
    except ImportError as e:
        return f"torchtitan not importable ({e})"
    att, moe = config.attention, config.moe
    D, V = config.d_model, config.vocab_size
    tt_config = Qwen3Model.Config(
        vocab_size=V,
        dim=D,
        norm=_qwen3_norm(D),
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D),
        lm_head=Linear.Config(in_features=D, out_features=V),
        layers=_build_qwen3_moe_layers(
            n_layers=config.num_layers,
            dim=D,
            n_heads=att.num_heads,
            n_kv_heads=att.num_kv_heads,
            head_dim=att.head_dim,
            moe_hidden_dim=moe.expert_dim,
            num_experts=moe.num_experts,
            top_k=moe.top_k,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=att.head_dim, max_seq_len=ids.shape[1], theta=att.rope_theta),
        ),
    )
    with torch.device("meta"):
        model = tt_config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device(device))
    if compiled:
        torch._dynamo.config.capture_scalar_outputs = True  # as torchtitan's apply_compile sets
        for block in model.layers.values():
            block.compile(fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device == "cuda")
    labels = ids.roll(-1, 1)

    def step():
        masks = model.get_attention_masks(positions)
        with torch.autocast(device, torch.bfloat16):
            logits = model(ids, positions, attention_masks=masks)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="hero,qwen3")
    p.add_argument("--modes", default="eager,compiled,cudagraph,fp8")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-torchtitan", action="store_true")
    a = p.parse_args()
    dry = a.device == "cpu"
    if dry:
        a.batch, a.seq, a.steps, a.warmup = 2, 128, 1, 1
    datasheet, measured = float("nan"), float("nan")
    if a.device == "cuda":
        name = torch.cuda.get_device_name()
        datasheet = load_hardware("h200" if "H200" in name else "h100-sxm").peak_bf16_flops
        measured = cuda_matmul_peak(torch.bfloat16)
        print(f"{name}: bf16 datasheet peak {datasheet / 1e12:.0f} TFLOP/s, measured matmul {measured / 1e12:.0f}")
    rows = []
    for model_name in a.models.split(","):
        config = model_config(model_name, dry)
        s = summarize(config, a.seq)
        ids, segments, positions = packed_batch(a.batch, a.seq, config.vocab_size, a.device)
        tokens = a.batch * a.seq
        contenders = [(f"marinlm {mode}", mode) for mode in a.modes.split(",")]
        if model_name == "qwen3" and not a.no_torchtitan:
            contenders += [("torchtitan eager", "tt-eager"), ("torchtitan compiled", "tt-compiled")]
        for label, mode in contenders:
            torch._dynamo.reset()
            why = fp8_supported(a.device) if mode == "fp8" else None
            if mode == "cudagraph" and a.device != "cuda":
                why = "no GPU"
            if why is None:
                try:
                    if mode.startswith("tt-"):
                        step = torchtitan_step(config, a.device, ids, positions, compiled=mode == "tt-compiled")
                    else:
                        step = marinlm_step(config, mode, a.device, ids, segments)
                    if isinstance(step, str):
                        why = step
                    else:
                        seconds, peak = time_steps(step, a.device, a.warmup, a.steps)
                except Exception as e:  # a row that fails says why; the others still run
                    why = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                if a.device == "cuda":
                    torch.cuda.empty_cache()
            if why is not None:
                rows.append((model_name, label, why))
                continue
            rate = tokens / seconds
            mfu = s.flops_per_token * rate / datasheet
            rows.append((model_name, label, seconds, rate, mfu, s.flops_per_token * rate / measured, peak))
    print(
        f"\nbatch {a.batch} x seq {a.seq}, bf16 autocast; MFU against the datasheet peak (measured matmul peak beside)"
    )
    print(f"{'model':6} {'contender':22} {'step ms':>9} {'tokens/s':>10} {'MFU':>6} {'(meas.)':>8} {'peak GiB':>9}")
    best: dict[tuple[str, str], float] = {}
    for row in rows:
        if len(row) == 3:
            print(f"{row[0]:6} {row[1]:22} skipped: {row[2]}")
            continue
        model_name, label, seconds, rate, mfu, mfu_measured, peak = row
        print(f"{model_name:6} {label:22} {seconds * 1e3:9.1f} {rate:10.0f} {mfu:6.1%} {mfu_measured:8.1%} {peak:9.1f}")
        side = "torchtitan" if label.startswith("torchtitan") else "marinlm"
        best[model_name, side] = max(best.get((model_name, side), 0.0), rate)
    for model_name in a.models.split(","):
        ours, theirs = best.get((model_name, "marinlm")), best.get((model_name, "torchtitan"))
        if ours and theirs:
            print(f"{model_name}: marinlm's best / torchtitan's best tokens/s = {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
