"""Mixtral, Qwen3-MoE and GLM-4.5 in and out of liandan: random tiny models made by transformers give the same logits
once imported, liandan MoE models give the same logits in transformers once exported (written in the Hub's
one-tensor-per-expert layout), both round trips hold, and what none of them expresses is refused in one
line."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from liandan.checkpoint.hf import export_hf, import_hf, import_notes
from liandan.checkpoint.streaming import differences as weight_differences
from liandan.checkpoint.streaming import stream_into, weight_source
from liandan.model import ModelArgs, Transformer

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
if not hasattr(transformers, "Qwen3MoeForCausalLM"):
    pytest.skip("this transformers has no Qwen3-MoE", allow_module_level=True)

STREAM_WORKER = Path(__file__).with_name("hf_moe_stream_worker.py")
VOCAB = 96
SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}  # fmt: skip
HF_CASES = {
    "mixtral": lambda: transformers.MixtralConfig(
        **SHAPE,
        intermediate_size=40,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_theta=5000.0,
        router_aux_loss_coef=0.02,
    ),
    # Two dense layers first, a head size apart from the width, the chosen weights renormalised.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE,
        head_dim=12,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_experts=6,
        num_experts_per_tok=3,
        mlp_only_layers=[0, 1],
        norm_topk_prob=True,
        rope_theta=2000.0,
    ),
    # Every layer routed, the chosen weights as softmax gave them (Qwen3-30B-A3B renormalises; others not).
    "qwen3_moe-unnormalised": lambda: transformers.Qwen3MoeConfig(
        **SHAPE,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
    # Sigmoid scores with a balancing bias, a shared expert, scaled weights, one dense layer first, qk-norm and
    # query/key/value biases, the rotary embedding on half of each head (transformers' default, GLM-4.5's).
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **SHAPE,
        head_dim=12,
        intermediate_size=40,
        moe_intermediate_size=16,
        n_routed_experts=6,
        num_experts_per_tok=3,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        use_qk_norm=True,
        attention_bias=True,
        rope_theta=3000.0,
    ),
    # No shared experts (transformers stores their empty weights), no dense layer, the weights not renormalised,
    # the rotary embedding over the whole head.
    "glm4_moe-plain": lambda: transformers.Glm4MoeConfig(
        **SHAPE,
        intermediate_size=40,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=0,
        first_k_dense_replace=0,
        norm_topk_prob=False,
        partial_rotary_factor=1.0,
    ),
    # dots.llm1: Qwen3's attention (qk-norm always) with GLM-4.5's routing, two shared experts.
    "dots1": lambda: transformers.Dots1Config(
        **SHAPE,
        head_dim=12,
        intermediate_size=40,
        moe_intermediate_size=16,
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_shared_experts=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.0,
    ),
}
BIASED = ("glm4_moe", "dots1")  # the architectures with a routing bias
GLM_ROUTING = {"moe_score": "sigmoid", "moe_balance": "bias", "moe_aux_loss": 0.0}
# liandan MoE models and the architecture each is written as.
LIANDAN_CASES = {
    "mixtral": ({}, "MixtralForCausalLM"),
    "qwen3_moe": ({"qk_norm": True, "moe_dense_layers": 1, "ffn_dim": 40}, "Qwen3MoeForCausalLM"),
    "qwen3_moe-unnormalised": ({"qk_norm": True, "moe_route_norm": False}, "Qwen3MoeForCausalLM"),
    # liandan's default balancing with sigmoid scores, as DeepSeek-V3 trains: only GLM-4.5 has both.
    "glm4_moe": (
        GLM_ROUTING
        | {
            "moe_shared_experts": 2,
            "moe_route_scale": 1.5,
            "moe_dense_layers": 1,
            "ffn_dim": 40,
            "qkv_bias": True,
            "qk_norm": True,
            "rope_fraction": 0.25,
        },
        "Glm4MoeForCausalLM",
    ),
    "glm4_moe-plain": (GLM_ROUTING | {"moe_route_norm": False}, "Glm4MoeForCausalLM"),
}


def randomised(model: torch.nn.Module, seed: int, routing_bias: bool = False) -> torch.nn.Module:
    """Every weight drawn anew: norms away from 1 (a norm in the wrong place shows), the rest wide enough for
    the routers' choices to be far from ties; with `routing_bias` the routers' balancing biases too, as a
    trained model's (wide enough to change some choices)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
        for name, buffer in model.named_buffers():
            if routing_bias and name.endswith(("e_score_correction_bias", "expert_bias")):
                buffer.copy_(torch.rand(buffer.shape, generator=generator) * 0.2 - 0.1)
    return model.eval()


