"""The loss-spike guard: a callback that watches every step, vetoes bad updates on every rank at once, rolls
back to a state from before a spike, skips the data behind it, lowers the learning rate if asked, and writes
a report naming the batches, documents and layers behind each incident.

Each step, before the update, the ranks share one small vector (loss, gradient norm, output-logit
statistics) and every rank judges the same numbers by the same rules (`rules.py`), so their verdicts agree
without a vote. A verdict is acted on by the detector's policy: warn, skip the update, roll back, or stop.
A rollback is decided before the update (the update is never applied) and carried out at the end of the
step (`on_step_end`): the newest in-memory state from before the spike began is put back, the batches from
there up to the detection are diagnosed and skipped, and training goes on from the restored step.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from liandan.checkpoint.ring import HeldState
from liandan.checkpoint.saving import SaveOutcome
from liandan.config import Config, GuardSection
from liandan.run import RunStopped
from liandan.train.callbacks import Callback
from liandan.train.guard import diagnosis
from liandan.train.guard.rules import Rise, RouterWatch, Rule, SourceWatch, Streak
from liandan.train.guard.stats import BlockProbe, HeadProbe, parameters_now, submodule, update_norms

if TYPE_CHECKING:
    from liandan.train.context import TrainContext

SEVERITY = {"ok": 0, "warn": 1, "skip": 2, "rollback": 3, "stop": 4}
ROUTER_DETECTORS = {"collapse", "drift"}  # judged after the update, from the step's routing


class GuardCallback(Callback):
    order = 5  # first: its veto and its rollback come before anything else reads the step

    def __init__(self, cfg: GuardSection, judge_loss: bool = True):
        self.cfg = g = cfg
        self.judge_loss = judge_loss  # the loss rules (spike, drop, early divergence); the others always judge
        self.loss = Rule(g.window, g.warmup, g.spike_mads, g.spike_min_ratio)
        self.drop = Rule(g.window, g.warmup, g.drop_mads, g.drop_min_ratio, downward=True)
        self.drop.history = self.loss.history  # one loss history, judged both ways
        self.grad = Rule(g.window, g.warmup, g.grad_mads, g.grad_min_ratio, log=True)
        self.logit = Rule(g.window, g.warmup, g.logit_mads, g.logit_min_ratio, log=True)
        self.z = Rule(g.window, g.warmup, g.logit_mads, g.logit_min_ratio, log=True)
        self.rise = Rise(self.loss.history, g.window, g.diverge_rise, g.spike_mads)
        self.spike_streak, self.drop_streak, self.rise_streak = Streak(), Streak(), Streak()
        self.sources = SourceWatch(g.window, g.warmup, g.drop_mads, g.source_floor, g.source_collapse, g.spike_persist)
        self.source_names: list[str] = []  # of a mixture watched source by source; empty otherwise
        self.routers = RouterWatch(g.router_window, g.router_warmup, g.router_dead, g.router_hot, g.router_drift)
        self.router_prefix = "layers"  # MoE layers are named as the layer statistics name blocks
        self.last_loss = math.nan  # of the step being judged, the mean over ranks
        self.skips_in_row = 0
        self.rollbacks: list[dict[str, Any]] = []
        self.lr_scale, self.lr_until = 1.0, None
        self.pending: dict[str, Any] | None = None  # the rollback decided at this step
        self.head: HeadProbe | None = None
        self.blocks: BlockProbe | None = None
        self.layer_record: dict[str, Any] | None = None
        self.before_update: list[torch.Tensor] | None = None
        self.whole: torch.nn.Module | None = None  # the one model of a known family, for probes and statistics

    # -- the hooks ----------------------------------------------------------------------------------------
    def on_train_start(self, ctx: TrainContext) -> None:
        spec, self.whole = ctx.module.spec, ctx.module.whole_model()
        if self.whole is None and ctx.dist.is_main:
            ctx.say(f"guard: {type(ctx.module).__name__} is not one model of a known family: no logit or layer"
                    " statistics, losses and gradient norms only")  # fmt: skip
        # A hook inside a compiled head would recompile it; a family may name no head module.
        if self.whole is not None and not ctx.cfg.train.compile and _has_module(self.whole, spec.head):
            stores = ctx.loader.stores
            watch = len(stores) > 1 and bool(self.cfg.source_floor or self.cfg.source_collapse)
            self.source_names = [s.name for s in stores] if watch else []
            self.head = HeadProbe(self.whole, spec, per_sequence=watch)
        if spec is not None:  # a pipeline rank may hold no MoE layer and still judge every router
            self.router_prefix = spec.blocks
        ctx.module.lr_scale = self._current_scale(ctx.step)
        self.rollback = ctx.rollback
        self.rollback.around_restore(self._across_restore)
        self.rollback.keep()

    def before_step(self, ctx: TrainContext, step: int) -> None:
        ctx.module.lr_scale = self._current_scale(step)
        if self._stats_step(step + 1):
            self.blocks = BlockProbe(self.whole, ctx.module.spec)

    def before_optimizer_step(self, ctx: TrainContext, step: int, loss: Any, grad_norm: float) -> bool:
        n = step + 1
        loss_value, grad_value, largest, z, parts = self._shared(ctx, loss, grad_norm)
        self.last_loss = loss_value
        findings = self._judge(n, loss_value, grad_value, largest, z)
        if parts and math.isfinite(loss_value):
            findings += [("drop", began, what) for began, what in self.sources.judge(n, parts)]
        if self.blocks is not None:
            self.layer_record = self._layer_stats(ctx, n, grad_value)
            attention = self.layer_record["attention_logit"]
            limit = self.cfg.attention_logit_limit
            if limit and attention and max(attention.values()) > limit:
                layer = max(attention, key=attention.get)
                what = f"largest attention logit {attention[layer]:.4g} in {layer} exceeds the limit {limit:g}"
                findings.append(("logits", n, what))
        action = max((self._policy(kind) for kind, _, _ in findings), key=SEVERITY.get, default="ok")
        if action == "skip":
            self.skips_in_row += 1
            if self.cfg.escalate_after and self.skips_in_row >= self.cfg.escalate_after:
                findings.append(("skips", n, f"{self.skips_in_row} updates skipped in a row"))
                action = "rollback"
        else:
            self.skips_in_row = 0
        if action == "rollback":
            action = self._plan_rollback(ctx, n, findings, loss_value)
        ctx.rollback.unsettled = bool(self.spike_streak.length or self.rise_streak.length)
        self._record(ctx, n, action, findings, loss_value)
        if action == "stop":
            self._stop(ctx, n, findings)
        return action in ("ok", "warn")

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        self._watch_routing(ctx, step)
        if self.layer_record is not None:
            record, self.layer_record = self.layer_record, None
            if self.before_update is not None:
                record["update"] = self._update_norms(ctx)
            if ctx.dist.is_main:
                diagnosis.append_layer_stats(ctx.room, record)
        if not ctx.rollback.pending and step % self.cfg.ring_every == 0 and not ctx.rollback.unsettled:
            self.rollback.keep()

    def on_step_end(self, ctx: TrainContext, step: int) -> None:
        if self.pending is None:
            return
        plan, self.pending = self.pending, None
        started = time.perf_counter()
        target = plan["target"]
        detected_at = ctx.loader.step  # the data step after the spike's last batch
        skipped_before = list(ctx.loader.skipped)
        source = "memory"
        if isinstance(target, SaveOutcome):  # read once, then kept in the ring for the passes below
            target, source = self.rollback.load_checkpoint(target.path), str(target.path)
        routers_first = diagnosis.routers_moved_first(list(self.routers.recent), plan["began"], target.step)
        self.rollback.restore(target)
        first_data = ctx.loader.step
        found = diagnosis.diagnose(ctx, self, target, step, plan["began"], first_data, plan["losses"])
        found["routers_first"] = routers_first
        self.rollback.restore(target)  # the replay moved on: back again
        # Early divergence on batches that look normal, and routers that collapsed or drifted, are the updates'
        # doing: the same batches again, at a lower rate for the rest of the run. Anything else skips the
        # batches up to the detection.
        diverged = _diverged(plan, found) and self.cfg.diverge_lr_factor != 1.0
        routing = {kind for kind, _, _ in plan["findings"]} <= ROUTER_DETECTORS
        again = diverged or routing
        skip = self.cfg.skip_batches if again else max(self.cfg.skip_batches, detected_at - first_data)
        ctx.loader.skipped = sorted(set(skipped_before) | set(ctx.loader.skipped))
        skipped = ctx.loader.skip(skip)
        if again:
            self.lr_scale *= self.cfg.diverge_lr_factor if diverged else self.cfg.router_lr_factor
            self.lr_until = None
        elif self.cfg.lr_factor != 1.0:
            self.lr_scale *= self.cfg.lr_factor
            self.lr_until = target.step + self.cfg.lr_steps if self.cfg.lr_steps else None
        ctx.module.lr_scale = self._current_scale(target.step)
        rollback = {"at": step, "began": plan["began"], "to": target.step, "from": source, "skipped": list(skipped),
                    "lr_scale": self.lr_scale, "lr_until": self.lr_until,
                    "seconds": round(time.perf_counter() - started, 3), "steps_redone": step - target.step}  # fmt: skip
        self.rollbacks.append(rollback)
        ctx.rollback.pending = False
        self.rollback.keep()  # the restored step, with its data skip, is the new place to come back to
        if ctx.dist.is_main:
            path = diagnosis.write_report(ctx, plan, rollback, found)
            ctx.files.log_event("rollback", step=step, report=str(path), **_event_fields(plan, rollback, found))
            ctx.say(diagnosis.one_line(plan, rollback, found, path))

    def on_train_end(self, ctx: TrainContext, result: Any) -> None:
        for probe in (self.head, self.blocks):
            if probe is not None:
                probe.close()

    def on_error(self, ctx: TrainContext, error: BaseException) -> None:
        self.on_train_end(ctx, None)

    # -- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "loss": self.loss.state_dict(), "grad": self.grad.state_dict(), "logit": self.logit.state_dict(),
            "z": self.z.state_dict(), "spike_streak": self.spike_streak.state_dict(),
            "drop_streak": self.drop_streak.state_dict(), "rise_streak": self.rise_streak.state_dict(),
            "skips_in_row": self.skips_in_row,
            "sources": self.sources.state_dict(), "routers": self.routers.state_dict(),
            **self._bookkeeping(),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss.load_state_dict(state["loss"])
        self.grad.load_state_dict(state["grad"])
        self.logit.load_state_dict(state["logit"])
        self.z.load_state_dict(state["z"])
        self.spike_streak.load_state_dict(state["spike_streak"])
        self.drop_streak.load_state_dict(state["drop_streak"])
        self.rise_streak.load_state_dict(state.get("rise_streak", {"length": 0, "began": 0}))  # an older guard's
        self.skips_in_row = int(state["skips_in_row"])
        self.sources.load_state_dict(state.get("sources", {}))  # absent from a checkpoint of an older guard
        self.routers.load_state_dict(state.get("routers", {}))
        self._load_bookkeeping(state)

    def _bookkeeping(self) -> dict[str, Any]:
        """What a rollback must not undo: the rollbacks made and the learning-rate scale they left."""
        return {"rollbacks": [dict(r) for r in self.rollbacks], "lr_scale": self.lr_scale, "lr_until": self.lr_until}

    def _load_bookkeeping(self, state: dict[str, Any]) -> None:
        self.rollbacks = [dict(r) for r in state["rollbacks"]]
        self.lr_scale, self.lr_until = float(state["lr_scale"]), state["lr_until"]

    # -- judging ----------------------------------------------------------------------------------------------
    def _shared(self, ctx: TrainContext, loss: torch.Tensor, grad_norm: float) -> tuple:
        """(mean loss, largest gradient norm, largest output logit, mean z) over all ranks, and each watched
        source's (sum of sampled losses, count) over all ranks: one collective."""
        largest, z = self.head.take(ctx.device) if self.head else (torch.zeros(()), torch.zeros(()))
        values = [loss.detach().float().reshape(()), torch.tensor(float(grad_norm)).to(loss.device),
                  largest.float().to(loss.device), z.float().to(loss.device)]  # fmt: skip
        if self.source_names:
            values.append(self._source_parts(ctx).to(loss.device))
        local = torch.cat([v.reshape(-1) for v in values]).double()
        if ctx.dist.distributed:
            gathered = [torch.empty_like(local) for _ in range(ctx.dist.world_size)]
            dist.all_gather(gathered, local)
            rows = torch.stack(gathered).cpu().tolist()
        else:
            rows = [local.cpu().tolist()]
        # A non-finite value anywhere must win: max() would drop a NaN.
        shared = (
            sum(r[0] for r in rows) / len(rows),
            _largest(r[1] for r in rows),
            _largest(r[2] for r in rows),
            sum(r[3] for r in rows) / len(rows),
        )
        count = len(self.source_names)
        totals = [sum(r[4 + i] for r in rows) for i in range(2 * count)]
        parts = {name: (totals[i], totals[count + i]) for i, name in enumerate(self.source_names)}
        return (*shared, parts)

    def _source_parts(self, ctx: TrainContext) -> torch.Tensor:
        """This rank's sums of sampled sequence losses by source, then their counts: zeros when the probe saw
        other sequences than the loader gave this rank (the same length on every rank either way)."""
        loader, count = ctx.loader, len(self.source_names)
        sequences = self.head.sequences if self.head else None
        per_rank = loader.global_batch // loader.dp_size
        if sequences is None or sequences[0].numel() != per_rank:
            return torch.zeros(2 * count, dtype=torch.float64)
        stores = loader.stores_for_step(loader.step - 1)[loader.dp_rank * per_rank : (loader.dp_rank + 1) * per_rank]
        owner = torch.from_numpy(stores).to(sequences[0].device)
        by_source = torch.zeros(2, count, dtype=torch.float64, device=owner.device)
        for row, values in zip(by_source, sequences, strict=True):
            row.index_add_(0, owner, values.double())  # on the device: no sync before the collective
        return by_source.reshape(-1)

    def _judge(self, n: int, loss: float, grad: float, largest: float, z: float) -> list[tuple[str, int, str]]:
        """The findings of step `n`: (detector, the step it began at, what was seen)."""
        found: list[tuple[str, int, str]] = []
        if not (math.isfinite(loss) and math.isfinite(grad)):
            found.append(("nonfinite", n, f"loss {loss:.4g}, gradient norm {grad:.4g}"))
            self.spike_streak.update(n, False)
            self.rise_streak.update(n, False)
            return found
        spike, drop, rise = self.loss.judge(loss), self.drop.judge(loss), self.rise.judge(loss)
        if not self.judge_loss:
            spike = drop = rise = None
        streak = self.spike_streak.update(n, bool(spike and spike.over))
        if spike and spike.over and (streak >= self.cfg.spike_persist or spike.severity >= self.cfg.spike_immediate):
            found.append(("spike", self.spike_streak.began, spike.describe("loss")))
        dropping = self.drop_streak.update(n, bool(drop and drop.over))
        if drop and drop.over and dropping == self.cfg.spike_persist:
            found.append(("drop", self.drop_streak.began, drop.describe("loss") + ": falling far faster than before"))
        rising = self.rise_streak.update(n, bool(rise and rise.over))
        if rise and rise.over and (rising >= self.cfg.spike_persist or rise.severity >= self.cfg.spike_immediate):
            what = (f"loss {loss:.4g} is {rise.excess / rise.median:.0%} above the lowest level so far,"
                    f" {rise.median:.4g}: early divergence")  # fmt: skip
            found.append(("diverge", self.rise_streak.began, what))
        if not streak and not dropping and not rising:
            self.loss.accept(loss)
        measured = [("grad", self.grad, grad, "gradient norm")]
        measured += [("logits", self.logit, largest, "largest output logit"), ("logits", self.z, z, "mean z")]
        for kind, rule, value, what in measured:
            if value <= 0:
                continue  # not measured
            verdict = rule.judge(value)
            if verdict and verdict.over:
                found.append((kind, n, verdict.describe(what)))
            # A value only warned about is what the run goes on with: it joins the history, so that slow
            # growth (logits growing as a small model learns) moves the level instead of warning every step.
            if not (verdict and verdict.over) or self._policy(kind) == "warn":
                rule.accept(value)
        return found

    def _policy(self, kind: str) -> str:
        c = self.cfg
        return {"nonfinite": c.on_nonfinite, "spike": c.on_spike, "grad": c.on_grad, "logits": c.on_logits,
                "drop": c.on_drop, "diverge": c.on_diverge, "skips": "rollback", "collapse": c.on_collapse,
                "drift": c.on_drift}[kind]  # fmt: skip

    def _plan_rollback(self, ctx: TrainContext, n: int, findings: list, loss: float) -> str:
        """Decide the rollback of step `n`: "rollback", or "stop" past the limit, or "skip" with nothing old
        enough to go back to."""
        began = min(step for _, step, _ in findings)
        recent = [r for r in self.rollbacks if r["at"] > n - self.cfg.rollback_window]
        if len(recent) >= self.cfg.max_rollbacks:
            what = f"{len(recent)} rollback(s) within guard.rollback_window = {self.cfg.rollback_window} steps already"
            findings.append(("limit", began, what))
            return "stop"
        limit = began - 1 - self.cfg.rollback_margin
        target: HeldState | SaveOutcome | None = ctx.rollback.newest_at_or_before(limit)
        saved = [o for o in ctx.checkpoints.outcomes if o.ok and o.step <= limit and o.path.is_dir()]
        if saved and (target is None or saved[-1].step > target.step):
            target = saved[-1]  # a durable checkpoint is newer (after a resume, the ring starts afresh)
        if target is None:
            # After a restart the ring starts at the resumed step, which no snapshot takes while a verdict is
            # open: the state the spike's first loss was measured on is the best left (and better than keeping
            # the spike's update).
            target = ctx.rollback.newest_at_or_before(began - 1)
        if target is None:
            what = (
                f"no state kept from before step {began - self.cfg.rollback_margin} (kept: {ctx.rollback.held_steps})"
            )
            findings.append(("no_state", began, what + "; skipping the update instead"))
            return "skip"
        median = self.loss.history.center_and_spread()[0] if len(self.loss.history) else None
        self.pending = {"target": target, "began": began, "at": n, "findings": list(findings),
                        "losses": {"at": loss, "running_median": median}}  # fmt: skip
        ctx.rollback.pending = True
        return "rollback"

    def _record(self, ctx: TrainContext, n: int, action: str, findings: list, loss: float) -> None:
        if any(kind == "drop" for kind, _, _ in findings):
            described = "; ".join(what for kind, _, what in findings if kind == "drop")
            diagnosis.report_drop(ctx, n, described, dict(self.sources.latest))
        if not findings or not ctx.dist.is_main:
            return
        described = "; ".join(f"{kind} (from step {began}): {what}" for kind, began, what in findings)
        ctx.files.log_event("guard", step=n, action=action, detectors=sorted({k for k, _, _ in findings}),
                                began=min(b for _, b, _ in findings), detail=described)  # fmt: skip
        if action != "rollback":  # a rollback speaks for itself once it is done
            verb = {"warn": "warning", "skip": "update skipped", "stop": "stopping", "ok": "noted"}[action]
            ctx.say(f"guard: step {n}: {verb}: {described}")

    def _stop(self, ctx: TrainContext, n: int, findings: list) -> None:
        path = diagnosis.write_stop_report(ctx, n, findings, self.rollbacks) if ctx.dist.is_main else None
        where = f"; report: {path}" if path else ""
        raise RunStopped(f"the loss-spike guard stopped the run at step {n}: "
                         + "; ".join(what for _, _, what in findings) + where)  # fmt: skip

    # -- the routers of a mixture of experts ----------------------------------------------------------------
    def _watch_routing(self, ctx: TrainContext, n: int) -> None:
        """Judge step `n`'s routing (`module.routing`, set after the update from the loads summed over every
        rank, so every rank judges the same numbers): a collapse or drift is warned of, stops the run, or rolls
        back to before it began (carried out in `on_step_end`, like the other rollbacks)."""
        routing = getattr(ctx.module, "routing", None)
        if routing is None:
            return
        self.routers.top_k = routing.top_k
        names = [f"{self.router_prefix}.{layer}" for layer in routing.layers]
        loads = dict(zip(names, routing.load.tolist(), strict=True))
        biases = dict(zip(names, routing.bias.tolist(), strict=True))
        findings = self.routers.judge(n, loads, biases)
        if any(self._policy(k) == "rollback" for k in ROUTER_DETECTORS) and not ctx.rollback.pending:
            # A collapse being counted may yet be rolled back past: no state of it is kept or saved meanwhile.
            streaks = any(r.streak.length for r in self.routers.layers.values())
            ctx.rollback.unsettled = ctx.rollback.unsettled or streaks
        if not findings:
            return
        action = max((self._policy(kind) for kind, _, _ in findings), key=SEVERITY.get)
        if action == "rollback" and not ctx.rollback.pending:
            # Too many rollbacks stop the run; with no state old enough, the update (already made) stays.
            action = self._plan_rollback(ctx, n, findings, self.last_loss)
            action = "warn" if action == "skip" else action
        elif action == "rollback":
            action = "warn"  # another rollback of this step goes back at least as far
        self._record(ctx, n, action, findings, self.last_loss)
        if action == "stop":
            self._stop(ctx, n, findings)

    # -- states and the learning rate ---------------------------------------------------------------------------
    def _across_restore(self) -> Any:
        """Around every rollback, the guard's or another's: what the guard has learned of the run (its
        rollbacks, the learning-rate scale they left) survives the restore of its older state, and a
        rollback of its own planned for this step is dropped (the other goes back at least as far)."""
        bookkeeping = self._bookkeeping()

        def after(step: int) -> None:
            self._load_bookkeeping(bookkeeping)
            self.pending = None
            self.rollback.module.lr_scale = self._current_scale(step)

        return after

    def _current_scale(self, step: int) -> float:
        if self.lr_until is not None and step >= self.lr_until:
            self.lr_scale, self.lr_until = 1.0, None
        return self.lr_scale

    # -- layer statistics --------------------------------------------------------------------------------------
    def _stats_step(self, n: int) -> bool:
        return bool(self.cfg.stats_every) and n % self.cfg.stats_every == 0 and self.whole is not None

    def _layer_stats(self, ctx: TrainContext, n: int, grad_norm: float) -> dict[str, Any]:
        """Per-layer statistics of step `n` before its update (the blocks' probe is removed here)."""
        probe, self.blocks = self.blocks, None
        probe.close()
        record = diagnosis.layer_stats(ctx, n, probe, grad_norm)
        self.before_update = parameters_now(self.whole)
        return record

    def _update_norms(self, ctx: TrainContext) -> dict[str, float]:
        before, self.before_update = self.before_update, None
        return update_norms(self.whole, before)


