"""The forward as a torch custom op, and the lower-level entry points tests and benchmarks use.

- ``flash_hopper::fwd`` (``fwd``) is the ``torch.library.custom_op`` that flash_attn_func calls
  whenever torch needs to see the op (torch.compile, make_fx, FakeTensors, autograd): opaque to
  torch.compile (no graph break, no tracing into ctypes), with a fake implementation for shape
  propagation and an autograd registration that refuses backward loudly. Its real implementation
  is the host path's ``_fwd.op``.
- ``fwd_into`` launches into caller-provided buffers (tests poison them with NaN first).
- ``make_params`` fills the C ABI struct for validated tensors (tests and bench/ab_libs.py call
  the library with it directly).
"""

from __future__ import annotations

import torch

from . import _fwd, _validate
from ._lib import FhFwdParams


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

    Returns the backend that ran ("fa2", "fa3" or the requested FA-3 variant), or "none" when
    there was nothing to compute (batch == 0 or seqlen_q == 0). seqlen_k == 0 does launch: the
    kernel writes out = 0 and lse = -inf. The launch is on torch's current stream of q's device.
    """
    return _fwd.into(q, k, v, out, lse, softmax_scale, window_left, window_right, softcap,
                     backend, num_sms)


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
    """FhFwdParams for tensors ``cfg`` was validated from, data pointers included, ``backend``
    as requested ("auto" leaves the choice to fh_fwd)."""
    effective = _validate.effective_strides
    p = _fwd.fill_params(
        cfg, effective(q), effective(k), effective(v), effective(out),
        effective(lse) if lse is not None else None, backend, num_sms,
    )
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    p.lse = lse.data_ptr() if lse is not None else None
    return p


# The schema is spelled out rather than inferred from annotations: it is the op's contract, and it
# does not depend on how a given torch version evaluates postponed (string) annotations.
FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, float softmax_scale, int window_left, int window_right, "
    "float softcap, str backend) -> (Tensor, Tensor)"
)

# torch.compile, make_fx, fake tensors and autograd see the op; its implementation is the host
# path's (validation cached per call signature, like the eager path).
fwd = torch.library.custom_op("flash_hopper::fwd", mutates_args=(), schema=FWD_SCHEMA)(_fwd.op)


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
