"""A model split into pipeline stages by its family's spec: which blocks each stage holds, which stages each
rank runs, and each stage as a copy of the whole model with every module it does not run removed.

Names do not change: a stage of Llama keeps `layers.5.attention.wq.weight` under that name, so a checkpoint
holds the same keys whatever the pipeline layout was and DCP reshards it across layouts (pp=2 to pp=1, four
stages to two), as torchtitan does by deleting layers from a meta-device copy of the model. The first stage
keeps what the spec's `pipeline_first` names (the embedding), the last what `pipeline_last` names (the final
norm and the head, whose loss it computes); the others run on hidden states (`Transformer.forward`).

Balanced splits weigh a block as one unit and the embedding and head by what they add in parameters and in
FLOPs against a block (the mean of the two shares), so the first and last stages get fewer blocks where the
vocabulary is large.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

from torch import nn

from liandan.model.spec import ModelSpec

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")
SINGLE_STAGE = ("gpipe", "1f1b")  # one stage per rank
V_SHAPED = ("zbv", "dualpipev")  # two stages per rank, the second on the way back: rank r holds r and 2p-1-r


def stage_layer_counts(n_layers: int, stages: int, given: Sequence[int] = (), first_extra: float = 0.0,
                       last_extra: float = 0.0) -> list[int]:  # fmt: skip
    """Blocks per stage: `given` (checked), or a balanced split of `n_layers` over `stages` where the first
    stage carries `first_extra` and the last `last_extra` blocks' worth of other work. ValueError (one line)
    when it cannot be done."""
    if given:
        if len(given) != stages or any(n < 1 for n in given) or sum(given) != n_layers:
            raise ValueError(
                f"parallel.pp_layers = {list(given)} must give {stages} stages (pp x pp_stages_per_rank) at least"
                f" one block each, {n_layers} blocks in all (model.n_layers)"
            )
        return list(given)
    if n_layers < stages:
        raise ValueError(
            f"model.n_layers = {n_layers} blocks cannot fill {stages} pipeline stages (pp x pp_stages_per_rank)"
        )
    total = n_layers + first_extra + last_extra
    # Stage k ends where the cumulative work reaches k / stages of the total, each stage keeping a block.
    ends = []
    for k in range(1, stages):
        end = round(k * total / stages - first_extra)
        ends.append(min(max(end, (ends[-1] if ends else 0) + 1), n_layers - (stages - k)))
    bounds = [0, *ends, n_layers]
    return [b - a for a, b in itertools.pairwise(bounds)]


def stage_extras(model: nn.Module, spec: ModelSpec, seq_len: int) -> tuple[float, float]:
    """The embedding's and the head's work in blocks: the mean of their share of parameters and of matmul
    FLOPs per token against the first block (6 per weight, and the block's attention over `seq_len`)."""
    blocks = list(getattr(model, spec.blocks).children())
    block_params = sum(p.numel() for p in blocks[0].parameters())
    dim = getattr(model.args, "dim", 0)
    block_flops = 6 * block_params + 6 * seq_len * dim  # causal attention: half of 12 * seq * dim

    def weight(names: Sequence[str], matmul: bool) -> float:
        params = sum(p.numel() for n in names for p in model.get_submodule(n).parameters())
        flops = 6 * params if matmul else 0
        return 0.5 * params / block_params + 0.5 * flops / block_flops

    return weight(spec.pipeline_first, matmul=False), weight(spec.pipeline_last, matmul=True)


def rank_stages(rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """The stage indices rank `rank` of `pp` runs: r, r+p, r+2p... (loop order), or r and 2p-1-r for the V
    schedules, whose last stage comes back to rank 0."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(per_rank)]


def stage_of_rank(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank that runs `stage`."""
    if schedule in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def pipeline_refusal(spec: ModelSpec, args, pp: int, per_rank: int, schedule: str) -> str | None:
    """Why the model or the schedule cannot be pipelined this way (one line), or None."""
    if schedule not in SCHEDULES:
        return f"parallel.pp_schedule = {schedule!r} is not one of {', '.join(SCHEDULES)}"
    if not (spec.pipeline_first or spec.pipeline_last):
        return f"model.family = {spec.name!r} does not say how to split it into stages; use parallel.pp = 1"
    if spec.tied(args):
        return (f"{spec.tie_setting or 'tied weights'} ties the first stage's embedding to the last stage's head;"
                " pipeline parallelism needs them untied")  # fmt: skip
    if schedule in SINGLE_STAGE and per_rank != 1:
        return (f"parallel.pp_schedule = {schedule} runs one stage per rank:"
                f" parallel.pp_stages_per_rank = {per_rank} must be 1")  # fmt: skip
    if schedule in V_SHAPED and per_rank != 2:
        return (f"parallel.pp_schedule = {schedule} runs two stages per rank in a V:"
                f" parallel.pp_stages_per_rank = {per_rank} must be 2")  # fmt: skip
    return None


def split_stage(model: nn.Module, spec: ModelSpec, layers: range, first: bool, last: bool) -> nn.Module:
    """`model` with only the blocks of `layers` (indices into its block container) and, on the first and last
    stages, the modules the spec puts there; in place, names unchanged."""
    blocks = getattr(model, spec.blocks)
    for index, name in enumerate(list(blocks.keys())):
        if index not in layers:
            del blocks[name]
    for name in () if first else spec.pipeline_first:
        setattr(model, name, None)
    for name in () if last else spec.pipeline_last:
        setattr(model, name, None)
    # Checkpoints keep a stage's optimizer state under parameter names (liandan.checkpoint.train_state).
    model.pipeline_stage = (layers.start, layers.stop)
    return model


def build_stages(model: nn.Module, spec: ModelSpec, counts: Sequence[int], stage_ids: Sequence[int]) -> list[nn.Module]:
    """This rank's stages, each a copy of `model` (the last one `model` itself) split to its blocks."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    stages = []
    for i, stage in enumerate(stage_ids):
        part = model if i == len(stage_ids) - 1 else copy.deepcopy(model)
        layers = range(starts[stage], starts[stage] + counts[stage])
        stages.append(split_stage(part, spec, layers, first=stage == 0, last=stage == len(counts) - 1))
    return stages
