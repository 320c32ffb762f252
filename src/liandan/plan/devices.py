"""Accelerators the planner knows: memory capacity and dense bf16 peak, by a forgiving name ("h100", "A100-40GB")."""

from __future__ import annotations

import re
from dataclasses import dataclass

from liandan.common.peaks import GPU_PEAK_TFLOPS_BF16, gpu_peak_flops, gpu_peak_flops_fp8
from liandan.config import ConfigError

# Memory per device in GiB, from the vendors' data sheets. HBM capacities are binary in practice (an "80GB"
# H100 has 80 GiB); the H200's 141 GB is what NVIDIA advertises (about 140 GiB is visible to CUDA). A bare
# family name means its largest common part (A100 = the 80 GB SXM part).
DEVICE_MEMORY_GIB: dict[str, float] = {
    "H100": 80.0,
    "H100 SXM": 80.0,
    "H100 PCIe": 80.0,
    "H100 NVL": 94.0,
    "H800": 80.0,
    "H200": 141.0,
    "GH200": 96.0,
    "B200": 180.0,
    "A100": 80.0,
    "A100 80GB": 80.0,
    "A100 40GB": 40.0,
    "A800": 80.0,
    "L40S": 48.0,
    "L4": 24.0,
    "A10G": 24.0,
    "A10": 24.0,
    "RTX 4090": 24.0,
    "RTX 3090": 24.0,
    "V100": 32.0,
    "V100 16GB": 16.0,
    "MI300X": 192.0,
    "MI250X": 128.0,
}


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    peak_tflops_bf16: float  # dense, no sparsity; fp32 runs at half this on TF32 tensor cores

    def peak_flops(self, dtype: str = "bf16") -> float:
        """FLOP/s one device offers in `dtype`, as the trainer's MFU counts it."""
        return self.peak_tflops_bf16 * 1e12 / (2 if dtype == "fp32" else 1)

    def peak_flops_fp8(self, dtype: str = "bf16") -> float:
        """FLOP/s of the device's fp8 matmuls; without fp8 units (or a known peak), `peak_flops(dtype)`."""
        return gpu_peak_flops_fp8(self.name) or self.peak_flops(dtype)


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def known_devices() -> list[str]:
    return sorted(set(DEVICE_MEMORY_GIB) | set(GPU_PEAK_TFLOPS_BF16))


def resolve_device(name: str, memory_gib: float | None = None) -> Device:
    """The device called `name` (case, spaces and dashes ignored: h100, a100-40gb, "RTX 4090"). `memory_gib`
    overrides the table, and is required for a device whose memory the table does not hold."""
    wanted = _key(name)
    names = {_key(n): n for n in known_devices()}
    if wanted not in names:
        raise ConfigError(
            f"unknown device '{name}'; known: {', '.join(n.lower().replace(' ', '-') for n in known_devices())}"
        )
    canonical = names[wanted]
    peak = gpu_peak_flops(canonical)
    if peak is None:  # pragma: no cover - every table name has a peak through its family
        raise ConfigError(f"no peak FLOP/s known for device '{name}'")
    memory = memory_gib if memory_gib is not None else DEVICE_MEMORY_GIB.get(canonical)
    if memory is None:
        raise ConfigError(f"memory of device '{name}' is not in the table; pass --device-memory-gib")
    if memory <= 0:
        raise ConfigError(f"--device-memory-gib = {memory:g} must be positive")
    return Device(canonical, float(memory), peak / 1e12)
