"""Silent data corruption: a callback that checks, at intervals, that the ranks compute what they must.

- Weight fingerprints (every check step, after the update): ranks that hold the same weights (the
  data-parallel replicas: every rank under DDP, the `dp_replicate` groups under HSDP) compare one int64 per
  parameter tensor, the sum of the tensor's bits read as integers. Any flipped bit changes it; a rank whose
  fingerprint differs from the majority's is the odd one.
- Cross-checks (every check step, before the update): the clipped gradient norm must be the same number on
  every rank, and under DDP the gradient all-reduce must add up: the audited hook (`allreduce.py`) records
  each rank's bucket sums before the all-reduce and the reduced sums after, and the sum of the ranks'
  contributions must equal the reduced sum within rounding (relative to the sum of magnitudes). The rank whose
  buffer as sent differs from what backward left in it is the one whose contribution went out wrong.
- Replays (every `replay_every` steps, before the update): data-parallel rank d recomputes, by forward passes
  alone, the loss of rank d+1's batch of this step and compares it with the loss rank d+1 computed. A rank
  that computes wrong disagrees with both its neighbours: the rank common to the mismatching pairs.

A mismatch is an incident: the update of the step is never applied (a veto before it, or, for fingerprints,
a rollback past it), every rank runs the golden matrix product to tell a faulty device from a transient
fault, and the run goes back through the rollback service to the newest in-memory state that
predates the fault and was verified (this callback runs before the guard, so that the guard only keeps
states whose fingerprints matched). The incident is an "sdc" event naming rank, host, what disagreed and the
steps. A transient fault (a flipped bit, one corrupted all-reduce) is then trained past; a device that fails
its golden test stops the run with `DeviceFault`, and the supervisor marks its node.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from liandan.config import Config, HealthSection
from liandan.run import RunStopped
from liandan.run.errors import DeviceFault
from liandan.train.callbacks import Callback
from liandan.train.health.ranks import gather_rows, golden_suspects

if TYPE_CHECKING:
    from liandan.train.context import TrainContext

REPLAY_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
ROUNDING_ULPS = 16  # how many units of rounding per rank a reduced sum may be off by before it is wrong


def fingerprint(parts: list[torch.nn.Module]) -> torch.Tensor:
    """One int64 per parameter tensor of this rank (its local shard): the sum of its elements' bits read as
    integers. Exact: equal weights give equal fingerprints on any device, and one flipped bit changes it."""
    sums = []
    with torch.no_grad():
        for p in (p for part in parts for p in part.parameters()):
            local = p.to_local() if hasattr(p, "to_local") else p
            ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[local.element_size()]
            sums.append(local.detach().reshape(-1).view(ints).sum(dtype=torch.int64))
    return torch.stack(sums) if sums else torch.zeros(1, dtype=torch.int64)


class SdcCallback(Callback):
    order = 4  # before the guard (5): a state is verified before the guard keeps it to roll back to

    def __init__(self, cfg: HealthSection, ring_every: int):
        self.cfg = cfg
        self.ring_every = ring_every  # 0: the guard is off
        self.hosts: list[str] = []
        self.replica_groups: list[list[int]] = []  # global ranks that hold the same weights; none: no replicas
        self.last_verified = 0  # the newest step whose weights passed the fingerprint check
        self.last_clean_replay = 0  # before the newest replay that agreed: a persistent fault began after it
        self.pending: dict[str, Any] | None = None
        self.incidents: list[dict[str, Any]] = []

    # -- the hooks ----------------------------------------------------------------------------------------
    def on_train_start(self, ctx: TrainContext) -> None:
        self.hosts = ctx.rank_hosts()
        layout = ctx.layout
        if ctx.mesh is not None and layout.dp_replicate > 1:
            # A group is one position on every other dim of the mesh (dp_shard, cp, tp, ...).
            ranks = ctx.mesh.mesh.movedim(ctx.mesh.mesh_dim_names.index("dp_replicate"), 0)
            self.replica_groups = ranks.reshape(ranks.shape[0], -1).T.tolist()
        elif ctx.dist.distributed:
            ctx.say(f"sdc: layout {layout} keeps no replicas of the weights: their fingerprints are not compared")
        if ctx.dist.distributed and ctx.dp_size < 2 and self.cfg.replay_every:
            ctx.say("sdc: one data-parallel rank: no neighbour to replay its steps on")
        # A resumed state was verified when it was saved; what came before it is not in memory anyway.
        self.last_verified = self.last_clean_replay = ctx.step

    def before_step(self, ctx: TrainContext, step: int) -> None:
        audit = ctx.module.allreduce_audit
        if audit is not None:
            audit.start(record=self._check_step(step + 1))

    def before_optimizer_step(self, ctx: TrainContext, step: int, loss: Any, grad_norm: float) -> bool:
        n = step + 1
        findings = []
        if self._check_step(n) and ctx.dist.distributed:
            findings += self._cross_check(ctx, n, grad_norm)
        if self._replay_step(n) and ctx.dp_size > 1:
            findings += self._replay(ctx, n, loss)
        if not findings:
            return True
        replayed = any(f["check"] == "replay" for f in findings)
        self._incident(ctx, n, findings, self.last_clean_replay if replayed else n - 1)
        return False

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        if ctx.rollback.pending or not self._check_step(step):
            return
        if not self.replica_groups:
            self.last_verified = step
            return
        found = self._fingerprints(ctx, step)
        if found is None:
            self.last_verified = step
        else:
            self._incident(ctx, step, [found], self.last_verified)

    def on_step_end(self, ctx: TrainContext, step: int) -> None:
        if self.pending is None:
            return
        plan, self.pending = self.pending, None
        ctx.phase("rollback")
        held = ctx.rollback.to_verified(plan["limit"])
        ctx.rollback.pending = False
        what = "; ".join(f["detail"] for f in plan["findings"])
        named = plan["ranks"]
        who = (", ".join(f"rank {r} on {self.hosts[r]}" for r in named) if named
               else plan.get("ambiguous") or "no rank named")  # fmt: skip
        event = {"step": plan["step"], "ranks": named, "hosts": [self.hosts[r] for r in named],
                 "checks": sorted({f["check"] for f in plan["findings"]}), "detail": what,
                 "verified": plan["limit"], "to": held.step if held else None, "persistent": plan["persistent"],
                 "golden": plan["golden"], "ambiguous": plan.get("ambiguous"), "reason": plan["reason"]}  # fmt: skip
        self.incidents.append(event)
        if ctx.dist.is_main:
            ctx.files.log_event("sdc", **event)
        back = f"rolled back to step {held.step}" if held else "no verified state in memory to roll back to"
        ctx.say(f"sdc: step {plan['step']}: {who}: {what}; {back}")
        if plan["persistent"]:
            rank = named[0]
            raise DeviceFault(
                f"silent data corruption: rank {rank} on host {self.hosts[rank]} {plan['reason']} at step"
                f" {plan['step']} ({what}); {back}; the run stopped: training on that device would corrupt it"
                " again",
                rank, self.hosts[rank],
            )  # fmt: skip
        if plan["recurs"]:
            raise RunStopped(f"silent data corruption recurred at step {plan['step']} ({who}: {what}) and no rank"
                             f" can be named; {back}; the run stopped")  # fmt: skip
        if held is None:
            raise RunStopped(f"silent data corruption at step {plan['step']} ({who}: {what}) and no verified state"
                             " in memory to roll back to (is the loss-spike guard off?); the run stopped")  # fmt: skip
        self.last_verified = held.step
        self.last_clean_replay = min(self.last_clean_replay, held.step)

    def state_dict(self) -> dict[str, Any]:
        # Kept with every state the guard holds and every checkpoint: a rewind to a state brings back what
        # was verified when it was kept.
        return {"last_verified": self.last_verified, "last_clean_replay": self.last_clean_replay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_verified = int(state["last_verified"])
        self.last_clean_replay = int(state["last_clean_replay"])

    # -- the checks ---------------------------------------------------------------------------------------------
    def _check_step(self, n: int) -> bool:
        return n % self.cfg.check_every == 0 or bool(self.ring_every and n % self.ring_every == 0)

    def _replay_step(self, n: int) -> bool:
        return bool(self.cfg.replay_every) and n % self.cfg.replay_every == 0

    def _fingerprints(self, ctx: TrainContext, step: int) -> dict[str, Any] | None:
        """Every rank's fingerprints in one collective over all ranks (so that every rank reaches the same
        verdict), compared within each group of replicas."""
        rows = [tuple(r.tolist()) for r in gather_rows(fingerprint(ctx.module.model_parts))]
        odd, disagree, tensors = [], [], set()
        for group in self.replica_groups:
            keys = [rows[r] for r in group]
            if len(set(keys)) == 1:
                continue
            common, count = Counter(keys).most_common(1)[0]
            if count * 2 <= len(keys):
                disagree += group
                continue
            for rank, key in zip(group, keys, strict=True):
                if key != common:
                    odd.append(rank)
                    tensors |= {j for j, (a, b) in enumerate(zip(key, common, strict=True)) if a != b}
        if not odd and not disagree:
            return None
        said = []
        if odd:
            said.append(f"rank(s) {', '.join(map(str, odd))} differ from their other replicas in parameter tensor(s)"
                        f" {', '.join(map(str, sorted(tensors)[:5]))}")  # fmt: skip
        if disagree:
            said.append(f"ranks {', '.join(map(str, disagree))} disagree; no majority")
        return {"check": "fingerprint", "suspects": odd, "disagree": disagree,
                "detail": f"weight fingerprints after step {step}: " + "; ".join(said)}  # fmt: skip

    def _cross_check(self, ctx: TrainContext, n: int, grad_norm: float) -> list[dict[str, Any]]:
        """The gradient norm and, under DDP, the all-reduce's sums, of every rank: one collective."""
        audit = ctx.module.allreduce_audit
        sums = audit.sums() if audit is not None else None
        values = [torch.tensor([float(grad_norm)], dtype=torch.float64, device=ctx.device)]
        if sums is not None:
            values.append(sums.reshape(-1))
        rows = gather_rows(torch.cat(values), None)
        found = []
        norms = [float(r[0]) for r in rows]
        if len(set(norms)) > 1:
            common, count = Counter(norms).most_common(1)[0]
            odd = [r for r, v in enumerate(norms) if v != common] if count * 2 > len(norms) else []
            listed = ", ".join(f"rank {r} {v:.9g}" for r, v in enumerate(norms))
            found.append({"check": "grad_norm", "suspects": odd, "detail": f"gradient norms of step {n} differ:"
                          f" {listed}", "disagree": [] if odd else list(range(len(norms)))})  # fmt: skip
        if sums is not None and len({len(r) for r in rows}) == 1:
            found += self._allreduce_sums(n, [r[1:].reshape(-1, 4) for r in rows])
        return found

    def _allreduce_sums(self, n: int, per_rank: list[torch.Tensor]) -> list[dict[str, Any]]:
        """(claimed sum, claimed magnitude, sent sum, reduced sum) per bucket of each rank (the replicas are
        every rank under DDP): the contributions must add up to the reduced sum within the rounding of
        float32 gradients (DDP reduces the master weights' gradients)."""
        eps = torch.finfo(torch.float32).eps
        table = torch.stack(per_rank)  # rank, bucket, column
        claimed, magnitude, sent, reduced = table.unbind(-1)
        size = len(per_rank)
        allowed = ROUNDING_ULPS * size * eps * magnitude.sum(0) + 1e-30
        off = (claimed.sum(0) - reduced).abs()  # every rank's view of each bucket's reduced sum
        if not bool((off > allowed).any()):
            return []
        buckets = sorted({int(b) for b in torch.nonzero(off > allowed)[:, 1].tolist()})
        senders = [r for r in range(size) if bool(((sent[r] - claimed[r]).abs() > ROUNDING_ULPS * eps
                                                   * magnitude[r] + 1e-30).any())]  # fmt: skip
        b = buckets[0]
        detail = (
            f"gradient all-reduce of step {n}: bucket(s) {', '.join(map(str, buckets))} reduced to"
            f" {float(reduced[0, b]):.6g}, the ranks' contributions add up to {float(claimed[:, b].sum()):.6g}"
        )
        if senders:
            detail += f"; rank(s) {', '.join(map(str, senders))} sent other gradients than backward gave them"
        else:
            detail += "; every rank sent what backward gave it: corrupted on the way"
        return [{"check": "allreduce", "suspects": senders, "detail": detail}]

    def _replay(self, ctx: TrainContext, n: int, loss: torch.Tensor) -> list[dict[str, Any]]:
        """Data-parallel rank d recomputes the loss of rank d+1's batch of this step and compares it with the
        loss rank d+1 reported; the rank common to every mismatching pair is the suspect."""
        loader, size = ctx.loader, ctx.dp_size
        neighbour = (ctx.dp_rank + 1) % size
        batches = loader.batch_at(loader.step - 1, ctx.micro_batch, dp_rank=neighbour)
        replayed = ctx.module.replay_loss(batches, n)
        row = torch.stack([torch.tensor(float(ctx.dp_rank), dtype=torch.float64, device=ctx.device),
                           loss.detach().double().reshape(()), replayed.double().reshape(())])  # fmt: skip
        rows = [r.tolist() for r in gather_rows(row, None)]
        tolerance = self.cfg.replay_tolerance or REPLAY_TOLERANCE.get(ctx.dtype, 1e-5)
        claimed = {int(d): value for d, value, _ in rows}  # tensor-parallel peers report the same loss
        pairs, lines = [], []
        for rank, (d, _, again) in enumerate(rows):
            owner = (int(d) + 1) % size
            theirs = claimed[owner]
            if abs(again - theirs) > tolerance * max(abs(theirs), 1e-12):
                owners = [r for r, row_ in enumerate(rows) if int(row_[0]) == owner]
                pairs.append({rank, *owners})
                lines.append(f"rank {rank} replayed {again:.7g} for data rank {owner}, which computed {theirs:.7g}")
        if not pairs:  # the devices computed right after this step's backward: its update is sound
            self.last_clean_replay = n
            return []
        common = sorted(set.intersection(*pairs))
        finding = {"check": "replay", "detail": f"replay of step {n}: " + "; ".join(lines)}
        if len(common) == 1:
            finding["suspects"] = common
        else:
            finding["suspects"], finding["disagree"] = [], common or sorted(set.union(*pairs))
        return [finding]

    # -- an incident --------------------------------------------------------------------------------------------
    def _incident(self, ctx: TrainContext, n: int, findings: list[dict[str, Any]], limit: int) -> None:
        """Name the rank (the golden test first: it tells a device that computes wrong), and plan the rollback
        to a verified state at or before `limit`, carried out at the end of the step."""
        wrong, results = golden_suspects(ctx, n, self.cfg.golden_size)
        checks = {f["check"] for f in findings}
        recurs = any(checks & set(i["checks"]) for i in self.incidents)  # a transient fault does not come back
        if wrong:
            named, reason = wrong, "failed its golden matrix product"
        else:
            suspects = [set(f["suspects"]) for f in findings if f["suspects"]]
            named = sorted(set.intersection(*suspects)) if suspects else []
            reason = "was named again by the same check after a rollback" if recurs and named else None
        persistent = bool(wrong) or (recurs and bool(named))
        if persistent:
            limit = min(limit, self.last_clean_replay)  # the device may have been wrong since then
        plan = {"step": n, "findings": findings, "ranks": named, "persistent": persistent, "reason": reason,
                "recurs": recurs,
                "limit": min(limit, self.last_verified),
                "golden": [{"rank": r, "ok": g["ok"], "max_error": g["max_error"]} for r, g in enumerate(results)]}  # fmt: skip
        if not named:
            disagree = sorted({r for f in findings for r in f.get("disagree", [])})
            if len(disagree) >= 2:
                plan["ambiguous"] = (f"ranks {', '.join(map(str, disagree[:-1]))} and {disagree[-1]} disagree;"
                                     " no majority, and every golden test passed")  # fmt: skip
        self.pending = plan
        ctx.rollback.pending = True


def _sdc(cfg: Config) -> Callback | None:
    return SdcCallback(cfg.health, cfg.guard.ring_every if cfg.guard.enabled else 0) if cfg.health.sdc else None
