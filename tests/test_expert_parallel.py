"""Expert parallelism (parallel.ep) and tensor parallelism on MoE models: the layout and its refusals, the same
training as without them, and checkpoints moving between expert-parallel degrees.

Tolerances (fp32):
- the worker (tests/ep_worker.py), whole model in one process against FSDP2 x EP x TP on 2 or 4 gloo ranks, same
  global batch: losses and global gradient norms to a relative 1e-6 (measured: equal losses, norms 1e-8
  apart), every gradient within 1e-6 (measured: 3e-8; a gradient divided by the wrong data-parallel size is
  off by 1e-3), parameters after 3 AdamW steps at lr 1e-2 within 5e-5 (measured: up to 1.5e-5; AdamW turns
  the last bits of near-zero gradient elements into whole updates), router biases equal;
- whole runs through `liandan train`: losses to a relative 1e-5, as tests/test_reshard.py (different reduction
  orders); resume in the same layout: bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (
    free_port,
    killed_after_step_6,
    read_run,
    run_liandan,
    run_losses,
    tiny_config,
    train_named,
    write_corpus,
)
from liandan.common.layout import Layout, resolve_layout
from liandan.config import ConfigError, load_config
from liandan.doctor.resume import parse_layout
from liandan.model import ModelArgs
from liandan.train.expert_parallel import ep_refusal

TESTS = Path(__file__).resolve().parent
MOE = ["--model.moe_experts=4", "--model.moe_top_k=2", "--model.moe_ffn_dim=32", "--model.moe_shared_experts=1"]
RTOL = 1e-5


def test_layout_takes_ep_from_dp_shard():
    layout = resolve_layout(load_config(None, ["--parallel.ep=2"]).parallel, 4)
    assert (layout.dp_shard, layout.ep, layout.expert_shard, layout.world_size) == (4, 2, 2, 4)
    assert str(layout) == "fsdp (dp_replicate=1, dp_shard=4, tp=1, ep=2)"
    assert Layout.parse(str(layout)) == layout
    assert resolve_layout(load_config(None, []).parallel, 4).ep == 1


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["--parallel.ep=3"], 4, "parallel.ep = 3 must divide parallel.dp_shard = 4"),
        (["--parallel.ep=2", "--parallel.dp_replicate=2"], 2, "parallel.ep = 2 must divide parallel.dp_shard = 1"),
    ],
)
def test_layout_refuses_ep_not_dividing_dp_shard(overrides, world, message):
    with pytest.raises(ValueError, match=message):
        resolve_layout(load_config(None, overrides).parallel, world)


def test_ep_refuses_dense_models_and_uneven_experts():
    dense = ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=2)
    moe = ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=2, moe_experts=6, moe_top_k=2)
    assert ep_refusal(dense, 1) is None and ep_refusal(moe, 3) is None
    assert "needs a mixture-of-experts model" in ep_refusal(dense, 2)
    assert ep_refusal(moe, 4) == "model.moe_experts = 6 must divide evenly over parallel.ep = 4 ranks"


def _ep_run(out: Path, dp_replicate: int, dp_shard: int, ep: int, collapsed: bool, tp: int = 1, sp: bool = False
            ) -> list[dict]:  # fmt: skip
    """One run of tests/ep_worker.py on dp_replicate x dp_shard x tp gloo ranks; each rank's report."""
    world, port = dp_replicate * dp_shard * tp, str(free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
        command = [sys.executable, str(TESTS / "ep_worker.py"), str(out), str(dp_replicate), str(dp_shard), str(ep),
                   str(int(collapsed)), str(tp), str(int(sp))]  # fmt: skip
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, local_experts, collapsed",
    [((1, 2, 2), 2, False), ((1, 4, 2), 1, False), ((2, 2, 2), 2, False), ((1, 4, 2), 1, True)],
    # ep4: test_resume_ep_checkpoint_in_another_layout. collapsed: half the ranks' experts get no rows, and
    # their zero gradients still go through FSDP2's reduction with their peers'
    ids=["ep2", "fsdp2xep2", "hsdp2xep2", "fsdp2xep2-collapsed"],
)
def test_expert_parallel_equals_one_process(tmp_path, layout, local_experts, collapsed):
    for report in _ep_run(tmp_path, *layout, collapsed):
        for step in report["steps"]:
            assert step["split_loss"] == pytest.approx(step["whole_loss"], rel=1e-6)
            assert step["split_norm"] == pytest.approx(step["whole_norm"], rel=1e-6)
            assert step["grad_diff"] <= 1e-6, step["worst"]
        for name, diff in report["params"].items():
            assert diff <= 5e-5, name
        assert report["bias_diff"] == 0.0 and report["bias_moved"] > 0
        for placements in report["expert_placements"].values():
            assert placements[-2] == "S(0)"  # over ep
            assert placements[-1][0] == local_experts  # this rank's share of the experts, after FSDP2's


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, tp, sp",
    [((1, 1, 1), 2, False), ((1, 1, 1), 2, True), ((1, 2, 1), 2, False), ((1, 2, 2), 2, False), ((1, 2, 2), 2, True)],
    ids=["tp2", "tp2-sp", "fsdp2xtp2", "fsdp2xtp2xep2", "fsdp2xtp2xep2-sp"],
)
def test_tensor_parallel_moe_equals_one_process(tmp_path, layout, tp, sp):
    """Tensor parallelism splits attention and leaves the MoE feed-forward whole on every rank of the group:
    the same losses, gradients and router biases as one process (the loads, counted tp times over, give the
    same shares and bias update)."""
    for report in _ep_run(tmp_path, *layout, False, tp, sp):
        for step in report["steps"]:
            assert step["split_loss"] == pytest.approx(step["whole_loss"], rel=1e-6)
            assert step["split_norm"] == pytest.approx(step["whole_norm"], rel=1e-6)
            assert step["grad_diff"] <= 1e-6, step["worst"]
        for name, diff in report["params"].items():
            assert diff <= 5e-5, name
        assert report["bias_diff"] == 0.0 and report["bias_moved"] > 0


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep-reshard")
    config = root / "tiny.toml"
    cfg = tiny_config(root / "runs", write_corpus(root), "--train.steps=8", "--checkpoint.every=4", "--run.name=",
                      "--resilience.supervise=false", *MOE)  # fmt: skip
    config.write_text(cfg.to_toml())
    done = train_named(config, "reference", 1)
    assert done.returncode == 0, done.stderr[-3000:]
    return config, run_losses(config, "reference")


