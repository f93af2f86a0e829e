"""A training step's compute as a sum over its operations, each priced from a cost table.

What a step runs, for any size: the structure from one training step of a small proxy (the
proxy of plan/activations.py, whose widths differ), the sizes from the config.

- **GEMMs** by shape: every linear layer's forward and its two gradients, M tokens x K in x N out
  (again in a checkpointed block's recomputed forward), and MuonH's Newton-Schulz products on
  each matrix (`newton_schulz_gemms`).
- **Composite operations** priced whole, by shape: attention's core (`Attention.attend`: scores,
  softmax and values, forward and backward) by rows, sequence, window and heads; the routed
  experts (dispatch, grouped GEMMs, combine) by assignments and widths; the LM head and loss.
- **Everything else** (norms, SConv, the head gate, RoPE, routing, residuals, autocast's casts,
  Adam and the optimizer's elementwise work): the bytes each operation reads and writes, filed
  by the width they are a multiple of, as the activation inventory files saved tensors, so that
  the target's bytes are the proxy's per unit of width times the target's widths; and the count
  of such operations, each paying one dispatch on the host.

`MeasuredTable` (plan/op_table.py) prices them: seconds by shape for GEMMs and composites, the
seconds of an operation moving the same bytes for the rest, and seconds a dispatch. On a CPU the
blocks' memory-bound work is timed whole, as a block of each kind runs it at the step's shape
(`MeasuredTable.block_memory`): there casts, strided reads and transcendental functions cost up
to several times an add of the same bytes.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from marinlm.kernels.config import KernelConfig
from marinlm.model.config import MarinConfig
from marinlm.plan.activations import _classify, layer_kind, packed_segments, proxy, widths

aten = torch.ops.aten
# Priced by shape (GEMMs), so not by the bytes they move.
GEMM_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
# The widths a tensor's trailing dimension may be told by (the proxy's small counts may collide).
WIDE = ("d_model", "query_heads", "kv_heads", "global_kv_heads", "latent", "shared_hidden", "dense_hidden", "vocab")


@dataclass
class OpInventory:
    """Per layer kind ("local", "global", "dense") and outside the blocks, and per pass ("local/forward",
    "outside/backward", ...): bytes a token by width class (per unit of width, as `Inventory`), and
    operations; the optimizer's bytes a weight element and operations a parameter tensor."""

    bytes_per_token: dict[str, dict[str, float]] = field(default_factory=dict)
    calls: dict[str, float] = field(default_factory=dict)
    views: dict[str, float] = field(default_factory=dict)  # view and metadata operations: a dispatch, no bytes
    step_bytes_per_weight: float = 0.0  # weight-shaped work in a step: casts, gradient norms and clipping
    optimizer_bytes_per_weight: float = 0.0
    optimizer_calls_per_tensor: float = 0.0
    tensors: int = 0  # the traced model's parameter tensors and MoE layers, which "step_tensors" and
    moe_layers: int = 0  # "step_layers" (the trainer's own work outside the model) scale with


class _Region(torch.autograd.Function):
    """Identity that moves the recorder into (`enter`) or out of a region in backward."""

    @staticmethod
    def forward(ctx, x, recorder, label, enter):
        ctx.recorder, ctx.label, ctx.enter = recorder, label, enter
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        if ctx.enter:
            ctx.recorder.stack.append(ctx.label)
        elif ctx.label in ctx.recorder.stack:
            ctx.recorder.stack.remove(ctx.label)
        return dx, None, None, None


