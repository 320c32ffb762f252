"""Evaluation throughput: liandan's evaluator against lm-evaluation-harness's Hugging Face model (`HFLM`) on
the same checkpoint exported through `liandan export --hf`'s writer, the same tasks, the same machine, in one
run.

One liandan Llama (random weights: throughput does not depend on them) and a byte-level BPE tokenizer trained
on Python's own documentation are written as a Hugging Face directory; two lm-eval tasks are written as local
jsonl files from the same documentation:

* cloze (multiple choice, log-likelihood): four lines of the documentation, and four candidate next lines
  (the true one and three others drawn with a fixed seed), the context about three times a choice's length,
  as a short few-shot prompt would be;
* complete (generation): the first 64 characters of a line, continued greedily until a newline or
  --max-gen-toks tokens.

lm-eval builds each task's requests once (its Instances, from the local files); each model answers the
same requests through lm-eval's model interface (`loglikelihood` for the cloze, `generate_until` for the
completion), batch size --batch-size, once on a few requests untimed, then in interleaved rounds (the best
round of each is reported, so a load spike from another process lands on one round, not on one model):

* liandan: the "liandan" lm-eval model (`liandan.evaluate.lm_eval_bridge.LiandanLM`) on the liandan model:
  text encoded as lm-eval encodes it, batched scoring and KV-cache generation from `liandan.evaluate.scoring`;
* hf transformers: `HFLM(pretrained=<export>)`, transformers' `LlamaForCausalLM` (SDPA) and its `generate`;
* liandan scoring alone: `scoring.loglikelihoods` / `scoring.generate` on the same requests tokenized
  beforehand, without lm-eval's request handling (what liandan's own task runner calls).

Examples/s is the task's documents over the seconds of the call (the cloze has four requests per document).
What lm-eval does around the model (building datasets and requests, metrics) is the same for both and is
left out: with a small model it would be most of the time. The two must agree: the largest difference of a
per-request log-likelihood and the share of identical generations are printed beside the speeds.

    python benchmarks/bench_eval.py                   # CPU or the first GPU
    python benchmarks/bench_eval.py --docs 64 --rounds 3 --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before lm-eval and datasets are imported: nothing downloads
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from liandan.checkpoint.hf import export_hf
from liandan.data.tokens.tokenizer import train_bpe
from liandan.evaluate import scoring
from liandan.model import ModelArgs, Transformer, count_params


def documentation_lines() -> list[str]:
    from pydoc_data.topics import topics

    lines = []
    for name in sorted(topics):
        lines += [line.strip() for line in topics[name].splitlines() if 40 <= len(line.strip()) <= 160]
    return lines


def write_tasks(directory: Path, lines: list[str], docs: int, max_gen_toks: int) -> None:
    rng = random.Random(0)
    cloze, complete = [], []
    for i in rng.sample(range(3, len(lines) - 1), docs):
        choices = [lines[i + 1], *rng.sample(lines, 3)]
        rng.shuffle(choices)
        passage = "\n".join(lines[i - 3 : i + 1])
        cloze.append({"context": passage, "choices": choices, "answer": choices.index(lines[i + 1])})
        complete.append({"prompt": lines[i][:64], "rest": lines[i][64:]})
    cloze_body = (
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
    )
    complete_body = (
        'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{rest}}"\n'
        f'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: {max_gen_toks}\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    for name, rows, body in (("bench_cloze", cloze, cloze_body), ("bench_complete", complete, complete_body)):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
            + body
        )


def task_requests(task: str, task_manager) -> tuple[list, int]:
    """lm-eval's requests for a task (its Instances, built once; both models answer the same ones) and the
    number of documents they come from."""
    from lm_eval.tasks import get_task_dict

    built = get_task_dict([task], task_manager)[task]
    built.build_all_requests(rank=0, world_size=1)
    return built.instances, len({instance.doc_id for instance in built.instances})


def timed_answers(lm, task: str, instances: list) -> tuple[float, list]:
    """Seconds for the model to answer the task's requests through lm-eval's LM interface, and the answers."""
    start = time.perf_counter()
    if task == "bench_cloze":
        answers = lm.loglikelihood(instances, disable_tqdm=True)
    else:
        answers = lm.generate_until(instances, disable_tqdm=True)
    return time.perf_counter() - start, answers


def timed_scoring(model, tokenizer, instances: list, task: str, batch_size: int, max_gen_toks: int, stops) -> float:
    """liandan's scoring on the same requests, tokenized before the clock starts (what liandan's own task
    runner calls, without lm-eval's request handling around it), with the bridge's stop tokens."""

    def encode(text: str) -> list[int]:
        return tokenizer.encode_batch([text])[0]

    if task == "bench_cloze":
        pairs = [instance.args for instance in instances]
        requests = [(encode(c), encode(c + x)[len(encode(c)) :]) for c, x in pairs]
        start = time.perf_counter()
        scoring.loglikelihoods(model, requests, batch_size=batch_size)
    else:
        prompts = [encode(instance.args[0]) for instance in instances]
        start = time.perf_counter()
        scoring.generate(model, prompts, max_new_tokens=max_gen_toks, stop_sequences=stops, eos_id=tokenizer.eos_id,
                         batch_size=batch_size, keep_stop=True)  # fmt: skip
    return time.perf_counter() - start


def agreement(task: str, ours: list, theirs: list) -> str:
    if task == "bench_cloze":
        return f"max |d loglik| {max(abs(a[0] - b[0]) for a, b in zip(ours, theirs, strict=True)):.2e}"
    return f"identical generations {sum(a == b for a, b in zip(ours, theirs, strict=True))}/{len(ours)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=48, help="documents per task")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-gen-toks", type=int, default=32)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's); one is steadier on a "
        "machine that other processes share, where threads that wait on each other lose most",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)

    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from liandan.evaluate.lm_eval_bridge import LiandanLM

    work = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    lines = documentation_lines()
    tokenizer = train_bpe(lines, opts.vocab)
    tokenizer.save(work / "tokenizer.json")
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=opts.vocab, dim=opts.dim, n_layers=opts.layers, n_heads=opts.dim // 64,
                     n_kv_heads=opts.dim // 128, max_seq_len=512, attention="sdpa")  # fmt: skip
    model = Transformer(args)
    export_hf({k: v.detach() for k, v in model.state_dict().items()}, args, work / "hf", work / "tokenizer.json")
    device = torch.device(opts.device)
    model = model.to(device).eval()
    model.configure_attention(device, training=False)
    write_tasks(work, lines, opts.docs, opts.max_gen_toks)
    tasks = TaskManager(include_path=str(work))

    ours = LiandanLM(model=model, tokenizer=tokenizer, batch_size=opts.batch_size, max_gen_toks=opts.max_gen_toks)
    # the task's generation_kwargs set max_gen_toks for both
    theirs = HFLM(pretrained=str(work / "hf"), device=opts.device, batch_size=opts.batch_size, dtype="float32",
                  add_bos_token=False)  # fmt: skip
    load = os.getloadavg()[0]
    results = {}
    for task in ("bench_cloze", "bench_complete"):
        instances, docs = task_requests(task, tasks)
        names = ("liandan", "hf transformers", "liandan scoring alone")
        best = dict.fromkeys(names, float("inf"))
        timed_answers(ours, task, instances[:8])  # warm-up, untimed: allocator, threads
        timed_answers(theirs, task, instances[:8])
        for _ in range(opts.rounds):
            seconds, our_answers = timed_answers(ours, task, instances)
            best["liandan"] = min(best["liandan"], seconds)
            seconds, their_answers = timed_answers(theirs, task, instances)
            best["hf transformers"] = min(best["hf transformers"], seconds)
            stops = ours._stop_tokens("\n")
            seconds = timed_scoring(model, tokenizer, instances, task, opts.batch_size, opts.max_gen_toks, stops)
            best["liandan scoring alone"] = min(best["liandan scoring alone"], seconds)
        results[task] = {
            "docs": docs,
            "requests": len(instances),
            "examples_per_s": {name: docs / s for name, s in best.items()},
            "ratio_liandan_over_hf": best["hf transformers"] / best["liandan"],
            "agreement": agreement(task, our_answers, their_answers),
        }
    import lm_eval
    import transformers

    setup = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "lm_eval": lm_eval.__version__, "python": platform.python_version(),
        "params": count_params(args).total, "dim": opts.dim, "layers": opts.layers, "vocab": opts.vocab,
        "docs": opts.docs, "rounds": opts.rounds, "batch_size": opts.batch_size, "max_gen_toks": opts.max_gen_toks,
        "load_start": load, "load_end": os.getloadavg()[0], "command": " ".join(sys.argv),
    }  # fmt: skip
    print(json.dumps(setup))
    print(f"{'task':<16}{'model':<24}{'examples/s':>12}")
    for task, result in results.items():
        for name, rate in result["examples_per_s"].items():
            print(f"{task:<16}{name:<24}{rate:>12.2f}")
        print(f"{task:<16}liandan / hf: {result['ratio_liandan_over_hf']:.2f}x; {result['agreement']}")
    if opts.json:
        opts.json.write_text(json.dumps({"setup": setup, "results": results}, indent=2))


if __name__ == "__main__":
    main()
