"""Checkpoints move between parallel layouts: save with one, stop, resume with another.

A run of 8 steps saves at step 4 and is killed after step 6; the same run directory is then resumed with a
different layout. Steps 5-8 must match a one-process run of all 8 steps to the distributed tolerance of
test_distributed.py (relative 1e-5, fp32): model, optimizer, scheduler and loader state all carried over,
with the same global batch on any number of data-parallel ranks.
"""

import pytest

from helpers import kill_then_resume, read_run, run_losses, tiny_config, train_named, write_corpus

pytestmark = pytest.mark.slow
RTOL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    config = root / "tiny.toml"
    cfg = tiny_config(
        root / "runs",
        write_corpus(root),
        "--train.steps=8",
        "--checkpoint.every=4",
        "--run.name=",
        "--resilience.supervise=false",
    )
    config.write_text(cfg.to_toml())
    train_named(config, "reference", 1)
    return config, run_losses(config, "reference")


@pytest.mark.parametrize(
    "before, after",
    [
        ((2, []), (1, [])),  # FSDP2 on 2 ranks -> 1 process
        ((1, []), (2, [])),  # 1 process -> FSDP2 on 2 ranks
        ((2, []), (4, ["--parallel.tp=2"])),  # FSDP2 -> FSDP2 x TP (2 x 2)
        ((2, ["--parallel.tp=2"]), (2, ["--parallel.dp_replicate=2"])),  # TP -> DDP
    ],
    ids=["fsdp2-to-1", "1-to-fsdp2", "fsdp2-to-fsdp2xtp2", "tp2-to-ddp2"],
)
def test_resume_in_another_layout(setup, before, after):
    config, reference = setup
    name = f"reshard-{before[0]}{''.join(before[1])}-to-{after[0]}{''.join(after[1])}".replace("--parallel.", "-")
    kill_then_resume(config, name, before, after)
    assert run_losses(config, name) == pytest.approx(reference, rel=RTOL)
    resumed = read_run(config.parent / "runs" / name).of_kind("resumed")
    assert resumed and resumed[-1]["step"] == 4
