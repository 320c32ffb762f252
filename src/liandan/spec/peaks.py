"""Dense bf16 peak FLOP/s of accelerators from their vendors' data sheets: the denominator of MFU in the
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
