"""State-dict adapter between MarinForCausalLM and HF transformers' Qwen3MoeForCausalLM / MixtralForCausalLM.

Only the plain subset of our configs maps onto HF's models: softmax top-k routing, full RoPE on
every layer, no latent, SConv, XSA, head gate, GatedNorm, shared experts or sliding windows; with
learned QK-norm gains it is Qwen3-MoE, with no QK-norm (and renormalised top-k) Mixtral, which
has the same layout without q_norm/k_norm. `native_family` names the first field that fits neither.
Tensor layouts: HF stores experts as gate_up_proj [E, 2F, D] and down_proj [E, D, F]; we store
gate_proj/up_proj [E, D, F] and down_proj [E, F, D] (x @ W).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from marinlm.model.config import MarinConfig, SoftmaxTopKRouterConfig


def native_family(config: MarinConfig) -> str:
    """ "qwen3_moe" or "mixtral": the transformers class that computes exactly this config's model."""
    a, m = config.attention, config.moe
    if not a.qk_norm and not a.qk_norm_gain:
        _check_plain(config, "Mixtral")
        if isinstance(m.router, SoftmaxTopKRouterConfig) and not m.router.normalize_topk:
            raise ValueError("moe.router.normalize_topk: Mixtral renormalises its top-k weights; set it true")
        return "mixtral"
    check_qwen3_compatible(config)
    return "qwen3_moe"


def check_qwen3_compatible(config: MarinConfig) -> None:
    _check_plain(config, "Qwen3-MoE")
    a = config.attention
    if not (a.qk_norm and a.qk_norm_gain):
        raise ValueError("attention.qk_norm: this setting has no Qwen3-MoE equivalent in HF transformers")


