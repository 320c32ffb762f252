"""The resume oracle (`liandan doctor --resume CONFIG`): is a resumed run the run that never stopped?

It trains the user's config for S steps in each layout asked for (the references, with a checkpoint at step
K), then resumes from each reference's checkpoint of step K to S in a fresh run directory: in the same layout,
and in the next layout of the list (a ring, so every layout both saves a checkpoint another one loads and
loads one another saved). Every run is a real `liandan train` process (several under `--nproc` for the
multi-process layouts) with this process's environment, so $LIANDAN_FAULTS reaches them.

With `--save-in=first` only the first layout trains a reference and every layout resumes its checkpoint:
fewer runs, but the other layouts' saves go unchecked.

The losses of steps K+1..S and the final weights of each resumed run are compared with its reference. On the
CPU in fp32 a resume in the same layout must be bit-identical: the same operations run in the same order on
the same numbers, so any difference at all is state the checkpoint failed to carry (the loader's position,
the schedule, random-number states, a callback's statistics). Another layout sums the same numbers in another
order (a gradient all-reduce over two ranks, a matrix product split across them), which moves fp32 results by
a few units in the last place (about 1e-7 relative) per step; RELATIVE_TOLERANCE (1e-5) leaves two orders of
magnitude for that over a few steps, while a resume that loses state moves them much further (a loader that
forgets its position: losses up to 3e-3 relative, weights 1e-2, on a tiny model that has barely begun to learn).
On a GPU even the same layout gets the tolerance: its kernels need not be deterministic.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from liandan.common.layout import Layout
from liandan.config import Config, ConfigError, load_config
from liandan.run import RunDir, atomic_write_json, step_dir_name

RELATIVE_TOLERANCE = 1e-5
DEFAULT_STEPS = 8
# each: every layout saves a checkpoint (3 runs per layout); first: only the first layout does (1 per layout + 1)
SAVE_IN = ("each", "first")
_PART = re.compile(r"^(ddp|fsdp|tp|ep|pp|cp)(\d+)$")
_LAYOUT_HELP = (
    "1, ddpN, fsdpN, tpN, epN (experts over N of the fsdp ranks), ppN (pipeline stages, by"
    " parallel.pp_schedule), cpN (each sequence over N ranks) or a combination such as fsdp2+tp2"
)


class OracleError(Exception):
    """A run the oracle needs could not be made (not a resume that drifted): one line, and an exit code."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class LayoutChoice:
    """A layout by its short name (`fsdp2`, `ddp2+tp2`, `1`) and the process count it takes."""

    name: str
    layout: Layout

    @property
    def nproc(self) -> int:
        return self.layout.world_size

    def overrides(self) -> list[str]:
        lay = self.layout
        return [f"--parallel.dp_replicate={lay.dp_replicate}", f"--parallel.dp_shard={lay.dp_shard}",
                f"--parallel.tp={lay.tp}", f"--parallel.pp={lay.pp}", f"--parallel.ep={lay.ep}",
                f"--parallel.cp={lay.cp}"]  # fmt: skip


def parse_layout(text: str) -> LayoutChoice:
    name = text.strip().lower()
    if name in ("1", "single"):
        return LayoutChoice("1", Layout(1, 1, 1))
    sizes = {"ddp": 1, "fsdp": 1, "tp": 1, "ep": 1, "pp": 1, "cp": 1}
    seen = set()
    for part in re.split(r"[+x]", name):
        match = _PART.match(part)
        if not match or match.group(1) in seen or int(match.group(2)) < 1:
            raise ConfigError(f"--layouts: '{text}' is not a layout; use {_LAYOUT_HELP}")
        seen.add(match.group(1))
        sizes[match.group(1)] = int(match.group(2))
    try:
        layout = Layout(sizes["ddp"], sizes["fsdp"], sizes["tp"], pp=sizes["pp"], ep=sizes["ep"], cp=sizes["cp"])
    except ValueError as err:
        raise ConfigError(f"--layouts: '{text}': {err}") from None
    return LayoutChoice(name, layout)


def parse_layouts(text: str) -> list[LayoutChoice]:
    choices = [parse_layout(item) for item in text.split(",") if item.strip()]
    if not choices:
        raise ConfigError(f"--layouts is empty; use a comma-separated list of {_LAYOUT_HELP}")
    names = [c.name for c in choices]
    if len(set(names)) != len(names):
        raise ConfigError(f"--layouts names a layout twice: {text}")
    return choices


