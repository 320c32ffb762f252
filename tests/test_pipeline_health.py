"""The loss-spike guard and the silent-data-corruption checks under pipeline parallelism, through `liandan
train`: their decisions rest on the loss (broadcast from the last stage) and the global gradient norm, the
same on every rank, so every stage rolls back together, each from its own ring."""

import pytest

from helpers import read_run, run_losses, tiny_config, train_named, write_corpus

pytestmark = pytest.mark.slow
GUARDED = ["--train.steps=40", "--optim.lr=3e-3", "--train.global_batch=16", "--guard.ring_every=10",
           "--train.seq_len=32", "--model.max_seq_len=32", "--checkpoint.every=100"]  # fmt: skip


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline-health")
    path = root / "tiny.toml"
    cfg = tiny_config(root / "runs", write_corpus(root), "--model.n_layers=4", "--resilience.supervise=false")
    path.write_text(cfg.to_toml())
    return path


def test_guard_rolls_every_stage_back_as_one_process_does(config):
    """A learning-rate burst at update 30: the guard rolls both stages back to its ring's step 20, replays the
    steps (no layer statistics without a whole model), finds the spike transient and skips the data; the
    whole curve, rollback included, equals one process's bit for bit."""
    piped = train_named(config, "pp-guard", 2, "--parallel.pp=2", *GUARDED, faults="burst@update:30")
    assert piped.returncode == 0, piped.stderr[-3000:]
    whole = train_named(config, "one-guard", 1, "--train.micro_batch=8", *GUARDED, faults="burst@update:30")
    assert whole.returncode == 0, whole.stderr[-3000:]
    records = read_run(config.parent / "runs" / "pp-guard")
    [rollback] = records.of_kind("rollback")
    assert (rollback["to"], rollback["from"], rollback["reproduced"]) == (20, "memory", False)
    assert rollback["skipped"] == [20, 31]
    assert run_losses(config, "pp-guard") == run_losses(config, "one-guard")
    assert [m["grad_norm"] for m in records.metrics] == [
        m["grad_norm"] for m in read_run(config.parent / "runs" / "one-guard").metrics
    ]


def test_sdc_replay_finds_a_faulty_rank_of_a_pipeline(config):
    """pp = 2 x dp_shard = 2: each data-parallel rank replays its neighbour's step through the pipeline's
    stages by forward passes; rank 1's wrong matrix products from step 3 make the replays of step 4 disagree,
    the golden matrix product names rank 1, and the run stops."""
    done = train_named(config, "pp-sdc", 4, "--parallel.pp=2", "--train.steps=6", "--health.replay_every=2",
                       "--guard.ring_every=2", faults="perturb@matmul:3:1")  # fmt: skip
    assert done.returncode != 0
    [sdc] = read_run(config.parent / "runs" / "pp-sdc").of_kind("sdc")
    assert sdc["step"] == 4 and "replay of step 4" in done.stdout
    assert "silent data corruption: rank 1" in done.stderr
    # the replays of step 2 agreed (the one incident is step 4's): the stages' forward passes gave the loss
    # the schedule computed; the run was rolled back to step 2
    assert len(run_losses(config, "pp-sdc")) == 2


ROUTED = ["--model.moe_experts=4", "--model.moe_top_k=2", "--model.moe_dense_layers=3", "--model.moe_aux_loss=1e-2",
          "--train.steps=24", "--train.global_batch=16", "--train.seq_len=32", "--model.max_seq_len=32",
          "--checkpoint.every=100", "--guard.ring_every=5", "--guard.router_warmup=4", "--guard.router_window=6",
          "--guard.on_collapse=rollback"]  # fmt: skip


def test_a_router_collapse_on_one_stage_rolls_every_stage_back_as_one_process_does(config):
    """Block 3, the one MoE layer, lives on the second stage: its rank plants the drill's collapse, every rank
    judges the routing shared over the pipeline group (the first holds no router) and both roll back together;
    the curve and the routing metrics equal one process's bit for bit."""
    piped = train_named(config, "pp-router", 2, "--parallel.pp=2", *ROUTED, faults="collapse@router:12:3")
    assert piped.returncode == 0, piped.stderr[-3000:]
    whole = train_named(config, "one-router", 1, "--train.micro_batch=8", *ROUTED, faults="collapse@router:12:3")
    assert whole.returncode == 0, whole.stderr[-3000:]
    records = read_run(config.parent / "runs" / "pp-router")
    [rollback] = records.of_kind("rollback")
    assert (rollback["detectors"], rollback["began"], rollback["to"]) == (["collapse"], 12, 10)
    assert rollback["routers_first"] == ["layers.3"]
    assert run_losses(config, "pp-router") == run_losses(config, "one-router")
    routing = [{k: v for k, v in m.items() if k.startswith("moe/")} for m in records.metrics]
    alone = read_run(config.parent / "runs" / "one-router").metrics
    assert routing == [{k: v for k, v in m.items() if k.startswith("moe/")} for m in alone]
    assert "moe/3/bias_max" in routing[-1]
