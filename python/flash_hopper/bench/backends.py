"""flash-hopper's own paths as benchmark backends: "fa3", "fa2" and the fa3 ablation variants the
build reports. The interface is base.py's; peers.py holds the others and registry.py lists them all.
"""

from __future__ import annotations

from .base import Backend
from .errors import first_line


class FlashHopperBackend(Backend):
    """flash_hopper.flash_attn_func with a forced path: "fa3", "fa2" or an fa3 ablation variant.

    Variants are whatever build_info()["fa3_variants"] lists; each is passed verbatim as the
    `backend=` argument of flash_attn_func.
    """

    origin = "flash-hopper"

    def __init__(self, name: str, path: str, variant: bool = False):
        self.name = name
        self.label = name
        self.path = path
        self.variant = variant
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

    def unsupported(self, case, direction: str | None = None) -> str | None:
        info = self.build_info()
        dtypes = {str(d) for d in info.get("dtypes", ())}  # FH_DTYPES spelling: bf16, fp16
        if dtypes and case.dtype not in dtypes:
            return f"library built without {case.dtype} (dtypes: {', '.join(sorted(dtypes))})"
        bucket_reason = self._head_dim_reason(info, case.head_dim)
        if bucket_reason:
            return bucket_reason
        if direction and "bwd" in direction:
            return self._backward_reason(info, case)
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

    def make_forward(self, q, k, v, case):
        from flash_hopper import flash_attn_func

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
        the same dispatch and launch; the path that ran must be the one asked for."""
        import torch

        from flash_hopper import ops

        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), dtype=torch.float32,
                         device=q.device)
        ran = ops.fwd_into(q, k, v, out, lse, *self._scalars(q, case), self.path)
        if ran != self.path:
            raise RuntimeError(f"the check ran path {ran!r}, but {self.path!r} is timed")
        return out, lse

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

        name, reason = which_backend(q, k, v, **self._call_kwargs(case))
        return str(name), str(reason)


def arch_digits(arch: str) -> str:
    """'sm90a' / 'sm_90a' / '90a' -> '90a': build_info spellings vary, the digits do not."""
    return str(arch).lower().replace("sm_", "").replace("sm", "")


def variant_names(info: dict) -> list[str]:
    """fa3 ablation variants reported by the build (build_info()["fa3_variants"])."""
    return [str(v) for v in info.get("fa3_variants") or ()]
