"""One rank of the sharded-scoring test: `python eval_shard_worker.py CASE OUT` under RANK/WORLD_SIZE/MASTER_*.
Scores the case's requests with the model sharded by FSDP2 over the ranks, then with it split by tensor
parallelism, and writes what it got to OUT/rank<r>.json; the test compares that with one process's answers.
`score_case` is the one computation both sides run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from liandan.evaluate import scoring
from liandan.model import ModelArgs, Transformer


def build(case: dict) -> Transformer:
    model = Transformer(ModelArgs(**case["args"]))
    model.load_state_dict(case["state"])
    return model


def score_case(model, case: dict) -> dict:
    return {
        "loglikelihoods": scoring.loglikelihoods(model, case["requests"], batch_size=3),
        "rolling": scoring.rolling_loglikelihoods(
            model, case["documents"], max_len=case["rolling_max_len"], prefix_token=0, batch_size=3
        ),
        "generated": scoring.generate(model, case["prompts"], max_new_tokens=case["max_new_tokens"], batch_size=3),
    }


def main(case_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from liandan.common.layout import Layout
    from liandan.train.parallelize import build_mesh, parallelize

    torch.set_num_threads(1)  # two ranks share the machine's cores: threads that wait on each other cost most
    case = torch.load(case_path)
    dist.init_process_group("gloo")
    results = {}
    # "tp_sp": tensor parallel as training sets it up by default, the loss over the vocabulary shards and
    # sequence parallelism between the blocks
    for name, layout, split in (("fsdp", Layout(1, 2, 1), False), ("tp", Layout(1, 1, 2), False),
                                ("tp_sp", Layout(1, 1, 2), True)):  # fmt: skip
        mesh = build_mesh(layout, "cpu")
        model = parallelize(build(case), mesh, layout, loss_parallel=split, sequence_parallel=split)
        results[name] = score_case(model, case)
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
