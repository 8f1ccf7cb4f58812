"""Forward and backward as torch custom ops, and the lower-level entry points tests and
benchmarks use.

- ``flash_hopper::fwd`` (``fwd``) is the ``torch.library.custom_op`` that flash_attn_func calls
  whenever torch needs to see the op (torch.compile, make_fx, FakeTensors): opaque to
  torch.compile (no graph break, no tracing into ctypes), with a fake implementation for shape
  propagation. Its real implementation is the host path's ``_fwd.op``. Its registered autograd
  saves q, k, v, out and lse and calls ``flash_hopper::bwd``, so compiled training graphs hold
  both ops.
- ``flash_hopper::bwd`` (``bwd``): dq, dk, dv by recomputation from the LSE; implementation
  ``_bwd.op``. It has no derivative of its own: a double backward raises, naming the op.
- ``flash_hopper::fwd_fp8`` (``fwd_fp8``): the FP8 (e4m3) forward with its descales, for
  inference (no autograd); implementation ``_fwd.fp8_op``.
- ``fwd_into`` / ``bwd_into`` launch into caller-provided buffers (tests poison them with NaN
  first).
- ``make_params`` fills the C ABI struct for validated tensors (tests and bench/ab_libs.py call
  the library with it directly).
"""

from __future__ import annotations

import torch

from . import _bwd, _fwd, _validate, _varlen
from ._abi import FhFwdParams


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


def bwd_into(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    backend: str = "auto",
    deterministic: bool = False,
    dlse: torch.Tensor | None = None,
    num_sms: int = 0,
) -> str:
    """Run the backward into ``dq``, ``dk``, ``dv`` (like q, k, v; written, never read).

    ``out`` and ``lse`` are the forward's (lse fp32 (b, hq, sq)); ``dlse`` the gradient of the
    lse or None for 0; ``deterministic`` makes dq bitwise reproducible; ``num_sms`` > 0 caps the
    persistent grid (tests use it to run many tiles per CTA), 0 uses every SM.

    Returns the backend that ran ("fa2", "fa3"), or "none" when batch == 0. seqlen_q == 0
    launches and writes dk = dv = 0, seqlen_k == 0 writes dq = 0. The launch is on torch's
    current stream of q's device; the workspace comes from torch's caching allocator.
    """
    return _bwd.into(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, window_left,
                     window_right, softcap, backend, deterministic, dlse, num_sms)


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


# The schemas are spelled out rather than inferred from annotations: they are the ops' contract,
# and they do not depend on how a given torch version evaluates postponed (string) annotations.
# ``deterministic`` changes only the backward; the forward op carries it so that its registered
# autograd, which sees only the op's inputs, can pass it on.
# ``sm_margin`` (FA3's: SMs the persistent kernels leave free) likewise reaches the backward.
FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, float softmax_scale, int window_left, int window_right, "
    "float softcap, str backend, bool deterministic, int sm_margin=0) -> (Tensor, Tensor)"
)
BWD_SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
    "float softmax_scale, int window_left, int window_right, float softcap, str backend, "
    "bool deterministic, int sm_margin=0) -> (Tensor, Tensor, Tensor)"
)

# The FP8 forward (inference: no autograd registered; flash_attn_func refuses FP8 inputs that
# require grad). out_dtype is bf16 or fp16; two_level selects the accumulation (fwd_params.h).
FWD_FP8_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? q_descale, Tensor? k_descale, Tensor? v_descale, "
    "float softmax_scale, int window_left, int window_right, float softcap, str backend, "
    "ScalarType out_dtype, bool two_level) -> (Tensor, Tensor)"
)

# torch.compile, make_fx, fake tensors and autograd see the ops; their implementations are the
# host paths' (validation cached per call signature, like the eager path).
fwd = torch.library.custom_op("flash_hopper::fwd", mutates_args=(), schema=FWD_SCHEMA)(_fwd.op)
bwd = torch.library.custom_op("flash_hopper::bwd", mutates_args=(), schema=BWD_SCHEMA)(_bwd.op)
fwd_fp8 = torch.library.custom_op("flash_hopper::fwd_fp8", mutates_args=(),
                                  schema=FWD_FP8_SCHEMA)(_fwd.fp8_op)


