"""Pipeline-parallel causal-LM pretraining as a train module, on `torch.distributed.pipelining`.

The model is split into `parallel.pp x parallel.pp_stages_per_rank` stages (`pipeline_split`); each rank
builds the whole model from the run's seed (on the meta device under `train.meta_init`), keeps its stages,
and applies FSDP2, recomputation and compile to each stage as to a whole model. Each micro-batch the
trainer hands over (the data-parallel batch, or one `train.micro_batch` of it) is one step of the schedule,
which splits it into `parallel.pp_microbatches` pipeline micro-batches.

The last stage computes the loss inside its forward (the family's own head and loss: chunked, fused,
z-loss, soft-capping), divided by the number of micro-batches of the step, as dense training divides it; it
is then broadcast over the pipeline group, so every rank returns, logs and agrees on the same loss. The
gradient norm is the global one: each rank's squares summed over the pipeline group.

A mixture of experts trains as a dense model does: each stage adds its own MoE layers' auxiliary losses to
the gradient (the last through the loss, the others through the hidden states they hand on:
`liandan.model.moe.carry_aux_loss`), and after the update counts and balances its own routers and shares
every layer's routing over the pipeline group, so each rank holds the whole model's routing stats.

Every rank of a pipeline group reads the same data-parallel batch (the loader's coordinates ignore `pp`); the
first stage uses the tokens, the last the targets, every stage the document ids of the attention mask.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from liandan.common.layout import Layout, uses_fsdp
from liandan.config import Config, ConfigError
from liandan.data.tokens.loader import Batch
from liandan.faults import faulty_matmuls, slow_forward
from liandan.model.moe import moe_layers, routing_step
from liandan.model.spec import get as get_model_spec
from liandan.train.causal_lm import CausalLMTrainModule, _config_step, _materialize, model_args
from liandan.train.expert_parallel import ep_refusal
from liandan.train.fp8 import dims_refusal, fp8_param_count
from liandan.train.hardware import PeakMemory
from liandan.train.meta_init import build_on_meta, plan_init
from liandan.train.optimizers import build_optimizers, schedule
from liandan.train.parallelize import parallelize, reshard
from liandan.train.pipeline_split import (
    SINGLE_STAGE,
    V_SHAPED,
    build_stages,
    pipeline_refusal,
    rank_stages,
    stage_extras,
    stage_layer_counts,
    stage_of_rank,
)
from liandan.train.train_module import PhaseHook

ZERO_BUBBLE = ("interleaved-zb", *V_SHAPED)  # weight gradients computed apart from input gradients

# liandan's schedule names -> torch.distributed.pipelining's
TORCH_SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "looped-bfs": "LoopedBFS",
    "interleaved-zb": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}


def microbatch_refusal(schedule: str, microbatches: int, pp: int, stages: int, rows: int) -> str | None:
    """Why `microbatches` pipeline micro-batches cannot run `schedule` over `stages` stages on `pp` ranks with
    `rows` sequences per schedule step (one line), or None."""
    key = f"parallel.pp_microbatches = {microbatches}"
    if microbatches < 1:
        return f"{key} must be at least 1"
    if rows % microbatches:
        return (f"{key} must divide the {rows} sequences each data-parallel rank runs per step"
                " (train.global_batch / data-parallel ranks, or train.micro_batch)")  # fmt: skip
    if schedule in ("1f1b", *V_SHAPED) and microbatches < stages:
        return f"{key} must be at least the {stages} pipeline stages for parallel.pp_schedule = {schedule}"
    rounds = max(1, microbatches // pp)
    if schedule in ("interleaved-1f1b", "interleaved-zb") and microbatches % rounds:
        return (f"{key} must split into {rounds} rounds of equal size (its quotient by parallel.pp = {pp}) for"
                f" parallel.pp_schedule = {schedule}: a multiple of {pp}, or fewer than {2 * pp}")  # fmt: skip
    return None


def data_parallel_refusal(schedule: str, layout: Layout) -> str | None:
    """Why the pipeline cannot run with this data parallelism (one line), or None."""
    if layout.dp_replicate > 1 and not uses_fsdp(layout):
        return "pipeline parallelism runs its stages under FSDP2 (parallel.dp_shard > 1), not DDP alone"
    if schedule in ZERO_BUBBLE and layout.dp_size > 1:
        return (
            f"parallel.pp_schedule = {schedule} computes weight gradients apart from input gradients, which"
            " FSDP2's reduction misses; use gpipe, 1f1b, interleaved-1f1b or looped-bfs with data parallelism"
        )
    return None


def pipeline_config_refusal(cfg: Config, layout: Layout, args=None) -> str | None:
    """Why the run's config cannot be pipelined over `layout` (one line), or None: asked by `liandan train`
    before any worker starts, and by the train module. `args`: the model's, once the vocabulary is known."""
    par, t = cfg.parallel, cfg.train
    spec = get_model_spec(cfg.model.family)
    args = args if args is not None else model_args(cfg, 0)
    n_stages = layout.pp * par.pp_stages_per_rank
    refusal = pipeline_refusal(spec, args, layout.pp, par.pp_stages_per_rank, par.pp_schedule)
    refusal = refusal or ep_refusal(args, layout.ep)
    if refusal is None and layout.tp > 1 and par.sequence_parallel:
        refusal = ("pipeline parallelism with parallel.tp > 1 hands whole sequences between stages:"
                   " set parallel.sequence_parallel = false")  # fmt: skip
    if refusal is None and layout.tp > 1:
        refusal = spec.tp_refusal(args, layout.tp)
    if refusal is None and (layout.cp > 1 or par.cpu_offload):
        refusal = "pipeline parallelism does not run with parallel.cp > 1 or parallel.cpu_offload yet"
    refusal = refusal or data_parallel_refusal(par.pp_schedule, layout)
    rows = t.micro_batch or t.global_batch // layout.dp_size
    microbatches = par.pp_microbatches or n_stages
    refusal = refusal or microbatch_refusal(par.pp_schedule, microbatches, layout.pp, n_stages, rows)
    if refusal is None:
        try:
            stage_layer_counts(args.n_layers, n_stages, list(par.pp_layers))
        except ValueError as err:
            refusal = str(err)
    return refusal


