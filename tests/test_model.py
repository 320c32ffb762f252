"""Tests for the model: shapes, attention masks and kernels, rotary embeddings, counts, init and loss."""

from __future__ import annotations

import math

import pytest
import torch

from liandan.model import MaskSpec, ModelArgs, Transformer, count_params, flops_per_token, lm_loss
from liandan.model.attention import PreparedMask, attend, eager_attention, reference_attention
from liandan.model.llama import apply_rope, model_rope_table, rope_table

# FlexAttention on the CPU runs unfused (forward only) and says so on every call.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

CPU = torch.device("cpu")
BACKENDS = ["sdpa", "eager", "flex"]
MASK_KINDS = ["causal", "document", "prefix", "prefix+document", "prefix-segments", "prefix-segments+document"]

B, T = 2, 24
# Packed rows: 2-4 documents of uneven lengths, different in each row.
DOC_LENGTHS = [[5, 11, 4, 4], [13, 3, 8]]
# Prefix-LM: a different prefix length in each row. Row 0's prefix crosses its first document boundary.
PREFIX_LENGTHS = [7, 15]
# Prefix positions need not be one leading run: here the first tokens of each document of DOC_LENGTHS.
PREFIX_SEGMENTS = [[0, 1, 5, 6, 7, 16, 20, 21], [0, 1, 2, 3, 13, 16, 17, 18]]


def small_args(**overrides) -> ModelArgs:
    kwargs = {
        "vocab_size": 97,
        "dim": 64,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn_dim": 96,
        "max_seq_len": 64,
    }
    kwargs.update(overrides)
    return ModelArgs(**kwargs)


def make_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(small_args(**overrides))


def doc_ids_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    out = []
    for lengths in rows:
        assert sum(lengths) == T
        out.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
    return torch.stack(out)


def prefix_from_lengths(lengths: list[int]) -> torch.Tensor:
    prefix = torch.zeros(len(lengths), T, dtype=torch.bool)
    for row, n in enumerate(lengths):
        prefix[row, :n] = True
    return prefix


def make_spec(kind: str) -> MaskSpec:
    doc_ids = doc_ids_from_lengths(DOC_LENGTHS) if "document" in kind else None
    prefix = None
    if "prefix-segments" in kind:
        prefix = torch.zeros(B, T, dtype=torch.bool)
        for row, positions in enumerate(PREFIX_SEGMENTS):
            prefix[row, positions] = True
    elif "prefix" in kind:
        prefix = prefix_from_lengths(PREFIX_LENGTHS)
    return MaskSpec(doc_ids=doc_ids, prefix=prefix)


def loop_mask(spec: MaskSpec, batch: int, seq_len: int) -> torch.Tensor:
    """The documented rule, one (q, k) pair at a time:
    allowed(q, k) = same_document(q, k) and (k <= q or (in_prefix(q) and in_prefix(k)))."""
    out = torch.zeros(batch, 1, seq_len, seq_len, dtype=torch.bool)
    for b in range(batch):
        for q in range(seq_len):
            for k in range(seq_len):
                same_doc = spec.doc_ids is None or bool(spec.doc_ids[b, q] == spec.doc_ids[b, k])
                both_prefix = spec.prefix is not None and bool(spec.prefix[b, q]) and bool(spec.prefix[b, k])
                out[b, 0, q, k] = same_doc and (k <= q or both_prefix)
    return out


# ----------------------------------------------------------------------------------------------- shapes


def test_logits_shape_and_scalar_loss():
    model = make_model()
    tokens = torch.randint(0, 97, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, 97)
    assert logits.dtype == torch.float32
    loss = model(tokens, targets=torch.randint(0, 97, (3, 10)))
    assert loss.shape == ()
    # Small init gives near-uniform predictions, so the loss starts near ln(V).
    assert abs(loss.item() - math.log(97)) < 0.1


def test_gqa_projection_shapes_and_forward():
    model = make_model(n_heads=8, n_kv_heads=2)
    attn = model.layers["0"].attention
    assert attn.wq.weight.shape == (8 * 8, 64)
    assert attn.wk.weight.shape == (2 * 8, 64)
    assert attn.wv.weight.shape == (2 * 8, 64)
    assert attn.wo.weight.shape == (64, 8 * 8)
    logits = model(torch.randint(0, 97, (2, 12)))
    assert logits.shape == (2, 12, 97)
    assert torch.isfinite(logits).all()


