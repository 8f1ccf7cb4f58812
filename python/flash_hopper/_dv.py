"""A V head dim of its own (FA3's dv != d: DeepSeek's 192 / 128, MLA-style 64 / 256 / 512), served
without kernels of their own by exact zero padding.

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

from typing import Any

import torch
import torch.nn.functional as F

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
    width = max(d, min(dv, MAX_HEAD_DIM))
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
