"""Recovery time and goodput of a supervised 2-rank run with injected faults, against the same run without.

A tiny Llama (configs/tiny.toml; `--scenario small` for a smaller one on shorter steps) trains for 200 steps on
2 processes (FSDP2 over gloo, CPU) under `liandan.resilience.supervisor`, with a durable checkpoint every 20
steps and an in-memory snapshot every step (`--memory-every`, 0 for none), twice: once without faults and once
with five faults, one per attempt:

    attempt 0  kill@step:27:1     SIGKILL of rank 1 after step 27
    attempt 1  raise@step:53:0    RuntimeError on rank 0 after step 53
    attempt 2  hang@data:90:1     rank 1 hangs loading the batch of step 90
    attempt 3  exit@save:120:0    rank 0 exits (code 1) while finalising the checkpoint of step 120
    attempt 4  kill@step:165:0    SIGKILL of rank 0 after step 165

(with --steps N the steps scale with N; the save fault stays on a checkpoint step).

    python benchmarks/recovery.py                      # both runs, about 6 minutes on 2 cores
    python benchmarks/recovery.py --steps 60           # a quick look
    python benchmarks/recovery.py --json results.json  # what docs/benchmarks.md reports
    python benchmarks/recovery.py --scenario small --memory-every 0   # durable checkpoints only

$LIANDAN_FAULTS fires in the first attempt only, so one fault per attempt needs a per-attempt schedule: the
supervisor's `attempt_env` hook sets $LIANDAN_FAULTS_ALWAYS to the schedule's entry for each attempt (none
after the last). The worker command is the one `liandan train` gives the supervisor, `python -m liandan.cli
train CONFIG --nproc=2 --run.name=NAME`, and the supervisor runs in this process:
`Supervisor(cfg, command, run_dir, 2, attempt_env=...).run()`.

Reported per incident, from the run's events.jsonl: what was injected, what the supervisor detected (crash or
hang), the step, the rank, the steps and seconds lost (the supervisor's: redone work from the resumed
checkpoint to the detection), the restart backoff, the recovery seconds of the matching "recovered" event
(detection to the next completed step), and the time from the fault itself to the next completed step. The
fault's time is the oldest of the ranks' last heartbeats when the supervisor reports the failure (read in its
`say` callback, before the next attempt clears them): the rank that failed beat last just before it failed,
its peers beat again before they blocked. For the hang: the seconds without progress against the learned
timeout (target: at most twice the timeout), and how long after the last progress the incident was recorded.
Worker processes of a failed attempt that are still alive when the supervisor reports the failure are counted
and then ended by this script (after the supervisor's handling, so its timing is measured as it is).

Goodput is the supervisor's: seconds of kept steps (metrics.jsonl after the last resume) over the
supervisor's wall time. Beside it: goodput without the fixed costs that the fault-free run pays as well (the
first attempt's start-up and the end: final checkpoint, summary, teardown), the fault-free run's goodput, the
ceiling that the redone steps alone leave (steps / (steps + steps lost)), and the wall time split into start-up,
kept steps, redone work, detection (fault to incident record), restarts (incident record to the next attempt's
train_start: backoff, launch, start-up, checkpoint load), end and the rest. The final weights of both runs
(checkpoints/step-00000200) must be bit-identical.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from liandan.checkpoint.loading import load_model
from liandan.config import load_config
from liandan.resilience.processes import alive
from liandan.resilience.supervisor import Supervisor
from liandan.train.heartbeat import read_heartbeats

ROOT = Path(__file__).resolve().parents[1]
NPROC = 2
GOODPUT_TARGET = 0.90
HANG_TARGET = 2.0  # a hang detected within this many timeouts

# The runs, on top of a config file (None: the built-in defaults); stated in the report.
#   tiny:  configs/tiny.toml as shipped (16 x 256 tokens per step, BPE vocabulary of 4096) on a token store
#          prepared beforehand, as a pretraining run's data is; fp32, no evaluation
#   small: a 3.1M-parameter model on 4 x 256 tokens per step with a byte tokenizer: steps of ~0.3 s, so that
#          start-up and restarts weigh far more than in any real run
SCENARIOS = {
    "tiny": (ROOT / "configs" / "tiny.toml", ["--train.dtype=fp32", "--train.eval_every=0",
                                              "--schedule.warmup_steps=20"]),
    "small": (None, ["--model.dim=256", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2",
                     "--model.max_seq_len=256", "--train.global_batch=4", "--train.seq_len=256", "--train.dtype=fp32",
                     "--schedule.warmup_steps=20", "--data.tokenizer=byte"]),
}  # fmt: skip
RESILIENCE = {
    "backoff_s": 0.25,  # doubles per restart: 0.25, 0.5, 1, 2, 4 s for five restarts
    "hang_factor": 10.0,  # the default
    "hang_floor_s": 5.0,  # tens of step times of a ~0.3 s step; seconds, not the default minute
    "startup_timeout_s": 120.0,  # start-up takes seconds here; the default is half an hour
    "max_restarts": 8,  # room for the five planned faults and a few more
}

# (action@point, fraction of the run, rank, description); one per attempt, in attempt order.
FAULTS = [
    ("kill@step", 0.135, 1, "SIGKILL of rank 1 after step {s}"),
    ("raise@step", 0.265, 0, "RuntimeError on rank 0 after step {s}"),
    ("hang@data", 0.45, 1, "rank 1 hangs loading the batch of step {s}"),
    ("exit@save", 0.60, 0, "rank 0 exits (code 1) while finalising the checkpoint of step {s}"),
    ("kill@step", 0.825, 0, "SIGKILL of rank 0 after step {s}"),
]


def fault_schedule(steps: int, every: int) -> list[dict]:
    out = []
    for spec, fraction, rank, text in FAULTS:
        step = max(1, round(fraction * steps))
        if spec.endswith("@save"):  # only checkpoint steps have a save
            step = min(max(every, every * round(step / every)), every * ((steps - 1) // every))
        out.append({"fault": f"{spec}:{step}:{rank}", "step": step, "rank": rank, "description": text.format(s=step)})
    return out


def load_helpers():
    spec = importlib.util.spec_from_file_location("liandan_test_helpers", ROOT / "tests" / "helpers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(
            ["lscpu"], check=False, capture_output=True, text=True, timeout=10
        ).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "load_average_start": list(os.getloadavg())}  # fmt: skip


# -- running ---------------------------------------------------------------------------------------------
def run_supervised(config: Path, cfg, name: str, schedule: list[str], log: Path, verbose: bool) -> dict:
    """One supervised run: the supervisor's exit code, its start and end, and for each failure the ranks'
    heartbeats when the supervisor reported it and the worker processes still alive then."""
    run_dir = Path(cfg.run.output_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    worker = [sys.executable, "-m", "liandan.cli", "train", str(config), f"--nproc={NPROC}", f"--run.name={name}"]
    for key in ("LIANDAN_FAULTS", "LIANDAN_FAULTS_ALWAYS"):
        os.environ.pop(key, None)

    def attempt_env(number: int) -> dict[str, str]:
        return {"LIANDAN_FAULTS_ALWAYS": schedule[number]} if number < len(schedule) else {}

    failures: list[dict] = []
    out = sys.stdout

    def say(message: str) -> None:
        if message.startswith("supervisor:") and " restart " in message:  # a failure was just recorded
            beats = read_heartbeats(run_dir / "heartbeat")
            # The supervisor has waited for the launcher to exit: a worker alive now outlives its attempt. It
            # is ended here, after the supervisor's own handling, so that it does not hold memory (or, for a
            # hung rank, live forever); the time it cost the supervisor is measured all the same.
            leaked = [b["pid"] for b in beats if alive(b["pid"])]
            for pid in leaked:
                os.kill(pid, signal.SIGKILL)
            failures.append({"time": time.time(), "beats": beats, "leaked_pids": leaked})
            if leaked:
                message += f" [{len(leaked)} worker process(es) of the failed attempt still alive: ended]"
        print(f"  [{name}] {message}", file=out, flush=True)

    supervisor = Supervisor(cfg, worker, run_dir, nproc=NPROC, say=say, attempt_env=attempt_env)
    started = time.time()
    with open(log, "w") as sink:
        # The supervisor relays the workers' output to sys.stdout/sys.stderr: to a log unless --verbose.
        quiet = contextlib.ExitStack()
        if not verbose:
            quiet.enter_context(contextlib.redirect_stdout(sink))
            quiet.enter_context(contextlib.redirect_stderr(sink))
        with quiet:
            code = supervisor.run()
    return {"code": code, "started": started, "ended": time.time(), "failures": failures, "run_dir": run_dir}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


# -- analysis ---------------------------------------------------------------------------------------------
def analyse(result: dict, planned: list[dict]) -> dict:
    """Per-incident rows and a partition of the supervisor's wall time:

    wall = first start-up + kept steps + redone work + detection + restarts + end + other

    first start-up: supervisor start to the first attempt's train_start event; redone work: from the point
    the failing attempt passed the checkpoint it resumes from (its own train_start, or the record of that
    step) to the fault; detection: fault to the incident record; restart: incident record to the next
    attempt's train_start (backoff, launch, start-up, checkpoint load); end: last step's record to the
    supervisor's end (final checkpoint, summary, teardown; from the last attempt's train_start if a failure came
    after the last step); other: the rest (checkpoint blocking and
    bookkeeping between kept steps)."""
    run_dir = result["run_dir"]
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    record = {m["step"]: m for m in metrics}
    incidents = [e for e in events if e["kind"] == "incident"]
    restarts = [e for e in events if e["kind"] == "restart"]
    recovered = [e for e in events if e["kind"] == "recovered"]
    starts = [e for e in events if e["kind"] == "train_start"]  # one per attempt that got to its first step
    resumed = [e for e in events if e["kind"] == "resumed"]
    per_attempt = len(starts) == len(incidents) + 1
    rows = []
    for i, incident in enumerate(incidents):
        nxt = incidents[i + 1]["time"] if i + 1 < len(incidents) else float("inf")
        rec = next((r for r in recovered if incident["time"] <= r["time"] < nxt), None)
        restart = next((r for r in restarts if incident["time"] <= r["time"] < nxt), None)
        loaded = next((r for r in resumed if incident["time"] <= r["time"] < nxt), None)
        next_start = next((r for r in starts if incident["time"] <= r["time"] < nxt), None)
        seen = result["failures"][i] if i < len(result["failures"]) else {"beats": [], "leaked_pids": []}
        fault_time = min((b["time"] for b in seen["beats"]), default=None)
        plan = planned[incident["attempt"]] if incident["attempt"] < len(planned) else None
        a = incident["attempt"]
        redone = restart_s = None
        if per_attempt and fault_time is not None:
            began = (
                starts[a]["time"]
                if incident["resume_step"] <= starts[a]["step"]
                else record[incident["resume_step"]]["time"]
            )
            redone = fault_time - began
            restart_s = starts[a + 1]["time"] - incident["time"]
        row = {
            "attempt": a,
            "fault": plan["fault"] if plan else "(not injected)",
            "injected": plan["description"] if plan else None,
            "detected_as": incident["failure"],
            "cause": incident["cause"],
            "step": incident["step"],
            "rank": incident["rank"],
            "resume_step": incident["resume_step"],
            "steps_lost": incident["steps_lost"],
            "seconds_lost": incident["seconds_lost"],  # the supervisor's figure
            "backoff_s": restart["after_seconds"] if restart else None,
            "recovery_s": rec["seconds"] if rec else None,  # the "recovered" event: incident record to next step
            "recovered_at_step": rec["step"] if rec else None,
            "fault_time": fault_time,
            "detection_s": incident["time"] - fault_time if fault_time else None,
            "fault_to_next_step_s": rec["time"] - fault_time if rec and fault_time else None,
            "redone_work_s": redone,
            "restart_s": restart_s,
            "leaked_workers": len(seen["leaked_pids"]),
            # where a restart goes: launch, imports, process group, model and checkpoint load (to "resumed",
            # backoff left out); the set-up after the load (to "train_start"); the first step
            "to_resumed_s": loaded["time"] - incident["time"] - (restart["after_seconds"] if restart else 0)
            if loaded
            else None,
            "resumed_to_start_s": next_start["time"] - loaded["time"] if loaded and next_start else None,
            "start_to_step_s": rec["time"] - next_start["time"] if rec and next_start else None,
        }
        if incident["failure"] == "hang":
            ev = incident["evidence"]
            last_progress = max(b["time"] for b in ev["ranks"])
            row.update(stalled_s=ev["stalled_seconds"], timeout_s=ev["timeout_seconds"],
                       hang_within_target=ev["stalled_seconds"] <= HANG_TARGET * ev["timeout_seconds"],
                       stall_to_incident_s=incident["time"] - last_progress)  # fmt: skip
        rows.append(row)

    wall, kept = summary["supervisor_wall_seconds"], summary["kept_step_seconds"]
    startup = starts[0]["time"] - result["started"] if starts else 0.0
    last = max(metrics, key=lambda m: m["step"]) if metrics else None
    end_time = next((e["time"] for e in reversed(events) if e["kind"] == "supervisor_end"), result["ended"])
    # from the last step's record, or from the last attempt's start when a failure came after the last step
    end = end_time - max([last["time"] if last else result["started"], *(s["time"] for s in starts[len(incidents) :])])
    steps = summary.get("steps", 0)
    lost_steps = sum(r["steps_lost"] for r in rows)
    parts = {k: sum(r[k] or 0.0 for r in rows) for k in ("redone_work_s", "detection_s", "restart_s", "backoff_s")}
    times = sorted(m["step_time_s"] for m in metrics)
    return {
        "exit_code": result["code"],
        "steps": steps,
        "restarts": summary.get("restarts"),
        "wall_s": wall,
        "kept_step_s": kept,
        "goodput": summary["goodput"],
        "first_startup_s": startup,
        "end_s": end,
        # the fixed costs a fault-free run pays as well left out: the time lost to faults alone
        "goodput_without_fixed_costs": kept / (wall - startup - end) if wall > startup + end else None,
        "steps_lost": lost_steps,
        **parts,
        "other_s": wall - kept - startup - end - parts["redone_work_s"] - parts["detection_s"] - parts["restart_s"],
        "redo_ceiling": steps / (steps + lost_steps) if steps else None,
        "median_step_s": times[len(times) // 2] if times else None,
        "final_loss": summary.get("final_loss"),
        "incidents": rows,
    }


def compare_weights(a: Path, b: Path) -> dict:
    model_a, _ = load_model(a)
    model_b, meta_b = load_model(b)
    sa, sb = model_a.state_dict(), model_b.state_dict()
    differ = [k for k in sa if k not in sb or not torch.equal(sa[k], sb[k])]
    return {"path_clean": str(a), "path_faults": str(b), "step": meta_b.get("step"), "tensors": len(sa),
            "bit_identical": not differ and set(sa) == set(sb), "differing": differ}  # fmt: skip


# -- report -----------------------------------------------------------------------------------------------
def _f(value, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def print_report(info: dict, clean: dict, faults: dict, weights: dict, verdict: dict) -> None:
    print()
    print(f"machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, Python {info['python']}; "
          f"load average {info['load_average_start'][0]:.2f} at the start, {info['load_average_end'][0]:.2f} at the end")  # fmt: skip
    print(f"model: {info['parameters'] / 1e6:.2f}M parameters; {info['steps']} steps of {info['tokens_per_step']} "
          f"tokens; checkpoint every {info['every']} steps (async), memory snapshot every {info['memory_every']} "
          f"(0: none); {NPROC} ranks, FSDP2 on gloo; scenario {info['scenario']}")  # fmt: skip
    print("resilience: " + ", ".join(f"{k}={v}" for k, v in info["resilience"].items()))
    print()
    print("| # | injected | detected | cause | step | rank | resumed | steps lost | s lost | detection s | "
          "backoff s | recovery s | fault to next step s |")  # fmt: skip
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in faults["incidents"]:
        print(f"| {r['attempt']} | `{r['fault']}` | {r['detected_as']} | {r['cause']} | {r['step']} | {r['rank']} | "
              f"{r['resume_step']} | {r['steps_lost']} | {_f(r['seconds_lost'])} | {_f(r['detection_s'])} | "
              f"{_f(r['backoff_s'], 2)} | {_f(r['recovery_s'])} | {_f(r['fault_to_next_step_s'])} |")  # fmt: skip
    for r in faults["incidents"]:
        if r["detected_as"] == "hang":
            print(f"\nhang (attempt {r['attempt']}): no progress for {r['stalled_s']:.1f}s when detected; learned timeout "
                  f"{r['timeout_s']:.1f}s; {r['stalled_s'] / r['timeout_s']:.2f}x "
                  f"({'within' if r['hang_within_target'] else 'NOT within'} {HANG_TARGET:g}x); incident recorded "
                  f"{r['stall_to_incident_s']:.1f}s after the last progress")  # fmt: skip
    print()
    print("restart breakdown (s): | # | launch to checkpoint loaded | set-up after the load | first step |")
    for r in faults["incidents"]:
        print(
            f"| {r['attempt']} | {_f(r['to_resumed_s'], 2)} | {_f(r['resumed_to_start_s'], 2)} | {_f(r['start_to_step_s'], 2)} |"
        )
    leaked = [(r["attempt"], r["leaked_workers"]) for r in faults["incidents"] if r["leaked_workers"]]
    if leaked:
        print(
            "worker processes alive after their attempt had ended: " + ", ".join(f"attempt {a}: {n}" for a, n in leaked)
        )
    print()
    print("| run | wall s | kept step s | goodput | goodput w/o fixed costs | 1st start-up s | end s | "
          "redone work s | detection s | restarts s | other s | median step s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, a in (("fault-free", clean), (f"{len(faults['incidents'])} faults", faults)):
        print(f"| {label} | {a['wall_s']:.1f} | {a['kept_step_s']:.1f} | {100 * a['goodput']:.1f}% | "
              f"{_f(100 * a['goodput_without_fixed_costs'], 1, '%')} | {a['first_startup_s']:.1f} | {a['end_s']:.1f} | "
              f"{a['redone_work_s']:.1f} | {a['detection_s']:.1f} | {a['restart_s']:.1f} | {a['other_s']:.1f} | "
              f"{_f(a['median_step_s'], 3)} |")  # fmt: skip
    print()
    print(f"fault-free wall / faulty wall: {clean['wall_s'] / faults['wall_s']:.1%}; ceiling from redone steps alone: "
          f"{faults['steps']} / ({faults['steps']} + {faults['steps_lost']}) = {_f(100 * (faults['redo_ceiling'] or 0), 1, '%')}")  # fmt: skip
    print(
        f"final weights at step {weights['step']}: "
        + ("bit-identical" if weights["bit_identical"] else f"DIFFER in {len(weights['differing'])} tensors")
        + f" ({weights['tensors']} tensors)"
    )
    print()
    for key, (ok, text) in verdict.items():
        print(f"{key}: {'met' if ok else 'NOT met'} ({text})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    parser.add_argument("--every", type=int, default=20, help="steps between checkpoints (default 20)")
    parser.add_argument(
        "--hang-floor",
        type=float,
        default=RESILIENCE["hang_floor_s"],
        help=f"resilience.hang_floor_s (default {RESILIENCE['hang_floor_s']:g})",
    )
    parser.add_argument(
        "--backoff",
        type=float,
        default=RESILIENCE["backoff_s"],
        help=f"resilience.backoff_s (default {RESILIENCE['backoff_s']:g})",
    )
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="tiny", help="which run (default tiny)")
    parser.add_argument(
        "--memory-every",
        type=int,
        default=1,
        help="checkpoint.memory_every: steps between in-memory snapshots, 0 for none (default 1)",
    )
    parser.add_argument("--dir", type=Path, help="keep the runs here (default: a temporary directory, deleted)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--verbose", action="store_true", help="show the workers' output")
    opts = parser.parse_args()
    if opts.steps < 2 * opts.every:
        parser.error(f"--steps must be at least twice --every ({opts.every})")

    resilience = {**RESILIENCE, "hang_floor_s": opts.hang_floor, "backoff_s": opts.backoff}
    info = machine()
    work = Path(tempfile.mkdtemp(prefix="liandan-recovery-")) if opts.dir is None else opts.dir
    work.mkdir(parents=True, exist_ok=True)
    try:
        corpus = load_helpers().write_corpus(work, n_docs=79)
        base, settings = SCENARIOS[opts.scenario]
        data = [f'--data.paths=["{corpus}"]']
        if opts.scenario == "tiny":
            from liandan.data.pipeline.prepare import prepare_store

            prepare_store(load_config(base, data).data, work / "store", say=lambda m: None)
            data = [f'--data.stores=["{work / "store"}"]']
        overrides = [f"--run.output_dir={work / 'runs'}", *settings, *data,
                     f"--train.steps={opts.steps}", f"--checkpoint.every={opts.every}",
                     f"--checkpoint.memory_every={opts.memory_every}",
                     *(f"--resilience.{k}={v}" for k, v in resilience.items())]  # fmt: skip
        cfg = load_config(base, overrides)
        config = work / "recovery.toml"
        config.write_text(cfg.to_toml())
        planned = fault_schedule(opts.steps, opts.every)
        print(f"runs under {work}; faults, one per attempt:")
        for i, p in enumerate(planned):
            print(f"  attempt {i}: {p['fault']:18s} {p['description']}")

        results = {}
        for name, schedule in (("clean", []), ("faults", [p["fault"] for p in planned])):
            shutil.rmtree(work / "runs" / name, ignore_errors=True)
            print(f"{name} run ...", flush=True)
            run_cfg = load_config(config, [f"--run.name={name}"])
            results[name] = run_supervised(config, run_cfg, name, schedule, work / f"{name}.log", opts.verbose)
            if results[name]["code"] != 0:
                print(f"{name} run ended with exit code {results[name]['code']}; worker output: {work / f'{name}.log'}")
                return 1
        info["load_average_end"] = list(os.getloadavg())
        clean, faults = analyse(results["clean"], []), analyse(results["faults"], planned)
        final = f"step-{opts.steps:08d}"
        weights = compare_weights(work / "runs/clean/checkpoints" / final, work / "runs/faults/checkpoints" / final)
        meta = json.loads((work / "runs/faults/summary.json").read_text())
        info.update(parameters=meta["parameters"], steps=opts.steps, every=opts.every, memory_every=opts.memory_every,
                    tokens_per_step=cfg.train.global_batch * cfg.train.seq_len, resilience=resilience,
                    scenario=opts.scenario, settings=settings)  # fmt: skip

        hangs = [r for r in faults["incidents"] if r["detected_as"] == "hang"]
        detected = sorted(r["attempt"] for r in faults["incidents"] if r["fault"] != "(not injected)")
        verdict = {
            "goodput >= 90%": (faults["goodput"] >= GOODPUT_TARGET, f"{100 * faults['goodput']:.1f}%"),
            "hang detected within 2x the learned timeout": (
                bool(hangs) and all(r["hang_within_target"] for r in hangs),
                ", ".join(f"{r['stalled_s']:.1f}s stalled at detection, timeout {r['timeout_s']:.1f}s" for r in hangs) or "no hang seen",
            ),
            "every fault detected once, run completed": (
                detected == list(range(len(planned))) and len(faults["incidents"]) == len(planned)
                and faults["exit_code"] == 0,
                f"{len(faults['incidents'])} incidents for {len(planned)} faults, exit code {faults['exit_code']}",
            ),
            "final weights bit-identical to the fault-free run": (weights["bit_identical"], f"step {weights['step']}"),
            "no worker process outlives its attempt": (
                not any(r["leaked_workers"] for r in faults["incidents"]),
                f"{sum(r['leaked_workers'] for r in faults['incidents'])} left alive by the supervisor",
            ),
        }  # fmt: skip
        print_report(info, clean, faults, weights, verdict)
        if opts.json:
            opts.json.write_text(json.dumps({"machine": info, "planned": planned, "clean": clean, "faults": faults,
                                             "weights": weights, "verdict": {k: v[0] for k, v in verdict.items()}},
                                            indent=1, default=str) + "\n")  # fmt: skip
        return 0
    finally:
        if opts.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
