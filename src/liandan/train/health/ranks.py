"""What the health checks share: gathering one small row from every rank of a group, and the golden matrix
product run on every rank at once (the host of every rank is the context's `rank_hosts`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from liandan.train.health.golden import golden_matmul, odd_ones_out

if TYPE_CHECKING:
    from liandan.train.context import TrainContext


def gather_rows(row: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """`row` of every rank of `group` (all ranks by default), in the group's rank order, on the CPU."""
    if not dist.is_initialized():
        return [row.cpu()]
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    return [r.cpu() for r in rows]


def golden_suspects(ctx: TrainContext, step: int, size: int) -> tuple[list[int], list[dict]]:
    """Every rank runs the golden matrix product (`golden.py`) in the run's dtype; returns the ranks that got
    it wrong against float64 or whose result's bits differ from the majority's, and every rank's result."""
    result = golden_matmul(ctx.device, ctx.dtype, size=size, seed=step, step=step).as_dict()
    if ctx.dist.distributed:
        results: list[Any] = [None] * ctx.dist.world_size
        dist.all_gather_object(results, result)
    else:
        results = [result]
    wrong = {r for r, got in enumerate(results) if not got["ok"]}
    wrong |= set(odd_ones_out([got["digest"] for got in results]))
    return sorted(wrong), results
