"""Dense bf16 and fp8 peak FLOP/s of accelerators from their vendors' data sheets: the denominator of MFU in the
trainer and the device table of the planner."""

from __future__ import annotations

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


def gpu_peak_flops(name: str) -> float | None:
    """Per-device dense bf16 peak in FLOP/s from the table, matching the longest key in the device name."""
    for key in sorted(GPU_PEAK_TFLOPS_BF16, key=len, reverse=True):
        if key.lower() in name.lower():
            return GPU_PEAK_TFLOPS_BF16[key] * 1e12
    return None


# Dense fp8 tensor-core peaks (no sparsity), for the devices that have fp8 tensor cores; the others are absent.
GPU_PEAK_TFLOPS_FP8 = {
    "H200": 1979.0,
    "H100 SXM": 1979.0,
    "H100 NVL": 1671.0,
    "H100 PCIe": 1513.0,
    "H100": 1979.0,
    "GH200": 1979.0,
    "H800": 1979.0,
    "B200": 4500.0,
    "B100": 3500.0,
    "L40S": 733.0,
    "L4": 242.5,
    "MI300X": 2615.0,
}


def gpu_peak_flops_fp8(name: str) -> float | None:
    """Per-device dense fp8 peak in FLOP/s, matched as `gpu_peak_flops` matches; None without fp8 units."""
    for key in sorted(GPU_PEAK_TFLOPS_BF16, key=len, reverse=True):
        if key.lower() in name.lower():
            tflops = GPU_PEAK_TFLOPS_FP8.get(key)
            return tflops * 1e12 if tflops is not None else None
    return None


def mixed_peak_flops(peak: float, fp8_peak: float, fp8_share: float) -> float:
    """The peak of a step whose FLOPs are `fp8_share` fp8 matmuls (at `fp8_peak`) and the rest at `peak`: the
    rate at which the whole step would run if every part ran at its own unit's peak (time-weighted, so MFU
    against it stays at most 1 and reaches 1 only when both parts are at their peaks)."""
    if not 0 <= fp8_share <= 1:
        raise ValueError(f"fp8 share of the FLOPs {fp8_share} must lie in [0, 1]")
    return 1.0 / (fp8_share / fp8_peak + (1 - fp8_share) / peak)
