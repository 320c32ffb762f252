"""What the hardware offers: bf16 support, peak FLOP/s for MFU, and peak memory."""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch

# Dense bf16 tensor-core peaks from the vendors' data sheets, in TFLOP/s (no sparsity).
GPU_PEAK_TFLOPS_BF16 = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "B100": 1750.0,
    "A100": 312.0,
    "A800": 312.0,
    "H800": 989.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,  # fp16: V100 has no bf16
    "MI300X": 1307.0,
    "MI250X": 383.0,
}


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


def gpu_peak_flops(name: str) -> float | None:
    """Per-device dense bf16 peak in FLOP/s from the table, matching the longest key in the device name."""
    for key in sorted(GPU_PEAK_TFLOPS_BF16, key=len, reverse=True):
        if key.lower() in name.lower():
            return GPU_PEAK_TFLOPS_BF16[key] * 1e12
    return None


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


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(FLOP/s, where the number came from) for one process's device."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name)
        if peak is not None:
            if dtype == torch.float32:
                peak /= 2  # TF32 tensor cores run at half the bf16 rate
            return peak, f"{name} data sheet"
        return measure_matmul_flops(dtype, size=4096), f"{name} measured matmul"
    return measure_matmul_flops(dtype), f"CPU measured {str(dtype).removeprefix('torch.')} matmul"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory on CUDA; peak resident set size of the process on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
