"""Meta-device initialisation: the same weights and losses as a model built whole, in every layout, and the
memory it takes measured against the planner's estimate."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from liandan.common.layout import Layout
from liandan.config import load_config
from liandan.plan.memory import init_memory
from liandan.plan.run_plan import plan_model_args
from liandan.train.causal_lm import CausalLMTrainModule
from liandan.train.meta_init import build_on_meta, materialize, plan_init

WORKER = Path(__file__).with_name("meta_init_worker.py")


def _config(*overrides: str):
    return load_config(None, ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
                              "--model.max_seq_len=32", "--train.seq_len=32", "--model.vocab_size=320",
                              "--train.dtype=fp32", *overrides])  # fmt: skip


@pytest.mark.parametrize("tied, recompute", [(False, "none"), (True, "full")])
def test_one_process_meta_init_equals_the_model_built_whole(tied, recompute):
    states, after = [], []
    for meta in (False, True):
        cfg = _config(f"--train.meta_init={str(meta).lower()}", f"--model.tie_embeddings={str(tied).lower()}",
                      f"--train.activation_checkpoint={recompute}")  # fmt: skip
        module = CausalLMTrainModule(cfg, 257, None, Layout(1, 1, 1), torch.device("cpu"), torch.float32)
        states.append({**module.model.state_dict(), "rope": module.model.rope})
        after.append(torch.rand(4))  # the generator is left where building the model whole leaves it
    whole, meta = states
    assert whole.keys() == meta.keys()
    assert [k for k in whole if not torch.equal(whole[k], meta[k])] == []
    assert torch.equal(after[0], after[1])


def _mul(layer):
    layer.weight.mul_(2)  # reads the values the replay would not have


def _padding_row(layer):
    layer.weight[0].zero_()  # a view: the replay knows whole tensors only


def _set_item(layer):
    layer.weight[0] = 1.0


def _assign_data(layer):
    layer.weight.data = torch.zeros(4, 4)


@pytest.mark.parametrize(
    "change, words",
    [(_mul, "mul_ on a parameter"), (_padding_row, "zero_ on part of a parameter"),
     (_set_item, "__setitem__ on a parameter"), (_assign_data, "an assignment to a parameter's .data")],
)  # fmt: skip
def test_a_parameter_set_otherwise_than_by_an_initialiser_is_refused(change, words):
    from torch import nn

    def build():
        layer = nn.Linear(4, 4)
        with torch.no_grad():
            change(layer)
        return layer

    model, record = build_on_meta(build)
    with pytest.raises(ValueError, match=f"meta init cannot replay {re.escape(words)}"):
        plan_init(model, record)


def test_a_model_with_buffers_but_no_init_buffers_is_refused():
    from torch import nn

    def build():
        layer = nn.Linear(4, 4)
        layer.register_buffer("table", torch.arange(4.0))
        return layer

    model, record = build_on_meta(build)
    with pytest.raises(ValueError, match="has buffers but no init_buffers"):
        materialize(model, plan_init(model, record), torch.device("cpu"), 0)


def test_planner_init_memory_by_hand():
    """Whole: 4 bytes per parameter. Meta init: the rank's fp32 shards on the device; on the host those plus the
    largest whole parameter, drawn there one at a time."""
    from liandan.model import ModelArgs, count_params

    args = ModelArgs(vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256)
    total = count_params(args).total  # 251,200: 2 blocks of 61,568 + embedding, head and final norm
    assert init_memory(args, Layout(1, 4, 1), meta=False).device == 4 * total
    meta = init_memory(args, Layout(1, 4, 1), meta=True)
    assert meta.device == 4 * total / 4
    assert meta.host == 4 * total / 4 + 4 * 1000 * 64  # the embedding (or head) is the largest tensor
    tp = init_memory(args, Layout(1, 1, 2), meta=True)
    assert tp.device == 4 * (total - 2 * 2 * 64 - 64) / 2 + 4 * (2 * 2 * 64 + 64)  # norms stay whole


def test_the_planner_counts_initialisation_in_whether_a_run_fits():
    """Llama 8B on 64 devices of 32 GiB: each step fits, but the whole fp32 model (30 GiB) on every rank
    before sharding does not; under meta init it does."""
    from liandan.plan.devices import resolve_device
    from liandan.plan.run_plan import plan_config

    config = Path(__file__).resolve().parents[1] / "configs" / "llama-8b.toml"
    device = resolve_device("h100", memory_gib=32)
    whole = plan_config(load_config(config, ["--train.meta_init=false"]), device, nproc=64)
    meta = plan_config(load_config(config, ["--train.meta_init=true"]), device, nproc=64)
    assert whole.memory.total == meta.memory.total < 0.9 * 32 * 2**30
    assert not whole.fits and whole.init.device > 0.9 * 32 * 2**30
    assert meta.fits and meta.init.device < 2**30


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Both ranks of the worker: FSDP and tensor-parallel train modules built each way, and the memory one
    rank took to build a larger model under meta init with FSDP."""
    out = tmp_path_factory.mktemp("meta_init")
    # Large allocations are given back to the system when freed, so the resident set follows what is alive.
    env = {**os.environ, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out / "store"), str(out)],
                              env={**env, "RANK": str(rank)}, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "tp", "ddp"])
