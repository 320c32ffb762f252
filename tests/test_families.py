"""Open model families through Llama's spec: random tiny Llama 3.x, Qwen2, Qwen3 and Mistral models made by
transformers import with the same logits, export back to transformers with the same logits, the import prints
the `[model]` block a config needs (and `checkpoint.init_from` holds a config to it), and a SentencePiece
`tokenizer.model` becomes the same tokenizer as a tokenizer.json."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import tomllib
import torch

from liandan.checkpoint.hf import export_hf, import_hf, import_notes
from liandan.cli.main import main as liandan_main
from liandan.config import ModelSection, build_section
from liandan.model import Transformer
from liandan.model.llama_spec import LLAMA
from liandan.model.spec import model_args

transformers = pytest.importorskip("transformers")
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5

VOCAB = 384
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}
# The original context is short against the test's 32 positions, so every frequency band of the rescaling
# (kept, blended, divided by the factor) shows up in the logits.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # fmt: skip


def _rope(theta: float, scaling: dict | None = None) -> dict:
    """RoPE settings as this transformers takes them: `rope_parameters` from version 5, `rope_theta` and
    `rope_scaling` before."""
    if TRANSFORMERS_5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **(scaling or {})}}
    return {"rope_theta": theta, **({"rope_scaling": scaling} if scaling else {})}


def _configs() -> dict:
    return {
        "llama3": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True, **_rope(500.0, LLAMA3_ROPE)),
        "qwen2": lambda: transformers.Qwen2Config(**COMMON, **_rope(1000.0)),
        # Qwen3 keeps the head size apart from the width, as Qwen3-0.6B does (16 heads of 128 in 1024).
        "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, **_rope(1000.0)),
        # Mistral 7B v0.1 attends over a sliding window, here of 16 positions.
        "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=16, **_rope(2000.0)),
    }


FAMILIES = list(_configs())


def random_hf_model(family: str, seed: int = 0):
    """A transformers model of `family` with norms away from 1 and biases away from 0, so a misplaced norm or a
    dropped bias changes the logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_configs()[family](), attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return model.float().eval()


def hf_load(path: Path):
    dtype = {"dtype" if TRANSFORMERS_5 else "torch_dtype": torch.float32}
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **dtype).eval()


def tokens(length: int = 32) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    """(family, the transformers model, the directory it was saved to)."""
    hf = random_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(path)
    return request.param, hf, path


def test_import_gives_the_logits_of_transformers(saved):
    family, hf, path = saved
    state, args = import_hf(path)
    model = Transformer(args).eval()
    model.load_state_dict(state)
    x = tokens(min(32, args.max_seq_len))
    with torch.no_grad():
        ours, theirs = model(x), hf(x).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    assert (args.qk_norm, args.qkv_bias) == (family == "qwen3", family == "qwen2")
    if family == "llama3":
        assert args.tie_embeddings and args.rope_scaling == "llama3" and args.rope_original_max_seq_len == 16
        plain = Transformer(dataclasses.replace(args, rope_scaling="none")).eval()
        plain.load_state_dict(state)
        with torch.no_grad():  # the rescaling is not a no-op here: without it the logits are far off
            assert (plain(x) - theirs).abs().max().item() > 1e-3
    if family == "qwen3":
        assert args.head_dim == 32 and args.dim // args.n_heads == 16


def test_export_loads_in_transformers_with_the_same_logits(saved, tmp_path):
    family, hf, path = saved
    state, args = import_hf(path)
    model = Transformer(args).eval()
    model.load_state_dict(state)
    back = hf_load(export_hf(model.state_dict(), args, tmp_path / "out"))
    x = tokens(min(32, args.max_seq_len))
    with torch.no_grad():
        assert (back(x).logits - model(x)).abs().max().item() < 1e-4
        assert (back(x).logits - hf(x).logits).abs().max().item() < 1e-4
    expected = {"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "LlamaForCausalLM"}  # fmt: skip
    assert type(back).__name__ == expected[family]
    again, args_again = import_hf(tmp_path / "out")
    assert args_again == args
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())


