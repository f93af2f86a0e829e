"""Tensor + sequence parallelism over the `tp` mesh axis, Megatron-style, on DTensor parameters.

Between blocks the residual stream is split along the sequence: each of the tp ranks holds T/tp
tokens of every row, and the norms (RMSNorm, GatedNorm) run on those. Attention and the MLP each
see the whole sequence, with their weights split by heads or by hidden width:

    x (T/tp) ─ norm ─ all-gather T ─ q/k/v/gate by heads ─ attention ─ o by heads ─ partial sums
             ─ SConv (linear and depthwise, so it runs on the partial sums) ─ reduce-scatter T ─ + x
    x (T/tp) ─ norm ─ all-gather T ─ router, latent projections and norm (replicated),
             routed and shared experts by hidden width ─ partial sums ─ SConv ─ reduce-scatter T ─ + x
    final norm ─ all-gather T ─ LM head by vocabulary rows ─ cross-entropy on vocabulary shards

Every parameter becomes a DTensor on the tp mesh, `Shard(d)` where the plan splits it and
`Replicate` elsewhere, so FSDP2, DCP and the optimizer see the real layout (Muon gathers whole
matrices; checkpoints move between layouts). The model's modules compute on local tensors: while
one runs, its parameters are replaced by their local shards (`_compute_on_local_shards`). Inside a
tp region every rank sees the same tokens, and each contributes part of the gradient of what it
reads (its heads, its slice of the hidden width, its vocabulary rows): the gradient of a
replicated parameter is summed over the tp ranks in backward, and the gather at a region's start
reduce-scatters its gradient.

Global layers read the first K of their S stored KV heads (Marin: 6 of 12), while rank r holds
stored heads [r·S/tp, (r+1)·S/tp) and needs K heads [r·K/tp, (r+1)·K/tp) for its queries: those
layers all-gather their keys and values over tp and keep the rank's part (`HeadSlice`).

The latent projections and the latent RMSNorm are replicated, not split: the norm needs the whole
latent width, and computing them on every rank costs 2·N·D·L FLOPs (about 8% of the routed
experts' at the hero shape) where splitting would add two collectives a layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from marinlm.model.experts import RoutedExperts
from marinlm.model.layers import SwiGLU, compute_dtype
from marinlm.model.loss import IGNORE_INDEX
from marinlm.model.moe import MoE
from marinlm.model.transformer import named_blocks

# --- collectives with the gradients a tp region needs ------------------------------------------------


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result as a plain tensor, still in the autograd graph (a one-row
    gather comes back as an AsyncCollectiveTensor whose `.wait()` drops the graph)."""
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


def gather_tokens(x_BTD: torch.Tensor, mesh) -> torch.Tensor:
    """All-gather the sequence (dim 1); backward reduce-scatters (sums each rank's partial gradient)."""
    return _waited(funcol.all_gather_single_autograd(x_BTD.contiguous(), gather_dim=1, group=mesh))


def scatter_tokens(x_BTD: torch.Tensor, mesh) -> torch.Tensor:
    """Sum the ranks' partial [B, T, D] and keep this rank's T/tp tokens; backward all-gathers."""
    return _waited(funcol.reduce_scatter_single_autograd(x_BTD.contiguous(), "sum", scatter_dim=1, group=mesh))


class _GatherReplicated(torch.autograd.Function):
    """All-gather along `dim` a tensor whose gradient is the same on every rank; backward keeps
    this rank's slice (the LM head's vocabulary shards, when whole logits are asked for)."""

    @staticmethod
    def forward(ctx, x, dim: int, group):
        ctx.dim, ctx.rank, ctx.size = dim, dist.get_rank(group), dist.get_world_size(group)
        pieces = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, ctx.dim)[ctx.rank].contiguous(), None, None


class _ReplicaShard(torch.autograd.Function):
    """The local tensor of a replicated DTensor parameter; backward sums the tp ranks' partial
    gradients, so the parameter's gradient is the whole one on every rank."""

    @staticmethod
    def forward(ctx, p: DTensor):
        ctx.mesh, ctx.placements = p.device_mesh, p.placements
        return p.to_local().detach()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.mesh.get_group())
        return DTensor.from_local(grad, ctx.mesh, ctx.placements, run_check=False)


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """What a module computes with: a split parameter's local shard (its gradient is that of the
    shard), or a replicated one's local copy (its gradient summed over tp in backward)."""
    if not isinstance(p, DTensor):
        return p
    if all(isinstance(pl, Replicate) for pl in p.placements):
        return _ReplicaShard.apply(p)
    return p.to_local()


