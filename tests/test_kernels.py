"""Every kernel (marinlm.kernels) against its reference module (marinlm.model): forward values and
gradients, in fp32 and under bf16 autocast, with packed documents and sliding windows."""

from __future__ import annotations

import copy

import pytest
import torch

from marinlm.kernels import KERNELS, apply_kernels
from marinlm.kernels.bf16 import EmulatedBf16Linear
from marinlm.kernels.config import KernelConfig
from marinlm.model import MarinForCausalLM
from marinlm.model.attention import Attention
from marinlm.model.config import AttentionConfig
from marinlm.model.context import ForwardContext
from marinlm.model.experts import RoutedExperts
from marinlm.model.layers import RMSNorm, SConv, doc_ids_and_positions
from marinlm.model.loss import NextTokenLoss
from marinlm.utils import device as device_probes

from conftest import build, randomize_identity_inits, tiny_config

PRECISIONS = pytest.mark.parametrize("precision", ["fp32", "bf16"])
# bf16: the kernels round at other points than the reference (once per fused node), so values
# agree to a few bf16 steps; fp32: to summation order.
TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-5), "bf16": dict(rtol=3e-2, atol=3e-2)}


def segments(B: int, T: int, seed: int = 0) -> torch.Tensor:
    """Packed documents of random lengths (about 8 tokens each)."""
    g = torch.Generator().manual_seed(seed)
    return torch.cumsum(torch.rand(B, T, generator=g) < 0.12, dim=1)


def context(seg_BT: torch.Tensor | None, B: int, T: int, window: int | None) -> ForwardContext:
    if seg_BT is None:
        doc, pos = torch.zeros(B, T, dtype=torch.long), torch.arange(T).expand(B, T)
    else:
        doc, pos = doc_ids_and_positions(seg_BT)
    return ForwardContext(doc, pos, packed=seg_BT is not None, decoding=False, derived=True, window=window)


def kernel_of(module: torch.nn.Module) -> torch.nn.Module:
    fast = copy.deepcopy(module)
    fast.__class__ = KERNELS[type(module)]
    return fast


def run(module, inputs, precision, call):
    """Outputs and the gradients of the float inputs and the parameters, for a fixed output grad."""
    inputs = [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = call(module, *inputs)
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(out.dtype)
    leaves = [t for t in inputs if t.requires_grad] + [p for p in module.parameters() if p.requires_grad]
    return [out.float(), *(g.float() for g in torch.autograd.grad(out, leaves, grad, allow_unused=False))]


def assert_same(reference, kernel, precision):
    for i, (a, b) in enumerate(zip(reference, kernel)):
        scale = a.abs().max().clamp_min(1e-6)
        tol = TOLERANCE[precision]
        torch.testing.assert_close(b / scale, a / scale, rtol=tol["rtol"], atol=tol["atol"], msg=f"tensor {i}")


@PRECISIONS
def test_fused_rms_norm(precision):
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(48))
    x = torch.randn(3, 20, 48)
    call = lambda m, x: m(x.bfloat16() if precision == "bf16" else x)  # noqa: E731 (bf16 inputs)
    assert_same(run(norm, [x], precision, call), run(kernel_of(norm), [x], precision, call), precision)


@PRECISIONS
@pytest.mark.parametrize("packed", [False, True])
def test_fused_sconv(precision, packed):
    conv = SConv(24, 4)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(4, 24))
    B, T = 2, 33
    ctx = context(segments(B, T) if packed else None, B, T, None)
    x = torch.randn(B, T, 24)

    def call(m, x):
        return m(x.bfloat16() if precision == "bf16" else x, ctx)[0]

    assert_same(run(conv, [x], precision, call), run(kernel_of(conv), [x], precision, call), precision)


@PRECISIONS
@pytest.mark.parametrize("is_global", [True, False])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("T", [40, 300])  # one query block; banded local layers and blocked attention
def test_fused_attention(precision, is_global, packed, T):
    config = AttentionConfig(
        num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=24, qk_norm=True, xsa=True, head_gate=True
    )
    torch.manual_seed(0)
    attn = Attention(config, 64, is_global=is_global, sconv_sites=["k", "v"], sconv_kernel=4, init_std=0.1)
    attn.reset_parameters()
    with torch.no_grad():
        attn.gate.weight.normal_(0, 0.3)
        for conv in (attn.sconv_k, attn.sconv_v):
            conv.weight.normal_(0, 0.5)
    B = 2
    a = torch.randn(B, T, 64)
    seg = segments(B, T, seed=T) if packed else None

    def call(m, a):  # a context per forward, as the model builds one
        return m(a, context(seg, B, T, config.sliding_window))

    assert_same(run(attn, [a], precision, call), run(kernel_of(attn), [a], precision, call), precision)


