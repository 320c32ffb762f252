"""Where liandan's training step spends its time on the CPU: torch.profiler over a few steps of the model of
`train_step.py`, built and stepped as `liandan train` does (`TrainModule`), after warm-up steps.

Prints the share of the step in each phase (forward with the loss, backward, gradient clipping, optimizer and
scheduler step with zero_grad), timed around each phase, and the operators that take the most time, as the
profiler sees them (compiled graphs show as Inductor's fused kernels and the matmuls they call). Operators are
also grouped by what they do: the output head's matmuls (those with the vocabulary as a dimension), the other
matmuls, attention, the cross-entropy, the optimizer, casts and copies, and the rest.

    python benchmarks/profile_step.py                          # bf16 and fp32, compiled
    python benchmarks/profile_step.py --dtypes bf16 --settings=--train.ce_chunks=4
    python benchmarks/profile_step.py --trace /tmp/step.json   # a Chrome trace of the last dtype as well
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from train_step import DTYPES, liandan_config, make_batches, model_args

from liandan.common.layout import Layout
from liandan.data.tokens.loader import Batch
from liandan.model import Transformer
from liandan.train.causal_lm import CausalLMTrainModule

PHASES = ("forward", "backward", "clip", "optimizer")


def kind_of(name: str, shapes: list, vocab: int) -> str:
    """What an operator (or fused kernel) of the step does, from its name and input shapes."""
    low = name.lower()
    if low in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul") or "mkldnn" in low:
        head = any(isinstance(s, list) and vocab in s for s in shapes)
        return "matmul: output head" if head else "matmul: blocks"
    if "attention" in low or "sdpa" in low or "flash" in low:
        return "attention"
    if "softmax" in low or "nll" in low or "cross_entropy" in low or "logsumexp" in low:
        return "cross-entropy"
    if "adam" in low or "foreach" in low or "optimizer" in low or "zero_" in low:
        return "optimizer and clip"
    if low in ("aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous") or "to_dtype" in low:
        return "casts and copies"
    if low.startswith("cpp_fused") or "graph_" in low or "compiled" in low:
        return "fused pointwise (compiled)"
    return "other"


def profile_dtype(name: str, opts: argparse.Namespace) -> dict:
    dtype = DTYPES[name]
    args = model_args(opts.seq_len)
    torch.manual_seed(opts.seed)
    state = Transformer(args).state_dict()
    settings = tuple(opts.settings)
    cfg = liandan_config(args, dtype, not opts.eager, settings)
    module = CausalLMTrainModule(cfg, args.vocab_size, None, Layout(1, 1, 1), torch.device("cpu"), dtype)
    module.model.load_state_dict(state)
    batches = make_batches(opts.warmup + opts.steps, opts.batch, opts.seq_len, args.vocab_size, opts.seed)
    times: dict[str, float] = defaultdict(float)

    def step(inputs: torch.Tensor, targets: torch.Tensor, timed: bool) -> None:
        batch = Batch(inputs, targets, torch.zeros_like(inputs))
        marks = [time.perf_counter()]
        with record_function("forward"), module._split(batch) as part:
            loss = module._micro_loss(part, 1)
        marks.append(time.perf_counter())
        with record_function("backward"):
            loss.backward()
        marks.append(time.perf_counter())
        with record_function("clip"):
            module.clip_grad_norm()
        marks.append(time.perf_counter())
        with record_function("optimizer"):
            module.optim_step()
        marks.append(time.perf_counter())
        if timed:
            for phase, start, end in zip(PHASES, marks[:-1], marks[1:], strict=True):
                times[phase] += end - start

    for inputs, targets in batches[: opts.warmup]:
        step(inputs, targets, timed=False)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for inputs, targets in batches[opts.warmup :]:
            step(inputs, targets, timed=True)
    if opts.trace:
        prof.export_chrome_trace(opts.trace)

    total = sum(times.values())
    events = prof.key_averages(group_by_input_shape=True)
    kinds: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    for e in events:
        if e.key in PHASES or e.key.startswith("ProfilerStep"):
            continue
        self_s = e.self_cpu_time_total / 1e6 / opts.steps
        ops[e.key] += self_s
        kinds[kind_of(e.key, e.input_shapes, args.vocab_size)] += self_s
    profiled = sum(kinds.values())
    return {
        "dtype": name,
        "settings": list(settings),
        "step_s": total / opts.steps,
        "threads": torch.get_num_threads(),
        "load": open("/proc/loadavg").read().split()[0],
        "phases": {p: times[p] / opts.steps for p in PHASES},
        "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "profiled_s": profiled,
        "top_ops": sorted(ops.items(), key=lambda kv: -kv[1])[: opts.top],
    }


def report(r: dict) -> None:
    step = r["step_s"]
    print(f"\n{r['dtype']} {' '.join(r['settings'])}: {1000 * step:.0f} ms per step (timed around the phases),"
          f" {r['threads']} threads, load average {r['load']}")  # fmt: skip
    for phase, s in r["phases"].items():
        print(f"  {phase:<10} {1000 * s:7.1f} ms  {100 * s / step:5.1f}%")
    print(f"  by kind of operator (self time, {1000 * r['profiled_s']:.0f} ms per step under the profiler):")
    for kind, s in r["kinds"].items():
        print(f"  {kind:<28} {1000 * s:7.1f} ms  {100 * s / r['profiled_s']:5.1f}%")
    print("  top operators (self time per step):")
    for op, s in r["top_ops"]:
        print(f"  {1000 * s:7.1f} ms  {100 * s / r['profiled_s']:5.1f}%  {op[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--steps", type=int, default=5, help="profiled steps")
    p.add_argument("--warmup", type=int, default=3, help="steps before (the first compiles)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eager", action="store_true", help="profile without train.compile")
    p.add_argument("--settings", action="append", default=[], help="a liandan config override; repeatable")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=None, help="write a Chrome trace of the last dtype here")
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    results = [profile_dtype(name.strip(), opts) for name in opts.dtypes.split(",") if name.strip()]
    for r in results:
        report(r)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
