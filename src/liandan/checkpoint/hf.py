"""Model weights in and out of the Hugging Face format, and a single-file consolidated checkpoint.

All functions work on plain, full (unsharded) state dicts in liandan's parameter naming, the keys of
`Transformer.state_dict()`. Tensors are read and written with `safetensors` only; nothing here unpickles.

* `export_hf` writes a directory that `transformers` loads as `LlamaForCausalLM` (or `Qwen3ForCausalLM` when
  the model uses qk-norm: Qwen3 is Llama plus a per-head RMSNorm on queries and keys before the rotary
  embedding, which is exactly liandan's qk-norm), optionally with the tokenizer.
* `import_hf` reads such a directory (one safetensors file or a sharded one with an index) back into liandan
  naming, and refuses configurations the liandan model cannot express.
* `save_consolidated` / `load_consolidated` keep a model in liandan naming in one `.safetensors` file with the
  `ModelArgs` in its metadata.

Both models use the rotate-half rotary layout, so the query and key projections move across unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import torch

from liandan.model.llama import ModelArgs

ARGS_METADATA_KEY = "liandan_model_args"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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

# Module wrappers that insert a path component into parameter names (activation checkpointing, torch.compile,
# DataParallel/DDP); a state dict taken from a wrapped model is accepted with these removed.
_WRAPPER_PARTS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|module)(?=\.)")


# ----------------------------------------------------------------------------------------------------------
# naming and validation


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every key of `Transformer(args).state_dict()`, in its order, and its shape (tied models list
    `output.weight` too)."""
    hd = args.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes[p + "attention_norm.weight"] = (args.dim,)
        shapes[p + "attention.wq.weight"] = (args.n_heads * hd, args.dim)
        shapes[p + "attention.wk.weight"] = (args.n_kv_heads * hd, args.dim)
        shapes[p + "attention.wv.weight"] = (args.n_kv_heads * hd, args.dim)
        shapes[p + "attention.wo.weight"] = (args.dim, args.n_heads * hd)
        if args.qk_norm:
            shapes[p + "attention.q_norm.weight"] = (hd,)
            shapes[p + "attention.k_norm.weight"] = (hd,)
        shapes[p + "ffn_norm.weight"] = (args.dim,)
        shapes[p + "feed_forward.w1.weight"] = (args.ffn_dim, args.dim)
        shapes[p + "feed_forward.w3.weight"] = (args.ffn_dim, args.dim)
        shapes[p + "feed_forward.w2.weight"] = (args.dim, args.ffn_dim)
    shapes["norm.weight"] = (args.dim,)
    shapes["output.weight"] = (args.vocab_size, args.dim)
    return shapes


def _liandan_to_hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match:
        rest = match.group(2)
        hf = _LAYER_NAMES.get(rest) or _QK_NORM_NAMES.get(rest)
        if hf is not None:
            return f"model.layers.{match.group(1)}.{hf}"
    raise KeyError(name)


def _hf_to_liandan_names(args: ModelArgs) -> dict[str, str]:
    """Hugging Face name -> liandan name for every tensor a checkpoint of `args` stores."""
    names = {}
    for key in expected_shapes(args):
        if key == "output.weight" and args.tie_embeddings:
            continue
        names[_liandan_to_hf_name(key)] = key
    return names


