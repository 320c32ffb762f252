"""The parallel layout of a run: how many ranks each named dimension of the device mesh has.

Dimensions, outermost first: `dp_replicate` (DDP replicas, or HSDP's replica groups), `dp_shard` (FSDP2's
shard group), `tp` (tensor parallel). `ep` (expert parallel) borrows its ranks from `dp_shard`, as torchtitan's
dp2ep does: the shard group splits into `dp_shard / ep` groups of `ep` neighbouring ranks, each of which
divides the routed experts among its ranks; the experts' weights are then sharded by FSDP2 over what is left
(`dp_shard / ep`), the dense weights over the whole `dp_shard`. It adds no processes. `cp` (context
parallel, between `dp_shard` and `tp`) splits each sequence over its ranks, which read the same batch; FSDP2
then shards the weights over `dp_shard x cp`, as torchtitan does. `pp` (pipeline stages) is the outermost
dimension: each pipeline rank runs its stages with the data-parallel, context-parallel and tensor-parallel
dims inside it, and the ranks of one pipeline group read the same data.

`str(layout)` is what checkpoints, memory snapshots, events and summaries record, e.g.
`fsdp (dp_replicate=1, dp_shard=2, tp=1)`; `Layout.parse` reads it back.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from liandan.config import ParallelSection

DIMS = ("dp_replicate", "dp_shard", "tp", "pp", "ep", "cp")
_PAIR = re.compile(r"(\w+)=(\d+)")


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        if self.cp < 1:
            raise ValueError(f"parallel.cp = {self.cp} must be at least 1")
        if self.pp < 1:
            raise ValueError(f"parallel.pp = {self.pp} must be at least 1")
        if self.ep < 1 or self.dp_shard % self.ep:
            raise ValueError(
                f"parallel.ep = {self.ep} must divide parallel.dp_shard = {self.dp_shard}: expert parallelism"
                " borrows its ranks from the FSDP shard group"
            )

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp * self.tp * self.pp

    @property
    def expert_shard(self) -> int:
        """Over how many ranks FSDP2 shards each expert-parallel rank's experts: what `ep` leaves of
        `dp_shard`."""
        return self.dp_shard // self.ep

    @property
    def kind(self) -> str:
        replicate, shard = self.dp_replicate > 1, self.dp_shard > 1
        dp = "hsdp" if replicate and shard else "ddp" if replicate else "fsdp" if shard else "single"
        model = [name for name in ("cp", "tp", "pp") if getattr(self, name) > 1]
        return "+".join(([] if dp == "single" and model else [dp]) + model)

    def __str__(self) -> str:
        extra = "".join(f", {d}={getattr(self, d)}" for d in ("pp", "cp", "ep") if getattr(self, d) != 1)
        return f"{self.kind} (dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, tp={self.tp}{extra})"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """The layout `str(layout)` printed (as a checkpoint's meta.json records it); ValueError otherwise."""
        kind, _, rest = text.strip().partition(" ")
        sizes = {name: int(value) for name, value in _PAIR.findall(rest)}
        if not rest.startswith("(") or not {"dp_replicate", "dp_shard", "tp"} <= sizes.keys() or set(sizes) - set(DIMS):
            raise ValueError(f"'{text}' is not a parallel layout like 'fsdp (dp_replicate=1, dp_shard=2, tp=1)'")
        layout = cls(**sizes)
        if layout.kind != kind or str(layout) != text.strip():
            raise ValueError(f"'{text}' is not a parallel layout: its sizes make '{layout}'")
        return layout


def local_nproc_refusal(nproc: int) -> str | None:
    """Why `--nproc` local processes cannot run here, or None: fewer than one, or more than four per CPU core
    (at least 8), which no accelerator host needs (each of its devices has cores of its own) and which a typo
    (1000 for 10) would otherwise start, one interpreter and process group each."""
    if nproc < 1:
        return f"--nproc = {nproc} must be at least 1"
    cores = os.cpu_count() or 1
    most = max(8, 4 * cores)
    if nproc > most:
        return (f"--nproc = {nproc} is more local processes than this machine can hold ({cores} CPU cores: at most"
                f" {most}); run more nodes instead")  # fmt: skip
    return None


def resolve_layout(cfg: ParallelSection, world_size: int) -> Layout:
    """Fill dp_shard = -1 with what the other dims leave, and check the product is the world size."""
    shard = cfg.dp_shard
    if shard == -1:
        rest = cfg.dp_replicate * cfg.cp * cfg.tp * cfg.pp
        if world_size % rest:
            named = " x parallel.cp" if cfg.cp != 1 else ""
            piped = " x parallel.pp" if cfg.pp != 1 else ""
            raise ValueError(
                f"parallel.dp_replicate{named} x parallel.tp{piped} = {rest} must divide the number of processes,"
                f" {world_size} (--nproc, or the torchrun/srun task count)"
            )
        shard = world_size // rest
    layout = Layout(cfg.dp_replicate, shard, cfg.tp, pp=cfg.pp, ep=cfg.ep, cp=cfg.cp)
    if layout.world_size != world_size:
        raise ValueError(
            f"parallel layout dp_replicate={layout.dp_replicate} x dp_shard={layout.dp_shard}"
            + (f" x cp={layout.cp}" if layout.cp != 1 else "")
            + f" x tp={layout.tp}"
            + (f" x pp={layout.pp}" if layout.pp != 1 else "")
            + f" = {layout.world_size} processes, not {world_size} (--nproc, or the torchrun/srun task count)"
        )
    if layout.cp > 1 and layout.ep > 1:
        raise ValueError("parallel.cp and parallel.ep cannot both exceed 1 yet: expert parallelism borrows its"
                         " ranks from dp_shard alone, not from the dp_shard x cp group FSDP2 shards over")  # fmt: skip
    if cfg.cpu_offload and not uses_fsdp(layout):
        raise ValueError(
            f"parallel.cpu_offload offloads FSDP2's parameter shards, but the layout {layout} does not shard:"
            " set parallel.dp_shard to more than 1 (or -1 with more processes than dp_replicate x tp)"
        )
    return layout


def uses_fsdp(layout: Layout) -> bool:
    """Whether the weights are sharded by FSDP2: over dp_shard, or over dp_shard x cp (the cp ranks hold the
    same weights and average their gradients, as FSDP2's reduce-scatter does)."""
    return layout.dp_shard > 1 or layout.cp > 1 or (layout.dp_replicate > 1 and layout.tp > 1)


def batch_split_refusal(global_batch: int, micro_batch: int, dp_size: int) -> str | None:
    """Why `train.global_batch` cannot be split over `dp_size` data-parallel ranks in whole micro-batches (one
    line), or None. Asked before any data is read: by `liandan train` before its workers start, and by each
    worker before the data pipeline runs."""
    if global_batch % dp_size:
        return (f"train.global_batch = {global_batch} must split evenly over the {dp_size} data-parallel ranks"
                f" (a multiple of {dp_size})")  # fmt: skip
    per_rank = global_batch // dp_size
    if micro_batch and per_rank % micro_batch:
        return (f"train.global_batch = {global_batch} must split into {dp_size} data-parallel ranks"
                f" of whole micro-batches of train.micro_batch = {micro_batch}")  # fmt: skip
    return None
