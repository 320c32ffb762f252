"""The proxy runs of `liandan mix` (docs/mixtures.md): the sources of a run config, the swarm's directory, and
its proxies run as `liandan train` processes, a few at a time.

Each proxy is the run config with the user's overrides (which size it: `--model.*`, `--train.steps=...`) and
its own `data.weights`, in `<out>/proxies/<name>/`; its held-out bits per byte per source at its last step
(the "eval_heldout" events of `[eval] every`, set to the proxy's steps) is its result. A proxy with a
summary.json and those events is finished and never trained again; any other is started again with
`run.overwrite`, which resumes it from its newest checkpoint when it has one and starts it over otherwise.
`design.json` records what the swarm is; a rerun with another design in the same directory is refused.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from liandan.config import Config, ConfigError, load_config
from liandan.plan.mixture import Proxy
from liandan.plan.trial_process import last_error, stop_process
from liandan.run import RunDir

POLL_S = 0.2
SET_BY_MIX = ("data.weights", "run.name", "run.output_dir", "run.overwrite", "resilience.supervise", "eval.every")


@dataclass(frozen=True)
class Source:
    name: str  # the store's directory name, as held-out results name it
    path: str
    tokens: int


def read_sources(cfg: Config) -> list[Source]:
    """The token stores of `[data] stores` and their tokens (from their manifests); ConfigError of one line
    when there is nothing to mix or a store cannot be read."""
    from liandan.data import DataError, TokenStore

    stores = cfg.data.stores
    if not stores:
        raise ConfigError("liandan mix mixes token stores: give [data] stores (two or more, as `liandan data run`"
                          " writes them); [data] paths make one store, one source")  # fmt: skip
    if len(stores) < 2:
        raise ConfigError(f"liandan mix needs two or more token stores to mix; [data] stores names one ({stores[0]})")
    if cfg.data.weights and len(cfg.data.weights) != len(stores):
        raise ConfigError(
            f"[data] weights gives {len(cfg.data.weights)} weights for {len(stores)} stores; give one per store"
        )
    sources = []
    for path in stores:
        try:
            store = TokenStore(path)
        except (DataError, OSError) as err:
            raise ConfigError(f"[data] stores: {err}") from None
        sources.append(Source(store.name, str(path), store.num_tokens))
    names = [s.name for s in sources]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"[data] stores: two stores share the directory name {twice[0]!r}, which names a source's"
                          " held-out results; rename one")  # fmt: skip
    if empty := [s.name for s in sources if not s.tokens]:
        raise ConfigError(f"[data] stores: {empty[0]} holds no tokens")
    return sources


def check_overrides(overrides: Sequence[str]) -> None:
    for item in overrides:
        key = item[2:].split("=", 1)[0]
        if key in SET_BY_MIX:
            raise ConfigError(f"override {item!r}: liandan mix sets {key} for each proxy")


def planned_tokens(config_path: Path, overrides: Sequence[str]) -> int:
    """The token budget of the run being planned: the config's train.steps x global_batch x seq_len, with the
    overrides except those of [train], which size the proxies."""
    cfg = load_config(config_path, [o for o in overrides if not o.startswith("--train.")])
    return cfg.train.steps * cfg.train.global_batch * cfg.train.seq_len


@dataclass
class Swarm:
    config: Path
    overrides: list[str]
    sources: list[Source]
    proxies: list[Proxy]
    out: Path
    seed: int
    concentration: float
    runs_dir: str = "proxies"  # under `out`; validate-<target> for the runs of `liandan mix --validate`

    @property
    def proxies_dir(self) -> Path:
        return self.out / self.runs_dir

    @property
    def design_path(self) -> Path:
        return self.out / "design.json" if self.runs_dir == "proxies" else self.proxies_dir / "design.json"

    def identity(self) -> dict:
        """What makes two swarms the same: a rerun with more or fewer runs is the same swarm (its proxies are
        drawn in the same order), anything else is another. A validation's runs are part of what it is."""
        identity = {"config": str(self.config.resolve()), "overrides": list(self.overrides),
                    "sources": [vars(s) for s in self.sources], "seed": self.seed,
                    "concentration": self.concentration}  # fmt: skip
        if self.runs_dir != "proxies":
            identity["runs"] = [p.to_dict() for p in self.proxies]
        return identity

    def claim(self) -> None:
        """Write design.json, refusing a directory that holds another swarm."""
        path = self.design_path
        if path.is_file():
            try:
                held = json.loads(path.read_text())["identity"]
            except (ValueError, KeyError, TypeError):
                raise ConfigError(f"{path} is not a liandan mix design; use another --out") from None
            mine = self.identity()
            if held != mine:
                keys = [k for k in mine if held.get(k) != mine[k]]
                differ = f"{', '.join(keys)} {'differs' if len(keys) == 1 else 'differ'}"
                if self.runs_dir != "proxies":
                    raise ConfigError(f"{self.proxies_dir} holds the validation runs of another recommendation or"
                                      f" size (its {differ}); remove it or use another --out")  # fmt: skip
                raise ConfigError(f"{self.out} holds the proxies of another swarm (its {differ});"
                                  " use another --out")  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        design = {"identity": self.identity(), "proxies": [p.to_dict() for p in self.proxies]}
        path.write_text(json.dumps(design, indent=1) + "\n")

    def proxy_dir(self, proxy: Proxy) -> Path:
        return self.proxies_dir / proxy.name

    def command(self, proxy: Proxy, steps: int) -> list[str]:
        weights = "[" + ", ".join(repr(w) for w in proxy.weights) + "]"
        return [sys.executable, "-m", "liandan.cli", "train", str(self.config), *self.overrides,
                f"--data.weights={weights}", f"--run.name={proxy.name}", f"--run.output_dir={self.proxies_dir}",
                "--run.overwrite=true", "--resilience.supervise=false", f"--eval.every={steps}",
                *([] if proxy.seed is None else [f"--run.seed={proxy.seed}"])]  # fmt: skip


