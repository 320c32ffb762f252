"""`liandan plan CONFIG`: parameters, FLOPs, memory per device, the smallest layout that fits, time and cost."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from liandan.config import ConfigError, load_config


def add_commands(sub) -> None:
    """Register this module's subcommands on the `liandan` subparsers object."""
    p = sub.add_parser(
        "plan",
        description="Plan a run from its config alone: no data, no weights, no devices. Numbers are estimates;"
        " docs/planning.md says how they are made and how far they were off on measured runs.",
    )
    p.add_argument("config", help="run config (TOML), e.g. configs/llama-8b.toml")
    p.add_argument(
        "--nproc",
        default=None,
        help="devices (processes) to plan for; default: the fewest the config's [parallel] admits",
    )
    p.add_argument(
        "--device", default="h100", help="accelerator: h100, h200, a100, a100-40gb, b200, mi300x, ... (default h100)"
    )
    p.add_argument("--device-memory-gib", default=None, help="memory per device in GiB, instead of the device table's")
    p.add_argument(
        "--headroom",
        default="0.1",
        help="share of device memory kept free for the CUDA context, NCCL and fragmentation (default 0.1)",
    )
    p.add_argument(
        "--ep-imbalance",
        default="1.25",
        help="under parallel.ep, the rows the busiest rank receives over the mean (default 1.25)",
    )
    p.add_argument("--gpus-per-node", default="8",
                   help="devices per node: groups within a node use NVLink, across nodes the network (default 8)")  # fmt: skip
    p.add_argument("--compute-efficiency", default="0.6",
                   help="share of the peak the matmuls reach when nothing waits, for ranking layouts (default 0.6)")  # fmt: skip
    p.add_argument(
        "--max-cp", default="8", help="largest context-parallel degree the ranking tries (default 8; 1: none)"
    )
    p.add_argument("--top", default="15", help="layouts that fit to list, best first (default 15; 0: all)")
    p.add_argument("--mfu", default="0.4", help="assumed model FLOPs utilisation for the time estimate (default 0.4)")
    p.add_argument("--price-per-device-hour", default=None, help="price of one device-hour, for a cost estimate")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(command=cmd_plan)


def _number(flag: str, text: str | None, kind: type = float):
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(f"{flag} = {text!r} must be {what}") from None
    if not math.isfinite(value):  # nan passes every range check after this, inf most
        raise ConfigError(f"{flag} = {text!r} must be a finite number")
    return value


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    nproc = _number("--nproc", args.nproc, int)
    memory_gib = _number("--device-memory-gib", args.device_memory_gib)
    headroom = _number("--headroom", args.headroom)
    mfu = _number("--mfu", args.mfu)
    ep_imbalance = _number("--ep-imbalance", args.ep_imbalance)
    if ep_imbalance < 1:
        raise ConfigError(f"--ep-imbalance = {ep_imbalance:g} must be at least 1")
    price = _number("--price-per-device-hour", args.price_per_device_hour)
    gpus_per_node = _number("--gpus-per-node", args.gpus_per_node, int)
    efficiency = _number("--compute-efficiency", args.compute_efficiency)
    top = _number("--top", args.top, int)
    max_cp = _number("--max-cp", args.max_cp, int)
    if gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node = {gpus_per_node} must be at least 1")
    if top < 0:
        raise ConfigError(f"--top = {top} must not be negative")
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc = {nproc} must be at least 1")
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu = {mfu:g} must be in (0, 1]")
    if price is not None and price < 0:
        raise ConfigError(f"--price-per-device-hour = {price:g} must not be negative")

    from liandan.plan.devices import resolve_device
    from liandan.plan.run_plan import plan_config

    device = resolve_device(args.device, memory_gib)
    cfg = load_config(args.config, overrides)
    plan = plan_config(cfg, device, nproc=nproc, mfu=mfu, price_per_device_hour=price, headroom=headroom,
                       ep_imbalance=ep_imbalance, gpus_per_node=gpus_per_node, compute_efficiency=efficiency,
                       max_cp=max_cp)  # fmt: skip
    if args.json:
        print(json.dumps(_jsonable(plan), indent=2))
    else:
        print_plan(plan, cfg, args.config)
        print_layouts(plan, cfg, top)
    return 0


