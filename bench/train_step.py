"""One full training step (forward, backward, AdamW): marinlm against HF transformers, on CPU or GPU.

Peer: `transformers.Qwen3MoeForCausalLM` with the dimensions of configs/model/qwen3-moe-style.yaml,
loaded with the same weights (the two compute the same function; tests/test_hf_parity.py). HF is
timed with each of its expert implementations; the ratio is taken against its fastest. The
hero-shaped `small` preset is timed too, to show what the Marin extras cost. Ours is timed twice:
as training runs it (`kernels.modules: auto`, the fast paths of marinlm.kernels) and as the plain
reference model (`kernels.modules: reference`), so the price of the fast paths is visible. MFU is against the
fp32/bf16 matmul peak measured in this run: up front, and between the interleaved steps, whichever is higher.

On a CPU without a bf16 GEMM (no AVX512 or AMX) torch's bf16 matmuls are reference loops (~1 GFLOP/s
here against ~175 in fp32). Under bf16 autocast HF's linear layers use them; ours compute the same
bf16-rounded products with fp32 GEMMs (kernels/bf16.py, tests/test_cpu_bf16.py). The bf16 ratio
on such a CPU therefore measures that dispatch, not better kernels; the fp32 ratio is like for like.

    python bench/train_step.py [--batch 4] [--seq 256] [--steps 3] [--skip-bf16]
    python bench/train_step.py --device cuda --batch 16 --seq 1024 --steps 10   # bf16 autocast only

On CPU it then profiles three more steps of ours and of HF's fastest, prints where each one's
time goes (expert GEMMs, other GEMMs with their GFLOP/s, attention, optimizer, gathers and copies,
elementwise), and the step time if every GEMM ran at the peak with the rest unchanged: how much any
GEMM kernel could still buy.

The contenders share one process, so that they are timed in the same moments, and with that one
oneDNN primitive cache (the kernels of bf16 GEMMs on CPU, built per shape: ~0.45 ms to build one,
~0.01 ms to find it in the cache). HF's `eager` experts multiply each expert's rows on their own,
a new shape for every new load: at the default capacity of 1,024 it built 650-790 kernels in each of
its steps (of ~3,800 GEMMs), and pushed the others' out between their steps. Measured on the 2-core
AVX512-BF16 EPYC, torch 2.13, 4 x 256 tokens in bf16 (ONEDNN_VERBOSE=2 and best of 10 interleaved):
- our step rebuilt 18-46 of its ~240 kernels with HF's eager interleaved, 0-12 without;
- our step took 354-370 ms with HF's eager interleaved, 311-320 ms without it (HF grouped_mm
  544-550 against 498-513; it calls ~2,400 GEMMs a step, on shapes that were all in the cache);
- at a capacity of 8,192, HF's eager step built 72-150 kernels a step and took 783-855 ms instead of
  1,214-1,234; with it interleaved, our step took 323 and 374 ms in two runs, and 303 and 317 without
  it, while HF grouped_mm took 579 and 598 against 499 and 527: the two slowed alike.
So the bench raises the cache to ONEDNN_CACHE kernels, unless ONEDNN_PRIMITIVE_CACHE_CAPACITY is set.
HF's eager step gains the most from it.

`--compile` also times both sides with each decoder block compiled (`torch.compile`, regional, as
`parallel.compile` does in training) and prints the compiled-against-compiled ratio beside the eager one.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from marinlm.config import load_config
from marinlm.hf.qwen3_moe import qwen3_moe_hf_config, to_hf_state_dict
from marinlm.kernels import apply_kernels
from marinlm.model import MarinConfig, MarinForCausalLM
from marinlm.model.summary import summarize
from marinlm.utils.perf import CATEGORIES, matmul_peak_flops, time_breakdown, tune_cpu_allocator

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"
# Overrides of configs/model/small.yaml for a 1.1B-total, 0.31B-active hero-shaped model: big enough
# to keep a GPU busy (bench/gpu_check.py, bench/muon_step.py).
HERO_SHAPED_1B = [
    "--d_model=2048",
    "--num_layers=8",
    "--attention.num_heads=16",
    "--attention.head_dim=128",
    "--moe.latent_dim=1024",
    "--moe.expert_dim=1024",
    "--moe.shared_expert_dim=1024",
    "--init_std=0.035",
]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved_times(steps: dict, rounds: int, device: str = "cpu") -> dict[str, list[float]]:
    """Warm every step up, then time them round-robin: each one's step time in each round.

    Interleaving spreads machine noise over all contenders alike; each one's minimum is its step
    least disturbed by other load, and the ratio of two contenders within a round cancels the
    slower drifts of a shared host's speed. Each round runs the contenders in its own order (a
    seeded shuffle), so that none always runs right after the same one: a step may leave the next
    one slower (HF's eager experts build new GEMM kernels every step; with them in the rounds the
    other contenders slowed alike, by 4-10%; see the module docstring).
    """
    for name, step in list(steps.items()):
        try:
            step()
            step()  # a second warm-up: the optimizer's state, the GPU kernels' autotuning, compilation
        except Exception as e:  # a compiled contender that torch.compile cannot handle: shown, not fatal
            if "compiled" not in name:
                raise
            print(f"  {name}: failed, not timed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            del steps[name]
    times = {name: [] for name in steps}
    order = random.Random(0)
    for _ in range(rounds):
        for name, step in order.sample(list(steps.items()), len(steps)):
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return times


ONEDNN_CACHE = 8192  # oneDNN primitive cache capacity for the bench process (module docstring)
PEAK = "matmul peak probe"
PEAK_SIZE = 2048


def peak_probe(dtype: torch.dtype):
    """A square matmul as a contender of `interleaved_times`: the peak measured in the same
    moments as the steps."""
    a, b = (torch.randn(PEAK_SIZE, PEAK_SIZE, dtype=dtype) for _ in range(2))
    return lambda: a @ b


def ours_step(model, ids, dtype):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    device = ids.device.type

    def step():
        # As the trainer calls it: no logits are returned, so the LM head and loss run fused and
        # chunked (model/loss.py, bench/lm_loss.py). HF's forward always materialises the logits.
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = model(ids, labels=ids, return_logits=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def hf_step(model, ids, dtype):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    device = ids.device.type

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def cuda_matmul_peak(dtype: torch.dtype, size: int = 8192, repeats: int = 20) -> float:
    """Measured FLOP/s of a large square matmul on the GPU: the MFU denominator, not the datasheet."""
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def print_breakdown(steps: dict, best: dict[str, float], config: MarinConfig, peak: float, rounds: int = 3) -> None:
    """Profile a few more steps of marinlm and of the HF contender in `steps`, show where each one's
    time goes, and what its step would take with every GEMM at the peak and everything else as it
    is: the most that faster GEMM kernels could buy."""
    F = config.moe.expert_dim  # HF's Qwen3-MoE experts multiply gate and up as one [2F, D] matrix
    att = config.attention
    heads = {att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim}
    widths = {config.d_model, config.vocab_size, config.moe.num_experts, *heads}
    assert not widths & {F, 2 * F}, f"expert width {F} (or {2 * F}) is also a model width: GEMMs not told apart"
    profiles = {name: [] for name in steps}
    for _ in range(rounds):  # interleaved, as the timing is; each one's least disturbed step is kept
        for name, step in steps.items():
            profiles[name].append(time_breakdown(step, steps=1, expert_dims=(F, 2 * F)))
    parts = {name: min(runs, key=lambda part: sum(s for s, _ in part.values())) for name, runs in profiles.items()}
    totals = {name: sum(s for s, _ in part.values()) for name, part in parts.items()}
    print(
        f"  where a step's time goes (profiled: the fastest of {rounds} interleaved steps each, each op's own time; "
        "GEMM rates in GFLOP/s):"
    )
    print(f"    {'':<22}" + "".join(f"{name:>30}" for name in parts))
    for category in CATEGORIES:
        cells = []
        for name, part in parts.items():
            seconds, flops = part[category]
            share = seconds / totals[name]
            rate = f"{flops / seconds / 1e9:6.1f}" if flops else " " * 6
            cells.append(f"{seconds * 1e3:9.1f} ms {share:4.0%}  {rate}")
        print(f"    {category:<22}" + "".join(f"{c:>30}" for c in cells))
    hf = next(name for name in parts if name != "marinlm")
    for name, part in parts.items():
        # In the profiled steps' own time: the host's speed, and the profiler's cost per op, differ
        # from the timed steps', so the fraction is carried over, not the milliseconds.
        profiled = totals[name]
        gemm_s = sum(part[c][0] for c in ("expert GEMMs", "other GEMMs"))
        gemm_flops = sum(part[c][1] for c in ("expert GEMMs", "other GEMMs"))
        bound = best[name] * (profiled - gemm_s + gemm_flops / peak) / profiled
        print(
            f"  {name}: with every GEMM at the peak ({gemm_s * 1e3:.0f} -> {gemm_flops / peak * 1e3:.0f} ms of "
            f"{profiled * 1e3:.0f} profiled) the step would take >= {bound * 1e3:.0f} ms"
            + (f", {best[hf] / bound:.2f}x {hf}" if name == "marinlm" else "")
        )


def build_ours(config: MarinConfig, device: str = "cpu", kernels: bool = True) -> MarinForCausalLM:
    """Ours as training builds it: `kernels.modules: auto` (the fast paths of marinlm.kernels), or
    the plain reference model with `kernels=False`."""
    with torch.device("meta"):
        model = MarinForCausalLM(config)
    if kernels:
        apply_kernels(model, device, "bf16")
    model.to_empty(device=device)
    model.init_weights(seed=0)
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip-bf16", action="store_true")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: bf16 autocast only")
    p.add_argument("--compile", action="store_true", help="also time both sides with compiled decoder blocks")
    a = p.parse_args()
    dev = a.device
    # Read by oneDNN when it builds its first kernel in this process: nothing has run yet.
    onednn_cache = os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE))
    import transformers

    tuned = tune_cpu_allocator()  # applies to both models: they share this process
    threads = torch.get_num_threads()
    where = torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or platform.machine()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {threads} threads, "
        f"{os.cpu_count()} cores, {where}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, allocator tuned: {tuned}, "
        f"oneDNN primitive cache {onednn_cache} (default 1024)"
    )
    print("both sides: same weights, same batch, AdamW(fused=True), same process")
    if dev == "cuda":
        peaks = {torch.bfloat16: cuda_matmul_peak(torch.bfloat16)}
        print(f"measured matmul peak: bf16 {peaks[torch.bfloat16] / 1e12:.0f} TFLOP/s (8192^3)")
    else:
        peaks = {dt: matmul_peak_flops(dt) for dt in (torch.float32, torch.bfloat16)}
        print(
            f"measured matmul peak: fp32 {peaks[torch.float32] / 1e9:.1f} GFLOP/s, "
            f"bf16 {peaks[torch.bfloat16] / 1e9:.1f} GFLOP/s"
        )

    qwen = load_config(MarinConfig, CONFIGS / "qwen3-moe-style.yaml")
    small = load_config(MarinConfig, CONFIGS / "small.yaml")
    dtypes = [torch.bfloat16] if dev == "cuda" else [torch.float32] if a.skip_bf16 else [torch.float32, torch.bfloat16]
    for dtype in dtypes:
        # bf16 matmuls are emulated by torch on CPUs without AVX512/AMX, and HF uses them; shrink
        # the shared step to stay short. Ours run the same bf16 products as fp32 GEMMs there.
        batch, seq = (a.batch, a.seq) if dtype == torch.float32 or peaks[dtype] > 20e9 else (1, 64)
        tokens = batch * seq
        ids = torch.randint(0, qwen.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(dev)
        ours = build_ours(qwen, dev)
        steps = {"marinlm": ours_step(ours, ids, dtype)}
        if a.compile:
            compiled = build_ours(qwen, dev)
            compiled.load_state_dict(ours.state_dict())
            for block in compiled.layers:
                block.compile()
            steps["marinlm compiled"] = ours_step(compiled, ids, dtype)
        # HF's batched_mm is not timed: 49 s/step on CPU (35x slower), and on an H200 at 16x1024
        # tokens it copies each token's expert weights (a 9 GiB allocation in one layer).
        for impl in ("eager", "grouped_mm"):
            hf = transformers.Qwen3MoeForCausalLM(qwen3_moe_hf_config(qwen))
            hf.load_state_dict(to_hf_state_dict(ours.state_dict(), qwen))
            try:
                hf.set_experts_implementation(impl)
            except (AttributeError, ValueError) as e:  # older transformers: eager only
                print(f"  HF ({impl}) unavailable in transformers {transformers.__version__}: {e}")
                continue
            steps[f"HF ({impl})"] = hf_step(hf.to(dev), ids, dtype)
            if a.compile and impl == "grouped_mm":
                hf_compiled = transformers.Qwen3MoeForCausalLM(qwen3_moe_hf_config(qwen))
                hf_compiled.load_state_dict(hf.state_dict())
                hf_compiled.set_experts_implementation(impl)
                for layer in hf_compiled.model.layers:
                    layer.compile()
                steps[f"HF ({impl}) compiled"] = hf_step(hf_compiled.to(dev), ids, dtype)
        emulated = dev == "cpu" and peaks[dtype] < peaks[torch.float32]  # MFU against an emulated peak means nothing
        if not emulated:  # the hero-shaped preset: what the Marin extras cost, in each precision
            small_ids = torch.randint(0, small.vocab_size, (batch, seq)).to(dev)
            steps["marinlm small"] = ours_step(build_ours(small, dev), small_ids, dtype)
        if dev == "cpu" and not emulated:
            steps[PEAK] = peak_probe(dtype)
        times = interleaved_times(steps, a.steps, dev)
        best = {contender: min(t) for contender, t in times.items()}
        name = "fp32" if dtype == torch.float32 else "bf16 autocast"
        print(f"\n[{name}] batch {batch} x {seq}, best of {a.steps} interleaved steps")
        if PEAK in best:
            # A shared host's speed drifts by tens of percent between minutes: the MFU denominator
            # is the fastest product seen, up front or between the steps.
            probed = 2 * PEAK_SIZE**3 / best.pop(PEAK)
            print(
                f"  matmul peak between the steps {probed / 1e9:.1f} GFLOP/s (up front {peaks[dtype] / 1e9:.1f}); "
                f"MFU against the higher"
            )
            peaks[dtype] = max(peaks[dtype], probed)
        flops = {name: summarize(small if "small" in name else qwen, seq).flops_per_token * tokens for name in best}
        for contender, t in best.items():
            mfu = "n/a (emulated bf16)" if emulated else f"{flops[contender] / t / peaks[dtype]:6.1%}"
            print(f"  {contender:<26} {tokens / t:8.0f} tok/s  step {t * 1e3:8.1f} ms  MFU {mfu}")
        hf_best = min((k for k in best if k.startswith("HF") and "compiled" not in k), key=best.get)
        rounds = sorted(h / o for h, o in zip(times[hf_best], times["marinlm"], strict=True))
        print(
            f"  marinlm / {hf_best}: {best[hf_best] / best['marinlm']:.2f}x best against best; within a round "
            f"median {statistics.median(rounds):.2f}x, {rounds[0]:.2f}-{rounds[-1]:.2f}x  (target >= 1.5x)"
        )
        # The reference model in rounds of its own: its bf16 `grouped_mm` experts build a oneDNN
        # kernel for every new row count, as HF's eager experts do, and would push the kernels of
        # the contenders above out of the primitive cache between their steps.
        reference = build_ours(qwen, dev, kernels=False)
        reference.load_state_dict(ours.state_dict())
        ref_times = interleaved_times(
            {
                "marinlm reference": ours_step(reference, ids, dtype),
                "marinlm": steps["marinlm"],
                hf_best: steps[hf_best],
            },
            a.steps,
            dev,
        )
        ref_best = {k: min(t) for k, t in ref_times.items()}
        ref_rounds = sorted(h / o for h, o in zip(ref_times[hf_best], ref_times["marinlm reference"], strict=True))
        print(
            f"  marinlm reference (kernels.modules: reference), in rounds of its own: step "
            f"{ref_best['marinlm reference'] * 1e3:.1f} ms; / {hf_best}: "
            f"{ref_best[hf_best] / ref_best['marinlm reference']:.2f}x best against best, within a round median "
            f"{statistics.median(ref_rounds):.2f}x; the kernels make ours "
            f"{ref_best['marinlm reference'] / ref_best['marinlm']:.2f}x faster"
        )
        if "marinlm compiled" in best and "HF (grouped_mm) compiled" in best:
            ratio = best["HF (grouped_mm) compiled"] / best["marinlm compiled"]
            print(f"  compiled: marinlm / HF (grouped_mm): {ratio:.2f}x")
        if not emulated:
            # The same model FLOPs cannot take less than FLOPs / peak: the ceiling on the ratio.
            hf_mfu = flops[hf_best] / best[hf_best] / peaks[dtype]
            print(
                f"  ceiling: at 100% MFU marinlm / {hf_best} would be {1 / hf_mfu:.2f}x; "
                f"1.5x needs MFU >= {1.5 * hf_mfu:.1%} (1.5 x HF's {hf_mfu:.1%})"
            )
        if (batch, seq) != (a.batch, a.seq):
            # HF's bf16 linear layers run torch's emulated kernels: the full shape would take minutes
            # a step. Ours (kernels/bf16.py) does not, so show it at the full shape too.
            full_ids = torch.randint(0, qwen.vocab_size, (a.batch, a.seq), generator=torch.Generator().manual_seed(0))
            full_step = ours_step(build_ours(qwen, dev), full_ids, dtype)
            full = min(interleaved_times({"full": full_step}, a.steps, dev)["full"])
            mfu = summarize(qwen, a.seq).flops_per_token * a.batch * a.seq / full / peaks[torch.float32]
            print(
                f"  marinlm at {a.batch} x {a.seq}: {a.batch * a.seq / full:8.0f} tok/s  step {full * 1e3:8.1f} ms"
                f"  MFU {mfu:6.1%} of the fp32 peak its GEMMs run at"
                f"  (HF not timed there: its bf16 matmuls run at {peaks[dtype] / 1e9:.1f} GFLOP/s)"
            )
        if dev == "cpu" and not emulated:
            print_breakdown({k: steps[k] for k in ("marinlm", hf_best)}, best, qwen, peaks[dtype])
        if "marinlm small" in best:
            ratio = best["marinlm small"] / best["marinlm"]
            print(
                f"  hero-shaped small ({summarize(small).total / 1e6:.1f}M) costs {ratio:.2f}x "
                f"the qwen3-style ({summarize(qwen).total / 1e6:.1f}M) step"
            )


if __name__ == "__main__":
    main()
