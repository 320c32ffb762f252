"""The language-model loss in three forms that give the same value and gradients:

- `lm_loss` on whole logits (B, T, V): cross-entropy in fp32, plus the z-loss term;
- the same on logits split over the vocabulary between tensor-parallel ranks (a `DTensor` sharded on its
  last dimension, as a column-parallel head leaves them): every rank computes the log-normaliser and the
  target's logit from its own columns, and only per-token numbers cross ranks, so no rank holds the full
  logits;
- `chunked_lm_loss`, which runs the head itself over slices of the tokens and recomputes each slice in the
  backward pass, so the fp32 logits of a large vocabulary never exist whole on one device.

Nothing here knows about meshes beyond what a DTensor carries; the model calls `lm_loss` and `full_logits`
and gets the right thing whichever way its head was parallelised from outside.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _vocab_sharded(logits: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(logits, DTensor):
        return False
    return logits.placements[-1] == Shard(logits.ndim - 1) or logits.placements[-1] == Shard(-1)


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """Whole logits as a plain tensor, gathered when the head left them split over ranks (inference)."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy in fp32 over targets >= 0 (-1 marks a position without a target), plus
    z_loss * mean(logsumexp(logits)^2), which keeps the softmax normaliser near 1 (PaLM). Logits split over
    the vocabulary (a DTensor sharded on its last dimension) are reduced without being gathered."""
    if _vocab_sharded(logits):
        return _vocab_parallel_loss(logits, targets, z_loss)
    logits = full_logits(logits).float().flatten(0, 1)
    targets = targets.flatten()
    loss = F.cross_entropy(logits, targets, ignore_index=-1)
    if z_loss:
        keep = (targets >= 0).float()
        lse = torch.logsumexp(logits, dim=-1)
        loss = loss + z_loss * (lse.pow(2) * keep).sum() / keep.sum().clamp(min=1)
    # No target at all (a fine-tuning window of prompt tokens alone) is a loss of 0, as in the other forms, not
    # the nan of a mean over nothing; the gradient is 0 either way.
    return torch.where((targets >= 0).any(), loss, 0.0)


# ---------------------------------------------------------------------------------------------------------
# vocabulary-parallel


class _ShardedNormaliser(torch.autograd.Function):
    """(log-normaliser, target logit) per token from this rank's columns of the logits. Both come out equal
    on every rank, so the loss built from them is too, and so is its gradient with respect to them: each
    rank's gradient for its own columns is then softmax * d(lse) plus d(target logit) at the target."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, targets: torch.Tensor, offset: int, group) -> tuple:
        width = local.shape[-1]
        largest = local.detach().amax(dim=-1)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        sum_exp = (local - largest[:, None]).exp().sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        lse = largest + sum_exp.log()
        column = targets - offset
        mine = (column >= 0) & (column < width)
        column = column.clamp(0, width - 1)
        picked = torch.where(mine, local.gather(1, column[:, None]).squeeze(1), 0.0)
        dist.all_reduce(picked, group=group)
        ctx.save_for_backward(local, lse, column, mine)
        return lse, picked

    @staticmethod
    def backward(ctx, grad_lse, grad_picked):
        local, lse, column, mine = ctx.saved_tensors
        grad = torch.zeros_like(local)
        if grad_lse is not None:
            grad = (local - lse[:, None]).exp() * grad_lse[:, None]
        if grad_picked is not None:
            grad.scatter_add_(1, column[:, None], (grad_picked * mine)[:, None])
        return grad, None, None, None


def _vocab_parallel_loss(logits, targets: torch.Tensor, z_loss: float) -> torch.Tensor:
    return _eager_vocab_parallel_loss()(logits, targets, z_loss)


@functools.cache
def _eager_vocab_parallel_loss() -> Callable:
    # The collectives inside run eagerly under a compiled head: the logits' matmul around them still compiles.
    # Wrapped on first use, not at import: torch.compiler.disable imports dynamo, a third of a second in every
    # process that never compiles.
    return torch.compiler.disable(_vocab_parallel_loss_eager)


def _vocab_parallel_loss_eager(logits, targets: torch.Tensor, z_loss: float) -> torch.Tensor:
    mesh = logits.device_mesh
    local = logits.to_local()
    width = local.shape[-1]
    if width * mesh.size() != logits.shape[-1]:
        raise ValueError(
            f"the vocabulary of {logits.shape[-1]} does not split evenly over {mesh.size()} tensor-parallel ranks"
        )
    offset = mesh.get_local_rank() * width
    targets = targets.flatten()
    lse, picked = _ShardedNormaliser.apply(local.float().flatten(0, -2), targets, offset, mesh.get_group())
    return _mean_loss(lse, picked, targets, z_loss)


def _mean_loss(lse: torch.Tensor, picked: torch.Tensor, targets: torch.Tensor, z_loss: float) -> torch.Tensor:
    keep = (targets >= 0).float()
    count = keep.sum().clamp(min=1)
    loss = ((lse - picked) * keep).sum() / count
    if z_loss:
        loss = loss + z_loss * (lse.pow(2) * keep).sum() / count
    return loss


