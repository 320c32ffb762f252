"""Hyperparameters that transfer across width (`[model] parameterization = "mup"`): a config's model at other
widths, and the coordinate check of `liandan check-transfer`.

A model is widened by heads of a fixed size (n_heads = width / head_dim, the grouping of key/value heads
kept): attention's 1/sqrt(head_dim) then needs no change with the width, and under muP every hidden matrix's
fan-in grows as the width does (its width multiplier is width / mup_base_dim).

The coordinate check trains the model a few steps at each width, from the same seed and on the same batches,
and measures on one fixed probe batch, before each step, the mean absolute value of each layer's output
(the embedding, every block, the logits) and how much that output moved in the step before. In a
parameterization whose hyperparameters transfer both stay flat as the width grows; under the standard one with
Adam the updates of the blocks and the logits grow with the width (Tensor Programs V, Yang et al. 2022, fig. 5).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from liandan.config import Config, ConfigError

# A slope of log(size) against log(width) beyond this is growth (or shrinkage): under the standard
# parameterization the updates grow about as the width (slope near 1), under muP they stay within noise.
FLAT_SLOPE = 0.25


def parse_widths(text: str) -> list[int]:
    """'64,128,256' -> [64, 128, 256]: at least two distinct positive widths, ascending."""
    try:
        widths = sorted({int(w) for w in text.split(",") if w.strip()})
    except ValueError:
        raise ConfigError(f"--widths = {text!r} must be comma-separated whole numbers, e.g. 64,128,256") from None
    if len(widths) < 2 or widths[0] < 1:
        raise ConfigError(f"--widths = {text!r} needs at least two different positive widths, e.g. 64,128,256")
    return widths


def widened(args: Any, width: int) -> Any:
    """The Llama args `args` at `width`: the same depth, heads of the same size (more of them), the same
    grouping of key/value heads, the feed-forward size derived again unless `args` scaled it by hand; under
    muP the same base width (so the width multiplier is width / mup_base_dim)."""
    head_dim = args.head_dim
    group = args.n_heads // args.n_kv_heads
    if width % (head_dim * group):
        raise ConfigError(
            f"width {width} is not a whole number of {group} query head(s) of {head_dim} per key/value head; "
            f"use multiples of {head_dim * group}"
        )
    n_heads = width // head_dim
    derived_ffn = dataclasses.replace(args, ffn_dim=0).ffn_dim
    ffn_dim = 0 if args.ffn_dim == derived_ffn else round(args.ffn_dim * width / args.dim)
    return dataclasses.replace(
        args, dim=width, n_heads=n_heads, n_kv_heads=n_heads // group, head_dim=head_dim, ffn_dim=ffn_dim
    )


def check_args(cfg: Config, vocab_size: int) -> Any:
    """The config's Llama args (the coordinate check widens Llama's blocks) for a tokenizer of `vocab_size`."""
    from liandan.model.spec import model_args

    if cfg.model.family != "llama":
        raise ConfigError(f"check-transfer widens Llama models; model.family = {cfg.model.family!r}")
    return model_args(cfg.model, vocab_size)


def open_data(cfg: Config, work_dir: Path, say: Callable[[str], None]) -> Any:
    """A loader over the config's data: its token stores, or its `[data]` documents tokenized into `work_dir`
    (with no paths, the Python documentation liandan ships)."""
    from liandan.data.pipeline.prepare import open_stores, prepare_store
    from liandan.data.tokens.loader import PackedLoader

    if cfg.data.stores:
        stores, _ = open_stores(cfg.data.stores, cfg.data.cache_dir, say)
    else:
        stores = [prepare_store(cfg.data, work_dir, say)[0]]
    t = cfg.train
    return PackedLoader(stores, t.seq_len, t.global_batch, cfg.run.seed, 0.0, 0, 1, weights=cfg.data.weights or None)


@dataclass
class WidthTrace:
    """One width's measurements: per layer, the mean |output| on the probe batch before each step (steps + 1
    values, the first at initialisation) and the mean |change| of that output over each step (steps values)."""

    width: int
    activation: dict[str, list[float]] = field(default_factory=dict)
    update: dict[str, list[float]] = field(default_factory=dict)
    loss: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Verdict:
    layer: str
    what: str  # "activation" or "update"
    sizes: tuple[float, ...]  # one per width
    slope: float  # of log(size) against log(width)

    @property
    def trend(self) -> str:
        if not math.isfinite(self.slope):
            return "diverged"
        if self.slope > FLAT_SLOPE:
            return "grows"
        return "shrinks" if self.slope < -FLAT_SLOPE else "flat"


def _layer_names(model: Any) -> list[str]:
    return ["embedding", *(f"block {i}" for i in model.layers), "logits"]


def _capture(model: Any, into: dict[str, Any]) -> list:
    """Forward hooks that keep each layer's output (detached, fp32) in `into`."""

    def keep(name: str):
        def hook(module, inputs, output):
            into[name] = output.detach().float()

        return hook

    modules = [model.tok_embeddings, *model.layers.values(), model.output]
    return [m.register_forward_hook(keep(n)) for n, m in zip(_layer_names(model), modules, strict=True)]


