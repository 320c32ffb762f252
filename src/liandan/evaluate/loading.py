"""A checkpoint's model, tokenizer and config, ready to evaluate: from a step directory, a checkpoints
directory or a run directory (its newest complete checkpoint)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from liandan.checkpoint.hf_tokenizer import HFChat
from liandan.checkpoint.info import resolve_checkpoint
from liandan.checkpoint.loading import load_model
from liandan.checkpoint.verify import CheckpointError
from liandan.config import Config, ConfigError, from_dict
from liandan.data.documents.corpus import DataError
from liandan.data.tokens.chat import CHATML_JINJA, CHATML_TOKENS, IM_END, ModelTemplate
from liandan.data.tokens.store import MANIFEST, TOKENIZER_FILE
from liandan.data.tokens.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def evaluation_device(requested: str | None, flag: str = "--device") -> torch.device:
    """Where a command runs a checkpoint's model: `requested` (cpu, cuda, cuda:1, or another accelerator this
    machine has), or by default cuda when there is one, else the CPU. ConfigError, in one line, for what is no
    device, is not on this machine, or holds no data (meta)."""
    if not requested:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ConfigError(f"{flag} {requested}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type == "meta":
        raise ConfigError(f"{flag} {requested}: the meta device holds no weights to run; use cpu or cuda")
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None or accelerator.type != device.type:
        built = " (this torch was built without CUDA)" if device.type == "cuda" and torch.version.cuda is None else ""
        raise ConfigError(f"{flag} {requested}: this machine has no {device.type} device{built}; use cpu")
    count = torch.accelerator.device_count()
    if device.index is not None and device.index >= count:
        raise ConfigError(f"{flag} {requested}: this machine has {count} {device.type} device(s), "
                          f"{device.type}:0 to {device.type}:{count - 1}")  # fmt: skip
    return device


def load_for_eval(
    run_or_ckpt: str | Path,
    *,
    tokenizer: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[nn.Module, Tokenizer, Config | None]:
    """(model in evaluation mode on `device`, its tokenizer, the config it was trained with: None for an
    imported checkpoint). `tokenizer` ("byte" or a tokenizer.json) overrides the search for the one the
    checkpoint records. CheckpointError, in one line, when there is no checkpoint or no tokenizer."""
    given = Path(run_or_ckpt)
    if not given.exists():
        raise CheckpointError(f"no such run or checkpoint: {given}")
    checkpoint = resolve_checkpoint(given)
    model, meta = load_model(checkpoint)
    tok = _tokenizer(checkpoint, meta, given if given != checkpoint else None, tokenizer)
    if tok.vocab_size > model.args.vocab_size:
        raise CheckpointError(f"the tokenizer has {tok.vocab_size} tokens but the model of {checkpoint} only "
                              f"{model.args.vocab_size}: not the tokenizer it was trained with")  # fmt: skip
    device = torch.device(device)
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    if model.configure_attention(device, training=False) == "flex" and device.type != "cuda":
        # FlexAttention is compiled on CUDA only: elsewhere it builds the whole score matrix, as SDPA with an
        # explicit mask does, and warns (nine lines) in every process that evaluates
        model.attention_backend = "sdpa"
    return model.eval(), tok, saved_config(meta, checkpoint)


def saved_config(meta: dict[str, Any], checkpoint: Path) -> Config | None:
    """The config saved in a checkpoint's meta.json (None when it has none, as imported checkpoints)."""
    text = meta.get("config")
    if not text:
        return None
    try:
        return from_dict(tomllib.loads(text))
    except (tomllib.TOMLDecodeError, ConfigError) as err:
        raise CheckpointError(f"{checkpoint}: the config saved in meta.json does not load: {err}") from None


def _tokenizer(checkpoint: Path, meta: dict, run_dir: Path | None, override: str | Path | None) -> Tokenizer:
    if override is not None:
        return load_tokenizer(override)
    fingerprint = meta.get("tokenizer")
    if fingerprint == ByteTokenizer().fingerprint():
        return ByteTokenizer()
    path = checkpoint_tokenizer(checkpoint, meta, run_dir)
    if path is None:
        what = f"the tokenizer {fingerprint} it was trained with" if fingerprint else "a tokenizer"
        raise CheckpointError(f"{checkpoint}: {what} was not found beside the checkpoint, in the run's data "
                              "directory or in its [data] stores; name a tokenizer.json")  # fmt: skip
    return HFTokenizer.load(path)


