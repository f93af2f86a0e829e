from __future__ import annotations

import ast
import math

import pytest
import torch
import torch.nn.functional as F

from marinlm.config import load_config
from marinlm.kernels.attention import band_block, banded_attention, banded_mask
from marinlm.kernels.layers import FusedSConv
from marinlm.kernels.loss import chunk_tokens, fused_chunked_loss
from marinlm.model import MarinConfig
from marinlm.model.context import ForwardContext, attention_mask
from marinlm.model.layers import SConv, doc_ids_and_positions
from marinlm.model.summary import summarize

from conftest import CONFIGS, ROOT, build, randomize_identity_inits, tiny_config

KERNELS = pytest.mark.parametrize("kernels", [False, True], ids=["reference", "kernels"])
SCONVS = pytest.mark.parametrize("sconv_class", [SConv, FusedSConv], ids=["reference", "fused"])


def sconv(conv, x, doc, state=None):
    """Run an SConv on `doc` ids (None: one document a row) as a forward's context would."""
    B, T = x.shape[:2]
    packed = doc is not None
    doc = torch.zeros(B, T, dtype=torch.long) if doc is None else doc
    positions = torch.zeros_like(doc)
    ctx = ForwardContext(doc, positions, packed=packed, decoding=state is not None, derived=True, window=None)
    return conv(x, ctx, state)


def packed_segments(B: int, T: int, cuts: list[int]) -> torch.Tensor:
    seg = torch.zeros(B, T, dtype=torch.long)
    for i, c in enumerate(cuts):
        seg[:, c:] = i + 1
    return seg


@KERNELS
@pytest.mark.parametrize("train_mode", [False, True])
def test_causal_with_packed_segments(train_mode, kernels):
    """Changing tokens at or after t0 never changes logits before t0 (train mode: with capacity)."""
    config = tiny_config(attention={"sliding_window": 8})
    model = build(config, kernels=kernels)
    randomize_identity_inits(model)
    model.train(train_mode)
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, 40))
    seg = packed_segments(2, 40, [13, 27])
    base = model(ids, seg).logits
    for t0 in (5, 13, 20, 39):
        changed = ids.clone()
        changed[:, t0:] = torch.randint(0, config.vocab_size, changed[:, t0:].shape)
        out = model(changed, seg).logits
        torch.testing.assert_close(out[:, :t0], base[:, :t0], rtol=0, atol=1e-5)


@KERNELS
def test_packed_document_equals_document_alone(kernels):
    """Attention, SConv and positions restart at a boundary: doc B packed after doc A == doc B alone."""
    config = tiny_config(attention={"sliding_window": 6})
    model = build(config, kernels=kernels).eval()
    randomize_identity_inits(model)
    torch.manual_seed(1)
    doc_a = torch.randint(0, config.vocab_size, (1, 17))
    doc_b = torch.randint(0, config.vocab_size, (1, 23))
    packed = torch.cat([doc_a, doc_b], dim=1)
    seg = packed_segments(1, 40, [17])
    logits = model(packed, seg).logits
    torch.testing.assert_close(logits[:, 17:], model(doc_b).logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits[:, :17], model(doc_a).logits, rtol=1e-4, atol=1e-5)


