"""The trainer: set up processes, the run directory, data and the train module, then a short loop of
callback calls around the train module's step. Everything else a run does (metric logging, heartbeats,
evaluation, memory snapshots, checkpoints, forecasts) is a callback (`liandan.train.callbacks`)."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# liandan's own callbacks register themselves: the loss-spike guard, silent-data-corruption and stragglers
import liandan.train.builtin_callbacks
import liandan.train.guard.callback
import liandan.train.health.sdc
import liandan.train.health.stragglers  # noqa: F401
from liandan import __version__
from liandan.checkpoint import snapshots
from liandan.checkpoint.handoff import newest_checkpoint
from liandan.checkpoint.manager import CheckpointManager, SaveError, read_meta
from liandan.checkpoint.resume import can_resume, choose_resume
from liandan.checkpoint.streaming import is_weight_source, load_weights
from liandan.checkpoint.verify import step_of
from liandan.config import Config, ConfigError
from liandan.data.loader import PackedLoader
from liandan.data.prepare import open_prepared, open_stores, prepare_store
from liandan.faults import corrupt_gradients, flip_parameter_bit, learning_rate_burst, maybe_inject
from liandan.run import META, RunDir, RunLock, holds_progress, lock_run_dir, naming
from liandan.run.remote import locate
from liandan.run.worker_env import WorkerEnv
from liandan.spec.layout import resolve_layout
from liandan.spec.peaks import mixed_peak_flops
from liandan.track import ConsoleLogger, FanOut, JsonlLogger, MetricsLogger, NullLogger, plot_run
from liandan.track.exporters import open_exporters
from liandan.track.store import StoreLogger
from liandan.train.callbacks import Callback, builtin_callbacks, in_order
from liandan.train.distributed import DistInfo, init_distributed, shutdown_distributed
from liandan.train.hardware import datasheet_fp8_peak_flops, device_peak_flops, resolve_dtype
from liandan.train.heartbeat import Heartbeat
from liandan.train.module import TrainModule, _config_step
from liandan.train.parallelize import build_mesh, dp_coordinates, reshard
from liandan.train.preemption import Preempted, StepAbandoned


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    tokens: int = 0
    seconds: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepOutput:
    """What the last step did, for the callbacks after it."""

    loss: torch.Tensor  # this rank's mean loss of the step
    grad_norm: float
    lr: float
    skipped: bool  # the update was vetoed by a callback


class Trainer:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path | None = None,
        callbacks: Sequence[Callback] = (),
        config_name: str = "run",
        say: Callable[[str], None] = print,
    ):
        self.cfg = cfg
        self.callbacks = in_order([*builtin_callbacks(cfg), *callbacks])
        for callback in self.callbacks:
            callback.name = callback.name or type(callback).__name__
        self.dist: DistInfo = init_distributed(cfg.run.device, cfg.parallel.backend,
                                               cfg.resilience.collective_timeout_s)  # fmt: skip
        self.say = say if self.dist.is_main else (lambda msg: None)
        self.layout = _config_step(resolve_layout, cfg.parallel, self.dist.world_size)
        self.mesh = build_mesh(self.layout, self.dist.device.type)
        self.device = self.dist.device
        self.dtype = resolve_dtype(cfg.train.dtype, self.device)
        self.step = 0
        self.tokens = 0  # of every kept step, earlier invocations' included
        self.tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        self.result = TrainResult(Path(), cfg.train.steps)
        self.last_step: StepOutput | None = None
        self.rolling_back = False  # the step just taken is about to be undone (see Callback.on_step_end)
        self.run_lock: RunLock | None = None  # held by rank 0 of an unsupervised run (the supervisor holds its own)
        self.run_dir, resuming = self._on_main_then_share(lambda: self._claim_run_dir(run_dir, config_name))
        self.room = RunDir.of(self.run_dir, cfg.checkpoint.dir)
        self.result.run_dir = self.run_dir
        self.say(f"run directory: {self.run_dir}")
        self.store_logger: StoreLogger | None = None
        self.files = self._file_loggers()
        self.heartbeat = Heartbeat(self.room, self.dist.rank)
        self.heartbeat.enable_stack_dumps()
        self.heartbeat.beat(0, "startup")
        self._open_data(resuming)
        self.module = TrainModule(cfg, self.tokenizer.vocab_size, self.mesh, self.layout, self.device, self.dtype)
        peaks = self._max_over_ranks([self.module.init_peak.host_bytes, self.module.init_peak.device_bytes])
        self._event("model_built", meta_init=cfg.train.meta_init, host_peak_bytes=peaks[0], device_peak_bytes=peaks[1])
        self._open_checkpoints()
        self._resume_or_init()
        peak, self.peak_source = device_peak_flops(self.device, self.dtype)
        # MFU's denominator: under fp8 the fp8 linears' share of the FLOPs counts at the fp8 peak (emulated,
        # or on a device the table does not know, at the compute dtype's); `peak_flops_dtype` stays the
        # compute dtype's peak, for an MFU comparable with runs without fp8.
        self.peak_flops_dtype = self._sum_over_ranks(peak)
        if self.module.fp8_share:
            fp8_peak = datasheet_fp8_peak_flops(self.device) if not cfg.train.fp8_emulate else None
            peak = mixed_peak_flops(peak, fp8_peak or peak, self.module.fp8_share)
            self.peak_source += f", fp8 linears at {'the fp8 data sheet peak' if fp8_peak else 'the same'}"
        self.peak_flops = self._sum_over_ranks(peak)
        self.logger = self._make_logger()
        params = self.module.params
        self.say(
            f"model: {params.total / 1e6:.2f}M parameters ({params.non_embedding / 1e6:.2f}M non-embedding),"
            f" {cfg.train.seq_len} tokens per sequence, attention {self.module.attention}, {_dtype_name(self.dtype)},"
            f" layout {self.layout}, {self.dist.world_size} process(es) on {self.device.type}"
        )
        if self.module.fp8_share:
            emulated = " (emulated)" if cfg.train.fp8_emulate else ""
            self.say(f"fp8 {cfg.train.fp8}{emulated}: {self.module.fp8_share:.0%} of the FLOPs; MFU against"
                     f" {self.peak_flops / 1e12:,.4g} TFLOP/s ({self.peak_source})")  # fmt: skip

    # -- the loop -----------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        steps, result = self.cfg.train.steps, self.result
        self.notify("on_train_start")
        # What x by tokens or FLOPs needs, said where every reader of the run finds it.
        self.logger.log_event(
            "train_start",
            step=self.step,
            layout=str(self.layout),
            world_size=self.dist.world_size,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=self.module.flops_per_token,
        )
        started, first_step = time.perf_counter(), self.step
        self.model.train()
        try:
            while self.step < steps:
                self.notify("before_step", self.step)
                try:
                    self.phase("data")
                    batches = self.loader.next_step(self.micro_batch)
                    maybe_inject("data", self.step + 1)
                    loss = self.module.forward_backward(batches, self.phase, self.step + 1)
                    corrupt_gradients(self.step + 1, self.model.parameters())
                    self.phase("optimizer")
                except StepAbandoned as abandoned:  # preempted, with no time to finish the step
                    self.stop_mid_step(abandoned.signum, abandoned.fallback_step)
                grad_norm, lr = self.module.clip_gradients(), self.module.lr
                update = self._agree_to_update(loss, grad_norm)
                if update:
                    self.module.optimizer_step(learning_rate_burst(self.step + 1))
                else:
                    self.module.skip_step()
                flip_parameter_bit(self.step + 1, self.model.parameters())
                self.step += 1
                self.tokens += self.tokens_per_step
                self.last_step = StepOutput(loss, grad_norm, lr, skipped=not update)
                self.notify("after_step", self.step, {})
                maybe_inject("step", self.step)
                self.notify("on_step_end", self.step)
            self.phase("done")  # the teardown: the last save may still be writing
            result.seconds, result.tokens = time.perf_counter() - started, self.tokens
            self.notify("on_train_end", result)
        except BaseException as err:
            self.notify("on_error", err)
            raise
        self._finish(result, first_step, (steps - first_step) * self.tokens_per_step)
        return result

    def notify(self, hook: str, *args: Any) -> None:
        """Call `hook` on every callback, in order."""
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def phase(self, name: str, micro: int = 0) -> None:
        """Where the current step has got to (heartbeats, for the supervisor's hang detection)."""
        for callback in self.callbacks:
            callback.on_phase(self, self.step, name, micro)

    def _agree_to_update(self, loss: torch.Tensor, grad_norm: float) -> bool:
        """Every callback that may veto the update is asked on every rank; one veto anywhere skips it
        everywhere, so the ranks' weights never part."""
        vetoers = [c for c in self.callbacks if c.overrides("before_optimizer_step")]
        if not vetoers:
            return True
        answers = [c.before_optimizer_step(self, self.step, loss, grad_norm) for c in vetoers]  # all are asked
        go = all(answers)
        if self.dist.distributed:
            flag = torch.tensor(1 if go else 0, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            go = bool(flag.item())
        return go

    # -- what callbacks call --------------------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.module.model

    @property
    def model_args(self) -> Any:
        return self.module.args

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.module.optimizer

    @property
    def autocast(self) -> bool:
        return self.module.autocast

    def save_checkpoint(self) -> float:
        """Save (in the background when asynchronous); returns the seconds training was blocked."""
        meta = {
            "format": "liandan-checkpoint",
            "layout": str(self.layout),
            **self.resume_state(),
            "model_family": self.module.spec.name,
            "model_args": dataclasses.asdict(self.model_args),
            "config": self.cfg.to_toml(),
            "liandan_version": __version__,
        }
        blocked = self.checkpoints.save(self.step, self.model, self.module.optimizer, meta)
        self.stop_if_unsaved(final=False)
        self.notify("on_checkpoint_saved", self.step)
        return blocked

    def stop_if_unsaved(self, final: bool) -> None:
        """End the run with a SaveError when its checkpoints are not being saved (see `unsaved_reason`): training
        on with nothing saved, or reporting success, would risk work that cannot be resumed."""
        reason = self.checkpoints.unsaved_reason(self.step, self.cfg.checkpoint.max_failed_saves, final)
        if reason is None:
            return
        self.heartbeat.beat(self.step, "done")  # the teardown, for the supervisor's watchdog
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
            self._event("preempted", signal=signal.Signals(signum).name, step=self.step, checkpoint=path)
        self.logger.close()
        raise Preempted(signum, self.step, path)

    def stop_mid_step(self, signum: int, fallback_step: int) -> None:
        """Preempted in the middle of a step, before its update, with no time to finish it: every rank goes
        back to the end of `fallback_step` (the step before, or an older one of the newest memory snapshot),
        saves it unless its checkpoint is saved or being saved, and stops. The model and optimizer still hold
        the end of the step before, but the loader, the random-number states and the callbacks' states have
        moved on: the memory snapshot holds them all, exactly as a checkpoint of its step would have."""
        self.module.optimizer.zero_grad(set_to_none=True)
        reshard(self.model)
        if self.checkpoints.started_step != fallback_step:
            state = self.snapshots.load(fallback_step, self.model, self.module.optimizer)
            self.rewind(fallback_step, state)
            self.phase("checkpoint")
            self.save_checkpoint()
        self.step = fallback_step
        self.stop_for_preemption(signum)

    def resume_state(self) -> dict[str, Any]:
        """What a resume needs besides the tensors: the schedule, the loader, the callbacks' states."""
        states = {c.name: state for c in self.callbacks if (state := c.state_dict())}
        return {"tokens": self.tokens, "scheduler": self.module.scheduler.state_dict(),
                "loader": self.loader.state_dict(), "tokenizer": self.stores[0].fingerprint,
                "callbacks": states}  # fmt: skip

    def rewind(self, step: int, state: dict[str, Any]) -> None:
        """Go back to `step`, whose `resume_state()` is `state`, after the caller has put that step's model and
        optimizer state back: the schedule, the loader, the callbacks' states, the token count, the metrics
        (the steps after `step` are about to be trained again)."""
        t = self.cfg.train
        undone = sum(1 for s in range(step + 1, self.step + 1) if s % t.log_every == 0 or s == t.steps)
        del self.result.losses[max(0, len(self.result.losses) - undone) :]
        self.module.scheduler.load_state_dict(state["scheduler"])
        self.loader.load_state_dict(state["loader"])
        self.tokens = int(state["tokens"])
        self.step = step
        for callback in self.callbacks:
            if callback.name in state.get("callbacks", {}):
                callback.load_state_dict(state["callbacks"][callback.name])
        if self.dist.is_main:
            self.room.truncate_metrics(step)

    def evaluate(self) -> float:
        batches = self.loader.validation(self.cfg.train.eval_batches, self.micro_batch)
        return self.mean_over_ranks(self.module.loss_over(batches))

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        # Tensor-parallel peers hold the same loss, so the mean over all ranks is the mean over data ranks.
        if self.dist.distributed:
            value = value.detach().clone()
            dist.all_reduce(value)
            value /= self.dist.world_size
        return float(value)

    def close(self) -> None:
        """Leave the process group and release the run directory; the trainer cannot step after this."""
        self.heartbeat.close()
        shutdown_distributed()
        if self.run_lock is not None:
            self.run_lock.release()

    # -- set-up ---------------------------------------------------------------------------------------------
    def _claim_run_dir(self, run_dir: Path | None, config_name: str) -> tuple[Path, bool]:
        path, resumable, self.run_lock = _make_run_dir(self.cfg, run_dir, config_name)
        return path, resumable

    def _open_data(self, resuming: bool) -> None:
        """Token stores from the data pipeline, or rank 0 tokenizes `[data] paths` into a store in the run
        directory (resuming, it reuses that store) and the others open it; then the loader of this rank."""
        cfg, t = self.cfg, self.cfg.train
        if cfg.data.stores:
            self.stores, self.tokenizer = open_stores(cfg.data.stores, cfg.data.cache_dir, self.say)
        else:
            data_dir = self.room.data

            def prepare() -> None:
                if not (resuming and self.room.data_manifest.is_file()):
                    prepare_store(cfg.data, data_dir, self.say)

            self._on_main_then_share(prepare)
            store, self.tokenizer = open_prepared(data_dir)
            self.stores = [store]
        self.dp_rank, self.dp_size = dp_coordinates(self.mesh, self.layout)
        per_rank = t.global_batch // self.dp_size if t.global_batch % self.dp_size == 0 else 0
        self.micro_batch = t.micro_batch or per_rank
        if not per_rank or per_rank % self.micro_batch:
            raise ConfigError(
                f"train.global_batch = {t.global_batch} must split into {self.dp_size} data-parallel ranks"
                f" of whole micro-batches of train.micro_batch = {self.micro_batch}"
            )
        self.loader = PackedLoader(
            self.stores, t.seq_len, t.global_batch, cfg.run.seed, cfg.data.val_fraction, self.dp_rank, self.dp_size,
            weights=cfg.data.weights or None,
        )  # fmt: skip

    def _open_checkpoints(self) -> None:
        c = self.cfg.checkpoint
        self.checkpoints = CheckpointManager(
            self.room.checkpoints,
            keep_last=c.keep_last,
            keep_every=c.keep_every,
            async_save=c.async_save,
            verify_on_load=c.verify,
            on_event=self._event,
        )
        if self.dist.is_main:
            stale = self.checkpoints.remove_stale_saves()
            if stale:
                self.say(f"removed {len(stale)} half-done checkpoint save(s) of an earlier process: "
                         + ", ".join(p.name for p in stale))  # fmt: skip
                self._event("stale_saves_removed", paths=[str(p) for p in stale])
        # Snapshots in host memory serve the supervisor's restarts only: it owns them and removes them.
        owner, handed = WorkerEnv.from_env().snapshot_owner, snapshots.handed_dir()
        self.snapshots = None
        if c.memory_every and owner and handed:
            self.snapshots = snapshots.MemorySnapshots(handed, self.dist.rank, self.dist.world_size, owner,
                                                       str(self.layout))  # fmt: skip

    def _resume_or_init(self) -> None:
        """Continue from the newest memory snapshot or checkpoint that verifies (`choose_resume`, the decision
        the supervisor takes too), or start from `init_from`."""
        c = self.cfg.checkpoint
        point = None
        if c.resume == "auto":
            in_memory = self.snapshots.agree() if self.snapshots else None
            newest = None
            if in_memory is not None:
                newest = self._on_main_then_share(
                    lambda: [p.name for p in self.checkpoints.complete_checkpoints()[-1:]]
                )
            point = choose_resume(in_memory, step_of(Path(newest[0])) if newest else None,
                                  lambda: newest_checkpoint(self.checkpoints))  # the supervisor's verdict, if fresh  # fmt: skip
        if point is not None and point.source == "memory":
            meta = self.snapshots.load(point.step, self.model, self.module.optimizer)
            self._continue_from(meta, point.step, f"the memory snapshot in {self.snapshots.directory}")
            self._event("resumed", step=self.step, source="memory", path=str(self.snapshots.directory),
                        from_layout=str(self.layout))  # fmt: skip
        elif point is not None and point.source == "checkpoint":
            # one that verifies may still fail to load: then the newest older one that does
            path, meta = self.checkpoints.load_newest(point.path, self.model, self.module.optimizer)
            self._continue_from(meta, int(meta["step"]), str(path))
            self._event("resumed", step=self.step, source="checkpoint", path=str(path), from_layout=meta.get("layout"))
        elif c.init_from:
            self._init_from(locate(c.init_from))
        if self.step == 0 and self.dist.is_main:  # a restart with nothing to resume from starts over
            self.room.truncate_metrics(0)

    def _init_from(self, source: Path) -> None:
        if is_weight_source(source):
            self._init_from_weights(source)
            return
        if not (source / META).is_file():
            raise ConfigError(f"checkpoint.init_from = {source}: no checkpoint there ({META} missing)")
        their_meta = read_meta(source)
        family = their_meta.get("model_family", "llama")
        if family != self.module.spec.name:
            raise ConfigError(f"checkpoint.init_from = {source} has another model: model.family = "
                              f"{self.module.spec.name} (checkpoint: {family})")  # fmt: skip
        # Shapes and what the shapes do not show (RoPE base and scaling, norm epsilon): either would load.
        differ = self.module.spec.differences(self.model_args, their_meta.get("model_args", {}))
        if differ:
            raise ConfigError(f"checkpoint.init_from = {source} has another model: {'; '.join(differ)}")
        self.checkpoints.load(source, self.model)
        self.say(f"initialised model weights from {source}")
        self._event("initialised", path=str(source))

    def _init_from_weights(self, source: Path) -> None:
        """Hugging Face or consolidated weights, each rank reading only its shards' slices, tensor by tensor."""
        try:
            read = load_weights(self.model, self.model_args, source)
        except (ValueError, OSError) as err:
            raise ConfigError(f"checkpoint.init_from = {source}: {err}") from None
        self.say(f"initialised model weights from {source}")
        self._event("initialised", path=str(source), bytes_read=self._sum_over_ranks(read))

    def _continue_from(self, meta: dict[str, Any], step: int, source: str) -> None:
        if meta.get("tokenizer") != self.stores[0].fingerprint:
            data = ", ".join(str(s.path) for s in self.stores)
            raise ConfigError(f"{source} was trained with another tokenizer than the data in {data}")
        self.module.scheduler.load_state_dict(meta["scheduler"])
        self.loader.load_state_dict(meta["loader"])
        self.step = step
        per_step = self.cfg.train.global_batch * self.cfg.train.seq_len
        self.tokens = int(meta.get("tokens", step * per_step))  # older snapshots lack it: tokens/step was constant
        states = meta.get("callbacks", {})
        for callback in self.callbacks:
            if callback.name in states:
                callback.load_state_dict(states[callback.name])
        if self.dist.is_main:
            self.room.truncate_metrics(self.step)
        self.say(f"resumed from {source} at step {self.step}")
        self.notify("on_checkpoint_loaded", self.step, source)

    def _event(self, kind: str, **fields: Any) -> None:
        # Said before it is recorded: on a full disk the record may fail.
        if kind == "checkpoint_failed":
            self.say(f"warning: checkpoint of step {fields['step']} failed ({fields['path']}): {fields['error']}")
        elif kind == "checkpoint_rejected":
            self.say(f"warning: checkpoint rejected: {fields.get('error')}")
        self.files.log_event(kind, **fields)

    def _max_over_ranks(self, values: list[int]) -> list[int]:
        if not self.dist.distributed:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def _sum_over_ranks(self, value: float) -> float:
        if not self.dist.distributed:
            return value
        t = torch.tensor(value, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t)

    def _on_main_then_share(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on rank 0 and hand its result (or its user-facing error) to every rank."""
        if not self.dist.distributed:
            return fn()
        box: list[Any] = [None]
        if self.dist.is_main:
            try:
                box[0] = ("ok", fn())
            except (ConfigError, ValueError, OSError) as err:
                box[0] = ("error", err)
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            raise value
        return value

    def _file_loggers(self) -> MetricsLogger:
        """Rank 0's records: the run's JSON-lines files and, after them, the project's run store, which
        indexes those files (it reads what the first one has just written)."""
        if not self.dist.is_main:
            return NullLogger()
        files = JsonlLogger(self.room)
        if not self.cfg.track.store:
            return files
        self.store_logger = StoreLogger(self.room, every_s=self.cfg.track.store_every_s, warn=self.say)
        return FanOut(files, self.store_logger)

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
            "parameters": params.total,
            "non_embedding_parameters": params.non_embedding,
            "flops_per_token": self.module.flops_per_token,
            "tokens_per_s": tokens_trained_now / result.seconds if result.seconds else None,
            "peak_flops": self.peak_flops,
            "peak_flops_source": self.peak_source,
            "layout": str(self.layout),
            "world_size": self.dist.world_size,
            "dtype": _dtype_name(self.dtype),
        }
        self.room.write_summary(result.summary)
        if self.cfg.track.plot:
            with naming(self.room.plot()):
                plot_run(self.run_dir)
        if self.store_logger is not None:  # the summary came after the loggers closed
            self.store_logger.close()


def _make_run_dir(cfg: Config, run_dir: Path | None, config_name: str) -> tuple[Path, bool, RunLock | None]:
    """(run directory, whether it holds checkpoints to resume from, its lock). A directory with an earlier
    run's steps and nothing to resume from is refused unless `run.overwrite` is set; one in use by another
    run is refused. A supervised worker takes no lock: its supervisor holds it."""
    if run_dir is None:
        run_dir = cfg.run_dir(config_name)
    room = RunDir.of(run_dir, cfg.checkpoint.dir)
    run_dir = room.path
    env = WorkerEnv.from_env()
    lock = None if env.supervised else lock_run_dir(room)  # before anything is touched
    resumable = False
    if cfg.checkpoint.resume == "auto":
        # The supervisor empties the snapshot directory when it starts: what is there is this run's.
        held = cfg.checkpoint.memory_every and env.snapshot_owner
        in_memory = snapshots.newest_held_step(snapshots.handed_dir()) if held else None
        resumable = can_resume(room.complete_checkpoints(), in_memory)
    # A supervised restart with nothing to resume from starts the run over.
    overwrite = cfg.run.overwrite or env.attempt > 0
    if holds_progress(room) and not resumable and not overwrite:
        raise ConfigError(
            f"run directory {run_dir} already holds a run with no checkpoint to resume from;"
            " choose another --run.name or pass --run.overwrite=true"
        )
    if overwrite and not resumable:
        # A restart keeps events.jsonl: the incidents that led to it are part of the run's history.
        restarting = not cfg.run.overwrite
        for path in (room.metrics, room.summary) if restarting else (room.metrics, room.events, room.summary):
            path.unlink(missing_ok=True)
        if not restarting:  # an earlier run's guard reports and tracker runs are not this run's
            shutil.rmtree(room.guard, ignore_errors=True)
            shutil.rmtree(room.tensorboard, ignore_errors=True)
            room.trackers.unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, resumable, lock


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
