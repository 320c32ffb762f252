"""What a run is made of, built before the trainer and handed to it: the processes and devices, the run
directory, the data loader, the train module, the checkpointer and the callbacks.

`build_components(cfg)` makes every one from the config, each by a small builder of its own; a Python caller
replaces any of them (its own loader, its own train module, more callbacks) without changing liandan:

    components = build_components(cfg, loader=my_loader, module=lambda env, tokenizer: MyModule(env))
    result = Trainer(components).train()

The data pipeline (tokenizing `[data] paths` into a store in the run directory, or opening `[data] stores`)
runs here, before the trainer exists.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from liandan.checkpoint import snapshots
from liandan.checkpoint.manager import CheckpointManager
from liandan.checkpoint.resume import can_resume
from liandan.checkpoint.saving import SaveError
from liandan.checkpoint.verify import CheckpointError
from liandan.common.layout import Layout, batch_split_refusal, resolve_layout
from liandan.config import Config, ConfigError
from liandan.data.documents.corpus import DataError
from liandan.data.pipeline.chat import prepare_chat_store
from liandan.data.pipeline.preferences import prepare_preference_store
from liandan.data.pipeline.prepare import open_prepared, open_stores, prepare_store
from liandan.data.tokens.loader import Batch, PackedLoader
from liandan.data.tokens.pairs import PairLoader
from liandan.plugins import PluginError
from liandan.run import RunDir, RunLock, holds_progress, lock_run_dir
from liandan.run.errors import DeviceFault, RunStopped
from liandan.run.worker_env import WorkerEnv
from liandan.track import FanOut, JsonlLogger, MetricsLogger, NullLogger
from liandan.track.store import StoreLogger
from liandan.train.callbacks import Callback, build_callbacks, in_order
from liandan.train.causal_lm import CausalLMTrainModule, _config_step
from liandan.train.distributed import DistInfo, init_distributed
from liandan.train.hardware import resolve_dtype
from liandan.train.heartbeat import Heartbeat
from liandan.train.parallelize import build_mesh, dp_coordinates
from liandan.train.train_module import TrainModule

# Errors that a restart cannot mend: the command line says them in one line and exits 2 (4: a faulty device).
STOPPING_ERRORS = (ConfigError, DataError, CheckpointError, PluginError, RunStopped)


class StepLoader(Protocol):
    """What the trainer needs of a data loader. liandan's `PackedLoader` also offers what the loss-spike guard
    uses to skip and diagnose batches (`step`, `skip`, `batch_at`, `documents_for_step`) and what evaluation
    uses (`validation`, `stores`); a loader without them runs with the guard unable to skip data."""

    def next_step(self, micro_batch: int) -> list[Batch]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class Environment:
    """The processes and devices the run trains on, and the few collectives set-up needs."""

    dist: DistInfo
    layout: Layout
    mesh: Any
    device: torch.device
    dtype: torch.dtype
    say: Callable[[str], None]

    @property
    def dp_coordinates(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel size)."""
        return dp_coordinates(self.mesh, self.layout)

    def on_main_then_share(self, fn: Callable[[], Any]) -> Any:
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

    def max_over_ranks(self, values: list[int]) -> list[int]:
        if not self.dist.distributed:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def sum_over_ranks(self, value: float) -> float:
        if not self.dist.distributed:
            return value
        t = torch.tensor(value, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t)


@dataclass
class Data:
    """The loader of this rank and what it reads."""

    loader: StepLoader
    micro_batch: int
    dp_rank: int
    dp_size: int
    stores: list[Any] = field(default_factory=list)  # token stores (their fingerprint ties checkpoints to them)
    tokenizer: Any = None


