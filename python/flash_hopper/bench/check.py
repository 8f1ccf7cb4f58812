"""Reference check of a backend's forward, by the project's tolerance rule (FA3's).

    err     = max |out - ref_fp32|
    ref_err = max |ref_lowp - ref_fp32|     (the same math done in the input precision by torch)
    pass   <=> err <= 2 * ref_err + 1e-5

A backend is as accurate as it can be expected to be when it is within 2x of what plain PyTorch
gets in the same precision. NaN anywhere fails.

LSE, where the backend returns it: the kernels keep scores in fp32, so a same-precision baseline
is an fp32 implementation, whose own error (~1e-6 at these lengths) is far below the absolute
term of tests/test_fwd_gpu.py's LSE rule; the bench does not pay for a float64 reference and
applies that term alone: max |lse - lse_fp32| <= 1e-4 (+ softcap * 2^-10 for tanh.approx), over
rows that see a key; rows that see none must be -inf exactly where the reference's are.

What is checked is what is timed: the same case at full size (same lengths, hence the same tile),
the same backend and kernel, on the timed inputs. The fp32 reference runs on the GPU a block of
query rows at a time (reference.attention_ref_chunked), so its memory stays bounded at any length,
and once per case: every backend of the case is compared against the same tensors.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

ATOL = 1e-5
LSE_ATOL = 1e-4
# tanh.approx.f32 has relative error <= 2^-11 on a capped score <= softcap; the LSE moves by at most
# the largest score error (tests/test_fwd_gpu.py uses the same bound).
SOFTCAP_LSE_ERROR = 2.0**-10


@dataclass
class CheckResult:
    err: float
    ref_err: float
    tol: float
    passed: bool
    shape: str  # the (batch, seqlen_q, seqlen_k) it ran at: the timed one
    lse_err: float | None = None  # None: the backend returns no LSE
    lse_tol: float | None = None


def tolerance(ref_err: float) -> float:
    return 2.0 * ref_err + ATOL


def lse_tolerance(softcap: float) -> float:
    return LSE_ATOL + softcap * SOFTCAP_LSE_ERROR


def max_abs_diff(a, b) -> float:
    """max |a - b| in fp32 (NaN if either holds one), 0 for empty tensors."""
    if a.numel() == 0:
        return 0.0
    return (a.float() - b.float()).abs().max().item()


def lse_error(lse, ref_lse) -> float:
    """max |lse - ref| over rows with keys; inf when the rows without keys (-inf) differ, NaN
    when lse holds a NaN."""
    import torch

    lse, ref_lse = lse.float(), ref_lse.float()
    if bool(lse.isnan().any()):
        return math.nan
    empty = ref_lse == -math.inf
    if not torch.equal(lse == -math.inf, empty):
        return math.inf
    return max_abs_diff(lse[~empty], ref_lse[~empty])


def _within(err: float | None, tol: float | None) -> bool:
    return err is not None and tol is not None and not math.isnan(err) and err <= tol


def compare(out, ref_fp32, ref_lowp, shape: str = "") -> CheckResult:
    """Apply the output rule to already computed tensors (any device)."""
    err = max_abs_diff(out, ref_fp32)
    ref_err = max_abs_diff(ref_lowp, ref_fp32)
    tol = tolerance(ref_err)
    return CheckResult(err=err, ref_err=ref_err, tol=tol, passed=_within(err, tol), shape=shape)


def shape_label(case) -> str:
    return f"b{case.batch} sq{case.seqlen_q} sk{case.seqlen_k}"


@contextlib.contextmanager
def ieee_fp32_matmuls():
    """fp32 matmuls in full fp32 for the block: a process that enabled TF32 (10-bit mantissa)
    would otherwise make the 'fp32' reference worse than the kernels it judges."""
    import torch

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


class References:
    """The fp32 output and LSE of one case's inputs and the same-precision error, computed once
    (on the inputs' device, in chunks of at most ``max_scores`` scores) and shared by every
    backend checked on those inputs. Holds no low-precision tensor: only its error is needed."""

    def __init__(self, q, k, v, case, max_scores: int | None = None):
        from flash_hopper.reference import CHUNK_SCORES, attention_ref_chunked

        kwargs = {"causal": case.causal, "window_size": tuple(case.window),
                  "softcap": case.softcap, "max_scores": max_scores or CHUNK_SCORES}
        with ieee_fp32_matmuls():
            self.out, self.lse = attention_ref_chunked(q, k, v, upcast=True, **kwargs)
            lowp, _ = attention_ref_chunked(q, k, v, upcast=False, **kwargs)
        self.ref_err = max_abs_diff(lowp, self.out)
        del lowp
        self.softcap = case.softcap
        self.shape = shape_label(case)

    def check(self, out, lse=None) -> CheckResult:
        err = max_abs_diff(out, self.out)
        tol = tolerance(self.ref_err)
        result = CheckResult(err=err, ref_err=self.ref_err, tol=tol, passed=_within(err, tol),
                             shape=self.shape)
        if lse is not None:
            result.lse_err = lse_error(lse, self.lse)
            result.lse_tol = lse_tolerance(self.softcap)
            result.passed = result.passed and _within(result.lse_err, result.lse_tol)
        return result


def describe(result: CheckResult | None) -> str:
    if result is None:
        return "-"
    return "ok" if result.passed else "FAIL"
