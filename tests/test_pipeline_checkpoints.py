"""Checkpoints move between pipeline layouts: a run saves at step 4 under one layout, is killed after step
6, and resumes under another (none, or other stages per rank); steps 5-8 must equal a one-process run of
all 8 steps that takes the same micro-batches (train.micro_batch = 2 of a global batch of 4, as the
pipeline's 2 micro-batches). They are bit for bit equal, in the same layout and across these: parameters
and optimizer state are saved under their names in every layout, and the pipeline computes as one process
does (tests/test_pipeline_parallel.py). The model routes its last three blocks to experts, with the balancing
bias and a load-balancing loss: the routers' biases (buffers) move between layouts with the weights.
"""

import pytest

from helpers import kill_then_resume, read_run, run_losses, tiny_config, train_named, write_corpus

pytestmark = pytest.mark.slow
INTERLEAVED = ["--parallel.pp=2", "--parallel.pp_schedule=interleaved-1f1b", "--parallel.pp_stages_per_rank=2",
               "--parallel.pp_microbatches=2"]  # fmt: skip
ONE = ["--train.micro_batch=2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline-reshard")
    config = root / "tiny.toml"
    cfg = tiny_config(root / "runs", write_corpus(root), "--train.steps=8", "--checkpoint.every=4", "--run.name=",
                      "--model.n_layers=4", "--resilience.supervise=false", "--model.moe_experts=4",
                      "--model.moe_dense_layers=1", "--model.moe_bias_rate=1e-2", "--model.moe_aux_loss=1e-2")  # fmt: skip
    config.write_text(cfg.to_toml())
    train_named(config, "reference", 1, *ONE)
    return config, run_losses(config, "reference")


@pytest.mark.parametrize(
    "before, after",
    [
        ((2, ["--parallel.pp=2"]), (1, ONE)),  # 1F1B on 2 stages -> one process
        ((1, ONE), (2, INTERLEAVED)),  # one process -> 4 stages, 2 per rank
    ],
    # pp=2 -> pp=2, bit for bit: test_resume_oracle.py's pipeline test
    ids=["pp2-to-1", "1-to-pp2x2"],
)
def test_resume_across_pipeline_layouts(setup, before, after):
    config, reference = setup
    name = f"pp-{before[0]}-{len(before[1])}-to-{after[0]}-{len(after[1])}"
    kill_then_resume(config, name, before, after)
    assert run_losses(config, name) == reference  # bit for bit
    assert read_run(config.parent / "runs" / name).of_kind("resumed")[-1]["step"] == 4
