"""The GPU suite: what liandan does on a GPU, end to end, in one command of under ten minutes on one H100.

Each phase is a `liandan` command in a subprocess, as a user runs it:

1. `liandan doctor`: the devices' golden matrix products (silent data corruption on the device), matmul
   throughput, memory bandwidth, disk, environment.
2. `liandan plan`: the planner's memory per device for the run, to hold the measured peak against.
3. `liandan train` of a Llama-3.2-1B-shaped model (`configs/llama-1b.toml`, a few layers) in bf16, compiled,
   FlexAttention with document masks, FSDP2 when given two GPUs or more, the SDC checks on (`[health]`),
   checkpoints: the reference run.
4. The same run killed (SIGKILL, `LIANDAN_FAULTS=kill@step:K`) after its first checkpoint: the supervisor
   restarts it from that checkpoint, and its losses must equal the reference's bit for bit.
5. The same run in fp8 (torchao's tensorwise recipe; compute capability 8.9 or more).
6. `liandan eval` of the reference's checkpoint (a generative task: KV-cache generation, and the held-out
   bits per byte) and `liandan generate` from it.

It prints MFU, tokens/s and peak memory against the planner's estimate for each training run, and each
check's verdict; `--json` writes them too. Without a CUDA GPU it refuses in one line. `--dry-run` prints the
commands it would run (anywhere).

    PYTHONPATH=src python benchmarks/gpu_suite.py                  # one GPU, about ten minutes
    PYTHONPATH=src python benchmarks/gpu_suite.py --dry-run
    PYTHONPATH=src python benchmarks/gpu_suite.py --nproc 2 --json suite.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "llama-1b.toml"
PROMPT = "The function"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="print the commands it would run, and run none")
    p.add_argument("--out", help="where the runs go (default: a new temporary directory)")
    p.add_argument("--nproc", type=int, help="GPUs to train on (default: every visible one)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks of the 1B-shaped model (default 4)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per training run (default 30)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (default 10)")
    p.add_argument("--kill-at", type=int, default=15, help="the killed run dies after this step (default 15)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--device-name", help="the planner's name of the device (default: from torch, e.g. h100)")
    p.add_argument("--data-dir", help="where the eval tasks' data lies (default: shared/data beside the repository)")
    p.add_argument("--json", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if not 0 < args.checkpoint_every < args.kill_at < args.steps:
        p.error("need 0 < --checkpoint-every < --kill-at < --steps: the killed run resumes from a checkpoint")
    return args


@dataclass
class Phase:
    name: str
    argv: list[str]  # after `liandan`
    env: dict[str, str] = field(default_factory=dict)
    capture: bool = False  # stdout is the phase's result (JSON), not shown


def liandan(*args: object) -> list[str]:
    return [sys.executable, "-m", "liandan.cli", *map(str, args)]


def train_overrides(args: argparse.Namespace, out: Path, nproc: int) -> list[str]:
    """The suite's run: configs/llama-1b.toml cut to a few layers and a short window, on the byte corpus."""
    return [
        f"--model.n_layers={args.layers}",
        f"--model.max_seq_len={args.seq}",
        f"--train.seq_len={args.seq}",
        f"--train.global_batch={args.batch}",
        f"--train.micro_batch={max(1, args.batch // nproc)}",
        f"--train.steps={args.steps}",
        "--train.dtype=bf16",
        "--train.compile=true",
        "--train.mask=document",
        "--model.llama.attention=flex",
        "--train.activation_checkpoint=none",
        f"--train.eval_every={args.checkpoint_every}",
        "--schedule.warmup_steps=5",
        f"--checkpoint.every={args.checkpoint_every}",
        "--checkpoint.async_save=false",
        "--health.sdc=true",
        "--health.check_every=5",
        "--health.replay_every=10",
        "--data.tokenizer=byte",
        f'--data.paths=["{out / "corpus.jsonl"}"]',
        f"--run.output_dir={out / 'runs'}",
        "--track.plot=false",
        "--doctor.preflight=false",  # the doctor is a phase of its own
    ]


def phases(
    args: argparse.Namespace, out: Path, nproc: int, device: str, fp8: bool, data_dir: Path | None
) -> list[Phase]:
    common = train_overrides(args, out, nproc)
    train = ("train", CONFIG, f"--nproc={nproc}", *common)
    runs = out / "runs"
    # gsm8k is generative (KV-cache generation); without its data, the held-out bits per byte alone
    tasks = ["--tasks=gsm8k", f"--data-dir={data_dir}"] if data_dir else []
    found = [
        Phase("doctor", ["doctor", CONFIG, f"--nproc={nproc}", f"--json={out / 'doctor.json'}", *common]),
        Phase("plan bf16", ["plan", CONFIG, f"--device={device}", f"--nproc={nproc}", "--json", *common], capture=True),
        Phase("train bf16", [*train, "--run.name=bf16"]),
        Phase(
            "train bf16, killed and resumed",
            [*train, "--run.name=bf16-killed", "--resilience.max_restarts=1"],
            env={"LIANDAN_FAULTS": f"kill@step:{args.kill_at}"},
        ),
    ]
    if fp8:
        fp8_train = [*train, "--run.name=fp8", "--train.fp8=tensorwise"]
        found += [
            Phase(
                "plan fp8",
                ["plan", CONFIG, f"--device={device}", f"--nproc={nproc}", "--json", *common, "--train.fp8=tensorwise"],
                capture=True,
            ),
            Phase("train fp8", fp8_train),
        ]
    found += [
        Phase("eval", ["eval", runs / "bf16", *tasks, "--limit=8", f"--json={out / 'eval.json'}"]),
        Phase("generate", ["generate", runs / "bf16", PROMPT, "--max-new-tokens=64", "--temperature=0"], capture=True),
    ]
    return found