def test_mistral_sliding_window_becomes_the_longest_sequence(tmp_path):
    """Within the window full causal attention is the model's attention; beyond it transformers' logits
    differ, so the import caps max_seq_len at the window and says why."""
    hf = random_hf_model("mistral")
    hf.save_pretrained(tmp_path)
    _, args = import_hf(tmp_path)
    assert args.max_seq_len == 16
    assert any("sliding_window = 16" in note for note in import_notes(tmp_path))
    x = tokens(24)
    with torch.no_grad():  # positions past the window see fewer keys in transformers than in full attention
        windowed, within = hf(x).logits, hf(x[:, :16]).logits
    assert torch.allclose(windowed[:, :16], within, atol=1e-5)


def test_import_prints_the_model_block_that_init_from_accepts(saved, tmp_path, capsys):
    _, _, path = saved
    assert liandan_main(["import", str(path), str(tmp_path / "ckpt"), "--hf"]) == 0
    printed = capsys.readouterr().out
    block = printed[printed.index("[model]") : printed.index("\n\n", printed.index("[model]"))]
    section = build_section("model", ModelSection, tomllib.loads(block)["model"])
    meta = json.loads((tmp_path / "ckpt" / "meta.json").read_text())
    assert LLAMA.differences(model_args(section, 0), meta["model_args"]) == []


def test_init_from_compares_what_the_shapes_do_not_show():
    ours = model_args(_section(dim=64, n_heads=4, vocab_size=VOCAB, rope_theta=500000.0), 0)
    saved = dataclasses.asdict(ours)
    assert LLAMA.differences(ours, saved) == []
    for field, value in [("rope_theta", 10000.0), ("norm_eps", 1e-6), ("rope_scaling", "llama3"),
                         ("head_dim", 32), ("qkv_bias", True)]:  # fmt: skip
        differ = LLAMA.differences(ours, saved | {field: value})
        assert len(differ) == 1 and differ[0].startswith(f"model.{field} = "), (field, differ)
    # The rescaling's parameters count only where rescaling is on.
    assert LLAMA.differences(ours, saved | {"rope_factor": 32.0}) == []
    scaled = dataclasses.replace(ours, rope_scaling="llama3")
    differ = LLAMA.differences(scaled, dataclasses.asdict(scaled) | {"rope_factor": 32.0})
    assert differ == ["model.rope_factor = 8.0 (checkpoint: 32.0)"]
    # A checkpoint saved before a field existed holds its default.
    older = {k: v for k, v in saved.items() if k not in ("head_dim", "qkv_bias", "rope_scaling")}
    assert LLAMA.differences(ours, older) == []


def test_unsupported_features_are_refused_in_one_line_naming_the_field(tmp_path, capsys):
    hf = random_hf_model("llama3")
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    field = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    config[field] = {**config[field], "rope_type": "yarn"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # what saving printed
    assert liandan_main(["import", str(tmp_path / "hf"), str(tmp_path / "out"), "--hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err and "yarn" in err, err
    assert not (tmp_path / "out").exists()


def test_sentencepiece_tokenizer_model_is_imported_as_the_same_tokenizer(tmp_path, capsys):
    spm = pytest.importorskip("sentencepiece", reason="converting a tokenizer.model needs sentencepiece")
    from pydoc_data.topics import topics

    from liandan.data import HFTokenizer

    # Llama 2's and Mistral's settings: byte-fallback BPE, no normalisation, whitespace kept.
    model = io.BytesIO()
    lines = [line for text in list(topics.values())[:30] for line in text.splitlines() if line.isascii()]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=VOCAB,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True, minloglevel=2)  # fmt: skip
    hf = random_hf_model("mistral")
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.model").write_bytes(model.getvalue())
    assert liandan_main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "--hf"]) == 0
    printed = capsys.readouterr().out
    assert f"--data.tokenizer={tmp_path / 'ckpt' / 'tokenizer.json'}" in printed
    ours = HFTokenizer.load(tmp_path / "ckpt" / "tokenizer.json")
    reference = spm.SentencePieceProcessor(model_proto=model.getvalue())
    texts = ["def f(x):\n    return x  # 42", "  Two  spaces,\ttabs and ünïcode 你好 fall back to bytes."]
    assert ours.encode_batch(texts) == [reference.encode(t) for t in texts]
    assert [ours.decode(ids) for ids in ours.encode_batch(texts)] == texts
    assert ours.eos_id == reference.eos_id()


