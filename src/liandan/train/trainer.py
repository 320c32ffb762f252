"""The training loop, readable top to bottom: set up processes, data, model, parallelism and optimizer, then
step. Everything around the loop (checkpoints, guards, incident handling, the run store) plugs in through
`Callback` hooks and the `MetricsLogger` seam, so the loop itself stays short."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from liandan import __version__
from liandan.checkpoint import memory
from liandan.checkpoint.manager import CheckpointManager
from liandan.config import Config, ConfigError
from liandan.data.loader import Batch, PackedLoader
from liandan.data.prepare import open_prepared, open_stores, prepare_store
from liandan.faults import maybe_inject
from liandan.model import ModelArgs, Transformer, count_params, flops_per_token
from liandan.resilience.handoff import newest_checkpoint
from liandan.track import ConsoleLogger, FanOut, JsonlLogger, MetricsLogger, NullLogger, plot_run
from liandan.train.distributed import DistInfo, init_distributed, shutdown_distributed
from liandan.train.hardware import device_peak_flops, peak_memory_bytes, resolve_dtype
from liandan.train.heartbeat import Heartbeat
from liandan.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from liandan.train.parallelize import build_mesh, dp_coordinates, gradient_sync, parallelize, resolve_layout, uses_fsdp
from liandan.train.preemption import Preempted, PreemptionGuard


class Callback:
    """Hooks into the loop. Subclass and override what you need; every method is optional."""

    def on_train_start(self, trainer: Trainer) -> None: ...

    def before_step(self, trainer: Trainer, step: int) -> None: ...

    def after_step(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None: ...

    def on_checkpoint(self, trainer: Trainer, step: int) -> None: ...

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None: ...


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    tokens: int = 0
    seconds: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path | None = None,
        callbacks: Sequence[Callback] = (),
        config_name: str = "run",
        say: Callable[[str], None] = print,
        preemption: PreemptionGuard | None = None,
    ):
        self.cfg, self.callbacks, self.preemption = cfg, list(callbacks), preemption
        self.dist: DistInfo = init_distributed(cfg.run.device, cfg.parallel.backend,
                                               cfg.resilience.collective_timeout_s)  # fmt: skip
        self.say = say if self.dist.is_main else (lambda msg: None)
        self.layout = _config_step(resolve_layout, cfg.parallel, self.dist.world_size)
        self.mesh = build_mesh(self.layout, self.dist.device.type)
        self.device = self.dist.device
        self.dtype = resolve_dtype(cfg.train.dtype, self.device)
        self.run_dir, resuming = self._on_main_then_share(lambda: _make_run_dir(cfg, run_dir, config_name))
        self.say(f"run directory: {self.run_dir}")
        self.files = JsonlLogger(self.run_dir) if self.dist.is_main else NullLogger()
        self.heartbeat = Heartbeat(self.run_dir / "heartbeat", self.dist.rank)
        self.heartbeat.enable_stack_dumps()
        self.heartbeat.beat(0, "startup")

        # Data: token stores from the data pipeline, or rank 0 tokenizes `[data] paths` into a store in the run
        # directory (resuming, it reuses that store) and the others open it.
        if cfg.data.stores:
            self.stores, self.tokenizer = open_stores(cfg.data.stores)
        else:
            data_dir = self.run_dir / "data"

            def prepare() -> None:
                if not (resuming and (data_dir / "manifest.json").is_file()):
                    prepare_store(cfg.data, data_dir, self.say)

            self._on_main_then_share(prepare)
            store, self.tokenizer = open_prepared(data_dir)
            self.stores = [store]
        self.dp_rank, self.dp_size = dp_coordinates(self.mesh, self.layout)
        t = cfg.train
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

        # Model: the same seed on every rank gives every rank the same initial weights before sharding.
        self.model_args = _model_args(cfg, self.tokenizer.vocab_size)
        torch.manual_seed(cfg.run.seed)
        model = Transformer(self.model_args)
        backend = _config_step(model.configure_attention, self.device)
        model.to(self.device)
        fsdp = uses_fsdp(self.layout)
        self.model = parallelize(
            model,
            self.mesh,
            self.layout,
            activation_checkpoint=t.activation_checkpoint,
            compile=t.compile,
            fsdp_param_dtype=self.dtype if fsdp and self.dtype != torch.float32 else None,
        )
        # FSDP2 casts parameters itself; elsewhere autocast runs matmuls in bf16 over fp32 master weights.
        self.autocast = self.dtype != torch.float32 and not fsdp
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device, mixed_tensor_kinds=self.layout.tp > 1)
        self.scheduler = build_scheduler(self.optimizer, t.steps, cfg.schedule)
        self.step = 0
        c = cfg.checkpoint
        self.checkpoints = CheckpointManager(
            Path(c.dir) if c.dir else self.run_dir / "checkpoints",
            keep_last=c.keep_last,
            keep_every=c.keep_every,
            async_save=c.async_save,
            verify_on_load=c.verify,
            on_event=self._event,
        )
        # Snapshots in host memory serve the supervisor's restarts only: it owns them and removes them.
        owner, handed = os.environ.get(memory.OWNER_ENV), memory.handed_dir()
        self.snapshots = None
        if c.memory_every and owner and handed:
            self.snapshots = memory.MemorySnapshots(handed, self.dist.rank, self.dist.world_size, owner,
                                                    str(self.layout))  # fmt: skip
        self._resume_or_init()

        self.params = count_params(self.model_args)
        self.flops_per_token = flops_per_token(self.model_args, t.seq_len)
        peak, self.peak_source = device_peak_flops(self.device, self.dtype)
        self.peak_flops = self._sum_over_ranks(peak)
        self.logger = self._make_logger()
        self.say(
            f"model: {self.params.total / 1e6:.2f}M parameters ({self.params.non_embedding / 1e6:.2f}M non-embedding),"
            f" {t.seq_len} tokens per sequence, attention {backend}, {_dtype_name(self.dtype)},"
            f" layout {self.layout}, {self.dist.world_size} process(es) on {self.device.type}"
        )

    # -- the loop -----------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        result = TrainResult(self.run_dir, t.steps)
        tokens_per_step = t.global_batch * t.seq_len
        for cb in self.callbacks:
            cb.on_train_start(self)
        self.logger.log_event("train_start", step=self.step, layout=str(self.layout), world_size=self.dist.world_size)
        started = time.perf_counter()
        first_step = self.step
        if self.preemption:
            self.preemption.start_loop(self.dist.distributed)
        self.model.train()
        while self.step < t.steps:
            for cb in self.callbacks:
                cb.before_step(self, self.step)
            step_start = time.perf_counter()
            self.heartbeat.beat(self.step, "data")
            batches = self.loader.next_step(self.micro_batch)
            maybe_inject("data", self.step + 1)
            loss = self.train_step(batches)
            self.heartbeat.beat(self.step, "optimizer")
            grad_norm = self.clip_gradients()
            lr = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1

            if self.step % t.log_every == 0 or self.step == t.steps:
                self.heartbeat.beat(self.step, "collective")
                loss_value = self._mean_over_ranks(loss)
                seconds = time.perf_counter() - step_start
                metrics = {
                    "loss": loss_value,
                    "grad_norm": float(grad_norm),
                    "lr": lr,
                    "tokens_per_s": tokens_per_step / seconds,
                    "mfu": self.flops_per_token * tokens_per_step / seconds / self.peak_flops,
                    "peak_mem_gib": peak_memory_bytes(self.device) / 2**30,
                    "step_time_s": seconds,
                }
                result.losses.append(loss_value)
                self.logger.log_metrics(self.step, metrics)
                for cb in self.callbacks:
                    cb.after_step(self, self.step, metrics)
                if not math.isfinite(loss_value):
                    self.logger.log_event("nonfinite_loss", step=self.step, loss=str(loss_value))
            self.heartbeat.beat(self.step, "step_end")
            if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                self.heartbeat.beat(self.step, "eval")
                result.val_loss = self.evaluate()
                self.logger.log_event("eval", step=self.step, loss=result.val_loss)
            if self.snapshots and self.step % cfg.checkpoint.memory_every == 0 and self.step < t.steps:
                self.snapshots.save(self.step, self.model, self.optimizer, self._resume_state())
            every = cfg.checkpoint.every
            stop = self.preemption.agreed() if self.preemption and self.step < t.steps else 0
            if stop or (every and (self.step % every == 0 or self.step == t.steps)):
                self.heartbeat.beat(self.step, "checkpoint")
                self.save_checkpoint()
            if stop:
                self._stop_for_preemption(stop)
            maybe_inject("step", self.step)
        if self.preemption:
            self.preemption.end_loop()
        self.heartbeat.beat(self.step, "done")  # the teardown: the last save may still be writing
        self.checkpoints.close()
        result.seconds = time.perf_counter() - started
        result.tokens = (t.steps - first_step) * tokens_per_step
        self._finish(result)
        for cb in self.callbacks:
            cb.on_train_end(self, result)
        return result

    def train_step(self, batches: list[Batch]) -> torch.Tensor:
        """Forward and backward over the micro-batches of one step; returns the step's mean loss (detached)."""
        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(batches):
            batch = batch.to(self.device)
            with gradient_sync(self.model, sync=i == len(batches) - 1):
                self.heartbeat.beat(self.step, "forward", micro=i)
                with self._autocast():
                    loss = self.model(batch.inputs, batch.targets, doc_ids=self._doc_ids(batch)) / len(batches)
                self.heartbeat.beat(self.step, "backward", micro=i)
                loss.backward()
            total += loss.detach()
        return total

    def save_checkpoint(self) -> float:
        """Save (in the background when asynchronous); returns the seconds training was blocked."""
        meta = {
            "format": "liandan-checkpoint",
            "tokens": self.step * self.cfg.train.global_batch * self.cfg.train.seq_len,
            "layout": str(self.layout),
            **self._resume_state(),
            "model_args": dataclasses.asdict(self.model_args),
            "config": self.cfg.to_toml(),
            "liandan_version": __version__,
        }
        blocked = self.checkpoints.save(self.step, self.model, self.optimizer, meta)
        for cb in self.callbacks:
            cb.on_checkpoint(self, self.step)
        return blocked

    def _stop_for_preemption(self, signum: int) -> None:
        """Every rank has just saved the checkpoint of this step: wait until it is complete, then stop."""
        self.checkpoints.close()
        saved = [o for o in self.checkpoints.outcomes if o.step == self.step and o.ok]
        path = str(saved[-1].path) if saved else None
        if "LIANDAN_SUPERVISED" not in os.environ:  # a supervisor records the preemption itself
            self._event("preempted", signal=signal.Signals(signum).name, step=self.step, checkpoint=path)
        self.logger.close()
        raise Preempted(signum, self.step, path)

    def _resume_state(self) -> dict[str, Any]:
        """What a resume needs besides the tensors."""
        return {"scheduler": self.scheduler.state_dict(), "loader": self.loader.state_dict(),
                "tokenizer": self.stores[0].fingerprint}  # fmt: skip

    def _resume_or_init(self) -> None:
        """Continue from the newest memory snapshot or checkpoint that verifies, or start from `init_from`."""
        c = self.cfg.checkpoint
        auto = c.resume == "auto"
        in_memory = self.snapshots.agree() if self.snapshots and auto else None
        newest = None
        if in_memory is not None:
            newest = self._on_main_then_share(lambda: [p.name for p in self.checkpoints.complete_checkpoints()[-1:]])
        if in_memory is not None and in_memory >= (int(newest[0][5:]) if newest else 0):
            path = None  # the snapshot is as new as any checkpoint: no checkpoint need be read, let alone verified
        else:
            path = newest_checkpoint(self.checkpoints) if auto else None  # the supervisor's verdict, if fresh
            if path is not None and in_memory is not None and in_memory <= int(path.name[5:]):
                in_memory = None
        if in_memory is not None:
            meta = self.snapshots.load(in_memory, self.model, self.optimizer)
            self._continue_from(meta, in_memory, f"the memory snapshot in {self.snapshots.directory}")
            self._event("resumed", step=self.step, source="memory", path=str(self.snapshots.directory),
                        from_layout=str(self.layout))  # fmt: skip
        elif path is not None:
            meta = self.checkpoints.load(path, self.model, self.optimizer, verified=True)
            self._continue_from(meta, int(meta["step"]), str(path))
            self._event("resumed", step=self.step, source="checkpoint", path=str(path), from_layout=meta.get("layout"))
        elif c.init_from:
            source = Path(c.init_from)
            if not (source / "meta.json").is_file():
                raise ConfigError(f"checkpoint.init_from = {source}: no checkpoint there (meta.json missing)")
            theirs = json.loads((source / "meta.json").read_text()).get("model_args", {})
            ours = dataclasses.asdict(self.model_args)
            shape_keys = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings", "qk_norm")
            differ = [f"model.{k} = {ours[k]} (checkpoint: {theirs.get(k)})" for k in shape_keys if theirs.get(k) != ours[k]]
            if differ:
                raise ConfigError(f"checkpoint.init_from = {source} has another model shape: {'; '.join(differ)}")
            self.checkpoints.load(source, self.model)
            self.say(f"initialised model weights from {source}")
            self._event("initialised", path=str(source))
        if self.step == 0 and self.dist.is_main:  # a restart with nothing to resume from starts over
            _truncate_metrics(self.run_dir / "metrics.jsonl", 0)

    def _continue_from(self, meta: dict[str, Any], step: int, source: str) -> None:
        if meta.get("tokenizer") != self.stores[0].fingerprint:
            data = ", ".join(str(s.path) for s in self.stores)
            raise ConfigError(f"{source} was trained with another tokenizer than the data in {data}")
        self.scheduler.load_state_dict(meta["scheduler"])
        self.loader.load_state_dict(meta["loader"])
        self.step = step
        if self.dist.is_main:
            _truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
        self.say(f"resumed from {source} at step {self.step}")

    def _event(self, kind: str, **fields: Any) -> None:
        self.files.log_event(kind, **fields)
        if kind in ("checkpoint_failed", "checkpoint_rejected"):
            self.say(f"warning: {kind.replace('_', ' ')}: {fields.get('error')}")

    def clip_gradients(self) -> float:
        return clip_grad_norm(self.model.parameters(), self.cfg.optim.grad_clip or float("inf"))

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        batches = self.loader.validation(self.cfg.train.eval_batches, self.micro_batch)
        total = torch.zeros((), device=self.device)
        for batch in batches:
            batch = batch.to(self.device)
            with self._autocast():
                total += self.model(batch.inputs, batch.targets, doc_ids=self._doc_ids(batch)).float()
        self.model.train()
        return self._mean_over_ranks(total / max(1, len(batches)))

    def close(self) -> None:
        """Leave the process group; the trainer cannot step after this."""
        self.heartbeat.close()
        shutdown_distributed()

    # -- helpers ------------------------------------------------------------------------------------------
    def _doc_ids(self, batch: Batch) -> torch.Tensor | None:
        return batch.doc_ids if self.cfg.train.mask == "document" else None

    def _autocast(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def _mean_over_ranks(self, value: torch.Tensor) -> float:
        # Tensor-parallel peers hold the same loss, so the mean over all ranks is the mean over data ranks.
        if self.dist.distributed:
            value = value.detach().clone()
            dist.all_reduce(value)
            value /= self.dist.world_size
        return float(value)

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

    def _make_logger(self) -> MetricsLogger:
        if not self.dist.is_main:
            return NullLogger()
        (self.run_dir / "config.toml").write_text(self.cfg.to_toml())
        return FanOut(self.files, ConsoleLogger(self.cfg.train.steps, first_step=self.step))

    def _finish(self, result: TrainResult) -> None:
        self.logger.log_event("train_end", step=self.step, seconds=result.seconds)
        self.logger.close()
        if not self.dist.is_main:
            return
        tail = result.losses[-max(1, len(result.losses) // 10) :]
        result.summary = {
            "steps": self.step,
            "tokens": result.tokens,
            "seconds": round(result.seconds, 3),
            "final_loss": result.losses[-1] if result.losses else None,
            "final_loss_smoothed": sum(tail) / len(tail) if tail else None,
            "val_loss": result.val_loss,
            "parameters": self.params.total,
            "non_embedding_parameters": self.params.non_embedding,
            "flops_per_token": self.flops_per_token,
            "tokens_per_s": result.tokens / result.seconds if result.seconds else None,
            "peak_flops": self.peak_flops,
            "peak_flops_source": self.peak_source,
            "layout": str(self.layout),
            "world_size": self.dist.world_size,
            "dtype": _dtype_name(self.dtype),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")
        plot_run(self.run_dir)


def _model_args(cfg: Config, tokenizer_vocab: int) -> ModelArgs:
    m = cfg.model
    vocab = m.vocab_size or 64 * math.ceil(tokenizer_vocab / 64)  # multiples of 64 keep matmuls aligned
    if vocab < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size = {vocab} is smaller than the tokenizer's {tokenizer_vocab} tokens")
    fields = {k: getattr(m, k) for k in ModelArgs.__dataclass_fields__ if k != "vocab_size"}
    return ModelArgs(vocab_size=vocab, **fields)


def _make_run_dir(cfg: Config, run_dir: Path | None, config_name: str) -> tuple[Path, bool]:
    """(run directory, whether it holds checkpoints to resume from). A directory with an earlier run and
    nothing to resume from is refused unless `run.overwrite` is set."""
    if run_dir is None:
        run_dir = Path(cfg.run.output_dir) / cfg.run_name(config_name)
    run_dir = Path(run_dir)
    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    resumable = cfg.checkpoint.resume == "auto" and any(ckpt_root.glob("step-*/manifest.json"))
    if cfg.checkpoint.resume == "auto" and cfg.checkpoint.memory_every and os.environ.get(memory.OWNER_ENV):
        # The supervisor empties the snapshot directory when it starts: what is there is this run's.
        handed = memory.handed_dir()
        resumable = resumable or bool(handed and any(handed.glob("rank-*.json")))
    # A supervised restart with nothing to resume from starts the run over.
    overwrite = cfg.run.overwrite or int(os.environ.get("LIANDAN_ATTEMPT", "0")) > 0
    if (run_dir / "metrics.jsonl").exists() and not resumable and not overwrite:
        raise ConfigError(
            f"run directory {run_dir} already holds a run with no checkpoint to resume from;"
            " choose another --run.name or pass --run.overwrite=true"
        )
    if overwrite and not resumable:
        # A restart keeps events.jsonl: the incidents that led to it are part of the run's history.
        restarting = not cfg.run.overwrite
        for name in ("metrics.jsonl", "summary.json") if restarting else ("metrics.jsonl", "events.jsonl", "summary.json"):
            (run_dir / name).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, resumable


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records of steps after `step`: they are about to be trained again."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))


def _config_step(fn: Callable, *args: Any) -> Any:
    """Setup steps raise ValueError for impossible settings; report them as configuration errors."""
    try:
        return fn(*args)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
