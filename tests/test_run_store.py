"""The run store (liandan.db): real run directories written by the run's own loggers or by real training
processes, real SQLite files, real processes killed by real signals."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import MICRO_MODEL, environment_without, run_liandan, start_liandan, tiny_config, write_corpus
from liandan.cli.main import main
from liandan.config import load_config
from liandan.run import RunDir, holder_running, lock_run_dir
from liandan.track import JsonlLogger
from liandan.track.store import RunStore, StoreError

SRC = str(Path(__file__).resolve().parents[1] / "src")


def write_run(project, name, steps=20, *, loss=lambda s: 10.0 / s, start=True, end=True, **overrides):
    """A run directory as training leaves it, written through the run's own JSON-lines logger."""
    room = RunDir(project / name)
    room.path.mkdir(parents=True, exist_ok=True)
    room.write_config(load_config(None, [f"--run.name={name}", *overrides.get("config", [])]).to_toml())
    files = JsonlLogger(room)
    if start:
        files.log_event("train_start", step=0, tokens_per_step=1024, flops_per_token=3e6)
    for step in range(1, steps + 1):
        files.log_metrics(step, {"loss": loss(step), "lr": 1e-3, "tokens_per_s": 1000.0 + step})
    if end:
        files.log_event("train_end", step=steps, seconds=1.0)
    files.close()
    return room


def log_event(room, kind, **fields):
    files = JsonlLogger(room)
    files.log_event(kind, **fields)
    files.close()


def leave_dead_holder(room):
    """The run's lock taken by a process that has ended since: a run whose process died."""
    code = f"from liandan.run import lock_run_dir; lock_run_dir({str(room.path)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": SRC})


def file_curve(room, key):
    """{step: value} of one key as metrics.jsonl holds it (a step logged again replaces the earlier)."""
    return {r["step"]: r[key] for r in room.read_metrics() if key in r}


def store_curve(store, name, key):
    c = store.curve(name, key)
    return dict(zip(c["step"], c["y"], strict=True))


def tables(path):
    with sqlite3.connect(path) as db:
        return {t: db.execute(f"SELECT * FROM {t} ORDER BY 1, 2, 3").fetchall() for t in ("metrics", "events", "files")}


