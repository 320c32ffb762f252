"""Llama's Hugging Face adapter: parameter names, and `config.json` to and from `ModelArgs`.

A model is written as `LlamaForCausalLM`, or as `Qwen3ForCausalLM` when it uses qk-norm: Qwen3 is Llama plus a
per-head RMSNorm on queries and keys before the rotary embedding, which is exactly liandan's qk-norm. Both use
the rotate-half rotary layout, so the query and key projections move across unchanged. The file handling
(safetensors, shards, state-dict checks) is model-agnostic and lives in `liandan.checkpoint.hf`.
"""

from __future__ import annotations

import re
from pathlib import Path

from liandan.model.llama import ModelArgs

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# liandan name -> Hugging Face name, per layer ("{i}" is the layer index).
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_QK_NORM_NAMES = {
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_GLOBAL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def to_hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match:
        rest = match.group(2)
        hf = _LAYER_NAMES.get(rest) or _QK_NORM_NAMES.get(rest)
        if hf is not None:
            return f"model.layers.{match.group(1)}.{hf}"
    raise KeyError(name)


def hf_config(args: ModelArgs, dtype_name: str, eos_token_id: int | None) -> dict:
    """The `config.json` of the Hugging Face model equal to a liandan model of `args`: `LlamaForCausalLM`, or
    `Qwen3ForCausalLM` with qk-norm."""
    qwen3 = args.qk_norm
    config = {
        "architectures": [ARCHITECTURES["qwen3" if qwen3 else "llama"]],
        "model_type": "qwen3" if qwen3 else "llama",
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
        # transformers 5 reads `rope_parameters`; earlier versions read the top-level `rope_theta` and take a
        # missing `rope_scaling` as plain RoPE. Both say the same.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "attention_bias": False,
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
    if qwen3:
        config.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=args.n_layers,
            layer_types=["full_attention"] * args.n_layers,
        )
    else:
        config.update(mlp_bias=False, pretraining_tp=1)
    return config


def _rope_settings(config: dict, where: Path) -> float:
    """rope_theta of a plain-RoPE config; refuses scaled or partial rotary embeddings."""
    theta = config.get("rope_theta")
    partial = config.get("partial_rotary_factor")
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
        if rope_type != "default":
            raise ValueError(
                f"{where}: {field} has rope_type {rope_type!r}; only plain RoPE (none/'default') is supported, "
                "scaled rotary embeddings are not"
            )
        if params.get("rope_theta") is not None:
            if theta is not None and float(params["rope_theta"]) != float(theta):
                raise ValueError(
                    f"{where}: {field}.rope_theta ({params['rope_theta']}) disagrees with rope_theta ({theta})"
                )
            theta = params["rope_theta"]
        partial = params.get("partial_rotary_factor", partial)
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {partial} is not supported (rotary on all dimensions only)")
    return float(theta if theta is not None else 10000.0)


def args_from_hf_config(config: dict, where: Path | str = "config.json") -> ModelArgs:
    """The liandan `ModelArgs` equal to a Hugging Face Llama or Qwen3 config, or a ValueError naming the field
    that liandan cannot express."""

    def need(field: str):
        if config.get(field) is None:
            raise ValueError(f"{where}: required field {field} is missing")
        return config[field]

    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (supported: llama, qwen3)")
    archs = config.get("architectures")
    if archs is not None and list(archs) != [ARCHITECTURES[model_type]]:
        raise ValueError(f"{where}: architectures {archs} is not supported; expected [{ARCHITECTURES[model_type]!r}]")
    if config.get("quantization_config") is not None:
        raise ValueError(f"{where}: quantization_config is set; quantized weights are not supported")
    act = config.get("hidden_act", config.get("hidden_activation", "silu"))
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (SwiGLU with silu only)")
    for field in ("attention_bias", "mlp_bias"):
        if config.get(field):
            raise ValueError(f"{where}: {field} is true; liandan's projections have no bias")
    if model_type == "qwen3":
        if config.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window is true; sliding-window attention is not supported")
        layer_types = config.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(f"{where}: layer_types {sorted(set(layer_types))} has non-full attention layers")

    dim = int(need("hidden_size"))
    n_heads = int(need("num_attention_heads"))
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) != dim // n_heads:
        raise ValueError(
            f"{where}: head_dim {head_dim} is not hidden_size // num_attention_heads = {dim // n_heads}; "
            "liandan derives the head size from the model width"
        )
    if n_heads % n_kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}"
        )
    default_positions = 32768 if model_type == "qwen3" else 2048
    return ModelArgs(
        vocab_size=int(need("vocab_size")),
        dim=dim,
        n_layers=int(need("num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        ffn_dim=int(need("intermediate_size")),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_settings(config, Path(where)),
        max_seq_len=int(config.get("max_position_embeddings") or default_positions),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        init_std=float(config.get("initializer_range", 0.02)),
    )
