"""One optimizer step and one validation pass, with the normalisation that keeps them exact.

Loss normalisation: the step's loss is the mean over every loss token of the global batch. Each
micro-batch's mean loss is weighted by its share of the global token count (all-reduced before
any backward), times the world size because FSDP2 averages gradients across ranks. So 1 process
and N processes on the same global batch compute the same gradient, up to summation order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from marinlm.model.router import RouterStats, bin_live, margin_range
from marinlm.parallel import autocast_caches_weights
from marinlm.parallel.distributed import all_reduce_, reduce_together
from marinlm.parallel.pipeline_parallel import PipelinedModel
from marinlm.train.signals import OutOfMemory
from marinlm.utils.device import autocast_context


@dataclass
class StepResult:
    loss: float  # cross-entropy, mean over the global batch's loss tokens
    z_loss: float
    aux_loss: float
    grad_norm: float
    tokens: int  # input tokens processed by all ranks
    loss_tokens: int
    skipped: bool  # NaN/Inf: the update was not applied
    router_stats: list[RouterStats]
    router_layers: list[int] | None = None  # the model's layer number of each (a pipeline stage's); None: 0, 1, ...
    committed: bool = True  # replica groups: False when the quorum did not agree (nothing was applied)
    groups: int = 1  # replica groups that trained this step


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the host's: Python's MemoryError and the CPU allocator's error."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(error, RuntimeError) and ("can't allocate memory" in str(error) or "out of memory" in str(error))


class OutOfMemoryInUpdate(RuntimeError):
    """The optimizer ran out of memory part-way through its update: some weights and moments may
    already hold the new step, so the step cannot be redone from where it was."""


def split_rows(batches: list[dict], pieces: int) -> list[dict]:
    """Each micro-batch cut into `pieces` along its rows (more accumulation, the same global batch)."""
    if pieces == 1:
        return batches
    return [{k: v[i::pieces] for k, v in b.items()} for b in batches for i in range(pieces)]


def total_norm(tensors: list[torch.Tensor], group=None) -> torch.Tensor:
    """The 2-norm of all `tensors` together (fp32 or wider), whole across every rank that holds a
    shard of them. DTensors on different meshes (experts on the expert mesh, the rest on the dense
    one) are reduced mesh by mesh, in the same order on every rank. `group`: ranks holding other
    tensors altogether (pipeline stages), whose squared norms add up."""
    by_mesh: dict = {}
    for t in tensors:
        by_mesh.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    squares = []
    for ts in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(ts)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.double().square())
    square = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    if group is not None:
        all_reduce_(square, group=group)
    return square.sqrt()


def reduce_router_stats(merged: list[RouterStats], group=None, replicas=None) -> list[RouterStats]:
    """Sum counts (and QB histograms) / average means and beta across the ranks of `group` (the
    data-parallel ranks: tensor-parallel ranks route the same tokens), and across the replica
    groups of this step (`replicas`), in place. Margins kept for a live-range histogram are binned
    first, over their range across all of them (a min and a max). Every layer's statistics go
    together: one reduction for the ranges and one for the rest (a dtype), not eight a layer."""

    def reduce_(t, op="sum"):
        all_reduce_(t, op=op, group=group)
        return t if replicas is None else replicas.all_reduce_(t, op)

    world = dist.get_world_size(group) if dist.is_initialized() else 1
    world *= 1 if replicas is None else replicas.participants
    live = [s for s in merged if s.margins is not None]
    if live:  # each range's min as the max of its negation: one max over every layer's
        ranges = torch.stack([torch.stack([-lo, hi]) for lo, hi in (margin_range(s.margins) for s in live)])
        reduce_(ranges, "max")
        for s, (negative_lo, hi) in zip(live, ranges):
            bin_live(s, -negative_lo, hi)
    if world > 1:
        means = [t for s in merged for t in (s.z_loss, s.beta) if t is not None]
        sums = [t for s in merged for t in (s.load, s.dropped, s.num_tokens, s.hist) if t is not None]
        reduce_together(sums + means, reduce_)
        torch._foreach_div_(means, world)
    return merged


def forward_backward(model, batches, *, device, precision, global_tokens: int, world_size: int):
    """Forward and backward over the rank's micro-batches, the loss of each weighted by its share of
    the global batch's loss tokens. Returns the fp64 sums (ce x tokens, z x tokens, aux) and the
    merged router statistics.

    Nothing here waits for the device: each share is counted on the host batch, and the sums stay
    on the device until the last backward is queued (a wait per micro-batch would leave a GPU idle
    while the host queues the next one's kernels)."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # fp64 so that fp64 runs log exactly
    # Merged as we go: at hero size one forward's QB histograms alone are ~0.7 GB.
    router_stats: list[RouterStats] = []
    fsdp = isinstance(model, FSDPModule)
    cache = autocast_caches_weights(model)
    for i, batch in enumerate(batches):
        if fsdp:  # reduce-scatter gradients only after the last micro-batch
            model.set_requires_gradient_sync(i == len(batches) - 1)
        ids = batch["input_ids"].to(device)
        with autocast_context(device, precision, cache):
            out = model(ids, batch["segment_ids"].to(device), batch["labels"].to(device), return_logits=False)
        tokens = int(batch["loss_mask"].sum())  # out.num_tokens, counted as global_tokens is, without the wait
        loss = out.lm_loss * (tokens / max(global_tokens, 1)) * world_size + out.aux_loss / len(batches)
        loss.backward()
        ce, z, aux = (t.detach().double() for t in (out.ce_loss, out.z_loss, out.aux_loss))
        sums += torch.stack([ce * tokens, z * tokens, aux / len(batches)])
        router_stats = merge_router_stats(router_stats, [s.detach() for s in out.router_stats], i)
    return sums.cpu(), router_stats


def merge_router_stats(merged: list[RouterStats], fresh: list[RouterStats], seen: int) -> list[RouterStats]:
    """`merged` (over `seen` forwards so far) with one more forward's statistics."""
    return fresh if seen == 0 else [RouterStats.merge([a, b], [seen, 1]) for a, b in zip(merged, fresh)]


def train_step(
    model,
    optimizer,
    batches: list[dict],
    *,
    device,
    precision: str,
    grad_clip: float | None,
    world_size: int,
    group=None,
    router_group=None,
    replicas=None,
) -> StepResult:
    """Forward/backward over the rank's micro-batches, then clip, guard and update.

    `world_size` counts the data-parallel ranks (each holding other rows), `group` is theirs (None:
    every rank); tensor-parallel ranks hold the same rows and count once. `replicas`: this step's
    fault-tolerant replica groups (parallel/fault_tolerance.py), over which the token count, loss
    sums, gradients and router statistics are reduced too, as HSDP's replicas would be; the update
    is applied only if every group in the quorum commits.
    """
    local_loss_tokens = sum(int(b["loss_mask"].sum()) for b in batches)
    count = all_reduce_(torch.tensor(float(local_loss_tokens)), group=group)
    groups = 1
    if replicas is not None:
        groups = replicas.participants
        world_size *= groups  # FSDP2 averages inside a group, the groups average across
        replicas.all_reduce_(count)
    global_loss_tokens = int(count.item())
    kwargs = dict(device=device, precision=precision, global_tokens=global_loss_tokens, world_size=world_size)
    pipelined = isinstance(model, PipelinedModel)
    if pipelined:  # a pipeline runs its schedule
        sums, router_stats = model.forward_backward(batches, **kwargs)
        layers = model.router_layers
    else:
        layers = None
        sums, router_stats = forward_backward(model, batches, **kwargs)
    all_reduce_(sums, group=group)
    params = [p for p in model.parameters() if p.grad is not None]
    if replicas is not None:
        replicas.all_reduce_(sums)
        replicas.average_gradients(params)
    grad_norm = total_norm([p.grad for p in params], model.pp_group if pipelined else None)  # stages hold other weights
    loss = sums[0].item() / max(global_loss_tokens, 1)
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm.item()))
    stats = reduce_router_stats(router_stats, router_group or group, replicas) if router_stats else []
    committed = replicas is None or replicas.should_commit()  # every step votes, a skipped one too
    if not skipped and committed:
        if grad_clip is not None:
            coefficient = min(1.0, grad_clip / (grad_norm.item() + 1e-6))  # as torch's clip_grad_norm_
            if coefficient < 1.0:
                for p in params:  # one by one: DTensors on different meshes take no foreach op together
                    p.grad.mul_(coefficient)
        try:
            optimizer.step()
        except BaseException as e:
            if is_out_of_memory(e):
                raise OutOfMemoryInUpdate(str(e)) from e
            raise
    optimizer.zero_grad(set_to_none=True)
    if not skipped and committed and stats:
        # The QB beta of this step becomes the bias of the next (and lands in the next checkpoint).
        unwrap(model).update_router_biases(stats)
    tokens = sum(b["input_ids"].numel() for b in batches) * world_size
    return StepResult(
        loss,
        sums[1].item() / max(global_loss_tokens, 1),
        sums[2].item() / world_size,
        grad_norm.item(),
        tokens,
        global_loss_tokens,
        skipped,
        stats,
        layers,
        committed,
        groups,
    )


