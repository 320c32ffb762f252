"""The doctor's verdict on every rank's record: who is out of line, how badly, and the one line that says so.

Wrong answers (a matrix product off from float64 or from the other ranks' bits, a collective that delivers
wrong data, a checkpoint directory that cannot be written) are failures. Speeds are judged against the
other ranks on the same host (the same hardware, as far as one can tell): below `slow_ratio` x their median
is out of line, a warning unless `on_slow = "fail"`; but the checkpoint-directory write, which the ranks of a
host share, is a warning only below an absolute rate (`DISK_SLOW_BYTES_PER_S`). Environment facts that will
hurt the run are warnings.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass

from liandan.config import Config
from liandan.doctor import environment
from liandan.train.health import odd_ones_out

CHECKS = ("golden", "matmul", "memory", "collectives", "pairs", "disk", "env")


@dataclass
class Finding:
    check: str
    level: str  # "fail" or "warn"
    what: str  # a phrase after "rank R on host H"
    rank: int | None  # None: the host as a whole
    host: str

    def who(self) -> str:
        return _who(self.rank, self.host)


def _who(rank: int | None, host: str) -> str:
    return f"rank {rank} on host {host}" if rank is not None else f"host {host}"


def finding_line(f: dict) -> str:
    """One finding of a report, as the table and the preflight print it."""
    return f"{f['level'].upper()} {f['check']}: {_who(f['rank'], f['host'])} {f['what']}"


# A checkpoint-directory write rate is judged on its own, not against the other ranks of its host: they write
# to the same device at the same moment, so one of them finishing later (229 MB/s beside 1 GB/s on a shared
# VM) says nothing about the disk. Below this, what a congested network share or a failing disk gives, a save
# of a few GB per rank takes minutes: worth a warning. The rates themselves are in the report's table.
DISK_SLOW_BYTES_PER_S = 50e6


def judge(cfg: Config, records: list[dict], parameters: int | None, seconds: float, step: int = 0) -> dict:
    """The report: every record with its verdict per check, the findings, the hosts' facts, one summary."""
    findings: list[Finding] = []
    _golden(records, findings)
    slow = cfg.doctor.slow_ratio
    level = "fail" if cfg.doctor.on_slow == "fail" else "warn"
    for dtype in records[0]["matmul"]:
        _speed(records, "matmul", lambda r, t=dtype: r["matmul"].get(t, {}).get("flops"), f"{dtype} matmul",
               "FLOP/s", slow, level, findings)  # fmt: skip
    _speed(records, "memory", lambda r: r["memory_bandwidth"], "memory copy", "B/s", slow, level, findings)
    for r in records:
        rate = r["disk"]["bytes_per_s"]
        if rate is not None and rate < DISK_SLOW_BYTES_PER_S:
            findings.append(Finding("disk", "warn", f"writes to {r['disk']['path']} at {si(rate, 'B/s')}, below"
                                    f" {si(DISK_SLOW_BYTES_PER_S, 'B/s')}: checkpoint saves there will be slow",
                                    r["rank"], r["host"]))  # fmt: skip
        if r["disk"]["error"]:
            findings.append(Finding("disk", "fail", f"cannot write to {r['disk']['path']} ({r['disk']['error']})",
                                    r["rank"], r["host"]))  # fmt: skip
    _collectives(records, findings)
    _pairs(records, slow, level, findings)
    hosts = _hosts(cfg, records, parameters, findings)
    failures = [f for f in findings if f.level == "fail"]
    ranks = []
    for r in records:
        verdicts = {check: "ok" for check in CHECKS}
        if len(records) < 2:
            verdicts["collectives"] = "-"
        if len(records) < 3 or not cfg.doctor.pairs:
            verdicts["pairs"] = "-"
        for f in findings:
            if f.rank == r["rank"] or (f.rank is None and f.host == r["host"]):
                verdicts[f.check] = "fail" if "fail" in (f.level, verdicts[f.check]) else "warn"
        ranks.append({**r, "verdicts": verdicts})
    return {
        "ok": not failures,
        "summary": summary(findings, len(records), len(hosts), seconds),
        "step": step,
        "world_size": len(records),
        "seconds": round(seconds, 3),
        "parameters": parameters,
        "findings": [asdict(f) for f in findings],
        "ranks": ranks,
        "hosts": hosts,
        "bandwidth": records[0].get("bandwidth", {}),
    }


def summary(findings: list[Finding], world: int, hosts: int, seconds: float) -> str:
    """One line: the failures, naming rank and host, else the warnings, else that all passed."""
    failures = [f for f in findings if f.level == "fail"]
    if failures:
        return "doctor: " + "; ".join(_merge(failures))
    warnings = [f for f in findings if f.level == "warn"]
    passed = f"all {world} rank(s) on {hosts} host(s) passed in {seconds:.1f}s"
    if warnings:
        return f"doctor: {passed}, with warnings: " + "; ".join(_merge(warnings))
    return f"doctor: {passed}"


