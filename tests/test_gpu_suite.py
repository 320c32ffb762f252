"""benchmarks/gpu_suite.py where there is no GPU: it refuses in one line, and its dry run prints `liandan`
commands whose configs load and whose plan the planner makes."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

from helpers import liandan_here
from liandan.config import load_config

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


def _suite(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a machine with one
    return subprocess.run(
        [sys.executable, SUITE, *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def _module():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_refuses_in_one_line():
    done = _suite()
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "no CUDA GPU" in done.stderr


def test_the_dry_run_prints_the_liandan_commands_of_every_phase(tmp_path):
    done = _suite("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    commands = [shlex.split(line) for line in done.stdout.splitlines() if not line.startswith("#")]
    words = [next(w for w in c if not w.startswith("LIANDAN_")) for c in commands]
    assert set(words) == {"liandan"}
    verbs = [c[c.index("liandan") + 1] for c in commands]
    assert verbs == ["doctor", "plan", "train", "train", "plan", "train", "eval", "generate"]
    trains = [c for c in commands if "train" in c]
    assert any(c[0] == "LIANDAN_FAULTS=kill@step:15" for c in trains)  # the run that is killed and resumed
    assert any("--train.fp8=tensorwise" in c for c in trains)
    for c in trains:
        overrides = [w for w in c[c.index("train") + 2 :] if w.startswith("--") and "." in w.split("=")[0]]
        cfg = load_config(c[c.index("train") + 1], overrides)
        assert (cfg.train.compile, cfg.train.mask, cfg.model.options.attention) == (True, "document", "flex")
        assert cfg.train.dtype == "bf16" and cfg.checkpoint.every == 10 and cfg.health.sdc


def test_the_plan_phase_gives_the_memory_the_peak_is_held_against(tmp_path):
    suite = _module()
    args = suite.parse_args(["--out", str(tmp_path)])
    phase = next(p for p in suite.phases(args, tmp_path, 1, "h100", True, None) if p.name == "plan bf16")
    done = liandan_here(*phase.argv)
    assert done.returncode == 0, done.stderr
    planned = suite.planned_gib(done.stdout)
    assert planned is not None and 5 < planned < 80  # a 4-layer 1B-shaped model on one H100


def test_the_resume_verdict_is_bit_for_bit(tmp_path):
    suite = _module()
    reference, killed = tmp_path / "a", tmp_path / "b"
    for run in (reference, killed):
        run.mkdir()
    rows = [f'{{"step": {s}, "loss": {10 - s * 0.1!r}}}' for s in range(1, 6)]
    (reference / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    (killed / "events.jsonl").write_text('{"kind": "restart", "attempt": 1}\n')
    (killed / "metrics.jsonl").write_text("\n".join([*rows[:4], *rows[2:]]) + "\n")  # steps 3-4 trained again
    assert suite.resume_verdict(reference, killed, 4).startswith("ok")
    (killed / "metrics.jsonl").write_text("\n".join([*rows[:4], *rows[2:4], '{"step": 5, "loss": 9.50001}']) + "\n")
    assert suite.resume_verdict(reference, killed, 4).startswith("FAIL: 1 steps differ from step 5")
