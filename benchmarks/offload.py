"""FSDP2 CPU offload (`parallel.cpu_offload`): the device memory it frees against the step time it costs.

The same Llama is sharded by liandan's `apply_fsdp` over the data-parallel ranks, once as FSDP2 keeps it
(parameter shards, gradients and AdamW state on the device) and once with FSDP2's `CPUOffloadPolicy` (all
three in host memory; each unit's shards copied to the device for its all-gather, its gradients back after
the reduce-scatter, the AdamW update on the host), and stepped as the trainer steps it: forward and backward
on the same seeded batches, gradient clipping, optimizer step. Each rank prints, per mode:

* where the training state lives: bytes of parameter shards, gradients and optimizer state per device type;
* on CUDA, `torch.cuda.max_memory_allocated` over the timed steps (the figure offload lowers) and the memory
  held between steps;
* the median step time, and the offload/no-offload ratios of both;
* the largest loss difference between the modes (offload must not change the arithmetic beyond rounding).

On the CPU the device is the host: offload moves nothing and frees nothing, and its copies are no-ops, so the
CPU run measures only the bookkeeping FSDP2's offload adds to a step (and checks the losses); the memory it
frees shows on a GPU.

    python benchmarks/offload.py                 # CPU: 2 gloo processes, a small model
    python benchmarks/offload.py --quick         # CUDA: one GPU, a 4-layer model of a 1B model's width (< 60 s)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from liandan.config import load_config
from liandan.model import ModelArgs, Transformer
from liandan.train.optimizers import build_optimizers, schedule
from liandan.train.parallelize import apply_fsdp

GIB = 2**30


def shapes(args: argparse.Namespace, cuda: bool) -> ModelArgs:
    if cuda:  # the width of Llama 3.2 1B, 4 of its 16 layers: ~0.5B parameters, most of them the embeddings
        return ModelArgs(vocab_size=32768, dim=2048, n_layers=args.layers or 4, n_heads=32, n_kv_heads=8,
                         ffn_dim=8192, max_seq_len=args.seq_len)  # fmt: skip
    return ModelArgs(vocab_size=8192, dim=256, n_layers=args.layers or 4, n_heads=4, max_seq_len=args.seq_len)


def state_bytes(model: torch.nn.Module, optimizers) -> dict[str, dict[str, int]]:
    """Bytes of this rank's parameter shards, gradients and optimizer state, by device type."""
    held: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def add(kind: str, tensor: torch.Tensor) -> None:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        held[kind][local.device.type] += local.numel() * local.element_size()

    for p in model.parameters():
        add("params", p)
        if p.grad is not None:
            add("grads", p.grad)
    for optimizer in optimizers.optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    add("optimizer", value)
    return {kind: dict(where) for kind, where in held.items()}


def run_mode(offload: bool, args: argparse.Namespace, device: torch.device, mesh) -> dict:
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = Transformer(shapes(args, cuda)).to(device)
    apply_fsdp(model, mesh, torch.bfloat16 if cuda else None, cpu_offload=offload)
    cfg = load_config(None, ["--optim.lr=1e-4", "--schedule.warmup_steps=0"])
    optimizers = build_optimizers([model], cfg.optim, schedule(args.steps + args.warmup, cfg.schedule),
                                  torch.device("cpu") if offload else device)  # fmt: skip
    vocab = model.args.vocab_size
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    batches = [torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=generator) for _ in range(2)]
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup and cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        tokens = batches[step % 2].to(device)
        start = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizers.clip_grad_norm(1.0)
        if step == args.warmup + args.steps - 1:
            state = state_bytes(model, optimizers)  # the gradients, before the step drops them
        optimizers.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    result = {"step_s": statistics.median(times[args.warmup :]), "losses": losses, "state": state}
    if cuda:
        result["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        result["held_gib"] = torch.cuda.memory_allocated() / GIB
    del model, optimizers
    if cuda:
        torch.cuda.empty_cache()
    return result


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    results = {offload: run_mode(offload, args, device, mesh) for offload in (False, True)}
    if rank == 0:
        report(results, args, device, world)
    dist.destroy_process_group()


def report(results: dict, args: argparse.Namespace, device: torch.device, world: int) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}, {world} rank(s), batch {args.batch} x {args.seq_len}, {args.steps} timed steps (rank 0)")
    for offload, r in results.items():
        held = ", ".join(f"{kind} {sum(w.values()) / GIB:.3f} GiB on {'+'.join(w)}" for kind, w in r["state"].items())
        memory = f"  peak {r['peak_gib']:.2f} GiB, held {r['held_gib']:.2f} GiB" if "peak_gib" in r else ""
        print(f"{'offload' if offload else 'no offload':>10}: step {r['step_s'] * 1000:8.1f} ms{memory}  [{held}]")
    base, off = results[False], results[True]
    line = f"offload / no offload: step time x{off['step_s'] / base['step_s']:.2f}"
    if "peak_gib" in base:
        line += f", peak memory x{off['peak_gib'] / base['peak_gib']:.2f} ({base['peak_gib'] - off['peak_gib']:.2f} GiB freed)"
    diff = max(abs(a - b) for a, b in zip(base["losses"], off["losses"]))
    print(f"{line}; largest loss difference {diff:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few steps: under a minute on one GPU")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is present")
    parser.add_argument("--nproc", type=int, default=0, help="ranks (default: 2 on the CPU, every GPU on CUDA)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default 10, --quick 4)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=0, help="sequences per rank (default 4)")
    parser.add_argument("--seq-len", type=int, default=0, help="default: 2048 on CUDA, 256 on the CPU")
    parser.add_argument("--layers", type=int, default=0, help="default 4")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    args.steps = args.steps or (4 if args.quick else 10)
    args.batch = args.batch or 4
    args.seq_len = args.seq_len or (2048 if cuda else 256)
    world = args.nproc or (torch.cuda.device_count() if cuda else 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, args), nprocs=world)


if __name__ == "__main__":
    main()
