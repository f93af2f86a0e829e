"""The bytes a layout's exchanges move a step: expert parallel's all-to-alls and context parallel's
keys, values and SConv halos, counted as parallel/ runs them."""

from __future__ import annotations


def expert_exchanges(
    model,
    dims,
    tokens: int,
    forwards: int,
    act_bytes: int,
    recompute: float,
    moe_layers: float,
    remote_share=None,
    travels: float = 1.0,
) -> tuple[float, float]:
    """(bytes a rank sends to other ranks, all-to-all calls) a step under expert parallel, as
    parallel/expert_parallel.py runs them: per MoE layer and forward, the experts' counts (int64,
    E/ep + 1 to each other rank), the rows to the experts and the results back (latent width,
    `act_bytes`), and in backward the two gradients' exchanges; a checkpointed block's
    recomputed forward exchanges all three again. Each assignment travels once each way;
    `remote_share` is the share of them whose expert sits on another rank: (ep - 1) / ep where
    every rank routes alike (whatever the skew across experts), or a run's measured share;
    `travels` the share of assignments sent at all (receiver_pooled sends kept ones only)."""
    share = (dims.ep - 1) / dims.ep if remote_share is None else remote_share
    latent = model.moe.latent_dim or model.d_model
    rows = tokens * model.moe.top_k * share * travels / forwards  # remote assignments of one forward
    header = (dims.ep - 1) * (model.moe.num_experts // dims.ep + 1) * 8
    forward = 2 * rows * latent * act_bytes + header
    per_forward = forward * (1 + recompute) + 2 * rows * latent * act_bytes
    calls = 3 * (1 + recompute) + 2
    return per_forward * forwards * moe_layers, calls * forwards * moe_layers


def context_exchange_bytes(model, seq_len: int, cp: int, act_bytes: int) -> float:
    """Bytes the busiest cp rank receives in one forward of a row: every layer's keys and values
    (global layers: all earlier tokens; local: the window's halo) and the SConv sites' halos."""
    from marinlm.parallel.context_parallel import reach_cost

    a = model.attention
    window = None if a.sliding_window is None else a.sliding_window - 1
    halo = reach_cost(seq_len, cp, model.sconv.kernel_size - 1).received
    kv_width = a.num_kv_heads * a.head_dim
    sites = {"k": kv_width, "v": kv_width, "attn": model.d_model, "mlp": model.d_model}
    total = 0.0
    for i in range(model.num_layers):
        is_global = model.is_global_layer(i)
        kv = (a.global_kv_heads() if is_global else a.num_kv_heads) * a.head_dim
        total += reach_cost(seq_len, cp, None if is_global else window).received * 2 * kv
        total += halo * sum(sites[s] for s in model.sconv.sites)
    return total * act_bytes
