"""Llama's parameter and FLOP counts from its shape alone (no weights needed), for MFU and planning. The rest of
liandan reaches them through the Llama spec (`liandan.model.count_params` and `flops_per_token` dispatch on the
args' family)."""

from __future__ import annotations

from liandan.model.llama import ModelArgs
from liandan.model.spec import ParamCounts, ParamSplit

__all__ = ["ParamCounts", "ParamSplit", "count_params", "flops_per_token", "param_split"]


def count_params(args: ModelArgs) -> ParamCounts:
    """Total and active counts: a MoE block's routed experts count in full towards the total and at
    top_k / experts towards the active parameters; its router and shared experts count in full in both."""
    d, L = args.dim, args.n_layers
    attn = _attention(args) + _qkv_bias(args) + (2 * args.head_dim if args.qk_norm else 0)
    dense_ffn = _ffn_matrices(args) * d * args.ffn_dim
    moe_layers = sum(args.is_moe_layer(i) for i in range(L)) if args.moe_experts else 0
    routed_total, routed_active, always = _moe_ffn(args)
    ffn_total = (L - moe_layers) * dense_ffn + moe_layers * (routed_total + always)
    ffn_active = (L - moe_layers) * dense_ffn + moe_layers * (routed_active + always)
    rest = L * (attn + 2 * d)  # attention and the two norms of every block
    embedding = args.vocab_size * d
    head = 0 if args.tie_embeddings else args.vocab_size * d
    non_embedding = rest + ffn_total + d + head
    matmul = non_embedding + (embedding if args.tie_embeddings else 0)
    inactive = ffn_total - ffn_active
    return ParamCounts(embedding + non_embedding, embedding, non_embedding, matmul,
                       active=embedding + non_embedding - inactive, active_matmul=matmul - inactive)  # fmt: skip


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token, PaLM's accounting (Chowdhery et al. 2022, appendix B):
    6 * N + 12 * L * H * Q * T, where N counts the parameters used in matmuls (the output head, not the
    input lookup), L layers, H heads, Q head size and T the sequence length. The attention term counts the
    full T x T score matrix, as PaLM does, even under a causal mask. Of a mixture of experts N counts the
    active parameters: a token's top_k routed experts, the shared experts and the router."""
    n = count_params(args).active_matmul
    return 6.0 * n + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len


def param_split(args: ModelArgs, tp: int = 1, ep: int = 1) -> ParamSplit:
    """Tensor parallel as Llama's plan applies it: q/k/v/w1/w3 column-parallel and wo/w2 row-parallel (divided
    by tp), the embedding vocabulary-parallel and the head column-parallel (divided by tp), norms replicated.
    A MoE block's feed-forward is not split by tp (every rank of the group holds it whole). Under expert
    parallelism (`ep`) FSDP2 gathers only a rank's own experts (experts / ep) with a block, so the largest
    block counts those; the total keeps every expert, which FSDP2 and ep together divide over dp_shard."""
    d, hd, L = args.dim, args.head_dim, args.n_layers
    attn = _ceil(_attention(args) + _qkv_bias(args), tp)
    dense = _ceil(_ffn_matrices(args) * d * args.ffn_dim, tp)
    routed_total, _, always = _moe_ffn(args)
    moe = routed_total + always
    norms = 2 * d + (2 * hd if args.qk_norm else 0)
    moe_layers = sum(args.is_moe_layer(i) for i in range(L)) if args.moe_experts else 0
    table = _ceil(args.vocab_size * d, tp)
    root = table * (1 if args.tie_embeddings else 2) + d
    matrices = L * attn + (L - moe_layers) * dense + moe_layers * moe
    if not moe_layers:
        return ParamSplit(L, attn + dense + norms, root, matrices + table)
    blocks = matrices + L * norms
    gathered_moe = routed_total // ep + always
    largest = attn + max(gathered_moe, dense if moe_layers < L else 0) + norms
    return ParamSplit(L, largest, root, matrices + table, blocks=blocks)


def _attention(args: ModelArgs) -> int:
    d, hd = args.dim, args.head_dim
    return d * args.n_heads * hd + 2 * d * args.n_kv_heads * hd + args.n_heads * hd * d


def _moe_ffn(args: ModelArgs) -> tuple[int, int, int]:
    """A MoE block's feed-forward: (routed experts' weights, the share of them a token uses, the weights
    every token goes through: router and shared experts). Zeros for a dense model."""
    if not args.moe_experts:
        return 0, 0, 0
    d, hidden, experts = args.dim, args.moe_ffn_dim, args.moe_experts
    expert = 3 * d * hidden  # SwiGLU: w1, w3, w2
    always = experts * d + 3 * d * hidden * args.moe_shared_experts  # router gate, shared experts
    return experts * expert, args.moe_top_k * expert, always


def _qkv_bias(args: ModelArgs) -> int:
    """Qwen2's biases: not matmul weights, but column-parallel like the projections they follow."""
    return (args.n_heads + 2 * args.n_kv_heads) * args.head_dim if args.qkv_bias else 0


def _ffn_matrices(args: ModelArgs) -> int:
    """SwiGLU's gate, up and down projections; ReLU^2 has no gate."""
    return 2 if getattr(args, "mlp", "swiglu") == "relu2" else 3


def _ceil(a: int, b: int) -> int:
    return -(-a // b)
