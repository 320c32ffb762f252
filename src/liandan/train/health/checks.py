"""Measurements of one rank's devices and of the links between ranks, with nothing but torch: matrix-product
throughput, memory bandwidth, and collectives whose every contribution is a known pattern, so that a wrong
result names the rank it came from. The doctor runs them before training; checks during training can run
them again to attribute a fault they saw.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from liandan.faults import faulty_matmuls
from liandan.train.health.golden import seeded_problem

Tamper = Callable[[torch.Tensor], object]  # applied to each send buffer before it goes out (fault drills)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(device: torch.device, work: Callable[[], object], amount: float, seconds: float) -> float:
    """Median `amount` per second of `work`, repeated for about `seconds` after one warm-up: the median, as
    other processes on a shared machine make single repetitions both slow and (timer jitter) absurdly fast."""
    work()
    synchronize(device)
    rates, deadline = [], time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        work()
        synchronize(device)
        rates.append(amount / max(time.perf_counter() - start, 1e-9))
        if time.perf_counter() >= deadline and len(rates) >= 3:
            return statistics.median(rates)


def matmul_throughput(device: torch.device, dtype: torch.dtype, size: int, seconds: float) -> float:
    """FLOP/s of a `size`-square matrix product in `dtype` on `device`."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return _rate(device, lambda: torch.mm(a, b), 2.0 * size**3, seconds)


def memory_bandwidth(device: torch.device, nbytes: int, seconds: float) -> float:
    """Bytes/s of a device-to-device copy of `nbytes` (each byte read once and written once)."""
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    return _rate(device, lambda: target.copy_(source), 2.0 * source.numel() * 4, seconds)


def rank_pattern(rank: int, numel: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """A pattern of small integers that only `rank` sends (elements `offset`.. of its sequence): sums of
    a few thousand of them stay exact in float32, so a received or reduced value is right or wrong, never
    rounded."""
    index = torch.arange(offset, offset + numel, dtype=torch.int64)
    values = (index * 31 + (rank + 1) * 7919) % 1021 - 510
    return values.to(device=device, dtype=torch.float32)


@dataclass
class CollectiveCheck:
    """What one rank saw of one collective among `ranks`."""

    name: str
    ranks: list[int]
    ok: bool
    wrong_senders: list[int] = field(default_factory=list)  # whose slots arrived wrong (all-gather)
    max_error: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def check_collectives(ranks: list[int], group: dist.ProcessGroup | None, device: torch.device, numel: int,
                      tamper: Tamper = lambda t: None) -> list[CollectiveCheck]:  # fmt: skip
    """All-gather, all-reduce and reduce-scatter of known patterns among `ranks` (global ranks, in group
    order); this rank must be one of them. The all-gather goes first: its slots tell whose contribution
    arrived wrong; the reductions tell only that a sum is wrong."""
    me = dist.get_rank()
    checks = []

    send = rank_pattern(me, numel, device)
    tamper(send)
    received = [torch.empty_like(send) for _ in ranks]
    dist.all_gather(received, send, group=group)
    errors = [float((r - rank_pattern(sender, numel, device)).abs().max()) for sender, r in zip(ranks, received)]
    wrong = [sender for sender, error in zip(ranks, errors) if error > 0]
    checks.append(CollectiveCheck("all_gather", ranks, not wrong, wrong, max(errors)))

    send = rank_pattern(me, numel, device)
    tamper(send)
    dist.all_reduce(send, group=group)
    expected = sum(rank_pattern(r, numel, device) for r in ranks)
    error = float((send - expected).abs().max())
    checks.append(CollectiveCheck("all_reduce", ranks, error == 0, max_error=error))

    chunk = max(1, numel // len(ranks))
    inputs = [rank_pattern(me, chunk, device, offset=i * chunk) for i in range(len(ranks))]
    for piece in inputs:
        tamper(piece)
    mine = ranks.index(me)
    output = torch.empty(chunk, dtype=torch.float32, device=device)
    dist.reduce_scatter(output, inputs, group=group)
    expected = sum(rank_pattern(r, chunk, device, offset=mine * chunk) for r in ranks)
    error = float((output - expected).abs().max())
    checks.append(CollectiveCheck("reduce_scatter", ranks, error == 0, max_error=error))
    return checks


def collective_bandwidth(name: str, group: dist.ProcessGroup | None, size: int, device: torch.device,
                         nbytes: int, rounds: int = 3) -> float:  # fmt: skip
    """Best observed bus bandwidth in bytes/s of collective `name` on `nbytes` among `size` ranks: the bytes
    each rank's link carries (the algorithm bandwidth scaled by 2(n-1)/n for an all-reduce and (n-1)/n for
    the others), comparable across group sizes. Every rank of the group must call it."""
    numel = max(size, nbytes // 4 // size * size)
    buffer = torch.ones(numel, dtype=torch.float32, device=device)
    if name == "all_reduce":
        work, factor = (lambda: dist.all_reduce(buffer, group=group)), 2 * (size - 1) / size
    elif name == "all_gather":
        piece = buffer[: numel // size]
        pieces = list(torch.empty_like(buffer).chunk(size))
        work, factor = (lambda: dist.all_gather(pieces, piece, group=group)), (size - 1) / size
    elif name == "reduce_scatter":
        pieces, out = list(buffer.chunk(size)), torch.empty(numel // size, device=device)
        work, factor = (lambda: dist.reduce_scatter(out, pieces, group=group)), (size - 1) / size
    else:
        raise ValueError(f"no bandwidth test for collective {name!r}")

    # A count of rounds, not a clock, bounds it: a rank that stopped on its own clock would leave the others
    # waiting in a collective it never joins.
    work()
    synchronize(device)
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        synchronize(device)
        best = max(best, numel * 4 * factor / max(time.perf_counter() - start, 1e-9))
    return best


@dataclass
class GroupGolden:
    """A matrix product computed by a group of ranks, each its block of rows, and assembled by all-gather."""

    ranks: list[int]
    max_error: float  # of the assembled product against float64, relative to its largest magnitude
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance


def group_golden(ranks: list[int], group: dist.ProcessGroup | None, device: torch.device, dtype: torch.dtype,
                 size: int, seed: int, step: int, tolerance: float) -> GroupGolden:  # fmt: skip
    """Every rank of `ranks` computes its block of rows of one seeded product and the group assembles it: a
    wrong block (a faulty device) or a wrong transfer (a faulty link) both show against float64 on every
    member. Every rank of the group must call it."""
    a, b, reference = seeded_problem(size, seed)
    rows = -(-size // len(ranks))
    mine = ranks.index(dist.get_rank()) if len(ranks) > 1 else 0
    block = torch.zeros(rows, size, dtype=dtype, device=device)
    part = a[mine * rows : (mine + 1) * rows]
    with faulty_matmuls(step):
        block[: part.shape[0]] = torch.mm(part.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
    blocks = [block]
    if len(ranks) > 1:
        blocks = [torch.empty_like(block) for _ in ranks]
        dist.all_gather(blocks, block, group=group)
    result = torch.cat(blocks)[:size].to("cpu", torch.float64)
    error = float((result - reference).abs().max()) / float(reference.abs().max())
    return GroupGolden(ranks, error, tolerance)