def _merge(findings: list[Finding]) -> list[str]:
    """One clause per rank (or host): its findings joined."""
    by_who: dict[str, list[str]] = defaultdict(list)
    for f in findings:
        by_who[f.who()].append(f.what)
    return [f"{who} {' and '.join(whats)}" for who, whats in by_who.items()]


def _golden(records: list[dict], findings: list[Finding]) -> None:
    wrong: dict[int, list[str]] = defaultdict(list)
    for r in records:
        for dtype, g in r["golden"].items():
            if not g["ok"]:
                wrong[r["rank"]].append(f"{dtype}: max error {g['max_error']:.1e} against float64, tolerance"
                                        f" {g['tolerance']:.1e}, {g['wrong_elements']} wrong element(s)")  # fmt: skip
    # Bits are compared among ranks of one device kind: one kernel on one input gives one answer there.
    kinds: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        kinds[r["facts"]["device_name"]].append(r)
    for same in kinds.values():
        for dtype in same[0]["golden"]:
            for index in odd_ones_out([r["golden"][dtype]["digest"] for r in same]):
                others = len(same) - 1
                wrong[same[index]["rank"]].append(f"{dtype}: its bits differ from the other {others} rank(s)'")
    for r in records:
        if wrong[r["rank"]]:
            findings.append(Finding("golden", "fail", f"computes wrong matrix products ({'; '.join(wrong[r['rank']])})",
                                    r["rank"], r["host"]))  # fmt: skip


def _speed(records: list[dict], check: str, value, label: str, unit: str, ratio: float, level: str,
           findings: list[Finding]) -> None:  # fmt: skip
    """Each rank against the median of the other ranks on its host."""
    if not ratio:
        return
    by_host: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if value(r) is not None:
            by_host[r["host"]].append(r)
    for same in by_host.values():
        for r in same:
            others = [value(o) for o in same if o is not r]
            if not others:
                continue
            median = statistics.median(others)
            if median > 0 and value(r) < ratio * median:
                findings.append(Finding(check, level, f"is slow: {label} {si(value(r), unit)}, {value(r) / median:.2f}x"
                                        f" the median of the other ranks on its host ({si(median, unit)})",
                                        r["rank"], r["host"]))  # fmt: skip


def _collectives(records: list[dict], findings: list[Finding]) -> None:
    """A sender whose all-gather slot arrived wrong at most ranks sends wrong data; a rank that alone sees
    wrong data receives it wrong; wrong sums that no sender explains are named where they were seen."""
    n = len(records)
    if n < 2:
        return
    host = {r["rank"]: r["host"] for r in records}
    counts: Counter[int] = Counter()
    for r in records:
        for c in r["collectives"]:
            counts.update(c["wrong_senders"])
    senders = sorted(s for s, count in counts.items() if count * 2 > n)
    for s in senders:
        findings.append(Finding("collectives", "fail", f"sends wrong data in collectives (its all-gather"
                                f" contribution arrived wrong at {counts[s]} of {n} ranks)", s, host[s]))  # fmt: skip
    wrong_at = {r["rank"]: [c["name"] for c in r["collectives"] if not c["ok"]] for r in records}
    seen = [rank for rank, names in wrong_at.items() if names and rank not in senders]
    if senders:  # what the bad sender explains is said; a receiver that saw more than it explains is not
        seen = [rank for rank in seen if set(records[rank]["collectives"][0]["wrong_senders"]) - set(senders)]
    for rank in seen:
        alone = len(seen) * 2 < n
        what = "receives wrong data in" if alone else "sees wrong results of"
        unsure = "" if alone else "; the sender cannot be told apart (try liandan doctor --bisect)"
        findings.append(Finding("collectives", "fail", f"{what} {', '.join(wrong_at[rank])}{unsure}", rank,
                                host[rank]))  # fmt: skip


