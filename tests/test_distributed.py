"""Real multi-process runs on gloo: every parallel layout must train the same model as one process.

Tolerance: losses agree to a relative 1e-5 in fp32. The layouts compute the same sums in a different order
(sharded reductions, split matmuls), so bit equality is not expected; 1e-5 is two orders above the
differences seen (~1e-7) and far below what a wrong gradient or a wrong batch split produces (> 1e-3).
"""

import os

import pytest

from helpers import environment_without, free_port, read_run, run_liandan, start_liandan, tiny_config, write_corpus

pytestmark = pytest.mark.slow
RTOL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    corpus = write_corpus(root)
    config = root / "tiny.toml"
    config.write_text(tiny_config(root / "runs", corpus, "--train.steps=5", "--run.name=").to_toml())
    reference = _train(config, 1, "--run.name=single")
    return config, reference


def _train(config, nproc, *overrides, env=None):
    done = run_liandan("train", config, f"--nproc={nproc}", *overrides, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _losses(config, next(o for o in overrides if o.startswith("--run.name=")).split("=", 1)[1])


def _losses(config, name):
    return [r["loss"] for r in read_run(config.parent / "runs" / name).metrics]


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, []),  # FSDP2 over 2 ranks
        (2, ["--parallel.tp=2"]),  # tensor parallel over 2 ranks
        (2, ["--parallel.dp_replicate=2", "--train.micro_batch=1"]),  # DDP with gradient accumulation
        (4, ["--parallel.dp_replicate=2", "--parallel.tp=2"]),  # HSDP-style replicate x TP on a 3-D mesh
    ],
    ids=["fsdp2", "tp2", "ddp2-accum", "replicate2xtp2"],
)
def test_layout_matches_single_process(setup, nproc, layout):
    config, reference = setup
    name = "run-" + "-".join(o.split(".")[-1] for o in layout) if layout else "run-fsdp"
    losses = _train(config, nproc, *layout, f"--run.name={name}")
    assert len(losses) == len(reference) == 5
    assert losses == pytest.approx(reference, rel=RTOL)
    summary = read_run(config.parent / "runs" / name).summary
    assert summary["world_size"] == nproc


@pytest.mark.parametrize("master", [None, "127.0.0.1"], ids=["nodelist", "master-addr"])
def test_slurm_style_launch_without_torchrun(setup, master):
    """Two processes started the way `srun` starts them: only SLURM_* variables (and MASTER_ADDR, where the
    job script sets it), no torchrun. Nothing they open listens on every interface: rank 0's store is bound
    to the node's address, here loopback, and so are gloo's sockets."""
    import time

    from helpers import listening_sockets, process_tree

    config, reference = setup
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR") and not k.startswith(("GLOO_", "NCCL_"))}  # fmt: skip
        env.update(
            SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_NTASKS_PER_NODE="2",
            SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2",  # srun's job step: what tells its tasks from a batch script
            SLURM_JOB_NODELIST="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", **({"MASTER_ADDR": master} if master else {}),
        )  # fmt: skip
        procs.append(start_liandan("train", config, f"--run.name=slurm-{master or 'nodelist'}", env=env))
    seen: set[tuple[str, int]] = set()
    while any(proc.poll() is None for proc in procs):
        seen |= listening_sockets([pid for proc in procs for pid in process_tree(proc.pid)])
        time.sleep(0.05)  # a sampling interval: the store and gloo's sockets live for the whole run
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    assert ("127.0.0.1", int(port)) in seen  # rank 0's store, bound where MASTER_ADDR says
    assert seen and {address for address, _ in seen} == {"127.0.0.1"}, seen  # no 0.0.0.0 or ::
    assert _losses(config, f"slurm-{master or 'nodelist'}") == pytest.approx(reference, rel=RTOL)
    summary = read_run(config.parent / "runs" / f"slurm-{master or 'nodelist'}").summary
    assert summary["world_size"] == 2 and summary["layout"].startswith("fsdp")


def test_impossible_layout_is_refused_before_launch(setup):
    config, _ = setup
    # everything else about tp = 3 is possible (sequence parallelism needs the sequence to split in 3)
    args = ["--nproc=2", "--parallel.tp=3", "--model.n_heads=3", "--model.n_kv_heads=3", "--model.dim=96",
            "--train.seq_len=48"]  # fmt: skip
    done = run_liandan("train", config, *args, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        (
            "liandan: error: parallel.dp_replicate x parallel.tp = 3 must divide the number of processes,"
            " 2 (--nproc, or the torchrun/srun task count)"
        )
    ]