def hf_model(case: str, seed: int = 0):
    config = HF_CASES[case]()
    config._attn_implementation = "eager"
    return randomised(transformers.AutoModelForCausalLM.from_config(config), seed, case.startswith(BIASED))


def liandan_model(case: str, seed: int = 0) -> Transformer:
    overrides, _ = LIANDAN_CASES[case]
    args = {"vocab_size": VOCAB, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 24,
            "max_seq_len": 64, "rope_theta": 500.0, "moe_experts": 4, "moe_top_k": 2, "moe_balance": "none",
            "moe_aux_loss": 0.01} | overrides  # fmt: skip
    return randomised(Transformer(ModelArgs(**args)), seed, args["moe_balance"] == "bias")


def hf_load(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


def hf_logits_far_from_ties(hf, batch: torch.Tensor) -> torch.Tensor:
    """transformers' logits, after checking that in every MoE layer each token's k-th and (k+1)-th expert
    scores differ by far more than the two implementations' rounding: equal logits then test the weights and
    the routing, not how each breaks a tie."""
    with torch.no_grad():
        out = hf(batch, output_router_logits=True)
    k = hf.config.num_experts_per_tok
    glm = hf.config.model_type in BIASED
    biases = [layer.mlp.gate.e_score_correction_bias for layer in hf.model.layers if glm and hasattr(layer.mlp, "gate")]
    for i, logits in enumerate(out.router_logits):
        if glm:  # chosen by sigmoid score plus bias
            choice = logits.float().sigmoid() + biases[i]
        else:
            choice = logits.float().softmax(-1)
        if logits.shape[-1] > k:
            top = choice.topk(k + 1, dim=-1).values
            assert (top[:, k - 1] - top[:, k]).min().item() > 1e-5
    return out.logits


def max_diff(model: Transformer, hf, batch: torch.Tensor) -> float:
    theirs = hf_logits_far_from_ties(hf, batch)
    with torch.no_grad():
        return (model(batch) - theirs).abs().max().item()


@pytest.mark.parametrize("case", list(HF_CASES))
def test_import_of_transformers_moe_gives_the_same_logits(tmp_path, case):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")  # sharded: experts spread over files
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    state_dict, args = import_hf(tmp_path / "hf")
    config = hf.config
    assert (args.moe_experts, args.moe_top_k) == (config.num_local_experts, config.num_experts_per_tok)
    assert args.moe_route_norm is (case == "mixtral" or config.norm_topk_prob)
    bias = state_dict["layers.2.feed_forward.router.expert_bias"]
    if case.startswith(BIASED):
        assert (args.moe_score, args.moe_balance) == ("sigmoid", "bias")
        assert args.moe_shared_experts == config.n_shared_experts
        assert args.moe_route_scale == config.routed_scaling_factor
        assert args.rope_fraction == (0.5 if case == "glm4_moe" else 1.0)  # transformers' GLM default: half
        assert args.moe_dense_layers == config.first_k_dense_replace
        assert args.qk_norm is getattr(config, "use_qk_norm", True)
        assert args.qkv_bias is getattr(config, "use_qk_norm", False)  # the GLM case has both or neither
        assert torch.equal(bias, hf.model.layers[2].mlp.gate.e_score_correction_bias)
        assert "set moe_bias_rate" in " ".join(import_notes(tmp_path / "hf"))
    else:
        assert args.moe_balance == "none" and args.moe_aux_loss == config.router_aux_loss_coef
        assert args.moe_dense_layers == len(getattr(config, "mlp_only_layers", []))
        assert args.qk_norm is case.startswith("qwen3")
        assert bias.count_nonzero() == 0
    model = Transformer(args).eval()
    model.load_state_dict(state_dict)
    assert max_diff(model, hf, tokens()) < 1e-4


@pytest.mark.parametrize("case", list(LIANDAN_CASES))
def test_exported_moe_loads_in_transformers_with_the_same_logits(tmp_path, case):
    model = liandan_model(case)
    out = export_hf(model.state_dict(), model.args, tmp_path / "hf")
    with safetensors.safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    experts = "block_sparse_moe.experts.3.w2" if case == "mixtral" else "mlp.experts.3.down_proj"
    assert f"model.layers.1.{experts}.weight" in names  # the Hub's layout, one tensor per expert
    assert not any("expert_bias" in n or "gate_up_proj" in n for n in names)
    assert ("model.layers.1.mlp.gate.e_score_correction_bias" in names) is case.startswith("glm")
    hf = hf_load(out)
    assert type(hf).__name__ == LIANDAN_CASES[case][1]
    assert max_diff(model, hf, tokens(2)) < 1e-4


@pytest.mark.parametrize("case", list(LIANDAN_CASES))
def test_export_then_import_gives_the_same_tensors(tmp_path, case):
    model = liandan_model(case)
    export_hf(model.state_dict(), model.args, tmp_path / "hf")
    state_dict, args = import_hf(tmp_path / "hf")
    assert args == model.args
    expected = model.state_dict()
    assert list(state_dict) == list(expected)
    assert [k for k, t in expected.items() if not torch.equal(state_dict[k], t)] == []


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "glm4_moe"])
def test_import_then_export_gives_transformers_the_same_model(tmp_path, case):
    hf = hf_model(case, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    state_dict, args = import_hf(tmp_path / "hf")
    export_hf(state_dict, args, tmp_path / "again")
    again = hf_load(tmp_path / "again")
    batch = tokens(4)
    with torch.no_grad():
        assert (again(batch).logits - hf_logits_far_from_ties(hf, batch)).abs().max().item() < 1e-5
    # GLM-4.5's config announces a multi-token-prediction layer its weights do not hold (transformers ignores
    # one); the export says none.
    skipped = ("transformers_version", "bos_token_id", "eos_token_id", "initializer_range", "head_dim",
               "num_nextn_predict_layers")  # fmt: skip
    for key, value in json.loads((tmp_path / "hf" / "config.json").read_text()).items():
        if key not in skipped:
            assert again.config.to_dict().get(key) == value, key


def test_liandan_import_and_export_commands(tmp_path):
    """`liandan import --hf` of a Mixtral prints its `[model]` block and what to add for its balancing, and
    `liandan export --hf` of the imported checkpoint gives transformers the same model."""
    from helpers import liandan_here

    hf = hf_model("mixtral", seed=7)
    hf.config.router_jitter_noise = 0.01
    hf.save_pretrained(tmp_path / "hf")
    done = liandan_here("import", tmp_path / "hf", tmp_path / "imported", "--hf")
    assert done.returncode == 0, done.stderr
    for line in ("moe_experts = 4", "moe_top_k = 2", "moe_route_norm = true", "moe_ffn_dim = 40"):
        assert line in done.stdout.splitlines()
    assert 'add moe_balance = "none" and moe_aux_loss = 0.02' in done.stdout
    assert "router_jitter_noise = 0.01" in done.stdout
    done = liandan_here("export", tmp_path / "imported", tmp_path / "out", "--hf")
    assert done.returncode == 0, done.stderr
    batch = tokens(8)
    with torch.no_grad():
        assert (hf_load(tmp_path / "out")(batch).logits - hf_logits_far_from_ties(hf, batch)).abs().max() < 1e-5


def test_dots1_goes_out_as_glm_with_the_same_logits(tmp_path):
    """dots.llm1 is GLM-4.5's routing on Qwen3's layers: read, it is written back as GLM-4.5, which computes
    the same function."""
    hf = hf_model("dots1", seed=3)
    hf.save_pretrained(tmp_path / "hf")
    state_dict, args = import_hf(tmp_path / "hf")
    export_hf(state_dict, args, tmp_path / "again")
    again = hf_load(tmp_path / "again")
    assert type(again).__name__ == "Glm4MoeForCausalLM"
    batch = tokens(4)
    with torch.no_grad():
        assert (again(batch).logits - hf_logits_far_from_ties(hf, batch)).abs().max().item() < 1e-5


@pytest.mark.parametrize("case", ["qwen3_moe", "glm4_moe-plain"])
def test_streamed_into_a_model_built_on_the_meta_device(tmp_path, case):
    """A Hugging Face MoE read tensor by tensor (experts assembled from their per-expert tensors) into a model
    built without storage, as `checkpoint.init_from` does: the routers' bias is zero where the files lack it
    (Qwen3-MoE), GLM-4.5's where they hold it; a GLM-4.5's empty shared-expert weights are passed over."""
    hf = hf_model(case, seed=5)
    hf.save_pretrained(tmp_path / "hf")
    with weight_source(tmp_path / "hf") as weights:
        with torch.device("meta"):
            model = Transformer(weights.args)
        model.to_empty(device="cpu")
        model.init_buffers()
        model.layers["2"].feed_forward.router.expert_bias.fill_(1.0)  # what a run's own init might leave
        stream_into(model, weights)
    bias = model.layers["2"].feed_forward.router.expert_bias
    if case == "qwen3_moe":
        assert bias.count_nonzero() == 0
    else:
        assert torch.equal(bias, hf.model.layers[2].mlp.gate.e_score_correction_bias)
    assert max_diff(model.eval(), hf, tokens(6)) < 1e-4


def test_glm_multi_token_prediction_layers_are_passed_over(tmp_path):
    """GLM-4.5's checkpoints store their multi-token-prediction layer after the decoder's (transformers does not
    load it): import and streaming pass over it while the config announces it, and refuse it otherwise."""
    from safetensors.torch import load_file, save_file

    hf = hf_model("glm4_moe-plain", seed=2)
    hf.save_pretrained(tmp_path)
    assert hf.config.num_nextn_predict_layers == 1
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.ones(32, 64)
    tensors["model.layers.3.mlp.experts.0.gate_proj.weight"] = torch.ones(16, 32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    state_dict, args = import_hf(tmp_path)
    model = Transformer(args).eval()
    model.load_state_dict(state_dict)
    assert args.n_layers == 3 and max_diff(model, hf, tokens()) < 1e-4
    assert any("multi-token-prediction layers (model.layers.3.* on" in note for note in import_notes(tmp_path))
    with weight_source(tmp_path) as weights:
        assert weights.args == args
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 0}))
    words = re.escape("tensors liandan has no place for: model.layers.3.eh_proj")
    with pytest.raises(ValueError, match=words):
        import_hf(tmp_path)
    with pytest.raises(ValueError, match=words), weight_source(tmp_path):
        pass


