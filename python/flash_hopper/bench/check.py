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

Gradients (rows that time a backward), by the backward's form of the same rule (docs/testing.md
"The tolerance doctrine", tests/test_bwd_gpu.py), for g in dq, dk, dv of one backward with a fixed dout:

    err     = max |g - g_fp32|
    ref_err = max |g_lowp - g_fp32|         (reference.attention_bwd_ref_chunked, upcast=False)
    pass   <=> err <= factor * ref_err + atol      factor 2, 3 with softcap (tanh.approx twice)
    atol    = max(2 * max |fl(g_fp32 + 0.3) - 0.3 - g_fp32| in the input dtype, 1e-4)

atol is FA3's rounding scale of the reference, floored like the GPU tests' (a gradient that is
almost all zeros has no rounding scale). Both references recompute from the fp32 forward
reference's output and LSE, so they cost one chunked backward each, once per case, and only for
a case with a backward row to check (``GradReferences``).

FP8 (e4m3) rows, forward only, by a rule of their own (``Fp8References``; check_metric
"rel-rmse" in the results, "max-abs" for the rule above):

    ref     = fp32 attention of the dequantized inputs (fp8_inputs.dequantize: data * descale)
    err     = ||out - ref||_2 / ||ref||_2       (relative RMS error over the whole output)
    pass   <=> err <= 0.05, and max |lse - lse_ref| <= 2e-3 (+ softcap * 2^-10)

The dequantized inputs are the exact values the kernel multiplies, so the quantization of the
inputs is not counted; what is left is the kernel's own FP8 rounding, P rounded to e4m3 (3
mantissa bits) for P V, a relative RMS error of ~2-3 % on N(0, 1) inputs. A same-precision torch
baseline does not exist (torch has no FP8 attention), so the bound is absolute; a bug (a lost key
block, a wrong descale, V^T in the wrong key order) gives errors of order 1, an accumulator that
loses precision at long context (the single-level ablation) a few percent more. The LSE bound is
tests/test_fp8_gpu.py's: the scores are exact products of the FP8 values, so the LSE keeps the
bf16 rows' accuracy up to the accumulator's rounding.

Mixed-mode rows ("bf16+e4m3", ...: 16-bit q, FP8 K / V with descales), forward only, by FA3's
rule above (``MixedReferences``, check_metric "max-abs"):

    ref_fp32 = fp32 attention of q on the dequantized k, v (k.data * k_descale, fp32)
    ref_lowp = the same in q's dtype, on q and the dequantized k, v rounded to q's dtype

The kernel converts the FP8 values exactly to q's dtype (every e4m3 / e5m2 value is a bf16 and an
fp16 value) and folds the descales into the score scale and the output in fp32, so its GEMMs see
what a 16-bit call on the dequantized k, v would see, less one rounding: the 16-bit rule applies
unchanged. The quantization of k and v is in both references, so it is not counted.

Varlen rows (packed (total, heads, d) inputs, forward only), by FA3's rule above
(``VarlenReferences``): each sequence's slice gets the dense References of a batch of one (its
own lengths, so causal and windows align on them), and the pieces are joined back into the packed
output (total, heads, d) and LSE (heads, total); ref_err is the largest over the sequences, which
is the same max as over the whole tensor. A result with a sequence's rows moved fails.
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
FP8_REL_RMSE = 0.05
FP8_LSE_ATOL = 2e-3
METRIC_MAX_ABS = "max-abs"  # FA3's rule: err and tol are max |out - ref| and its bound
METRIC_REL_RMSE = "rel-rmse"  # the FP8 rule: err is the relative RMS error


@dataclass
class CheckResult:
    err: float
    ref_err: float | None  # None: the rule has no same-precision baseline (FP8)
    tol: float
    passed: bool
    shape: str  # the (batch, seqlen_q, seqlen_k) it ran at: the timed one
    lse_err: float | None = None  # None: the backend returns no LSE
    lse_tol: float | None = None
    metric: str = METRIC_MAX_ABS  # what err and tol measure


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


def lse_tolerance(softcap: float, atol: float = LSE_ATOL) -> float:
    return atol + softcap * SOFTCAP_LSE_ERROR


def max_abs_diff(a, b) -> float:
    """max |a - b| in fp32 (NaN if either holds one), 0 for empty tensors."""
    if a.numel() == 0:
        return 0.0
    return (a.float() - b.float()).abs().max().item()


