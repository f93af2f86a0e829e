"""The hero recipe's optimizer: MuonH on matrices, AdamH on the LM head, Adam on the rest.

- **MuonH**: momentum 0.95 with Nesterov (`buf = mu*buf + g`, direction `mu*buf + g`), then 5
  quintic Newton-Schulz steps per matrix (per expert for stacked [E, in, out] experts), then the
  hyperball step `W' = W - lr * U * ||W||_F / ||U||_F`, rescaled to keep `||W||_F`.
- **AdamH**: the Adam direction (bias-corrected) with the same norm-preserving step.
- **Adam**: plain Adam (no weight decay) at its own learning rate.

Works on plain tensors and on FSDP2 `DTensor` parameters. Newton-Schulz needs whole matrices, so
a matrix sharded along one of its own two dims is all-gathered, orthogonalised on every rank (the
same result everywhere) and sliced back; stacked experts sharded along the expert dim are already
whole on their rank and need no communication. Norms of sharded matrices are all-reduced. There is
never a per-shard orthogonalisation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

# Keller Jordan's quintic Newton-Schulz coefficients (https://kellerjordan.github.io/posts/muon/)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype=torch.float32) -> torch.Tensor:
    """Approximately orthogonalise each matrix in the last two dims (batched over leading dims)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + eps)
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if transpose else x).to(g.dtype)


def _matrix_sharded(p: torch.Tensor) -> bool:
    """True when a DTensor is split along one of its last two (matrix) dims."""
    if not isinstance(p, DTensor):
        return False
    return any(isinstance(pl, Shard) and pl.dim % p.ndim >= p.ndim - 2 for pl in p.placements)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _frobenius(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Per-matrix Frobenius norms [..., 1, 1] of a (possibly sharded) parameter-shaped tensor."""
    sq = local.float().pow(2).sum(dim=(-2, -1), keepdim=True)
    if _matrix_sharded(param):
        dist.all_reduce(sq, group=param.device_mesh.get_group())
    return sq.sqrt()


def _hyperball_step(p: torch.Tensor, update_local: torch.Tensor, lr: float) -> None:
    """W <- normalise(W - lr * U * |W| / |U|) * |W|, per matrix, in place on the local shard."""
    w = _local(p)
    w_norm = _frobenius(w, p)
    u_norm = _frobenius(update_local, p)
    new = w.float() - lr * update_local.float() * (w_norm / u_norm.clamp_min(1e-10))
    new_norm = _frobenius(new, p)
    w.copy_(new * (w_norm / new_norm.clamp_min(1e-10)))


class MarinOptimizer(torch.optim.Optimizer):
    """One optimizer over param groups tagged `kind` = "muonh", "adamh" or "adam".

    Group options: lr, betas, eps, momentum, nesterov, ns_steps, ns_dtype. Learning-rate schedules
    scale each group's `lr` (LambdaLR), so MuonH/AdamH and Adam keep their own peaks.
    """

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
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            kind="adam",
        )
        for group in groups:
            if group["kind"] not in ("muonh", "adamh", "adam"):
                raise ValueError(f"unknown parameter group kind {group['kind']!r}")
            group.setdefault("lr", adam_lr if group["kind"] == "adam" else lr)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MarinOptimizer does not take a closure"
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                {"muonh": self._muonh, "adamh": self._adamh, "adam": self._adam}[group["kind"]](p, group)

    def _muonh(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["momentum"] = torch.zeros_like(p)
        buf = state["momentum"]
        mu = group["momentum"]
        buf.mul_(mu).add_(p.grad)
        direction = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf
        if _matrix_sharded(p):
            full = direction.full_tensor()
            u = newton_schulz(full, group["ns_steps"], dtype=group["ns_dtype"])
            u_local = distribute_tensor(u, p.device_mesh, p.placements, src_data_rank=None).to_local()
        else:
            u_local = newton_schulz(_local(direction), group["ns_steps"], dtype=group["ns_dtype"])
        # Under FSDP2 CPU offload the parameter lives on the host while the gathered matrix comes
        # back on the mesh's GPU (where Newton-Schulz is fast): the step itself is on the host.
        _hyperball_step(p, u_local.to(_local(p).device), group["lr"])

    def _adam_direction(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = state["step"].item()
        m, v, g = _local(state["exp_avg"]), _local(state["exp_avg_sq"]), _local(p.grad)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
        return (m / (1 - beta1**t)) / denom

    def _adamh(self, p: torch.Tensor, group: dict) -> None:
        _hyperball_step(p, self._adam_direction(p, group), group["lr"])

    def _adam(self, p: torch.Tensor, group: dict) -> None:
        _local(p).add_(self._adam_direction(p, group), alpha=-group["lr"])


def marin_param_kinds(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """Split parameters the way the hero recipe does.

    adam: input embedding, router weights, head gates, 1-D gains, SConv kernels.
    adamh: the LM head (untied).
    muonh: every other matrix (attention, routed/shared/dense experts, latent projections, GatedNorm).
    """
    kinds: dict[str, list] = {"muonh": [], "adamh": [], "adam": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith("lm_head."):
            kind = "adamh"
        elif (
            name.startswith("embed.")
            or ".router." in name
            or name.endswith("attn.gate.weight")
            or ".sconv" in name
            or p.ndim < 2
        ):
            kind = "adam"
        else:
            kind = "muonh"
        kinds[kind].append((name, p))
    return kinds
