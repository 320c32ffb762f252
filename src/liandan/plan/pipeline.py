"""Pipeline parallelism for the planner: the bubble of each schedule, the micro-batches whose activations a
pipeline rank keeps alive, which virtual stages a rank runs, and how the decoder layers split into stages.

Bubble shares (idle time over the whole step) for p pipeline ranks, m micro-batches, v virtual stages per rank:

- gpipe, 1f1b: (p - 1) / (m + p - 1) (GPipe, Huang et al. 2019; PipeDream-Flush / 1F1B, Narayanan et al. 2021).
- interleaved-1f1b, looped-bfs: the idle time shrinks by v (Narayanan et al. 2021, section 2.2: the bubble time
  fraction (p - 1) / (v·m) of the ideal time; looped BFS, Lamy-Poirier 2023, has the same bubble): as a share
  of the step, (p - 1) / (v·m + p - 1).
- interleaved-zb, zbv, dualpipev: the backward pass split into its input and weight gradients fills the
  bubble with weight-gradient work. With a forward F, an input-gradient pass B and a weight-gradient pass W of
  equal time (the zero-bubble paper's assumption, Qi et al. 2023, "Zero Bubble Pipeline Parallelism",
  section 3), 1F1B idles (p - 1)(F + B + W) and ZB-H1 (p - 1)(F + B - W): a third of 1F1B's bubble at the
  same activation memory. DeepSeek-V3's report (Table 2) gives DualPipe's bubble as (p/2 - 1)(F&B + B - 3W),
  which with its overlapped F&B ~ F + B is again about a third. The planner takes a third of the
  interleaved bubble for interleaved-zb, zbv and dualpipev (v = 2 for the last two): the analytical figure at
  F = B = W, unmeasured here; the V schedules' near-zero bubbles of ZB-V (Qi et al. 2024,
  "Pipeline Parallelism with Controllable Memory") need T_F = T_B = T_W exactly and are not assumed.

Activations in flight on a rank, in micro-batches of that rank's whole set of layers:

- gpipe and looped-bfs run every forward before any backward: all m.
- 1f1b: rank r keeps min(m, p - r): p on the first rank.
- interleaved-1f1b and interleaved-zb: Megatron's warm-up of (p - r - 1)·2 + (v - 1)·p + 1 chunk
  micro-batches, a chunk being 1/v of the rank's layers: on the first rank p·(1 + (p - 1)/(p·v)), Korthikanti
  et al. 2022's factor (section 4.2.3).
- zbv: ZB-V keeps 1F1B's peak, p, on every rank (Qi et al. 2024); dualpipev p + 1 (DeepSeek-V3, Table 2).
"""

from __future__ import annotations

from liandan.config import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")
SINGLE_STAGE = ("gpipe", "1f1b")
V_SHAPED = ("zbv", "dualpipev")
ZERO_BUBBLE = ("interleaved-zb", "zbv", "dualpipev")
ZERO_BUBBLE_FACTOR = 1 / 3  # ZB-H1's (F + B - W) over 1F1B's (F + B + W), with F = B = W


def virtual_stages(schedule: str, stages_per_rank: int) -> int:
    """Stages each rank runs: one for gpipe and 1f1b, two for the V schedules, `stages_per_rank` otherwise."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline schedule '{schedule}' is not one of {', '.join(SCHEDULES)}")
    if schedule in SINGLE_STAGE:
        return 1
    if schedule in V_SHAPED:
        return 2
    return stages_per_rank


def bubble_share(schedule: str, pp: int, microbatches: int, v: int = 1) -> float:
    """Share of the step the average pipeline rank is idle (module docstring)."""
    if pp <= 1:
        return 0.0
    v = virtual_stages(schedule, v)
    idle = (pp - 1) / v  # in units of one micro-batch's time on one rank
    if schedule in ZERO_BUBBLE:
        idle *= ZERO_BUBBLE_FACTOR
    return idle / (microbatches + idle)


def in_flight(schedule: str, pp: int, microbatches: int, rank: int, v: int = 1) -> float:
    """Micro-batches of its layers' activations rank `rank` keeps alive at its peak (module docstring)."""
    m = microbatches
    if pp <= 1:
        return 1.0
    v = virtual_stages(schedule, v)
    if schedule in ("gpipe", "looped-bfs"):
        return float(m)
    if schedule == "1f1b":
        return float(min(m, pp - rank))
    if schedule == "zbv":
        return float(min(m, pp))
    if schedule == "dualpipev":
        return float(min(m, pp + 1))
    return min(float(m), ((pp - rank - 1) * 2 + (v - 1) * pp + 1) / v)


def rank_stages(schedule: str, pp: int, v: int = 1) -> list[list[int]]:
    """The stages (0 = the embedding's, pp·v - 1 = the head's) each rank runs: looped (r, r + p, ...) for the
    interleaved schedules, a V (r and 2p - 1 - r) for zbv and dualpipev, so that the first rank holds the
    embedding and the head."""
    v = virtual_stages(schedule, v)
    if schedule in V_SHAPED:
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    return [[r + i * pp for i in range(v)] for r in range(pp)]


def split_layers(n_layers: int, stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Decoder layers per stage, balanced so the busiest stage is as light as it can be when the first stage
    also carries `first_extra` layers' worth (the embedding) and the last `last_extra` (the norm, head and
    loss). Every stage gets at least one layer."""
    if stages < 1 or n_layers < stages:
        raise ConfigError(f"{n_layers} layers cannot fill {stages} pipeline stages with at least one layer each")
    extra = [0.0] * stages
    extra[0] += first_extra
    extra[-1] += last_extra
    lo, hi = 0.0, n_layers + max(extra)
    for _ in range(60):  # the smallest stage load that holds every layer
        cap = (lo + hi) / 2
        if sum(max(1, int(cap - e + 1e-9)) for e in extra) >= n_layers:
            hi = cap
        else:
            lo = cap
    counts = [max(1, int(hi - e + 1e-9)) for e in extra]
    excess = sum(counts) - n_layers
    while excess > 0:  # take the surplus from the stages with the most layers, middle stages first
        i = max(range(stages), key=lambda k: (counts[k], 0 < k < stages - 1, -abs(k - stages / 2)))
        counts[i] -= 1
        excess -= 1
    return counts
