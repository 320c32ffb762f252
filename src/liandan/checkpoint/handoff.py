"""The supervisor's checkpoint verdict, handed to the workers it starts next.

After a failure the supervisor verifies the checkpoints (every byte against its manifest) to know which step
the run resumes from. Reading a large checkpoint twice, once in the supervisor and again in the workers
moments later, would double the time a restart spends on it. So the supervisor writes what it found, with
the size and modification time of every file it read; rank 0 trusts that verdict while nothing it covers has
changed (and no newer checkpoint has appeared), and verifies as usual otherwise.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from liandan.checkpoint.verify import complete_checkpoints
from liandan.run import atomic_write, dumps_json, read_json
from liandan.run.remote import is_url
from liandan.run.worker_env import WorkerEnv

# The verdict lives among the supervisor's logs (`RunDir.verdict`); the workers find it through
# $LIANDAN_VERIFIED_CHECKPOINT.


def stamp(directory: Path) -> dict[str, list[int]]:
    """Size and modification time (ns) of every file in a checkpoint directory."""
    out = {}
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        info = path.stat()
        out[str(path.relative_to(directory))] = [info.st_size, info.st_mtime_ns]
    return out


def verify_and_hand_over(root: Path, checksums: bool, handoff: Path, on_event) -> Path | None:
    """The newest checkpoint under `root` that verifies (reporting each one that fails), written down for
    the next workers; None (and nothing written) when none does."""
    from liandan.checkpoint.loading import newest_verified

    rejected = []

    def note(kind: str, **fields) -> None:
        rejected.append(fields["path"])
        on_event(kind, **fields)

    found = newest_verified(root, checksums, note)
    handoff.unlink(missing_ok=True)
    if found is not None and not is_url(root):  # objects in a store have no stamp to trust: workers verify
        verdict = {"root": str(Path(root).resolve()), "checksums": checksums, "path": str(found.resolve()),
                   "stamp": stamp(found), "rejected": {str(Path(p).resolve()): stamp(Path(p)) for p in rejected}}  # fmt: skip
        with contextlib.suppress(OSError):  # no room for it (a full disk): the workers then verify for themselves
            atomic_write(handoff, dumps_json(verdict), durable=False)  # read moments later, on this machine
    return found


def trusted(root: Path, checksums: bool) -> Path | None:
    """The handed-over checkpoint if the verdict still holds for `root`: same files, sizes and times, and
    every newer complete checkpoint one that the supervisor rejected, unchanged since."""
    handed = WorkerEnv.from_env().verified_checkpoint
    if handed is None or is_url(root):
        return None
    verdict = read_json(handed)
    if not isinstance(verdict, dict):
        return None
    root = Path(root).resolve()
    if verdict.get("root") != str(root) or (checksums and not verdict.get("checksums")):
        return None
    path = Path(verdict["path"])
    complete = [p.resolve() for p in complete_checkpoints(root)]
    newer = [p for p in complete if p.name > path.name]
    if path not in complete or stamp(path) != verdict["stamp"]:
        return None
    if any(verdict["rejected"].get(str(p)) != stamp(p) for p in newer):
        return None
    return path


def newest_checkpoint(manager) -> Path | None:
    """`manager.latest_verified()`, without reading again a checkpoint that the supervisor verified moments
    ago. Rank 0 decides for all ranks."""
    import torch.distributed as dist

    box = [None]
    if manager.rank == 0:
        found = trusted(manager.root, manager.verify_on_load)
        box[0] = str(found) if found else None
    if manager.distributed:
        dist.broadcast_object_list(box, src=0, group=manager.group)
    return Path(box[0]) if box[0] else manager.latest_verified()
