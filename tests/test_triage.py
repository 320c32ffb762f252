"""Incident triage (liandan.track.triage): each kind of evidence a run records, classified as data, hardware,
code or unknown; and two drills run for real here, a crash in a user's callback and a hang in a collective.
The other drills are triaged where they already run: the poisoned batch and a kill in the demo
(test_cli.py), perturb@matmul, flip@param and corrupt@allreduce in test_health.py, kill, raise and a hang
in the data in test_supervisor.py."""

from __future__ import annotations

import os

import pytest

from helpers import read_run, run_liandan, tiny_config, write_corpus
from liandan import faults
from liandan.resilience.incidents import timeline
from liandan.track.triage import CATEGORIES, triage

USER_TRACEBACK = """Traceback (most recent call last):
  File "/usr/lib/python3.11/runpy.py", line 198, in _run_module_as_main
  File "/opt/venv/lib/python3.11/site-packages/liandan/train/trainer.py", line 301, in train
  File "/opt/venv/lib/python3.11/site-packages/liandan/train/callbacks.py", line 88, in after_step
  File "/home/me/project/my_callbacks.py", line 12, in after_step
    total = 1 / self.seen
ZeroDivisionError: division by zero
"""
LIANDAN_TRACEBACK = USER_TRACEBACK.rsplit("  File", 1)[0] + "KeyError: 'loss'\n"
COLLECTIVE_TRACEBACK = USER_TRACEBACK.rsplit("  File", 1)[0] + (
    "torch.distributed.DistBackendError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"
)
OOM_TRACEBACK = USER_TRACEBACK.rsplit("  File", 1)[0] + "torch.OutOfMemoryError: CUDA out of memory.\n"


def crash(text: str | None, cause: str = "exit code 1") -> dict:
    tracebacks = {"rank 1": [text]} if text else {}
    return {"kind": "incident", "failure": "crash", "cause": cause, "step": 7, "rank": 1, "host": "node-a",
            "evidence": {"tracebacks": {"rank 0": ["KeyError: 'unrelated'"], **tracebacks}}}  # fmt: skip


@pytest.mark.parametrize(
    "event, category, said",
    [
        (crash(USER_TRACEBACK), "code", "a crash in user code at project/my_callbacks.py:12 in after_step"),
        (crash(LIANDAN_TRACEBACK), "code", "a crash in liandan at liandan/train/callbacks.py:88"),
        (crash(COLLECTIVE_TRACEBACK), "hardware", "a collective failed under rank 1 on node-a"),
        (crash(OOM_TRACEBACK), "code", "ran out of memory"),
        # another rank's traceback is a consequence of this one's death, not its cause
        (crash(None, "signal SIGKILL"), "unknown", "killed from outside (signal SIGKILL)"),
        (
            {"kind": "incident", "failure": "hang", "cause": "hang in allreduce", "rank": 0, "host": "b"},
            "hardware",
            "rank 0 on b stopped first, in allreduce",
        ),
        (
            {"kind": "rollback", "culprit_data_steps": [18], "documents": 3, "report": "guard/spike.json"},
            "data",
            "data step(s) 18 are anomalous on the model from before the spike (3 document(s) named",
        ),
        ({"kind": "rollback", "culprit_data_steps": [], "reproduced": False}, "hardware", "did not come back"),
        (
            {
                "kind": "rollback",
                "culprit_data_steps": [],
                "reproduced": True,
                "layers_first": [{"layer": "layers.3", "statistic": "grad_norm"}],
            },
            "code",
            "moved first: layers.3",
        ),
        ({"kind": "too_good", "step": 40, "tokens": ["\\\\"]}, "data", "the loss fell faster than learning does"),
        ({"kind": "guard", "action": "warn", "detectors": ["spike"]}, "unknown", "without a rollback"),
        ({"kind": "sdc", "ranks": [], "ambiguous": "ranks 0 and 1 disagree; no majority"}, "unknown", "no majority"),
        (
            {"kind": "checkpoint_failed", "error": "OSError: [Errno 28] No space left on device"},
            "hardware",
            "storage is full",
        ),
        ({"kind": "checkpoint_rejected", "error": "shard fails its checksum"}, "hardware", "no longer verifies"),
        (
            {
                "kind": "doctor",
                "ok": False,
                "failures": [{"check": "golden", "rank": 3, "host": "c", "what": "computes wrong matrix products"}],
            },
            "hardware",
            "rank 3 on host c computes wrong",
        ),
        (
            {
                "kind": "doctor",
                "ok": True,
                "warnings": [
                    {"check": "env", "rank": None, "host": "c", "what": "runs torch 2.12 where the others run 2.13"}
                ],
            },
            "code",
            "host c runs torch 2.12",
        ),
        (
            {
                "kind": "doctor",
                "ok": True,
                "warnings": [
                    {
                        "check": "env",
                        "rank": None,
                        "host": "c",
                        "what": "has 0.00 GiB free; 4 checkpoints of 0.00 GiB each need 0.01 GiB",
                    }
                ],
            },
            "hardware",
            "0.00 GiB free",
        ),
        ({"kind": "preempted", "signal": "SIGTERM"}, "hardware", "the cluster took the run's nodes back"),
        ({"kind": "incident", "failure": "crash"}, "unknown", "ended with  and no traceback"),
    ],
)
def test_each_kind_of_evidence_is_triaged(event, category, said):
    found = triage(event)
    assert found.category == category and found.category in CATEGORIES, found
    assert said in found.evidence, found
    assert found.next_step


