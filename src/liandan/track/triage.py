"""Incident triage: is it a data problem, a hardware problem or a code problem? Each incident event of a run is
classified from the evidence its record carries, with the evidence that decided it and a next step.

- **data**: the guard's diagnosis put the batches of named data steps through the model from before the spike
  and found them anomalous (their documents are in its report), or the loss fell too fast to be learning (a
  flood of easy tokens).
- **hardware** (devices, hosts, the network, storage and the cluster): a silent-data-corruption check or the
  doctor named a rank (a golden matrix product, replicas that disagree, a collective delivering wrong data),
  a device fault, a straggler, a spike that did not come back when replayed from the same state (transient),
  a hang (the phase and rank that stopped first), a collective that failed, a full disk or a checkpoint
  changed on disk, a preemption.
- **code** (liandan's, the user's, or the configuration): a Python traceback, placed by its innermost frame in
  liandan or outside it (a user's callback or plug-in), a user error the run stopped on, a spike that comes
  back on replay with batches that look normal (the update: learning rate, optimizer state), software that
  differs between hosts.
- **unknown**: what the record cannot decide (a process killed from outside with no traceback, a guard
  warning no rollback diagnosed, replicas that disagree without a majority).

The rules read the fields the events are written with (`liandan.resilience`, `liandan.train.guard`,
`liandan.train.health`, `liandan.doctor`); a record missing a field is classified as far as it says anything.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

CATEGORIES = ("data", "hardware", "code", "unknown")

# What a traceback's last line says when a collective failed under the rank, rather than the rank's own code.
COLLECTIVE_FAILURE = re.compile(
    r"DistBackendError|DistNetworkError|NCCL|[Gg]loo|Connection (closed|reset|refused)|Broken pipe|"
    r"ProcessGroup|[Ww]atchdog|timed out",
)
OUT_OF_MEMORY = re.compile(r"out of memory|OutOfMemoryError|MemoryError")
FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
# Frames that are neither liandan's nor the user's: the interpreter's and the installed packages'.
LIBRARY = re.compile(r"[/\\](site-packages|dist-packages|lib[/\\]python\d+\.\d+)[/\\]")
LIANDAN = re.compile(r"[/\\]liandan[/\\]")
HARDWARE_CHECKS = ("golden", "matmul", "memory", "collectives", "pairs", "disk")


@dataclass(frozen=True)
class Triage:
    category: str  # one of CATEGORIES
    evidence: str  # what in the record decided it
    next_step: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    def line(self) -> str:
        return f"{self.category}: {self.evidence}; next: {self.next_step}"


def triage(event: dict[str, Any]) -> Triage | None:
    """The classification of one incident event; None for an event that is no fault (a restart, a recovery, a
    clean doctor, a preemption plan)."""
    try:
        return _triage(event)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return Triage("unknown", f"an incomplete {event.get('kind', 'event')} record", "read it in events.jsonl")


def _triage(e: dict[str, Any]) -> Triage | None:
    kind = e.get("kind")
    rule = _RULES.get(kind)
    return rule(e) if rule else None


def _rollback(e: dict) -> Triage:
    culprits = e.get("culprit_data_steps") or []
    report = e.get("report", "its report")
    if culprits:
        steps = ", ".join(str(s) for s in culprits)
        return Triage("data", f"data step(s) {steps} are anomalous on the model from before the spike"
                              f" ({e.get('documents', 0)} document(s) named in {report})",
                      "the run skipped them; take the named documents out of their source and look for more like"
                      " them (liandan inspect)")  # fmt: skip
    routers = e.get("routers_first") or []
    if routers:
        return Triage("unknown", f"no anomalous batch; the router of {routers[0]} moved first",
                      "look at that layer's expert loads in the report; a collapse points at the balancing (bias"
                      " rate, auxiliary loss)")  # fmt: skip
    if e.get("reproduced") is False:
        return Triage("hardware", "no anomalous batch, and the spike did not come back when replayed from the same"
                                  " state: a transient fault",
                      "if it recurs, run liandan doctor on the hosts of the run")  # fmt: skip
    if e.get("reproduced"):
        moved = e.get("layers_first") or []
        first = f"; moved first: {moved[0].get('layer')} {moved[0].get('statistic')}" if moved else ""
        return Triage("code", "no anomalous batch, and the spike comes back when replayed from the same state:"
                              f" the update (learning rate, optimizer state) or the model's code{first}",
                      "lower the learning rate or its warm-up, or look at the layer that moved first")  # fmt: skip
    return Triage("unknown", "the rollback's diagnosis found no culprit batch and did not replay", f"read {report}")


def _too_good(e: dict) -> Triage:
    tokens = ", ".join(repr(t) for t in e.get("tokens", [])[:5])
    easiest = f"; easiest tokens {tokens}" if tokens else ""
    return Triage(
        "data",
        f"the loss fell faster than learning does at step {e.get('step')}{easiest}",
        "look at those batches' sources for repeated or degenerate text (liandan inspect)",
    )


def _guard(e: dict) -> Triage | None:
    if e.get("action") == "rollback":  # the rollback's own record carries the diagnosis
        return None
    detectors = e.get("detectors") or []
    if detectors == ["drop"]:
        return _too_good(e)
    what = ", ".join(detectors) or "a finding"
    stopped = " and stopped the run" if e.get("action") == "stop" else ""
    return Triage(
        "unknown",
        f"the guard saw {what}{stopped} without a rollback to diagnose it",
        'let the guard roll back (guard.on_spike = "rollback"): its replay tells data from a fault',
    )


def _nonfinite(e: dict) -> Triage:
    return Triage(
        "unknown",
        f"a non-finite loss ({e.get('loss')}) at step {e.get('step')} with no diagnosis",
        "turn the guard on: it rolls back and tells bad data from a transient fault",
    )


def _sdc(e: dict) -> Triage:
    ranks = e.get("ranks") or []
    if not ranks:
        return Triage("unknown", e.get("ambiguous") or "replicas disagree and no rank is named",
                      "run liandan doctor on every host of the run")  # fmt: skip
    hosts = e.get("hosts") or ["?"] * len(ranks)
    named = ", ".join(f"rank {r} on {h}" for r, h in zip(ranks, hosts, strict=False))
    why = e.get("reason") or "disagreed with its replicas"
    checks = ", ".join(e.get("checks") or [])
    if e.get("persistent"):
        step = "the run stopped on that device: exclude its host or replace the device, and run liandan doctor there"
    else:
        step = "the run rolled back and goes on; the same check naming it again stops the run"
    return Triage("hardware", f"{named} {why} ({checks})", step)


def _device_fault(e: dict) -> Triage:
    marked = "excluded" if e.get("excluded") else "recorded as a suspect"
    return Triage(
        "hardware",
        f"node {e.get('node')} failed its golden matrix product ({marked})",
        "test or replace the device (liandan doctor on that host) before it rejoins",
    )


def _node_excluded(e: dict) -> Triage:
    why = e.get("reason") or f"{e.get('failures')} failures attributed to it"
    return Triage("hardware", f"node {e.get('node')}: {why}", "run liandan doctor on it before it rejoins")


def _straggler(e: dict) -> Triage:
    ratio = e.get("seconds", 0.0) / max(e.get("median_seconds") or 1e-12, 1e-12)
    return Triage(
        "hardware",
        f"rank {e.get('rank')} on {e.get('host')}: its {e.get('phase')} takes {ratio:.1f}x the others' median",
        "check that device's clocks and temperature and its host's load; exclude it if it persists",
    )


def _incident(e: dict) -> Triage:
    where = f"rank {e.get('rank')}" + (f" on {e['host']}" if e.get("host") else "")
    if e.get("failure") == "hang":
        phase = str(e.get("cause", "")).removeprefix("hang in ")
        if phase == "startup":
            return Triage(
                "unknown",
                f"no progress before the first step ({where})",
                "read the attempt's log: a rendezvous, an import or a data read that never ends",
            )
        return Triage("hardware", f"{where} stopped first, in {phase}, and the others waited",
                      "look at the stacks in the record and at that host's network and storage; a hang in a"
                      " collective points at the network or a peer")  # fmt: skip
    evidence = e.get("evidence") or {}
    text = _traceback_of(evidence, e.get("rank"))
    if text:
        return _from_traceback(text, where)
    cause = str(e.get("cause", ""))
    if "SIGKILL" in cause:
        return Triage(
            "unknown",
            f"{where} was killed from outside ({cause}) with no traceback",
            "check the host's kernel log for the out-of-memory killer, and the scheduler's",
        )
    return Triage("unknown", f"{where} ended with {cause} and no traceback", "read the attempt's log")


def _traceback_of(evidence: dict, rank: Any) -> str:
    """The failed rank's last traceback (the supervisor's relay labels them "rank R"); any rank's only where no
    rank is named: the others' tracebacks after a rank died are its consequences (their collectives fail)."""
    tracebacks = evidence.get("tracebacks") or {}
    if not isinstance(tracebacks, dict) or not tracebacks:
        return ""
    if rank is None:
        found = list(tracebacks.values())
    else:
        found = [texts for label, texts in tracebacks.items() if label == f"rank {rank}"]
    if not found:
        return ""
    texts = found[0]
    return texts[-1] if isinstance(texts, list) and texts else str(texts or "")


