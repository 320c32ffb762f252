"""FP8 training through torchao's float8 linears, on the CPU in torchao's emulation (the casts to fp8 and
back happen; the matmuls run in the compute dtype), plus the refusals, MFU's peak and the planner's count."""

import sys

import pytest
import torch

pytest.importorskip("torchao.float8")

from helpers import environment_without, read_metrics, run_liandan, tiny_config, write_corpus
from liandan.common.layout import Layout
from liandan.common.peaks import gpu_peak_flops_fp8, mixed_peak_flops
from liandan.config import ConfigError, load_config
from liandan.model import ModelArgs, Transformer
from liandan.plan.devices import resolve_device
from liandan.plan.memory import memory_per_device
from liandan.plan.run_plan import plan_config
from liandan.train import Trainer
from liandan.train.fp8 import Fp8, convert_to_fp8, fp8_refusal

STEPS = 6
# Emulated fp8 moves the loss of this tiny model by under 1e-3 in 6 steps (measured: 2e-4 to 6e-4); 1e-2
# leaves room across platforms while a broken conversion (wrong scales, a lost gradient) moves it far more.
LOSS_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One short fp32 run and the same run with each recipe, emulated."""
    tmp = tmp_path_factory.mktemp("fp8")
    corpus = write_corpus(tmp)
    out = {}
    for recipe in ("none", "tensorwise", "rowwise"):
        cfg = tiny_config(tmp / recipe, corpus, f"--train.steps={STEPS}", f"--train.fp8={recipe}",
                          "--train.fp8_emulate=true")  # fmt: skip
        trainer = Trainer(cfg, say=lambda m: None)
        out[recipe] = (trainer, trainer.train())
    return out


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_fp8_training_tracks_the_fp32_losses(runs, recipe):
    reference = runs["none"][1].losses
    losses = runs[recipe][1].losses
    assert len(losses) == len(reference) == STEPS
    gaps = [abs(a - b) for a, b in zip(losses, reference, strict=True)]
    assert max(gaps) < LOSS_TOLERANCE
    assert max(gaps) > 0  # the fp8 casts really ran
    assert losses[-1] < losses[0]


def test_fp8_run_converts_the_block_linears_and_logs_both_mfus(runs):
    trainer, result = runs["rowwise"]
    model = trainer.module.model
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds.pop("output") == "Linear"
    assert set(kinds.values()) == {"Float8Linear"} and len(kinds) == 2 * 7  # 2 layers x q, k, v, o, w1, w2, w3
    args = trainer.module.args
    per_layer = 2 * args.dim * args.n_heads * args.head_dim + 2 * args.dim * args.n_kv_heads * args.head_dim
    per_layer += 3 * args.dim * args.ffn_dim
    assert trainer.module.fp8_params == args.n_layers * per_layer
    assert trainer.module.fp8_share == pytest.approx(6 * args.n_layers * per_layer / trainer.module.flops_per_token)
    # Emulated on the CPU, the fp8 matmuls run at the compute dtype's peak: both MFUs are the same number.
    last = read_metrics(result.run_dir)[-1]
    assert last["mfu_dtype_peak"] == pytest.approx(last["mfu"])
    assert "mfu_dtype_peak" not in read_metrics(runs["none"][1].run_dir)[-1]


def test_skip_patterns_choose_what_stays_in_high_precision():
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=64, max_seq_len=16))
    keys = list(model.state_dict())
    converted = convert_to_fp8(model, Fp8("tensorwise", ["output", "layers.1.*"], emulate=True))
    assert list(model.state_dict()) == keys  # checkpoints and exports move between fp8 and bf16 runs
    assert converted and all(name.startswith("layers.0.") for name in converted)
    assert type(model.layers["1"].attention.wq).__name__ == "Linear"
    loss = model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
    loss.backward()
    assert model.layers["0"].attention.wq.weight.grad is not None


def test_refusals_are_one_line(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    message = fp8_refusal("rowwise", cpu)
    assert message and "CUDA" in message and "\n" not in message
    assert fp8_refusal("rowwise", cpu, emulate=True) is None
    # A linear whose size fp8 matmuls cannot take (dim 40: 40 % 16 != 0) is named with the way out.
    corpus = write_corpus(tmp_path)
    cfg = tiny_config(tmp_path / "run", corpus, "--model.dim=40", "--model.n_heads=2", "--model.n_kv_heads=1",
                      "--train.fp8=tensorwise", "--train.fp8_emulate=true")  # fmt: skip
    with pytest.raises(ConfigError, match=r"linear 'layers\.0\.attention\.\w+' is 40 -> .*train\.fp8_skip"):
        Trainer(cfg, say=lambda m: None)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        Trainer(tiny_config(tmp_path / "cpu", corpus, "--train.fp8=tensorwise"), say=lambda m: None)
    with pytest.raises(ConfigError, match="tp > 1 is not supported"):
        load_config(None, ["--train.fp8=rowwise", "--parallel.tp=2"])
    # torchao absent: a None entry in sys.modules makes its import fail as an uninstalled package does.
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    assert fp8_refusal("tensorwise", cpu, emulate=True) == (
        "train.fp8 needs torchao, which is not installed: pip install 'liandan[fp8]'"
    )


def test_mixed_peak_by_hand():
    assert gpu_peak_flops_fp8("NVIDIA H100 80GB HBM3") == 1979e12
    assert gpu_peak_flops_fp8("NVIDIA A100-SXM4-80GB") is None  # no fp8 tensor cores
    # 3/4 of the FLOPs at 1979 TFLOP/s, 1/4 at 989: 1 / (0.75 / 1979 + 0.25 / 989) = 1582.9 TFLOP/s.
    assert mixed_peak_flops(989e12, 1979e12, 0.75) == pytest.approx(1582.9e12, rel=1e-4)
    assert mixed_peak_flops(989e12, 1979e12, 0.0) == 989e12
    assert mixed_peak_flops(989e12, 1979e12, 1.0) == pytest.approx(1979e12)


def test_planner_counts_fp8_linears_in_time_and_memory(tmp_path):
    overrides = ["--model.dim=256", "--model.n_layers=4", "--model.n_heads=4", "--model.vocab_size=512",
                 "--model.max_seq_len=256", "--train.seq_len=256", "--train.global_batch=8", "--train.steps=100",
                 "--data.tokenizer=byte"]  # fmt: skip
    h100 = resolve_device("h100")
    plain = plan_config(load_config(None, overrides), h100, nproc=1)
    fp8 = plan_config(load_config(None, [*overrides, "--train.fp8=tensorwise"]), h100, nproc=1)
    args = plain.model
    per_layer = 4 * args.dim * args.dim + 3 * args.dim * args.ffn_dim  # n_kv_heads = n_heads: 4 square matrices
    assert fp8.fp8.params == 4 * per_layer and fp8.fp8.layers == 4 * 7
    share = 6 * fp8.fp8.params / fp8.flops.per_token
    expected_peak = 1 / (share / 1979e12 + (1 - share) / 989e12)
    assert fp8.time.peak_flops_per_device == pytest.approx(expected_peak)
    assert fp8.time.seconds == pytest.approx(plain.time.seconds * 989e12 / expected_peak)
    # bf16 on one device: the converted weights lose autocast's 2-byte copies and gain 2 bytes of fp8 casts
    # for one block at a time.
    assert fp8.memory.transient - plain.memory.transient == pytest.approx(-2 * fp8.fp8.params + 2 * per_layer)
    fsdp = Layout(1, 2, 1)
    kw = {"micro_batch": 1, "seq_len": 256}
    gap = memory_per_device(args, fsdp, fp8_params=fp8.fp8.params, **kw).transient
    assert gap - memory_per_device(args, fsdp, **kw).transient == pytest.approx(2 * per_layer)


@pytest.mark.slow
def test_emulated_fp8_under_two_rank_fsdp_tracks_one_process(runs, tmp_path):
    """FSDP2 gathers the converted linears' weights in the compute dtype and each rank casts them to fp8: the
    same losses as one process within the fp8 tolerance."""
    cfg = runs["tensorwise"][0].cfg
    config = tmp_path / "fsdp.toml"
    config.write_text(cfg.to_toml())
    done = run_liandan("train", config, "--nproc", "2", f"--run.output_dir={tmp_path}", "--run.name=fsdp",
                       "--parallel.backend=gloo", "--resilience.supervise=false", env=environment_without(),
                       timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(tmp_path / "fsdp") if "loss" in r]
    assert "fp8 tensorwise (emulated): " in done.stdout
    reference = runs["none"][1].losses
    assert max(abs(a - b) for a, b in zip(losses, reference, strict=True)) < LOSS_TOLERANCE


def test_importing_torchao_on_this_machine_prints_nothing():
    """torchao logs a warning for each of its CUDA kernel libraries it cannot load (on a CPU machine, all of
    them); liandan's import of it says nothing: a fresh interpreter, as every run is."""
    import subprocess
    import sys

    pytest.importorskip("torchao")
    code = "import torch; from liandan.train.fp8 import fp8_refusal; print(fp8_refusal('tensorwise', torch.device('cpu'), emulate=True))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout == "None\n"
    assert done.stderr == "", done.stderr
