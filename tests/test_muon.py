"""Muon: the hidden matrices orthogonalised, AdamW for the rest; the same update sharded as in one process.

Tolerances (fp32 parameters, Newton-Schulz in bf16 as torch.optim.Muon computes it):
- liandan's Muon on plain tensors (Newton-Schulz of the matrices of one shape batched) against torch.optim.Muon
  (one matrix at a time), same gradients: each orthogonalised update, and each parameter's move, within a
  relative 2e-2 (Frobenius). The same bf16 operations per matrix, but the batched and the single matmul kernels
  may sum in another order, so an element now and then rounds to the neighbouring bf16 value and the
  iterations carry it on (measured: 3 of 720 random matrices not bit for bit the same, by up to 0.8%; all 28
  of the width-128 benchmark model's the same). A norm taken over the stack instead of per matrix, a lost
  transpose or a matrix's update given to another is off by far more; the momentum buffers are exact;
- sharded against one process, same gradients (tests/muon_worker.py): each Muon parameter within an absolute
  1e-6 of its largest value (ShardedMuon gathers the whole matrix and runs the same operations; measured: 0);
  AdamW's parameters within 1e-6 too (its sharded kernels differ from the fused one in the last bits);
- whole runs on 2 processes against one: losses to a relative 1e-4. The gradients of sharded reductions differ
  in the last fp32 bits (AdamW's runs agree to 1e-5, tests/test_distributed.py); Newton-Schulz in bf16 turns a
  few of those into a bf16 rounding step of an update's element, so Muon's losses drift a little more (seen:
  1.1e-5 after 6 steps). A lost shard or a matrix orthogonalised in pieces is off by 1e-2 or more;
- resume in the same layout: bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import (
    free_port,
    killed_after_step_6,
    liandan_here,
    read_run,
    run_losses,
    tiny_config,
    train_named,
    write_corpus,
)
from liandan.config import ConfigError, load_config
from liandan.model import ModelArgs, Transformer
from liandan.model.roles import parameter_roles
from liandan.train import Trainer
from liandan.train.optimizers import build_optimizers, optimizer_plugin
from liandan.train.optimizers.muon import build_muon, muon_roles
from liandan.train.optimizers.sharded_muon import ShardedMuon, newton_schulz_flops

TESTS = Path(__file__).resolve().parent
SHARDED_TOLERANCE = 1e-6  # of the parameter's largest value
BATCHED_RTOL = 2e-2  # batched Newton-Schulz against one matrix at a time (Frobenius)
RTOL = 1e-4  # whole runs in two layouts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _section(*overrides):
    return load_config(None, ["--optim.name=muon", *overrides]).optim


def _model(**fields):
    torch.manual_seed(0)
    return Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, **fields))


# ---------------------------------------------------------------------------------------------------------
# which parameters Muon takes


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tied):
    model = _model(tie_embeddings=tied)
    muon, rest = muon_roles(parameter_roles(model))
    names = {r.name for r in muon}
    assert names == {n for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2}
    assert {r.role for r in rest} == {"embedding", "vector"} | (set() if tied else {"head"})
    assert "tok_embeddings.weight" in {r.name for r in rest}
    muon_opt, adamw = build_muon(model, _section(), torch.device("cpu"))
    assert type(muon_opt) is ShardedMuon and type(adamw) is torch.optim.AdamW
    held = [id(p) for o in (muon_opt, adamw) for g in o.param_groups for p in g["params"]]
    assert sorted(held) == sorted({id(p) for p in model.parameters()})  # each parameter in exactly one
    assert all(g["adjust_lr_fn"] == "match_rms_adamw" and g["weight_decay"] == 0.1 for g in muon_opt.param_groups)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_embedding_and_the_head_take_their_own_learning_rate_scales(tied):
    model = _model(tie_embeddings=tied)
    section = _section("--optim.lr=0.01", "--optim.muon.embedding_lr_scale=10", "--optim.muon.head_lr_scale=0.5")
    muon_opt, adamw = build_muon(model, section, torch.device("cpu"))
    lr_of = {id(p): g["lr"] for o in (muon_opt, adamw) for g in o.param_groups for p in g["params"]}
    assert lr_of[id(model.tok_embeddings.weight)] == pytest.approx(0.1)  # a tied head is the embedding
    if not tied:
        assert lr_of[id(model.output.weight)] == pytest.approx(0.005)
    assert lr_of[id(model.norm.weight)] == pytest.approx(0.01)
    assert all(g["lr"] == pytest.approx(0.01) for g in muon_opt.param_groups)  # Muon's matrices: unscaled
    decay_of = {id(p): g["weight_decay"] for g in adamw.param_groups for p in g["params"]}
    assert decay_of[id(model.tok_embeddings.weight)] == 0.0  # the scales change no group's decay
    if not tied:
        assert decay_of[id(model.output.weight)] == 0.1
    with pytest.raises(ConfigError, match="embedding_lr_scale = -1"):
        _section("--optim.muon.embedding_lr_scale=-1")


def test_the_config_selects_muon_and_its_keys(tmp_path):
    cfg = load_config(None, ["--optim.name=muon", "--optim.muon.adjust_lr=spectral", "--optim.muon.momentum=0.9"])
    assert cfg.optim.options.adjust_lr == "spectral" and cfg.optim.muon.momentum == 0.9
    assert cfg.optim.options.beta2 == 0.95  # AdamW's keys, for what Muon leaves to it
    container = build_optimizers([_model()], cfg.optim, lambda step: 1.0, torch.device("cpu"))
    assert [type(o).__name__ for o in container] == ["ShardedMuon", "AdamW"]
    assert container.optimizers[0].param_groups[0]["adjust_lr_fn"] == "original"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--optim.muon.adjust_lr=rms"], "adjust_lr = 'rms' is not allowed"),
        (["--optim.muon.ns_steps=0"], "ns_steps = 0 is too small"),
        (["--optim.muon.ns_coefficients=[3.4, -4.7]"], "optim.muon.ns_coefficients must be three numbers"),
    ],
)
def test_bad_muon_settings_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        _section(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------------
# the update


def _reference_step(weight, grad, buf, *, lr, wd, momentum, steps, scale):
    """Muon's step written out in float64: Nesterov momentum, the quintic Newton-Schulz on the wide side,
    decoupled weight decay at the unscaled learning rate, the update at the scaled one."""
    a, b, c = 3.4445, -4.7750, 2.0315
    buf = momentum * buf + (1 - momentum) * grad
    update = (1 - momentum) * grad + momentum * buf
    x = update.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    x = x.T if tall else x
    return weight * (1 - lr * wd) - scale * lr * x, buf


@pytest.mark.parametrize(
    "adjust, scale",
    [
        ("match_rms_adamw", lambda r, c: 0.2 * math.sqrt(max(r, c))),
        ("spectral", lambda r, c: math.sqrt(max(1, r / c))),
        ("none", lambda r, c: 1.0),
    ],
)
@pytest.mark.parametrize("shape", [(24, 40), (40, 24)], ids=["wide", "tall"])
def test_one_step_equals_the_update_written_out(adjust, scale, shape):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=generator)
    grads = [torch.randn(*shape, generator=generator) for _ in range(2)]
    param = torch.nn.Parameter(weight.clone())
    optimizer = build_muon(torch.nn.Sequential(), _section(), torch.device("cpu"))  # nothing to optimise
    assert optimizer == []
    from liandan.train.optimizers.muon import muon_over

    class Roled:  # what muon_over reads of a roled parameter
        def __init__(self, p):
            self.param, self.width_mult = p, 1.0

    optimizer = muon_over([Roled(param)], _section(f"--optim.muon.adjust_lr={adjust}", "--optim.lr=0.01"))
    expected, buf = weight.double(), torch.zeros(shape)
    for grad in grads:  # the second step uses the momentum of the first
        param.grad = grad.clone()
        optimizer.step()
        expected, buf = _reference_step(expected, grad, buf, lr=0.01, wd=0.1, momentum=0.95, steps=5,
                                        scale=scale(*shape))  # fmt: skip
    # Newton-Schulz runs in bf16: the update is the float64 one to 2% (measured: about 1%); a wrong
    # scale, a plain (not Nesterov) momentum or a missed weight decay is off by 10% or more
    moved, expected_move = param.detach().double() - weight, expected - weight
    assert (moved - expected_move).norm() / expected_move.norm() < 0.02
    assert torch.allclose(optimizer.state[param]["momentum_buffer"], buf.float(), rtol=1e-6, atol=1e-7)


# square, wide and tall matrices; 16 x 24 and 24 x 16 share one stack (Newton-Schulz works on the wide side);
# 8 x 40 is the only one of its shape (the unbatched path)
SHAPES = [(16, 16), (16, 16), (16, 16), (16, 24), (24, 16), (16, 24), (24, 16), (8, 40)]


def _matrices(shapes, seed=0):
    """Random matrices of `shapes`, the k-th scaled by 10^(k mod 3 - 1): one stack holds matrices whose norms
    are 100 times apart, which a norm taken over the whole stack would not survive."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=generator) * 10.0 ** (k % 3 - 1))
            for k, shape in enumerate(shapes)]  # fmt: skip