def trace_width(args: Any, cfg: Config, batches: Sequence[Any], probe: Any, seed: int) -> WidthTrace:
    """Train a model of `args` on `batches` (one step each) with the config's optimizer at a constant learning
    rate (no clipping: the check looks at the raw updates), measuring on `probe` before every step."""
    import torch

    from liandan.model.llama import Transformer
    from liandan.train.optimizers import build_optimizers

    torch.manual_seed(seed)
    model = Transformer(args)
    optimizers = build_optimizers([model], cfg.optim, lambda step: 1.0, torch.device("cpu"))
    trace = WidthTrace(args.dim)
    outputs: dict[str, torch.Tensor] = {}
    hooks = _capture(model, outputs)
    previous: dict[str, torch.Tensor] = {}
    try:
        for step in range(len(batches) + 1):
            with torch.no_grad():
                model(probe.inputs)
            for name, out in outputs.items():
                trace.activation.setdefault(name, []).append(out.abs().mean().item())
                if name in previous:
                    trace.update.setdefault(name, []).append((out - previous[name]).abs().mean().item())
            previous = dict(outputs)
            if step == len(batches):
                break
            batch = batches[step]
            loss = model(batch.inputs, batch.targets)
            loss.backward()
            optimizers.step()
            trace.loss.append(loss.item())
    finally:
        for hook in hooks:
            hook.remove()
    return trace


def _slope(widths: Sequence[int], sizes: Sequence[float]) -> float:
    if any(not math.isfinite(s) or s <= 0 for s in sizes):
        return math.nan
    xs, ys = [math.log(w) for w in widths], [math.log(s) for s in sizes]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def verdicts(traces: Sequence[WidthTrace]) -> list[Verdict]:
    """Per layer: the activation after the last step and the mean update per step, across the widths."""
    widths = [t.width for t in traces]
    out = []
    for layer in traces[0].activation:
        for what in ("activation", "update"):
            if what == "activation":
                sizes = tuple(t.activation[layer][-1] for t in traces)
            else:
                sizes = tuple(sum(t.update[layer]) / max(1, len(t.update[layer])) for t in traces)
            out.append(Verdict(layer, what, sizes, _slope(widths, sizes)))
    return out


def coordinate_check(cfg: Config, widths: Sequence[int], steps: int, work_dir: Path,
                     say: Callable[[str], None] = print) -> tuple[Any, list[WidthTrace]]:  # fmt: skip
    """(the config's args at the first width, one trace per width), every width trained from `cfg.run.seed` on
    the same `steps` batches of the config's data."""
    import torch

    for width in widths:  # refused before any data is read
        widened(check_args(cfg, 256), width)
    loader = open_data(cfg, work_dir, say)
    base = check_args(cfg, loader.stores[0].tokenizer.vocab_size)
    micro = cfg.train.global_batch

    def batch() -> Any:
        return loader.next_step(micro)[0]

    probe = batch()
    batches = [batch() for _ in range(steps)]
    traces = []
    threads = torch.get_num_threads()
    for width in widths:
        args = widened(base, width)
        say(f"width {width}: {args.n_heads} heads of {args.head_dim}, ffn {args.ffn_dim}, {threads} thread(s)")
        traces.append(trace_width(args, cfg, batches, probe, cfg.run.seed))
    return widened(base, widths[0]), traces