@PRECISIONS
@pytest.mark.parametrize("impl", ["auto", "grouped_mm", "chunked", "bmm", "loop"])
@pytest.mark.parametrize("capacity", [None, 9])
def test_fused_experts(precision, impl, capacity):
    torch.manual_seed(1)
    experts = RoutedExperts(8, 32, 48, init_std=0.2, impl="auto")
    experts.reset_parameters()
    fast = kernel_of(experts)
    fast.impl = impl
    N, k = 40, 2
    x = torch.randn(N, 32)
    chosen = torch.randn(N, 8).topk(k, dim=-1).indices
    weights = torch.rand(N, k)

    def call(m, x, w):
        out, dropped = m(x, chosen, w, capacity=capacity)
        assert dropped.item() == (0 if capacity is None else dropped.item())
        return out

    ref = run(experts, [x, weights], precision, call)
    got = run(fast, [x, weights], precision, call)
    assert_same(ref, got, precision)
    dropped = [m(x, chosen, weights, capacity=capacity)[1].item() for m in (experts, fast)]
    assert dropped[0] == dropped[1]


@PRECISIONS
@pytest.mark.parametrize("impl", ["auto", "chunked", "bmm", "loop"])
def test_fused_experts_on_rows_grouped_by_expert(precision, impl):
    """What a rank receives under expert parallel (rows already grouped by expert, no weights):
    the kernel's `run_experts` against the reference's, with an expert that gets no row and one
    that fills several chunks."""
    torch.manual_seed(2)
    experts = RoutedExperts(4, 32, 48, init_std=0.2, impl="auto")
    experts.reset_parameters()
    fast = kernel_of(experts)
    fast.impl = impl
    counts = torch.tensor([5, 0, 150, 21])
    x = torch.randn(int(counts.sum()), 32)

    def call(m, x):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        return m.run_experts(x.to(dtype), counts, m.resolve_impl(dtype))

    if impl == "auto":  # a CPU with bf16 GEMMs runs the padded chunks; fp32 the grouped GEMM
        cpu_bf16 = precision == "bf16" and not device_probes.emulated_bf16(torch.device("cpu"))
        assert fast.resolve_impl(torch.bfloat16 if precision == "bf16" else torch.float32) == (
            "chunked" if cpu_bf16 else "grouped_mm"
        )
    assert_same(run(experts, [x], precision, call), run(fast, [x], precision, call), precision)


@pytest.mark.parametrize("capacity", [None, 9])
def test_grouped_mm_experts_on_bf16_weights_take_torchs_autograd(monkeypatch, capacity):
    """With bf16 operands (a GPU under autocast, or bf16 weights) `grouped_mm` runs torch's own op
    and autograd, not the custom op: the same values and gradients as the reference loop."""
    import marinlm.kernels.experts as fast_experts

    def custom_op(*args):
        raise AssertionError("the custom grouped_mm op ran on bf16 operands")

    monkeypatch.setattr(fast_experts, "grouped_mm", custom_op)
    torch.manual_seed(1)
    experts = RoutedExperts(8, 32, 48, init_std=0.2, impl="loop")
    experts.reset_parameters()
    experts.to(torch.bfloat16)
    fast = kernel_of(experts)
    fast.impl = "grouped_mm"
    N, k = 40, 2
    x, weights = torch.randn(N, 32).bfloat16(), torch.rand(N, k).bfloat16()
    chosen = torch.randn(N, 8).topk(k, dim=-1).indices

    def call(m, x, w):
        return m(x, chosen, w, capacity=capacity)[0]

    assert_same(run(experts, [x, weights], "fp32", call), run(fast, [x, weights], "fp32", call), "bf16")


@PRECISIONS
@pytest.mark.parametrize("z_weight", [0.0, 1e-2])
def test_fused_next_token_loss(precision, z_weight):
    loss = NextTokenLoss(z_weight, chunk_tokens=16)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(50, 32, generator=g)
    w = 0.3 * torch.randn(97, 32, generator=g)
    labels = torch.randint(0, 97, (50,), generator=g)
    labels[3:9] = -100

    def call(m, h, w):
        return m(h, w, labels)[0]

    assert_same(run(loss, [h, w], precision, call), run(kernel_of(loss), [h, w], precision, call), precision)


def test_emulated_bf16_linear_matches_nn_linear(monkeypatch):
    monkeypatch.setattr(device_probes, "_cpu_has_bf16_gemm", lambda: False)
    linear = torch.nn.Linear(32, 24, bias=False)
    fast = copy.deepcopy(linear)
    fast.__class__ = EmulatedBf16Linear
    x = torch.randn(5, 32)
    for precision in ("fp32", "bf16"):
        call = lambda m, x: m(x)  # noqa: E731
        assert_same(run(linear, [x], precision, call), run(fast, [x], precision, call), precision)