class _Recorder(TorchDispatchMode):
    """Counts each operation's bytes (filed by width) and calls under the current region's label;
    operations under the label "priced" (GEMMs, composites) count nothing."""

    def __init__(self, table: dict[str, float], tokens: int, weight_shapes: set):
        super().__init__()
        self.table, self.tokens, self.weight_shapes = table, tokens, weight_shapes
        self.stack: list[str] = []
        self.bytes: dict[str, dict[str, float]] = {}
        self.calls: dict[str, float] = {}
        self.views: dict[str, float] = {}
        self.weight_bytes = self.optimizer_bytes = 0.0

    @property
    def label(self) -> str:
        """The region and the pass: "local/forward", "outside/backward", ..., or "priced"."""
        backward = torch._C._current_autograd_node() is not None
        label = self.stack[-1] if self.stack else ("outside" if backward else "step")
        if label in ("priced", "optimizer", "step"):
            return label
        return f"{label}/{'backward' if backward else 'forward'}"

    def region(self, fn, label: str):
        """`fn` wrapped so that its forward and backward count under `label`."""

        def wrapped(first, *args, **kwargs):
            self.stack.append(label)
            try:
                out = fn(first if not _grads(first) else _Region.apply(first, self, label, False), *args, **kwargs)
            finally:
                self.stack.remove(label)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                return _Region.apply(out, self, label, True)
            if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and out[0].requires_grad:
                return (_Region.apply(out[0], self, label, True), *out[1:])
            return out

        return wrapped

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        label = self.label
        if label == "priced" or func in GEMM_OPS:
            return out
        if func.is_view:
            self.views[label] = self.views.get(label, 0.0) + 1
            return out
        tensors = list(_tensors(args, kwargs, out))
        if label == "step":  # the trainer's own work: per weight tensor (norms, clipping) or per MoE layer (router)
            per_tensor = any(tuple(t.shape) in self.weight_shapes for t in tensors)
            label = "step_tensors" if per_tensor else "step_layers"
        self.calls[label] = self.calls.get(label, 0.0) + 1
        bucket = self.bytes.setdefault(label, {})
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if label == "optimizer":
                self.optimizer_bytes += nbytes
                continue
            if tuple(t.shape) in self.weight_shapes:
                self.weight_bytes += nbytes
                continue
            if label == "step_layers":
                bucket["one"] = bucket.get("one", 0.0) + nbytes  # bytes a call, as they are
                continue
            # By elements a token; else (SConv's shifted slices, T - j rows) by the trailing width.
            name = _classify(t.numel() / self.tokens, self.table)
            if name is None and t.dim() >= 2:
                name = _classify(t.shape[-1], {k: self.table[k] for k in WIDE if k in self.table})
            key, value = (name, nbytes / self.tokens / self.table[name]) if name else ("unknown", nbytes / self.tokens)
            bucket[key] = bucket.get(key, 0.0) + value
        return out


class _KernelTimer(_Recorder):
    """Seconds of the memory-bound operations' kernels by region and pass (`MeasuredTable.block_memory`):
    GEMMs, views and what runs under the label "priced" not counted."""

    clock = staticmethod(time.perf_counter)

    def __init__(self):
        super().__init__({}, 1, set())
        self.seconds: dict[str, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = self.clock()
        out = func(*args, **(kwargs or {}))
        took = self.clock() - start
        label = self.label
        if label != "priced" and func not in GEMM_OPS and not func.is_view:
            self.seconds[label] = self.seconds.get(label, 0.0) + took
        return out


def mark_priced(recorder: _Recorder, model: nn.Module) -> None:
    """Count nothing under `recorder` in what is priced by shape: attention's core, the routed
    experts, the LM head and loss."""
    from marinlm.model.attention import Attention
    from marinlm.model.experts import RoutedExperts
    from marinlm.model.loss import NextTokenLoss

    for module in model.modules():
        if isinstance(module, Attention):
            module.attend = recorder.region(module.attend, "priced")
        elif isinstance(module, RoutedExperts | NextTokenLoss):
            module.forward = recorder.region(module.forward, "priced")


def _grads(x) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad


def _tensors(args, kwargs, out):
    stack = [args, kwargs or {}, out]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())


_TRACES: dict[tuple, OpInventory] = {}


def trace_ops(config: MarinConfig, optim, precision: str, kernels: KernelConfig | None = None) -> OpInventory:
    """One training step of the proxy of `config` (forward, backward, `optim`'s step) in `precision`
    with the CPU kernels `kernels` asks for, its memory-bound operations filed (once a process)."""
    key = (repr(config), repr(optim), precision, repr(kernels))
    if key not in _TRACES:
        _TRACES[key] = _trace_ops(config, optim, precision, kernels)
    return _TRACES[key]


