"""Context parallelism (`parallel.cp`) on the CPU, with PyTorch's ring attention over the CPU's SDPA kernel
(`liandan.train.cpu_ring`).

tests/cp_worker.py runs a context-parallel step on 2 gloo ranks against the same model in one process: the
sequence sharded in the causal load-balancing order by PyTorch's `context_parallel`, the rotary positions
travelling with the tokens, the ring in forward and backward, the loss weights when targets are left out, the
loss over the cp ranks, and FSDP2's gradient average over dp_shard x cp. Tolerances: the losses equal to a
relative 1e-6, the gradients to 1e-5 absolute (seen: 1e-6; the ring merges the chunks' partial attention by
their log-sum-exp, in another order than one kernel over the whole sequence). The trainer's runs: a sequence of
1,024 tokens over cp = 2, cp = 2 x dp_shard = 2 and cp = 2 x tp = 2 gives one process's losses to 1e-5, and a
kill and resume under cp = 2 the losses of the run that never stopped, bit for bit.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import free_port, kill_then_resume, run_losses, tiny_config, train_named, write_corpus
from liandan.train.context_parallel import cp_refusal

TESTS = Path(__file__).resolve().parent


def test_cp_refusals_name_what_to_set():
    assert cp_refusal(1, 30, "document", "flex", "cpu") is None  # no context parallelism: nothing to check
    assert cp_refusal(2, 64, "causal", "auto", "cuda") is None
    assert cp_refusal(2, 30, "causal", "sdpa", "cuda") == (
        "train.seq_len = 30 must be a multiple of 2 x parallel.cp = 4: the causal load balance cuts each"
        " sequence into 2 x cp equal chunks"
    )
    assert cp_refusal(2, 64, "document", "sdpa", "cuda") == (
        "parallel.cp = 2 needs train.mask = 'causal': PyTorch's ring attention over SDPA has no document mask"
    )
    assert cp_refusal(2, 64, "causal", "flex", "cuda") == (
        "parallel.cp = 2 needs model.attention = 'sdpa' (or 'auto'): ring attention is SDPA's"
    )
    assert cp_refusal(2, 64, "causal", "sdpa", "cpu") is None  # PyTorch's ring over the CPU's kernel
    assert cp_refusal(2, 64, "causal", "sdpa", "mps") == (
        "parallel.cp = 2 needs CUDA or the CPU: PyTorch's ring attention (torch"
        f" {torch.__version__}) shards their SDPA kernels only, not mps's"
    )


def test_a_torch_without_the_ring_internals_is_refused_in_one_line(monkeypatch):
    from liandan.train import cpu_ring

    assert cpu_ring.missing() is None  # this torch has them
    monkeypatch.setattr(cpu_ring, "_NEEDED", (*cpu_ring._NEEDED, "_a_name_torch_does_not_have"))
    assert cp_refusal(2, 64, "causal", "sdpa", "cpu") == (
        f"parallel.cp = 2 on the CPU needs PyTorch's ring attention internals (torch {torch.__version__}):"
        f" {cpu_ring._CP_ATTENTION} has no _a_name_torch_does_not_have"
    )
    monkeypatch.setattr(cpu_ring, "_CP_ATTENTION", "torch.no_such_module")
    assert "torch.no_such_module does not import" in cp_refusal(2, 64, "causal", "sdpa", "cpu")
    assert cp_refusal(2, 64, "causal", "sdpa", "cuda") is None  # CUDA's ring is PyTorch's own


@pytest.mark.slow
def test_sequence_split_loss_and_gradients_match_one_process(tmp_path):
    world, port = 2, str(free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
        command = [sys.executable, str(TESTS / "cp_worker.py"), str(tmp_path)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]
    batch = reports[0]["batch"]
    seq = len(batch["inputs"][0])
    chunk = seq // (2 * world)
    counted = sum(t >= 0 for row in batch["targets"] for t in row)
    for rank, report in enumerate(reports):
        assert report["mesh"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
        share = report["share"]
        # the causal load balance: chunk r and chunk 2cp-1-r of every sequence
        held = [*range(rank * chunk, (rank + 1) * chunk), *range(seq - (rank + 1) * chunk, seq - rank * chunk)]
        for row in range(len(batch["inputs"])):
            assert share["positions"][row] == held
            assert share["inputs"][row] == [batch["inputs"][row][p] for p in held]
            assert share["targets"][row] == [batch["targets"][row][p] for p in held]
        counted_here = sum(t >= 0 for row in share["targets"] for t in row)
        assert share["weight"] == pytest.approx(counted_here * world / counted, rel=1e-6)
        for step in report["steps"]:
            assert step["split_loss"] == pytest.approx(step["whole_loss"], rel=1e-6)
            assert step["grad_diff"] <= 1e-5
        assert report["param_diff"] <= 1e-4  # three AdamW steps of lr 1e-2 move the weights by ~3e-2
    assert reports[0]["share"]["weight"] != reports[1]["share"]["weight"]  # the left-out targets fell on rank 0


# 1,024 tokens a sequence: each cp rank attends over its 512 and the ring brings it the rest
LONG = ["--train.mask=causal", "--model.max_seq_len=1024", "--train.seq_len=1024", "--train.steps=8",
        "--checkpoint.every=4", "--resilience.supervise=false", "--doctor.preflight=false"]  # fmt: skip


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    config = root / "tiny.toml"
    config.write_text(tiny_config(root / "runs", write_corpus(root), "--run.name=", *LONG).to_toml())
    done = train_named(config, "one", 1)
    assert done.returncode == 0, done.stderr[-3000:]
    return config, run_losses(config, "one")


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, layout, shown",
    [(2, ["--parallel.cp=2"], "dp_shard=1, tp=1, cp=2)"),
     (4, ["--parallel.cp=2", "--parallel.dp_shard=2"], "dp_shard=2, tp=1, cp=2)"),
     (4, ["--parallel.cp=2", "--parallel.tp=2"], "dp_shard=1, tp=2, cp=2)")],
    ids=["cp2", "cp2-dp_shard2", "cp2-tp2"],
)  # fmt: skip
def test_a_long_sequence_split_over_cp_ranks_trains_as_one_process(long_run, nproc, layout, shown):
    config, reference = long_run
    name = "-".join(o.split(".")[-1] for o in layout)
    done = train_named(config, name, nproc, *layout)
    assert done.returncode == 0, done.stderr[-3000:]
    assert shown in done.stdout  # split over the cp ranks, not taken as data parallelism (which gives these losses too)
    assert run_losses(config, name) == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow
def test_a_cp_run_killed_and_resumed_gives_the_losses_of_the_run_that_never_stopped(long_run):
    config, _ = long_run
    done = train_named(config, "cp-straight", 2, "--parallel.cp=2")
    assert done.returncode == 0, done.stderr[-3000:]
    straight = run_losses(config, "cp-straight")
    cp = (2, ["--parallel.cp=2"])
    kill_then_resume(config, "cp-resumed", cp, cp)
    assert run_losses(config, "cp-resumed") == straight  # bit for bit
