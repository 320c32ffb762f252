"""The smallest layout that fits: the fewest devices on which a training step fits in memory, searched over
FSDP2 x tensor-parallel splits and activation recomputation modes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from liandan.common.layout import Layout
from liandan.model.spec import spec_for
from liandan.plan.activations import CHECKPOINT_MODES
from liandan.plan.memory import DEFAULT_HEADROOM, MemoryEstimate, memory_per_device


@dataclass(frozen=True)
class LayoutFit:
    nproc: int
    layout: Layout
    activation_checkpoint: str
    micro_batch: int
    estimate: MemoryEstimate


def micro_batch_for(global_batch: int, micro_batch: int, layout: Layout) -> int | None:
    """Sequences per rank per forward pass in `layout`, as the trainer derives them (micro_batch = 0: the
    whole per-rank batch), or None where the global batch does not split into whole micro-batches."""
    if global_batch % layout.dp_size:
        return None
    per_rank = global_batch // layout.dp_size
    b = micro_batch or per_rank
    return b if per_rank % b == 0 else None


def tp_degrees(args: Any, nproc: int, max_tp: int = 8) -> list[int]:
    """Tensor-parallel degrees liandan accepts for this model on `nproc` devices (powers of two): those its
    family's tensor-parallel plan can split it by."""
    spec = spec_for(args)
    out, t = [], 1
    while t <= min(max_tp, nproc):
        if nproc % t == 0 and spec.tp_refusal(args, t) is None:
            out.append(t)
        t *= 2
    return out


def smallest_fitting_layout(
    args: Any,
    *,
    seq_len: int,
    global_batch: int,
    micro_batch: int = 0,
    device_memory_gib: float,
    headroom: float = DEFAULT_HEADROOM,
    dtype: str = "bf16",
    attention: str = "flash",
    checkpoint_modes: tuple[str, ...] = CHECKPOINT_MODES,
    max_tp: int = 8,
    max_nproc: int | None = None,
    ep: int = 1,
    **settings: Any,
) -> LayoutFit | None:
    """The fewest devices (a power of two) on which a step fits, searching FSDP2 x tensor-parallel splits
    (dp_shard = nproc / tp) and recomputation modes. At equal device count it prefers the least
    recomputation, then the smallest tensor-parallel degree. None when nothing up to `max_nproc` (default:
    as many devices as the global batch allows data-parallel ranks, times max_tp) fits. `ep`: the
    expert-parallel degree kept in every layout (those whose dp_shard it does not divide are skipped).
    `settings`: the sequence_parallel, loss_parallel, ce_chunks, fp8_params, optimizer_state_bytes_per_param
    and ep_imbalance that `memory_per_device` takes."""
    limit = max_nproc or min(2**16, global_batch * max_tp)
    nproc = 1
    while nproc <= limit:
        for mode in checkpoint_modes:
            for tp in tp_degrees(args, nproc, max_tp):
                if (nproc // tp) % ep:
                    continue
                layout = Layout(1, nproc // tp, tp, ep=ep)
                b = micro_batch_for(global_batch, micro_batch, layout)
                if b is None:
                    continue
                est = memory_per_device(
                    args, layout, micro_batch=b, seq_len=seq_len, activation_checkpoint=mode, dtype=dtype,
                    attention=attention, accumulation_steps=global_batch // layout.dp_size // b, **settings,
                )  # fmt: skip
                if est.fits(device_memory_gib, headroom):
                    return LayoutFit(nproc, layout, mode, b, est)
        nproc *= 2
    return None