def _jsonable(plan) -> dict:
    out = dataclasses.asdict(plan)
    m = plan.memory
    out["memory"]["total"] = m.total
    out["memory"]["activations"]["total"] = m.activations.total
    out["memory"]["states"]["total"] = m.states.total
    out["memory"]["layout"]["kind"] = m.layout.kind
    if plan.smallest is not None:
        out["smallest"]["estimate"]["total"] = plan.smallest.estimate.total
    if plan.optimizer is None:
        del out["optimizer"]  # AdamW's plan stays as it was
    if plan.staged is not None:
        out["staged"]["worst"] = dataclasses.asdict(plan.staged.worst)
        out["staged"]["worst"]["total"] = plan.staged.worst.total
        out["staged"]["time"]["total"] = plan.staged.time.total
    for row, ranked in zip(out["ranking"], plan.ranking, strict=True):
        row["step_seconds"] = ranked.step_seconds if ranked.evaluated is not None else None
        if ranked.evaluated is not None:
            row["memory_bytes"] = ranked.evaluated.worst.total
            row["overrides"] = ranked.evaluated.candidate.overrides()
    _drop_unit_dims(out)
    return out


def _drop_unit_dims(value) -> None:
    """Leave out the layouts' pp and ep while they are 1 (always, for now): the JSON stays as it was."""
    if isinstance(value, dict):
        if {"dp_replicate", "dp_shard", "tp"} <= value.keys() and "cp" not in value:
            for dim in ("pp", "ep"):
                if value.get(dim) == 1:
                    del value[dim]
        for item in value.values():
            _drop_unit_dims(item)


# ---------------------------------------------------------------------------------------------------------
# printing


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale or unit == "KiB":
            return f"{n / scale:,.2f} {unit}"
    return f"{n:.0f} B"  # pragma: no cover


def _count(n: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def _duration(seconds: float) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:,.1f} hours"
    if seconds >= 120:
        return f"{seconds / 60:,.1f} minutes"
    return f"{seconds:,.1f} seconds"


def _seconds(seconds: float) -> str:
    return f"{seconds:,.2f} s" if seconds >= 1 else f"{seconds:.3g} s"


def _ac_word(mode: str) -> str:
    return {"none": "no recomputation", "selective": "selective recomputation", "full": "full recomputation"}[mode]