def shown(phase: Phase) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in phase.env.items())
    return " ".join(filter(None, [env, "liandan", *map(shlex.quote, map(str, phase.argv))]))


def write_corpus(path: Path, repeats: int = 3) -> None:
    """Python's own documentation, a few times over: enough bytes for the suite's steps, on any machine."""
    from pydoc_data.topics import topics

    with path.open("w") as handle:
        for r in range(repeats):
            for name in sorted(topics):
                handle.write(json.dumps({"id": f"{name}-{r}", "text": topics[name]}) + "\n")


def losses(run: Path) -> dict[int, float]:
    """The loss of each step of a run, the last record of a step winning (a resumed run trains some again)."""
    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().startswith("{")]


def figures(run: Path, planned_gib: float | None) -> dict:
    """Median tokens/s and MFU past the compiling first steps, peak memory against the plan."""
    records = [r for r in read_metrics(run) if "tokens_per_s" in r]
    timed = records[3:] or records
    if not timed:
        return {"verdict": "FAIL: no metrics"}
    peak = max(r["peak_mem_gib"] for r in records)
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed),
        "peak_mem_gib": peak,
        "planned_gib": planned_gib,
        "final_loss": records[-1]["loss"],
    }


def events(run: Path, kind: str) -> list[dict]:
    path = run / "events.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in rows if e.get("kind") == kind]


def resume_verdict(reference: Path, killed: Path, kill_at: int) -> str:
    a, b = losses(reference), losses(killed)
    if not a or set(a) != set(b):
        return f"FAIL: steps differ ({len(a)} in the reference, {len(b)} after the resume)"
    restarts = len(events(killed, "restart"))
    if not restarts:
        return "FAIL: the killed run was never restarted (was the fault planted?)"
    differ = [s for s in sorted(a) if a[s] != b[s]]
    if differ:
        gap = max(abs(a[s] - b[s]) for s in differ)
        return f"FAIL: {len(differ)} steps differ from step {differ[0]} (largest gap {gap:.3g})"
    return f"ok: killed after step {kill_at}, restarted {restarts}x from its checkpoint, {len(a)} losses bit for bit"


def run_phase(phase: Phase, log: Path) -> tuple[int, str, float]:
    started = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIANDAN_")} | phase.env
    with log.open("w") as err:
        stdout = subprocess.PIPE if phase.capture else err
        done = subprocess.run(
            liandan(*phase.argv), env=env, cwd=REPO, stdout=stdout, stderr=err, text=True, check=False
        )
    return done.returncode, done.stdout or "", time.perf_counter() - started