def _from_traceback(text: str, where: str) -> Triage:
    lines = [line for line in text.splitlines() if line.strip()]
    error = lines[-1].strip() if lines else "an exception"
    if OUT_OF_MEMORY.search(error):
        return Triage(
            "code",
            f"{where} ran out of memory: {error}",
            "fit the run to the device: liandan plan, a smaller micro-batch or recomputation",
        )
    if COLLECTIVE_FAILURE.search(error):
        return Triage(
            "hardware",
            f"a collective failed under {where}: {error}",
            "check the network and the peer ranks (the first to fail is named in the record)",
        )
    frames = [m for line in lines if (m := FRAME.match(line))]
    own = [m for m in frames if LIANDAN.search(m["file"]) or not LIBRARY.search(m["file"])]
    if not own:
        return Triage("code", f"{where} raised {error} inside a library", "read the traceback in the record")
    last = own[-1]
    place = f"{_short(last['file'])}:{last['line']} in {last['func']}"
    if LIANDAN.search(last["file"]):
        return Triage(
            "code",
            f"a crash in liandan at {place}: {error}",
            "a bug in liandan or a case it refuses badly: report it with the traceback in the record",
        )
    return Triage("code", f"a crash in user code at {place}: {error}", f"fix {_short(last['file'])}")