def naive_attention(q, k, v, segment_ids, window):
    """Loops over every (batch, head, query): softmax over the keys the rules allow."""
    B, H, T, Dh = q.shape
    group = H // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                allowed = []
                for s in range(t + 1):
                    same_doc = bool((segment_ids[b, s : t + 1] == segment_ids[b, t]).all())
                    if same_doc and (window is None or t - s < window):
                        allowed.append(s)
                kh = k[b, h // group, allowed]
                scores = kh @ q[b, h, t] / math.sqrt(Dh)
                out[b, h, t] = torch.softmax(scores, 0) @ v[b, h // group, allowed]
    return out


@pytest.mark.parametrize("window", [None, 1, 4])
def test_masked_sdpa_matches_naive_reference(window):
    torch.manual_seed(2)
    B, H, K, T, Dh = 2, 4, 2, 19, 8
    q, k, v = torch.randn(B, H, T, Dh), torch.randn(B, K, T, Dh), torch.randn(B, K, T, Dh)
    seg = torch.tensor([[0] * 7 + [1] * 5 + [2] * 7, [5] * 10 + [3] * 9])
    doc, pos = doc_ids_and_positions(seg)
    mask = attention_mask(doc, pos, doc, pos, window)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, naive_attention(q, k, v, seg, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 5, 16, 37])  # shorter than a block, whole blocks, a part-filled last block
@pytest.mark.parametrize("window, block", [(1, 4), (3, 8), (8, 8), (20, 8)])
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("packed", [True, False])
def test_banded_attention_equals_the_whole_row_masked_sdpa(T, window, block, kv_heads, packed):
    """Outputs and all three input gradients, in float64, with packed documents and without
    (the model's doc ids are then all 0)."""
    gen = torch.Generator().manual_seed(T * 100 + window * 10 + block + kv_heads)
    B, H, Dh = 2, 4, 8
    q, k, v = (
        torch.randn(B, n, T, Dh, generator=gen, dtype=torch.float64).requires_grad_() for n in (H, kv_heads, kv_heads)
    )
    seg = torch.cumsum(torch.rand(B, T, generator=gen) < 0.15, dim=1)
    if packed:
        doc, pos = doc_ids_and_positions(seg)
    else:
        doc, pos = torch.zeros(B, T, dtype=torch.long), torch.arange(T).expand(B, T)
    want = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attention_mask(doc, pos, doc, pos, window), enable_gqa=True
    )
    mask = banded_mask(doc, pos, window, block)
    # Every softmax row has a key, the padding queries' too: some kernels (kernels/cpu_attention.py)
    # turn an empty row into NaN, which the backward would carry into dK and dV.
    assert mask.allowed_X1QS.any(-1).all()
    got = banded_attention(q, k, v, mask)
    dy = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dy), torch.autograd.grad(want, (q, k, v), dy)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    if T == 37 and window == 3 and kv_heads == 2 and packed:
        torch.testing.assert_close(got.float(), naive_attention(q.float(), k.float(), v.float(), seg, window))


def test_banded_attention_is_taken_where_cheaper_and_matches_the_model_without_it(monkeypatch):
    """Blocks for long rows on CPU (the sizes measured fastest in `band_block`); the model's logits
    and gradients equal those of one masked SDPA per row."""
    import marinlm.kernels.attention as attention

    cpu = torch.device("cpu")
    assert [band_block(T, w, cpu) for T, w in [(256, 64), (1024, 256), (4096, 2048)]] == [32, 64, 256]
    assert band_block(64, 64, cpu) is None and band_block(256, 64, torch.device("meta")) is None
    config = tiny_config(attention={"sliding_window": 8})
    model = build(config, kernels=True)
    randomize_identity_inits(model)
    ids = torch.randint(0, config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(3))
    seg = packed_segments(2, 70, [9, 41])

    def run():
        model.zero_grad()
        logits = model(ids, seg).logits
        logits.square().mean().backward()
        return logits, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    calls = []
    monkeypatch.setattr(attention, "banded_attention", lambda *a: calls.append(1) or banded_attention(*a))
    banded = run()
    assert len(calls) == 3  # tiny's three local layers
    monkeypatch.setattr(attention, "band_block", lambda *a: None)
    whole_row = run()
    assert len(calls) == 3
    torch.testing.assert_close(banded[0], whole_row[0], rtol=1e-5, atol=1e-5)
    for g, w in zip(banded[1], whole_row[1]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_positions_restart_and_repeated_ids_are_new_documents():
    seg = torch.tensor([[7, 7, 7, 2, 2, 7, 7]])
    doc, pos = doc_ids_and_positions(seg)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert doc.tolist() == [[1, 1, 1, 2, 2, 3, 3]]


@SCONVS
def test_sconv_matches_naive_and_never_mixes_documents(sconv_class):
    torch.manual_seed(3)
    conv = sconv_class(channels=5, kernel_size=4)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(4, 5))
    x = torch.randn(2, 12, 5)
    seg = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12])
    doc, _ = doc_ids_and_positions(seg)
    y, _ = sconv(conv, x, doc)
    expected = torch.zeros_like(x)
    for b in range(2):
        for t in range(12):
            for lag in range(4):
                if t - lag >= 0 and seg[b, t - lag] == seg[b, t]:
                    expected[b, t] += conv.weight[lag] * x[b, t - lag]
    torch.testing.assert_close(y, expected)
    # Perturbing document 0 leaves documents 1 and 2 untouched.
    x2 = x.clone()
    x2[0, :5] += 100.0
    y2, _ = sconv(conv, x2, doc)
    torch.testing.assert_close(y2[0, 5:], y[0, 5:])


