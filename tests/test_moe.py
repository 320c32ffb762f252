"""Mixture of experts: the router's arithmetic against hand computations, the dropless and capacity paths
against a per-token reference, the balancing bias, the auxiliary losses in the gradient but not the value;
and a MoE run through the training machinery: routing metrics in metrics.jsonl, the run store and an
exporter, meta init and activation checkpointing changing no number, the guard's ring and memory snapshots
carrying the balancing bias, Muon with stacked experts, counts of total and active parameters."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import liandan_here, read_metrics, tiny_config, write_corpus
from liandan.model import ModelArgs, Transformer
from liandan.model.counts import count_params, flops_per_token, param_split
from liandan.model.moe import MoE, MoEConfig, Router, grouped_matmul, moe_layers, routing_step

MOE_RUN = ["--model.moe_experts=4", "--model.moe_top_k=2", "--model.moe_ffn_dim=64", "--model.moe_shared_experts=1",
           "--model.moe_dense_layers=1", "--model.moe_z_loss=1e-3", "--train.log_every=2",
           "--checkpoint.enabled=false"]  # fmt: skip


def _router(**kw) -> Router:
    torch.manual_seed(0)
    router = Router(8, MoEConfig(**{"experts": 4, "top_k": 2, "ffn_dim": 16, **kw}))
    return router.train()


def test_the_bias_chooses_the_experts_but_the_weights_are_the_scores():
    router = _router(route_norm=False)
    x = torch.randn(32, 8)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 5.0]))  # far above any softmax score
    indices, weights, _ = router(x)
    assert sorted(set(indices.flatten().tolist())) == [2, 3]
    scores = router.gate(x).float().softmax(-1)
    assert torch.equal(weights, scores.gather(-1, indices))  # the bias never enters the weights
    router.expert_bias.zero_()
    unbiased, _, _ = router(x)
    assert set(unbiased.flatten().tolist()) != {2, 3}


def test_route_norm_makes_the_chosen_weights_sum_to_one_and_scale_multiplies_them():
    x = torch.randn(16, 8)
    _, weights, _ = _router(route_norm=True, route_scale=2.5, score="sigmoid")(x)
    assert torch.allclose(weights.sum(-1), torch.full((16,), 2.5))


def test_load_balancing_loss_is_switch_transformers_by_hand():
    router = _router(aux_loss=0.5, bias_balance=False)
    x = torch.randn(64, 8)
    indices, _, aux = router(x)
    probs = router.gate(x).float().softmax(-1)
    experts, pairs = 4, indices.numel()
    expected = 0.0
    for e in range(experts):
        share = (indices == e).sum().item() / pairs  # f_e
        expected += share * probs[:, e].mean().item()  # P_e
    assert aux.item() == pytest.approx(0.5 * experts * expected, rel=1e-6)


def test_router_z_loss_is_the_mean_squared_log_partition():
    router = _router(z_loss=0.1)
    x = torch.randn(64, 8)
    _, _, aux = router(x)
    logits = router.gate(x).float()
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 64
    assert aux.item() == pytest.approx(0.1 * expected, rel=1e-5)
    router.eval()
    assert router(x)[2].item() == 0.0  # no auxiliary loss outside training


def test_the_bias_moves_towards_the_less_loaded_experts():
    router = _router()
    router.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]), rate=0.01)
    assert router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])


def _naive_moe(moe: MoE, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Each token through its chosen experts one at a time, in token order, an expert taking at most
    `capacity` (token, expert) pairs."""
    indices, weights, _ = moe.router(x)
    w = moe.experts
    out = torch.zeros_like(x)
    taken = [0] * moe.cfg.experts
    for t in range(x.shape[0]):
        for k in range(moe.cfg.top_k):
            e = int(indices[t, k])
            if capacity is not None and taken[e] >= capacity:
                continue
            taken[e] += 1
            h = F.silu(x[t] @ w.w1[e].t()) * (x[t] @ w.w3[e].t())
            out[t] += weights[t, k] * (h @ w.w2[e].t())
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out


def _moe(capacity_factor=0.0, shared=None) -> MoE:
    torch.manual_seed(1)
    moe = MoE(8, MoEConfig(experts=4, top_k=2, ffn_dim=16, capacity_factor=capacity_factor), shared)
    moe.reset_parameters(0.5, 0.5)
    return moe.train()


def test_dropless_equals_a_per_token_loop():
    moe = _moe(shared=torch.nn.Linear(8, 8, bias=False))
    x = torch.randn(2, 24, 8)
    with torch.no_grad():
        got = moe(x).reshape(-1, 8)
        want = _naive_moe(moe, x.reshape(-1, 8))
    assert torch.allclose(got, want, atol=1e-5)