def _trace_ops(
    config: MarinConfig, optim, precision: str, kernels: KernelConfig | None, full_size: tuple[int, int] | None = None
) -> OpInventory:
    """`trace_ops`; `full_size` (rows, sequence): trace `config` itself at that size instead of
    its proxy (a check of the proxy's scaling, tests/test_plan.py)."""
    from marinlm.kernels import apply_kernels
    from marinlm.model.transformer import MarinForCausalLM
    from marinlm.optim import build_optimizer
    from marinlm.train.step import train_step

    proxy_config, T = proxy(config)
    B = 2
    if full_size is not None:
        proxy_config, (B, T) = config, full_size
    with torch.device("meta"):
        model = MarinForCausalLM(proxy_config)
    kernels = kernels or KernelConfig()
    apply_kernels(
        model, "cpu", precision, dataclasses.replace(kernels, loss_chunk_tokens=min(kernels.loss_chunk_tokens, 64))
    )
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    params = list(model.parameters())
    shapes = {tuple(p.shape) for p in params} | {tuple(p.shape)[::-1] for p in params}
    recorder = _Recorder(widths(proxy_config, T) | {"vocab": proxy_config.vocab_size}, B * T, shapes)
    mark_priced(recorder, model)
    for i, block in enumerate(model.layers):
        block.forward = recorder.region(block.forward, layer_kind(proxy_config, i))
    model.forward = recorder.region(model.forward, "outside")
    optimizer = build_optimizer(model, optim, "cpu")
    step = optimizer.step

    def optimizer_step():  # its own region: its bytes scale with the weights
        recorder.stack.append("optimizer")
        try:
            step()
        finally:
            recorder.stack.pop()

    optimizer.step = optimizer_step
    ids = torch.randint(0, proxy_config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "segment_ids": packed_segments(B, T), "labels": ids.roll(-1, 1)}
    batch["loss_mask"] = torch.ones_like(ids)
    with recorder:  # the trainer's own step (train/step.py): forward, backward, clipping, update, router biases
        train_step(
            model, optimizer, [batch], device=torch.device("cpu"), precision=precision, grad_clip=1.0, world_size=1
        )
    weights = sum(p.numel() for p in params)
    inv = OpInventory(recorder.bytes, dict(recorder.calls), dict(recorder.views), recorder.weight_bytes / weights)
    inv.optimizer_bytes_per_weight = recorder.optimizer_bytes / weights
    inv.optimizer_calls_per_tensor = recorder.calls.get("optimizer", 0.0) / len(params)
    inv.tensors, inv.moe_layers = len(params), sum(proxy_config.is_moe_layer(i) for i in range(proxy_config.num_layers))
    return inv


def linear_shapes(model) -> dict[str, list[tuple[int, int]]]:
    """(in, out) of every linear layer each block kind of `model` (a MarinForCausalLM, on meta) runs."""
    shapes: dict[str, list[tuple[int, int]]] = {}
    for i, block in enumerate(model.layers):
        linears = [(m.in_features, m.out_features) for m in block.modules() if type(m) is nn.Linear]
        shapes.setdefault(layer_kind(model.config, i), linears)
    return shapes


def newton_schulz_gemms(shapes: list[tuple[int, ...]], steps: int, device: str) -> list[tuple[int, int, int, int, int]]:
    """(batch, m, k, n, calls) of the Newton-Schulz products the optimizer runs on matrices of
    `shapes` (a stack of experts [E, in, out] is E of them): same-shaped matrices stacked into
    batches of at most `ns_batch_elements` elements (optim/marin.py `newton_schulz_many`), each
    iteration X Xᵀ, A A and B X with X [m, n], m <= n."""
    from marinlm.optim.marin import ns_batch_elements

    limit = ns_batch_elements(torch.device(device))
    groups: dict[tuple[int, int], list[int]] = {}
    for shape in shapes:
        groups.setdefault(tuple(shape[-2:]), []).append(shape[0] if len(shape) == 3 else 1)
    gemms = []
    for (rows, cols), counts in groups.items():
        m, n = min(rows, cols), max(rows, cols)
        batches, size = [0], 0
        for count in counts:  # a tensor that alone passes the limit goes alone
            if batches[-1] and size + count * rows * cols > limit:
                batches.append(0)
                size = 0
            batches[-1] += count
            size += count * rows * cols
        for b in batches:
            gemms += [(b, m, n, m, steps), (b, m, m, m, steps), (b, m, m, n, steps)]
    return gemms


