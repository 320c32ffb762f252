"""The Llama family's speed-run recipe options (ReLU^2 feed-forward, logit soft-capping, zero-initialised output
projections): each changes the forward as it says, the standard model is untouched, the loss paths agree, meta
init gives the same weights, and what cannot be exported or configured is refused in one line."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from liandan.common.layout import Layout
from liandan.config import ConfigError, load_config
from liandan.model import ModelArgs, count_params
from liandan.model.llama import Transformer
from liandan.model.llama_hf import hf_config
from liandan.model.llama_spec import LLAMA, state_shapes
from liandan.train.causal_lm import CausalLMTrainModule

SHAKESPEARE = Path(__file__).resolve().parents[1] / "configs" / "shakespeare-char.toml"


def _args(**recipe) -> ModelArgs:
    return ModelArgs(vocab_size=96, dim=32, n_layers=2, n_heads=2, max_seq_len=16, **recipe)


def _model(seed: int = 0, **recipe) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(_args(**recipe))


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 96, (2, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_the_standard_model_is_built_and_computes_as_without_the_options():
    """The options' defaults draw the same numbers and compute the same loss, bit for bit, as the model built
    from args that name them explicitly off; and the defaults are the documented ones."""
    default, explicit = _model(), _model(mlp="swiglu", logit_softcap=0.0, zero_init_out=False)
    tokens, targets = _batch()
    assert torch.equal(default(tokens, targets), explicit(tokens, targets))
    args = _args()
    assert (args.mlp, args.logit_softcap, args.zero_init_out, args.tie_embeddings) == ("swiglu", 0.0, False, False)
    assert "layers.0.feed_forward.w3.weight" in default.state_dict()


def test_relu2_feed_forward_is_w2_of_squared_relu_and_has_no_gate():
    model = _model(mlp="relu2")
    ffn = model.layers["0"].feed_forward
    assert ffn.w3 is None
    assert ffn.w1.weight.shape == (128, 32)  # 4 * dim, as nanoGPT's MLP
    x = torch.randn(3, 32)
    expected = ffn.w2(torch.relu(ffn.w1(x)) ** 2)
    assert torch.allclose(ffn(x), expected)
    assert torch.allclose(ffn(-x), ffn.w2(torch.relu(-ffn.w1(x)) ** 2))
    shapes = state_shapes(model.args)
    assert shapes == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert count_params(model.args).total == sum(p.numel() for p in model.parameters())


def test_softcap_bounds_the_logits_and_is_tanh_of_the_uncapped_ones():
    plain, capped = _model(), _model(logit_softcap=0.5)
    tokens, _ = _batch()
    raw = plain(tokens)
    assert torch.allclose(capped(tokens), 0.5 * torch.tanh(raw / 0.5))
    with torch.no_grad():
        plain.output.weight.mul_(100.0)
        capped.output.weight.mul_(100.0)
    assert plain(tokens).abs().max() > 10  # logits far past the cap stay within it (tanh saturates to 1.0)
    assert capped(tokens).abs().max() <= 0.5


@pytest.mark.parametrize("cap, mup", [(0.0, False), (3.0, False), (3.0, True)], ids=["plain", "softcap", "softcap+mup"])
def test_softcap_gives_the_same_loss_and_gradients_on_every_loss_path(cap, mup):
    tokens, targets = _batch()
    results = []
    # under muP (half the base width) the logit multiplier goes before the cap on every path as well
    parameterization = {"parameterization": "mup", "mup_base_dim": 16} if mup else {}
    for chunks, fused in ((1, False), (3, False), (2, True)):
        model = _model(logit_softcap=cap, **parameterization)
        with torch.no_grad():
            model.output.weight.mul_(30.0)  # logits past the cap, so that it matters
        model.configure_loss(chunks, fused=fused)
        loss = model(tokens, targets)
        loss.backward()
        results.append((loss.detach(), model.output.weight.grad.clone(), model.tok_embeddings.weight.grad.clone()))
    for loss, head_grad, embed_grad in results[1:]:
        assert torch.allclose(loss, results[0][0], rtol=1e-5)
        assert torch.allclose(head_grad, results[0][1], rtol=1e-4, atol=1e-6)
        assert torch.allclose(embed_grad, results[0][2], rtol=1e-4, atol=1e-6)
    if cap:  # and the cap changed the loss
        uncapped = _model()
        with torch.no_grad():
            uncapped.output.weight.mul_(30.0)
        assert not torch.allclose(uncapped(tokens, targets), results[0][0])


def test_zero_init_out_starts_blocks_as_identity_and_logits_uniform():
    model = _model(zero_init_out=True)
    for block in model.layers.values():
        assert not block.attention.wo.weight.any()
        assert not block.feed_forward.w2.weight.any()
        assert block.attention.wq.weight.any()
    tokens, targets = _batch()
    assert not model(tokens).any()  # an untied zero head: every logit is zero
    loss = model(tokens, targets)
    assert torch.allclose(loss, torch.log(torch.tensor(96.0)))
    loss.backward()  # and learning starts: the zero matrices get gradients
    assert model.output.weight.grad.abs().sum() > 0
    tied = _model(zero_init_out=True, tie_embeddings=True)
    assert tied.output.weight.any()  # a tied head is the embedding table: kept


@pytest.mark.parametrize("recipe", [{"mlp": "relu2"}, {"zero_init_out": True}, {"logit_softcap": 15.0}])
def test_meta_init_gives_the_weights_of_the_model_built_whole(recipe):
    states = []
    for meta in (False, True):
        overrides = [f"--model.{k}={str(v).lower()}" for k, v in recipe.items()]
        cfg = load_config(None, ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=2", "--model.max_seq_len=16",
                                 "--train.seq_len=16", "--train.dtype=fp32", f"--train.meta_init={str(meta).lower()}",
                                 *overrides])  # fmt: skip
        module = CausalLMTrainModule(cfg, 96, None, Layout(1, 1, 1), torch.device("cpu"), torch.float32)
        states.append(module.model.state_dict())
    whole, meta = states
    assert whole.keys() == meta.keys()
    assert [k for k in whole if not torch.equal(whole[k], meta[k])] == []


@pytest.mark.parametrize(
    "override, words",
    [("--model.mlp=geglu", "model.mlp = 'geglu' is not allowed"),
     ("--model.logit_softcap=-1", "model.logit_softcap = -1.0 is too small"),
     ("--model.zero_init_out=maybe", "model.zero_init_out")],
)  # fmt: skip
def test_bad_recipe_settings_are_one_line_config_errors(override, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert words in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "recipe, words", [({"mlp": "relu2"}, "model.mlp = 'relu2'"), ({"logit_softcap": 30.0}, "model.logit_softcap")]
)
def test_hugging_face_export_refuses_what_llama_cannot_express(recipe, words):
    with pytest.raises(ValueError, match=words) as err:
        hf_config(_args(**recipe), "float32", None)
    assert "\n" not in str(err.value)
    assert hf_config(_args(zero_init_out=True), "float32", None)["model_type"] == "llama"  # init only


def test_a_checkpoint_of_another_recipe_is_named_as_different():
    ours = _args(mlp="relu2", logit_softcap=15.0)
    theirs = dataclasses.asdict(_args())
    assert LLAMA.differences(ours, theirs) == ["model.mlp = relu2 (checkpoint: swiglu)",
                                               "model.logit_softcap = 15.0 (checkpoint: 0.0)"]  # fmt: skip
    assert LLAMA.differences(_args(), theirs) == []


def test_the_shipped_shakespeare_config_parses_and_trains_two_steps(tmp_path):
    from liandan.train.trainer import Trainer

    corpus = tmp_path / "input.txt"
    corpus.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40)
    cfg = load_config(SHAKESPEARE, [f"--run.output_dir={tmp_path}", "--run.name=run", f"--data.paths=[\"{corpus}\"]",
                                    "--train.steps=2", "--schedule.warmup_steps=1", "--train.eval_every=0",
                                    "--doctor.preflight=false", "--checkpoint.enabled=false"])  # fmt: skip
    assert cfg.data.tokenizer == "byte"
    assert (cfg.model.llama.dim, cfg.model.llama.n_layers, cfg.train.seq_len, cfg.train.global_batch) == (
        128,
        4,
        64,
        12,
    )
    assert cfg.optim.name == "muon"
    trainer = Trainer(cfg, say=lambda m: None)
    try:
        result = trainer.train()
    finally:
        trainer.close()
    assert trainer.progress.step == 2 and result.losses and all(math.isfinite(loss) for loss in result.losses)
