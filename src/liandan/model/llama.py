"""A Llama-style decoder in one file: RMSNorm, rotary embeddings (optionally with Llama 3's rescaling), SwiGLU,
grouped-query attention, optional tied embeddings, qk-norm, query/key/value biases and z-loss, and the speed-run
recipe options (ReLU^2 feed-forward, logit soft-capping, zero-initialised output projections). The model is
plain PyTorch; parallelism, precision and recomputation are applied from outside (liandan.train.parallelize),
so nothing here knows about them.

Rotary embeddings use the rotate-half layout of Hugging Face's Llama, so weights move between the two
without permutation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from liandan.model.attention import MaskSpec, PreparedMask, attend, choose_backend
from liandan.model.kv_cache import KVCache
from liandan.model.loss import chunked_lm_loss, full_logits, fused_lm_loss, lm_loss
from liandan.model.moe import GroupedExperts, MoE, MoEConfig, carry_aux_loss

# The feed-forward kinds: SwiGLU (three matrices) and ReLU^2 (two, as in modded-nanogpt and Primer).
FEED_FORWARDS = ("swiglu", "relu2")


@dataclass
class ModelArgs:
    vocab_size: int = 32000
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0
    ffn_dim: int = 0
    ffn_multiple_of: int = 64
    head_dim: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0  # the share of each head's dimensions the rotary embedding turns (the first ones)
    rope_scaling: str = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    z_loss: float = 0.0
    init_std: float = 0.02
    parameterization: str = "standard"
    mup_base_dim: int = 0
    attention: str = "auto"
    mlp: str = "swiglu"
    logit_softcap: float = 0.0
    zero_init_out: bool = False
    # Mixture of experts (liandan.model.moe): 0 experts is a dense model.
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_ffn_dim: int = 0
    moe_shared_experts: int = 0
    moe_dense_layers: int = 0
    moe_score: str = "softmax"
    moe_route_norm: bool = True
    moe_route_scale: float = 1.0
    moe_balance: str = "bias"
    moe_bias_rate: float = 1e-3
    moe_aux_loss: float = 0.0
    moe_z_loss: float = 0.0
    moe_capacity_factor: float = 0.0

    def __post_init__(self) -> None:
        self.n_kv_heads = self.n_kv_heads or self.n_heads
        # Qwen3 and others decouple the head size from the width (Qwen3-0.6B: 16 heads of 128 in 1024).
        self.head_dim = self.head_dim or self.dim // self.n_heads
        if self.rope_fraction != 1.0 and (
            not 0.0 < self.rope_fraction < 1.0 or self.rope_dims < 2 or self.rope_dims % 2
        ):
            raise ValueError(
                f"model.rope_fraction = {self.rope_fraction} must be in (0, 1] and turn an even number of the "
                f"{self.head_dim} dimensions of a head (it turns {self.rope_dims})"
            )
        if self.mlp not in FEED_FORWARDS:
            raise ValueError(f"model.mlp = {self.mlp!r} is not one of {', '.join(FEED_FORWARDS)}")
        if not self.ffn_dim:
            hidden = int(2 * (4 * self.dim) / 3) if self.mlp == "swiglu" else 4 * self.dim
            self.ffn_dim = self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)
        if self.moe_experts:
            self.moe_ffn_dim = self.moe_ffn_dim or self.ffn_dim
            if self.mlp != "swiglu":
                raise ValueError("model.moe_experts needs model.mlp = swiglu (the experts are SwiGLU feed-forwards)")
            if self.moe_balance not in ("bias", "none"):
                raise ValueError(f"model.moe_balance = {self.moe_balance!r} is not one of bias, none")
            self.moe_config()  # checks the rest

    def moe_config(self) -> MoEConfig:
        return MoEConfig(
            experts=self.moe_experts,
            top_k=self.moe_top_k,
            ffn_dim=self.moe_ffn_dim,
            shared_experts=self.moe_shared_experts,
            score=self.moe_score,
            route_norm=self.moe_route_norm,
            route_scale=self.moe_route_scale,
            bias_balance=self.moe_balance == "bias",
            aux_loss=self.moe_aux_loss,
            z_loss=self.moe_z_loss,
            capacity_factor=self.moe_capacity_factor,
        )

    @property
    def rope_dims(self) -> int:
        """How many of each head's dimensions the rotary embedding turns: the first ones, in the rotate-half
        layout among themselves; the rest pass through (transformers' `partial_rotary_factor`)."""
        return int(self.head_dim * self.rope_fraction)

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` has routed experts (the first `moe_dense_layers` blocks stay dense)."""
        return self.moe_experts > 0 and index >= self.moe_dense_layers

    @property
    def width_mult(self) -> float:
        """The width over the tuned base width under muP; 1.0 under the standard parameterization."""
        if self.parameterization != "mup":
            return 1.0
        if self.mup_base_dim <= 0:
            raise ValueError("model.parameterization = mup needs model.mup_base_dim")
        return self.dim / self.mup_base_dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_frequencies(args: ModelArgs) -> torch.Tensor:
    """The rotary angular frequencies (rope_dims / 2), in fp64, with Llama 3's long-context rescaling when
    `rope_scaling = "llama3"`: frequencies whose wavelength is short against the original context keep their
    value, those whose wavelength exceeds it are divided by `rope_factor`, and a band in between blends the
    two linearly in (original context / wavelength)."""
    hd = args.rope_dims
    freq = 1.0 / args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    if args.rope_scaling == "none":
        return freq
    if args.rope_scaling != "llama3":
        raise ValueError(f"model.rope_scaling = {args.rope_scaling!r} is not one of none, llama3")
    periods_in_context = args.rope_original_max_seq_len * freq / (2 * math.pi)
    low, high = args.rope_low_freq_factor, args.rope_high_freq_factor
    kept = ((periods_in_context - low) / (high - low)).clamp(0.0, 1.0)  # 1: fast, kept; 0: slow, fully rescaled
    return freq / args.rope_factor * (1 - kept) + freq * kept


def rope_table(head_dim: int, max_seq_len: int, theta: float, frequencies: torch.Tensor | None = None) -> torch.Tensor:
    """(max_seq_len, head_dim) table of [cos | sin] halves, in fp32; `frequencies` (fp64, head_dim / 2)
    replace the plain ones of base `theta` when given."""
    if frequencies is None:
        frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), frequencies)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def model_rope_table(args: ModelArgs) -> torch.Tensor:
    return rope_table(args.rope_dims, args.max_seq_len, args.rope_theta, rope_frequencies(args))


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); table: (T, R) or (B, T, R) rows for each position. With R < D (a partial rotary
    embedding) the first R dimensions turn and the rest pass through."""
    rotary = table.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary], table), x[..., rotary:]], dim=-1)
    half = x.shape[-1] // 2
    cos, sin = table[..., :half], table[..., half:]
    if table.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        # Qwen2-style biases on the query, key and value projections (not the output projection).
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, mask: PreparedMask, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    @torch.no_grad()
    def largest_logit(self, x: torch.Tensor, rope: torch.Tensor, positions: int = 256) -> torch.Tensor:
        """The largest causal attention logit q.k/sqrt(head_dim) over the first sequence's first `positions`
        positions (its own heads under tensor parallelism): a diagnostic, computed beside the real forward."""
        x = x[:1, :positions]
        seq = x.shape[1]
        q = self.wq(x).view(1, seq, -1, self.head_dim)
        k = self.wk(x).view(1, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope[:seq]), apply_rope(k, rope[:seq])
        q, k = q.transpose(1, 2).float(), k.transpose(1, 2).float()
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        return logits.masked_fill(future, -math.inf).amax()


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, hidden: int = 0):
        super().__init__()
        hidden = hidden or args.ffn_dim
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        # ReLU^2 has no gate: w2(relu(w1 x)^2).
        self.w3 = nn.Linear(args.dim, hidden, bias=False) if args.mlp == "swiglu" else None
        self.w2 = nn.Linear(hidden, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.relu(self.w1(x)).square())
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def feed_forward(args: ModelArgs, index: int) -> nn.Module:
    """Block `index`'s feed-forward: dense, or routed experts (and shared ones) in a MoE layer."""
    if not args.is_moe_layer(index):
        return FeedForward(args)
    cfg = args.moe_config()
    shared = FeedForward(args, cfg.shared_experts * cfg.ffn_dim) if cfg.shared_experts else None
    return MoE(args.dim, cfg, shared)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, index: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = feed_forward(args, index)

    def forward(
        self, x: torch.Tensor, rope: torch.Tensor, mask: PreparedMask, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, mask, cache, layer)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer index keeps parameter names stable when layers are wrapped or pruned.
        self.layers = nn.ModuleDict({str(i): Block(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", model_rope_table(args), persistent=False)
        self.attention_backend = "sdpa"
        self.ce_chunks = 1
        self.ce_fused = False
        # What a pipeline stage without the head divides its auxiliary losses' gradient by: the number the
        # last stage divides each micro-batch's loss by (`liandan.train.pipeline`).
        self.loss_divisor = 1.0
        self.init_weights()

    def init_weights(self) -> None:
        """Normal(0, init_std) everywhere; the projections that write into the residual stream (wo, w2) get
        init_std / sqrt(2 * n_layers) so the residual's variance does not grow with depth. Under muP the
        blocks' matrices (not the embedding, not the head) are further scaled by 1/sqrt(width_mult): std
        proportional to 1/sqrt(fan_in), equal to init_std at the base width. With `zero_init_out` the
        residual-writing projections, and an untied output head, start at zero instead (see `_zero_at_init`)."""
        std = self.args.init_std
        hidden_std = std / math.sqrt(self.args.width_mult) if self.args.width_mult != 1.0 else std
        out_std = hidden_std / math.sqrt(2 * self.args.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear) and self._zero_at_init(name):
                nn.init.zeros_(module.weight)
            elif isinstance(module, nn.Linear):
                last = name.rsplit(".", 1)[-1]
                nn.init.normal_(
                    module.weight,
                    0.0,
                    std if module is self.output else out_std if last in ("wo", "w2") else hidden_std,
                )
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, GroupedExperts):
                module.reset_parameters(hidden_std, out_std)
                if self.args.zero_init_out:
                    nn.init.zeros_(module.w2)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        self.init_buffers()

    def width_mults(self) -> dict[int, float]:
        """muP's width multiplier of each hidden matrix (the blocks' linear weights), by the id of the
        parameter as it is now (parallel wrappers replace parameters, so this is read when asked); empty under
        the standard parameterization. Read by `liandan.model.roles` for the optimizers' learning rates."""
        mult = self.args.width_mult
        if self.args.parameterization != "mup":
            return {}
        return {id(p): mult for layer in self.layers.values() for p in layer.parameters() if p.dim() >= 2}

    @property
    def output_mult(self) -> float:
        """muP's multiplier of the logits, 1 / width_mult (the head's init and learning rate stay those of the
        base width, so its logits would otherwise grow with the width)."""
        return 1.0 / self.args.width_mult

    def _head_input(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm, and under muP the output multiplier, applied before the projection (the same as
        multiplying the logits: the head is linear without a bias) so that every loss path shares it."""
        x = self.norm(h)
        mult = self.output_mult
        return x if mult == 1.0 else x * mult

    def _zero_at_init(self, name: str) -> bool:
        """`zero_init_out` (modded-nanogpt): every block starts as the identity and the first logits are
        uniform; the gradients still reach these matrices, since their inputs are not zero. A tied head is
        the embedding table, which keeps its normal init."""
        if not self.args.zero_init_out:
            return False
        return name.rsplit(".", 1)[-1] in ("wo", "w2") or (name == "output" and not self.args.tie_embeddings)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Buffers computed from the args (the rotary table) or starting at zero (the routers' balancing
        biases and counters), where the model's storage was allocated after construction (meta-device
        initialisation)."""
        self.rope.copy_(model_rope_table(self.args))
        for layer in self.layers.values():
            if isinstance(layer.feed_forward, MoE):
                for buffer in layer.feed_forward.router.buffers():
                    buffer.zero_()

    def configure_loss(self, ce_chunks: int, fused: bool = False) -> None:
        """Compute the head and its loss over `ce_chunks` slices of the tokens (1: all at once); `fused`: with
        their gradients in the forward pass (`fused_lm_loss`)."""
        self.ce_chunks = ce_chunks
        self.ce_fused = fused

    def configure_attention(self, device: torch.device, training: bool = True) -> str:
        self.attention_backend = choose_backend(self.args.attention, device, training)
        return self.attention_backend

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        prefix: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V), or the mean loss when `targets` is given (targets of -1 are ignored).

        doc_ids (B, T): packed-document ids; no attention across documents.
        prefix (B, T) bool: positions that attend bidirectionally among themselves (prefix-LM).
        positions (B, T): rotary positions, default 0..T-1.
        cache: decode incrementally: `tokens` fill the cache's next slots and attend to every slot before
            them (its positions and padding replace `positions`, `doc_ids` and `prefix`); logits only.
        logits_at (B, K): logits of these positions only, (B, K, V): scoring needs few positions, and the
            output projection of all of them is most of the work of a small model with a large vocabulary.
        """
        if cache is not None:
            return self._forward_cached(tokens, cache, logits_at)
        seq = tokens.shape[1]
        mask = PreparedMask(MaskSpec(doc_ids, prefix), self.attention_backend, seq, tokens.device)
        rope = self.rope[:seq] if positions is None else self.rope[positions]
        # A pipeline stage (liandan.train.pipeline_split) may lack the embedding, whose stage then hands it
        # the hidden states as `tokens`, or the head, and then returns its hidden states for the next stage.
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        if self.output is None:
            return self._carry_aux_gradients(h)
        if targets is None:
            return full_logits(self._logits(_rows(h, logits_at)))
        return self._with_aux_gradients(self.head_loss(h, targets))

    def _aux_losses(self) -> list[torch.Tensor]:
        """The auxiliary losses of this forward's MoE layers (training only)."""
        if not self.training:
            return []
        return [
            layer.feed_forward.aux_loss
            for layer in self.layers.values()
            if isinstance(layer.feed_forward, MoE) and layer.feed_forward.aux_loss is not None
        ]

    def _with_aux_gradients(self, loss: torch.Tensor) -> torch.Tensor:
        """The routers' auxiliary losses (load balance, z-loss) join the gradient but not the value: the
        loss a MoE run reports is the language-model loss, comparable with a dense run's."""
        aux = self._aux_losses()
        if not aux:
            return loss
        total = torch.stack(aux).sum()
        return loss + (total - total.detach()).to(loss.dtype)

    def _carry_aux_gradients(self, h: torch.Tensor) -> torch.Tensor:
        """A pipeline stage without the head: its MoE layers' auxiliary losses join the gradient through the
        hidden states it hands on, as `_with_aux_gradients` joins them to the loss."""
        aux = self._aux_losses()
        if not aux or not torch.is_grad_enabled():
            return h
        return carry_aux_loss(h, torch.stack(aux).sum(), self.loss_divisor)

    def _forward_cached(self, tokens: torch.Tensor, cache: KVCache, logits_at: torch.Tensor | None) -> torch.Tensor:
        bsz, seq = tokens.shape
        rope = self.rope[cache.positions(bsz, seq, tokens.device)]
        mask = PreparedMask.explicit(cache.allowed(bsz, seq, tokens.device), self.attention_backend)
        h = self.tok_embeddings(tokens)
        for index, layer in enumerate(self.layers.values()):
            h = layer(h, rope, mask, cache, index)
        cache.advance(seq)
        return full_logits(self._logits(_rows(h, logits_at)))

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, output projection and loss: one unit, so it can be compiled as one (the fp32 logits
        of a large vocabulary are the biggest tensor of a small model's step). With `ce_chunks` > 1 the logits
        are made and reduced a slice of the tokens at a time; under tensor parallelism they may come out split
        over the vocabulary, which `lm_loss` reduces in place."""
        if self.ce_fused:
            bias = self.output.bias
            if bias is not None:
                raise ValueError("train.ce_fused needs an output projection without a bias")
            return fused_lm_loss(self._head_input(h), self.output.weight, targets, self.args.z_loss, self.ce_chunks,
                                 self.args.logit_softcap)  # fmt: skip
        if self.ce_chunks > 1:
            return chunked_lm_loss(self._logits, h, targets, self.args.z_loss, self.ce_chunks)
        return lm_loss(self._logits(h), targets, self.args.z_loss)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return softcap(self.output(self._head_input(h)), self.args.logit_softcap)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap): logits bounded in (-cap, cap), near-linear well inside (Gemma 2,
    modded-nanogpt); the logits unchanged when cap is 0."""
    if not cap:
        return logits
    return cap * torch.tanh(logits / cap)


def _rows(h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """h (B, T, D) at positions (B, K), or all of h."""
    if positions is None:
        return h
    return h[torch.arange(h.shape[0], device=h.device)[:, None], positions]


def block_attention_logit(block: Block, x: torch.Tensor, args: tuple) -> torch.Tensor:
    """The spec's `attention_logit`: a block's largest attention logit, from its input and its rotary table."""
    return block.attention.largest_logit(block.attention_norm(x), args[0])