def _compute_on_local_shards(module: nn.Module, grad_scale: float | None = None) -> None:
    """While `module` runs, its own parameters read as their local shards (`local_shard`), their
    gradients times `grad_scale` where given."""
    names = [name for name, _ in module.named_parameters(recurse=False)]
    if not names:
        return

    def swap_in(mod, args):
        for name in names:
            local = local_shard(mod._parameters[name])
            if grad_scale is not None and local.requires_grad:
                local.register_hook(lambda grad: grad * grad_scale)
            mod.__dict__[name] = local  # found before nn.Module.__getattr__

    def swap_out(mod, args, output):
        for name in names:
            mod.__dict__.pop(name, None)
        return output

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_out, always_call=True)


def _distribute(module: nn.Module, mesh, splits: dict[str, int]) -> None:
    """Make each of `module`'s own parameters a DTensor on `mesh`: Shard(splits[name]) or Replicate."""
    for name, p in list(module.named_parameters(recurse=False)):
        if isinstance(p, DTensor):
            continue
        placement = Shard(splits[name]) if name in splits else Replicate()
        dt = distribute_tensor(p.detach(), mesh, [placement], src_data_rank=None if p.is_meta else 0)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


# --- the plan -----------------------------------------------------------------------------------------


def _gather_input(mesh):
    def hook(module, args):
        return (gather_tokens(args[0], mesh), *args[1:])

    return hook


def _scatter_output(mesh):
    def hook(module, args, output):
        if isinstance(output, tuple):  # SConv: (y, state); MoE: (y, routing)
            return (scatter_tokens(output[0], mesh), *output[1:])
        return scatter_tokens(output, mesh)

    return hook


def _keep_own_tokens(mesh):
    """After a computation on the all-gathered sequence, each rank keeps its own T/tp tokens."""
    rank, size = mesh.get_local_rank(), mesh.size()

    def hook(module, args, output):
        y = output[0] if isinstance(output, tuple) else output
        mine = y.chunk(size, dim=1)[rank]
        return (mine, *output[1:]) if isinstance(output, tuple) else mine

    return hook


def _global_kv_heads(mesh, num_used: int, num_stored: int, head_dim: int):
    """HeadSlice under tp: gather every rank's stored heads, keep the used heads this rank's
    queries read, [r·K/tp, (r+1)·K/tp)."""
    size, rank = mesh.size(), mesh.get_local_rank()
    per_rank = num_used // size

    def hook(module, args, output):
        x_BTC = args[0].contiguous()  # a positive dim: funcol's view after the gather misreads -1 on a 3-D input
        full_BTC = _waited(funcol.all_gather_single_autograd(x_BTC, gather_dim=x_BTC.dim() - 1, group=mesh))
        return full_BTC[..., rank * per_rank * head_dim : (rank + 1) * per_rank * head_dim]

    return hook


def _scale_aux_loss(size: int):
    """Every tp rank computes the router's balancing loss from the same scores, and both its
    gradient paths (router weight, MoE input) are summed over tp: each rank backpropagates 1/tp."""

    def hook(module, args, routing):
        aux = routing.aux_loss
        if aux is not None:
            routing.aux_loss = aux / size + (aux - aux / size).detach()
        return routing

    return hook


