"""The forward as a torch custom op, on top of the C ABI.

- ``fwd_into`` validates, picks the backend (dispatch.py's policy on the real device and build)
  and launches into caller-provided buffers. Tests call it directly to poison outputs with NaN.
- ``flash_hopper::fwd`` (``fwd``) is the ``torch.library.custom_op`` that flash_attn_func calls:
  opaque to torch.compile (no graph break, no tracing into ctypes), with a fake implementation
  for shape propagation and an autograd registration that refuses backward loudly.
"""

from __future__ import annotations

import torch

from . import _device, _lib, _validate, dispatch
from ._lib import FhBackend, FhDtype, FhFwdParams, FhVariant

_DTYPES = {torch.float16: ("fp16", FhDtype.FP16), torch.bfloat16: ("bf16", FhDtype.BF16)}
_BACKEND_ENUM = {"auto": FhBackend.AUTO, "fa2": FhBackend.FA2, "fa3": FhBackend.FA3}


def dtype_name(dtype: torch.dtype) -> str:
    """'fp16' / 'bf16', the names of FH_DTYPES and of build_info()['dtypes']."""
    return _DTYPES[dtype][0]


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def resolve_backend(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    requested: str,
    fa3_layout_problem: str | None = None,
) -> tuple[str, str]:
    """(backend, reason) that serves (dtype, head_dim) on ``device`` with the loaded library.

    ``fa3_layout_problem``: ``_validate.tma_layout_problem`` of the call's q/k/v.
    """
    lib = _lib.get_library()
    info = _device.device_info(_device_index(device))
    enum_dtype = _DTYPES[dtype][1]

    def built(backend: str, _dtype: str, bucket: int) -> bool:
        return lib.has_fwd_kernel(_BACKEND_ENUM[backend], enum_dtype, bucket)

    return dispatch.select_backend(
        requested, info.capability, built, dtype_name(dtype), head_dim, fa3_layout_problem
    )


def make_params(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    cfg: _validate.FwdConfig,
    backend: str,
    num_sms: int = 0,
) -> FhFwdParams:
    """FhFwdParams for validated tensors (strides in elements; head_dim stride 1 not stored)."""
    p = FhFwdParams()
    p.abi_version = _lib.ABI_VERSION
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    p.lse = lse.data_ptr() if lse is not None else None
    p.dtype = p.out_dtype = _DTYPES[q.dtype][1]
    p.batch, p.seqlen_q, p.seqlen_k = cfg.batch, cfg.seqlen_q, cfg.seqlen_k
    p.heads_q, p.heads_kv = cfg.heads_q, cfg.heads_kv
    p.head_dim = p.head_dim_v = cfg.head_dim
    for prefix, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        batch_stride, row_stride, head_stride, _ = _validate.effective_strides(t)
        setattr(p, f"{prefix}_batch_stride", batch_stride)
        setattr(p, f"{prefix}_row_stride", row_stride)
        setattr(p, f"{prefix}_head_stride", head_stride)
    if lse is not None:
        p.lse_batch_stride, p.lse_head_stride, _ = _validate.effective_strides(lse)
    p.softmax_scale = cfg.softmax_scale
    p.softcap = cfg.softcap
    p.window_left, p.window_right = cfg.window_left, cfg.window_right
    p.num_splits = 1
    p.backend = _BACKEND_ENUM["fa3" if backend in dispatch.FA3_VARIANTS else backend]
    p.variant = dispatch.FA3_VARIANTS.get(backend, FhVariant.TUNED)
    p.num_sms = num_sms
    return p


def fwd_into(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    backend: str = "auto",
    num_sms: int = 0,
) -> str:
    """Run the forward into ``out`` (like q) and ``lse`` (fp32 (b, hq, sq), or None).

    ``num_sms`` > 0 caps the FA-3 path's persistent grid at that many CTAs (tests use 1 to run
    many tiles per CTA); 0 uses every SM.

    Returns the backend that ran ("fa2"/"fa3"), or "none" when there was nothing to compute
    (batch == 0 or seqlen_q == 0). seqlen_k == 0 does launch: the kernel writes out = 0 and
    lse = -inf. The launch is on torch's current stream of q's device.
    """
    cfg = _validate.check_op_args(
        q, k, v, softmax_scale, window_left, window_right, softcap, backend
    )
    _validate.check_outputs(out, lse, q, cfg)
    _validate.check_alignment(q=q, k=k, v=v, out=out, lse=lse)
    return _launch(q, k, v, out, lse, cfg, num_sms)


def _launch(q, k, v, out, lse, cfg: _validate.FwdConfig, num_sms: int = 0) -> str:
    """fwd_into after validation (same arguments): pick the backend, fill the params, launch."""
    if cfg.batch == 0 or cfg.seqlen_q == 0:
        return "none"
    name, _reason = resolve_backend(
        q.device, q.dtype, cfg.head_dim, cfg.backend, _validate.tma_layout_problem(q=q, k=k, v=v)
    )
    index = _device_index(q.device)
    if num_sms <= 0:
        num_sms = _device.device_info(index).sm_count
    params = make_params(q, k, v, out, lse, cfg, name, num_sms=num_sms)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    if index == torch.cuda.current_device():
        _lib.get_library().fwd(params, stream)
    else:  # the runtime launches on the current device: make it q's
        with torch.cuda.device(index):
            _lib.get_library().fwd(params, stream)
    return name


# The schema is spelled out rather than inferred from annotations: it is the op's contract, and it
# does not depend on how a given torch version evaluates postponed (string) annotations.
FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, float softmax_scale, int window_left, int window_right, "
    "float softcap, str backend) -> (Tensor, Tensor)"
)


def fwd_eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): out (b, sq, hq, d) in q's dtype, lse fp32 (b, hq, sq), both contiguous.

    Empty outputs (batch == 0 or seqlen_q == 0) come back without a launch (fwd_into's rule).
    This is the ``flash_hopper::fwd`` op's implementation. In eager mode with no input requiring
    grad, flash_attn_func skips the custom-op dispatch (~100 us of host time per call, as much as
    a short-sequence kernel) and calls fwd_validated with the arguments it already validated.
    """
    cfg = _validate.check_op_args(
        q, k, v, softmax_scale, window_left, window_right, softcap, backend
    )
    return fwd_validated(q, k, v, cfg)


def fwd_validated(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: _validate.FwdConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """fwd_eager for q, k, v that ``cfg`` was validated from (check_fwd_args / check_op_args):
    flash_attn_func's eager path, which would otherwise validate a second time (~20 us)."""
    _validate.check_alignment(q=q, k=k, v=v)
    batch, seqlen_q, heads_q, _ = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    _launch(q, k, v, out, lse, cfg)
    return out, lse


# The custom op wraps the same function: torch.compile, make_fx, fake tensors and autograd see it.
fwd = torch.library.custom_op("flash_hopper::fwd", mutates_args=(), schema=FWD_SCHEMA)(fwd_eager)


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, window_left, window_right, softcap, backend):
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, v.shape[-1]))
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


def _fwd_backward(ctx, grad_out, grad_lse):
    raise NotImplementedError(
        "flash_hopper::fwd: backward lands in a later issue (the FA-2/FA-3 backward kernels); "
        "until then flash_attn_func is forward-only: call it under torch.no_grad() or on "
        "tensors that do not require grad"
    )


fwd.register_autograd(_fwd_backward)
