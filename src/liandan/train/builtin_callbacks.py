"""liandan's own callbacks, registered by name and chosen by the config like any other: heartbeats for the
supervisor, metric logging, evaluation, memory snapshots and checkpoints. Their `order` leaves room for
callbacks that must run between them: routing 3, metrics 10, forecast 12, heartbeat 15, evaluation 20, a
callback's default 50, snapshots 80, checkpoints 90, the preemption guard 95."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from liandan.config import Config
from liandan.train.callbacks import Callback
from liandan.train.hardware import peak_memory_bytes

if TYPE_CHECKING:
    from liandan.train.context import TrainContext, TrainResult


class HeartbeatCallback(Callback):
    """Each rank's step and phase into its heartbeat file, for the supervisor's hang detection; the step's end
    once its metrics are logged, before evaluation and saves."""

    order = 15

    def on_phase(self, ctx: TrainContext, step: int, phase: str, micro: int) -> None:
        ctx.heartbeat.beat(step, phase, micro=micro)

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        ctx.heartbeat.beat(step, "step_end")


class MetricsCallback(Callback):
    """On every `train.log_every`-th step and the last: the loss averaged over ranks, grad norm, learning rate,
    throughput, MFU, peak memory and step time, into metrics.jsonl and onto the console; a non-finite loss is
    also an event. Later callbacks read what it logged from `metrics`."""

    order = 10

    def __init__(self) -> None:
        self.step_started = 0.0

    def before_step(self, ctx: TrainContext, step: int) -> None:
        self.step_started = time.perf_counter()

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        t = ctx.cfg.train
        if step % t.log_every and step != t.steps:
            return
        ctx.phase("collective")
        out = ctx.last_step
        loss = ctx.mean_over_ranks(out.loss)
        seconds = time.perf_counter() - self.step_started
        tokens = ctx.tokens_per_step
        metrics.update(
            loss=loss,
            grad_norm=float(out.grad_norm),
            lr=out.lr,
            tokens_per_s=tokens / seconds,
            mfu=ctx.module.flops_per_token * tokens / seconds / ctx.peak_flops,
            peak_mem_gib=peak_memory_bytes(ctx.device) / 2**30,
            step_time_s=seconds,
        )
        if ctx.module.fp8_share:  # against the compute dtype's peak alone: comparable with runs without fp8
            metrics["mfu_dtype_peak"] = ctx.module.flops_per_token * tokens / seconds / ctx.peak_flops_dtype
        if out.skipped:
            metrics["update_skipped"] = 1.0
        if ctx.module.lr_scale != 1.0:  # the loss-spike guard lowered it after a rollback
            metrics["lr_scale"] = ctx.module.lr_scale
        ctx.result.losses.append(loss)
        ctx.logger.log_metrics(step, metrics)
        if not math.isfinite(loss):
            ctx.logger.log_event("nonfinite_loss", step=step, loss=str(loss))


class RoutingCallback(Callback):
    """A MoE model's routing of the step (`TrainModule.routing`, summed over the ranks) into the step's
    metrics on the steps MetricsCallback logs: per MoE layer the load's max and min over the mean, its entropy,
    the share of pairs dropped, the balancing bias's range and every expert's load over the mean
    (`moe/<layer>/...`), and the largest load of any block (`moe/load_max`). Before the guard (5) and the health checks, which read the same `metrics`."""

    order = 3

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        t = ctx.cfg.train
        routing = getattr(ctx.module, "routing", None)
        if routing is None or (step % t.log_every and step != t.steps):
            return
        summary = routing.summary()
        metrics.update(summary)
        # the worst block's most loaded expert: one number for the console and the report's chart
        metrics["moe/load_max"] = max(v for k, v in summary.items() if k.endswith("/load_max"))
        for row, layer in enumerate(routing.layers):
            bias = routing.bias[row]
            metrics[f"moe/{layer}/bias_min"] = float(bias.min())
            metrics[f"moe/{layer}/bias_max"] = float(bias.max())
        metrics.update(routing.expert_loads())


class PreferenceMetricsCallback(Callback):
    """A preference step's rewards, reward accuracy, margins, log-probabilities and the loss's own metrics (the
    KL to the reference under DPO; `TrainModule.preference_metrics`, means over the ranks) into the step's
    metrics on the steps MetricsCallback logs."""

    order = 4

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        t = ctx.cfg.train
        found = getattr(ctx.module, "preference_metrics", None)
        if not found or (step % t.log_every and step != t.steps):
            return
        metrics.update({name: ctx.mean_over_ranks(torch.tensor(value)) for name, value in found.items()})


class EvalCallback(Callback):
    """The validation loss every `train.eval_every` steps and at the last, as an "eval" event."""

    order = 20

    def __init__(self) -> None:
        self.said_none = False

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        t = ctx.cfg.train
        if (step % t.eval_every and step != t.steps) or ctx.rollback.pending:
            return
        ctx.phase("eval")
        loss = ctx.validation_loss()
        if loss is None:  # no number rather than a made-up one: a 0.0 would read as a perfect model
            if not self.said_none:
                ctx.say(self.why_no_loss(ctx))
                self.said_none = True
            return
        ctx.result.val_loss = loss
        ctx.logger.log_event("eval", step=step, loss=loss)
        by_source = self.losses_by_source(ctx)
        if by_source and ctx.dist.is_main:
            ctx.logger.log_metrics(step, {f"val/{source}/loss": value for source, value in by_source.items()})
        ctx.notify("on_eval", step, loss)

    @staticmethod
    def why_no_loss(ctx: TrainContext) -> str:
        if not hasattr(ctx.loader, "validation"):
            return f"no validation loss: the loader ({type(ctx.loader).__name__}) has no `validation`"
        return (f"no validation loss: the token stores hold no window out (data.val_fraction ="
                f" {ctx.cfg.data.val_fraction}, or fewer held-out windows than data-parallel ranks)")  # fmt: skip

    @staticmethod
    def losses_by_source(ctx: TrainContext) -> dict[str, float]:
        """The validation loss of each source of a mixture (a loader of several token stores), over the
        windows of it that the mixture's validation loss reads: nothing for one source, whose loss that is."""
        split = getattr(ctx.loader, "validation_by_store", None)
        if split is None or len(ctx.loader.stores) < 2:
            return {}
        return {source: ctx.mean_over_ranks(ctx.module.eval_batch(batches))
                for source, batches in split(ctx.cfg.train.eval_batches, ctx.micro_batch)}  # fmt: skip