def test_two_ranks_meta_init_gives_the_same_shards_and_losses(two_ranks, layout):
    for rank in two_ranks:
        whole, meta = rank[f"{layout}/False/shards"], rank[f"{layout}/True/shards"]
        assert whole.keys() == meta.keys()
        assert [k for k in whole if not torch.equal(whole[k], meta[k])] == []
        assert rank[f"{layout}/True/losses"] == rank[f"{layout}/False/losses"]  # bit for bit


# The estimate counts tensors; the measured rise also holds the allocator's and FSDP's own small buffers.
TOLERANCE = 0.10


@pytest.mark.slow
def test_meta_init_peak_host_memory_matches_the_planner(two_ranks):
    from liandan.model import count_params

    cfg = load_config(None, ["--model.dim=512", "--model.n_layers=8", "--model.n_heads=8",
                             "--model.max_seq_len=32", "--train.seq_len=32", "--model.vocab_size=4096",
                             "--train.meta_init=true"])  # fmt: skip
    args = plan_model_args(cfg)
    estimate = init_memory(args, Layout(1, 2, 1), meta=True).host
    whole = 4 * count_params(args).total
    assert estimate < 0.65 * whole  # the case is one where meta init matters
    for rank in two_ranks:
        measured = rank["large_host_peak"]
        assert abs(measured - estimate) <= TOLERANCE * estimate, (measured, estimate, whole)
        assert measured < whole


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp", "tp"])
@pytest.mark.parametrize("source", ["whole.safetensors", "hf"])
def test_weights_stream_into_each_rank_s_shards(two_ranks, layout, source):
    """A consolidated file (fp32) and a Hugging Face directory (bf16) read into FSDP and tensor-parallel shards:
    each rank gets its slice of every tensor and reads no more than its shards hold."""
    shard_bytes = []
    for rank in two_ranks:
        streamed, expected = rank[f"{layout}/{source}/streamed"], rank[f"{layout}/{source}/expected"]
        assert streamed.keys() == expected.keys()
        assert [k for k in streamed if not torch.equal(streamed[k], expected[k])] == []
        stored = 2 if source == "hf" else 4
        shard_bytes.append(sum(t.numel() for t in streamed.values()) * stored)
        assert rank[f"{layout}/{source}/read"] == shard_bytes[-1]


@pytest.mark.parametrize("change, words", [("drop", "missing layers.1.ffn_norm.weight"),
                                           ("extra", "tensors liandan has no place for: model.extra"),
                                           ("reshape", "has shape (192, 64), the model arguments give (64, 192)")])  # fmt: skip
def test_a_hugging_face_directory_that_does_not_fit_the_model_is_refused(tmp_path, change, words):
    from safetensors.torch import load_file, save_file

    from liandan.checkpoint import hf
    from liandan.checkpoint.streaming import weight_source

    module = CausalLMTrainModule(_config(), 257, None, Layout(1, 1, 1), torch.device("cpu"), torch.float32)
    hf.export_hf(module.model.state_dict(), module.model.args, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    if change == "drop":
        del tensors["model.layers.1.post_attention_layernorm.weight"]
    elif change == "extra":
        tensors["model.extra"] = torch.zeros(2)
    else:
        tensors["model.layers.0.mlp.down_proj.weight"] = (
            tensors["model.layers.0.mlp.down_proj.weight"].reshape(192, 64).contiguous()
        )
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=re.escape(words)), weight_source(tmp_path):
        pass


def test_weights_of_another_model_are_named_field_by_field():
    from liandan.checkpoint.streaming import differences
    from liandan.model import ModelArgs

    ours = ModelArgs(vocab_size=320, dim=64, n_layers=2, n_heads=4)
    assert differences(ours, ModelArgs(vocab_size=320, dim=64, n_layers=2, n_heads=4)) == []
    theirs = ModelArgs(vocab_size=320, dim=128, n_layers=2, n_heads=4, rope_theta=500000.0)
    assert differences(ours, theirs) == [
        "model.dim = 64 (weights: 128)",
        "model.head_dim = 16 (weights: 32)",
        "model.ffn_dim = 192 (weights: 384)",
        "model.rope_theta = 10000.0 (weights: 500000.0)",
    ]


def test_the_shipped_large_configs_initialise_on_the_meta_device():
    """Meta init is exact for Llama (above): the configs of models that a whole fp32 copy per rank would
    strain use it, and the planner counts their initialisation as sharded."""
    from liandan.plan.devices import resolve_device
    from liandan.plan.run_plan import plan_config

    configs = Path(__file__).resolve().parents[1] / "configs"
    for name in ("gpt2-124m", "llama-1b", "llama-8b"):
        assert load_config(configs / f"{name}.toml", []).train.meta_init, name
    plan = plan_config(load_config(configs / "llama-8b.toml", []), resolve_device("h100"), nproc=64)
    assert plan.init.device < 2**30
