"""The activation memory of a training forward, estimated for any size from a small proxy.

Autograd keeps, from each forward until its backward, the tensors its ops saved. Which tensors a
Marin block saves depends on its structure (SConv sites, GatedNorm, the latent, XSA, the router,
the kernels), and their sizes on its widths. So the estimate runs one forward of a *proxy*: the
same structure with small, distinct widths, counts the bytes of every saved tensor per token (each
storage once, parameters excluded), and files each under the width its size is a multiple of
(d_model, the query heads' width, the latent width, k times the expert width, the sequence for
T x T masks, ...). The target's bytes are each class's bytes per unit of width times the target's
width: exact for the structure, linear in the widths.

`tests/test_plan.py` checks the estimate for `tiny` and `small` against the activation peak that
`torch.distributed._tools.MemTracker` measures in a real forward and backward.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from marinlm.kernels.config import KernelConfig
from marinlm.model.config import MarinConfig


def widths(config: MarinConfig, seq_len: int) -> dict[str, float]:
    """The per-token widths a saved tensor can be a multiple of, for `config`."""
    a, m = config.attention, config.moe
    latent = m.latent_dim or config.d_model
    return {
        "d_model": config.d_model,
        "query_heads": a.num_heads * a.head_dim,
        "kv_heads": a.num_kv_heads * a.head_dim,
        "global_kv_heads": a.global_kv_heads() * a.head_dim,
        "heads": a.num_heads,
        "latent": latent,
        "k_latent": m.top_k * latent,
        "k_experts_hidden": m.top_k * m.expert_dim,
        "shared_hidden": m.shared_expert_dim,
        "dense_hidden": m.dense_ffn_dim,
        "gated_rank": config.gated_norm_rank,
        "experts": m.num_experts,
        "top_k": m.top_k,
        "top_k_plus_1": m.top_k + 1,
        "sequence": seq_len,  # a T x T mask or score per row is `sequence` elements a token
        "one": 1,
    }


def weight_key(name: str) -> str:
    """A parameter's name as `Inventory.weight_copies` files it: a block's as layers.#.* (any
    block's alike), activation checkpointing's wrapper left out."""
    return re.sub(r"^layers\.\d+\.", "layers.#.", name.replace("_checkpoint_wrapped_module.", ""))


def context_bytes_a_token(config: MarinConfig) -> float:
    """Bytes a token of a forward's context (`model/context.py` `ForwardContext`), which a
    checkpointed block keeps till backward: document ids and positions (int64), RoPE's cos and sin
    tables (fp32), SConv's keep mask a lag (bool); its T x T masks are counted apart."""
    sconv = config.sconv.kernel_size - 1 if config.sconv.sites else 0
    return 2 * 8 + 2 * (config.attention.rope_dim // 2) * 4 + sconv


def layer_kind(config: MarinConfig, i: int) -> str:
    """ "dense" (a first_k_dense layer), "global" or "local": the layer kinds the estimates tell apart."""
    if not config.is_moe_layer(i):
        return "dense"
    return "global" if config.is_global_layer(i) else "local"


def proxy(config: MarinConfig) -> tuple[MarinConfig, int]:
    """`config` with its structure and small widths chosen so that the `widths` differ; and the
    proxy's sequence length. Widths are multiples of 8 so that bf16 grouped GEMMs align."""
    c = copy.deepcopy(config)
    heads, kv, glob = 6, 3, (1 if config.attention.global_kv_heads() < config.attention.num_kv_heads else 3)
    c.d_model, c.vocab_size, c.num_layers, c.max_seq_len = 88, 512, 2, 104
    c.gated_norm_rank = 24 if config.gated_norm_rank else 0
    a = c.attention
    a.num_heads, a.head_dim, a.num_kv_heads, a.num_global_kv_heads = heads, 40, kv, glob
    a.sliding_window = 40 if config.attention.sliding_window else None
    a.global_every, a.last_layer_global = 2, True  # layer 0 local, layer 1 global
    m = c.moe
    m.num_experts, m.top_k, m.expert_dim = 10, min(config.moe.top_k, 3), 56
    m.latent_dim = 72 if config.moe.latent_dim else None
    m.shared_expert_dim, m.dense_ffn_dim, m.capacity_factor = 152, 136 if config.moe.first_k_dense else 0, None
    m.first_k_dense = 1 if config.moe.first_k_dense else 0
    if hasattr(m.router, "hist_bins"):
        m.router.hist_bins = 100
    return c, 104


@dataclass
class Inventory:
    """Saved bytes a token, by width class: for each local and global layer kind, a dense (first_k_dense)
    layer, and outside the blocks (embedding, final norm, loss). `per_forward`: T x T tensors saved once."""

    layer_kinds: dict[str, dict[str, float]] = field(default_factory=dict)
    outside: dict[str, float] = field(default_factory=dict)
    head: dict[str, float] = field(default_factory=dict)  # the part of `outside` saved after the blocks
    unknown: float = 0.0  # bytes a token no width explains (kept as they are)
    # Under autocast a forward ends holding a bf16 copy of the weights it multiplies (saved for
    # backward, or in autocast's cache): bytes per weight element (2 where every matrix is cast).
    cast_bytes_per_weight: float = 0.0
    # The weights whose copies a forward ends holding (a block's named layers.#.*): {name: (bytes
    # an element, saved for backward, in autocast's cache)}: the cache, when on, holds every
    # block's copies till the forward ends, checkpointed or not; a checkpointed block saves none.
    weight_copies: dict[str, tuple[int, bool, bool]] = field(default_factory=dict)


def _classify(per_token: float, table: dict[str, float]) -> str | None:
    for name, value in table.items():
        if value and abs(per_token - value) < 1e-6:
            return name
    return None


def width_class(elements: int, storage_elements: float, B: int, T: int, table: dict, kernel_size: int) -> str | None:
    """The width a tensor of B rows of T tokens is a multiple of: by its elements a token, or its storage's (a
    view's storage may be larger); None if none. SConv's products with its keep masks span T - shift tokens a row
    (packed documents): filed under their width, as if the row were whole."""
    name = _classify(elements / (B * T), table) or _classify(storage_elements / (B * T), table)
    for shift in range(1, kernel_size if name is None else 1):
        name = name or _classify(elements / (B * (T - shift)), table)
    return name


def build_proxy(
    config: MarinConfig, precision: str, kernels: KernelConfig | None, kernels_device: str, depth: bool = False
):
    """The proxy model of `config` (`proxy`), initialised, with the run's kernels (`inventory`); `depth`: with
    `config`'s layers (count, and which are dense and global) rather than one of each kind. Returns the model,
    its config and its sequence length."""
    from marinlm.kernels import apply_kernels
    from marinlm.model.transformer import MarinForCausalLM

    proxy_config, T = proxy(config)
    if depth:
        a = proxy_config.attention
        proxy_config.num_layers = config.num_layers
        a.global_every, a.last_layer_global = config.attention.global_every, config.attention.last_layer_global
        proxy_config.moe.first_k_dense = config.moe.first_k_dense
    with torch.device("meta"):
        model = MarinForCausalLM(proxy_config)
    kernels = kernels or KernelConfig()
    kernels = dataclasses.replace(kernels, loss_chunk_tokens=64 if kernels.loss_chunk_tokens else 0)
    apply_kernels(model, "cpu", precision, kernels if kernels_device == "cpu" else kernels.reference())
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model, proxy_config, T


def inventory(
    config: MarinConfig, precision: str, kernels: KernelConfig | None = None, kernels_device: str = "cpu"
) -> Inventory:
    """Run one training forward of the proxy of `config` in `precision` (fp32 or bf16 autocast) and
    file its saved tensors. `kernels`: the run's (default: auto), its loss chunks scaled to the
    proxy; `kernels_device`: whose kernels the estimate stands for ("cpu" swaps in the CPU kernels
    `kernels` asks for; "cuda" keeps the reference modules, as CUDA's are)."""
    from marinlm.parallel.activation_checkpoint import apply_activation_checkpointing

    model, proxy_config, T = build_proxy(config, precision, kernels, kernels_device)
    B = 2
    table = widths(proxy_config, T)
    N = B * T
    ids = torch.randint(0, proxy_config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    # Training rows are packed documents: the step passes their segment ids, and with them the
    # model builds (and saves) its attention and SConv masks.
    segments = packed_segments(B, T)
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    where = ["outside"]
    found: dict[str, dict[str, float]] = {}
    unknown = 0.0
    names = {id(p): weight_key(n) for n, p in model.named_parameters()}

    class Casts(TorchDispatchMode):
        """Keeps a weak reference to each copy of a weight (a leaf) cast in a forward."""

        def __init__(self):
            super().__init__()
            self.copies: list[tuple] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and id(args[0]) in names:
                self.copies.append((weakref.ref(out), names[id(args[0])], out.element_size()))
            return out

        def live(self) -> dict[str, int]:
            """{weight (a block's as layers.#.*): bytes an element} of the copies still held (saved
            for backward or in autocast's cache)."""
            return {name: size for ref, name, size in self.copies if ref() is not None}

    def pack(t: torch.Tensor):
        nonlocal unknown
        key = t.untyped_storage().data_ptr()
        if key in seen or t.device.type == "meta":
            return t
        seen.add(key)
        nbytes = t.untyped_storage().nbytes()
        if t.dtype != torch.float32 and tuple(t.shape) in shapes:  # autocast's copy of a weight (`Casts`)
            return t
        name = width_class(t.numel(), nbytes / t.element_size(), B, T, table, proxy_config.sconv.kernel_size)
        if name is None:
            unknown += nbytes / N
        else:
            bucket = found.setdefault(where[0], {})
            bucket[name] = bucket.get(name, 0.0) + nbytes / N / table[name]
        return t

    def enter(kind):
        def hook(module, args):
            where[0] = kind

        return hook

    def leave(module, args, output):
        where[0] = "head"  # until the next block: after the last, the final norm, LM head and loss

    for i, block in enumerate(model.layers):
        kind = layer_kind(proxy_config, i)
        block.register_forward_pre_hook(enter(kind))
        block.register_forward_hook(leave)
    # Autocast's copies of the weights: with its cache off (as a step under FSDP2 or activation
    # checkpointing runs, `parallel.autocast_caches_weights`) those saved for backward stay; with
    # it on, also those it cached, for every block (shown with every block checkpointed).
    saved, cached = Casts(), Casts()
    uncached = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16", cache_enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), uncached, saved:
        model(ids, segments, labels=ids, return_logits=False)
        held = saved.live()
    apply_activation_checkpointing(model, "full", 1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"), cached:
        model(ids, segments, labels=ids, return_logits=False)
        in_cache = cached.live()
    matrices = sum(p.numel() for p in model.parameters() if p.ndim >= 2)
    outside, head = found.get("outside", {}), found.get("head", {})
    outside = {k: outside.get(k, 0.0) + head.get(k, 0.0) for k in set(outside) | set(head)}
    inv = Inventory({k: v for k, v in found.items() if k not in ("outside", "head")}, outside, head, unknown)
    copies = held | in_cache
    inv.cast_bytes_per_weight = sum(p.numel() * copies.get(names[id(p)], 0) for p in model.parameters()) / matrices
    inv.weight_copies = {name: (size, name in held, name in in_cache) for name, size in copies.items()}
    return inv


def activation_bytes(
    inv: Inventory,
    config: MarinConfig,
    tokens: int,
    seq_len: int,
    layers=None,
    weights: int = 0,
    gpu: bool = False,
    cp: int = 1,
    act_bytes: int = 4,
    embed: bool = True,
    head: bool = True,
) -> dict[str, float]:
    """Saved bytes of a forward over `tokens` tokens of rows of `seq_len`: by part ("blocks",
    "outside", "weight_copies" of the `weights` matrix elements the rank multiplies, "masks",
    "context_halo"), for the given layer indices (all by default).

    `gpu`: CUDA's fused attention keeps no T x T scores, as the CPU proxy's does; what stays is the
    boolean document/window mask, one for the local and one for the global layers a forward.

    `cp`: the rank holds `tokens` of rows cut over `cp` context-parallel ranks: each query's T x T
    terms span the keys its chunk reaches (`context_parallel.reach_cost`, the busiest rank's), and
    each layer keeps the keys and values it gathered (own and received, `act_bytes` an element)
    and its SConv inputs' halo.

    `embed`, `head`: whether the rank runs the embedding and the final norm, LM head and loss (a
    pipeline stage runs one, both or neither); what is saved outside the blocks is theirs.
    """
    table = widths(config, seq_len)
    layers = range(config.num_layers) if layers is None else layers
    a = config.attention
    keys = {"global": seq_len, "local": seq_len, "dense": seq_len}  # keys a query's T x T terms span
    halo = {"global": 0.0, "local": 0.0, "dense": 0.0}  # bytes a row beside the per-token ones
    # A row's masks, [T, T] each: one for the local layers and one for the global, of those it runs.
    mask_elements = len({config.is_global_layer(i) for i in layers}) * seq_len * seq_len
    if cp > 1:
        from marinlm.parallel.context_parallel import reach_cost

        mine = seq_len // cp
        window = a.sliding_window
        cost = {
            "global": reach_cost(seq_len, cp, None),
            "local": reach_cost(seq_len, cp, None if window is None else window - 1),
        }
        cost["dense"] = cost["local"]
        sconv = reach_cost(seq_len, cp, config.sconv.kernel_size - 1)
        kv_width = a.num_kv_heads * a.head_dim
        sites = {"k": kv_width, "v": kv_width, "attn": config.d_model, "mlp": config.d_model}
        sconv_halo = sconv.received * sum(sites[s] for s in config.sconv.sites) * act_bytes
        for kind, c in cost.items():
            keys[kind] = c.pairs / mine
            kv = (a.global_kv_heads() if kind == "global" else a.num_kv_heads) * a.head_dim
            halo[kind] = c.seen * 2 * kv * act_bytes + sconv_halo
        if not gpu:  # the CPU's SDPA keeps a float copy of a mask; one process's global layers have none
            halo["global"] += 4 * cost["global"].pairs
        mask_elements = cost["global"].pairs + cost["local"].pairs
    rows = tokens / (seq_len // cp)

    def per_token(bucket: dict[str, float], kind: str) -> float:
        width = dict(table, sequence=keys[kind])
        return sum(c * width[name] for name, c in bucket.items() if not (gpu and name == "sequence"))

    blocks = halos = 0.0
    for i in layers:
        kind = layer_kind(config, i)
        blocks += per_token(inv.layer_kinds.get(kind, inv.layer_kinds.get("local", {})), kind)
        halos += halo[kind]
    return {
        "blocks": blocks * tokens,
        "outside": (
            (per_token(inv.outside, "local") - per_token(inv.head, "local")) * embed
            + per_token(inv.head, "local") * head
            + inv.unknown
        )
        * tokens,
        "weight_copies": inv.cast_bytes_per_weight * weights,
        "masks": mask_elements * rows if gpu or cp > 1 else 0.0,  # bool, local and global
        "context_halo": halos * rows,
    }


def packed_segments(rows: int, seq_len: int) -> torch.Tensor:
    """Segment ids of rows packed from documents of random lengths (a new one at each position with
    probability 1 / min(1024, seq_len / 2)), as a loader of packed documents gives them."""
    g = torch.Generator("cpu").manual_seed(0)
    starts = torch.rand(rows, seq_len, generator=g, device="cpu") < 1 / min(1024, seq_len // 2)
    starts[:, 0] = True
    return torch.cumsum(starts.long(), 1)
