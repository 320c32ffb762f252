"""In-memory snapshots: bit-exact round trips of model, optimizer and RNG state, two slots that survive a
crash during a write, data that must match its checksum, snapshots of another owner or shape ignored, and
ranks that agree on the newest step all of them hold (real gloo processes)."""

import copy
import json
import stat

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from liandan.checkpoint import snapshots
from liandan.checkpoint.snapshots import MemorySnapshots, newest_common_step
from liandan.run import temporary


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))


def _step(model, optimizer):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_round_trip_is_bit_exact_and_training_continues_identically(tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer)
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1, owner="sup-1", layout="single")
    snaps.save(1, model, optimizer, {"loader": {"position": 7}})
    for group in optimizer.param_groups:
        group["lr"] = 5e-3  # a scheduler moved it after the snapshot: the snapshot's value must come back
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    reference_opt.load_state_dict(optimizer.state_dict())
    for group in reference_opt.param_groups:
        group["lr"] = 1e-2
    rng = torch.get_rng_state()
    expected = []
    for _ in range(3):
        _step(reference, reference_opt)
        expected.append([p.detach().clone() for p in reference.parameters()])

    torch.manual_seed(99)  # a restarted process: other weights, no optimizer state, another RNG position
    fresh, fresh_opt = _model_and_optimizer(seed=5)
    assert not fresh_opt.state
    state = MemorySnapshots(tmp_path, rank=0, world_size=1, owner="sup-1", layout="single").load(1, fresh, fresh_opt)
    assert state == {"loader": {"position": 7}}
    assert torch.equal(torch.get_rng_state(), rng)
    assert fresh_opt.param_groups[0]["lr"] == 1e-2 and fresh_opt.param_groups[0]["betas"] == (0.9, 0.95)
    for p, q in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    torch.set_rng_state(rng)
    for weights in expected:
        _step(fresh, fresh_opt)
        for p, q in zip(fresh.parameters(), weights, strict=True):
            assert torch.equal(p, q)


def test_a_nan_in_the_state_is_written_as_strict_json(tmp_path):
    """A non-finite number in the state riding along (a callback's statistic, say) never reaches the header
    as NaN, which strict JSON readers refuse: it is written as null, and the snapshot still loads."""

    def refuse(constant):
        raise ValueError(f"{constant} in a snapshot header")

    model, optimizer = _model_and_optimizer()
    _step(model, optimizer)
    snaps = MemorySnapshots(tmp_path, rank=0, world_size=1, owner="sup-1", layout="single")
    snaps.save(1, model, optimizer, {"guard": {"level": float("nan"), "spread": float("inf"), "n": 3}})
    [header] = tmp_path.glob("rank-00000.slot-*.json")
    assert json.loads(header.read_text(), parse_constant=refuse)["state"]["guard"] == {"level": None, "spread": None,
                                                                                       "n": 3}  # fmt: skip
    assert snaps.load(1, *_model_and_optimizer(seed=1))["guard"]["n"] == 3


def test_two_slots_torn_writes_and_checksums(tmp_path):
    model, optimizer = _model_and_optimizer()
    snaps = MemorySnapshots(tmp_path, 0, 1, "sup-1", "single")
    for step in (1, 2, 3):
        _step(model, optimizer)
        snaps.save(step, model, optimizer, {})
    assert snaps.steps() == {3: 0, 2: 1}  # the oldest was overwritten in place
    assert snaps.agree() == 3
    # A crash while step 4 is written: its header was removed first, so only step 2 remains beside it.
    (tmp_path / "rank-00000.slot-0.json").unlink()
    assert snaps.agree() == 2
    # Data that no longer matches its header's checksum is not used.
    data = tmp_path / "rank-00000.slot-1.bin"
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert snaps.steps() == {2: 1} and snaps.agree() is None
    with pytest.raises(RuntimeError, match="no sound memory snapshot of step 2"):
        snaps.load(2, model, optimizer)


def test_snapshots_of_another_owner_world_or_layout_are_ignored(tmp_path):
    model, optimizer = _model_and_optimizer()
    _step(model, optimizer)
    MemorySnapshots(tmp_path, 0, 1, "sup-1", "single").save(1, model, optimizer, {})
    assert MemorySnapshots(tmp_path, 0, 1, "sup-1", "single").agree() == 1
    assert MemorySnapshots(tmp_path, 0, 1, "sup-2", "single").agree() is None  # a later supervisor
    assert MemorySnapshots(tmp_path, 0, 1, "sup-1", "fsdp").agree() is None
    assert newest_common_step(tmp_path, 1, "sup-1") == 1
    assert newest_common_step(tmp_path, 2, "sup-1") is None  # rank 1's files are not here
    header = json.loads((tmp_path / "rank-00000.slot-0.json").read_text())
    assert header["format"] == snapshots.FORMAT and header["step"] == 1 and header["owner"] == "sup-1"