def test_worker_side_error_is_one_line_from_the_launcher(setup, tmp_path):
    """An error that only the workers can find (here a missing tokenizer) still ends as one line, exit 2."""
    config, _ = setup
    done = run_liandan("train", config, "--nproc=2", "--run.name=bad", f"--data.tokenizer={tmp_path / 'missing.json'}",
                       timeout=300)  # fmt: skip
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    # torch's C++ runtime may add "terminate called ..." for the rank torchrun stops; liandan says it once
    errors = [line for line in done.stderr.splitlines() if line.startswith("liandan: error:")]
    assert errors == [f"liandan: error: tokenizer file not found: {tmp_path / 'missing.json'}"]


def _lonely_collective(rank, port, timeout_s, failed, out):
    import time

    import torch
    import torch.distributed as dist

    from liandan.train.distributed import init_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    init_distributed("cpu", "gloo", timeout_s)
    if rank == 1:
        failed.wait(120)  # never joins the collective; leaves once rank 0 has given up on it
        return
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        out.put(("completed", 0.0))
    except RuntimeError:
        out.put(("failed", time.monotonic() - started))
    failed.set()


def test_collective_timeout_ends_a_wait_for_a_missing_peer():
    """`resilience.collective_timeout_s` reaches the process group: a collective that a peer never joins
    fails after about that long instead of the default half hour."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    failed, out, port = ctx.Event(), ctx.Queue(), free_port()
    procs = [ctx.Process(target=_lonely_collective, args=(rank, port, 2.0, failed, out)) for rank in range(2)]
    for p in procs:
        p.start()
    outcome, seconds = out.get(timeout=120)
    for p in procs:
        p.join(60)
    assert outcome == "failed" and 1.5 <= seconds < 30


def test_a_bound_store_listens_on_loopback_only():
    """c10d's TCPStore listens on every interface whatever host it is given; ours only where it is told."""
    import torch.distributed as dist

    from helpers import listening_sockets
    from liandan.train.stores import LOOPBACK, bound_store

    store = bound_store(LOOPBACK)
    client = dist.TCPStore(LOOPBACK, store.port, is_master=False)
    client.set("key", "value")
    assert store.get("key") == b"value"
    assert [(address, port) for address, port in listening_sockets([os.getpid()]) if port == store.port] == [
        (LOOPBACK, store.port)
    ]


def test_torchrun_launch_listens_on_loopback_only(tmp_path):
    """Unsupervised `--nproc=2` goes through torchrun: its rendezvous store, the workers' store and gloo's
    sockets all listen on 127.0.0.1 only."""
    from helpers import listeners_until_exit

    config = tmp_path / "tiny.toml"
    config.write_text(tiny_config(tmp_path / "runs", write_corpus(tmp_path), "--train.steps=2").to_toml())
    proc = start_liandan("train", config, "--nproc=2", "--resilience.supervise=false",
                         env=environment_without("LIANDAN_", "GLOO_", "NCCL_"))  # fmt: skip
    seen = listeners_until_exit(proc)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert seen and {address for address, _ in seen} == {"127.0.0.1"}, seen


@pytest.mark.slow
def test_workers_end_with_a_launcher_that_is_killed(tmp_path):
    """torchrun's agent ends its workers when it is stopped, but not when it is killed outright, nor the workers
    it was still starting when it was stopped: each worker ends with its launcher instead."""
    import signal
    import time

    from helpers import process_tree, wait_for_step
    from liandan.resilience.processes import alive

    config = tmp_path / "tiny.toml"
    config.write_text(tiny_config(tmp_path / "runs", write_corpus(tmp_path), "--train.steps=100000",
                                  "--checkpoint.every=0", "--run.name=orphans").to_toml())  # fmt: skip
    launcher = start_liandan("train", config, "--nproc=2", "--resilience.supervise=false", quiet=True,
                             env=environment_without())  # fmt: skip
    workers = []
    try:
        wait_for_step(tmp_path / "runs" / "orphans", 1, launcher)
        workers = [pid for pid in process_tree(launcher.pid) if pid != launcher.pid]
        assert len(workers) >= 2, workers
        launcher.kill()
        launcher.wait()
        deadline = time.time() + 30
        while any(alive(pid) for pid in workers) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in workers), [pid for pid in workers if alive(pid)]
    finally:
        launcher.kill()
        launcher.wait()
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