def proxy_result(run_dir: Path, names: Sequence[str]) -> dict[str, float] | None:
    """A finished proxy's held-out bits per byte per source at its last step; None while unfinished."""
    room = RunDir(run_dir)
    try:
        steps = room.load_summary()["steps"]
    except (OSError, ValueError, KeyError):
        return None
    found = {}
    for event in room.read_events():
        if event.get("kind") == "eval_heldout" and event.get("step") == steps:
            value = event.get("bits_per_byte")
            found[event.get("source")] = float(value) if value is not None else math.nan
    if any(name not in found for name in names):
        return None
    return {name: found[name] for name in names}


@dataclass
class ProxyOutcome:
    proxy: Proxy
    state: str  # finished (by this call), reused (by an earlier one) or failed
    bits_per_byte: dict[str, float] | None = None
    note: str = ""
    seconds: float = 0.0
    run_dir: str = ""


class SwarmReporter:
    """What the swarm tells its user; the command line prints a line per proxy."""

    def started(self, proxy: Proxy) -> None: ...

    def finished(self, outcome: ProxyOutcome, done: int, total: int) -> None: ...


@dataclass
class _Running:
    proxy: Proxy
    process: subprocess.Popen
    log: object
    started: float = field(default_factory=time.perf_counter)


def run_swarm(swarm: Swarm, steps: int, parallel: int = 1, reporter: SwarmReporter | None = None) -> list[ProxyOutcome]:
    """Every proxy's outcome, in the design's order: finished ones read back, the others trained, `parallel`
    processes at a time (each given an even share of the CPU threads unless OMP_NUM_THREADS says otherwise)."""
    reporter = reporter or SwarmReporter()
    names = [s.name for s in swarm.sources]
    outcomes: dict[str, ProxyOutcome] = {}
    pending = []
    for proxy in swarm.proxies:
        result = proxy_result(swarm.proxy_dir(proxy), names)
        if result is None:
            pending.append(proxy)
        else:
            outcomes[proxy.name] = ProxyOutcome(proxy, "reused", result, run_dir=str(swarm.proxy_dir(proxy)))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // parallel)))
    running: list[_Running] = []
    total = len(swarm.proxies)
    on_term = _stop_on_sigterm()
    try:
        while pending or running:
            while pending and len(running) < parallel:
                proxy = pending.pop(0)
                run_dir = swarm.proxy_dir(proxy)
                run_dir.mkdir(parents=True, exist_ok=True)
                log = RunDir(run_dir).trial_log.open("w")
                reporter.started(proxy)
                process = subprocess.Popen(swarm.command(proxy, steps), stdout=log, stderr=subprocess.STDOUT, env=env)
                running.append(_Running(proxy, process, log))
            time.sleep(POLL_S)
            for job in [j for j in running if j.process.poll() is not None]:
                running.remove(job)
                job.log.close()
                outcome = _outcome(swarm, job, names)
                outcomes[job.proxy.name] = outcome
                reporter.finished(outcome, len(outcomes), total)
    finally:
        for job in running:  # interrupted: the proxies still training are stopped; a rerun starts them again
            stop_process(job.process)
            job.log.close()
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
    return [outcomes[p.name] for p in swarm.proxies]


def _stop_on_sigterm():
    """SIGTERM ends the swarm as Ctrl-C does, so that no proxy is left training without it. Returns the
    handler it replaced (None off the main thread, where signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def _outcome(swarm: Swarm, job: _Running, names: Sequence[str]) -> ProxyOutcome:
    run_dir = swarm.proxy_dir(job.proxy)
    seconds = round(time.perf_counter() - job.started, 2)
    result = proxy_result(run_dir, names)
    if job.process.returncode == 0 and result is not None:
        return ProxyOutcome(job.proxy, "finished", result, seconds=seconds, run_dir=str(run_dir))
    if job.process.returncode == 0:
        note = "no held-out bits per byte of every source at its last step ([eval] heldout_sequences = 0?)"
    else:
        note = f"exit code {job.process.returncode}: {last_error(RunDir(run_dir).trial_log)}"
    return ProxyOutcome(job.proxy, "failed", None, note, seconds, str(run_dir))