def test_a_capacity_drops_the_later_pairs_and_counts_them():
    moe = _moe(capacity_factor=0.5)
    x = torch.randn(40, 8)
    capacity = math.ceil(0.5 * 40 * 2 / 4)
    got = moe(x)  # a training forward with gradients: counted
    with torch.no_grad():  # not counted again
        counts = torch.bincount(moe.router(x)[0].flatten(), minlength=4)
    expected_drops = (counts - capacity).clamp(min=0).sum().item()
    assert expected_drops > 0
    assert moe.router.dropped.item() == expected_drops
    with torch.no_grad():
        assert torch.allclose(got, _naive_moe(moe, x, capacity), atol=1e-5)
    stats = routing_step(torch.nn.ModuleDict({"3": torch.nn.ModuleDict({"feed_forward": moe})}), bias_rate=0.0)
    assert stats.layers == [3] and stats.summary()["moe/3/dropped"] == pytest.approx(expected_drops / 80)
    assert moe.router.dropped.item() == 0 and moe.router.load.sum().item() == 0  # read and cleared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim, out", [(16, 24), (5, 7)], ids=["grouped-kernel", "unaligned-loop"])
def test_grouped_matmul_equals_the_loop_forward_and_backward(dtype, dim, out):
    torch.manual_seed(2)
    counts = torch.tensor([3, 0, 6, 0, 7])  # empty experts in the middle and last
    x = torch.randn(16, dim, dtype=dtype, requires_grad=True)
    w = torch.randn(5, out, dim, dtype=dtype, requires_grad=True)
    got = grouped_matmul(x, w, counts)
    starts = torch.cumsum(counts, 0) - counts
    want = torch.cat([x[s : s + c] @ w[e].t() for e, (s, c) in enumerate(zip(starts.tolist(), counts.tolist()))])
    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, (x, w), grad)
    want_grads = torch.autograd.grad(want, (x, w), grad)
    tol = 0 if dtype == torch.float32 else 2e-2
    for a, b in ((got, want), *zip(got_grads, want_grads, strict=True)):
        assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _moe_model(**kw) -> Transformer:
    torch.manual_seed(3)
    args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16, moe_experts=4, moe_top_k=2,
                     moe_ffn_dim=16, moe_shared_experts=1, **kw)  # fmt: skip
    return Transformer(args).train()


def test_under_autocast_the_experts_run_the_grouped_kernel_on_fp32_master_weights():
    from liandan.model.moe import GroupedExperts

    experts = GroupedExperts(64, 128, 4)
    for w in experts.parameters():
        torch.nn.init.normal_(w, 0.0, 0.02)
    x, counts = torch.randn(32, 64), torch.tensor([8, 8, 0, 16])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = experts(x, counts)
        out.float().sum().backward()
    ran = {event.name for event in prof.events()}
    assert "aten::_grouped_mm" in ran  # not one matmul per expert
    assert out.dtype == torch.bfloat16 and experts.w1.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loop = torch.cat([x[:8] @ experts.w1[0].t(), x[8:16] @ experts.w1[1].t(), x[16:] @ experts.w1[3].t()])
    assert torch.equal(grouped_matmul(x.bfloat16(), experts.w1.bfloat16(), counts), loop)


def test_a_compiled_moe_block_under_autocast_compiles_once_whatever_the_routing():
    moe = MoE(16, MoEConfig(experts=4, top_k=2, ffn_dim=32))
    moe.reset_parameters(0.5, 0.5)
    compiled = torch.compile(moe, backend="eager")  # dynamo's tracing and guards alone: no code generation
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True), torch.autocast("cpu", dtype=torch.bfloat16):
        counts = set()
        for seed in range(4):  # a new split of the rows over the experts each time
            x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(seed))
            compiled(x).float().sum().backward()
            counts.add(tuple(torch.bincount(moe.router(x.reshape(-1, 16))[0].flatten(), minlength=4).tolist()))
    assert len(counts) > 1


def test_auxiliary_losses_change_the_gradient_but_not_the_loss():
    tokens = torch.randint(0, 64, (2, 17))
    losses, grads = [], []
    for aux in (0.0, 0.5):
        model = _moe_model(moe_aux_loss=aux, moe_z_loss=aux)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
        grads.append(model.layers["0"].feed_forward.router.gate.weight.grad.clone())
    assert losses[0] == losses[1]
    assert not torch.allclose(grads[0], grads[1])


