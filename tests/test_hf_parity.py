from __future__ import annotations

import pytest
import torch

from marinlm.config import load_config
from marinlm.hf.qwen3_moe import check_qwen3_compatible, from_hf_state_dict, qwen3_moe_hf_config, to_hf_state_dict
from marinlm.model import MarinConfig

from conftest import CONFIGS, build

transformers = pytest.importorskip("transformers")


def small_qwen_config() -> MarinConfig:
    return load_config(
        MarinConfig,
        CONFIGS / "model" / "qwen3-moe-style.yaml",
        ["--vocab_size=512", "--d_model=64", "--num_layers=2", "--moe.expert_dim=32", "--moe.num_experts=8"],
    )


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "kernels"])
def test_qwen3_style_matches_hf_logits(kernels):
    """Our qwen3-moe-style model and HF Qwen3MoeForCausalLM compute the same function, on the
    reference model and with the kernels swapped in."""
    config = small_qwen_config()
    ours = build(config, seed=0, kernels=kernels).eval()
    hf = transformers.Qwen3MoeForCausalLM(qwen3_moe_hf_config(config)).eval()
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), config))
    ids = torch.randint(0, config.vocab_size, (2, 33))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, rtol=1e-4, atol=1e-5)
    # and the loss with a gradient, where the kernels take their training paths (eval mode: no
    # capacity drops, which HF does not have)
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    out = ours(ids, labels=labels, return_logits=False)
    hf_loss = hf(ids, labels=ids).loss  # HF shifts the labels itself
    torch.testing.assert_close(out.ce_loss, hf_loss, rtol=1e-5, atol=1e-6)
    # and back again
    again = build(config, seed=1)
    again.load_state_dict(from_hf_state_dict(hf.state_dict(), config))
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, msg=name)


def test_marin_features_are_refused_with_the_key():
    config = load_config(MarinConfig, CONFIGS / "model" / "tiny.yaml")
    with pytest.raises(ValueError, match="gated_norm_rank"):
        check_qwen3_compatible(config)
