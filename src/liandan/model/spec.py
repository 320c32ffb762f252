"""A model family's spec: what the rest of liandan needs to know about a model, in one object.

The trainer builds the model through the spec, `train/parallelize.py` takes its tensor-parallel plan and its
block container from it, the planner its parameter and FLOP counts and its per-rank parameter split, and the
Hugging Face interchange its names and config translation. None of them names a layer of a particular model.
A family is chosen by `[model] family` and registered as a plug-in (`liandan.plugins`, kind "model_family"),
with the dataclass of its own config keys (`[model.<family>]`); Llama is liandan's own (Qwen3-style qk-norm is
a Llama variant, told apart by the Hugging Face adapter).

A family's module is a plain `nn.Module` (no parallelism) that keeps its args as `.args`, returns logits from
`forward(tokens)` and the mean loss from `forward(tokens, targets, doc_ids=...)`, keeps its repeated blocks as
the children of one container attribute (`ModelSpec.blocks`), and may offer
`configure_attention(device, training=True) -> str` to pick an attention kernel.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from liandan import plugins
from liandan.config import Config, ConfigError, ModelSection


@dataclass(frozen=True)
class ParamCounts:
    """A model's parameters. Of a mixture of experts only some are used per token: `active` counts the
    routed experts' weights at top_k / experts (what a token goes through: its top_k experts, the shared
    experts and the router whole); a dense model's active counts equal its totals."""

    total: int
    embedding: int  # the input token table (shared with the head when tied)
    non_embedding: int
    matmul: int  # parameters used in a matmul: all but the input lookup, which counts when tied
    active: int = -1  # parameters a token goes through; -1: all of them (a dense model)
    active_matmul: int = -1  # of `matmul`, those a token's matmuls use: the N of 6N FLOPs per token

    def __post_init__(self) -> None:
        if self.active < 0:
            object.__setattr__(self, "active", self.total)
        if self.active_matmul < 0:
            object.__setattr__(self, "active_matmul", self.matmul)

    @property
    def sparse(self) -> bool:
        return self.active != self.total


@dataclass(frozen=True)
class ParamSplit:
    """Parameters one tensor-parallel rank holds, before any data-parallel sharding."""

    n_layers: int
    block: int  # one repeated block (its tensor-parallel matrices / tp, what stays replicated whole); the
    # largest where blocks differ (a MoE model's dense first layers): what FSDP2 gathers at a time
    root: int  # the rest, which FSDP2 wraps as the root unit (for Llama: embedding, final norm, head)
    matmul: int  # of all these, the weights used in matmuls (the ones autocast copies to bf16)
    blocks: int = -1  # every block together where they differ; -1: n_layers * block

    @property
    def total(self) -> int:
        return (self.blocks if self.blocks >= 0 else self.n_layers * self.block) + self.root


@dataclass(frozen=True)
class TensorParallelPlan:
    """Module name -> `torch.distributed.tensor.parallel` style, for `parallelize_module`."""

    top: dict[str, Any]  # names under the model itself (embedding, head)
    block: dict[str, Any]  # names under each block of the block container
    # block name -> the plan of that block where it differs from `block` (a MoE block's feed-forward)
    blocks: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Stacked:
    """A liandan tensor that Hugging Face checkpoints store as several: `names[i]` holds its slice `[i]` (a MoE
    layer's experts, stacked on their first dimension in liandan, one tensor per expert on the Hub)."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class HFAdapter:
    """How a family's weights and config move to and from Hugging Face `transformers`."""

    architectures: dict[str, str]  # HF model_type -> architecture class this family reads and writes
    to_hf_name: Callable[[str], str]  # liandan state-dict key -> HF key (KeyError for a key it does not know)
    config: Callable[[Any, str, int | None], dict]  # (args, dtype name, eos id) -> config.json
    args_from_config: Callable[[dict, str], Any]  # (config.json, where) -> args, or a ValueError naming the field
    ignored_suffixes: tuple[str, ...] = ()  # HF tensors skipped on import (buffers recomputed from the config)
    # (config.json, HF tensor name) -> whether import passes over a tensor the model has no place for (layers
    # transformers does not use either, as GLM-4.5's multi-token prediction)
    skipped: Callable[[dict, str], bool] = lambda config, name: False
    fp32_suffixes: tuple[str, ...] = ()  # HF tensors written in fp32 whatever the export dtype (as HF keeps them)
    notes: Callable[[dict], list[str]] = lambda config: []  # config.json -> lines the import should print
    # (args, state dict without tied keys) -> the tensors to write: folds multipliers HF has no place for
    export_weights: Callable[[Any, dict], dict] = lambda args, tensors: tensors
    # args -> where each stored (untied) liandan key goes, when not all go one to one by `to_hf_name`: an HF
    # name, a `Stacked` of names, or None where HF stores nothing (a buffer that must then be zero: it is
    # zero on import, and an export of another value is refused)
    tensor_names: Callable[[Any], dict[str, str | Stacked | None]] | None = None


