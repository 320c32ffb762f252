"""Bisection: narrow a set of suspect ranks down to the faulty one in log2(n) rounds.

Each round splits the suspects into two halves, and each half computes one seeded matrix product together
in a group of its own (every rank its block of rows, assembled by all-gather), judged against float64 on
every member; both halves run at once. The half that fails holds the fault and is kept. A fault that needs
ranks of both halves to show (a bad link between them) makes neither half fail: the bisection then stops
and says so. Ranks outside the suspects only take part in the bookkeeping (group creation, the verdicts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from liandan.config import ConfigError
from liandan.doctor.probe import Settings
from liandan.run.worker_env import node_name
from liandan.train.distributed import DistInfo
from liandan.train.health import checks
from liandan.train.health.golden import TOLERANCE


def parse_suspects(text: str) -> list[str]:
    """`0,2,3` or `node-a,node-b` (or both mixed): the items of a --bisect list."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"--bisect {text!r} names no rank or host; give e.g. --bisect 0,1,2,3")
    return items


def resolve_suspects(items: list[str], hosts: list[str]) -> list[int]:
    """Ranks from rank numbers and host names (every rank of a named host); one-line errors for the rest."""
    ranks: list[int] = []
    for item in items:
        if item.isdigit():
            rank = int(item)
            if rank >= len(hosts):
                raise ConfigError(f"--bisect: rank {rank} is not among the {len(hosts)} rank(s) of this run")
            found = [rank]
        else:
            found = [rank for rank, host in enumerate(hosts) if host == item]
            if not found:
                raise ConfigError(f"--bisect: no rank runs on host {item!r}; hosts: {', '.join(sorted(set(hosts)))}")
        ranks += [rank for rank in found if rank not in ranks]
    return sorted(ranks)


def _hosts(info: DistInfo) -> list[str]:
    if not info.distributed:
        return [node_name()]
    hosts: list = [None] * info.world_size
    dist.all_gather_object(hosts, node_name())
    return hosts


def bisect(s: Settings, info: DistInfo, items: list[str], step: int = 0) -> dict:
    """Bisect the suspects `items` (ranks or hosts); every rank of the process group must call it. The report
    holds each round's halves and verdicts and the rank found (None when the fault did not show); `render`
    tells the rounds."""
    hosts = _hosts(info)
    suspects = initial = resolve_suspects(items, hosts)
    rounds: list[dict] = []
    note = ""
    dtype = torch.float32  # a rare wrong element shows against float64 in fp32; bf16's rounding would hide it

    def describe(ranks: list[int]) -> str:
        on = sorted({hosts[r] for r in ranks})
        return f"rank(s) {','.join(map(str, ranks))} on {','.join(on)}"

    def test(halves: list[list[int]]) -> list[tuple[bool, float]]:
        """Each half's (failed, largest error), the halves tested at once, known to every rank."""
        groups = [dist.new_group(h) if info.distributed else None for h in halves]  # every rank, same order
        verdicts = torch.zeros(2 * len(halves), dtype=torch.float64)
        for index, (half, group) in enumerate(zip(halves, groups)):
            if info.rank in half:
                seed = 1000 + len(rounds)
                g = checks.group_golden(half, group, info.device, dtype, s.golden_size, seed, step, TOLERANCE[dtype])
                verdicts[2 * index] = 0.0 if g.ok else 1.0
                verdicts[2 * index + 1] = g.max_error
        if info.distributed:
            verdicts = verdicts.to(info.device)
            dist.all_reduce(verdicts, op=dist.ReduceOp.MAX)
            for group in groups:
                dist.destroy_process_group(group)
        values = verdicts.cpu().tolist()
        return [(values[2 * i] > 0, values[2 * i + 1]) for i in range(len(halves))]

    if len(suspects) == 1:  # nothing to split: the one suspect alone
        ((failed, error),) = test([suspects])
        rounds.append({"round": 1, "halves": [{"ranks": suspects, "failed": failed, "max_error": error}]})
        if not failed:
            suspects, note = [], "it passes alone"
    while len(suspects) > 1:
        half = len(suspects) // 2
        halves = [suspects[:half], suspects[half:]]
        outcome = test(halves)
        rounds.append({"round": len(rounds) + 1, "halves": [{"ranks": h, "failed": f, "max_error": e}
                                                            for h, (f, e) in zip(halves, outcome)]})  # fmt: skip
        failing = [h for h, (f, _) in zip(halves, outcome) if f]
        if not failing:  # either there is no fault, or it needs both halves: the two together tell
            ((together, error),) = test([suspects])
            rounds[-1]["together"] = {"ranks": suspects, "failed": together, "max_error": error}
            if together:
                note = f"neither half of {describe(suspects)} fails alone, together they do: the fault needs both"
            else:
                suspects, note = [], "every half passes"
            break
        if len(failing) == 2:
            note = "both halves failed in a round: more than one rank is faulty; the first half was followed"
        suspects = failing[0]
    found = suspects[0] if len(suspects) == 1 else None
    if found is not None:
        summary = f"doctor: bisection names rank {found} on host {hosts[found]} after {len(rounds)} round(s)"
    elif suspects:
        summary = f"doctor: bisection stopped after {len(rounds)} round(s): {note}"
    else:
        summary = f"doctor: bisection found no fault in {describe(initial)} ({note})"
    if note and found is not None:
        summary += f" ({note})"
    return {"ok": found is None and not suspects, "summary": summary, "found": found,
            "host": hosts[found] if found is not None else None, "suspects": suspects, "rounds": rounds,
            "hosts": hosts}  # fmt: skip


def render(report: dict) -> list[str]:
    """The rounds as they went, then the summary, from a bisection report."""
    hosts = report["hosts"]

    def said(h: dict) -> str:
        on = ",".join(sorted({hosts[rank] for rank in h["ranks"]}))
        verdict = "FAIL" if h["failed"] else "pass"
        return f"rank(s) {','.join(map(str, h['ranks']))} on {on} {verdict} (max error {h['max_error']:.1e})"

    lines = []
    for r in report["rounds"]:
        line = f"round {r['round']}: " + "; ".join(said(h) for h in r["halves"])
        if "together" in r:
            line += f"; together: {said(r['together'])}"
        lines.append(line)
    lines.append(report["summary"])
    return lines