class StepWithinMemory:
    """One optimizer step over a step's micro-batches (`train_step` with `how`); out of memory
    before the update, the step is abandoned and, with `train.oom_retry`, redone with each
    micro-batch cut in two, down to one row (`pieces` stays for the rest of the run); inside the
    update (weights maybe half updated, and fewer rows would not help), the run stops. Replica
    groups do not retry: the other groups would not redo the step."""

    def __init__(self, model, stepper, optimizer, config, dims, how: dict):
        """`dims`: the layout (mesh.ParallelDims), whose data-parallel ranks reduce the step."""
        self.model, self.stepper, self.optimizer, self.config = model, stepper, optimizer, config
        self.how = how | dict(world_size=dims.batch_world, group=dims.batch_group, router_group=dims.router_group)
        self.pieces = 1

    def __call__(self, micro: list[dict], step: int, on_retry) -> StepResult:
        """Step number `step` over `micro`; `on_retry(rows)` is told of each retry at fewer rows."""
        c = self.config
        while True:
            batches = split_rows(micro, self.pieces)
            try:
                return train_step(self.model, self.stepper, batches, **self.how)
            except BaseException as e:
                if isinstance(e, OutOfMemoryInUpdate):
                    raise OutOfMemory(
                        f"out of memory in the optimizer update of step {step}: some weights may hold the new step, "
                        "so it is not redone and nothing more is saved; resume (--resume auto) with "
                        "parallel.offload: optimizer or more data_parallel_shard ranks to shard the optimizer state"
                    ) from None
                if not is_out_of_memory(e):
                    raise
                self.optimizer.zero_grad(set_to_none=True)  # the partial gradients go; weights were not touched
                rows = batches[0]["input_ids"].shape[0]
                if not c.train.oom_retry or rows == 1 or self.how.get("replicas"):
                    retry = "" if c.train.oom_retry else "set train.oom_retry: true to retry it with fewer rows, or "
                    raise OutOfMemory(
                        f"out of memory in step {step} at {rows} rows per forward "
                        f"(train.micro_batch {c.train.micro_batch or 'auto'}, parallel.activation_checkpointing "
                        f"{c.parallel.activation_checkpointing}): {retry}lower train.micro_batch or set "
                        "parallel.activation_checkpointing: full"
                    ) from None
                self.pieces *= 2
                on_retry(rows, len(batches) * 2)


