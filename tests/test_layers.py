"""The norm and query/key transforms, reference (model/layers.py) and fused (kernels/), against
the same maths op by op in fp64."""

import itertools

import pytest
import torch

from marinlm.kernels.attention import fused_qk_transform
from marinlm.kernels.layers import FusedRMSNorm
from marinlm.model.context import ForwardContext, rope_cos_sin
from marinlm.model.layers import RMSNorm, qk_transform

NORMS = pytest.mark.parametrize("norm_class", [RMSNorm, FusedRMSNorm], ids=["reference", "fused"])
QK = pytest.mark.parametrize("qk_transform", [qk_transform, fused_qk_transform], ids=["reference", "fused"])


def unfused_rms_norm(x, weight, eps):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def unfused_qk(x, normalize, gain, cos, sin, mult, eps=1e-6):
    """QK-norm, gain, RoPE on the first 2R dims (split-half pairs) and qk_mult, op by op in fp64."""
    y = x.double()
    if normalize:
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if gain is not None:
        y = y * gain.double()
    if cos is not None:
        half = cos.shape[-1]
        c, s = cos.double().unsqueeze(2), sin.double().unsqueeze(2)
        y1, y2 = y[..., :half], y[..., half : 2 * half]
        y = torch.cat([y1 * c - y2 * s, y2 * c + y1 * s, y[..., 2 * half :]], -1)
    return y * mult


@NORMS
def test_rms_norm_gradients_pass_gradcheck(norm_class):
    norm = norm_class(8, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8, dtype=torch.float64))
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = norm.weight.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)), (x, w))


@NORMS
def test_rms_norm_gain_gradient_matches_autograd(norm_class):
    """The weight gradient against autograd through the op-by-op formula (fp64)."""
    norm = norm_class(16, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(16, dtype=torch.float64))
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    g = torch.randn(3, 5, 16, dtype=torch.float64)
    w_ref = norm.weight.detach().clone().requires_grad_()
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    unfused_rms_norm(x_ref, w_ref, 1e-6).backward(g)
    norm(x_ours).backward(g)
    torch.testing.assert_close(norm.weight.grad, w_ref.grad)
    torch.testing.assert_close(x_ours.grad, x_ref.grad)


@NORMS
def test_rms_norm_rounds_once_in_bf16(norm_class):
    """bf16 in, bf16 out: the fp32 result rounded once, so within half a bf16 step of the exact one."""
    norm = norm_class(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(64))
    x = torch.randn(4, 7, 64).bfloat16()
    y = norm(x)
    assert y.dtype == torch.bfloat16
    exact = unfused_rms_norm(x, norm.weight, 1e-6)
    assert torch.all((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-30)


QK_CASES = list(
    itertools.product(
        [True, False],  # normalize
        [True, False],  # gain
        [0, 4, 8],  # rope dims of the 8-wide heads: NoPE, half, full
        [1.0, 1.3],  # qk_mult
    )
)


def qk_inputs(rope_dim, dtype, B=2, T=5, H=3, Dh=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, Dh, generator=g, dtype=dtype)
    gain = (1 + 0.3 * torch.randn(Dh, generator=g)).to(dtype)
    pos = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 5, 6, 7]])[:B, :T]
    cos, sin = rope_cos_sin(pos, rope_dim, 10000.0) if rope_dim else (None, None)
    if cos is not None:
        cos, sin = cos.to(dtype), sin.to(dtype)
    return x, gain, cos, sin


