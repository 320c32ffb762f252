"""Heartbeats written in place: what a reader gets when it catches a write halfway, what a killed rank
leaves, and which disks get in-place writes (tests/test_supervisor.py has the watchdog that reads them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from liandan.run import RunDir, dumps_json
from liandan.train import heartbeat
from liandan.train.heartbeat import Heartbeat, file_system, read_heartbeat, read_heartbeats, stamped

SRC = Path(__file__).resolve().parents[1] / "src"


def test_a_heartbeat_is_rewritten_in_place_on_a_local_disk(tmp_path):
    assert file_system(tmp_path) in heartbeat.LOCAL_FILE_SYSTEMS  # the tests' own disk
    beat = Heartbeat(RunDir(tmp_path), rank=0)
    beat.beat(3, "data")
    inode = beat.path.stat().st_ino
    sizes = []
    # the last record is 10 characters shorter than the one before it (the same parts timed)
    for step, micro in [(400, 123456789), (400, 123456789), (4, 0)]:
        beat.beat(step, "forward", micro)
        sizes.append(beat.path.stat().st_size)
    assert beat.path.stat().st_ino == inode
    assert sizes[-1] == sizes[-2]  # a shorter record is padded, never truncated
    [record] = read_heartbeats(RunDir(tmp_path))
    assert (record["step"], record["phase"], record["micro"]) == (4, "forward", 0) and "crc32" not in record
    beat.close()


def test_a_record_caught_halfway_through_a_write_is_not_read(tmp_path):
    path = tmp_path / "rank-00000.json"
    old = {"rank": 0, "step": 12, "phase": "forward", "time": 100.25}
    new = {"rank": 0, "step": 13, "phase": "backward", "time": 100.75}
    whole_old, whole_new = stamped(dumps_json(old)), stamped(dumps_json(new))
    path.write_text(whole_new + "   ")  # padded to an older, longer record's length
    assert read_heartbeat(path) == new
    for cut in range(1, len(whole_old) - 1):  # one record's head over the other's tail, every split
        for head, tail in ((whole_new, whole_old), (whole_old, whole_new)):
            torn = (head[:cut] + tail[cut:]).ljust(len(whole_new))
            if torn.rstrip() not in (whole_new, whole_old):
                path.write_text(torn)
                assert read_heartbeat(path) is None, torn  # never a mix of the two
    path.write_text(dumps_json(old))  # a file replaced whole (a network disk) carries no CRC
    assert read_heartbeat(path) == old
    path.write_text("")  # created, not written yet
    assert read_heartbeat(path) is None


def test_a_rank_killed_right_after_a_beat_leaves_that_beat(tmp_path):
    """The exactness the supervisor's crash reports need: the beat just before SIGKILL is the one on disk."""
    code = (
        "import os, signal, sys\n"
        "from liandan.run import RunDir\n"
        "from liandan.train.heartbeat import Heartbeat\n"
        "beat = Heartbeat(RunDir(sys.argv[1]), rank=2)\n"
        "for step in range(1, 8):\n"
        "    for phase in ('data', 'forward', 'backward', 'optimizer'):\n"
        "        beat.beat(step, phase)\n"
        "beat.beat(8, 'data')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(SRC))
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == -9, done.stderr
    [record] = read_heartbeats(RunDir(tmp_path))
    assert (record["rank"], record["step"], record["phase"]) == (2, 8, "data")


def test_the_file_system_of_a_path_comes_from_the_mount_table(small_disk):
    assert file_system(Path("/proc/self")) == "proc"
    assert file_system(small_disk("64k") / "deeper" / "file") == "tmpfs"


@pytest.mark.parametrize("kind", ["nfs4", "lustre", "fuse.sshfs", ""])
def test_a_heartbeat_on_a_network_disk_replaces_the_file(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(heartbeat, "file_system", lambda path: kind)
    beat = Heartbeat(RunDir(tmp_path), rank=0)
    beat.beat(1, "data")
    inode = beat.path.stat().st_ino
    beat.beat(1, "forward")
    assert beat.path.stat().st_ino != inode  # a new file each beat, whole: what a client of another node sees
    assert "crc32" not in beat.path.read_text() and read_heartbeats(RunDir(tmp_path))[0]["phase"] == "forward"


def test_a_heartbeat_times_whole_steps(tmp_path, monkeypatch):
    """A rank times its own steps, from one step's batch to the next's (the supervisor's hang timeout follows
    them, however short they are next to its poll), and its checkpoints; a resumed start or a guard's rollback
    times no step of its own, the steps it replays count."""
    clock = [100.0]
    monkeypatch.setattr(heartbeat, "time", SimpleNamespace(time=lambda: clock[0]))
    beat = Heartbeat(RunDir(tmp_path), rank=0)

    def step(begin, count, checkpoint_s=0.0):
        """Step `count + 1`, its batch at `begin`, 0.5 s long (and a checkpoint after it); the last record."""
        for offset, at_count, phase in [(0.0, count, "data"), (0.1, count, "forward"), (0.2, count, "backward"),
                                        (0.3, count, "optimizer"), (0.4, count + 1, "collective"),
                                        (0.5, count + 1, "step_end")]:  # fmt: skip
            clock[0] = begin + offset
            beat.beat(at_count, phase)
        if checkpoint_s:
            beat.beat(count + 1, "checkpoint")
            clock[0] += checkpoint_s
        [record] = read_heartbeats(RunDir(tmp_path))
        return record

    beat.beat(0, "startup")  # resumed at step 4
    assert "step_s" not in step(101.0, 4)  # the first batch has no batch before it
    assert step(101.5, 5, checkpoint_s=3.0)["step_s"] == 0.5
    record = step(105.0, 6)
    assert record["step_s"] == 2.0  # the median of 0.5 and 3.5 (a step with its checkpoint)
    assert record["longest"]["checkpoint"] == 3.0  # and the checkpoint on its own
    assert step(105.5, 7)["step_s"] == 0.5  # the median of 0.5, 3.5 and 0.5: a rare checkpoint passed over
    beat.beat(8, "rollback")  # back to the state of step 4: the count falls, no step is timed
    assert step(106.5, 4)["step_s"] == 0.5
    assert step(107.0, 5)["step_s"] == 0.5  # the replayed step counts: 0.5, 3.5, 0.5, 0.5
    beat.close()
