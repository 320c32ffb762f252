"""The model: model families behind one spec each (Llama today), their masks and their counts."""

from liandan.model import llama_spec  # registers the Llama family
from liandan.model.attention import MaskSpec
from liandan.model.kv_cache import KVCache
from liandan.model.llama import ModelArgs, Transformer, lm_loss
from liandan.model.spec import ModelSpec, ParamCounts, count_params, flops_per_token, spec_for
from liandan.model.spec import get as get_model_spec

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
