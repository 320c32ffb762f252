"""`liandan export` / `liandan import` / `liandan ckpt info` on a real trained run."""


import pytest
import torch

from helpers import read_run, run_liandan, tiny_config, write_corpus
from liandan.checkpoint.hf import load_consolidated
from liandan.checkpoint.manager import load_model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("interchange")
    config = root / "tiny.toml"
    cfg = tiny_config(root / "runs", write_corpus(root), "--train.steps=4", "--checkpoint.every=4", "--run.name=",
                      "--data.tokenizer=bpe", "--data.bpe_vocab_size=300")  # fmt: skip
    config.write_text(cfg.to_toml())
    done = run_liandan("train", config, "--run.name=src")
    assert done.returncode == 0, done.stderr
    return config, root / "runs" / "src"


@pytest.mark.slow
def test_export_hf_loads_in_transformers_with_matching_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run = trained
    done = run_liandan("export", run, tmp_path / "hf", "--hf")
    assert done.returncode == 0, done.stderr
    ours, _meta = load_model(run / "checkpoints" / "step-00000004")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff < 1e-4
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    from liandan.data import HFTokenizer

    text = "The for statement iterates."
    assert tokenizer(text)["input_ids"] == HFTokenizer.load(run / "data" / "tokenizer.json").encode_batch([text])[0]


@pytest.mark.slow
def test_export_consolidated(trained, tmp_path):
    _, run = trained
    out = tmp_path / "model.safetensors"
    assert run_liandan("export", run, out, "--consolidated").returncode == 0
    state, args = load_consolidated(out)
    ours, _ = load_model(run / "checkpoints" / "step-00000004")
    assert args.dim == 64
    for key, value in ours.state_dict().items():
        assert torch.equal(state[key], value), key


@pytest.mark.slow
def test_import_hf_then_continue_training(trained, tmp_path):
    config, run = trained
    assert run_liandan("export", run, tmp_path / "hf", "--hf").returncode == 0
    done = run_liandan("import", tmp_path / "hf", tmp_path / "imported", "--hf")
    assert done.returncode == 0, done.stderr
    assert "--checkpoint.init_from=" in done.stdout
    info = run_liandan("ckpt", "info", tmp_path / "imported")
    assert "verified" in info.stdout and "NOT" not in info.stdout
    cont = run_liandan("train", config, "--run.name=continued", f"--checkpoint.init_from={tmp_path / 'imported'}",
                   "--train.steps=2", "--schedule.warmup_steps=1", "--checkpoint.every=0")  # fmt: skip
    assert cont.returncode == 0, cont.stderr
    fresh = run_liandan("train", config, "--run.name=fresh", "--train.steps=2", "--schedule.warmup_steps=1", "--checkpoint.every=0")
    assert fresh.returncode == 0
    def loss(name):
        return read_run(run.parent / name).metrics[0]["loss"]

    assert loss("continued") < loss("fresh")


def test_bad_paths_are_one_line_errors(tmp_path):
    for args in (["ckpt", "info", tmp_path / "none"], ["export", tmp_path / "none", tmp_path / "o", "--hf"],
                 ["import", tmp_path / "none", tmp_path / "o", "--hf"]):  # fmt: skip
        done = run_liandan(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
