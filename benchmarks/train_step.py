"""Training-step throughput on the CPU: liandan against Hugging Face transformers and a plain PyTorch loop.

All implementations train the same ~10M-parameter Llama (RMSNorm, rotary embeddings, SwiGLU, causal SDPA) on
the same seeded random token batches, starting from the same weights, in the same process, fp32 and bf16 (bf16
only where the CPU has native bf16 arithmetic). For each dtype the script prints tokens/s of every
implementation, the ratio liandan / best peer, and liandan's MFU against the square-matmul peak measured in the
same run.

    python benchmarks/train_step.py                       # the full run, minutes on 2 cores
    python benchmarks/train_step.py --steps 4 --warmup 2  # a quick look
    python benchmarks/train_step.py --threads 1 --liandan-settings="--train.ce_fused=true --train.ce_chunks=4"

Implementations:

* liandan: `liandan.train.module.TrainModule` built from a config as `liandan train` builds it (`train.compile`,
  causal mask, SDPA, constant schedule; `--liandan-settings` adds variants with other settings), stepped as
  `Trainer.train` steps it: forward and backward (autocast to bf16 over fp32 master weights), clip, optimizer
  and scheduler step. Compiled by default (`--liandan-modes eager,compile` adds the eager one).
* hf: `transformers.LlamaForCausalLM` with `attn_implementation="sdpa"`; plain: a compact Llama written below.
  Each peer runs in the configurations of `--peer-modes`: `compile` (`model.compile()`, fused AdamW),
  `compile+opt` (`model.compile()`, clip and foreach AdamW step in one `torch.compile`d function) and `eager`
  (torch's default AdamW). The fastest peer configuration is the reference.

The implementations are timed in interleaved rounds (each runs steps/rounds steps in turn), so a load spike from
another process on the machine is shared between them rather than landing on one. The summary gives liandan /
best peer by tokens/s over all timed steps and by the fastest single step (the least disturbed by other
processes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from liandan.common.layout import Layout
from liandan.config import Config, load_config
from liandan.data.tokens.loader import Batch
from liandan.model import ModelArgs, Transformer, count_params, flops_per_token
from liandan.train.causal_lm import CausalLMTrainModule
from liandan.train.hardware import cpu_supports_bf16, measure_matmul_flops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PEERS = ("hf", "plain")


def model_args(seq_len: int) -> ModelArgs:
    """~10.3M parameters: 8192 vocabulary, 4 layers of width 320 (5 heads of 64), SwiGLU hidden 896, untied."""
    return ModelArgs(
        vocab_size=8192,
        dim=320,
        n_layers=4,
        n_heads=5,
        n_kv_heads=5,
        ffn_dim=896,
        max_seq_len=seq_len,
        attention="sdpa",
    )


# ---------------------------------------------------------------------------------------------------------
# the plain PyTorch peer


class PlainBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.eps = a.n_heads, a.n_kv_heads, a.head_dim, a.norm_eps
        self.attn_norm = nn.Parameter(torch.ones(a.dim))
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(a.dim))
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = rms_norm(x, self.attn_norm, self.eps)
        q = self.wq(h).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = rms_norm(x, self.ffn_norm, self.eps)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class PlainLlama(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.eps = a.norm_eps
        self.embed = nn.Embedding(a.vocab_size, a.dim)
        self.blocks = nn.ModuleList(PlainBlock(a) for _ in range(a.n_layers))
        self.norm = nn.Parameter(torch.ones(a.dim))
        self.head = nn.Linear(a.dim, a.vocab_size, bias=False)
        inv_freq = 1.0 / a.rope_theta ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim)
        angles = torch.outer(torch.arange(a.max_seq_len).float(), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t])
        logits = self.head(rms_norm(x, self.norm, self.eps))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).type_as(x)


# ---------------------------------------------------------------------------------------------------------
# weights: every implementation starts from the reference liandan model's weights


def liandan_to_plain(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    out = {
        "embed.weight": state["tok_embeddings.weight"],
        "norm": state["norm.weight"],
        "head.weight": state["output.weight"],
    }
    for i in range(n_layers):
        p = f"layers.{i}."
        out[f"blocks.{i}.attn_norm"] = state[p + "attention_norm.weight"]
        out[f"blocks.{i}.ffn_norm"] = state[p + "ffn_norm.weight"]
        for name in ("wq", "wk", "wv", "wo"):
            out[f"blocks.{i}.{name}.weight"] = state[p + f"attention.{name}.weight"]
        for name in ("w1", "w2", "w3"):
            out[f"blocks.{i}.{name}.weight"] = state[p + f"feed_forward.{name}.weight"]
    return out


def liandan_to_hf(state: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    out = {
        "model.embed_tokens.weight": state["tok_embeddings.weight"],
        "model.norm.weight": state["norm.weight"],
        "lm_head.weight": state["output.weight"],
    }
    names = {
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w3": "mlp.up_proj",
        "feed_forward.w2": "mlp.down_proj",
    }
    for i in range(n_layers):
        for ours, theirs in names.items():
            out[f"model.layers.{i}.{theirs}.weight"] = state[f"layers.{i}.{ours}.weight"]
    return out


# ---------------------------------------------------------------------------------------------------------
# the implementations, each as a model and a step function


@dataclass
class Variant:
    name: str  # e.g. "liandan (compile)"
    family: str  # "liandan", "hf" or "plain"
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # one full training step; returns the loss
    model: nn.Module
    first_step_s: float = 0.0
    warmup_s: float = 0.0
    step_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def autocast(dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


def liandan_config(args: ModelArgs, dtype: torch.dtype, compile: bool, settings: tuple[str, ...] = ()) -> Config:
    """The `[model]` and `[train]` settings of a `liandan train` run of this model, with `settings` (overrides
    as on the command line) on top."""
    return load_config(
        None,
        [
            f"--model.vocab_size={args.vocab_size}",
            f"--model.dim={args.dim}",
            f"--model.n_layers={args.n_layers}",
            f"--model.n_heads={args.n_heads}",
            f"--model.n_kv_heads={args.n_kv_heads}",
            f"--model.ffn_dim={args.ffn_dim}",
            f"--model.max_seq_len={args.max_seq_len}",
            "--model.attention=sdpa",
            f"--train.seq_len={args.max_seq_len}",
            f"--train.dtype={'fp32' if dtype == torch.float32 else 'bf16'}",
            f"--train.compile={str(compile).lower()}",
            "--train.mask=causal",  # the peers attend causally: packed documents would add a mask to liandan only
            "--schedule.kind=constant",
            "--schedule.warmup_steps=0",
            "--data.tokenizer=byte",
            *settings,
        ],
    )


def build_liandan(
    args: ModelArgs, state: dict, dtype: torch.dtype, compile: bool, settings: tuple[str, ...] = ()
) -> Variant:
    """liandan's `TrainModule` as `Trainer` builds it, stepped as `Trainer.train` steps it: forward and backward
    over the micro-batches, clip, optimizer and scheduler step."""
    cfg = liandan_config(args, dtype, compile, settings)
    module = CausalLMTrainModule(cfg, args.vocab_size, None, Layout(1, 1, 1), torch.device("cpu"), dtype)
    module.model.load_state_dict(state)

    def no_phase(*_args, **_kwargs) -> None:
        pass

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = module.train_batch([Batch(inputs, targets, torch.zeros_like(inputs))], no_phase)
        module.clip_grad_norm()
        module.optim_step()
        return loss

    name = "liandan (compile)" if compile else "liandan (eager)"
    if settings:
        name += " " + " ".join(settings)
    return Variant(name, "liandan", step, module.model)


PEER_MODES = ("eager", "compile", "compile+opt")


def peer_update(model: nn.Module, mode: str) -> Callable[[], None]:
    """Clip, AdamW step and zero_grad of a peer, each mode as a user would write it: `eager` torch's default
    AdamW (foreach); `compile` the fused AdamW kernel; `compile+opt` clip and the foreach AdamW step traced
    together by torch.compile (one graph over every parameter, as PyTorch's compiled-optimizer recipe does)."""
    params = list(model.parameters())
    if mode == "compile":
        optimizer = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=True)
    else:
        optimizer = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, foreach=True)

    def clip_and_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()

    if mode == "compile+opt":
        clip_and_step = torch.compile(clip_and_step, dynamic=False)

    def update() -> None:
        clip_and_step()
        optimizer.zero_grad(set_to_none=True)

    return update


