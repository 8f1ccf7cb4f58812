"""FA3's ``qv`` (MLA's absorbed decode) as a composite of torch GEMMs: no fused kernel yet.

With q and k of head dim d <= 64 (the rope part), v and qv of head dim dv in [256, 512] (the
latent part), per query head and KV head of its group:

    S[i, j] = softmax_scale * (q[i] . k[j] + qv[i] . v[j])      softcap on the sum, then the mask
    O[i]    = sum_j softmax_j(S)[i, j] * v[j]                    (width dv; lse = logsumexp_j S)

V serves twice: as the second "key" of qv and as the value. The default scale is
1 / sqrt(d + dv), FA3's (_validate.check_qv). Without qv (a KV cache whose v_cache has a head
dim of its own, _validate.check_own_v_cache) the qv . v term is absent and the scale defaults
to 1 / sqrt(d). The mask is the package's (mask.py): bottom-right aligned on each sequence's
attended keys, causal / window / attention_chunk; a row that sees no key gets out 0 and lse
-inf.

The algorithm is the forward kernels', with torch ops for the tiles: query blocks, and for each
an online softmax over key blocks (running row max, row sum and output accumulator), so only one
(query block x key block) score tile exists at a time. Block sizes keep each of the big
temporaries (the score tile, a key block's K / V rows, a query block's accumulator) within
BLOCK_ELEMENTS elements: memory O(block), not O(seqlen_q x seqlen_k). Everything is computed in
fp32 (float64 for float64 inputs, the tests' exact mode) and returned in q's dtype.

Sequences of different lengths (varlen, a KV cache's cache_seqlens / cache_leftpad, a paged
cache, cache_batch_idx) are batched: ``Rows`` gathers row j of every sequence of the batch at
once (a dense entry, a packed offset or a page), reading rows outside a sequence's span as
zeros (unused pages may hold NaN: they never reach a result or a gradient), and the mask hides
them. The work is padded to the longest sequence of the batch; no value is read back to the
host except, in checked calls, the longest lengths (they bound the loops), so an unchecked call
can run under CUDA-graph capture.

Autograd: the composite is made of differentiable torch ops, so flash_attn_func /
flash_attn_varlen_func give exact gradients for q, k, v and qv (FA3 has no backward for qv). The
running max is detached (the result does not depend on it), and under grad each query block is
checkpointed (its tiles recomputed in the backward), so training memory stays bounded too.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Union

import torch
from torch.utils.checkpoint import checkpoint

from . import _validate, _varlen

# Elements of each big temporary of a block step (fp32: 64 MiB), see _block_sizes.
BLOCK_ELEMENTS = 1 << 24
# The longest key block: a few GEMMs per block step, not thousands of small ones.
MAX_BLOCK_K = 1024

# A length, bound or position per sequence: one int for every sequence, or an int tensor (batch,).
PerSeq = Union[int, torch.Tensor]


class Rows:
    """Row j of each sequence of a batch, from one or more tensors laid out alike:

    - dense: tensors (batch, length, heads, dim); sequence b is entry ``entry[b]`` (None: b);
    - packed: tensors (total, heads, dim); sequence b starts at row ``start[b]``;
    - paged: tensors (num_pages, page_size, heads, dim); row j of sequence b is slot
      j % page_size of page ``table[b, j // page_size]``.

    ``lo`` / ``hi``: each sequence's rows in use, [lo, hi); rows outside it read as zeros.
    ``length``: the positions there are (the loops' bound). Every index is clamped into its
    tensor: an unchecked bad value reads a wrong row at worst, never outside the tensor.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], batch: int, length: int, *,
                 lo: PerSeq = 0, hi: PerSeq | None = None, entry: torch.Tensor | None = None,
                 start: torch.Tensor | None = None, table: torch.Tensor | None = None) -> None:
        self.tensors = tuple(tensors)
        self.batch, self.length = batch, length
        self.lo, self.hi = lo, length if hi is None else hi
        self.entry, self.start, self.table = entry, start, table
        self.heads = self.tensors[0].shape[-2]

    def _full(self, j0: int, j1: int) -> bool:
        """Whether rows [j0, j1) are in use in every sequence (known without the values)."""
        return (isinstance(self.lo, int) and isinstance(self.hi, int) and self.lo <= j0
                and j1 <= self.hi)

    def block(self, j0: int, j1: int) -> list[torch.Tensor]:
        """Rows [j0, j1) of every sequence: one (batch, j1 - j0, heads, dim) per tensor."""
        t0 = self.tensors[0]
        device = t0.device
        if self.start is None and self.table is None and self.entry is None:
            parts = [t[:, j0:j1] for t in self.tensors]  # views
        else:
            pos = torch.arange(j0, j1, device=device)
            if self.table is not None:
                num_pages, page_size = t0.shape[0], t0.shape[1]
                column = (pos // page_size).clamp_(max=self.table.shape[1] - 1)
                index = (self.table.long()[:, column].clamp_(0, num_pages - 1),
                         (pos % page_size)[None, :])
            elif self.start is not None:
                total = t0.shape[0]
                if total == 0:  # no rows at all: every sequence is empty
                    return [t.new_zeros(self.batch, j1 - j0, *t.shape[1:]) for t in self.tensors]
                index = ((self.start.long()[:, None] + pos[None, :]).clamp_(0, total - 1),)
            else:
                entries = self.entry.long().clamp(0, t0.shape[0] - 1)
                index = (entries[:, None], pos.clamp(max=t0.shape[1] - 1)[None, :])
            parts = [t[index] for t in self.tensors]
        if self._full(j0, j1):
            return parts
        pos = torch.arange(j0, j1, device=device)[None, :]
        used = (pos >= _per_seq(self.lo, 2)) & (pos < _per_seq(self.hi, 2))  # (batch | 1, n)
        return [torch.where(used[:, :, None, None], x, x.new_zeros(())) for x in parts]


def _per_seq(x: PerSeq, dims: int) -> PerSeq:
    """A per-sequence value as a (batch, 1, ...) tensor of ``dims`` dims that broadcasts."""
    return x.long().view(-1, *([1] * (dims - 1))) if isinstance(x, torch.Tensor) else x


def _visible(rows: tuple[int, int], cols: tuple[int, int], q_len: PerSeq, lo: PerSeq,
             hi: PerSeq, left: int, right: int, chunk: int,
             device: torch.device) -> torch.Tensor | None:
    """(batch | 1, rows, cols) bool: whether query row i in [rows) sees the key at position j
    in [cols), or None when every pair of the tile is visible. The package's mask (mask.py) on
    each sequence's attended keys [lo, hi) and its q_len rows, bottom-right aligned: with
    jj = j - lo and the row's diagonal key diag = i + (hi - lo) - q_len,

        i < q_len, 0 <= jj, j < hi,  diag - left <= jj (left >= 0),  jj <= diag + right
        (right >= 0),  floor(diag / chunk) == floor(jj / chunk) (chunk > 0)."""
    plain = all(isinstance(x, int) for x in (q_len, lo, hi)) and left < 0 and right < 0
    if plain and chunk <= 0 and rows[1] <= q_len and lo <= cols[0] and cols[1] <= hi:
        return None
    i = torch.arange(*rows, device=device).view(1, -1, 1)
    j = torch.arange(*cols, device=device).view(1, 1, -1)
    q_len, lo, hi = (_per_seq(x, 3) for x in (q_len, lo, hi))
    jj = j - lo
    diag = i + (hi - lo) - q_len
    visible = (i < q_len) & (jj >= 0) & (j < hi)
    if left >= 0:
        visible = visible & (jj >= diag - left)
    if right >= 0:
        visible = visible & (jj <= diag + right)
    if chunk > 0:
        visible = visible & (torch.div(diag, chunk, rounding_mode="floor")
                             == torch.div(jj, chunk, rounding_mode="floor"))
    return visible


def _key_span(i0: int, i1: int, q_len: PerSeq, lo: PerSeq, hi: PerSeq, left: int, right: int,
              chunk: int, length: int) -> tuple[int, int]:
    """The key positions query rows [i0, i1) may see: exact bounds when the lengths are ints
    (causal and windowed calls skip the blocks nobody sees), else every position."""
    if not all(isinstance(x, int) for x in (q_len, lo, hi)):
        return 0, length
    last = min(i1, q_len) - 1
    if last < i0 or hi <= lo:
        return 0, 0
    keys = hi - lo
    diag0, diag1 = i0 + keys - q_len, last + keys - q_len
    first, stop = 0, keys  # relative to lo
    if left >= 0:
        first = max(first, diag0 - left)
    if right >= 0:
        stop = min(stop, diag1 + right + 1)
    if chunk > 0:
        first = max(first, (diag0 // chunk) * chunk)
        stop = min(stop, (diag1 // chunk + 1) * chunk)
    return (lo + first, lo + stop) if first < stop else (0, 0)


def _block_sizes(batch: int, heads_q: int, heads_kv: int, head_dim: int, head_dim_v: int,
                 seqlen_q: int, seqlen_k: int, budget: int) -> tuple[int, int]:
    """(block_q, block_k) keeping within ``budget`` elements each: a key block's K / V rows
    (batch, block_k, heads_kv, d + dv), the score tile (batch, heads_q, block_q, block_k) and a
    query block's accumulator (batch, heads_q, block_q, dv)."""
    block_k = min(max(seqlen_k, 1), MAX_BLOCK_K,
                  budget // max(batch * heads_kv * (head_dim + head_dim_v), 1))
    block_k = max(block_k, 1)
    per_row = batch * heads_q * max(block_k, head_dim_v)
    block_q = max(1, min(max(seqlen_q, 1), budget // max(per_row, 1)))
    return block_q, block_k


def attention(queries: Rows, keys: Rows, *, softmax_scale: float, window: tuple[int, int],
              softcap: float, chunk: int = 0, block_q: int | None = None,
              block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The composite: queries' tensors (q, qv) or (q,) (no qv term), keys' tensors (k, v);
    query rows in use [0, queries.hi) (queries.lo must be 0), keys attended [keys.lo, keys.hi)
    per sequence.
    Returns out (batch, queries.length, heads_q, dv) in q's dtype and lse (batch, heads_q,
    queries.length) in the compute dtype (fp32; float64 for float64 inputs); rows past a
    sequence's q_len get out 0 and lse -inf. block_q / block_k: tile sizes (tests), default
    from BLOCK_ELEMENTS."""
    q, qv = queries.tensors[0], (queries.tensors[1:] or (None,))[0]
    k, v = keys.tensors
    batch, heads_q, heads_kv = queries.batch, q.shape[-2], k.shape[-2]
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    seqlen_q = queries.length
    compute = torch.promote_types(q.dtype, torch.float32)
    auto_q, auto_k = _block_sizes(batch, heads_q, heads_kv, head_dim, head_dim_v, seqlen_q,
                                  keys.length, BLOCK_ELEMENTS)
    block_q, block_k = block_q or auto_q, block_k or auto_k
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, qv, k, v))
    recompute = grad and not torch.compiler.is_compiling()
    left, right = window
    outs, lses = [], []
    for i0 in range(0, seqlen_q, block_q):
        i1 = min(seqlen_q, i0 + block_q)
        span = _key_span(i0, i1, queries.hi, keys.lo, keys.hi, left, right, chunk, keys.length)
        step = functools.partial(_query_block, keys=keys, i0=i0, span=span, q_len=queries.hi,
                                 softmax_scale=softmax_scale, window=window, softcap=softcap,
                                 chunk=chunk, block_k=block_k, compute=compute)
        qb, qvb = (queries.block(i0, i1) + [None])[:2]
        out, lse = checkpoint(step, qb, qvb, use_reentrant=False) if recompute else step(qb, qvb)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    if not outs:
        return (q.new_zeros(batch, 0, heads_q, head_dim_v),
                torch.zeros(batch, heads_q, 0, dtype=compute, device=q.device))
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _query_block(qb: torch.Tensor, qvb: torch.Tensor | None, *, keys: Rows, i0: int,
                 span: tuple[int, int], q_len: PerSeq, softmax_scale: float,
                 window: tuple[int, int], softcap: float, chunk: int, block_k: int,
                 compute: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One query block (batch, n, heads_q, d / dv; qvb None: no qv term) against the keys of
    ``span``: the online softmax over key blocks. The query heads of a KV head are stacked as
    rows (row g * n + i: query head kv * group + g, token i), so each K / V block serves its
    whole group in one GEMM.
    Returns out (batch, n, heads_q, dv) and lse (batch, heads_q, n), in ``compute``."""
    batch, n, heads_q = qb.shape[:3]
    heads_kv = keys.heads
    group = heads_q // heads_kv
    rows = group * n

    def stacked(x: torch.Tensor) -> torch.Tensor:  # (batch, n, heads_q, D) -> (batch, kv, rows, D)
        x = x.to(compute).reshape(batch, n, heads_kv, group, x.shape[-1])
        return x.permute(0, 2, 3, 1, 4).reshape(batch, heads_kv, rows, x.shape[-1])

    qh = stacked(qb)
    qvh = stacked(qvb) if qvb is not None else None
    head_dim_v = keys.tensors[1].shape[-1]
    neg_inf = float("-inf")
    row_max = qh.new_full((batch, heads_kv, rows), neg_inf)  # detached: a stabilizer only
    row_sum = qh.new_zeros(batch, heads_kv, rows)
    acc = qh.new_zeros(batch, heads_kv, rows, head_dim_v)
    left, right = window
    for j0 in range(span[0], span[1], block_k):
        j1 = min(span[1], j0 + block_k)
        kb, vb = keys.block(j0, j1)
        kh = kb.to(compute).permute(0, 2, 3, 1)  # (batch, kv, d, nk)
        vh = vb.to(compute).permute(0, 2, 1, 3)  # (batch, kv, nk, dv)
        s = torch.matmul(qh, kh)
        if qvh is not None:
            s = s + torch.matmul(qvh, vh.transpose(-1, -2))
        s = s * softmax_scale
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        visible = _visible((i0, i0 + n), (j0, j1), q_len, keys.lo, keys.hi, left, right, chunk,
                           qb.device)
        if visible is not None:  # (batch | 1, n, nk) onto (batch, kv, group, n, nk)
            s = s.view(batch, heads_kv, group, n, j1 - j0)
            s = s.masked_fill(~visible[:, None, None], neg_inf).view(batch, heads_kv, rows,
                                                                       j1 - j0)
        new_max = torch.maximum(row_max, s.detach().amax(dim=-1))
        ref = torch.where(new_max > neg_inf, new_max, 0.0)  # a row without keys yet: any finite
        p = torch.exp(s - ref[..., None])
        rescale = torch.exp(row_max - ref)
        row_sum = row_sum * rescale + p.sum(dim=-1)
        acc = acc * rescale[..., None] + torch.matmul(p, vh)
        row_max = new_max
    seen = row_sum > 0
    total = torch.where(seen, row_sum, 1.0)
    out = acc / total[..., None]
    ref = torch.where(row_max > neg_inf, row_max, 0.0)
    lse = torch.where(seen, ref + torch.log(total), neg_inf)
    out = out.view(batch, heads_kv, group, n, head_dim_v).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, n, heads_q, head_dim_v), lse.reshape(batch, heads_q, n)


def scatter_rows(padded: torch.Tensor, start: torch.Tensor, q_len: torch.Tensor,
                 total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded per-sequence result (batch, seqlen, ...) back to packed rows (total, ...): row i
    of sequence b to start[b] + i for i < q_len[b]. Returns (rows, covered (total,) bool); rows
    no sequence covers are zeros. The rows outside a span go to one scratch row past the end
    (no data-dependent shapes: capturable)."""
    batch, seqlen = padded.shape[:2]
    i = torch.arange(seqlen, device=padded.device)[None, :]
    target = start.long()[:, None] + i
    target = torch.where((i < q_len.long()[:, None]) & (target < total), target, total)
    target = target.reshape(-1)
    rows = padded.new_zeros(total + 1, *padded.shape[2:])
    rows = rows.index_put((target,), padded.reshape(batch * seqlen, *padded.shape[2:]))
    covered = torch.zeros(total + 1, dtype=torch.bool, device=padded.device)
    covered[target] = True
    return rows[:total], covered[:total]


# --- flash_attn_func and flash_attn_varlen_func with qv --------------------------------------


def func_forward(q: Any, k: Any, v: Any, qv: Any, softmax_scale: Any, causal: Any,
                 window_size: Any, softcap: Any, attention_chunk: int, backend: Any,
                 return_attn_probs: bool, out_dtype: Any = None,
                 fp8_accumulation: Any = "two-level"):
    """flash_attn_func(..., qv=qv): checked here (flash_attn_func has checked the FA3 extras),
    then the composite on q's device. out (batch, seqlen_q, heads_q, dv) in q's dtype, lse fp32
    (batch, heads_q, seqlen_q). out_dtype / fp8_accumulation: as for any 16-bit call (None /
    "two-level"); descales are ignored, as there."""
    names = (("q", q, "(batch, seqlen_q, heads_q, head_dim)"),
             ("k", k, "(batch, seqlen_k, heads_kv, head_dim)"),
             ("v", v, "(batch, seqlen_k, heads_kv, head_dim_v)"),
             ("qv", qv, "(batch, seqlen_q, heads_q, head_dim_v)"))
    for name, t, layout in names:
        _validate._check_tensor(name, t, 4, layout)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k: expected batch (dim 0) == q's {q.shape[0]}, got {k.shape[0]} "
                         f"(shape {tuple(k.shape)})")
    cfg = _validate.check_qv(q, k, v, qv, softmax_scale, causal, window_size, softcap, backend)
    _validate.check_not_fp8_extras(q, None, None, None, out_dtype, fp8_accumulation)
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    out, lse = attention(Rows((q, qv), batch, seqlen_q), Rows((k, v), batch, seqlen_k),
                         softmax_scale=cfg.softmax_scale,
                         window=(cfg.window_left, cfg.window_right), softcap=cfg.softcap,
                         chunk=int(attention_chunk))
    return (out, lse.float()) if return_attn_probs else out


def varlen_forward(q: Any, k: Any, v: Any, qv: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
                   max_seqlen_q: Any, max_seqlen_k: Any, seqused_q: Any, seqused_k: Any,
                   softmax_scale: Any, causal: Any, window_size: Any, softcap: Any,
                   attention_chunk: int, backend: Any, out: Any, return_attn_probs: bool):
    """flash_attn_varlen_func(..., qv=qv): q (total_q, heads_q, d), qv (total_q, heads_q, dv),
    k (total_k, heads_kv, d), v (total_k, heads_kv, dv); sequence b's rows from
    cu_seqlens_q[b] (seqused_q[b] of them, else its span) and keys from cu_seqlens_k[b]. The
    offsets' values are checked as the varlen path's (one read, _varlen.check_offsets) unless
    unchecked; the loops run to the longest sequence (checked) or to max_seqlen_q /
    max_seqlen_k (unchecked: rows past max_seqlen_q get out 0). out (total_q, heads_q, dv) in
    q's dtype (written into ``out`` when given: its rows outside every span keep their values),
    lse fp32 (heads_q, total_q)."""
    for name, t, total in (("q", q, "total_q"), ("k", k, "total_k"), ("v", v, "total_k"),
                           ("qv", qv, "total_q")):
        _varlen._check_packed(name, t, total)
    _varlen._check_offsets_tensor("cu_seqlens_q", cu_seqlens_q, None, q, "batch + 1 offsets")
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q: expected batch + 1 >= 1 entries, got 0")
    batch = cu_seqlens_q.shape[0] - 1
    _varlen._check_offsets_tensor("cu_seqlens_k", cu_seqlens_k, batch + 1, q,
                                  "batch + 1 offsets, as cu_seqlens_q")
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            _varlen._check_offsets_tensor(name, t, batch, q, "one length per sequence")
    max_q = _varlen._check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _varlen._check_max_seqlen("max_seqlen_k", max_seqlen_k)
    cfg = _validate.check_qv(q, k, v, qv, softmax_scale, causal, window_size, softcap, backend)
    total_q, heads_q = q.shape[0], q.shape[1]
    if out is not None:
        want = (total_q, heads_q, cfg.head_dim_v)
        _validate._check_tensor("out", out, 3, "(total_q, heads_q, head_dim_v)")
        if tuple(out.shape) != want or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out: expected shape {want} (total_q, heads_q, qv's head dim), "
                             f"dtype {q.dtype} on {q.device}, got {tuple(out.shape)}, "
                             f"{out.dtype} on {out.device}")
    q_len = seqused_q if seqused_q is not None else cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    k_len = seqused_k if seqused_k is not None else cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    if _varlen.offsets_checked() and batch > 0:  # one read: the values, and the longest spans
        h = _varlen.check_offsets(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, total_q,
                                  k.shape[0])
        spans_q = h.used_q or [b - a for a, b in zip(h.cu_q, h.cu_q[1:])]
        spans_k = h.used_k or [b - a for a, b in zip(h.cu_k, h.cu_k[1:])]
        max_q, max_k = max(spans_q, default=0), max(spans_k, default=0)
    queries = Rows((q, qv), batch, max_q, hi=q_len, start=cu_seqlens_q[:-1])
    keys = Rows((k, v), batch, max_k, hi=k_len, start=cu_seqlens_k[:-1])
    padded, lse = attention(queries, keys, softmax_scale=cfg.softmax_scale,
                            window=(cfg.window_left, cfg.window_right), softcap=cfg.softcap,
                            chunk=int(attention_chunk))
    result, lse = packed_result(padded, lse, cu_seqlens_q[:-1], q_len, total_q, out,
                                return_attn_probs)
    return (result, lse) if return_attn_probs else result


def packed_result(padded: torch.Tensor, lse: torch.Tensor, start: torch.Tensor,
                  q_len: torch.Tensor, total: int, out: torch.Tensor | None,
                  need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """attention()'s padded (out, lse) of packed queries (sequence b's rows from start[b],
    q_len[b] of them) in the varlen layouts: out (total, heads_q, dv), written into ``out`` when
    given (its rows outside every span keep their values, a fresh one has zeros there), and lse
    (heads_q, total) in attention()'s dtype (-inf outside the spans) when need_lse."""
    result, covered = scatter_rows(padded, start, q_len, total)
    if out is not None:
        with torch.no_grad():
            out.copy_(torch.where(covered[:, None, None], result, out))
        result = out
    if not need_lse:
        return result, None
    lse_rows, _ = scatter_rows(lse.transpose(1, 2), start, q_len, total)
    lse_rows = torch.where(covered[:, None], lse_rows, float("-inf"))
    return result, lse_rows.t().contiguous()