@dataclass
class Components:
    cfg: Config
    env: Environment
    room: RunDir
    resuming: bool  # the run directory holds something to resume from
    run_lock: RunLock | None  # held by rank 0 of an unsupervised run (the supervisor holds its own)
    files: MetricsLogger  # rank 0's records in the run directory (and the run store)
    store_logger: StoreLogger | None
    heartbeat: Heartbeat
    data: Data
    module: TrainModule
    checkpoints: CheckpointManager
    snapshots: snapshots.MemorySnapshots | None
    callbacks: list[Callback]
    say: Callable[[str], None]

    def event(self, kind: str, **fields: Any) -> None:
        """An event in the run's log (rank 0), said on the console first where the user must know at once."""
        if kind == "checkpoint_failed":  # said before it is recorded: on a full disk the record may fail
            self.say(f"warning: checkpoint of step {fields['step']} failed ({fields['path']}): {fields['error']}")
        elif kind == "checkpoint_rejected":
            self.say(f"warning: checkpoint rejected: {fields.get('error')}")
        self.files.log_event(kind, **fields)


ModuleFactory = Callable[[Environment, Any], TrainModule]  # (environment, tokenizer) -> the train module
LoaderFactory = Callable[[Environment, int, int], StepLoader]  # (environment, dp rank, dp size) -> the loader


def build_components(
    cfg: Config,
    run_dir: Path | None = None,
    config_name: str = "run",
    callbacks: Sequence[Callback] = (),
    loader: StepLoader | LoaderFactory | None = None,
    module: TrainModule | ModuleFactory | None = None,
    say: Callable[[str], None] = print,
) -> Components:
    """Every component of a run from its config; `loader` and `module` (objects, or factories called once the
    processes and the mesh exist) replace liandan's own; `callbacks` join the registered ones, each replacing
    a registered one of its class."""
    env = build_environment(cfg, say)
    holder: list[RunLock | None] = [None]

    def claim() -> tuple[Path, bool]:
        path, resumable, holder[0] = claim_run_dir(cfg, run_dir, config_name)
        return path, resumable

    path, resuming = env.on_main_then_share(claim)
    room = RunDir.of(path, cfg.checkpoint.dir)
    env.say(f"run directory: {room.path}")
    files, store_logger = file_loggers(cfg, room, env)
    with stops_recorded(files):  # from here on the run directory is this run's
        heartbeat = Heartbeat(room, env.dist.rank)
        heartbeat.enable_stack_dumps()
        heartbeat.beat(0, "startup")
        data = build_data(cfg, env, room, resuming, loader)
        if module is None:
            module = build_train_module(cfg, env, data.tokenizer)
        elif not isinstance(module, TrainModule):
            module = module(env, data.tokenizer)
        parts = Components(cfg, env, room, resuming, holder[0], files, store_logger, heartbeat, data, module,
                           None, None, [], env.say)  # type: ignore[arg-type]  # fmt: skip
        parts.checkpoints, parts.snapshots = build_checkpointer(cfg, room, env, parts.event)
        # A callback handed in replaces a registered one of its class (a caller's own forecast, configured otherwise).
        registered = [c for c in build_callbacks(cfg) if not any(type(c) is type(own) for own in callbacks)]
        parts.callbacks = in_order([*registered, *callbacks])
        for callback in parts.callbacks:
            callback.name = callback.name or type(callback).__name__
        return parts


def build_environment(cfg: Config, say: Callable[[str], None] = print) -> Environment:
    info = init_distributed(cfg.run.device, cfg.parallel.backend, cfg.resilience.collective_timeout_s)
    layout = _config_step(resolve_layout, cfg.parallel, info.world_size)
    mesh = build_mesh(layout, info.device.type)
    dtype = resolve_dtype(cfg.train.dtype, info.device)
    return Environment(info, layout, mesh, info.device, dtype, say if info.is_main else (lambda msg: None))