def _short(path: str) -> str:
    """A file's path from its package (liandan/...) or its last two parts."""
    parts = re.split(r"[/\\]", path)
    if "liandan" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("liandan") :])
    return "/".join(parts[-2:])


def _gave_up(e: dict) -> Triage:
    reason = str(e.get("reason", ""))
    if "user error" in reason or "error:" in reason:
        return Triage(
            "code",
            f"the run stopped on an error it cannot retry past: {reason}",
            "fix the configuration or the code it names, then resume",
        )
    return Triage(
        "unknown", f"the supervisor gave up: {reason or 'no reason recorded'}", "triage the incidents before it"
    )


def _checkpoint_failed(e: dict) -> Triage:
    error = str(e.get("error", ""))
    last = [line for line in error.splitlines() if line.strip()]
    said = last[-1].strip() if last else "no error recorded"
    if "No space left" in error or "ENOSPC" in error or "Disk quota" in error:
        return Triage(
            "hardware",
            f"the checkpoint's storage is full: {said}",
            "free space or move checkpoint.dir; the previous checkpoint is kept",
        )
    return Triage("unknown", f"a checkpoint failed to save: {said}", "read the error in the record")


def _checkpoint_rejected(e: dict) -> Triage:
    return Triage(
        "hardware",
        f"a saved checkpoint no longer verifies: {e.get('error', '')}",
        "the run fell back to an older checkpoint; check the storage that changed it",
    )


def _preempted(e: dict) -> Triage:
    return Triage(
        "hardware",
        f"the cluster took the run's nodes back ({e.get('signal')})",
        "nothing: the run resumes from its save",
    )


def _doctor(e: dict) -> Triage | None:
    findings = (e.get("failures") or []) + (e.get("warnings") or [])
    if e.get("ok") and not findings:
        return None
    if not findings:
        return Triage("unknown", str(e.get("summary", "the doctor stopped the run")), "read doctor.json")

    def said(f: dict) -> str:
        who = f"rank {f.get('rank')} on host {f.get('host')}" if f.get("rank") is not None else f"host {f.get('host')}"
        return f"the doctor's {f.get('check')} check: {who} {f.get('what')}"

    if device := next((f for f in findings if f.get("check") in HARDWARE_CHECKS), None):
        return Triage(
            "hardware", said(device), "exclude that host or replace the device; liandan doctor again before it rejoins"
        )
    if disk := next((f for f in findings if "free" in str(f.get("what", ""))), None):  # room for checkpoints
        return Triage("hardware", said(disk), "free space or move checkpoint.dir before the run needs it")
    return Triage("code", said(findings[0]), "make the hosts' software the same")


_RULES = {
    "rollback": _rollback,
    "too_good": _too_good,
    "guard": _guard,
    "nonfinite_loss": _nonfinite,
    "sdc": _sdc,
    "device_fault": _device_fault,
    "node_excluded": _node_excluded,
    "straggler": _straggler,
    "incident": _incident,
    "gave_up": _gave_up,
    "checkpoint_failed": _checkpoint_failed,
    "checkpoint_rejected": _checkpoint_rejected,
    "preempted": _preempted,
    "doctor": _doctor,
}