# -- two real training processes at once -------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two `liandan train` at once into one project directory, one supervised and one not, each ingesting
    after every record (store_every_s = 0) so that their writes to the store interleave."""
    root = tmp_path_factory.mktemp("pair")
    project = root / "runs"
    config = root / "tiny.toml"
    config.write_text(tiny_config(project, write_corpus(root), *MICRO_MODEL, "--train.steps=40").to_toml())
    common = ("--track.store_every_s=0", "--doctor.preflight=false", "--forecast.every=20")
    # Slow forward passes keep both training long enough to overlap, whatever their start-up takes.
    env = environment_without(LIANDAN_FAULTS="slow@forward:1")
    procs = [
        start_liandan("train", config, "--run.name=alpha", *common, env=env),
        start_liandan("train", config, "--run.name=beta", "--resilience.supervise=false", "--optim.lr=1e-3",
                      *common, env=env),
    ]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    return project


@pytest.mark.slow
def test_concurrent_writers_store_every_metric_of_both_runs(pair):
    alpha, beta = RunDir(pair / "alpha"), RunDir(pair / "beta")
    times = [[r["time"] for r in room.read_metrics()] for room in (alpha, beta)]
    assert times[0][0] < times[1][-1] and times[1][0] < times[0][-1], "the two runs did not train at once"
    with sqlite3.connect(pair / "liandan.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with RunStore(pair) as store:  # what the writers left, before any sync of ours
        for room in (alpha, beta):
            name = room.name
            keys = {k for r in room.read_metrics() for k in r} - {"step"}
            assert set(store.metric_keys(name)) == keys
            for key in keys:
                assert store_curve(store, name, key) == file_curve(room, key), (name, key)
            events = room.read_events()
            assert [e["kind"] for e in store.events(name)] == [e["kind"] for e in events]
            run = store.run(name)
            assert run["status"] == "finished" and run["step"] == 40
            assert run["tokens_per_step"] == 8 * 32 and run["flops_per_token"] > 0
            assert run["forecast"] is not None and run["final_loss"] == room.read_summary()["final_loss"]
        assert store.run("alpha")["goodput"] is not None  # the supervisor's summary, ingested after it ended
        assert store.run("beta")["goodput"] is None


@pytest.mark.slow
def test_rebuild_from_the_files_equals_the_incremental_store(pair, tmp_path):
    incremental = tables(pair / "liandan.db")
    with RunStore(pair) as store:
        before = store.runs()
        assert store.rebuild() == ["alpha", "beta"]
        assert store.runs() == before
    assert tables(pair / "liandan.db") == incremental


@pytest.mark.slow
def test_liandan_runs_lists_and_compares_real_runs(pair, capsys):
    done = run_liandan("runs", pair)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(line for line in lines if "status" in line)
    for column in ("run", "steps", "tokens", "loss", "val loss", "goodput", "restarts", "incidents", "forecast"):
        assert column in header
    rows = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in ("alpha", "beta")}
    assert set(rows) == {"alpha", "beta"} and all("finished" in r and "40" in r for r in rows.values())
    with RunStore(pair) as store:
        latest = {name: store.forecasts(name)[-1] for name in rows}
    for name, row in rows.items():  # the latest forecast: central value, interval, the step it was made at
        forecast = latest[name]
        assert f"{forecast['final_loss']:.3f} [{forecast['low']:.3f}-{forecast['high']:.3f}] @{forecast['step']}" in row
    assert main(["runs", str(pair), "--compare", "alpha", "beta", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["metrics"]["alpha"]["final_loss"] == RunDir(pair / "alpha").read_summary()["final_loss"]
    assert report["metrics"]["beta"]["tokens_per_s"] > 0 and 0 < report["metrics"]["beta"]["mfu"]
    differ = report["config_differs"]
    assert differ["optim.lr"] == [0.0003, 0.001] and differ["resilience.supervise"] == [True, False]
    assert "run.name" in differ and "train.steps" not in differ
    assert main(["runs", str(pair), "--compare", "alpha", "beta"]) == 0
    shown = capsys.readouterr().out
    assert "best_val_loss" in shown and "optim.lr" in shown and "resilience.supervise" in shown


# -- a writer killed in the middle of its transaction ------------------------------------------------------
KILLED_WRITER = """
import sys
from pathlib import Path
from liandan.run import RunDir
from liandan.track.store import RunStore
store = RunStore(sys.argv[1])
store.ingest(sys.argv[2])  # committed
db = store._db
db.execute("BEGIN IMMEDIATE")
store._ingest(db, RunDir(sys.argv[3]), RunDir(sys.argv[3]).name)  # not committed
print("in transaction", flush=True)
sys.stdin.read()  # until killed
"""


def test_a_writer_killed_mid_transaction_loses_nothing_committed(tmp_path):
    project = tmp_path / "runs"
    done, pending = write_run(project, "done", steps=30), write_run(project, "pending", steps=25)
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, project, done.path, pending.path],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": SRC})  # fmt: skip
    try:
        assert writer.stdout.readline().strip() == "in transaction"
        with RunStore(project) as reader:  # write-ahead logging: readers go on while a writer holds the lock
            assert reader.metric_keys("done") and not reader.metric_keys("pending")
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        writer.kill()
    assert writer.returncode == -signal.SIGKILL
    with sqlite3.connect(project / "liandan.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with RunStore(project, timeout_s=5) as store:
        assert store_curve(store, "done", "loss") == file_curve(done, "loss")
        assert store.metric_keys("pending") == []
        assert store.ingest(pending) == 25 + 2  # the dead writer's lock is gone and its lines are read again
        assert store_curve(store, "pending", "loss") == file_curve(pending, "loss")
        assert store.ingest(pending) == 0


# -- files that change under the store ---------------------------------------------------------------------
def test_a_rewritten_metrics_file_is_read_again(tmp_path):
    project = tmp_path / "runs"
    room = write_run(project, "r", steps=20)
    with RunStore(project) as store:
        store.ingest(room)
        room.truncate_metrics(10)  # a resume from step 10 drops the steps it trains again...
        files = JsonlLogger(room)
        for step in range(11, 16):  # ...and logs them anew
            files.log_metrics(step, {"loss": 100.0 + step})
        files.close()
        store.ingest(room)
        assert store_curve(store, "r", "loss") == file_curve(room, "loss")
        assert sorted(store_curve(store, "r", "loss")) == list(range(1, 16))
        # Appending after what was read keeps the rows read so far: only the new line is read.
        with room.metrics.open("a") as handle:
            handle.write(json.dumps({"step": 16, "loss": 7.0}) + "\n")
            handle.write('{"step": 17, "loss": 6')  # half-written: left for the next ingest
        assert store.ingest(room) == 1
        with room.metrics.open("a") as handle:
            handle.write('.5}\n{"step": 18, "loss": NaN}\n')
        assert store.ingest(room) == 2
        assert store_curve(store, "r", "loss")[17] == 6.5 and store_curve(store, "r", "loss")[18] is None
        room.metrics.unlink()
        store.ingest(room)
        assert store.metric_keys("r") == []


def test_odd_and_older_records_are_taken_as_the_run_readers_take_them(tmp_path):
    project = tmp_path / "runs"
    room = write_run(project, "r", steps=2)
    with room.metrics.open("a") as handle:  # files written before non-finite numbers were null, and odd keys
        handle.write('{"step": 3, "loss": "nan", "lr": NaN, "grad_norm": Infinity, "note": "x", "ok": true}\n')
        handle.write('{"step": "4", "loss": 1.0}\n[1, 2]\nnot json\n{"step": 5, "loss": 0.5}\n')
    with room.events.open("a") as handle:
        handle.write('{"time": 1.0, "kind": "eval", "step": 3, "loss": NaN}\n{"kind": 7}\n')
    with RunStore(project) as store:
        store.ingest(room)
        assert store_curve(store, "r", "loss") == {1: 10.0, 2: 5.0, 3: None, 5: 0.5}
        assert store_curve(store, "r", "lr")[3] is None and store_curve(store, "r", "grad_norm")[3] is None
        assert "note" not in store.metric_keys("r") and "ok" not in store.metric_keys("r")
        [evaluation] = store.evaluations("r")
        assert evaluation["loss"] is None  # kept as valid JSON: null
        assert [e["kind"] for e in store.events("r")] == ["train_start", "train_end", "eval"]


def test_a_corrupt_database_is_set_aside_and_rebuilt(tmp_path):
    project = tmp_path / "runs"
    room = write_run(project, "r", steps=12)
    (project / "liandan.db").write_bytes(b"this is not a database" * 100)
    with RunStore(project) as store:
        assert store_curve(store, "r", "loss") == file_curve(room, "loss")
    aside = list(project.glob("liandan.db.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not")
    # Pages broken inside a database whose header still reads: found broken when opened, set aside too.
    size = (project / "liandan.db").stat().st_size
    with open(project / "liandan.db", "r+b") as handle:
        handle.seek(4096)
        handle.write(os.urandom(size - 4096))
    write_run(project, "r2", steps=3)
    with RunStore(project) as store:
        assert {r["name"] for r in store.runs()} == {"r", "r2"}
        assert store_curve(store, "r2", "loss") == file_curve(RunDir(project / "r2"), "loss")
    assert len(list(project.glob("liandan.db.corrupt-*"))) == 2
    incremental = tables(project / "liandan.db")
    assert main(["runs", str(project), "--rebuild", "--json"]) == 0
    assert tables(project / "liandan.db") == incremental


# -- what the queries answer -------------------------------------------------------------------------------
LOCK_HOLDER = """
import sys
from pathlib import Path
from liandan.run import lock_run_dir
lock = lock_run_dir(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


def test_status_running_finished_interrupted_and_resumed(tmp_path):
    project = tmp_path / "runs"
    room = write_run(project, "r", steps=5, end=False)
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, room.path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SRC})  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with RunStore(project) as store:
            store.ingest(room)
            assert store.run("r")["status"] == "running"
            holder.kill()
            holder.wait(timeout=30)
            assert store.run("r")["status"] == "interrupted"  # told without reading the run's files again
            log_event(room, "train_end", step=5)
            store.ingest(room)
            assert store.run("r")["status"] == "finished"
            lock = lock_run_dir(room)  # a resume of the finished run, by this process
            log_event(room, "train_start", step=5)
            store.ingest(room)
            assert store.run("r")["status"] == "running"
            lock.release()
            for kind, status in (("preempted", "preempted"), ("train_stopped", "stopped"), ("gave_up", "gave up")):
                log_event(room, kind, step=5)
                store.ingest(room)
                assert store.run("r")["status"] == status
    finally:
        holder.kill()


