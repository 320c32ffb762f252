"""Context parallelism: PyTorch's ring attention in liandan's context-parallel step against one process.

Two ranks (one GPU each with NCCL; on a machine of one GPU, both on it, over gloo; without a GPU, CPU processes
over gloo, one thread each) hold the same Llama. Each
step, every rank computes the loss and gradients of the whole batch alone (SDPA over the whole sequence), then
the same batch split by `liandan.train.context_parallel.sequence_split` (PyTorch's `context_parallel`: the
causal load-balancing order, the rotary positions, ring attention in forward and backward) with the loss
weights liandan applies; the gradients of the split are summed over the ranks and divided by cp, as FSDP2's
average over dp_shard x cp does, and the loss averaged by `mean_over_cp`. Printed: both losses, the largest
relative gradient difference, and the time of a step each way. Checks, besides equality: the load balance (each
rank's step time under the ring).

    python benchmarks/context_parallel.py --quick      # < 60 s on one GPU: seq 8192, 4 layers of width 512
    python benchmarks/context_parallel.py --seq-len 32768 --steps 5
    python benchmarks/context_parallel.py --seq-len 4096 --layers 2 --steps 3   # on the CPU (no GPU)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from liandan.model import ModelArgs, Transformer
from liandan.train.context_parallel import cp_refusal, mean_over_cp, sequence_split


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    cuda = torch.cuda.is_available()
    shared = torch.cuda.device_count() < world
    if cuda:
        device = torch.device("cuda", 0 if shared else rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("gloo" if shared else "nccl", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    cp_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    sync = torch.cuda.synchronize if cuda else lambda: None
    model_args = ModelArgs(vocab_size=8192, dim=512, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                           max_seq_len=args.seq_len, attention="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(model_args).to(device)
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(1)
    rows = []
    for step in range(args.steps + 1):
        tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq_len + 1), generator=generator)
        inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device).clone()  # a copy on the CPU too
        targets[0, : args.seq_len // 8] = -1  # left-out targets: the ranks' shares of the counted ones differ
        sync()
        start = time.perf_counter()
        whole = model(inputs, targets)
        whole.backward()
        sync()
        whole_s = time.perf_counter() - start
        whole_grads = [p.grad.clone() for p in params]
        model.zero_grad()
        start = time.perf_counter()
        with sequence_split(cp_mesh, inputs, targets) as part:
            loss = model(part.inputs, part.targets, positions=part.positions) * part.weight
            loss.backward()
        sync()
        split_s = time.perf_counter() - start
        for p in params:
            dist.all_reduce(p.grad)
            p.grad /= world
        split_loss = float(mean_over_cp(cp_mesh, loss.detach()))
        worst = max(
            float((p.grad - g).abs().max() / g.abs().max().clamp(min=1e-30)) for p, g in zip(params, whole_grads)
        )
        model.zero_grad()
        if step:  # the first step compiles and warms the kernels
            rows.append((float(whole.detach()), split_loss, worst, whole_s, split_s))
    if rank == 0:
        name = torch.cuda.get_device_name(device) if cuda else "CPU"
        how = ("both on one GPU over gloo" if shared else "one GPU each over NCCL") if cuda else "one thread each, gloo"
        print(f"{name}: cp = {world} ({how}), batch {args.batch} x {args.seq_len}, {args.layers} layers, fp32")
        for whole_loss, split_loss, worst, whole_s, split_s in rows:
            print(f"loss whole {whole_loss:.6f} split {split_loss:.6f} (rel diff {abs(split_loss / whole_loss - 1):.1e})"
                  f"  largest relative gradient difference {worst:.1e}  step whole {whole_s * 1e3:.0f} ms,"
                  f" split {split_s * 1e3:.0f} ms")  # fmt: skip
        print(f"median step: whole {statistics.median(r[3] for r in rows) * 1e3:.0f} ms,"
              f" split per rank {statistics.median(r[4] for r in rows) * 1e3:.0f} ms")  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 steps at seq 8192: under a minute on one GPU")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default 5, --quick 3)")
    args = parser.parse_args()
    args.steps = args.steps or (3 if args.quick else 5)
    refusal = cp_refusal(args.cp, args.seq_len, "causal", "sdpa", "cuda" if torch.cuda.is_available() else "cpu")
    if refusal:
        sys.exit(f"context_parallel.py: {refusal}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.cp, port, args), nprocs=args.cp)


if __name__ == "__main__":
    main()