@pytest.mark.parametrize("T", [2, 9])
@pytest.mark.parametrize("with_docs", [False, True])
@SCONVS
def test_sconv_gradients_pass_gradcheck(T, with_docs, sconv_class):
    """The backward of SConv (fp64 gradcheck), taps across document starts included."""
    torch.manual_seed(7)
    conv = sconv_class(channels=3, kernel_size=4).double()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(4, 3))
    x = torch.randn(2, T, 3, dtype=torch.float64, requires_grad=True)
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2][:T], [5] * T])
    doc = doc_ids_and_positions(seg)[0] if with_docs else None
    assert torch.autograd.gradcheck(lambda x, w: sconv(conv, x, doc)[0], (x, conv.weight))
    conv.weight.requires_grad_(False)  # frozen, as in fine-tuning: dx alone
    assert torch.autograd.gradcheck(lambda x: sconv(conv, x, doc)[0], (x,))
    assert conv.weight.grad is None


@pytest.mark.parametrize("with_docs", [False, True])
@SCONVS
def test_sconv_on_sequences_shorter_than_its_kernel(with_docs, sconv_class):
    """T < kernel_size: the output is the first T outputs of a longer sequence (it used to crash)."""
    torch.manual_seed(5)
    conv = sconv_class(channels=3, kernel_size=4)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(4, 3))
    x = torch.randn(2, 6, 3)
    doc = torch.ones(2, 6, dtype=torch.long) if with_docs else None
    full, _ = sconv(conv, x, doc)
    for T in (1, 2, 3):
        y, _ = sconv(conv, x[:, :T], None if doc is None else doc[:, :T])
        torch.testing.assert_close(y, full[:, :T])


def test_model_forward_on_one_to_three_tokens():
    """Inputs shorter than the SConv kernel (a one-word bits-per-byte text) give the full forward's prefix."""
    config = tiny_config()
    model = build(config).eval()
    randomize_identity_inits(model)
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(6))
    full = model(ids).logits
    for T in (1, 2, 3):
        torch.testing.assert_close(model(ids[:, :T]).logits, full[:, :T], rtol=1e-4, atol=1e-5)


@SCONVS
def test_sconv_incremental_state_matches_full(sconv_class):
    torch.manual_seed(4)
    conv = sconv_class(channels=3, kernel_size=4)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(4, 3))
    x = torch.randn(2, 9, 3)
    doc = torch.tensor([[1] * 9, [0, 0, 1, 1, 1, 1, 1, 1, 1]])
    full, _ = sconv(conv, x, doc)
    state = conv.empty_state(2, "cpu", torch.float32)
    pieces = []
    for chunk in (slice(0, 4), slice(4, 5), slice(5, 9)):
        y, state = sconv(conv, x[:, chunk], doc[:, chunk], state)
        pieces.append(y)
    torch.testing.assert_close(torch.cat(pieces, 1), full)


def test_init_follows_the_spec():
    config = load_config(MarinConfig, CONFIGS / "model" / "small.yaml")
    model = build(config, seed=0)
    for name, p in model.named_parameters():
        if name.endswith("attn.gate.weight"):
            assert torch.all(p == 0), name
        elif "sconv" in name:
            assert torch.all(p[0] == 1) and torch.all(p[1:] == 0), name
        elif p.ndim == 1:
            assert torch.all(p == 1), name  # RMSNorm gains
        else:
            assert p.abs().max() <= 3 * config.init_std + 1e-7, name
            if p.numel() > 10_000:
                # a normal cut at +-3 std has std 0.9866 * std
                assert abs(p.std().item() - 0.9866 * config.init_std) < 0.05 * config.init_std, name
    for name, b in model.named_buffers():
        if name.endswith("router.bias"):
            assert torch.all(b == 0)


def test_meta_init_is_deterministic():
    a, b = build(tiny_config(), seed=5), build(tiny_config(), seed=5)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