def build_data(cfg: Config, env: Environment, room: RunDir, resuming: bool,
               loader: StepLoader | LoaderFactory | None = None) -> Data:  # fmt: skip
    """Token stores from the data pipeline, or rank 0 tokenizes `[data] paths` into a store in the run
    directory (resuming, it reuses that store) and the others open it; then the loader of this rank."""
    t = cfg.train
    dp_rank, dp_size = env.dp_coordinates
    refusal = batch_split_refusal(t.global_batch, t.micro_batch, dp_size)
    if refusal:
        raise ConfigError(refusal)
    micro_batch = t.micro_batch or t.global_batch // dp_size
    if loader is not None:  # the caller's own data
        own = loader if hasattr(loader, "next_step") else loader(env, dp_rank, dp_size)  # type: ignore[operator]
        return Data(own, micro_batch, dp_rank, dp_size, list(getattr(own, "stores", [])),
                    getattr(own, "tokenizer", None))  # fmt: skip
    sft, dpo = t.objective == "sft", t.objective == "dpo"
    if sft and t.mask != "document":
        raise ConfigError('train.objective = "sft" needs train.mask = "document": packed conversations must not'
                          " attend to each other")  # fmt: skip
    if cfg.data.stores:
        stores, tokenizer = open_stores(cfg.data.stores, cfg.data.cache_dir, env.say)
    else:

        def prepare() -> None:
            if resuming and room.data_manifest.is_file():
                return
            if dpo:
                prepare_preference_store(cfg.data, room.data, env.say)
            elif sft:
                prepare_chat_store(cfg.data, room.data, env.say)
            else:
                prepare_store(cfg.data, room.data, env.say)

        env.on_main_then_share(prepare)
        store, tokenizer = open_prepared(room.data)
        stores = [store]
    if dpo:
        pairs = PairLoader(stores, t.seq_len, t.global_batch, cfg.run.seed, cfg.data.val_fraction, dp_rank, dp_size,
                           weights=cfg.data.weights or None, split_seed=cfg.data.split_seed)  # fmt: skip
        say_pairs(pairs, t, env.say)
        return Data(pairs, micro_batch, dp_rank, dp_size, stores, tokenizer)
    packed = PackedLoader(
        stores, t.seq_len, t.global_batch, cfg.run.seed, cfg.data.val_fraction, dp_rank, dp_size,
        weights=cfg.data.weights or None, loss_mask=sft and t.sft_targets == "assistant",
        split_seed=cfg.data.split_seed,
    )  # fmt: skip
    if sft:
        say_epochs(packed, t, env.say)
    return Data(packed, micro_batch, dp_rank, dp_size, stores, tokenizer)


def say_epochs(loader: PackedLoader, t: Any, say: Callable[[str], None]) -> None:
    """Fine-tuning counts in epochs over a small set (the loader reshuffles each store every epoch), and a
    conversation longer than a sequence is cut: say both."""
    windows = sum(len(s.train_windows) for s in loader.streams)
    say(f"fine-tuning on {windows:,} sequences of {t.seq_len} tokens per epoch: {t.steps} steps of"
        f" {t.global_batch} are {t.steps * t.global_batch / windows:.2f} epochs")  # fmt: skip
    lengths = np.concatenate([np.diff(shard.doc_starts) for store in loader.stores for shard in store.shards])
    if long := int((lengths > t.seq_len + 1).sum()):
        say(
            f"warning: {long} of {len(lengths)} conversations are longer than train.seq_len = {t.seq_len} tokens:"
            " each is cut where its sequences end, and its later turns are learned without their beginning"
        )


def say_pairs(loader: PairLoader, t: Any, say: Callable[[str], None]) -> None:
    """DPO counts in epochs over its pairs; a conversation longer than a row loses its end: say both."""
    pairs = sum(len(s.train_windows) for s in loader.streams)
    say(f"preference optimisation on {pairs:,} pairs per epoch ({t.preference_loss} loss): {t.steps} steps of"
        f" {t.global_batch} pairs are {t.steps * t.global_batch / pairs:.2f} epochs")  # fmt: skip
    long, total = loader.truncated()
    if long:
        say(f"warning: {long} of {total} conversations of the pairs are longer than train.seq_len + 1 ="
            f" {t.seq_len + 1} tokens: each is cut there, the rest of its reply not compared")  # fmt: skip


