"""The guard's watch on the routers of a mixture of experts: a router collapse planted by the `collapse@router`
drill is named within the window and acted on (warned of, or rolled back with the learning rate cut and the
balancing bias put back), imbalance drift is named, a clean MoE run raises no router alarm, and a spike
report names the routers that moved first."""

from __future__ import annotations

import json
import os

import pytest

from helpers import faults_planned, read_run, run_liandan, tiny_config, write_corpus
from liandan import faults
from liandan.model.moe import moe_layers
from liandan.train import Trainer
from liandan.train.guard.callback import GuardCallback
from liandan.train.guard.diagnosis import routers_moved_first
from liandan.train.guard.rules import RouterWatch

MOE = ["--model.moe_experts=4", "--model.moe_top_k=2", "--model.moe_dense_layers=1", "--guard.ring_every=5",
       "--guard.router_warmup=4",
       "--guard.router_window=6"]  # fmt: skip
PLANTED = 12  # the step the drill pushes layer 1's router towards expert 0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("router-corpus"), 60)


def train(out, corpus, *overrides, fault="", steps=24):
    """An in-process tiny MoE run; returns (the trainer after training, what the run directory holds)."""
    with faults_planned(fault):
        trainer = Trainer(tiny_config(out, corpus, f"--train.steps={steps}", *MOE, *overrides), say=lambda m: None)
        try:
            result = trainer.train()
        finally:
            trainer.close()
    return trainer, read_run(result.run_dir)


def test_a_clean_moe_run_raises_no_router_alarm(tmp_path, corpus):
    trainer, records = train(tmp_path, corpus, steps=30)
    assert records.of_kind("guard") == [] and records.of_kind("rollback") == []
    assert trainer.module.routing is not None and trainer.module.routing.layers == [1]


def test_a_planted_collapse_is_warned_of_within_the_window(tmp_path, corpus):
    trainer, records = train(tmp_path, corpus, fault=f"collapse@router:{PLANTED}:1")
    [event] = records.of_kind("guard")
    assert event["detectors"] == ["collapse"] and event["action"] == "warn"
    assert event["began"] == PLANTED and event["step"] == PLANTED + 6 - 1  # named as the window fills
    assert "layers.1: expert 0 chosen by 100% of the tokens" in event["detail"]
    assert records.of_kind("rollback") == []
    # A warning changes nothing: expert 0 still takes every token at the end.
    bias = moe_layers(trainer.module.model)[1].router.expert_bias
    assert bias[0] > 9.0


def test_a_planted_collapse_is_rolled_back_with_the_learning_rate_cut(tmp_path, corpus):
    trainer, records = train(tmp_path, corpus, "--guard.on_collapse=rollback", fault=f"collapse@router:{PLANTED}:1")
    [rollback] = records.of_kind("rollback")
    assert rollback["detectors"] == ["collapse"] and rollback["step"] == PLANTED + 6 - 1
    assert rollback["began"] == PLANTED and rollback["to"] == 10  # the newest state kept before step 12 - 1
    assert rollback["lr_scale"] == 0.5 and rollback["lr_until"] is None
    assert rollback["skipped"] == [10, 10]  # the same batches again: the data is not to blame
    assert rollback["routers_first"] == ["layers.1"]
    report = json.loads((records.path / "guard" / f"spike-step-{rollback['step']:08d}.json").read_text())
    moved = {(m["statistic"], m["step"]) for m in report["routers_first"]}
    assert ("bias", PLANTED) in moved and ("entropy", PLANTED) in moved
    # The restored bias (a buffer) let the router balance again: no second alarm, every expert in use.
    assert len(records.of_kind("guard")) == 1
    bias = moe_layers(trainer.module.model)[1].router.expert_bias
    assert bias.abs().max() < 0.1
    assert trainer.module.routing.load.min() > 0.05
    assert [m["step"] for m in records.metrics] == list(range(1, 25))


