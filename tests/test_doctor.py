"""The hardware doctor: `liandan doctor` alone and with --nproc, the preflight of `liandan train`, bisection of
suspect ranks, and the verdicts on made-up records. Device faults come from $LIANDAN_FAULTS in subprocesses
(`perturb@matmul`: a rank's matrix products are wrong in rare elements; `corrupt@allreduce`: a rank's first
collective contribution goes out wrong)."""

from __future__ import annotations

import json
import os
import time

import pytest

from helpers import MICRO_MODEL, liandan_here, read_run, run_liandan, tiny_config, write_corpus
from liandan.config import load_config
from liandan.run.worker_env import node_name

HOST = node_name()  # the workers' host: they run here, under the same environment


def doctor(tmp, *args, faults: str | None = None, name: str = "report"):
    """`liandan doctor ARGS` in a subprocess, with its JSON report (None when it wrote none) and wall time."""
    env = {**os.environ, "LIANDAN_FAULTS": faults} if faults else None
    report = tmp / f"{name}.json"
    started = time.perf_counter()
    done = run_liandan("doctor", f"--json={report}", f"--run.output_dir={tmp / 'runs'}", *args, env=env, timeout=300)
    seconds = time.perf_counter() - started
    return done, (json.loads(report.read_text()) if report.is_file() else None), seconds


@pytest.fixture(scope="module")
def clean_two_ranks(tmp_path_factory):
    return doctor(tmp_path_factory.mktemp("clean"), "--nproc=2")


@pytest.fixture(scope="module")
def wrong_products(tmp_path_factory):
    return doctor(tmp_path_factory.mktemp("perturb"), "--nproc=2", faults="perturb@matmul:0:1")


@pytest.fixture(scope="module")
def wrong_contribution(tmp_path_factory):
    """Three ranks, so that the pairs are tested too (after the all-gather that the fault, once, spoiled)."""
    return doctor(tmp_path_factory.mktemp("corrupt"), "--nproc=3", faults="corrupt@allreduce:0:1")


@pytest.mark.slow
def test_clean_two_ranks_pass_and_report_every_check(clean_two_ranks):
    done, report, seconds = clean_two_ranks
    assert done.returncode == 0, done.stderr
    assert report["ok"] and report["world_size"] == 2 and report["mode"] == "check"
    assert (
        done.stdout.splitlines()[-1] == report["summary"] and "all 2 rank(s) on 1 host(s) passed" in report["summary"]
    )
    assert not [f for f in report["findings"] if f["level"] == "fail"]
    for rank, r in enumerate(report["ranks"]):
        assert r["rank"] == rank and r["host"] == HOST
        assert set(r["verdicts"]) == {"golden", "matmul", "memory", "collectives", "pairs", "disk", "env"}
        assert r["verdicts"]["golden"] == r["verdicts"]["collectives"] == "ok"
        assert r["verdicts"]["disk"] != "fail"  # speeds may warn: other processes share this machine's cores
        assert r["verdicts"]["pairs"] == "-"  # two ranks: the only pair is everyone, tested already
        assert {t: g["ok"] for t, g in r["golden"].items()} == {"float32": True, "bfloat16": True}
        assert r["matmul"]["float32"]["flops"] > 0 and r["memory_bandwidth"] > 0
        assert r["disk"]["bytes_per_s"] > 0 and r["disk"]["error"] is None
        assert [(c["name"], c["ok"]) for c in r["collectives"]] == [
            ("all_gather", True), ("all_reduce", True), ("reduce_scatter", True)]  # fmt: skip
        assert set(r["bandwidth"]) == {"all_reduce", "all_gather", "reduce_scatter"}
        assert r["facts"]["torch"] and "bf16" in r["facts"]
    # the same products on the same kind of device: the same bits
    assert len({r["golden"]["float32"]["digest"] for r in report["ranks"]}) == 1
    facts = report["hosts"][HOST]
    assert facts["ranks"] == 2 and facts["state"]["checkpoint_bytes"] == 12 * report["parameters"]
    print(f"liandan doctor --nproc 2: {seconds:.1f}s wall, {report['seconds']:.1f}s of checks")


@pytest.mark.slow
def test_wrong_products_name_the_rank_and_its_host(wrong_products):
    done, report, _ = wrong_products
    assert done.returncode == 1, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("liandan: ")]
    assert line.startswith(f"liandan: doctor: rank 1 on host {HOST} computes wrong matrix products (float32"), line
    assert "rank 0" not in line
    assert not report["ok"] and report["ranks"][1]["verdicts"]["golden"] == "fail"
    assert report["ranks"][0]["verdicts"]["golden"] == "ok"
    assert report["ranks"][1]["golden"]["float32"]["wrong_elements"] > 0
    row = next(r for r in done.stdout.splitlines() if r.startswith("1 "))
    assert "FAIL" in row and HOST in row


