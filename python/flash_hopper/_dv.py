"""A V head dim of its own (FA3's dv != d: DeepSeek's 192 / 128, MLA-style 64 / 256 / 512).

Inference calls whose (d, dv) pair has a kernel of its own
(build_info "head_dim_v_kernels", kernels/src/tables.cmake FH_HEAD_DIM_V_TABLE: d in 136..192
with dv in 104..128; fp16 / bf16, the FA-3 path on cc 9.0) run it: V's stages, the PV GEMM and O
are dv wide, Q / K / S stay d wide (``native_forward``). Every other call, and every call whose
inputs require grad, is served by exact zero padding:

- Zero columns appended to q and k change no score (q . k sums them as 0), so q and k are padded
  to width = max(d, min(dv, 256)) (the largest head dim a kernel serves) with the softmax scale
  kept at d's (1 / sqrt(d) unless given).
- V is cut into blocks of that width, the last zero-padded: every call sees the same scores, so
  each block's output is exact and the LSE is the same in every call; zero V columns give zero
  output columns, which are dropped.
- Autograd composes the rest: dq and dk are the sums over the blocks' calls (dP and D are sums
  over V's columns, so dS is too), dv the blocks' dv, the pads' gradients are sliced away.

One call for dv <= 256 (d = 64, dv = 256: one d256 call, 4x the QK^T work of d64 and one
softmax), two for dv = 512.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from . import _device, _env, _fwd, _lib, _plan_cache, _tables, _validate

MAX_HEAD_DIM = 256  # the largest head-dim bucket (kernels/src/tables.cmake)


def differs(q: Any, v: Any) -> bool:
    """Whether a call has its own V head dim (tensors of the same rank, last dims differing)."""
    return (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == v.dim()
            and q.dim() >= 1 and q.shape[-1] != v.shape[-1])


def _check(q: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("v", v)):
        dim = t.shape[-1]
        if dim == 0 or dim % 8:
            raise ValueError(f"{name}: expected a head dim that is a positive multiple of 8 (a "
                             f"V head dim of its own pads q / k / v with zero columns), got "
                             f"{dim}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"q: expected head_dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}")


def split_call(call: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               softmax_scale: Any, return_attn_probs: bool, **kwargs: Any):
    """call(q', k', v_block, softmax_scale=..., return_attn_probs=True, **kwargs) -> (out, lse)
    over V's blocks; returns out (..., dv) and, when asked, the LSE."""
    _check(q, v)
    d, dv = q.shape[-1], v.shape[-1]
    width = padding_width(d, dv)
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    if width > d:
        q, k = F.pad(q, (0, width - d)), F.pad(k, (0, width - d))
    outs, lse = [], None
    for start in range(0, dv, width):
        block = v[..., start:start + width]
        used = block.shape[-1]
        if used < width:
            block = F.pad(block, (0, width - used))
        out, block_lse = call(q, k, block, softmax_scale=softmax_scale, return_attn_probs=True,
                              **kwargs)
        outs.append(out[..., :used])
        lse = block_lse if lse is None else lse
    out = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0].contiguous()
    return (out, lse) if return_attn_probs else out


def which_backend(q: Any, k: Any, v: Any, backend: Any, softmax_scale: Any, causal: Any,
                  window_size: Any, softcap: Any) -> tuple[str, str]:
    """flash_attn_func's answer for a call with V's own head dim: the kernel with V's own head
    dim where an inference call runs it, else the padded call's kernel, the padding named."""
    _check(q, v)
    if isinstance(k, torch.Tensor) and k.dim() == q.dim() and k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected head_dim (last dim) == q's {q.shape[-1]}, got "
                         f"{k.shape[-1]}")
    if native_serves(q, k, v, backend):
        plan = _dense_plan(q, k, v, softmax_scale, causal, window_size, softcap, backend, 0)
        return plan.backend, plan.reason
    from torch._subclasses.fake_tensor import FakeTensorMode

    d, dv = q.shape[-1], v.shape[-1]
    width = padding_width(d, dv)
    with FakeTensorMode():  # the padded call's metadata, nothing allocated
        padded = [torch.empty(*t.shape[:-1], width, dtype=t.dtype, device=t.device)
                  for t in (q, k, v)]
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    plan = _fwd.plan_eager(*padded, scale, causal, window_size, softcap, backend)
    return plan.backend, plan.reason + padding_note(d, dv)


