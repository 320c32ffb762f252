"""Multi-node runs: failures attributed to the node where they began, a node that keeps failing excluded
(the list kept with the run), an excluded node refusing to join, and the other nodes carrying on.

Two "nodes" are two supervisors on this machine ($LIANDAN_NODE_NAME), each with one worker, meeting in
torchrun's elastic c10d rendezvous on 127.0.0.1.
"""

import json
import multiprocessing
import time

import pytest

from helpers import environment_without, free_port, read_run, run_liandan, start_liandan, tiny_config, write_corpus
from liandan.resilience.nodes import ExclusionList, attribute, write_report

pytestmark = pytest.mark.slow


def _node_env(node: str, port: int, **extra) -> dict:
    endpoint = f"127.0.0.1:{port}"
    return environment_without(LIANDAN_NODE_NAME=node, LIANDAN_NNODES="1:2", LIANDAN_RDZV_ENDPOINT=endpoint, **extra)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes")
    cfg = tiny_config(root / "runs", write_corpus(root), "--train.steps=8", "--checkpoint.every=2", "--run.name=",
                      "--resilience.backoff_s=0", "--resilience.hang_floor_s=20", "--resilience.max_restarts=4",
                      "--checkpoint.async_save=false", "--train.global_batch=2")  # fmt: skip
    path = root / "tiny.toml"
    path.write_text(cfg.to_toml())
    return path


def _train(config, name, env, extra=()):
    return start_liandan("train", config, "--nproc=1", f"--run.name={name}", *extra, env=env)


def _events(run_dir, kind):
    return read_run(run_dir).of_kind(kind)


def test_failing_node_is_excluded_and_the_others_carry_on(config):
    """node-b's worker is killed at step 3 in every attempt: after two failures attributed to it, node-b
    leaves and node-a finishes the run alone from the newest checkpoint."""
    port, run_dir = free_port(), config.parent / "runs" / "elastic"
    a = _train(config, "elastic", _node_env("node-a", port, LIANDAN_RDZV_LAST_CALL_S="3"))
    b = _train(config, "elastic", _node_env("node-b", port, LIANDAN_RDZV_LAST_CALL_S="3",
                                            LIANDAN_FAULTS_ALWAYS="kill@step:3"))  # fmt: skip
    _, err_b = b.communicate(timeout=240)
    _, err_a = a.communicate(timeout=240)
    assert b.returncode == 3, err_b[-3000:]
    assert "node node-b is excluded" in err_b and "after 2 failures attributed to it" in err_b
    assert a.returncode == 0, err_a[-3000:]
    assert (run_dir / "checkpoints" / "step-00000008" / "manifest.json").is_file()
    listed = json.loads((run_dir / "excluded_nodes.json").read_text())["nodes"]
    assert listed["node-b"]["excluded"] and len(listed["node-b"]["failures"]) == 2
    assert "node-a" not in listed
    assert (run_dir / "excluded_nodes.txt").read_text().strip() == "node-b"
    incidents = _events(run_dir, "incident")
    assert incidents and all(i["host"] == "node-b" for i in incidents)  # both nodes' records blame node-b
    assert {i["reported_by"] for i in incidents} == {"node-a", "node-b"}
    [excluded] = _events(run_dir, "node_excluded")
    assert excluded["node"] == "node-b"
    # The last attempt ran on node-a alone: one rank.
    assert _events(run_dir, "train_start")[-1]["world_size"] == 1


def test_excluded_node_refuses_to_join(config):
    run_dir = config.parent / "runs" / "refused"
    run_dir.mkdir(parents=True)
    exclusions = ExclusionList(run_dir, limit=2)
    for step in (3, 5):
        exclusions.record_failure("node-b", {"cause": "signal SIGKILL", "step": step})
    started = time.time()
    b = _train(config, "refused", _node_env("node-b", free_port()))
    _, err = b.communicate(timeout=60)
    assert b.returncode == 3
    assert f"node node-b is excluded from run {run_dir}" in err and "Traceback" not in err
    assert not (run_dir / "logs" / "node-b" / "attempt-0.log").exists()  # no worker was started
    [refused] = _events(run_dir, "node_refused")
    assert refused["node"] == "node-b" and refused["time"] >= started


def test_bad_node_settings_are_one_line_errors(config):
    env = _node_env("node-a", 1234)
    env["LIANDAN_NNODES"] = "two"
    done = run_liandan("train", config, "--run.name=bad", env=env, timeout=60)
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == "liandan: error: $LIANDAN_NNODES = 'two' must be a node count N or a range MIN:MAX, e.g. 2:4"
    )


def _add_failures(run_dir, node, n):
    exclusions = ExclusionList(run_dir, limit=1000)
    for i in range(n):
        exclusions.record_failure(node, {"step": i})