def apply_tensor_parallel(model: nn.Module, mesh, *, expert_parallel: bool = False) -> None:
    """Shard `model` (a MarinForCausalLM, on meta or initialised) over the 1-D tp `mesh`, in place.

    With `expert_parallel` the MoE layers stay on the sequence shard instead (torchtitan's ETP=1):
    every tp rank routes its own T/tp tokens, whose rows expert parallelism sends to the experts'
    ranks; the router, the latent projections and the shared experts are replicated, and the
    output SConv sees the whole sequence (all-gathered, each rank keeping its own tokens after).
    """
    size = mesh.size()
    # A pipeline stage holds the embedding, the head, both or neither.
    if model.embed is not None:
        parallelize_module(model.embed, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
    if model.lm_head is not None:
        if model.config.tie_embeddings and model.embed is not None:
            model.lm_head.weight = model.embed.weight
        else:
            _distribute(model.lm_head, mesh, {"weight": 0})
        model.loss = VocabParallelLoss(model.loss.z_weight, model.loss.chunk_tokens, mesh)
        model.lm_head.register_forward_hook(lambda m, args, out: _GatherReplicated.apply(out, -1, mesh.get_group()))
        _compute_on_local_shards(model.lm_head)
    if model.final_norm is not None:
        model.final_norm.register_forward_hook(lambda m, args, out: gather_tokens(out, mesh))

    for _, block in named_blocks(model):
        attn, mlp = block.attn, block.mlp
        on_shard = expert_parallel and isinstance(mlp, MoE)  # the MoE on this rank's tokens
        attn.register_forward_pre_hook(_gather_input(mesh))
        # The branch outputs are partial sums; SConv (linear) runs on them, then they are scattered.
        (attn if block.sconv_attn is None else block.sconv_attn).register_forward_hook(_scatter_output(mesh))
        if not on_shard:
            mlp.register_forward_pre_hook(_gather_input(mesh))
            (mlp if block.sconv_mlp is None else block.sconv_mlp).register_forward_hook(_scatter_output(mesh))
        elif block.sconv_mlp is not None:  # it mixes each token with the 3 before: the whole sequence
            block.sconv_mlp.register_forward_pre_hook(_gather_input(mesh))
            block.sconv_mlp.register_forward_hook(_keep_own_tokens(mesh))
        if attn.kv_in_use is not None:
            attn.kv_in_use.register_forward_hook(_global_kv_heads(mesh, attn.num_kv, attn.num_kv_stored, attn.head_dim))
        if isinstance(mlp, MoE) and not on_shard:
            mlp.router.register_forward_hook(_scale_aux_loss(size))
        splits = _block_splits(block, split_mlp=not on_shard)
        for module in block.modules():
            if on_shard and isinstance(module, RoutedExperts):
                continue  # expert parallelism places them
            _distribute(module, mesh, splits.get(module, {}))
            _compute_on_local_shards(module)
    for module in (model.embed_norm, model.final_norm):
        for sub in module.modules() if module is not None else ():
            _distribute(sub, mesh, {})
            _compute_on_local_shards(sub)


def _block_splits(block: nn.Module, split_mlp: bool = True) -> dict[nn.Module, dict[str, int]]:
    """The parameters the plan splits, by module: parameter name -> the dim split over tp. The rest
    (norms, GatedNorm, router, latent projections, SConv of the branch outputs; the whole MLP where
    `split_mlp` is False) are replicated."""
    attn = block.attn
    splits: dict[nn.Module, dict[str, int]] = {}
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.gate):  # [heads * Dh, D]: by heads
        _split_linear(splits, proj, 0)
    _split_linear(splits, attn.o_proj, 1)
    for sconv in (attn.sconv_k, attn.sconv_v):
        if sconv is not None:
            splits[sconv] = {"weight": 1}  # [taps, channels]: the channels of this rank's KV heads
    for module in block.modules() if split_mlp else ():
        if isinstance(module, SwiGLU):  # shared experts and dense FFNs, by hidden width
            _split_linear(splits, module.gate_proj, 0)
            _split_linear(splits, module.up_proj, 0)
            _split_linear(splits, module.down_proj, 1)
        elif isinstance(module, RoutedExperts):  # [E, in, hidden] and [E, hidden, in], by hidden width
            splits[module] = {"gate_proj": 2, "up_proj": 2, "down_proj": 1}
            # Fine-tuning's grouped LoRA, x A_e B_e: B by hidden width going in, A coming out.
            names = {"lora_B_gate_proj": 2, "lora_B_up_proj": 2, "lora_A_down_proj": 1}
            splits[module].update({n: d for n, d in names.items() if n in module._parameters})
    return splits


def _split_linear(splits: dict, linear: nn.Module | None, dim: int) -> None:
    """Split `linear`'s weight [out, in] along `dim`. Under a peft LoRA adapter (x A B, scaled) the
    base layer splits so, and so does B for an output split (A then sees the whole input) or A for an
    input split (B then adds to the partial sums the base layer leaves): the rest is replicated."""
    if linear is None:
        return
    if not hasattr(linear, "base_layer"):
        splits[linear] = {"weight": dim}
        return
    splits[linear.base_layer] = {"weight": dim}
    for adapters in (linear.lora_B if dim == 0 else linear.lora_A).values():
        splits[adapters] = {"weight": dim}


