"""Llama's Hugging Face adapter: parameter names, and `config.json` to and from `ModelArgs`.

Four open families are one liandan Llama with different switches, all in the rotate-half rotary layout, so
every projection moves across unchanged:

* Llama 1, 2 and 3.x: plain; Llama 3.1+ rescale RoPE (`rope_scaling` of type `llama3`), 3.2 ties embeddings.
* Qwen2 / Qwen2.5: biases on the query, key and value projections (`qkv_bias`).
* Qwen3: a per-head RMSNorm on queries and keys before the rotary embedding (`qk_norm`), often with a head
  size apart from the width (`head_dim`).
* Mistral: Llama's layers with sliding-window attention in some versions (see `_sliding_window`).
* Mixtral and Qwen3-MoE: Mistral's and Qwen3's layers with routed experts (`liandan.model.llama_hf_moe`).
* GLM-4.5 (Glm4Moe): routed experts scored by sigmoid with DeepSeek-V3's balancing bias, shared experts,
  optional qk-norm and query/key/value biases; dots.llm1 (Dots1): the same experts on Qwen3's layers, read
  and written back as GLM-4.5 (`liandan.model.llama_hf_moe`).

A model is written as `Qwen3ForCausalLM` when it uses qk-norm, `Qwen2ForCausalLM` when it has query/key/value
biases, and `LlamaForCausalLM` otherwise (an imported Mistral comes back as a Llama with the same logits); a
model with experts as `Glm4MoeForCausalLM` when they are scored by sigmoid, otherwise as `Qwen3MoeForCausalLM`
with qk-norm and `MixtralForCausalLM` without.
The file handling (safetensors, shards, state-dict checks) is model-agnostic and lives in
`liandan.checkpoint.hf`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from liandan.model import llama_hf_moe
from liandan.model.llama import ModelArgs
from liandan.model.spec import Stacked

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    **llama_hf_moe.ARCHITECTURES,
}
_WINDOWED = ("mistral", "mixtral")  # a global sliding window (`sliding_window`) whatever use_sliding_window says
_QK_NORM = ("qwen3", "qwen3_moe", "dots1")
_PARTIAL_ROTARY = ("glm4_moe",)  # transformers turns only the first partial_rotary_factor of each head

# liandan name -> Hugging Face name, per layer ("{i}" is the layer index).
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA3_SCALING = {  # liandan field -> the Hugging Face rope parameter
    "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_seq_len": "original_max_position_embeddings",
}


def to_hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise KeyError(name)


def tensor_names(args: ModelArgs, keys: list[str]) -> dict[str, str | Stacked | None]:
    """Each of `keys` (a model's state-dict keys but the tied ones) -> its Hugging Face name, the names of the
    per-expert tensors it stacks, or None where the checkpoint holds nothing (see `llama_hf_moe`)."""
    moe = {}
    if args.moe_experts:
        model_type = export_type(args)
        for i in range(args.n_layers):
            if args.is_moe_layer(i):
                moe.update({f"layers.{i}.{k}": v for k, v in llama_hf_moe.layer_names(model_type, args, i).items()})
    return {key: moe[key] if key in moe else to_hf_name(key) for key in keys}


def export_type(args: ModelArgs) -> str:
    """The Hugging Face model_type a model of `args` is written as, or a ValueError if none expresses it."""
    if args.mlp != "swiglu":
        raise ValueError(f"model.mlp = {args.mlp!r} has no transformers architecture to export to (SwiGLU only)")
    if args.logit_softcap:
        raise ValueError("model.logit_softcap has no transformers Llama, Qwen2 or Qwen3 setting to export to")
    if args.width_mult != 1.0 and args.tie_embeddings:
        # The output multiplier folds into an untied head only: the shared table is the embedding's too.
        raise ValueError(
            "model.parameterization = mup with model.tie_embeddings scales the logits by a multiplier that "
            "Hugging Face's tied head cannot hold; train with tie_embeddings = false to export"
        )
    model_type = llama_hf_moe.export_type(args) if args.moe_experts else None
    if args.rope_fraction != 1.0 and model_type not in _PARTIAL_ROTARY:
        raise ValueError(
            f"model.rope_fraction = {args.rope_fraction}: of the architectures liandan writes only GLM-4.5 (experts "
            'with moe_score = "sigmoid") has a partial rotary embedding'
        )
    if model_type:
        return model_type
    if args.qk_norm and args.qkv_bias:
        # Qwen3's attention_bias also puts a bias on the output projection, which liandan does not have.
        raise ValueError("model.qk_norm with model.qkv_bias has no transformers architecture to export to")
    return "qwen3" if args.qk_norm else "qwen2" if args.qkv_bias else "llama"


def export_weights(args: ModelArgs, tensors: dict) -> dict:
    """The tensors to write: muP's logit multiplier (1 / width_mult) folded into the head's weight (Hugging
    Face's Llama computes plain `lm_head(norm(h))`, the same logits then; unchanged under the standard one).
    A MoE router's balancing bias has no place in Mixtral or Qwen3-MoE: refused unless zero (GLM-4.5 has it)."""
    model_type = export_type(args)
    for key, tensor in tensors.items():
        if model_type != "glm4_moe" and key.endswith("router.expert_bias") and tensor.count_nonzero():
            raise ValueError(
                f'{key} is not zero (model.moe_balance = "bias"): Mixtral and Qwen3-MoE route without a bias, so '
                "the exported model would choose other experts, and GLM-4.5, which has one, scores by sigmoid; "
                'export a model trained with moe_balance = "none", or with moe_score = "sigmoid"'
            )
    mult = 1.0 / args.width_mult
    if mult == 1.0:
        return tensors
    head = tensors["output.weight"]
    return {**tensors, "output.weight": (head.double() * mult).to(head.dtype)}


def _rope_parameters(args: ModelArgs) -> dict:
    params: dict = {"rope_type": args.rope_scaling if args.rope_scaling != "none" else "default"}
    params["rope_theta"] = args.rope_theta
    if args.rope_scaling == "llama3":
        params.update({hf: getattr(args, ours) for ours, hf in _LLAMA3_SCALING.items()})
    return params


def hf_config(args: ModelArgs, dtype_name: str, eos_token_id: int | None) -> dict:
    """The `config.json` of the Hugging Face model equal to a liandan model of `args` (see `export_type`)."""
    model_type = export_type(args)
    rope = _rope_parameters(args)
    config = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        # transformers 5 reads `rope_parameters`; earlier versions read the top-level `rope_theta` and
        # `rope_scaling` (absent: plain RoPE). Both say the same.
        "rope_theta": args.rope_theta,
        "rope_parameters": rope,
        "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": args.init_std,
        "use_cache": True,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }
    if args.rope_scaling != "none":
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if model_type in llama_hf_moe.ARCHITECTURES:
        config.update(llama_hf_moe.config_fields(args, model_type))
        if model_type == "glm4_moe":  # transformers takes half a head for an absent partial_rotary_factor
            config["rope_parameters"]["partial_rotary_factor"] = args.rope_fraction
            config["partial_rotary_factor"] = args.rope_fraction
        if model_type == "qwen3_moe":
            config.update(attention_bias=False, use_sliding_window=False, sliding_window=None)
    elif model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        if model_type == "qwen3":
            config["attention_bias"] = False
        config.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=args.n_layers,
            layer_types=["full_attention"] * args.n_layers,
        )
    return config