@KERNELS
def test_bf16_autocast_forward_backward_is_finite(kernels):
    config = tiny_config()
    model = build(config, kernels=kernels)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, packed_segments(2, 24, [10]), labels=ids)
    assert out.logits.dtype == torch.bfloat16
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.dtype == torch.float32  # master weights stay fp32


def test_loss_terms_and_ignore_index():
    config = tiny_config()
    model = build(config)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = ids.clone()
    labels[:, 8:] = -100
    out = model(ids, labels=labels)
    logits = out.logits.float()
    ce = F.cross_entropy(logits[:, :8].reshape(-1, config.vocab_size), ids[:, :8].reshape(-1))
    z = config.z_loss_weight * torch.logsumexp(logits[:, :8], -1).pow(2).mean()
    torch.testing.assert_close(out.ce_loss, ce)
    torch.testing.assert_close(out.z_loss, z)
    torch.testing.assert_close(out.loss, ce + z)
    assert out.num_tokens == 16
    assert math.isclose(out.ce_loss.item(), math.log(config.vocab_size), rel_tol=0.1)  # near uniform at init


def test_fused_loss_chunks_grow_on_accelerators_up_to_the_memory_of_marins():
    """On GPUs a chunk may hold 512 MiB of fp32 logits, about what 1,024 tokens take at Marin's 128k
    vocabulary (each chunk costs the same kernel launches); on CPU the configured chunk stays."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert chunk_tokens(1024, 16384, cpu) == 1024
    assert chunk_tokens(1024, 16384, gpu) == 8192  # bench/train_step.py's 16 x 1,024 tokens: 2 chunks, not 16
    assert chunk_tokens(1024, 128256, gpu) == 1046
    assert chunk_tokens(4096, 128256, gpu) == 4096  # a larger setting is kept


@KERNELS
@pytest.mark.parametrize("tied, vocab_rows", [(False, None), (True, None), (False, 37)])
def test_fused_chunked_loss_matches_materialised_logits(tied, vocab_rows, kernels, monkeypatch):
    """The training path (return_logits=False) fuses LM head and loss in chunks; values and every
    gradient must equal the materialised-logits path, with ignored labels, a z-loss and a last
    chunk shorter than the rest; also with the vocabulary in blocks of 37 rows (the last one
    shorter), so that labels fall in every block."""
    if vocab_rows is not None:
        monkeypatch.setattr("marinlm.kernels.loss.vocab_block_rows", lambda vocab, tokens, device: vocab_rows)
    config = tiny_config(tie_embeddings=tied, z_loss_weight=1e-2)
    ids = torch.randint(0, config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, 1)
    labels[0, 5:9] = labels[2, -1] = -100
    results = []
    for return_logits in (True, False):
        model = build(config, kernels=kernels, loss_chunk_tokens=7)
        out = model(ids, labels=labels, return_logits=return_logits)
        assert (out.logits is None) != return_logits
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((out, grads))
    (ref, ref_grads), (fused, fused_grads) = results
    assert fused.num_tokens == ref.num_tokens == 3 * 16 - 5
    assert fused.z_loss.item() > 1e-3  # the z-loss term is really exercised
    for name in ("loss", "lm_loss", "ce_loss", "z_loss", "aux_loss"):
        torch.testing.assert_close(getattr(fused, name), getattr(ref, name), rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # evaluation: chunked loss alone, no gradient work
        plain = build(config, kernels=kernels, loss_chunk_tokens=7)(ids, labels=labels, return_logits=False)
    torch.testing.assert_close(plain.lm_loss, ref.lm_loss, rtol=1e-5, atol=1e-6)
    # Each token's cross-entropy, for scoring: from the pass without a gradient and from the
    # materialised logits alike; 0 at ignored labels; the fused kernel's training pass never forms
    # them.
    logp = torch.log_softmax(ref.logits.detach().float(), -1)
    want = -logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1) * (labels != -100)
    for out in (plain, ref):
        torch.testing.assert_close(out.token_ce.detach(), want, rtol=1e-5, atol=1e-5)
    assert (fused.token_ce is None) == kernels


def test_fused_loss_with_logits_far_apart_across_vocabulary_blocks(monkeypatch):
    """Each vocabulary block is exponentiated against the running max at that block and rescaled
    to the softmax in the backward pass. With logits tens of nats apart, where the max jumps from
    block to block (and exp(logit - final max) underflows in the early blocks), the loss and both
    gradients must still equal an fp64 reference, z-loss included."""
    monkeypatch.setattr("marinlm.kernels.loss.vocab_block_rows", lambda vocab, tokens, device: 16)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(9, 8, generator=gen).requires_grad_()
    # Rows of W grow along the vocabulary, so later blocks hold logits up to ~100 nats larger.
    w = (torch.randn(80, 8, generator=gen) * torch.linspace(0.1, 8.0, 80).unsqueeze(1)).requires_grad_()
    labels = torch.tensor([0, 5, 17, 40, 79, 63, -100, 2, 31])
    loss = fused_chunked_loss(h, w, labels, z_weight=1e-4, chunk=4)[0]
    grads = torch.autograd.grad(loss, (h, w))
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits = h64 @ w64.t()
    assert (logits.amax(1) - logits.amin(1)).min() > 40  # far apart indeed
    keep = labels != -100
    ref = F.cross_entropy(logits[keep], labels[keep]) + 1e-4 * torch.logsumexp(logits[keep], 1).square().mean()
    ref_grads = torch.autograd.grad(ref, (h64, w64))
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def test_fused_loss_backward_twice_scaled_and_with_the_weight_used_twice():
    """The fused loss hands back its kept gradients as they are when the loss itself is
    differentiated (no pass over dW). A second backward over a retained graph, a scaled loss and a
    weight used elsewhere too (tied embeddings) must still give the exact gradients: autograd
    must not accumulate into, or hand out, the kept tensors."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(9, 8, generator=gen).requires_grad_()
    w = torch.randn(40, 8, generator=gen).requires_grad_()
    labels = torch.tensor([0, 5, 17, 39, 21, -100, 2, 31, 11])
    loss = fused_chunked_loss(h, w, labels, z_weight=1e-4, chunk=4)[0]
    want = [g.clone() for g in torch.autograd.grad(loss, (h, w), retain_graph=True)]
    # Twice over the retained graph, and with the weight also used elsewhere.
    total = loss + (3 * w).sum()
    total.backward(retain_graph=True)
    total.backward(retain_graph=True)
    torch.testing.assert_close(h.grad, 2 * want[0], rtol=0, atol=0)
    torch.testing.assert_close(w.grad, 2 * (want[1] + 3), rtol=1e-6, atol=1e-6)
    for got, ref in zip(torch.autograd.grad(0.5 * loss, (h, w), retain_graph=True), want):
        torch.testing.assert_close(got, 0.5 * ref, rtol=0, atol=0)
    for got, ref in zip(torch.autograd.grad(loss, (h, w)), want):  # the kept gradients are unchanged
        assert torch.equal(got, ref)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("chunk", [9, 4])  # one chunk; several, the last one shorter
