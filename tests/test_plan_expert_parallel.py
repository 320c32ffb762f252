"""`liandan plan` under expert parallelism and tensor parallelism of MoE models: what ep divides (the experts
FSDP2 gathers with a block), what it adds (all-to-all buffers, the busiest rank's headroom), and what tp
leaves whole (a MoE block's feed-forward)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import liandan_here
from liandan.common.layout import Layout
from liandan.config import load_config
from liandan.model.counts import _moe_ffn
from liandan.plan.activations import activation_memory
from liandan.plan.devices import resolve_device
from liandan.plan.memory import memory_per_device, param_split
from liandan.plan.run_plan import plan_config, plan_model_args

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "moe-tiny.toml"
B, S = 4, 256


@pytest.fixture(scope="module")
def args():
    return plan_model_args(load_config(CONFIG, []))


def _estimate(args, ep: int, **kw):
    return memory_per_device(args, Layout(1, 4, 1, ep=ep), micro_batch=B, seq_len=S, dtype="bf16", **kw)


def test_ep_divides_the_gathered_experts_and_keeps_the_states(args):
    routed, _, _ = _moe_ffn(args)
    whole, ep2, ep4 = _estimate(args, 1), _estimate(args, 2), _estimate(args, 4)
    # FSDP2 alone or with ep, every expert's fp32 states are divided over the 4 dp_shard ranks.
    assert ep2.states == whole.states == ep4.states
    assert param_split(args, 1, 2).block == param_split(args).block - routed // 2
    # Gathered in bf16 (current + prefetched block), their bf16 and fp32 gradients: 2 * 2 + 2 + 4 bytes each.
    assert whole.transient - ep2.transient == pytest.approx(10 * routed / 2)
    assert whole.transient - ep4.transient == pytest.approx(10 * routed * 3 / 4)
    assert whole.expert_parallel is None


def test_ep_adds_all_to_all_buffers_and_imbalance_headroom(args):
    rows = B * S * args.moe_top_k
    balanced, ep2, ep4 = _estimate(args, 2, ep_imbalance=1.0), _estimate(args, 2), _estimate(args, 4)
    e = ep2.expert_parallel
    assert e.imbalance == 1.25
    assert e.buffers == pytest.approx((1 + 1.25) * rows * args.dim * 2)  # sent + received, bf16
    assert balanced.expert_parallel.buffers == pytest.approx(2 * rows * args.dim * 2)
    assert balanced.expert_parallel.imbalance_headroom == 0 < e.imbalance_headroom
    assert ep2.total - balanced.total == pytest.approx(e.total - balanced.expert_parallel.total)
    # The share of the rows that leaves the device: 1/2 at ep 2, 3/4 at ep 4.
    traffic = ep4.expert_parallel.all_to_all_bytes_per_step / e.all_to_all_bytes_per_step
    assert traffic == pytest.approx(1.5)
    assert _estimate(args, 2, activation_checkpoint="full").expert_parallel.imbalance_headroom == 0


def test_tensor_parallelism_leaves_the_moe_feed_forward_whole(args):
    routed, _, always = _moe_ffn(args)
    one, two = param_split(args), param_split(args, 2)
    moe_blocks = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    # Only attention, the dense block's feed-forward and the vocabulary tables halve.
    assert one.total - two.total < one.total - moe_blocks * (routed + always)
    assert two.total > moe_blocks * (routed + always)


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallelism_keeps_the_moe_activations_whole(args, sp):
    """At tp 2 each block's attention halves (queries, keys, values and output, 4·h_q bf16 values a token, and
    the log-sum-exp), so does the dense block's MLP (4·f), and under sequence parallelism the fp32 norms
    (16·h bytes); the MoE blocks' feed-forward stays whole."""
    kw = {"micro_batch": B, "seq_len": S, "dtype": "bf16", "sequence_parallel": sp}
    one, two = activation_memory(args, tp=1, **kw), activation_memory(args, tp=2, **kw)
    moe_blocks = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    attention = (4 * args.n_heads * (args.head_dim or args.dim // args.n_heads) * 2 + 4 * args.n_heads) / 2
    dense_mlp = 4 * args.ffn_dim * 2 / 2 * (args.n_layers - moe_blocks) / args.n_layers
    norms = 16 * args.dim / 2 if sp else 0
    assert one.per_layer - two.per_layer == pytest.approx(B * S * (attention + dense_mlp + norms))


def test_plan_with_ep_shows_the_expert_parallel_rows():
    cfg = load_config(CONFIG, ["--parallel.ep=2"])
    plan = plan_config(cfg, resolve_device("h100"), nproc=4, ep_imbalance=1.5)
    assert plan.memory.layout.ep == 2 and plan.memory.expert_parallel.imbalance == 1.5
    assert plan.smallest is not None and plan.smallest.layout.ep == 2
    shown = liandan_here("plan", CONFIG, "--device=h100", "--nproc=4", "--parallel.ep=2", "--ep-imbalance=1.5",
                         check=True).stdout  # fmt: skip
    assert "all-to-all buffers" in shown and "expert imbalance" in shown and "all-to-all traffic" in shown
    refused = liandan_here("plan", CONFIG, "--ep-imbalance=0.5")
    assert refused.returncode != 0 and "--ep-imbalance = 0.5 must be at least 1" in refused.stderr
