"""Pipeline parallelism (parallel.pp): the stage split, the schedules' refusals, and training through every
schedule equal to one process.

Tolerances (fp32, gloo on CPU), measured with tests/pipeline_worker.py (3 AdamW steps, clipping at 1.0):
- pipeline alone, every schedule on 2 stages and 1F1B, interleaved 1F1B and ZBV on 4: bit-exact against one
  process running the same micro-batches: losses, gradient norms (every tensor's norm gathered over the
  stages, one norm of them in the model's order, as one process takes it), parameters after the clipped
  steps and the evaluation loss. Each micro-batch's loss is divided by their number, a power of two, before
  its backward, and gradients accumulate in micro-batch order, as in one process. Looped BFS runs its
  backward over the micro-batches in another order: its losses stay bit-exact over these 3 steps, norms to
  a relative 2e-5, parameters within 1e-4 (measured 2e-5), evaluation to 1e-6.
- pipeline x FSDP2 (pp=2, dp_shard=2): losses to a relative 1e-6 (measured 6e-8: FSDP2's reduce-scatter
  sums in another order), norms to 1e-5, parameters within 1e-4.
- pipeline x tensor parallel (pp=2, tp=2, 4 stages): the split matrix products sum in another order; the
  first gradient norm to a relative 1e-6 (measured 2e-8), losses to 1e-6 (measured 1e-7); AdamW turns the
  last bits of near-zero gradient elements into whole updates, so later norms drift to 3e-5 (bound 1e-4)
  and parameters to 1.2e-4 (bound 5e-4).
- mixture of experts (the auxiliary losses and the balancing bias on): pp=2 through 1F1B, interleaved 1F1B and
  ZBV bit-exact, the biases after every step equal; pp=2 x dp_shard=2 x ep=2 losses to a relative 1e-6
  (measured 6e-8), norms to 1e-5 (measured 1e-7), parameters within 2e-4 (measured 6e-5), biases equal (the
  same experts chosen: the loads are whole numbers).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import free_port, read_run, run_liandan, tiny_config, train_named, write_corpus
from liandan.common.layout import Layout, resolve_layout
from liandan.config import ConfigError, load_config
from liandan.model import ModelArgs, Transformer
from liandan.model.llama_spec import LLAMA
from liandan.train.pipeline import data_parallel_refusal, microbatch_refusal, pipeline_config_refusal
from liandan.train.pipeline_split import (
    build_stages,
    pipeline_refusal,
    rank_stages,
    stage_extras,
    stage_layer_counts,
    stage_of_rank,
)

TESTS = Path(__file__).resolve().parent


def _pipeline_run(out: Path, pp: int, dp_shard: int, runs: list[str], tp: int = 1, ep: int = 1) -> dict:
    """tests/pipeline_worker.py on pp x dp_shard x tp gloo ranks (ep of the dp_shard ranks splitting the
    experts); rank 0's report (it holds the reference)."""
    world, port = pp * dp_shard * tp, str(free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
        command = [sys.executable, str(TESTS / "pipeline_worker.py"), str(out), str(pp), str(dp_shard), ",".join(runs),
                   str(tp), str(ep)]  # fmt: skip
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    return json.loads((out / "rank0.json").read_text())


ALL_ON_TWO = ["gpipe:1", "1f1b:1", "interleaved-1f1b:2", "looped-bfs:2", "interleaved-zb:2", "zbv:2", "dualpipev:2"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "pp, runs",
    [(2, ALL_ON_TWO), (4, ALL_ON_TWO)],
    ids=["2-ranks-every-schedule", "4-ranks-every-schedule"],
)
def test_every_schedule_trains_as_one_process(tmp_path, pp, runs):
    report = _pipeline_run(tmp_path, pp, 1, runs)
    assert report.keys() == set(runs)
    for run, entry in report.items():
        schedule, per_rank = run.split(":")
        assert len(entry["layers"]) == pp * int(per_rank) and sum(entry["layers"]) == 8
        if schedule == "looped-bfs":  # its backward takes the micro-batches in another order
            assert entry["losses"] == pytest.approx(entry["ref_losses"], rel=1e-6), run
            assert entry["norms"] == pytest.approx(entry["ref_norms"], rel=2e-5), run
            assert entry["eval"] == pytest.approx(entry["ref_eval"], rel=1e-6), run
            assert entry["param_diff"] <= 1e-4, run
        else:  # bit for bit
            assert entry["losses"] == entry["ref_losses"], run
            assert (entry["norms"], entry["eval"], entry["param_diff"]) == (entry["ref_norms"], entry["ref_eval"], 0)
        if schedule in ("zbv", "dualpipev"):
            assert entry["stages"] == [0, 2 * pp - 1]  # rank 0 holds the first and the last stage: a V


@pytest.mark.slow
def test_pipeline_with_fsdp_trains_as_one_process(tmp_path):
    report = _pipeline_run(tmp_path, 2, 2, ["1f1b:1", "interleaved-1f1b:2"])
    for run, entry in report.items():
        assert entry["losses"] == pytest.approx(entry["ref_losses"], rel=1e-6), run
        assert entry["norms"] == pytest.approx(entry["ref_norms"], rel=1e-5), run
        assert entry["param_diff"] <= 1e-4, run


@pytest.mark.slow
def test_pipeline_with_tensor_parallel_trains_as_one_process(tmp_path):
    report = _pipeline_run(tmp_path, 2, 1, ["interleaved-1f1b:2"], tp=2)
    entry = report["interleaved-1f1b:2"]
    assert entry["norms"][0] == pytest.approx(entry["ref_norms"][0], rel=1e-6)  # before any update
    assert entry["losses"] == pytest.approx(entry["ref_losses"], rel=1e-6)
    assert entry["norms"] == pytest.approx(entry["ref_norms"], rel=1e-4)
    assert entry["param_diff"] <= 5e-4


@pytest.mark.slow
def test_moe_trains_through_the_pipeline_as_one_process(tmp_path):
    # every block but the first routes, with a load-balancing loss, a router z-loss and the balancing bias
    report = _pipeline_run(tmp_path, 2, 1, ["1f1b:1:moe", "interleaved-1f1b:2:moe", "zbv:2:moe"])
    for run, entry in report.items():
        assert entry["losses"] == entry["ref_losses"], run
        assert (entry["norms"], entry["eval"], entry["param_diff"]) == (entry["ref_norms"], entry["ref_eval"], 0), run
        assert entry["biases"] == entry["ref_biases"] and len(entry["biases"]) == 3, run
        assert len(entry["biases"][-1]) == 7 and any(any(row) for row in entry["biases"][-1]), run  # every layer


@pytest.mark.slow
def test_moe_with_expert_parallel_stages_trains_as_one_process(tmp_path):
    report = _pipeline_run(tmp_path, 2, 2, ["interleaved-1f1b:2:moe"], ep=2)
    entry = report["interleaved-1f1b:2:moe"]
    assert entry["losses"] == pytest.approx(entry["ref_losses"], rel=1e-6)
    assert entry["norms"] == pytest.approx(entry["ref_norms"], rel=1e-5)
    assert entry["param_diff"] <= 2e-4
    assert entry["biases"] == entry["ref_biases"]


def test_stages_chained_compute_the_whole_model_and_keep_its_names():
    args = ModelArgs(vocab_size=64, dim=32, n_layers=5, n_heads=4, max_seq_len=16)
    torch.manual_seed(0)
    whole = Transformer(args)
    counts = [1, 2, 2]
    stages = build_stages(Transformer(args), LLAMA, counts, [0, 1, 2])
    for stage in stages:
        stage.load_state_dict({k: v for k, v in whole.state_dict().items() if k in stage.state_dict()})
    names = [set(dict(s.named_parameters())) for s in stages]
    assert set().union(*names) == set(dict(whole.named_parameters()))
    assert not names[0] & names[1] and not names[1] & names[2]
    assert "tok_embeddings.weight" in names[0] and {"norm.weight", "output.weight"} <= names[2]
    assert {n.split(".")[1] for n in names[1] if n.startswith("layers.")} == {"1", "2"}
    tokens = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    hidden = stages[1](stages[0](tokens, targets), targets)
    assert hidden.shape == (2, 16, 32)  # a middle stage hands on hidden states
    assert torch.equal(stages[2](hidden, targets), whole(tokens, targets))


def test_moe_stages_carry_their_auxiliary_losses_into_the_backward_pass():
    args = ModelArgs(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16, moe_experts=4, moe_ffn_dim=32,
                     moe_dense_layers=1, moe_aux_loss=1e-2, moe_z_loss=1e-3)  # fmt: skip
    torch.manual_seed(0)
    whole = Transformer(args)
    first, last = build_stages(copy.deepcopy(whole), LLAMA, [2, 2], [0, 1])
    first.loss_divisor = 4.0  # the number the last stage's loss is divided by
    tokens, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    (whole(tokens, targets) / 4.0).backward()
    loss = last(first(tokens, targets), targets) / 4.0
    loss.backward()
    assert torch.equal(loss, whole(tokens, targets).detach() / 4.0)  # the value is the language-model loss
    stage_grads = {n: p.grad for part in (first, last) for n, p in part.named_parameters()}
    for name, param in whole.named_parameters():
        assert torch.equal(stage_grads[name], param.grad), name  # layer 1's router's included, bit for bit
    first.zero_grad()
    last.zero_grad()
    first.loss_divisor = 2.0
    (last(first(tokens, targets), targets) / 4.0).backward()
    assert not torch.equal(
        first.layers["1"].feed_forward.router.gate.weight.grad, stage_grads["layers.1.feed_forward.router.gate.weight"]
    )


def test_balanced_split_gives_the_first_and_last_stages_fewer_blocks():
    assert stage_layer_counts(8, 2) == [4, 4]
    assert stage_layer_counts(8, 4, first_extra=0.5, last_extra=1.5) == [2, 2, 3, 1]
    assert stage_layer_counts(4, 4, first_extra=3, last_extra=3) == [1, 1, 1, 1]  # every stage keeps one
    assert stage_layer_counts(6, 3, given=[1, 3, 2]) == [1, 3, 2]
    # a large vocabulary weighs on the last stage (the head) more than on the first (the lookup)
    args = ModelArgs(vocab_size=4096, dim=32, n_layers=8, n_heads=4, max_seq_len=16)
    first, last = stage_extras(Transformer(args), LLAMA, 16)
    assert 0 < first < last
    counts = stage_layer_counts(8, 4, first_extra=first, last_extra=last)
    assert sum(counts) == 8 and counts[-1] < counts[1] and counts[0] <= counts[1]


@pytest.mark.parametrize(
    "n_layers, stages, given, message",
    [
        (8, 2, [3, 4], r"^parallel.pp_layers = \[3, 4\] must give 2 stages .* 8 blocks in all \(model.n_layers\)$"),
        (8, 2, [8, 0], r"^parallel.pp_layers = \[8, 0\] must give 2 stages .*at least one block each"),
        (2, 4, [], r"^model.n_layers = 2 blocks cannot fill 4 pipeline stages \(pp x pp_stages_per_rank\)$"),
    ],
)
def test_impossible_splits_are_refused_in_one_line(n_layers, stages, given, message):
    with pytest.raises(ValueError, match=message):
        stage_layer_counts(n_layers, stages, given)


def test_stage_placement_loops_or_folds_into_a_v():
    assert [rank_stages(r, 2, 2, "interleaved-1f1b") for r in range(2)] == [[0, 2], [1, 3]]
    assert [rank_stages(r, 4, 2, "zbv") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_of_rank(s, 2, "dualpipev") for s in range(4)] == [0, 1, 1, 0]
    assert [stage_of_rank(s, 2, "looped-bfs") for s in range(4)] == [0, 1, 0, 1]


def test_schedule_and_micro_batch_refusals_are_one_line():
    args = ModelArgs(vocab_size=64, dim=32, n_layers=4, n_heads=4)
    assert pipeline_refusal(LLAMA, args, 2, 2, "1f1b") == (
        "parallel.pp_schedule = 1f1b runs one stage per rank: parallel.pp_stages_per_rank = 2 must be 1"
    )
    assert pipeline_refusal(LLAMA, args, 2, 1, "zbv").endswith("parallel.pp_stages_per_rank = 1 must be 2")
    assert "untied" in pipeline_refusal(LLAMA, ModelArgs(tie_embeddings=True), 2, 1, "1f1b")
    assert pipeline_refusal(LLAMA, args, 2, 2, "interleaved-1f1b") is None
    assert microbatch_refusal("1f1b", 3, 2, 2, 8) == (
        "parallel.pp_microbatches = 3 must divide the 8 sequences each data-parallel rank runs per step"
        " (train.global_batch / data-parallel ranks, or train.micro_batch)"
    )
    assert microbatch_refusal("1f1b", 2, 4, 4, 8) == (
        "parallel.pp_microbatches = 2 must be at least the 4 pipeline stages for parallel.pp_schedule = 1f1b"
    )
    assert microbatch_refusal("interleaved-1f1b", 9, 4, 8, 18) == (
        "parallel.pp_microbatches = 9 must split into 2 rounds of equal size (its quotient by parallel.pp = 4)"
        " for parallel.pp_schedule = interleaved-1f1b: a multiple of 4, or fewer than 8"
    )
    assert microbatch_refusal("interleaved-1f1b", 6, 4, 8, 12) is None  # one round of 6, as torch allows
    assert microbatch_refusal("gpipe", 8, 2, 2, 8) is None
    assert "not DDP alone" in data_parallel_refusal("1f1b", Layout(2, 1, 1, pp=2))
    assert "FSDP2's reduction misses" in data_parallel_refusal("zbv", Layout(1, 2, 1, pp=2))
    assert data_parallel_refusal("1f1b", Layout(1, 2, 1, pp=2)) is None
    sp = load_config(None, ["--parallel.pp=2", "--parallel.tp=2", "--model.n_layers=4"])
    assert pipeline_config_refusal(sp, Layout(1, 1, 2, pp=2)) == (
        "pipeline parallelism with parallel.tp > 1 hands whole sequences between stages:"
        " set parallel.sequence_parallel = false"
    )
    sp.parallel.sequence_parallel = False
    assert pipeline_config_refusal(sp, Layout(1, 1, 2, pp=2)) is None
    moe = load_config(None, ["--parallel.pp=2", "--model.n_layers=4", "--model.moe_experts=4"])
    assert pipeline_config_refusal(moe, Layout(1, 4, 1, pp=2, ep=4)) is None
    assert pipeline_config_refusal(moe, Layout(1, 2, 1, pp=2, ep=2)) is None
    dense = load_config(None, ["--parallel.pp=2", "--model.n_layers=4"])
    assert pipeline_config_refusal(dense, Layout(1, 2, 1, pp=2, ep=2)) == (
        "parallel.ep = 2 needs a mixture-of-experts model (model.moe_experts > 0); this one is dense"
    )
    offload = load_config(None, ["--parallel.pp=2", "--parallel.cpu_offload=true", "--model.n_layers=4"])
    assert pipeline_config_refusal(offload, Layout(1, 2, 1, pp=2)) == (
        "pipeline parallelism does not run with parallel.cp > 1 or parallel.cpu_offload yet"
    )


def test_layout_with_pipeline_stages():
    cfg = load_config(None, ["--parallel.pp=2"])
    layout = resolve_layout(cfg.parallel, 8)
    assert (layout.pp, layout.dp_shard, layout.world_size) == (2, 4, 8)
    assert str(layout) == "fsdp+pp (dp_replicate=1, dp_shard=4, tp=1, pp=2)"
    assert str(Layout(1, 1, 1, pp=2)) == "pp (dp_replicate=1, dp_shard=1, tp=1, pp=2)"
    assert Layout.parse("pp (dp_replicate=1, dp_shard=1, tp=1, pp=2)").pp == 2
    assert Layout.parse(str(layout)) == layout
    with pytest.raises(ValueError, match=r"^parallel.dp_replicate x parallel.tp x parallel.pp = 4 must divide"):
        resolve_layout(load_config(None, ["--parallel.pp=2", "--parallel.tp=2"]).parallel, 6)


def test_pp_layers_read_from_toml_and_the_command_line():
    assert load_config(None, ["--parallel.pp_layers=[3, 5]"]).parallel.pp_layers == [3, 5]
    assert load_config(None, ["--parallel.pp_layers=3,5"]).parallel.pp_layers == [3, 5]
    with pytest.raises(ConfigError, match=r"^parallel.pp_layers = \['a'\] must be a list of integers$"):
        load_config(None, ["--parallel.pp_layers=a"])


def test_train_refuses_a_pipeline_it_cannot_run_before_any_worker_starts(tmp_path):
    corpus = write_corpus(tmp_path)
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_config(tmp_path / "runs", corpus, "--model.n_layers=4").to_toml())
    done = run_liandan("train", config, "--nproc=2", "--parallel.pp=2", "--parallel.pp_microbatches=3")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "liandan: error: parallel.pp_microbatches = 3 must divide the 4 sequences each data-parallel rank runs"
        " per step (train.global_batch / data-parallel ranks, or train.micro_batch)"
    )
    assert not (tmp_path / "runs").exists()  # nothing tokenized, no run directory


@pytest.mark.slow
def test_validation_batches_short_of_held_out_windows_run_through_the_pipeline_as_one_process(tmp_path):
    # 9 held-out windows (int(3238 * 0.003)) in batches of the 4 sequences a step runs: 4, 4 and a last of 1,
    # a shape the schedule's stages were not built for, and fewer sequences than its 2 micro-batches
    config = tmp_path / "tiny.toml"
    cfg = tiny_config(tmp_path / "runs", write_corpus(tmp_path), "--train.steps=2", "--schedule.warmup_steps=0",
                      "--train.eval_every=1", "--data.val_fraction=0.003", "--run.name=",
                      "--resilience.supervise=false")  # fmt: skip
    config.write_text(cfg.to_toml())
    losses = {}
    for name, nproc, layout in [("one", 1, []), ("pp", 2, ["--parallel.pp=2"])]:
        done = train_named(config, name, nproc, *layout)
        assert done.returncode == 0, done.stderr[-3000:]
        losses[name] = [e["loss"] for e in read_run(tmp_path / "runs" / name).of_kind("eval")]
    assert len(losses["pp"]) == 2
    # one process averages the same three batches; the pipeline's training step adds in another order
    assert losses["pp"] == pytest.approx(losses["one"], rel=1e-5)
