"""Runs the sweep: for each case, each backend and each direction, one result row.

Order of work per case: allocate inputs once (several sets when they fit in L2), compute the fp32
reference once on the first set (full size, chunked: check.py), then per backend: config check ->
first call on that set (the reference check of exactly what is timed; it also surfaces setup
errors) -> timing per direction. A failure in one backend becomes a row with its reason and the
sweep goes on.

Backward rows (bwd, fwd+bwd) add, once per backend and case, before their timing: the gradient
check (one backward on the first set with the case's fixed dout, against check.GradReferences,
computed at the first backend that needs them) and the backward's memory (memory.py). A backward
that fails to run is classified like a failing first call, for the backward rows only.

FP8 (e4m3) cases: inputs drawn as for bf16, then quantized (fp8_inputs.py); a backend without an
FP8 path is skipped first ("unsupported (no FP8): ..."); the check is check.py's FP8 rule. %peak
and %gemm use the ceilings of the row's dtype when RunOptions gives them per dtype.

Mixed cases ("bf16+e4m3", ...): inputs drawn as for q's dtype, k and v quantized into the FP8 K / V
dtype (fp8_inputs.py); a backend without a mixed-mode path is skipped first ("unsupported (no
mixed mode): ..."); the check is the 16-bit rule against fp32 on q and the dequantized k, v
(check.MixedReferences). Like FP8 cases they are forward only: backward rows are skipped.

Varlen cases (--varlen): q, k, v packed (total tokens, heads, head_dim); a backend without a varlen
path is skipped first ("unsupported (no varlen): ..."); the check is check.VarlenReferences (the
16-bit rule per sequence); backward rows are skipped (VARLEN_NO_BACKWARD). Each backend's timed
calls run in its ``timing_context`` (flash-hopper's turns the varlen offsets check off there).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable, Union

from . import check as checks
from .cases import FP8_NO_BACKWARD, MIXED_NO_BACKWARD  # noqa: F401 - re-exported for callers
from .errors import first_line
from .fp8_inputs import quantize_inputs, quantize_kv_cache
from .memory import bwd_memory
from .report import normalize

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# What an FP8 case's inputs are drawn in before quantization: the bf16 case's values.
FP8_SOURCE_DTYPE = "bf16"
# A ceiling in TFLOP/s for every dtype, or one per dtype ({"bf16": 989.4, "e4m3": 1978.9}).
Ceiling = Union[float, Mapping[str, float], None]


class SetupError(RuntimeError):
    """A backend's first call failed; the message is already one readable line."""


@dataclass
class RunOptions:
    directions: Sequence[str] = ("fwd",)
    check: str = "on"  # on | off
    peak_tflops: Ceiling = None
    gemm_tflops: Ceiling = None
    device: str = "cuda"
    seed: int = 0


def base_row(case, backend_name: str, direction: str) -> dict[str, object]:
    """The row's configuration; a varlen case's lengths as one space-separated string (the same
    in JSON and CSV)."""
    seqlens = " ".join(map(str, case.seqlens)) if case.is_varlen else None
    return {
        "backend": backend_name, "kernel": None, "kernel_reason": None, "direction": direction,
        "dtype": case.dtype, "batch": case.batch, "seqlen_q": case.seqlen_q,
        "seqlen_k": case.seqlen_k, "seqlens": seqlens, "heads": case.heads, "heads_kv": case.heads_kv,
        "head_dim": case.head_dim, "causal": case.causal, "window_left": case.window[0],
        "window_right": case.window[1], "softcap": case.softcap, "mask": case.mask_label,
        "status": None, "reason": None, "flops": case.flops(direction),
    }


def ceiling_for(ceiling: Ceiling, dtype: str) -> float | None:
    """A ceiling option's TFLOP/s for rows of ``dtype``: a number applies to every dtype, a
    mapping is looked up (None where it has no entry)."""
    if isinstance(ceiling, Mapping):
        return ceiling.get(dtype)
    return ceiling


