"""State-dict adapter between MarinForCausalLM and HF transformers' Qwen3MoeForCausalLM.

Only the plain Qwen3-MoE subset of our configs maps onto HF's model: softmax top-k routing,
full RoPE on every layer, learned QK-norm gains, no latent, SConv, XSA, head gate, GatedNorm,
shared experts or sliding windows. `check_qwen3_compatible` names the first field that is not.
Tensor layouts: HF stores experts as gate_up_proj [E, 2F, D] and down_proj [E, D, F]; we store
gate_proj/up_proj [E, D, F] and down_proj [E, F, D] (x @ W).
"""

from __future__ import annotations

import torch

from marinlm.model.config import MarinConfig, SoftmaxTopKRouterConfig


def check_qwen3_compatible(config: MarinConfig) -> None:
    a, m = config.attention, config.moe
    requirements = {
        "gated_norm_rank": config.gated_norm_rank == 0,
        "embed_norm": not config.embed_norm,
        "z_loss_weight": config.z_loss_weight == 0,
        "attention.sliding_window": a.sliding_window is None,
        "attention.num_global_kv_heads": a.num_global_kv_heads in (None, a.num_kv_heads),
        "attention.qk_norm": a.qk_norm and a.qk_norm_gain,
        "attention.qk_mult": a.qk_mult == 1.0,
        "attention.rope_fraction": a.rope_fraction == 1.0 and a.rope_local and a.rope_global,
        "attention.xsa": not a.xsa,
        "attention.head_gate": not a.head_gate,
        "moe.latent_dim": m.latent_dim is None,
        "moe.num_shared_experts": m.num_shared_experts == 0,
        "moe.first_k_dense": m.first_k_dense == 0,
        "moe.capacity_factor": m.capacity_factor is None,
        "moe.router": isinstance(m.router, SoftmaxTopKRouterConfig),
        "sconv.sites": not config.sconv.sites,
    }
    for key, ok in requirements.items():
        if not ok:
            raise ValueError(f"{key}: this setting has no Qwen3-MoE equivalent in HF transformers")


def qwen3_moe_hf_config(config: MarinConfig):
    """The transformers.Qwen3MoeConfig with the same architecture."""
    from transformers import Qwen3MoeConfig

    check_qwen3_compatible(config)
    a, m = config.attention, config.moe
    return Qwen3MoeConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=m.expert_dim,  # unused: every layer is sparse
        moe_intermediate_size=m.expert_dim,
        num_experts=m.num_experts,
        num_experts_per_tok=m.top_k,
        num_hidden_layers=config.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        max_position_embeddings=config.max_seq_len,
        rope_theta=a.rope_theta,
        rms_norm_eps=config.norm_eps,
        norm_topk_prob=m.router.normalize_topk,
        router_aux_loss_coef=m.router.aux_loss_weight,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        initializer_range=config.init_std,
    )


def _direct_names(config: MarinConfig) -> list[tuple[str, str]]:
    """(our name, HF name) for every tensor that maps one to one; the experts are handled apart."""
    pairs = [("embed.weight", "model.embed_tokens.weight"), ("final_norm.weight", "model.norm.weight")]
    pairs.append(("lm_head.weight", "lm_head.weight"))
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        pairs += [
            (f"{ours}attn.{n}.weight", f"{hf}self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        ]
        pairs += [
            (f"{ours}attn.q_norm_weight", f"{hf}self_attn.q_norm.weight"),
            (f"{ours}attn.k_norm_weight", f"{hf}self_attn.k_norm.weight"),
            (f"{ours}attn_norm.weight", f"{hf}input_layernorm.weight"),
            (f"{ours}mlp_norm.weight", f"{hf}post_attention_layernorm.weight"),
            (f"{ours}mlp.router.weight", f"{hf}mlp.gate.weight"),
        ]
    return pairs


def to_hf_state_dict(state: dict[str, torch.Tensor], config: MarinConfig) -> dict[str, torch.Tensor]:
    check_qwen3_compatible(config)
    out = {hf: state[ours] for ours, hf in _direct_names(config)}
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.mlp.experts.", f"model.layers.{i}.mlp.experts."
        gate_up = torch.cat([state[f"{ours}gate_proj"], state[f"{ours}up_proj"]], dim=2)  # [E, D, 2F]
        out[f"{hf}gate_up_proj"] = gate_up.transpose(1, 2).contiguous()
        out[f"{hf}down_proj"] = state[f"{ours}down_proj"].transpose(1, 2).contiguous()
    return out


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], config: MarinConfig) -> dict[str, torch.Tensor]:
    check_qwen3_compatible(config)
    hf_state = dict(hf_state)
    hf_state.setdefault("lm_head.weight", hf_state["model.embed_tokens.weight"])  # tied checkpoints
    out = {ours: hf_state[hf] for ours, hf in _direct_names(config)}
    F = config.moe.expert_dim
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.mlp.", f"model.layers.{i}.mlp.experts."
        out[f"{ours}router.bias"] = torch.zeros(config.moe.num_experts)
        gate_up = hf_state[f"{hf}gate_up_proj"].transpose(1, 2)  # [E, D, 2F]
        out[f"{ours}experts.gate_proj"] = gate_up[..., :F].contiguous()
        out[f"{ours}experts.up_proj"] = gate_up[..., F:].contiguous()
        out[f"{ours}experts.down_proj"] = hf_state[f"{hf}down_proj"].transpose(1, 2).contiguous()
    return out
