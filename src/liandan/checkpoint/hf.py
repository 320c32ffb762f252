"""Model weights in and out of the Hugging Face format, and a single-file consolidated checkpoint.

All functions work on plain, full (unsharded) state dicts in liandan's parameter naming, the keys of the
model's `state_dict()`. Tensors are read and written with `safetensors` only; nothing here unpickles. What
is particular to a model family (its state-dict shapes, tied weights, Hugging Face names, config and
architectures) comes from its spec's `hf` adapter (`liandan.model.spec`); for Llama see
`liandan.model.llama_hf`.

* `export_hf` writes a directory that `transformers` loads (Llama: `LlamaForCausalLM`, `Qwen2ForCausalLM` with
  query/key/value biases, `Qwen3ForCausalLM` with qk-norm; with experts `MixtralForCausalLM` or
  `Qwen3MoeForCausalLM`), optionally with the tokenizer, and for a model fine-tuned on chats its chat
  template and the tokens that end a turn (`HFChat`).
* `import_hf` reads such a directory (one safetensors file or a sharded one with an index) back into liandan
  naming, choosing the family by the config's `model_type` (Llama's adapter reads llama, qwen2, qwen3,
  mistral, mixtral and qwen3_moe), and refuses configurations the family cannot express, naming the field.

Names map one to one, except where the adapter's `tensor_names` says otherwise: a MoE layer's experts, one
stacked tensor in liandan and one tensor per expert on the Hub (`Stacked`), and a router's balancing bias,
which the Hub's MoE models do not have (zero on import; export refuses any other value).
* `save_consolidated` / `load_consolidated` keep a model in liandan naming in one `.safetensors` file with its
  family and args in its metadata.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from liandan.checkpoint.hf_tokenizer import HFChat, tokenizer_eos, turn_end_ids, write_tokenizer
from liandan.model.spec import HFAdapter, ModelSpec, Stacked, spec_for, specs
from liandan.model.spec import get as get_model_spec
from liandan.run import atomic_write, replacing, umask_mode

ARGS_METADATA_KEY = "liandan_model_args"
FAMILY_METADATA_KEY = "liandan_model_family"  # absent in files written before families: llama

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Module wrappers that insert a path component into parameter names (activation checkpointing, torch.compile,
# DataParallel/DDP); a state dict taken from a wrapped model is accepted with these removed.
_WRAPPER_PARTS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|module)(?=\.)")


# ----------------------------------------------------------------------------------------------------------
# naming and validation


def expected_shapes(args: Any) -> dict[str, tuple[int, ...]]:
    """Every key of the model's `state_dict()`, in its order, and its shape (tied keys listed too)."""
    return spec_for(args).state_shapes(args)


def _adapter(spec: ModelSpec) -> HFAdapter:
    if spec.hf is None:
        raise ValueError(f"model family {spec.name!r} has no Hugging Face adapter")
    return spec.hf


def hf_tensor_names(args: Any) -> dict[str, str | Stacked | None]:
    """Where each stored (untied) key of a model of `args` is in a Hugging Face checkpoint: one tensor's name,
    the names of the tensors stacked to make it (`Stacked`: a MoE layer's experts, one per expert on the
    Hub), or None when the checkpoint holds nothing for it (a buffer that is then zero)."""
    spec = spec_for(args)
    adapter, tied = _adapter(spec), spec.tied(args)
    if adapter.tensor_names is not None:
        return adapter.tensor_names(args)
    return {key: adapter.to_hf_name(key) for key in spec.state_shapes(args) if key not in tied}


def _hf_to_liandan_names(args: Any) -> dict[str, tuple[str, int | None]]:
    """Hugging Face name -> (liandan name, the index of its slice when stacked, else None) for every tensor a
    checkpoint of `args` stores."""
    out: dict[str, tuple[str, int | None]] = {}
    for key, where in hf_tensor_names(args).items():
        if isinstance(where, Stacked):
            out.update({name: (key, i) for i, name in enumerate(where.names)})
        elif where is not None:
            out[where] = (key, None)
    return out


def unstored_keys(args: Any) -> list[str]:
    """The keys of a model of `args` that a Hugging Face checkpoint holds nothing for: zero on import."""
    return [key for key, where in hf_tensor_names(args).items() if where is None]