def _rope_settings(config: dict, where: Path) -> dict:
    """The ModelArgs rotary fields of a config: plain RoPE or Llama 3's rescaling, over the whole head or, in
    GLM-4.5, its first `partial_rotary_factor` (half when absent, as transformers reads it); refuses other
    scalings and partial rotary embeddings elsewhere, naming the field."""
    theta = config.get("rope_theta")
    partial = config.get("partial_rotary_factor")
    if partial is None and config.get("model_type") == "glm4_moe":
        partial = 0.5
    settings: dict = {"rope_scaling": "none"}
    for field in ("rope_parameters", "rope_scaling"):
        params = config.get(field)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"{where}: {field} must be an object or null, got {params!r}")  # noqa: TRY004 (a config error)
        if params and all(isinstance(v, dict) for v in params.values()):
            # One entry per attention layer type; usable only if they are all the same.
            values = list(params.values())
            if any(v != values[0] for v in values):
                raise ValueError(f"{where}: {field} differs between layer types, which liandan cannot express")
            params = values[0]
        rope_type = params.get("rope_type", params.get("type")) or "default"
        if rope_type == "llama3":
            for ours, hf in _LLAMA3_SCALING.items():
                if params.get(hf) is None:
                    raise ValueError(f"{where}: {field} of rope_type 'llama3' lacks {hf}")
                settings[ours] = type(getattr(ModelArgs, ours))(params[hf])
            if settings["rope_high_freq_factor"] <= settings["rope_low_freq_factor"]:
                raise ValueError(f"{where}: {field}.high_freq_factor must exceed low_freq_factor")
            settings["rope_scaling"] = "llama3"
        elif rope_type != "default":
            raise ValueError(
                f"{where}: {field} has rope_type {rope_type!r}; supported: plain RoPE (none/'default') and 'llama3'"
            )
        if params.get("rope_theta") is not None:
            if theta is not None and float(params["rope_theta"]) != float(theta):
                raise ValueError(
                    f"{where}: {field}.rope_theta ({params['rope_theta']}) disagrees with rope_theta ({theta})"
                )
            theta = params["rope_theta"]
        partial = params.get("partial_rotary_factor", partial)
    if partial is not None and float(partial) != 1.0:
        if config.get("model_type") not in _PARTIAL_ROTARY:
            raise ValueError(
                f"{where}: partial_rotary_factor {partial} is not supported in {config.get('model_type')} "
                "(rotary on all dimensions only)"
            )
        settings["rope_fraction"] = float(partial)
    settings["rope_theta"] = float(theta if theta is not None else 10000.0)
    return settings


