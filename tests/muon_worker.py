"""One rank of the sharded-Muon test: `python muon_worker.py OUT DP_REPLICATE DP_SHARD TP` under
RANK/WORLD_SIZE/MASTER_* with DP_REPLICATE x DP_SHARD x TP ranks.

A tiny model is trained for a few steps twice in every rank: whole (`ShardedMuon` on plain tensors, Newton-Schulz
batched by shape, + AdamW, as one process builds them) and parallelized in the given layout (`ShardedMuon` + AdamW over DTensors), both by the Muon
plug-in. Both take the same gradients each step (the whole model's, each rank given its shards), so only the
optimizers differ. Writes, per parameter, the largest difference of the whole parameters and of the momentum
buffers, and the parameter's largest value, to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from liandan.config import load_config
from liandan.model import ModelArgs, Transformer

VOCAB, SEQ, BATCH, STEPS = 64, 16, 2, 3


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _shard_like(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(like, DTensor):
        return whole.clone()
    mesh = like.device_mesh
    replicated = DTensor.from_local(whole.clone(), mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements)


def main(out_dir: str, dp_replicate: int, dp_shard: int, tp: int) -> None:
    from liandan.common.layout import Layout
    from liandan.train.optimizers.muon import build_muon
    from liandan.train.parallelize import build_mesh, parallelize

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    layout = Layout(dp_replicate, dp_shard, tp)
    mesh = build_mesh(layout, "cpu")
    section = load_config(None, ["--optim.name=muon", "--optim.lr=0.02"]).optim
    args = ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
    torch.manual_seed(0)
    whole = Transformer(args)
    torch.manual_seed(0)
    split = parallelize(Transformer(args), mesh, layout)
    device = torch.device("cpu")
    whole_opts, split_opts = build_muon(whole, section, device), build_muon(split, section, device, tp > 1)
    generator = torch.Generator().manual_seed(1)
    split_params = dict(split.named_parameters())
    for _ in range(STEPS):
        batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        whole(batch[:, :-1], batch[:, 1:]).backward()
        for name, p in whole.named_parameters():
            split_params[name].grad = _shard_like(p.grad, split_params[name])
        for optimizer in whole_opts + split_opts:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    buffers = {id(p): s["momentum_buffer"] for o in split_opts for p, s in o.state.items() if "momentum_buffer" in s}
    whole_buffers = {id(p): s["momentum_buffer"] for o in whole_opts for p, s in o.state.items()
                     if "momentum_buffer" in s}  # fmt: skip
    report = {"optimizers": [type(o).__name__ for o in split_opts], "params": {}}
    for name, p in whole.named_parameters():
        q = split_params[name]
        row = {"diff": float((_whole(q.detach()) - p.detach()).abs().max()), "scale": float(p.detach().abs().max())}
        if id(q) in buffers:
            row["momentum_diff"] = float((_whole(buffers[id(q)]) - whole_buffers[id(p)]).abs().max())
            row["sharded"] = hasattr(q, "full_tensor")
        report["params"][name] = row
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:5]))