def _has_module(model: torch.nn.Module, name: str) -> bool:
    try:
        submodule(model, name)
    except AttributeError:
        return False
    return True


def _diverged(plan: dict, found: dict) -> bool:
    """Early divergence on batches that look normal on the model from before it, and that came back on replay
    (not a transient fault): the learning rate's doing."""
    diverged = any(kind == "diverge" for kind, _, _ in plan["findings"])
    return diverged and not found.get("culprit_data_steps") and found.get("reproduced") is not False


def _largest(values) -> float:
    values = list(values)
    return next((v for v in values if not math.isfinite(v)), max(values))


def _event_fields(plan: dict, rollback: dict, found: dict) -> dict[str, Any]:
    return {
        "began": rollback["began"], "to": rollback["to"], "from": rollback["from"], "skipped": rollback["skipped"],
        "lr_scale": rollback["lr_scale"], "lr_until": rollback["lr_until"], "seconds": rollback["seconds"],
        "steps_redone": rollback["steps_redone"],
        "detectors": sorted({kind for kind, _, _ in plan["findings"]}),
        "culprit_data_steps": found.get("culprit_data_steps", []), "documents": len(found.get("documents", [])),
        "reproduced": found.get("reproduced"), "layers_first": found.get("layers_first", [])[:3],
        "routers_first": list(dict.fromkeys(m["layer"] for m in found.get("routers_first", [])))[:3],
    }  # fmt: skip


def _guard(cfg: Config) -> Callback | None:
    # A preference loss of a few pairs a step is a noisy, heavy-tailed mean that moves by half its level from
    # batch to batch as the policy leaves the reference: its spikes and drops say nothing of the run's health
    return GuardCallback(cfg.guard, judge_loss=cfg.train.objective != "dpo") if cfg.guard.enabled else None