def test_a_bf16_export_keeps_glm_routing_bias_in_fp32(tmp_path):
    """transformers keeps GLM-4.5's routing bias in fp32 whatever the model's dtype; a bf16 export writes it
    so, since rounding it would change which experts are chosen."""
    model = liandan_model("glm4_moe")
    export_hf(model.state_dict(), model.args, tmp_path / "hf", dtype=torch.bfloat16)
    with safetensors.safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        assert f.get_tensor("model.layers.1.mlp.gate.weight").dtype == torch.bfloat16
    assert torch.equal(bias, model.layers["1"].feed_forward.router.expert_bias)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(hf.model.layers[1].mlp.gate.e_score_correction_bias, bias)


def test_a_config_leaving_ffn_dim_at_its_default_starts_from_an_all_moe_model(tmp_path):
    """Every block of a Mixtral has experts, so the dense feed-forward width shapes no tensor: a config that
    leaves model.ffn_dim at its default starts from its weights; with a dense first block the width counts.
    A dense model's expert fields count no more."""
    hf_model("mixtral").save_pretrained(tmp_path)
    with weight_source(tmp_path) as weights:
        theirs = weights.args
    ours = ModelArgs(**{**dataclasses.asdict(theirs), "ffn_dim": 0})  # a [model] block without ffn_dim
    assert (ours.ffn_dim, theirs.ffn_dim) == (128, 40)
    assert weight_differences(ours, theirs) == []
    dense_first = dataclasses.replace(theirs, moe_dense_layers=1)
    ours = dataclasses.replace(ours, moe_dense_layers=1)
    assert weight_differences(ours, dense_first) == ["model.ffn_dim = 128 (weights: 40)"]
    dense = ModelArgs(**{**dataclasses.asdict(theirs), "moe_experts": 0, "moe_ffn_dim": 0})
    assert weight_differences(dataclasses.replace(dense, moe_dense_layers=2, moe_shared_experts=1), dense) == []