@PRECISIONS
@pytest.mark.parametrize(
    "overrides",
    [
        {},  # the hero-shaped tiny preset: latent MoE, QB, GatedNorm, SConv, XSA, local/global
        {"moe": {"router": {"type": "softmax_topk"}, "latent_dim": None}, "attention": {"qk_norm_gain": True}},
    ],
    ids=["tiny", "qwen3-style"],
)
def test_whole_model_with_kernels_equals_the_reference(precision, overrides):
    """The whole model, packed rows long enough for banded local layers, a training step's loss
    and every parameter's gradient, kernels against reference. At the tiny preset's large init
    (0.139) bf16 rounding is chaotic (tests/test_cpu_bf16.py), hence 0.02 here."""
    config = tiny_config(max_seq_len=160, init_std=0.02, **overrides)
    reference = build(config)
    randomize_identity_inits(reference)
    kernels = apply_kernels(copy.deepcopy(reference), "cpu", precision)
    assert all(type(m) in KERNELS.values() for m in kernels.modules() if type(m) in KERNELS.values())
    ids = torch.randint(0, config.vocab_size, (2, 160), generator=torch.Generator().manual_seed(3))
    seg = segments(2, 160, seed=4)
    results = []
    for model in (reference, kernels):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(ids, seg, labels=ids.roll(-1, 1), return_logits=False)
        out.loss.backward()
        results.append([out.loss.detach(), *(p.grad for p in model.parameters())])
    if precision == "fp32":
        assert_same(results[0], results[1], precision)
    else:  # bf16 rounding compounds over layers: the loss to a bf16 step, gradients by direction
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-2, atol=0)
        for a, b in zip(results[0][1:], results[1][1:]):
            cosine = torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0)
            assert cosine > 0.99 or a.abs().max() < 1e-6, cosine


def test_apply_kernels_keeps_every_tensor_and_follows_the_switch():
    config = tiny_config()
    with torch.device("meta"):
        model = MarinForCausalLM(config)
    keys = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    apply_kernels(model, "cpu", "bf16")  # on meta, before any weight exists
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == keys
    swapped = {type(m) for m in model.modules()}
    assert set(KERNELS.values()) <= swapped and not set(KERNELS) & swapped
    reference = MarinForCausalLM(tiny_config())
    apply_kernels(reference, "cpu", "bf16", KernelConfig(modules="reference"))
    assert not set(KERNELS.values()) & {type(m) for m in reference.modules()}


def test_activation_statistics_are_those_of_the_blocks_outputs():
    """The monitor's residual RMS and max-abs of layer 0 equal those of the block run by hand, and
    on a step that is not due it registers nothing."""
    from marinlm.train.activations import ActivationMonitor

    config = tiny_config()
    model = build(config)
    randomize_identity_inits(model)
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    monitor = ActivationMonitor(model, every=2)
    with monitor.watch(1):
        assert not model.layers[0]._forward_hooks
        model(ids)
    assert monitor.report() == ({}, {})
    with monitor.watch(2):
        model(ids)
    assert not model.layers[0]._forward_hooks  # removed after the step
    scalars, samples = monitor.report()
    with torch.no_grad():
        x = model.embed(ids)
        x = model.embed_norm(x) if model.embed_norm is not None else x
        y, _ = model.layers[0](x, model.context(ids, None, None, None, None))
    assert scalars["act/layer_0/residual_rms"] == pytest.approx(y.square().mean().sqrt().item(), rel=1e-5)
    assert scalars["act/layer_0/residual_max_abs"] == pytest.approx(y.abs().max().item(), rel=1e-6)
    assert len(scalars) == 6 * config.num_layers and samples["act/layer_0/mlp"].size > 0


@PRECISIONS
@pytest.mark.parametrize("T, S", [(24, 24), (24, 80), (64, 200)])
def test_causal_tail_attention(precision, T, S):
    """A chunk's queries against the keys up to the chunk's end, one document (context parallel's
    global layers): torch's flash kernel on the unmasked prefix and the causal tail, merged by
    log-sum-exp, against the reference's one masked SDPA; grouped KV heads."""
    config = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16)
    attn = Attention(config, 64, is_global=True, sconv_sites=[], sconv_kernel=4, init_std=0.1).requires_grad_(False)
    g = torch.Generator().manual_seed(T + S)
    q, k, v = (
        torch.randn(2, 4, T, 16, generator=g),
        torch.randn(2, 2, S, 16, generator=g),
        torch.randn(2, 2, S, 16, generator=g),
    )

    def call(m, q, k, v):
        cast = (lambda t: t.bfloat16()) if precision == "bf16" else (lambda t: t)
        return m.attend_causal_tail(cast(q), cast(k), cast(v))

    assert_same(run(attn, [q, k, v], precision, call), run(kernel_of(attn), [q, k, v], precision, call), precision)
