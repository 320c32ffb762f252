"""One rank of the expert- and tensor-parallel MoE tests: `python ep_worker.py OUT DP_REPLICATE DP_SHARD EP
COLLAPSED [TP [SP]]` under RANK/WORLD_SIZE/MASTER_* with DP_REPLICATE x DP_SHARD x TP ranks; COLLAPSED = 1
biases every router to experts 0 and 1, so that the ranks holding the others receive no rows; SP = 1 adds
sequence parallelism to TP.

Every rank trains a tiny MoE model twice for a few steps on the same global batch: whole, in this process
(the mean of the loss over every rank's micro-batch, the routing's loads summed over all of them), and
parallelized in the given layout (FSDP2 with expert and tensor parallelism, each data-parallel rank its own micro-batch, the ranks of a
tensor-parallel group the same one). Both use
AdamW and the bias balancing after each step. Writes, per step, both losses, both global gradient norms (the
parallel one by the optimizers container's clip_grad_norm) and the largest gradient difference over each
parameter; at the end each parameter's and each router bias's largest difference, to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from liandan.model import ModelArgs, Transformer

VOCAB, SEQ, BATCH, STEPS, BIAS_RATE = 64, 16, 2, 3, 0.01


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main(out_dir: str, dp_replicate: int, dp_shard: int, ep: int, collapsed: int = 0, tp: int = 1, sp: int = 0) -> None:
    from liandan.common.layout import Layout
    from liandan.model.moe import routing_step
    from liandan.train.optimizers.container import clip_grad_norm
    from liandan.train.parallelize import build_mesh, dp_coordinates, parallelize

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    layout = Layout(dp_replicate, dp_shard, tp, ep=ep)
    mesh = build_mesh(layout, "cpu")
    alone, _ = dist.new_subgroups(group_size=1)  # the whole model's routing: this process's counts only
    args = ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ,
                     moe_experts=4, moe_top_k=2, moe_ffn_dim=16, moe_shared_experts=1, moe_aux_loss=0.01,
                     moe_z_loss=0.001)  # fmt: skip
    torch.manual_seed(0)
    whole = Transformer(args)
    torch.manual_seed(0)
    split = parallelize(Transformer(args), mesh, layout, sequence_parallel=bool(sp))
    if collapsed:  # every token's choice is experts 0 and 1: the ranks holding 2 and 3 receive no rows
        for model in (whole, split):
            for name, bias in model.named_buffers():
                if name.endswith("expert_bias"):
                    bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    whole_opt = torch.optim.AdamW(whole.parameters(), lr=1e-2, foreach=False)
    split_opt = torch.optim.AdamW(split.parameters(), lr=1e-2, foreach=False)
    dp_rank, dp_size = dp_coordinates(mesh, layout)
    generator = torch.Generator().manual_seed(1)
    split_params = dict(split.named_parameters())
    report: dict = {"steps": [], "params": {}, "expert_placements": {}}
    for _ in range(STEPS):
        batch = torch.randint(0, VOCAB, (dp_size * BATCH, SEQ + 1), generator=generator)
        parts = batch.split(BATCH)
        whole_loss = sum(whole(part[:, :-1], part[:, 1:]) for part in parts) / dp_size
        whole_loss.backward()
        mine = parts[dp_rank]
        loss = split(mine[:, :-1], mine[:, 1:])
        loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # the ranks of a tensor-parallel group hold the same loss
        grad_diff = {name: float((_whole(split_params[name].grad) - p.grad).abs().max())
                     for name, p in whole.named_parameters()}  # fmt: skip
        report["steps"].append({
            "whole_loss": float(whole_loss), "split_loss": float(mean_loss) / dist.get_world_size(),
            "whole_norm": float(torch.nn.utils.get_total_norm([p.grad for p in whole.parameters()])),
            "split_norm": clip_grad_norm(split.parameters(), float("inf")),
            "grad_diff": max(grad_diff.values()), "worst": max(grad_diff, key=grad_diff.get),
        })  # fmt: skip
        for optimizer in (whole_opt, split_opt):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        routing_step(whole, BIAS_RATE, group=alone)
        routing_step(split, BIAS_RATE)
    for name, p in whole.named_parameters():
        report["params"][name] = float((_whole(split_params[name].detach()) - p.detach()).abs().max())
        q = split_params[name]
        if ".experts." in name and hasattr(q, "placements"):  # a DTensor unless tensor parallelism alone
            report["expert_placements"][name] = [str(x) for x in q.placements] + [list(q.to_local().shape)]
    split_buffers = dict(split.named_buffers())
    report["bias_diff"] = max(
        float((split_buffers[name] - b).abs().max()) for name, b in whole.named_buffers() if "expert_bias" in name
    )
    report["bias_moved"] = max(float(b.abs().max()) for name, b in whole.named_buffers() if "expert_bias" in name)
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