@pytest.mark.slow
def test_a_wrong_collective_contribution_names_its_sender(wrong_contribution):
    done, report, _ = wrong_contribution
    assert done.returncode == 1, done.stderr
    assert f"liandan: doctor: rank 1 on host {HOST} sends wrong data in collectives" in done.stderr
    [finding] = [f for f in report["findings"] if f["level"] == "fail"]
    assert (finding["rank"], finding["check"]) == (1, "collectives")
    assert "arrived wrong at 3 of 3 ranks" in finding["what"]
    for r in report["ranks"]:  # every rank saw rank 1's slot of the all-gather wrong, nothing else
        assert [c["wrong_senders"] for c in r["collectives"]] == [[1], [], []]
        assert [c["ok"] for c in r["collectives"]] == [False, True, True]
        assert r["verdicts"]["pairs"] != "fail" and sorted(p["ok"] for p in r["pairs"]) == [True, True]
        assert all(p["bandwidth"] > 0 and r["rank"] in p["ranks"] for p in r["pairs"])


@pytest.fixture(scope="module")
def bisected(tmp_path_factory):
    """Four ranks, rank 2's products wrong; `run.name` names an existing run directory, which gets the report."""
    tmp = tmp_path_factory.mktemp("bisect")
    (tmp / "runs" / "suspect").mkdir(parents=True)
    done, report, _ = doctor(tmp, "--nproc=4", "--bisect=0,1,2,3", "--run.name=suspect",
                                   faults="perturb@matmul:0:2")  # fmt: skip
    return done, report, tmp / "runs" / "suspect"


@pytest.mark.slow
def test_bisection_names_the_faulty_rank_of_four_in_two_rounds(bisected):
    done, report, run_dir = bisected
    assert done.returncode == 1, done.stderr
    rounds = [line for line in done.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2, done.stdout
    assert "rank(s) 0,1 on" in rounds[0] and "0,1 on " + HOST + " pass" in rounds[0]
    assert "rank(s) 2,3 on " + HOST + " FAIL" in rounds[0]
    assert "rank(s) 2 on " + HOST + " FAIL" in rounds[1] and "rank(s) 3 on " + HOST + " pass" in rounds[1]
    assert f"liandan: doctor: bisection names rank 2 on host {HOST} after 2 round(s)" in done.stderr
    assert report["found"] == 2 and report["host"] == HOST and len(report["rounds"]) == 2
    run = read_run(run_dir)
    [event] = run.of_kind("doctor_bisect")
    assert (event["found"], event["host"], event["rounds"], event["ok"]) == (2, HOST, 2, False)
    assert json.loads((run_dir / "doctor-bisect.json").read_text())["found"] == 2
    timeline = liandan_here("incidents", run_dir, check=True).stdout
    assert f"DOCTOR BISECTION: bisection names rank 2 on host {HOST} after 2 round(s)" in timeline


@pytest.mark.slow
def test_bisection_of_a_host_without_a_fault_finds_none(tmp_path):
    done, report, _ = doctor(tmp_path, "--nproc=2", f"--bisect={HOST}")
    assert done.returncode == 0, done.stderr
    assert report["found"] is None and report["ok"]
    assert f"doctor: bisection found no fault in rank(s) 0,1 on {HOST}" in done.stdout


# -- the preflight of `liandan train` -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    cfg = tiny_config(
        root / "runs",
        write_corpus(root),
        *MICRO_MODEL,
        "--train.steps=2",
        "--schedule.warmup_steps=1",
        "--doctor.preflight=true",
    )  # the doctor is what these tests are about
    path = root / "preflight.toml"
    path.write_text(cfg.to_toml())
    return path


def train(config, name, *args, faults=None):
    env = {**os.environ, "LIANDAN_FAULTS": faults} if faults else None
    done = run_liandan("train", config, f"--run.name={name}", *args, env=env, timeout=300)
    return done, load_config(config).run.output_dir + f"/{name}"


@pytest.fixture(scope="module")
def preflight_run(train_config):
    return train(train_config, "checked", "--nproc=2")


@pytest.fixture(scope="module")
def stopped_run(train_config):
    return train(train_config, "stopped", "--nproc=2", faults="perturb@matmul:0:1")


