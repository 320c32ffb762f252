"""muP (`model.parameterization = "mup"`): init, learning-rate and output multipliers by width, the meta-device
init and the Hugging Face export under it, the coordinate check (`liandan check-transfer`) and the target
settings `liandan sweep --target-dim` prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import tiny_config, write_corpus
from liandan.cli.main import main
from liandan.common.layout import Layout
from liandan.config import ConfigError, load_config
from liandan.model.llama import ModelArgs, Transformer
from liandan.model.roles import parameter_roles
from liandan.plan import transfer
from liandan.train.causal_lm import CausalLMTrainModule
from liandan.train.optimizers.adamw import build_adamw

SMALL = {"vocab_size": 96, "n_layers": 2, "max_seq_len": 16, "head_dim": 8, "ffn_multiple_of": 16}


def _model(dim: int, parameterization: str = "mup", base: int = 32, seed: int = 0, **extra) -> Transformer:
    torch.manual_seed(seed)
    args = ModelArgs(dim=dim, n_heads=dim // 8, parameterization=parameterization, mup_base_dim=base,
                     **{**SMALL, **extra})  # fmt: skip
    return Transformer(args)


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(seed))


def test_width_mults_init_and_learning_rates_under_mup():
    model = _model(256, base=32)  # width_mult 8
    mults = model.width_mults()
    roles = {r.name: r for r in parameter_roles(model)}
    hidden = [r for r in roles.values() if r.role == "hidden"]
    assert len(hidden) == 2 * 7 and {r.width_mult for r in hidden} == {8.0}
    assert set(mults) == {id(r.param) for r in hidden}
    assert roles["tok_embeddings.weight"].width_mult == roles["output.weight"].width_mult == 1.0
    # init: hidden std 0.02 / sqrt(8) (wo, w2 also / sqrt(2 * n_layers)); embedding and head unchanged
    stds = {name: p.std().item() for name, p in model.named_parameters()}
    assert stds["layers.0.attention.wq.weight"] == pytest.approx(0.02 / 8**0.5, rel=0.05)
    assert stds["layers.0.feed_forward.w2.weight"] == pytest.approx(0.02 / 8**0.5 / 2, rel=0.05)
    assert stds["tok_embeddings.weight"] == pytest.approx(0.02, rel=0.05)
    assert stds["output.weight"] == pytest.approx(0.02, rel=0.05)
    assert model.output_mult == 1 / 8
    section = load_config(None, ["--optim.lr=0.004"]).optim
    groups = build_adamw(model, section, torch.device("cpu")).param_groups
    by_param = {id(p): g["lr"] for g in groups for p in g["params"]}
    assert {by_param[id(r.param)] for r in hidden} == {0.0005}
    assert by_param[id(roles["output.weight"].param)] == by_param[id(roles["tok_embeddings.weight"].param)] == 0.004


def test_the_logits_carry_the_output_multiplier_on_every_loss_path():
    model, tokens = _model(64, base=32), _tokens()
    h = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        h = layer(h, model.rope[:16], _mask(model, tokens))
    expected = model.output(model.norm(h)) / 2
    torch.testing.assert_close(model(tokens), expected)
    targets = _tokens(2)
    whole = model(tokens, targets)
    model.configure_loss(4)
    torch.testing.assert_close(model(tokens, targets), whole)
    model.configure_loss(1, fused=True)
    torch.testing.assert_close(model(tokens, targets), whole)
    plain = torch.nn.functional.cross_entropy(expected.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(whole, plain)


def _mask(model, tokens):
    from liandan.model.attention import MaskSpec, PreparedMask

    return PreparedMask(MaskSpec(None, None), model.attention_backend, tokens.shape[1], tokens.device)


def test_standard_is_unchanged_and_mup_at_its_base_width_is_standard_bit_for_bit():
    """The standard model ignores mup_base_dim, and muP at its base width (every multiplier 1) is the standard
    model: the same weights, logits and AdamW update, bit for bit."""
    section = load_config(None, ["--optim.lr=0.01"]).optim
    results = []
    for parameterization, base in (("standard", 0), ("standard", 32), ("mup", 64)):
        model = _model(64, parameterization, base)
        assert model.width_mults() == {} or set(model.width_mults().values()) == {1.0}
        optimizer = build_adamw(model, section, torch.device("cpu"))
        loss = model(_tokens(), _tokens(2))
        loss.backward()
        optimizer.step()
        results.append((loss.detach(), {k: v.clone() for k, v in model.state_dict().items()}))
    (loss0, state0), *others = results
    for loss, state in others:
        assert torch.equal(loss, loss0)
        assert all(torch.equal(state[k], state0[k]) for k in state0)


def test_tied_embeddings_under_mup_train_as_one_embedding():
    model = _model(64, base=32, tie_embeddings=True)
    roles = parameter_roles(model)
    assert [r.role for r in roles if r.param is model.output.weight] == ["embedding"]
    assert model(_tokens(), _tokens(2)).isfinite()


@pytest.mark.parametrize("tied", [False, True])
def test_meta_init_equals_eager_init_under_mup(tied):
    states = []
    for meta in (False, True):
        cfg = load_config(None, ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=8", "--model.vocab_size=128",
                                 "--model.max_seq_len=16", "--train.seq_len=16", "--train.dtype=fp32",
                                 "--model.parameterization=mup", "--model.mup_base_dim=16",
                                 f"--model.tie_embeddings={str(tied).lower()}",
                                 f"--train.meta_init={str(meta).lower()}"])  # fmt: skip
        module = CausalLMTrainModule(cfg, 100, None, Layout(1, 1, 1), torch.device("cpu"), torch.float32)
        states.append(module.model.state_dict())
    eager, meta = states
    assert eager.keys() == meta.keys()
    assert all(torch.equal(eager[k], meta[k]) for k in eager)
    assert eager["layers.0.attention.wq.weight"].std() < 0.013  # the muP scale, not the plain 0.02


def test_hf_export_folds_the_output_multiplier_and_refuses_a_tied_head(tmp_path):
    from safetensors.torch import load_file

    from liandan.checkpoint.hf import export_hf, import_hf

    model = _model(64, base=16)  # output multiplier 1/4
    out = export_hf(model.state_dict(), model.args, tmp_path / "hf")
    assert not json.loads((out / "config.json").read_text())["tie_word_embeddings"]
    assert torch.equal(load_file(out / "model.safetensors")["lm_head.weight"], model.output.weight.detach() / 4)
    state, args = import_hf(out)
    assert args.parameterization == "standard"
    plain = Transformer(args)
    plain.load_state_dict(state)
    torch.testing.assert_close(plain(_tokens()), model(_tokens()))
    tied = _model(64, base=16, tie_embeddings=True)
    with pytest.raises(ValueError, match="tie_embeddings"):
        export_hf(tied.state_dict(), tied.args, tmp_path / "tied")


def test_mup_needs_a_base_width():
    with pytest.raises(ConfigError, match="mup_base_dim"):
        load_config(None, ["--model.parameterization=mup"])
    cfg = load_config(None, ["--model.llama.parameterization=mup", "--model.llama.mup_base_dim=64"])
    assert (cfg.model.llama.parameterization, cfg.model.options.mup_base_dim) == ("mup", 64)


def test_widened_keeps_the_head_size_and_the_grouping():
    args = ModelArgs(dim=64, n_heads=8, n_kv_heads=4, vocab_size=100)
    wide = transfer.widened(args, 256)
    assert (wide.head_dim, wide.n_heads, wide.n_kv_heads, wide.ffn_dim) == (8, 32, 16, ModelArgs(dim=256).ffn_dim)
    with pytest.raises(ConfigError, match="multiples of 16"):
        transfer.widened(args, 72)


def test_coordinate_check_flat_under_mup_growing_under_standard(tmp_path):
    corpus = write_corpus(tmp_path)
    trends = {}
    for parameterization in ("standard", "mup"):
        cfg = tiny_config(tmp_path / "run", corpus, "--model.n_heads=8", "--model.n_kv_heads=8",
                          "--model.ffn_multiple_of=16", f"--model.parameterization={parameterization}",
                          "--model.mup_base_dim=32", "--optim.lr=0.01", "--train.global_batch=4",
                          "--train.seq_len=32")  # fmt: skip
        _, traces = transfer.coordinate_check(cfg, [32, 64, 128], 4, tmp_path / parameterization, lambda s: None)
        found = transfer.verdicts(traces)
        trends[parameterization] = {(v.layer, v.what): v.trend for v in found}
        table = transfer.table(traces, found)
        assert len(table) == 1 + len(found) and "slope" in table[0]
    assert set(trends["mup"].values()) == {"flat"}, trends["mup"]
    standard = trends["standard"]
    assert standard["block 1", "update"] == standard["logits", "update"] == "grows"
    assert standard["embedding", "activation"] == "flat"
    png = transfer.plot(traces, tmp_path / "plot.png", "mup")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_target_settings_carry_the_rate_over_under_mup_only():
    mup = load_config(None, ["--model.dim=64", "--model.n_heads=4", "--model.parameterization=mup",
                             "--model.mup_base_dim=64", "--optim.lr=0.004"])  # fmt: skip
    lines = transfer.target_settings(mup, 1024)
    assert "carries over" in lines[0]
    assert lines[1].split() == ["--model.dim=1024", "--model.n_heads=64", "--model.n_kv_heads=64",
                                "--model.head_dim=16", "--model.parameterization=mup", "--model.mup_base_dim=64",
                                "--optim.lr=0.004"]  # fmt: skip
    standard = load_config(None, ["--model.dim=64", "--model.n_heads=4", "--optim.lr=0.004"])
    lines = transfer.target_settings(standard, 1024)
    assert "does not carry over" in lines[0] and "--optim.lr=0.00025" in lines[1]
    assert "--model.mup_base_dim=64" in lines[2]


def test_the_sweep_file_and_flag_name_a_target_width(tmp_path):
    from liandan.plan.sweep import load_sweep

    base = tmp_path / "base.toml"
    base.write_text('[model]\ndim = 64\nn_heads = 4\nparameterization = "mup"\nmup_base_dim = 64\n')
    sweep = tmp_path / "s.toml"
    sweep.write_text(f'base = "{base}"\ntarget_dim = 512\n[params]\n"optim.lr" = {{ low = 1e-4, high = 1e-2 }}\n')
    assert load_sweep(sweep).target_dim == 512
    assert load_sweep(sweep, target_dim=2048).target_dim == 2048
    sweep.write_text(f'base = "{base}"\ntarget_dim = -1\n[params]\n"optim.lr" = {{ low = 1e-4, high = 1e-2 }}\n')
    with pytest.raises(ConfigError, match="target_dim"):
        load_sweep(sweep)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["check-transfer", "CFG", "--widths", "64"], "at least two different positive widths"),
        (["check-transfer", "CFG", "--widths", "64,x"], "comma-separated whole numbers"),
        (["check-transfer", "CFG", "--steps", "0"], "between 1 and 1000"),
        (["check-transfer", "CFG", "--plot", "out.pdf"], "must name a .png file"),
        (["check-transfer", "CFG", "--widths", "64,72"], "multiples of 16"),
        (["check-transfer", "CFG", "--model.parameterization=mup"], "needs model.mup_base_dim"),
        (["check-transfer", "missing.toml"], "missing.toml"),
        (["sweep", "s.toml", "--target-dim", "0"], "--target-dim = 0"),
    ],
)
def test_cli_mistakes_are_one_line(tmp_path, capsys, argv, words):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[model]\ndim = 64\nn_heads = 4\n")
    code = main([str(cfg) if a == "CFG" else a for a in argv])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err and words in err, err


def test_check_transfer_command_prints_a_verdict_and_writes_the_plot(tmp_path, capsys):
    corpus = write_corpus(tmp_path)
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "[model]\ndim = 32\nn_heads = 4\nmax_seq_len = 32\nparameterization = 'mup'\nmup_base_dim = 32\n"
        f"[train]\nglobal_batch = 2\nseq_len = 32\n[data]\ntokenizer = 'byte'\npaths = ['{corpus}']\n"
    )
    plot = tmp_path / "out" / "ct.png"
    assert main(["check-transfer", str(cfg), "--widths", "32,64", "--steps", "2", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "parameterization mup (base width 32)" in out and "verdict:" in out and "logits" in out
    assert Path(plot).is_file()


@pytest.mark.parametrize("parameterization", ["standard", "mup"])
def test_sweep_prints_the_best_trials_settings_at_the_target_width(tmp_path, capsys, parameterization):
    """A study that already holds its trial: the sweep runs nothing, prints the best and its target settings."""
    import optuna

    from liandan.plan.sweep import load_sweep, open_study

    base = tmp_path / "base.toml"
    base.write_text(f'[model]\ndim = 64\nn_heads = 4\nparameterization = "{parameterization}"\nmup_base_dim = 64\n')
    sweep = tmp_path / "s.toml"
    sweep.write_text(f'base = "{base}"\noutput_dir = "{tmp_path / "out"}"\ntrials = 1\n'
                     '[params]\n"optim.lr" = { low = 1e-4, high = 1e-2, log = true }\n')  # fmt: skip
    distribution = optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)
    open_study(load_sweep(sweep)).add_trial(
        optuna.trial.create_trial(params={"optim.lr": 0.004}, distributions={"optim.lr": distribution}, value=2.5)
    )
    assert main(["sweep", str(sweep), "--target-dim", "1024"]) == 0
    out = capsys.readouterr().out
    assert "best: trial 0" in out
    if parameterization == "mup":
        assert "carries over" in out and "--model.n_heads=64" in out and "--optim.lr=0.004" in out
    else:
        assert "does not carry over" in out and "--optim.lr=0.00025" in out


def test_muon_under_mup_scales_match_rms_rates_by_the_square_root_of_the_width_multiplier():
    from liandan.train.optimizers.muon import build_muon

    model = _model(128, base=32)  # width_mult 4
    for adjust, hidden_lrs in (("match_rms_adamw", {0.005}), ("spectral", {0.01})):
        section = load_config(None, ["--optim.name=muon", "--optim.lr=0.01", f"--optim.muon.adjust_lr={adjust}"]).optim
        muon, adamw = build_muon(model, section, torch.device("cpu"))
        assert {g["lr"] for g in muon.param_groups} == hidden_lrs
        assert {g["lr"] for g in adamw.param_groups} == {0.01}  # embedding, head, norms: unchanged
    plain = _model(128, "standard")
    muon, _ = build_muon(plain, section, torch.device("cpu"))
    assert len(muon.param_groups) == 1 and muon.param_groups[0]["lr"] == 0.01


def test_weights_trained_under_another_parameterization_are_another_model():
    import dataclasses

    from liandan.model.llama_spec import LLAMA

    mup, standard = _model(64, base=32).args, _model(64, "standard", base=0).args
    assert LLAMA.differences(standard, dataclasses.asdict(mup)) == [
        "model.parameterization = standard (checkpoint: mup)",
        "model.mup_base_dim = 0 (checkpoint: 32)",
    ]
    assert LLAMA.differences(mup, dataclasses.asdict(dataclasses.replace(mup, mup_base_dim=64)))
    assert LLAMA.differences(mup, dataclasses.asdict(mup)) == []
    assert LLAMA.differences(standard, {k: v for k, v in dataclasses.asdict(standard).items()
                                        if k not in ("parameterization", "mup_base_dim")}) == []  # fmt: skip