# ---------------------------------------------------------------------------------------------------------
# chunked


def _chunk_sums(head: Callable, hidden: torch.Tensor, targets: torch.Tensor, z_loss: float) -> torch.Tensor:
    logits = head(hidden).float()
    total = F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum")
    if z_loss:
        keep = (targets >= 0).float()
        total = total + z_loss * (torch.logsumexp(logits, dim=-1).pow(2) * keep).sum()
    return total


def chunked_lm_loss(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    z_loss: float,
    chunks: int,
) -> torch.Tensor:
    """`lm_loss(head(hidden), targets, z_loss)` with `head` (final norm and output projection, per token)
    applied to `chunks` slices of the tokens in turn. Each slice's logits are freed as soon as its sums are
    taken and rebuilt in the backward pass (activation checkpointing), so the largest logits tensor alive is
    one slice's. The sums add up in a different order than one cross-entropy over everything: equal to
    rounding (a relative 1e-6 in fp32), not bit for bit."""
    from torch.utils.checkpoint import checkpoint

    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    count = (targets >= 0).sum().clamp(min=1)
    total = torch.zeros((), device=hidden.device)
    for part, part_targets in zip(hidden.chunk(chunks), targets.chunk(chunks), strict=True):
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_sums, head, part, part_targets, z_loss, use_reentrant=False)
        else:
            total = total + _chunk_sums(head, part, part_targets, z_loss)
    return total / count


# ---------------------------------------------------------------------------------------------------------
# fused head and loss


def _fused_pass(
    hidden, weight, targets, z_loss: float, chunks: int, compute_dtype, count, need_grad: bool, softcap: float = 0.0
):
    """(mean loss, grad of hidden, grad of weight (fp32)) of the cross-entropy of `hidden @ weight.T` (soft-capped
    to softcap * tanh(logits / softcap) when `softcap` is not 0), a slice of the tokens at a time; the
    gradients are None unless `need_grad`. The matmuls run in `compute_dtype`, the softmax in fp32, as the
    unfused path does under autocast."""
    h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
    grad_h = torch.empty_like(hidden) if need_grad else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    start = 0
    for part in h.split(-(-h.shape[0] // chunks)):
        rows = slice(start, start + part.shape[0])
        start += part.shape[0]
        part_targets = targets[rows]
        keep = (part_targets >= 0).float()
        column = part_targets.clamp(min=0)[:, None]
        logits = (part @ w.t()).float()
        if softcap:
            squashed = torch.tanh(logits / softcap)
            logits = softcap * squashed
        lse = torch.logsumexp(logits, dim=-1)
        total = total + ((lse - logits.gather(1, column).squeeze(1)) * keep).sum()
        if z_loss:
            total = total + z_loss * (lse.pow(2) * keep).sum()
        if not need_grad:
            continue
        # d/dlogits of (lse - target logit + z lse^2) / count = (softmax (1 + 2 z lse) - onehot) / count
        scale = keep / count
        soft_scale = scale * (1 + 2 * z_loss * lse) if z_loss else scale
        grad = (logits - lse[:, None]).exp_().mul_(soft_scale[:, None])
        grad.scatter_add_(1, column, -scale[:, None])
        if softcap:  # d(c tanh(x / c))/dx = 1 - tanh(x / c)^2
            grad.mul_(1 - squashed.square())
        grad = grad.to(compute_dtype)
        grad_h[rows] = (grad @ w).to(hidden.dtype)
        grad_w += (grad.t() @ part).float()
    return total / count, grad_h, grad_w


class _FusedHeadLoss(torch.autograd.Function):
    """The loss of `_fused_pass` with the gradients it computed in the forward pass: the backward pass only
    scales them, so no logits are kept for it, and none are made twice (`chunked_lm_loss` makes them twice)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, z_loss: float, chunks: int, compute_dtype, count, softcap: float):
        loss, grad_h, grad_w = _fused_pass(hidden, weight, targets, z_loss, chunks, compute_dtype, count, True, softcap)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, (grad_w * grad_out).to(ctx.weight_dtype), None, None, None, None, None, None


def fused_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    z_loss: float,
    chunks: int = 1,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`lm_loss(hidden @ weight.T, targets, z_loss)` for hidden (..., D) and the output projection's weight
    (V, D), the gradients computed with the loss, `chunks` slices of the tokens at a time; the logits
    soft-capped first when `softcap` is not 0 (`liandan.model.llama.softcap`). Under autocast the
    matmuls run in its dtype. Equal to the unfused loss to rounding (the sums add up in another order), not
    bit for bit; deterministic like it. Without gradients (evaluation, replays) the same arithmetic gives the
    same loss."""
    device = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    count = (targets >= 0).sum().clamp(min=1).float()
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _FusedHeadLoss.apply(hidden, weight, targets, z_loss, chunks, compute_dtype, count, softcap)
        return _fused_pass(hidden, weight, targets, z_loss, chunks, compute_dtype, count, False, softcap)[0]