def table(traces: Sequence[WidthTrace], found: Sequence[Verdict]) -> list[str]:
    """The lines `check-transfer` prints: per layer and measure, the size at each width, the slope, the trend."""
    head = f"{'layer':<12} {'measure':<10} " + " ".join(f"{'w=' + str(t.width):>10}" for t in traces)
    lines = [head + f" {'slope':>7}  trend"]
    for v in found:
        sizes = " ".join(f"{s:>10.4g}" for s in v.sizes)
        lines.append(f"{v.layer:<12} {v.what:<10} {sizes} {v.slope:>7.2f}  {v.trend}")
    return lines


def plot(traces: Sequence[WidthTrace], out: Path, title: str) -> Path:
    """Two panels, activations and updates: each layer's size against the width, one line per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = [t.width for t in traces]
    layers = list(traces[0].activation)
    fig, axes = plt.subplots(2, len(layers), figsize=(2.3 * len(layers), 4.6), sharex=True, squeeze=False)
    steps = len(traces[0].update[layers[0]])
    colors = plt.get_cmap("viridis")
    for col, layer in enumerate(layers):
        for row, (what, series) in enumerate((("activation", "activation"), ("update", "update"))):
            ax = axes[row][col]
            for step in range(steps):
                ys = [getattr(t, series)[layer][step + (1 if what == "activation" else 0)] for t in traces]
                ax.plot(widths, ys, "o-", ms=2.5, lw=1, color=colors(step / max(1, steps - 1)))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.tick_params(labelsize=6)
            if row == 0:
                ax.set_title(layer, fontsize=8)
            if col == 0:
                ax.set_ylabel(f"mean |{'output' if what == 'activation' else 'output change per step'}|", fontsize=7)
            if row == 1:
                ax.set_xlabel("width", fontsize=7)
    fig.suptitle(f"{title} (lines: steps 1..{steps}, light = later)", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def target_settings(cfg: Config, target: int) -> list[str]:
    """What `liandan sweep --target-dim` prints for the best trial's config `cfg`: the overrides that train
    the model at width `target`, with the tuned learning rate carried over under muP; under the standard
    parameterization, that it does not carry over, and the common 1/width rule's guess."""
    args = check_args(cfg, 256)  # the vocabulary changes no width
    wide = widened(args, target)
    shape = [f"--model.dim={target}", f"--model.n_heads={wide.n_heads}", f"--model.n_kv_heads={wide.n_kv_heads}",
             f"--model.head_dim={wide.head_dim}"]  # fmt: skip
    if wide.ffn_dim != dataclasses.replace(wide, ffn_dim=0).ffn_dim:
        shape.append(f"--model.ffn_dim={wide.ffn_dim}")
    lr = cfg.optim.lr
    if args.parameterization == "mup":
        heading = (
            f"width {target} (muP, tuned at width {args.dim}, base width {args.mup_base_dim}): the learning rate"
            " carries over; muP scales each hidden matrix's by mup_base_dim / dim itself"
        )
        settings = [*shape, "--model.parameterization=mup", f"--model.mup_base_dim={args.mup_base_dim}"]
        return [heading, "  " + " ".join([*settings, f"--optim.lr={lr:.4g}"])]
    guess = lr * args.dim / target
    heading = (
        f"width {target}: under the standard parameterization the learning rate tuned at width {args.dim} does"
        f" not carry over; a guess by the common 1/width rule: --optim.lr={guess:.4g}"
    )
    return [
        heading,
        "  " + " ".join([*shape, f"--optim.lr={guess:.4g}"]),
        f"  to carry it over, sweep with --model.parameterization=mup --model.mup_base_dim={args.dim}",
    ]
