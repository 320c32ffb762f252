"""What the hardware offers: bf16 support, peak FLOP/s for MFU, and peak memory."""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

from liandan.common.peaks import gpu_peak_flops, gpu_peak_flops_fp8
from liandan.run.files import atomic_file
from liandan.run.worker_env import WorkerEnv


def cpu_supports_bf16() -> bool:
    """True where the CPU has native bf16 arithmetic (AVX512-BF16 or AMX), so bf16 is faster, not emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return sys.platform == "darwin" and torch.backends.mps.is_available()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "fp32":
        return torch.float32
    if requested == "bf16":
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def measure_matmul_flops(dtype: torch.dtype, size: int = 1024, seconds: float = 0.5) -> float:
    """Best observed FLOP/s of a square matmul in `dtype` on this process's CPU threads: the practical peak
    that CPU MFU is measured against."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    for _ in range(3):
        torch.mm(a, b)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = max(best, 4 * 2 * size**3 / (time.perf_counter() - start))
    return best


PEAK_CACHE_FILE = "peak_flops.json"
PEAK_CACHE_MAX_AGE_S = 7 * 24 * 3600  # long enough to skip the benchmark on restarts, short enough to notice upgrades


def cache_dir() -> Path | None:
    """$LIANDAN_CACHE_DIR, else $XDG_CACHE_HOME/liandan, else ~/.cache/liandan; None where there is no home."""
    configured = WorkerEnv.from_env().cache_dir
    if configured is not None:
        return configured
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "liandan"
    try:
        return Path.home() / ".cache" / "liandan"
    except RuntimeError:
        return None


def cpu_model_name() -> str:
    """The CPU's marketing name from /proc/cpuinfo where there is one, else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _peak_cache_key(dtype: torch.dtype, size: int) -> str:
    # Everything that moves the measured number; a change in any of them must miss the cache.
    return "|".join(
        [
            cpu_model_name(),
            f"cpus={os.cpu_count()}",
            f"threads={torch.get_num_threads()}",
            f"torch={torch.__version__}",
            str(dtype).removeprefix("torch."),
            f"size={size}",
        ]
    )


def _read_peak_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):  # missing, unreadable or corrupt: measure instead
        return {}
    return data if isinstance(data, dict) else {}


def _write_peak_cache(path: Path, entries: dict) -> None:
    """Replace the cache file atomically, so a rank starting concurrently never reads half a file; failures are
    ignored, since a cache must never stop training (read-only home, full disk)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # unique: ranks starting together each replace the file with a whole one of their own
        with atomic_file(path, "w", durable=False, unique=True) as handle:
            json.dump(entries, handle, indent=1, sort_keys=True)
    except (OSError, ValueError, TypeError):
        pass


def _fresh_flops(entry: object, now: float) -> float | None:
    if not isinstance(entry, dict):
        return None
    flops, measured_at = entry.get("flops"), entry.get("measured_at")
    if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (flops, measured_at)):
        return None
    # A timestamp from the future (clock set back) counts as stale rather than fresh forever.
    if flops <= 0 or not 0 <= now - measured_at < PEAK_CACHE_MAX_AGE_S:
        return None
    return float(flops)


def cpu_peak_flops(dtype: torch.dtype, size: int = 1024, seconds: float = 0.5) -> tuple[float, bool]:
    """(FLOP/s, whether it came from the disk cache): measure_matmul_flops, remembered per machine and thread
    count so restarts skip the benchmark."""
    directory = cache_dir()
    path = directory / PEAK_CACHE_FILE if directory is not None else None
    key = _peak_cache_key(dtype, size)
    entries = _read_peak_cache(path) if path is not None else {}
    now = time.time()
    cached = _fresh_flops(entries.get(key), now)
    if cached is not None:
        return cached, True
    flops = measure_matmul_flops(dtype, size=size, seconds=seconds)
    if path is not None and flops > 0 and math.isfinite(flops):
        # Re-read just before writing so entries another rank or run added meanwhile survive; expired ones go.
        entries = {k: v for k, v in _read_peak_cache(path).items() if _fresh_flops(v, now) is not None}
        entries[key] = {"flops": flops, "measured_at": time.time()}
        _write_peak_cache(path, entries)
    return flops, False


def datasheet_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The data sheet's dense peak of a GPU in `dtype`; None for a CPU or a GPU the tables do not know."""
    if device.type != "cuda":
        return None
    peak = gpu_peak_flops(torch.cuda.get_device_name(device))
    if peak is not None and dtype == torch.float32:
        peak /= 2  # TF32 tensor cores run at half the bf16 rate
    return peak


def datasheet_fp8_peak_flops(device: torch.device) -> float | None:
    """The data sheet's dense fp8 peak of a GPU; None for a CPU or a GPU the table does not know."""
    if device.type != "cuda":
        return None
    return gpu_peak_flops_fp8(torch.cuda.get_device_name(device))


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(FLOP/s, where the number came from) for one process's device."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = datasheet_peak_flops(device, dtype)
        if peak is not None:
            return peak, f"{name} data sheet"
        return measure_matmul_flops(dtype, size=4096), f"{name} measured matmul"
    flops, cached = cpu_peak_flops(dtype)
    source = f"CPU measured {str(dtype).removeprefix('torch.')} matmul"
    return flops, (f"{source} (cached)" if cached else source)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; peak resident set size of the process on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakMemory:
    """How far this process's memory rose above where it stood at `start()`, at its highest until `stop()`:
    host memory (the resident set) and, on CUDA, device memory. With `reset`, the peaks are reset at the start
    (Linux lets a process reset its resident set's high-water mark), which makes the figures exact but also
    makes the process's lifetime peaks (`peak_memory_bytes`) start there; without it, or where the mark cannot
    be reset, the lifetime peaks stand in (upper bounds)."""

    def __init__(self, device: torch.device, reset: bool = False):
        self.device = device
        self.reset = reset
        self.host_bytes = 0
        self.device_bytes = 0

    def start(self) -> PeakMemory:
        if self.reset:
            try:  # "5" resets VmHWM to the current resident set (Linux >= 4.0)
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass
        self._host_start = (_proc_status_kib("VmRSS") or 0) * 1024
        if self.device.type == "cuda":
            if self.reset:
                torch.cuda.reset_peak_memory_stats(self.device)
            self._device_start = torch.cuda.memory_allocated(self.device)
        return self

    def stop(self) -> PeakMemory:
        hwm = _proc_status_kib("VmHWM")
        peak = hwm * 1024 if hwm is not None else peak_memory_bytes(torch.device("cpu"))
        self.host_bytes = max(0, peak - self._host_start)
        if self.device.type == "cuda":
            self.device_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._device_start)
        return self
