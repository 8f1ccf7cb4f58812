"""Plain eager training: flash_attn_func as a torch.autograd.Function over the host paths.

Why not the custom ops' registered autograd: a custom op call costs a dispatcher round trip and
its Python wrapper (about half of a small forward's host time in the forward's history, PERFLOG
FA-2 v3); in plain eager mode nothing needs to see the op, so this Function calls the forward's
plan cache (``_fwd.plan_eager``: flash_attn_func's own arguments, validated once per signature)
and ``_bwd.op`` directly. Anything traced (torch.compile, make_fx, FakeTensors, dispatch modes)
goes through ``ops.fwd`` instead, whose registered autograd does the same through
``flash_hopper::bwd``.

The backward runs the backend the forward was asked for: "auto" asks the backward's policy
again (the FA-3 path on cc 9.0 where this build has the bucket's FA-3 backward kernel and the
tensors load with TMA, else the FA-2 path); an explicit "fa3" that cannot run (no such kernel
built, another GPU, a layout TMA cannot load) raises, naming why.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _bwd, _device, _fwd, _varlen, ops
from ._errors import UnsupportedError

FORWARD_ONLY = ("q/k/v: the FP8 forward has no backward (its inputs required grad: the forward "
                "ran, the gradient cannot); train in fp16 / bf16, or call it under "
                "torch.no_grad() / torch.inference_mode()")


class ForwardOnly(torch.autograd.Function):
    """A forward without a backward (FP8 and the mixed mode) called on inputs that require grad,
    as FA3's own tests call it: the forward runs (``run`` returns (out, lse or None)) and a
    backward through its results raises, naming why, instead of returning no gradient."""

    @staticmethod
    def forward(ctx: Any, run: Any, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return run()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[None, ...]:
        raise UnsupportedError(FORWARD_ONLY)


class KvCacheForwardOnly(ForwardOnly):
    """flash_attn_with_kvcache on inputs that require grad: forward only, as FA3's."""

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[None, ...]:
        raise UnsupportedError(
            "flash_attn_with_kvcache has no backward (an inference call, as FA3's: its inputs "
            "required grad, the forward ran, the gradient cannot); call it under torch.no_grad() "
            "/ torch.inference_mode(), or train through flash_attn_func / flash_attn_varlen_func")


class FlashAttnFunction(torch.autograd.Function):
    """(out, lse) = attention(q, k, v); gradients for q, k, v from dout and (when the lse was
    used) dlse."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Any,
                causal: Any, window_size: Any, softcap: Any, backend: Any,
                deterministic: bool, sm_margin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        plan = _fwd.plan_eager(q, k, v, softmax_scale, causal, window_size, softcap, backend,
                               sm_margin)
        out, lse = _fwd._run_new_outputs(plan, q, k, v)  # the backward needs the lse
        ctx.save_for_backward(q, k, v, out, lse)
        cfg = plan.cfg  # resolved: scale, window with causal folded in
        ctx.bwd_args = (cfg.softmax_scale, cfg.window_left, cfg.window_right, cfg.softcap,
                        cfg.backend, deterministic, sm_margin)
        ctx.set_materialize_grads(False)  # an unused lse gets None, not a zeros tensor
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        dout, dlse = ops.loadable_grads(out, dout, dlse)
        dq, dk, dv = _bwd.op(dout, q, k, v, out, lse, dlse, *ctx.bwd_args)
        return dq, dk, dv, None, None, None, None, None, None, None


class QkvPackedFunction(torch.autograd.Function):
    """flash_attn_qkvpacked_func in plain eager training: the forward on qkv's views q, k, v
    (``parts(qkv)``), the backward straight into the same views of one fresh dqkv (FA3's way: no
    concatenation of dq, dk and dv afterwards; bwd_into takes strided gradients)."""

    @staticmethod
    def forward(ctx: Any, qkv: torch.Tensor, parts: Any, softmax_scale: Any, causal: Any,
                window_size: Any, softcap: Any, backend: Any, deterministic: bool,
                sm_margin: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = parts(qkv)
        plan = _fwd.plan_eager(q, k, v, softmax_scale, causal, window_size, softcap, backend,
                               sm_margin)
        out, lse = _fwd._run_new_outputs(plan, q, k, v)
        ctx.save_for_backward(qkv, out, lse)
        cfg = plan.cfg
        ctx.parts = parts
        ctx.bwd_args = (cfg.softmax_scale, cfg.window_left, cfg.window_right, cfg.softcap,
                        cfg.backend, deterministic)
        ctx.num_sms = _device.grid_cap(q.device, sm_margin)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        qkv, out, lse = ctx.saved_tensors
        dout, dlse = ops.loadable_grads(out, dout, dlse)
        dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        _bwd.into(dout, *ctx.parts(qkv), out, lse, *ctx.parts(dqkv), *ctx.bwd_args, dlse,
                  ctx.num_sms, cache=True)
        return (dqkv,) + (None,) * 8


class FlashAttnVarlenFunction(torch.autograd.Function):
    """(out, lse) of a varlen call (flash_attn_varlen_func); gradients for q, k, v (the
    varlen backward, _varlen.backward)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: Any,
                max_seqlen_k: Any, seqused_q: Any, seqused_k: Any, softmax_scale: Any,
                causal: Any, window_size: Any, softcap: Any, backend: Any,
                deterministic: bool, sm_margin: int = 0,
                checked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # checked: offsets built by the caller (_chunk.py), not read back
        bounds: list = []
        out, lse, vp = _varlen.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, seqused_q, seqused_k, softmax_scale, causal,
                                       window_size, softcap, backend, checked=checked,
                                       sm_margin=sm_margin, bounds=bounds)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                              seqused_k)
        cfg = vp.dense.cfg
        ctx.bwd_args = (cfg.softmax_scale, cfg.window_left, cfg.window_right, cfg.softcap,
                        cfg.backend, deterministic, sm_margin, *(bounds or (0, 0)))
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None):
        q, k, v, out, lse, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
        dout, dlse = ops.loadable_grads(out, dout, dlse)
        dq, dk, dv = _varlen.backward(dout, q, k, v, out, lse, dlse, cu_q, cu_k, used_q, used_k,
                                      *ctx.bwd_args)
        return (dq, dk, dv) + (None,) * 14