def _step_both(mine, theirs, a, b, generator):
    for p, q in zip(mine, theirs, strict=True):
        p.grad = torch.randn(p.shape, generator=generator) * p.detach().abs().mean()
        q.grad = p.grad.clone()
    a.step()
    b.step()


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.detach().double() - expected.detach().double()).norm() / expected.detach().double().norm())


def _assert_same_moves(start, mine, theirs):
    for s, p, q in zip(start, mine, theirs, strict=True):
        assert _relative(p - s, q - s) <= BATCHED_RTOL, tuple(p.shape)


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain-momentum"])
def test_batched_newton_schulz_gives_torch_muons_update(adjust, nesterov):
    """Several shapes in both orientations, several steps (the momentum carried), two param groups of their
    own rates: the parameters and momentum buffers those of torch.optim.Muon, which goes matrix by matrix."""
    mine, theirs = _matrices(SHAPES), _matrices(SHAPES)
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": nesterov, "adjust_lr_fn": adjust,
              "ns_coefficients": (3.4445, -4.7750, 2.0315), "ns_steps": 5}  # fmt: skip
    groups = lambda ps: [{"params": ps[:5]}, {"params": ps[5:], "lr": 0.01}]
    a, b = ShardedMuon(groups(mine), **kwargs), torch.optim.Muon(groups(theirs), **kwargs)
    start = [p.detach().clone() for p in mine]
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        _step_both(mine, theirs, a, b, generator)
    _assert_same_moves(start, mine, theirs)
    for p, q in zip(mine, theirs, strict=True):
        assert torch.equal(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"])  # element-wise: exact


def test_newton_schulz_by_shape_is_each_matrix_on_its_own():
    from liandan.train.optimizers.sharded_muon import newton_schulz, newton_schulz_by_shape

    updates = [p.detach() for p in _matrices(SHAPES, seed=2)] + [torch.zeros(16, 16)]  # a zero update: eps
    coefficients = (3.4445, -4.7750, 2.0315)
    batched = newton_schulz_by_shape(updates, coefficients, 5)
    for u, got in zip(updates[:-1], batched[:-1], strict=True):
        alone = newton_schulz(u, coefficients, 5)
        assert got.shape == u.shape and got.dtype == torch.bfloat16
        assert _relative(got, alone) <= BATCHED_RTOL, tuple(u.shape)
    assert not batched[-1].any()  # the zero update: divided by eps, not by zero


def test_muon_state_moves_between_torch_muon_and_liandans_mid_run():
    """A checkpoint's state and group keys are torch.optim.Muon's: state saved by one loads into the other
    (a fresh optimizer, as on resume) and the run goes on with the same parameters."""
    kwargs = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    mine, theirs = _matrices(SHAPES), _matrices(SHAPES)
    start = [p.detach().clone() for p in mine]
    a, b = ShardedMuon(mine, **kwargs), torch.optim.Muon(theirs, **kwargs)
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        _step_both(mine, theirs, a, b, generator)
    assert a.state_dict()["state"][0].keys() == b.state_dict()["state"][0].keys() == {"momentum_buffer"}
    # swap: liandan's state into a fresh torch.optim.Muon and the other way round, then both go on
    a_state, b_state = a.state_dict(), b.state_dict()
    a, b = ShardedMuon(mine, **kwargs), torch.optim.Muon(theirs, **kwargs)
    a.load_state_dict(b_state)
    b.load_state_dict(a_state)
    for _ in range(2):
        _step_both(mine, theirs, a, b, generator)
    _assert_same_moves(start, mine, theirs)
    for p, q in zip(mine, theirs, strict=True):
        assert torch.equal(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"])


def test_newton_schulz_flops_count_the_three_matmuls_per_iteration():
    # X X^T: 2 m^2 n; b A + c A A: 2 m^3; a X + B X: 2 m^2 n; m the smaller side
    assert newton_schulz_flops(8, 32, 5) == 5 * (2 * 8 * 8 * 32 + 2 * 8**3 + 2 * 8 * 8 * 32)
    assert newton_schulz_flops(32, 8, 5) == newton_schulz_flops(8, 32, 5)
    plugin = optimizer_plugin("muon")
    assert plugin.state_bytes("hidden") == 4.0 and plugin.state_bytes("embedding") == 8.0


def test_the_plan_counts_one_momentum_buffer_per_hidden_matrix_and_newton_schulz():
    from liandan.plan.devices import resolve_device
    from liandan.plan.run_plan import plan_config

    shape = ["--model.dim=256", "--model.n_layers=4", "--model.n_heads=4", "--model.vocab_size=1024",
             "--train.seq_len=256", "--train.global_batch=8"]  # fmt: skip
    adamw = plan_config(load_config(None, shape), resolve_device("h100"))
    muon = plan_config(load_config(None, [*shape, "--optim.name=muon"]), resolve_device("h100"))
    assert adamw.optimizer is None  # AdamW's flat 8 bytes say all
    o = muon.optimizer
    model = Transformer(muon.model)
    hidden = [p for n, p in model.named_parameters() if n.startswith("layers.") and p.dim() == 2]
    assert o.params_by_role["hidden"] == sum(p.numel() for p in hidden)
    assert o.state_bytes_by_role == {"embedding": 8.0, "vector": 8.0, "hidden": 4.0, "head": 8.0}
    saved = 4 * o.params_by_role["hidden"]
    assert adamw.memory.states.optimizer - muon.memory.states.optimizer == pytest.approx(saved)
    assert o.step_flops == sum(newton_schulz_flops(*p.shape, 5) for p in hidden)
    assert 0 < o.step_share < 1 and muon.time.seconds > adamw.time.seconds


def test_the_plan_gives_stacked_expert_weights_adamws_state_under_muon():
    from liandan.plan.devices import resolve_device
    from liandan.plan.run_plan import plan_config

    shape = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=2", "--model.vocab_size=512",
             "--model.llama.moe_experts=4", "--model.llama.moe_top_k=2", "--train.seq_len=64"]  # fmt: skip
    adamw = plan_config(load_config(None, shape), resolve_device("h100"))
    muon = plan_config(load_config(None, [*shape, "--optim.name=muon"]), resolve_device("h100"))
    o = muon.optimizer
    stacked = o.params_by_role["hidden 3-d"]
    assert stacked > 0 and o.state_bytes_by_role["hidden 3-d"] == 8.0  # AdamW's two moments: Muon skips them
    saved = 4 * o.params_by_role["hidden"]  # the 2-D hidden matrices alone
    assert adamw.memory.states.optimizer - muon.memory.states.optimizer == pytest.approx(saved)


def test_liandan_plan_shows_muons_state_and_flops(tmp_path):
    config = tmp_path / "muon.toml"
    config.write_text(load_config(None, ["--optim.name=muon", "--model.dim=256", "--model.n_layers=2"]).to_toml())
    done = liandan_here("plan", config, "--device=h100", check=True)
    assert "muon step FLOPs" in done.stdout and "Newton-Schulz" in done.stdout
    assert "muon: 4 B per parameter of hidden" in done.stdout


# ---------------------------------------------------------------------------------------------------------
# training, resume and the guard's ring


def _run(tmp_path, corpus, name, *overrides):
    cfg = tiny_config(tmp_path, corpus, "--optim.name=muon", "--optim.lr=3e-3", "--schedule.kind=constant",
                      f"--run.name={name}", *overrides)  # fmt: skip
    trainer = Trainer(cfg, say=lambda msg: None)
    result = trainer.train()
    return trainer, result, [r["loss"] for r in read_run(tmp_path / name).metrics]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus):
    """A run of 8 steps straight through: the trainer and its losses."""
    root = tmp_path_factory.mktemp("muon")
    trainer, _, losses = _run(root, corpus, "straight", "--train.steps=8")
    return trainer, losses


