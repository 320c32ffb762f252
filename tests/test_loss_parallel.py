"""Tensor parallelism done without whole logits: the vocabulary-parallel loss, sequence parallelism, tied
embeddings and qk-norm split over 2 gloo ranks, each against one process; and the chunked loss against the
plain one.

Tolerances (fp32): split computations sum in a different order (all-reduces over shards, split matmuls).
Values agree to a relative 1e-6 and gradients to an absolute 1e-6 of gradients of size ~0.1 (seen: ~1e-7);
losses of a few training steps to a relative 1e-5, as tests/test_distributed.py. A wrong gradient (a
missing all-reduce, an unsummed replicated weight) is off by 1e-3 or more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import free_port, tiny_config
from liandan.config import ConfigError
from liandan.model import ModelArgs, Transformer
from liandan.model.loss import chunked_lm_loss, fused_lm_loss, lm_loss
from liandan.model.spec import get as get_model_spec
from liandan.plan.activations import activation_memory

TESTS = Path(__file__).resolve().parent
VARIANTS = ("gathered", "loss_parallel", "sequence_parallel", "tied_qk_norm", "tied_z_loss")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """One 2-process run of tests/tp_worker.py; each rank's report."""
    out = tmp_path_factory.mktemp("tp")
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(TESTS.parent / "src"), str(TESTS), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(TESTS / "tp_worker.py"), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("z", ["z=0.0", "z=0.01"])
def test_vocab_parallel_loss_equals_plain_loss(ranks, z):
    for report in ranks:
        check = report["loss"][z]
        assert check["loss"] == pytest.approx(check["expected"], rel=1e-6)
        assert check["grad_diff"] < 1e-6 < check["grad_scale"] * 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_tensor_parallel_training_matches_one_process(ranks, variant):
    for report in ranks:
        whole, split = report["train"][variant]["whole"], report["train"][variant]["split"]
        assert split["losses"] == pytest.approx(whole["losses"], rel=1e-5)
        assert whole["grads"].keys() == split["grads"].keys()
        for name, grad in whole["grads"].items():
            assert torch.tensor(split["grads"][name]) == pytest.approx(torch.tensor(grad), abs=1e-6), name
        assert split["tied"] == whole["tied"]


@pytest.mark.slow
def test_no_rank_holds_whole_logits_or_whole_sequences(ranks):
    for report in ranks:
        train = report["train"]
        assert train["gathered"]["split"]["widest_logits"] == 64  # the old plan gathers them
        for variant in ("loss_parallel", "sequence_parallel", "tied_qk_norm", "tied_z_loss"):
            assert train[variant]["split"]["widest_logits"] == 32
        assert train["loss_parallel"]["split"]["residual_seq"] == 16
        assert train["sequence_parallel"]["split"]["residual_seq"] == 8
        assert train["tied_qk_norm"]["split"]["residual_seq"] == 8


# ---------------------------------------------------------------------------------------------------------
# chunked cross-entropy, one process


@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_chunked_loss_equals_plain_loss(z):
    """Values to a relative 1e-6, gradients of the head, the final norm and the hidden states to 1e-7 of
    gradients of size ~1e-3 (different summation order, so not bit for bit)."""
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=96, dim=32, n_layers=1, n_heads=2, max_seq_len=16, z_loss=z)
    model = Transformer(args)
    hidden = torch.randn(3, 10, 32)
    targets = torch.randint(0, 96, (3, 10))
    targets[1, 3:] = -1

    def run(chunks: int):
        model.zero_grad()
        h = hidden.clone().requires_grad_()
        model.configure_loss(chunks)
        loss = model.head_loss(h, targets)
        loss.backward()
        return loss.detach(), h.grad, model.output.weight.grad.clone(), model.norm.weight.grad.clone()

    plain = run(1)
    assert plain[0] == lm_loss(model.output(model.norm(hidden)), targets, z).detach()
    for chunks in (2, 7):
        got = run(chunks)
        assert got[0] == pytest.approx(float(plain[0]), rel=1e-6)
        for a, b in zip(got[1:], plain[1:], strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-7)


def test_chunked_loss_never_holds_whole_logits():
    """Every logits tensor the head makes, forward and backward (recomputed), is one chunk's rows."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    rows = []
    head.register_forward_hook(lambda module, inputs, output: rows.append(output.shape[0]))
    hidden = torch.randn(40, 16, requires_grad=True)
    loss = chunked_lm_loss(head, hidden, torch.randint(0, 50, (40,)), 0.0, 4)
    loss.backward()
    assert rows == [10] * 8  # 4 forward, 4 recomputed in backward


@pytest.mark.parametrize("z", [0.0, 1e-2])
@pytest.mark.parametrize("chunks", [1, 3])
def test_fused_loss_equals_plain_loss(z, chunks):
    """`train.ce_fused`: the same loss (relative 1e-6) and gradients of the head, the final norm and the hidden
    states (1e-7 of gradients of size ~1e-3) in fp32; in bf16 autocast the same to bf16's rounding of the
    head's matmuls, which both paths round alike with one chunk; without gradients, the same loss as with."""
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=96, dim=32, n_layers=1, n_heads=2, max_seq_len=16, z_loss=z)
    model = Transformer(args)
    hidden = torch.randn(3, 10, 32)
    targets = torch.randint(0, 96, (3, 10))
    targets[1, 3:] = -1

    def run(fused: bool, dtype: torch.dtype):
        model.zero_grad()
        h = hidden.clone().requires_grad_()
        model.configure_loss(chunks, fused=fused)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = model.head_loss(h, targets) / 2  # a share of an accumulated step's loss
        loss.backward()
        return loss.detach(), h.grad, model.output.weight.grad.clone(), model.norm.weight.grad.clone()

    plain, fused = run(False, torch.float32), run(True, torch.float32)
    assert fused[0] == pytest.approx(float(plain[0]), rel=1e-6)
    for a, b in zip(fused[1:], plain[1:], strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-7)
    plain, fused = run(False, torch.bfloat16), run(True, torch.bfloat16)
    assert fused[0] == pytest.approx(float(plain[0]), rel=1e-6)
    tolerance = 1e-6 if chunks == 1 else 5e-3  # several chunks: each chunk's weight gradient rounded to bf16
    for a, b in zip(fused[1:], plain[1:], strict=True):
        assert (a - b).abs().max() <= tolerance * b.abs().max()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.head_loss(hidden, targets) == 2 * fused[0]  # evaluation and replays: the same arithmetic
    assert fused_lm_loss(hidden, model.output.weight, targets, z, chunks).requires_grad


