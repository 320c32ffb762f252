"""One rank of the context-parallel tests: `python cp_worker.py OUT` under RANK/WORLD_SIZE/MASTER_* with
WORLD_SIZE = cp ranks (gloo).

A context-parallel step as the trainer runs it, against the same model in one process: the mesh with its cp
dim, FSDP2 over dp_shard x cp, `sequence_split` (PyTorch's `context_parallel` sharding the batch in the causal
load-balancing order, with the rotary positions, and SDPA routed to PyTorch's ring attention, over the CPU's
kernel by `liandan.train.cpu_ring`), the loss weights and `mean_over_cp`.

Writes to OUT/rank<r>.json: this rank's share of the batch (inputs, targets, positions, weight), the whole
batch, per step the parallel and the one-process losses and the largest gradient difference, and at the end
the largest parameter difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from liandan.model import ModelArgs, Transformer

VOCAB, SEQ, BATCH, STEPS = 64, 32, 2, 3


def main(out_dir: str) -> None:
    from liandan.common.layout import Layout
    from liandan.train.context_parallel import mean_over_cp, sequence_split
    from liandan.train.parallelize import build_mesh, parallelize

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout(1, 1, 1, cp=world)
    mesh = build_mesh(layout, "cpu")
    cp_mesh = mesh["cp"]
    args = ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
    torch.manual_seed(0)
    whole = Transformer(args)
    torch.manual_seed(0)
    split = parallelize(Transformer(args), mesh, layout)
    whole.attention_backend = split.attention_backend = "sdpa"
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=1e-2, foreach=False)
    split_opt = torch.optim.AdamW(split.parameters(), lr=1e-2, foreach=False)
    generator = torch.Generator().manual_seed(1)
    report: dict = {"steps": []}
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
        targets[0, :5] = -1  # targets left out of the loss: the ranks' shares of the counted ones differ
        whole_loss = whole(inputs, targets)
        whole_loss.backward()
        with sequence_split(cp_mesh, inputs, targets) as part:
            loss = split(part.inputs, part.targets, positions=part.positions) * part.weight
            loss.backward()
            if step == 0:
                report["share"] = {"inputs": part.inputs.tolist(), "targets": part.targets.tolist(),
                                   "positions": part.positions.tolist(), "weight": float(part.weight)}  # fmt: skip
                report["batch"] = {"inputs": inputs.tolist(), "targets": targets.tolist()}
        grad_diff = max(
            float((a.grad - b.grad.full_tensor()).abs().max())
            for a, b in zip(whole.parameters(), split.parameters(), strict=True)
        )
        report["steps"].append({"whole_loss": float(whole_loss.detach()), "split_loss": float(mean_over_cp(cp_mesh, loss.detach())),
                                "grad_diff": grad_diff})  # fmt: skip
        for opt in (whole_opt, split_opt):
            opt.step()
            opt.zero_grad()
    report["param_diff"] = max(
        float((a - b.full_tensor()).abs().max()) for a, b in zip(whole.parameters(), split.parameters(), strict=True)
    )
    report["mesh"] = list(mesh.mesh_dim_names)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