@pytest.mark.slow
def test_train_runs_the_doctor_first_by_default(preflight_run):
    done, run_dir = preflight_run
    assert done.returncode == 0, done.stderr
    run = read_run(run_dir)
    [event] = run.of_kind("doctor")
    assert event["ok"] and event["step"] == 0 and event["failures"] == []
    assert run.events.index(event) < run.events.index(run.of_kind("train_start")[0])
    report = json.loads((run.path / "doctor.json").read_text())
    assert report["ok"] and report["world_size"] == 2 and report["parameters"] == run.summary["parameters"]
    assert "doctor: all 2 rank(s) on 1 host(s) passed" in done.stdout


@pytest.mark.slow
def test_a_failing_preflight_stops_the_run_before_step_one(stopped_run):
    done, run_dir = stopped_run
    assert done.returncode == 2, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("liandan: ")]
    assert line.startswith(f"liandan: error: doctor: rank 1 on host {HOST} computes wrong matrix products"), line
    assert "the run stopped before step 1" in line
    run = read_run(run_dir)
    assert run.metrics == [] and run.summary == {}  # not one step trained
    assert run.of_kind("restart") == [] and run.of_kind("incident") == []  # the supervisor did not retry
    [event] = run.of_kind("doctor")
    assert not event["ok"] and [(f["rank"], f["check"]) for f in event["failures"]] == [(1, "golden")]
    assert not json.loads((run.path / "doctor.json").read_text())["ok"]
    timeline = liandan_here("incidents", run_dir, check=True).stdout
    assert f"DOCTOR STOPPED the run before step 1: rank 1 on host {HOST} computes wrong matrix products" in timeline


@pytest.mark.slow
def test_the_preflight_can_be_skipped(train_config):
    done, run_dir = train(train_config, "unchecked", "--doctor.preflight=false", "--resilience.supervise=false",
                          faults="perturb@matmul:0:0")  # fmt: skip
    assert done.returncode == 0, done.stderr  # wrong products, but nobody looked
    run = read_run(run_dir)
    assert run.of_kind("doctor") == [] and not (run.path / "doctor.json").exists()
    assert len(run.metrics) == 2


# -- one process, in this process -----------------------------------------------------------------------------


