"""One rank of the pipeline-parallel tests: `python pipeline_worker.py OUT PP DP_SHARD RUNS [TP [EP]]` under
RANK/WORLD_SIZE/MASTER_* with PP x DP_SHARD x TP ranks (EP of the DP_SHARD ranks split the experts). RUNS is
a comma-separated list of SCHEDULE:STAGES_PER_RANK, each with `:moe` for the mixture-of-experts model (every
block but the first routes to 2 of 4 experts, with DeepSeek-V3's balancing bias, a load-balancing loss and a
router z-loss), whose entries also give both models' balancing biases after each step.

For each run the rank builds liandan's pipeline train module from a config (a tiny Llama of 8 blocks, fp32,
AdamW, gradient clipping at 1.0) and trains it for a few steps on batches drawn from a fixed seed, each
data-parallel rank its own rows; rank 0 also trains the whole model in this process (the dense train module)
on all the rows, in the same micro-batches. Writes, per run, both models' per-step losses and gradient
norms, the largest difference of each of this rank's parameters from the whole model's after the last
step, and the evaluation loss of both, to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB, SEQ, ROWS, STEPS = 64, 16, 8, 3
MODEL = ["--model.dim=32", "--model.n_layers=8", "--model.n_heads=4", "--model.n_kv_heads=2",
         f"--model.max_seq_len={SEQ}", f"--model.vocab_size={VOCAB}", f"--train.seq_len={SEQ}",
         f"--train.steps={STEPS}", "--train.dtype=fp32", "--optim.lr=1e-2", "--optim.grad_clip=1.0",
         "--schedule.warmup_steps=1", "--data.tokenizer=byte"]  # fmt: skip
MOE = ["--model.moe_experts=4", "--model.moe_top_k=2", "--model.moe_ffn_dim=32", "--model.moe_dense_layers=1",
       "--model.moe_bias_rate=1e-2", "--model.moe_aux_loss=1e-2", "--model.moe_z_loss=1e-3"]  # fmt: skip


def batches(step: int, dp_size: int, microbatches: int):
    """The step's global batch as `dp_size` lists of `microbatches` Batches: two documents per row."""
    from liandan.data.tokens.loader import Batch

    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (dp_size * ROWS, SEQ + 1), generator=generator)
    doc_ids = (torch.arange(SEQ) >= SEQ // 3).int().expand(dp_size * ROWS, SEQ)
    whole = Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), doc_ids.contiguous())
    size = ROWS // microbatches
    per_rank = []
    for r in range(dp_size):
        rows = slice(r * ROWS, (r + 1) * ROWS)
        per_rank.append([Batch(*(t[rows][i * size:(i + 1) * size] for t in (whole.inputs, whole.targets, whole.doc_ids)))
                         for i in range(microbatches)])  # fmt: skip
    return per_rank


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(module, steps_batches, eval_rows):
    losses, norms, biases = [], [], []
    for step, rows in enumerate(steps_batches, start=1):
        losses.append(float(module.train_batch(rows, lambda *a, **k: None, step)))
        norms.append(module.clip_grad_norm())
        module.optim_step()
        if module.routing is not None:
            biases.append(module.routing.bias.tolist())
    return losses, norms, float(module.eval_batch(eval_rows)), biases


def main(out_dir: str, pp: int, dp_shard: int, runs: str, tp: int = 1, ep: int = 1) -> None:
    from liandan.common.layout import Layout
    from liandan.config import load_config
    from liandan.train.causal_lm import CausalLMTrainModule
    from liandan.train.parallelize import build_mesh, dp_coordinates
    from liandan.train.pipeline import PipelineTrainModule

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    layout = Layout(1, dp_shard, tp, pp=pp, ep=ep)
    mesh = build_mesh(layout, "cpu")
    dp_rank, dp_size = dp_coordinates(mesh, layout)
    cpu = torch.device("cpu")
    report = {}
    for run in runs.split(","):
        schedule, per_rank, *kind = run.split(":")
        model = [*MODEL, *MOE] if kind == ["moe"] else MODEL
        microbatches = pp * int(per_rank)
        cfg = load_config(None, [*model, f"--parallel.pp={pp}", f"--parallel.ep={ep}", f"--parallel.dp_shard={dp_shard}",
                                 f"--parallel.pp_schedule={schedule}", f"--parallel.pp_stages_per_rank={per_rank}",
                                 f"--train.global_batch={ROWS * dp_size}", f"--parallel.tp={tp}", "--parallel.sequence_parallel=false"])  # fmt: skip
        steps = [batches(s, dp_size, microbatches) for s in range(STEPS)]
        eval_rows = batches(99, dp_size, microbatches)
        module = PipelineTrainModule(cfg, VOCAB, mesh, layout, cpu, torch.float32)
        # the trainer's micro-batch is the rank's whole batch: the schedule splits it into its micro-batches
        joined = [[_join(rows)] for rows in (s[dp_rank] for s in steps)]
        losses, norms, eval_loss, biases = train(module, joined, [_join(eval_rows[dp_rank])])
        mean = torch.tensor([*losses, eval_loss], dtype=torch.float64)
        dist.all_reduce(mean)
        mean /= dist.get_world_size()  # the ranks of a pipeline group hold the same loss
        entry = {"losses": mean[:-1].tolist(), "norms": norms, "eval": float(mean[-1]),
                 "stages": module.stage_ids, "layers": module.stage_layers, "biases": biases}  # fmt: skip
        if dist.get_rank() == 0:
            ref_cfg = load_config(None, [*model, f"--train.global_batch={ROWS * dp_size}",
                                         f"--train.micro_batch={ROWS // microbatches}"])  # fmt: skip
            reference = CausalLMTrainModule(ref_cfg, VOCAB, None, Layout(1, 1, 1), cpu, torch.float32)
            flat = [[b for rows in s for b in rows] for s in steps]
            ref_losses, ref_norms, ref_eval, ref_biases = train(
                reference, flat, [b for rows in eval_rows for b in rows]
            )
            entry.update(ref_losses=ref_losses, ref_norms=ref_norms, ref_eval=ref_eval, ref_biases=ref_biases)
            ref_params = dict(reference.model.named_parameters())
        objects = [None] * dist.get_world_size()
        mine = {name: _whole(p).detach() for part in module.model_parts for name, p in part.named_parameters()}
        dist.all_gather_object(objects, mine)
        if dist.get_rank() == 0:
            gathered = {k: v for d in objects for k, v in d.items()}
            assert gathered.keys() == ref_params.keys(), sorted(set(ref_params) ^ set(gathered))
            entry["param_diff"] = max(float((gathered[k] - p).abs().max()) for k, p in ref_params.items())
        report[run] = entry
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _join(rows):
    from liandan.data.tokens.loader import Batch

    return Batch(*(torch.cat([getattr(b, f) for b in rows]) for f in ("inputs", "targets", "doc_ids")))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *map(int, sys.argv[5:]))
