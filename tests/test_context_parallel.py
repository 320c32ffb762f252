"""Context parallelism (`parallel.cp`) on the CPU: what runs here.

PyTorch's ring attention runs only CUDA's SDPA kernels (liandan.train.context_parallel says why), so a CPU run
asking for cp > 1 is refused in one line; benchmarks/context_parallel.py checks the ring on a GPU. The rest of a
context-parallel step is tested on 2 gloo ranks by tests/cp_worker.py, with a stand-in for the attention
(gathered keys and values under the causal mask of their positions): the sequence sharded in the causal
load-balancing order by PyTorch's `context_parallel`, the rotary positions travelling with the tokens, the loss
weights when targets are left out, the loss over the cp ranks, and FSDP2's gradient average over dp_shard x cp.
Tolerances: the losses equal to a relative 1e-6 (they came out bit-equal), the gradients to 1e-5 absolute
(seen: 1e-6; the keys' reductions run in another order).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import free_port, run_liandan, tiny_config, write_corpus
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
    assert cp_refusal(2, 64, "causal", "sdpa", "cpu").startswith("parallel.cp = 2 needs CUDA: PyTorch's ring")


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


@pytest.mark.slow
def test_cp_on_the_cpu_is_refused_in_one_line(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_config(tmp_path / "runs", write_corpus(tmp_path)).to_toml())
    done = run_liandan("train", config, "--nproc=2", "--parallel.cp=2", "--train.mask=causal", timeout=180)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("liandan: error: parallel.cp = 2 needs CUDA: PyTorch's ring")