def print_plan(plan, cfg, config_path: str) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from liandan.plan.memory import ADAMW_STATE_BYTES_PER_PARAM, GIB, usable_bytes, zero_bytes_per_param

    console = Console(width=None if sys.stdout.isatty() else 110, highlight=False)
    m, a, p, d, t = plan.memory, plan.model, plan.params, plan.device, cfg.train
    usable = usable_bytes(d.memory_gib, plan.headroom)

    console.print(
        f"[bold]plan[/bold] {config_path}: {plan.nproc} x {d.name} ({d.memory_gib:g} GiB,"
        f" dense bf16 peak {d.peak_tflops_bf16:g} TFLOP/s)"
    )

    console.print("\n[bold]Model and FLOPs[/bold]")
    table = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
    table.add_column("")
    table.add_column("", justify="right")
    table.add_column("")
    table.add_row("parameters", f"{p.total:,}", _count(p.total))
    table.add_row(
        "  embedding", f"{p.embedding:,}", _count(p.embedding) + (" (tied with the head)" if a.tie_embeddings else "")
    )
    table.add_row("  non-embedding", f"{p.non_embedding:,}", _count(p.non_embedding))
    if p.sparse:
        experts = f"top-{a.moe_top_k} of {a.moe_experts} routed experts"
        table.add_row("  active per token", f"{p.active:,}", f"{_count(p.active)} ({experts}; the FLOPs count these)")
    f = plan.flops
    attn = 12.0 * a.n_layers * a.n_heads * a.head_dim * t.seq_len
    table.add_row(
        "FLOPs per token", f"{f.per_token:.3e}", f"PaLM 6N + 12·L·H·Q·T = {f.per_token - attn:.3e} + {attn:.3e}"
    )
    table.add_row("tokens", f"{f.tokens:.3e}", f"{t.steps:,} steps x {t.global_batch:,} sequences x {t.seq_len:,}")
    table.add_row("FLOPs for the run", f"{f.total:.3e}", f"6ND alone: {f.six_nd:.3e}")
    o = plan.optimizer
    if o is not None and o.step_flops:
        table.add_row(
            f"{o.name} step FLOPs", f"{o.step_flops:.3e}",
            f"per step, {o.step_share:.2%} of the model's (Newton-Schulz; in the time estimate)",
        )  # fmt: skip
    console.print(table)

    title = (
        f"Memory per device: {m.layout}, micro-batch {m.micro_batch} x {m.seq_len} tokens, {m.dtype},"
        f" {_ac_word(m.activation_checkpoint)}"
    )
    console.print(f"\n[bold]{title}[/bold]")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("part")
    table.add_column("size", justify="right")
    table.add_column("how")
    shard = {"fsdp": f"sharded over dp_shard={m.layout.dp_shard}", "ddp": "replicated", "single": "whole"}[m.sharding]
    tp_note = f", /tp={m.layout.tp}" if m.layout.tp > 1 else ""
    # Expert weights and their optimizer state count in full: without expert parallelism each rank keeps every
    # expert (or its FSDP share); the activations count the active experts only.
    experts = ", every expert" if p.sparse else ""
    table.add_row(
        "parameters", _size(m.states.params),
        f"fp32, {_count(m.params_per_device)} per device ({shard}{tp_note}{experts})",
    )  # fmt: skip
    table.add_row("gradients", _size(m.states.grads), "fp32")
    k = m.optimizer_state_bytes_per_param
    optimizer_how = "fp32 Adam m and v" if k == ADAMW_STATE_BYTES_PER_PARAM else f"{k:g} bytes per parameter"
    if o is not None and len(set(o.state_bytes_by_role.values())) > 1:
        by_bytes: dict[float, list[str]] = {}
        for role, n in o.params_by_role.items():
            by_bytes.setdefault(o.state_bytes_by_role[role], []).append(f"{role} {_count(n)}")
        shares = "; ".join(f"{b:g} B per parameter of {', '.join(roles)}" for b, roles in sorted(by_bytes.items()))
        optimizer_how = f"{o.name}: {shares} ({k:.3g} B on average)"
    table.add_row("optimizer", _size(m.states.optimizer), optimizer_how)
    table.add_row("transient", _size(m.transient), m.transient_what)
    if (e := m.expert_parallel) is not None:
        table.add_row(
            "all-to-all buffers",
            _size(e.buffers),
            f"one MoE layer's dispatched rows, sent + received (x{e.imbalance:g} on the busiest rank)",
        )
        table.add_row(
            "expert imbalance",
            _size(e.imbalance_headroom),
            f"the busiest rank's expert activations above the mean (x{e.imbalance:g}; --ep-imbalance)",
        )
        table.add_row(
            "all-to-all traffic",
            _size(e.all_to_all_bytes_per_step),
            f"sent per device per step (dispatch and combine, forward and backward, ep={m.layout.ep})",
        )
    acts = m.activations
    table.add_row(
        "activations",
        _size(acts.layers),
        f"{a.n_layers} layers x {_size(acts.per_layer)} ({acts.formula}, {m.attention} attention)",
    )
    if acts.recompute:
        table.add_row("recomputed layer", _size(acts.recompute), "one block rebuilt at a time in backward")
    if acts.masks:
        table.add_row("attention masks", _size(acts.masks), "dense (b, 1, s, s) document masks kept by SDPA")
    split = []
    if m.layout.tp > 1 and cfg.parallel.loss_parallel:
        split.append(f"/tp={m.layout.tp}, vocabulary-parallel loss")
    if cfg.train.ce_chunks > 1:
        split.append(f"/{cfg.train.ce_chunks} chunks")
    table.add_row(
        "head and loss",
        _size(acts.head),
        f"fp32 logits, log-softmax, gradient ({20 if a.z_loss else 12} B per logit{''.join(', ' + w for w in split)})",
    )
    verdict = "fits" if plan.fits else "[bold red]does NOT fit[/bold red]"
    table.add_row(
        "[bold]total[/bold]", f"[bold]{_size(m.total)}[/bold]",
        f"{verdict} in {usable / GIB:,.1f} of {d.memory_gib:g} GiB ({plan.headroom:.0%} headroom)",
    )  # fmt: skip
    console.print(table)
    if plan.init is not None:
        i = plan.init
        how = "train.meta_init" if i.meta else "built whole (train.meta_init = false)"
        tight = " [bold red]does NOT fit[/bold red]" if i.device > usable else ""
        console.print(f"initialisation: {_size(i.device)} per device, {_size(i.host)} host ({i.what}; {how}){tight}")

    zero_bytes = " + ".join(f"{b:g}" for b in zero_bytes_per_param(m.dtype, k))
    title = (
        f"ZeRO paper accounting: Ψ = {_count(m.params_per_rank)} parameters per tensor-parallel rank,"
        f" Nd = {m.layout.dp_size}, {zero_bytes} bytes per parameter"
    )
    console.print(f"\n[bold]{title}[/bold]")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("stage", "shards", "parameters", "gradients", "optimizer", "total"):
        table.add_column(col, justify="left" if col in ("stage", "shards") else "right")
    for z in m.zero:
        s = z.states
        table.add_row(z.name, z.sharded, _size(s.params), _size(s.grads), _size(s.optimizer), _size(s.total))
    s = m.states
    table.add_row(
        f"liandan ({m.sharding})", "fp32 states" + (", all sharded" if m.sharding == "fsdp" else ""),
        _size(s.params), _size(s.grads), _size(s.optimizer), _size(s.total), style="bold",
    )  # fmt: skip
    console.print(table)

    title = (
        f"Activations per layer, Korthikanti et al. 2022's GPT-3 block (paper) and liandan's as planned:"
        f" s={t.seq_len}, b={m.micro_batch}, h={a.dim}, a={a.n_heads}, t={m.layout.tp}, {m.dtype}"
    )
    console.print(f"\n[bold]{title}[/bold]")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("recomputation", "parallel", "paper's formula", "paper", f"liandan, {m.attention} attention", ""):
        text = ("recomputation", "parallel", "paper's formula", "")
        table.add_column(col, justify="left" if col in text else "right")
    for v in plan.variants:
        table.add_row(
            v.checkpoint,
            v.parallel,
            v.formula,
            _size(v.paper_bytes),
            _size(v.kernel_bytes),
            "<- this run" if v.used else "",
        )
    console.print(table)

    fit = plan.smallest
    if fit is None:
        console.print(
            f"\n[bold red]No layout fits[/bold red] {d.name} ({usable / GIB:,.1f} GiB usable) at this micro-batch."
        )
    else:
        console.print(
            f"\n[bold]Smallest layout that fits[/bold] {d.name} ({usable / GIB:,.1f} GiB usable):"
            f" --nproc {fit.nproc}, {fit.layout}, {_ac_word(fit.activation_checkpoint)},"
            f" micro-batch {fit.micro_batch}: {_size(fit.estimate.total)} per device"
        )

    r = plan.time
    peak = r.peak_flops_per_device / 1e12
    precision = m.dtype
    if plan.fp8 is not None and plan.fp8.params:
        share = 6 * plan.fp8.params / f.per_token
        precision += f"; fp8 {plan.fp8.recipe} in {plan.fp8.layers} linears, {share:.0%} of the FLOPs"
    title = f"Time and cost: {r.nproc} x {d.name} at MFU {r.mfu:.2f} of {peak:g} TFLOP/s ({precision})"
    console.print(f"\n[bold]{title}[/bold]")
    table = Table(box=box.SIMPLE, show_header=False, pad_edge=False)
    table.add_column("")
    table.add_column("", justify="right")
    table.add_row("tokens per second", f"{f.tokens / r.seconds:,.0f}")
    table.add_row("wall clock", _duration(r.seconds))
    table.add_row("device-hours", f"{r.device_hours:,.0f}" if r.device_hours >= 100 else f"{r.device_hours:.3g}")
    if r.cost is not None:
        table.add_row(
            "cost", f"{r.cost:,.0f} (at {r.cost / r.device_hours if r.device_hours else 0:g} per device-hour)"
        )
    console.print(table)