def price_step(
    train,
    table,
    inv: OpInventory,
    *,
    rows: int,
    forwards: int,
    layers,
    recompute: float = 0.0,
    head: bool = True,
    weights: int | None = None,
    tensors: int | None = None,
    matrices: list[tuple[int, ...]] | None = None,
) -> dict[str, float]:
    """Seconds of one rank's step by part: `forwards` forwards (and backwards) of `rows` rows each
    through the blocks `layers` (indices), the LM head and loss if `head`; checkpointed blocks'
    share `recompute` runs its forward again; then the optimizer over `weights` elements in
    `tensors` tensors, with Newton-Schulz on `matrices` (default: the whole model's)."""
    from marinlm.model.transformer import MarinForCausalLM

    model = train.model
    seq = train.data.seq_len
    tokens = rows * seq
    width = widths(model, seq) | {"vocab": model.vocab_size}
    with torch.device("meta"):
        meta = MarinForCausalLM(model)
    shapes = linear_shapes(meta)
    part = dict.fromkeys(("gemms", "attention", "experts", "loss", "memory", "dispatch", "optimizer"), 0.0)
    fwd_dispatch, view_dispatch = table.dispatch
    dispatch = max(fwd_dispatch - table.elementwise(48), 0.0)  # autograd's share, beyond a small kernel

    def memory(label: str, share: float = 1.0, seconds: float | None = None) -> None:
        """The label's operations (`seconds` where timed whole, else each at the mean bytes an operation
        moves), and their dispatch."""
        calls = inv.calls.get(label, 0.0)
        units = inv.bytes_per_token.get(label, {})
        nbytes = tokens * sum(u * width.get(name, 1.0) for name, u in units.items())
        if seconds is not None:
            part["memory"] += share * seconds
        elif calls:
            part["memory"] += share * calls * table.elementwise(nbytes / calls)
        part["dispatch"] += share * (calls * dispatch + inv.views.get(label, 0.0) * view_dispatch)

    for i in layers:
        kind = layer_kind(model, i)
        for fan_in, fan_out in shapes[kind]:
            fwd, both = table.linear(tokens, fan_in, fan_out)
            part["gemms"] += both + recompute * fwd
        fwd, both = table.attention(rows, seq, model.is_global_layer(i))
        part["attention"] += both + recompute * fwd
        if kind != "dense":
            fwd, both = table.experts(tokens)
            part["experts"] += both + recompute * fwd
        # On a CPU a block's memory-bound work is timed as the block runs it; a GPU's kernels queue
        # behind one another, so there it is priced by bytes.
        timed = table.block_memory(kind, rows, seq) if table.device == "cpu" else (None, None)
        memory(f"{kind}/forward", 1 + recompute, timed[0])
        memory(f"{kind}/backward", 1.0, timed[1])
    memory("outside/forward")
    memory("outside/backward")
    if head:
        part["loss"] += table.loss(tokens)[1]
    part = {k: v * forwards for k, v in part.items()}
    params = list(meta.parameters())
    weights = sum(p.numel() for p in params) if weights is None else weights
    tensors = len(params) if tensors is None else tensors
    moe_layers = sum(model.is_moe_layer(i) for i in layers)
    step_calls = inv.calls.get("step_tensors", 0.0) * tensors / max(inv.tensors, 1)
    if step_calls:  # gradient norms, clipping: per weight tensor, once a step
        part["memory"] += step_calls * table.elementwise(inv.step_bytes_per_weight * weights / step_calls)
        part["dispatch"] += step_calls * dispatch
    layer_calls = inv.calls.get("step_layers", 0.0)
    if layer_calls:  # router statistics and biases: per MoE layer, once a step
        each = inv.bytes_per_token.get("step_layers", {}).get("one", 0.0) / layer_calls
        part["memory"] += layer_calls * moe_layers / max(inv.moe_layers, 1) * (table.elementwise(each) + dispatch)
    optimizer_calls = inv.optimizer_calls_per_tensor * tensors
    part["optimizer"] += optimizer_calls * table.elementwise(inv.optimizer_bytes_per_weight * weights / optimizer_calls)
    if train.optim.type_name == "marin":
        from marinlm.optim import newton_schulz_dtype
        from marinlm.optim.marin import marin_param_kinds

        if matrices is None:
            matrices = [tuple(p.shape) for _, p in marin_param_kinds(meta)["muonh"]]
        ns = "bf16" if newton_schulz_dtype(train.optim, table.device) == "bfloat16" else "fp32"
        for batch, m, k, n, calls in newton_schulz_gemms(matrices, train.optim.ns_steps, table.device):
            part["optimizer"] += calls * table.gemm(m, k, n, ns, batch=batch)
    return part


def step_seconds(part: dict[str, float], device: str) -> float:
    """A step's seconds from `price_step`'s parts: on a CPU the host runs everything in turn; on a
    GPU the host dispatches while the GPU computes, and the slower of the two sets the pace."""
    if device == "cpu":
        return sum(part.values())
    return max(part["dispatch"], sum(v for k, v in part.items() if k != "dispatch"))