def _no_tp_check(args: Any, tp: int) -> str | None:
    return None


def _untied(args: Any) -> dict[str, str]:
    return {}


def _no_function_fields(args: Any) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class ModelSpec:
    """One model family. Functions take the family's args (an instance of `args_type`)."""

    name: str
    args_type: type
    args_from_config: Callable[[ModelSection, int], Any]  # ([model] section, vocabulary size) -> args
    build: Callable[[Any], Any]  # args -> a plain nn.Module, initialised
    state_shapes: Callable[[Any], dict[str, tuple[int, ...]]]  # every state-dict key, in order, and its shape
    count_params: Callable[[Any], ParamCounts]
    flops_per_token: Callable[[Any, int], float]  # (args, sequence length) -> training FLOPs per token
    param_split: Callable[[Any, int], ParamSplit]  # (args, tp) -> what one tensor-parallel rank holds
    shape_fields: tuple[str, ...]  # args fields that change the state dict's keys or shapes
    # args -> the fields that change what the model computes without changing its shapes (RoPE base, norm
    # epsilon): weights from a checkpoint must have been trained under the same values
    function_fields: Callable[[Any], tuple[str, ...]] = _no_function_fields
    # args -> the shape fields no tensor of a model of these args depends on (Llama's dense feed-forward width
    # when every block has routed experts): two models that both leave one unused may differ in it
    unused_fields: Callable[[Any], tuple[str, ...]] = _no_function_fields
    tied: Callable[[Any], dict[str, str]] = _untied  # key -> the key whose tensor it shares
    tie_setting: str = ""  # the args field that ties them, for messages
    # (args, *, loss_parallel, sequence_parallel) -> the plan; None: no tensor parallelism. With loss_parallel
    # the head's output is a DTensor split over the vocabulary (`liandan.model.loss.lm_loss` reduces it).
    tp_plan: Callable[..., TensorParallelPlan] | None = None
    tp_check: Callable[[Any, int], str | None] = _no_tp_check  # why `tp` cannot split this model, or None
    blocks: str = "layers"  # the container of repeated blocks: one FSDP2 unit and one recomputation unit each
    compiled_methods: tuple[str, ...] = ()  # methods compiled on their own when blocks are compiled one by one
    # Pipeline stages (liandan.train.pipeline_split): the top-level modules only the first stage keeps (what
    # turns tokens into the blocks' input) and only the last keeps (what turns the blocks' output into the
    # loss); a stage without them runs on hidden states. Both empty: the family cannot be pipelined.
    pipeline_first: tuple[str, ...] = ()
    pipeline_last: tuple[str, ...] = ()
    hf: HFAdapter | None = None
    head: str = "output"  # the module whose output is the logits, watched by the loss-spike guard
    # (block, its input activations, the rest of its forward's arguments) -> the largest attention logit of
    # the block's first sequence, for the guard's layer statistics; None: the family does not say
    attention_logit: Callable[[Any, Any, tuple], Any] | None = None
    # the dataclass of its `[model.<family>]` keys, when its registration does not name one (an entry point)
    options: type | None = None

    def differences(self, ours: Any, theirs: dict[str, Any], source: str = "checkpoint") -> list[str]:
        """How a checkpoint's args (`theirs`, as saved in its metadata; fields it lacks take their defaults)
        differ from `ours` in shape or function, one 'model.FIELD = OURS (SOURCE: THEIRS)' each. A shape
        field that neither model uses is not compared."""
        known = {f.name for f in dataclasses.fields(self.args_type)}
        try:
            their_args = self.args_type(**{k: v for k, v in theirs.items() if k in known})
        except (TypeError, ValueError) as err:
            return [f"the {source}'s model arguments do not make a {self.name} model: {err}"]
        mine, full = dataclasses.asdict(ours), dataclasses.asdict(their_args)
        unused = set(self.unused_fields(ours)) & set(self.unused_fields(their_args))
        fields = dict.fromkeys(self.shape_fields + self.function_fields(ours) + self.function_fields(their_args))
        return [
            f"model.{k} = {mine[k]} ({source}: {full[k]})" for k in fields if k not in unused and mine[k] != full[k]
        ]

    def tp_refusal(self, args: Any, tp: int) -> str | None:
        """Why a tensor-parallel degree of `tp` cannot split a model of `args` (one line), or None."""
        if tp <= 1:
            return None
        if self.tp_plan is None:
            return f"model.family = {self.name!r} has no tensor-parallel plan; use parallel.tp = 1"
        return self.tp_check(args, tp)


