"""Peak memory and time of the head and its loss (final norm, output projection, cross-entropy), forward and
backward, with the logits made whole and with `train.ce_chunks` slices, against what `liandan plan` counts
for them.

A Llama-3-sized head by default: 128,256-token vocabulary, hidden size 4096, one sequence of 8192 tokens, bf16
autocast over fp32 weights. The gradients of the weights exist before the measured pass (a warm-up pass made
them; they are zeroed, not freed), so the peak is what the pass itself adds: the activations the planner's
"head and loss" line estimates.

    python benchmarks/chunked_ce.py                       # the first GPU, or the CPU (smaller by default)
    python benchmarks/chunked_ce.py --chunks 1 4 8 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from liandan.model import ModelArgs, Transformer
from liandan.plan.activations import activation_memory


def measure(model: Transformer, hidden: torch.Tensor, targets: torch.Tensor, chunks: int, device) -> dict:
    model.configure_loss(chunks)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step() -> float:
        h = hidden.detach().requires_grad_()
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            loss = model.head_loss(h, targets)
        loss.backward()
        return float(loss.detach())

    step()  # warm-up: kernels chosen, weight gradients allocated
    model.zero_grad(set_to_none=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    loss = step()
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else float("nan")
    times = []
    for _ in range(5):  # the fastest of five passes: a load spike lands on one of them
        model.zero_grad(set_to_none=False)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = min(times)
    return {"chunks": chunks, "loss": loss, "peak_gib": peak / 2**30, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=0, help="0: 128256 on a GPU, 32000 on the CPU")
    parser.add_argument("--dim", type=int, default=0, help="0: 4096 on a GPU, 512 on the CPU")
    parser.add_argument("--tokens", type=int, default=0, help="0: 8192 on a GPU, 2048 on the CPU")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--json", default="")
    opts = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    vocab, dim, tokens = opts.vocab or (128256 if gpu else 32000), opts.dim or (4096 if gpu else 512), opts.tokens
    tokens = tokens or (8192 if gpu else 2048)
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=vocab, dim=dim, n_layers=1, n_heads=dim // 128, max_seq_len=tokens)
    model = Transformer(args).to(device)
    hidden = torch.randn(1, tokens, dim, device=device)
    targets = torch.randint(0, vocab, (1, tokens), device=device)
    rows = []
    for chunks in opts.chunks:
        row = measure(model, hidden, targets, chunks, device)
        planned = activation_memory(args, micro_batch=1, seq_len=tokens, dtype="bf16" if gpu else "fp32",
                                    ce_chunks=chunks).head  # fmt: skip
        row["planned_gib"] = planned / 2**30
        rows.append(row)
        print(
            f"ce_chunks={chunks:3d}  loss {row['loss']:.6f}  peak {row['peak_gib']:7.3f} GiB"
            f"  planned {row['planned_gib']:7.3f} GiB  {row['seconds'] * 1e3:8.1f} ms"
        )
    if opts.json:
        meta = {"device": torch.cuda.get_device_name() if gpu else "cpu", "vocab": vocab, "dim": dim, "tokens": tokens}
        with open(opts.json, "w") as handle:
            json.dump({**meta, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
