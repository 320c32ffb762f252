"""Tests for the Hugging Face interchange and the consolidated single-file checkpoint: exported models give the
same logits in transformers, imports give the same logits in liandan, round trips are exact, errors are clear."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from liandan.checkpoint.hf import (
    ARGS_METADATA_KEY,
    export_hf,
    import_hf,
    load_consolidated,
    save_consolidated,
)
from liandan.model import ModelArgs, Transformer

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

VOCAB = 320
CASES = {
    "untied-gqa": {},
    "tied": {"tie_embeddings": True},
    "mha": {"n_kv_heads": 4},
    "qk-norm": {"qk_norm": True},
}
HAS_QWEN3 = hasattr(transformers, "Qwen3ForCausalLM")


def small_args(**overrides) -> ModelArgs:
    # Non-default theta and eps, so a config field that is dropped on the way shows up in the logits.
    kwargs = {
        "vocab_size": VOCAB,
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 96,
        "max_seq_len": 64,
        "rope_theta": 500.0,
        "norm_eps": 1e-5,
    }
    kwargs.update(overrides)
    return ModelArgs(**kwargs)


def make_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(small_args(**overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # away from 1, so a norm weight in the wrong place changes the logits
                param.uniform_(0.5, 1.5)
    return model.eval()


def random_tokens(seed: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(seed))


def hf_load(cls, path: Path):
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return cls.from_pretrained(path, attn_implementation="eager", **{dtype_kw: torch.float32}).eval()


def hf_class(args: ModelArgs):
    if args.qk_norm:
        if not HAS_QWEN3:
            pytest.skip("this transformers has no Qwen3")
        return transformers.Qwen3ForCausalLM
    return transformers.LlamaForCausalLM


@pytest.mark.parametrize("case", list(CASES))
def test_exported_model_gives_same_logits_in_transformers(tmp_path, case):
    model = make_model(**CASES[case])
    args = model.args
    out = export_hf(model.state_dict(), args, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM" if args.qk_norm else "LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is args.tie_embeddings
    hf = hf_load(hf_class(args), out)
    assert hf.config.rms_norm_eps == args.norm_eps
    tokens = random_tokens()
    with torch.no_grad():
        ours = model(tokens)
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_export_then_import_is_exact(tmp_path, case):
    model = make_model(**CASES[case])
    export_hf(model.state_dict(), model.args, tmp_path / "hf")
    state_dict, args = import_hf(tmp_path / "hf")
    assert args == model.args
    expected = model.state_dict()
    assert list(state_dict) == list(expected)
    for key, tensor in expected.items():
        assert state_dict[key].dtype == tensor.dtype, key
        assert torch.equal(state_dict[key], tensor), key
    if model.args.tie_embeddings:
        assert state_dict["output.weight"] is state_dict["tok_embeddings.weight"]
        with safetensors.safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
            assert "lm_head.weight" not in set(f.keys())
            assert f.metadata() == {"format": "pt"}
    # And the imported state dict loads strictly into a fresh model.
    Transformer(args).load_state_dict(state_dict)


def test_export_in_bfloat16(tmp_path):
    model = make_model()
    export_hf(model.state_dict(), model.args, tmp_path / "hf", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    state_dict, _ = import_hf(tmp_path / "hf")
    for key, tensor in model.state_dict().items():
        assert state_dict[key].dtype == torch.bfloat16
        assert torch.equal(state_dict[key], tensor.to(torch.bfloat16)), key


def test_export_accepts_names_from_wrapped_blocks(tmp_path):
    model = make_model()
    # Names as activation checkpointing and torch.compile leave them on wrapped blocks.
    renames = {"layers.0.": "layers.0._checkpoint_wrapped_module.", "layers.1.": "layers.1._orig_mod."}
    wrapped = {}
    for key, value in model.state_dict().items():
        for old, new in renames.items():
            key = key.replace(old, new)
        wrapped[key] = value
    export_hf(wrapped, model.args, tmp_path / "hf")
    state_dict, _ = import_hf(tmp_path / "hf")
    assert all(torch.equal(state_dict[k], v) for k, v in model.state_dict().items())


def test_exported_tokenizer_loads_with_autotokenizer(tmp_path):
    from pydoc_data.topics import topics

    from liandan.data.tokens.tokenizer import EOS, train_bpe

    texts = [topics[name] for name in sorted(topics)[:12]]
    tok = train_bpe(texts, 400)
    tok.save(tmp_path / "tokenizer.json")
    model = make_model(vocab_size=tok.vocab_size)
    out = export_hf(model.state_dict(), model.args, tmp_path / "hf", tokenizer_json=tmp_path / "tokenizer.json")
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == tok.eos_id

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.is_fast
    assert hf_tok.eos_token == EOS and hf_tok.eos_token_id == tok.eos_id
    samples = [
        texts[3][:800],
        "Naïve café — 東京 ✓ and emoji 🙂",
        f"one document{EOS}the next",
        "  spaces  , and . punct",
    ]
    for text, ids in zip(samples, tok.encode_batch(samples)):
        assert hf_tok.encode(text) == ids
        assert hf_tok(text)["input_ids"] == ids
        assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids)


def hf_llama_with_random_norms(seed: int, **config_overrides):
    torch.manual_seed(seed)
    kwargs = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 2000.0,
    }
    kwargs.update(config_overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("layout", ["single", "sharded", "tied"])
def test_import_of_transformers_llama_gives_same_logits(tmp_path, layout):
    hf = hf_llama_with_random_norms(3, tie_word_embeddings=layout == "tied")
    kwargs = {"max_shard_size": "60KB"} if layout == "sharded" else {}
    hf.save_pretrained(tmp_path / "hf", **kwargs)
    if layout == "sharded":
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
        assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1

    state_dict, args = import_hf(tmp_path / "hf")
    assert (args.rope_theta, args.norm_eps, args.n_kv_heads, args.ffn_dim) == (2000.0, 1e-5, 2, 96)
    assert args.tie_embeddings is (layout == "tied")
    model = Transformer(args).eval()
    model.load_state_dict(state_dict)
    tokens = random_tokens(2)
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff < 1e-4


@pytest.mark.skipif(not HAS_QWEN3, reason="this transformers has no Qwen3")
def test_import_of_transformers_qwen3_gives_same_logits(tmp_path):
    torch.manual_seed(4)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=1000.0,
    )
    hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "hf")
    state_dict, args = import_hf(tmp_path / "hf")
    assert args.qk_norm and args.rope_theta == 1000.0
    model = Transformer(args).eval()
    model.load_state_dict(state_dict)
    tokens = random_tokens(5)
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", ["untied-gqa", "tied"])
def test_consolidated_round_trip(tmp_path, case):
    model = make_model(**CASES[case])
    path = tmp_path / "sub" / "model.safetensors"
    save_consolidated(model.state_dict(), model.args, path)

    with safetensors.safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        keys = set(f.keys())
    assert json.loads(metadata[ARGS_METADATA_KEY])["dim"] == 64
    assert ("output.weight" in keys) is not model.args.tie_embeddings
    assert "tok_embeddings.weight" in keys

    state_dict, args = load_consolidated(path)
    assert args == model.args
    for key, tensor in model.state_dict().items():
        assert torch.equal(state_dict[key], tensor), key
    fresh = Transformer(args).eval()
    fresh.load_state_dict(state_dict)
    tokens = random_tokens()
    with torch.no_grad():
        assert torch.equal(fresh(tokens), model(tokens))


def test_consolidated_file_without_args_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=ARGS_METADATA_KEY):
        load_consolidated(path)


@pytest.fixture
def exported(tmp_path) -> Path:
    model = make_model()
    return export_hf(model.state_dict(), model.args, tmp_path / "hf")


@pytest.mark.parametrize(
    "field, value",
    [
        ("attention_bias", True),
        ("mlp_bias", True),
        ("hidden_act", "gelu"),
        ("head_dim", 15),
        ("model_type", "gemma"),
        ("use_sliding_window", True),
        ("partial_rotary_factor", 0.5),
        pytest.param(
            "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, id="yarn"
        ),
        pytest.param("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, id="rope_scaling-llama3-incomplete"),
        pytest.param(
            "rope_parameters",
            {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
            id="rope_parameters-linear",
        ),
        pytest.param("num_attention_heads", 0, id="no-heads"),  # was a ZeroDivisionError
        pytest.param("hidden_size", "abc", id="width-a-string"),  # was int()'s message, naming no field
        pytest.param("hidden_size", 64.5, id="width-a-fraction"),  # was cut to 64 silently
        pytest.param("rms_norm_eps", "x", id="eps-a-string"),
        pytest.param("initializer_range", -0.02, id="negative-init"),
    ],
)
def test_import_refuses_unsupported_config(exported, field, value):
    config_path = exported / "config.json"
    config = json.loads(config_path.read_text())
    config[field] = value
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field) as refused:
        import_hf(exported)
    assert "\n" not in str(refused.value)


def test_import_refuses_checkpoint_that_does_not_match_config(exported):
    config_path = exported / "config.json"
    config = json.loads(config_path.read_text())
    config["intermediate_size"] = 128
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight has shape"):
        import_hf(exported)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_import_refuses_weights_that_are_not_finite(exported, value):
    from safetensors.torch import load_file, save_file

    path = exported / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight holds 1 NaN or infinite"):
        import_hf(exported)


def test_export_refuses_state_dict_that_does_not_match_args(tmp_path):
    model = make_model()
    state_dict = dict(model.state_dict())
    del state_dict["layers.1.ffn_norm.weight"]
    with pytest.raises(ValueError, match=r"layers\.1\.ffn_norm\.weight"):
        export_hf(state_dict, model.args, tmp_path / "a")
    with pytest.raises(ValueError, match="feed_forward.w1.weight"):
        export_hf(model.state_dict(), small_args(ffn_dim=128), tmp_path / "b")
    with pytest.raises(ValueError, match="tie_embeddings"):
        export_hf(model.state_dict(), small_args(tie_embeddings=True), tmp_path / "c")


def test_missing_paths_raise_file_not_found(tmp_path, exported):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        import_hf(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="config.json is a file: name the directory"):
        import_hf(exported / "config.json")
    with pytest.raises(FileNotFoundError, match="nothing.safetensors"):
        load_consolidated(tmp_path / "nothing.safetensors")
    (exported / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        import_hf(exported)
    model = make_model()
    with pytest.raises(FileNotFoundError, match="no-tokenizer.json"):
        export_hf(model.state_dict(), model.args, tmp_path / "x", tokenizer_json=tmp_path / "no-tokenizer.json")