@pytest.mark.parametrize("variant", [{"qkv_bias": True}, {"head_dim": 32}, {"qkv_bias": True, "head_dim": 8}])
def test_counts_and_the_planner_s_split_follow_biases_and_head_size(variant):
    from liandan.model import count_params
    from liandan.plan.memory import param_split

    args = model_args(_section(dim=64, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, **variant), 0)
    model = Transformer(args)
    assert count_params(args).total == sum(p.numel() for p in model.parameters())
    assert param_split(args).total == count_params(args).total
    if args.qkv_bias:  # biases start at zero, as the projections' outputs should
        assert all(torch.equal(b, torch.zeros_like(b)) for n, b in model.named_parameters() if n.endswith("bias"))


def test_llama3_rescaling_keeps_fast_divides_slow_and_blends_between():
    from liandan.model.llama import rope_frequencies

    args = model_args(_section(dim=64, n_heads=2, rope_theta=10000.0, rope_scaling="llama3", rope_factor=8.0,
                                   rope_original_max_seq_len=64), 0)  # fmt: skip
    plain = rope_frequencies(dataclasses.replace(args, rope_scaling="none"))
    scaled = rope_frequencies(args)
    periods = 64 * plain / (2 * torch.pi)  # how often each frequency turns within the original context
    fast, slow = periods > 4.0, periods < 1.0
    assert fast.any() and slow.any() and (~fast & ~slow).any()
    assert torch.equal(scaled[fast], plain[fast])
    torch.testing.assert_close(scaled[slow], plain[slow] / 8.0)
    middle = ~fast & ~slow
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8.0)).all()


# Published configs, as transformers 4 wrote them (fields that do not matter here left out), and the models'
# published parameter counts.
_LLAMA3_1 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
             "rope_type": "llama3"}  # fmt: skip
IN_THE_WILD = {
    "Llama-3.1-8B": (8_030_261_248, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": _LLAMA3_1, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "vocab_size": 128256}),
    "Llama-3.2-1B": (1_235_814_400, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": 64, "hidden_size": 2048,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32,
        "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {**_LLAMA3_1, "factor": 32.0}, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "vocab_size": 128256}),
    "Qwen2.5-0.5B": (494_032_768, {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "use_sliding_window": False,
        "vocab_size": 151936}),
    "Qwen3-0.6B": (596_049_920, {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}),
    "Mistral-7B-v0.1": (7_241_732_096, {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(IN_THE_WILD))
def test_published_configs_give_the_published_parameter_counts(name):
    from liandan.checkpoint.hf import args_from_hf_config
    from liandan.model import count_params

    params, config = IN_THE_WILD[name]
    args = args_from_hf_config(config)
    assert count_params(args).total == params
    expected = {"Llama-3.1-8B": ("llama3", 131072), "Llama-3.2-1B": ("llama3", 131072), "Qwen2.5-0.5B": ("none", 32768),
                "Qwen3-0.6B": ("none", 40960), "Mistral-7B-v0.1": ("none", 4096)}[name]  # fmt: skip
    assert (args.rope_scaling, args.max_seq_len) == expected


def _section(**keys) -> ModelSection:
    """A [model] section from flat keys, as a config file writes them."""
    return build_section("model", ModelSection, keys)
