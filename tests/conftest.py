import os
from collections import Counter

import pytest

# One thread per process, for the suite and the processes it starts (they inherit os.environ; the supervisor's
# own default only fills an unset variable). Its models are tiny, so a second thread gains little, and on a
# shared 2-core machine threads that wait on each other at every operation cost most: under load the same
# scoring took 7x as long on two threads as on one. Set before torch is imported, which reads it then.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def liandan_cache_dir(tmp_path_factory):
    """Keep the suite out of the real ~/.cache; one directory for the whole session (and the subprocesses it
    starts, which inherit os.environ) so the CPU peak benchmark runs once rather than per training start."""
    previous = os.environ.get("LIANDAN_CACHE_DIR")
    os.environ["LIANDAN_CACHE_DIR"] = str(tmp_path_factory.mktemp("liandan-cache"))
    yield
    if previous is None:
        os.environ.pop("LIANDAN_CACHE_DIR", None)
    else:
        os.environ["LIANDAN_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def incident_run(tmp_path_factory):
    """helpers.INCIDENT_RUN, trained once for the session: a `helpers.TrainedRun`. Its project directory (the run
    directory's parent) is the dashboard's; tests may add runs beside it, and leave this one as it is."""
    from helpers import (
        INCIDENT_FAULTS,
        INCIDENT_OVERRIDES,
        INCIDENT_RUN,
        TrainedRun,
        environment_without,
        run_liandan,
        tiny_config,
        tracker_env,
        write_corpus,
    )

    root = tmp_path_factory.mktemp("incident-run")
    project = root / "runs"
    project.mkdir()
    cfg = tiny_config(project, write_corpus(root, 200), f"--run.name={INCIDENT_RUN}", *INCIDENT_OVERRIDES)
    config = root / f"{INCIDENT_RUN}.toml"
    config.write_text(cfg.to_toml())
    env = environment_without(LIANDAN_CACHE_DIR=os.environ["LIANDAN_CACHE_DIR"], LIANDAN_FAULTS=INCIDENT_FAULTS,
                              **tracker_env(root))  # fmt: skip
    done = run_liandan("train", config, "--nproc=2", env=env, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    return TrainedRun(project / INCIDENT_RUN, done.stdout, done.stderr)


@pytest.fixture
def small_disk(tmp_path):
    """`small_disk(size)`: a real tmpfs of that size mounted under tmp_path (root only: skips elsewhere), so
    a full disk is the kernel's ENOSPC, not a simulation. Unmounted afterwards."""
    import subprocess

    mounted = []

    def mount(size: str, name: str = "small-disk"):
        path = tmp_path / name
        path.mkdir()
        command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            reason = done.stderr.strip() or "needs root"
            pytest.skip(f"cannot mount a tmpfs here ({reason}); the injected ENOSPC tests cover the path")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "--lazy", str(path)], check=False)


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 for one test module, its bucket `helpers.S3_BUCKET`, and the variables that
    point boto at it (set here too, and returned for subprocesses)."""
    import logging
    import urllib.request

    from helpers import S3_BUCKET
    from liandan.run.remote import locate

    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    forget_file_systems()  # one made for an earlier module's server would point at its closed port
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # moto's buckets live in the process, not the server: an earlier module's would still be there
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            patch.delenv(key, raising=False)
        locate(f"s3://{S3_BUCKET}").fs.mkdir(S3_BUCKET)
        yield env
    server.stop()
    forget_file_systems()


def forget_file_systems() -> None:
    """Drop the S3 file systems this process made: liandan keeps one per store and s3fs caches instances, both
    keyed by URL, not by the endpoint in the environment."""
    import s3fs

    from liandan.run import remote

    remote._filesystem.cache_clear()
    s3fs.S3FileSystem.clear_instance_cache()


# -- how the suite is spread over xdist's workers (pyproject's addopts: --dist loadfile) ---------------------
# A file's tests go to one worker, so that its module fixtures are made once; files that share a costly session
# fixture go to one worker together, which makes it once rather than each worker that runs one of them. (xdist's
# own answer, --dist loadgroup, renames the tests to group them, which pytest 9 no longer lets it do.)
SHARED_SESSION_FIXTURE = {f"tests/{name}.py": "incident_run" for name in ("test_dash", "test_exporters", "test_report")}

# Work goes out in the order below: the longest files first (about a minute or more each on the 2-core CI
# machine, by its --durations), then the others, the files with most tests first, as xdist orders them. A long
# file started last would leave the other worker idle while it runs; short files at the end even the two out.
LONGEST_FIRST = [
    "tests/test_supervisor.py",
    "incident_run",
    "tests/test_expert_parallel.py",
    "tests/test_resume_oracle.py",
    "tests/test_cli.py",
    "tests/test_guard.py",
    "tests/test_moe.py",
    "tests/test_distributed.py",
    "tests/test_checkpoint.py",
    "tests/test_node_exclusion.py",
    "tests/test_reshard.py",
    "tests/test_muon.py",
    "tests/test_health.py",
    "tests/test_pipeline_parallel.py",
    "tests/test_pipeline_checkpoints.py",
    "tests/test_cpu_offload.py",
    "tests/test_pipeline_health.py",
]


def work_unit(nodeid: str) -> str:
    """What goes to one worker whole: the test's file, or the group of files it shares a session fixture with."""
    file = nodeid.split("::", 1)[0]
    return SHARED_SESSION_FIXTURE.get(file, file)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests in the order their work units go out (pyproject's --no-loadscope-reorder keeps it)."""
    units = [work_unit(item.nodeid) for item in items]
    sizes = Counter(units)
    first = {unit: index for index, unit in reversed(list(enumerate(units)))}
    rank = {unit: index for index, unit in enumerate(LONGEST_FIRST)}

    def order(index: int) -> tuple:
        unit = units[index]
        return rank.get(unit, len(rank)), -sizes[unit], first[unit], index

    items[:] = [items[i] for i in sorted(range(len(items)), key=order)]


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for the mode asked for
    from xdist.scheduler import LoadFileScheduling

    class WorkUnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnitScheduling(config, log)
