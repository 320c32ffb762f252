"""Llama's own keys of the run config, `[model.llama]` (or flat in `[model]`, as before there were other
families): the shape, rotary embeddings, norms, attention kernel and initialisation. Imports no torch, so that
checking a config stays cheap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from liandan.config import ConfigError, option


@dataclass
class LlamaOptions:
    dim: int = option(256, "hidden size", min=8)
    n_layers: int = option(4, "transformer blocks", min=1)
    n_heads: int = option(4, "query heads", min=1)
    n_kv_heads: int = option(0, "key/value heads for grouped-query attention; 0 means n_heads", min=0)
    ffn_dim: int = option(
        0, "feed-forward hidden size; 0 derives 8/3*dim (swiglu) or 4*dim (relu2) rounded to ffn_multiple_of", min=0
    )
    ffn_multiple_of: int = option(64, "rounding of the derived SwiGLU hidden size", min=1)
    head_dim: int = option(0, "size of one attention head; 0 means dim / n_heads (Qwen3 sets it apart)", min=0)
    norm_eps: float = option(1e-5, "RMSNorm epsilon", min=0.0)
    rope_theta: float = option(10000.0, "rotary embedding base", min=1.0)
    rope_fraction: float = option(
        1.0, "share of each head's dimensions the rotary embedding turns, the first ones (GLM-4.5: 0.5)", min=0.0
    )
    rope_scaling: Literal["none", "llama3"] = option("none", "rotary rescaling for long context: llama3 (Llama 3.1+)")
    rope_factor: float = option(8.0, "llama3 rope_scaling: divisor of the slow frequencies", min=1.0)
    rope_low_freq_factor: float = option(
        1.0, "llama3 rope_scaling: below this many periods per context, rescaled", min=0.0
    )
    rope_high_freq_factor: float = option(
        4.0, "llama3 rope_scaling: above this many periods per context, kept", min=0.0
    )
    rope_original_max_seq_len: int = option(
        8192, "llama3 rope_scaling: the context the model was first trained at", min=1
    )
    tie_embeddings: bool = option(
        False, "share the input embedding with the output head; false (the default) is an untied head"
    )
    qk_norm: bool = option(False, "RMSNorm on queries and keys per head (attention-logit growth fix)")
    qkv_bias: bool = option(False, "biases on the query, key and value projections (Qwen2)")
    z_loss: float = option(0.0, "weight of the z-loss term log(Z)^2 on the output logits (PaLM uses 1e-4)", min=0.0)
    init_std: float = option(
        0.02, "std of the normal init; output projections are scaled by 1/sqrt(2*n_layers)", min=0.0
    )
    parameterization: Literal["standard", "mup"] = option(
        "standard",
        "mup: init, learning rates and output multiplier scaled with the width (dim / mup_base_dim) so that "
        "hyperparameters tuned at mup_base_dim hold at other widths (grow the width by heads of a fixed head_dim)",
    )
    mup_base_dim: int = option(0, "mup: the width whose hyperparameters are the tuned ones (required under mup)", min=0)
    attention: Literal["auto", "flex", "sdpa", "eager"] = option(
        "auto", "attention kernel: flex (FlexAttention block masks), sdpa, or eager (reference-style matmuls)"
    )
    # Speed-run recipe options (modded-nanogpt), each off by default.
    mlp: Literal["swiglu", "relu2"] = option("swiglu", "feed-forward: swiglu, or relu2 (w2(relu(w1 x)^2), no gate)")
    logit_softcap: float = option(
        0.0, "soft-cap the output logits to cap*tanh(logits/cap) (modded-nanogpt uses 15-30); 0 is off", min=0.0
    )
    zero_init_out: bool = option(
        False, "start the residual-writing projections (wo, w2) and an untied head at zero instead of a normal init"
    )

    # Mixture of experts (liandan.model.moe): every block after the first moe_dense_layers routes each token
    # to moe_top_k of moe_experts SwiGLU experts.
    moe_experts: int = option(0, "routed experts per MoE block; 0 is a dense model", min=0)
    moe_top_k: int = option(2, "experts each token is routed to", min=1)
    moe_ffn_dim: int = option(0, "each expert's hidden size; 0 means ffn_dim", min=0)
    moe_shared_experts: int = option(0, "shared experts every token goes through (DeepSeek, Qwen2-MoE)", min=0)
    moe_dense_layers: int = option(0, "the first blocks that keep a dense feed-forward (DeepSeek-V3: 3)", min=0)
    moe_score: Literal["softmax", "sigmoid"] = option(
        "softmax", "router scores: softmax over experts (Mixtral, Qwen3-MoE) or sigmoid per expert (DeepSeek-V3)"
    )
    moe_route_norm: bool = option(True, "renormalise the chosen experts' weights to sum to one")
    moe_route_scale: float = option(1.0, "factor on the routed experts' output weights (DeepSeek-V3: 2.5)", min=0.0)
    moe_balance: Literal["bias", "none"] = option(
        "bias", "bias: auxiliary-loss-free balancing by a per-expert bias on the choice (DeepSeek-V3); none"
    )
    moe_bias_rate: float = option(1e-3, "step of the balancing bias's update per training step", min=0.0)
    moe_aux_loss: float = option(
        0.0,
        "weight of the global load-balancing loss (Switch: 1e-2); its gradient only, not in the logged loss",
        min=0.0,
    )
    moe_z_loss: float = option(0.0, "weight of the router z-loss (ST-MoE: 1e-3)", min=0.0)
    moe_capacity_factor: float = option(
        0.0,
        "0: dropless; otherwise each expert takes at most factor * tokens * top_k / experts, the rest dropped",
        min=0.0,
    )

    def check(self) -> None:
        """Checks that involve more than one key (a one-line ConfigError)."""
        if self.head_dim and self.head_dim % 2:
            raise ConfigError(f"model.head_dim = {self.head_dim} must be even for rotary embeddings")
        if not self.head_dim and self.dim % self.n_heads:
            raise ConfigError(f"model.dim = {self.dim} must be divisible by model.n_heads = {self.n_heads}")
        if not self.head_dim and (self.dim // self.n_heads) % 2:
            raise ConfigError(
                f"head size model.dim / model.n_heads = {self.dim // self.n_heads} must be even for rotary embeddings"
            )
        head = self.head_dim or self.dim // self.n_heads
        rotary = int(head * self.rope_fraction)
        if self.rope_fraction != 1.0 and (not 0.0 < self.rope_fraction < 1.0 or rotary < 2 or rotary % 2):
            raise ConfigError(
                f"model.rope_fraction = {self.rope_fraction} must be in (0, 1] and turn an even number of the "
                f"{head} dimensions of a head (it turns {rotary})"
            )
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ConfigError(
                f"model.rope_high_freq_factor = {self.rope_high_freq_factor} must exceed "
                f"model.rope_low_freq_factor = {self.rope_low_freq_factor}"
            )
        if self.parameterization == "mup" and not self.mup_base_dim:
            raise ConfigError(
                "model.parameterization = mup needs model.mup_base_dim, the width its hyperparameters were tuned at"
            )
        if self.moe_experts and self.moe_top_k > self.moe_experts:
            raise ConfigError(
                f"model.moe_top_k = {self.moe_top_k} must not exceed model.moe_experts = {self.moe_experts}"
            )
        if self.moe_experts and self.mlp != "swiglu":
            raise ConfigError("model.moe_experts needs model.mlp = swiglu (the experts are SwiGLU feed-forwards)")
        if self.moe_experts and self.moe_dense_layers >= self.n_layers:
            raise ConfigError(
                f"model.moe_dense_layers = {self.moe_dense_layers} leaves no MoE block of model.n_layers = "
                f"{self.n_layers}"
            )
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ConfigError(f"model.n_kv_heads = {kv} must divide model.n_heads = {self.n_heads}")
