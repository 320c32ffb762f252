"""Every layout of a run on N devices, ranked: those that fit by predicted step time (`liandan.plan.layouts`),
each other one with the one-line reason it is slower than the best or cannot run.

Searched: tensor parallel in powers of two (up to twice the node, to show what crossing nodes costs), pipeline
parallel in powers of two (the config's schedule, virtual stages and micro-batches), context parallel 1 to 8,
FSDP over what is left (the config's dp_replicate and ep kept), and for each the least costly activation
recomputation, with or without CPU offload, that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from liandan.plan.activations import CHECKPOINT_MODES
from liandan.plan.layouts import Candidate, Evaluated, Workload, evaluate
from liandan.plan.memory import GIB, usable_bytes

TERM_WORDS = {
    "compute": "compute on the busiest rank",
    "recompute": "recomputation",
    "bubble": "pipeline bubble",
    "tp": "tensor-parallel traffic",
    "cp": "ring-attention KV exchange",
    "ep": "expert all-to-all",
    "pp": "pipeline send/receive",
    "fsdp": "FSDP traffic not hidden by compute",
    "offload": "optimizer step on the CPU",
}


@dataclass(frozen=True)
class Ranked:
    dims: str  # the layout's dims, e.g. "dp_shard=8 tp=8 pp=4"
    evaluated: Evaluated | None  # the fastest variant that fits, else the smallest, else None (cannot run)
    fits: bool
    reason: str  # empty for the best

    @property
    def step_seconds(self) -> float:
        return self.evaluated.time.total if self.evaluated is not None else float("inf")


def _powers(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def rank_layouts(
    w: Workload,
    nproc: int,
    *,
    device_memory_gib: float,
    headroom: float,
    dp_replicate: int = 1,
    ep: int = 1,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    pp_microbatches: int = 0,
    micro_batch: int = 0,
    tp_refusal=lambda tp: None,
    max_tp: int | None = None,
    max_cp: int = 8,
) -> list[Ranked]:
    """Every layout of `nproc` devices, best first: the fitting ones by step time, then those that do not fit
    by memory, then those that cannot run. `micro_batch` and `pp_microbatches` fix the micro-batch (0: every
    power of two is tried); `tp_refusal(tp)` is the model family's reason it cannot split by tp, or None."""
    usable = usable_bytes(device_memory_gib, headroom)
    rows: list[Ranked] = []
    for pp in _powers(nproc):
        for tp in _powers(min(nproc, max_tp or 2 * w.network.gpus_per_node)):
            for cp in _powers(min(max_cp, nproc)):
                if nproc % (pp * tp * cp * dp_replicate):
                    continue
                shard = nproc // (pp * tp * cp * dp_replicate)
                dims = Candidate(dp_replicate, shard, tp, pp, cp, ep).dims()
                why = _refusal(w, tp, pp, cp, shard, dp_replicate, ep, schedule, stages_per_rank, tp_refusal)
                if why:
                    rows.append(Ranked(dims, None, False, why))
                    continue
                batches = _batches(w, pp, shard * dp_replicate, pp_microbatches, micro_batch, schedule)
                if isinstance(batches, str):
                    rows.append(Ranked(dims, None, False, batches))
                    continue
                best: Evaluated | None = None
                smallest: Evaluated | None = None
                for m, b in reversed(batches):  # largest micro-batch first: it keeps ties (fewer, larger matmuls)
                    for offload in (False, True):
                        for mode in CHECKPOINT_MODES:
                            c = Candidate(dp_replicate, shard, tp, pp, cp, ep, schedule, stages_per_rank, m, b, mode,
                                          offload)  # fmt: skip
                            e = evaluate(w, c)
                            if e.worst.total <= usable:
                                if best is None or e.time.total < best.time.total:
                                    best = e
                            elif smallest is None or e.worst.total < smallest.worst.total:
                                smallest = e
                if best is not None:
                    rows.append(Ranked(dims, best, True, ""))
                else:
                    assert smallest is not None
                    worst = smallest.worst
                    where = f" on pipeline rank {worst.rank}" if pp > 1 else ""
                    rows.append(Ranked(dims, smallest, False, f"does not fit: {worst.total / GIB:,.1f} GiB{where}"
                                       f" > {usable / GIB:,.1f} GiB usable, with {smallest.candidate.checkpoint}"
                                       f" recomputation{' and offload' if smallest.candidate.offload else ''}"))  # fmt: skip
    fitting = sorted((r for r in rows if r.fits), key=lambda r: r.step_seconds)
    too_big = sorted((r for r in rows if not r.fits and r.evaluated is not None), key=lambda r: r.evaluated.worst.total)
    invalid = [r for r in rows if r.evaluated is None]
    if fitting:
        top = fitting[0].evaluated
        fitting = [fitting[0]] + [Ranked(r.dims, r.evaluated, True, why_slower(r.evaluated, top)) for r in fitting[1:]]
    return fitting + too_big + invalid