def peer_model(model: nn.Module, mode: str) -> nn.Module:
    if mode != "eager":
        model.compile(dynamic=False)  # in place, whole graph: the model's forward with its loss
    return model


def build_hf(args: ModelArgs, state: dict, dtype: torch.dtype, mode: str = "eager") -> Variant:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    model.load_state_dict(liandan_to_hf(state, args.n_layers), strict=False)  # strict=False: rotary buffers
    model.train()
    update = peer_update(model, mode)
    model = peer_model(model, mode)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast(dtype):
            # shift_labels: the targets are already shifted, so every implementation trains on the same pairs.
            loss = model(input_ids=inputs, labels=targets, shift_labels=targets, use_cache=False).loss
        loss.backward()
        update()
        return loss.detach()

    return Variant(f"hf transformers ({mode})", "hf", step, model)


def build_plain(args: ModelArgs, state: dict, dtype: torch.dtype, mode: str = "eager") -> Variant:
    model = PlainLlama(args)
    model.load_state_dict(liandan_to_plain(state, args.n_layers))
    update = peer_update(model, mode)
    model = peer_model(model, mode)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast(dtype):
            loss = model(inputs, targets)
        loss.backward()
        update()
        return loss.detach()

    return Variant(f"plain pytorch ({mode})", "plain", step, model)