def test_tied_embeddings_share_one_parameter():
    tied = make_model(tie_embeddings=True)
    untied = make_model(tie_embeddings=False)
    assert tied.output.weight is tied.tok_embeddings.weight
    assert untied.output.weight is not untied.tok_embeddings.weight
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == 97 * 64
    assert len([p for p in tied.parameters() if p is tied.tok_embeddings.weight]) == 1


# ----------------------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_dense_mask_matches_documented_rule(kind):
    spec = make_spec(kind)
    dense = spec.dense(T, CPU)
    expected = loop_mask(spec, B, T)
    assert dense.dtype == torch.bool
    assert dense.dim() == 4 and dense.shape[1:] == (1, T, T)
    assert torch.equal(dense.expand(B, 1, T, T), expected)


def test_dense_mask_contents_by_hand():
    # Row 0: documents [0, 0, 0, 1, 1], prefix covers the first 2 positions.
    spec = MaskSpec(doc_ids=torch.tensor([[0, 0, 0, 1, 1]]), prefix=torch.tensor([[True, True, False, False, False]]))
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(spec.dense(5, CPU)[0, 0], expected)


@pytest.mark.parametrize("n_kv_heads", [4, 2])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_attend_matches_reference(kind, backend, n_kv_heads):
    g = torch.Generator().manual_seed(1)
    n_heads, head_dim = 4, 16
    q = torch.randn(B, n_heads, T, head_dim, generator=g)
    k = torch.randn(B, n_kv_heads, T, head_dim, generator=g)
    v = torch.randn(B, n_kv_heads, T, head_dim, generator=g)
    spec = make_spec(kind)
    expected = reference_attention(q, k, v, spec.dense(T, CPU))
    mask = PreparedMask(spec, backend, T, CPU)
    with torch.no_grad():
        out = attend(q, k, v, mask)
    assert out.shape == (B, n_heads, T, head_dim)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_differs_between_mask_kinds():
    # Guards the test above: the mask kinds must actually produce different attention on this data.
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, 4, T, 16, generator=g) for _ in range(3))
    outs = [reference_attention(q, k, v, make_spec(kind).dense(T, CPU)) for kind in MASK_KINDS]
    for i in range(len(outs)):
        for j in range(i + 1, len(outs)):
            assert (outs[i] - outs[j]).abs().max() > 1e-2, (MASK_KINDS[i], MASK_KINDS[j])


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_attend_gradients_match_reference(backend):
    g = torch.Generator().manual_seed(2)
    spec = make_spec("prefix+document")
    q = torch.randn(B, 4, T, 16, generator=g, dtype=torch.float64)
    k = torch.randn(B, 2, T, 16, generator=g, dtype=torch.float64)
    v = torch.randn(B, 2, T, 16, generator=g, dtype=torch.float64)
    w = torch.randn(B, 4, T, 16, generator=g, dtype=torch.float64)

    def grads(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        (fn(*leaves) * w.to(dtype)).sum().backward()
        return [t.grad.double() for t in leaves]

    mask = PreparedMask(spec, backend, T, CPU)
    got = grads(lambda a, b, c: attend(a, b, c, mask), torch.float32)
    want = grads(lambda a, b, c: reference_attention(a, b, c, spec.dense(T, CPU)), torch.float64)
    for g_got, g_want in zip(got, want):
        torch.testing.assert_close(g_got, g_want, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------ model-level masks


def packed_tokens() -> torch.Tensor:
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_document_mask_isolates_documents(backend):
    model = make_model()
    model.attention_backend = backend
    doc_ids = doc_ids_from_lengths(DOC_LENGTHS)
    tokens = packed_tokens()
    changed = tokens.clone()
    in_doc1 = doc_ids == 1
    changed[in_doc1] = (tokens[in_doc1] + 1) % 97
    with torch.no_grad():
        delta = (model(changed, doc_ids=doc_ids) - model(tokens, doc_ids=doc_ids)).abs().amax(dim=-1)
        delta_plain = (model(changed) - model(tokens)).abs().amax(dim=-1)
    for row, lengths in enumerate(DOC_LENGTHS):
        doc0, doc1, rest = slice(0, lengths[0]), slice(lengths[0], sum(lengths[:2])), slice(sum(lengths[:2]), T)
        # Document 0 never sees document 1 (it comes first, and it is another document).
        assert delta[row, doc0].max() < 1e-6
        assert delta_plain[row, doc0].max() < 1e-6
        # Document 1 itself changes.
        assert delta[row, doc1].min() > 1e-3
        # Later documents are blind to document 1 under the document mask, and see it without.
        assert delta[row, rest].max() < 1e-6
        assert delta_plain[row, rest].min() > 1e-4


@pytest.mark.parametrize("reset_positions", [True, False])
def test_packed_documents_match_separate_runs(reset_positions):
    model = make_model()
    lengths = DOC_LENGTHS[0]
    doc_ids = doc_ids_from_lengths([lengths])
    # Rotary embeddings only see relative offsets, so with the document mask the positions may restart at each
    # document or run on across the row: either way each document is computed as if it stood alone.
    positions = torch.cat([torch.arange(n) for n in lengths])[None] if reset_positions else None
    tokens = packed_tokens()[:1]
    with torch.no_grad():
        packed = model(tokens, doc_ids=doc_ids, positions=positions)
        unmasked = model(tokens, positions=positions)
        start = 0
        for i, n in enumerate(lengths):
            alone = model(tokens[:, start : start + n])
            torch.testing.assert_close(packed[:, start : start + n], alone, atol=1e-5, rtol=1e-5)
            if i > 0:  # without the document mask, later documents see the earlier ones
                assert (unmasked[:, start : start + n] - alone).abs().max() > 1e-3
            start += n


def test_default_positions_equal_explicit_arange():
    model = make_model()
    tokens = packed_tokens()
    with torch.no_grad():
        default = model(tokens)
        explicit = model(tokens, positions=torch.arange(T).expand(B, T))
    torch.testing.assert_close(explicit, default, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_later_tokens_do_not_affect_earlier_logits(backend):
    model = make_model()
    model.attention_backend = backend
    tokens = packed_tokens()
    t = 15
    changed = tokens.clone()
    changed[:, t] = (tokens[:, t] + 1) % 97
    with torch.no_grad():
        base, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :t], base[:, :t], atol=1e-6, rtol=0)
    assert (after[:, t:] - base[:, t:]).abs().amax(dim=(1, 2)).min() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_positions_see_later_prefix_tokens(backend):
    model = make_model()
    model.attention_backend = backend
    prefix = prefix_from_lengths(PREFIX_LENGTHS)
    tokens = packed_tokens()
    changed = tokens.clone()
    for row, n in enumerate(PREFIX_LENGTHS):
        changed[row, n - 1] = (tokens[row, n - 1] + 1) % 97  # the last prefix token
    with torch.no_grad():
        base, after = model(tokens, prefix=prefix), model(changed, prefix=prefix)
        base_causal, after_causal = model(tokens), model(changed)
    for row, n in enumerate(PREFIX_LENGTHS):
        # Every earlier prefix position sees the change under prefix-LM...
        assert (after[row, : n - 1] - base[row, : n - 1]).abs().amax(dim=-1).min() > 1e-4
        # ...and none of them does under the plain causal mask.
        torch.testing.assert_close(after_causal[row, : n - 1], base_causal[row, : n - 1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_positions_do_not_see_tokens_after_the_prefix(backend):
    model = make_model()
    model.attention_backend = backend
    prefix = prefix_from_lengths(PREFIX_LENGTHS)
    tokens = packed_tokens()
    changed = tokens.clone()
    for row, n in enumerate(PREFIX_LENGTHS):
        changed[row, n] = (tokens[row, n] + 1) % 97  # the first position after the prefix
    with torch.no_grad():
        base, after = model(tokens, prefix=prefix), model(changed, prefix=prefix)
    for row, n in enumerate(PREFIX_LENGTHS):
        torch.testing.assert_close(after[row, :n], base[row, :n], atol=1e-6, rtol=0)
        assert (after[row, n] - base[row, n]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------ backend agreement


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_backends_give_same_logits(kind):
    model = make_model(qk_norm=True)
    spec = make_spec(kind)
    tokens = packed_tokens()
    logits = {}
    with torch.no_grad():
        for backend in BACKENDS:
            model.attention_backend = backend
            logits[backend] = model(tokens, doc_ids=spec.doc_ids, prefix=spec.prefix)
    assert logits["sdpa"].abs().max() > 0.1
    torch.testing.assert_close(logits["eager"], logits["sdpa"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["flex"], logits["sdpa"], atol=1e-5, rtol=1e-5)


def test_sdpa_and_eager_give_same_loss_and_gradients():
    spec = make_spec("prefix+document")
    tokens = packed_tokens()
    targets = torch.roll(tokens, -1, dims=1)
    results = {}
    for backend in ["sdpa", "eager"]:
        model = make_model(seed=4)
        model.attention_backend = backend
        loss = model(tokens, targets=targets, doc_ids=spec.doc_ids, prefix=spec.prefix)
        loss.backward()
        results[backend] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(results["eager"][0], results["sdpa"][0], atol=1e-6, rtol=1e-6)
    for name, grad in results["sdpa"][1].items():
        torch.testing.assert_close(results["eager"][1][name], grad, atol=1e-6, rtol=1e-4, msg=name)


# ----------------------------------------------------------------------------------------------- RoPE


HEAD_DIM = 32
TABLE = rope_table(HEAD_DIM, 128, 10000.0)


def rope_at(x: torch.Tensor, pos: int) -> torch.Tensor:
    """Rotate one (D,) vector to position `pos`."""
    return apply_rope(x.view(1, 1, 1, -1), TABLE[pos : pos + 1]).view(-1)


def test_rope_table_shape_and_values():
    assert TABLE.shape == (128, HEAD_DIM)
    assert TABLE.dtype == torch.float32
    inv_freq = [10000.0 ** (-2 * i / HEAD_DIM) for i in range(HEAD_DIM // 2)]
    for pos in (0, 1, 5, 63):
        expected = [math.cos(pos * f) for f in inv_freq] + [math.sin(pos * f) for f in inv_freq]
        torch.testing.assert_close(TABLE[pos], torch.tensor(expected), atol=1e-6, rtol=0)


def test_rope_position_zero_is_identity():
    x = torch.randn(2, 5, 3, HEAD_DIM)
    out = apply_rope(x, TABLE[:1].expand(5, HEAD_DIM))
    torch.testing.assert_close(out, x, atol=0, rtol=0)


def test_rope_preserves_norm():
    x = torch.randn(2, 40, 3, HEAD_DIM)
    out = apply_rope(x, TABLE[:40])
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[:, 1:], x[:, 1:], atol=1e-3)


def test_rope_dot_product_depends_only_on_relative_position():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(HEAD_DIM, generator=g), torch.randn(HEAD_DIM, generator=g)
    for diff in (0, 1, 3, 17, -4):
        pairs = [(m, m - diff) for m in (20, 25, 33, 50, 60)]
        dots = [torch.dot(rope_at(q, m), rope_at(k, n)).item() for m, n in pairs]
        for d in dots[1:]:
            assert d == pytest.approx(dots[0], abs=1e-4)
    # Different offsets give different dot products.
    by_diff = [torch.dot(rope_at(q, 30), rope_at(k, 30 - diff)).item() for diff in (0, 1, 2, 5)]
    assert len({round(d, 3) for d in by_diff}) == len(by_diff)


def test_rope_different_positions_give_different_results():
    x = torch.randn(HEAD_DIM)
    outs = [rope_at(x, pos) for pos in (0, 1, 2, 10, 63)]
    for i in range(len(outs)):
        for j in range(i + 1, len(outs)):
            assert (outs[i] - outs[j]).abs().max() > 1e-3


def test_rope_matches_rotate_half_formula():
    # Hugging Face Llama layout: x * cos + rotate_half(x) * sin, with cos/sin repeated over both halves.
    x = torch.randn(2, 10, 3, HEAD_DIM)
    half = HEAD_DIM // 2
    cos = torch.cat([TABLE[:10, :half]] * 2, dim=-1)[None, :, None]
    sin = torch.cat([TABLE[:10, half:]] * 2, dim=-1)[None, :, None]
    rotate_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    torch.testing.assert_close(apply_rope(x, TABLE[:10]), x * cos + rotate_half * sin, atol=1e-6, rtol=1e-6)


def test_rope_per_row_table():
    x = torch.randn(2, 6, 3, HEAD_DIM)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 0, 1, 2]])
    out = apply_rope(x, TABLE[positions])
    torch.testing.assert_close(out[0], apply_rope(x[:1], TABLE[:6])[0], atol=0, rtol=0)
    for t, pos in enumerate(positions[1].tolist()):
        torch.testing.assert_close(out[1, t], apply_rope(x[1:2, t : t + 1], TABLE[pos : pos + 1])[0, 0])


def test_partial_rope_turns_the_first_dimensions_and_passes_the_rest():
    """`rope_fraction` (GLM-4.5's partial_rotary_factor): the first rope_dims of each head turn as a head of
    that size would, over frequencies of that size; the rest pass through untouched."""
    args = ModelArgs(dim=64, n_heads=2, rope_fraction=0.25, max_seq_len=16)
    assert args.rope_dims == 8
    table = model_rope_table(args)
    assert table.shape == (16, 8)
    torch.testing.assert_close(table, rope_table(8, 16, args.rope_theta), atol=0, rtol=0)
    x = torch.randn(2, 16, 3, 32)
    out = apply_rope(x, table)
    torch.testing.assert_close(out[..., :8], apply_rope(x[..., :8], table), atol=0, rtol=0)
    torch.testing.assert_close(out[..., 8:], x[..., 8:], atol=0, rtol=0)
    with pytest.raises(ValueError, match="model.rope_fraction = 0.1 must be in"):
        ModelArgs(dim=64, n_heads=2, rope_fraction=0.1)


# ------------------------------------------------------------------------------ fp16 overflow in eager


def test_fp16_matmul_works_on_cpu():
    a = torch.randn(8, 16)
    b = torch.randn(16, 8)
    out = a.half() @ b.half()
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), a @ b, atol=2e-2, rtol=1e-2)


def test_eager_attention_split_scale_avoids_fp16_overflow():
    # head_dim 16: the scale 16^-1/2 = 1/4 splits into 1/2 on q and 1/2 on k, both exact in fp16.
    head_dim, seq = 16, 12
    g = torch.Generator().manual_seed(6)
    signs_q = torch.randint(0, 2, (1, 2, seq, head_dim), generator=g) * 2 - 1
    signs_k = torch.randint(0, 2, (1, 2, seq, head_dim), generator=g) * 2 - 1
    signs_k[..., ::3, :] = signs_q[..., ::3, :]  # some keys equal their query: q·k = 64*64*16
    q = (64.0 * signs_q).half()
    k = (64.0 * signs_k).half()
    v = torch.randn(1, 2, seq, head_dim, generator=g).half()
    allowed = MaskSpec().dense(seq, CPU)

    raw = q.double() @ k.double().transpose(-2, -1)
    assert raw.abs().max() > 65504  # q·k itself does not fit in fp16...
    assert (raw / math.sqrt(head_dim)).abs().max() < 65504  # ...but q·k / sqrt(d) does

    # The naive order, q @ k^T in fp16 and then the scale, overflows.
    naive_scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    assert torch.isinf(naive_scores).any()
    naive = naive_scores.float().masked_fill(~allowed, float("-inf")).softmax(-1).half() @ v
    assert not torch.isfinite(naive).all()

    out = eager_attention(q, k, v, allowed)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()
    expected = reference_attention(q, k, v, allowed)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


def test_eager_attention_fp16_matches_reference_on_ordinary_inputs():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, T, 16, generator=g).half() for _ in range(3))
    allowed = make_spec("prefix+document").dense(T, CPU)
    out = eager_attention(q, k, v, allowed)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, allowed), atol=1e-2, rtol=1e-2)


