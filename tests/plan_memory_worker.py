"""One rank of the planner's multi-process memory check: `python plan_memory_worker.py OUT ROOT NAMES
[OVERRIDE ...]` under RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.

Trains the runs NAMES (comma-separated keys of test_plan_memory.RUNS, with the OVERRIDES that make the
layout, e.g. --parallel.dp_shard=2 or --parallel.pp=2) one after the other with `liandan.train.Trainer`, as
tests/test_plan_memory.py does in one process (the same work per rank as its one-process runs): the kernel's peak-RSS mark reset before each, the peak less
the resident size before the Trainer was built, glibc's mmap threshold fixed so that freed tensors return to
the OS. Each run joins a process group of its own (MASTER_PORT + its index). Beside each measurement the
planner's estimate for this rank (`liandan.plan.layouts.evaluate`, fp32 as trained on the CPU): the
pipeline rank's memory where the layout has stages. Writes {name: [measured, estimated]} to
OUT/rank<r>.json, or {"refused": message} when the trainer refuses the layout.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
from pathlib import Path

# The one-process table's work per device on each of 2 data-parallel ranks: one sequence for the states runs,
# 16 for the activation runs.
PER_RANK = {"states": ["--train.global_batch=2"], "activations": ["--train.global_batch=32"]}


def estimate(cfg, rank: int) -> float:
    from liandan.plan.layouts import Candidate, Network, Workload, evaluate
    from liandan.plan.run_plan import plan_model_args

    p, t = cfg.parallel, cfg.train
    world = int(os.environ["WORLD_SIZE"])
    shard = p.dp_shard if p.dp_shard > 0 else world // (p.dp_replicate * p.tp * p.pp * p.cp)
    per_rank = t.global_batch // (p.dp_replicate * shard)
    if p.pp > 1:
        m = p.pp_microbatches or p.pp * p.pp_stages_per_rank
    else:
        m = per_rank // (t.micro_batch or per_rank)
    work = Workload(plan_model_args(cfg), t.seq_len, t.global_batch, 1e12, Network(), "fp32", "flash",
                    p.sequence_parallel, p.loss_parallel, t.ce_chunks, pp_layers=tuple(p.pp_layers))  # fmt: skip
    cand = Candidate(p.dp_replicate, shard, p.tp, p.pp, p.cp, p.ep, p.pp_schedule, p.pp_stages_per_rank, m,
                     per_rank // m, t.activation_checkpoint, p.cpu_offload)  # fmt: skip
    ranks = evaluate(work, cand).ranks
    stage = rank // (world // p.pp)  # pp is the outermost dim of the mesh
    return ranks[stage].total if p.pp > 1 else ranks[0].total


def main(out: str, root: str, names: str, *overrides: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from helpers import tiny_config
    from liandan.train import Trainer
    from test_plan_memory import M_MMAP_THRESHOLD, RUNS, _status

    rank = int(os.environ["RANK"])
    base_port = int(os.environ["MASTER_PORT"])
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    corpus = Path(root) / "corpus.jsonl"  # written by the test, read by every rank
    results: dict = {}
    for i, name in enumerate(["warm-up", *names.split(",")]):
        os.environ["MASTER_PORT"] = str(base_port + i)
        cfg = tiny_config(Path(root) / "runs", corpus, f"--run.name={name}", "--train.steps=2", "--train.mask=causal",
                          "--checkpoint.enabled=false",
                          "--guard.enabled=false", *RUNS.get(name, []),
                          *PER_RANK.get(name.split("-")[0], []), *overrides)  # fmt: skip
        gc.collect()
        libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        before = _status("VmRSS")
        try:
            trainer = Trainer(cfg, say=lambda message: None)
        except (ValueError, RuntimeError) as err:  # the layout refused before any step (ConfigError is a ValueError)
            results = {"refused": str(err).splitlines()[0]}
            break
        trainer.train()
        trainer.close()
        measured = _status("VmHWM") - before
        del trainer
        results[name] = [float(measured), estimate(cfg, rank)]
    results.pop("warm-up", None)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
