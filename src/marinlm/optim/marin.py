"""The hero recipe's optimizer: MuonH on matrices, AdamH on the LM head, Adam on the rest.

- **MuonH**: momentum 0.95 with Nesterov (`buf = mu*buf + g`, direction `mu*buf + g`), then 5
  quintic Newton-Schulz steps per matrix (per expert for stacked [E, in, out] experts; computed
  batched over same-shaped matrices), then the hyperball step
  `W' = W - lr * U * ||W||_F / ||U||_F`, rescaled to keep `||W||_F`.
- **AdamH**: the Adam direction (bias-corrected) with the same norm-preserving step.
- **Adam**: plain Adam at its own learning rate.
- **Muon** (`matrix_update: muon`, the widely used variant beside MuonH): the same momentum and
  Newton-Schulz direction, then `W' = W·(1 - lr·wd) - lr·0.2·sqrt(max(rows, cols))·U`, the scale
  that gives the update the RMS of AdamW's (Liu et al., "Muon is Scalable for LLM Training",
  arXiv 2502.16982).
- **Decoupled weight decay** (`weight_decay`): `W *= 1 - lr·wd` before the step, on Muon matrices and
  on the Adam group's matrices (embeddings, router), as AdamW; the hyperball steps keep each
  matrix's norm, so they take none.

Works on plain tensors and on FSDP2 `DTensor` parameters. Newton-Schulz needs whole matrices, so
a matrix sharded along one of its own two dims is all-gathered, orthogonalised on every rank (the
same result everywhere) and sliced back; stacked experts sharded along the expert dim are already
whole on their rank and need no communication. Norms of sharded matrices are all-reduced. There is
never a per-shard orthogonalisation.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

# Newton-Schulz coefficients (a, b, c) of X <- a·X + (b·G + c·G²)·X, G = X·Xᵀ: one triple per
# iteration, cycled. `quintic_schedule` is levanter's "quintic" set (levanter/optim/util.py,
# NEWTON_SCHULZ_COEFFICIENTS), the one Marin's hero MuonH runs (experiments/grug/moe_hero_ep/
# grugmuon_hero.py, coefficient_type="quintic"); `simple` is Keller Jordan's single triple
# (https://kellerjordan.github.io/posts/muon/), levanter's "simple" and most Muon code's.
NS_SCHEDULES = {
    "quintic_schedule": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "simple": ((3.4445, -4.7750, 2.0315),),
}


def newton_schulz(
    g: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype=torch.float32, schedule: str = "simple"
) -> torch.Tensor:
    """Approximately orthogonalise each matrix in the last two dims (batched over leading dims),
    in `dtype`, with the coefficients of `schedule` (`NS_SCHEDULES`)."""
    coefficients = NS_SCHEDULES[schedule]
    x = g.to(dtype)
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + eps)
    if x.ndim > 3:
        x = x.reshape(-1, *x.shape[-2:])
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:
        x = x.mT
    # Each step as Marin spells it, X <- a·X + B·X with B = b·G + c·G²: two fused multiply-adds
    # (addmm's beta·input + alpha·product). Folding a·I into B's diagonal instead rounds a + b·G_ii
    # to 8 bits in bf16, which pushed singular values past 1.04.
    addmm = torch.baddbmm if x.ndim == 3 else torch.addmm
    for i in range(steps):
        a, b, c = coefficients[i % len(coefficients)]
        gram = x @ x.mT
        poly = addmm(gram, gram, gram, beta=b, alpha=c)
        x = addmm(x, poly, x, beta=a)
    return (x.mT if transpose else x).reshape(g.shape).to(g.dtype)


def ns_batch_elements(device: torch.device) -> int:
    """How many elements one batched Newton-Schulz call may stack.

    On a CPU a stack of every layer's experts falls out of cache and runs slower than one matrix
    at a time, while a stack of small matrices runs faster: a batch stays near cache size. On a
    GPU a step of small matrices is bound by kernel launches, so batches are large
    (`python bench/muon_step.py`; its readings are in docs/performance.md).
    """
    return 1 << 26 if device.type == "cuda" else 1 << 21


def newton_schulz_many(
    matrices: list[torch.Tensor],
    steps: int = 5,
    dtype=torch.float32,
    max_elements: int | None = None,
    schedule: str = "simple",
    eps: float = 1e-7,
) -> list[torch.Tensor]:
    """`newton_schulz` of each tensor, computed batched over tensors of the same matrix shape.

    Same result per matrix as calling it one by one (each matrix is normalised on its own); fewer,
    larger matmuls. A model has few distinct matrix shapes (7 for the 80 matrices of `tiny`). A
    batch holds at most `max_elements` elements (default: `ns_batch_elements`), which also bounds
    the optimizer's extra memory at scale; a single larger tensor goes alone.
    """
    out: list[torch.Tensor | None] = [None] * len(matrices)
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(matrices):
        groups.setdefault((tuple(m.shape[-2:]), m.dtype, m.device), []).append(i)
    for (shape, _, device), members in groups.items():
        limit = ns_batch_elements(device) if max_elements is None else max_elements
        batch: list[int] = []
        size = 0
        for n, i in enumerate(members):
            batch.append(i)
            size += matrices[i].numel()
            if n < len(members) - 1 and size + matrices[members[n + 1]].numel() <= limit:
                continue
            if len(batch) == 1:  # nothing to stack: no copy
                out[i] = newton_schulz(matrices[i], steps, eps, dtype, schedule)
            else:
                stacked = torch.cat([matrices[j].reshape(-1, *shape) for j in batch])
                counts = [matrices[j].numel() // (shape[0] * shape[1]) for j in batch]
                for j, piece in zip(batch, newton_schulz(stacked, steps, eps, dtype, schedule).split(counts)):
                    out[j] = piece.reshape(matrices[j].shape)
            batch, size = [], 0
    return out


def _splits_matrix(placement, ndim: int) -> bool:
    """Whether a placement splits one of the last two (matrix) dims. FSDP2 over tensor parallel
    places `_StridedShard`, which in torch 2.13 is neither a `Shard` subclass nor `is_shard()`."""
    return isinstance(placement, Shard | _StridedShard) and placement.dim % ndim >= ndim - 2


def _matrix_sharded(p: torch.Tensor) -> bool:
    """True when a DTensor is split along one of its last two (matrix) dims."""
    if not isinstance(p, DTensor):
        return False
    return any(_splits_matrix(pl, p.ndim) for pl in p.placements)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _frobenius(locals_: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-matrix Frobenius norms [..., 1, 1] (fp32; fp64 for fp64) of (possibly sharded)
    parameter-shaped tensors: the squares of sharded matrices summed over the mesh axes that split
    them (HSDP: dp_shard), in one all-reduce per group of ranks and dtype for the whole list."""
    norms, pending = [], {}
    for i, (local, param) in enumerate(zip(locals_, params)):
        dtype = torch.float64 if local.dtype == torch.float64 else torch.float32
        norms.append(torch.linalg.vector_norm(local, dim=(-2, -1), keepdim=True, dtype=dtype))
        if _matrix_sharded(param):
            axes = tuple(a for a, pl in enumerate(param.placements) if _splits_matrix(pl, param.ndim))
            groups = tuple(param.device_mesh.get_group(a) for a in axes)
            pending.setdefault((groups, dtype), []).append(i)
    for (groups, _), members in pending.items():  # the same order on every rank: the parameters'
        squares = torch.cat([norms[i].square().flatten() for i in members])
        for group in groups:
            dist.all_reduce(squares, group=group)
        for i, sq in zip(members, squares.split([norms[i].numel() for i in members])):
            norms[i] = sq.view_as(norms[i]).sqrt()
    return norms


