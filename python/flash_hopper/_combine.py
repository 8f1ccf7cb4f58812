"""flash_attn_combine (FA3's signature): merge attention results computed over disjoint key sets
(split-KV partials, context-parallel ring steps) through their log-sum-exps.

For partials i with out_i = softmax over their keys times V and lse_i = log sum exp of their
scores, the attention over the union of the keys is

    lse = log sum_i exp(lse_i),    out = sum_i exp(lse_i - lse) * out_i

exactly (in fp32). A partial whose keys are all masked (lse_i = -inf) weighs 0; a row whose every
partial is -inf gets out 0 and lse -inf, as the attention kernels give a row that sees no key.

This is the operation in torch (a few fused elementwise passes over the partials), on any device.
``lse_weights`` is the merge's one weighting rule, shared by every caller that merges partials
(flash_attn_combine here, the ring's running merge in distributed.py, the attention sink in
kvcache.apply_sinks, a partial without a value).
"""

from __future__ import annotations

from typing import Any

import torch

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NEG_INF = float("-inf")


def lse_weights(total: torch.Tensor, *lses: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """exp(lse_i - total) for each partial's fp32 log-sum-exp lse_i: the factor of its output in
    the merged one, where ``total`` (broadcastable against every lse_i) is the merged log-sum-exp
    (logsumexp / logaddexp of the lse_i, and of a sink's logit). A row no key sees (total -inf,
    so every lse_i -inf) weighs 0, not exp(-inf - (-inf)) = NaN: its merged out is 0, as the
    kernels give a row without keys. A NaN lse_i stays NaN."""
    base = total.masked_fill(total == _NEG_INF, 0.0)
    return tuple(torch.exp(lse - base) for lse in lses)


def _check(out_partial: Any, lse_partial: Any, out: Any, out_dtype: Any) -> torch.dtype:
    for name, t, dims, what in (
        ("out_partial", out_partial, 5, "(num_splits, batch, seqlen, heads, head_dim)"),
        ("lse_partial", lse_partial, 4, "(num_splits, batch, seqlen, heads)"),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor {what}, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name}: expected a {dims}-D tensor {what}, got shape "
                             f"{tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected dtype torch.float32 (partials are fp32), got "
                            f"{t.dtype}")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:4]):
        raise ValueError(f"lse_partial: expected shape {tuple(out_partial.shape[:4])} "
                         f"(out_partial's first four dims), got {tuple(lse_partial.shape)}")
    if lse_partial.device != out_partial.device:
        raise ValueError(f"lse_partial: expected a tensor on out_partial's device "
                         f"{out_partial.device}, got {lse_partial.device}")
    dtype = out_partial.dtype if out_dtype is None else out_dtype
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype: expected None (torch.float32), torch.float32, torch.float16 "
                         f"or torch.bfloat16, got {out_dtype!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
        want = tuple(out_partial.shape[1:])
        if tuple(out.shape) != want:
            raise ValueError(f"out: expected shape {want} (batch, seqlen, heads, head_dim), got "
                             f"{tuple(out.shape)}")
        if out.dtype != dtype:
            raise TypeError(f"out: expected dtype {dtype} (out_dtype), got {out.dtype}")
        if out.device != out_partial.device:
            raise ValueError(f"out: expected a tensor on out_partial's device "
                             f"{out_partial.device}, got {out.device}")
    return dtype


def flash_attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor,
                       out: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of attention results over disjoint key sets, merged exactly (FA3's
    flash_attn_combine: its arguments and layouts).

    out_partial: fp32 (num_splits, batch, seqlen, heads, head_dim); lse_partial: fp32
    (num_splits, batch, seqlen, heads), natural log (any strides for both). Returns out
    (batch, seqlen, heads, head_dim) in ``out_dtype`` (default fp32), written into ``out`` when
    given, and lse fp32 (batch, seqlen, heads) (a transposed view of a (batch, heads, seqlen)
    tensor, as FA3 returns it). Rows whose partials are all -inf: out 0, lse -inf.
    """
    dtype = _check(out_partial, lse_partial, out, out_dtype)
    with torch.no_grad():
        batch, seqlen, heads = out_partial.shape[1:4]
        lse = torch.empty(batch, heads, seqlen, dtype=torch.float32,
                          device=out_partial.device).transpose(1, 2)
        torch.logsumexp(lse_partial, dim=0, out=lse)
        (weight,) = lse_weights(lse.unsqueeze(0), lse_partial)
        merged = torch.einsum("nbsh,nbshd->bshd", weight, out_partial)
        if out is None:
            out = merged.to(dtype)
        else:
            out.copy_(merged)
    return out, lse


__all__ = ["flash_attn_combine", "lse_weights"]