# ------------------------------------------------------------------------------------- parameter counts

COUNT_ARGS = {"vocab_size": 100, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}


def hand_counts(tie: bool, qk_norm: bool) -> dict[str, int]:
    vocab, dim, layers, head_dim, kv_dim, ffn = 100, 64, 2, 16, 2 * 16, 128
    embedding = vocab * dim  # 6400
    per_layer = (
        dim * dim  # wq: 4096
        + dim * kv_dim  # wk: 2048
        + dim * kv_dim  # wv: 2048
        + dim * dim  # wo: 4096
        + 3 * dim * ffn  # w1, w3, w2: 24576
        + 2 * dim  # attention_norm, ffn_norm: 128
        + (2 * head_dim if qk_norm else 0)  # q_norm, k_norm: 32
    )
    final_norm = dim
    head = 0 if tie else vocab * dim
    non_embedding = layers * per_layer + final_norm + head
    return {
        "total": embedding + non_embedding,
        "embedding": embedding,
        "non_embedding": non_embedding,
        "matmul": non_embedding + (embedding if tie else 0),
    }


def test_hand_counts_spelled_out():
    # Untied, no qk-norm: per layer 4096 + 2048 + 2048 + 4096 + 24576 + 128 = 36992.
    assert hand_counts(tie=False, qk_norm=False) == {
        "total": 6400 + 2 * 36992 + 64 + 6400,  # 86848
        "embedding": 6400,
        "non_embedding": 2 * 36992 + 64 + 6400,  # 80448
        "matmul": 80448,
    }
    assert hand_counts(tie=False, qk_norm=False)["total"] == 86848


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_count_params_matches_hand_arithmetic_and_model(tie, qk_norm):
    args = ModelArgs(**COUNT_ARGS, tie_embeddings=tie, qk_norm=qk_norm)
    counts = count_params(args)
    expected = hand_counts(tie, qk_norm)
    assert counts.total == expected["total"]
    assert counts.embedding == expected["embedding"]
    assert counts.non_embedding == expected["non_embedding"]
    assert counts.matmul == expected["matmul"]
    assert counts.total == counts.embedding + counts.non_embedding

    model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == counts.total
    assert model.tok_embeddings.weight.numel() == counts.embedding


