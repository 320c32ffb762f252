"""What the guard finds out about an incident, and the reports it writes.

After a rollback it has the state from before the spike and the batches that followed. It puts each batch
through the model from before the spike: a batch whose loss is anomalous there is bad data (its documents
are named), while batches that look normal there point at the updates (learning rate, optimizer state) or at
the device. Then it replays the steps from the restored state with per-layer statistics on every step, and
names the layers whose statistics moved first; whether the spike comes back on replay says whether it is
reproducible (data, state) or transient (a device, a one-off fault). Both passes start from and end at the
restored state, so they change nothing in the run.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from liandan.run import RunDir, append_jsonl, atomic_write_json
from liandan.train.guard.stats import BlockProbe, norms_by_layer, parameters_now, update_norms

if TYPE_CHECKING:
    from liandan.checkpoint.ring import HeldState
    from liandan.train.context import TrainContext
    from liandan.train.guard.callback import GuardCallback

MOVED = math.log(2.0)  # a statistic has "moved" once it doubled or halved
NEAR_ZERO_LOSS = 0.1  # nats: a token predicted this well is one the model has all but memorised
SHOWN_TOKENS = 10
ENTROPY_MOVE = 0.05  # a router's load entropy (over log experts) has moved once it changed by this much...
BIAS_MOVE = 1e-4  # ...and its balancing bias once a step moved it this much (or 10 times its usual step)


# -- layer statistics ---------------------------------------------------------------------------------------
def layer_stats(ctx: TrainContext, n: int, probe: BlockProbe, grad_norm: float) -> dict[str, Any]:
    """Per-layer statistics of step `n` once its gradients are clipped, before its update: weight and gradient
    norms (the gradient's before clipping), and the largest activation RMS and attention logit over ranks."""
    named = list(ctx.module.model.named_parameters())
    clip = ctx.cfg.optim.grad_clip
    unclip = max(1.0, grad_norm / clip) if clip and math.isfinite(grad_norm) else 1.0
    grads = {k: v * unclip for k, v in norms_by_layer((name, p.grad) for name, p in named).items()}
    record = {
        "step": n,
        "grad_norm": grad_norm,
        "weight": norms_by_layer((name, p) for name, p in named),
        "grad": grads,
        "activation_rms": _largest_over_ranks(ctx, probe.rms),
        "attention_logit": _largest_over_ranks(ctx, probe.attention),
    }
    if probe.failed:
        record["attention_logit_error"] = probe.failed
    return record


def _largest_over_ranks(ctx: TrainContext, values: dict[str, torch.Tensor]) -> dict[str, float]:
    if not values:
        return {}
    names = sorted(values)
    stacked = torch.stack([values[name].float().reshape(()) for name in names])
    if ctx.dist.distributed:
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    return dict(zip(names, stacked.cpu().tolist(), strict=True))


def append_layer_stats(room: RunDir, record: dict[str, Any]) -> None:
    room.guard.mkdir(parents=True, exist_ok=True)
    append_jsonl(room.layer_stats, record)


# -- after a rollback -------------------------------------------------------------------------------------------
def diagnose(ctx: TrainContext, guard: GuardCallback, target: HeldState, at: int, began: int, first_data: int,
             losses: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """The batches of steps target.step + 1 .. `at` (data steps from `first_data`) judged on the model from
    before the spike, their culprits' documents, and (with `guard.replay`) a replay with layer statistics.
    Called on every rank with the restored state in place; leaves the model moved on by the replay."""
    micro = ctx.micro_batch
    count = at - target.step
    batches = []
    for i in range(count):
        loss = ctx.mean_over_ranks(ctx.module.eval_batch(ctx.loader.batch_at(first_data + i, micro)))
        verdict = guard.loss.judge(loss)
        batches.append({"step": target.step + 1 + i, "data_step": first_data + i, "loss_before_spike": loss,
                        "culprit": bool(verdict is None and not math.isfinite(loss) or verdict and verdict.over)})  # fmt: skip
    culprits = [b["data_step"] for b in batches if b["culprit"]]
    found: dict[str, Any] = {"batches": batches, "culprit_data_steps": culprits}
    if ctx.dist.is_main:
        found["documents"] = [
            {
                "data_step": d,
                "store": ref.store,
                "shard": ref.shard,
                "document": ref.document,
                "source": ref.source,
                "id": ref.doc_id,
            }
            for d in culprits
            for ref in ctx.loader.documents_for_step(d)
        ]
    if guard.cfg.replay:
        # Without one whole model (pipeline stages) the replay still tells whether the spike comes back; the
        # layer statistics are left out.
        records = replay(ctx, count, layers=guard.whole is not None)
        found["replay"] = records
        index = began - target.step - 1
        if 0 <= index < len(records):
            replayed = records[index]["loss"]
            verdict = guard.loss.judge(replayed)
            if not math.isfinite(replayed) or verdict is not None:  # too little history: cannot tell
                found["reproduced"] = not math.isfinite(replayed) or verdict.over
        found["layers_first"] = moved_first(records, began) if found.get("reproduced") else []
    if guard.head is not None:
        guard.head.take(ctx.device)  # what the diagnosis measured is not the next step's
    return found


def replay(ctx: TrainContext, count: int, layers: bool = True) -> list[dict[str, Any]]:
    """Train `count` steps from the current state with layer statistics on each where `layers` (the run's
    position is put back by the caller)."""
    module, records = ctx.module, []
    for i in range(count):
        probe = BlockProbe(module.model, module.spec) if layers else None
        batches = ctx.loader.next_step(ctx.micro_batch)
        loss = module.train_batch(batches, lambda *args, step=i, **kwargs: ctx.phase("rollback", step))
        grad_norm = module.clip_grad_norm()
        if probe is not None:
            probe.close()
            record = layer_stats(ctx, ctx.step + 1 + i, probe, grad_norm)
            before = parameters_now(module.model)
        else:
            record = {"step": ctx.step + 1 + i, "grad_norm": grad_norm}
        if math.isfinite(grad_norm):
            module.optim_step()
        else:
            module.skip_step()
        if probe is not None:
            record["update"] = update_norms(module.model, before)
        record["loss"] = ctx.mean_over_ranks(loss)
        records.append(record)
    return records


def moved_first(records: list[dict[str, Any]], began: int) -> list[dict[str, Any]]:
    """The layer statistics that moved earliest from step `began` on, against their own history in the replay
    before it: a move is a change of at least a factor of two and of five times the statistic's own
    step-to-step noise. One entry per (layer, statistic), earliest first, then by how far it moved."""
    before = [r for r in records if r["step"] < began]
    after = [r for r in records if r["step"] >= began]
    if not before or not after:
        return []
    moved = []
    for stat in ("grad", "update", "activation_rms", "attention_logit", "weight"):
        for layer in before[0].get(stat, {}):
            history = [math.log(v) for r in before if (v := r.get(stat, {}).get(layer)) and v > 0 and math.isfinite(v)]
            if not history:
                continue
            base = median(history)
            diffs = [abs(b - a) for a, b in itertools.pairwise(history)]
            threshold = max(MOVED, 5 * median(diffs)) if diffs else MOVED
            for record in after:
                value = record.get(stat, {}).get(layer)
                if value is None:
                    continue
                change = math.log(value) - base if value > 0 and math.isfinite(value) else math.inf
                if abs(change) >= threshold:
                    moved.append({"layer": layer, "statistic": stat, "step": record["step"],
                                  "factor": math.exp(change) if math.isfinite(change) else None,
                                  "size": abs(change)})  # fmt: skip
                    break
    moved.sort(key=lambda m: (m["step"], -m["size"]))
    for m in moved:
        del m["size"]
    return moved


def routers_moved_first(recent: list[dict[str, Any]], began: int, restored: int) -> list[dict[str, Any]]:
    """The MoE layers whose routing moved in the steps from the restored state (`restored`) up to the step
    the incident began at, against the routing seen at and before the restored state (`recent`: the guard's
    RouterWatch.recent): a load entropy away from its level by ENTROPY_MOVE and five times its step-to-step
    noise, or a bias that moved in one step ten times its usual step. One entry per (layer, statistic),
    earliest first, then by how far it moved."""
    recent = [r for r in recent if r["step"] <= began]
    count = sum(1 for r in recent if r["step"] <= restored) or 1  # recent is in step order
    if len(recent) <= count:
        return []
    moved = []
    for layer in recent[count - 1]["layers"]:
        rows = [(r["step"], r["layers"][layer]) for r in recent if layer in r["layers"]]
        before = [seen for step, seen in rows if step <= restored] or [rows[0][1]]
        after = rows[len(before) :]
        entropies = [seen["entropy"] for seen in before]
        diffs = [abs(b - a) for a, b in itertools.pairwise(entropies)]
        level = median(entropies)
        threshold = max(ENTROPY_MOVE, 5 * median(diffs)) if diffs else ENTROPY_MOVE
        for step, seen in after:
            if abs(seen["entropy"] - level) >= threshold:
                moved.append({"layer": layer, "statistic": "entropy", "step": step, "from": level,
                              "to": seen["entropy"], "size": abs(seen["entropy"] - level) / threshold})  # fmt: skip
                break
        changes = [_largest_change(a["bias"], b["bias"]) for (_, a), (_, b) in itertools.pairwise(rows)]
        usual = [change for change, _ in changes[: len(before) - 1]]
        threshold = max(BIAS_MOVE, 10 * median(usual)) if usual else BIAS_MOVE
        for (step, _), (change, expert) in zip(after, changes[len(before) - 1 :], strict=True):
            if change >= threshold:
                moved.append({"layer": layer, "statistic": "bias", "step": step, "expert": expert,
                              "change": change, "size": change / threshold})  # fmt: skip
                break
    moved.sort(key=lambda m: (m["step"], -m["size"]))
    for m in moved:
        del m["size"]
    return moved


def _largest_change(before: list[float], after: list[float]) -> tuple[float, int]:
    """The largest change of one expert's bias between two steps, and that expert."""
    if len(before) != len(after) or not before:
        return 0.0, 0
    changes = [abs(b - a) for a, b in zip(before, after, strict=True)]
    expert = max(range(len(changes)), key=changes.__getitem__)
    return changes[expert], expert


# -- reports ----------------------------------------------------------------------------------------------------
def write_report(ctx: TrainContext, plan: dict[str, Any], rollback: dict[str, Any], found: dict[str, Any]) -> Path:
    path = ctx.room.guard_report("spike", rollback["at"])
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "kind": "rollback",
        "step": rollback["at"],
        "began": rollback["began"],
        "findings": [{"detector": k, "began": b, "detail": d} for k, b, d in plan["findings"]],
        "loss": plan["losses"],
        "rollback": rollback,
        "verdict": verdict(found),
        **{k: v for k, v in found.items() if k != "replay"},
        "replay": found.get("replay", []),
    }
    atomic_write_json(path, report)
    return path


def verdict(found: dict[str, Any]) -> str:
    if found.get("culprit_data_steps"):
        steps = ", ".join(str(s) for s in found["culprit_data_steps"])
        return f"bad data: the batch(es) of data step {steps} are anomalous on the model from before the spike"
    if found.get("reproduced") is False:
        return ("not reproducible: the batches look normal on the model from before the spike and the spike did"
                " not come back on replay (a transient fault: an update or a device)")  # fmt: skip
    return "the batches look normal on the model from before the spike: the updates (learning rate, optimizer state)"


def one_line(plan: dict[str, Any], rollback: dict[str, Any], found: dict[str, Any], path: Path) -> str:
    first, end = rollback["skipped"]
    detectors = ", ".join(sorted({kind for kind, _, _ in plan["findings"]}))
    lr = f", learning rate x{rollback['lr_scale']:g}" if rollback["lr_scale"] != 1.0 else ""
    if rollback["lr_scale"] != 1.0 and rollback["lr_until"] is None:
        lr += " for the rest of the run"
    data = f"skipped data steps {first}..{end - 1}" if end > first else "the same data again"
    layers = found.get("layers_first", [])
    moved = f"; moved first: {layers[0]['layer']} {layers[0]['statistic']}" if layers else ""
    routers = found.get("routers_first", [])
    if routers:
        moved += "; routers moved first: " + ", ".join(f"{m['layer']} {m['statistic']} (step {m['step']})"
                                                       for m in routers[:3])  # fmt: skip
    return (f"guard: {detectors} at step {rollback['at']} (began at step {rollback['began']}): rolled back to step"
            f" {rollback['to']}, {data}{lr}; {verdict(found)}{moved}; report {path}")  # fmt: skip


def write_stop_report(ctx: TrainContext, n: int, findings: list, rollbacks: list[dict[str, Any]]) -> Path:
    path = ctx.room.guard_report("stop", n)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"kind": "stop", "step": n, "rollbacks": rollbacks,
                             "findings": [{"detector": k, "began": b, "detail": d} for k, b, d in findings]})  # fmt: skip
    return path