def checkpoint_tokenizer(checkpoint: Path, meta: dict, run_dir: Path | None) -> Path | None:
    """The tokenizer.json a checkpoint was trained with (meta.json holds its fingerprint; an imported
    checkpoint holds none, and the file copied beside it is taken): in the stores of `[data] stores` of the
    config saved with it, in the run's own data directory (<run>/data, beside <run>/checkpoints unless the
    run was given), or in the checkpoint directory itself."""
    candidates = [path for store in _trained_on_stores(meta) if (path := _store_tokenizer(store)) is not None]
    for directory in (run_dir, checkpoint.parent.parent, checkpoint.parent):
        if directory is not None:
            candidates.append(directory / "data" / TOKENIZER_FILE)
    candidates.append(checkpoint / TOKENIZER_FILE)
    return next((path for path in candidates if _is_tokenizer(path, meta.get("tokenizer"))), None)


def checkpoint_chat(
    checkpoint: Path, meta: dict, run_dir: Path | None, warn: Callable[[str], None] = print
) -> HFChat | None:
    """How the conversations a checkpoint was fine-tuned on were rendered, for its export; None for a model
    that was not (pretraining). The template is the one the manifest of a store it trained on names
    (`loss_mask.template`, in the same places `checkpoint_tokenizer` looks), else the saved config's
    `data.chat_template` when its objective trains on chats. A model's own template is read from that
    store, which keeps the model's tokenizer_config.json, else from the directory of the config's
    `data.tokenizer`; when neither holds it (or holds another template), `warn` says so and the export
    goes without one (None)."""
    try:
        config = tomllib.loads(meta.get("config") or "")
    except tomllib.TOMLDecodeError:
        config = {}
    data = config.get("data", {})
    template, store = _store_template(checkpoint, meta, run_dir)
    if template is None and config.get("train", {}).get("objective") in ("sft", "dpo"):
        template = data.get("chat_template", "chatml")
    if template is None:
        return None
    if template == "chatml":
        return HFChat(CHATML_JINJA, (IM_END,), CHATML_TOKENS)
    places = [store] if store is not None else []
    if isinstance(data.get("tokenizer"), str) and data["tokenizer"] not in ("byte", "bpe"):
        places.append(Path(data["tokenizer"]).parent)
    for place in places:
        try:
            model = ModelTemplate(place)
        except DataError:
            continue
        if template in ("tokenizer", model.name):  # the config names no hash; a store's manifest does
            return HFChat(model.template, (model.eos_token,) if model.eos_token else (), (), model.tokenizer_config())
    where = f"not in {' nor in '.join(str(p) for p in places)}" if places else "no store or model directory named"
    warn(f"warning: the model's chat template the data was rendered with was not found ({where}); the export "
         "has no chat_template")  # fmt: skip
    return None


def _store_template(checkpoint: Path, meta: dict, run_dir: Path | None) -> tuple[str | None, Path | None]:
    """(`loss_mask.template`, the store) of the first store with the checkpoint's tokenizer that has a loss
    mask: a fine-tuning store it trained on; (None, None) when there is none."""
    stores = [Path(s) for s in _trained_on_stores(meta)]
    stores += [d / "data" for d in (run_dir, checkpoint.parent.parent, checkpoint.parent) if d is not None]
    for store in stores:
        try:
            manifest = json.loads((store / MANIFEST).read_text())
        except (OSError, ValueError):  # not a local store (a URL, or gone): the config says the rest
            continue
        if manifest.get("tokenizer") == meta.get("tokenizer") and isinstance(manifest.get("loss_mask"), dict):
            return manifest["loss_mask"].get("template"), store
    return None, None


def _is_tokenizer(path: Path, fingerprint: str | None) -> bool:
    """Whether `path` is a Hugging Face tokenizer.json with this fingerprint (any, given None)."""
    if not path.is_file():
        return False
    try:
        if "liandan" in json.loads(path.read_text()):  # liandan's byte tokenizer: nothing for transformers
            return False
        return fingerprint is None or HFTokenizer.load(path).fingerprint() == fingerprint
    except (OSError, ValueError):  # unreadable: not the tokenizer (DataError and JSON errors are ValueErrors)
        return False


def _store_tokenizer(store: str) -> Path | None:
    """The tokenizer.json of a store, a store URL's fetched alone into the shard cache."""
    from liandan.data.tokens.cache import store_tokenizer

    try:
        return store_tokenizer(store)
    except (DataError, ConfigError):  # a store URL unreadable from here: the other places may hold the tokenizer
        return None


def _trained_on_stores(meta: dict) -> list[str]:
    """The `[data] stores` of the config saved with a checkpoint."""
    try:
        stores = tomllib.loads(meta.get("config") or "").get("data", {}).get("stores")
    except (tomllib.TOMLDecodeError, AttributeError, TypeError):
        return []
    return [str(s) for s in stores] if isinstance(stores, list) else []