def why_slower(e: Evaluated, best: Evaluated) -> str:
    """One line: the term that most separates `e`'s step time from the best's."""
    mine, theirs = e.time.terms(), best.time.terms()
    term = max(mine, key=lambda k: mine[k] - theirs[k])
    total = e.time.total
    slower = total / best.time.total - 1
    c = e.candidate
    if term == "compute" and c.pp > 1:
        more = mine[term] / theirs[term] - 1
        what = f"pp={c.pp}: the busiest pipeline rank computes {more:.0%} more than the best layout's ranks"
    elif term == "bubble":
        what = f"pp={c.pp}: bubble {e.time.bubble_share:.0%} of the step ({c.schedule}, m={c.microbatches}, v={c.v})"
    elif term == "recompute":
        what = f"{c.checkpoint} recomputation {mine[term] / total:.0%} of the step (needed to fit)"
    elif term == "offload":
        what = f"CPU offload: optimizer step on the host {mine[term] / total:.0%} of the step (needed to fit)"
    else:
        what = f"{TERM_WORDS[term]} {mine[term] / total:.0%} of the step"
        dim = {"tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp", "fsdp": "fsdp"}.get(term)
        if dim and dim in e.time.crossing:
            size = {"tp": c.tp, "cp": c.cp * c.tp, "ep": c.ep * c.cp * c.tp, "pp": c.pp, "fsdp": c.fsdp_shard * c.tp}[
                dim
            ]
            label = {"cp": "cp x tp", "ep": "ep x cp x tp", "fsdp": "dp_shard x cp x tp"}.get(dim, dim)
            what = f"{label}={size} crosses nodes: {what}"
    if slower < 0.005:
        return f"as fast as the best within 0.5%; its largest extra term: {what}"
    return f"{slower:+.0%} slower: {what}"


def _refusal(w, tp, pp, cp, shard, dp_replicate, ep, schedule, stages_per_rank, tp_refusal) -> str:
    args = w.args
    if tp > 1 and (why := tp_refusal(tp)):
        return why
    if w.sequence_parallel and tp > 1 and (w.seq_len // cp) % tp:
        return f"sequence parallel needs seq_len / cp = {w.seq_len // cp} divisible by tp = {tp}"
    if cp > 1 and w.seq_len % (2 * cp):
        return f"cp={cp}: seq_len {w.seq_len} must divide by 2 x cp for the causal load balance"
    if ep > 1 and shard % ep:
        return f"ep={ep} must divide dp_shard={shard}"
    if pp > 1:
        from liandan.plan.pipeline import virtual_stages

        stages = pp * virtual_stages(schedule, stages_per_rank)
        if args.n_layers < stages:
            return f"pp={pp}: {args.n_layers} layers cannot fill {stages} stages"
        if w.pp_layers and len(w.pp_layers) != stages:
            return f"pp={pp}: parallel.pp_layers gives {len(w.pp_layers)} stages, not {stages}"
    return ""


def _batches(w, pp, dp, pp_microbatches, micro_batch, schedule="1f1b") -> list[tuple[int, int]] | str:
    """The (micro-batches per step, sequences per micro-batch) of a data-parallel rank to try, or why none:
    the config's micro-batch where it sets one (train.micro_batch, or parallel.pp_microbatches under PP), else
    every power of two that divides the rank's batch (under PP, leaving at least pp micro-batches)."""
    if w.global_batch % dp:
        return f"global batch {w.global_batch} does not split over {dp} data-parallel ranks"
    per_rank = w.global_batch // dp
    if pp > 1 and pp_microbatches:
        if per_rank % pp_microbatches:
            return f"pp={pp}: {per_rank} sequences per rank do not split into {pp_microbatches} micro-batches"
        sizes = [per_rank // pp_microbatches]
    elif micro_batch:
        if per_rank % micro_batch:
            return f"{per_rank} sequences per rank do not split into micro-batches of {micro_batch}"
        sizes = [micro_batch]
    else:
        sizes = [b for b in _powers(per_rank) if per_rank % b == 0]
    out = [(per_rank // b, b) for b in sizes if pp == 1 or per_rank // b >= pp]
    if pp > 1 and schedule in ("interleaved-1f1b", "interleaved-zb"):
        # torch.distributed.pipelining runs these in rounds of pp micro-batches: m must split into whole rounds
        rounds = [(m, b) for m, b in out if m % max(1, m // pp) == 0]
        if out and not rounds:
            m = out[0][0]
            return f"pp={pp}: {schedule} runs its micro-batches in rounds: {m} do not split into {m // pp} rounds"
        out = rounds
    if not out:
        return f"pp={pp}: {per_rank // sizes[-1]} micro-batches per step, fewer than the {pp} stages (the pipeline never fills)"
    return out