class SnapshotCallback(Callback):
    """A copy of the whole training state in host memory every `checkpoint.memory_every` steps, for the
    supervisor's restarts (it owns the snapshots; unsupervised runs take none). Late in the step, so the
    states of the callbacks before it include this step. A step the guard has not settled on (a loss over a
    threshold, its verdict still open) is not kept: the snapshot waits for the first settled step, so that a
    restart never resumes past a spike the guard would have rolled back."""

    order = 80

    def __init__(self) -> None:
        self.due = False

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        self.due = (self.due or step % ctx.cfg.checkpoint.memory_every == 0) and not ctx.rollback.pending
        if ctx.snapshots and self.due and step < ctx.cfg.train.steps and _settled(ctx):
            ctx.snapshots.save(step, ctx.module.model_parts, ctx.module.optimizers, ctx.resume_state())
            self.due = False


class CheckpointCallback(Callback):
    """A checkpoint every `checkpoint.every` steps, every `checkpoint.every_minutes` and at the last step
    (`checkpoint.at_end`); at the end, the wait for the last save and the refusal to report success when it
    (or too many saves in a row) failed. Last in the step but for the preemption guard, so the states of the
    callbacks before it include this step. A save due at a step the guard has not settled on (a loss over a
    threshold, its verdict still open) waits for the first settled step; the last step is always saved.

    The time interval is measured on rank 0's clock alone and its verdict broadcast to every rank (one
    collective a step, on a small gloo group of the ranks' own: no device synchronisation), so that all ranks
    save the same steps although their clocks differ."""

    order = 90

    def __init__(self) -> None:
        self.group = None
        self.last_save = time.monotonic()  # a save resets the time interval, whatever asked for it
        self.due = False

    def on_train_start(self, ctx: TrainContext) -> None:
        if ctx.cfg.checkpoint.every_minutes and ctx.dist.distributed:
            self.group = dist.new_group(backend="gloo")  # every rank: the config is the same on all
        self.last_save = time.monotonic()

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        c = ctx.cfg.checkpoint
        due = bool(c.every) and step % c.every == 0
        if not due and c.every_minutes and step < ctx.cfg.train.steps:
            due = self._time_is_up(ctx, c.every_minutes)
        # a step rolled back is undone: the restored run comes to its multiple again
        self.due = (self.due or due) and not ctx.rollback.pending
        last = c.at_end and step == ctx.cfg.train.steps and not ctx.rollback.pending  # no later verdict can come
        if (self.due and _settled(ctx)) or last:
            ctx.phase("checkpoint")
            ctx.save_checkpoint()
            self.due = False

    def on_checkpoint_saved(self, ctx: TrainContext, step: int) -> None:
        self.last_save = time.monotonic()

    def _time_is_up(self, ctx: TrainContext, minutes: float) -> bool:
        """Rank 0's verdict, on every rank. Collective when distributed."""
        up = ctx.dist.is_main and time.monotonic() - self.last_save >= minutes * 60
        if self.group is None:
            return up
        flag = torch.tensor([1 if up else 0], dtype=torch.int32)
        dist.broadcast(flag, src=0, group=self.group)  # the group holds every rank: global rank 0 is its first
        return bool(flag.item())

    def on_train_end(self, ctx: TrainContext, result: TrainResult) -> None:
        ctx.checkpoints.close()
        ctx.stop_if_unsaved(final=True)


def _settled(ctx: TrainContext) -> bool:
    """Neither a rollback of this step decided nor a verdict on it open (a spike streak: a checkpoint of it could
    hold the spike's update and, resumed from, lose the rollback)."""
    return not ctx.rollback.pending and not ctx.rollback.unsettled


def _heartbeat(cfg: Config) -> Callback:
    return HeartbeatCallback()


def _metrics(cfg: Config) -> Callback:
    return MetricsCallback()


def _routing(cfg: Config) -> Callback:
    return RoutingCallback()  # idle unless the train module routes (a MoE model)


def _preferences(cfg: Config) -> Callback | None:
    return PreferenceMetricsCallback() if cfg.train.objective == "dpo" else None


def _eval(cfg: Config) -> Callback | None:
    return EvalCallback() if cfg.train.eval_every else None


def _snapshots(cfg: Config) -> Callback | None:
    return SnapshotCallback() if cfg.checkpoint.memory_every else None


def _checkpoint(cfg: Config) -> Callback | None:
    return CheckpointCallback() if cfg.checkpoint.saves else None
