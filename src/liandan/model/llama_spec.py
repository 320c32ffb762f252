"""The Llama family's spec: how its args come from `[model]`, its state-dict shapes, its tensor-parallel plan,
its counts and its Hugging Face adapter. Registered as the model family "llama" in `liandan.plugins`; its
config keys are `liandan.model.llama_options.LlamaOptions`."""

from __future__ import annotations

import dataclasses

from liandan.config import ModelSection
from liandan.model import counts, llama_hf
from liandan.model.llama import ModelArgs, Transformer, block_attention_logit
from liandan.model.spec import HFAdapter, ModelSpec, TensorParallelPlan

# ModelArgs fields that do not come from [model] under the same name: derived from the tokenizer.
DERIVED_FIELDS = ("vocab_size",)
SHAPE_FIELDS = (
    *("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim"),
    *("tie_embeddings", "qk_norm", "qkv_bias"),
    *("moe_experts", "moe_ffn_dim", "moe_shared_experts", "moe_dense_layers"),
)


def args_from_config(section: ModelSection, vocab_size: int) -> ModelArgs:
    """Every other ModelArgs field is the key of the same name in `[model.llama]` or, for `max_seq_len`, in
    `[model]` (tests/test_model_spec.py checks that they cannot drift apart)."""
    keys = {**dataclasses.asdict(section.options), "max_seq_len": section.max_seq_len}
    fields = {f.name: keys[f.name] for f in dataclasses.fields(ModelArgs) if f.name not in DERIVED_FIELDS}
    return ModelArgs(vocab_size=vocab_size, **fields)


def state_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every key of `Transformer(args).state_dict()`, in its order, and its shape (tied models list
    `output.weight` too)."""
    hd = args.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes[p + "attention_norm.weight"] = (args.dim,)
        for name, heads in (("wq", args.n_heads), ("wk", args.n_kv_heads), ("wv", args.n_kv_heads)):
            shapes[p + f"attention.{name}.weight"] = (heads * hd, args.dim)
            if args.qkv_bias:
                shapes[p + f"attention.{name}.bias"] = (heads * hd,)
        shapes[p + "attention.wo.weight"] = (args.dim, args.n_heads * hd)
        if args.qk_norm:
            shapes[p + "attention.q_norm.weight"] = (hd,)
            shapes[p + "attention.k_norm.weight"] = (hd,)
        shapes[p + "ffn_norm.weight"] = (args.dim,)
        if args.is_moe_layer(i):
            shapes.update(_moe_shapes(args, p + "feed_forward."))
            continue
        shapes[p + "feed_forward.w1.weight"] = (args.ffn_dim, args.dim)
        if args.mlp == "swiglu":
            shapes[p + "feed_forward.w3.weight"] = (args.ffn_dim, args.dim)
        shapes[p + "feed_forward.w2.weight"] = (args.dim, args.ffn_dim)
    shapes["norm.weight"] = (args.dim,)
    shapes["output.weight"] = (args.vocab_size, args.dim)
    return shapes


def _moe_shapes(args: ModelArgs, p: str) -> dict[str, tuple[int, ...]]:
    experts, hidden, d = args.moe_experts, args.moe_ffn_dim, args.dim
    shapes = {
        p + "router.expert_bias": (experts,),
        p + "router.gate.weight": (experts, d),
        p + "experts.w1": (experts, hidden, d),
        p + "experts.w2": (experts, d, hidden),
        p + "experts.w3": (experts, hidden, d),
    }
    if args.moe_shared_experts:
        shared = args.moe_shared_experts * hidden
        shapes[p + "shared_experts.w1.weight"] = (shared, d)
        shapes[p + "shared_experts.w3.weight"] = (shared, d)
        shapes[p + "shared_experts.w2.weight"] = (d, shared)
    return shapes


def function_fields(args: ModelArgs) -> tuple[str, ...]:
    """Fields that change what a model of the same shapes computes: weights trained under other values give
    another function (a wrong RoPE base or epsilon loads cleanly and quietly degrades the model). The
    rescaling's parameters count only when rescaling is on, the recipe options only when set (a model with
    or without them is named the same way as before they existed)."""
    scaling = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len")
    mup = ("parameterization", "mup_base_dim") if args.parameterization == "mup" else ()
    recipe = (("mlp",) if args.mlp != "swiglu" else ()) + (("logit_softcap",) if args.logit_softcap else ())
    recipe += ("rope_fraction",) if args.rope_fraction != 1.0 else ()
    moe = ("moe_top_k", "moe_score", "moe_route_norm", "moe_route_scale") if args.moe_experts else ()
    return (
        ("rope_theta", "norm_eps", "rope_scaling")
        + (scaling if args.rope_scaling != "none" else ())
        + mup
        + recipe
        + moe
    )


def unused_fields(args: ModelArgs) -> tuple[str, ...]:
    """Shape fields no tensor depends on: the dense feed-forward's width when every block has routed experts,
    the experts' fields in a dense model."""
    if not args.moe_experts:
        return ("moe_ffn_dim", "moe_shared_experts", "moe_dense_layers")
    return ("ffn_dim",) if args.moe_dense_layers == 0 else ()