def test_one_rank_alone_writes_its_report(tmp_path, capsys):
    from liandan.cli.main import main

    checkpoints = tmp_path / "not-made-yet" / "checkpoints"
    code = main(["doctor", f"--json={tmp_path / 'r.json'}", f"--checkpoint.dir={checkpoints}",
                 "--doctor.measure_s=0.02", "--checkpoint.memory_every=10"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] and report["world_size"] == 1
    assert report["ranks"][0]["verdicts"]["collectives"] == "-"
    assert report["ranks"][0]["disk"]["path"] == str(tmp_path)  # the nearest directory that exists
    assert not checkpoints.parent.exists()  # the doctor makes no directories
    assert out.splitlines()[0].split()[:4] == ["rank", "host", "device", "golden"]
    assert f"host {HOST}: 1 rank(s)" in out and "memory snapshots need" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--doctor.slow_ratio=2"], "doctor.slow_ratio = 2.0 is too large; it must be <= 1.0"),
        (["--doctor.on_slow=maybe"], "doctor.on_slow = 'maybe' is not allowed; choose one of 'warn', 'fail'"),
        (["--doctor.golden_size=8"], "doctor.golden_size = 8 is too small; it must be >= 16"),
        (["--doctor.prefligth=false"], "unknown key 'doctor.prefligth' (did you mean 'doctor.preflight'?)"),
        (["--nproc=0"], "--nproc = 0 must be at least 1"),
        (["--nproc=100000"], "--nproc = 100000 is more local processes than this machine can hold"),
        (["--nproc=2", "--bisect=0,7"], "--bisect: rank 7 is not among the 2 rank(s) of --nproc 2"),
        (["--bisect=no-such-host"], "--bisect: no rank runs on host 'no-such-host'"),
        (["--bisect=,"], "--bisect ',' names no rank or host"),
    ],
)
def test_bad_settings_are_one_line_errors(args, message, capsys):
    from liandan.cli.main import main

    assert main(["doctor", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("liandan: error: ") and message in err and "\n" not in err, err


# -- verdicts on made-up records ------------------------------------------------------------------------------


def record(rank, host="a", flops=100.0, copy=10.0, write=5e8, wrong_senders=(), pairs=()):
    digest = "same"
    return {
        "rank": rank, "local_rank": rank, "host": host, "device": "cpu",
        "golden": {"float32": {"dtype": "float32", "max_error": 1e-7, "tolerance": 2e-3, "digest": digest,
                               "wrong_elements": 0, "ok": True}},
        "matmul": {"float32": {"flops": flops, "peak_flops": None}},
        "memory_bandwidth": copy,
        "disk": {"path": "/x", "bytes": 1, "bytes_per_s": write, "error": None},
        "facts": {"device_name": "cpu", "torch": "2", "cuda": None, "nccl": None, "bf16": True,
                  "shm_path": "/dev/shm", "shm_total_bytes": 1 << 30, "checkpoint_dir": "/x",
                  "disk_free_bytes": 1 << 40},
        "collectives": [{"name": "all_gather", "ranks": [], "ok": not wrong_senders,
                         "wrong_senders": list(wrong_senders), "max_error": 0.0}],
        "bandwidth": {}, "pairs": list(pairs),
    }  # fmt: skip


def test_a_slow_rank_is_a_warning_or_a_failure_as_configured():
    from liandan.doctor.verdict import judge

    records = [record(0), record(1, flops=30.0), record(2), record(3, host="b", flops=1.0)]
    report = judge(load_config(None, []), records, None, 1.0)
    assert report["ok"]  # slow is a warning by default; rank 3 is alone on its host: nothing to compare with
    [finding] = report["findings"]
    assert (finding["rank"], finding["check"], finding["level"]) == (1, "matmul", "warn")
    assert "0.30x the median of the other ranks on its host" in finding["what"]
    assert report["summary"].startswith("doctor: all 4 rank(s) on 2 host(s) passed in 1.0s, with warnings: rank 1")
    strict = judge(load_config(None, ["--doctor.on_slow=fail"]), records, None, 1.0)
    assert not strict["ok"] and strict["summary"].startswith("doctor: rank 1 on host a is slow: float32 matmul")


def test_a_rank_that_alone_receives_wrong_data_is_named_as_receiver():
    from liandan.doctor.verdict import judge

    records = [record(0), record(1), record(2, wrong_senders=[0])]
    report = judge(load_config(None, []), records, None, 1.0)
    [finding] = report["findings"]
    assert finding["rank"] == 2 and finding["what"] == "receives wrong data in all_gather"


def test_pairs_name_the_rank_that_fails_in_every_pair():
    from liandan.doctor.verdict import judge

    def pair(a, b, ok):
        return {"ranks": [a, b], "ok": ok, "bandwidth": 1.0, "wrong_senders": []}

    pairs = {(0, 1): True, (0, 2): False, (1, 2): False}  # rank 2 fails with everyone
    records = [record(r, pairs=[pair(a, b, ok) for (a, b), ok in pairs.items() if r in (a, b)]) for r in range(3)]
    report = judge(load_config(None, []), records, None, 1.0)
    assert [(f["rank"], f["check"]) for f in report["findings"]] == [(2, "pairs")]
    assert "pair(s) 0-2, 1-2" in report["findings"][0]["what"]


def test_pair_rounds_cover_every_pair_once_in_disjoint_rounds():
    from liandan.doctor.probe import pair_rounds

    for world in range(2, 9):
        rounds = pair_rounds(world)
        assert len(rounds) == (world - 1 if world % 2 == 0 else world)
        every = [pair for r in rounds for pair in r]
        assert sorted(every) == [(a, b) for a in range(world) for b in range(a + 1, world)]
        for r in rounds:
            ranks = [rank for pair in r for rank in pair]
            assert len(ranks) == len(set(ranks))


def test_environment_warnings_name_what_will_hurt(tmp_path):
    from liandan.doctor.environment import environment_warnings, state_size, write_throughput

    cfg = load_config(None, ["--checkpoint.memory_every=5", "--checkpoint.every=10", "--train.dtype=bf16"])
    size = state_size(cfg, 10_000_000, world_size=2, local_world_size=2)
    assert size.checkpoint_bytes == 120_000_000
    assert size.snapshot_bytes_per_host == 2 * 60_000_000 * 2  # two ranks' shards (FSDP over 2), two slots each
    facts = {"bf16": False, "device_name": "cpu X", "nccl": None, "shm_path": "/dev/shm", "shm_total_bytes": 1 << 20,
             "checkpoint_dir": "/ckpt", "disk_free_bytes": 200_000_000}  # fmt: skip
    said = environment_warnings(cfg, facts, size, "cpu")
    assert len(said) == 3, said
    assert "train.dtype = 'bf16' but cpu X has no native bf16" in said[0]
    assert "memory snapshots of this host's ranks need 0.22 GiB" in said[1]
    assert "/ckpt has 0.19 GiB free; 4 checkpoints of 0.11 GiB each need 0.45 GiB" in said[2]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = write_throughput(blocker / "checkpoints", 1 << 20, rank=0)  # a path through a file
    assert result["bytes_per_s"] is None and result["error"].startswith("NotADirectoryError")


def test_incidents_tell_the_doctor_in_one_line(tmp_path):
    from liandan.resilience.incidents import timeline
    from liandan.run import RunDir, append_jsonl

    room = RunDir(tmp_path)
    append_jsonl(room.events, {"time": 1.0, "kind": "doctor", "step": 0, "ok": True, "warnings": [],
                               "summary": "doctor: all 2 rank(s) on 1 host(s) passed in 1.0s"})  # fmt: skip
    append_jsonl(room.events, {"time": 2.0, "kind": "doctor", "step": 40, "ok": False, "warnings": [],
                               "summary": "doctor: rank 3 on host n7 computes wrong matrix products (...)"})  # fmt: skip
    append_jsonl(room.events, {"time": 3.0, "kind": "doctor", "standalone": True, "ok": True,
                               "warnings": [{"rank": 1}], "summary": "doctor: all 2 rank(s) ..., with warnings: x"})  # fmt: skip
    append_jsonl(room.events, {"time": 4.0, "kind": "doctor_bisect", "ok": False, "found": 3, "host": "n7",
                               "rounds": 3, "summary": "doctor: bisection names rank 3 on host n7 after 3 round(s)"})  # fmt: skip
    lines = timeline(tmp_path)
    assert len(lines) == 3, lines  # the clean preflight is no incident
    assert lines[0].endswith(
        "DOCTOR STOPPED the run before step 41: rank 3 on host n7 computes wrong matrix products (...)"
    )
    assert lines[1].endswith("doctor warning (liandan doctor): all 2 rank(s) ..., with warnings: x")
    assert lines[2].endswith("DOCTOR BISECTION: bisection names rank 3 on host n7 after 3 round(s)")


def test_the_doctor_records_in_the_run_directory_a_run_of_its_config_uses(tmp_path):
    from liandan.doctor.runner import record_in_run
    from liandan.run import RunDir

    report = {"mode": "check", "ok": True, "summary": "doctor: all 1 rank(s) passed", "findings": [], "seconds": 1.0}
    project = tmp_path / "runs"
    named = load_config(None, [f"--run.output_dir={project}", "--run.name=r1"])
    named.run_dir("tiny").mkdir(parents=True)  # as the run of this config made it
    assert record_in_run(named, report) == RunDir.of(project / "r1").doctor
    assert [e["kind"] for e in RunDir.of(project / "r1").read_events()] == ["doctor"]
    # An empty run.name stands for a new timestamped run: no run directory of it exists yet, and the project
    # directory (output_dir itself) is no run directory to write into.
    unnamed = load_config(None, [f"--run.output_dir={project}"])
    assert record_in_run(unnamed, report) is None
    assert not RunDir.of(project).doctor.exists() and not RunDir.of(project).events.exists()


def test_a_checkpoint_directory_write_is_judged_on_its_own_rate():
    """Ranks of one host write to one device at once: a rank at 229 MB/s beside one at 2 GB/s is no fault;
    a rate too low for saves is, whatever the other ranks get."""
    from liandan.doctor.verdict import judge

    shared_vm = judge(load_config(None, []), [record(0, write=229e6), record(1, write=2e9)], None, 1.0)
    assert shared_vm["findings"] == [] and shared_vm["ranks"][0]["verdicts"]["disk"] == "ok"
    slow = judge(load_config(None, []), [record(0, write=20e6), record(1, write=20e6)], None, 1.0)
    assert [(f["rank"], f["check"], f["level"]) for f in slow["findings"]] == [(0, "disk", "warn"), (1, "disk", "warn")]
    assert (
        "writes to /x at 20" in slow["findings"][0]["what"] and "checkpoint saves there will be slow" in slow["summary"]
    )


def test_a_json_path_that_cannot_be_written_is_refused_before_the_checks(tmp_path):
    (tmp_path / "t.toml").write_text("")
    done = liandan_here("doctor", "--json", tmp_path / "t.toml" / "x.json")
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr.strip().splitlines() == [
        f"liandan: error: cannot write {tmp_path}/t.toml/x.json: {tmp_path}/t.toml is not a directory"
    ]