# ---------------------------------------------------------------------------------------------------------
# measurement


def make_batches(n: int, batch: int, seq_len: int, vocab: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def initial_losses(args: ModelArgs, state: dict, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
    """fp32 forward loss of each implementation on one batch from the shared weights: they must agree."""
    inputs, targets = batch
    out = {}
    with torch.no_grad():
        m = Transformer(args)
        m.load_state_dict(state)
        m.configure_attention(torch.device("cpu"))
        out["liandan"] = float(m(inputs, targets))
        out["plain"] = float(build_plain(args, state, torch.float32).model(inputs, targets))
        hf = build_hf(args, state, torch.float32).model
        out["hf"] = float(hf(input_ids=inputs, labels=targets, shift_labels=targets, use_cache=False).loss)
    return out


def measure_peak(dtype: torch.dtype, sizes: tuple[int, ...], seconds: float) -> float:
    """The best square-matmul FLOP/s over a few sizes: the practical peak MFU is measured against."""
    return max(measure_matmul_flops(dtype, size=s, seconds=seconds) for s in sizes)


def run_dtype(
    dtype_name: str,
    args: ModelArgs,
    state: dict,
    batches: list,
    opts: argparse.Namespace,
    say: Callable[[str], None],
) -> dict:
    dtype = DTYPES[dtype_name]
    torch._dynamo.reset()
    peak_before = measure_peak(dtype, opts.peak_sizes, opts.peak_seconds)
    variants = []
    if "liandan" in opts.impls:
        for mode in opts.liandan_modes:
            variants.append(build_liandan(args, state, dtype, mode == "compile"))
        for settings in opts.liandan_settings:
            variants.append(build_liandan(args, state, dtype, True, tuple(settings.split())))
    for mode in opts.peer_modes:
        if "hf" in opts.impls:
            variants.append(build_hf(args, state, dtype, mode))
        if "plain" in opts.impls:
            variants.append(build_plain(args, state, dtype, mode))

    warm, timed = batches[: opts.warmup], batches[opts.warmup :]
    for v in variants:
        start = time.perf_counter()
        v.losses.append(float(v.step(*warm[0])))
        v.first_step_s = time.perf_counter() - start
        start = time.perf_counter()
        for inputs, targets in warm[1:]:
            v.step(inputs, targets)
        v.warmup_s = time.perf_counter() - start
        say(f"  {dtype_name} {v.name}: first step {v.first_step_s:.2f}s (includes compilation where compiled)")

    # Interleaved rounds: each variant runs its share of the timed steps in turn, on the same batches.
    rounds = max(1, min(opts.rounds, len(timed)))
    chunks = [timed[i * len(timed) // rounds : (i + 1) * len(timed) // rounds] for i in range(rounds)]
    for chunk in chunks:
        for v in variants:
            for inputs, targets in chunk:
                start = time.perf_counter()
                loss = v.step(inputs, targets)
                v.step_times.append(time.perf_counter() - start)
            v.losses.append(float(loss))
    peak = max(peak_before, measure_peak(dtype, opts.peak_sizes, opts.peak_seconds))

    tokens_per_step = opts.batch * opts.seq_len
    fpt = flops_per_token(args, opts.seq_len)
    rows = {}
    for v in variants:
        total = sum(v.step_times)
        tps = tokens_per_step * len(v.step_times) / total
        rows[v.name] = {
            "family": v.family,
            "tokens_per_s": tps,
            "tokens_per_s_median_step": tokens_per_step / statistics.median(v.step_times),
            "step_s_mean": total / len(v.step_times),
            "step_s_min": min(v.step_times),
            "step_s_max": max(v.step_times),
            "step_s": v.step_times,
            "first_step_s": v.first_step_s,
            "warmup_s": v.warmup_s,
            "mfu": fpt * tps / peak,
            "loss_first": v.losses[0],
            "loss_last": v.losses[-1],
        }
    liandan = max((r for r in rows.values() if r["family"] == "liandan"), key=lambda r: r["tokens_per_s"], default=None)
    peers = [r for r in rows.values() if r["family"] in PEERS]
    best_peer = max(peers, key=lambda r: r["tokens_per_s"], default=None)
    summary = {
        "dtype": dtype_name,
        "peak_flops": peak,
        "peak_flops_before": peak_before,
        "rows": rows,
        "liandan": next((k for k, r in rows.items() if r is liandan), None),
        "best_peer": next((k for k, r in rows.items() if r is best_peer), None),
    }
    if liandan and best_peer:
        summary["ratio_vs_best_peer"] = liandan["tokens_per_s"] / best_peer["tokens_per_s"]
        # On a loaded machine a step's time is its own work plus whatever other processes took from it; the
        # fastest step of each is the closest to its own work alone.
        fastest = min(r["step_s_min"] for r in rows.values() if r["family"] == "liandan")
        fastest_peer = min(r["step_s_min"] for r in peers)
        summary["ratio_fastest_step"] = fastest_peer / fastest
        summary["mfu"] = liandan["mfu"]
    return summary


def load_average() -> float | None:
    try:
        return float(open("/proc/loadavg").read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def report(results: dict, opts: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 130))
    table = Table(
        title=f"Training step throughput, batch {opts.batch} x {opts.seq_len} tokens, {opts.steps} timed steps"
    )
    for col in (
        "dtype",
        "implementation",
        "tokens/s",
        "tokens/s median step",
        "step (ms)",
        "first step (s)",
        "MFU",
        "loss first→last",
    ):
        table.add_column(col, justify="left" if col in ("dtype", "implementation") else "right")
    for d in results["dtypes"]:
        for name, r in d["rows"].items():
            mark = " *" if name == d["liandan"] else ""
            table.add_row(
                d["dtype"],
                name + mark,
                f"{r['tokens_per_s']:,.0f}",
                f"{r['tokens_per_s_median_step']:,.0f}",
                f"{1000 * r['step_s_mean']:.0f}",
                f"{r['first_step_s']:.1f}",
                f"{100 * r['mfu']:.1f}%",
                f"{r['loss_first']:.3f}→{r['loss_last']:.3f}",
            )
        table.add_section()
    console.print(table)
    summary = Table(title="liandan (* best liandan variant) against the best peer")
    for col in ("dtype", "matmul peak", "liandan tokens/s", "best peer", "ratio", "ratio, fastest steps", "target 1.3x",
                "MFU"):  # fmt: skip
        summary.add_column(col, justify="left" if col == "dtype" else "right")
    for d in results["dtypes"]:
        if "ratio_vs_best_peer" not in d:
            continue
        summary.add_row(
            d["dtype"],
            f"{d['peak_flops'] / 1e9:,.0f} GFLOP/s",
            f"{d['rows'][d['liandan']]['tokens_per_s']:,.0f}",
            f"{d['best_peer']} {d['rows'][d['best_peer']]['tokens_per_s']:,.0f}",
            f"{d['ratio_vs_best_peer']:.2f}x",
            f"{d['ratio_fastest_step']:.2f}x",
            "met" if d["ratio_vs_best_peer"] >= 1.3 else "not met",
            f"{100 * d['mfu']:.1f}%",
        )
    if "overall" in results:
        o = results["overall"]
        summary.add_section()
        summary.add_row(
            "best of each",
            "",
            f"{o['liandan_tokens_per_s']:,.0f} ({o['liandan']})",
            f"{o['best_peer']} {o['best_peer_tokens_per_s']:,.0f}",
            f"{o['ratio']:.2f}x",
            "",
            "met" if o["ratio"] >= 1.3 else "not met",
            "",
        )
    console.print(summary)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps per implementation and dtype")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one compiles)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--impls", default="liandan,hf,plain", help="comma-separated: liandan, hf, plain")
    p.add_argument("--liandan-modes", default="compile", help="comma-separated: eager, compile")
    p.add_argument(
        "--liandan-settings",
        action="append",
        default=[],
        help="another compiled liandan variant with these config overrides (space-separated), e.g."
        " '--train.ce_chunks=4'; repeatable",
    )
    p.add_argument(
        "--peer-modes",
        default="compile,compile+opt",
        help=f"comma-separated peer configurations, each timed: {', '.join(PEER_MODES)}",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--peak-sizes", default="1024,2048", help="square matmul sizes for the peak")
    p.add_argument("--peak-seconds", type=float, default=1.5, help="seconds per peak measurement")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results to this file")
    opts = p.parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    opts.peak_sizes = tuple(int(s) for s in opts.peak_sizes.split(","))
    opts.impls = tuple(s.strip() for s in opts.impls.split(","))
    opts.liandan_modes = tuple(s.strip() for s in opts.liandan_modes.split(",") if s.strip())
    opts.peer_modes = tuple(s.strip() for s in opts.peer_modes.split(",") if s.strip())
    for mode in opts.peer_modes:
        if mode not in PEER_MODES:
            p.error(f"unknown peer mode {mode!r}; choose from {', '.join(PEER_MODES)}")
    opts.warmup = max(1, opts.warmup)
    requested = [s.strip() for s in opts.dtypes.split(",") if s.strip()]
    dtypes = []
    for name in requested:
        if name not in DTYPES:
            p.error(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
        if name == "bf16" and not cpu_supports_bf16():
            print("bf16 skipped: this CPU has no native bf16 arithmetic (AVX512-BF16 or AMX)")
            continue
        dtypes.append(name)

    args = model_args(opts.seq_len)
    counts = count_params(args)
    torch.manual_seed(opts.seed)
    state = {k: v.clone() for k, v in Transformer(args).state_dict().items()}
    batches = make_batches(opts.warmup + opts.steps, opts.batch, opts.seq_len, args.vocab_size, opts.seed)
    machine = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "bf16_supported": cpu_supports_bf16(),
    }
    try:
        import transformers

        machine["transformers"] = transformers.__version__
    except ImportError:
        pass
    print(
        f"{machine['cpu']}, {machine['threads']} threads, torch {machine['torch']}; model {counts.total / 1e6:.2f}M"
        f" parameters, {flops_per_token(args, opts.seq_len) / 1e6:.1f} MFLOP per token; batch {opts.batch} x"
        f" {opts.seq_len}, {opts.warmup} warmup + {opts.steps} timed steps"
    )
    if {"hf", "plain"} & set(opts.impls) and "liandan" in opts.impls:
        check = initial_losses(args, state, batches[0])
        print(
            "fp32 loss on the first batch from the shared weights: "
            + ", ".join(f"{k} {v:.5f}" for k, v in check.items())
        )
        spread = max(check.values()) - min(check.values())
        if spread > 1e-3:
            raise SystemExit(
                f"the implementations disagree on the same weights (spread {spread:.2e}): not the same model"
            )

    started = time.perf_counter()
    load_start = load_average()
    results: dict = {
        "machine": machine,
        "model": {**asdict(args), "parameters": counts.total, "flops_per_token": flops_per_token(args, opts.seq_len)},
        "settings": {k: v for k, v in vars(opts).items() if k != "json"},
        "dtypes": [],
    }
    for name in dtypes:
        print(f"{name}:")
        results["dtypes"].append(run_dtype(name, args, state, batches, opts, print))
    # Across dtypes: the fastest liandan configuration against the fastest peer configuration.
    lian = [
        (d["rows"][d["liandan"]]["tokens_per_s"], f"{d['liandan']} {d['dtype']}")
        for d in results["dtypes"]
        if d["liandan"]
    ]
    peer = [
        (r["tokens_per_s"], f"{k} {d['dtype']}")
        for d in results["dtypes"]
        for k, r in d["rows"].items()
        if r["family"] in PEERS
    ]
    if lian and peer:
        (lt, ln), (pt, pn) = max(lian), max(peer)
        results["overall"] = {
            "liandan": ln,
            "liandan_tokens_per_s": lt,
            "best_peer": pn,
            "best_peer_tokens_per_s": pt,
            "ratio": lt / pt,
        }
    results["seconds"] = time.perf_counter() - started
    results["load_average"] = {"start": load_start, "end": load_average()}
    report(results, opts)
    print(
        f"total {results['seconds']:.0f}s; 1-minute load average {load_start} at the start, {load_average()} at the end"
        f" ({machine['threads']} threads here: more means other processes shared the CPU)"
    )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
