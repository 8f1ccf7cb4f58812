"""Dense BF16/FP16 tensor-core peaks by GPU name, and a measured GEMM ceiling.

The table holds NVIDIA datasheet numbers for dense math (half of the "with sparsity" figures),
FP32 accumulation, boost clock. Two ceilings are reported because they answer different questions:
% of datasheet peak says how far the hardware is from its limit; % of a measured cuBLAS GEMM says
how close attention is to the best-known matmul on this particular board, clocks and power cap.
"""

from __future__ import annotations

import re

# Ordered: the first matching pattern wins, so variants (NVL, PCIe) precede the SXM family name.
PEAK_TFLOPS = (
    (r"H100 NVL|H200 NVL", 835.5, "H100/H200 NVL"),
    (r"H100 PCIe", 756.5, "H100 PCIe"),
    (r"GH200|H200|H100|H800", 989.4, "H100/H200 SXM"),
    (r"A100|A800", 312.0, "A100"),
    (r"\bA30\b", 165.0, "A30"),
    (r"\bA10\b", 125.0, "A10"),
    (r"L40S", 362.1, "L40S"),
    (r"\bL40\b", 181.0, "L40"),
    (r"\bL4\b", 121.0, "L4"),
    (r"RTX 4090", 165.2, "RTX 4090"),
    (r"B200", 2250.0, "B200"),
)

GEMM_SIZE = 8192


def lookup_peak(device_name: str) -> tuple[float | None, str]:
    """(TFLOP/s, which table entry) for a device name; (None, reason) when it is unknown."""
    for pattern, tflops, label in PEAK_TFLOPS:
        if re.search(pattern, device_name or ""):
            return tflops, f"datasheet {label} dense bf16/fp16"
    return None, f"no datasheet peak known for {device_name!r} (pass --peak-tflops)"


def gemm_flops(size: int) -> float:
    return 2.0 * size ** 3


def measure_gemm_ceiling(timer, dtype: str = "bf16", size: int = GEMM_SIZE) -> dict:
    """Median TFLOP/s of one size^3 cuBLAS matmul in `dtype`, timed with the sweep's own timer."""
    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a = torch.randn(size, size, device="cuda", dtype=torch_dtype)
    b = torch.randn(size, size, device="cuda", dtype=torch_dtype)
    c = torch.empty(size, size, device="cuda", dtype=torch_dtype)
    stats = timer.measure([lambda: torch.mm(a, b, out=c)])
    return {"dtype": dtype, "size": size, "ms": stats.median,
            "tflops": gemm_flops(size) / (stats.median * 1e-3) / 1e12}
