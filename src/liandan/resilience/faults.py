"""Fault injection for tests of the recovery machinery: off unless $LIANDAN_FAULTS names faults.

Format: comma-separated `ACTION@POINT:STEP[:RANK]`, for example
    LIANDAN_FAULTS="kill@step:6"              SIGKILL this process after optimizer step 6 (every rank)
    LIANDAN_FAULTS="kill@save:4:0"            SIGKILL rank 0 while finalising the checkpoint of step 4
    LIANDAN_FAULTS="enospc@save:4"            raise ENOSPC while writing the checkpoint of step 4

Points: `step` (after an optimizer step), `save` (after a checkpoint's shards are written, before its
manifest). Actions: `kill` (SIGKILL), `raise` (RuntimeError), `enospc` (OSError ENOSPC).
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "LIANDAN_FAULTS"


def _faults() -> list[tuple[str, str, int, int | None]]:
    spec = os.environ.get(ENV, "").strip()
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        action, where = item.split("@", 1)
        parts = where.split(":")
        rank = int(parts[2]) if len(parts) > 2 else None
        out.append((action, parts[0], int(parts[1]), rank))
    return out


def maybe_inject(point: str, step: int) -> None:
    """Fire every configured fault that matches this point, step and rank."""
    if ENV not in os.environ:
        return
    rank = int(os.environ.get("RANK", "0"))
    for action, where, at_step, at_rank in _faults():
        if where != point or at_step != step or (at_rank is not None and at_rank != rank):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "raise":
            raise RuntimeError(f"injected fault at {point} {step} on rank {rank}")
        if action == "enospc":
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {point} {step})")
        raise ValueError(f"{ENV}: unknown fault action '{action}'")
