"""`liandan launch` (a Slurm script or per-node commands, one supervisor per node) and what `liandan train`
does when torchrun, srun or a Slurm allocation started it."""

import os
import shlex
import subprocess

import pytest

from helpers import MICRO_MODEL, environment_without, free_port, read_run, run_liandan, tiny_config, write_corpus
from liandan.cli.main import main
from liandan.config import ConfigError
from liandan.resilience.launch import how_started

STEPS = 4


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    cfg = tiny_config(root / "runs", write_corpus(root), *MICRO_MODEL, f"--train.steps={STEPS}", "--run.name=",
                      "--checkpoint.every=2", "--doctor.preflight=false", "--schedule.warmup_steps=1")  # fmt: skip
    path = root / "tiny.toml"
    path.write_text(cfg.to_toml())
    return path


SRUN_TASK = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_NUM_NODES": "2"}
BATCH_SCRIPT = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}


@pytest.mark.parametrize(
    "nproc, env, how, says",
    [
        (1, {}, "here", None),
        (2, {"LIANDAN_SUPERVISED": "1", "WORLD_SIZE": "2", "RANK": "1"}, "worker", None),
        (1, {"WORLD_SIZE": "2", "RANK": "0"}, "torchrun", "started by torchrun (or another launcher): this run is unsupervised"),
        (1, {"WORLD_SIZE": "2", "RANK": "0", "LIANDAN_ERROR_DIR": "/tmp/e"}, "torchrun", None),  # `supervise = false`
        (1, {**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "8"}, "srun", "started by srun as 8 ranks: this run is unsupervised"),
        (4, {**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "1"}, "here", None),  # srun -n1 liandan train --nproc=4
        (4, {**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "2", "LIANDAN_NNODES": "2", "LIANDAN_RDZV_ENDPOINT": "h:1"}, "here", None),
        (4, {**BATCH_SCRIPT, "SLURM_JOB_NUM_NODES": "1"}, "here", None),  # a batch script on one node: --nproc works
    ],
)  # fmt: skip
def test_how_liandan_train_was_started(nproc, env, how, says):
    start = how_started(nproc, env)
    assert start.how == how
    if says is None:
        assert start.note is None
    else:
        assert start.note.startswith(f"liandan: note: {says}") and "liandan launch" in start.note
        assert "\n" not in start.note


@pytest.mark.parametrize(
    "nproc, env, refusal",
    [
        (8, {**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "2"}, "--nproc = 8 inside a Slurm job step of 2 tasks"),
        (8, {**BATCH_SCRIPT, "SLURM_JOB_NUM_NODES": "2"}, "this Slurm allocation has 2 nodes, but `liandan train`"),
    ],
)
def test_nproc_is_never_silently_ignored_under_slurm(nproc, env, refusal):
    with pytest.raises(ConfigError, match=refusal) as caught:
        how_started(nproc, env)
    assert "\n" not in str(caught.value)


def test_train_in_a_batch_script_of_several_nodes_refuses_in_one_line(config):
    done = run_liandan("train", config, "--nproc=4", env=environment_without(**BATCH_SCRIPT, SLURM_JOB_NUM_NODES="2"))
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("liandan: error: this Slurm allocation has 2 nodes") and "liandan launch" in line


