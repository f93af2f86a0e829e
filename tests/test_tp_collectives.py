"""The tensor-parallel sequence collectives on 2 gloo processes: forward values and gradients, for
one row as for several (a one-row all-gather came back as an AsyncCollectiveTensor whose `.wait()`
dropped the autograd graph, so a micro-batch of 1 under TP trained nothing before the head)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from marinlm.parallel.tensor_parallel import gather_tokens, scatter_tokens

from conftest import spawn_ranks

WORLD = 2


def _ranks(rank: int, store: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
        for rows in (1, 3):
            weights = torch.arange(rows * 8 * 4, dtype=torch.float64).view(rows, 8, 4)
            x = torch.full((rows, 4, 4), float(rank + 1), dtype=torch.float64, requires_grad=True)
            y = gather_tokens(x, mesh)  # [rows, 8, 4]: rank 0's tokens, then rank 1's
            (y * weights).sum().backward()
            results[("gather", rows, rank)] = (y.detach(), x.grad, y.requires_grad)
            x = torch.full((rows, 8, 4), float(rank + 1), dtype=torch.float64, requires_grad=True)
            z = scatter_tokens(x, mesh)  # the sum of both ranks, this rank's 4 tokens
            (z * weights[:, :4]).sum().backward()
            results[("scatter", rows, rank)] = (z.detach(), x.grad, z.requires_grad)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict:
    results = mp.Manager().dict()
    spawn_ranks(_ranks, (str(tmp_path_factory.mktemp("tp") / "store"), results), WORLD)
    return dict(results)


@pytest.mark.distributed
@pytest.mark.parametrize("rows", [1, 3])
def test_sequence_gather_and_scatter_keep_the_graph(collected, rows):
    weights = torch.arange(rows * 8 * 4, dtype=torch.float64).view(rows, 8, 4)
    for rank in range(WORLD):
        y, grad, tracked = collected[("gather", rows, rank)]
        assert tracked
        assert torch.equal(y[:, :4], torch.ones(rows, 4, 4, dtype=torch.float64))
        assert torch.equal(y[:, 4:], torch.full((rows, 4, 4), 2.0, dtype=torch.float64))
        # Every rank's loss reads the whole sequence: a token's gradient sums both ranks' weights.
        assert torch.equal(grad, 2 * weights[:, 4 * rank : 4 * rank + 4])
        z, grad, tracked = collected[("scatter", rows, rank)]
        assert tracked and torch.equal(z, torch.full((rows, 4, 4), 3.0, dtype=torch.float64))
        # Backward all-gathers: each input token gets the weight of the rank that kept it.
        assert torch.equal(grad, torch.cat([weights[:, :4], weights[:, :4]], dim=1))