def padding_width(head_dim: int, head_dim_v: int) -> int:
    """The padded calls' head dim: q / k zero-padded to it, V cut into blocks of it."""
    return max(head_dim, min(head_dim_v, MAX_HEAD_DIM))


def padding_note(head_dim: int, head_dim_v: int) -> str:
    """How a call with V's own head dim is padded, for reasons (which_backend, supports)."""
    width = padding_width(head_dim, head_dim_v)
    blocks = -(-head_dim_v // width)
    return (f"; v's head dim {head_dim_v}: q / k zero-padded to {width}, V in {blocks} "
            f"block{'s' if blocks > 1 else ''} of {width} (_dv.py)")


# --- the kernels with V's own head dim ----------------------------------------------------------

# The FA-3 path's names that run the tuned kernel (its ping-pong switch included).
_NATIVE_BACKENDS = ("auto", "fa3", "fa3-no-pingpong")
_plans = _plan_cache.PlanCache(64)


@functools.cache
def _native_pairs(lib: Any) -> frozenset:
    """{(dtype name, head-dim bucket, V head-dim bucket)} of the library's kernels with V's own
    head dim (build_info "head_dim_v_kernels"; absent before they existed)."""
    info = lib.build_info()
    return frozenset((k["dtype"], int(k["head_dim"]), int(k["head_dim_v"]))
                     for k in info.get("head_dim_v_kernels") or ())


def native_serves(q: Any, k: Any, v: Any, backend: Any) -> bool:
    """Whether a call with V's own head dim runs a kernel of its own: inference (no input
    requires grad), fp16 / bf16 CUDA tensors on a cc 9.0 GPU, a backend that may run the FA-3
    path's tuned kernel, and a kernel for (d, dv)'s buckets in this build. Anything else it
    does not check (shapes, strides) the native call validates and reports itself.
    FLASH_HOPPER_DV_KERNEL=0 (_env.py) sends every call to the padding."""
    if not _env.dv_kernel_on() or not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    if backend not in _NATIVE_BACKENDS or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not q.is_cuda or q.dim() < 1 or v.dim() != q.dim():
        return False
    if max(q.shape[-1], v.shape[-1]) > _tables.MAX_HEAD_DIM:
        return False
    try:
        lib = _lib.get_library()
    except (OSError, RuntimeError):
        return False
    name = "bf16" if q.dtype == torch.bfloat16 else "fp16"
    pair = (name, _tables.head_dim_bucket(q.shape[-1]), _tables.head_dim_bucket(v.shape[-1]))
    if pair not in _native_pairs(lib):
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return _device.device_info(index).capability == (9, 0)


def _dense_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Any,
                causal: Any, window_size: Any, softcap: Any, backend: Any,
                sm_margin: int) -> _fwd.Plan:
    """flash_attn_func's plan for V's own head dim: q / k validated as every call's (v in k's
    place: the same rules but for the last dim), v as k's shape with its own last dim, then the
    library's policy on the parameters with head_dim_v set (it names what it does not serve)."""
    key = ("dv", _fwd._eager_key(q, k, v, softmax_scale, causal, window_size, softcap, backend),
           sm_margin)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    cfg = _validate.check_fwd_args(q, k, k, softmax_scale, causal, window_size, softcap, backend)
    dv = _validate.check_own_head_dim_v(q, k, v)
    plan = _fwd.make_plan(cfg, q, k, v, with_lse=True,
                          num_sms=_device.grid_cap(q.device, sm_margin), head_dim_v=dv)
    if key[1] is not None:
        _plans.remember(key, plan)
    return plan


def native_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Any,
                   causal: Any, window_size: Any, softcap: Any, backend: Any,
                   return_attn_probs: bool, sm_margin: int = 0) -> Any:
    """flash_attn_func on the kernel with V's own head dim (``native_serves`` said it runs):
    out (batch, seqlen_q, heads_q, dv), and the LSE when asked."""
    plan = _dense_plan(q, k, v, softmax_scale, causal, window_size, softcap, backend, sm_margin)
    out, lse = _fwd._run_new_outputs(plan, q, k, v, need_lse=return_attn_probs)
    return (out, lse) if return_attn_probs else out
