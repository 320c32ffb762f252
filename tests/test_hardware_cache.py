"""The CPU peak FLOP/s benchmark is cached on disk, so restarts on the same machine skip it."""

import json
import time

import pytest
import torch

from liandan.train import hardware
from liandan.train.hardware import PEAK_CACHE_FILE, device_peak_flops

CPU = torch.device("cpu")
real_measure = hardware.measure_matmul_flops


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIANDAN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / PEAK_CACHE_FILE


@pytest.fixture
def measured(monkeypatch):
    """Counts benchmark runs; the real benchmark runs, at a size and duration small enough for a test."""
    calls = []

    def measure(dtype, size=1024, seconds=0.5):
        calls.append(dtype)
        return real_measure(dtype, size=128, seconds=0.01)

    monkeypatch.setattr(hardware, "measure_matmul_flops", measure)
    return calls


def forbid_measuring(monkeypatch):
    def measure(*args, **kwargs):
        raise AssertionError("measured although the cache should have answered")

    monkeypatch.setattr(hardware, "measure_matmul_flops", measure)


def test_second_start_reads_the_cache(cache, measured, monkeypatch):
    flops, source = device_peak_flops(CPU, torch.float32)
    assert flops > 0 and source == "CPU measured float32 matmul"
    assert measured == [torch.float32]
    entries = json.loads(cache.read_text())
    assert [entry["flops"] for entry in entries.values()] == [flops]

    forbid_measuring(monkeypatch)
    assert device_peak_flops(CPU, torch.float32) == (flops, "CPU measured float32 matmul (cached)")


def test_thread_count_and_dtype_miss_the_cache(cache, measured):
    device_peak_flops(CPU, torch.float32)
    _, source = device_peak_flops(CPU, torch.bfloat16)
    assert "(cached)" not in source
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        _, source = device_peak_flops(CPU, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert "(cached)" not in source
    assert measured == [torch.float32, torch.bfloat16, torch.float32]
    assert len(json.loads(cache.read_text())) == 3  # different keys accumulate rather than overwrite


def test_expired_entry_is_remeasured(cache, measured):
    device_peak_flops(CPU, torch.float32)
    entries = json.loads(cache.read_text())
    for entry in entries.values():
        entry["measured_at"] = time.time() - 8 * 24 * 3600
    cache.write_text(json.dumps(entries))
    _, source = device_peak_flops(CPU, torch.float32)
    assert "(cached)" not in source and len(measured) == 2
    assert all(entry["measured_at"] > time.time() - 60 for entry in json.loads(cache.read_text()).values())


def test_corrupt_cache_is_ignored_and_rewritten(cache, measured, monkeypatch):
    cache.parent.mkdir(parents=True)
    cache.write_bytes(b"\xff\x00{not json\x9c")
    flops, source = device_peak_flops(CPU, torch.float32)
    assert flops > 0 and "(cached)" not in source
    assert len(json.loads(cache.read_text())) == 1
    assert not [p for p in cache.parent.iterdir() if p != cache]  # no temporary file left behind

    forbid_measuring(monkeypatch)
    assert device_peak_flops(CPU, torch.float32) == (flops, "CPU measured float32 matmul (cached)")


def test_unwritable_cache_dir_still_measures(tmp_path, monkeypatch, measured):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("LIANDAN_CACHE_DIR", str(blocker / "cache"))
    for _ in range(2):
        flops, source = device_peak_flops(CPU, torch.float32)
        assert flops > 0 and source == "CPU measured float32 matmul"
    assert len(measured) == 2


def test_cache_dir_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("LIANDAN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert hardware.cache_dir() == tmp_path / "liandan"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hardware.cache_dir() == tmp_path / "home" / ".cache" / "liandan"


def test_real_benchmark_is_cached(cache):
    flops, cached = hardware.cpu_peak_flops(torch.float32, size=128, seconds=0.05)
    assert flops > 0 and not cached
    assert hardware.cpu_peak_flops(torch.float32, size=128, seconds=0.05) == (flops, True)
