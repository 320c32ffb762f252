"""The model: a plain Llama-style decoder, its masks and its counts."""

from liandan.model.attention import MaskSpec
from liandan.model.counts import ParamCounts, count_params, flops_per_token
from liandan.model.llama import ModelArgs, Transformer, lm_loss

__all__ = ["MaskSpec", "ModelArgs", "ParamCounts", "Transformer", "count_params", "flops_per_token", "lm_loss"]
