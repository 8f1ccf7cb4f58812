"""Reference check of a backend's forward output, by the project's tolerance rule (FA3's).

    err     = max |out - ref_fp32|
    ref_err = max |ref_lowp - ref_fp32|     (the same math done in the input precision by torch)
    pass   <=> err <= 2 * ref_err + 1e-5

A backend is as accurate as it can be expected to be when it is within 2x of what plain PyTorch
gets in the same precision. NaN anywhere fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ATOL = 1e-5
# Check at full size when b*h*sq*sk is at most this (the fp32 reference materializes the scores:
# 2^26 elements = 256 MB); otherwise on a proxy of the same config with batch 1, lengths <= 1024.
FULL_CHECK_MAX_SCORES = 1 << 26
PROXY_MAX_LEN = 1024


@dataclass
class CheckResult:
    err: float
    ref_err: float
    tol: float
    passed: bool
    shape: str  # the (batch, seqlen_q, seqlen_k) it ran at: full size or proxy


def tolerance(ref_err: float) -> float:
    return 2.0 * ref_err + ATOL


def compare(out, ref_fp32, ref_lowp, shape: str = "") -> CheckResult:
    """Apply the rule to already computed tensors (any device)."""
    err = (out.float() - ref_fp32.float()).abs().max().item()
    ref_err = (ref_lowp.float() - ref_fp32.float()).abs().max().item()
    tol = tolerance(ref_err)
    passed = not math.isnan(err) and not math.isnan(tol) and err <= tol
    return CheckResult(err=err, ref_err=ref_err, tol=tol, passed=passed, shape=shape)


def check_case(case, mode: str):
    """The case to check at for a given --check mode, or None when checking is off."""
    if mode == "off":
        return None
    if mode == "full" or (mode == "auto" and case.score_elements() <= FULL_CHECK_MAX_SCORES):
        return case
    return case.proxy(PROXY_MAX_LEN)


def shape_label(case) -> str:
    return f"b{case.batch} sq{case.seqlen_q} sk{case.seqlen_k}"


class References:
    """fp32 and same-precision reference outputs for one set of check inputs, computed once and
    shared by every backend checked on those inputs."""

    def __init__(self, q, k, v, case):
        from flash_hopper.reference import attention_ref

        kwargs = {"causal": case.causal, "window_size": tuple(case.window),
                  "softcap": case.softcap}
        self.fp32 = attention_ref(q, k, v, upcast=True, **kwargs)[0]
        self.lowp = attention_ref(q, k, v, upcast=False, **kwargs)[0]
        self.shape = shape_label(case)

    def check(self, out) -> CheckResult:
        return compare(out, self.fp32, self.lowp, self.shape)


def describe(result: CheckResult | None) -> str:
    if result is None:
        return "-"
    return "ok" if result.passed else "FAIL"