def test_muon_trains_a_tiny_model(straight):
    trainer, losses = straight
    assert [type(o).__name__ for o in trainer.module.optimizers] == ["ShardedMuon", "AdamW"]
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.slow
def test_a_resumed_muon_run_is_bit_identical(tmp_path, corpus, straight):
    _run(tmp_path, corpus, "resumed", "--train.steps=4", "--checkpoint.every=4", "--checkpoint.async_save=false")
    _, _, resumed = _run(tmp_path, corpus, "resumed", "--train.steps=8")
    assert read_run(tmp_path / "resumed").of_kind("resumed")[-1]["step"] == 4
    assert resumed == straight[1]  # momentum buffers, AdamW's moments and the schedule carried over


def test_the_guards_ring_puts_muons_momentum_back():
    from liandan.checkpoint.ring import StateRing, restore

    model = _model()
    optimizers = build_optimizers([model], _section(), lambda step: 1.0, torch.device("cpu"))

    def step():
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizers.step()

    momentum = lambda: [s["momentum_buffer"].clone() for s in optimizers.optimizers[0].state.values()]
    step()
    kept_momentum, kept_params = momentum(), [p.detach().clone() for p in model.parameters()]
    held = StateRing(2).keep(1, [model], optimizers, {})
    assert any(name.endswith("momentum_buffer") for name in held.tensors)
    step()
    assert not torch.equal(momentum()[0], kept_momentum[0])
    restore(held, [model], optimizers)
    assert all(torch.equal(a, b) for a, b in zip(momentum(), kept_momentum, strict=True))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), kept_params, strict=True))


