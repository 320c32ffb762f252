"""Model specs: the registry, `[model] family`, the [model] section against Llama's ModelArgs, and a toy family
registered here alone that the planner, the trainer, checkpoints and the consolidated format pick up without
any other file knowing of it."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
import torch

from helpers import tiny_config, write_corpus
from liandan import plugins
from liandan.checkpoint.hf import export_hf, load_consolidated, save_consolidated
from liandan.checkpoint.loading import load_model
from liandan.cli.main import main
from liandan.config import ConfigError, ModelSection, load_config
from liandan.model import ModelArgs, Transformer, count_params, flops_per_token, spec_for
from liandan.model import spec as model_spec
from liandan.model.llama_options import LlamaOptions
from liandan.model.llama_spec import DERIVED_FIELDS, LLAMA
from liandan.model.spec import get, model_args, register
from liandan.plan.devices import resolve_device
from liandan.plan.layout_search import tp_degrees
from liandan.plan.memory import param_split
from liandan.plan.run_plan import plan_config
from liandan.plugins import Plugin
from liandan.train import Trainer
from toy_family import TOY, ToyArgs, ToyModel, toy_counts, toy_shapes

# ---------------------------------------------------------------------------------------------------------
# the registry and [model] family


def test_llama_is_registered_and_unknown_families_are_one_line():
    assert get("llama") is LLAMA and spec_for(ModelArgs()) is LLAMA and "llama" in model_spec.families()
    with pytest.raises(ConfigError) as err:
        get("nope")
    assert str(err.value) == "model.family = 'nope' is not a known model family; known: llama"


def test_a_family_name_or_args_type_is_registered_once():
    with pytest.raises(ValueError, match="'llama' is registered twice"):
        register(dataclasses.replace(LLAMA))
    with pytest.raises(ValueError, match="ModelArgs already belongs to model family 'llama'"):
        register(dataclasses.replace(LLAMA, name="llama-again"))
    assert register(LLAMA) is LLAMA  # registering the same spec again is harmless


@pytest.mark.parametrize("command", ["train", "plan"])
def test_unknown_family_on_the_command_line_exits_2_with_one_line(capsys, tmp_path, command):
    config = tmp_path / "run.toml"
    config.write_text(f'[run]\noutput_dir = "{tmp_path}"\n[data]\ntokenizer = "byte"\n')
    code = main([command, str(config), "--model.family=nope"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "liandan: error: model.family = 'nope' is not a known model family; known: llama"
    ]
    assert not list(tmp_path.glob("*/metrics.jsonl"))  # nothing started


def test_model_section_and_model_args_cannot_drift():
    """Every ModelArgs field is a key of the same name, type and default in [model.llama] or [model]
    (max_seq_len), or derived (vocab_size, from the tokenizer); no other keys."""
    section = {f.name: f for f in dataclasses.fields(LlamaOptions)} | {
        "max_seq_len": ModelSection.__dataclass_fields__["max_seq_len"]
    }
    section_types = typing.get_type_hints(LlamaOptions) | {"max_seq_len": int}
    args_types = typing.get_type_hints(ModelArgs)
    for f in dataclasses.fields(ModelArgs):
        if f.name in DERIVED_FIELDS:
            continue
        assert f.name in section, f"ModelArgs.{f.name} has no [model] key"
        assert section_types[f.name] == args_types[f.name] or typing.get_origin(section_types[f.name]) is typing.Literal
        assert section[f.name].default == f.default, f.name
    assert set(section) - {f.name for f in dataclasses.fields(ModelArgs)} == set()


def test_args_from_config_takes_every_key():
    overrides = ["--model.dim=96", "--model.n_layers=3", "--model.n_heads=6", "--model.n_kv_heads=2",
                 "--model.ffn_dim=200", "--model.ffn_multiple_of=32", "--model.norm_eps=1e-6",
                 "--model.rope_theta=5e5", "--model.max_seq_len=512", "--model.tie_embeddings=true",
                 "--model.qk_norm=true", "--model.z_loss=1e-4", "--model.init_std=0.01", "--model.attention=sdpa"]  # fmt: skip
    cfg = load_config(None, overrides)
    args = model_args(cfg.model, tokenizer_vocab=257)
    assert args == ModelArgs(vocab_size=320, dim=96, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=200,
                             ffn_multiple_of=32, norm_eps=1e-6, rope_theta=5e5, max_seq_len=512, tie_embeddings=True,
                             qk_norm=True, z_loss=1e-4, init_std=0.01, attention="sdpa")  # fmt: skip
    assert model_args(load_config(None, ["--model.vocab_size=1000"]).model, 257).vocab_size == 1000


def test_llama_tp_refusals():
    args = ModelArgs(dim=64, n_heads=4, n_kv_heads=2)
    assert LLAMA.tp_refusal(args, 1) is None and LLAMA.tp_refusal(args, 2) is None
    assert "must divide" in LLAMA.tp_refusal(args, 4)
    assert LLAMA.tp_refusal(ModelArgs(tie_embeddings=True, qk_norm=True), 2) is None  # both have sharded forms


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--parallel.tp=4", "--model.n_kv_heads=2"],
            "parallel.tp = 4 must divide model.n_heads = 4 and n_kv_heads = 2",
        ),
    ],
)
def test_the_family_refuses_a_config_it_cannot_split_in_one_line(overrides, message):
    cfg = load_config(None, ["--parallel.tp=2", "--model.n_heads=4", *overrides])  # config.py leaves it to the family
    with pytest.raises(ConfigError) as info:
        model_spec.check_model_config(cfg)
    assert str(info.value) == message
    assert model_spec.check_model_config(load_config(None, ["--parallel.tp=2", "--model.n_heads=4"])) is LLAMA


# ---------------------------------------------------------------------------------------------------------
# a toy family in a file of its own (tests/toy_family.py), registered as a plug-in: the planner, the trainer,
# checkpoints and the consolidated format pick it up without any other file knowing of it.


@pytest.fixture
def toy():
    plugins.register(Plugin("model_family", "toy", "toy_family:TOY", options="toy_family:ToyOptions"))
    yield TOY
    plugins.unregister("model_family", "toy")


def toy_config(run_dir, corpus, *overrides: str):
    """tiny_config's run with the toy family: its keys in [model.toy], Llama's absent."""
    return load_config(None, [f"--run.output_dir={run_dir}", "--run.name=run", "--model.family=toy",
                              "--model.toy.dim=64", "--model.toy.n_heads=4", "--model.max_seq_len=64",
                              "--train.steps=6", "--train.global_batch=4", "--train.seq_len=64", "--train.dtype=fp32",
                              "--schedule.warmup_steps=2", "--data.tokenizer=byte", f'--data.paths=["{corpus}"]',
                              "--track.plot=false", *overrides])  # fmt: skip


def test_toy_family_counts_and_build(toy):
    args = ToyArgs()
    model = model_spec.build(args)
    assert isinstance(model, ToyModel)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == toy_shapes(args)
    assert count_params(args).total == sum(p.numel() for p in model.parameters()) == 2 * 320 * 32 + 2 * 2 * 32 * 64
    assert flops_per_token(args, 64) == 6.0 * (320 * 32 + 2 * 2 * 32 * 64)
    assert model_spec.families() == ["llama", "toy"]
    assert "has no tensor-parallel plan" in toy.tp_refusal(args, 2)
    with pytest.raises(ConfigError, match="model.family = 'toy' has no tensor-parallel plan"):
        model_spec.check_model_config(load_config(None, ["--model.family=toy", "--parallel.tp=2"]))


def test_planner_reads_the_toy_family(toy):
    cfg = load_config(None, ["--model.family=toy", "--model.vocab_size=512", "--model.toy.dim=128",
                             "--model.n_layers=3", "--model.n_heads=4", "--train.seq_len=256", "--train.global_batch=8"])  # fmt: skip
    plan = plan_config(cfg, resolve_device("h100"), nproc=2)
    args = ToyArgs(512, 128, 3, 4, 256)
    assert plan.model == args
    assert plan.params == toy_counts(args)
    assert plan.flops.per_token == 6.0 * toy_counts(args).matmul
    assert plan.memory.params_per_rank == param_split(args).total == 3 * 2 * 128 * 256 + 2 * 512 * 128
    assert tp_degrees(args, 8) == [1]  # no tensor-parallel plan: the layout search keeps tp = 1
    assert plan.smallest is not None and plan.smallest.layout.tp == 1


def test_trainer_checkpoints_and_consolidated_files_take_the_toy_family(toy, tmp_path):
    corpus = write_corpus(tmp_path)
    cfg = toy_config(tmp_path / "runs", corpus, "--train.steps=2", "--checkpoint.every=2",
                     "--checkpoint.async_save=false", "--train.activation_checkpoint=full")  # fmt: skip
    trainer = Trainer(cfg, say=lambda msg: None)
    try:
        args = trainer.module.args
        assert args == ToyArgs(320, 64, 2, 4, 128)
        assert isinstance(trainer.module.model, ToyModel)
        assert all(type(b).__name__ == "CheckpointWrapper" for b in trainer.module.model.stack)  # recomputed per block
        result = trainer.train()
    finally:
        trainer.close()
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))
    assert result.summary["parameters"] == toy_counts(args).total
    assert result.summary["flops_per_token"] == 6.0 * toy_counts(args).matmul

    step = result.run_dir / "checkpoints" / "step-00000002"
    assert json.loads((step / "meta.json").read_text())["model_family"] == "toy"
    model, _ = load_model(step)
    assert isinstance(model, ToyModel) and model.args == args

    state = {k: v.detach() for k, v in model.state_dict().items()}
    save_consolidated(state, args, tmp_path / "toy.safetensors")
    loaded, loaded_args = load_consolidated(tmp_path / "toy.safetensors")
    assert loaded_args == args and all(torch.equal(loaded[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="model family 'toy' has no Hugging Face adapter"):
        export_hf(state, args, tmp_path / "hf")


def test_init_from_refuses_a_checkpoint_of_another_family(toy, tmp_path):
    """A Llama model cannot start from a toy checkpoint: the family is part of the shape check."""
    corpus = write_corpus(tmp_path)
    cfg = toy_config(tmp_path / "runs", corpus, "--train.steps=2", "--run.name=toy",
                     "--checkpoint.every=2", "--checkpoint.async_save=false")  # fmt: skip
    trainer = Trainer(cfg, say=lambda msg: None)
    try:
        result = trainer.train()
    finally:
        trainer.close()
    source = result.run_dir / "checkpoints" / "step-00000002"
    with pytest.raises(ConfigError, match="model.family = llama \\(checkpoint: toy\\)"):
        Trainer(tiny_config(tmp_path / "runs", corpus, "--run.name=llama", f"--checkpoint.init_from={source}"))


def test_llama_model_is_built_through_its_spec():
    args = ModelArgs(vocab_size=320, dim=64, n_layers=2, n_heads=4)
    assert type(model_spec.build(args)) is Transformer
    shapes = {k: tuple(v.shape) for k, v in Transformer(args).state_dict().items()}
    assert shapes == LLAMA.state_shapes(args)
