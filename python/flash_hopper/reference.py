"""Reference attention in plain torch: the oracle of the tests. Device-agnostic, float64-capable.

- ``attention_ref``: naive softmax(Q K^T) V; with ``upcast=False`` it computes in the input dtype
  like a same-precision PyTorch implementation (the low-precision side of FA3's tolerance rule).
- ``attention_ref_chunked``: the same, a block of query rows at a time, so the (rows, seqlen_k)
  scores stay under a memory budget: the benchmark checks full-size timed calls with it on the GPU.
- ``attention_tiled_fwd``: the online-softmax forward exactly as the FlashAttention papers derive
  it (blocks of queries, a loop over key blocks with running max / sum and a rescaled
  accumulator). It is what the kernels implement, written to be read, and it walks key blocks with
  the kernels' own policy (which blocks, which of them masked).
- ``attention_bwd_ref``: the backward by recomputation from the LSE, as the kernels do it,
  including the gradient of the returned LSE (``dlse``).
- ``attention_bwd_ref_chunked``: the same, a block of query rows at a time (dq per block, dk and dv
  summed over blocks): the benchmark checks full-size timed backward calls with it on the GPU.

Conventions, shared with the kernels (api.h): layout (batch, seqlen, heads, head_dim); GQA maps
query head h to kv head h // (heads_q // heads_kv); scores are scaled by softmax_scale, then soft-
capped (score = softcap * tanh(score / softcap)); which keys a query sees is flash_hopper.mask's
AttentionMask (bottom-right aligned causal and windows, FA3's attention_chunk), the mirror of the
kernels' mask.h. A query row that sees no key gets out 0 and lse -inf, never NaN. LSE is
natural-log, shape (batch, heads_q, seqlen_q).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .mask import AttentionMask

Tensor = torch.Tensor
NEG_INF = float("-inf")
# attention_ref_chunked's default budget: scores per chunk (2^26 fp32 = 256 MB; the softmax holds
# about three such temporaries at once).
CHUNK_SCORES = 1 << 26


def _mask(q: Tensor, k: Tensor, causal: bool, window_size: Sequence[int],
          attention_chunk: int) -> AttentionMask:
    return AttentionMask.from_args(q.shape[1], k.shape[1], causal, window_size, attention_chunk)


def _compute_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32) if upcast else dtype


def _heads_first(t: Tensor, heads_q: int, dtype: torch.dtype) -> Tensor:
    """(b, s, h, d) -> (b, heads_q, s, d) in ``dtype``, repeating kv heads for GQA."""
    group = heads_q // t.shape[2]
    if group > 1:
        t = t.repeat_interleave(group, dim=2)
    return t.to(dtype).transpose(1, 2)


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _capped(scores: Tensor, softcap: float) -> Tensor:
    return softcap * torch.tanh(scores / softcap) if softcap > 0 else scores


def _attend(qh: Tensor, kh: Tensor, vh: Tensor, visible: Tensor | None, scale: float,
            softcap: float) -> tuple[Tensor, Tensor]:
    """Naive attention of (b, h, rows, d) queries on (b, h, sk, d) keys and values, in their dtype:
    (out (b, h, rows, d), lse (b, h, rows)). ``visible``: bool (rows, sk), None when all keys are."""
    scores = _capped(qh @ kh.transpose(-1, -2) * scale, softcap)
    if visible is not None:
        scores = scores.masked_fill(~visible, NEG_INF)
    # Subtract the row max for stability; a fully masked row has max -inf: use 0 there so that
    # exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
    if kh.shape[-2] > 0:
        row_max = scores.amax(dim=-1, keepdim=True)
    else:  # no keys at all (amax of an empty row is an error)
        row_max = scores.new_full((*scores.shape[:-1], 1), NEG_INF)
    row_max = torch.where(row_max == NEG_INF, torch.zeros_like(row_max), row_max)
    expd = torch.exp(scores - row_max)
    row_sum = expd.sum(dim=-1, keepdim=True)
    empty = row_sum == 0
    probs = expd / torch.where(empty, torch.ones_like(row_sum), row_sum)
    lse = torch.where(empty, torch.full_like(row_sum, NEG_INF), row_max + row_sum.log())
    return probs @ vh, lse.squeeze(-1)


def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    upcast: bool = True,
    attention_chunk: int = 0,
) -> tuple[Tensor, Tensor]:
    """Naive attention: (out (b, sq, hq, d), lse (b, hq, sq)).

    upcast=True computes (and returns) in float32, or float64 for float64 inputs; upcast=False
    computes every step in the input dtype. Differentiable (tests use it with autograd).
    """
    dtype = _compute_dtype(q.dtype, upcast)
    heads_q, head_dim = q.shape[2], q.shape[3]
    mask = _mask(q, k, causal, window_size, attention_chunk)
    qh = q.to(dtype).transpose(1, 2)
    kh, vh = _heads_first(k, heads_q, dtype), _heads_first(v, heads_q, dtype)
    visible = None if mask.is_full else mask.dense(device=q.device)
    out, lse = _attend(qh, kh, vh, visible, _scale(softmax_scale, head_dim), softcap)
    return out.transpose(1, 2), lse


@torch.no_grad()
def attention_ref_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    upcast: bool = True,
    attention_chunk: int = 0,
    max_scores: int = CHUNK_SCORES,
) -> tuple[Tensor, Tensor]:
    """attention_ref a block of query rows at a time (not differentiable).

    Each row's softmax runs over all its keys, so chunking rows changes no arithmetic: only the
    memory, about batch * heads_q * rows * seqlen_k scores (at most ``max_scores``, and at least
    one row) plus q, k and v in the compute dtype (k and v repeated per query head for GQA).
    """
    dtype = _compute_dtype(q.dtype, upcast)
    batch, seqlen_q, heads_q, head_dim = q.shape
    mask = _mask(q, k, causal, window_size, attention_chunk)
    scale = _scale(softmax_scale, head_dim)
    qh = q.to(dtype).transpose(1, 2)
    kh, vh = _heads_first(k, heads_q, dtype), _heads_first(v, heads_q, dtype)
    out = torch.empty(batch, heads_q, seqlen_q, v.shape[3], dtype=dtype, device=q.device)
    lse = torch.empty(batch, heads_q, seqlen_q, dtype=dtype, device=q.device)
    rows = max(1, max_scores // max(1, batch * heads_q * k.shape[1]))
    for r0 in range(0, seqlen_q, rows):
        r1 = min(r0 + rows, seqlen_q)
        visible = None if mask.is_full else mask.dense(rows=(r0, r1), device=q.device)
        out[:, :, r0:r1], lse[:, :, r0:r1] = _attend(qh[:, :, r0:r1], kh, vh, visible, scale,
                                                     softcap)
    return out.transpose(1, 2), lse


def attention_tiled_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    block_m: int = 64,
    block_n: int = 64,
    attention_chunk: int = 0,
) -> tuple[Tensor, Tensor]:
    """Online-softmax forward (FlashAttention, Alg. 1 of FA2): (out, lse) like attention_ref.

    Per block of queries, over the key blocks it can see:
        S = Q_i K_j^T * scale (softcapped, masked)
        m_new = max(m, rowmax(S));  P = exp(S - m_new);  alpha = exp(m - m_new)
        l = alpha * l + rowsum(P);  acc = alpha * acc + P V_j;  m = m_new
    then out = acc / l and lse = m + log(l). A row that has seen only masked keys keeps
    m = -inf; it is shifted by 0 instead (no -inf - -inf), so P = 0, l = 0, out 0, lse -inf.

    The blocks and their order are the kernels': AttentionMask.key_blocks gives the range, visited
    from n_max - 1 down, and only the blocks AttentionMask.unmasked_blocks leaves out get the
    element mask. A policy that calls a block unmasked when it is not makes this differ from
    attention_ref, which masks every element.
    """
    dtype = _compute_dtype(q.dtype, True)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    mask = _mask(q, k, causal, window_size, attention_chunk)
    scale = _scale(softmax_scale, head_dim)
    qh = q.to(dtype).transpose(1, 2)
    kh, vh = _heads_first(k, heads_q, dtype), _heads_first(v, heads_q, dtype)
    out = torch.zeros(batch, heads_q, seqlen_q, v.shape[3], dtype=dtype, device=q.device)
    lse = torch.full((batch, heads_q, seqlen_q), NEG_INF, dtype=dtype, device=q.device)

    for m_block in range(-(-seqlen_q // block_m)):
        m0, m1 = m_block * block_m, min((m_block + 1) * block_m, seqlen_q)
        q_tile = qh[:, :, m0:m1]  # (b, h, BLK_M, d)
        row_max = torch.full((batch, heads_q, m1 - m0), NEG_INF, dtype=dtype, device=q.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros(batch, heads_q, m1 - m0, v.shape[3], dtype=dtype, device=q.device)
        blocks = mask.key_blocks(m_block, block_m, block_n)
        split = mask.unmasked_blocks(blocks, m_block, block_m, block_n)
        for n_block in reversed(range(blocks.n_min, blocks.n_max)):
            n0, n1 = n_block * block_n, min((n_block + 1) * block_n, seqlen_k)
            s = _capped(q_tile @ kh[:, :, n0:n1].transpose(-1, -2) * scale, softcap)
            if split.masked(n_block):
                tile_mask = mask.dense(rows=(m0, m1), cols=(n0, n1), device=q.device)
                s = s.masked_fill(~tile_mask, NEG_INF)  # (b, h, BLK_M, BLK_N)
            new_max = torch.maximum(row_max, s.amax(dim=-1))
            shift = torch.where(new_max == NEG_INF, torch.zeros_like(new_max), new_max)
            p = torch.exp(s - shift.unsqueeze(-1))
            alpha = torch.exp(row_max - shift)  # rescales what was accumulated so far
            row_sum = alpha * row_sum + p.sum(dim=-1)
            acc = alpha.unsqueeze(-1) * acc + p @ vh[:, :, n0:n1]
            row_max = new_max
        seen = row_sum > 0
        safe_sum = torch.where(seen, row_sum, torch.ones_like(row_sum))
        out[:, :, m0:m1] = acc / safe_sum.unsqueeze(-1)
        lse[:, :, m0:m1] = torch.where(seen, row_max + safe_sum.log(), lse[:, :, m0:m1])
    return out.transpose(1, 2), lse


def attention_bwd_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    attention_chunk: int = 0,
    dlse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward by recomputation from the LSE (FlashAttention): (dq, dk, dv) in q/k/v layouts.

        P  = exp(S - lse)              (S scaled, softcapped, masked: the forward's scores)
        dV = P^T dO                    D  = rowsum(dO * O) - dlse
        dP = dO V^T                    dS = P * (dP - D)
        dS_raw = dS * (1 - tanh^2)     (through the softcap; identity without it)
        dQ = dS_raw K * scale          dK = dS_raw^T Q * scale
    With GQA, dK and dV of the query heads that share a kv head are summed.

    ``dlse``: the gradient of the returned lse, (b, hq, sq), or None for 0. Since
    d lse_i / d S_ij = P_ij, it adds P * dlse to dS, which is the same as subtracting it from D.
    """
    dtype = _compute_dtype(q.dtype, True)
    heads_q, head_dim = q.shape[2], q.shape[3]
    mask = _mask(q, k, causal, window_size, attention_chunk)
    visible = None if mask.is_full else mask.dense(device=q.device)
    dq, dk, dv = _bwd_rows(
        q.to(dtype).transpose(1, 2), _heads_first(k, heads_q, dtype),
        _heads_first(v, heads_q, dtype), out.to(dtype).transpose(1, 2),
        dout.to(dtype).transpose(1, 2), lse.to(dtype), dlse, visible,
        _scale(softmax_scale, head_dim), softcap)
    return dq.transpose(1, 2), _per_kv_head(dk, k.shape[2]), _per_kv_head(dv, k.shape[2])