@pytest.mark.parametrize(
    "case, change, words",
    [
        ("qwen3_moe", {"decoder_sparse_step": 2, "mlp_only_layers": []}, "decoder_sparse_step 2 make layers [0, 2] dense"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers [1] with decoder_sparse_step 1 make layers [1]"),
        ("qwen3_moe", {"num_experts_per_tok": 7}, "num_experts_per_tok 7 must be between 1 and num_local_experts 6"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size is missing"),
        ("mixtral", {"num_experts_per_tok": 1}, "num_experts_per_tok 1 with renormalised weights"),
        ("mixtral", {"model_type": "olmoe"}, "model_type 'olmoe' is not supported (supported: llama, qwen2, qwen3, mistral, mixtral, qwen3_moe, glm4_moe, dots1)"),
        ("mixtral", {"num_local_experts": 8}, "block_sparse_moe.gate.weight has shape (4, 32), config.json implies (8, 32)"),
        ("qwen3_moe", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported in qwen3_moe"),
        ("glm4_moe", {"n_group": 2, "topk_group": 1}, "topk_group 1 of n_group 2: group-limited routing is not supported"),
        ("glm4_moe", {"num_experts_per_tok": 1}, "num_experts_per_tok 1 with renormalised weights"),
        ("dots1", {"n_shared_experts": None}, "required field n_shared_experts is missing"),
        ("glm4_moe", {"first_k_dense_replace": 3}, "first_k_dense_replace 3 leaves no MoE layer of num_hidden_layers 3"),
        ("dots1", {"attention_bias": True}, "attention_bias is true; liandan has no bias on the attention output"),
        ("dots1", {"layer_types": None, "max_window_layers": 2}, "layer_types ['full_attention', 'sliding_attention']"),
    ],
)  # fmt: skip
def test_import_refuses_what_liandan_cannot_express(tmp_path, case, change, words):
    hf_model(case).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(ValueError, match=re.escape(words)) as refused:
        import_hf(tmp_path / "hf")
    assert "\n" not in str(refused.value)


def test_a_checkpoint_lacking_one_expert_is_refused_by_import_and_streaming(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model("mixtral").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.1.w2.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    words = "checkpoint lacks model.layers.2.block_sparse_moe.experts.1.w2.weight"
    with pytest.raises(ValueError, match=re.escape(words)):
        import_hf(tmp_path)
    with pytest.raises(ValueError, match=re.escape(words)), weight_source(tmp_path):
        pass


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"moe_shared_experts": 1}, "model.moe_shared_experts with softmax scores"),
        ({"moe_route_scale": 2.5}, "model.moe_route_scale != 1 with softmax scores"),
        ({"moe_dense_layers": 1}, "model.moe_dense_layers: Mixtral has no dense layers"),
        ({"moe_route_norm": False}, "model.moe_route_norm = false"),
        ({"qkv_bias": True}, "model.qkv_bias with softmax-scored experts"),
        ({"moe_balance": "bias"}, "layers.0.feed_forward.router.expert_bias is not zero"),
    ],
)
def test_export_refuses_softmax_scores_with_what_only_glm_expresses(tmp_path, overrides, words):
    args = liandan_model("mixtral").args
    model = Transformer(ModelArgs(**{**args.__dict__, **overrides}))
    if overrides.get("moe_balance") == "bias":  # a trained run's bias
        model.layers["0"].feed_forward.router.expert_bias.uniform_(-0.1, 0.1)
    with pytest.raises(ValueError, match=words) as refused:
        export_hf(model.state_dict(), model.args, tmp_path / "hf")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_a_stack_is_read_by_the_slice_a_shard_holds(tmp_path):
    """The slices an expert-sharded, row-split or empty shard asks of a stack of per-expert tensors."""
    hf = hf_model("mixtral", seed=9)
    hf.save_pretrained(tmp_path)
    whole, _ = import_hf(tmp_path)
    key = "layers.1.feed_forward.experts.w3"
    with weight_source(tmp_path) as weights:
        stack = weights.located[key]
        assert stack.stacked and len(stack.parts) == 4 and stack.shape() == (4, 40, 32)
        for index in [(slice(1, 3), slice(0, 40), slice(0, 32)), (slice(0, 4), slice(10, 20), slice(0, 32))]:
            assert torch.equal(stack.read(index), whole[key][index])
        assert stack.read((slice(4, 4), slice(0, 40), slice(0, 16))).shape == (0, 40, 16)
        assert torch.equal(stack.read(None), whole[key])