def to_hf_tensors(args: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict without tied keys in Hugging Face naming: stacked tensors split into their slices (views),
    keys HF stores nothing for left out after checking that they are zero."""
    names = hf_tensor_names(args)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        where = names[key]
        if isinstance(where, Stacked):
            out.update(zip(where.names, tensor.unbind(0), strict=True))
        elif where is not None:
            out[where] = tensor
        elif torch.count_nonzero(tensor):
            raise ValueError(f"{key} is not zero and a Hugging Face checkpoint has no place for it")
    return out


def _plain_state_dict(state_dict: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """Wrapper path components removed; refuses sharded tensors and non-tensors."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{what}: entry {key!r} is a {type(value).__name__}, not a tensor")  # noqa: TRY004
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


def _check_state_dict(state_dict: dict[str, torch.Tensor], args: Any, what: str) -> dict[str, torch.Tensor]:
    """The tensors to store: every expected key with the expected shape; a tied key (Llama's `output.weight`
    with tied embeddings) may be absent, and if present must equal the tensor it is tied to. Returns the state
    dict without the tied keys."""
    state_dict = _plain_state_dict(state_dict, what)
    spec = spec_for(args)
    shapes, tied = spec.state_shapes(args), spec.tied(args)
    optional = set(tied)
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
    for key, source in tied.items():
        if key in state_dict:
            out, emb = state_dict[key], state_dict[source]
            if not _same_storage(out, emb) and not torch.equal(out, emb.to(out.dtype)):
                raise ValueError(f"{what}: {spec.tie_setting or 'tying'} is set but {key} differs from {source}")
    return {k: v for k, v in state_dict.items() if k not in tied}


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


def _prepare_for_save(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype | None, fp32_suffixes: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Detached, on the CPU, contiguous, cast to `dtype` if given (to fp32 for names ending in one of
    `fp32_suffixes`), and never two sharing one storage (safetensors refuses shared storage)."""
    out = {}
    seen: set[int] = set()
    for key, tensor in tensors.items():
        cast = torch.float32 if fp32_suffixes and key.endswith(fp32_suffixes) else dtype or tensor.dtype
        t = tensor.detach().to(device="cpu", dtype=cast).contiguous()
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

    with replacing(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, umask_mode())  # safetensors makes it 0600: readable as the config and tokenizer beside it


def _write_json(path: Path, obj: dict) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"dtype must be one of torch.float32, torch.bfloat16, torch.float16, not {dtype}")


# ----------------------------------------------------------------------------------------------------------
# export


def hf_config(args: Any, dtype: torch.dtype = torch.float32, eos_token_id: int | None = None) -> dict:
    """The `config.json` of the Hugging Face model equal to a liandan model of `args`, by its family's adapter
    (Llama: `LlamaForCausalLM`, or `Qwen3ForCausalLM` with qk-norm)."""
    return _adapter(spec_for(args)).config(args, _dtype_name(dtype), eos_token_id)


def export_hf(
    state_dict: dict[str, torch.Tensor],
    args: Any,
    out_dir: Path,
    tokenizer_json: Path | None = None,
    dtype: torch.dtype = torch.float32,
    chat: HFChat | None = None,
) -> Path:
    """Write `model.safetensors` and `config.json` (and, given `tokenizer_json`, the tokenizer files) to
    `out_dir` so that `transformers` loads them with `from_pretrained(out_dir)`. Returns `out_dir`.

    A model with qk-norm is written as `Qwen3ForCausalLM`, which has the same per-head query/key RMSNorm
    before the rotary embedding; otherwise as `LlamaForCausalLM`. With tied embeddings only
    `model.embed_tokens.weight` is stored and the config says `tie_word_embeddings: true`. The tokenizer's
    end-of-document token (`<|endoftext|>` for tokenizers liandan trains) becomes both the end-of-sequence and
    the beginning-of-sequence token: liandan separates documents with it, as GPT-2 does. Multipliers the
    Hugging Face architecture lacks (muP's on the logits) are folded into the weights by the family's adapter.

    With `chat` (and the tokenizer, which it needs), tokenizer_config.json carries the chat template and
    the model stops generating at the end of a turn: the end-of-sequence ids of config.json and of a
    generation_config.json are the turn's end tokens followed by the end-of-document token, as Qwen2's chat
    models have them. For ChatML the tokenizer's `eos_token` is then `<|im_end|>`, its `pad_token` the
    end-of-document token and its markers `additional_special_tokens`; a model's own template comes with that
    model's tokenizer_config.json, kept as it is."""
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

    eos_token, eos_id, stop_ids = None, None, []
    if chat is not None and tokenizer_json is None:
        raise ValueError("a chat template is exported with its tokenizer: the tokenizer.json was not found")
    if tokenizer_json is not None:
        tokenizer_json = Path(tokenizer_json)
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tokenizer_json}")
        eos_token, eos_id, tok_vocab = tokenizer_eos(tokenizer_json)
        if tok_vocab > args.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer_json} has {tok_vocab} tokens but the model's vocab_size is {args.vocab_size}"
            )
        if chat is not None:
            stop_ids = turn_end_ids(tokenizer_json, chat, eos_id)

    out_dir.mkdir(parents=True, exist_ok=True)
    adapter = _adapter(spec_for(args))
    hf_tensors = to_hf_tensors(args, adapter.export_weights(args, tensors))
    hf_tensors = _prepare_for_save(hf_tensors, dtype, adapter.fp32_suffixes)
    _save_safetensors(hf_tensors, out_dir / "model.safetensors", {"format": "pt"})
    config = hf_config(args, dtype, eos_id)
    if stop_ids:
        config["eos_token_id"] = stop_ids
        generation = {"bos_token_id": eos_id, "eos_token_id": stop_ids, "pad_token_id": eos_id}
        _write_json(out_dir / "generation_config.json", generation)
    _write_json(out_dir / "config.json", config)
    if tokenizer_json is not None:
        write_tokenizer(tokenizer_json, out_dir, eos_token, args.max_seq_len, chat)
    return out_dir