def fill_timing(row: dict[str, object], stats, options: RunOptions) -> None:
    """Times in ms, TFLOP/s from the median, and both ceilings (of the row's dtype). Unset text
    fields stay None, so JSON and CSV (where an empty cell reads back as None) agree."""
    tflops = row["flops"] / (stats.median * 1e-3) / 1e12
    peak = ceiling_for(options.peak_tflops, row["dtype"])
    gemm = ceiling_for(options.gemm_tflops, row["dtype"])
    row.update({
        "status": "ok", "ms": stats.median, "ms_p20": stats.p20, "ms_p80": stats.p80,
        "ms_min": stats.min, "ms_max": stats.max, "iters": stats.n, "tflops": tflops,
        "host_ms": stats.host_ms,
        "pct_peak": 100.0 * tflops / peak if peak else None,
        "pct_gemm": 100.0 * tflops / gemm if gemm else None,
        "notes": "; ".join(filter(None, [row.get("notes"), *stats.notes])) or None,
    })


def fill_check(row: dict[str, object], result) -> None:
    if result is None:
        return
    row.update({"check_err": result.err, "check_ref_err": result.ref_err,
                "check_tol": result.tol, "check_lse_err": result.lse_err,
                "check_lse_tol": result.lse_tol, "check_pass": result.passed,
                "check_shape": result.shape, "check_metric": result.metric})


def fill_grad_check(row: dict[str, object], result) -> None:
    """Gradient columns of a backward row; its check_pass then needs the forward's check (the
    backward consumes the forward's output and LSE) and the gradients' to pass."""
    if result is None:
        return
    for name in checks.GRAD_NAMES:
        row[f"check_{name}_err"] = result.err[name]
        row[f"check_{name}_tol"] = result.tol[name]
    row["check_grad_pass"] = result.passed
    row["check_pass"] = result.passed and row.get("check_pass") is not False
    row["check_shape"] = row.get("check_shape") or result.shape


def has_backward(direction: str) -> bool:
    return "bwd" in direction


def is_unsupported(exc: BaseException) -> bool:
    """Does a failure mean "this configuration is not supported" (UnsupportedError is a
    NotImplementedError, possibly wrapped) rather than a bug?"""
    return isinstance(exc, NotImplementedError) or isinstance(exc.__cause__, NotImplementedError)


def fp8_skip_reason(backend, case) -> str | None:
    """Why ``backend`` is skipped for an FP8 case (it has no FP8 path), a mixed case (it has no
    mixed-mode path) or a varlen case (it has no varlen path), or None."""
    if case.is_fp8:
        why = backend.fp8_reason()
        return None if why is None else f"unsupported (no FP8): {why}"
    if case.is_mixed:
        why = backend.mixed_reason()
        return None if why is None else f"unsupported (no mixed mode): {why}"
    if case.is_varlen:
        why = backend.varlen_reason()
        return None if why is None else f"unsupported (no varlen): {why}"
    return None


def make_inputs(case, device, generator):
    """q, k, v: N(0, 1) in the case's dtype; for FP8, the bf16 case's values quantized per head
    (fp8_inputs.Fp8Input each); for the mixed mode, the values of the case of q's dtype, q as it
    is and k, v quantized per kv head into the FP8 K / V dtype (Fp8Inputs). Varlen: packed
    (total tokens, heads, head_dim), 16-bit."""
    import torch

    dtype = getattr(torch, TORCH_DTYPES[FP8_SOURCE_DTYPE if case.is_fp8 else case.q_dtype])
    if case.is_varlen:
        shapes = [(case.tokens_q, case.heads, case.head_dim),
                  (case.tokens_k, case.heads_kv, case.head_dim),
                  (case.tokens_k, case.heads_kv, case.head_dim)]
    else:
        shapes = [(case.batch, case.seqlen_q, case.heads, case.head_dim),
                  (case.batch, case.seqlen_k, case.heads_kv, case.head_dim),
                  (case.batch, case.seqlen_k, case.heads_kv, case.head_dim)]
    inputs = tuple(torch.randn(s, device=device, dtype=dtype, generator=generator)
                   for s in shapes)
    if case.is_fp8:
        return quantize_inputs(*inputs)
    if case.is_mixed:
        q, k, v = inputs
        return (q, *quantize_kv_cache(k, v, case.kv_dtype))
    return inputs


def _with_grad(inputs):
    return tuple(t.detach().requires_grad_(True) for t in inputs)