@pytest.fixture(scope="module")
def two_ranks_streamed(tmp_path_factory):
    """Both ranks of the streaming worker: what each read from each source into its FSDP shards."""
    out = tmp_path_factory.mktemp("moe_stream")
    env = {**os.environ, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(STREAM_WORKER), str(out / "store"), str(out)],
                              env={**env, "RANK": str(rank)}, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("source", ["hf", "whole.safetensors"])
def test_weights_stream_into_fsdp_shards_reading_only_their_experts(two_ranks_streamed, source):
    """Two ranks, FSDP over both, three experts (two on one rank, one on the other): each rank's shards equal
    its slices of the whole model, it read no more bytes than they hold (a Hugging Face checkpoint's experts
    read one by one, only those of the rank's shard), and the routers' bias is the consolidated file's, or zero
    from a Hugging Face checkpoint, which has none."""
    experts_held = []
    for rank in two_ranks_streamed:
        streamed, expected = rank[f"{source}/streamed"], rank[f"{source}/expected"]
        assert [k for k in expected if not torch.equal(streamed[k], expected[k])] == []
        bias, expected_bias = rank[f"{source}/bias"], rank[f"{source}/expected_bias"]
        assert list(bias) == ["layers.1.feed_forward.router.expert_bias"]
        assert all(torch.equal(bias[k], expected_bias[k]) for k in bias)
        bias_bytes = 0 if source == "hf" else 4 * sum(t.numel() for t in bias.values())
        assert rank[f"{source}/read"] == 4 * sum(t.numel() for t in streamed.values()) + bias_bytes
        experts_held.append(streamed["layers.1.feed_forward.experts.w1"].shape[0])
    assert experts_held == [2, 1]
