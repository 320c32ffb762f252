"""FSDP2's CPU offload (`parallel.cpu_offload`) on 2 gloo processes: the same model, the same losses.

On a CPU the offloaded shards stay where they were (host memory is the device's memory), so the arithmetic is
the one of FSDP2 without offload: the losses must be bit-equal to it, from meta-device initialisation and
through a kill and a resume. What the
offload buys and costs on a GPU is measured by benchmarks/offload.py.
"""

import pytest

from helpers import read_run, run_liandan, run_losses, tiny_config, train_named, write_corpus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    config = root / "tiny.toml"
    cfg = tiny_config(root / "runs", write_corpus(root), "--train.steps=8", "--checkpoint.every=4", "--run.name=",
                      "--resilience.supervise=false")  # fmt: skip
    config.write_text(cfg.to_toml())
    done = train_named(config, "fsdp", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    return config, run_losses(config, "fsdp")


def test_offload_trains_as_fsdp_does_through_a_kill_and_resume(setup):
    config, reference = setup
    # synchronous saves, so the checkpoint of step 4 is complete when the kill after step 6 comes; built on the
    # meta device, its shards filled on the host (meta init gives the weights of the model built whole)
    killed = train_named(config, "offload", 2, "--parallel.cpu_offload=true", "--checkpoint.async_save=false",
                         "--train.meta_init=true", faults="kill@step:6:0")  # fmt: skip
    assert killed.returncode != 0
    assert run_losses(config, "offload") == reference[:6]
    done = train_named(config, "offload", 2, "--parallel.cpu_offload=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "at step 4" in done.stdout
    assert run_losses(config, "offload") == reference
    assert read_run(config.parent / "runs" / "offload").of_kind("resumed")[-1]["step"] == 4


def test_offload_without_sharding_is_refused_in_one_line(setup):
    config, _ = setup
    done = run_liandan("train", config, "--nproc=1", "--run.name=alone", "--parallel.cpu_offload=true", timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        (
            "liandan: error: parallel.cpu_offload offloads FSDP2's parameter shards, but the layout single"
            " (dp_replicate=1, dp_shard=1, tp=1) does not shard: set parallel.dp_shard to more than 1 (or -1"
            " with more processes than dp_replicate x tp)"
        )
    ]