def print_layouts(plan, cfg, top: int = 15) -> None:
    """The config's layout per pipeline rank (when it uses PP, CP or offload), then every layout of the run's
    devices: those that fit ranked by predicted step time, the others each with why not."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from liandan.plan.memory import GIB, usable_bytes

    console = Console(width=None if sys.stdout.isatty() else 140, highlight=False)
    usable = usable_bytes(plan.device.memory_gib, plan.headroom)
    if (e := plan.staged) is not None:
        c = e.candidate
        where = (
            f"pipeline rank: {c}[/bold] (stage layers {list(e.stage_layers)})" if c.pp > 1 else f"device: {c}[/bold]"
        )
        console.print(f"\n[bold]Memory per {where}")
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for col in ("rank", "layers", "holds", "states", "gathered", "activations", "in flight", "buffers", "total"):
            table.add_column(col, justify="left" if col in ("rank", "holds") else "right")
        for r in e.ranks:
            holds = ", ".join(w for w, h in (("embedding", r.embedding), ("head", r.head)) if h) or "-"
            states = _size(r.params + r.grads + r.optimizer) + (f" (host {_size(r.host)})" if r.host else "")
            worst = r is e.worst
            table.add_row(
                str(r.rank), str(r.layers), holds, states, _size(r.transient), _size(r.activations),
                f"{r.in_flight:g}", _size(r.buffers), _size(r.total) + (" <- worst" if worst else ""),
            )  # fmt: skip
        console.print(table)
        t = e.time
        verdict = "fits" if e.worst.total <= usable else "[bold red]does NOT fit[/bold red]"
        console.print(
            f"worst rank {e.worst.rank}: {_size(e.worst.total)}, {verdict} in {usable / GIB:,.1f} GiB;"
            f" bubble {t.bubble_share:.1%} of the step; predicted step {_seconds(t.total)}"
        )
    rows = plan.ranking
    if not rows:
        return
    fitting = [r for r in rows if r.fits]
    shown = fitting if top == 0 else fitting[:top]
    net = f"{plan.gpus_per_node} GPUs per node"
    console.print(
        f"\n[bold]Layouts on {plan.nproc} x {plan.device.name} ({net}), ranked by predicted step time[/bold]"
        f" ({len(fitting)} of {len(rows)} fit; docs/planning.md says how step times are predicted)"
    )
    if not fitting:
        console.print("[bold red]No layout fits[/bold red] at this global batch.")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("#", "layout", "micro-batches", "recompute", "step", "MFU", "memory", "why not first"):
        table.add_column(col, justify="right" if col in ("#", "step", "MFU", "memory") else "left")
    model_flops = plan.flops.per_token * cfg.train.global_batch * cfg.train.seq_len
    peak = plan.time.peak_flops_per_device
    for i, r in enumerate(shown, 1):
        e = r.evaluated
        c = e.candidate
        pipe = f"{c.microbatches} x {c.micro_batch}" + (f", {c.schedule} v={c.v}" if c.pp > 1 else "")
        ac = c.checkpoint + (" + offload" if c.offload else "")
        mfu = model_flops / (plan.nproc * peak * e.time.total)
        table.add_row(str(i), r.dims, pipe, ac, _seconds(e.time.total), f"{mfu:.0%}", _size(e.worst.total),
                      r.reason or "best")  # fmt: skip
    console.print(table)
    if len(shown) < len(fitting):
        console.print(f"({len(fitting) - len(shown)} more fit, slower; --top 0 lists them)")
    others = [r for r in rows if not r.fits]
    if others:
        console.print("[bold]Layouts that do not fit or cannot run[/bold]")
        for r in others:
            console.print(f"  {r.dims}: {r.reason}")
