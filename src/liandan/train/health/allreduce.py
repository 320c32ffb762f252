"""The data-parallel gradient all-reduce, audited: a DDP communication hook that averages each bucket as DDP's
own does and, on the steps the silent-data-corruption check asks for, records what each rank put in and what
came out, so that the ranks can check that the reduced sums add up to their contributions.

Per bucket and rank, on a recorded step: the sum and the sum of magnitudes of the bucket as backward left it
(the rank's claim), the sum of the buffer as it is handed to the collective (what was sent), and the sum of
the reduced result. Sums are float64 and stay on the device until the check gathers them, so a recorded step
costs three reductions over the gradients and no synchronisation; other steps cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from liandan.faults import corrupt_contribution


@dataclass
class AllReduceAudit:
    """The hook's state: the step being trained (counted from 1) and, while `recording`, its bucket sums."""

    group: Any = None  # the replicas' process group
    step: int = 0
    recording: bool = False
    claimed: list[torch.Tensor] = field(default_factory=list)  # per bucket: (sum, sum of magnitudes)
    sent: list[torch.Tensor] = field(default_factory=list)
    reduced: list[torch.Tensor] = field(default_factory=list)

    def start(self, record: bool) -> None:
        self.recording = record
        self.claimed, self.sent, self.reduced = [], [], []

    def sums(self) -> torch.Tensor | None:
        """This rank's recorded sums, one row per bucket: (claimed sum, claimed magnitude, sent sum, reduced
        sum); None when nothing was recorded."""
        if not self.claimed or len(self.reduced) != len(self.claimed):
            return None
        rows = [torch.stack([c[0], c[1], s, r]) for c, s, r in zip(self.claimed, self.sent, self.reduced, strict=True)]
        return torch.stack(rows)


def audited_allreduce(audit, bucket):  # DDP checks a hook's annotations against real types: none here
    """A DDP communication hook (`bucket`: a `dist.GradBucket`; returns a future of the reduced buffer): DDP's averaging all-reduce (divide by the group's size, then sum), with the audit's records around it.
    The contribution is corrupted here when a `corrupt@allreduce` fault asks for it: between the claim and the
    send, where a fault on the way out would strike."""
    buffer = bucket.buffer()
    size = dist.get_world_size(audit.group)
    buffer.div_(size)
    if audit.recording:
        wide = buffer.double()
        audit.claimed.append(torch.stack([wide.sum(), wide.abs().sum()]))
    corrupt_contribution(audit.step, buffer)
    if audit.recording:
        audit.sent.append(buffer.sum(dtype=torch.float64))
    work = dist.all_reduce(buffer, group=audit.group, async_op=True)

    def reduced(future: torch.futures.Future) -> torch.Tensor:
        result = future.value()[0]
        if audit.recording:
            audit.reduced.append(result.sum(dtype=torch.float64))
        return result

    return work.get_future().then(reduced)