def _pairs(records: list[dict], ratio: float, level: str, findings: list[Finding]) -> None:
    """Pairs whose collectives went wrong: a rank that fails in every one of its pairs is the bad one; pair
    bandwidth: each rank's median over its pairs against the other ranks' medians."""
    host = {r["rank"]: r["host"] for r in records}
    failed: dict[int, int] = Counter()
    tested: dict[int, int] = Counter()
    for r in records:
        for p in r["pairs"]:
            tested[r["rank"]] += 1
            failed[r["rank"]] += not p["ok"]
    blamed = {rank for rank, count in failed.items() if count and count == tested[rank]}
    explained = {rank for rank in failed if rank not in blamed and failed[rank]
                 and all(p["ok"] or set(p["ranks"]) & blamed for p in records[rank]["pairs"])}  # fmt: skip
    for rank in sorted(blamed | ({r for r in failed if failed[r]} - explained)):
        bad = [p["ranks"] for p in records[rank]["pairs"] if not p["ok"]]
        described = ", ".join(f"{a}-{b}" for a, b in bad)
        findings.append(Finding("pairs", "fail", f"gets wrong collective results in pair(s) {described}", rank,
                                host[rank]))  # fmt: skip
    medians = {r["rank"]: statistics.median(p["bandwidth"] for p in r["pairs"]) for r in records if r["pairs"]}
    if not ratio:
        return
    for rank, value in medians.items():
        others = [v for other, v in medians.items() if other != rank]
        median = statistics.median(others) if others else 0
        if median > 0 and value < ratio * median:
            what = (f"is slow: pair all-reduce {si(value, 'B/s')}, {value / median:.2f}x the median of the other"
                    f" ranks ({si(median, 'B/s')})")  # fmt: skip
            findings.append(Finding("pairs", level, what, rank, host[rank]))


def _hosts(cfg: Config, records: list[dict], parameters: int | None, findings: list[Finding]) -> dict:
    """Each host's facts (its first rank's view), the state its ranks will keep, and what will hurt."""
    hosts: dict[str, dict] = {}
    local: Counter[str] = Counter(r["host"] for r in records)
    for r in records:
        if r["host"] in hosts:
            continue
        size = environment.state_size(cfg, parameters, len(records), local[r["host"]]) if parameters else None
        facts = {**r["facts"], "ranks": local[r["host"]], "state": size.as_dict() if size else None}
        hosts[r["host"]] = facts
        device_type = r["device"].split(":")[0]
        for said in environment.environment_warnings(cfg, r["facts"], size, device_type):
            findings.append(Finding("env", "warn", said, None, r["host"]))
    for key in ("torch", "cuda", "nccl"):
        versions = Counter(h[key] for h in hosts.values())
        if len(versions) > 1:
            common = versions.most_common(1)[0][0]
            for name, h in hosts.items():
                if h[key] != common:
                    findings.append(Finding("env", "warn", f"runs {key} {h[key]} where the others run {common}",
                                            None, name))  # fmt: skip
    return hosts


def si(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def render(report: dict) -> list[str]:
    """The table: one row per rank with its verdict per check and its main numbers; then each host's facts,
    the collectives' bandwidth, the findings, and the summary line."""
    dtypes = list(report["ranks"][0]["matmul"]) if report["ranks"] else []
    head = ["rank", "host", "device", *CHECKS, *(f"{t} matmul" for t in dtypes), "copy", "write"]
    rows = [head]
    for r in report["ranks"]:
        cells = [str(r["rank"]), r["host"], r["device"]]
        cells += [{"fail": "FAIL", "warn": "WARN"}.get(v, v) for v in (r["verdicts"][c] for c in CHECKS)]
        cells += [_of_peak(r["matmul"][t]) for t in dtypes]
        cells += [si(r["memory_bandwidth"], "B/s"), si(r["disk"]["bytes_per_s"], "B/s")]
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for name, h in report["hosts"].items():
        shm = h["shm_total_bytes"]
        state = h.get("state") or {}
        line = (f"host {name}: {h['ranks']} rank(s), {h['device_name']}, torch {h['torch']}, CUDA {h['cuda'] or '-'},"
                f" NCCL {h['nccl'] or '-'}, bf16 {'yes' if h['bf16'] else 'no'},"
                f" {h['shm_path']} {_gib(shm)}")  # fmt: skip
        if state:
            line += f" (memory snapshots need {_gib(state['snapshot_bytes_per_host'])})"
        line += f", {h['checkpoint_dir']} {_gib(h['disk_free_bytes'])} free"
        if state:
            line += f" (a checkpoint is {_gib(state['checkpoint_bytes'])})"
        lines.append(line)
    if report["bandwidth"]:
        lines.append("collectives, all ranks: " + ", ".join(f"{name} {si(v, 'B/s')}" for name, v
                                                            in report["bandwidth"].items()))  # fmt: skip
    lines += [finding_line(f) for f in report["findings"]]
    lines.append(report["summary"])
    return lines


def _of_peak(m: dict) -> str:
    """Achieved FLOP/s, and the share of the data sheet's peak where there is one (GPUs)."""
    said = si(m["flops"], "FLOP/s")
    return f"{said} ({m['flops'] / m['peak_flops']:.0%} of peak)" if m.get("peak_flops") else said


def _gib(value: float | None) -> str:
    return "?" if value is None else f"{value / environment.GIB:.2f} GiB"
