"""flash-hopper's own paths as benchmark backends: "fa3", "fa2", the fa3 ablation variants the
build reports, and "fa3-fp8-single-level", the FP8 accumulation ablation. The interface is
base.py's; peers.py holds the others and registry.py lists them all.

FP8 (e4m3) cases run on the FA-3 path only ("fa3", its variants, and the ablation), forward only:
flash_attn_func(q8, k8, v8, q_descale=, k_descale=, v_descale=), the output in bf16.
"fa3-fp8-single-level" is "fa3" with fp8_accumulation="single-level" (the tensor core's
accumulator carries the whole P V sum instead of adding each key block's product into fp32
registers): a backend of its own rather than an option, so that one sweep times both side by side
and each row names what ran; it takes e4m3 cases only.

Mixed-mode cases ("bf16+e4m3", "fp16+e5m2", ...: 16-bit q against an FP8 K / V cache) run on
"fa3" only, forward only: flash_attn_func(q, k8, v8, k_descale=, v_descale=), the output in q's
dtype. The host path refuses the mixed mode on the FA-2 path and on the FA-3 ablation variants
(even where build_info lists a variant for the kernel, it runs the tuned one only), so "fa2", the
variants and the FP8 accumulation ablation report it as unsupported (``mixed_reason``).

Varlen cases (packed q, k, v and the case's cu_seqlens, built on the device before timing) run on
"fa3" and "fa2", forward only: flash_attn_varlen_func(q, k, v, cu, cu, max_s, max_s, ...); the
ablation variants and the FP8 ablation are dense only (``varlen_reason``). The varlen call reads
its offsets back to the host to validate them (FLASH_HOPPER_CHECK_OFFSETS, read per call); the
checked call keeps that check, the timed calls run without it (``timing_context``), so the time
is the kernel's rather than a device-to-host round trip per call.
"""

from __future__ import annotations

import contextlib
import os

from .. import _env
from .base import Backend
from .cases import FP8_DTYPES, FP8_NO_BACKWARD, MIXED_NO_BACKWARD
from .errors import first_line

FP8_SINGLE_LEVEL = "fa3-fp8-single-level"
# flash_hopper._varlen reads it on every call: "0" skips the offsets' device-to-host check.
CHECK_OFFSETS_ENV = _env.CHECK_OFFSETS


@contextlib.contextmanager
def offsets_check_off():
    """FLASH_HOPPER_CHECK_OFFSETS=0 for the block, restored after it."""
    previous = os.environ.get(CHECK_OFFSETS_ENV)
    os.environ[CHECK_OFFSETS_ENV] = "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[CHECK_OFFSETS_ENV]
        else:
            os.environ[CHECK_OFFSETS_ENV] = previous