def planned_gib(text: str) -> float | None:
    try:
        return json.loads(text)["memory"]["total"] / 2**30
    except (ValueError, KeyError, TypeError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    if not gpu and not args.dry_run:
        print("gpu_suite: no CUDA GPU here (torch.cuda.is_available() is False); --dry-run prints what it runs",
              file=sys.stderr)  # fmt: skip
        return 2
    nproc = args.nproc or (torch.cuda.device_count() if gpu else 1)
    capability = torch.cuda.get_device_capability() if gpu else (9, 0)
    fp8 = capability >= (8, 9) and (args.dry_run or importlib.util.find_spec("torchao") is not None)
    device = args.device_name or (_planner_name(torch.cuda.get_device_name()) if gpu else "h100")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-suite-"))
    data_dir = Path(args.data_dir) if args.data_dir else next(
        (d for d in (REPO.parent / "shared" / "data", REPO / "shared" / "data") if (d / "eval" / "gsm8k-test.jsonl").is_file()), None)  # fmt: skip
    plan = phases(args, out, nproc, device, fp8, data_dir)
    if args.dry_run:
        print(f"# write {out / 'corpus.jsonl'} (Python's documentation), then:")
        for phase in plan:
            print(shown(phase))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    write_corpus(out / "corpus.jsonl")
    print(f"gpu_suite: {nproc} x {torch.cuda.get_device_name()} (capability {capability[0]}.{capability[1]}), "
          f"torch {torch.__version__}, {args.layers} layers of configs/llama-1b.toml, out {out}", flush=True)  # fmt: skip
    results: dict = {"device": torch.cuda.get_device_name(), "nproc": nproc, "torch": torch.__version__, "phases": {}}
    for phase in plan:
        rc, stdout, seconds = run_phase(phase, out / f"{phase.name.replace(' ', '-').replace(',', '')}.log")
        results["phases"][phase.name] = {"rc": rc, "seconds": round(seconds, 1), "stdout": stdout[-4000:]}
        print(f"  {phase.name:32s} exit {rc}  {seconds:6.1f} s", flush=True)
    verdicts = judge(results, out, args, nproc, fp8)
    results["verdicts"] = verdicts
    print("\nverdicts:")
    for name, line in verdicts.items():
        print(f"  {name:18s} {line}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0 if all(v.startswith(("ok", "n/a")) for v in verdicts.values()) else 1


def judge(results: dict, out: Path, args: argparse.Namespace, nproc: int, fp8: bool) -> dict[str, str]:
    phases_run, runs = results["phases"], out / "runs"

    def rc(name: str) -> int:
        return phases_run.get(name, {}).get("rc", -1)

    verdicts: dict[str, str] = {}
    doctor, report = out / "doctor.json", {}
    if doctor.is_file():
        report = json.loads(doctor.read_text())
        verdicts["doctor"] = ("ok: " if report.get("ok") else "FAIL: ") + str(report.get("summary", ""))[:300]
    else:
        verdicts["doctor"] = f"FAIL: exit {rc('doctor')}, no report"
    for name, run, plan in (("bf16", "bf16", "plan bf16"), ("fp8", "fp8", "plan fp8")):
        if name == "fp8" and not fp8:
            verdicts[name] = "n/a: fp8 needs compute capability 8.9 or more and torchao (the [fp8] extra)"
            continue
        numbers = figures(runs / run, planned_gib(phases_run.get(plan, {}).get("stdout", "")))
        results[f"figures {name}"] = numbers
        if "mfu" not in numbers or rc(f"train {name}"):
            verdicts[name] = f"FAIL: exit {rc(f'train {name}')}"
            continue
        planned = numbers["planned_gib"]
        against = f" (planned {planned:.1f} GiB)" if planned else ""
        verdicts[name] = (f"ok: {numbers['tokens_per_s']:,.0f} tokens/s, MFU {numbers['mfu']:.1%}, peak "
                          f"{numbers['peak_mem_gib']:.1f} GiB{against}, final loss {numbers['final_loss']:.3f}")  # fmt: skip
    verdicts["fsdp2"] = "ok: trained sharded over {nproc} GPUs" if nproc > 1 else "n/a: one GPU, nothing to shard"
    verdicts["fsdp2"] = verdicts["fsdp2"].format(nproc=nproc)
    verdicts["kill + resume"] = resume_verdict(runs / "bf16", runs / "bf16-killed", args.kill_at)
    sdc = [e for run in ("bf16", "bf16-killed", "fp8") for e in events(runs / run, "sdc")]
    golden = [f for f in report.get("findings", []) if isinstance(f, dict) and f.get("check") == "golden"]
    if sdc or golden:
        verdicts["sdc"] = (
            f"FAIL: {len(sdc)} sdc incidents, {len(golden)} golden-product findings: {[*sdc, *golden][0]}"[:300]
        )
    elif not report:
        verdicts["sdc"] = "FAIL: no doctor report, no golden matrix products"
    elif nproc > 1:
        verdicts["sdc"] = "ok: fingerprints, gradient norms and replays agreed every 5 and 10 steps"
    else:
        verdicts["sdc"] = "ok: the doctor's golden matrix products (one GPU: no replicas to compare in training)"
    evaluated = out / "eval.json"
    verdicts["eval"] = (
        f"ok: {_eval_line(evaluated)}" if rc("eval") == 0 and evaluated.is_file() else f"FAIL: exit {rc('eval')}"
    )
    text = phases_run.get("generate", {}).get("stdout", "")
    verdicts["generate"] = f"ok: {text.strip()[:80]!r}" if rc("generate") == 0 and text.startswith(PROMPT) else "FAIL"
    return verdicts


def _eval_line(path: Path) -> str:
    """Each task's spread line and each source's held-out line, from `liandan eval --json`."""
    report = json.loads(path.read_text())
    lines = [t.get("line", t.get("task", "?")) for t in report.get("tasks", [])]
    lines += [h.get("line", h.get("source", "?")) for h in report.get("heldout", [])]
    return "; ".join(lines) or "nothing scored"


def _planner_name(device_name: str) -> str:
    """The planner's device for torch's name of it ("NVIDIA H100 80GB HBM3" -> h100)."""
    lowered = device_name.lower()
    for name in ("h200", "h100", "a100", "l40s", "l4", "b200"):
        if name in lowered:
            return name
    return "h100"


if __name__ == "__main__":
    sys.exit(main())