@pytest.mark.slow
def test_two_fsdp_ranks_roll_back_a_planted_collapse_together(tmp_path, corpus):
    """Every rank judges the routing summed over both and plants the same bias: they roll back together, and
    the run ends with the bias they restored (FSDP leaves buffers whole on every rank)."""
    config = tmp_path / "moe.toml"
    config.write_text(tiny_config(tmp_path, corpus, "--train.steps=24", *MOE).to_toml())
    env = {**{k: v for k, v in os.environ.items() if k != faults.ENV}, faults.ENV: f"collapse@router:{PLANTED}:1"}
    done = run_liandan("train", config, "--nproc=2", "--run.name=fsdp", "--guard.on_collapse=rollback", env=env,
                       timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_run(tmp_path / "fsdp")
    [rollback] = records.of_kind("rollback")
    assert (rollback["step"], rollback["began"], rollback["to"]) == (PLANTED + 5, PLANTED, 10)
    assert rollback["routers_first"] == ["layers.1"] and rollback["lr_scale"] == 0.5
    assert [m["step"] for m in records.metrics] == list(range(1, 25))


def test_a_stop_policy_stops_the_run_at_the_collapse(tmp_path, corpus):
    from liandan.run import RunStopped

    with pytest.raises(RunStopped, match="router collapse") as stopped:
        train(tmp_path, corpus, "--guard.on_collapse=stop", fault=f"collapse@router:{PLANTED}")
    [run_dir] = [p for p in tmp_path.iterdir() if (p / "events.jsonl").is_file()]
    [event] = read_run(run_dir).of_kind("train_stopped")  # the run shows as stopped, not interrupted
    assert event["error"] == str(stopped.value) and event["cause"] == "user error"
    assert f"at step {event['step']}:" in event["error"]  # the last step completed: the router watch stops after it


def test_the_drill_refuses_a_layer_without_a_router(tmp_path, corpus):
    with pytest.raises(ValueError, match="no MoE router there"):
        train(tmp_path, corpus, fault="collapse@router:2:0", steps=3)  # block 0 is dense


def test_a_dead_expert_and_a_drifting_balance_are_named():
    watch = RouterWatch(window=4, warmup=3, dead=0.05, hot=0.9, drift=0.3, top_k=2)
    found = []
    for step in range(1, 9):
        found += watch.judge(step, {"layers.0": [0.25, 0.25, 0.25, 0.25]}, {"layers.0": [0.0] * 4})
    assert found == []
    for step in range(9, 13):
        found += watch.judge(step, {"layers.0": [0.0, 1 / 3, 1 / 3, 1 / 3]}, {"layers.0": [0.0] * 4})
    assert [(kind, began) for kind, began, _ in found] == [("drift", 8), ("collapse", 9)]
    assert "max/mean expert load 1.33" in found[0][2] and "expert 0 gets 0 of the mean load" in found[1][2]
    # A collapse is named once per streak; a state saved and loaded judges on the same way.
    again = RouterWatch(window=4, warmup=3, dead=0.05, hot=0.9, drift=0.3, top_k=2)
    again.load_state_dict(json.loads(json.dumps(watch.state_dict())))
    assert again.judge(13, {"layers.0": [0.0, 1 / 3, 1 / 3, 1 / 3]}, {}) == []
    assert watch.judge(13, {"layers.0": [0.0, 1 / 3, 1 / 3, 1 / 3]}, {}) == []


def test_routers_that_moved_first_are_named_earliest_first():
    def step(n, entropy, bias):
        return {"step": n, "layers": {"layers.1": {"entropy": 0.99, "max": 1.1, "bias": [0.0, 0.0]},
                                      "layers.2": {"entropy": entropy, "max": 1.1, "bias": bias}}}  # fmt: skip

    recent = [step(n, 0.99 - 0.001 * (n % 2), [0.001 * n, -0.001 * n]) for n in range(1, 11)]
    recent += [step(11, 0.98, [0.5, -0.011]), step(12, 0.6, [0.5, -0.012]), step(13, 0.5, [0.5, -0.013])]
    moved = routers_moved_first(recent, began=13, restored=10)
    assert [(m["layer"], m["statistic"], m["step"]) for m in moved] == [("layers.2", "bias", 11),
                                                                       ("layers.2", "entropy", 12)]  # fmt: skip
    assert moved[0]["expert"] == 0 and routers_moved_first(recent, began=10, restored=10) == []


def test_a_dense_run_has_no_routing_to_watch(tmp_path, corpus):
    with faults_planned():
        trainer = Trainer(tiny_config(tmp_path, corpus, "--train.steps=3"), say=lambda m: None)
        try:
            trainer.train()
        finally:
            trainer.close()
    [guard] = [c for c in trainer.callbacks if isinstance(c, GuardCallback)]
    assert trainer.module.routing is None and guard.routers.layers == {} and not guard.routers.recent