def test_snapshot_directory_is_per_run_unpredictable_and_removable(tmp_path):
    a, b = snapshots.create_dir(tmp_path / "a", tmp_path), snapshots.create_dir(tmp_path / "b", tmp_path)
    again = snapshots.create_dir(tmp_path / "a", tmp_path)  # another supervisor of the same run: another name
    assert len({a, b, again}) == 3 and a.parent == tmp_path
    assert snapshots.snapshot_dirs(tmp_path / "a", tmp_path) == sorted([a, again])
    assert stat.S_IMODE(a.stat().st_mode) == 0o700
    MemorySnapshots(a, 0, 1, "x").save(1, torch.nn.Linear(2, 2), None, {})
    snapshots.remove_dir(a)
    assert not a.exists()
    assert (
        snapshots.remove_stale(tmp_path / "a", tmp_path) == []
        and snapshots.snapshot_dirs(tmp_path / "a", tmp_path) == []
    )
    assert b.is_dir()  # another run's


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    return victim


def test_a_planted_symlink_at_the_directory_path_is_never_written_through(tmp_path):
    run, shm, victim = tmp_path / "run", tmp_path / "shm", _victim(tmp_path)
    shm.mkdir(mode=0o700)
    # the predictable names an attacker could plant: the old fixed one, and the new prefix with a guess
    prefix = snapshots._prefix(run)
    for name in (prefix[:-1], prefix + "guess"):
        (shm / name).symlink_to(victim)
    made = snapshots.create_dir(run, shm)
    assert not made.is_symlink() and made.resolve().parent == shm.resolve()
    with pytest.raises(PermissionError, match="symlink"):  # handed a link, a worker refuses it
        MemorySnapshots(shm / (prefix + "guess"), 0, 1, "x")
    assert snapshots.remove_stale(run, shm) == []  # removes our directory; leaves the links and their targets
    assert not made.exists() and sorted(p.name for p in victim.iterdir()) == ["precious.txt"]
    assert (victim / "precious.txt").read_text() == "keep me"
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError, match="open to other users"):
        MemorySnapshots(shared, 0, 1, "x")


def test_a_planted_symlink_at_a_slot_file_is_replaced_not_followed(tmp_path):
    directory, victim = snapshots.create_dir(tmp_path / "run", tmp_path), _victim(tmp_path)
    target = victim / "precious.txt"
    header_tmp = temporary(directory / "rank-00000.slot-0.json").name  # where the header is written first
    for name in ("rank-00000.slot-0.bin", "rank-00000.slot-0.json", header_tmp):
        (directory / name).symlink_to(target)
    model, optimizer = _model_and_optimizer()
    snaps = MemorySnapshots(directory, 0, 1, "sup-1", "single")
    assert snaps.steps() == {}  # a header that is a link is not read
    _step(model, optimizer)
    snaps.save(1, model, optimizer, {})
    assert target.read_text() == "keep me" and sorted(p.name for p in victim.iterdir()) == ["precious.txt"]
    assert not any(p.is_symlink() for p in directory.iterdir())
    assert snaps.agree() == 1
    (directory / "inside-link").symlink_to(victim)
    snapshots.remove_dir(directory)  # cleanup removes everything of ours, links included, and nothing else
    assert not directory.exists() and target.read_text() == "keep me"


def _agree_worker(rank, directory, held, out):
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=2)
    try:
        model = torch.nn.Linear(4, 4)
        snaps = MemorySnapshots(directory, rank, 2, "sup-1", "fsdp")
        for step in held[rank]:
            with torch.no_grad():
                model.weight.fill_(step + rank)
            snaps.save(step, model, None, {"step": step})
        agreed = snaps.agree()
        state = snaps.load(agreed, model, None)
        out.put((rank, agreed, state["step"], float(model.weight[0, 0])))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_agree_on_the_newest_step_all_hold(tmp_path):
    """Rank 0 got to write step 4, rank 1 died before it did: both resume from step 3."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    held = {0: [2, 3, 4], 1: [2, 3]}
    mp.start_processes(_agree_worker, args=(tmp_path, held, out), nprocs=2, start_method="spawn")
    results = sorted(out.get(timeout=60) for _ in range(2))
    assert results == [(0, 3, 3, 3.0), (1, 3, 3, 4.0)]
    assert newest_common_step(tmp_path, 2, "sup-1") == 3