def layout_refusal(cfg: Config, choice: LayoutChoice) -> str | None:
    """Why the config cannot train in this layout (one line), or None."""
    from liandan.model.spec import get, model_args
    from liandan.train.expert_parallel import ep_refusal

    lay, t = choice.layout, cfg.train
    per_rank = t.global_batch // lay.dp_size
    if t.global_batch % lay.dp_size or (t.micro_batch and per_rank % t.micro_batch):
        return (f"train.global_batch = {t.global_batch} does not split into {lay.dp_size} data-parallel ranks"
                f" of train.micro_batch = {t.micro_batch or per_rank}")  # fmt: skip
    args = model_args(cfg.model, 256)  # the vocabulary is not split
    if lay.tp > 1 and (refusal := get(cfg.model.family).tp_refusal(args, lay.tp)):
        return refusal
    if lay.pp > 1:
        from liandan.train.pipeline import pipeline_config_refusal

        return pipeline_config_refusal(cfg, lay, args)
    if lay.cp > 1:
        from liandan.train.context_parallel import cp_refusal

        attention = getattr(args, "attention", "sdpa")
        if why := cp_refusal(lay.cp, t.seq_len, t.mask, attention, "cuda" if _on_gpu() else "cpu"):
            return why
    return ep_refusal(args, lay.ep)


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def default_layouts(cfg: Config, on_gpu: bool) -> tuple[list[LayoutChoice], list[str]]:
    """One process and every two-process layout the config trains in (two processes exercise every way a
    checkpoint is split and joined again; for a mixture-of-experts model, experts split over both ranks too);
    one process alone on a single GPU. Returns them and, for each layout left out, why."""
    import torch

    from liandan.model.spec import model_args

    two = not on_gpu or torch.cuda.device_count() >= 2
    names = ["1", "ddp2", "fsdp2", "tp2", "pp2"] if two else ["1"]
    if two and getattr(model_args(cfg.model, 256), "moe_experts", 0):
        names.append("fsdp2+ep2")
    chosen, skipped = [], []
    for choice in map(parse_layout, names):
        why = layout_refusal(cfg, choice)
        chosen.append(choice) if why is None else skipped.append(f"{choice.name}: {why}")
    return chosen, skipped


@dataclass
class Check:
    """One resume compared with its reference."""

    saved_in: str
    resumed_in: str
    exact: bool  # bit-identity expected (same layout on the CPU), else RELATIVE_TOLERANCE
    loss_diff: float | None = None  # the largest |difference| of the losses of steps K+1..S
    loss_relative: float | None = None
    loss_step: int | None = None  # where it is
    first_diverging_step: int | None = None  # the first step whose loss is outside what is allowed
    weight_diff: float | None = None  # the largest |difference| of a final weight
    weight_relative: float | None = None  # over the largest |weight| of that tensor
    weight_tensor: str | None = None
    problem: str | None = None  # what failed, in words; None: it passed

    @property
    def passed(self) -> bool:
        return self.problem is None


@dataclass
class Report:
    config: str
    steps: int
    resume_at: int
    device: str
    tolerance: float
    layouts: list[str]
    skipped: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    workdir: str | None = None  # where the runs are, when they were kept

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def summary(self) -> str:
        failed = next((c for c in self.checks if not c.passed), None)
        if failed is not None:
            return f"resume drift: saved in {failed.saved_in}, resumed in {failed.resumed_in}: {failed.problem}"
        exact = sum(c.exact for c in self.checks)
        return (f"resume is exact: {len(self.checks)} resumes at step {self.resume_at} match the runs that never"
                f" stopped ({exact} bit-identical, {len(self.checks) - exact} within relative {self.tolerance:g})")  # fmt: skip

    def table(self) -> list[str]:
        rows = [("saved in", "resumed in", "loss diff (step)", "weight diff (tensor)", "verdict")]
        for c in self.checks:
            loss = _where(c.loss_diff, f"step {c.loss_step}")
            weight = _where(c.weight_diff, c.weight_tensor)
            verdict = ("exact" if c.exact else "ok") if c.passed else "FAIL"
            rows.append((c.saved_in, c.resumed_in, loss, weight, verdict))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4] for row in rows]

    def to_json(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "checks"}, "passed": self.passed,
                "summary": self.summary(),
                "checks": [{**asdict(c), "passed": c.passed} for c in self.checks]}  # fmt: skip


