"""Context parallelism (`parallel.cp`): each sequence split over the `cp` ranks of the mesh's "cp" dim, attention
by PyTorch's ring attention (`torch.distributed.tensor.experimental.context_parallel`).

The cp ranks of one data-parallel rank read the same micro-batch. Inside `sequence_split`, PyTorch's
`context_parallel` reorders its inputs, targets and rotary positions in the causal load-balancing order (the
sequence cut into 2 x cp equal chunks, rank r keeping chunks r and 2cp-1-r: an early chunk with little of the
causal triangle to compute and a late one with much, the same amount on every rank), keeps this rank's share,
and routes SDPA to the ring, which passes the keys and values round the cp ranks; the forward and the backward
both run inside it. The positions travel with the tokens, so each token is rotated by its place in the whole
sequence.

Each rank's loss is the mean over its own tokens, weighted by its share of the micro-batch's counted targets
(times cp): FSDP2's gradient average over dp_shard x cp then makes the gradient of the whole sequence's mean,
and the mean of the weighted losses over the cp ranks is the sequence's loss, the one that is reported.

PyTorch's ring attention takes the CUDA SDPA kernels (flash, memory-efficient, cuDNN); on the CPU, SDPA runs
`_scaled_dot_product_flash_attention_for_cpu`, which `liandan.train.cpu_ring` hands to the same ring. Other
devices are refused in one line by `cp_refusal`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from liandan.train import cpu_ring

IGNORED = -1  # a target the loss leaves out (liandan.model.loss)


def cp_refusal(cp: int, seq_len: int, mask: str, attention: str, device_type: str) -> str | None:
    """Why a run cannot split its sequences over `cp` ranks (one line), or None."""
    if cp == 1:
        return None
    if seq_len % (2 * cp):
        return (f"train.seq_len = {seq_len} must be a multiple of 2 x parallel.cp = {2 * cp}: the causal load"
                " balance cuts each sequence into 2 x cp equal chunks")  # fmt: skip
    if mask != "causal":
        return (f"parallel.cp = {cp} needs train.mask = 'causal': PyTorch's ring attention over SDPA has no"
                " document mask")  # fmt: skip
    if attention not in ("auto", "sdpa"):
        return f"parallel.cp = {cp} needs model.attention = 'sdpa' (or 'auto'): ring attention is SDPA's"
    if device_type == "cpu" and (why := cpu_ring.missing()):
        return (
            f"parallel.cp = {cp} on the CPU needs PyTorch's ring attention internals (torch {torch.__version__}): {why}"
        )
    if device_type not in ("cuda", "cpu"):
        return (f"parallel.cp = {cp} needs CUDA or the CPU: PyTorch's ring attention (torch {torch.__version__})"
                f" shards their SDPA kernels only, not {device_type}'s")  # fmt: skip
    return None


@dataclass
class SequenceShard:
    """This rank's share of a micro-batch: its tokens, their targets and rotary positions, and the weight
    of its mean loss (its share of the counted targets, times cp)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None


@contextlib.contextmanager
def sequence_split(cp_mesh: DeviceMesh | None, inputs: torch.Tensor, targets: torch.Tensor,
                   doc_ids: torch.Tensor | None = None) -> Iterator[SequenceShard]:  # fmt: skip
    """This rank's share of the (batch, seq) micro-batch, with ring attention on while inside; without a cp
    mesh, the micro-batch whole."""
    if cp_mesh is None:
        yield SequenceShard(inputs, targets, doc_ids=doc_ids)
        return
    from torch.distributed.tensor.experimental import context_parallel

    if inputs.device.type == "cpu":
        cpu_ring.install()
    batch, seq = inputs.shape
    positions = torch.arange(seq, device=inputs.device).repeat(batch, 1)
    counted = (targets != IGNORED).sum()
    # context_parallel shards its buffers in place: copies, so the caller's batch stays whole.
    buffers = [inputs.clone(), targets.clone(), positions]
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                          no_restore_buffers=set(buffers)):  # fmt: skip
        local_inputs, local_targets, local_positions = buffers
        weight = (local_targets != IGNORED).sum() * cp_mesh.size() / counted.clamp(min=1)
        yield SequenceShard(local_inputs, local_targets, local_positions, weight)


def mean_over_cp(cp_mesh: DeviceMesh | None, loss: torch.Tensor) -> torch.Tensor:
    """The mean over the cp ranks of their weighted losses: the loss of the whole sequences."""
    if cp_mesh is None:
        return loss
    total = loss.detach().clone()
    dist.all_reduce(total, group=cp_mesh.get_group())
    return total / cp_mesh.size()
