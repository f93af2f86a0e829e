from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from marinlm.config import ConfigError
from marinlm.model import SamplingConfig, generate
from marinlm.model.generate import filter_logits, penalize_repeats

from conftest import build, randomize_identity_inits, tiny_config


def test_cache_decoding_matches_full_forward():
    """Prefill then one token at a time through the KV cache (window 6 < length, so the local
    caches trim) gives the logits of one full forward, for a left-padded batch."""
    config = tiny_config(attention={"sliding_window": 6})
    model = build(config).eval()
    randomize_identity_inits(model)
    torch.manual_seed(0)
    seqs = [torch.randint(0, config.vocab_size, (n,)) for n in (21, 15)]
    prompt_len = [9, 5]
    pad = max(prompt_len) - min(prompt_len)
    prompts = torch.zeros(2, max(prompt_len), dtype=torch.long)
    mask = torch.zeros_like(prompts)
    for i, (s, p) in enumerate(zip(seqs, prompt_len)):
        prompts[i, -p:] = s[:p]
        mask[i, -p:] = 1
    doc = mask.clone()
    pos = torch.where(mask.bool(), mask.cumsum(1) - 1, torch.arange(prompts.shape[1]))
    caches = model.empty_caches(2)
    with torch.no_grad():
        step_logits = [model(prompts, caches=caches, doc_ids=doc, positions=pos).logits[:, -1]]
        next_pos = mask.sum(1, keepdim=True)
        for t in range(6):
            token = torch.stack([s[p + t] for s, p in zip(seqs, prompt_len)]).unsqueeze(1)
            out = model(token, caches=caches, doc_ids=torch.ones_like(token), positions=next_pos)
            step_logits.append(out.logits[:, -1])
            next_pos = next_pos + 1
        for i, (s, p) in enumerate(zip(seqs, prompt_len)):
            full = model(s[: p + 6].unsqueeze(0)).logits[0, p - 1 :]
            got = torch.stack([lg[i] for lg in step_logits])
            torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
    assert pad == 4
    assert caches[0].k_BKSD.shape[2] == 6  # local layer trimmed to the window
    assert caches[-1].k_BKSD.shape[2] == max(prompt_len) + 6  # global layer keeps everything


def test_prefill_computes_the_next_token_logits_only():
    """The prompt's forward in generation needs the last position's logits, not [B, T, V]."""
    config = tiny_config()
    model = build(config).eval()
    randomize_identity_inits(model)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        last = model(ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, config.vocab_size)
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, labels=ids, logits_to_keep=1)

    positions = []
    model.lm_head.register_forward_pre_hook(lambda module, args: positions.append(args[0].shape[1]))
    out = generate(model, ids, SamplingConfig(max_new_tokens=3, temperature=0))
    assert out.shape == (2, 15)
    assert positions == [1, 1, 1]  # the prefill, then two decoding steps


def test_generate_greedy_is_deterministic_and_stops_at_eos():
    config = tiny_config()
    model = build(config)
    prompt = torch.randint(0, config.vocab_size, (1, 7))
    a = generate(model, prompt, SamplingConfig(max_new_tokens=8, temperature=0))
    b = generate(model, prompt, SamplingConfig(max_new_tokens=8, temperature=0))
    assert torch.equal(a, b) and a.shape == (1, 15)
    eos = int(a[0, 7])
    stopped = generate(model, prompt, SamplingConfig(max_new_tokens=8, temperature=0), eos_token_id=eos)
    assert stopped.shape == (1, 8)
    assert model.training  # generate restores the mode


def test_sampling_with_seed_is_reproducible():
    config = tiny_config()
    model = build(config)
    prompt = torch.randint(0, config.vocab_size, (2, 5))
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.8, top_k=50, top_p=0.9, seed=3)
    assert torch.equal(generate(model, prompt, sampling), generate(model, prompt, sampling))


@pytest.mark.slow
def test_generation_produces_only_ids_below_the_vocab_size_it_is_given():
    """A model's vocabulary padded past its tokenizer's (qwen3-moe-style's 16,384 rows over a
    4,096-token tokenizer) sampled 152 of 200 ids the tokenizer cannot decode."""
    config = tiny_config()
    model = build(config)
    randomize_identity_inits(model)
    prompt = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(0))
    for sampling in (
        SamplingConfig(max_new_tokens=40, temperature=1.0, seed=0),
        SamplingConfig(max_new_tokens=40, temperature=0.9, top_k=100, top_p=0.95, repetition_penalty=1.3, seed=0),
    ):
        assert (generate(model, prompt, sampling)[:, 5:] >= 40).any()
        assert generate(model, prompt, sampling, vocab_size=40)[:, 5:].max() < 40


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, 1.0, 2, 1.0))
    assert kept.tolist() == [[True, True, False, False]]
    kept = torch.isfinite(filter_logits(logits, 1.0, 0, 0.7))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7, 0.8 >= 0.7
    kept = torch.isfinite(filter_logits(logits, 1.0, 0, 0.4))
    assert kept.tolist() == [[True, False, False, False]]
    kept = torch.isfinite(filter_logits(logits, 1.0, 0, 0.0))
    assert kept.tolist() == [[True, False, False, False]]  # never an empty nucleus (NaN probabilities)


def test_repetition_penalty_is_transformers_repetition_penalty():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    logits, input_ids = torch.randn(3, 50), torch.randint(0, 50, (3, 12))
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, input_ids, True)
    expected = transformers.RepetitionPenaltyLogitsProcessor(1.3)(input_ids, logits.clone())
    torch.testing.assert_close(penalize_repeats(logits, seen, 1.3), expected)


def test_penalized_decoding_matches_a_full_forward_reference():
    """Greedy decoding through the cache with a repetition penalty, for a left-padded batch, picks
    what a full forward over the real tokens with transformers' penalty picks at every step: the
    padding is not counted as seen, and each new token is."""
    transformers = pytest.importorskip("transformers")
    config = tiny_config(vocab_size=64)  # small enough that plain greedy decoding repeats a token
    model = build(config).eval()
    randomize_identity_inits(model)
    torch.manual_seed(1)
    real = [torch.randint(0, config.vocab_size, (n,)) for n in (7, 4)]
    sampling = SamplingConfig(max_new_tokens=10, temperature=0, repetition_penalty=3.0)
    # Pad with the token the short prompt alone is continued with (not one of its own): were padding
    # counted as seen, the penalty would turn that choice down.
    pad = int(generate(model, real[1][None], replace(sampling, max_new_tokens=1))[0, -1])
    assert pad not in real[1].tolist()
    prompts, mask = torch.full((2, 7), pad), torch.zeros(2, 7, dtype=torch.long)
    for i, r in enumerate(real):
        prompts[i, -len(r) :], mask[i, -len(r) :] = r, 1
    got = generate(model, prompts, sampling, attention_mask=mask)[:, 7:]
    penalty = transformers.RepetitionPenaltyLogitsProcessor(3.0)
    with torch.no_grad():
        for i, seq in enumerate(real):
            seq = seq.unsqueeze(0)
            for _ in range(10):
                logits = penalty(seq, model(seq).logits[:, -1].float())
                seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
            assert got[i].tolist() == seq[0, -10:].tolist()
    plain = generate(model, prompts, SamplingConfig(max_new_tokens=10, temperature=0), attention_mask=mask)[:, 7:]
    assert not torch.equal(plain, got)  # the penalty changed what was picked


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", -1),
        ("temperature", -0.5),
        ("top_k", -3),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("repetition_penalty", 0.0),
    ],
)
def test_bad_sampling_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=field) as info:
        SamplingConfig(**{field: value})
    assert info.value.key == field
