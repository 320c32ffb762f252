"""The trainer: a short loop of callback calls around the train module's step. Everything a run is made of
(processes, run directory, data, train module, checkpointer, callbacks) is built before it
(`liandan.train.components`) and handed in; everything else a run does (metric logging, heartbeats,
evaluation, memory snapshots, checkpoints, the loss-spike guard, forecasts) is a callback
(`liandan.train.callbacks`), which sees the run through a `TrainContext`."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from liandan import __version__
from liandan.checkpoint.handoff import newest_checkpoint
from liandan.checkpoint.info import read_meta
from liandan.checkpoint.resume import choose_resume
from liandan.checkpoint.saving import SaveError
from liandan.checkpoint.streaming import is_weight_source, load_weights
from liandan.checkpoint.train_state import parts_parameters
from liandan.checkpoint.verify import CheckpointError, step_of
from liandan.common.peaks import mixed_peak_flops
from liandan.config import Config, ConfigError
from liandan.faults import collapse_router, corrupt_gradients, flip_parameter_bit, learning_rate_burst, maybe_inject
from liandan.run import META, naming
from liandan.run.remote import locate
from liandan.run.worker_env import WorkerEnv
from liandan.track import ConsoleLogger, FanOut, MetricsLogger, NullLogger, plot_run
from liandan.track.exporters import open_exporters
from liandan.train.callbacks import Callback
from liandan.train.components import Components, build_components, record_stop, stops_recorded
from liandan.train.context import RunProgress, StepOutput, TrainContext, TrainResult
from liandan.train.distributed import shutdown_distributed
from liandan.train.hardware import datasheet_fp8_peak_flops, device_peak_flops
from liandan.train.optimizers import optimizer_plugin
from liandan.train.parallelize import reshard
from liandan.train.preemption import Preempted, StepAbandoned
from liandan.train.rollback import Rollback, available_host_memory, ranks_on_this_host, ring_refusal, state_bytes
from liandan.train.tokenizer_check import check_init_tokenizer

__all__ = ["StepOutput", "TrainResult", "Trainer"]


class Trainer:
    def __init__(
        self,
        components: Components | Config,
        run_dir: Path | None = None,
        callbacks: Sequence[Callback] = (),
        config_name: str = "run",
        say: Callable[[str], None] = print,
    ):
        """`components` from `build_components`; a Config builds them first (`run_dir`, `callbacks`,
        `config_name` and `say` are for that case)."""
        if isinstance(components, Config):
            components = build_components(components, run_dir, config_name, callbacks, say=say)
        elif run_dir is not None or callbacks:
            raise TypeError("run_dir and callbacks go to build_components, not to a Trainer of components")
        parts = self.parts = components
        cfg = self.cfg = parts.cfg
        self.env, self.dist, self.module, self.callbacks = parts.env, parts.env.dist, parts.module, parts.callbacks
        self.loader, self.room, self.files, self.checkpoints = (
            parts.data.loader,
            parts.room,
            parts.files,
            parts.checkpoints,
        )
        self.say = parts.say
        self.progress = RunProgress()
        self.result = TrainResult(parts.room.path, cfg.train.steps)
        # a DPO step's global batch counts pairs, each two rows
        rows = cfg.train.global_batch * (2 if cfg.train.objective == "dpo" else 1)
        self.tokens_per_step = rows * cfg.train.seq_len
        if self.module.init_peak is not None:
            peaks = self.env.max_over_ranks([self.module.init_peak.host_bytes, self.module.init_peak.device_bytes])
            self.files.log_event("model_built", meta_init=cfg.train.meta_init, host_peak_bytes=peaks[0],
                                 device_peak_bytes=peaks[1])  # fmt: skip
        with stops_recorded(self.files):
            ring = cfg.guard.ring_size if cfg.guard.enabled else 0
            self._check_ring(ring)
            self.rollback = Rollback(self.module, self.checkpoints, lambda: self.progress.step, self.resume_state,
                                     self.rewind, ring)  # fmt: skip
            services = {
                "logger": lambda: self.logger, "phase": self.phase, "notify": self.notify,
                "save_checkpoint": self.save_checkpoint, "stop_if_unsaved": self.stop_if_unsaved,
                "stop_for_preemption": self.stop_for_preemption, "resume_state": self.resume_state,
            }  # fmt: skip
            self.ctx = TrainContext(parts, self.progress, self.result, self.rollback, services, 0.0, 0.0)
            self._resume_or_init()
            self._measure_peaks()
            self.logger = self._make_logger()
            self._say_model()

    def _optimizer_state_bytes(self):
        """Bytes of optimizer state per parameter by role, from the `[optim]` plug-in (None for a train module
        handed in with optimizers of its own kind)."""
        try:
            return optimizer_plugin(self.cfg.optim.name).state_bytes
        except ConfigError:
            return None

    def _check_ring(self, ring: int) -> None:
        """Refuse a ring of rollback states that host memory cannot hold, before it fills it step by step. The
        same verdict on every rank: the largest state against the least memory available."""
        if not ring:
            return
        each = state_bytes(self.module.model_parts, self._optimizer_state_bytes())
        each, scarce = self.env.max_over_ranks([each, -(available_host_memory() or -1)])
        available = -scarce if scarce < 0 else None
        refusal = ring_refusal(ring, each, available, ranks_on_this_host(self.dist.world_size))
        if refusal:
            raise ConfigError(refusal)

    def _measure_peaks(self) -> None:
        """MFU's denominator: under fp8 the fp8 linears' share of the FLOPs counts at the fp8 peak (emulated,
        or on a device the table does not know, at the compute dtype's); `peak_flops_dtype` stays the compute
        dtype's peak, for an MFU comparable with runs without fp8."""
        env, cfg = self.env, self.cfg
        peak, self.peak_source = device_peak_flops(env.device, env.dtype)
        self.peak_flops_dtype = env.sum_over_ranks(peak)
        if self.module.fp8_share:
            fp8_peak = datasheet_fp8_peak_flops(env.device) if not cfg.train.fp8_emulate else None
            peak = mixed_peak_flops(peak, fp8_peak or peak, self.module.fp8_share)
            self.peak_source += f", fp8 linears at {'the fp8 data sheet peak' if fp8_peak else 'the same'}"
        self.peak_flops = env.sum_over_ranks(peak)
        self.ctx.peak_flops, self.ctx.peak_flops_dtype = self.peak_flops, self.peak_flops_dtype

    def _say_model(self) -> None:
        cfg, env, module, params = self.cfg, self.env, self.module, self.module.params
        counted = ""
        if params:
            active = f", {params.active / 1e6:.2f}M active per token" if params.sparse else ""
            counted = (
                f"{params.total / 1e6:.2f}M parameters ({params.non_embedding / 1e6:.2f}M non-embedding{active}), "
            )
        self.say(
            f"model: {counted}{cfg.train.seq_len} tokens per sequence, attention {module.attention},"
            f" {_dtype_name(env.dtype)}, layout {env.layout}, {self.dist.world_size} process(es) on {env.device.type}"
        )
        if module.fp8_share:
            emulated = " (emulated)" if cfg.train.fp8_emulate else ""
            self.say(f"fp8 {cfg.train.fp8}{emulated}: {module.fp8_share:.0%} of the FLOPs; MFU against"
                     f" {self.peak_flops / 1e12:,.4g} TFLOP/s ({self.peak_source})")  # fmt: skip

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def run_dir(self) -> Path:
        return self.room.path

    # -- the loop -----------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        steps, result, progress = self.cfg.train.steps, self.result, self.progress
        micro_batch = self.parts.data.micro_batch
        self.notify("on_train_start")
        # What x by tokens or FLOPs needs, said where every reader of the run finds it.
        self.logger.log_event(
            "train_start",
            step=progress.step,
            layout=str(self.env.layout),
            world_size=self.dist.world_size,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=self.module.flops_per_token,
        )
        started, first_step = time.perf_counter(), progress.step
        self.module.train()
        try:
            while progress.step < steps:
                self.notify("before_step", progress.step)
                try:
                    self.phase("data")
                    batches = self.loader.next_step(micro_batch)
                    maybe_inject("data", progress.step + 1)
                    collapse_router(progress.step + 1, self.module.model_parts, stages=self.env.layout.pp > 1)
                    loss = self.module.train_batch(batches, self.phase, progress.step + 1)
                    corrupt_gradients(progress.step + 1, self._parameters())
                    self.phase("optimizer")
                except StepAbandoned as abandoned:  # preempted, with no time to finish the step
                    self.stop_mid_step(abandoned.signum, abandoned.fallback_step)
                grad_norm, lr = self.module.clip_grad_norm(), self.module.lr
                update = self._agree_to_update(loss, grad_norm)
                if update:
                    self.module.optim_step(learning_rate_burst(progress.step + 1))
                else:
                    self.module.skip_step()
                flip_parameter_bit(progress.step + 1, self._parameters())
                progress.step += 1
                progress.tokens += self.tokens_per_step
                progress.last_step = StepOutput(loss, grad_norm, lr, skipped=not update)
                self.notify("after_step", progress.step, {})
                maybe_inject("step", progress.step)
                self.notify("on_step_end", progress.step)
            self.phase("done")  # the teardown: the last save may still be writing
            result.seconds, result.tokens = time.perf_counter() - started, progress.tokens
            self.notify("on_train_end", result)
        except BaseException as err:
            self.notify("on_error", err)
            record_stop(self.files, err, self.step)
            raise
        self._finish(result, first_step, (steps - first_step) * self.tokens_per_step)
        return result

    def notify(self, hook: str, *args: Any) -> None:
        """Call `hook` on every callback, in order."""
        for callback in self.callbacks:
            getattr(callback, hook)(self.ctx, *args)

    def phase(self, name: str, micro: int = 0) -> None:
        """Where the current step has got to (heartbeats, for the supervisor's hang detection)."""
        for callback in self.callbacks:
            callback.on_phase(self.ctx, self.progress.step, name, micro)

    def _parameters(self):
        return parts_parameters(self.module.model_parts)

    def _agree_to_update(self, loss: torch.Tensor, grad_norm: float) -> bool:
        """Every callback that may veto the update is asked on every rank; one veto anywhere skips it
        everywhere, so the ranks' weights never part."""
        vetoers = [c for c in self.callbacks if c.overrides("before_optimizer_step")]
        if not vetoers:
            return True
        answers = [c.before_optimizer_step(self.ctx, self.progress.step, loss, grad_norm) for c in vetoers]
        go = all(answers)  # all are asked
        if self.dist.distributed:
            flag = torch.tensor(1 if go else 0, device=self.env.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            go = bool(flag.item())
        return go

    # -- saving, stopping, going back ---------------------------------------------------------------------
    def save_checkpoint(self) -> float:
        """Save (in the background when asynchronous); returns the seconds training was blocked."""
        meta = {
            "format": "liandan-checkpoint",
            "layout": str(self.env.layout),
            **self.resume_state(),
            "config": self.cfg.to_toml(),
            "liandan_version": __version__,
        }
        blocked = self.checkpoints.save(self.progress.step, self.module.model_parts, self.module.optimizers, meta)
        self.stop_if_unsaved(final=False)
        self.notify("on_checkpoint_saved", self.progress.step)
        return blocked

    def stop_if_unsaved(self, final: bool) -> None:
        """End the run with a SaveError when its checkpoints are not being saved (see `unsaved_reason`): training
        on with nothing saved, or reporting success, would risk work that cannot be resumed."""
        reason = self.checkpoints.unsaved_reason(self.step, self.cfg.checkpoint.max_failed_saves, final)
        if reason is None:
            return
        self.parts.heartbeat.beat(self.step, "done")  # the teardown, for the supervisor's watchdog
        self.checkpoints.close()
        with contextlib.suppress(OSError):  # the error below says it all, whether or not the disk takes the record
            self.logger.log_event("train_stopped", step=self.step, error=reason)
        with contextlib.suppress(OSError):
            self.logger.close()
        raise SaveError(reason)

    def stop_for_preemption(self, signum: int) -> None:
        """Every rank has just saved the checkpoint of this step: wait until it is complete, then stop."""
        self.checkpoints.close()
        saved = [o for o in self.checkpoints.outcomes if o.step == self.step and o.ok]
        path = str(saved[-1].path) if saved else None
        if not WorkerEnv.from_env().supervised:  # a supervisor records the preemption itself
            self.parts.event("preempted", signal=signal.Signals(signum).name, step=self.step, checkpoint=path)
        self.logger.close()
        raise Preempted(signum, self.step, path)

    def stop_mid_step(self, signum: int, fallback_step: int) -> None:
        """Preempted in the middle of a step, before its update, with no time to finish it: every rank goes
        back to the end of `fallback_step` (the step before, or an older one of the newest memory snapshot),
        saves it unless its checkpoint is saved or being saved, and stops. The model parts and optimizers still
        hold the end of the step before, but the loader, the random-number states and the callbacks' states
        have moved on: the memory snapshot holds them all, exactly as a checkpoint of its step would have."""
        self.module.zero_grad()
        for part in self.module.model_parts:
            reshard(part)
        if self.checkpoints.started_step != fallback_step:
            state = self.parts.snapshots.load(fallback_step, self.module.model_parts, self.module.optimizers)
            self.rewind(fallback_step, state)
            self.phase("checkpoint")
            self.save_checkpoint()
        self.progress.step = fallback_step
        self.stop_for_preemption(signum)

    def resume_state(self) -> dict[str, Any]:
        """What a resume needs besides the tensors: the train module's state (the schedule), the loader, the
        callbacks' states; and the model they belong to (its family and args, checked on every resume)."""
        states = {c.name: state for c in self.callbacks if (state := c.state_dict())}
        stores = self.parts.data.stores
        own = self.module.state_dict()
        spec, args = self.module.spec, self.module.args
        model = {"model_family": spec.name} if spec is not None else {}
        if args is not None:
            model["model_args"] = dataclasses.asdict(args)
        return {"tokens": self.progress.tokens, **own, "loader": self.loader.state_dict(),
                "tokenizer": stores[0].fingerprint if stores else None, "callbacks": states, **model}  # fmt: skip

    def rewind(self, step: int, state: dict[str, Any]) -> None:
        """Go back to `step`, whose `resume_state()` is `state`, after the caller has put that step's model and
        optimizer state back: the train module's state, the loader, the callbacks' states, the token count,
        the metrics (the steps after `step` are about to be trained again)."""
        t = self.cfg.train
        undone = sum(1 for s in range(step + 1, self.progress.step + 1) if s % t.log_every == 0 or s == t.steps)
        del self.result.losses[max(0, len(self.result.losses) - undone) :]
        self.module.load_state_dict(state)
        self.loader.load_state_dict(state["loader"])
        self.progress.tokens = int(state["tokens"])
        self.progress.step = step
        for callback in self.callbacks:
            if callback.name in state.get("callbacks", {}):
                callback.load_state_dict(state["callbacks"][callback.name])
        if self.dist.is_main:
            self.room.truncate_metrics(step)

    def close(self) -> None:
        """Leave the process group and release the run directory; the trainer cannot step after this. A save
        still in flight here is one the run ended on an error during: its partial directory goes."""
        self.checkpoints.abandon()
        self.parts.heartbeat.close()
        shutdown_distributed()
        if self.parts.run_lock is not None:
            self.parts.run_lock.release()

    def _resume_or_init(self) -> None:
        """Continue from the newest memory snapshot or checkpoint that verifies (`choose_resume`, the decision
        the supervisor takes too), or start from `init_from`."""
        c = self.cfg.checkpoint
        point = None
        if c.resume == "auto":
            snaps = self.parts.snapshots
            in_memory = snaps.agree() if snaps else None
            newest = None
            if in_memory is not None:
                newest = self.env.on_main_then_share(
                    lambda: [p.name for p in self.checkpoints.complete_checkpoints()[-1:]]
                )
            point = choose_resume(in_memory, step_of(Path(newest[0])) if newest else None,
                                  lambda: newest_checkpoint(self.checkpoints))  # the supervisor's verdict, if fresh  # fmt: skip
            if point.source == "none":
                self._refuse_to_start_over()
        if point is not None and point.source == "memory":
            snapshot = f"the memory snapshot of step {point.step} in {self.parts.snapshots.directory}"
            self._check_model(self.parts.snapshots.state_of(point.step), snapshot)
            meta = self.parts.snapshots.load(point.step, self.module.model_parts, self.module.optimizers)
            self._continue_from(meta, point.step, f"the memory snapshot in {self.parts.snapshots.directory}")
            self.parts.event("resumed", step=self.step, source="memory", path=str(self.parts.snapshots.directory),
                             from_layout=str(self.env.layout))  # fmt: skip
        elif point is not None and point.source == "checkpoint":
            self._check_model(read_meta(point.path), str(point.path))  # before a load that might half fit
            # one that verifies may still fail to load: then the newest older one that does
            path, meta = self.checkpoints.load_newest(point.path, self.module.model_parts, self.module.optimizers)
            self._continue_from(meta, int(meta["step"]), str(path))
            if path != point.path:  # an older one: checked as well, although loaded already (the run stops)
                self._check_model(meta, str(path))
            self.parts.event(
                "resumed", step=self.step, source="checkpoint", path=str(path), from_layout=meta.get("layout")
            )
        elif c.init_from:
            self._init_from(locate(c.init_from))
        reference = getattr(self.module, "reference", None)  # DPO's frozen reference: the initial weights
        if reference is not None and c.init_from:
            self._init_from(locate(c.init_from), [reference])
        if self.progress.step == 0 and self.dist.is_main:  # a restart with nothing to resume from starts over
            self.room.truncate_metrics(0)

    def _refuse_to_start_over(self) -> None:
        """Stop, on every rank, where the run holds complete checkpoints and none of them verifies: starting
        from step 0 would throw away the run's progress behind a warning, and its new saves would soon retire
        the checkpoints that a person could still repair or inspect."""
        complete = self.env.on_main_then_share(lambda: [str(p) for p in self.checkpoints.complete_checkpoints()])
        if complete:
            raise CheckpointError(
                f"none of the {len(complete)} checkpoint(s) under {self.checkpoints.root} verifies (each rejection"
                f" is above; the newest is {complete[-1]}), and the run does not start over from step 0 past"
                " them: move the checkpoints aside to start over"
            )

    def _init_from(self, source: Path, parts: list[torch.nn.Module] | None = None) -> None:
        """Load `init_from` into the model parts (the train module's, or `parts`: a DPO reference)."""
        what = "model weights" if parts is None else "the reference's weights"
        if is_weight_source(source):
            check_init_tokenizer(source, None, self.parts.data, self.say)
            self._init_from_weights(source, None if parts is None else parts[0], what)
            return
        if not source.exists():
            raise ConfigError(f"checkpoint.init_from = {source}: no such file or directory")
        if not (source / META).is_file():
            raise ConfigError(f"checkpoint.init_from = {source}: no checkpoint there ({META} missing)")
        meta = read_meta(source)
        self._check_model(meta, f"checkpoint.init_from = {source}")
        check_init_tokenizer(source, meta, self.parts.data, self.say)
        self.checkpoints.load(source, self.module.model_parts if parts is None else parts)
        self.say(f"initialised {what} from {source}")
        self.parts.event("initialised", path=str(source))

    def _check_model(self, meta: dict[str, Any], source: str) -> None:
        """Refuse, in one line naming the keys, a checkpoint or snapshot of another model than this run's: its
        family, its shapes, or what the shapes do not show (RoPE base and scaling, norm epsilon). Tensors that
        still fit would load (fewer layers: the rest silently dropped). `checkpoint.allow_model_change` lets a
        deliberate change through, said once. A train module without a spec or args has nothing to compare."""
        spec, args = self.module.spec, self.module.args
        if spec is None or args is None or "model_args" not in meta:
            return
        family = meta.get("model_family", "llama")  # checkpoints from before families are Llama's
        if family != spec.name:
            differ = [f"model.family = {spec.name} (checkpoint: {family})"]
        else:
            differ = spec.differences(args, meta["model_args"])
        if not differ:
            return
        said = f"{source} holds another model: {'; '.join(differ)}"
        if family != spec.name:  # no tensor of another family is this one's
            raise ConfigError(said)
        if not self.cfg.checkpoint.allow_model_change:
            raise ConfigError(f"{said}; to change the model on purpose, set checkpoint.allow_model_change = true")
        self.say(f"{said}; loading what fits (checkpoint.allow_model_change)")
        self.parts.event("model_changed", source=source, differences=differ)

    def _init_from_weights(
        self, source: Path, model: torch.nn.Module | None = None, what: str = "model weights"
    ) -> None:
        """Hugging Face or consolidated weights, each rank reading only its shards' slices, tensor by tensor."""
        try:
            read = load_weights(self.module.model if model is None else model, self.module.args, source)
        except (ValueError, OSError) as err:
            raise ConfigError(f"checkpoint.init_from = {source}: {err}") from None
        self.say(f"initialised {what} from {source}")
        self.parts.event("initialised", path=str(source), bytes_read=self.env.sum_over_ranks(read))

    def _continue_from(self, meta: dict[str, Any], step: int, source: str) -> None:
        stores = self.parts.data.stores
        if stores and meta.get("tokenizer") != stores[0].fingerprint:
            data = ", ".join(str(s.path) for s in stores)
            raise ConfigError(f"{source} was trained with another tokenizer than the data in {data}")
        self.module.load_state_dict(meta)
        self.loader.load_state_dict(meta["loader"])
        self.progress.step = step
        per_step = self.cfg.train.global_batch * self.cfg.train.seq_len
        self.progress.tokens = int(
            meta.get("tokens", step * per_step)
        )  # older snapshots lack it: tokens/step was constant
        states = meta.get("callbacks", {})
        for callback in self.callbacks:
            if callback.name in states:
                callback.load_state_dict(states[callback.name])
        if self.dist.is_main:
            self.room.truncate_metrics(self.progress.step)
        self.say(f"resumed from {source} at step {self.step}")
        self.notify("on_checkpoint_loaded", self.step, source)

    def _make_logger(self) -> MetricsLogger:
        if not self.dist.is_main:
            return NullLogger()
        self.room.write_config(self.cfg.to_toml())
        loggers: list[MetricsLogger] = [self.files, ConsoleLogger(self.cfg.train.steps, first_step=self.step)]
        # after the files: the exporters hand on the events the files have just recorded
        exporters = open_exporters(self.room, self.cfg, first_step=self.step)
        if exporters is not None:
            self.say(f"exporting to {exporters.describe()}")
            loggers.append(exporters)
        return FanOut(*loggers)

    def _finish(self, result: TrainResult, first_step: int, tokens_trained_now: int) -> None:
        """summary.json: `tokens` counts every kept step of the run (what `liandan fit` takes as D); `seconds`
        and `tokens_per_s` are this invocation's, from `first_step` on."""
        self.logger.log_event("train_end", step=self.step, seconds=result.seconds)
        self.logger.close()
        if not self.dist.is_main:
            return
        tail = result.losses[-max(1, len(result.losses) // 10) :]
        params = self.module.params
        result.summary = {
            "steps": self.step,
            "tokens": result.tokens,
            "first_step": first_step,
            "seconds": round(result.seconds, 3),
            "final_loss": result.losses[-1] if result.losses else None,
            "final_loss_smoothed": sum(tail) / len(tail) if tail else None,
            "val_loss": result.val_loss,
            "parameters": params.total if params else None,
            "non_embedding_parameters": params.non_embedding if params else None,
            "active_parameters": params.active if params else None,  # of a MoE: per token; else = parameters
            "flops_per_token": self.module.flops_per_token,
            "tokens_per_s": tokens_trained_now / result.seconds if result.seconds else None,
            "peak_flops": self.peak_flops,
            "peak_flops_source": self.peak_source,
            "layout": str(self.env.layout),
            "world_size": self.dist.world_size,
            "dtype": _dtype_name(self.env.dtype),
        }
        self.room.write_summary(result.summary)
        if self.cfg.track.plot:
            with naming(self.room.plot()):
                plot_run(self.run_dir)
        if self.parts.store_logger is not None:  # the summary came after the loggers closed
            self.parts.store_logger.close()


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