# ----------------------------------------------------------------------------------------------------------
# import


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config.json not found in {model_dir}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")  # noqa: TRY004 - a malformed file: a user error
    return config


def args_from_hf_config(config: dict, where: Path | str = "config.json") -> Any:
    """The args of the family whose adapter reads the config's `model_type` (Llama: llama and qwen3), or a
    ValueError naming the field that liandan cannot express."""
    model_type = config.get("model_type")
    supported = []
    for spec in specs():
        if spec.hf is not None:
            if model_type in spec.hf.architectures:
                return spec.hf.args_from_config(config, str(where))
            supported += spec.hf.architectures
    raise ValueError(f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(supported)})")


def import_notes(model_dir: Path) -> list[str]:
    """Lines an import of `model_dir` should print beyond the model's args (e.g. how a Mistral's sliding window
    was taken), by the family's adapter."""
    config = _read_config(Path(model_dir))
    return _adapter(spec_for(args_from_hf_config(config))).notes(config)


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


def import_hf(model_dir: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """Read a Hugging Face checkpoint directory of a supported architecture (Llama, Qwen2, Qwen3, Mistral,
    Mixtral, Qwen3-MoE, GLM-4.5): `config.json` and one or more `.safetensors` files. Returns a state dict in
    liandan naming, in the stored dtype, that the family's model (`Transformer(args)` for Llama) loads with
    `load_state_dict`, and the args. Tied keys (Llama's `output.weight` with tied embeddings) are the same
    tensor as the one they are tied to; tensors stored one per expert are stacked; keys the checkpoint holds
    nothing for (a MoE router's balancing bias) are zeros."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    if model_dir.exists() and not model_dir.is_dir():
        raise ValueError(f"{model_dir} is a file: name the directory that holds config.json and the weights")
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    config = _read_config(model_dir)
    args = args_from_hf_config(config, model_dir / "config.json")
    spec = spec_for(args)
    adapter, tied = _adapter(spec), spec.tied(args)
    names = _hf_to_liandan_names(args)
    shapes = spec.state_shapes(args)
    tied_hf = {adapter.to_hf_name(key) for key in tied}

    state_dict: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}  # stacked keys: their slices as read
    unexpected: list[str] = []
    for path in _weight_files(model_dir):
        try:
            tensors = load_file(str(path))
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for malformed files
            raise ValueError(f"cannot read {path}: {err}") from None
        for hf_name, tensor in tensors.items():
            if hf_name in names:
                key, index = names[hf_name]
                if key in state_dict or index in parts.get(key, {}):
                    raise ValueError(f"{path}: {hf_name} is stored more than once")
                shape = shapes[key] if index is None else shapes[key][1:]
                if tuple(tensor.shape) != shape:
                    raise ValueError(f"{path}: {hf_name} has shape {tuple(tensor.shape)}, config.json implies {shape}")
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    bad = int((~torch.isfinite(tensor)).sum())
                    # a model with a NaN weight gives NaN logits everywhere: found here, not at the first step
                    raise ValueError(f"{path}: {hf_name} holds {bad} NaN or infinite value(s) of {tensor.numel()}")
                if index is None:
                    state_dict[key] = tensor
                else:
                    parts.setdefault(key, {})[index] = tensor
            elif hf_name in tied_hf:
                continue  # tied: transformers uses the tensor it is tied to and ignores a stored copy
            elif adapter.ignored_suffixes and hf_name.endswith(adapter.ignored_suffixes):
                continue  # a buffer some checkpoints store, recomputed from the config
            elif adapter.skipped(config, hf_name):
                continue  # layers transformers does not use either
            elif tensor.numel() == 0:
                continue  # holds nothing (a GLM-4.5 without shared experts stores their empty weights)
            else:
                unexpected.append(hf_name)
    if unexpected:
        raise ValueError(f"{model_dir}: tensors liandan has no place for: {_preview(sorted(unexpected))}")
    missing = sorted(
        hf for hf, (key, index) in names.items() if key not in state_dict and index not in parts.get(key, {})
    )
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {_preview(missing)}")
    for key, slices in parts.items():
        state_dict[key] = torch.stack([slices[i] for i in range(len(slices))])
    for key in unstored_keys(args):
        state_dict[key] = torch.zeros(shapes[key])
    for key, source in tied.items():
        state_dict[key] = state_dict[source]
    return {k: state_dict[k] for k in shapes}, args


# ----------------------------------------------------------------------------------------------------------
# consolidated single-file checkpoint


def _args_to_json(args: Any) -> str:
    return json.dumps(dataclasses.asdict(args), sort_keys=True)


def _args_from_json(text: str, where: Path, family: str = "llama") -> Any:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: metadata {ARGS_METADATA_KEY} is not valid JSON: {err}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: metadata {ARGS_METADATA_KEY} is not a JSON object")  # noqa: TRY004 - as above
    args_type = get_model_spec(family).args_type
    known = {f.name for f in dataclasses.fields(args_type)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{where}: metadata {ARGS_METADATA_KEY} has unknown model fields {unknown}")
    return args_type(**fields)


def save_consolidated(state_dict: dict[str, torch.Tensor], args: Any, path: Path) -> None:
    """Write the model to one `.safetensors` file in liandan naming, with `args` as JSON in the file's metadata
    under `liandan_model_args` and its family under `liandan_model_family`. Tensors keep their dtype; tied
    weights are stored once."""
    path = Path(path)
    tensors = _check_state_dict(state_dict, args, "state dict")
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", ARGS_METADATA_KEY: _args_to_json(args), FAMILY_METADATA_KEY: spec_for(args).name}
    _save_safetensors(_prepare_for_save(tensors, None), path, metadata)


def load_consolidated(path: Path) -> tuple[dict[str, torch.Tensor], Any]:
    """Read a file written by `save_consolidated`: (state dict, args). Tied keys (Llama's `output.weight` with
    tied embeddings) are the same tensor as the one they are tied to."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if ARGS_METADATA_KEY not in metadata:
                raise ValueError(f"{path}: no {ARGS_METADATA_KEY} in the safetensors metadata")
            args = _args_from_json(metadata[ARGS_METADATA_KEY], path, metadata.get(FAMILY_METADATA_KEY, "llama"))
            state_dict = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for malformed files
        raise ValueError(f"cannot read {path}: {err}") from None
    state_dict = _check_state_dict(state_dict, args, str(path))
    for key, source in spec_for(args).tied(args).items():
        state_dict[key] = state_dict[source]
    return {k: state_dict[k] for k in expected_shapes(args)}, args