class FlashHopperBackend(Backend):
    """flash_hopper.flash_attn_func with a forced path: "fa3", "fa2" or an fa3 ablation variant.

    Variants are whatever build_info()["fa3_variants"] lists; each is passed verbatim as the
    `backend=` argument of flash_attn_func. ``fp8_accumulation``: None for flash_attn_func's
    default; set, the backend is an FP8 ablation that passes it and takes e4m3 cases only.
    """

    origin = "flash-hopper"

    def __init__(self, name: str, path: str, variant: bool = False,
                 fp8_accumulation: str | None = None):
        self.name = name
        self.label = name
        self.path = path
        self.variant = variant
        self.fp8_accumulation = fp8_accumulation
        if fp8_accumulation is not None:
            self.only_dtypes = FP8_DTYPES
        self.only_major = 9 if name.startswith("fa3") else None
        self._info: dict | None = None

    def build_info(self) -> dict:
        if self._info is None:
            import flash_hopper

            self._info = dict(flash_hopper.build_info())
        return self._info

    def software_reason(self) -> str | None:
        try:
            info = self.build_info()
        except Exception as exc:  # noqa: BLE001 - any load failure: unavailable, with its reason
            return f"flash-hopper library not loadable: {first_line(exc)}"
        archs = [str(a) for a in info.get("archs", ())]
        if self.variant:
            variants = variant_names(info)
            if self.name not in variants:
                return (f"not in this build's fa3_variants "
                        f"({', '.join(variants) if variants else 'none reported'})")
        wanted = "90" if self.name.startswith("fa3") else "80"
        if not any(arch_digits(a).startswith(wanted) for a in archs):
            return (f"library built without sm{wanted} kernels "
                    f"(archs: {', '.join(archs) or 'none'})")
        return None

    def version(self) -> str | None:
        if self.software_reason() is not None:
            return None
        info = self.build_info()
        commit = info.get("commit")
        return f"{info.get('version')}" + (f" ({commit})" if commit else "")

    def fp8_reason(self) -> str | None:
        if self.path == "fa2":
            return (f"the FA-2 path has no FP8 kernels (e4m3 runs on fa3, its variants and "
                    f"{FP8_SINGLE_LEVEL})")
        return None

    def mixed_reason(self) -> str | None:
        if self.path == "fa2":
            return "the FA-2 path has no mixed-mode kernels (the mixed mode runs on fa3)"
        if self.fp8_accumulation is not None:
            return (f"{self.name} is the FP8 accumulation ablation (e4m3 cases only); the mixed "
                    f"mode's GEMMs are 16-bit (it runs on fa3)")
        if self.variant:
            return (f"the FA-3 ablation variants ({self.name}) have no mixed-mode kernels: the "
                    f"mixed mode runs on the tuned fa3 kernel only")
        return None

    def varlen_reason(self) -> str | None:
        if self.fp8_accumulation is None and not self.variant:
            return None
        what = ("the FP8 accumulation ablation (e4m3 cases only)" if self.fp8_accumulation
                else "an FA-3 ablation variant, dense only")
        return f"{self.name} is {what}; flash_attn_varlen_func runs the tuned fa3 kernel and fa2"

    def timing_context(self, case):
        """Varlen: the offsets check off while timing (module docstring)."""
        return offsets_check_off() if case.is_varlen else contextlib.nullcontext()

    def unsupported(self, case, direction: str | None = None) -> str | None:
        varlen_reason = self.varlen_reason() if case.is_varlen else None
        if varlen_reason:
            return varlen_reason
        if self.only_dtypes is not None and case.dtype not in self.only_dtypes:
            return (f"FP8 accumulation ablation: {' / '.join(self.only_dtypes)} cases only, not "
                    f"{case.dtype}")
        info = self.build_info()
        dtypes = {str(d) for d in info.get("dtypes", ())}  # FH_DTYPES spelling: bf16, fp16, e4m3
        if dtypes and case.dtype not in dtypes:
            return f"library built without {case.dtype} (dtypes: {', '.join(sorted(dtypes))})"
        if case.is_fp8:
            fp8_reason = self._fp8_case_reason(info, case, direction)
            if fp8_reason:
                return fp8_reason
        if case.is_mixed:
            mixed_reason = self.mixed_reason() or self._mixed_case_reason(info, case, direction)
            if mixed_reason:
                return mixed_reason
        bucket_reason = self._head_dim_reason(info, case.head_dim)
        if bucket_reason:
            return bucket_reason
        if direction and "bwd" in direction:
            return self._backward_reason(info, case)
        return None

    def _fp8_case_reason(self, info: dict, case, direction: str | None) -> str | None:
        """Why this build cannot run the FP8 forward of ``case`` on this path, or None: the
        direction (no backward), the head-dim rule, and build_info's exact kernel list (FP8
        kernels cover fewer head dims than bf16 ones, so the head_dims union does not say)."""
        from flash_hopper import _tables

        if direction and "bwd" in direction:
            return FP8_NO_BACKWARD
        multiple = _tables.FP8_HEAD_DIM_MULTIPLE
        if case.head_dim % multiple:
            return f"FP8 needs head_dim a multiple of {multiple}, got {case.head_dim}"
        if (self.fp8_accumulation == "single-level"
                and case.head_dim > _tables.FP8_SINGLE_LEVEL_MAX_HEAD_DIM):
            return (f"the single-level ablation exists for head_dim <= "
                    f"{_tables.FP8_SINGLE_LEVEL_MAX_HEAD_DIM} (the d192 / d256 FP8 kernels "
                    f"accumulate in two levels only), got {case.head_dim}")
        try:
            bucket = _tables.head_dim_bucket(case.head_dim)
        except ValueError:  # d > 256: the call itself says why
            return None
        built = _fa3_forward_kernels(info, case.dtype, bucket)
        if built is None:  # no exact list (an old library): the coarse checks decide
            return None
        if not built:
            return (f"library built without an fa3 {case.dtype} forward kernel for head-dim "
                    f"bucket {bucket}")
        variant = (info.get("variants") or {}).get(self.path)
        if variant is not None and all("variants" in e and variant not in e["variants"]
                                       for e in built):
            return (f"library built without the {self.path} variant of the fa3 {case.dtype} "
                    f"kernel for head-dim bucket {bucket}")
        return None

    @staticmethod
    def _mixed_case_reason(info: dict, case, direction: str | None) -> str | None:
        """Why this build cannot run the mixed-mode forward of ``case`` on the fa3 path, or None:
        the direction (no backward), the head-dim rule (a multiple of 16 in the mixed mode's
        buckets) and build_info's exact kernel list."""
        from flash_hopper import _tables

        if direction and "bwd" in direction:
            return MIXED_NO_BACKWARD
        multiple = _tables.FP8_HEAD_DIM_MULTIPLE
        if case.head_dim % multiple:
            return (f"the mixed mode needs head_dim a multiple of {multiple} (16-byte rows of "
                    f"FP8 K / V), got {case.head_dim}")
        try:
            bucket = _tables.head_dim_bucket(case.head_dim)
        except ValueError:  # d > 256: the call itself says why
            return None
        buckets = _tables.MIXED_HEAD_DIM_BUCKETS
        if bucket not in buckets:
            return (f"the mixed mode has kernels for head-dim buckets "
                    f"{', '.join(map(str, buckets))}, got d={case.head_dim} (bucket {bucket})")
        if _fa3_forward_kernels(info, case.dtype, bucket) == []:
            return (f"library built without an fa3 {case.dtype} forward kernel for head-dim "
                    f"bucket {bucket}")
        return None

    def _backward_reason(self, info: dict, case) -> str | None:
        """Why this build cannot run the backward of ``case`` on this path, or None. Libraries
        before ABI 3 have no "backward" key (no backward); the FA-3 ablation variants train with
        the tuned FA-3 backward, so they need its kernel."""
        from flash_hopper import _tables

        if not _tables.has_backward(info):
            return "library built without backward kernels (build_info backward: false)"
        path = "fa3" if self.name.startswith("fa3") else "fa2"
        try:
            bucket = _tables.head_dim_bucket(case.head_dim)
        except ValueError:  # d > 256: the call itself says why
            return None
        built = {(k.get("backend"), k.get("dtype"), k.get("head_dim"))
                 for k in _tables.kernel_entries(info, "bwd")}
        if (path, case.dtype, bucket) not in built:
            return (f"library built without a {path} backward kernel for {case.dtype} head-dim "
                    f"bucket {bucket}")
        return None

    @staticmethod
    def _head_dim_reason(info: dict, head_dim: int) -> str | None:
        built = [int(d) for d in info.get("head_dims", ())]
        if not built:
            return None
        from flash_hopper.dispatch import head_dim_bucket

        try:
            bucket = head_dim_bucket(head_dim)
        except ValueError:  # d > 256: the call itself says why
            return None
        if bucket not in built:
            return (f"library built without head-dim bucket {bucket} for d={head_dim} "
                    f"(built: {', '.join(map(str, built))})")
        return None

    def _call_kwargs(self, case) -> dict:
        return {"causal": case.causal, "window_size": tuple(case.window),
                "softcap": case.softcap, "backend": self.path}

    def _fp8_call(self, q, k, v, case) -> tuple[tuple, dict]:
        """flash_attn_func's (args, kwargs) for Fp8Input q, k, v: the FP8 data, the descales and
        the accumulation mode (when this backend sets one). Mixed cases: q as it is, k and v's
        FP8 data and their descales."""
        if case.is_mixed:
            kwargs = dict(self._call_kwargs(case), k_descale=k.descale, v_descale=v.descale)
            return (q, k.data, v.data), kwargs
        kwargs = dict(self._call_kwargs(case), q_descale=q.descale, k_descale=k.descale,
                      v_descale=v.descale)
        if self.fp8_accumulation is not None:
            kwargs["fp8_accumulation"] = self.fp8_accumulation
        return (q.data, k.data, v.data), kwargs

    @staticmethod
    def _offsets(q, case):
        """(cu_seqlens, max_seqlen) of a varlen case: int32 offsets on q's device (for q and k:
        self-attention)."""
        import torch

        return torch.tensor(case.cu_seqlens(), dtype=torch.int32, device=q.device), case.seqlen_q

    def make_forward(self, q, k, v, case):
        from flash_hopper import flash_attn_func, flash_attn_varlen_func

        if case.is_varlen:
            cu, longest = self._offsets(q, case)
            kwargs = self._call_kwargs(case)
            return lambda: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, **kwargs)
        if case.is_fp8 or case.is_mixed:
            args, kwargs = self._fp8_call(q, k, v, case)
            return lambda: flash_attn_func(*args, **kwargs)
        kwargs = self._call_kwargs(case)
        return lambda: flash_attn_func(q, k, v, **kwargs)

    @staticmethod
    def _scalars(q, case) -> tuple[float, int, int, float]:
        """(softmax_scale, window_left, window_right, softcap) of the ops-level entry points, as
        flash_attn_func derives them for the timed call."""
        import math

        from flash_hopper.mask import AttentionMask

        mask = AttentionMask.from_args(case.seqlen_q, case.seqlen_k, case.causal, case.window)
        return 1.0 / math.sqrt(q.shape[3]), mask.window_left, mask.window_right, case.softcap

    def run_checked(self, q, k, v, case):
        """The timed call's kernel through ops.fwd_into, into NaN-filled buffers (an element the
        kernel does not write fails the check). flash_attn_func (what is timed) and fwd_into run
        the same dispatch and launch; the path that ran must be the one asked for. FP8 and mixed
        cases: ``_run_checked_fp8``; varlen cases: ``_run_checked_varlen``."""
        import torch

        from flash_hopper import ops

        if case.is_varlen:
            return self._run_checked_varlen(q, k, v, case)
        if case.is_fp8 or case.is_mixed:
            return self._run_checked_fp8(q, k, v, case)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=torch.float32,
                         device=q.device)
        ran = ops.fwd_into(q, k, v, out, lse, *self._scalars(q, case), self.path)
        if ran != self.path:
            raise RuntimeError(f"the check ran path {ran!r}, but {self.path!r} is timed")
        return out, lse

    def _run_checked_fp8(self, q, k, v, case):
        """The timed FP8 or mixed-mode call itself (there is no fwd_into for them: no caller
        buffers), with its LSE, in NaN-filled blocks (``in_nan_blocks``)."""
        from flash_hopper import flash_attn_func

        args, kwargs = self._fp8_call(q, k, v, case)
        return in_nan_blocks(lambda: flash_attn_func(*args, return_attn_probs=True, **kwargs),
                             case.dtype)

    def _run_checked_varlen(self, q, k, v, case):
        """The timed varlen call with its LSE (heads, total), the output written into a
        NaN-filled ``out=`` and the LSE in a NaN-filled block (``in_nan_blocks``). The offsets
        check stays on here: the checked call also validates the offsets that are timed."""
        import torch

        from flash_hopper import flash_attn_varlen_func

        cu, longest = self._offsets(q, case)
        out = torch.full_like(q, float("nan"))
        kwargs = dict(self._call_kwargs(case), return_attn_probs=True, out=out)
        return in_nan_blocks(
            lambda: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, **kwargs),
            "varlen")

    @property
    def bwd_path(self) -> str:
        """The backward that trains this path: the ablation variants use the tuned FA-3 one."""
        return "fa2" if self.path == "fa2" else "fa3"

    def run_checked_backward(self, q, k, v, dout, case):
        """The checked forward (run_checked), then ops.bwd_into on its out and LSE into
        NaN-filled dq, dk, dv. The timed backward (autograd of flash_attn_func) runs the same
        host path on the same forward outputs; the path that ran must be the one timed."""
        import torch

        from flash_hopper import ops

        out, lse = self.run_checked(q, k, v, case)
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        ran = ops.bwd_into(dout, q, k, v, out, lse, dq, dk, dv, *self._scalars(q, case),
                           backend=self.path)
        if ran != self.bwd_path:
            raise RuntimeError(f"the gradient check ran backward path {ran!r}, but "
                               f"{self.bwd_path!r} is timed")
        return dq, dk, dv

    def bwd_workspace_bytes(self, q, k, v, case) -> int:
        """fh_bwd_workspace_size for the timed backward (the fp32 dQ accumulator, dK / dV
        accumulators under GQA, the D and LSE rows), through the host path's own plan: metadata
        only, nothing is launched."""
        import torch

        from flash_hopper import _bwd, _validate

        out = torch.empty_like(q)  # stands in for the forward's output and for dout
        lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32,
                          device=q.device)
        cfg = _validate.check_bwd_args(out, q, k, v, out, lse, None, *self._scalars(q, case),
                                       self.path, False)
        return _bwd.make_plan(cfg, out, q, k, v, out, lse, None).workspace_bytes

    def kernel(self, q, k, v, case) -> tuple[str, str]:
        from flash_hopper import which_backend

        if case.is_varlen:
            return self._varlen_kernel(q, k, v, case)
        if case.is_fp8 or case.is_mixed:
            return self._fp8_kernel(q, k, v, case)
        name, reason = which_backend(q, k, v, **self._call_kwargs(case))
        return str(name), str(reason)

    def _fp8_kernel(self, q, k, v, case) -> tuple[str, str]:
        """(kernel, why) of an FP8 or mixed-mode call: which_backend takes no descales, so the
        host path's own validation and plan are asked (metadata only, as for
        bwd_workspace_bytes)."""
        from flash_hopper import _fwd, _validate

        accumulation = self.fp8_accumulation or "two-level"
        args, kwargs = self._fp8_call(q, k, v, case)
        cfg, fp8 = _validate.check_fp8_args(
            *args, None, case.causal, tuple(case.window), case.softcap, self.path,
            kwargs.get("q_descale"), kwargs["k_descale"], kwargs["v_descale"], None, accumulation)
        plan = _fwd.make_plan(cfg, *args, fp8=fp8)
        if case.is_mixed:
            what = f"mixed mode: {case.q_dtype} q, {case.kv_dtype} K / V, 16-bit GEMMs"
        else:
            what = f"FP8 e4m3, {accumulation} accumulation"
        return str(plan.backend), f"{plan.reason}; {what}"

    def _varlen_kernel(self, q, k, v, case) -> tuple[str, str]:
        """(kernel, why) of a varlen call: its plan's (the (1, total) view's), metadata only."""
        from flash_hopper import _varlen

        cu, longest = self._offsets(q, case)
        plan = _varlen.plan(q, k, v, cu, cu, longest, longest, None, None, None, case.causal,
                            tuple(case.window), case.softcap, self.path)
        why = f"{plan.dense.reason}; flash_attn_varlen_func, {case.batch} sequences"
        return str(plan.dense.backend), why


