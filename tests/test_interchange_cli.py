"""`liandan export` / `liandan import` / `liandan ckpt info` on a real trained run. Those commands only read and
write files, so they run in this process; the runs train in processes of their own, without a supervisor
(nothing here crashes), and one export of the run serves every test that reads it."""

import os

import pytest
import torch

from helpers import faults_planned, liandan_here, read_run, run_liandan, tiny_config, write_corpus
from liandan.checkpoint.hf import load_consolidated
from liandan.checkpoint.loading import load_model


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("interchange")
    config = root / "tiny.toml"
    cfg = tiny_config(root / "runs", write_corpus(root), "--train.steps=4", "--checkpoint.every=4", "--run.name=",
                      "--data.tokenizer=bpe", "--data.bpe_vocab_size=300", "--resilience.supervise=false")  # fmt: skip
    config.write_text(cfg.to_toml())
    done = run_liandan("train", config, "--run.name=src")
    assert done.returncode == 0, done.stderr
    return config, root / "runs" / "src"


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """`liandan export RUN DIR --hf` of the trained run; the tests only read it."""
    _, run = trained
    out = tmp_path_factory.mktemp("exported") / "hf"
    done = liandan_here("export", run, out, "--hf")
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.slow
def test_export_hf_loads_in_transformers_with_matching_logits(trained, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run = trained
    ours, _meta = load_model(run / "checkpoints" / "step-00000004")
    theirs = AutoModelForCausalLM.from_pretrained(exported, torch_dtype=torch.float32)
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff < 1e-4
    tokenizer = AutoTokenizer.from_pretrained(exported)
    from liandan.data import HFTokenizer

    text = "The for statement iterates."
    assert tokenizer(text)["input_ids"] == HFTokenizer.load(run / "data" / "tokenizer.json").encode_batch([text])[0]


@pytest.mark.slow
def test_export_consolidated(trained, tmp_path):
    _, run = trained
    out = tmp_path / "model.safetensors"
    assert liandan_here("export", run, out, "--consolidated").returncode == 0
    state, args = load_consolidated(out)
    ours, _ = load_model(run / "checkpoints" / "step-00000004")
    assert args.dim == 64
    for key, value in ours.state_dict().items():
        assert torch.equal(state[key], value), key


@pytest.mark.slow
def test_import_hf_then_continue_training(trained, exported, tmp_path):
    config, run = trained
    done = liandan_here("import", exported, tmp_path / "imported", "--hf")
    assert done.returncode == 0, done.stderr
    assert "--checkpoint.init_from=" in done.stdout and "[model]" in done.stdout
    info = liandan_here("ckpt", "info", tmp_path / "imported")
    assert "verified" in info.stdout and "NOT" not in info.stdout
    cont = run_liandan("train", config, "--run.name=continued", f"--checkpoint.init_from={tmp_path / 'imported'}",
                   "--train.steps=2", "--schedule.warmup_steps=1",
                        "--checkpoint.every=0")  # fmt: skip
    assert cont.returncode == 0, cont.stderr
    fresh = run_liandan(
        "train", config, "--run.name=fresh", "--train.steps=2", "--schedule.warmup_steps=1", "--checkpoint.every=0"
    )
    assert fresh.returncode == 0

    def loss(name):
        return read_run(run.parent / name).metrics[0]["loss"]

    assert loss("continued") < loss("fresh")
    # The same shapes under another RoPE base would load and quietly train a different function: refused.
    wrong = run_liandan("train", config, "--run.name=wrong-base", f"--checkpoint.init_from={tmp_path / 'imported'}",
                        "--model.llama.rope_theta=500000", "--train.steps=1", "--schedule.warmup_steps=1",
                        "--checkpoint.every=0")  # fmt: skip
    _one_line_error(wrong, "checkpoint.init_from", "model.rope_theta = 500000.0 (checkpoint: 10000.0)")
    # A tokenizer of the same size trained on other text fits every tensor and gives the tokens other ids.
    other = write_corpus(tmp_path, n_docs=12)
    foreign = run_liandan("train", config, "--run.name=foreign-tokenizer", f'--data.paths=["{other}"]',
                          f"--checkpoint.init_from={tmp_path / 'imported'}", "--train.steps=1",
                          "--schedule.warmup_steps=1", "--checkpoint.every=0")  # fmt: skip
    tokenizer = tmp_path / "imported" / "tokenizer.json"
    _one_line_error(foreign, f"checkpoint.init_from = {tmp_path / 'imported'} was trained with the tokenizer {tokenizer}",
                    f"train with --data.tokenizer={tokenizer}")  # fmt: skip
    # A run's checkpoint: its tokenizer is the run's prepared data's, the one its fingerprint names.
    checkpoint = run / "checkpoints" / "step-00000004"
    from_run = run_liandan("train", config, "--run.name=foreign-tokenizer-run", f'--data.paths=["{other}"]',
                           f"--checkpoint.init_from={checkpoint}", "--train.steps=1", "--schedule.warmup_steps=1",
                           "--checkpoint.every=0")  # fmt: skip
    _one_line_error(from_run, f"was trained with the tokenizer {run / 'data' / 'tokenizer.json'}")


@pytest.mark.slow
def test_init_from_a_hf_directory_streams_into_a_meta_built_model(trained, tmp_path):
    """No import step: the exported directory itself starts the run, read into the model built on the meta
    device."""
    from liandan.checkpoint.hf import export_hf

    config, run = trained
    ours, _ = load_model(run / "checkpoints" / "step-00000004")
    export_hf(ours.state_dict(), ours.args, tmp_path / "hf")
    cont = run_liandan("train", config, "--run.name=from-hf", f"--checkpoint.init_from={tmp_path / 'hf'}",
                       "--train.meta_init=true", "--train.steps=1", "--schedule.warmup_steps=1",
                       "--checkpoint.every=0", f'--data.stores=["{run / "data"}"]')  # fmt: skip
    assert cont.returncode == 0, cont.stderr
    records = read_run(run.parent / "from-hf")
    (built,) = records.of_kind("model_built")
    assert built["meta_init"] is True and built["host_peak_bytes"] > 0
    (initialised,) = records.of_kind("initialised")
    assert initialised["bytes_read"] == 4 * sum(p.numel() for p in ours.parameters())
    assert records.metrics[0]["loss"] < read_run(run).metrics[0]["loss"]  # trained weights, not a fresh init


def test_bad_paths_are_one_line_errors(tmp_path):
    for args in (["ckpt", "info", tmp_path / "none"], ["export", tmp_path / "none", tmp_path / "o", "--hf"],
                 ["import", tmp_path / "none", tmp_path / "o", "--hf"]):  # fmt: skip
        done = liandan_here(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_an_export_path_that_cannot_be_written_is_one_line(trained, tmp_path):
    _, run = trained
    (tmp_path / "t.toml").write_text("")
    (tmp_path / "ck").mkdir()
    for out, kind, said in ((tmp_path / "t.toml" / "x.safetensors", "--consolidated", "t.toml is not a directory"),
                            (tmp_path / "ck", "--consolidated", "it is a directory; name a file in it"),
                            (tmp_path / "t.toml", "--hf", "it is a file, not a directory")):  # fmt: skip
        _one_line_error(liandan_here("export", run, out, kind), f"cannot write {out}: ", said)
    assert list((tmp_path / "ck").iterdir()) == []


def _one_line_error(done, *words):
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_export_and_ckpt_info_find_a_run_s_checkpoints_where_its_config_put_them(trained, tmp_path):
    config, _ = trained
    elsewhere = tmp_path / "elsewhere"
    done = run_liandan("train", config, "--run.name=ckpt-elsewhere", f"--checkpoint.dir={elsewhere}", "--train.steps=2",
                   "--checkpoint.every=2", "--schedule.warmup_steps=1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = config.parent / "runs" / "ckpt-elsewhere"
    assert not (run / "checkpoints").exists() and (elsewhere / "step-00000002" / "manifest.json").is_file()
    exported = liandan_here("export", run, tmp_path / "hf", "--hf")
    assert exported.returncode == 0, exported.stderr
    assert str(elsewhere / "step-00000002") in exported.stdout
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (run / "data" / "tokenizer.json").read_bytes()
    info = liandan_here("ckpt", "info", run)
    assert info.returncode == 0 and str(elsewhere / "step-00000002") in info.stdout, info.stdout + info.stderr
    assert info.stdout.rstrip().endswith(", verified"), info.stdout


def test_import_refuses_an_existing_target_before_writing_and_never_leaves_staging(exported, tmp_path):
    parent = tmp_path / "ckpt"
    target = parent / "imported"
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("mine")
    _one_line_error(liandan_here("import", exported, target, "--hf"), str(target), "already exists")
    assert os.listdir(parent) == ["imported"] and os.listdir(target) == ["notes.txt"]
    # a failure while the checkpoint is written leaves no staging directory behind either
    with faults_planned("enospc@save:0"):
        _one_line_error(liandan_here("import", exported, parent / "other", "--hf"), "No space left on device")
    assert os.listdir(parent) == ["imported"]


def test_export_hf_of_a_run_on_token_stores_includes_the_store_tokenizer(trained, tmp_path):
    from transformers import AutoTokenizer

    from liandan.config import load_config
    from liandan.data import HFTokenizer
    from liandan.data.pipeline.prepare import prepare_store

    config, _ = trained
    store = tmp_path / "store"
    prepare_store(load_config(config).data, store, say=lambda message: None)
    done = run_liandan("train", config, "--run.name=on-store", f'--data.stores=["{store}"]', "--train.steps=2",
                   "--checkpoint.every=2", "--schedule.warmup_steps=1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = config.parent / "runs" / "on-store"
    assert not (run / "data").exists()
    exported = liandan_here("export", run, tmp_path / "hf", "--hf")
    assert exported.returncode == 0 and "warning" not in exported.stdout, exported.stdout + exported.stderr
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (store / "tokenizer.json").read_bytes()
    text = "The for statement iterates."
    expected = HFTokenizer.load(store / "tokenizer.json").encode_batch([text])[0]
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == expected


def test_exported_weights_are_as_readable_as_the_files_beside_them(tmp_path):
    """safetensors creates its files 0600; an export follows the umask like config.json beside it."""
    from liandan.checkpoint.hf import export_hf, save_consolidated
    from liandan.model import ModelArgs, Transformer

    model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=64, max_seq_len=16))
    previous = os.umask(0o022)
    try:
        export_hf(model.state_dict(), model.args, tmp_path / "hf")
        save_consolidated(model.state_dict(), model.args, tmp_path / "model.safetensors")
    finally:
        os.umask(previous)
    mode = lambda path: path.stat().st_mode & 0o777
    assert mode(tmp_path / "hf" / "model.safetensors") == mode(tmp_path / "hf" / "config.json") == 0o644
    assert mode(tmp_path / "model.safetensors") == 0o644
