"""The command line as a user meets it: real subprocesses, exit codes and messages."""

import json

import pytest

from helpers import SHARED_DATA, read_run, run_liandan, tiny_config, write_corpus


def assert_one_line_error(done, *words, code=2):
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("liandan: error: "), done.stderr
    for word in words:
        assert word in lines[0]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    path = root / "tiny.toml"
    path.write_text(tiny_config(root / "runs", write_corpus(root), "--run.name=").to_toml())
    return path


def test_help_lists_commands():
    done = run_liandan("--help")
    assert done.returncode == 0
    for command in ("train", "demo", "config"):
        assert command in done.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["--model.dim=abc"], ["model.dim", "'abc'", "integer"]),
        (["--model.widht=3"], ["unknown key 'model.widht'", "allowed:"]),
        (["--train.dtype=fp8"], ["train.dtype", "'fp8'", "'bf16'"]),
        (["stray"], ["unrecognised argument 'stray'"]),
        (['--data.paths=["/no/such/file.jsonl"]'], ["data file not found: /no/such/file.jsonl"]),
        (["--data.tokenizer=/no/tokenizer.json"], ["tokenizer file not found"]),
        (["--parallel.tp=2"], ["parallel.dp_replicate x parallel.tp = 2 must divide", "but 1 were launched"]),
        (["--run.output_dir=/proc/liandan-runs"], ["/proc/liandan-runs"]),
    ],
)
def test_user_mistakes_give_one_line_and_nonzero_exit(config, args, words):
    done = run_liandan("train", config, *args)
    code = 1 if "output_dir" in args[0] else 2
    assert_one_line_error(done, *words, code=code)


def test_missing_and_broken_config_files(tmp_path):
    assert_one_line_error(run_liandan("train", tmp_path / "absent.toml"), "config file not found")
    broken = tmp_path / "broken.toml"
    broken.write_text("[train]\nsteps = \n")
    assert_one_line_error(run_liandan("train", broken), "not valid TOML")
    assert_one_line_error(run_liandan("train", tmp_path / "absent.toml", "--nproc=0"), "config file not found")


def test_bad_nproc(config):
    assert_one_line_error(run_liandan("train", config, "--nproc=0"), "--nproc = 0")


def test_config_command(config):
    done = run_liandan("config", config, "--train.steps=11")
    assert done.returncode == 0 and "steps = 11" in done.stdout
    keys = run_liandan("config", "--keys")
    assert keys.returncode == 0 and "model.qk_norm" in keys.stdout


@pytest.mark.slow
def test_train_command_end_to_end(config):
    done = run_liandan("train", config, "--run.name=cli")
    assert done.returncode == 0, done.stderr
    assert "run directory:" in done.stdout and "final loss" in done.stdout
    summary = read_run(config.parent / "runs" / "cli").summary
    assert summary["steps"] == 6


@pytest.mark.slow
def test_demo_runs_on_pythons_own_docs(tmp_path):
    done = run_liandan("demo", "--steps=6", "--output-dir", tmp_path, "--train.global_batch=4", "--data.bpe_vocab_size=512")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Python documentation corpus" in out
    assert "sample, prompted with 'The for statement'" in out
    assert "rank 1 will be killed (SIGKILL) after step 2" in out and "with 1 restart(s)" in out
    assert "CRASH" in out and "resumed at step 2 from the in-memory snapshot" in out  # no step lost
    run_dir, data_dir = sorted(tmp_path.iterdir())  # demo-<time> and demo-<time>-data
    for name in ("config.toml", "metrics.jsonl", "summary.json", "training.png", "hf/config.json"):
        assert (run_dir / name).exists(), name
    for name in ("summary.json", "stores/corpus/manifest.json", "stores/corpus/tokenizer.json", "report/report.html"):
        assert (data_dir / name).exists(), name
    summary = json.loads((data_dir / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["normalize", "language", "gopher_repetition"]
    import tomllib

    config = tomllib.loads((run_dir / "config.toml").read_text())
    assert config["data"]["stores"] == [str(data_dir / "stores" / "corpus")]
    assert f"run directory: {run_dir}" in out


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_DATA / "corpus").is_dir(), reason="../shared/data is absent")
def test_demo_on_users_chinese_and_english_files(tmp_path):
    files = [SHARED_DATA / "corpus" / "zh-classics.jsonl", SHARED_DATA / "corpus" / "en-shakespeare.txt"]
    done = run_liandan("demo", "--data", *files, "--steps=4", "--output-dir", tmp_path, "--train.global_batch=4", "--data.bpe_vocab_size=1024")
    assert done.returncode == 0, done.stderr
    data_dir = next(p for p in tmp_path.iterdir() if p.name.endswith("-data"))
    summary = json.loads((data_dir / "summary.json").read_text())
    assert summary["read"]["documents"] > 5407  # every Chinese record and Shakespeare's paragraphs
    assert summary["stores"]["corpus"]["tokens"] > 100_000
