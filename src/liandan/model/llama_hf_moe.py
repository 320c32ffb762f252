"""The mixture-of-experts part of Llama's Hugging Face adapter: Mixtral, Qwen3-MoE and GLM-4.5 (Glm4Moe).

All three are liandan Llamas with routed experts (`moe_experts`) and top-k token choice; Mixtral and Qwen3-MoE
score the experts by softmax, GLM-4.5 by sigmoid:

* Mixtral: Mistral's attention, every layer's feed-forward a MoE whose chosen weights are always renormalised
  to sum to one; `intermediate_size` is each expert's hidden size.
* Qwen3-MoE: Qwen3's attention (per-head qk-norm); the chosen weights renormalised when `norm_topk_prob`;
  experts of `moe_intermediate_size`; dense layers of `intermediate_size` where `mlp_only_layers` and
  `decoder_sparse_step` say, which liandan expresses when they are the first layers (`moe_dense_layers`).
* GLM-4.5 (and dots.llm1, `Dots1ForCausalLM`, read only: Qwen3's attention with GLM-4.5's routing, written
  back as GLM-4.5 with the same logits): DeepSeek-V3's routing on grouped-query attention: sigmoid scores,
  a per-expert bias (`e_score_correction_bias`) added for the choice only, the chosen scores renormalised
  when `norm_topk_prob` and multiplied by `routed_scaling_factor`, shared experts of `n_shared_experts *
  moe_intermediate_size`, the first `first_k_dense_replace` layers dense; optional qk-norm (`use_qk_norm`)
  and query/key/value biases (`attention_bias`, none on the output projection); the rotary embedding on the
  first `partial_rotary_factor` of each head (`rope_fraction`; GLM-4.5's own checkpoints turn half). That
  is liandan's MoE with `moe_score = "sigmoid"` and its balancing bias exactly when group-limited routing
  is off (`topk_group` = `n_group`).

Hub checkpoints store one tensor per expert and projection; liandan stacks each projection's experts into
one tensor (`Stacked` names). Mixtral and Qwen3-MoE have no routing bias: liandan's (`router.expert_bias`,
auxiliary-loss-free balancing) is zero on import and must be zero to export; they balanced their routers with
a load-balancing loss (`router_aux_loss_coef`), which becomes `moe_aux_loss`, with `moe_balance = "none"`.
GLM-4.5's bias is liandan's, imported with `moe_balance = "bias"`. A model with sigmoid scores is written as
GLM-4.5, whatever its balancing; softmax scores with a bias, shared experts or scaled weights have no
transformers architecture (GLM-4.5 scores by sigmoid only).
OLMoE is not read: its query/key RMSNorm spans the whole projection, not each head as liandan's qk-norm does.
"""

from __future__ import annotations

from pathlib import Path

