"""Dense tensor-core peaks by GPU name (BF16/FP16 and FP8), and a measured GEMM ceiling.

The table holds NVIDIA datasheet numbers for dense math (half of the "with sparsity" figures),
FP32 accumulation, boost clock. Two ceilings are reported because they answer different questions:
% of datasheet peak says how far the hardware is from its limit; % of a measured cuBLAS GEMM says
how close attention is to the best-known matmul on this particular board, clocks and power cap.
Both are per dtype: FP8 (e4m3) rows are compared with the FP8 peak and an FP8 GEMM
(torch._scaled_mm, e4m3 x e4m3 -> bf16), bf16 / fp16 rows with the 16-bit ones. Mixed-mode rows
(bf16+e4m3, ...) are compared with the 16-bit ones of q's dtype: K / V are FP8 in memory only, the
GEMMs are 16-bit (cases.gemm_dtype).
"""

from __future__ import annotations

import re
from typing import Any

from .cases import FP8_DTYPES, gemm_dtype
from .errors import first_line

# Ordered: the first matching pattern wins, so variants (NVL, PCIe) precede the SXM family name.
# (pattern, dense bf16/fp16 TFLOP/s, dense FP8 TFLOP/s or None without FP8 tensor cores, label)
PEAK_TFLOPS = (
    (r"H100 NVL|H200 NVL", 835.5, 1670.5, "H100/H200 NVL"),
    (r"H100 PCIe", 756.5, 1513.0, "H100 PCIe"),
    (r"GH200|H200|H100|H800", 989.4, 1978.9, "H100/H200 SXM"),
    (r"A100|A800", 312.0, None, "A100"),
    (r"\bA30\b", 165.0, None, "A30"),
    (r"\bA10\b", 125.0, None, "A10"),
    (r"L40S", 362.1, 733.0, "L40S"),
    (r"\bL40\b", 181.0, 362.1, "L40"),
    (r"\bL4\b", 121.0, 242.5, "L4"),
    (r"RTX 4090", 165.2, 330.3, "RTX 4090"),
    (r"B200", 2250.0, 4500.0, "B200"),
)

GEMM_SIZE = 8192


class GemmUnavailable(RuntimeError):
    """The GEMM for a dtype's ceiling cannot run here (e.g. no torch._scaled_mm)."""


def lookup_peak(device_name: str, dtype: Any = "bf16") -> tuple[float | None, str]:
    """(TFLOP/s, which table entry) for a device name and a sweep dtype (its GEMMs' dtype's peak;
    a name or a torch dtype, as gemm_dtype takes it); (None, reason) when it is unknown."""
    fp8 = gemm_dtype(dtype) in FP8_DTYPES
    kind = "FP8" if fp8 else "bf16/fp16"
    for pattern, half, fp8_peak, label in PEAK_TFLOPS:
        if re.search(pattern, device_name or ""):
            tflops = fp8_peak if fp8 else half
            if tflops is None:
                return None, f"no dense {kind} peak for {label} (no FP8 tensor cores)"
            return tflops, f"datasheet {label} dense {kind}"
    return None, f"no datasheet {kind} peak known for {device_name!r} (pass --peak-tflops)"


def gemm_flops(size: int) -> float:
    return 2.0 * size ** 3


def measure_gemm_ceiling(timer, dtype: Any = "bf16", size: int = GEMM_SIZE,
                         device: str = "cuda") -> dict:
    """Median TFLOP/s of one size^3 cuBLAS matmul in `dtype`'s GEMM dtype, timed with the sweep's
    own timer: torch.mm for bf16 / fp16 (and the mixed dtypes, by q's dtype), torch._scaled_mm
    (e4m3 x e4m3 -> bf16, unit scales, b column-major as cuBLASLt's FP8 GEMM wants it) for e4m3.
    The result's "dtype" is the GEMM's. GemmUnavailable when the FP8 GEMM cannot run."""
    import torch

    dtype = gemm_dtype(dtype)
    if dtype in FP8_DTYPES:
        fn, op = _scaled_mm_call(size, device), "torch._scaled_mm (bf16 out)"
    else:
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        a = torch.randn(size, size, device=device, dtype=torch_dtype)
        b = torch.randn(size, size, device=device, dtype=torch_dtype)
        c = torch.empty(size, size, device=device, dtype=torch_dtype)
        fn, op = (lambda: torch.mm(a, b, out=c)), "torch.mm"
    stats = timer.measure([fn])
    return {"dtype": dtype, "size": size, "ms": stats.median, "op": op,
            "tflops": gemm_flops(size) / (stats.median * 1e-3) / 1e12}


def _scaled_mm_call(size: int, device: str):
    """The FP8 GEMM as a zero-argument callable, run once here so that a torch without it (or
    with another signature) says so before the timing: GemmUnavailable, naming the cause."""
    import torch

    scaled_mm = getattr(torch, "_scaled_mm", None)
    if scaled_mm is None:
        raise GemmUnavailable(f"torch {torch.__version__} has no torch._scaled_mm (FP8 GEMM)")
    e4m3 = torch.float8_e4m3fn
    a = torch.randn(size, size, device=device).to(e4m3)
    b = torch.randn(size, size, device=device).to(e4m3).t()  # column-major
    one = torch.tensor(1.0, device=device)

    def run():
        return scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    try:
        run()
    except Exception as exc:  # TypeError (an old signature), RuntimeError (no kernel here)
        raise GemmUnavailable(f"torch._scaled_mm failed: {first_line(exc)}") from exc
    return run