def _hyperball_steps(params: list[torch.Tensor], updates: list[torch.Tensor], lr: float) -> None:
    """W <- normalise(W - lr * U * |W| / |U|) * |W|, per matrix, in place on each local shard
    (`updates`: the shards' updates).

    On fp32 weights the step runs in place: five passes over the matrix (three norms, one
    multiply-add, one scale) and no temporaries. The norms of all the matrices are reduced
    together, three all-reduces in all, not three a sharded matrix.
    """
    weights = [_local(p) for p in params]
    new = [w if w.dtype in (torch.float32, torch.float64) else w.float() for w in weights]
    w_norms = _frobenius(new, params)
    for n, u, w_norm, u_norm in zip(new, updates, w_norms, _frobenius(updates, params)):
        n.addcmul_(u, w_norm / u_norm.clamp_min(1e-10), value=-lr)
    for n, w_norm, n_norm in zip(new, w_norms, _frobenius(new, params)):
        n.mul_(w_norm / n_norm.clamp_min(1e-10))
    for n, w in zip(new, weights):
        if n is not w:
            w.copy_(n)


def _gather(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The whole matrix of a parameter-shaped local shard (all ranks of the parameter's mesh)."""
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    ).full_tensor()


def _gather_many(locals_: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
    """`_gather` of each local shard: those cut along dim 0 over one mesh axis and replicated over
    any others (FSDP2's layout, and HSDP's) through one all-gather a group of ranks and dtype,
    each shard padded to the even cut's rows as FSDP2 pads it; any other layout on its own."""
    out: list[torch.Tensor | None] = [None] * len(params)
    batches: dict = {}
    for i, (local, p) in enumerate(zip(locals_, params)):
        cut = [axis for axis, pl in enumerate(p.placements) if not pl.is_replicate()]
        placement = p.placements[cut[0]] if len(cut) == 1 else None
        if type(placement) is Shard and placement.dim == 0:
            batches.setdefault((p.device_mesh.get_group(cut[0]), local.dtype, local.device), []).append(i)
        else:
            out[i] = _gather(local, p)
    for (group, _, _), members in batches.items():  # the same order on every rank: the parameters'
        ranks = dist.get_world_size(group)
        rows = [-(-params[i].shape[0] // ranks) for i in members]
        widths = [math.prod(params[i].shape[1:]) for i in members]
        pieces = []
        for i, r, width in zip(members, rows, widths):
            padded = locals_[i].new_zeros(r, width)
            padded[: locals_[i].shape[0]] = locals_[i].reshape(locals_[i].shape[0], width)
            pieces.append(padded.reshape(-1))
        flat = torch.cat(pieces)
        gathered = flat.new_empty(ranks * flat.numel())
        dist.all_gather_single(gathered, flat, group=group)
        offset = 0
        for i, r, width in zip(members, rows, widths):
            rank_rows = gathered.view(ranks, -1)[:, offset : offset + r * width].reshape(ranks * r, width)
            out[i] = rank_rows[: params[i].shape[0]].reshape(params[i].shape)
            offset += r * width
    return out


def _muon_step(p: torch.Tensor, update_local: torch.Tensor, lr: float, weight_decay: float) -> None:
    """W <- W·(1 - lr·wd) - lr·0.2·sqrt(max(rows, cols))·U on the local shard (U from Newton-Schulz)."""
    w = _local(p)
    if weight_decay:
        w.mul_(1 - lr * weight_decay)
    rows, cols = p.shape[-2:]
    w.add_(update_local.to(w.dtype), alpha=-lr * 0.2 * max(rows, cols) ** 0.5)


class MarinOptimizer(torch.optim.Optimizer):
    """One optimizer over param groups tagged `kind` = "muonh", "adamh" or "adam".

    Group options: lr, betas, eps, momentum, nesterov, ns_steps, ns_dtype, ns_schedule, ns_eps. Learning-rate schedules
    scale each group's `lr` (LambdaLR), so MuonH/AdamH and Adam keep their own peaks.
    """

    WINDOW_ELEMENTS = 1 << 26  # gathered MuonH matrices held at once (256 MB in fp32)

    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float,
        adam_lr: float,
        betas=(0.9, 0.95),
        eps=1e-8,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        ns_dtype=torch.float32,
        ns_schedule="simple",
        ns_eps=1e-7,
        weight_decay=0.0,
    ):
        defaults = dict(
            weight_decay=weight_decay,
            lr=lr,
            betas=betas,
            eps=eps,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            ns_schedule=ns_schedule,
            ns_eps=ns_eps,
            kind="adam",
        )
        for group in groups:
            if group["kind"] not in ("muonh", "muon", "adamh", "adam"):
                raise ValueError(f"unknown parameter group kind {group['kind']!r}")
            group.setdefault("lr", adam_lr if group["kind"] == "adam" else lr)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MarinOptimizer does not take a closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["kind"] in ("muonh", "muon"):
                self._muonh(params, group)
            elif group["kind"] == "adamh":
                _hyperball_steps(params, self._adam_directions(params, group), group["lr"])
            else:
                directions = self._adam_directions(params, group)
                decayed = [_local(p) for p in params if p.ndim >= 2]
                if group["weight_decay"] and decayed:
                    torch._foreach_mul_(decayed, 1 - group["lr"] * group["weight_decay"])
                torch._foreach_add_([_local(p) for p in params], directions, alpha=-group["lr"])

    def _muonh(self, params: list[torch.Tensor], group: dict) -> None:
        """Momentum, Newton-Schulz batched over same-shaped matrices, hyperball step.

        Parameters go through in windows of about `WINDOW_ELEMENTS` gathered elements: a matrix
        sharded along its own dims is all-gathered whole, and holding every gathered matrix of a
        hero-sized model at once would not fit; one window at a time does.
        """
        window: list[torch.Tensor] = []
        size = 0
        for n, p in enumerate(params):
            window.append(p)
            # Experts sharded along the expert dim are whole matrices on their rank already.
            size += p.numel() if _matrix_sharded(p) else _local(p).numel()
            if size < self.WINDOW_ELEMENTS and n < len(params) - 1:
                continue
            directions = self._muon_directions(window, group)
            updates = newton_schulz_many(
                directions,
                group["ns_steps"],
                dtype=group["ns_dtype"],
                schedule=group["ns_schedule"],
                eps=group["ns_eps"],
            )
            shards = []
            for q, u in zip(window, updates):
                if _matrix_sharded(q):
                    u = distribute_tensor(u, q.device_mesh, q.placements, src_data_rank=None).to_local()
                # Under FSDP2 CPU offload the parameter lives on the host while the gathered
                # matrix comes back on the mesh's GPU (where Newton-Schulz is fast).
                shards.append(u.to(_local(q).device))
            if group["kind"] == "muon":
                for q, u in zip(window, shards):
                    _muon_step(q, u, group["lr"], group["weight_decay"])
            else:
                _hyperball_steps(window, shards, group["lr"])
            window, size = [], 0

    def _muon_directions(self, params: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """`buf = mu*buf + g`, then the direction `g + mu*buf` (Nesterov) or `buf`: whole matrices.

        One foreach op per term over all the parameters (on their local shards), not one op per
        parameter: `tiny` has 80 MuonH matrices, and each small op costs its own dispatch.
        """
        mu = group["momentum"]
        bufs, grads = [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum"] = torch.zeros_like(p)
            bufs.append(_local(state["momentum"]))
            grads.append(_local(p.grad))
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        directions = list(torch._foreach_add(grads, bufs, alpha=mu) if group["nesterov"] else bufs)
        sharded = [i for i, p in enumerate(params) if _matrix_sharded(p)]
        for i, whole in zip(sharded, _gather_many([directions[i] for i in sharded], [params[i] for i in sharded])):
            directions[i] = whole
        return directions

    def _adam_directions(self, params: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """The bias-corrected Adam direction `m_hat / (sqrt(v_hat) + eps)` of each parameter's local shard.

        One foreach op per term over the group. The bias corrections stay per parameter: one that
        had no gradient in some step has counted fewer steps (as in torch.optim.Adam).
        """
        beta1, beta2 = group["betas"]
        exp_avgs, exp_avg_sqs, grads, steps = [], [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            grads.append(_local(p.grad))
            # The step count lives beside the moments it corrects (a checkpoint loaded by torch's
            # load_state_dict brings it to the host), so that no step reads a value back.
            step = state.get("step", torch.zeros((), dtype=torch.float64))
            if step.device != exp_avgs[-1].device or step.dtype != torch.float64:
                step = step.to(exp_avgs[-1].device, torch.float64)
            state["step"] = step
            steps.append(step)
        torch._foreach_add_(steps, 1.0)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denominators = torch._foreach_div(exp_avg_sqs, _bias_corrections(beta2, steps))
        torch._foreach_sqrt_(denominators)
        torch._foreach_add_(denominators, group["eps"])
        directions = torch._foreach_div(exp_avgs, _bias_corrections(beta1, steps))
        torch._foreach_div_(directions, denominators)
        return directions


def _bias_corrections(beta: float, steps: list[torch.Tensor]) -> list[torch.Tensor]:
    """1 - beta^t for each step count t, computed where the counts live."""
    powers = torch._foreach_pow(beta, steps)
    torch._foreach_neg_(powers)
    torch._foreach_add_(powers, 1.0)
    return powers


def marin_param_kinds(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """Split parameters the way the hero recipe does.

    adam: input embedding, router weights, head gates, 1-D gains, SConv kernels.
    adamh: the LM head (untied).
    muonh: every other matrix (attention, routed/shared/dense experts, latent projections, GatedNorm).
    """
    kinds: dict[str, list] = {"muonh": [], "adamh": [], "adam": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            kinds[param_kind(name, p.ndim)].append((name, p))
    return kinds


def param_kind(name: str, ndim: int) -> str:
    """The hero recipe's kind of the parameter `name` with `ndim` dims (`marin_param_kinds`)."""
    if name.startswith("lm_head."):
        return "adamh"
    if name.startswith("embed.") or ".router." in name or name.endswith("attn.gate.weight") or ".sconv" in name:
        return "adam"
    return "adam" if ndim < 2 else "muonh"