def test_what_is_no_fault_is_not_triaged():
    for event in ({"kind": "restart", "attempt": 1}, {"kind": "recovered"}, {"kind": "doctor", "ok": True},
                  {"kind": "guard", "action": "rollback", "detectors": ["spike"]}):  # fmt: skip
        assert triage(event) is None
    # a record whose fields are of the wrong type is still classified, as unknown
    assert triage({"kind": "sdc", "ranks": 5}).category == "unknown"


USERS_CALLBACK = """
from liandan.train.callbacks import Callback, register_callback


class Fails(Callback):
    def after_step(self, ctx, step, metrics):
        if step == 2:
            raise ZeroDivisionError("the user's own bug")


@register_callback("fails")
def fails(cfg):
    return Fails()
"""


@pytest.mark.slow
def test_a_crash_in_a_users_callback_is_triaged_as_user_code(tmp_path):
    (tmp_path / "users_failing.py").write_text(USERS_CALLBACK)
    cfg = tiny_config(tmp_path / "runs", write_corpus(tmp_path), "--train.steps=3", '--train.callbacks=["users_failing"]',
                      "--resilience.supervise=true", "--resilience.max_restarts=0")  # fmt: skip
    config = tmp_path / "run.toml"
    config.write_text(cfg.to_toml())
    env = {k: v for k, v in os.environ.items() if k not in (faults.ENV, faults.ENV_ALWAYS)}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    done = run_liandan("train", config, env=env, timeout=300)
    assert done.returncode != 0
    [incident] = read_run(tmp_path / "runs" / "run").of_kind("incident")
    found = triage(incident)
    assert found.category == "code" and "a crash in user code at " in found.evidence, found
    assert "users_failing.py" in found.evidence and "ZeroDivisionError: the user's own bug" in found.evidence
    assert found.next_step.startswith("fix ") and "users_failing.py" in found.next_step
    shown = run_liandan("incidents", tmp_path / "runs" / "run", check=True).stdout
    assert "-> code: a crash in user code at " in shown


@pytest.mark.slow
def test_a_hang_in_a_collective_is_triaged_as_hardware(tmp_path):
    cfg = tiny_config(tmp_path / "runs", write_corpus(tmp_path), "--train.steps=8", "--checkpoint.every=2",
                      "--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--resilience.backoff_s=0",
                      "--resilience.hang_floor_s=4", "--resilience.hang_factor=4")  # fmt: skip
    config = tmp_path / "run.toml"
    config.write_text(cfg.to_toml())
    env = {k: v for k, v in os.environ.items() if k not in (faults.ENV, faults.ENV_ALWAYS)}
    # rank 1 never sends its gradients of step 6 (after 5 steps, the supervisor's hang timeout follows the step time)
    env[faults.ENV] = "hang@allreduce:6:1"
    done = run_liandan("train", config, "--nproc=2", env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]  # found, killed and resumed
    [incident] = read_run(tmp_path / "runs" / "run").of_kind("incident")
    assert incident["failure"] == "hang" and incident["cause"] == "hang in backward" and incident["step"] == 5
    found = triage(incident)
    assert found.category == "hardware" and "stopped first, in " in found.evidence, found
    assert "a hang in a collective points at the network or a peer" in found.next_step
    assert any(line.strip().startswith("-> hardware: rank ") for line in timeline(tmp_path / "runs" / "run", True))