def _per_kv_head(t: Tensor, heads_kv: int) -> Tensor:
    """(b, hq, sk, d) per query head -> (b, sk, hkv, d), summed over each kv head's group."""
    batch, heads_q, seqlen_k, dim = t.shape
    return t.reshape(batch, heads_kv, heads_q // heads_kv, seqlen_k, dim).sum(dim=2).transpose(1, 2)


def _bwd_rows(qh: Tensor, kh: Tensor, vh: Tensor, oh: Tensor, doh: Tensor, lse: Tensor,
              dlse: Tensor | None, visible: Tensor | None, scale: float,
              softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    """attention_bwd_ref's formulas for a block of query rows, (b, h, rows, d) against all keys
    (b, h, sk, d): (dq rows, this block's dk and dv terms (b, h, sk, d)). Every tensor stays in
    qh's dtype except P, which is exp(S - lse) computed in lse's dtype and then stored in qh's."""
    raw = qh @ kh.transpose(-1, -2) * scale
    if softcap > 0:
        tanh = torch.tanh(raw / softcap)
        s = softcap * tanh
    else:
        s = raw
    if visible is not None:
        s = s.masked_fill(~visible, NEG_INF)
    shift = torch.where(lse == NEG_INF, torch.zeros_like(lse), lse)  # rows without keys: P = 0
    p = torch.exp(s.to(lse.dtype) - shift.unsqueeze(-1)).to(qh.dtype)
    dv = p.transpose(-1, -2) @ doh
    dp = doh @ vh.transpose(-1, -2)
    delta = (doh * oh).sum(dim=-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(delta.dtype).unsqueeze(-1)
    ds = p * (dp - delta)
    if softcap > 0:
        ds = ds * (1 - tanh * tanh)
    return ds @ kh * scale, ds.transpose(-1, -2) @ qh * scale, dv


@torch.no_grad()
def attention_bwd_ref_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    dlse: Tensor | None = None,
    chunk_scores: int = CHUNK_SCORES,
    upcast: bool = True,
    attention_chunk: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """attention_bwd_ref a block of query rows at a time (not differentiable): (dq, dk, dv).

    A query row's gradient needs only its own row of P and dS, so each block of rows gives its
    dq rows outright and adds its terms to dk and dv, which are summed over blocks (and, for GQA,
    over the query heads of a kv head) in the compute dtype. Memory: a few
    batch * heads_q * rows * seqlen_k temporaries (rows chosen so one holds at most
    ``chunk_scores``, and at least one row), plus q, k, v, dk and dv per query head.

    upcast=True computes (and returns) in float32, or float64 for float64 inputs. upcast=False is
    the same-precision implementation of the tolerance rule: every product and every stored
    intermediate in the input dtype, returned in it; two things stay in float32, as in any real
    implementation: the LSE (a natural-log LSE of ~10 rounded to bf16 would move P by 3 %) and
    the sum of the blocks' dk / dv terms (a split-K GEMM's accumulator, so the block size does
    not change the result's precision).
    """
    acc = _compute_dtype(q.dtype, True)
    store = acc if upcast else q.dtype
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    mask = _mask(q, k, causal, window_size, attention_chunk)
    scale = _scale(softmax_scale, head_dim)
    qh = q.to(store).transpose(1, 2)
    kh, vh = _heads_first(k, heads_q, store), _heads_first(v, heads_q, store)
    oh, doh = out.to(store).transpose(1, 2), dout.to(store).transpose(1, 2)
    lse = lse.to(acc)
    dq = torch.empty(batch, heads_q, seqlen_q, head_dim, dtype=store, device=q.device)
    dk = torch.zeros(batch, heads_q, seqlen_k, head_dim, dtype=acc, device=q.device)
    dv = torch.zeros(batch, heads_q, seqlen_k, v.shape[3], dtype=acc, device=q.device)
    rows = max(1, chunk_scores // max(1, batch * heads_q * seqlen_k))
    for r0 in range(0, seqlen_q, rows):
        r1 = min(r0 + rows, seqlen_q)
        visible = None if mask.is_full else mask.dense(rows=(r0, r1), device=q.device)
        dlse_rows = None if dlse is None else dlse[:, :, r0:r1]
        dq[:, :, r0:r1], dk_rows, dv_rows = _bwd_rows(
            qh[:, :, r0:r1], kh, vh, oh[:, :, r0:r1], doh[:, :, r0:r1], lse[:, :, r0:r1],
            dlse_rows, visible, scale, softcap)
        dk += dk_rows
        dv += dv_rows

    return (dq.transpose(1, 2), _per_kv_head(dk, heads_kv).to(store),
            _per_kv_head(dv, heads_kv).to(store))


def attention_varlen_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    seqused_q: Tensor | None = None,
    seqused_k: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    upcast: bool = True,
) -> tuple[Tensor, Tensor]:
    """Naive attention of a packed variable-length batch (FA3's varlen layout):
    q (total_q, heads_q, d), k / v (total_k, heads_kv, d); sequence b is rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and likewise for k / v, of which only the first
    seqused_q[b] / seqused_k[b] take part when given. Masks are per sequence, bottom-right
    aligned on its used lengths. Returns (out (total_q, heads_q, d), lse (heads_q, total_q)); rows
    past a sequence's seqused_q (and rows no sequence covers) are 0 in out and -inf in lse, as
    are rows that see no key. Differentiable like attention_ref."""
    dtype = _compute_dtype(q.dtype, upcast)
    total_q, heads_q = q.shape[0], q.shape[1]
    out = torch.zeros(total_q, heads_q, v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((heads_q, total_q), NEG_INF, dtype=dtype, device=q.device)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used_q = seqused_q.tolist() if seqused_q is not None else None
    used_k = seqused_k.tolist() if seqused_k is not None else None
    for b in range(len(starts_q) - 1):
        q0, k0 = starts_q[b], starts_k[b]
        sq = used_q[b] if used_q is not None else starts_q[b + 1] - q0
        sk = used_k[b] if used_k is not None else starts_k[b + 1] - k0
        if sq == 0:
            continue
        o, l = attention_ref(q[None, q0:q0 + sq], k[None, k0:k0 + sk], v[None, k0:k0 + sk],
                             softmax_scale, causal, window_size, softcap, upcast)
        out = out.index_copy(0, torch.arange(q0, q0 + sq, device=q.device), o[0])
        lse = lse.index_copy(1, torch.arange(q0, q0 + sq, device=q.device), l[0])
    return out, lse


def _attend_with_sink(qh: Tensor, kh: Tensor, vh: Tensor, visible: Tensor | None, scale: float,
                      softcap: float, sink: Tensor) -> tuple[Tensor, Tensor]:
    """_attend with a per-head sink logit (gpt-oss style, ``sink`` (h,)): it joins each row's
    softmax denominator without a value, so out = sum_j exp(s_j) v_j / (sum_j exp(s_j) +
    exp(sink)) and lse = log(sum_j exp(s_j) + exp(sink)). A row that sees no key gets out 0 and
    lse = sink."""
    scores = _capped(qh @ kh.transpose(-1, -2) * scale, softcap)
    if visible is not None:
        scores = scores.masked_fill(~visible, NEG_INF)
    sink = sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    both = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(both, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return probs @ vh, lse


def attention_kvcache_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    page_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    upcast: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Naive attention over a KV cache with FA3's flash_attn_with_kvcache semantics:
    (out (b, sq, hq, d), lse (b, hq, sq), k_cache', v_cache'), the caches returned as new tensors
    with the new keys written (what the kernel does in place).

    Cache: dense (batch_cache, seqlen_cache, heads_kv, d), batch b reading row
    cache_batch_idx[b] (default b); or paged (num_pages, page_size, heads_kv, d) with page_table
    (b, max_pages) int32: logical position j of batch b is page page_table[b, j // page_size],
    slot j % page_size. cache_seqlens (int or (b,)): the positions already filled; the new k / v
    (b, seqlen_new, heads_kv, d), when given, are written at positions [cache_seqlens,
    cache_seqlens + seqlen_new). The keys attended are positions [cache_leftpad[b] (default 0),
    cache_seqlens[b] + seqlen_new); masks are bottom-right aligned on that span. Nothing past it
    (garbage, NaN, unused pages) is read. sinks: fp32 (hq,), a logit per query head that joins
    the softmax denominator without a value (_attend_with_sink); lse then includes it.
    """
    batch, seqlen_q, heads_q, head_dim = q.shape
    dtype = _compute_dtype(q.dtype, upcast)
    paged = page_table is not None
    page_size = k_cache.shape[1]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    new = 0 if k is None else k.shape[1]
    if isinstance(cache_seqlens, int) or cache_seqlens is None:
        filled = [int(cache_seqlens or 0)] * batch
    else:
        filled = [int(x) for x in cache_seqlens.tolist()]
    leftpad = [0] * batch if cache_leftpad is None else [int(x) for x in cache_leftpad.tolist()]
    rows = list(range(batch)) if cache_batch_idx is None else cache_batch_idx.tolist()

    def slots(b: int, positions: range) -> tuple[Tensor, Tensor]:
        """(cache row or page, slot) of batch b's logical positions."""
        pos = torch.tensor(list(positions), dtype=torch.long, device=k_cache.device)
        if paged:
            return page_table[b].long()[pos // page_size], pos % page_size
        return torch.full_like(pos, rows[b]), pos

    out = torch.zeros(batch, seqlen_q, heads_q, v_cache.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((batch, heads_q, seqlen_q), NEG_INF, dtype=dtype, device=q.device)
    for b in range(batch):
        if new:
            page, slot = slots(b, range(filled[b], filled[b] + new))
            k_cache[page, slot] = k[b].to(k_cache.dtype)
            v_cache[page, slot] = v[b].to(v_cache.dtype)
        page, slot = slots(b, range(leftpad[b], filled[b] + new))
        kb, vb = k_cache[page, slot][None], v_cache[page, slot][None]
        if sinks is None:
            o, l = attention_ref(q[b:b + 1], kb, vb, softmax_scale, causal, window_size,
                                 softcap, upcast)
        else:
            mask = _mask(q[b:b + 1], kb, causal, window_size, 0)
            visible = None if mask.is_full else mask.dense(device=q.device)
            oh, l = _attend_with_sink(q[b:b + 1].to(dtype).transpose(1, 2),
                                      _heads_first(kb, heads_q, dtype),
                                      _heads_first(vb, heads_q, dtype), visible,
                                      _scale(softmax_scale, head_dim), softcap, sinks)
            o = oh.transpose(1, 2)
        out[b], lse[b] = o[0], l[0]
    return out, lse, k_cache, v_cache