from liandan.model.llama import ModelArgs
from liandan.model.spec import Stacked

ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "dots1": "Dots1ForCausalLM",
}
# DeepSeek-V3's routing (sigmoid scores, a balancing bias, shared experts) on grouped-query attention
BIASED = ("glm4_moe", "dots1")
# transformers' defaults for the routing fields a config may leave out; None: required (no usable default)
_BIASED_DEFAULTS = {
    "glm4_moe": {"n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
                 "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True},
    "dots1": {"n_routed_experts": None, "num_experts_per_tok": None, "moe_intermediate_size": 1408,
              "n_shared_experts": None, "first_k_dense_replace": 0, "norm_topk_prob": False},
}  # fmt: skip

# liandan stacked projection -> its per-expert Hugging Face name, and the MoE block's name, per model type
_EXPERT_NAMES = {
    "mixtral": {"w1": "w1", "w2": "w2", "w3": "w3"},
    "qwen3_moe": {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
    "glm4_moe": {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
    "dots1": {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
}
_BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp", "glm4_moe": "mlp", "dots1": "mlp"}
_SHARED_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}  # GLM-4.5's and dots.llm1's


def routes_normalised(args: ModelArgs) -> bool:
    """Whether the chosen experts' weights sum to one: liandan renormalises only more than one expert."""
    return args.moe_route_norm and args.moe_top_k > 1


def export_type(args: ModelArgs) -> str:
    """The Hugging Face model_type a MoE model is written as: GLM-4.5 with sigmoid scores; with softmax scores
    Qwen3-MoE with qk-norm, Mixtral without; a ValueError naming the setting none of them expresses."""
    if args.moe_score == "sigmoid":
        return "glm4_moe"
    glm = '(GLM-4.5, which has them, scores by sigmoid: model.moe_score = "sigmoid")'
    if args.moe_shared_experts:
        raise ValueError(f"model.moe_shared_experts with softmax scores: Mixtral and Qwen3-MoE have none {glm}")
    if args.moe_route_scale != 1.0:
        raise ValueError(
            f"model.moe_route_scale != 1 with softmax scores: Mixtral and Qwen3-MoE do not scale the experts' "
            f"weights {glm}"
        )
    if args.qkv_bias:
        raise ValueError(f"model.qkv_bias with softmax-scored experts has no transformers architecture {glm}")
    if args.qk_norm:
        return "qwen3_moe"
    if args.moe_dense_layers:
        raise ValueError(
            "model.moe_dense_layers: Mixtral has no dense layers (with model.qk_norm the model would go out as "
            "Qwen3-MoE, which has them)"
        )
    if not routes_normalised(args):
        raise ValueError(
            "model.moe_route_norm = false (or one expert per token): Mixtral renormalises the chosen experts' "
            "weights (Qwen3-MoE, which need not, needs model.qk_norm)"
        )
    return "mixtral"


def layer_names(model_type: str, args: ModelArgs, layer: int) -> dict[str, str | Stacked | None]:
    """A MoE layer's liandan keys (after `layers.{i}.`) -> their Hugging Face names."""
    block = f"model.layers.{layer}.{_BLOCK[model_type]}"
    glm = model_type in BIASED
    names: dict[str, str | Stacked | None] = {
        "feed_forward.router.gate.weight": f"{block}.gate.weight",
        # Mixtral and Qwen3-MoE have no routing bias
        "feed_forward.router.expert_bias": f"{block}.gate.e_score_correction_bias" if glm else None,
    }
    for ours, theirs in _EXPERT_NAMES[model_type].items():
        experts = tuple(f"{block}.experts.{e}.{theirs}.weight" for e in range(args.moe_experts))
        names[f"feed_forward.experts.{ours}"] = Stacked(experts)
    if glm and args.moe_shared_experts:
        for ours, theirs in _SHARED_NAMES.items():
            names[f"feed_forward.shared_experts.{ours}.weight"] = f"{block}.shared_experts.{theirs}.weight"
    return names


def config_fields(args: ModelArgs, model_type: str) -> dict:
    """The MoE fields of the `config.json` of a model of `args`."""
    common = {
        "num_experts_per_tok": args.moe_top_k,
        "output_router_logits": False,
        "router_aux_loss_coef": args.moe_aux_loss,
    }
    if model_type == "glm4_moe":
        return {
            "num_experts_per_tok": args.moe_top_k,
            "output_router_logits": False,
            "n_routed_experts": args.moe_experts,
            "moe_intermediate_size": args.moe_ffn_dim,
            "intermediate_size": args.ffn_dim,
            "n_shared_experts": args.moe_shared_experts,
            "routed_scaling_factor": args.moe_route_scale,
            "norm_topk_prob": routes_normalised(args),
            "first_k_dense_replace": args.moe_dense_layers,
            "n_group": 1,
            "topk_group": 1,
            "use_qk_norm": args.qk_norm,
            "attention_bias": args.qkv_bias,
            "num_nextn_predict_layers": 0,  # no multi-token prediction layers
        }
    if model_type == "mixtral":
        return {
            **common,
            "num_local_experts": args.moe_experts,
            "intermediate_size": args.moe_ffn_dim,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    return {
        **common,
        "num_experts": args.moe_experts,
        "moe_intermediate_size": args.moe_ffn_dim,
        "intermediate_size": args.ffn_dim,
        "norm_topk_prob": routes_normalised(args),
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(args.moe_dense_layers)),
    }


def _dense_layers(config: dict, experts: int, n_layers: int, where: Path) -> int:
    """How many first layers of a Qwen3-MoE config are dense; a ValueError when its dense layers are not the
    first ones (transformers: a layer is dense when in `mlp_only_layers` or when (i + 1) is not a multiple of
    `decoder_sparse_step`)."""
    step = int(config.get("decoder_sparse_step") or 1)
    only = config.get("mlp_only_layers") or []
    if step < 1:
        raise ValueError(f"{where}: decoder_sparse_step {step} must be at least 1")
    dense = [i for i in range(n_layers) if i in only or not (experts > 0 and (i + 1) % step == 0)]
    if dense != list(range(len(dense))):
        raise ValueError(
            f"{where}: mlp_only_layers {list(only)} with decoder_sparse_step {step} make layers {dense} dense; "
            "liandan keeps only the first layers dense (model.moe_dense_layers)"
        )
    return len(dense)


def args_fields(config: dict, model_type: str, n_layers: int, where: Path) -> dict:
    """The ModelArgs `moe_*` fields of a Mixtral, Qwen3-MoE or GLM-4.5 config, or a ValueError naming the
    field."""
    if model_type in BIASED:
        return _biased_fields(config, model_type, n_layers, where)
    experts = config.get("num_local_experts", config.get("num_experts"))
    expert_field = "num_local_experts" if "num_local_experts" in config else "num_experts"
    if experts is None:
        raise ValueError(f"{where}: required field {expert_field} is missing")
    experts = int(experts)
    if model_type == "qwen3_moe" and experts == 0:
        return {}  # every layer dense: a Qwen3
    top_k = int(config.get("num_experts_per_tok") or (2 if model_type == "mixtral" else 8))
    if not 1 <= top_k <= experts:
        raise ValueError(f"{where}: num_experts_per_tok {top_k} must be between 1 and {expert_field} {experts}")
    if model_type == "mixtral":
        route_norm = True
        ffn = config.get("intermediate_size")
        dense = 0
    else:
        route_norm = bool(config.get("norm_topk_prob", False))
        ffn = config.get("moe_intermediate_size")
        if ffn is None:
            raise ValueError(f"{where}: required field moe_intermediate_size is missing")
        dense = _dense_layers(config, experts, n_layers, where)
    if route_norm and top_k == 1:
        # liandan weighs a lone expert by its score (its router then learns from the loss); renormalised it is 1
        raise ValueError(f"{where}: num_experts_per_tok 1 with renormalised weights is not supported")
    return {
        "moe_experts": experts,
        "moe_top_k": top_k,
        "moe_ffn_dim": int(ffn),
        "moe_dense_layers": dense,
        "moe_score": "softmax",
        "moe_route_norm": route_norm,
        "moe_balance": "none",
        "moe_aux_loss": float(config.get("router_aux_loss_coef") or 0.0),
    }


def _biased_fields(config: dict, model_type: str, n_layers: int, where: Path) -> dict:
    """The `moe_*` fields of a GLM-4.5 or dots.llm1 config; fields it lacks take transformers' defaults."""
    defaults = _BIASED_DEFAULTS[model_type]

    def field(name: str, default=None):
        value = config.get(name)
        if value is None:
            value = defaults.get(name, default)
        if value is None:
            raise ValueError(f"{where}: required field {name} is missing")
        return value

    experts = int(config.get("num_local_experts") or field("n_routed_experts"))
    top_k = int(field("num_experts_per_tok"))
    if not 1 <= top_k <= experts:
        raise ValueError(f"{where}: num_experts_per_tok {top_k} must be between 1 and n_routed_experts {experts}")
    groups, kept = int(field("n_group", 1)), int(field("topk_group", 1))
    if kept != groups:
        # With every group kept the choice is plain top-k; otherwise only experts of the best groups compete.
        raise ValueError(
            f"{where}: topk_group {kept} of n_group {groups}: group-limited routing is not supported "
            "(topk_group must equal n_group)"
        )
    dense = int(field("first_k_dense_replace"))
    if dense >= n_layers:
        raise ValueError(f"{where}: first_k_dense_replace {dense} leaves no MoE layer of num_hidden_layers {n_layers}")
    route_norm = bool(field("norm_topk_prob"))
    if route_norm and top_k == 1:
        raise ValueError(f"{where}: num_experts_per_tok 1 with renormalised weights is not supported")
    return {
        "moe_experts": experts,
        "moe_top_k": top_k,
        "moe_ffn_dim": int(field("moe_intermediate_size")),
        "moe_shared_experts": int(field("n_shared_experts")),
        "moe_dense_layers": dense,
        "moe_score": "sigmoid",
        "moe_route_norm": route_norm,
        "moe_route_scale": float(field("routed_scaling_factor", 1.0)),
        "moe_balance": "bias",
        "moe_aux_loss": 0.0,
    }


def import_notes(config: dict) -> list[str]:
    """What an import of a Mixtral, Qwen3-MoE, GLM-4.5 or dots.llm1 should say about its routing."""
    if config.get("model_type") in BIASED:
        bias = (
            "the checkpoint's routers carry DeepSeek-V3's balancing bias (e_score_correction_bias), imported as "
            'liandan\'s (moe_balance = "bias"); its update rate is not in the checkpoint: set moe_bias_rate'
        )
        extra = int(config.get("num_nextn_predict_layers") or 0) if config.get("model_type") == "glm4_moe" else 0
        first = config.get("num_hidden_layers")
        mtp = (
            f"num_nextn_predict_layers = {extra}: multi-token-prediction layers (model.layers.{first}.* on, for "
            "speculative decoding), where the checkpoint stores them, are not read"
        )
        return [bias, mtp] if extra else [bias]
    if config.get("model_type") not in ARCHITECTURES or not config.get("num_local_experts", config.get("num_experts")):
        return []
    coef = float(config.get("router_aux_loss_coef") or 0.0)
    balancing = (
        f"the checkpoint's routers have no bias and were balanced by a load-balancing loss: to go on as it was "
        f'trained, add moe_balance = "none" and moe_aux_loss = {coef} (its router_aux_loss_coef) to [model]; '
        'liandan\'s default bias balancing (moe_balance = "bias") starts from a zero bias'
    )
    notes = [balancing]
    if config.get("router_jitter_noise"):
        jitter = config["router_jitter_noise"]
        notes.append(f"router_jitter_noise = {jitter} (noise on the routers' input in training) is not reproduced")
    return notes
