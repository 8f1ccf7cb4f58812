"""Reference attention in plain torch: the oracle of the tests. Device-agnostic, float64-capable.

- ``attention_ref``: naive softmax(Q K^T) V; with ``upcast=False`` it computes in the input dtype
  like a same-precision PyTorch implementation (the low-precision side of FA3's tolerance rule).
- ``attention_tiled_fwd``: the online-softmax forward exactly as the FlashAttention papers derive
  it (blocks of queries, a loop over key blocks with running max / sum and a rescaled
  accumulator). It is what the kernels implement, written to be read.
- ``attention_bwd_ref``: the backward by recomputation from the LSE, as the kernels will do it.

Conventions, shared with the kernels (api.h): layout (batch, seqlen, heads, head_dim); GQA maps
query head h to kv head h // (heads_q // heads_kv); scores are scaled by softmax_scale, then soft-
capped (score = softcap * tanh(score / softcap)); the mask is bottom-right aligned: query i sees
key j iff i + sk - sq - left <= j <= i + sk - sq + right, a negative bound meaning unbounded;
causal is right = 0. A query row that sees no key gets out 0 and lse -inf, never NaN.
LSE is natural-log, shape (batch, heads_q, seqlen_q).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Tensor = torch.Tensor


def _window(causal: bool, window_size: Sequence[int]) -> tuple[int, int]:
    left, right = int(window_size[0]), int(window_size[1])
    return (left, 0) if causal else (left, right)


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    window_left: int = -1,
    window_right: int = -1,
    device: torch.device | None = None,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> Tensor:
    """Bool (rows, cols) mask, True where query i may see key j (bottom-right aligned window).

    ``rows``/``cols`` = (start, stop) select a tile of the full (seqlen_q, seqlen_k) mask.
    """
    r0, r1 = rows if rows is not None else (0, seqlen_q)
    c0, c1 = cols if cols is not None else (0, seqlen_k)
    i = torch.arange(r0, r1, device=device).unsqueeze(1)
    j = torch.arange(c0, c1, device=device).unsqueeze(0)
    diagonal = i + (seqlen_k - seqlen_q)  # the key a query is aligned with
    mask = torch.ones(r1 - r0, c1 - c0, dtype=torch.bool, device=device)
    if window_left >= 0:
        mask &= j >= diagonal - window_left
    if window_right >= 0:
        mask &= j <= diagonal + window_right
    return mask


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


def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    upcast: bool = True,
) -> tuple[Tensor, Tensor]:
    """Naive attention: (out (b, sq, hq, d), lse (b, hq, sq)).

    upcast=True computes (and returns) in float32, or float64 for float64 inputs; upcast=False
    computes every step in the input dtype. Differentiable (tests use it with autograd).
    """
    dtype = _compute_dtype(q.dtype, upcast)
    heads_q, head_dim = q.shape[2], q.shape[3]
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    left, right = _window(causal, window_size)
    qh = q.to(dtype).transpose(1, 2)
    kh, vh = _heads_first(k, heads_q, dtype), _heads_first(v, heads_q, dtype)

    scores = _capped(qh @ kh.transpose(-1, -2) * _scale(softmax_scale, head_dim), softcap)
    mask = visible_mask(seqlen_q, seqlen_k, left, right, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    # Subtract the row max for stability; a fully masked row has max -inf: use 0 there so that
    # exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
    if seqlen_k > 0:
        row_max = scores.amax(dim=-1, keepdim=True)
    else:  # no keys at all (amax of an empty row is an error)
        row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    expd = torch.exp(scores - row_max)
    row_sum = expd.sum(dim=-1, keepdim=True)
    empty = row_sum == 0
    probs = expd / torch.where(empty, torch.ones_like(row_sum), row_sum)
    out = (probs @ vh).transpose(1, 2)
    lse = torch.where(empty, torch.full_like(row_sum, float("-inf")), row_max + row_sum.log())
    return out, lse.squeeze(-1)


def _key_block_range(
    m0: int, m1: int, seqlen_q: int, seqlen_k: int, left: int, right: int, block_n: int
) -> tuple[int, int]:
    """[first, last) key blocks holding a key visible to some query in rows [m0, m1).

    Row i sees a contiguous key interval that slides by one per row, so the rows of a block
    together see one contiguous interval [lo, hi]: every other key block is entirely masked.
    """
    offset = seqlen_k - seqlen_q
    lo = max(m0 + offset - left, 0) if left >= 0 else 0
    hi = min(m1 - 1 + offset + right, seqlen_k - 1) if right >= 0 else seqlen_k - 1
    if lo > hi:
        return 0, 0
    return lo // block_n, hi // block_n + 1


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
) -> tuple[Tensor, Tensor]:
    """Online-softmax forward (FlashAttention, Alg. 1 of FA2): (out, lse) like attention_ref.

    Per block of queries, over the key blocks it can see:
        S = Q_i K_j^T * scale (softcapped, masked)
        m_new = max(m, rowmax(S));  P = exp(S - m_new);  alpha = exp(m - m_new)
        l = alpha * l + rowsum(P);  acc = alpha * acc + P V_j;  m = m_new
    then out = acc / l and lse = m + log(l). A row that has seen only masked keys keeps
    m = -inf; it is shifted by 0 instead (no -inf - -inf), so P = 0, l = 0, out 0, lse -inf.
    """
    dtype = _compute_dtype(q.dtype, True)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k = k.shape[1]
    left, right = _window(causal, window_size)
    scale = _scale(softmax_scale, head_dim)
    qh = q.to(dtype).transpose(1, 2)
    kh, vh = _heads_first(k, heads_q, dtype), _heads_first(v, heads_q, dtype)
    out = torch.zeros(batch, heads_q, seqlen_q, v.shape[3], dtype=dtype, device=q.device)
    lse = torch.full((batch, heads_q, seqlen_q), float("-inf"), dtype=dtype, device=q.device)

    for m0 in range(0, seqlen_q, block_m):
        m1 = min(m0 + block_m, seqlen_q)
        q_tile = qh[:, :, m0:m1]  # (b, h, BLK_M, d)
        row_max = torch.full((batch, heads_q, m1 - m0), float("-inf"), dtype=dtype, device=q.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros(batch, heads_q, m1 - m0, v.shape[3], dtype=dtype, device=q.device)
        first, last = _key_block_range(m0, m1, seqlen_q, seqlen_k, left, right, block_n)
        for n_block in range(first, last):
            n0, n1 = n_block * block_n, min((n_block + 1) * block_n, seqlen_k)
            s = _capped(q_tile @ kh[:, :, n0:n1].transpose(-1, -2) * scale, softcap)
            tile_mask = visible_mask(seqlen_q, seqlen_k, left, right, q.device, (m0, m1), (n0, n1))
            s = s.masked_fill(~tile_mask, float("-inf"))  # (b, h, BLK_M, BLK_N)
            new_max = torch.maximum(row_max, s.amax(dim=-1))
            shift = torch.where(new_max == float("-inf"), torch.zeros_like(new_max), new_max)
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
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward by recomputation from the LSE (FlashAttention): (dq, dk, dv) in q/k/v layouts.

        P  = exp(S - lse)              (S scaled, softcapped, masked: the forward's scores)
        dV = P^T dO                    D  = rowsum(dO * O)
        dP = dO V^T                    dS = P * (dP - D)
        dS_raw = dS * (1 - tanh^2)     (through the softcap; identity without it)
        dQ = dS_raw K * scale          dK = dS_raw^T Q * scale
    With GQA, dK and dV of the query heads that share a kv head are summed.
    """
    dtype = _compute_dtype(q.dtype, True)
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    left, right = _window(causal, window_size)
    scale = _scale(softmax_scale, head_dim)
    qh = q.to(dtype).transpose(1, 2)
    kh, vh = _heads_first(k, heads_q, dtype), _heads_first(v, heads_q, dtype)
    oh, doh = out.to(dtype).transpose(1, 2), dout.to(dtype).transpose(1, 2)
    lse = lse.to(dtype)

    raw = qh @ kh.transpose(-1, -2) * scale
    if softcap > 0:
        tanh = torch.tanh(raw / softcap)
        s = softcap * tanh
    else:
        s = raw
    mask = visible_mask(seqlen_q, seqlen_k, left, right, device=q.device)
    s = s.masked_fill(~mask, float("-inf"))
    # Rows with lse = -inf saw no key: all their scores are -inf, shift by 0 so P = 0 there.
    shift = torch.where(lse == float("-inf"), torch.zeros_like(lse), lse)
    p = torch.exp(s - shift.unsqueeze(-1))

    dv = p.transpose(-1, -2) @ doh
    dp = doh @ vh.transpose(-1, -2)
    delta = (doh * oh).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta)
    if softcap > 0:
        ds = ds * (1 - tanh * tanh)
    dq = ds @ kh * scale
    dk = ds.transpose(-1, -2) @ qh * scale

    def per_kv_head(t: Tensor) -> Tensor:  # (b, hq, sk, d) -> (b, sk, hkv, d), group-summed
        grouped = t.reshape(batch, heads_kv, heads_q // heads_kv, seqlen_k, t.shape[-1])
        return grouped.sum(dim=2).transpose(1, 2)

    return dq.transpose(1, 2), per_kv_head(dk), per_kv_head(dv)