def _check_plain(config: MarinConfig, family: str) -> None:
    a, m = config.attention, config.moe
    requirements = {
        "gated_norm_rank": config.gated_norm_rank == 0,
        "embed_norm": not config.embed_norm,
        "z_loss_weight": config.z_loss_weight == 0,
        "attention.sliding_window": a.sliding_window is None,
        "attention.num_global_kv_heads": a.num_global_kv_heads in (None, a.num_kv_heads),
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
            raise ValueError(f"{key}: this setting has no {family} equivalent in HF transformers")


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


def mixtral_hf_config(config: MarinConfig):
    """The transformers.MixtralConfig with the same architecture."""
    from transformers import MixtralConfig

    native_family(config)
    a, m = config.attention, config.moe
    return MixtralConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=m.expert_dim,
        num_hidden_layers=config.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        max_position_embeddings=config.max_seq_len,
        rope_theta=a.rope_theta,
        rms_norm_eps=config.norm_eps,
        num_local_experts=m.num_experts,
        num_experts_per_tok=m.top_k,
        router_aux_loss_coef=m.router.aux_loss_weight,
        sliding_window=None,
        tie_word_embeddings=config.tie_embeddings,
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
        if config.attention.qk_norm:  # Mixtral has none
            pairs += [
                (f"{ours}attn.q_norm_weight", f"{hf}self_attn.q_norm.weight"),
                (f"{ours}attn.k_norm_weight", f"{hf}self_attn.k_norm.weight"),
            ]
        pairs += [
            (f"{ours}attn_norm.weight", f"{hf}input_layernorm.weight"),
            (f"{ours}mlp_norm.weight", f"{hf}post_attention_layernorm.weight"),
            (f"{ours}mlp.router.weight", f"{hf}mlp.gate.weight"),
        ]
    return pairs


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the HF checkpoint: its name, the marinlm tensors it is made from, and how."""

    name: str
    sources: tuple[str, ...]
    build: Callable[..., torch.Tensor]


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _router_weight(name: str):
    def build(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # HF's softmax router has no bias: a trained one would silently pick other experts.
        if bias.device.type != "meta" and bool(bias.abs().max() > 0):
            raise ValueError(
                f"{name}: the router bias is not zero, and Qwen3-MoE's router has none; export as remote code"
            )
        return weight

    return build


def _gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=2).transpose(1, 2).contiguous()  # [E, D, 2F] -> [E, 2F, D]


def _down(down: torch.Tensor) -> torch.Tensor:
    return down.transpose(1, 2).contiguous()


def _expert(e: int):
    def build(stack: torch.Tensor) -> torch.Tensor:
        return stack[e].t().contiguous()  # ours x @ W [in, out] -> nn.Linear [out, in]

    return build


def half_pair_order(config: MarinConfig) -> torch.Tensor | None:
    """Where each dim of a head goes in transformers' split-half RoPE, for a config whose RoPE
    rotates adjacent pairs (`attention.rope_pairs: interleaved`): the rotary dims' evens, then
    their odds, then the rest. Queries and keys permuted so (their projection rows and QK-norm
    gains) give the same scores, since q·k is the same sum in any order and RMS norm does not see
    the order. None for split-half configs, which need nothing."""
    a = config.attention
    if a.rope_pairs != "interleaved":
        return None
    R = a.rope_dim
    return torch.cat([torch.arange(0, R, 2), torch.arange(1, R, 2), torch.arange(R, a.head_dim)])


def _permute_heads(order: torch.Tensor, head_dim: int):
    """Each head's dims of a projection's rows (or a [head_dim] gain) taken in `order`."""

    def build(tensor: torch.Tensor) -> torch.Tensor:
        heads = tensor.reshape(-1, head_dim, *tensor.shape[1:])
        return heads[:, order.to(tensor.device)].reshape(tensor.shape)

    return build


def _rope_permuted(name: str) -> bool:
    return name.endswith(("attn.q_proj.weight", "attn.k_proj.weight", "attn.q_norm_weight", "attn.k_norm_weight"))


def hf_tensor_plan(config: MarinConfig, fused: bool = False) -> list[HFTensor]:
    """Every tensor of the Qwen3MoeForCausalLM checkpoint, in order, as a function of ours: the
    export reads only each one's sources, so it never needs the whole model at once.

    The files use the Hub's layout, one nn.Linear per expert (`experts.{e}.gate_proj.weight`), which
    transformers itself writes and every reader of Qwen3-MoE folders expects; `fused` gives the
    in-memory layout of transformers 5's modules instead (gate_up_proj [E, 2F, D]) for load_state_dict."""
    family = native_family(config)
    order = half_pair_order(config)
    plan = []
    for ours, hf in _direct_names(config):
        if order is not None and _rope_permuted(ours):
            plan.append(HFTensor(hf, (ours,), _permute_heads(order, config.attention.head_dim)))
        elif ours.endswith("mlp.router.weight"):
            bias = ours.replace(".weight", ".bias")
            if family == "mixtral" and not fused:
                hf = hf.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            plan.append(HFTensor(hf, (ours, bias), _router_weight(bias)))
        elif not (config.tie_embeddings and ours == "lm_head.weight"):
            plan.append(HFTensor(hf, (ours,), _same))
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.mlp.experts.", f"model.layers.{i}.mlp.experts."
        if fused:
            plan.append(HFTensor(f"{hf}gate_up_proj", (f"{ours}gate_proj", f"{ours}up_proj"), _gate_up))
            plan.append(HFTensor(f"{hf}down_proj", (f"{ours}down_proj",), _down))
            continue
        if family == "mixtral":  # its files: block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down)
            hf = f"model.layers.{i}.block_sparse_moe.experts."
        names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if family == "mixtral" else {}
        for e in range(config.moe.num_experts):
            for name in ("gate_proj", "up_proj", "down_proj"):
                out = names.get(name, name)
                plan.append(HFTensor(f"{hf}{e}.{out}.weight", (f"{ours}{name}",), _expert(e)))
    return plan


def to_hf_state_dict(state: dict[str, torch.Tensor], config: MarinConfig) -> dict[str, torch.Tensor]:
    """The state dict of transformers' Qwen3MoeForCausalLM module (fused experts), for load_state_dict."""
    return {t.name: t.build(*(state[s] for s in t.sources)) for t in hf_tensor_plan(config, fused=True)}


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], config: MarinConfig) -> dict[str, torch.Tensor]:
    """Our tensors from a Qwen3-MoE or Mixtral state dict: the Hub's files (one nn.Linear per expert;
    Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`) or transformers 5's fused modules."""
    native_family(config)
    hf_state = dict(hf_state)
    hf_state.setdefault("lm_head.weight", hf_state["model.embed_tokens.weight"])  # tied checkpoints
    for i in range(config.num_layers):  # Mixtral's files name the MoE block apart
        for old, new in ((f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."),):
            for key in [k for k in hf_state if k.startswith(old)]:
                renamed = key.replace(old, new).replace(".w1.", ".gate_proj.").replace(".w3.", ".up_proj.")
                hf_state[renamed.replace(".w2.", ".down_proj.")] = hf_state.pop(key)
    out = {ours: hf_state.pop(hf) for ours, hf in _direct_names(config)}
    order = half_pair_order(config)
    if order is not None:  # back from transformers' split-half order (`half_pair_order`)
        back = _permute_heads(torch.argsort(order), config.attention.head_dim)
        out = {name: back(t) if _rope_permuted(name) else t for name, t in out.items()}
    F, E = config.moe.expert_dim, config.moe.num_experts
    for i in range(config.num_layers):
        ours, hf = f"layers.{i}.mlp.", f"model.layers.{i}.mlp.experts."
        out[f"{ours}router.bias"] = torch.zeros(E)
        if f"{hf}gate_up_proj" in hf_state:
            gate_up = hf_state.pop(f"{hf}gate_up_proj").transpose(1, 2)  # [E, D, 2F]
            out[f"{ours}experts.gate_proj"] = gate_up[..., :F].contiguous()
            out[f"{ours}experts.up_proj"] = gate_up[..., F:].contiguous()
            out[f"{ours}experts.down_proj"] = hf_state.pop(f"{hf}down_proj").transpose(1, 2).contiguous()
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            per_expert = [hf_state.pop(f"{hf}{e}.{name}.weight").t() for e in range(E)]
            out[f"{ours}experts.{name}"] = torch.stack(per_expert).contiguous()
    if hf_state:
        raise ValueError(
            f"{len(hf_state)} tensors of the checkpoint have no place in the model, e.g. {next(iter(hf_state))}"
        )
    return out