def test_a_lock_whose_pid_went_to_a_newer_process_has_no_holder(tmp_path):
    room = RunDir(tmp_path / "r")
    lock = lock_run_dir(room)  # this process's lock...
    assert holder_running(room) is True
    taken = json.loads(room.lock.read_text())
    taken["started"] = "2001-01-01 00:00:00 +0000"  # ...had it been taken before this process started
    room.lock.write_text(json.dumps(taken))
    assert holder_running(room) is False
    lock.release()


def test_curves_by_tokens_and_flops_and_thinned_with_their_spikes(tmp_path):
    project = tmp_path / "runs"
    write_run(project, "r", steps=1000, loss=lambda s: 50.0 if s == 517 else 2.0)
    write_run(project, "old", steps=10, start=False, config=["--train.global_batch=2", "--train.seq_len=8"])
    with RunStore(project) as store:
        store.sync()
        tokens, flops = store.curve("r", "loss", x="tokens"), store.curve("r", "loss", x="flops")
        assert tokens["x"][:3] == [1024, 2048, 3072] and flops["x"][-1] == 1000 * 1024 * 3e6
        assert store.curve("old", "loss", x="tokens")["x"][:2] == [16, 32]  # from its config, the fallback
        with pytest.raises(ValueError, match="FLOPs"):
            store.curve("old", "loss", x="flops")
        thin = store.curve("r", "loss", max_points=100)
        assert len(thin["y"]) <= 100 and max(thin["high"]) == 50.0 and max(thin["y"]) < 50.0
        assert min(thin["low"]) == 2.0 and thin["step"][0] == 1
        part = store.curve("r", "loss", start=500, end=520)
        assert part["step"] == list(range(500, 521)) and part["y"][17] == 50.0
        assert store.curve("r", "loss", start=-(10**30), end=10**30)["step"][-1] == 1000  # huge ranges clamp
        with pytest.raises(ValueError, match="x must be"):
            store.curve("r", "loss", x="parsecs")


