"""The CPU attention kernel (kernels/cpu_attention.py) against torch's SDPA."""

import pytest
import torch
import torch.nn.functional as F

from marinlm.kernels import bf16 as cpu_bf16
from marinlm.kernels import cpu_attention
from marinlm.model.context import attention_mask
from marinlm.utils import device as device_probes


def dict_memo():
    """A per-forward memo as `ForwardContext.memo`, and the list of keys it built."""
    store, built = {}, []

    def memo(key, build):
        if key not in store:
            built.append(key)
            store[key] = build()
        return store[key]

    return memo, built


def qkv(B, H, K, T, S, dtype, seed=0, spread=1.0, head_dim=16):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, L, head_dim, generator=g) for n, L in ((H, T), (K, S), (K, S)))
    q, k, v = (spread * q).to(dtype), (spread * k).to(dtype), v.to(dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def packed_mask(B, T, window):
    """Two documents per row, split at a different point in each row, with a sliding window."""
    doc = torch.stack([(torch.arange(T) >= 3 + 2 * b).long() for b in range(B)])
    pos = torch.where(doc == 0, torch.arange(T), torch.arange(T) - (3 + 2 * torch.arange(B)).unsqueeze(1))
    return attention_mask(doc, pos, doc, pos, window)


def outputs_and_grads(fn, q, k, v, g):
    y = fn(q, k, v)
    return [y, *torch.autograd.grad(y, (q, k, v), g)]


CASES = {
    "causal, grouped heads": dict(H=6, K=2, T=12, S=12, mask=None),
    "packed documents and a window": dict(H=4, K=4, T=12, S=12, mask="packed"),
    "decoding against a longer cache": dict(H=4, K=2, T=3, S=12, mask="cache"),
    "a mask that is not causal": dict(H=4, K=2, T=12, S=12, mask="random"),
}
# 16: the scale 1/4 is exact on bf16 (fpmath-mode products); 24: 1/√24 is not (plain fp32 products).
HEAD_DIMS = [16, 24]


def case_mask(case, B):
    if case["mask"] == "packed":
        return packed_mask(B, case["T"], window=5)
    if case["mask"] == "random":  # each query sees itself and about half the other keys, later ones too
        T, S = case["T"], case["S"]
        return (torch.rand(B, 1, T, S, generator=torch.Generator().manual_seed(2)) < 0.5) | torch.eye(
            T, S, dtype=torch.bool
        )
    if case["mask"] == "cache":  # the last 3 of 12 positions attend to everything up to themselves
        T, S = case["T"], case["S"]
        return (torch.arange(S) <= torch.arange(S - T, S).unsqueeze(1)).expand(B, 1, T, S)
    return None


def blocks(case, mask, block):
    """The query blocks of a case: one (None), or blocks of `block` rows."""
    if block is None:
        return [(0, case["T"], 0, case["S"])]
    spans = cpu_attention.query_blocks(case["T"], case["S"], mask, is_causal=mask is None, block=block)
    assert len(spans) > 1
    return spans


# Rows of 12 queries in blocks of 5 (the last one short); the 3 decoding queries in blocks of 2.
BLOCKS = {"one block": None, "query blocks": 5}


def block_rows(name, blocking):
    return None if BLOCKS[blocking] is None else min(BLOCKS[blocking], CASES[name]["T"] - 1)


@pytest.mark.parametrize("blocking", BLOCKS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("name", CASES)
def test_matches_sdpa_in_fp32_with_gradients(name, head_dim, blocking):
    """In fp32 nothing is rounded: forward and the written-out backward equal SDPA's, in one
    block of queries or several."""
    case, B = CASES[name], 2
    q, k, v = qkv(B, case["H"], case["K"], case["T"], case["S"], torch.float32, head_dim=head_dim)
    mask = case_mask(case, B)
    g = torch.randn(B, case["H"], case["T"], head_dim, generator=torch.Generator().manual_seed(1))
    spans = blocks(case, mask, block_rows(name, blocking))

    def ours(q, k, v):
        return cpu_attention.short_attention(q, k, v, mask, is_causal=mask is None, spans=spans)

    def ref(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)

    for a, b in zip(outputs_and_grads(ours, q, k, v, g), outputs_and_grads(ref, q, k, v, g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blocking", BLOCKS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("name", CASES)
def test_bf16_error_is_close_to_torch_bf16_kernel(name, head_dim, blocking):
    """bf16 inputs: against an fp64 reference on the same (exact) values, our output and
    gradients are within 2x the error of torch's CPU bf16 SDPA, plus half a rounding step.

    torch's CPU kernel rounds only its outputs; ours rounds P and dS to bf16 as operands of the
    second GEMMs, where GPU FlashAttention rounds them too, which costs up to ~1.9x its error
    here. Scores spread over about ±12 make bf16-rounded scores fail this (5.7x on y). In query
    blocks, dK and dV add up bf16 products of the blocks (in fp32)."""
    case, B = CASES[name], 2
    q, k, v = qkv(B, case["H"], case["K"], case["T"], case["S"], torch.bfloat16, seed=3, spread=3.0, head_dim=head_dim)
    mask = case_mask(case, B)
    spans = blocks(case, mask, block_rows(name, blocking))
    g = torch.randn(B, case["H"], case["T"], head_dim, generator=torch.Generator().manual_seed(4)).bfloat16()

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)

    exact = outputs_and_grads(sdpa, *(t.detach().double().requires_grad_() for t in (q, k, v)), g.double())
    ours = outputs_and_grads(
        lambda q, k, v: cpu_attention.short_attention(q, k, v, mask, is_causal=mask is None, spans=spans), q, k, v, g
    )
    torch_bf16 = outputs_and_grads(sdpa, q, k, v, g)
    for what, a, b, want in zip(("y", "dq", "dk", "dv"), ours, torch_bf16, exact):
        assert a.dtype == torch.bfloat16, what
        ours_err = (a.double() - want).abs().max().item()
        torch_err = (b.double() - want).abs().max().item()
        assert ours_err <= 2 * torch_err + 2**-9 * want.abs().max().item(), (what, ours_err, torch_err)


def test_taken_for_fp32_and_native_bf16_within_the_kept_scores_only(monkeypatch):
    q, k, _ = qkv(1, 4, 2, 8, 8, torch.bfloat16)
    take = cpu_attention.use_short_attention
    native = not cpu_bf16.emulated_bf16("cpu")
    assert take(q, k) == native
    T = cpu_attention.FP32_BLOCK_ROWS
    q32, k32, _ = qkv(1, 4, 2, T + 1, T + 1, torch.float32)
    assert take(q32, k32)  # fp32 rows of more than one block, on every CPU
    assert not take(q32[:, :, :T], k32) and not take(q.float(), k.float())  # one block: flash
    assert not take(q.half(), k.half())
    assert not take(q, k, attn_mask=torch.zeros(8, 8))  # an additive float mask goes to SDPA
    assert take(q, k, attn_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool)) == native
    assert not take(q, k, attn_mask=torch.ones(1, 4, 8, 8, dtype=torch.bool))  # one mask per head: SDPA
    if native:  # 1 x 4 heads x 8 queries x 8 keys = 256 probabilities, 144 in causal blocks of 2
        causal = cpu_attention.query_blocks(8, 8, is_causal=True, block=2)
        assert cpu_attention.saved_scores(1, 4, causal) == 4 * 2 * (2 + 4 + 6 + 8)
        monkeypatch.setattr(cpu_attention, "MAX_SCORES", 255)
        assert not take(q, k) and take(q, k, spans=causal)
    monkeypatch.setattr(device_probes, "_cpu_has_bf16_gemm", lambda: False)
    assert not take(q, k)  # emulated bf16 GEMMs: kernels/bf16.py's fp32 path
    monkeypatch.setattr(cpu_attention, "MAX_SCORES", 4 * (T + 1) ** 2)  # fp32 needs no bf16 GEMM
    assert take(q32, k32)
    monkeypatch.setattr(cpu_attention, "MAX_SCORES", 4 * (T + 1) ** 2 - 1)
    assert not take(q32, k32)


def test_query_blocks_skip_the_keys_no_query_of_the_block_sees():
    qb = cpu_attention.query_blocks
    rows = cpu_attention.LONG_ROWS
    assert qb(rows, rows, is_causal=True) == [(0, rows, 0, rows)]  # short rows: one block
    step = cpu_attention.BLOCK_ROWS
    long = qb(rows + 1, rows + 1, is_causal=True)
    assert long == [(s, min(s + step, rows + 1), 0, min(s + step, rows + 1)) for s in range(0, rows + 1, step)]
    # fp32: blocks of FP32_BLOCK_ROWS from the shortest rows that have two.
    step = cpu_attention.FP32_BLOCK_ROWS
    assert qb(step, step, is_causal=True, dtype=torch.float32) == [(0, step, 0, step)]
    fp32 = qb(step + 1, step + 1, is_causal=True, dtype=torch.float32)
    assert fp32 == [(0, step, 0, step), (step, step + 1, 0, step + 1)]
    assert qb(rows, rows, is_causal=True, dtype=torch.float32) == [
        (s, s + step, 0, s + step) for s in range(0, rows, step)
    ]
    assert qb(10, 10, is_causal=False, block=4) == [(0, 4, 0, 10), (4, 8, 0, 10), (8, 10, 0, 10)]  # all keys
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    assert qb(10, 10, causal, block=4) == [(0, 4, 0, 4), (4, 8, 0, 8), (8, 10, 0, 10)]
    later = causal.clone()
    later[5, 9] = True  # a query of the second block may see a later key: that block reaches it
    assert qb(10, 10, later.expand(2, 1, 10, 10), block=4) == [(0, 4, 0, 4), (4, 8, 0, 10), (8, 10, 0, 10)]
    # Decoding 4 queries against 10 keys: aligned to the bottom right, as a KV cache is.
    cache = torch.arange(10) <= torch.arange(6, 10).unsqueeze(1)
    assert qb(4, 10, cache, block=2) == [(0, 2, 0, 8), (2, 4, 0, 10)]
    # Two rows packed with documents: row 0 splits at 3, row 1 at 5. The queries from 5 on see no
    # key before their document's start in either row, so their blocks skip the first 3 keys.
    packed = packed_mask(2, 10, window=None)
    assert qb(10, 10, packed, block=4) == [(0, 4, 0, 4), (4, 8, 0, 8), (8, 10, 3, 10)]
    assert qb(10, 10, packed, block=2)[-2:] == [(6, 8, 3, 8), (8, 10, 3, 10)]


def test_query_blocks_read_a_mask_once_a_forward(monkeypatch):
    """Every global layer of a forward passes the same mask: with the forward's memo the blocks
    are read off it once; without one, at every call."""
    reads = []
    real_any = torch.Tensor.any
    mask = torch.ones(10, 10, dtype=torch.bool).tril()

    def counting_any(self, *args, **kwargs):
        if self.shape[-2:] == (10, 10):
            reads.append(1)
        return real_any(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "any", counting_any)
    memo, built = dict_memo()
    first = cpu_attention.query_blocks(10, 10, mask, block=4, memo=memo)
    assert cpu_attention.query_blocks(10, 10, mask, block=4, memo=memo) == first and len(reads) == 1
    assert cpu_attention.query_blocks(10, 10, mask, block=4) == first and len(reads) == 2
    assert cpu_attention.query_blocks(10, 10, mask, block=3, memo=memo) != first and len(reads) == 3
    assert len(built) == 2
    mask[9, :] = False
    mask[9, 0] = True
    assert cpu_attention.query_blocks(10, 10, mask, block=4) == first[:2] + [(8, 10, 0, 9)]


def test_block_biases_are_built_once_a_forward_for_each_blocks_and_causality():
    """Every layer of a forward passes the same mask (or none): with the forward's memo the
    kernel's additive biases are built once and handed out again, never for other blocks or
    causality; without it, built at each call."""
    memo, _ = dict_memo()

    def bb(*args):
        return cpu_attention.block_biases(*args, memo)

    cpu = torch.device("cpu")

    def expected(mask, spans):
        mask = mask.reshape(-1, 1, 1, *mask.shape[-2:])
        return [
            torch.zeros(mask[..., s:e, lo:hi].shape).masked_fill_(~mask[..., s:e, lo:hi], -torch.inf)
            for s, e, lo, hi in spans
        ]

    def check(biases, mask, spans):
        assert len(biases) == len(spans)
        for got, want in zip(biases, expected(mask, spans)):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=0, atol=0)

    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    spans = cpu_attention.query_blocks(10, 10, is_causal=True, block=4)
    first = bb(None, True, 10, 10, spans, cpu)
    check(first, causal, spans)
    assert bb(None, True, 10, 10, spans, cpu) is first  # the next layer's call: the same biases
    everything = bb(None, False, 10, 10, spans, cpu)  # not causal: no -inf
    check(everything, torch.ones(10, 10, dtype=torch.bool), spans)
    wider = cpu_attention.query_blocks(10, 10, is_causal=True, block=5)
    check(bb(None, True, 10, 10, wider, cpu), causal, wider)
    # A mask: its own biases (a forward's memo is for one mask; the caller keys it by mask).
    mask = packed_mask(2, 10, window=None)
    from_mask = cpu_attention.block_biases(mask, False, 10, 10, spans, cpu)
    check(from_mask, mask, spans)
    assert cpu_attention.block_biases(mask, False, 10, 10, spans, cpu) is not from_mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_rows_are_attended_in_query_blocks(monkeypatch, dtype):
    """The model's kernel cuts rows longer than LONG_ROWS (bf16) or FP32_BLOCK_ROWS (fp32) into
    blocks of queries and gives what SDPA gives, with packed documents too; past MAX_SCORES kept
    probabilities it leaves them to SDPA."""
    if dtype == torch.bfloat16 and cpu_bf16.emulated_bf16("cpu"):
        pytest.skip("needs a CPU with bf16 GEMMs")
    T = (cpu_attention.LONG_ROWS if dtype == torch.bfloat16 else 2 * cpu_attention.FP32_BLOCK_ROWS) + 20
    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
    q, k, v = qkv(2, 4, 2, T, T, dtype, seed=8, head_dim=16)
    g = torch.randn(2, 4, T, 16, generator=torch.Generator().manual_seed(9)).to(dtype)
    taken = []
    real = cpu_attention.short_attention

    def recording(*args, spans=None, **kwargs):
        taken.append(spans)
        return real(*args, spans=spans, **kwargs)

    monkeypatch.setattr(cpu_attention, "short_attention", recording)
    causal = cpu_attention.query_blocks(T, T, is_causal=True, dtype=dtype)
    assert len(causal) == 3
    # Room for the probabilities of the causal blocks only, not for all T x T of them.
    monkeypatch.setattr(cpu_attention, "MAX_SCORES", cpu_attention.saved_scores(2, 4, causal))
    for mask in (None, packed_mask(2, T, window=None)):

        def model_kernel(q, k, v, mask=mask):
            return cpu_attention.scaled_dot_product_attention(q, k, v, mask, is_causal=mask is None, enable_gqa=True)

        def sdpa(q, k, v, mask=mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)

        exact = outputs_and_grads(sdpa, *(t.detach().double().requires_grad_() for t in (q, k, v)), g.double())
        ours = outputs_and_grads(model_kernel, q, k, v, g)
        # Packed: the second document starts at 3 and 5 in the two rows, so the blocks after the
        # first skip the first 3 keys.
        blocks = causal if mask is None else [(s, e, 3 if s else 0, hi) for s, e, _, hi in causal]
        assert taken.pop() == blocks
        for what, a, want in zip(("y", "dq", "dk", "dv"), ours, exact):
            assert a.dtype == dtype, what
            atol = tolerance * want.abs().max().item()
            torch.testing.assert_close(a.double(), want, rtol=tolerance, atol=atol, msg=what)
        with torch.no_grad():  # keeps no probabilities: the same output
            torch.testing.assert_close(model_kernel(q, k, v), ours[0], rtol=0, atol=0)
        assert taken.pop() == blocks
    everything = torch.ones(2, 1, T, T, dtype=torch.bool)  # not causal: every block needs all keys
    cpu_attention.scaled_dot_product_attention(q, k, v, everything, enable_gqa=True)
    monkeypatch.setattr(cpu_attention, "MAX_SCORES", cpu_attention.saved_scores(2, 4, causal) - 1)
    cpu_attention.scaled_dot_product_attention(q, k, v, None, is_causal=True, enable_gqa=True)
    assert not taken  # SDPA both times
    # Called on its own, the kernel picks the same blocks for the dtype.
    biases = cpu_attention.block_biases
    monkeypatch.setattr(cpu_attention, "block_biases", lambda *args: taken.append(args[4]) or biases(*args))
    real(q, k, v, None, is_causal=True)
    assert taken == [causal]


@pytest.mark.parametrize("backward_under_autocast", [False, True])
def test_autocast_does_not_lower_its_fp32_products(backward_under_autocast):
    """The model calls it inside `torch.autocast("cpu", bfloat16)`, where a plain torch.bmm of
    fp32 operands would run in bf16 and round the scores (and, with the backward inside the
    autocast region too, dP): it must compute the same numbers as outside autocast."""
    case, B = CASES["causal, grouped heads"], 2
    q, k, v = qkv(B, case["H"], case["K"], case["T"], case["S"], torch.bfloat16, seed=5, spread=3.0)
    g = torch.randn(B, case["H"], case["T"], 16, generator=torch.Generator().manual_seed(6)).bfloat16()

    def attend(q, k, v):
        return cpu_attention.short_attention(q, k, v, None, is_causal=True)

    plain = outputs_and_grads(attend, q, k, v, g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attend(q, k, v)
        grads = torch.autograd.grad(y, (q, k, v), g) if backward_under_autocast else None
    if grads is None:
        grads = torch.autograd.grad(y, (q, k, v), g)
    for what, a, b in zip(("y", "dq", "dk", "dv"), [y, *grads], plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=what)


def test_fpmath_mode_only_where_the_scaled_operand_still_holds_bf16_values():
    """A power of two times a bf16 value is a bf16 value, so the fpmath-mode product rounds
    nothing; 1/√24 or 1/√32 times one generally is not, and those products stay plain fp32."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(7)).bfloat16()
    for head_dim in (16, 64, 256, 24, 32, 128):
        scale = head_dim**-0.5
        taken = cpu_attention._bf16_products(x, scale)
        scaled = x.float() * scale
        assert taken == torch.equal(scaled.bfloat16().float(), scaled), head_dim
        assert not cpu_attention._bf16_products(x.float(), scale)  # fp32 inputs: never
    assert cpu_attention._bf16_products(x, 64**-0.5) and not cpu_attention._bf16_products(x, 32**-0.5)


def test_bf16_fpmath_mode_only_for_bf16_inputs_and_restored(monkeypatch):
    """The process-wide oneDNN setting is switched on around the two fp32-result products of bf16
    inputs with a power-of-two scale only, and is back to what it was afterwards, also when the
    block raises."""
    seen = []
    real = cpu_bf16.bf16_operand_products
    before = torch.backends.mkldnn.matmul.fp32_precision
    assert before != "bf16"

    def recording(enabled=True):
        seen.append(enabled)
        return real(enabled)

    monkeypatch.setattr(cpu_attention, "bf16_operand_products", recording)
    for dtype, head_dim in ((torch.bfloat16, 16), (torch.float32, 16), (torch.bfloat16, 24)):
        seen.clear()
        q, k, v = qkv(1, 4, 2, 8, 8, dtype, head_dim=head_dim)
        cpu_attention.short_attention(q, k, v, None, is_causal=True).sum().backward()
        assert seen == [dtype == torch.bfloat16 and head_dim == 16] * 2, (dtype, head_dim)
        assert torch.backends.mkldnn.matmul.fp32_precision == before
    with pytest.raises(RuntimeError), real():
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
        raise RuntimeError
    assert torch.backends.mkldnn.matmul.fp32_precision == before


@pytest.mark.slow
def test_compiles_without_a_graph_break_for_the_fpmath_mode():
    """Setting oneDNN's mode is a graph break; under torch.compile the products stay plain fp32."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    q, k, v = qkv(1, 4, 2, 8, 8, torch.bfloat16)

    def attend(q, k, v):
        return cpu_attention.short_attention(q, k, v, None, is_causal=True)

    compiled = torch.compile(attend, backend=backend)
    y = compiled(q, k, v)
    torch.testing.assert_close(y, attend(q, k, v), rtol=0, atol=0)
    assert backend.frame_count == 1 and len(backend.graphs) == 1


def test_long_rows_with_a_mask_compile_to_one_graph():
    """Checking the mask for keys to skip is a graph break: while compiling, blocks take all keys."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    if cpu_bf16.emulated_bf16("cpu"):
        pytest.skip("needs a CPU with bf16 GEMMs")
    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    T = cpu_attention.LONG_ROWS + 20
    q, k, v = qkv(1, 4, 2, T, T, torch.bfloat16)
    mask = packed_mask(1, T, window=None)

    def attend(q, k, v, mask):
        return cpu_attention.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)

    y = torch.compile(attend, backend=backend)(q, k, v, mask)
    torch.testing.assert_close(y, attend(q, k, v, mask), rtol=0, atol=0)
    assert len(backend.graphs) == 1 and not counters["graph_break"], dict(counters["graph_break"])