# -- too good to be true ------------------------------------------------------------------------------------
@torch.no_grad()
def easiest_tokens(ctx: TrainContext, data_step: int) -> list[dict[str, Any]]:
    """The tokens that carry the most targets of the batch of `data_step` at near-zero loss: what a model
    that found a shortcut in the data (a flood of one character) predicts. Collective: every rank calls it."""
    model, module = ctx.module.model, ctx.module
    vocab = module.args.vocab_size
    count = torch.zeros(vocab, dtype=torch.float64)
    loss_sum = torch.zeros(vocab, dtype=torch.float64)
    predicted = torch.zeros(vocab, dtype=torch.float64)
    model.eval()
    try:
        for batch in ctx.loader.batch_at(data_step, ctx.micro_batch):
            batch = batch.to(ctx.device)
            with module.autocasting():
                logits = model(batch.inputs)
            logits = (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).float().flatten(0, 1)
            targets = batch.targets.flatten()
            kept = targets >= 0  # fine-tuning's prompts and padding (target -1) are no targets
            logits, targets = logits[kept], targets[kept]
            losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none").double().cpu()
            targets = targets.cpu()
            count.index_add_(0, targets, torch.ones_like(losses))
            loss_sum.index_add_(0, targets, losses)
            predicted.index_add_(0, logits.argmax(-1).cpu(), torch.ones_like(losses))
    finally:
        model.train()
    if ctx.dist.distributed:
        for t in (count, loss_sum, predicted):
            dist.all_reduce(t)
    total = float(count.sum()) or 1.0
    mean = loss_sum / count.clamp(min=1)
    easy = torch.nonzero((count > 0) & (mean < NEAR_ZERO_LOSS)).flatten().tolist()
    easy.sort(key=lambda i: -float(count[i]))
    return [
        {
            "id": i,
            "text": ctx.tokenizer.decode([i]),
            "share": float(count[i]) / total,
            "mean_loss": float(mean[i]),
            "predicted_share": float(predicted[i]) / total,
        }
        for i in easy[:SHOWN_TOKENS]
    ]


def report_drop(ctx: TrainContext, n: int, described: str, sources: dict[str, float] | None = None) -> None:
    """A too-good-to-be-true warning's report: what was seen, each source's newest sampled loss (a mixture's)
    and the tokens the model finds easiest in the step's batch. Collective."""
    tokens = easiest_tokens(ctx, ctx.loader.step - 1)
    if not ctx.dist.is_main:
        return
    path = ctx.room.guard_report("drop", n)
    path.parent.mkdir(parents=True, exist_ok=True)
    documents = [ref.__dict__ for ref in ctx.loader.documents_for_step(ctx.loader.step - 1)]
    atomic_write_json(path, {"kind": "drop", "step": n, "detail": described, "source_losses": sources or {},
                             "easiest_tokens": tokens, "documents": documents})  # fmt: skip
    shown = ", ".join(
        f"{t['text']!r} {100 * t['share']:.1f}% of targets at loss {t['mean_loss']:.3f}" for t in tokens[:3]
    )
    ctx.say(f"guard: step {n}: too good to be true? easiest tokens: {shown or 'none near zero loss'}; report {path}")
    ctx.files.log_event("too_good", step=n, report=str(path), detail=described,
                            tokens=[t["text"] for t in tokens[:5]])  # fmt: skip