@fwd_fp8.register_fake
def _fwd_fp8_fake(q, k, v, q_descale, k_descale, v_descale, softmax_scale, window_left,
                  window_right, softcap, backend, out_dtype, two_level):
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, v.shape[-1]), dtype=out_dtype)
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, window_left, window_right, softcap, backend, deterministic,
              sm_margin=0):
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty((batch, seqlen_q, heads_q, v.shape[-1]))
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dlse, softmax_scale, window_left, window_right, softcap,
              backend, deterministic, sm_margin=0):
    # Fresh contiguous gradients shaped like their inputs, whatever the inputs' layouts.
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _fwd_setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, window_left, window_right, softcap, backend, deterministic,
     sm_margin) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.bwd_args = (softmax_scale, window_left, window_right, softcap, backend, deterministic,
                    sm_margin)
    # A gradient of None (not zeros) for an output the loss does not use: the lse usually.
    ctx.set_materialize_grads(False)


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dout, dlse = loadable_grads(out, dout, dlse)
    dq, dk, dv = bwd(dout, q, k, v, out, lse, dlse, *ctx.bwd_args)
    return dq, dk, dv, None, None, None, None, None, None, None


def loadable_grads(out: torch.Tensor, dout: torch.Tensor | None,
                   dlse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output gradients autograd hands the backward, as the bwd op takes them: a dout of
    None (only the lse was used) becomes zeros; a dlse that is not contiguous (``lse.sum()``
    gives a broadcast) is made so. dout's layout is the host path's business (_bwd.py)."""
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is not None and not dlse.is_contiguous():
        dlse = dlse.contiguous()
    return dout, dlse


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def _bwd_backward(ctx, grad_dq, grad_dk, grad_dv):
    raise NotImplementedError(
        "flash_hopper::bwd: double backward (a gradient of the attention backward, e.g. "
        "torch.autograd.grad(..., create_graph=True) followed by another backward) is not "
        "supported"
    )


bwd.register_autograd(_bwd_backward)


# --- varlen (flash_attn_varlen_func under torch.compile) ---------------------------------------
# The forward's implementation is _varlen.forward (the offsets' values checked on the host
# outside graph capture); the backward runs per sequence through the dense backward kernels
# (_varlen.backward), an op of its own so that compiled graphs keep it opaque.
FWD_VARLEN_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "Tensor? seqused_q, Tensor? seqused_k, int max_seqlen_q, int max_seqlen_k, "
    "float softmax_scale, int window_left, int window_right, float softcap, str backend, "
    "bool deterministic, int sm_margin=0) -> (Tensor, Tensor)"
)
BWD_VARLEN_SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_q, Tensor? seqused_k, "
    "float softmax_scale, int window_left, int window_right, float softcap, str backend, "
    "bool deterministic, int sm_margin=0, int max_seqlen_q=0, int max_seqlen_k=0) -> "
    "(Tensor, Tensor, Tensor)"
)


def _fwd_varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, window_left, window_right, softcap, backend,
                     deterministic, sm_margin=0):
    out, lse, _ = _varlen.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, seqused_q, seqused_k, softmax_scale, False,
                                  (window_left, window_right), softcap, backend,
                                  sm_margin=sm_margin)
    return out, lse


fwd_varlen = torch.library.custom_op("flash_hopper::fwd_varlen", mutates_args=(),
                                     schema=FWD_VARLEN_SCHEMA)(_fwd_varlen_impl)
bwd_varlen = torch.library.custom_op("flash_hopper::bwd_varlen", mutates_args=(),
                                     schema=BWD_VARLEN_SCHEMA)(_varlen.backward)


@fwd_varlen.register_fake
def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, window_left, window_right, softcap, backend,
                     deterministic, sm_margin=0):
    total_q, heads_q, _ = q.shape
    out = q.new_empty((total_q, heads_q, v.shape[-1]))
    lse = q.new_empty((heads_q, total_q), dtype=torch.float32)
    return out, lse


@bwd_varlen.register_fake
def _bwd_varlen_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                     seqused_k, softmax_scale, window_left, window_right, softcap, backend,
                     deterministic, sm_margin=0, max_seqlen_q=0, max_seqlen_k=0):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _fwd_varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, used_q, used_k, max_seqlen_q, max_seqlen_k, softmax_scale,
     window_left, window_right, softcap, backend, deterministic, sm_margin) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, used_q, used_k)
    # The backward's bounds of the sequences' lengths: the caller's max_seqlen (FA3's contract)
    ctx.bwd_args = (softmax_scale, window_left, window_right, softcap, backend, deterministic,
                    sm_margin, max_seqlen_q, max_seqlen_k)
    ctx.set_materialize_grads(False)


def _fwd_varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
    dout, dlse = loadable_grads(out, dout, dlse)
    dq, dk, dv = bwd_varlen(dout, q, k, v, out, lse, dlse, cu_q, cu_k, used_q, used_k,
                            *ctx.bwd_args)
    return (dq, dk, dv) + (None,) * 13


fwd_varlen.register_autograd(_fwd_varlen_backward, setup_context=_fwd_varlen_setup_context)
bwd_varlen.register_autograd(_bwd_backward)