def test_counts_give_total_and_active_parameters():
    model = _moe_model(moe_dense_layers=1)
    args = model.args
    counts = count_params(args)
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert param_split(args).total == counts.total
    routed = args.moe_experts * 3 * args.dim * args.moe_ffn_dim  # one MoE block's routed experts
    assert counts.total - counts.active == routed * (1 - args.moe_top_k / args.moe_experts)
    assert counts.active_matmul == counts.matmul - (counts.total - counts.active) and counts.sparse
    dense = count_params(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16))
    assert dense.active == dense.total and not dense.sparse
    attention = 12.0 * args.n_layers * args.n_heads * args.head_dim * 16
    assert flops_per_token(args, 16) == 6.0 * counts.active_matmul + attention


def test_the_ring_and_memory_snapshots_restore_the_balancing_bias(tmp_path):
    from liandan.checkpoint.ring import StateRing, restore
    from liandan.checkpoint.snapshots import MemorySnapshots

    model = _moe_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 9))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    router = model.layers["1"].feed_forward.router
    router.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.3, -0.4]))
    kept = router.expert_bias.clone()
    ring = StateRing(2)
    ring.keep(1, model, optimizer, {})
    snapshots = MemorySnapshots(tmp_path, rank=0, world_size=1, owner="test", layout="single")
    snapshots.save(1, model, optimizer, {})
    router.expert_bias.add_(1.0)  # a later step's update
    restore(ring.newest_at_or_before(1), model, optimizer)
    assert torch.equal(router.expert_bias, kept)
    router.expert_bias.add_(1.0)
    snapshots.load(1, model, optimizer)
    assert torch.equal(router.expert_bias, kept)


def test_muon_leaves_the_stacked_expert_weights_to_adamw():
    from liandan.model.roles import parameter_roles
    from liandan.train.optimizers.muon import muon_roles

    muon, adamw = muon_roles(parameter_roles(_moe_model()))
    assert muon and all(r.param.dim() == 2 for r in muon)
    stacked = {r.name for r in adamw if r.param.dim() == 3}
    assert stacked == {f"layers.{i}.feed_forward.experts.{w}" for i in (0, 1) for w in ("w1", "w2", "w3")}
    assert all(r.role == "hidden" for r in adamw if r.param.dim() == 3)


# -- a MoE run through the trainer ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("moe-corpus"), n_docs=12)


def _train(root, corpus, name, *overrides):
    from liandan.train import Trainer

    said = []
    trainer = Trainer(tiny_config(root, corpus, f"--run.name={name}", *MOE_RUN, *overrides), say=said.append)
    result = trainer.train()
    bias = torch.stack([m.router.expert_bias.clone() for m in moe_layers(trainer.module.model).values()])
    return trainer, result, bias, said


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory, corpus):
    """A MoE run of 6 steps with the TensorBoard exporter, metrics every 2 steps."""
    return _train(tmp_path_factory.mktemp("moe-runs"), corpus, "run", '--track.exporters=["tensorboard"]')