def test_count_params_literal_values():
    assert count_params(ModelArgs(**COUNT_ARGS)).total == 86848
    tied = count_params(ModelArgs(**COUNT_ARGS, tie_embeddings=True))
    assert (tied.total, tied.embedding, tied.non_embedding, tied.matmul) == (80448, 6400, 74048, 80448)
    assert count_params(ModelArgs(**COUNT_ARGS, qk_norm=True)).total == 86848 + 2 * 2 * 16


@pytest.mark.parametrize("tie", [False, True])
def test_flops_per_token_by_hand(tie):
    args = ModelArgs(**COUNT_ARGS, tie_embeddings=tie)
    seq_len = 32
    matmul = 80448  # equal tied or not: the head's matmul counts once either way
    layers, heads, head_dim = 2, 4, 16
    expected = 6 * matmul + 12 * layers * heads * head_dim * seq_len  # 482688 + 49152
    assert expected == 531840
    assert flops_per_token(args, seq_len) == expected
    # The attention term grows linearly with the sequence length.
    assert flops_per_token(args, 2 * seq_len) - flops_per_token(args, seq_len) == 12 * layers * heads * head_dim * 32


@pytest.mark.parametrize("dim", [64, 96, 100, 128, 200, 256, 512, 768, 1000, 4096])
@pytest.mark.parametrize("multiple_of", [8, 32, 64, 256])
def test_derived_ffn_dim_rule(dim, multiple_of):
    args = ModelArgs(dim=dim, n_heads=4, ffn_multiple_of=multiple_of)
    # 8/3 * dim rounded up to a multiple of ffn_multiple_of, in exact integer arithmetic.
    expected = multiple_of * -(-8 * dim // (3 * multiple_of))
    assert args.ffn_dim == expected
    assert args.ffn_dim % multiple_of == 0
    assert 8 * dim / 3 <= args.ffn_dim < 8 * dim / 3 + multiple_of


def test_derived_ffn_dim_known_values():
    assert ModelArgs(dim=4096, n_heads=32, ffn_multiple_of=256).ffn_dim == 11008  # Llama 7B
    assert ModelArgs(dim=64, ffn_multiple_of=64).ffn_dim == 192
    assert ModelArgs(dim=64, ffn_dim=100).ffn_dim == 100  # an explicit value is kept
    assert ModelArgs(n_heads=8).n_kv_heads == 8  # n_kv_heads 0 means plain multi-head attention


# ----------------------------------------------------------------------------------------------- init


def test_init_scales_residual_projections():
    n_layers, init_std = 8, 0.02
    torch.manual_seed(8)
    model = Transformer(ModelArgs(vocab_size=256, dim=128, n_layers=n_layers, n_heads=4, ffn_dim=256, max_seq_len=16))
    out_std = init_std / math.sqrt(2 * n_layers)  # 0.005
    for name, module in model.layers.items():
        attn, ffn = module.attention, module.feed_forward
        for w in (attn.wq, attn.wk, attn.wv, ffn.w1, ffn.w3):
            assert w.weight.std().item() == pytest.approx(init_std, rel=0.03), name
        for w in (attn.wo, ffn.w2):
            assert w.weight.std().item() == pytest.approx(out_std, rel=0.03), name
            assert abs(w.weight.mean().item()) < 0.05 * out_std
    assert model.tok_embeddings.weight.std().item() == pytest.approx(init_std, rel=0.03)
    assert model.output.weight.std().item() == pytest.approx(init_std, rel=0.03)


def test_init_norms_are_ones():
    model = make_model(qk_norm=True)
    norms = [n for n, _ in model.named_parameters() if n.endswith("norm.weight")]
    # attention_norm, ffn_norm, q_norm, k_norm per layer, plus the final norm.
    assert len(norms) == 2 * 4 + 1
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name


def test_init_weights_resets_a_modified_model():
    model = make_model(qk_norm=True)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)
        model.rope.zero_()
    model.init_weights()
    assert torch.equal(model.norm.weight, torch.ones(64))
    assert model.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
    torch.testing.assert_close(model.rope, rope_table(16, 64, 10000.0), atol=0, rtol=0)