class PipelineTrainModule(CausalLMTrainModule):
    def __init__(self, cfg: Config, tokenizer_vocab: int, mesh, layout: Layout, device: torch.device,
                 dtype: torch.dtype):  # fmt: skip
        from torch.distributed.pipelining.schedules import get_schedule_class

        self.cfg, self.device, self.dtype = cfg, device, dtype
        par, t = cfg.parallel, cfg.train
        self.spec = get_model_spec(cfg.model.family)
        self.args = model_args(cfg, tokenizer_vocab)
        self.pp, self.per_rank, self.schedule_name = layout.pp, par.pp_stages_per_rank, par.pp_schedule
        n_stages = self.pp * self.per_rank
        refusal = pipeline_config_refusal(cfg, layout, self.args)
        if refusal:
            raise ConfigError(refusal)
        self.microbatches = par.pp_microbatches or n_stages
        self.rows = t.micro_batch or t.global_batch // layout.dp_size  # the batch shape the stages are built for
        self.init_peak = PeakMemory(device, reset=t.meta_init).start()
        torch.manual_seed(cfg.run.seed)  # every rank builds the same whole model, then keeps its stages
        plan = None
        if t.meta_init:
            model, record = build_on_meta(lambda: self.spec.build(self.args))
            plan = _config_step(plan_init, model, record)
        else:
            model = self.spec.build(self.args)
        configure = getattr(model, "configure_attention", None)
        self.attention = _config_step(configure, device) if configure else "built in"
        if t.ce_chunks > 1 or t.ce_fused:
            model.configure_loss(t.ce_chunks, fused=t.ce_fused)
        fp8 = self._fp8_plan(t, device)
        if fp8 and (refusal := dims_refusal(model, fp8.skip)):
            raise ConfigError(refusal)
        self.fp8_params = fp8_param_count(model, fp8.skip) if fp8 else 0
        # Every MoE layer of the whole model: each rank routes through its own, and shares their stats.
        self.moe_configs = {index: moe.cfg for index, moe in moe_layers(model).items()}
        first, last = stage_extras(model, self.spec, t.seq_len)
        counts = _config_step(stage_layer_counts, self.args.n_layers, n_stages, list(par.pp_layers), first, last)
        self.stage_layers = counts
        pp_rank = mesh.get_local_rank("pp")
        self.stage_ids = rank_stages(pp_rank, self.pp, self.per_rank, self.schedule_name)
        fsdp = uses_fsdp(layout)
        parts = []
        for part in build_stages(model, self.spec, counts, self.stage_ids):
            if plan is None:
                part.to(device)
            parts.append(parallelize(
                part, mesh, layout, activation_checkpoint=t.activation_checkpoint, compile=t.compile,
                fsdp_param_dtype=dtype if fsdp and dtype != torch.float32 else None, spec=self.spec,
                loss_parallel=par.loss_parallel and layout.tp > 1, sequence_parallel=False,
                materialize=None if plan is None else _stage_materializer(plan, device, cfg.run.seed), fp8=fp8,
            ))  # fmt: skip
        self.init_peak.stop()
        self.autocast = dtype != torch.float32 and not fsdp
        # What flows between stages: the compute dtype where FSDP2 casts the weights, fp32 under autocast
        # (the residual stream stays in the embedding's dtype).
        self._hidden_dtype = dtype if fsdp else torch.float32
        self.model_parts = parts
        self.pp_group = mesh["pp"].get_group()
        last_rank = stage_of_rank(n_stages - 1, self.pp, self.schedule_name)
        self.last_stage_src = dist.get_global_rank(self.pp_group, last_rank)
        stage_kind = _counted_stage()
        self.stages = [stage_kind(part, s, n_stages, device, group=self.pp_group)
                       for part, s in zip(parts, self.stage_ids, strict=True)]  # fmt: skip
        self._loss_divisor = float(self.microbatches)
        kind = get_schedule_class(TORCH_SCHEDULES[self.schedule_name])
        try:
            self.schedule = kind(self.stages[0] if self.schedule_name in SINGLE_STAGE else self.stages,
                                 n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)  # fmt: skip
        except ValueError as err:
            raise ConfigError(f"parallel.pp_schedule = {self.schedule_name}: {err}") from None
        self.optimizers = build_optimizers(parts, cfg.optim, schedule(t.steps, cfg.schedule), device,
                                           mixed_tensor_kinds=layout.tp > 1 or layout.ep > 1)  # fmt: skip
        self.optimizers.norm_group = self.pp_group
        self.params = self.spec.count_params(self.args)
        self.flops_per_token = self.spec.flops_per_token(self.args, t.seq_len)
        self.fp8_share = min(1.0, 6.0 * self.fp8_params / self.flops_per_token)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last stage returns its micro-batch's mean loss; the step's share of it is what dense training
        takes of each of its micro-batches (a power of two divides exactly, so the gradients match)."""
        return output / self._loss_divisor

    # -- a step ---------------------------------------------------------------------------------------------
    def train_batch(self, batches: list[Batch], phase: PhaseHook, step: int = 0) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        self._loss_divisor = float(self.microbatches * len(batches))
        for part in self.model_parts:
            part.loss_divisor = self._loss_divisor  # the stages without the head scale their auxiliary losses
        for i, batch in enumerate(batches):
            phase("forward", micro=i)
            with faulty_matmuls(step), self.autocasting():
                slow_forward(step)
                total += self._run(batch.to(self.device), train=True)
        return self._from_last_stage(total)

    @torch.no_grad()
    def eval_batch(self, batches: list[Batch]) -> torch.Tensor:
        self.train(False)
        total = torch.zeros((), device=self.device)
        self._loss_divisor = float(self.microbatches * max(1, len(batches)))
        for batch in batches:
            with self.autocasting():
                total += self._run(batch.to(self.device), train=False)
        self.train(True)
        return self._from_last_stage(total)

    def _run(self, batch: Batch, train: bool) -> torch.Tensor:
        """One schedule step over `batch`; the sum of its micro-batches' scaled losses on the last stage's
        rank, 0 elsewhere."""
        losses: list[torch.Tensor] = []
        kwargs = self._stage_kwargs(batch)
        if train:
            self.schedule.step(batch.inputs, target=batch.targets, losses=losses, return_outputs=False, **kwargs)
        elif self.schedule_name in V_SHAPED or len(batch.inputs) != self.rows:
            # torch 2.13's V schedules still hand gradients between a rank's two stages in `eval` (and fail);
            # and a schedule's stages receive only the shape they were built for, which the last validation
            # batch, short of held-out windows, does not have
            losses = self._forward_only(batch, kwargs)
        else:
            self.schedule.eval(batch.inputs, target=batch.targets, losses=losses, return_outputs=False, **kwargs)
        total = torch.zeros((), device=self.device)
        for loss in losses:  # in micro-batch order, as dense training adds them
            total += loss.detach().float()
        return total

    def _stage_kwargs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """What every stage takes besides its input: the targets (the last stage's loss) and the document ids
        (every stage's attention mask)."""
        kwargs = {"targets": batch.targets}
        doc_ids = self._doc_ids(batch)
        if doc_ids is not None:
            kwargs["doc_ids"] = doc_ids
        return kwargs

    def _forward_only(self, batch: Batch, kwargs: dict) -> list[torch.Tensor]:
        """Each micro-batch through the stages in order, the hidden states sent point to point between the
        ranks that run neighbouring stages: the last stage's scaled losses, on its rank. A batch of any number
        of sequences: each micro-batch's loss is weighted by its share of them, as one forward of the whole
        batch would average it, and the empty ones of a batch shorter than the micro-batches are skipped."""
        n_stages = self.pp * self.per_rank
        local = dict(zip(self.stage_ids, self.model_parts, strict=True))
        owner = [dist.get_global_rank(self.pp_group, stage_of_rank(s, self.pp, self.schedule_name))
                 for s in range(n_stages)]  # fmt: skip
        chunks = [batch.inputs.tensor_split(self.microbatches)] + [
            value.tensor_split(self.microbatches) for value in kwargs.values()
        ]
        losses = []
        for m in range(self.microbatches):
            extra = {key: chunks[1 + i][m] for i, key in enumerate(kwargs)}
            hidden = chunks[0][m]
            if not len(hidden):
                continue
            share = len(hidden) * self.microbatches / len(batch.inputs)  # 1.0 exactly for an even split
            for stage in range(n_stages):
                if stage not in local:
                    continue
                if stage > 0 and owner[stage - 1] != owner[stage]:
                    rows, seq = chunks[0][m].shape
                    hidden = torch.empty(rows, seq, self.args.dim, dtype=self._hidden_dtype, device=self.device)
                    dist.recv(hidden, src=owner[stage - 1], group=self.pp_group)
                out = local[stage](hidden, **extra)
                if stage == n_stages - 1:
                    losses.append(self._loss(out, batch.targets) * share)
                elif owner[stage + 1] != owner[stage]:
                    dist.send(out.contiguous(), dst=owner[stage + 1], group=self.pp_group)
                hidden = out
        return losses

    def _from_last_stage(self, total: torch.Tensor) -> torch.Tensor:
        """The loss the last stage computed, on every rank of the pipeline group."""
        dist.broadcast(total, src=self.last_stage_src, group=self.pp_group)
        return total

    def clip_grad_norm(self) -> float:
        """The global gradient norm, clipped to `optim.grad_clip`. Without sharded gradients it is computed as
        one process computes it (one norm of every tensor's norm, in the model's order), so the clipped
        update is the same bit for bit; sharded ones sum their squares over the pipeline group."""
        grads = [p.grad for part in self.model_parts for p in part.parameters() if p.grad is not None]
        if any(isinstance(g, DTensor) for g in grads):
            return self.optimizers.clip_grad_norm()
        mine = {stage: torch.stack(torch._foreach_norm(part_grads)).tolist() if part_grads else []
                for stage, part_grads in zip(self.stage_ids, self._grads_by_part(), strict=True)}  # fmt: skip
        gathered: list[dict[int, list[float]]] = [{} for _ in range(self.pp)]
        dist.all_gather_object(gathered, mine, group=self.pp_group)
        by_stage = {stage: norms for one in gathered for stage, norms in one.items()}
        norms = [n for stage in sorted(by_stage) for n in by_stage[stage]]
        if not norms:
            return 0.0
        total = float(torch.linalg.vector_norm(torch.tensor(norms, dtype=grads[0].dtype if grads else torch.float32)))
        limit = self.optimizers.grad_clip or float("inf")
        if total > limit and grads:
            torch._foreach_mul_(grads, limit / (total + 1e-6))
        return total

    def _grads_by_part(self) -> list[list[torch.Tensor]]:
        return [[p.grad for p in part.parameters() if p.grad is not None] for part in self.model_parts]

    @torch.no_grad()
    def replay_loss(self, batches: list[Batch], step: int) -> torch.Tensor:
        """The loss `train_batch` gave on `batches`, by forward passes alone through the stages in the same
        micro-batches and arithmetic (the sdc check's replay on a neighbour's data), on every rank."""
        total = torch.zeros((), device=self.device)
        self._loss_divisor = float(self.microbatches * len(batches))
        with faulty_matmuls(step):
            for batch in batches:
                batch = batch.to(self.device)
                with self.autocasting():
                    for loss in self._forward_only(batch, self._stage_kwargs(batch)):
                        total += loss.detach().float()
        for part in self.model_parts:
            reshard(part)  # no backward follows: FSDP2's gathered last block would go stale at the update
        return self._from_last_stage(total)

    def _route(self, bias_rate: float) -> None:
        """Each rank counts and balances the routers of its own stages; the loads are summed over the ranks
        holding the same layers and the stats of every layer reach every rank of the pipeline group."""
        if self.moe_configs:
            self.routing = routing_step(self.model_parts, bias_rate, every_layer=self.moe_configs,
                                        stage_group=self.pp_group)  # fmt: skip

    def whole_model(self) -> torch.nn.Module | None:
        return None  # each rank holds stages only: layer statistics, probes and evaluation leave it out

    @property
    def model(self) -> torch.nn.Module:
        raise ValueError(f"{type(self).__name__} holds pipeline stages {self.stage_ids}, not a whole model")


@functools.cache
def _counted_stage() -> type:
    """torch's PipelineStage whose metadata inference leaves the routers' counts alone: on its first step, and
    again after each switch between evaluation and training, the stage runs a forward of its own to learn the
    shapes it sends (on the first micro-batch or on empty tensors), which the step's routing must not count."""
    from torch.distributed.pipelining import PipelineStage

    class CountedStage(PipelineStage):
        def _prepare_forward_infra(self, *args, **kwargs):
            routers = [moe.router for moe in moe_layers(self.submod).values()]
            counts = [(router.load.clone(), router.dropped.clone()) for router in routers]
            try:
                return super()._prepare_forward_infra(*args, **kwargs)
            finally:
                with torch.no_grad():
                    for router, (load, dropped) in zip(routers, counts, strict=True):
                        router.load.copy_(load)
                        router.dropped.copy_(dropped)

    return CountedStage


def _stage_materializer(plan, device: torch.device, seed: int):
    return lambda part: _materialize(part, plan, device, seed)
