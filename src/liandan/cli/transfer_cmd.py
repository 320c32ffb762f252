"""`liandan check-transfer CONFIG --widths 64,128,256`: the coordinate check of a config's parameterization."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from liandan.config import ConfigError, load_config


def add_commands(sub) -> None:
    p = sub.add_parser(
        "check-transfer",
        description=(
            "Train the config's model a few steps at each width (the same depth, heads of the same size, the same"
            " data and seed) and show how each layer's output and its change per step grow with the width. Flat"
            " everywhere: learning rates tuned at one width should hold at the others (model.parameterization ="
            " mup); growing: they will not (the standard parameterization under Adam)."
        ),
    )
    p.add_argument("config", help="run config (TOML), e.g. configs/tiny.toml")
    p.add_argument("--widths", default="64,128,256", help="model widths to compare (default 64,128,256)")
    p.add_argument("--steps", default="10", help="training steps at each width (default 10)")
    p.add_argument("--plot", default="check-transfer.png", help="where to write the plot (default check-transfer.png)")
    p.set_defaults(command=cmd_check_transfer)


def _steps(text: str) -> int:
    try:
        steps = int(text)
    except ValueError:
        raise ConfigError(f"--steps = {text!r} must be a whole number") from None
    if not 1 <= steps <= 1000:
        raise ConfigError(f"--steps = {steps} must be between 1 and 1000")
    return steps


def cmd_check_transfer(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.plan import transfer

    widths = transfer.parse_widths(args.widths)
    steps = _steps(args.steps)
    plot_path = Path(args.plot)
    if plot_path.suffix.lower() != ".png":
        raise ConfigError(f"--plot = {args.plot!r} must name a .png file")
    cfg = load_config(args.config, overrides)
    o = cfg.model.options
    mup = getattr(o, "parameterization", "standard") == "mup"
    with tempfile.TemporaryDirectory(prefix="liandan-check-transfer-") as work:
        first, traces = transfer.coordinate_check(cfg, widths, steps, Path(work) / "data", say=print)
    found = transfer.verdicts(traces)
    what = f"parameterization {'mup (base width ' + str(first.mup_base_dim) + ')' if mup else 'standard'}"
    print(f"{what}, optimizer {cfg.optim.name}, lr {cfg.optim.lr:g}, {steps} steps, heads of {first.head_dim}")
    for line in transfer.table(traces, found):
        print(line)
    growing = [f"{v.layer} {v.what}" for v in found if v.trend != "flat"]
    if growing:
        print(f"verdict: not width-invariant ({', '.join(growing)}): the best learning rate will move with the width")
    else:
        print("verdict: every layer flat across the widths: hyperparameters tuned at one width should transfer")
    print(f"plot: {transfer.plot(traces, plot_path, what)}")
    return 0
