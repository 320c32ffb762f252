"""The model: model families behind one spec each (Llama today), their masks and their counts. Names are
imported on first use, so that a family's config keys (`llama_options`) can be read without torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "KVCache": "liandan.model.kv_cache",
    "MaskSpec": "liandan.model.attention",
    "ModelArgs": "liandan.model.llama",
    "Transformer": "liandan.model.llama",
    "lm_loss": "liandan.model.llama",
    "ModelSpec": "liandan.model.spec",
    "ParamCounts": "liandan.model.spec",
    "count_params": "liandan.model.spec",
    "flops_per_token": "liandan.model.spec",
    "spec_for": "liandan.model.spec",
    "get_model_spec": "liandan.model.spec:get",
    "llama_spec": "liandan.model.llama_spec:",
}

__all__ = [
    "KVCache",
    "MaskSpec",
    "ModelArgs",
    "ModelSpec",
    "ParamCounts",
    "Transformer",
    "count_params",
    "flops_per_token",
    "get_model_spec",
    "llama_spec",
    "lm_loss",
    "spec_for",
]


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'liandan.model' has no attribute {name!r}")
    module, _, attribute = where.partition(":")
    loaded = importlib.import_module(module)
    return loaded if where.endswith(":") else getattr(loaded, attribute or name)