def test_fused_loss_never_reads_uninitialised_buffers(bf16, chunk, monkeypatch):
    """The fused loss allocates its buffers with torch.empty and must write every element before
    reading it (the first chunk writes dW, later ones add to it). With every torch.empty and
    empty_like filled with NaN, loss and gradients must equal those of a normal run bit for bit."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(9, 8, generator=gen).requires_grad_()
    w = torch.randn(40, 8, generator=gen).requires_grad_()
    labels = torch.tensor([0, 5, 17, 39, 21, -100, 2, 31, 11])
    monkeypatch.setattr("marinlm.kernels.loss.vocab_block_rows", lambda vocab, tokens, device: 16)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = fused_chunked_loss(h, w, labels, z_weight=1e-4, chunk=chunk)[0]
        return (loss, *torch.autograd.grad(loss, (h, w)))

    want = run()
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))
    for got, ref in zip(run(), want):
        assert torch.equal(got, ref)


@KERNELS
def test_fused_chunked_loss_under_bf16_autocast(kernels):
    config = tiny_config()
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    for return_logits in (True, False):
        model = build(config, kernels=kernels, loss_chunk_tokens=5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(ids, labels=ids, return_logits=return_logits)
        out.loss.backward()
        assert all(torch.isfinite(p.grad).all() and p.grad.dtype == torch.float32 for p in model.parameters())
        losses.append(out.loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=2e-2)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_embeddings": True},
        {"moe": {"first_k_dense": 1, "dense_ffn_dim": 96}},
        {"moe": {"router": {"type": "aux_free"}}},
        {"moe": {"router": {"type": "softmax_topk"}}, "attention": {"qk_norm_gain": True}},
        {"moe": {"latent_dim": None, "num_shared_experts": 0, "capacity_factor": None}},
        {"attention": {"sliding_window": None, "xsa": False, "head_gate": False}, "sconv": {"sites": []}},
    ],
)
@KERNELS
def test_variants_train(overrides, kernels):
    config = tiny_config(**overrides)
    model = build(config, kernels=kernels)
    ids = torch.randint(0, config.vocab_size, (2, 20))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert len(out.router_stats) == config.num_moe_layers
    if config.tie_embeddings:
        assert model.lm_head.weight is model.embed.weight
    if "softmax_topk" in str(overrides):
        assert out.aux_loss > 0


def test_hero_preset_parameter_count_on_meta():
    config = load_config(MarinConfig, CONFIGS / "model" / "marin-535b-a23b.yaml")
    s = summarize(config)
    assert abs(s.total - 535.3e9) / 535.3e9 < 0.005, s.total
    assert abs(s.active - 22.76e9) / 22.76e9 < 0.02, s.active
    per_layer = {k: v / 48 for k, v in s.total_by_component.items()}
    assert per_layer["attention"] == 2 * 6144 * 6144 + 2 * 6144 * 1536 + 6144 * 48  # 94.66M
    assert per_layer["router"] == 6144 * 384
    assert per_layer["latent"] == 2 * 6144 * 3072 + 3072 / 48 * 48  # + latent RMSNorm gain
    assert per_layer["routed_experts"] == 384 * 3 * 3072 * 3072
    assert per_layer["shared_experts"] == 2 * 3 * 6144 * 3072
    assert s.total_by_component["embedding"] == s.total_by_component["lm_head"] == 128256 * 6144
    assert [i + 1 for i in range(48) if config.is_global_layer(i)] == list(range(4, 49, 4))


def test_model_package_has_no_distributed_code():
    """model/ neither imports nor touches torch.distributed (parallel/ applies sharding)."""
    for path in (ROOT / "src" / "marinlm" / "model").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [ast.unparse(node)]
            else:
                continue
            assert not any("torch.distributed" in n for n in names), (path, names)
            # nor anything of the layers built on it: the model is what they train, evaluate and shard
            upward = ("marinlm.train", "marinlm.data", "marinlm.eval", "marinlm.parallel", "marinlm.kernels")
            assert not any(n.startswith(upward) for n in names), (path, names)


def test_the_reference_model_reads_in_one_sitting():
    """model/ is plain torch: at most ~2,050 lines (2,000 before Marin's capacity rule), no file
    over 500, no custom autograd, and no module-level state (caches live in the per-forward
    context); fast paths live in kernels/."""
    files = sorted((ROOT / "src" / "marinlm" / "model").rglob("*.py"))
    lines = {path.name: len(path.read_text().splitlines()) for path in files}
    assert sum(lines.values()) <= 2050 and max(lines.values()) <= 500, lines
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert not any("autograd.Function" in b for b in bases), (path.name, node.name)
            if isinstance(node, ast.Attribute):
                assert ast.unparse(node) not in ("torch.library.custom_op", "torch.autograd.Function"), path.name
        for node in tree.body:  # module level: constants only, never a mutable container or object
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and "__all__" not in ast.unparse(node):
                value = node.value
                assert isinstance(value, (ast.Constant, ast.UnaryOp, ast.Tuple, ast.BinOp, ast.Subscript)), (
                    path.name,
                    ast.unparse(node),
                )


@pytest.mark.slow
def test_the_reference_model_compiles_in_fp32():
    """`kernels.experts: auto` picks grouped_mm for fp32 in eager on a CPU, but torch.compile's grouped_mm
    takes bf16 only: compiled blocks of the reference model in fp32 failed at trace time (also LoRA
    fine-tuning with `parallel.compile`). Compiled, they give eager's loss and gradients. The
    failure was in tracing, which AOTAutograd does as inductor does, without building kernels."""
    config = tiny_config(num_layers=2)
    eager, compiled = build(config, seed=0), build(config, seed=0)
    for block in compiled.layers:
        block.compile(backend="aot_eager")
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (eager, compiled):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
