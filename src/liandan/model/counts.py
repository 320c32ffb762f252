"""Parameter and FLOP counts from a model's shape alone (no weights needed), for MFU and planning."""

from __future__ import annotations

from dataclasses import dataclass

from liandan.model.llama import ModelArgs


@dataclass(frozen=True)
class ParamCounts:
    total: int
    embedding: int  # the input token table (shared with the head when tied)
    non_embedding: int
    matmul: int  # parameters used in a matmul per token: all but the input lookup, which counts when tied


def count_params(args: ModelArgs) -> ParamCounts:
    d, hd, L = args.dim, args.head_dim, args.n_layers
    attn = d * args.n_heads * hd + 2 * d * args.n_kv_heads * hd + args.n_heads * hd * d
    qk_norm = 2 * hd if args.qk_norm else 0
    ffn = 3 * d * args.ffn_dim
    per_layer = attn + qk_norm + ffn + 2 * d
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
