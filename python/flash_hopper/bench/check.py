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

Gradients (rows that time a backward), by the backward's form of the same rule (kernels/BWD_PLAN.md
§10.1, tests/test_bwd_gpu.py), for g in dq, dk, dv of one backward with a fixed dout:

    err     = max |g - g_fp32|
    ref_err = max |g_lowp - g_fp32|         (reference.attention_bwd_ref_chunked, upcast=False)
    pass   <=> err <= factor * ref_err + atol      factor 2, 3 with softcap (tanh.approx twice)
    atol    = max(2 * max |fl(g_fp32 + 0.3) - 0.3 - g_fp32| in the input dtype, 1e-4)

atol is FA3's rounding scale of the reference, floored like the GPU tests' (a gradient that is
almost all zeros has no rounding scale). Both references recompute from the fp32 forward
reference's output and LSE, so they cost one chunked backward each, once per case, and only for
a case with a backward row to check (``GradReferences``).
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
GRAD_NAMES = ("dq", "dk", "dv")
GRAD_FACTOR = 2.0
SOFTCAP_GRAD_FACTOR = 3.0
GRAD_ATOL = 1e-4


@dataclass
class CheckResult:
    err: float
    ref_err: float
    tol: float
    passed: bool
    shape: str  # the (batch, seqlen_q, seqlen_k) it ran at: the timed one
    lse_err: float | None = None  # None: the backend returns no LSE
    lse_tol: float | None = None


def tolerance(ref_err: float, factor: float = 2.0, atol: float = ATOL) -> float:
    """The rule's bound: ``factor`` times the same-precision error, plus ``atol``."""
    return factor * ref_err + atol


def rounding_scale(ref, dtype) -> float:
    """FA3's rounding scale of ``ref`` in ``dtype``: 2 * max |fl(r + 0.3) - 0.3 - r|, with r =
    ``ref`` rounded to ``dtype`` (what an ulp of the values around 0.3 amounts to)."""
    rounded = ref.to(dtype)
    return 2.0 * max_abs_diff(rounded + 0.3 - 0.3, rounded)


def grad_tolerance(ref_err: float, rounding: float, softcap: float) -> float:
    factor = SOFTCAP_GRAD_FACTOR if softcap else GRAD_FACTOR
    return tolerance(ref_err, factor, max(rounding, GRAD_ATOL))


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


@dataclass
class GradCheckResult:
    """The gradient rule's numbers per gradient name (GRAD_NAMES); passed when all three pass."""

    err: dict[str, float]
    ref_err: dict[str, float]
    tol: dict[str, float]
    passed: bool
    shape: str


class GradReferences:
    """The fp32 dq, dk, dv of one case's inputs and ``dout`` and their tolerances, computed once
    from the forward ``References`` (its fp32 output and LSE) and shared by every backend whose
    backward is checked on those inputs. Like References, it keeps no low-precision tensor."""

    def __init__(self, q, k, v, dout, case, forward: References, max_scores: int | None = None):
        from flash_hopper.reference import CHUNK_SCORES, attention_bwd_ref_chunked

        kwargs = {"causal": case.causal, "window_size": tuple(case.window),
                  "softcap": case.softcap, "chunk_scores": max_scores or CHUNK_SCORES}
        args = (q, k, v, forward.out, forward.lse, dout)
        with ieee_fp32_matmuls():
            self.grads = attention_bwd_ref_chunked(*args, upcast=True, **kwargs)
            lowp = attention_bwd_ref_chunked(*args, upcast=False, **kwargs)
        self.ref_err = {n: max_abs_diff(g, r) for n, g, r in zip(GRAD_NAMES, lowp, self.grads)}
        del lowp
        self.tol = {n: grad_tolerance(self.ref_err[n], rounding_scale(r, q.dtype), case.softcap)
                    for n, r in zip(GRAD_NAMES, self.grads)}
        self.shape = shape_label(case)

    def check(self, grads) -> GradCheckResult:
        """Apply the rule to a backend's (dq, dk, dv)."""
        err = {n: max_abs_diff(g, r) for n, g, r in zip(GRAD_NAMES, grads, self.grads)}
        passed = all(_within(err[n], self.tol[n]) for n in GRAD_NAMES)
        return GradCheckResult(err=err, ref_err=dict(self.ref_err), tol=dict(self.tol),
                               passed=passed, shape=self.shape)


def describe(result: CheckResult | None) -> str:
    if result is None:
        return "-"
    return "ok" if result.passed else "FAIL"
