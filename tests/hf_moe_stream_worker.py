"""One rank of the MoE streaming test: `python hf_moe_stream_worker.py STORE OUT` with RANK and WORLD_SIZE set.

A MoE model (3 experts: FSDP2 gives one rank two of them, the other one) built whole from one seed, written by
rank 0 as a Hugging Face directory (one tensor per expert) and as a consolidated file (its routers' bias set
away from zero), then streamed into a model of another seed built on the meta device and sharded by FSDP over
both ranks. Writes OUT/rank<r>.pt: each source's shards, the slices of the whole they should equal, the
routers' biases and the bytes read."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from liandan.checkpoint import hf
from liandan.checkpoint.streaming import local_slice, stream_into, weight_source
from liandan.common.layout import Layout
from liandan.config import load_config
from liandan.train.causal_lm import CausalLMTrainModule
from liandan.train.parallelize import build_mesh

MOE = ["--model.dim=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.qk_norm=true",
       "--model.moe_experts=3", "--model.moe_top_k=2", "--model.moe_ffn_dim=24", "--model.moe_dense_layers=1",
       "--model.max_seq_len=32", "--train.seq_len=32", "--model.vocab_size=320", "--train.dtype=fp32"]  # fmt: skip


def config(meta: bool, seed: int):
    return load_config(None, [*MOE, f"--train.meta_init={str(meta).lower()}", f"--run.seed={seed}"])


def biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_buffers() if k.endswith("expert_bias")}


def main(store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))  # fmt: skip
    cpu, out_dir = torch.device("cpu"), Path(out)
    whole = CausalLMTrainModule(config(False, 0), 257, None, Layout(1, 1, 1), cpu, torch.float32).model
    state = dict(whole.state_dict())
    trained_bias = {k: torch.linspace(-0.1, 0.1, v.numel()) for k, v in biases(whole).items()}
    if dist.get_rank() == 0:
        hf.export_hf(state, whole.args, out_dir / "hf")
        hf.save_consolidated(state | trained_bias, whole.args, out_dir / "whole.safetensors")
    dist.barrier()
    fsdp = Layout(1, 2, 1)
    result: dict = {}
    for source in ("hf", "whole.safetensors"):
        module = CausalLMTrainModule(config(True, 1), 257, build_mesh(fsdp, "cpu"), fsdp, cpu, torch.float32)
        with weight_source(out_dir / source) as weights:
            result[f"{source}/read"] = stream_into(module.model, weights)
        params = dict(module.model.named_parameters())
        result[f"{source}/streamed"] = {k: p.to_local().detach().clone() for k, p in params.items()}
        result[f"{source}/expected"] = {k: state[k][local_slice(p)] for k, p in params.items()}
        result[f"{source}/bias"] = biases(module.model)
        result[f"{source}/expected_bias"] = (
            trained_bias if source != "hf" else {k: torch.zeros_like(v) for k, v in trained_bias.items()}
        )
    torch.save(result, out_dir / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