def _sliding_window(config: dict, model_type: str, positions: int, n_layers: int, where: Path) -> int:
    """The longest sequence liandan's full causal attention computes exactly as the config's attention does.

    Mistral 7B v0.1 attends over a sliding window of 4096 positions; v0.2 and later have none. On sequences no
    longer than the window the two attentions are the same, so such a model is imported with `max_seq_len`
    set to the window (training at longer sequences is refused by `train.seq_len <= model.max_seq_len`).
    Mixtral's window is Mistral's. Qwen2/Qwen3's optional per-layer windows (`use_sliding_window`) are
    refused."""
    if model_type in _WINDOWED:
        window = config.get("sliding_window")
        return min(positions, int(window)) if window else positions
    if config.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window is true; sliding-window attention is not supported")
    layer_types = config.get("layer_types") or []
    if model_type == "dots1" and not layer_types and config.get("sliding_window") is not None:
        # transformers' Dots1Config: layers from max_window_layers on attend over the sliding window
        first = int(config.get("max_window_layers", 62))
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(int(n_layers))]
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{where}: layer_types {sorted(set(layer_types))} has non-full attention layers")
    return positions


def skipped_tensor(config: dict, name: str) -> bool:
    """Whether `name` is in one of GLM-4.5's multi-token-prediction layers, stored after the decoder's
    (`num_nextn_predict_layers` of them): speculative decoding's, which transformers does not load either."""
    extra = int(config.get("num_nextn_predict_layers") or 0)
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if config.get("model_type") != "glm4_moe" or not extra or not match:
        return False
    decoder = int(config.get("num_hidden_layers") or 0)
    return decoder <= int(match.group(1)) < decoder + extra


def import_notes(config: dict) -> list[str]:
    """What a user should know about an import beyond the `[model]` block: lines for the import to print."""
    window, positions = config.get("sliding_window"), config.get("max_position_embeddings")
    notes = llama_hf_moe.import_notes(config)
    if config.get("model_type") in _WINDOWED and window and (not positions or int(window) < int(positions)):
        why = "full causal attention equals the model's sliding-window attention; longer sequences are refused"
        notes.insert(0, f"sliding_window = {window}: max_seq_len is set to the window, within which {why}")
    return notes


def args_from_hf_config(config: dict, where: Path | str = "config.json") -> ModelArgs:
    """The liandan `ModelArgs` equal to a Hugging Face Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE, GLM-4.5
    or dots.llm1 config, or a ValueError naming the field that liandan cannot express."""

    def need(field: str):
        if config.get(field) is None:
            raise ValueError(f"{where}: required field {field} is missing")
        return config[field]

    def whole(field: str, default: int | None = None) -> int:
        """A positive whole number (JSON's, not a string or 64.5), or `default` when absent or null."""
        value = config.get(field)
        if value is None and default is not None:
            return default
        value = need(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {field} = {value!r} must be a positive whole number")
        return value

    def positive(field: str, default: float) -> float:
        value = config.get(field, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{where}: {field} = {value!r} must be a positive number")
        return float(value)

    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    archs = config.get("architectures")
    if archs is not None and list(archs) != [ARCHITECTURES[model_type]]:
        raise ValueError(f"{where}: architectures {archs} is not supported; expected [{ARCHITECTURES[model_type]!r}]")
    if config.get("quantization_config") is not None:
        raise ValueError(f"{where}: quantization_config is set; quantized weights are not supported")
    act = config.get("hidden_act", config.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (SwiGLU with silu only)")
    glm = model_type == "glm4_moe"  # its attention_bias is on the query, key and value projections only
    if config.get("attention_bias") and not glm:  # Qwen2 has no such field: its q/k/v biases are fixed
        raise ValueError(f"{where}: attention_bias is true; liandan has no bias on the attention output projection")
    if config.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias is true; liandan's feed-forward projections have no bias")

    dim = whole("hidden_size")
    n_heads = whole("num_attention_heads")
    n_kv_heads = whole("num_key_value_heads", n_heads)
    head_dim = whole("head_dim", max(1, dim // n_heads))
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim {head_dim} is odd; rotary embeddings need an even head size")
    if n_heads % n_kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}"
        )
    default_positions = 2048 if model_type == "llama" else 32768
    positions = whole("max_position_embeddings", default_positions)
    n_layers = whole("num_hidden_layers")
    ffn_dim = whole("intermediate_size")
    moe = (
        llama_hf_moe.args_fields(config, model_type, n_layers, Path(where))
        if model_type in llama_hf_moe.ARCHITECTURES
        else {}
    )
    return ModelArgs(
        vocab_size=whole("vocab_size"),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        norm_eps=positive("rms_norm_eps", 1e-6),
        **_rope_settings(config, Path(where)),
        max_seq_len=_sliding_window(config, model_type, positions, n_layers, Path(where)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=model_type in _QK_NORM or (glm and bool(config.get("use_qk_norm"))),
        qkv_bias=model_type == "qwen2" or (glm and bool(config.get("attention_bias"))),
        init_std=positive("initializer_range", 0.02),
        **moe,
    )