class ResumeOracle:
    def __init__(
        self,
        config: str,
        overrides: list[str],
        layouts: list[LayoutChoice] | None,
        steps: int = DEFAULT_STEPS,
        resume_at: int | None = None,
        workdir: Path | None = None,
        save_in: str = "each",
        say: Callable[[str], None] = print,
    ):
        resume_at = steps // 2 if resume_at is None else resume_at
        if steps < 2:
            raise ConfigError(f"--resume-steps = {steps} must be at least 2 (train, then resume)")
        if not 1 <= resume_at < steps:
            raise ConfigError(f"--resume-at = {resume_at} must be between 1 and --resume-steps - 1 = {steps - 1}")
        if workdir is not None and workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
            raise ConfigError(f"--workdir {workdir} must be a new or empty directory")
        self.config, self.steps, self.resume_at, self.say = config, steps, resume_at, say
        # fp32 unless the user asks otherwise: bf16 rounds too coarsely for the comparison to mean much
        self.overrides = ["--train.dtype=fp32", *overrides]
        self.cfg = load_config(config, self._run_overrides(Path("."), "check", LayoutChoice("1", Layout(1, 1, 1))))
        self.device = _device(self.cfg)
        skipped: list[str] = []
        if layouts is None:
            layouts, skipped = default_layouts(self.cfg, self.device == "cuda")
        for choice in layouts:
            why = layout_refusal(self.cfg, choice)
            if why is not None:
                raise ConfigError(f"layout {choice.name}: {why}")
        if save_in not in SAVE_IN:
            raise ConfigError(f"--save-in = {save_in!r} must be one of {', '.join(SAVE_IN)}")
        self.layouts, self.workdir, self.keep, self.save_in = layouts, workdir, workdir is not None, save_in
        self.report = Report(config, steps, resume_at, self.device, RELATIVE_TOLERANCE, [c.name for c in layouts],
                             skipped)  # fmt: skip

    def run(self) -> Report:
        work = self.workdir or Path(tempfile.mkdtemp(prefix="liandan-resume-"))
        work.mkdir(parents=True, exist_ok=True)
        self.say(f"resume oracle: {self.steps} steps, resumed at step {self.resume_at}, layouts"
                 f" {', '.join(self.report.layouts)}, on {self.device}; runs in {work}")  # fmt: skip
        for note in self.report.skipped:
            self.say(f"  left out {note}")
        n = len(self.layouts)
        if self.save_in == "first":
            pairs = [(0, i) for i in range(n)]
        else:
            pairs = [(i, i) for i in range(n)] + ([(i, (i + 1) % n) for i in range(n)] if n > 1 else [])
        for i in sorted({saved for saved, _ in pairs}):
            self._train(work, f"ref-{self.layouts[i].name}", self.layouts[i], resuming=False)
        for saved, resumed in pairs:
            check = self._resume(work, self.layouts[saved], self.layouts[resumed])
            self.report.checks.append(check)
            self.say(f"  resumed in {check.resumed_in} from {check.saved_in}: "
                     + ("ok" if check.passed else check.problem))  # fmt: skip
        if self.keep or not self.report.passed:  # a failure's runs are kept to look into
            self.report.workdir = str(work)
        else:
            shutil.rmtree(work, ignore_errors=True)
        return self.report

    # -- the runs ------------------------------------------------------------------------------------------
    def _run_overrides(self, work: Path, name: str, choice: LayoutChoice) -> list[str]:
        return [
            *self.overrides,
            f"--run.output_dir={work}",
            f"--run.name={name}",
            "--run.overwrite=false",
            f"--train.steps={self.steps}",
            "--train.log_every=1",  # every step's loss, to find the first that drifts
            "--checkpoint.enabled=true",
            f"--checkpoint.every={self.resume_at}",
            "--checkpoint.every_minutes=0",  # the saves the comparison rests on, none other
            "--checkpoint.at_end=true",
            "--checkpoint.keep_last=0",
            "--checkpoint.keep_every=0",
            "--checkpoint.dir=",
            "--checkpoint.resume=auto",
            "--resilience.supervise=false",  # one plain attempt: a restart would hide a crash of the resume
            # scratch runs about resuming: no device preflight, task evaluation, run store, trackers or
            # training.png of the user's run (each would cost every one of the runs time, and the trackers would
            # get them all)
            "--doctor.preflight=false",
            "--eval.every=0",
            "--track.store=false",
            "--track.exporters=[]",
            "--track.plot=false",
            *choice.overrides(),
        ]

    def _train(self, work: Path, name: str, choice: LayoutChoice, resuming: bool) -> str | None:
        """Run `liandan train` in `work/name`; None when it succeeded, else its error line (a reference that
        fails is an OracleError: nothing can be compared with it)."""
        log = work / f"{name}.log"
        command = [sys.executable, "-m", "liandan.cli", "train", self.config, f"--nproc={choice.nproc}",
                   *self._run_overrides(work, name, choice)]  # fmt: skip
        with log.open("w") as out:
            # this environment is inherited whole: $LIANDAN_FAULTS and the like reach the runs
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
        if code == 0:
            return None
        error = f"exit code {code}: {_error_line(log)} (log: {log})"
        if not resuming:
            raise OracleError(f"the reference run in layout {choice.name} failed with {error}", 2 if code == 2 else 1)
        return error

    def _resume(self, work: Path, saved: LayoutChoice, resumed: LayoutChoice) -> Check:
        """A fresh run directory holding the reference's data and its checkpoint of step K, trained to S in
        `resumed`'s layout and compared with the reference."""
        K, S = self.resume_at, self.steps
        name = f"resume-{saved.name}-then-{resumed.name}"
        reference, run = RunDir.of(work / f"ref-{saved.name}"), RunDir.of(work / name)
        run.checkpoints.mkdir(parents=True)
        if reference.data.is_dir():  # the tokenized data (absent when the config trains from token stores)
            shutil.copytree(reference.data, run.data)
        shutil.copytree(reference.checkpoints / step_dir_name(K), run.checkpoints / step_dir_name(K))
        exact = saved == resumed and self.device == "cpu"
        check = Check(saved.name, resumed.name, exact)
        error = self._train(work, name, resumed, resuming=True)
        if error is not None:
            check.problem = f"the resumed run failed with {error}"
            return check
        if not any(e.get("kind") == "resumed" and e.get("step") == K for e in run.read_events()):
            check.problem = f"the run did not resume from the checkpoint of step {K} (see {run.events})"
            return check
        self._compare_losses(check, reference, run)
        self._compare_weights(check, reference.checkpoints / step_dir_name(S), run.checkpoints / step_dir_name(S))
        return check

    # -- the comparisons -----------------------------------------------------------------------------------
    def _allowed(self, check: Check, diff: float, relative: float) -> bool:
        return diff == 0 if check.exact else relative <= RELATIVE_TOLERANCE

    def _compare_losses(self, check: Check, reference: RunDir, run: RunDir) -> None:
        ours, theirs = _losses(reference), _losses(run)
        for step in range(self.resume_at + 1, self.steps + 1):
            if step not in ours or step not in theirs:
                which = "reference" if step not in ours else "resumed run"
                check.problem = f"the {which} logged no loss for step {step}"
                return
            diff, relative = _difference(ours[step], theirs[step], abs(ours[step]))
            if check.loss_relative is None or relative > check.loss_relative:
                check.loss_diff, check.loss_relative, check.loss_step = diff, relative, step
            if check.first_diverging_step is None and not self._allowed(check, diff, relative):
                check.first_diverging_step = step
                check.problem = (f"the loss of step {step} differs by {diff:.3g} (relative {relative:.3g};"
                                 f" {self._expected(check)}): {theirs[step]!r} instead of {ours[step]!r}")  # fmt: skip

    def _compare_weights(self, check: Check, reference: Path, resumed: Path) -> None:
        from liandan.checkpoint.loading import load_model

        ours, _ = load_model(reference)
        theirs, _ = load_model(resumed)
        a, b = ours.state_dict(), theirs.state_dict()
        if a.keys() != b.keys():
            check.problem = (
                check.problem or f"the final checkpoints hold other tensors: {sorted(a.keys() ^ b.keys())[:3]}"
            )
            return
        for key in a:
            scale = a[key].abs().max().item() if a[key].numel() else 0.0
            diff = (a[key].double() - b[key].double()).abs().max().item() if a[key].numel() else 0.0
            diff, relative = _difference(0.0, diff, scale)
            if check.weight_relative is None or relative > check.weight_relative:
                check.weight_diff, check.weight_relative, check.weight_tensor = diff, relative, key
        if check.problem is None and not self._allowed(check, check.weight_diff or 0.0, check.weight_relative or 0.0):
            check.problem = (f"the final weights differ by up to {check.weight_diff:.3g} in {check.weight_tensor}"
                             f" (relative {check.weight_relative:.3g}; {self._expected(check)})")  # fmt: skip

    def _expected(self, check: Check) -> str:
        return "a resume in the same layout must be exact" if check.exact else f"allowed {RELATIVE_TOLERANCE:g}"


def write_report(report: Report, path: Path) -> None:
    atomic_write_json(path, report.to_json())


def _device(cfg: Config) -> str:
    if cfg.run.device != "auto":
        return cfg.run.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _losses(run: RunDir) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in run.read_metrics() if "step" in r and r.get("loss") is not None}


def _difference(ours: float, theirs: float, scale: float) -> tuple[float, float]:
    """(|ours - theirs|, that over `scale`); a NaN or infinity on one side only is an infinite difference."""
    if not (math.isfinite(ours) and math.isfinite(theirs)):
        same = repr(ours) == repr(theirs)
        return (0.0, 0.0) if same else (math.inf, math.inf)
    diff = abs(ours - theirs)
    return diff, (diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))


def _where(diff: float | None, where: str | None) -> str:
    """A difference for the table, with where it is largest (nowhere, when it is 0)."""
    return "-" if diff is None else "0" if diff == 0 else f"{diff:.2g} ({where})"


def _error_line(log: Path) -> str:
    """The run's own one-line error, else the last line it printed."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line.removeprefix("liandan: error: ") for line in lines if line.startswith("liandan: error: ")]
    return errors[-1] if errors else (lines[-1] if lines else "no output")
