"""vLLM-compatible entry point: ``flash_attn_varlen_func`` with the argument names and order of
vLLM's ``vllm.vllm_flash_attn.flash_attn_varlen_func`` (max_seqlen_q, cu_seqlens_q, max_seqlen_k
first; ``out=``, ``return_softmax_lse``, ``fa_version``, ``scheduler_metadata``, ``num_splits``),
computing exactly what flash_hopper.flash_attn_varlen_func computes for the same call.

The paged call (block_table (batch, max_blocks) int32 over k / v caches (num_blocks,
block_size, heads_kv, head_dim), seqused_k the keys per sequence, no cu_seqlens_k) runs through
flash_hopper.flash_attn_with_kvcache's paged path with the same semantics; s_aux (attention sinks,
fp32 (heads_q,)) joins each row's softmax denominator (kvcache.apply_sinks).

q_v (MLA's extra query, vLLM's FA3-MLA backend: q the rope part, k / v views of the latent
cache) is flash_hopper's qv: the composite path of torch GEMMs (_qv.py), paged or not.

Performance hints are accepted and not used (fa_version 2 or 3, scheduler_metadata,
num_splits). What this package does not implement yet is refused with an error naming the
argument: dropout, ALiBi, 16-bit q against FP8 k / v (the mixed mode), context parallelism
(cp_world_size > 1), FA2's attention probabilities (return_attn_probs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import kvcache
from ._errors import UnsupportedError
from .interface import flash_attn_varlen_func as _varlen_func


def _refuse(name: str, value: Any, why: str) -> None:
    raise UnsupportedError(f"{name}: expected {why}, got {value!r}")


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    max_seqlen_q: int,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_k: int,
    cu_seqlens_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    q_v: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
    return_softmax_lse: bool = False,
    out: torch.Tensor | None = None,
    scheduler_metadata: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    num_splits: int = 0,
    fa_version: int = 3,
    s_aux: torch.Tensor | None = None,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_tot_seqused_k: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM's flash_attn_varlen_func: out, or (out, softmax_lse) with return_softmax_lse
    (lse fp32 (heads_q, total_q)). See flash_hopper.flash_attn_varlen_func for the semantics."""
    if block_table is not None and cu_seqlens_k is not None:
        _refuse("cu_seqlens_k", type(cu_seqlens_k).__name__, "None with block_table (the paged "
                "call gives each sequence's keys by seqused_k)")
    if block_table is None and cu_seqlens_k is None:
        _refuse("cu_seqlens_k", None, "a tensor, or block_table with seqused_k (the paged call)")
    if block_table is not None and seqused_k is None:
        _refuse("seqused_k", None, "a tensor with block_table (the keys of each sequence)")
    if dropout_p != 0.0:
        _refuse("dropout_p", dropout_p, "0.0 (dropout is not implemented)")
    if alibi_slopes is not None:
        _refuse("alibi_slopes", type(alibi_slopes).__name__, "None (ALiBi is not implemented)")
    if cp_world_size != 1 or cp_tot_seqused_k is not None:
        _refuse("cp_world_size", cp_world_size, "1 (context parallelism is not implemented in "
                "this entry point)")
    if return_attn_probs:
        _refuse("return_attn_probs", return_attn_probs, "False (FA2's attention probabilities "
                "are not returned; return_softmax_lse gives the LSE)")
    if fa_version not in (2, 3):
        raise ValueError(f"fa_version: expected 2 or 3, got {fa_version!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise TypeError(f"num_splits: expected an int >= 0, got {num_splits!r}")
    if window_size is None:
        window_size = (-1, -1)
    if block_table is not None:  # the paged call: flash_attn_with_kvcache's paged path
        return kvcache.flash_attn_with_kvcache(
            q, k, v, qv=q_v, cache_seqlens=seqused_k, page_table=block_table,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q, q_descale=q_descale, k_descale=k_descale,
            v_descale=v_descale, softmax_scale=softmax_scale, causal=causal,
            window_size=tuple(window_size), softcap=softcap,
            return_softmax_lse=return_softmax_lse, sinks=s_aux, out=out)
    sinks = kvcache.check_sinks(s_aux, q, name="s_aux")
    result = _varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
        softmax_scale=softmax_scale, causal=causal, qv=q_v, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, window_size=tuple(window_size), softcap=softcap,
        deterministic=deterministic, return_attn_probs=return_softmax_lse or sinks is not None,
        out=out)
    if sinks is None:
        return result
    o, lse = result
    sunk, lse = kvcache.apply_sinks(o, lse, sinks, 0)
    if out is not None:
        out.copy_(sunk)
        sunk = out
    return (sunk, lse) if return_softmax_lse else sunk


__all__ = ["flash_attn_varlen_func"]
