"""The command line as a user meets it: real subprocesses, exit codes and messages."""

import json
import subprocess
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from helpers import (
    SHARED_DATA,
    environment_without,
    liandan_here,
    read_run,
    run_liandan,
    start_liandan,
    tiny_config,
    write_corpus,
)


def assert_one_line_error(done, *words, code=2):
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("liandan: error: "), done.stderr
    for word in words:
        assert word in lines[0]


def refused_here(*args) -> subprocess.CompletedProcess:
    """`liandan ARGS...` that its own checks stop before any worker starts, run in this process: no interpreter
    and torch to start for each mistake. A warning counts as a line of stderr, as it would in a process of its
    own: Python's default filters, not this session's, decide which are shown."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", hidden)
        done = liandan_here(*args)
    printed = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in shown)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout, done.stderr + printed)


# found by the workers, not by the process that starts them: only a real launch shows what the user sees
FOUND_BY_THE_WORKERS = {"--data.tokenizer=/no/tokenizer.json"}


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
        (
            ["--parallel.tp=2"],
            ["parallel.dp_replicate x parallel.tp = 2 must divide", "number of processes, 1 (--nproc"],
        ),
        (["--run.output_dir=/proc/liandan-runs"], ["/proc/liandan-runs"]),
        (["--run.name=../../outside"], ["run.name = '../../outside' must be one directory name"]),
        (["--run.name=/tmp/absolute-run"], ["run.name = '/tmp/absolute-run' must be one directory name"]),
        (["--optim.lr=nan"], ["optim.lr = nan must be a finite number"]),
        (["--optim.lr=inf"], ["optim.lr = inf must be a finite number"]),
        (['--train.callbacks=["no_such_callbacks"]'], ["train.callbacks: cannot import 'no_such_callbacks'"]),
        (['--train.callbacks=["a/b.py"]'], ["train.callbacks: 'a/b.py' is not a module name"]),
        (["--parallel.tp=2", "--train.ce_chunks=4"], ["train.ce_chunks > 1 is for tp = 1"]),
    ],
)
def test_user_mistakes_give_one_line_and_nonzero_exit(config, args, words):
    launch = run_liandan if FOUND_BY_THE_WORKERS & set(args) else refused_here
    done = launch("train", config, *args)
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
    # a typo of 1000 for 10 starts no process: one interpreter each would swamp the machine
    assert_one_line_error(run_liandan("train", config, "--nproc=100000"), "--nproc = 100000 is more local processes")


def test_config_command(config):
    done = run_liandan("config", config, "--train.steps=11")
    assert done.returncode == 0 and "steps = 11" in done.stdout
    keys = run_liandan("config", "--keys")
    assert keys.returncode == 0 and "model.llama.qk_norm" in keys.stdout


@pytest.mark.slow
def test_train_command_end_to_end(config):
    done = run_liandan("train", config, "--run.name=cli")
    assert done.returncode == 0, done.stderr
    assert "run directory:" in done.stdout and "final loss" in done.stdout
    summary = read_run(config.parent / "runs" / "cli").summary
    assert summary["steps"] == 6


@pytest.mark.parametrize("supervised", [True, False], ids=["supervised", "alone"])
def test_a_run_whose_console_goes_away_trains_on_to_its_end(config, supervised):
    """The program reading a run's output ends (a pipe into `head`, a driver script killed): the run goes on
    quietly and saves its last checkpoint, where it used to die of BrokenPipeError at its next line, unsaved."""
    name = f"console-gone-{supervised}"
    run = start_liandan("train", config, f"--run.name={name}", f"--resilience.supervise={str(supervised).lower()}",
                        "--train.steps=12")  # fmt: skip
    assert run.stdout.readline().startswith("run directory:")
    run.stdout.close()
    run.stderr.close()  # every line from here on meets a closed pipe
    assert run.wait(timeout=300) == 0
    records = read_run(config.parent / "runs" / name)
    assert records.summary["steps"] == 12 and records.of_kind("train_end")
    assert (config.parent / "runs" / name / "checkpoints" / "step-00000012").is_dir()


def _wait_for(condition, process, what, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the process ended ({process.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.1)


@pytest.mark.slow
def test_one_run_at_a_time_in_a_run_directory(config):
    run_dir = config.parent / "runs" / "locked"
    # The first run checkpoints step 2 and then hangs there, holding the run directory.
    first = start_liandan("train", config, "--run.name=locked", "--resilience.supervise=false",
                          "--checkpoint.every=1", "--checkpoint.async_save=false",
                          env=environment_without(LIANDAN_FAULTS="hang@step:2"), quiet=True)  # fmt: skip
    try:
        _wait_for(lambda: (run_dir / "checkpoints" / "step-00000002" / "manifest.json").is_file(), first, "step 2")
        metrics = (run_dir / "metrics.jsonl").read_text()
        for how in ([], ["--resilience.supervise=false"]):  # refused by a supervisor and by a plain run alike
            done = run_liandan("train", config, "--run.name=locked", *how)
            assert_one_line_error(done, f"run directory {run_dir} is in use", f"pid {first.pid} on ")
        assert (run_dir / "metrics.jsonl").read_text() == metrics  # the refused runs touched nothing
    finally:
        first.kill()  # SIGKILL: the kernel releases the lock
        first.wait()
    # The next run takes the directory: its supervisor holds the lock and its two workers train under it.
    done = run_liandan("train", config, "--run.name=locked", "--nproc=2")
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stdout and "done: 6 steps" in done.stdout
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6


@pytest.mark.slow
def test_demo_runs_on_pythons_own_docs(tmp_path):
    # A short guard warmup and ring, so that 50 steps fit the poisoned batch, its rollback and the kill after them.
    # The demo's own vocabulary of 4096: with 512 ids a model this young is close to uniform over them, and noise
    # costs it too little more than text for a spike.
    done = run_liandan("demo", "--steps=50", "--output-dir", tmp_path, "--train.global_batch=4",
                       "--guard.warmup=8", "--guard.ring_every=10")  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Python documentation corpus" in out
    assert "sample, prompted with 'The for statement'" in out
    assert "rank 1 will be killed (SIGKILL) after step 20" in out and "with 1 restart(s)" in out
    assert "CRASH" in out and "resumed at step 20 from the in-memory snapshot" in out  # no step lost
    # every launch checks its machines first, and the health checks say what the layout lets them compare
    assert out.count("doctor: all 2 rank(s) on 1 host(s) passed") == 2, out
    assert "sdc: layout fsdp" in out and "doctor.json" in out
    [poisoned_line] = [line for line in out.splitlines() if line.startswith("poisoned data step 18: its ")]
    rollbacks = [line for line in out.splitlines() if "ROLLBACK" in line]
    assert len(rollbacks) == 1 and "at step 19: " in rollbacks[0], out
    assert "back to step 10, skipped data steps 10..18" in rollbacks[0]
    assert "bad data: data step(s) 18 (" in rollbacks[0]
    # each incident triaged on the line under it: the poisoned batch as data, the kill from outside as unknown
    lines = out.splitlines()
    assert lines[lines.index(rollbacks[0]) + 1].strip().startswith("-> data: data step(s) 18 are anomalous"), out
    [crash] = [line for line in lines if "CRASH" in line]
    assert lines[lines.index(crash) + 1].strip().startswith("-> unknown: rank 1 on "), out
    run_dir, data_dir = sorted(p for p in tmp_path.iterdir() if p.is_dir())  # demo-<time>, demo-<time>-data
    # The guard names exactly the documents made noise, found here by comparing the store trained on with the
    # pipeline's.
    from liandan.data import TokenStore

    store = data_dir / "stores" / "corpus-poisoned"
    clean, poisoned = TokenStore(data_dir / "stores" / "corpus"), TokenStore(store)
    changed = []
    for index, (a, b) in enumerate(zip(clean.shards, poisoned.shards, strict=True)):
        differs = np.flatnonzero(np.asarray(a.tokens) != np.asarray(b.tokens))
        changed += [
            ("corpus-poisoned", index, int(d), *b.provenance(int(d))) for d in np.unique(a.document_of(differs))
        ]
    [rollback] = read_run(run_dir).of_kind("rollback")
    assert rollback["culprit_data_steps"] == [18]
    report = json.loads(Path(rollback["report"]).read_text())
    named = [(d["store"], d["shard"], d["document"], d["source"], d["id"]) for d in report["documents"]]
    assert changed and named == sorted(changed)
    assert f"its {len(named)} document(s) are random tokens" in poisoned_line
    for name in ("config.toml", "metrics.jsonl", "summary.json", "training.png", "hf/config.json",
                 "guard/spike-step-00000019.json", "doctor.json"):  # fmt: skip
        assert (run_dir / name).exists(), name
    skipped = liandan_here("skipped", run_dir, check=True).stdout
    assert skipped.startswith(f"9 skipped batch(es) of {run_dir} (") and "  data step 18: " in skipped
    for name in ("summary.json", "stores/corpus/manifest.json", "stores/corpus/tokenizer.json", "report/report.html"):
        assert (data_dir / name).exists(), name
    summary = json.loads((data_dir / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["normalize", "language", "pii", "gopher_repetition"]
    # a live forecast of the final loss, fitted beside training, set against what the run measured
    assert "forecast of the final loss from step " in out and "; measured " in out
    import tomllib

    config = tomllib.loads((run_dir / "config.toml").read_text())
    assert config["data"]["stores"] == [str(store)]
    assert f"run directory: {run_dir}" in out
    # it ends with the commands that show the run: the dashboard on its project, the report it wrote
    assert f"liandan dash {tmp_path}" in out and f"liandan report {run_dir}" in out
    assert "ROLLBACK at step 19" in (run_dir / "report.html").read_text()
    if SHARED_DATA.is_dir():  # its last word: a few cloze items under every prompt format, never one number
        [spread] = [line for line in out.splitlines() if line.strip().startswith("cloze_en: acc mean")]
        assert "spread" in spread and "over 5 formats, 10 items" in spread


def test_demo_takes_a_directory_of_data_files(tmp_path):
    from liandan.cli.demo import prepare_data
    from liandan.data.pipeline.layout import PipelineLayout

    data = tmp_path / "my-text"
    (data / "drafts").mkdir(parents=True)
    (data / "b-prose.txt").write_text("".join(f"Paragraph {i} says something about parsing.\n\n" for i in range(30)))
    records = [json.dumps({"text": f"Record {i} is a document."}) + "\n" for i in range(20)]
    (data / "a-records.jsonl").write_text("".join(records))
    (data / "notes.csv").write_text("not,a,corpus\n")  # neither is what is in drafts/: only data files directly in it
    (data / "drafts" / "c.txt").write_text("A draft.\n")
    summary = prepare_data([str(data)], tmp_path / "out", 300)
    assert summary["tasks"] == 2 and summary["read"]["documents"] == 50
    markers = PipelineLayout(tmp_path / "out").state_dir.glob("clean-*.json")  # one done marker per task
    tasks = [json.loads(p.read_text())["task"]["path"] for p in markers]
    assert sorted(tasks) == [str(data / "a-records.jsonl"), str(data / "b-prose.txt")]

    empty = tmp_path / "empty"
    empty.mkdir()
    done = run_liandan("demo", "--data", empty, "--output-dir", tmp_path)
    assert_one_line_error(done, f"--data {empty}: the directory holds no .txt, .jsonl or .parquet files")
    before = set(tmp_path.iterdir())
    done = run_liandan("demo", "--steps", "0", "--output-dir", tmp_path)  # refused before any data is written
    assert_one_line_error(done, "train.steps = 0 is too small; it must be >= 1")
    assert set(tmp_path.iterdir()) == before


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_DATA / "corpus").is_dir(), reason="../shared/data is absent")
def test_demo_on_users_chinese_and_english_files(tmp_path):
    # Two steps: rank 1 is killed after the first, as in a longer run, and the run resumes for the second; what is
    # asked of the user's files is the data summary below.
    files = [SHARED_DATA / "corpus" / "zh-classics.jsonl", SHARED_DATA / "corpus" / "en-shakespeare.txt"]
    done = run_liandan(
        "demo",
        "--data",
        *files,
        "--steps=2",
        "--output-dir",
        tmp_path,
        "--train.global_batch=4",
        "--data.bpe_vocab_size=1024",
    )
    assert done.returncode == 0, done.stderr
    data_dir = next(p for p in tmp_path.iterdir() if p.name.endswith("-data"))
    summary = json.loads((data_dir / "summary.json").read_text())
    assert summary["read"]["documents"] > 5407  # every Chinese record and Shakespeare's paragraphs
    assert summary["stores"]["corpus"]["tokens"] > 100_000


def test_an_error_line_is_never_empty():
    """Whatever reaches the command line names what failed: the exception's type, and an OS error's path."""
    from liandan.checkpoint.verify import CheckpointError
    from liandan.cli.main import describe_error

    assert describe_error(CheckpointError("")) == "CheckpointError (no message)"
    assert describe_error(OSError()) == "OSError: no message"
    full = OSError(28, "No space left on device", "/runs/x/events.jsonl")
    assert describe_error(full) == "OSError: No space left on device: /runs/x/events.jsonl"
    assert describe_error(FileNotFoundError(2, "No such file or directory", "a.toml")).startswith("FileNotFoundError: ")