def build_train_module(cfg: Config, env: Environment, tokenizer: Any) -> TrainModule:
    """Dense causal-LM pretraining of the `[model]` family, with the `[optim]` optimizer; pipelined over
    `parallel.pp` ranks when it is above 1."""
    if tokenizer is None:
        raise ConfigError("the train module needs a tokenizer: give a loader with one, or a train module")
    if cfg.train.objective == "dpo":
        if env.layout.pp > 1:
            raise ConfigError('train.objective = "dpo" does not run under pipeline parallelism yet (parallel.pp = 1)')
        from liandan.train.preference import DPOTrainModule

        return DPOTrainModule(cfg, tokenizer.vocab_size, env.mesh, env.layout, env.device, env.dtype)
    if env.layout.pp > 1:
        from liandan.train.pipeline import PipelineTrainModule

        return PipelineTrainModule(cfg, tokenizer.vocab_size, env.mesh, env.layout, env.device, env.dtype)
    return CausalLMTrainModule(cfg, tokenizer.vocab_size, env.mesh, env.layout, env.device, env.dtype)


def build_checkpointer(cfg: Config, room: RunDir, env: Environment,
                       event: Callable[..., None]) -> tuple[CheckpointManager, snapshots.MemorySnapshots | None]:  # fmt: skip
    """The checkpoint manager of the run directory (half-done saves of an earlier process removed) and, under
    the supervisor, this rank's memory snapshots (it owns them and removes them)."""
    c = cfg.checkpoint
    checkpoints = CheckpointManager(room.checkpoints, keep_last=c.keep_last, keep_every=c.keep_every,
                                    async_save=c.async_save, verify_on_load=c.verify, on_event=event)  # fmt: skip
    if env.dist.is_main:
        stale = checkpoints.remove_stale_saves()
        if stale:
            env.say(f"removed {len(stale)} half-done checkpoint save(s) of an earlier process: "
                    + ", ".join(p.name for p in stale))  # fmt: skip
            event("stale_saves_removed", paths=[str(p) for p in stale])
    owner, handed = WorkerEnv.from_env().snapshot_owner, snapshots.handed_dir()
    held = None
    if c.memory_every and owner and handed:
        held = snapshots.MemorySnapshots(handed, env.dist.rank, env.dist.world_size, owner, str(env.layout))
    return checkpoints, held


@contextlib.contextmanager
def stops_recorded(files: MetricsLogger):
    """Within it, an error a restart cannot mend is recorded in the run's events (`record_stop`)."""
    try:
        yield
    except BaseException as err:
        record_stop(files, err)
        raise


def record_stop(files: MetricsLogger, err: BaseException, step: int | None = None) -> None:
    """An unsupervised run that ends on an error a restart cannot mend (a bad config or input, a run stopped by
    its own rules) says so in its events, so that it shows as stopped rather than interrupted. A supervisor
    records its workers' itself; checkpoints that were not being saved are recorded where that is found.
    `step`: the last step the run completed, when its loop had started."""
    if not isinstance(err, STOPPING_ERRORS) or isinstance(err, SaveError) or WorkerEnv.from_env().supervised:
        return
    cause = "device fault" if isinstance(err, DeviceFault) else "user error"
    with contextlib.suppress(OSError):  # the error itself is said in any case
        files.log_event("train_stopped", error=str(err), cause=cause, **({} if step is None else {"step": step}))


def file_loggers(cfg: Config, room: RunDir, env: Environment) -> tuple[MetricsLogger, StoreLogger | None]:
    """Rank 0's records: the run's JSON-lines files and, after them, the project's run store, which indexes
    those files (it reads what the first one has just written)."""
    if not env.dist.is_main:
        return NullLogger(), None
    files = JsonlLogger(room)
    if not cfg.track.store:
        return files, None
    store_logger = StoreLogger(room, every_s=cfg.track.store_every_s, warn=env.say)
    return FanOut(files, store_logger), store_logger


def claim_run_dir(cfg: Config, run_dir: Path | None, config_name: str) -> tuple[Path, bool, RunLock | None]:
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