def _plain_state_dict(state_dict: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """Wrapper path components removed; refuses sharded tensors and non-tensors."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{what}: entry {key!r} is a {type(value).__name__}, not a tensor")
        if hasattr(value, "full_tensor") or hasattr(value, "_local_tensor"):
            raise ValueError(
                f"{what}: {key!r} is a sharded DTensor; gather a full state dict first "
                "(e.g. torch.distributed.checkpoint.state_dict.get_model_state_dict with full_state_dict=True)"
            )
        name = _WRAPPER_PARTS.sub("", key).lstrip(".")
        if name in out:
            raise ValueError(f"{what}: {key!r} and another entry both map to {name!r}")
        out[name] = value
    return out


def _check_state_dict(state_dict: dict[str, torch.Tensor], args: ModelArgs, what: str) -> dict[str, torch.Tensor]:
    """The tensors to store: every expected key with the expected shape; for tied models `output.weight` may be
    absent, and if present must equal `tok_embeddings.weight`. Returns the state dict without `output.weight`
    when tied."""
    state_dict = _plain_state_dict(state_dict, what)
    shapes = expected_shapes(args)
    optional = {"output.weight"} if args.tie_embeddings else set()
    missing = sorted(set(shapes) - set(state_dict) - optional)
    unexpected = sorted(set(state_dict) - set(shapes))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {_preview(missing)}")
        if unexpected:
            parts.append(f"unexpected {_preview(unexpected)}")
        raise ValueError(f"{what} does not match the model arguments: " + "; ".join(parts))
    for key, tensor in state_dict.items():
        if tuple(tensor.shape) != shapes[key]:
            raise ValueError(f"{what}: {key} has shape {tuple(tensor.shape)}, the model arguments give {shapes[key]}")
        if not tensor.is_floating_point():
            raise ValueError(f"{what}: {key} has dtype {tensor.dtype}, expected a floating-point tensor")
    if args.tie_embeddings and "output.weight" in state_dict:
        out, emb = state_dict["output.weight"], state_dict["tok_embeddings.weight"]
        if not _same_storage(out, emb) and not torch.equal(out, emb.to(out.dtype)):
            raise ValueError(f"{what}: tie_embeddings is set but output.weight differs from tok_embeddings.weight")
    if args.tie_embeddings:
        state_dict = {k: v for k, v in state_dict.items() if k != "output.weight"}
    return state_dict


def _preview(keys: list[str], n: int = 6) -> str:
    shown = ", ".join(keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _prepare_for_save(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Detached, on the CPU, contiguous, cast to `dtype` if given, and never two sharing one storage (safetensors
    refuses shared storage)."""
    out = {}
    seen: set[int] = set()
    for key, tensor in tensors.items():
        t = tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out[key] = t
    return out


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Written next to `path` and renamed into place, so an interrupted save never leaves a truncated file."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"dtype must be one of torch.float32, torch.bfloat16, torch.float16, not {dtype}")


# ----------------------------------------------------------------------------------------------------------
# export


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32, eos_token_id: int | None = None) -> dict:
    """The `config.json` of the Hugging Face model equal to a liandan model of `args`: `LlamaForCausalLM`, or
    `Qwen3ForCausalLM` with qk-norm."""
    dtype_name = _dtype_name(dtype)
    qwen3 = args.qk_norm
    config = {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
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


def export_hf(
    state_dict: dict[str, torch.Tensor],
    args: ModelArgs,
    out_dir: Path,
    tokenizer_json: Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write `model.safetensors` and `config.json` (and, given `tokenizer_json`, the tokenizer files) to
    `out_dir` so that `transformers` loads them with `from_pretrained(out_dir)`. Returns `out_dir`.

    A model with qk-norm is written as `Qwen3ForCausalLM`, which has the same per-head query/key RMSNorm
    before the rotary embedding; otherwise as `LlamaForCausalLM`. With tied embeddings only
    `model.embed_tokens.weight` is stored and the config says `tie_word_embeddings: true`. The tokenizer's
    end-of-document token (`<|endoftext|>` for tokenizers liandan trains) becomes both the end-of-sequence and
    the beginning-of-sequence token: liandan separates documents with it, as GPT-2 does."""
    out_dir = Path(out_dir)
    _dtype_name(dtype)
    tensors = _check_state_dict(state_dict, args, "state dict")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"export directory {out_dir} exists and is not a directory")
    stale = [p.name for p in (out_dir / "model.safetensors.index.json", out_dir / "pytorch_model.bin") if p.exists()]
    if stale:
        raise ValueError(
            f"export directory {out_dir} already holds {', '.join(stale)}, which transformers could load instead "
            "of the exported weights; export to an empty directory"
        )

    eos_token, eos_id = None, None
    if tokenizer_json is not None:
        tokenizer_json = Path(tokenizer_json)
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tokenizer_json}")
        eos_token, eos_id, tok_vocab = _tokenizer_eos(tokenizer_json)
        if tok_vocab > args.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer_json} has {tok_vocab} tokens but the model's vocab_size is {args.vocab_size}"
            )

    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tensors = {_liandan_to_hf_name(k): v for k, v in tensors.items()}
    _save_safetensors(_prepare_for_save(hf_tensors, dtype), out_dir / "model.safetensors", {"format": "pt"})
    _write_json(out_dir / "config.json", hf_config(args, dtype, eos_id))
    if tokenizer_json is not None:
        _write_tokenizer(tokenizer_json, out_dir, eos_token, args.max_seq_len)
    return out_dir


def _tokenizer_eos(path: Path) -> tuple[str, int, int]:
    """(end-of-document token, its id, vocabulary size) of a tokenizer.json, found by the same rule the
    trainer uses (`liandan.data.tokenizer.HFTokenizer`)."""
    from tokenizers import Tokenizer

    from liandan.data.tokenizer import HFTokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises plain Exception for malformed files
        raise ValueError(f"cannot read tokenizer {path}: {err}") from None
    try:
        eos_id = HFTokenizer(tok).eos_id
    except ValueError as err:
        raise ValueError(f"tokenizer {path}: {err}") from None
    return tok.id_to_token(eos_id), eos_id, tok.get_vocab_size()


def _write_tokenizer(tokenizer_json: Path, out_dir: Path, eos_token: str, max_len: int) -> None:
    target = out_dir / "tokenizer.json"
    if tokenizer_json.resolve() != target.resolve():
        shutil.copyfile(tokenizer_json, target)
    special = {"bos_token": eos_token, "eos_token": eos_token}
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "model_max_length": max_len,
            # The tokenizer.json adds no special tokens and decodes byte-exactly; keep both that way.
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        },
    )
    _write_json(out_dir / "special_tokens_map.json", special)


# ----------------------------------------------------------------------------------------------------------
# import

_SUPPORTED = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config.json not found in {model_dir}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
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
            raise ValueError(f"{where}: {field} must be an object or null, got {params!r}")
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
    if model_type not in _SUPPORTED:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported (supported: llama, qwen3)")
    archs = config.get("architectures")
    if archs is not None and list(archs) != [_SUPPORTED[model_type]]:
        raise ValueError(f"{where}: architectures {archs} is not supported; expected [{_SUPPORTED[model_type]!r}]")
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


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in the order transformers would pick them."""
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index} is not a safetensors index (needs a 'weight_map'): {err}") from None
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f} named in {index} not found")
        return files
    pickled = sorted(p.name for p in model_dir.glob("pytorch_model*.bin"))
    if pickled:
        raise ValueError(
            f"{model_dir} holds only pickled weights ({', '.join(pickled)}); they are not loaded, for safety. "
            "Re-save them as safetensors (save_pretrained(..., safe_serialization=True))"
        )
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def import_hf(model_dir: Path) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """Read a Hugging Face Llama (or Qwen3) checkpoint directory: `config.json` and one or more `.safetensors`
    files. Returns a state dict in liandan naming, in the stored dtype, that `Transformer(args)` loads with
    `load_state_dict`, and the `ModelArgs`. For tied embeddings `output.weight` is the same tensor as
    `tok_embeddings.weight`."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    args = args_from_hf_config(_read_config(model_dir), model_dir / "config.json")
    names = _hf_to_liandan_names(args)
    shapes = expected_shapes(args)

    state_dict: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for path in _weight_files(model_dir):
        try:
            tensors = load_file(str(path))
        except Exception as err:  # safetensors raises its own error types for malformed files
            raise ValueError(f"cannot read {path}: {err}") from None
        for hf_name, tensor in tensors.items():
            if hf_name in names:
                key = names[hf_name]
                if key in state_dict:
                    raise ValueError(f"{path}: {hf_name} is stored more than once")
                if tuple(tensor.shape) != shapes[key]:
                    raise ValueError(
                        f"{path}: {hf_name} has shape {tuple(tensor.shape)}, config.json implies {shapes[key]}"
                    )
                state_dict[key] = tensor
            elif hf_name == "lm_head.weight" and args.tie_embeddings:
                continue  # tied: transformers uses the embedding matrix and ignores a stored head
            elif hf_name.endswith("rotary_emb.inv_freq"):
                continue  # a buffer some older checkpoints store; recomputed from rope_theta
            else:
                unexpected.append(hf_name)
    if unexpected:
        raise ValueError(f"{model_dir}: tensors liandan has no place for: {_preview(sorted(unexpected))}")
    missing = sorted(hf for hf, key in names.items() if key not in state_dict)
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {_preview(missing)}")
    if args.tie_embeddings:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    return {k: state_dict[k] for k in shapes}, args


# ----------------------------------------------------------------------------------------------------------
# consolidated single-file checkpoint


def _args_to_json(args: ModelArgs) -> str:
    return json.dumps(dataclasses.asdict(args), sort_keys=True)


def _args_from_json(text: str, where: Path) -> ModelArgs:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: metadata {ARGS_METADATA_KEY} is not valid JSON: {err}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: metadata {ARGS_METADATA_KEY} is not a JSON object")
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{where}: metadata {ARGS_METADATA_KEY} has unknown model fields {unknown}")
    return ModelArgs(**fields)


def save_consolidated(state_dict: dict[str, torch.Tensor], args: ModelArgs, path: Path) -> None:
    """Write the model to one `.safetensors` file in liandan naming, with `args` as JSON in the file's metadata
    under `liandan_model_args`. Tensors keep their dtype; tied embeddings are stored once."""
    path = Path(path)
    tensors = _check_state_dict(state_dict, args, "state dict")
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", ARGS_METADATA_KEY: _args_to_json(args)}
    _save_safetensors(_prepare_for_save(tensors, None), path, metadata)


def load_consolidated(path: Path) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """Read a file written by `save_consolidated`: (state dict, ModelArgs). For tied embeddings `output.weight`
    is the same tensor as `tok_embeddings.weight`."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if ARGS_METADATA_KEY not in metadata:
                raise ValueError(f"{path}: no {ARGS_METADATA_KEY} in the safetensors metadata")
            args = _args_from_json(metadata[ARGS_METADATA_KEY], path)
            state_dict = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except ValueError:
        raise
    except Exception as err:  # safetensors raises its own error types for malformed files
        raise ValueError(f"cannot read {path}: {err}") from None
    state_dict = _check_state_dict(state_dict, args, str(path))
    if args.tie_embeddings:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    return {k: state_dict[k] for k in expected_shapes(args)}, args