# --------------------------------------------------------------------------------------------- z-loss


def hand_loss(logits: torch.Tensor, targets: torch.Tensor, z: float) -> torch.Tensor:
    logits = logits.double().reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    ce_terms, z_terms = [], []
    for row, t in zip(logits, targets.tolist()):
        if t == -1:
            continue
        lse = torch.log(torch.exp(row - row.max()).sum()) + row.max()
        ce_terms.append(lse - row[t])
        z_terms.append(lse**2)
    return torch.stack(ce_terms).mean() + z * torch.stack(z_terms).mean()


@pytest.mark.parametrize("z", [0.0, 1e-4, 0.1])
def test_lm_loss_matches_hand_computation(z):
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 7, 11, generator=g) * 3 + 2
    targets = torch.randint(0, 11, (3, 7), generator=g)
    targets[0, :3] = -1
    targets[2, 6] = -1
    loss = lm_loss(logits, targets, z_loss=z)
    assert loss.shape == ()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), hand_loss(logits, targets, z), atol=1e-5, rtol=1e-6)


def test_z_loss_term_is_active():
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(2, 5, 11, generator=g) + 4  # logsumexp well away from 0
    targets = torch.randint(0, 11, (2, 5), generator=g)
    diff = lm_loss(logits, targets, z_loss=0.5) - lm_loss(logits, targets)
    lse = torch.logsumexp(logits.double(), dim=-1)
    assert diff.item() == pytest.approx(0.5 * lse.pow(2).mean().item(), rel=1e-5)
    assert diff.item() > 1.0