@pytest.mark.slow
def test_ep_refused_for_a_dense_model_in_one_line(tmp_path):
    config = tmp_path / "dense.toml"
    config.write_text(tiny_config(tmp_path / "runs", write_corpus(tmp_path), "--resilience.supervise=false").to_toml())
    done = train_named(config, "dense", 2, "--parallel.ep=2")
    assert done.returncode == 2
    assert "parallel.ep = 2 needs a mixture-of-experts model" in done.stderr


@pytest.mark.slow
def test_train_moe_with_tensor_parallelism_matches_one_process_and_resumes_without_it(moe_setup):
    """tp 2 with sequence parallelism, killed after its step-4 checkpoint, resumed in one process: the
    replicated experts and the split attention load back into whole tensors."""
    config, reference = moe_setup
    killed = train_named(config, "tp2", 2, "--parallel.tp=2", "--parallel.sequence_parallel=true",
                         "--checkpoint.async_save=false", faults="kill@step:6:0")  # fmt: skip
    assert killed.returncode != 0
    assert run_losses(config, "tp2") == pytest.approx(reference[:6], rel=RTOL)
    done = train_named(config, "tp2", 1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "at step 4" in done.stdout
    assert run_losses(config, "tp2") == pytest.approx(reference, rel=RTOL)


@pytest.mark.slow
def test_train_moe_with_fsdp_x_tp_from_meta_init_matches_one_process(moe_setup):
    config, reference = moe_setup
    done = train_named(config, "fsdp2xtp2-meta", 4, "--parallel.tp=2", "--train.meta_init=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert run_losses(config, "fsdp2xtp2-meta") == pytest.approx(reference, rel=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize(
    "after",
    [(2, ["--parallel.ep=2"]), (1, []), (4, ["--parallel.ep=4"])],
    ids=["ep2-same-layout", "ep2-to-1", "ep2-to-ep4"],
)
def test_resume_ep_checkpoint_in_another_layout(moe_setup, after):
    config, reference = moe_setup
    name = f"ep2-to-{after[0]}{''.join(after[1])}".replace("--parallel.", "-")
    killed_after_step_6(config, name, (2, ["--parallel.ep=2"]))
    assert len(run_losses(config, name)) == 6
    before = run_losses(config, name)
    done = train_named(config, name, after[0], *after[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "at step 4" in done.stdout
    losses = run_losses(config, name)
    assert losses == pytest.approx(reference, rel=RTOL)
    if after[0] == 2:  # the same layout: what the killed run computed for steps 5 and 6, bit for bit
        assert losses[4:6] == before[4:6]
    resumed = read_run(config.parent / "runs" / name).of_kind("resumed")
    assert resumed and resumed[-1]["step"] == 4


def test_doctor_names_expert_parallel_layouts():
    assert parse_layout("fsdp2+ep2").layout == Layout(1, 2, 1, ep=2)
    assert "--parallel.ep=2" in parse_layout("fsdp2+ep2").overrides()
    with pytest.raises(ConfigError, match=r"^--layouts: 'fsdp2\+ep4': parallel.ep = 4 must divide"):
        parse_layout("fsdp2+ep4")


@pytest.mark.slow
def test_doctor_resume_covers_an_expert_parallel_layout(moe_setup, tmp_path):
    config, _ = moe_setup
    report_path = tmp_path / "report.json"
    # saved in the first layout only (half the runs): test_resume_ep_checkpoint_in_another_layout resumes
    # checkpoints saved under ep
    done = run_liandan("doctor", "--resume", config, "--layouts=1,fsdp2+ep2", "--save-in=first",
                       "--resume-steps=4", f"--json={report_path}", timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = json.loads(report_path.read_text())["checks"]
    assert {(c["saved_in"], c["resumed_in"]) for c in checks} == {("1", "1"), ("1", "fsdp2+ep2")}
    for check in checks:
        assert check["passed"]
        if check["saved_in"] == check["resumed_in"]:
            assert check["loss_diff"] == 0 and check["weight_diff"] == 0


@pytest.mark.slow
def test_guard_rolls_back_expert_shards_from_its_ring(moe_setup):
    """A learning-rate burst on 2 ranks with ep = 2: the guard rolls every rank's shards (its experts
    included) back to the ring's state of step 20, from memory, and the run ends."""
    config, _ = moe_setup
    guarded = ["--train.steps=40", "--optim.lr=3e-3", "--train.global_batch=16", "--guard.ring_every=10",
               "--train.seq_len=32", "--model.max_seq_len=32", "--checkpoint.every=100"]  # fmt: skip
    done = train_named(config, "ep-guard", 2, "--parallel.ep=2", *guarded, faults="burst@update:30")
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_run(config.parent / "runs" / "ep-guard")
    [rollback] = records.of_kind("rollback")
    assert (rollback["to"], rollback["from"]) == (20, "memory")
    assert [m["step"] for m in records.metrics] == list(range(1, 41))


@pytest.mark.slow
def test_hsdp_x_ep_fingerprints_agree_until_a_bit_flips(moe_setup):
    """2 replicas x 2 shards with ep = 2: the replicas' fingerprints (expert shards included) and replays agree
    at step 5; a bit flipped on rank 3 after step 7 is found at step 10 in its replica group (ranks 1 and 3),
    and the run rolls back to step 5 and finishes."""
    config, _ = moe_setup
    checked = ["--parallel.dp_replicate=2", "--parallel.ep=2", "--train.steps=12", "--health.check_every=5",
               "--health.replay_every=5", "--guard.ring_every=5", "--checkpoint.every=0"]  # fmt: skip
    done = train_named(config, "ep-sdc", 4, *checked, faults="flip@param:7:3")
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_run(config.parent / "runs" / "ep-sdc")
    [sdc] = records.of_kind("sdc")
    assert sdc["step"] == 10 and sdc["checks"] == ["fingerprint"] and sdc["to"] == 5
    assert "ranks 1, 3 disagree" in sdc["detail"] and records.summary["steps"] == 12