def relative_rmse(out, ref) -> float:
    """||out - ref||_2 / ||ref||_2, differences in fp32 and sums in float64 (NaN if out holds
    one); 0 for equal tensors, inf for a difference from an all-zero ref."""
    import torch

    ref = ref.float()
    diff = (out.float() - ref).pow(2).sum(dtype=torch.float64).item()
    norm = ref.pow(2).sum(dtype=torch.float64).item()
    if math.isnan(diff) or diff == 0.0:
        return diff
    return math.sqrt(diff / norm) if norm > 0 else math.inf


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


def compare(out, ref_fp32, ref_lowp, shape: str = "", atol: float = ATOL) -> CheckResult:
    """Apply the output rule to already computed tensors (any device); ``atol`` its absolute
    term (the decode sweep passes its own, decode.CHECK_ATOL)."""
    err = max_abs_diff(out, ref_fp32)
    ref_err = max_abs_diff(ref_lowp, ref_fp32)
    tol = tolerance(ref_err, atol=atol)
    return CheckResult(err=err, ref_err=ref_err, tol=tol, passed=_within(err, tol), shape=shape)


def shape_label(case) -> str:
    if case.is_varlen:
        return f"varlen b{case.batch} total{case.tokens_q} max{case.seqlen_q}"
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
    backend checked on those inputs. Holds no low-precision tensor: only its error is needed.

    The same-precision reference computes in q's dtype (attention_ref_chunked with upcast=False
    casts k and v to it), so fp32 k, v (MixedReferences' dequantized ones) are rounded once."""

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


class VarlenReferences(References):
    """FA3's rule for one varlen case (module docstring): References per sequence, joined into
    the packed layout, computed once and shared by every backend checked on them. q, k, v are
    packed (total, heads, d); check() is References' on the packed out and (heads, total) LSE."""

    def __init__(self, q, k, v, case, max_scores: int | None = None):
        import dataclasses

        import torch

        outs, lses, errors = [], [], []
        offsets = case.cu_seqlens()
        for start, stop in zip(offsets[:-1], offsets[1:]):
            n = stop - start
            one = dataclasses.replace(case, batch=1, seqlen_q=n, seqlen_k=n, seqlens=None)
            piece = References(*(t[None, start:stop] for t in (q, k, v)), one, max_scores)
            outs.append(piece.out[0])  # (n, heads, d)
            lses.append(piece.lse[0])  # (heads, n)
            errors.append(piece.ref_err)
        self.out = torch.cat(outs)
        self.lse = torch.cat(lses, dim=1)
        self.ref_err = max(errors)
        self.softcap = case.softcap
        self.shape = shape_label(case)


class MixedReferences(References):
    """FA3's rule for one mixed-mode case (module docstring): q a 16-bit tensor, k and v
    fp8_inputs.Fp8Input; the references of q on the dequantized k, v (fp32), computed once like
    References' and shared by every backend checked on them."""

    def __init__(self, q, k, v, case, max_scores: int | None = None):
        super().__init__(q, k.dequantize(), v.dequantize(), case, max_scores)


class Fp8References:
    """The FP8 rule's reference for one e4m3 case (module docstring): the fp32 output and LSE of
    the dequantized inputs, computed once like References' and shared by every backend checked
    on them. q, k, v are fp8_inputs.Fp8Input."""

    def __init__(self, q, k, v, case, max_scores: int | None = None):
        from flash_hopper.reference import CHUNK_SCORES, attention_ref_chunked

        kwargs = {"causal": case.causal, "window_size": tuple(case.window),
                  "softcap": case.softcap, "max_scores": max_scores or CHUNK_SCORES}
        real = [t.dequantize() for t in (q, k, v)]  # float32
        with ieee_fp32_matmuls():
            self.out, self.lse = attention_ref_chunked(*real, upcast=True, **kwargs)
        del real
        self.softcap = case.softcap
        self.shape = shape_label(case)

    def check(self, out, lse=None) -> CheckResult:
        return compare_fp8(out, self.out, lse, self.lse, self.softcap, self.shape)


def compare_fp8(out, ref, lse=None, ref_lse=None, softcap: float = 0.0,
                shape: str = "") -> CheckResult:
    """Apply the FP8 rule to already computed tensors (any device); the LSE where given."""
    err = relative_rmse(out, ref)
    result = CheckResult(err=err, ref_err=None, tol=FP8_REL_RMSE,
                         passed=_within(err, FP8_REL_RMSE), shape=shape, metric=METRIC_REL_RMSE)
    if lse is not None:
        result.lse_err = lse_error(lse, ref_lse)
        result.lse_tol = lse_tolerance(softcap, FP8_LSE_ATOL)
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