def tied(args: ModelArgs) -> dict[str, str]:
    return {"output.weight": "tok_embeddings.weight"} if args.tie_embeddings else {}


def hf_tensor_names(args: ModelArgs) -> dict:
    """Where each stored key goes in a Hugging Face checkpoint (`llama_hf.tensor_names`)."""
    untied = [key for key in state_shapes(args) if key not in tied(args)]
    return llama_hf.tensor_names(args, untied)


def tp_plan(args: ModelArgs, *, loss_parallel: bool = False, sequence_parallel: bool = False) -> TensorParallelPlan:
    """Megatron-style: column-parallel q/k/v and w1/w3, row-parallel wo and w2, vocabulary-parallel
    embedding and column-parallel head. Each rank holds n_heads / tp heads.

    loss_parallel: the head's logits stay split over the vocabulary (a DTensor the loss reduces in place)
    instead of being gathered whole on every rank.
    sequence_parallel: between the tensor-parallel regions (the norms, the residual stream) activations are
    split over the sequence: the row-parallel outputs reduce-scatter instead of all-reducing, and each
    region's input is all-gathered back to whole sequences.
    qk-norm's per-head norms act on each rank's own heads: their weights are replicated DTensors whose
    input is marked as split over the heads, so their gradients are summed over the ranks.
    A tied head shares the embedding's table, which both styles split by rows (vocabulary) alike; the tie
    is restored after sharding (`apply_tp`).
    A MoE block's feed-forward (router, routed and shared experts) is not split: every rank of the group
    runs it whole on the same tokens, the whole sequences (under sequence parallelism its input is gathered
    and each rank keeps its own positions of the output), so its weights and their gradients are alike on
    every rank; FSDP2 and expert parallelism shard them over the data-parallel ranks."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    block = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
    }
    if args.mlp != "swiglu":
        del block["feed_forward.w3"]
    if sequence_parallel:
        top["norm"] = SequenceParallel()
        block["attention_norm"] = SequenceParallel()
        block["ffn_norm"] = SequenceParallel()
        # Attention takes (x, rope, mask, cache, layer): only x is gathered back to whole sequences.
        block["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None),
        )
        block["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if args.qk_norm:
        # q and k are (batch, seq, heads, head_dim) here, each rank holding its own heads (dimension 2).
        block["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        block["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    moe_block = {name: style for name, style in block.items() if not name.startswith("feed_forward")}
    if sequence_parallel:
        moe_block["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(Shard(1),),
        )
    moe = {str(i): moe_block for i in range(args.n_layers) if args.is_moe_layer(i)}
    return TensorParallelPlan(top=top, block=block, blocks=moe)


def tp_check(args: ModelArgs, tp: int) -> str | None:
    """The plan splits heads, so tp must divide both head counts; experts are not split by it."""
    if args.n_heads % tp or args.n_kv_heads % tp:
        return f"parallel.tp = {tp} must divide model.n_heads = {args.n_heads} and n_kv_heads = {args.n_kv_heads}"
    return None


LLAMA = ModelSpec(
    name="llama",
    args_type=ModelArgs,
    args_from_config=args_from_config,
    build=Transformer,
    state_shapes=state_shapes,
    count_params=counts.count_params,
    flops_per_token=counts.flops_per_token,
    param_split=counts.param_split,
    shape_fields=SHAPE_FIELDS,
    unused_fields=unused_fields,
    function_fields=function_fields,
    tied=tied,
    tie_setting="tie_embeddings",
    tp_plan=tp_plan,
    tp_check=tp_check,
    blocks="layers",
    compiled_methods=("head_loss",),
    pipeline_first=("tok_embeddings",),
    pipeline_last=("norm", "output"),
    attention_logit=block_attention_logit,
    hf=HFAdapter(
        architectures=llama_hf.ARCHITECTURES,
        to_hf_name=llama_hf.to_hf_name,
        config=llama_hf.hf_config,
        args_from_config=llama_hf.args_from_hf_config,
        ignored_suffixes=("rotary_emb.inv_freq",),  # a buffer some older checkpoints store
        skipped=llama_hf.skipped_tensor,
        fp32_suffixes=("e_score_correction_bias",),  # GLM-4.5's routing bias: transformers keeps it in fp32
        notes=llama_hf.import_notes,
        export_weights=llama_hf.export_weights,
        tensor_names=hf_tensor_names,
    ),
)