def test_routing_metrics_reach_metrics_jsonl_the_run_store_tensorboard_and_the_report(moe_run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from liandan.run import RunDir
    from liandan.track.store import RunStore

    trainer, result, bias, said = moe_run
    records = read_metrics(result.run_dir)
    assert [r["step"] for r in records] == [2, 4, 6]
    for record in records:  # one MoE block (block 1; block 0 is dense), four experts
        assert record["moe/1/load_max"] >= 1.0 >= record["moe/1/load_min"] >= 0.0
        assert 0.0 < record["moe/1/entropy"] <= 1.0 and record["moe/1/dropped"] == 0.0
        loads = [record[f"moe/1/expert/{e}"] for e in range(4)]
        assert sum(loads) == pytest.approx(4.0) and max(loads) == pytest.approx(record["moe/1/load_max"])
        assert not any(key.startswith("moe/0/") for key in record)
        assert record["moe/load_max"] == record["moe/1/load_max"]  # the one MoE block is the worst
    assert records[-1]["moe/1/bias_max"] == pytest.approx(bias[0].max().item())
    assert records[-1]["moe/1/bias_max"] > records[-1]["moe/1/bias_min"]  # the balancing moved the biases
    room = RunDir(result.run_dir)
    with RunStore.of_run(room) as store:
        store.sync()
        assert {"moe/1/load_max", "moe/1/entropy", "moe/1/expert/3"} <= set(store.metric_keys(room.name))
    scalars = EventAccumulator(str(room.tensorboard), size_guidance={"scalars": 0}).Reload()
    curve = [(e.step, e.value) for e in scalars.Scalars("moe/1/load_max")]
    assert curve == [(r["step"], pytest.approx(r["moe/1/load_max"])) for r in records]
    page = tmp_path / "report.html"
    liandan_here("report", result.run_dir, "-o", page, check=True)
    assert "expert load (the most loaded expert of any MoE block)" in page.read_text()
    [model_line] = [line for line in said if line.startswith("model:")]
    counts = trainer.module.params
    assert f"{counts.total / 1e6:.2f}M parameters" in model_line
    assert f"{counts.active / 1e6:.2f}M active per token" in model_line


@pytest.mark.parametrize("how", [["--train.meta_init=true"], ["--train.activation_checkpoint=full"]],
                         ids=["meta-init", "recompute"])  # fmt: skip
def test_meta_init_and_recomputation_change_no_number(moe_run, corpus, tmp_path, how):
    """Routing counted once under recomputation (the recomputed forward does not count again): the biases
    and the losses are those of the plain run bit for bit."""
    _, plain, plain_bias, _ = moe_run
    _, result, bias, _ = _train(tmp_path, corpus, "other", *how)
    assert result.losses == plain.losses
    assert torch.equal(bias, plain_bias)


def test_muon_trains_a_moe_model(corpus, tmp_path):
    trainer, result, _, _ = _train(tmp_path, corpus, "muon", "--optim.name=muon", "--train.steps=3")
    assert [type(o).__name__ for o in trainer.module.optimizers.per_part[0]] == ["ShardedMuon", "AdamW"]
    assert all(math.isfinite(loss) for loss in result.losses) and result.losses[-1] < result.losses[0]


@pytest.mark.slow
def test_a_moe_run_resumes_bit_exact_in_one_process_and_fsdp2_with_uneven_experts(tmp_path):
    """The resume oracle over a MoE model of 3 experts (FSDP2 over 2 ranks splits them 2 + 1), its balancing
    bias moving fast: resumed in the same layout, losses and final weights (the biases among them) are those
    of the run that never stopped, bit for bit; across layouts within the oracle's tolerance."""
    import json

    from helpers import MICRO_MODEL, run_liandan

    cfg = tiny_config(tmp_path / "runs", write_corpus(tmp_path, n_docs=8), *MICRO_MODEL, "--model.moe_experts=3",
                      "--model.moe_top_k=2", "--model.moe_shared_experts=1", "--model.moe_bias_rate=1e-2")  # fmt: skip
    config, report_path = tmp_path / "moe.toml", tmp_path / "report.json"
    config.write_text(cfg.to_toml())
    done = run_liandan("doctor", "--resume", config, "--layouts=1,fsdp2", "--resume-steps=4", f"--json={report_path}",
                       timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checks = json.loads(report_path.read_text())["checks"]
    assert len(checks) == 4
    for check in checks:
        assert check["passed"], check
        if check["saved_in"] == check["resumed_in"]:
            assert check["exact"] and check["loss_diff"] == 0 and check["weight_diff"] == 0


def test_the_plan_counts_every_expert_in_memory_and_the_active_ones_in_flops_and_activations():
    from pathlib import Path

    from liandan.config import load_config
    from liandan.plan.activations import activation_memory, block_bytes
    from liandan.plan.devices import resolve_device
    from liandan.plan.run_plan import plan_config, plan_model_args

    config = Path(__file__).resolve().parents[1] / "configs" / "moe-tiny.toml"
    cfg = load_config(config, [])
    plan = plan_config(cfg, resolve_device("h100"), nproc=2)
    counts, args = plan.params, plan_model_args(cfg)
    assert counts.sparse and counts.active < counts.total
    assert plan.memory.params_per_rank == counts.total  # every expert's weights, and their optimizer state
    assert plan.memory.states.optimizer == 8.0 * counts.total / 2  # AdamW, FSDP over 2 ranks
    assert plan.flops.six_nd == 6.0 * counts.active_matmul * plan.flops.tokens
    kw = {"micro_batch": 8, "seq_len": 256, "checkpoint": "none"}
    moe_acts = activation_memory(args, **kw)
    dense_args = plan_model_args(load_config(config, ["--model.moe_experts=0"]))
    dense_acts = activation_memory(dense_args, **kw)
    shape = {"micro_batch": 8, "seq_len": 256}
    extra = block_bytes(args, moe=True, **shape) - block_bytes(dense_args, **shape)  # active experts, not all
    assert extra > 0 and moe_acts.layers == pytest.approx(dense_acts.layers + 3 * extra)  # 3 MoE blocks of 4
    shown = liandan_here("plan", config, "--device=h100", check=True).stdout
    assert f"{counts.active:,}" in shown and "every expert" in shown