def test_lm_loss_ignores_minus_one_targets():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 6, 11, generator=g)
    targets = torch.randint(0, 11, (2, 6), generator=g)
    targets[:, 4:] = -1
    perturbed = logits.clone()
    perturbed[:, 4:] += torch.randn(2, 2, 11, generator=g) * 10
    for z in (0.0, 0.1):
        a = lm_loss(logits, targets, z_loss=z)
        torch.testing.assert_close(lm_loss(perturbed, targets, z_loss=z), a, atol=1e-7, rtol=0)
        # Equal to the loss over the kept positions alone.
        torch.testing.assert_close(a, lm_loss(logits[:, :4], targets[:, :4], z_loss=z))


def test_model_applies_configured_z_loss():
    model = make_model(z_loss=1e-2)
    tokens = packed_tokens()
    targets = torch.roll(tokens, -1, dims=1)
    targets[:, -1] = -1
    with torch.no_grad():
        logits = model(tokens)
        loss = model(tokens, targets=targets)
    torch.testing.assert_close(loss, lm_loss(logits, targets, z_loss=1e-2))
    assert loss.item() > lm_loss(logits, targets).item()


# ---------------------------------------------------------------------------------------------- grads


@pytest.mark.parametrize(
    "overrides, kind",
    [
        ({}, "causal"),
        ({"qk_norm": True}, "prefix+document"),
        ({"tie_embeddings": True, "qk_norm": True, "z_loss": 1e-3}, "document"),
    ],
    ids=["plain-causal", "qk_norm-prefix+document", "tied+qk_norm+z_loss-document"],
)
def test_every_parameter_gets_a_finite_nonzero_gradient(overrides, kind):
    model = make_model(**overrides)
    spec = make_spec(kind)
    tokens = packed_tokens()
    targets = torch.roll(tokens, -1, dims=1)
    loss = model(tokens, targets=targets, doc_ids=spec.doc_ids, prefix=spec.prefix)
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    if overrides.get("qk_norm"):
        assert any("q_norm" in n for n in names) and any("k_norm" in n for n in names)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name
