"""One rank of the tensor-parallel test: `python tp_worker.py OUT` under RANK/WORLD_SIZE/MASTER_* with 2 ranks.

Checks, each against the same computation in this process on whole tensors:
- `lm_loss` on logits split over the vocabulary (a DTensor) against `lm_loss` on the whole logits, with and
  without z-loss: the value and each rank's columns of the gradient;
- a few training steps of a tiny model split by tensor parallelism (plain, loss parallel, loss + sequence
  parallel, and with tied embeddings and qk-norm) against the unsplit model: the losses, the first step's
  gradients, the widest logits any rank held and the length of the residual stream's sequence per rank.
Writes what it measured to OUT/rank<r>.json; the test asserts on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from liandan.model import ModelArgs, Transformer
from liandan.model.loss import lm_loss

VOCAB, SEQ, BATCH, STEPS = 64, 16, 2, 3
VARIANTS = {
    "gathered": ({}, {"loss_parallel": False, "sequence_parallel": False}),
    "loss_parallel": ({}, {"loss_parallel": True, "sequence_parallel": False}),
    "sequence_parallel": ({}, {"loss_parallel": True, "sequence_parallel": True}),
    "tied_qk_norm": ({"tie_embeddings": True, "qk_norm": True}, {"loss_parallel": True, "sequence_parallel": True}),
    "tied_z_loss": ({"tie_embeddings": True, "z_loss": 1e-2}, {"loss_parallel": True, "sequence_parallel": False}),
}


def loss_checks(mesh) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    rank, size = mesh.get_local_rank(), mesh.size()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, VOCAB, generator=generator) * 4
    targets = torch.randint(0, VOCAB, (3, 5), generator=generator)
    targets[0, :2] = -1  # positions without a target
    width = VOCAB // size
    out = {}
    for z in (0.0, 1e-2):
        whole = logits.clone().requires_grad_()
        expected = lm_loss(whole, targets, z)
        expected.backward()
        mine = logits[..., rank * width : (rank + 1) * width].clone().requires_grad_()
        got = lm_loss(DTensor.from_local(mine, mesh, [Shard(2)], run_check=False), targets, z)
        got.backward()
        out[f"z={z}"] = {
            "loss": float(got.detach()),
            "expected": float(expected),
            "grad_diff": float((mine.grad - whole.grad[..., rank * width : (rank + 1) * width]).abs().max()),
            "grad_scale": float(whole.grad.abs().max()),
        }
    return out


def train(model_fields: dict, options: dict, mesh) -> dict:
    from liandan.common.layout import Layout
    from liandan.train.parallelize import parallelize

    args = ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ, **model_fields)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]
    torch.manual_seed(0)
    whole = Transformer(args)
    torch.manual_seed(0)
    split = parallelize(Transformer(args), mesh, Layout(1, 1, mesh.size()), **options)
    return {"whole": _steps(whole, batches), "split": _steps(split, batches)}


def _steps(model: Transformer, batches: list[torch.Tensor]) -> dict:
    """Train on `batches`; the losses, the first step's gradients (whole), the widest logits this rank held
    and the sequence length of the residual stream this rank held between blocks."""
    seen = {"widest_logits": 0, "residual_seq": 0}

    def logits(module, inputs, output):
        seen["widest_logits"] = max(seen["widest_logits"], _local(output).shape[-1])

    def residual(module, inputs):
        seen["residual_seq"] = _local(inputs[0]).shape[1]

    model.output.register_forward_hook(logits)
    model.layers["1"].register_forward_pre_hook(residual)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses, grads = [], {}
    for step, batch in enumerate(batches):
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        if step == 0:
            grads = {name: _whole(p.grad).tolist() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    tied = model.output.weight is model.tok_embeddings.weight
    return {"losses": losses, "grads": grads, "tied": tied, **seen}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main(out_dir: str) -> None:
    from liandan.common.layout import Layout
    from liandan.train.parallelize import build_mesh

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    full_mesh = build_mesh(Layout(1, 1, dist.get_world_size()), "cpu")
    report = {"loss": loss_checks(full_mesh["tp"])}
    report["train"] = {name: train(fields, options, full_mesh) for name, (fields, options) in VARIANTS.items()}
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
