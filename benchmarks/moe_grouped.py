"""The dropless expert computation on this CPU: `torch._grouped_mm` (one grouped kernel for every expert)
against the per-expert loop of `liandan.model.moe.grouped_matmul`, forward and backward, fp32 and bf16.

    python benchmarks/moe_grouped.py                 # 8 experts, 4096 routed rows of width 512, hidden 1024
    python benchmarks/moe_grouped.py --experts 64 --rows 8192 --repeat 20 --threads 2

First the kernel's correctness against the loop on the shapes that matter (an empty expert first, in the
middle and last; every row with one expert; rows beyond the last offset, as a capacity limit leaves), forward
and both gradients; then the time of a SwiGLU expert layer (w1, w3, w2, as `GroupedExperts` runs it) forward
and backward, each way, as medians of `--repeat` timed runs after two warm-up runs, in alternating turns so
load from other processes lands on both. Printed: ms per way and the loop / grouped ratio (> 1: grouped is
faster), per dtype. The routing is random and uneven (Dirichlet shares), as a router early in training gives.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from liandan.model.moe import grouped_matmul


def loop_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return grouped_matmul(x, weight, counts)  # off CUDA: the per-expert loop


def kernel_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


def correctness(dtype: torch.dtype) -> list[str]:
    """Problems found with the grouped kernel against the loop (empty when it agrees everywhere)."""
    problems = []
    torch.manual_seed(0)
    cases = {"empty first": [0, 5, 3, 8], "empty middle": [4, 0, 7, 5], "empty last": [6, 6, 4, 0],
             "one expert": [0, 16, 0, 0], "tiny": [1, 1, 1, 1]}  # fmt: skip
    tol = 0.0 if dtype == torch.float32 else 1e-2
    for name, counts in cases.items():
        counts = torch.tensor(counts)
        rows = int(counts.sum())
        x = torch.randn(rows, 16, dtype=dtype, requires_grad=True)
        w = torch.randn(len(counts), 24, 16, dtype=dtype, requires_grad=True)
        try:
            got = kernel_mm(x, w, counts)
            want = loop_mm(x, w, counts)
            grad = torch.randn_like(want)
            gx, gw = torch.autograd.grad(got, (x, w), grad)
            rx, rw = torch.autograd.grad(want, (x, w), grad)
        except (RuntimeError, NotImplementedError) as err:
            problems.append(f"{name}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
            continue
        for what, a, b in (("forward", got, want), ("grad x", gx, rx), ("grad w", gw, rw)):
            diff = (a.float() - b.float()).abs().max().item()
            if diff > tol * max(1.0, b.float().abs().max().item()):
                problems.append(f"{name}: {what} differs by {diff:.3g}")
    return problems


def expert_layer(mm, x, w1, w3, w2, counts) -> torch.Tensor:
    h = F.silu(mm(x, w1, counts)) * mm(x, w3, counts)
    return mm(h, w2, counts)


def time_once(mm, tensors, counts) -> float:
    x, w1, w3, w2 = tensors
    start = time.perf_counter()
    out = expert_layer(mm, x, w1, w3, w2, counts)
    out.float().square().mean().backward()
    elapsed = time.perf_counter() - start
    for t in tensors:
        t.grad = None
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4096, help="routed (token, expert) rows")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", default="")
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    results = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "shape": vars(a), "dtypes": {}}  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        problems = correctness(dtype)
        torch.manual_seed(1)
        shares = torch.distributions.Dirichlet(torch.ones(a.experts)).sample()
        counts = torch.bincount(torch.multinomial(shares, a.rows, replacement=True), minlength=a.experts)
        tensors = [torch.randn(a.rows, a.dim, dtype=dtype, requires_grad=True)]
        tensors += [(torch.randn(a.experts, a.hidden, a.dim, dtype=dtype) * 0.02).requires_grad_() for _ in range(2)]
        tensors += [(torch.randn(a.experts, a.dim, a.hidden, dtype=dtype) * 0.02).requires_grad_()]
        times: dict[str, list[float]] = {"loop": [], "grouped": []}
        ways = {"loop": loop_mm, "grouped": kernel_mm}
        for turn in range(a.repeat + 2):
            for way, mm in ways.items():
                seconds = time_once(mm, tensors, counts)
                if turn >= 2:
                    times[way].append(seconds)
        loop, grouped = (statistics.median(times[w]) * 1e3 for w in ("loop", "grouped"))
        results["dtypes"][name] = {"loop_ms": loop, "grouped_ms": grouped, "ratio": loop / grouped,
                                   "problems": problems}  # fmt: skip
        verdict = "agrees with the loop" if not problems else "; ".join(problems)
        print(f"{name}: loop {loop:.1f} ms, grouped {grouped:.1f} ms, loop/grouped {loop / grouped:.2f}x;"
              f" kernel {verdict}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
