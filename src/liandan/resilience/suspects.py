"""What the supervisor does about a node whose hardware the training health checks found wanting: a device
that failed its golden test after silent data corruption (the workers stopped with `DeviceFault`), and a
rank reported as a persistent straggler. It reads the workers' "sdc" and "straggler" events and marks the
node in the run's `excluded_nodes.json` (`nodes.ExclusionList`): excluded at once on several nodes, where the
others carry on without it; recorded as a suspect on one node, where there is nowhere else to run, and the
run ends with one line that says which device to take out of service (`ExclusionList.mark`)."""

from __future__ import annotations

from liandan.resilience.nodes import ExclusionList
from liandan.run import RunDir


def device_fault(room: RunDir, since: float) -> dict:
    """The newest "sdc" event since `since` whose rank failed its golden test (empty when none was written)."""
    faults = [e for e in room.read_events() if e.get("kind") == "sdc" and e.get("persistent") and e["time"] >= since]
    if not faults:
        return {}
    fault = faults[-1]
    ranks, hosts = fault.get("ranks") or [None], fault.get("hosts") or [None]
    return {
        "step": fault.get("step"),
        "rank": ranks[0],
        "host": hosts[0],
        "detail": fault.get("detail", ""),
        "reason": fault.get("reason") or "failed its golden matrix product",
    }


def stragglers_on(room: RunDir, node: str, since: float) -> list[dict]:
    """The "straggler" events since `since` that name a rank of `node`."""
    return [e for e in room.read_events() if e.get("kind") == "straggler" and e.get("host") == node
            and e["time"] >= since]  # fmt: skip


def mark_device(exclusions: ExclusionList, fault: dict, node: str, exclude: bool) -> tuple[str, str]:
    """Mark the node of a device that failed its golden test (`device_fault`'s record; `node` where it names
    none); returns (that node, the reason recorded)."""
    host, rank, step = fault.get("host") or node, fault.get("rank"), fault.get("step")
    reason = f"the device of rank {rank} computes wrong: it {fault.get('reason')} at step {step}"
    exclusions.mark(host, {"rank": rank, "host": host, "step": step, "reason": reason,
                           "detail": fault.get("detail", "")}, exclude=exclude)  # fmt: skip
    return host, reason


def mark_straggler(exclusions: ExclusionList, node: str, straggler: dict) -> str:
    """Exclude `node` for the persistent straggler a "straggler" event names; returns the reason recorded."""
    reason = (f"rank {straggler['rank']} was a straggler in {straggler['phase']} ({straggler['ratio']}x the"
              f" others' median, reported at step {straggler['step']})")  # fmt: skip
    exclusions.mark(node, {**{k: straggler.get(k) for k in ("rank", "step", "phase", "ratio")}, "reason": reason},
                    exclude=True)  # fmt: skip
    return reason