# ---------------------------------------------------------------------------------------------------------
# what is refused, and what the planner counts


def test_tied_and_qk_norm_are_no_longer_refused_with_tp():
    llama = get_model_spec("llama")
    assert llama.tp_refusal(ModelArgs(tie_embeddings=True, qk_norm=True), 2) is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--parallel.tp=2", "--train.seq_len=63", "--model.max_seq_len=64"], "must be divisible by parallel.tp"),
        (["--parallel.tp=2", "--train.ce_chunks=4"], "train.ce_chunks > 1 is for tp = 1"),
        (["--parallel.tp=2", "--train.ce_fused=true"], "train.ce_fused is for tp = 1"),
    ],
)
def test_impossible_settings_are_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, tmp_path / "corpus.jsonl", *overrides)


def test_planner_counts_the_logits_each_rank_holds():
    args = ModelArgs(vocab_size=128_000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8)
    kw = {"micro_batch": 1, "seq_len": 8192, "tp": 8}
    gathered = activation_memory(args, **kw, loss_parallel=False).head
    split = activation_memory(args, **kw, loss_parallel=True, sequence_parallel=True).head
    logits = 12 * 8192 * 128_000
    assert gathered - split == pytest.approx(logits * 7 / 8 + 2 * 2 * 8192 * 4096 * 7 / 8)
    one = activation_memory(args, micro_batch=1, seq_len=8192, dtype="fp32").head
    chunked = activation_memory(args, micro_batch=1, seq_len=8192, dtype="fp32", ce_chunks=8).head
    assert one - chunked == pytest.approx(logits * 7 / 8)
    # in bf16 the recomputed chunks cast the head's weight again
    one = activation_memory(args, micro_batch=1, seq_len=8192).head
    chunked = activation_memory(args, micro_batch=1, seq_len=8192, ce_chunks=8).head
    assert one - chunked == pytest.approx(logits * 7 / 8 - 2 * 128_000 * 4096)


def test_train_module_takes_ce_chunks(tmp_path):
    """`train.ce_chunks` reaches the model through the train module: the same step loss and gradients."""
    from liandan.common.layout import Layout
    from liandan.data.tokens.loader import Batch
    from liandan.train.causal_lm import CausalLMTrainModule

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 33), generator=generator)
    batch = Batch(tokens[:, :-1], tokens[:, 1:], torch.zeros(2, 32, dtype=torch.int32))
    results = []
    for chunks in (1, 4):
        cfg = tiny_config(tmp_path, tmp_path / "corpus.jsonl", f"--train.ce_chunks={chunks}", "--model.z_loss=1e-3")
        module = CausalLMTrainModule(cfg, 256, None, Layout(1, 1, 1), torch.device("cpu"), torch.float32)
        loss = module.train_batch([batch], lambda *a, **k: None)
        results.append((float(loss), module.model.output.weight.grad.clone()))
    assert module.model.ce_chunks == 4
    cfg = tiny_config(tmp_path, tmp_path / "corpus.jsonl", "--train.ce_fused=true", "--model.z_loss=1e-3")
    module = CausalLMTrainModule(cfg, 256, None, Layout(1, 1, 1), torch.device("cpu"), torch.float32)
    loss = module.train_batch([batch], lambda *a, **k: None)
    assert module.model.ce_fused
    assert float(loss) == pytest.approx(results[0][0], rel=1e-6)
    assert torch.allclose(module.model.output.weight.grad, results[0][1], rtol=0, atol=1e-7)
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-6)
    assert torch.allclose(results[1][1], results[0][1], rtol=0, atol=1e-7)


def test_a_vocabulary_tp_cannot_split_is_refused_before_sharding(tmp_path):
    from liandan.common.layout import Layout
    from liandan.train.causal_lm import CausalLMTrainModule

    cfg = tiny_config(tmp_path, tmp_path / "corpus.jsonl", "--parallel.tp=2", "--model.vocab_size=321")
    with pytest.raises(ConfigError, match="vocabulary of 321 does not split evenly over parallel.tp = 2"):
        CausalLMTrainModule(cfg, 257, None, Layout(1, 1, 2), torch.device("cpu"), torch.float32)