class CaseReferences:
    """What every backend of one case is checked against, each computed at most once: the
    forward's check.References up front, the gradients' check.GradReferences at the first
    backend whose backward is checked (a case without one never pays for them). Each is the
    object, a string saying why there is none, or None when checks are off. FP8 cases get
    check.Fp8References, mixed cases check.MixedReferences, varlen cases check.VarlenReferences,
    and none of them a gradient reference (no backward)."""

    def __init__(self, case, inputs, dout, check: str, max_scores: int | None = None):
        self.case, self.inputs, self.dout = case, inputs, dout
        self.max_scores = max_scores
        self.forward = None
        self._grads = None
        if check == "off":
            return
        references = (checks.Fp8References if case.is_fp8 else
                      checks.MixedReferences if case.is_mixed else
                      checks.VarlenReferences if case.is_varlen else checks.References)
        try:
            self.forward = references(*inputs, case, max_scores=max_scores)
        except Exception as exc:  # noqa: BLE001 - no reference (or OOM) must not stop timing
            self.forward = f"reference unavailable: {first_line(exc)}"

    def grads(self):
        if self.case.no_backward_reason and self.forward is not None:
            return f"no gradient reference: {self.case.no_backward_reason}"
        if self._grads is None and isinstance(self.forward, checks.References):
            try:
                self._grads = checks.GradReferences(*self.inputs, self.dout, self.case,
                                                    self.forward, max_scores=self.max_scores)
            except Exception as exc:  # noqa: BLE001 - as for the forward's
                self._grads = f"gradient reference unavailable: {first_line(exc)}"
        return self._grads if self._grads is not None else self.forward


def direction_fn(backend, inputs, case, direction: str) -> Callable[[], object]:
    """The callable to time for one direction.

    bwd re-runs only the backward of one recorded forward (retain_graph), fwd+bwd runs both;
    autograd.grad (not .backward) so no .grad accumulates and CUDA-graph capture stays legal.
    """
    import torch

    if direction == "fwd":
        return backend.make_forward(*inputs, case)
    leaves = _with_grad(inputs)
    forward = backend.make_forward(*leaves, case)
    out = forward()
    grad_out = torch.randn_like(out)
    if direction == "bwd":
        return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
    return lambda: torch.autograd.grad(forward(), leaves, grad_out)


