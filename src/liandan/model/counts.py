"""Llama's parameter and FLOP counts from its shape alone (no weights needed), for MFU and planning. The rest of
liandan reaches them through the Llama spec (`liandan.model.count_params` and `flops_per_token` dispatch on the
args' family)."""

from __future__ import annotations

from liandan.model.llama import ModelArgs
from liandan.model.spec import ParamCounts, ParamSplit

__all__ = ["ParamCounts", "ParamSplit", "count_params", "flops_per_token", "param_split"]


def count_params(args: ModelArgs) -> ParamCounts:
    d, hd, L = args.dim, args.head_dim, args.n_layers
    attn = d * args.n_heads * hd + 2 * d * args.n_kv_heads * hd + args.n_heads * hd * d
    qk_norm = 2 * hd if args.qk_norm else 0
    ffn = _ffn_matrices(args) * d * args.ffn_dim
    per_layer = attn + _qkv_bias(args) + qk_norm + ffn + 2 * d
    embedding = args.vocab_size * d
    head = 0 if args.tie_embeddings else args.vocab_size * d
    non_embedding = L * per_layer + d + head
    matmul = non_embedding + (embedding if args.tie_embeddings else 0)
    return ParamCounts(embedding + non_embedding, embedding, non_embedding, matmul)


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token, PaLM's accounting (Chowdhery et al. 2022, appendix B):
    6 * N + 12 * L * H * Q * T, where N counts the parameters used in matmuls (the output head, not the
    input lookup), L layers, H heads, Q head size and T the sequence length. The attention term counts the
    full T x T score matrix, as PaLM does, even under a causal mask."""
    n = count_params(args).matmul
    return 6.0 * n + 12.0 * args.n_layers * args.n_heads * args.head_dim * seq_len


def param_split(args: ModelArgs, tp: int = 1) -> ParamSplit:
    """Tensor parallel as Llama's plan applies it: q/k/v/w1/w3 column-parallel and wo/w2 row-parallel (divided
    by tp), the embedding vocabulary-parallel and the head column-parallel (divided by tp), norms replicated."""
    d, hd = args.dim, args.head_dim
    attn = d * args.n_heads * hd + 2 * d * args.n_kv_heads * hd + args.n_heads * hd * d
    matrices = _ceil(attn + _qkv_bias(args), tp) + _ceil(_ffn_matrices(args) * d * args.ffn_dim, tp)
    norms = 2 * d + (2 * hd if args.qk_norm else 0)
    table = _ceil(args.vocab_size * d, tp)
    root = table * (1 if args.tie_embeddings else 2) + d
    return ParamSplit(args.n_layers, matrices + norms, root, args.n_layers * matrices + table)


def _qkv_bias(args: ModelArgs) -> int:
    """Qwen2's biases: not matmul weights, but column-parallel like the projections they follow."""
    return (args.n_heads + 2 * args.n_kv_heads) * args.head_dim if args.qkv_bias else 0


def _ffn_matrices(args: ModelArgs) -> int:
    """SwiGLU's gate, up and down projections; ReLU^2 has no gate."""
    return 2 if getattr(args, "mlp", "swiglu") == "relu2" else 3


def _ceil(a: int, b: int) -> int:
    return -(-a // b)