# ---------------------------------------------------------------------------------------------------------
# sharded: real processes on gloo


def _sharded_run(out: Path, dp_replicate: int, dp_shard: int, tp: int) -> list[dict]:
    """One run of tests/muon_worker.py on dp_replicate x dp_shard x tp gloo ranks; each rank's report."""
    world, port = dp_replicate * dp_shard * tp, str(free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
        command = [sys.executable, str(TESTS / "muon_worker.py"), str(out), str(dp_replicate), str(dp_shard), str(tp)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [(1, 2, 1), (1, 1, 2), (1, 2, 2), (1, 3, 1)],
    ids=["fsdp2", "tp2", "fsdp2xtp2", "fsdp3-uneven"],  # 3 ranks: the 32-row matrices split 11, 11, 10
)
def test_sharded_muon_equals_one_process(tmp_path, layout):
    for report in _sharded_run(tmp_path, *layout):
        assert report["optimizers"] == ["ShardedMuon", "AdamW"]
        muon = {name: row for name, row in report["params"].items() if "momentum_diff" in row}
        assert muon and all(row["sharded"] for row in muon.values())
        for name, row in report["params"].items():
            assert row["diff"] <= SHARDED_TOLERANCE * row["scale"], name
            assert row.get("momentum_diff", 0.0) <= SHARDED_TOLERANCE * row["scale"], name


@pytest.fixture(scope="module")
def reshard_setup(tmp_path_factory):
    """A tiny Muon run's config (8 steps, a checkpoint at step 4) and its losses in one process."""
    root = tmp_path_factory.mktemp("muon-reshard")
    cfg = tiny_config(root / "runs", write_corpus(root), "--optim.name=muon", "--optim.lr=3e-3", "--train.steps=8",
                      "--checkpoint.every=4", "--run.name=", "--resilience.supervise=false")  # fmt: skip
    config = root / "tiny.toml"
    config.write_text(cfg.to_toml())
    done = train_named(config, "reference", 1)
    assert done.returncode == 0, done.stderr[-3000:]
    return config, run_losses(config, "reference")


@pytest.mark.slow
@pytest.mark.parametrize("after", [(1, []), (2, ["--parallel.tp=2"])], ids=["fsdp2-to-1", "fsdp2-to-tp2"])
def test_a_sharded_muon_run_resumes_in_another_layout(reshard_setup, after):
    """Trained on 2 FSDP ranks, killed after step 6, resumed from step 4 in another layout: every loss that of
    one process (the 2-rank steps too), to the distributed tolerance."""
    config, reference = reshard_setup
    name = f"muon-fsdp2-to-{after[0]}{''.join(after[1])}".replace("--parallel.", "-")
    killed_after_step_6(config, name, (2, []))
    assert run_losses(config, name) == pytest.approx(reference[:6], rel=RTOL)
    done = train_named(config, name, after[0], *after[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "at step 4" in done.stdout
    assert run_losses(config, name) == pytest.approx(reference, rel=RTOL)