# ---------------------------------------------------------------------------------------------------------
# the registry


def register(spec: ModelSpec, options: type | None = None) -> ModelSpec:
    """Make a family available to `[model] family` from Python (a family in a package of its own registers
    through an entry point instead: `liandan.plugins`). `options`: the dataclass of its `[model.<family>]` keys.
    Each family has its own args type, by which functions given only args (the planner's, the Hugging Face
    interchange's) find it."""
    for other in specs():
        if other.args_type is spec.args_type and other.name != spec.name:
            raise ValueError(f"{spec.args_type.__name__} already belongs to model family {other.name!r}")
    try:
        plugins.register_object("model_family", spec.name, spec, options=options)
    except plugins.PluginError as err:
        raise ValueError(str(err)) from None
    return spec


def unregister(name: str) -> None:
    plugins.unregister("model_family", name)


def families() -> list[str]:
    return sorted(plugins.names("model_family"))


def specs() -> list[ModelSpec]:
    return [get(name) for name in families()]


def get(name: str) -> ModelSpec:
    """The spec of a family, or a one-line ConfigError listing the known ones."""
    try:
        return plugins.load("model_family", name, what="model.family")
    except plugins.PluginError as err:
        raise ConfigError(str(err)) from None


def spec_for(args: Any) -> ModelSpec:
    """The family whose args type `args` is."""
    for spec in specs():
        if type(args) is spec.args_type:
            return spec
    raise ValueError(f"no registered model family takes {type(args).__name__}; known: {', '.join(families())}")


# ---------------------------------------------------------------------------------------------------------
# what the rest of liandan calls


def padded_vocab(vocab_size: int, tokenizer_vocab: int) -> int:
    """`[model] vocab_size`, or the tokenizer's size rounded up to a multiple of 64 (aligned matmuls) when 0."""
    return vocab_size or 64 * math.ceil(tokenizer_vocab / 64)


def model_args(section: ModelSection, tokenizer_vocab: int) -> Any:
    """The args a `[model]` section describes, in its family's args type: the one place they are derived."""
    return get(section.family).args_from_config(section, padded_vocab(section.vocab_size, tokenizer_vocab))


def check_model_config(cfg: Config) -> ModelSpec:
    """The checks of a run's config that its model family decides, before anything starts: the family is
    registered, and its spec can split the model over `parallel.tp` ranks. A one-line ConfigError otherwise;
    `config.py` checks only what holds for every family. Returns the spec."""
    spec = get(cfg.model.family)
    # The vocabulary may wait for the tokenizer (model.vocab_size = 0): no family splits heads by it.
    refusal = spec.tp_refusal(model_args(cfg.model, 0), cfg.parallel.tp)
    if refusal:
        raise ConfigError(refusal)
    return spec


def build(args: Any) -> Any:
    """The plain model of `args`, of whatever family."""
    return spec_for(args).build(args)


def count_params(args: Any) -> ParamCounts:
    """Parameter counts from the shape alone, of whatever family."""
    return spec_for(args).count_params(args)


def flops_per_token(args: Any, seq_len: int) -> float:
    """Training FLOPs per token from the shape alone, of whatever family."""
    return spec_for(args).flops_per_token(args, seq_len)
