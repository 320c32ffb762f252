"""The pipeline bubble on the CPU: the measured idle share of a pipeline step against the schedule's theory.

A Llama of --layers blocks is trained by liandan's pipeline train module on --pp gloo processes, one thread
each, through each schedule asked for (--m micro-batches of --rows sequences per step); then one process of
one thread trains the whole model on the same micro-batches by gradient accumulation. With perfect balance and
no bubble a pipeline step would take the whole model's step divided by pp; the measured bubble share is what
the pipeline step spends beyond that:

    bubble = 1 - (whole step / pp) / pipeline step

which also holds the stages' point-to-point sends and any imbalance between stages. The theory for p stages
and m micro-batches is (p-1)/(m+p-1) for GPipe and 1F1B; with v stages per rank (interleaved 1F1B) the warm-up
and cool-down shrink by v: (p-1)/(v*m+p-1). The zero-bubble schedules (interleaved-zb, zbv) fill the bubble
with weight-gradient work; their measured gain over 1F1B is printed beside them. Steps are timed after
--warmup untimed ones, each pipeline step followed by one of the whole model (so that both meet the same
load on a shared machine); the medians of --steps are reported. Each process is pinned to one thread, so pp
processes need pp free cores for the figures to mean anything: `uptime` is printed first.

    python benchmarks/pipeline_bubble.py                        # pp=2, m=4: 1f1b, interleaved-1f1b, zb
    python benchmarks/pipeline_bubble.py --m 8 --schedules 1f1b:1,interleaved-1f1b:2
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

SRC = Path(__file__).resolve().parents[1] / "src"


def config(args, pp: int, schedule: str, per_rank: int, microbatch_rows: int = 0):
    from liandan.config import load_config

    keys = [f"--model.dim={args.dim}", f"--model.n_layers={args.layers}", "--model.n_heads=8",
            f"--model.max_seq_len={args.seq}", "--model.vocab_size=512", f"--train.seq_len={args.seq}",
            "--train.dtype=fp32", f"--train.global_batch={args.rows * args.m}", "--train.steps=1000",
            "--data.tokenizer=byte", "--optim.grad_clip=1.0"]  # fmt: skip
    if pp > 1:
        keys += [f"--parallel.pp={pp}", f"--parallel.pp_schedule={schedule}",
                 f"--parallel.pp_stages_per_rank={per_rank}", f"--parallel.pp_microbatches={args.m}"]  # fmt: skip
    if microbatch_rows:
        keys.append(f"--train.micro_batch={microbatch_rows}")
    return load_config(None, keys)


def batch(args, rows: int):
    from liandan.data.tokens.loader import Batch

    tokens = torch.randint(0, 512, (rows, args.seq + 1), generator=torch.Generator().manual_seed(0))
    return Batch(
        tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.zeros(rows, args.seq, dtype=torch.int32)
    )


def step(module, batches, i: int) -> float:
    start = time.perf_counter()
    module.train_batch(batches, lambda *a, **k: None, i + 1)
    module.clip_grad_norm()
    module.optim_step()
    return time.perf_counter() - start


def worker(args) -> None:
    """One rank: every schedule in turn, its steps alternating with the whole model's on rank 0 (the other
    ranks wait at a barrier), so that both see the machine's load alike; rank 0 prints the medians."""
    from liandan.common.layout import Layout
    from liandan.train.causal_lm import CausalLMTrainModule
    from liandan.train.parallelize import build_mesh
    from liandan.train.pipeline import PipelineTrainModule

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    layout = Layout(1, 1, 1, pp=args.pp)
    mesh = build_mesh(layout, "cpu")
    cpu = torch.device("cpu")
    whole = None
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        whole = CausalLMTrainModule(config(args, 1, "", 1, microbatch_rows=args.rows), 512, None, Layout(1, 1, 1),
                                    cpu, torch.float32)  # fmt: skip
    for run in args.schedules.split(","):
        schedule, per_rank = run.split(":")
        torch.manual_seed(0)
        module = PipelineTrainModule(config(args, args.pp, schedule, int(per_rank)), 512, mesh, layout, cpu,
                                     torch.float32)  # fmt: skip
        piped, alone = [], []
        for i in range(args.warmup + args.steps):
            dist.barrier()
            seconds = step(module, [batch(args, args.rows * args.m)], i)
            dist.barrier()
            if whole is not None:
                alone.append(step(whole, [batch(args, args.rows)] * args.m, i))
            if i >= args.warmup:
                piped.append(seconds)
        if whole is not None:
            print(f"{run} {statistics.median(piped):.6f} {statistics.median(alone[args.warmup :]):.6f}", flush=True)
        del module
    dist.destroy_process_group()


def theory(pp: int, m: int, schedule: str, per_rank: int) -> float | None:
    if schedule in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"):
        return (pp - 1) / (per_rank * m + pp - 1)
    return None  # zero-bubble schedules: ideally none


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--m", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--rows", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--schedules", default="gpipe:1,1f1b:1,interleaved-1f1b:2,interleaved-zb:2,zbv:2")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    print("uptime:", subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.pp):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.pp), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(SRC))  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env,
                                      stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, text=True))  # fmt: skip
    out, _ = procs[0].communicate()
    for proc in procs[1:]:
        proc.wait()
    times = {run: (float(piped), float(alone)) for run, piped, alone in (line.split() for line in out.splitlines())}
    print(f"pp={args.pp}, m={args.m} micro-batches of {args.rows}x{args.seq} tokens, {args.layers} blocks of"
          f" width {args.dim}, one thread per process")  # fmt: skip
    print(f"{'schedule':<22}{'step ms':>9}{'whole ms':>10}{'bubble':>9}{'theory':>9}{'vs 1f1b':>9}")
    base = times.get("1f1b:1", (float("nan"), 0.0))[0]
    for run, (seconds, whole) in times.items():
        schedule, per_rank = run.split(":")
        measured = 1 - (whole / args.pp) / seconds
        expected = theory(args.pp, args.m, schedule, int(per_rank))
        shown = f"{expected:.1%}" if expected is not None else "0"
        print(f"{run:<22}{seconds * 1000:>9.1f}{whole * 1000:>10.1f}{measured:>9.1%}{shown:>9}{base / seconds:>8.2f}x")


if __name__ == "__main__":
    main()