class Runner:
    def __init__(self, backends, timer, options: RunOptions, progress=None):
        self.backends = list(backends)
        self.timer = timer
        self.options = options
        self.progress = progress
        self.rows: list[dict[str, object]] = []  # grows as the sweep runs: kept on interrupt

    def _step(self, message: str) -> None:
        if self.progress is not None:
            self.progress.step(message)

    def run(self, cases) -> list[dict[str, object]]:
        try:
            for case in cases:
                self.rows.extend(normalize(row) for row in self.run_case(case))
        finally:
            if self.progress is not None:
                self.progress.finish()
        return self.rows

    def run_case(self, case) -> list[dict[str, object]]:
        import torch

        generator = torch.Generator(device=self.options.device).manual_seed(self.options.seed)
        n_sets = self.timer.sets_for(case.input_bytes())
        inputs = [make_inputs(case, self.options.device, generator) for _ in range(n_sets)]
        dout = None
        if not case.no_backward_reason and any(has_backward(d) for d in self.options.directions):
            # One output gradient per case (drawn after the inputs, which stay as without it):
            # every backend's backward is checked and measured with it.
            q = inputs[0][0]
            dout = torch.randn(q.shape, dtype=q.dtype, device=q.device, generator=generator)
        references = CaseReferences(case, inputs[0], dout, self.options.check)
        rows: list[dict[str, object]] = []
        for backend in self.backends:
            rows.extend(self._run_backend(backend, case, inputs, references))
        del inputs, references, dout
        if self.options.device == "cuda":
            torch.cuda.empty_cache()
        return rows

    @staticmethod
    def _failure(backend, exc: BaseException, what: str) -> tuple[str, str]:
        """(status, reason) of a backend call that raised. Peers failing are unsupported configs;
        our own library failing is a bug, except when it says so itself (UnsupportedError)."""
        status = ("error" if backend.origin == "flash-hopper" and not is_unsupported(exc)
                  else "skipped")
        detail = str(exc) if isinstance(exc, SetupError) else first_line(exc)
        return status, f"{what}: {detail}"

    def _run_backend(self, backend, case, inputs, references):
        directions = list(self.options.directions)
        reason = fp8_skip_reason(backend, case) or backend.unsupported(case)
        if reason:
            return [self._skip(case, backend, d, reason) for d in directions]
        try:
            kernel, kernel_reason = backend.kernel(*inputs[0], case)
            result = self._first_call(backend, case, inputs[0], references.forward)
        except Exception as exc:  # noqa: BLE001 - one backend's failure must not end the sweep
            status, message = self._failure(backend, exc, "failed to run")
            return [self._skip(case, backend, d, message, status) for d in directions]
        rows = []
        backward = None  # _backward(): ("ok", check, memory, notes) or (status, reason), once
        for direction in directions:
            row = base_row(case, backend.name, direction)
            row.update({"kernel": kernel, "kernel_reason": kernel_reason})
            if isinstance(result, str):
                row["notes"] = result  # why there is no check
            else:
                fill_check(row, result)
            reason = ((case.no_backward_reason if has_backward(direction) else None)
                      or backend.unsupported(case, direction))
            if reason:
                row.update({"status": "skipped", "reason": reason})
                self._step(f"{backend.name} {direction} {self._label(case)}: skipped ({reason})")
                rows.append(row)
                continue
            if has_backward(direction):
                if backward is None:
                    backward = self._backward(backend, case, inputs[0], references)
                if not self._fill_backward(row, backward):
                    self._step(f"{backend.name} {direction} {self._label(case)}: "
                               f"{row['status']}")
                    rows.append(row)
                    continue
            self._time(row, backend, case, inputs, direction)
            rows.append(row)
        return rows

    def _backward(self, backend, case, inputs, references):
        """The gradient check and the memory of ``backend``'s backward on the case: ("ok",
        gradient check or None, memory, note), or (status, reason) when the backward cannot
        run."""
        check = note = None
        grad_refs = references.grads()
        if isinstance(grad_refs, str):
            note = grad_refs  # why there is no gradient check
        elif grad_refs is not None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the forward's first call reported them
                    grads = backend.run_checked_backward(*inputs, references.dout, case)
                check = grad_refs.check(grads)
                del grads
            except Exception as exc:  # noqa: BLE001 - the backward rows say why
                return self._failure(backend, exc, "backward failed to run")
        memory, memory_note = bwd_memory(backend, inputs, references.dout, case)
        return ("ok", check, memory, "; ".join(filter(None, [note, memory_note])) or None)

    @staticmethod
    def _fill_backward(row, backward) -> bool:
        """Write a backward row's check, memory and notes; False when its backward cannot run
        (the row then carries the status and reason)."""
        if backward[0] != "ok":
            row.update({"status": backward[0], "reason": backward[1]})
            return False
        _, check, memory, notes = backward
        fill_grad_check(row, check)
        row.update(memory)
        row["notes"] = "; ".join(filter(None, [row.get("notes"), notes])) or None
        return True

    def _first_call(self, backend, case, inputs, references):
        """Run once on the timed inputs (the check of what is timed when checks are on) and return
        a CheckResult, a string saying why there is none, or None. Warnings raised on the way
        (SDPA explains its kernel choice in warnings) become part of the error message."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if references is None:
                    backend.make_forward(*inputs, case)()
                    return None
                out, lse = backend.run_checked(*inputs, case)
            except Exception as exc:
                details = [str(w.message).strip().splitlines()[0] for w in caught if
                           str(w.message).strip()]
                raise SetupError(" | ".join([first_line(exc)] + details[:3])) from exc
        if isinstance(references, str):
            return references
        return references.check(out, lse)

    def _time(self, row, backend, case, inputs, direction: str) -> None:
        import torch

        try:
            with backend.timing_context(case):
                fns = [direction_fn(backend, s, case, direction) for s in inputs]
                stats = self.timer.measure(fns)
            fill_timing(row, stats, self.options)
            message = f"{row['tflops']:.1f} TFLOP/s"
        except torch.cuda.OutOfMemoryError:
            row.update({"status": "error", "reason": "out of memory"})
            message = "out of memory"
        except Exception as exc:  # noqa: BLE001 - recorded in the row; the sweep goes on
            row.update({"status": "error", "reason": first_line(exc)})
            message = "error"
        self._step(f"{backend.name} {direction} {self._label(case)}: {message}")

    def _skip(self, case, backend, direction, reason, status="skipped"):
        row = base_row(case, backend.name, direction)
        row.update({"status": status, "reason": reason})
        self._step(f"{backend.name} {direction} {self._label(case)}: {status}")
        return row

    @staticmethod
    def _label(case) -> str:
        return f"{case.dtype} d={case.head_dim} s={case.seqlen_label} {case.mask_label}"