# --- the loss on vocabulary shards ----------------------------------------------------------------------


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy and logsumexp of logits split by vocabulary rows over `group`.

    Each rank holds logits [C, V/tp] for vocabulary ids [start, start + V/tp). The maximum, the sum
    of exponentials and the label's logit are reduced over the group, so every rank returns the
    whole-vocabulary values; the gradient each rank returns is that of its own logits.
    """

    @staticmethod
    def forward(ctx, logits_CV, labels_C, start: int, group):
        V = logits_CV.shape[1]
        peak_C = logits_CV.max(dim=1).values
        dist.all_reduce(peak_C, op=dist.ReduceOp.MAX, group=group)
        exp_CV = torch.exp(logits_CV - peak_C.unsqueeze(1))
        sum_C = exp_CV.sum(1)
        local_C = labels_C - start
        mine_C = (local_C >= 0) & (local_C < V) & (labels_C != IGNORE_INDEX)
        index_C = torch.where(mine_C, local_C, torch.zeros_like(local_C))
        target_C = torch.where(mine_C, logits_CV.gather(1, index_C.unsqueeze(1)).squeeze(1), 0.0)
        both = torch.stack([sum_C, target_C])
        dist.all_reduce(both, group=group)
        lse_C = torch.log(both[0]) + peak_C
        nll_C = torch.where(labels_C != IGNORE_INDEX, lse_C - both[1], 0.0)
        ctx.save_for_backward(exp_CV, both[0], index_C, mine_C, labels_C != IGNORE_INDEX)
        return nll_C, lse_C

    @staticmethod
    def backward(ctx, grad_nll_C, grad_lse_C):
        exp_CV, sum_C, index_C, mine_C, counted_C = ctx.saved_tensors
        grad_nll_C = torch.where(counted_C, grad_nll_C, 0.0)  # an ignored token's nll is the constant 0
        softmax_CV = exp_CV / sum_C.unsqueeze(1)
        grad_CV = softmax_CV * (grad_nll_C + grad_lse_C).unsqueeze(1)
        grad_CV.scatter_add_(1, index_C.unsqueeze(1), torch.where(mine_C, -grad_nll_C, 0.0).unsqueeze(1))
        return grad_CV, None, None, None


class VocabParallelLoss(nn.Module):
    """`model.loss.NextTokenLoss` with the LM head's weight split by vocabulary rows (loss
    parallel): the chunks of tokens, checkpointing and the z-loss as there, each chunk's logits
    [C, V/tp] on each rank, never gathered."""

    def __init__(self, z_weight: float, chunk_tokens: int, mesh):
        super().__init__()
        self.z_weight, self.chunk_tokens, self.mesh = z_weight, chunk_tokens, mesh

    def _chunk(self, h_CD, weight_VD, labels_C, start: int):
        logits_CV = nn.functional.linear(h_CD, weight_VD)
        logits_CV = logits_CV.to(compute_dtype(logits_CV))
        nll_C, lse_C = _VocabParallelCrossEntropy.apply(logits_CV, labels_C, start, self.mesh.get_group())
        return nll_C, (lse_C.square() * (labels_C != IGNORE_INDEX)).sum()

    def forward(self, h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor):
        """(ce + z with a gradient, ce, z, counted tokens, per-token cross-entropy [N])."""
        local_VD = local_shard(weight_VD)
        start = self.mesh.get_local_rank() * local_VD.shape[0]
        count = (labels_N != IGNORE_INDEX).sum()
        denominator = count.clamp_min(1).float()
        chunk = self.chunk_tokens or h_ND.shape[0]
        checkpointed = torch.is_grad_enabled() and (h_ND.requires_grad or local_VD.requires_grad)
        nll, z_sums = [], []
        for first in range(0, h_ND.shape[0], chunk):
            args = (h_ND[first : first + chunk], local_VD, labels_N[first : first + chunk], start)
            nll_C, z_C = checkpoint(self._chunk, *args, use_reentrant=False) if checkpointed else self._chunk(*args)
            nll.append(nll_C)
            z_sums.append(z_C)
        nll_N = torch.cat(nll)
        ce = nll_N.sum() / denominator
        z = self.z_weight * torch.stack(z_sums).sum() / denominator
        return ce + z, ce, z, count, nll_N