def test_train_under_a_launcher_says_it_is_unsupervised(config):
    env = environment_without(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    done = run_liandan("train", config, "--run.name=torchrun", "--train.steps=1", "--checkpoint.every=0", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    notes = [line for line in done.stderr.splitlines() if "unsupervised" in line]
    assert notes == [notes[0]] and notes[0].startswith("liandan: note: started by torchrun")


def test_sbatch_script_starts_one_supervisor_per_node(config, capsys, tmp_path):
    run = config.parent / "runs" / "big"
    run.mkdir(parents=True)
    (run / "excluded_nodes.txt").write_text("gpu-17\n")  # a node that kept failing in an earlier job
    assert main(["launch", str(config), "--nodes", "4", "--gpus-per-node", "8", "--min-nodes", "3",
                 "--run.name=big", "--train.steps=3"]) == 0  # fmt: skip
    script = capsys.readouterr().out
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --exclude=gpu-17", 'LIANDAN_NNODES="${LIANDAN_NNODES:-3:4}"'):  # fmt: skip
        assert line in script.splitlines() or line in script, line
    [srun] = [line for line in script.splitlines() if line.startswith("srun ")]
    words = shlex.split(srun)
    assert words[:3] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0"]
    assert "--nproc=8" in words and "--run.name=big" in words and "--train.steps=3" in words
    (tmp_path / "job.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], check=False).returncode == 0  # valid shell


def test_submit_without_sbatch_keeps_the_script_and_says_where(config, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without Slurm's commands
    assert main(["launch", str(config), "--nodes", "2", "--gpus-per-node", "1", "--submit", "--run.name=later"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    script = config.parent / "runs" / "later.sbatch"
    assert (
        line == f"liandan: error: sbatch is not on PATH; the script is at {script}: submit it from a Slurm login node"
    )
    assert "#SBATCH --nodes=2" in script.read_text()


def test_launch_refuses_a_layout_the_world_cannot_take(config, capsys):
    assert main(["launch", str(config), "--nodes", "2", "--gpus-per-node", "3", "--parallel.tp=4"]) == 2
    assert "tp" in capsys.readouterr().err


def test_launch_refuses_what_is_not_a_host(config, capsys):
    for hosts, bad in (("a:22,b", "a:22"), ("a b,c", "a b"), ("a;rm -rf /,b", "a;rm -rf /")):
        assert main(["launch", str(config), "--nodes", "2", "--gpus-per-node", "1", f"--hosts={hosts}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"liandan: error: --hosts: {bad!r} is not a host name or address (the port goes to --port)"]
    assert (
        main(
            ["launch", str(config), "--nodes", "3", "--gpus-per-node", "1", "--hosts=gpu-01.cluster,10.0.0.2,[fe80::1]"]
        )
        == 0
    )
    assert "LIANDAN_RDZV_ENDPOINT=gpu-01.cluster:" in capsys.readouterr().out


@pytest.mark.slow
def test_two_nodes_started_from_the_printed_commands(config):
    """Two "nodes" on this machine, each a shell running one printed line: their supervisors meet, start one
    rank each, and train one run of world size 2 together."""
    printed = run_liandan("launch", config, "--nodes=2", "--gpus-per-node=1", "--hosts=127.0.0.1,127.0.0.1",
                          f"--port={free_port()}", "--run.name=two-nodes", "--train.steps=2")  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.strip().splitlines()
    assert len(lines) == 2 and all("LIANDAN_NNODES=2 " in line for line in lines)
    env = environment_without()
    nodes = [subprocess.Popen(["bash", "-c", line], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for line in lines]  # fmt: skip
    outputs = [node.communicate(timeout=240) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    run = read_run(config.parent / "runs" / "two-nodes")
    assert [r["step"] for r in run.metrics] == [1, 2]  # the override reached both nodes
    assert {e["world_size"] for e in run.of_kind("train_start")} == {2}
    assert "unsupervised" not in outputs[0][1] + outputs[1][1]


@pytest.mark.parametrize(
    "how, supervise, nproc, role",
    [
        ("here", True, 1, "supervise"),
        ("here", True, 4, "supervise"),
        ("here", False, 4, "launch"),
        ("here", False, 1, "train"),
        ("worker", True, 4, "train"),
        ("torchrun", True, 1, "train"),
        ("srun", False, 4, "train"),
    ],
)
def test_only_a_process_a_person_started_supervises_or_launches(how, supervise, nproc, role):
    from liandan.config import load_config
    from liandan.resilience.launch import Start
    from liandan.resilience.roles import choose_role

    cfg = load_config(None, [f"--resilience.supervise={str(supervise).lower()}"])
    assert choose_role(cfg, nproc, Start(how)) == role


def test_python_starts_a_supervised_run_of_two_ranks_as_the_command_does(config, monkeypatch, capsys):
    from liandan.cli.main import prepare_training
    from liandan.resilience.roles import run_training

    for name in [k for k in os.environ if k.startswith("LIANDAN_")]:
        monkeypatch.delenv(name)
    code = run_training(str(config), 2, ["--run.name=from-python"], prepare=prepare_training)
    assert code == 0, capsys.readouterr().err[-3000:]
    run = read_run(config.parent / "runs" / "from-python")
    assert run.summary["steps"] == STEPS and run.summary["restarts"] == 0  # the supervisor's summary
    assert {e["kind"] for e in run.events} >= {"supervisor_start", "supervisor_end"}