def in_nan_blocks(call, what: str):
    """``call()`` -> (out, lse), run so that both come back in blocks that held NaN: the first
    call finds the blocks the caching allocator gives it (or the out= it was given); they are
    NaN-filled and freed, and the second call gets the same ones back: freeing them restores the
    pool the first call saw, and the call allocates the same sizes in the same order on the same
    stream. Checked by address, so an element the kernel does not write fails the check (it
    cannot pass on another backend's freed output, as a plain fresh allocation could)."""
    import math

    out, lse = call()
    addresses = (out.data_ptr(), lse.data_ptr())
    out.fill_(math.nan)
    lse.fill_(math.nan)
    del out, lse
    out, lse = call()
    if out.is_cuda and (out.data_ptr(), lse.data_ptr()) != addresses:
        raise RuntimeError(f"the {what} check could not run in NaN-filled buffers: the caching "
                           "allocator gave the second call other blocks (use --check off)")
    return out, lse


def _fa3_forward_kernels(info: dict, dtype: str, bucket: int) -> list[dict] | None:
    """build_info's fa3 forward kernel entries of ``dtype`` at head-dim ``bucket``; None when the
    build lists no kernels (an old library: coarse checks only)."""
    from flash_hopper import _tables

    entries = _tables.kernel_entries(info, "fwd")
    if not entries:
        return None
    return [e for e in entries
            if (e.get("backend"), e.get("dtype"), e.get("head_dim")) == ("fa3", dtype, bucket)]


def arch_digits(arch: str) -> str:
    """'sm90a' / 'sm_90a' / '90a' -> '90a': build_info spellings vary, the digits do not."""
    return str(arch).lower().replace("sm_", "").replace("sm", "")


def variant_names(info: dict) -> list[str]:
    """fa3 ablation variants reported by the build (build_info()["fa3_variants"])."""
    return [str(v) for v in info.get("fa3_variants") or ()]
