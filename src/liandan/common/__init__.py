"""What several layers need to know alike, without torch: the parallel layout, the data-sheet peak FLOP/s of
accelerators and the learning-rate schedule (`plan` and `train`), and the tokenizers' end-of-document rule
(`data` and `checkpoint`, in `liandan.common.tokens`). Imports nothing of liandan but `config`."""

from liandan.common.layout import Layout, resolve_layout, uses_fsdp
from liandan.common.peaks import GPU_PEAK_TFLOPS_BF16, gpu_peak_flops
from liandan.common.schedule import lr_multiplier

__all__ = ["GPU_PEAK_TFLOPS_BF16", "Layout", "gpu_peak_flops", "lr_multiplier", "resolve_layout", "uses_fsdp"]
