"""What Muon costs per step against AdamW: the same model, the same batches, one process or FSDP2 ranks.

    python benchmarks/muon_overhead.py                         # the ~10M model, 30 counted steps each
    python benchmarks/muon_overhead.py --steps 60 --threads 2 --json out.json
    python benchmarks/muon_overhead.py --nproc 2               # FSDP2 on 2 gloo ranks: ShardedMuon
    python benchmarks/muon_overhead.py --newton-schulz         # liandan's Muon step against torch.optim.Muon's

Two copies of the ~10M-parameter Llama of benchmarks/train_step.py (width 320, 4 layers, SwiGLU 896, 8192-token
vocabulary, batch 8 x 256, fp32), built from the same seed, one with `[optim] name = "adamw"`, one with
"muon" (Newton-Schulz on the 28 hidden matrices, AdamW on the rest), through the optimizer plug-ins as
the trainer builds them. They train in alternating turns of `--turn` steps on the same batches, so load from
other processes lands on both; the first turn of each is warm-up. Printed per optimizer: the whole step (forward,
backward, update) and the update alone, in ms (medians of the per-step times), the Muon/AdamW ratios, and the
share of the step's model FLOPs that `liandan plan` counts for Newton-Schulz. The batches are random tokens:
the losses say nothing here. With `--nproc N` both train under FSDP2 on N gloo ranks (global batch 8 split
over them), Muon as `ShardedMuon` (gather, orthogonalise on the owner rank, broadcast); rank 0's times.

With `--newton-schulz`, the Muon update alone over the hidden matrices of a model (by default
configs/shakespeare-char.toml's: 4 layers of width 128, 28 matrices of 128 x 128 and 128 x 384), two ways on
the same parameters and gradients: liandan's (`ShardedMuon` on plain tensors: Newton-Schulz of the matrices
of one shape in one batched product) and `torch.optim.Muon`'s (one matrix at a time), alternating, medians of
`--steps` each, and the largest relative difference of their updates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from liandan.config import load_config
from liandan.model import ModelArgs, Transformer
from liandan.train.optimizers import build_optimizers

ARGS = {"dim": 320, "n_layers": 4, "n_heads": 5, "n_kv_heads": 5, "ffn_dim": 896, "vocab_size": 8192,
        "max_seq_len": 256}  # fmt: skip
BATCH, SEQ = 8, 256


def planned_share(model: Transformer) -> float:
    """Newton-Schulz FLOPs of one step over the model's forward and backward FLOPs, as `liandan plan` counts."""
    from liandan.model.roles import parameter_roles
    from liandan.model.spec import flops_per_token
    from liandan.train.optimizers import optimizer_plugin

    section = load_config(None, ["--optim.name=muon"]).optim
    ns = optimizer_plugin("muon").step_flops(parameter_roles(model), section)
    return ns / (flops_per_token(model.args, SEQ) * BATCH * SEQ)