def test_rope_tables_are_built_once_a_forward_and_match_fp64():
    """The context builds each table once a forward, whatever the number of layers asking."""
    pos = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 5, 6, 7]])

    def want(pos, rope_dim, theta):
        inv_freq = 1.0 / theta ** (torch.arange(rope_dim // 2, dtype=torch.float64) / (rope_dim // 2))
        angles = pos.double().unsqueeze(-1) * inv_freq
        return angles.cos().float(), angles.sin().float()

    ctx = ForwardContext(torch.zeros_like(pos), pos, packed=False, decoding=False, derived=True, window=None)
    first = ctx.rope(8, 10000.0)
    assert ctx.rope(8, 10000.0) is first
    for args in ((8, 10000.0), (4, 10000.0), (4, 500.0)):
        for got, ref in zip(ctx.rope(*args), want(pos, *args)):
            torch.testing.assert_close(got, ref)
    assert ctx.rope(4, 500.0) is not first


@QK
@pytest.mark.parametrize("normalize,with_gain,rope_dim,mult", QK_CASES)
def test_qk_transform_matches_op_by_op_maths_and_passes_gradcheck(qk_transform, normalize, with_gain, rope_dim, mult):
    x, gain, cos, sin = qk_inputs(rope_dim, torch.float64)
    gain = gain if with_gain else None

    def fused(x, *gain_arg):
        return qk_transform(
            x, normalize=normalize, gain=gain_arg[0] if gain_arg else None, cos_BTR=cos, sin_BTR=sin, mult=mult
        )

    inputs = (x.requires_grad_(), *([gain.requires_grad_()] if with_gain else []))
    torch.testing.assert_close(fused(*inputs), unfused_qk(x, normalize, gain, cos, sin, mult))
    assert torch.autograd.gradcheck(fused, inputs)


@QK
def test_qk_transform_with_nothing_to_do_returns_its_input(qk_transform):
    x = torch.randn(2, 3, 4, 8)
    assert qk_transform(x, normalize=False) is x
    empty = torch.zeros(2, 3, 0)
    assert qk_transform(x, normalize=False, cos_BTR=empty, sin_BTR=empty) is x


@QK
def test_qk_transform_fp32_gradients_match_autograd_of_the_op_by_op_maths(qk_transform):
    x, gain, cos, sin = qk_inputs(4, torch.float32, seed=1)
    dy = torch.randn_like(x)
    ours_x, ours_g = x.clone().requires_grad_(), gain.clone().requires_grad_()
    ref_x, ref_g = x.double().requires_grad_(), gain.double().requires_grad_()
    qk_transform(ours_x, normalize=True, gain=ours_g, cos_BTR=cos, sin_BTR=sin, mult=1.3).backward(dy)
    unfused_qk(ref_x, True, ref_g, cos, sin, 1.3).backward(dy.double())
    torch.testing.assert_close(ours_x.grad, ref_x.grad.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_g.grad, ref_g.grad.float(), rtol=1e-5, atol=1e-6)


@QK
def test_qk_transform_rounds_once_in_bf16(qk_transform):
    """bf16 queries: one rounding of the fp32 result, so within half a bf16 step of the exact
    value (the op-by-op chain rounds after the norm, the gain and the rotation)."""
    x, gain, cos, sin = qk_inputs(8, torch.float32, seed=2)
    x, gain = x.bfloat16(), gain.float()
    y = qk_transform(x, normalize=True, gain=gain, cos_BTR=cos, sin_BTR=sin, mult=1.3)
    assert y.dtype == torch.bfloat16
    exact = unfused_qk(x, True, gain, cos, sin, 1.3)
    assert torch.all((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6)


def rotate_adjacent_pairs(x, cos, sin):
    """RoPE written out pair by pair as Marin's fused path rotates: dims (2i, 2i + 1) of each head
    by angle i, the dims past 2R kept (fp64)."""
    y = x.double().clone()
    for i in range(cos.shape[-1]):
        c, s = cos[..., i].double().unsqueeze(-1), sin[..., i].double().unsqueeze(-1)  # [B, T, 1] over heads
        a, b = x[..., 2 * i].double(), x[..., 2 * i + 1].double()
        y[..., 2 * i], y[..., 2 * i + 1] = a * c - b * s, b * c + a * s
    return y


@QK
@pytest.mark.parametrize("rope_dim", [8, 4])  # the whole head, and half of it (the hero's rope_fraction)
def test_interleaved_rope_rotates_adjacent_pairs(qk_transform, rope_dim):
    """`interleaved` equals the explicit rotation of pairs (2i, 2i+1), values and gradients, and is
    the split-half rotation of the same vector with its rotary dims permuted (evens, then odds):
    the permutation the native Hugging Face export applies to the q/k weights."""
    x, _, cos, sin = qk_inputs(rope_dim, torch.float64)

    def ours(x):
        return qk_transform(x, normalize=False, cos_BTR=cos, sin_BTR=sin, interleaved=True)

    torch.testing.assert_close(ours(x), rotate_adjacent_pairs(x, cos, sin))
    assert torch.autograd.gradcheck(ours, (x.clone().requires_grad_(),))
    order = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2), torch.arange(rope_dim, x.shape[-1])])
    half = qk_transform(x[..., order], normalize=False, cos_BTR=cos, sin_BTR=sin)
    torch.testing.assert_close(half, ours(x)[..., order])
    assert not torch.allclose(qk_transform(x, normalize=False, cos_BTR=cos, sin_BTR=sin), ours(x))