def test_hostile_names_never_reach_outside_the_project(tmp_path):
    project, outside = tmp_path / "runs", tmp_path / "secret"
    write_run(tmp_path, "secret", steps=3)
    write_run(project, "plain", steps=3)
    odd = "x'; DROP TABLE runs; -- ü ✓"
    write_run(project, odd, steps=3)
    (project / "escape").symlink_to(outside)
    (project / "alias").symlink_to(project / "plain")  # one run under two names: listed once, by its own
    with RunStore(project) as store:
        assert set(store.sync()) == {"plain", odd}
        for run in store.runs():
            assert os.path.commonpath([run["path"], str(project.resolve())]) == str(project.resolve())
        with pytest.raises(StoreError, match="not a run directory of"):
            store.ingest(outside)
        with pytest.raises(StoreError):
            store.ingest(project / "escape")
        with pytest.raises(KeyError):
            store.run("../secret")
        assert store.curve("../secret", "loss")["y"] == [] and store.events("../secret") == []
        assert store_curve(store, odd, "loss") == file_curve(RunDir(project / odd), "loss")
        import shutil

        shutil.rmtree(project / "plain")
        assert store.sync() == [odd] and [r["name"] for r in store.runs()] == [odd]  # gone from the store too


# -- liandan runs ------------------------------------------------------------------------------------------
def test_liandan_runs_on_a_project(tmp_path, capsys):
    project = tmp_path / "runs"
    write_run(project, "one", steps=8, config=["--train.seq_len=128"])
    leave_dead_holder(write_run(project, "two", steps=4, end=False))
    assert main(["runs", str(project)]) == 0
    out = capsys.readouterr().out
    one = next(line for line in out.splitlines() if line.startswith("one"))
    assert "finished" in one and "8" in one
    assert main(["runs", str(project), "--json"]) == 0
    listed = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert listed["two"]["status"] == "interrupted" and listed["one"]["step"] == 8 and "config" not in listed["one"]
    assert main(["runs", str(project), "--compare", "one", "two"]) == 0
    out = capsys.readouterr().out
    assert "train.seq_len" in out and "128" in out and "final_loss" in out
    assert main(["runs", str(tmp_path / "empty-project")]) == 2
    assert "project directory not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["runs", str(tmp_path / "empty")]) == 0 and "no runs in" in capsys.readouterr().out
    assert main(["runs", str(tmp_path / "empty"), "--json"]) == 0 and json.loads(capsys.readouterr().out) == []
    assert list((tmp_path / "empty").iterdir()) == []  # no store is left in a directory that holds no runs
    assert main(["runs", str(project / "one" / "config.toml")]) == 2
    assert "is a file, not a project directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, words",
    [
        (["--compare", "one", "missing"], ["no run named 'missing'", "runs: one"]),
        (["--compare", "one"], ["two or more run names"]),
        (["--train.steps=3"], ["takes no config overrides"]),
    ],
)
def test_liandan_runs_refuses_bad_input_in_one_line(tmp_path, capsys, args, words):
    project = tmp_path / "runs"
    write_run(project, "one", steps=2)
    assert main(["runs", str(project), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("liandan: error: ")
    for word in words:
        assert word in err[0]
    assert main(["runs", str(project / "one")]) == 2
    assert "is a run directory; its project directory is" in capsys.readouterr().err


def test_a_resumed_run_replaces_the_steps_it_trains_again_in_the_store(tmp_path):
    """Steps logged after the last checkpoint are trained again on resume (the trainer drops them from
    metrics.jsonl): the store, written by the trainer alone, ends up with the file's values, not the old ones."""
    from liandan.train import Trainer

    def train(steps):
        cfg = tiny_config(tmp_path / "runs", write_corpus(tmp_path), *MICRO_MODEL, "--run.name=resumed",
                          f"--train.steps={steps}", "--checkpoint.every=2", "--checkpoint.async_save=false",
                          "--doctor.preflight=false")  # fmt: skip
        trainer = Trainer(cfg, say=lambda m: None)
        try:
            return trainer.train()
        finally:
            trainer.close()

    room = RunDir(train(4).run_dir)
    with room.metrics.open("a") as handle:  # what a crash after step 6 of a longer invocation would have left
        for step in (5, 6):
            handle.write(json.dumps({"step": step, "time": 0.0, "loss": 99.0}) + "\n")
    with RunStore(room.project) as store:
        store.ingest(room)
        assert store_curve(store, "resumed", "loss")[6] == 99.0
    train(8)
    with RunStore(room.project) as store:
        for key in ("loss", "lr", "time", "step_time_s"):
            assert store_curve(store, "resumed", key) == file_curve(room, key), key
        assert sorted(store_curve(store, "resumed", "loss")) == list(range(1, 9))
        run = store.run("resumed")
        assert run["status"] == "finished" and run["step"] == 8 and run["tokens"] == 8 * 8 * 32
        assert [e["step"] for e in store.checkpoints("resumed")] == [2, 4, 6, 8]


def test_one_store_shared_by_threads_that_ingest_and_query_at_once(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    project = tmp_path / "runs"
    rooms = [write_run(project, f"r{i}", steps=200) for i in range(4)]

    def work(i):
        for _ in range(10):
            store.sync() if i % 2 else store.ingest(rooms[i])
            assert store_curve(store, rooms[i].name, "loss") == file_curve(rooms[i], "loss")
            store.runs()

    with RunStore(project) as store, ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(4)))


def test_incidents_checkpoints_evaluations_and_forecasts(tmp_path):
    project = tmp_path / "runs"
    room = write_run(project, "r", steps=10, end=False)
    for kind, fields in [("doctor", {"ok": True, "warnings": []}), ("doctor", {"ok": True, "warnings": ["slow"]}),
                         ("eval", {"step": 5, "loss": 3.0}), ("checkpoint_saved", {"step": 5, "path": "gone/step-5"}),
                         ("guard", {"step": 6, "action": "rollback"}), ("rollback", {"step": 6}),
                         ("incident", {"step": 8}), ("restart", {"step": 8}),
                         ("forecast", {"step": 10, "final_loss": 2.5, "low": 2.4, "high": 2.6}),
                         ("train_end", {"step": 10})]:  # fmt: skip
        log_event(room, kind, **fields)
    (room.checkpoints / "step-00000010").mkdir(parents=True)
    log_event(room, "checkpoint_saved", step=10, path=str(room.checkpoints / "step-00000010"))
    with RunStore(project) as store:
        store.sync()
        assert [e["kind"] for e in store.incidents("r")] == ["doctor", "rollback", "incident", "restart"]
        assert store.run("r")["incidents"] == 3  # the restart goes with its incident
        assert [(c["step"], c["present"]) for c in store.checkpoints("r")] == [(5, False), (10, True)]
        assert [e["loss"] for e in store.evaluations("r")] == [3.0]
        assert store.run("r")["forecast"]["final_loss"] == 2.5 == store.forecasts("r")[-1]["final_loss"]
        seq = store.incidents("r")[2]["seq"]
        assert store.event("r", seq)["kind"] == "incident" and store.event("r", 10**9) is None
        assert [e["kind"] for e in store.events("r", newest=2)] == ["train_end", "checkpoint_saved"]


def test_a_store_that_cannot_be_written_costs_the_run_one_warning(tmp_path):
    from liandan.train import Trainer

    project = tmp_path / "runs"
    (project / "liandan.db").mkdir(parents=True)  # where the database would go: not a file SQLite can open
    said = []
    cfg = tiny_config(project, write_corpus(tmp_path), *MICRO_MODEL, "--train.steps=3", "--doctor.preflight=false",
                      "--track.store_every_s=0")  # fmt: skip
    trainer = Trainer(cfg, say=said.append)
    try:
        result = trainer.train()
    finally:
        trainer.close()
    assert result.summary["steps"] == 3 and len(RunDir(result.run_dir).read_metrics()) == 3
    warnings = [m for m in said if "run store" in m]
    assert len(warnings) == 1, said  # once for the whole run
    assert warnings[0].startswith("warning: the run store is not updated from now on") and "liandan.db" in warnings[0]


def test_a_run_still_training_shows_its_latest_validation_loss(tmp_path, capsys):
    project = tmp_path / "runs"
    room = write_run(project, "training", steps=20, end=False)
    files = JsonlLogger(room)
    files.log_event("eval", step=10, loss=4.25)
    files.log_event("eval", step=20, loss=3.5)
    files.close()
    with RunStore(project) as store:
        store.ingest(room)
        assert store.run("training")["val_loss"] == 3.5  # no summary yet: the newest validation
    room.summary.write_text(json.dumps({"val_loss": 3.25}))
    with RunStore(project) as store:
        store.ingest(room)
        assert store.run("training")["val_loss"] == 3.25  # a finished run's own word
