"""One rank of the context-parallel tests: `python cp_worker.py OUT` under RANK/WORLD_SIZE/MASTER_* with
WORLD_SIZE = cp ranks (gloo).

PyTorch's ring attention does not run on the CPU (see liandan.train.context_parallel), so the attention of
the parallel model is a stand-in here: each rank gathers the keys, values and positions of every cp rank and
attends with the causal mask of the positions (eager attention, no SDPA). Everything else is what a
context-parallel step runs: the mesh with its cp dim, FSDP2 over dp_shard x cp, `sequence_split` (PyTorch's
`context_parallel` sharding the batch in the causal load-balancing order, with the rotary positions), the
loss weights and `mean_over_cp`.

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
import torch.distributed.nn.functional as dist_nn

from liandan.model import ModelArgs, Transformer

VOCAB, SEQ, BATCH, STEPS = 64, 32, 2, 3


def gathered_attention(group, positions: list[torch.Tensor]):
    """Causal attention over the keys and values of every cp rank, placed by their positions."""
    from liandan.model.attention import eager_attention

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = dist_nn.all_gather(t.contiguous(), group=group)
        for part in parts:
            # gloo's all-to-all, which sends the gradients back, needs them contiguous (the keys' are not)
            part.register_hook(torch.Tensor.contiguous)
        return torch.cat(parts, dim=2)

    def attend(q, k, v, mask):
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        keys, values = gather(k), gather(v)
        where = positions[0]  # (B, T/cp): this rank's queries
        everywhere = torch.cat([torch.empty_like(where) for _ in range(dist.get_world_size(group))], dim=1)
        dist.all_gather_into_tensor(everywhere.view(-1), where.contiguous().view(-1), group=group)
        parts = everywhere.view(dist.get_world_size(group), *where.shape)
        key_positions = torch.cat(list(parts), dim=1)
        allowed = (key_positions[:, None, :] <= where[:, :, None])[:, None]
        return eager_attention(q, k=keys, v=values, allowed=allowed)

    return attend


def main(out_dir: str) -> None:
    from liandan.common.layout import Layout
    from liandan.model import llama
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
    whole.attention_backend = split.attention_backend = "eager"
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=1e-2, foreach=False)
    split_opt = torch.optim.AdamW(split.parameters(), lr=1e-2, foreach=False)
    generator = torch.Generator().manual_seed(1)
    report: dict = {"steps": []}
    own_attend = llama.attend
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
        targets[0, :5] = -1  # targets left out of the loss: the ranks' shares of the counted ones differ
        whole_loss = whole(inputs, targets)
        whole_loss.backward()
        positions: list[torch.Tensor] = []
        with sequence_split(cp_mesh, inputs, targets) as part:
            positions.append(part.positions)
            llama.attend = gathered_attention(cp_mesh.get_group(), positions)
            try:
                loss = split(part.inputs, part.targets, positions=part.positions) * part.weight
                loss.backward()
            finally:
                llama.attend = own_attend
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
