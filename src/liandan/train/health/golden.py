"""Golden tests: deterministic matrix products whose answer is known, to tell a device that computes wrong.

A product of seeded matrices is computed on the device in the dtype under test and compared twice: with a
float64 reference on the CPU (an error far beyond the dtype's rounding is a wrong answer), and, across ranks,
by a digest of its exact bits (devices of one kind running one kernel on one input agree bit for bit, so a
rank whose digest differs from the majority's is the odd one out, even where its error is small).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from liandan.faults import faulty_matmuls

# Relative error of a product against float64 beyond which it is wrong, not rounded: ~16x the worst rounding
# seen on CPUs and GPUs for inner dimension 256 (TF32 included), and far under a flipped exponent bit.
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 6e-2, torch.float16: 1e-2}


@dataclass
class GoldenResult:
    dtype: str
    max_error: float  # largest |result - reference|, relative to the reference's largest magnitude
    tolerance: float
    digest: str  # of the result's bits, for comparison across ranks
    wrong_elements: int

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def golden_matmul(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 256, seed: int = 0,
                  step: int = 0) -> GoldenResult:  # fmt: skip
    """One seeded `size`-square product on `device` in `dtype`, judged against float64. `step` is the
    training step the test runs at (for injected device faults)."""
    a, b, reference = seeded_problem(size, seed)
    with faulty_matmuls(step):
        result = torch.mm(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
    result = result.to("cpu")
    scale = float(reference.abs().max())
    error = (result.double() - reference).abs() / scale
    tolerance = TOLERANCE.get(dtype, 2e-3)
    digest = hashlib.sha256(result.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    return GoldenResult(str(dtype).removeprefix("torch."), float(error.max()), tolerance, digest,
                        int((error > tolerance).sum()))  # fmt: skip


def seeded_problem(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two seeded `size`-square float64 matrices and their product: a golden test's question and answer."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(size, size, generator=generator, dtype=torch.float64)
    b = torch.randn(size, size, generator=generator, dtype=torch.float64)
    return a, b, a @ b


def odd_ones_out(digests: list[str]) -> list[int]:
    """The indices whose digest differs from the majority's; none where there is no strict majority (two
    ranks that disagree cannot say which of them is wrong)."""
    if not digests:
        return []
    common, count = Counter(digests).most_common(1)[0]
    if count * 2 <= len(digests):
        return []
    return [i for i, d in enumerate(digests) if d != common]