def measure(a: argparse.Namespace, rank: int = 0, world: int = 1) -> dict:
    """Both optimizers' step and update times on this rank (of `world` FSDP2 ranks when `world` > 1)."""
    torch.set_num_threads(a.threads)
    mesh = layout = None
    if world > 1:
        from liandan.common.layout import Layout
        from liandan.train.parallelize import build_mesh

        layout = Layout(1, world, 1)
        mesh = build_mesh(layout, "cpu")
    runs = {}
    for name in ("adamw", "muon"):
        torch.manual_seed(0)
        model = Transformer(ModelArgs(**ARGS))
        if world > 1:
            from liandan.train.parallelize import parallelize

            model = parallelize(model, mesh, layout)
        section = load_config(None, [f"--optim.name={name}", f"--optim.lr={a.lr}"]).optim
        runs[name] = {"model": model, "optim": build_optimizers([model], section, lambda s: 1.0, torch.device("cpu")),
                      "step": [], "update": []}  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    rows = BATCH // world
    for turn in range(a.steps // a.turn + 1):  # the first turn is warm-up
        batches = [torch.randint(0, ARGS["vocab_size"], (BATCH, SEQ + 1), generator=generator) for _ in range(a.turn)]
        for run in runs.values():
            for batch in batches:
                mine = batch[rank * rows : (rank + 1) * rows]
                start = time.perf_counter()
                run["model"](mine[:, :-1], mine[:, 1:]).backward()
                middle = time.perf_counter()
                run["optim"].step()
                end = time.perf_counter()
                if turn:
                    run["step"].append(end - start)
                    run["update"].append(end - middle)
    return {name: {"step_ms": 1e3 * statistics.median(run["step"]), "update_ms": 1e3 * statistics.median(run["update"])}
            for name, run in runs.items()}  # fmt: skip


def newton_schulz_times(a: argparse.Namespace) -> dict:
    """Milliseconds of one Muon update over the hidden matrices of a model of `--dim` x `--layers`: liandan's
    batched one and torch.optim.Muon's (medians), and how far apart their updates are."""
    from liandan.model.roles import parameter_roles
    from liandan.train.optimizers.muon import muon_over, muon_roles

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=a.dim, n_layers=a.layers, n_heads=4, vocab_size=320, max_seq_len=64))
    hidden, _ = muon_roles(parameter_roles(model))
    section = load_config(None, ["--optim.name=muon", f"--optim.lr={a.lr}"]).optim
    mine = muon_over(hidden, section)
    params = [r.param for r in hidden]
    theirs_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    g = mine.param_groups[0]
    theirs = torch.optim.Muon(theirs_params, **{k: v for k, v in g.items() if k != "params"})
    grads = [torch.randn_like(p) for p in params]
    times: dict[str, list[float]] = {"liandan": [], "torch": []}
    worst = 0.0
    for step in range(a.steps + 1):  # the first is warm-up
        for name, optimizer, ps in (("liandan", mine, params), ("torch", theirs, theirs_params)):
            before = [p.detach().clone() for p in ps]
            for p, grad in zip(ps, grads, strict=True):
                p.grad = grad.clone()
            start = time.perf_counter()
            optimizer.step()
            if step:
                times[name].append(time.perf_counter() - start)
            moves = [p.detach() - b for p, b in zip(ps, before, strict=True)]
            if name == "liandan":
                mine_moves = moves
        worst = max(worst, *(float((m - t).norm() / t.norm()) for m, t in zip(mine_moves, moves, strict=True)))
    shapes = sorted({tuple(sorted(p.shape)) for p in params})
    return {"matrices": len(params), "shapes": [list(s) for s in shapes], "worst_relative_difference": worst,
            **{f"{name}_ms": 1e3 * statistics.median(t) for name, t in times.items()}}  # fmt: skip


def _rank(rank: int, world: int, port: int, a: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    figures = measure(a, rank, world)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(figures, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="counted steps per optimizer")
    parser.add_argument("--turn", type=int, default=5, help="steps per turn")
    parser.add_argument("--threads", type=int, default=1, help="threads per process")
    parser.add_argument("--nproc", type=int, default=1, help="FSDP2 ranks on gloo (ShardedMuon)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--newton-schulz", action="store_true",
                        help="the Muon update alone: liandan's batched against torch.optim.Muon")  # fmt: skip
    parser.add_argument("--dim", type=int, default=128, help="--newton-schulz: the model's width")
    parser.add_argument("--layers", type=int, default=4, help="--newton-schulz: the model's layers")
    a = parser.parse_args()
    if a.newton_schulz:
        out = {"threads": a.threads, "steps": a.steps, "load_average": os.getloadavg(), **newton_schulz_times(a)}
        print(f"Muon update over {out['matrices']} matrices of shapes {out['shapes']} (width {a.dim}, {a.layers} layers),"
              f" {a.threads} thread(s): liandan (batched by shape) {out['liandan_ms']:.1f} ms, torch.optim.Muon"
              f" {out['torch_ms']:.1f} ms: {out['liandan_ms'] / out['torch_ms']:.2f}x; updates differ by at most"
              f" {out['worst_relative_difference']:.1e} (relative); load average {out['load_average'][0]:.1f}")  # fmt: skip
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=2)
        return
    if a.nproc > 1:
        import socket
        import tempfile

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rank0.json")
            mp.spawn(_rank, args=(a.nproc, port, a, path), nprocs=a.nproc)
            with open(path) as f:
                figures = json.load(f)
    else:
        figures = measure(a)
    torch.manual_seed(0)
    out = {"machine": platform.machine(), "nproc": a.nproc, "threads": a.threads, "steps": a.steps,
           "load_average": os.getloadavg(), "planned_share": planned_share(Transformer(ModelArgs(**ARGS))),
           **figures}  # fmt: skip
    for name in ("adamw", "muon"):
        print(f"{name:6s} step {out[name]['step_ms']:8.1f} ms   update {out[name]['update_ms']:7.1f} ms")
    out["step_ratio"] = out["muon"]["step_ms"] / out["adamw"]["step_ms"]
    out["update_ratio"] = out["muon"]["update_ms"] / out["adamw"]["update_ms"]
    print(f"muon / adamw on {a.nproc} process(es): step {out['step_ratio']:.3f}, update alone {out['update_ratio']:.2f}"
          f"  (load average {out['load_average'][0]:.1f}); liandan plan's Newton-Schulz FLOPs:"
          f" {out['planned_share']:.1%} of the step's model FLOPs")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
