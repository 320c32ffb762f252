"""One rank of the meta-initialisation test: `python meta_init_worker.py STORE OUT` with RANK and WORLD_SIZE set.

For FSDP, tensor parallelism and DDP over both ranks, the train module built both ways from the same seed: its
shards and the losses of a few steps. Then the host memory it takes to build, shard and initialise a larger
model under meta init with FSDP over both ranks (one whose whole fp32 copy is larger than a rank's share plus
one whole parameter). Writes OUT/rank<r>.pt for the test to compare."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from liandan.checkpoint import hf
from liandan.checkpoint.streaming import local_slice, stream_into, weight_source
from liandan.common.layout import Layout
from liandan.config import load_config
from liandan.data.tokens.loader import Batch
from liandan.train.causal_lm import CausalLMTrainModule
from liandan.train.parallelize import build_mesh

SMALL = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.max_seq_len=32", "--train.seq_len=32", "--model.vocab_size=320"]  # fmt: skip
# ~28M parameters (111 MB in fp32), no parameter larger than 8.4 MB: a rank's share plus one whole parameter
# stays well below the whole model.
LARGE = ["--model.dim=512", "--model.n_layers=8", "--model.n_heads=8", "--model.max_seq_len=32",
         "--train.seq_len=32", "--model.vocab_size=4096"]  # fmt: skip


def config(shape: list[str], meta: bool, seed: int = 0):
    return load_config(None, [*shape, f"--train.meta_init={str(meta).lower()}", "--train.dtype=fp32", f"--run.seed={seed}",
                              "--train.steps=3", "--train.global_batch=4", "--schedule.warmup_steps=1"])  # fmt: skip


def shards(module: CausalLMTrainModule) -> dict[str, torch.Tensor]:
    return {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for name, p in module.model.named_parameters()}  # fmt: skip


def train(module: CausalLMTrainModule, steps: int = 3) -> list[float]:
    generator = torch.Generator().manual_seed(7)
    losses = []
    for step in range(1, steps + 1):
        tokens = torch.randint(0, 257, (2, 33), generator=generator)
        batch = Batch(tokens[:, :-1], tokens[:, 1:], torch.zeros(2, 32, dtype=torch.int32))
        loss = module.train_batch([batch], lambda *a, **k: None, step)
        module.optim_step()
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    return losses


def main(store: str, out: str) -> None:
    import os

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))  # fmt: skip
    cpu = torch.device("cpu")
    result: dict = {}
    fsdp, tp = Layout(1, 2, 1), Layout(1, 1, 2)
    for name, layout in (("fsdp", fsdp), ("tp", tp), ("ddp", Layout(2, 1, 1))):
        for meta in (False, True):
            module = CausalLMTrainModule(
                config(SMALL, meta), 257, build_mesh(layout, "cpu"), layout, cpu, torch.float32
            )
            result[f"{name}/{meta}/shards"] = shards(module)
            result[f"{name}/{meta}/losses"] = train(module)
            del module
    # Weights of another seed, written whole by rank 0, streamed into each layout's shards.
    whole = CausalLMTrainModule(config(SMALL, False), 257, None, Layout(1, 1, 1), cpu, torch.float32).model
    whole_state = {k: v for k, v in whole.state_dict().items()}
    if dist.get_rank() == 0:
        hf.save_consolidated(whole_state, whole.args, Path(out) / "whole.safetensors")
        hf.export_hf(whole_state, whole.args, Path(out) / "hf", dtype=torch.bfloat16)
    dist.barrier()
    for name, layout in (("fsdp", fsdp), ("tp", tp)):
        for source in ("whole.safetensors", "hf"):
            module = CausalLMTrainModule(config(SMALL, True, seed=1), 257, build_mesh(layout, "cpu"), layout, cpu,
                                 torch.float32)  # fmt: skip
            with weight_source(Path(out) / source) as weights:
                read = stream_into(module.model, weights)
            result[f"{name}/{source}/streamed"] = shards(module)
            result[f"{name}/{source}/expected"] = {
                k: whole_state[k].to(torch.bfloat16 if source == "hf" else torch.float32).float()[local_slice(p) or ()]
                for k, p in module.model.named_parameters()
            }
            result[f"{name}/{source}/read"] = read
    # Measured last: the first sharded model also pays for code loaded on first use (tens of MB).
    large = CausalLMTrainModule(config(LARGE, True), 257, build_mesh(fsdp, "cpu"), fsdp, cpu, torch.float32)
    result["large_host_peak"] = large.init_peak.host_bytes
    torch.save(result, Path(out) / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