def test_concurrent_supervisors_lose_no_failure(tmp_path):
    """Supervisors of different nodes update the list at the same moments: the file lock keeps every count."""
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_add_failures, args=(tmp_path, f"node-{i}", 40)) for i in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    nodes = ExclusionList(tmp_path).read()["nodes"]
    assert {name: len(entry["failures"]) for name, entry in nodes.items()} == {f"node-{i}": 40 for i in range(3)}


def test_attribution_prefers_the_earliest_own_failure(tmp_path):
    start = time.time()
    # node-a's worker died first; node-b's died after, of the lost connection (a secondary failure)
    write_report(
        tmp_path, "node-b", {"since": start + 1.0, "origin": "node-b", "cause": "exit code 1", "secondary": True}
    )
    write_report(
        tmp_path, "node-a", {"since": start + 1.2, "origin": "node-a", "cause": "signal SIGKILL", "secondary": False}
    )
    node, evidence = attribute(tmp_path, start, {"node-a": start, "node-b": start}, grace_s=1.0)
    assert node == "node-a" and evidence["silent"] == []
    # a hang seen from node-c: the stalled rank is on node-b, whatever node-c's own timing
    write_report(
        tmp_path, "node-c", {"since": start + 0.5, "origin": "node-b", "cause": "hang in data", "secondary": False}
    )
    assert attribute(tmp_path, start, {"node-a": start, "node-c": start}, grace_s=1.0)[0] == "node-b"
    # a node that never reports (its machine is gone) and beat last before anyone failed is the origin
    later = time.time()
    write_report(
        tmp_path, "node-a", {"since": later + 2.0, "origin": "node-a", "cause": "exit code 1", "secondary": True}
    )
    node, evidence = attribute(tmp_path, later, {"node-a": later + 1.9, "node-d": later + 0.5}, grace_s=0.3)
    assert node == "node-d" and evidence["silent"] == ["node-d"]


def test_each_node_listens_on_its_address_towards_the_endpoint(monkeypatch):
    """torchrun's rendezvous runs with liandan's backend (stores bound, not on every interface) and each
    node's workers' store on the address it reaches the endpoint from, or $LIANDAN_NODE_ADDR."""
    from liandan.config import ConfigError
    from liandan.resilience.nodes import Rendezvous

    monkeypatch.delenv("LIANDAN_NODE_ADDR", raising=False)
    args = Rendezvous(1, 2, "127.0.0.1:29400", "run").torchrun_args()
    assert "--rdzv-backend=liandan-c10d" in args and "--local-addr=127.0.0.1" in args
    monkeypatch.setenv("LIANDAN_NODE_ADDR", "10.1.2.3")
    assert "--local-addr=10.1.2.3" in Rendezvous(1, 2, "node01:29400", "run").torchrun_args()
    monkeypatch.setenv("LIANDAN_NODE_ADDR", "localhost")  # a name where an address belongs
    with pytest.raises(ConfigError, match="no address of this node to listen on"):
        Rendezvous(1, 2, "node01:29400", "run").torchrun_args()
    monkeypatch.setenv("LIANDAN_NODE_ADDR", "127.0.1.1")  # a host name that resolves to loopback on its node
    with pytest.raises(ConfigError, match="other nodes cannot reach"):
        Rendezvous(1, 2, "node01:29400", "run").torchrun_args()


def test_a_node_whose_device_computes_wrong_is_excluded_at_once(config):
    """node-b's worker computes wrong matrix products from step 3: the replay of step 4 disagrees, its golden
    test fails, every worker stops with the device fault, node-b is excluded at the first incident and leaves,
    and node-a finishes the run alone."""
    port, run_dir = free_port(), config.parent / "runs" / "device"
    checks = ["--health.replay_every=2", "--health.check_every=2", "--guard.ring_every=2"]
    a = _train(config, "device", _node_env("node-a", port, LIANDAN_RDZV_LAST_CALL_S="3"), extra=checks)
    b = _train(config, "device", _node_env("node-b", port, LIANDAN_RDZV_LAST_CALL_S="3",
                                           LIANDAN_FAULTS="perturb@matmul:3"), extra=checks)  # fmt: skip
    _, err_b = b.communicate(timeout=240)
    _, err_a = a.communicate(timeout=240)
    assert b.returncode == 3, err_b[-3000:]
    assert "node node-b is excluded" in err_b and "failed its golden matrix product at step 4" in err_b
    assert a.returncode == 0, err_a[-3000:]
    [sdc] = _events(run_dir, "sdc")
    assert sdc["step"] == 4 and sdc["hosts"] == ["node-b"] and sdc["persistent"]
    listed = json.loads((run_dir / "excluded_nodes.json").read_text())["nodes"]
    assert listed["node-b"]["excluded"] and listed["node-b"]["failures"] == [] and "node-a" not in listed
    assert listed["node-b"]["suspect"][0]["rank"] == sdc["ranks"][0]
    assert _events(run_dir, "train_start")[-1]["world_size"] == 1
