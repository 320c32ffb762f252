"""The supervisor-worker contract: every LIANDAN_* variable is typed, named once, and read through it."""

import ast
import sys
from pathlib import Path

import pytest

from liandan.config import ConfigError, load_config
from liandan.run import worker_env
from liandan.run.worker_env import NodeEnv, WorkerEnv, node_name

SRC = Path(__file__).resolve().parents[1] / "src" / "liandan"


def test_worker_env_round_trips(tmp_path):
    env = WorkerEnv(supervised=True, attempt=3, attempt_token="sup-3", snapshot_owner="sup",
                    snapshot_dir=tmp_path / "shm", verified_checkpoint=tmp_path / "verified.json", failure_file=tmp_path / "failure.json",
                    preempt_grace_s=12.5, error_dir=tmp_path / "errors", node_name="node-a", cache_dir=tmp_path / "cache",
                    faults="kill@step:3", faults_always="hang@data:2:1")  # fmt: skip
    variables = env.to_env()
    assert set(variables) == set(worker_env.WORKER_NAMES)
    assert variables[worker_env.ATTEMPT] == "3" and variables[worker_env.SUPERVISED] == "1"
    assert WorkerEnv.from_env(variables) == env
    assert WorkerEnv.from_env({}) == WorkerEnv() and WorkerEnv().to_env() == {}
    assert WorkerEnv.from_env(WorkerEnv(supervised=True).to_env()).attempt == 0


def test_node_env_round_trips():
    env = NodeEnv(nnodes=(2, 4), rdzv_endpoint="head:29500", rdzv_id="r1", rdzv_last_call_s=2.5,
                  node_failure_limit=3, standby=False, node_addr="10.0.0.2")  # fmt: skip
    assert set(env.to_env()) == set(worker_env.NODE_NAMES)
    assert NodeEnv.from_env(env.to_env()) == env
    assert NodeEnv.from_env({worker_env.NNODES: "2", worker_env.RDZV_ENDPOINT: "h:1"}).nnodes == (2, 2)
    assert NodeEnv.from_env({}) == NodeEnv() and NodeEnv().to_env() == {}


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"LIANDAN_ATTEMPT": "two"}, "$LIANDAN_ATTEMPT = 'two' must be a whole number of attempts, at least 0"),
        ({"LIANDAN_ATTEMPT": "-1"}, "$LIANDAN_ATTEMPT = '-1' must be a whole number of attempts, at least 0"),
        ({"LIANDAN_SUPERVISED": "yes"}, "$LIANDAN_SUPERVISED = 'yes' must be 1 (on) or 0 (off)"),
        (
            {"LIANDAN_PREEMPT_GRACE_S": "nan"},
            "$LIANDAN_PREEMPT_GRACE_S = 'nan' must be a number of seconds, at least 0",
        ),
    ],
)
def test_a_malformed_worker_variable_is_one_line(variables, message):
    with pytest.raises(ConfigError) as err:
        WorkerEnv.from_env(variables)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"LIANDAN_NNODES": "two"}, "$LIANDAN_NNODES = 'two' must be a node count N or a range MIN:MAX, e.g. 2:4"),
        ({"LIANDAN_NNODES": "4:2"}, "$LIANDAN_NNODES = '4:2' must be a node count N or a range MIN:MAX, e.g. 2:4"),
        ({"LIANDAN_NNODES": "2"}, "$LIANDAN_NNODES is set, so $LIANDAN_RDZV_ENDPOINT must name the rendezvous as host:port"),
        ({"LIANDAN_RDZV_LAST_CALL_S": "soon"}, "$LIANDAN_RDZV_LAST_CALL_S = 'soon' must be a number of seconds"),
        ({"LIANDAN_NODE_FAILURE_LIMIT": "0"}, "$LIANDAN_NODE_FAILURE_LIMIT = '0' must be a whole number of failures, at least 1"),
        ({"LIANDAN_STANDBY": "no"}, "$LIANDAN_STANDBY = 'no' must be 1 (on) or 0 (off)"),
    ],
)  # fmt: skip
def test_a_malformed_node_variable_is_one_line(variables, message):
    with pytest.raises(ConfigError) as err:
        NodeEnv.from_env(variables)
    assert str(err.value) == message


def test_injected_faults_reach_the_first_attempt_only():
    inherited = WorkerEnv(faults="kill@step:3", faults_always="exit@step:5", node_name="n")
    first, second = inherited.for_attempt(0), inherited.for_attempt(1, attempt_token="t")
    assert first.supervised and first.attempt == 0
    assert (first.faults, first.faults_always) == ("kill@step:3", "exit@step:5")
    assert (second.attempt, second.faults, second.faults_always, second.attempt_token) == (1, None, "exit@step:5", "t")
    assert second.node_name == "n"


def test_node_name_falls_back_to_slurm_then_the_host():
    assert node_name({worker_env.NODE_NAME: "a", "SLURMD_NODENAME": "b"}) == "a"
    assert node_name({"SLURMD_NODENAME": "b"}) == "b"
    assert node_name({}) != ""


def test_the_supervisor_hands_each_attempt_the_contract(tmp_path, monkeypatch):
    from liandan.resilience.supervisor import Supervisor

    monkeypatch.setenv(worker_env.FAULTS, "kill@step:2")
    monkeypatch.setenv(worker_env.FAULTS_ALWAYS, "exit@step:9")
    monkeypatch.setenv(worker_env.VERIFIED_CHECKPOINT, "/stale/verified.json")  # never inherited
    cfg = load_config(None, [])
    supervisor = Supervisor(cfg, [sys.executable, "-c", "pass"], tmp_path / "run", nproc=2)
    first, second = WorkerEnv.from_env(supervisor._env(0)), WorkerEnv.from_env(supervisor._env(1))
    assert first.supervised and first.attempt == 0 and second.attempt == 1
    assert first.attempt_token == f"{supervisor.id}-0" and second.attempt_token == f"{supervisor.id}-1"
    assert first.snapshot_owner == supervisor.id and first.error_dir == supervisor.errors
    assert first.verified_checkpoint is None
    assert (first.faults, second.faults) == ("kill@step:2", None)
    assert first.faults_always == second.faults_always == "exit@step:9"


def _liandan_literals(path: Path) -> list[str]:
    """String constants naming a LIANDAN_ variable, docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        and node.value.startswith("LIANDAN_")
    ]  # fmt: skip


def test_the_names_are_defined_in_the_contract_only():
    owners = {
        SRC / "run" / "worker_env.py",
        SRC / "faults.py",  # below the contract: it reads its own two variables, and the contract imports their names
    }
    stray = {str(p.relative_to(SRC)): _liandan_literals(p) for p in SRC.rglob("*.py") if p not in owners}
    assert {path: names for path, names in stray.items() if names} == {}