def unwrap(model):
    """The MarinForCausalLM inside (FSDP2 keeps the class; compile/AC wrap only blocks)."""
    return getattr(model, "_orig_mod", model)


def param_norm(model) -> float:
    """The global norm of the floating-point weights (a 4-bit QLoRA base stores bytes: left out)."""
    return total_norm([p for p in model.parameters() if p.is_floating_point()]).item()


def validate(model, batches, *, device, precision: str, group=None) -> dict[str, float]:
    """Mean loss per token and bits per byte over the given held-out batches (summed over `group`'s ranks)."""
    return _val_metrics(_val_totals(model, batches, device=device, precision=precision, group=group))


def validate_sources(
    model,
    sources: dict,
    batch_size: int,
    max_rows: int | None,
    rank: int,
    world_size: int,
    *,
    device,
    precision: str,
    group=None,
    progress: bool = False,
) -> dict[str, float]:
    """Validation over each source's held-out rows (`dataset.validation_sources`, `max_rows` of each):
    `val/loss`, `val/bpb` and `val/tokens` over all of them together, and with several sources
    `val/NAME/...` for each, so that a mixture shows which of its data the model learns. With
    `progress`, a bar with an ETA over the batches (a whole split takes minutes on a CPU)."""
    from marinlm.dataset.loader import validation_batches
    from marinlm.utils.progress import progress_bar

    def rows(source) -> int:
        return source.rows_per_epoch if max_rows is None else min(max_rows, source.rows_per_epoch)

    batches = sum(math.ceil(math.ceil(rows(s) / world_size) / batch_size) for s in sources.values())
    what = "validation" if max_rows is None else f"validation, at most {max_rows} rows a source"
    with progress_bar(total=batches, desc=what, unit="batch", disable=not progress) as bar:
        totals = {
            name: _val_totals(
                model,
                _ticking(validation_batches(source, batch_size, max_rows, rank, world_size), bar),
                device=device,
                precision=precision,
                group=group,
            )
            for name, source in sources.items()
        }
    metrics = _val_metrics(sum(totals.values()))
    if len(totals) > 1:
        for name, t in totals.items():
            metrics.update(_val_metrics(t, f"val/{name}"))
    return metrics


def _ticking(batches, bar):
    for batch in batches:
        yield batch
        bar.update(1)


def _val_metrics(totals: torch.Tensor, prefix: str = "val") -> dict[str, float]:
    nats, tokens, num_bytes = totals.tolist()
    return {
        f"{prefix}/loss": nats / max(tokens, 1),
        f"{prefix}/bpb": nats / (math.log(2) * max(num_bytes, 1)),
        f"{prefix}/tokens": tokens,
    }


@torch.no_grad()
def _val_totals(model, batches, *, device, precision: str, group=None) -> torch.Tensor:
    """Summed nats, tokens and bytes over the batches (all ranks).

    The loss goes through the model's fused, chunked LM head as in training (model/loss.py): the
    [B, T, V] logits are never held. For the hero shape, 8 rows of 4,096 tokens and a 128k
    vocabulary, they would be 8.4 GB in bf16, and an fp32 log-softmax of them 2 x 16.8 GB more,
    on top of the training state, at every validation.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # nats, tokens, bytes
    for batch in batches:
        with autocast_context(device, precision):
            out = model(
                batch["input_ids"].to(device),
                batch["segment_ids"].to(device),
                batch["labels"].to(device),
                return_logits=False,
            )
        totals += torch.tensor(
            [float(out.token_ce.double().sum()), float(out.num_tokens), float(batch["byte_weights"].double().sum())],
            dtype=torch.float64,
        )
    all_reduce_(totals, group=group)
    model.train(was_training)
    return totals
