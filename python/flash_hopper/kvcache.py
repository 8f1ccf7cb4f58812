"""flash_attn_with_kvcache: new queries against a KV cache, FA3's signature.

Short queries run on the decode kernel (_decode, kernels/decode/) where the library's policy says
it serves them (fh_decode_select_backend, asked before the append: the decode table's dtypes and
head dims, at most its max_rows packed rows of seqlen_q x heads_q / heads_kv, a GPU whose shared
memory holds it): the query heads of a KV head packed as one tile's rows, the keys split across
CTAs (the splits merged by a combine kernel launched behind it), K / V read in place from a dense
cache or through the page table of a paged one (any page size, any strides), masks, softcap and
sinks in the kernel. FP8 caches too, read as FP8 and widened to 16 bits in the kernel: q, k_cache
and v_cache in e4m3 with q / k / v_descale (FA3's convention, out in bf16), or fp16 / bf16 q against
an e4m3 / e5m2 cache with k / v_descale (the library's mixed mode, out in q's dtype; the decode
kernel is its only route: refused, naming k_cache, where it does not serve the call). New k / v
must be in the cache's dtype (FA3's rule: appended as they are, never quantized here).

Everything else (long queries, other head dims) goes through the varlen kernels
(_varlen.forward): q (batch, seqlen_q, ...) is the packed (batch * seqlen_q, ...) view with
sequences of seqlen_q rows (or, with cu_seqlens_q, already packed); the cache is the packed (rows,
heads_kv, head_dim) view of its rows, sequence b reading cache entry cache_batch_idx[b] (the
library's kv_batch_idx), keys [cache_leftpad[b], cache_seqlens[b] + new_b) (leftpad_k,
seqused_k). Unmasked rows there take _packed_varlen (packed GQA and split-KV at this level). A
paged cache on that path is gathered into a dense copy first and the new keys written back into
the pool (_paged): correct for any page size, with a copy per call.

Masks are bottom-right aligned on the attended keys, as in FA3. New k / v ((batch, seqlen_new,
...) or packed with cu_seqlens_k_new) are written into the cache first, in place, at positions
[cache_seqlens[b], cache_seqlens[b] + new_b) (torch's index_put_: one small kernel; FA3 fuses it
into the attention kernel); in a paged cache at (page_table[b][pos // page_size], pos %
page_size).

Values are checked on the host as the varlen offsets are (one device-to-host copy per call:
cache_seqlens + new_b <= seqlen_cache, cache_batch_idx within the cache or the page table's rows,
cache_leftpad <= the filled length, the offsets non-decreasing within their tensors, the used
pages within the pool), except while a CUDA graph is captured or with
FLASH_HOPPER_CHECK_OFFSETS=0; unchecked bad values then give wrong results but never touch memory
outside the tensors (the append's positions and entries are clamped to the cache, the kernels
clamp every offset, span, entry and page id). Every refusal comes before the append: the route
(the decode kernel only where the device's shared memory holds it), the split count (within the
varlen grid) and the page table's geometry are settled first. Index tensors of any strides are
copied contiguous (the kernels read them by raw pointer).

Rotary embedding (rotary_cos / rotary_sin, FA3's positions and layouts) rotates q and the new
keys in torch before they are attended / appended (fp32 math, one rounding; FP8 q and caches
too, saturated to the FP8 range).

Sinks (a logit per query head joining the softmax denominator, gpt-oss style): in the decode
kernel, else exactly from the kernels' LSE (apply_sinks: out * exp(lse - logaddexp(lse, sink))).

attention_chunk (FA3's chunked-local attention, fp16 / bf16 / e4m3 without sinks, eagerly outside
graph capture): the attended keys gathered and split into chunks on the host (_chunked).

qv (MLA's extra query, FA3's semantics: v_cache with a head dim of its own, 256 to 512, k_cache's
at most 64), and a v_cache with a head dim of its own without qv (FA3's d 192 / dv 128 and d <= 64
/ dv <= 512; fp16 / bf16): their own route, "composite" (_run_composite), through the same checks
and append; the composite path of torch GEMMs (_qv.py, not a fused kernel yet) reads dense or
paged caches in place, a key block at a time; masks (attention_chunk included, also under
capture), sinks and rotary (q and the new keys, never qv) as elsewhere; no key split.

Not yet (each refused naming the argument): attention_chunk with 16-bit q against an FP8
cache, with sinks or under graph capture (off the composite route); 16-bit q against an FP8 cache
off the decode kernel; a v_cache of its own head dim with FP8 inputs.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from . import _autograd, _chunk, _decode, _device, _qv, _validate, _varlen
from ._combine import flash_attn_combine, lse_weights
from ._errors import UnsupportedError
from ._tables import FP8_DTYPES, KV_FP8_DTYPES, TORCH_DTYPES

_INT32_MAX = 2**31 - 1
# The varlen kernels' sequences per call (gridDim.y / z): the packed path's pseudo-sequences
# (batch x key splits) stay within it.
_MAX_SEQUENCES = 65535
_offsets: dict[tuple, torch.Tensor] = {}  # (device, n, step) -> int32 arange, built outside capture
_graph_offsets: dict[tuple, torch.Tensor] = {}  # those a captured call took: never freed


def _arange_offsets(n: int, step: int, device: torch.device) -> torch.Tensor:
    """int32 [0, step, ..., n * step] on device, built once outside capture (_decode.eager_constant:
    a captured call takes it, no arange kernel in the graph: a graph node per call costs a short
    decode step measurably, bench/PERFLOG.md, "Where a short decode call's time goes, and the
    graph around it")."""
    return _decode.eager_constant(_offsets, _graph_offsets, (device, n, step), lambda: torch.arange(
        0, (n + 1) * step, step, dtype=torch.int32, device=device))


def _check_tensor(name: str, t: Any, dims: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {what}, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-D tensor {what}, got shape {tuple(t.shape)}")
    return t


def _check_index(name: str, t: Any, entries: int, q: torch.Tensor, what: str = "q's batch",
                 dtype: torch.dtype = torch.int32) -> torch.Tensor | None:
    """An optional 1-D tensor of ``entries`` values (int32 unless ``dtype``) on q's device.
    Returned contiguous (a copy of a strided or expanded one, e.g. beam search's
    ``zeros(1).expand(4)`` or ``sinks[:, layer]``): the kernels read it by raw pointer."""
    if t is None:
        return None
    kind = "int32" if dtype == torch.int32 else "fp32"
    shape = "batch," if what == "q's batch" else ("heads_q," if what == "heads_q" else what)
    _check_tensor(name, t, 1, f"of {kind} ({shape})")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.shape[0] != entries:
        raise ValueError(f"{name}: expected {entries} entries ({what}), got {t.shape[0]}")
    if t.device != q.device:
        raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got {t.device}")
    return t.contiguous()


def _refuse(name: str, value: Any, why: str) -> None:
    if value is not None:
        raise UnsupportedError(f"{name}: expected None ({why} is not implemented yet), got "
                               f"{type(value).__name__}")


def _rows_view(name: str, cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The cache (batch_cache, seqlen_cache, heads, d) as packed rows (rows, heads, d), a view, and
    the rows from one cache entry to the next (cu_seqlens_k's step)."""
    b, s, h, d = cache.shape
    s0, s1, s2, _ = cache.stride()
    if b == 0 or s == 0:
        return cache.reshape(b * s, h, d), s
    if s1 <= 0 or s0 % s1 or s0 // s1 < s:
        raise ValueError(f"{name}: expected an entry stride that is a whole number of rows of at "
                         f"least seqlen_cache ({s}) (stride(0) = k * stride(1)), got strides "
                         f"{cache.stride()}")
    step = s0 // s1
    rows = (b - 1) * step + s
    if b * step >= 2**31:
        raise ValueError(f"{name}: expected at most 2^31 - 1 rows in the cache (int32 offsets), "
                         f"got {b} entries of {step} rows")
    return cache.as_strided((rows, h, d), (s1, s2, 1), cache.storage_offset()), step


def _check_values(cache_seqlens: torch.Tensor, new: int | None, seqlen_cache: int,
                  batch_cache: int, cache_batch_idx: torch.Tensor | None,
                  cache_leftpad: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                  total_q: int, cu_seqlens_k_new: torch.Tensor | None, total_new: int,
                  max_seqlen_q: int | None = None) -> None:
    """One device-to-host copy of the per-sequence values and their rules. new: the new keys per
    sequence (None: cu_seqlens_k_new gives them). max_seqlen_q (varlen queries): at least every
    sequence's query count (the kernels size their grids by it)."""
    named = [("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
             ("cache_leftpad", cache_leftpad), ("cu_seqlens_q", cu_seqlens_q),
             ("cu_seqlens_k_new", cu_seqlens_k_new)]
    named = [(name, t) for name, t in named if t is not None]
    host = torch.cat([t for _, t in named]).cpu().tolist()
    values, pos = {}, 0
    for name, t in named:
        values[name], pos = host[pos:pos + t.shape[0]], pos + t.shape[0]
    for name, total, src in (("cu_seqlens_q", total_q, "q.shape[0]"),
                             ("cu_seqlens_k_new", total_new, "k.shape[0]")):
        offsets = values.get(name)
        if offsets is None:
            continue
        if offsets[0] != 0:
            raise ValueError(f"{name}: expected 0 at index 0, got {offsets[0]}")
        for i in range(1, len(offsets)):
            if offsets[i] < offsets[i - 1]:
                raise ValueError(f"{name}: expected non-decreasing offsets, got "
                                 f"{offsets[i - 1]} then {offsets[i]} at index {i}")
        exact = name == "cu_seqlens_k_new"  # the new keys are packed: all of them used
        if (offsets[-1] != total) if exact else (offsets[-1] > total):
            want = "=" if exact else "<="
            raise ValueError(f"{name}: expected the last offset {want} {src} ({total}), got "
                             f"{offsets[-1]}")
    offsets = values.get("cu_seqlens_q")
    if offsets is not None and max_seqlen_q is not None:
        for b in range(len(offsets) - 1):
            if offsets[b + 1] - offsets[b] > max_seqlen_q:
                raise ValueError(f"max_seqlen_q: expected at least every sequence's query count, "
                                 f"got {max_seqlen_q} with sequence {b} of "
                                 f"{offsets[b + 1] - offsets[b]} (cu_seqlens_q)")
    lengths = values["cache_seqlens"]
    idx, lead = values.get("cache_batch_idx"), values.get("cache_leftpad")
    cu_new = values.get("cu_seqlens_k_new")
    for b, length in enumerate(lengths):
        added = new if cu_new is None else cu_new[b + 1] - cu_new[b]
        if length < 0 or length + added > seqlen_cache:
            raise ValueError(
                f"cache_seqlens: expected 0 <= cache_seqlens[{b}] <= seqlen_cache - its new keys "
                f"({seqlen_cache} - {added} = {seqlen_cache - added}), got {length}")
        if idx is not None and not 0 <= idx[b] < batch_cache:
            raise ValueError(f"cache_batch_idx: expected 0 <= cache_batch_idx[{b}] < "
                             f"k_cache.shape[0] ({batch_cache}), got {idx[b]}")
        if lead is not None and not 0 <= lead[b] <= length + added:
            raise ValueError(f"cache_leftpad: expected 0 <= cache_leftpad[{b}] <= cache_seqlens"
                             f"[{b}] + its new keys ({length + added}), got {lead[b]}")


def _unwindowed(causal: Any, window_size: Any) -> bool:
    """Neither causal nor a window: FA3 rotates every query at the one position cache_seqlens."""
    if causal:
        return False
    return all(int(x) < 0 for x in window_size)


def _check_rotary(cos: Any, sin: Any, seqlens: Any, q: torch.Tensor, k: Any, head_dim: int,
                  batch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """FA3's rotary arguments: cos / sin (seqlen_ro, rotary_dim / 2) in q's dtype (or fp32;
    e4m3 for FP8 q, as FA3), rotary_dim <= head_dim and a multiple of 16, new k / v given;
    rotary_seqlens int32 (batch,). Returns (cos, sin) or None (no rotary)."""
    if cos is None and sin is None:
        return None
    if cos is None or sin is None:
        raise ValueError("rotary_cos / rotary_sin: expected both or neither, got "
                         f"{type(cos).__name__} and {type(sin).__name__}")
    if k is None:
        raise ValueError("rotary_cos: expected new k / v with it (FA3 rotates the keys it "
                         "appends), got k None")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        _check_tensor(name, t, 2, "(seqlen_ro, rotary_dim / 2)")
        if t.dtype not in (q.dtype, torch.float32):
            raise ValueError(f"{name}: expected q's dtype {q.dtype} or torch.float32, got "
                             f"{t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {t.device}")
    if tuple(sin.shape) != tuple(cos.shape):
        raise ValueError(f"rotary_sin: expected rotary_cos's shape {tuple(cos.shape)}, got "
                         f"{tuple(sin.shape)}")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim > head_dim or rotary_dim % 16 or rotary_dim == 0:
        raise ValueError(f"rotary_cos: expected rotary_dim = 2 * rotary_cos.shape[1] a multiple "
                         f"of 16 in [16, head_dim = {head_dim}], got {rotary_dim}")
    if cos.shape[0] == 0:
        raise ValueError("rotary_cos: expected seqlen_ro >= 1 positions, got 0")
    _check_index("rotary_seqlens", seqlens, batch, q)
    return cos, sin


def _packed_index(cu: torch.Tensor, total: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, index within it) of each of ``total`` packed tokens, from the offsets ``cu``
    (int64; tokens past the last offset count as the last sequence's: never an index error)."""
    token = torch.arange(total, device=cu.device, dtype=torch.int32)
    seq = torch.searchsorted(cu[1:], token, right=True).clamp_(0, max(batch - 1, 0))
    return seq, (token - cu[seq]).long()


def _new_key_index(batch: int, new: int | None, cu_new: torch.Tensor | None, total_new: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, index among its new keys) of each new key, in k's layout: (batch, seqlen_new)
    for k (batch, seqlen_new, ...), (total_new,) for packed k (new None: cu_new gives them)."""
    if new is None:
        return _packed_index(cu_new, total_new, batch)
    seq = torch.arange(batch, device=device)[:, None].expand(batch, new)
    return seq, torch.arange(new, device=device)[None].expand(batch, new)


def _append_slots(seq: torch.Tensor, index: torch.Tensor, cache_seqlens: torch.Tensor,
                  seqlen_cache: int, batch_cache: int, cache_batch_idx: torch.Tensor | None,
                  pages: tuple[torch.Tensor, int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where new key ``index`` of sequence ``seq`` goes: (cache entry or pool page, position in
    it), at cache_seqlens[seq] + index. Every value is clamped into the cache (the position to
    [0, seqlen_cache), the entry to [0, batch_cache), a page id to the pool), so an unchecked call
    (graph capture, FLASH_HOPPER_CHECK_OFFSETS=0) writes wrong rows at worst, never outside the
    cache and never a device assert."""
    pos = (cache_seqlens.long()[seq] + index).clamp_(0, max(seqlen_cache - 1, 0))
    if pages is not None:  # position -> (page, slot) through the table
        table, num_pages, page_size = pages
        return table.long()[seq, pos // page_size].clamp_(0, num_pages - 1), pos % page_size
    if cache_batch_idx is not None:
        return cache_batch_idx.long().clamp(0, max(batch_cache - 1, 0))[seq], pos
    return seq, pos


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
            interleaved: bool = True) -> torch.Tensor:
    """x (..., heads, d) with its first rotary_dim features rotated at positions pos (...)
    (clamped into cos / sin: unchecked values never index outside them), in fp32, then x's
    dtype (an FP8 x saturated to its largest finite value: a rotated pair can grow by sqrt(2);
    its descale, one per (sequence, head), commutes with the rotation). Interleaved (GPT-J):
    pairs (0, 1), (2, 3), ...; else (GPT-NeoX) pairs (i, i + r/2)."""
    half = cos.shape[1]
    pos = pos.clamp(0, cos.shape[0] - 1)

    def take(table: torch.Tensor) -> torch.Tensor:  # rows pos of the table, in fp32
        if table.dtype in KV_FP8_DTYPES:  # gathered as bytes: not every build indexes float8
            return table.view(torch.uint8)[pos].view(table.dtype).float()
        return table[pos].float()

    c, s = take(cos).unsqueeze(-2), take(sin).unsqueeze(-2)  # (..., n, 1, r/2)
    xr = x[..., :2 * half].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    if x.dtype in KV_FP8_DTYPES:
        top = torch.finfo(x.dtype).max
        rot = rot.clamp(-top, top)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def _check_sinks(sinks: Any, heads_q: int, q: torch.Tensor,
                 name: str = "sinks") -> torch.Tensor | None:
    """sinks: fp32 (heads_q,) on q's device, one logit per query head (gpt-oss style)."""
    return _check_index(name, sinks, heads_q, q, "heads_q", torch.float32)


def check_sinks(sinks: Any, q: Any, name: str = "sinks") -> torch.Tensor | None:
    """_check_sinks for a q whose heads are its dim -2 (other entry points: vllm.py)."""
    if sinks is None:
        return None
    if not isinstance(q, torch.Tensor) or q.dim() < 2:
        raise TypeError(f"q: expected a torch.Tensor (..., heads, head_dim), got "
                        f"{type(q).__name__}")
    return _check_sinks(sinks, q.shape[-2], q, name)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                heads_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with a per-head sink logit from attention without it, exactly: the sink joins
    each row's softmax denominator without a value, so with L = logaddexp(lse, sink)
    out_sink = out * exp(lse - L) and lse_sink = L (a row without keys: out 0, lse = sink).
    lse fp32 with the heads on dim ``heads_dim``; out with the heads on its dim -2. Returns
    (out_sink in out's dtype, lse_sink)."""
    shape = [1] * lse.dim()
    shape[heads_dim] = -1
    sink = sinks.view(shape)
    total = torch.logaddexp(lse, sink)
    # the sink is a partial without a value: only out's own weight scales it (a row without keys
    # and a sink of -inf: an empty denominator, weight 0)
    (factor,) = lse_weights(total, lse)  # (.., heads, ..) as lse
    # the factor per (row, head) in out's layout: heads on out's dim -2, rows as in lse
    # (batch, heads, seqlen) -> (batch, seqlen, heads, 1); (heads, total) -> (total, heads, 1)
    f = factor.movedim(heads_dim, -1).unsqueeze(-1)
    return (out.float() * f).to(out.dtype), total


def _check_cache_shapes(k_cache: torch.Tensor, v_cache: torch.Tensor, own_v: bool) -> None:
    """v_cache shaped as k_cache; with own_v (qv calls, or a v_cache of its own head dim) but
    for its head dim."""
    if own_v and tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise ValueError(f"v_cache: expected k_cache's dims but the last "
                         f"{tuple(k_cache.shape[:3])} (v_cache has a head dim of its own), got "
                         f"{tuple(v_cache.shape)}")
    if not own_v and tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache: expected k_cache's shape {tuple(k_cache.shape)}, got "
                         f"{tuple(v_cache.shape)}")


def _check_page_table(page_table: Any, k_cache: Any, v_cache: Any, q: Any, k: Any,
                      cache_batch_idx: Any, cu_seqlens_q: Any,
                      own_v: bool = False) -> tuple[torch.Tensor, int, int]:
    """The page table's and the pool's checks; returns (the page table's rows of the batch in
    order (cache_batch_idx applied), num_pages, page_size). own_v: v_cache has a head dim of
    its own (the composite route's calls)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if k is not None and not isinstance(k, torch.Tensor):
        raise TypeError(f"k: expected None or a torch.Tensor, got {type(k).__name__}")
    if not isinstance(page_table, torch.Tensor):
        raise TypeError(f"page_table: expected a torch.Tensor of int32 (batch, max_pages), got "
                        f"{type(page_table).__name__}")
    if page_table.dtype != torch.int32 or page_table.dim() != 2:
        raise ValueError(f"page_table: expected an int32 2-D tensor (batch, max_pages), got "
                         f"{page_table.dtype} of shape {tuple(page_table.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t, 4, "(num_pages, page_size, heads_kv, head_dim) with page_table")
    _check_cache_shapes(k_cache, v_cache, own_v)
    if page_table.device != k_cache.device:
        raise ValueError(f"page_table: expected the cache's device {k_cache.device}, got "
                         f"{page_table.device}")
    num_pages, page_size = k_cache.shape[:2]
    if num_pages == 0 or page_size == 0:
        raise ValueError(f"k_cache: expected at least one page of at least one slot, got shape "
                         f"{tuple(k_cache.shape)}")
    if page_table.shape[1] * page_size > _INT32_MAX:
        raise ValueError(f"page_table: expected max_pages * page_size <= 2**31 - 1 keys per "
                         f"sequence (int32 positions), got {page_table.shape[1]} * {page_size}")
    batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    if cache_batch_idx is not None:
        entries = _check_index("cache_batch_idx", cache_batch_idx, batch, q)
        rows = page_table.shape[0]
        if rows == 0:
            raise ValueError("page_table: expected rows for cache_batch_idx to pick, got 0")
        if _varlen.offsets_checked() and batch > 0:  # as the dense path's check of the index
            bad = (entries < 0) | (entries >= rows)
            if bool(bad.any()):
                b = int(bad.nonzero()[0, 0])
                raise ValueError(f"cache_batch_idx: expected 0 <= cache_batch_idx[{b}] < "
                                 f"page_table.shape[0] ({rows}), got {int(entries[b])}")
        # unchecked (graph capture, FLASH_HOPPER_CHECK_OFFSETS=0): clamped to the table's rows
        table = page_table[entries.long().clamp(0, rows - 1)]
    else:
        if page_table.shape[0] != batch:
            raise ValueError(f"page_table: expected {batch} rows (q's batch) without "
                             f"cache_batch_idx, got {page_table.shape[0]}")
        table = page_table
    if table.shape[0] and (table.stride(1) != 1 or table.stride(0) < table.shape[1]):
        table = table.contiguous()  # the kernel reads rows of max_pages contiguous entries
    return table, num_pages, page_size


def _longest_q(q: torch.Tensor, k_cache: torch.Tensor, cu_seqlens_q: Any,
               max_seqlen_q: Any) -> int:
    """The query tokens of the longest sequence, as the decode route sizes its grid (seqlen_q; a
    varlen call's max_seqlen_q, or all its rows without one); 0 for shapes the full checks will
    refuse."""
    varlen = isinstance(cu_seqlens_q, torch.Tensor)
    if q.dim() != (3 if varlen else 4) or q.shape[-2] % k_cache.shape[2]:
        return 0
    return q.shape[1] if not varlen else (
        int(max_seqlen_q) if isinstance(max_seqlen_q, numbers.Integral) else q.shape[0])


def _paged(*, page_table, k_cache, v_cache, cache_batch_idx, **call):
    """A paged cache the decode kernel does not serve (FP8, long queries, other head dims):
    each sequence's used pages gathered into a dense copy (one index kernel; table entries
    clamped into the pool, so garbage there is never an index error), the dense path run on it
    (every check, the new keys appended into the copy, attention), then the new keys written into
    the pool's pages. Correct for any page size; costs a copy of the used pages per call.

    The copy holds the first ``used`` columns of the table for every sequence, ``used`` the most
    pages any sequence fills (its keys plus its new keys; one read of the lengths where the call
    is checked), so its size follows the longest sequence, not the table's width (a vLLM block
    table is as wide as the model's context). Unchecked calls (CUDA-graph capture,
    FLASH_HOPPER_CHECK_OFFSETS=0) cannot read the lengths and copy every column.
    """
    q, k = call["q"], call["k"]
    table, num_pages, page_size = _check_page_table(page_table, k_cache, v_cache, q, k,
                                                    cache_batch_idx, call["cu_seqlens_q"])
    batch = table.shape[0]
    capacity = table.shape[1] * page_size
    cu_new = call["cu_seqlens_k_new"]
    lengths = call["cache_seqlens"]  # as the dense path reads it: None = pages full (new keys last)
    if lengths is None and cu_new is None:
        lengths = capacity - (0 if k is None else k.shape[1])
    if isinstance(lengths, numbers.Integral) and not isinstance(lengths, bool):
        lengths = torch.full((batch,), int(lengths), dtype=torch.int32, device=q.device)
    columns = table.shape[1]
    new_ok = k is None or (k.dim() == 4 if cu_new is None else (
        k.dim() == 3 and isinstance(cu_new, torch.Tensor) and cu_new.dtype == torch.int32
        and tuple(cu_new.shape) == (batch + 1,) and cu_new.device == q.device))
    if (_varlen.offsets_checked() and batch > 0 and isinstance(lengths, torch.Tensor)
            and lengths.shape == (batch,) and lengths.dtype == torch.int32
            and lengths.device == q.device and new_ok):
        lengths = lengths.contiguous()
        _check_pages(table, lengths, k, cu_new, page_size, num_pages)
        used = _used_pages(lengths, k, cu_new, page_size, capacity)
        most, least = torch.stack((used.max(), lengths.min().long())).tolist()  # one read
        if least >= 0:  # a negative length is refused by the dense path: naming the table's
            columns = max(1, min(columns, most))  # capacity, so the copy keeps every column
    pages = table[:, :columns].long().clamp(0, num_pages - 1)  # (batch, columns)
    dense_k = k_cache[pages].reshape(batch, columns * page_size, *k_cache.shape[2:])
    dense_v = v_cache[pages].reshape(batch, columns * page_size, *v_cache.shape[2:])
    if columns < table.shape[1]:  # the copy is shorter than the table: lengths say where
        call["cache_seqlens"] = lengths
    result = flash_attn_with_kvcache(k_cache=dense_k, v_cache=dense_v, cache_batch_idx=None,
                                     page_table=None, **call)
    if k is not None and batch > 0:  # the new keys, now in the copy, into the pool's pages
        seq, index = _new_key_index(batch, None if cu_new is not None else k.shape[1], cu_new,
                                    k.shape[0], q.device)
        pos = (lengths.long()[seq] + index).clamp(0, columns * page_size - 1)
        page, slot = pages[seq, pos // page_size], pos % page_size
        with torch.no_grad():
            k_cache[page, slot] = dense_k[seq, pos]
            v_cache[page, slot] = dense_v[seq, pos]
    return result


def _used_pages(seqlens: torch.Tensor, k: Any, cu_new: Any, page_size: int,
                capacity: int) -> torch.Tensor:
    """The pages each sequence fills (its keys and its new keys; lengths clamped to
    [0, capacity], so a bad length counts as a full table and the dense path's check names it)."""
    if k is None:
        added = torch.zeros_like(seqlens)
    elif cu_new is not None:
        added = cu_new[1:] - cu_new[:-1]
    else:
        added = torch.full_like(seqlens, k.shape[1])
    keys = (seqlens.long().clamp(0, capacity) + added.long().clamp(min=0)).clamp(max=capacity)
    return (keys + page_size - 1) // page_size


def _check_pages(table: torch.Tensor, seqlens: torch.Tensor, k: Any, cu_new: Any,
                 page_size: int, num_pages: int) -> None:
    """The used page-table entries (the pages holding positions below cache_seqlens + the new
    keys) within the pool; unused entries may hold anything. Found on the device, one scalar
    copied back (a table of 10^5 entries read into Python cost milliseconds per call); the first
    bad entry is located on the host only when there is one."""
    used = _used_pages(seqlens, k, cu_new, page_size, table.shape[1] * page_size)  # (batch,)
    columns = torch.arange(table.shape[1], device=table.device)
    bad = ((table < 0) | (table >= num_pages)) & (columns[None, :] < used[:, None])
    if not bool(bad.any()):
        return
    b, i = (int(x) for x in bad.nonzero()[0])
    raise ValueError(f"page_table: expected page_table[{b}][{i}] (a page holding sequence {b}'s "
                     f"keys) in [0, num_pages = {num_pages}), got {int(table[b, i])}")


# Split-KV: a split is worth its combine only with at least this many keys.
_MIN_KEYS_PER_SPLIT = 1024
_MAX_SPLITS = 64


def _splits(num_splits: int, batch: int, rows: int, heads_kv: int, seqlen_cache: int,
            device: torch.device) -> int:
    """The key splits of a packed decode call: num_splits when > 0 (FA3's meaning; 1 = none), else
    enough to give every SM a tile when the tiles are few and the keys many (shapes only, so a
    captured graph's choice holds for every replay). Never more than the varlen kernels'
    sequences per call allow (batch x splits pseudo-sequences), so the packed path cannot be
    refused after the cache was written."""
    cap = max(1, min(_MAX_SPLITS, _MAX_SEQUENCES // max(batch, 1)))
    if num_splits > 0:
        return min(num_splits, cap)
    return min(_heuristic_splits(batch, rows, heads_kv, seqlen_cache, device), cap)


def _heuristic_splits(batch: int, rows: int, heads_kv: int, seqlen_cache: int,
                      device: torch.device) -> int:
    tiles = batch * heads_kv * -(-rows // 128)
    try:
        sms = _device.device_info(device.index if device.index is not None
                                  else torch.cuda.current_device()).sm_count
    except Exception:  # noqa: BLE001 - no device query: no split
        return 1
    # no rows (an unchecked max_seqlen_q of 0, as under graph capture): nothing to split
    if tiles == 0 or tiles >= 0.8 * sms:
        return 1
    return max(1, min(-(-sms // tiles), seqlen_cache // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS))


# get_scheduler_metadata's tensor: int32 [tag, splits, batch, max_seqlen_q, max_seqlen_k,
# heads_q, heads_kv, head_dim, decode_splits, head_dim_v]; its host copy rides along as the
# tensor's
# attribute (reading the device values back would cost a synchronization per call). splits:
# the varlen path's key splits; decode_splits: the decode kernel's num_splits (0: its own
# shape-only heuristic, fh_decode_plan, the same at every replay).
_METADATA_TAG = 0x46484D33  # "FHM3"
_METADATA_FIELDS = ("splits", "batch", "max_seqlen_q", "max_seqlen_k", "heads_q", "heads_kv",
                    "head_dim", "decode_splits", "head_dim_v")


def get_scheduler_metadata(
    batch_size: int, max_seqlen_q: int, max_seqlen_k: int, num_heads_q: int, num_heads_kv: int,
    headdim: int, cache_seqlens: torch.Tensor, qkv_dtype: torch.dtype = torch.bfloat16,
    headdim_v: int | None = None, cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
    page_size: int | None = None, max_seqlen_k_new: int = 0, causal: bool = False,
    window_size: Sequence[int] = (-1, -1), attention_chunk: int = 0, has_softcap: bool = False,
    num_splits: int = 0, pack_gqa: bool | None = None, sm_margin: int = 0,
) -> torch.Tensor:
    """FA3's get_scheduler_metadata (its parameters and order): the scheduling decision of
    flash_attn_with_kvcache calls of this shape, made once (outside a CUDA graph) and passed to
    each call as ``scheduler_metadata``: the key-split count (num_splits itself, or for
    num_splits=0 the varlen path's heuristic; the decode kernel's own heuristic is shape-only, so
    it is taken at each call and agrees between replays). The values that change per step
    (cache_seqlens, leftpad) are read by each call, so one metadata serves every step of a decode
    loop with the same shapes. A call whose shapes differ from the metadata's raises, naming
    both. headdim_v: None or headdim, or a V head dim of its own (qv calls, MLA: headdim <= 64
    with headdim_v in [256, 512], e.g. 64 / 512; without qv: e.g. 192 / 128); their composite
    path does not split, the metadata only checks their shapes."""
    for name, value in (("batch_size", batch_size), ("max_seqlen_q", max_seqlen_q),
                        ("max_seqlen_k", max_seqlen_k), ("num_heads_q", num_heads_q),
                        ("num_heads_kv", num_heads_kv), ("headdim", headdim)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise TypeError(f"{name}: expected an int >= 0, got {value!r}")
        if value >= 2**31:  # the metadata tensor is int32
            raise ValueError(f"{name}: expected an int in [0, 2**31), got {value}")
    if num_heads_kv == 0 or num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_kv: expected a divisor of num_heads_q ({num_heads_q}), got "
                         f"{num_heads_kv}")
    if headdim_v is None:
        headdim_v = headdim
    elif headdim_v != headdim:  # a V head dim of its own: the composite route's calls
        if isinstance(headdim_v, bool) or not isinstance(headdim_v, numbers.Integral):
            raise TypeError(f"headdim_v: expected None or an int, got {headdim_v!r}")
        _validate.check_own_v_head_dims(headdim, headdim_v, "headdim", "headdim_v")
    if page_size is not None and (isinstance(page_size, bool)
                                  or not isinstance(page_size, numbers.Integral)
                                  or page_size < 1):
        raise TypeError(f"page_size: expected None or an int >= 1, got {page_size!r}")
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected a torch.Tensor of int32 (batch,), got "
                        f"{type(cache_seqlens).__name__}")
    # attention_chunk: accepted (its calls split on the host; the metadata does not apply)
    _validate.check_fa3_extras(attention_chunk, num_splits, pack_gqa, sm_margin,
                               chunk_served=True)
    group = num_heads_q // num_heads_kv
    splits = _splits(num_splits, batch_size, max_seqlen_q * group, num_heads_kv, max_seqlen_k,
                     cache_seqlens.device) if cache_seqlens.is_cuda else max(num_splits, 1)
    values = (splits, batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
              min(num_splits, _decode.INT32_MAX), int(headdim_v))
    meta = torch.tensor((_METADATA_TAG, *values), dtype=torch.int32, device=cache_seqlens.device)
    meta.flash_hopper_schedule = dict(zip(_METADATA_FIELDS, values))
    return meta


def _metadata_splits(meta: Any, **shape: int) -> tuple[int, int]:
    """The split counts a scheduler_metadata tensor holds (the varlen path's, the decode
    kernel's), after checking it was made for this call's shapes."""
    if not isinstance(meta, torch.Tensor):
        raise TypeError(f"scheduler_metadata: expected None or get_scheduler_metadata's tensor, "
                        f"got {type(meta).__name__}")
    schedule = getattr(meta, "flash_hopper_schedule", None)
    if (schedule is None or meta.dtype != torch.int32
            or tuple(meta.shape) != (1 + len(_METADATA_FIELDS),)):
        raise ValueError(f"scheduler_metadata: expected the tensor flash_hopper's "
                         f"get_scheduler_metadata returned (int32 ({1 + len(_METADATA_FIELDS)},) "
                         f"with its schedule), got {meta.dtype} {tuple(meta.shape)}")
    for name, value in shape.items():
        if schedule[name] != value:
            raise ValueError(f"scheduler_metadata: made for {name} = {schedule[name]}, this call "
                             f"has {value}")
    return schedule["splits"], schedule["decode_splits"]


def _chunked(q_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             cu_q: torch.Tensor, used_k: torch.Tensor, cache_batch_idx: torch.Tensor | None,
             cache_leftpad: torch.Tensor | None, chunk: int, cfg: Any,
             out_rows: torch.Tensor | None,
             descales: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FA3's attention_chunk on a dense cache (after the append): each sequence's attended keys
    (positions [cache_leftpad, used_k), the chunk rule counting from cache_leftpad as FA3's)
    gathered into one packed K / V, then the varlen chunk split (_chunk.varlen_forward). One
    device-to-host copy of the lengths, one gather of the attended keys (the price of serving it
    without a kernel of its own). descales: an FP8 call's (q, k, v) descales, None for 16-bit."""
    batch, seqlen_cache = cu_q.shape[0] - 1, k_cache.shape[1]
    parts = [cu_q, used_k] + ([cache_leftpad] if cache_leftpad is not None else [])
    host = torch.cat([t.to(torch.int32) for t in parts]).cpu().tolist()  # one read
    cq, host = host[:batch + 1], host[batch + 1:]
    ends = [min(max(e, 0), seqlen_cache) for e in host[:batch]]
    starts = host[batch:2 * batch] if cache_leftpad is not None else [0] * batch
    lengths = [max(e - b, 0) for b, e in zip(starts, ends)]
    device = q_rows.device
    rows = (cache_batch_idx.long().clamp(0, k_cache.shape[0] - 1) if cache_batch_idx is not None
            else torch.arange(batch, device=device))
    counts = torch.tensor(lengths, dtype=torch.long, device=device)
    seq = torch.repeat_interleave(torch.arange(batch, device=device), counts)
    first = torch.tensor([0] + lengths, dtype=torch.long, device=device).cumsum(0)
    pos = (torch.arange(int(sum(lengths)), device=device) - first[seq]
           + torch.tensor(starts, dtype=torch.long, device=device)[seq])
    k_packed, v_packed = k_cache[rows[seq], pos], v_cache[rows[seq], pos]
    cu_k = first.to(torch.int32)
    max_q = max((b - a for a, b in zip(cq, cq[1:])), default=0)
    return _chunk.varlen_forward(
        q_rows, k_packed, v_packed, cu_q, cu_k, max_q, max(lengths, default=0), None, None,
        chunk, cfg.softmax_scale, False, (cfg.window_left, cfg.window_right), cfg.softcap,
        cfg.backend, False, 0, out_rows, False, descales)


def _packed_varlen(q, k_rows, v_rows, cu_k, seqlen_cache, used_k, cache_batch_idx,
                   cache_leftpad, batch_k, cfg, backend, descales, splits, out, return_lse):
    """Unmasked rows (one query token, or no causal / window): exact with the query heads of a
    KV head packed as the rows of one sequence of heads_kv heads (packed GQA: each K / V tile is
    read once per KV head, not once per query head) and, with splits > 1, the keys split across
    pseudo-sequences (the same cache entry, keys [start_s, stop_s) through leftpad_k /
    seqused_k) merged by their LSEs (split-KV: batch 1 fills the GPU). Returns (out, lse) in
    flash_attn_with_kvcache's layouts."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    heads_kv = k_rows.shape[1]
    group = heads_q // heads_kv
    rows = seqlen_q * group  # row t * group + g: token t, query head h_kv * group + g
    qp = q.reshape(batch, seqlen_q, heads_kv, group, head_dim).transpose(2, 3)
    qp = qp.reshape(batch, rows, heads_kv, head_dim)
    entry = (cache_batch_idx if cache_batch_idx is not None
             else torch.arange(batch, dtype=torch.int32, device=q.device))
    lead = cache_leftpad
    if splits > 1:
        if lead is None:
            lead = torch.zeros_like(used_k)
        chunk = -(-seqlen_cache // splits)
        edges = torch.arange(splits + 1, dtype=torch.int32, device=q.device) * chunk
        start = torch.maximum(lead[:, None], edges[None, :-1]).minimum(used_k[:, None])
        stop = torch.minimum(used_k[:, None], edges[None, 1:]).maximum(start)
        lead, used = start.reshape(-1), stop.reshape(-1)
        entry = entry.repeat_interleave(splits)
        qp = qp.unsqueeze(1).expand(batch, splits, rows, heads_kv, head_dim)
        descales = tuple(d if d is None or d.dim() < 2 else d.repeat_interleave(splits, 0)
                         for d in descales)
    else:
        used = used_k
    seqs = batch * splits
    qp = qp.reshape(seqs * rows, heads_kv, head_dim)
    cu_q = _arange_offsets(seqs, rows, q.device)
    kv_index = entry if (cache_batch_idx is not None or splits > 1) else None
    result, lse, _ = _varlen.forward(
        qp, k_rows, v_rows, cu_q, cu_k, rows, seqlen_cache, None, used, cfg.softmax_scale,
        False, (-1, -1), cfg.softcap, backend, need_lse=return_lse or splits > 1,
        descales=descales, kv_batch_idx=kv_index, leftpad_k=lead,
        batch_k=(batch_k or batch) if kv_index is not None else 0, checked=True)
    if splits > 1:  # partials (splits, batch, rows, heads_kv, d) merged by their LSEs
        part = result.view(batch, splits, rows, heads_kv, head_dim).transpose(0, 1).float()
        part_lse = lse.view(heads_kv, batch, splits, rows).permute(2, 1, 3, 0)
        merged, lse_rows = flash_attn_combine(part, part_lse, out_dtype=result.dtype)
        lse = lse_rows.permute(0, 2, 1) if return_lse else None  # (batch, heads_kv, rows)
    else:
        merged = result.view(batch, rows, heads_kv, head_dim)
        lse = lse.view(heads_kv, batch, rows).transpose(0, 1) if return_lse else None
    o = merged.view(batch, seqlen_q, group, heads_kv, head_dim).transpose(2, 3)
    o = o.reshape(batch, seqlen_q, heads_q, head_dim)
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:  # (batch, heads_kv, seqlen_q * group) -> (batch, heads_q, seqlen_q)
        lse = lse.reshape(batch, heads_kv, seqlen_q, group).transpose(2, 3)
        lse = lse.reshape(batch, heads_q, seqlen_q)
    return o, lse


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    qv: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    rotary_seqlens: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: torch.Tensor | None = None,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
    return_softmax_lse: bool = False,
    *,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against a KV cache, after writing the new k / v into it (FA3's
    flash_attn_with_kvcache: its parameters, order and defaults; forward only).

    q: (batch, seqlen_q, heads_q, head_dim); k_cache / v_cache: (batch_cache, seqlen_cache,
    heads_kv, head_dim), q's dtype (fp16, bf16, or torch.float8_e4m3fn with q / k / v_descale
    fp32 (batch, heads_kv) as in flash_attn_func), or for fp16 / bf16 q an FP8 cache
    (torch.float8_e4m3fn / torch.float8_e5m2, k and v alike, with k_descale / v_descale; the
    decode kernel only), last dim contiguous. cache_seqlens: int or
    int32 (batch,), the filled positions of each sequence's cache entry (None: all seqlen_cache).
    k / v (optional, both or neither): (batch, seqlen_new, heads_kv, head_dim), written in place
    at positions [cache_seqlens, cache_seqlens + seqlen_new) before attending (cache_seqlens
    itself is not updated, as in FA3). cache_batch_idx: int32 (batch,), the cache entry of each
    sequence (default b; with duplicates and new k / v, which write lands is unspecified, as in
    FA3). cache_leftpad: int32 (batch,), the first position attended (default 0). The keys
    attended are positions [cache_leftpad, cache_seqlens + seqlen_new); causal / window_size /
    softcap / softmax_scale as in flash_attn_func, bottom-right aligned on those keys. A
    sequence without keys gets out 0 and lse -inf.

    Varlen queries: q (total_q, heads_q, head_dim) with cu_seqlens_q int32 (batch + 1,) and
    max_seqlen_q (a hint: a checked call takes the longest sequence; unchecked, the decode
    kernel's grid covers max_seqlen_q tokens of each sequence and the rows past it get out 0 and
    lse -inf, the FA path computes every row); then new k / v may be packed too, (total_new, heads_kv, head_dim) with
    cu_seqlens_k_new int32 (batch + 1,), sequence b's new keys at rows [cu_seqlens_k_new[b],
    cu_seqlens_k_new[b + 1]).

    Returns out (batch, seqlen_q, heads_q, head_dim) ((total_q, ...) for varlen queries; bf16
    for FP8 inputs), and with return_softmax_lse also lse fp32 (batch, heads_q, seqlen_q)
    ((heads_q, total_q) for varlen queries). out (keyword only): write the result into this
    tensor. backend (keyword only): as in flash_attn_func; "auto" runs short queries on the
    decode kernel (module docstring), an explicit path name its varlen kernels.
    Performance hints: num_splits (0 = heuristic, 1 = no key split), pack_gqa (False: no
    packing), scheduler_metadata (get_scheduler_metadata's, for this call's shapes), sm_margin.
    rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2), rotary_interleaved, rotary_seqlens: as
    FA3's (with new k / v; the keys rotated at cache_seqlens + i, or rotary_seqlens + i, before
    they are appended; q at the same positions when causal / windowed, all at the first one
    otherwise).
    sinks (keyword only): fp32 (heads_q,), a logit per query head that joins each row's softmax
    denominator without a value (gpt-oss; the LSE then includes it, a row without keys gets
    out 0 and lse = sink).
    page_table: int32 (batch, max_pages) (or (batch_cache, max_pages) with cache_batch_idx) over
    caches of shape (num_pages, page_size, heads_kv, head_dim) with any strides (e.g. vLLM's K
    and V as views of one buffer); position j of a sequence is page page_table[b][j //
    page_size], slot j % page_size; entries past a sequence's pages may hold anything.
    attention_chunk: FA3's chunked-local attention over the attended keys (counted from
    cache_leftpad, as FA3's), fp16 / bf16 / e4m3 without sinks, eager outside graph capture: the
    attended keys are gathered and split into chunks (_chunked; paged caches through their dense
    copy). Not implemented yet, refused naming the argument: see the module docstring.
    qv (MLA's extra query, FA3's semantics): (batch, seqlen_q, heads_q, dv), or (total_q,
    heads_q, dv) with cu_seqlens_q, q's dtype (fp16 / bf16) and device, last dim contiguous;
    k_cache (..., heads_kv, d) with d <= 64, v_cache (..., heads_kv, dv) with dv in [256, 512]
    (paged: (num_pages, page_size, heads_kv, d) and (..., dv)), new k (..., d) / v (..., dv).
    The scores are softmax_scale * (q . k + qv . v) (softcap on that sum; rotary rotates q and
    the new keys, never qv), out has v's head dim dv; softmax_scale defaults to
    1 / sqrt(d + dv). It runs a composite path of torch GEMMs (_qv.py; not a fused kernel yet)
    on q's device, reading the cache in place (pages through the table) one key block at a
    time; num_splits and scheduler_metadata (get_scheduler_metadata(..., headdim=d,
    headdim_v=dv)) do not change its result; backend must be "auto".
    A v_cache with a head dim of its own and no qv (FA3 takes d in (128, 192] with dv in
    (96, 128], and d <= 64 with dv <= 512; here fp16 / bf16, d a multiple of 8 up to 256, dv up
    to 512): k_cache / new k of head dim d, v_cache / new v of dv, out of dv, softmax_scale
    defaulting to 1 / sqrt(d); the same composite path runs it.
    Runs eagerly (no custom op under torch.compile yet); inputs that require grad run forward
    only (a backward raises, as FA3 has none).
    """
    pages = None  # a paged cache read in place: (table, num_pages, page_size)
    if page_table is not None:
        args = {k: v for k, v in locals().items() if k != "pages"}
        pages = _pages_in_place(page_table, k_cache, v_cache, q, k, cache_batch_idx, cu_seqlens_q,
                                max_seqlen_q, qv, attention_chunk, out, backend)
        if pages is None:
            return _paged(**args)
        page_table, cache_batch_idx = None, None  # the table's rows are the batch's, in order
    call = _checked_call(
        q, k_cache, v_cache, k, v, qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new, max_seqlen_q=max_seqlen_q,
        rotary_seqlens=rotary_seqlens, q_descale=q_descale, k_descale=k_descale,
        v_descale=v_descale, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        attention_chunk=attention_chunk, softcap=softcap, rotary_interleaved=rotary_interleaved,
        scheduler_metadata=scheduler_metadata, num_splits=num_splits, pack_gqa=pack_gqa,
        sm_margin=sm_margin, return_softmax_lse=return_softmax_lse, sinks=sinks, out=out,
        backend=backend, pages=pages)
    route, splits = _route(call)

    def run() -> tuple[torch.Tensor, torch.Tensor | None]:
        return _execute(call, route, splits)

    grad = call.grad
    result, lse = _autograd.KvCacheForwardOnly.apply(run, q, k_cache, v_cache) if grad else run()
    return (result, lse) if return_softmax_lse else result


def _pages_in_place(page_table: Any, k_cache: Any, v_cache: Any, q: Any, k: Any,
                    cache_batch_idx: Any, cu_seqlens_q: Any, max_seqlen_q: Any, qv: Any,
                    attention_chunk: Any, out: Any, backend: Any,
                    ) -> tuple[torch.Tensor, int, int] | None:
    """The route of a paged call, decided first: (table, num_pages, page_size) when the decode
    kernel or the composite route reads the pool in place, None for the paged fallback (_paged:
    a dense copy)."""
    composite = _composite(qv, k_cache, v_cache)
    table, num_pages, page_size = _check_page_table(page_table, k_cache, v_cache, q, k,
                                                    cache_batch_idx, cu_seqlens_q,
                                                    own_v=composite)
    if composite:  # the composite path reads the pages itself (_qv.Rows)
        return table, num_pages, page_size
    varlen = isinstance(cu_seqlens_q, torch.Tensor)
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    if (backend != "auto" or attention_chunk
            or not _decode.serves(q, k_cache, v_cache, out, batch,
                                  _longest_q(q, k_cache, cu_seqlens_q, max_seqlen_q), varlen,
                                  table)):
        return None
    return table, num_pages, page_size


def _composite(qv: Any, k_cache: Any, v_cache: Any) -> bool:
    """Whether a call takes the composite route: qv, or a v_cache with a head dim of its own."""
    return qv is not None or (isinstance(k_cache, torch.Tensor)
                              and isinstance(v_cache, torch.Tensor)
                              and k_cache.dim() == v_cache.dim() >= 1
                              and k_cache.shape[-1] != v_cache.shape[-1])


class _KvCall(NamedTuple):
    """A checked flash_attn_with_kvcache call (_checked_call): every argument validated and in
    the forms the routes take, the cache not written yet."""

    q: torch.Tensor
    q_att: torch.Tensor  # the queries attended: q, rotated when rotary_cos is given
    q_rows: torch.Tensor  # q_att as (total_q, heads_q, head_dim)
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    out: torch.Tensor | None
    out_rows: torch.Tensor | None  # out as (total_q, heads_q, head_dim)
    varlen_q: bool
    batch: int
    seqlen_q: int  # max_seqlen_q for varlen queries
    heads_q: int
    head_dim: int
    batch_cache: int
    seqlen_cache: int  # a paged cache: a sequence's capacity (its table row's pages)
    heads_kv: int
    group: int  # heads_q / heads_kv (0 when it does not divide: the checks refuse it)
    cache_seqlens: torch.Tensor
    cache_batch_idx: torch.Tensor | None
    cache_leftpad: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k_new: torch.Tensor | None
    new: int | None  # new keys per sequence; None: packed, cu_seqlens_k_new gives them
    total_new: int
    rotary: tuple[torch.Tensor, torch.Tensor] | None
    rotary_base: torch.Tensor | None  # each sequence's first rotary position
    rotary_interleaved: bool
    sinks: torch.Tensor | None
    pages: tuple[torch.Tensor, int, int] | None
    k_rows: torch.Tensor  # the caches as packed rows (a paged cache: one page's)
    v_rows: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used_k: torch.Tensor  # cache_seqlens + the new keys
    descales: tuple
    varlen_args: tuple  # _varlen's positional arguments for this call
    batch_k: int
    decode: bool  # the decode kernel serves it (decided before the checks that depend on it)
    cfg: Any
    attention_chunk: int
    num_splits: int
    pack_gqa: bool | None
    meta_splits: int | None  # scheduler_metadata's split counts
    meta_decode_splits: int | None
    backend: str
    need_lse: bool
    return_softmax_lse: bool
    grad: bool
    qv: torch.Tensor | None = None  # MLA's extra query: the composite route (_run_composite)
    composite: bool = False  # qv, or a v_cache of its own head dim: the composite route


def _checked_call(q, k_cache, v_cache, k, v, *, qv, rotary_cos, rotary_sin, cache_seqlens,
                  cache_batch_idx, cache_leftpad, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q,
                  rotary_seqlens, q_descale, k_descale, v_descale, softmax_scale, causal,
                  window_size, attention_chunk, softcap, rotary_interleaved, scheduler_metadata,
                  num_splits, pack_gqa, sm_margin, return_softmax_lse, sinks, out, backend,
                  pages) -> _KvCall:
    """flash_attn_with_kvcache's checks, all of them before the cache is written (a refused call
    leaves it as it was), each error naming the argument; the values (lengths, offsets, indices,
    pages) are read and checked too unless the call is unchecked (_varlen.offsets_checked)."""
    # rotary_seqlens without rotary_cos / rotary_sin is ignored, as in FA3
    if max_seqlen_q is not None and (isinstance(max_seqlen_q, bool)
                                     or not isinstance(max_seqlen_q, numbers.Integral)
                                     or not 0 <= max_seqlen_q <= _validate.INT64_MAX):
        raise TypeError(f"max_seqlen_q: expected None or an int >= 0, got {max_seqlen_q!r}")
    _validate.check_fa3_extras(attention_chunk, num_splits, pack_gqa, sm_margin,
                               chunk_served=True)
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved: expected a bool, got {rotary_interleaved!r}")
    if return_softmax_lse is not True and return_softmax_lse is not False:
        raise TypeError(f"return_softmax_lse: expected a bool, got {return_softmax_lse!r}")

    varlen_q = cu_seqlens_q is not None
    if varlen_q:
        _check_tensor("q", q, 3, "(total_q, heads_q, head_dim) with cu_seqlens_q")
        _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, "of int32 (batch + 1,)")
        if cu_seqlens_q.shape[0] < 1:
            raise ValueError("cu_seqlens_q: expected batch + 1 >= 1 entries, got 0")
        batch = cu_seqlens_q.shape[0] - 1
        cu_seqlens_q = _check_index("cu_seqlens_q", cu_seqlens_q, batch + 1, q,
                                    "batch + 1 offsets")
        total_q, heads_q, head_dim = q.shape
        seqlen_q = total_q if max_seqlen_q is None else int(max_seqlen_q)
    else:
        _check_tensor("q", q, 4, "(batch, seqlen_q, heads_q, head_dim)")
        batch, seqlen_q, heads_q, head_dim = q.shape
        total_q = batch * seqlen_q
    _check_tensor("k_cache", k_cache, 4, "(batch_cache, seqlen_cache, heads_kv, head_dim)")
    _check_tensor("v_cache", v_cache, 4, "(batch_cache, seqlen_cache, heads_kv, head_dim)")
    composite = _composite(qv, k_cache, v_cache)
    _check_cache_shapes(k_cache, v_cache, composite)
    # 16-bit q against an FP8 cache (the mixed mode): the decode kernel's only (checked below)
    mixed = q.dtype in TORCH_DTYPES and k_cache.dtype in KV_FP8_DTYPES
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if mixed and t.dtype != k_cache.dtype:
            raise ValueError(f"{name}: expected k_cache's dtype {k_cache.dtype} (an FP8 cache "
                             f"under {q.dtype} q holds k and v in one FP8 dtype), got {t.dtype}")
        if not mixed and t.dtype != q.dtype:
            raise ValueError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension (stride 1), got "
                             f"stride {t.stride(-1)}")
    batch_cache, seqlen_cache, heads_kv, _ = k_cache.shape
    if pages is not None:  # the capacity of a sequence: its table row's pages
        batch_cache, seqlen_cache = pages[0].shape[0], pages[0].shape[1] * pages[2]
    if batch_cache == 0 and batch > 0:
        raise ValueError(f"k_cache: expected at least one cache entry for a batch of {batch}, "
                         f"got batch_cache 0")
    if cache_batch_idx is None and batch_cache != batch:
        raise ValueError(f"k_cache: expected batch_cache = q's batch ({batch}) without "
                         f"cache_batch_idx, got {batch_cache}")
    if (k is None) != (v is None):
        raise ValueError(f"k / v: expected both or neither, got k {type(k).__name__} and v "
                         f"{type(v).__name__}")
    if cu_seqlens_k_new is not None and k is None:
        raise ValueError("cu_seqlens_k_new: expected None without new k / v")
    new = 0  # new keys per sequence (cu_seqlens_k_new: per sequence, new = None)
    total_new = 0
    if k is not None:
        packed = cu_seqlens_k_new is not None
        for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
            if packed:
                _check_tensor(name, t, 3, "(total_new, heads_kv, head_dim) with cu_seqlens_k_new")
                ok = t.shape[1:] == cache.shape[2:]
                want = "(total_new, heads_kv, head_dim)"
            else:
                _check_tensor(name, t, 4, "(batch, seqlen_new, heads_kv, head_dim)")
                ok = t.shape[0] == batch and t.shape[2:] == cache.shape[2:]
                want = "(batch, seqlen_new, heads_kv, head_dim)"
            if not ok:  # each cache's own head dim (they may differ)
                raise ValueError(f"{name}: expected shape {want} with batch {batch}, heads_kv "
                                 f"{heads_kv}, head_dim {cache.shape[3]}, got "
                                 f"{tuple(t.shape)}")
            if t.dtype != k_cache.dtype:
                # FA3's rule (k_new of q's dtype, the cache's): new keys are appended as they
                # are, never quantized here
                hint = (" (an FP8 cache takes new keys already quantized to its dtype, with the "
                        "cache's descales)" if k_cache.dtype in KV_FP8_DTYPES else "")
                raise ValueError(f"{name}: expected the cache's dtype {k_cache.dtype}, got "
                                 f"{t.dtype}{hint}")
            if t.device != q.device:
                raise ValueError(f"{name}: expected q's device {q.device}, got {t.device}")
        if v.shape[0] != k.shape[0] or (not packed and v.shape[1] != k.shape[1]):
            raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        if packed:
            cu_seqlens_k_new = _check_index("cu_seqlens_k_new", cu_seqlens_k_new, batch + 1, q,
                                            "batch + 1 offsets")
            new, total_new = None, k.shape[0]
        else:
            new, total_new = k.shape[1], batch * k.shape[1]
    if cache_seqlens is None:
        if new is None:
            raise ValueError("cache_seqlens: expected an int32 tensor (batch,) with "
                             "cu_seqlens_k_new (where the new keys go)")
        cache_seqlens = seqlen_cache - new
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        limit = seqlen_cache - (new or 0)
        if not 0 <= int(cache_seqlens) <= limit:
            raise ValueError(f"cache_seqlens: expected 0 <= cache_seqlens <= seqlen_cache - "
                             f"seqlen_new ({limit}), got {cache_seqlens}")
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32,
                                   device=q.device)
    elif isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = _check_index("cache_seqlens", cache_seqlens, batch, q)
    else:
        raise TypeError(f"cache_seqlens: expected None, an int or an int32 tensor (batch,), got "
                        f"{type(cache_seqlens).__name__}")
    cache_batch_idx = _check_index("cache_batch_idx", cache_batch_idx, batch, q)
    cache_leftpad = _check_index("cache_leftpad", cache_leftpad, batch, q)
    rotary = _check_rotary(rotary_cos, rotary_sin, rotary_seqlens, q, k, head_dim, batch)
    sinks = _check_sinks(sinks, heads_q, q)
    if attention_chunk and (mixed or sinks is not None):
        raise UnsupportedError(f"attention_chunk: expected 0 with 16-bit q against an FP8 cache "
                               f"or sinks (chunked KV-cache attention runs on fp16 / bf16 / e4m3 "
                               f"without sinks), got {attention_chunk}")
    if (attention_chunk and not composite and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing()):
        raise UnsupportedError(f"attention_chunk: expected 0 while a CUDA graph is captured (the "
                               f"chunks are split on the host from cache_seqlens), got "
                               f"{attention_chunk}")
    meta_splits = meta_decode_splits = None
    if scheduler_metadata is not None:
        meta_splits, meta_decode_splits = _metadata_splits(
            scheduler_metadata, batch=batch, heads_q=heads_q, heads_kv=heads_kv,
            head_dim=head_dim, head_dim_v=v_cache.shape[3])
    grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad
        for t in (q, k_cache, v_cache, k, v, qv))
    if out is not None and grad:
        raise UnsupportedError("out: expected None when an input requires grad")
    if torch.compiler.is_compiling():
        raise UnsupportedError("flash_attn_with_kvcache runs eagerly only (no flash_hopper "
                               "custom op takes it under torch.compile yet)")

    if composite:  # the composite path reads the caches itself (_qv.Rows): no row views
        k_rows, v_rows, step = k_cache, v_cache, 1
    elif pages is None:
        k_rows, step = _rows_view("k_cache", k_cache)
        v_rows, v_step = _rows_view("v_cache", v_cache)
        if v_step != step:
            raise ValueError(f"v_cache: expected k_cache's entry stride in rows ({step}), got "
                             f"{v_step}")
    else:  # the checks of the rows of one page (the kernel reads the pool itself)
        k_rows, v_rows, step = k_cache[0], v_cache[0], 1
    base = None  # rotary: the position of each sequence's first new key
    q_att = q  # the queries attended: q, rotated when rotary_cos is given (FA3's positions)
    if rotary is not None:
        base = (rotary_seqlens if rotary_seqlens is not None else cache_seqlens).long()
        fixed = _unwindowed(causal, window_size)  # non-causal, no window: one position
        if varlen_q:  # (total_q,): each token at its sequence's base (+ its index)
            seq, index = _packed_index(cu_seqlens_q, total_q, batch)
            pos = base[seq] if fixed else base[seq] + index
        else:
            steps = torch.zeros(seqlen_q, dtype=torch.long, device=q.device) if fixed else \
                torch.arange(seqlen_q, device=q.device)
            pos = base[:, None] + steps[None]
        q_att = _rotate(q, *rotary, pos, rotary_interleaved)
    q_rows = q_att if varlen_q else q_att.reshape(total_q, heads_q, head_dim)
    out_rows = None
    if out is not None:
        dims = 3 if varlen_q else 4
        _check_tensor("out", out, dims, "of q's shape")
        if composite:  # the output has v's head dim
            want = tuple(q.shape[:-1]) + (v_cache.shape[3],)
            if tuple(out.shape) != want or out.dtype != q.dtype or out.device != q.device:
                raise ValueError(f"out: expected shape {want} (q's, with v_cache's head dim), "
                                 f"dtype {q.dtype} on {q.device}, got {tuple(out.shape)}, "
                                 f"{out.dtype} on {out.device}")
        elif tuple(out.shape) != tuple(q.shape):
            raise ValueError(f"out: expected q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
        try:
            out_rows = out if varlen_q else out.view(total_q, heads_q, out.shape[-1])
        except RuntimeError:
            raise ValueError(f"out: expected a tensor whose (batch, seqlen_q) dims flatten to one "
                             f"(strides {out.stride()})") from None
    cu_q = cu_seqlens_q if varlen_q else _arange_offsets(batch, seqlen_q, q.device)
    cu_k = _arange_offsets(batch_cache, step, q.device)
    if new is None:  # per sequence, from the offsets
        used_k = cache_seqlens + (cu_seqlens_k_new[1:] - cu_seqlens_k_new[:-1])
    else:
        used_k = cache_seqlens + new if new else cache_seqlens
    fp8 = q.dtype in FP8_DTYPES or mixed  # descales as flash_attn_func's FP8 / mixed mode
    descales = (q_descale, k_descale, v_descale) if fp8 else (None, None, None)
    args = (q_rows, k_rows, v_rows, cu_q, cu_k, seqlen_q, seqlen_cache, None, used_k,
            softmax_scale, causal, window_size, softcap, backend)
    # Every check (devices, dtypes, head dim, scale, window, descales, out) before the cache is
    # written: a refused call leaves it as it was.
    batch_k = batch_cache if cache_batch_idx is not None else 0
    # Whether the decode kernel serves the call (_route's first choice) is decided here, as it
    # picks the checks: a paged cache came here only if it serves it.
    group = heads_q // heads_kv if heads_q % heads_kv == 0 else 0
    decode = not composite and (pages is not None or (
        backend == "auto" and not attention_chunk
        and _decode.serves(q, k_cache, v_cache, out, batch, seqlen_q, varlen_q)))
    if qv is not None:  # MLA's extra query: the composite path (_qv.py), on any device
        cfg = _validate.check_qv(q, k_cache, v_cache, qv, softmax_scale, causal, window_size,
                                 softcap, backend, "k_cache", "v_cache")
    elif composite:  # v_cache's own head dim without qv: the composite path too
        cfg = _validate.check_own_v_cache(q, k_cache, v_cache, softmax_scale, causal,
                                          window_size, softcap, backend)
    elif mixed and not decode:
        raise UnsupportedError(
            f"k_cache: {q.dtype} q against an FP8 cache ({k_cache.dtype}, the mixed mode) runs on "
            f"the decode kernel only, which does not serve this call (backend {backend!r}, "
            f"{seqlen_q} query tokens x {group} query heads per KV head, head_dim {head_dim}, "
            f"device {q.device}; flash_hopper.supports(..., kvcache=True) says why)")
    elif decode:  # the checks alone: no FA kernel needs to exist for this dtype / head dim
        cfg = _varlen.check_call(*args, out_rows, descales, batch_k)
    else:
        cfg = _varlen.plan(*args, out_rows, descales, batch_k).dense.cfg
    if _varlen.offsets_checked() and batch > 0:
        _check_values(cache_seqlens, new, seqlen_cache, batch_cache, cache_batch_idx,
                      cache_leftpad, cu_seqlens_q, total_q, cu_seqlens_k_new, total_new,
                      seqlen_q if varlen_q else None)
        if pages is not None:
            _check_pages(pages[0], cache_seqlens, k, cu_seqlens_k_new, pages[2], pages[1])
    return _KvCall(
        q, q_att, q_rows, k_cache, v_cache, k, v, out, out_rows, varlen_q, batch, seqlen_q,
        heads_q, head_dim, batch_cache, seqlen_cache, heads_kv, group, cache_seqlens,
        cache_batch_idx, cache_leftpad, cu_seqlens_q, cu_seqlens_k_new, new, total_new, rotary,
        base, rotary_interleaved, sinks, pages, k_rows, v_rows, cu_q, cu_k, used_k, descales,
        args, batch_k, decode, cfg, attention_chunk, num_splits, pack_gqa, meta_splits,
        meta_decode_splits, backend, return_softmax_lse or sinks is not None, return_softmax_lse,
        grad, qv=qv, composite=composite)


def _route(c: _KvCall) -> tuple[str, int]:
    """Which executor runs a checked call ("decode", "packed", "chunked" or "varlen"; the paged
    fallback was decided before the checks, _pages_in_place) and the key splits of the packed
    route. The decode kernel (backend "auto"): the short queries the library's policy sends there
    (decided before the checks, _decode.serves), any mask, sinks in the kernel; an explicit
    backend ("fa2", "fa3") runs
    that path's varlen kernels. Unmasked rows (one query token, or neither causal nor a window):
    the query heads of a KV head can share its tiles, and the keys can be split
    (_packed_varlen)."""
    if c.composite:
        return "composite", 1
    unmasked = c.cfg.window_left < 0 and (c.cfg.window_right < 0
                                          or (not c.varlen_q and c.seqlen_q == 1))
    if c.meta_splits is not None:
        splits = c.meta_splits
    else:
        splits = _splits(c.num_splits, c.batch, c.seqlen_q * c.group, c.heads_kv, c.seqlen_cache,
                         c.q.device)
    if c.decode:
        return "decode", splits
    if (unmasked and not c.varlen_q and c.batch > 0 and c.pack_gqa is not False
            and (c.group > 1 or splits > 1) and not c.attention_chunk):
        return "packed", splits
    return ("chunked" if c.attention_chunk else "varlen"), splits


def _append(c: _KvCall) -> None:
    """The new keys into the cache at [cache_seqlens, + new); with rotary, each key rotated at
    its position from the rotary base first (FA3's order)."""
    seq, index = _new_key_index(c.batch, c.new, c.cu_seqlens_k_new, c.total_new, c.q.device)
    rows, pos = _append_slots(seq, index, c.cache_seqlens, c.seqlen_cache, c.batch_cache,
                              c.cache_batch_idx, c.pages)
    keys = c.k if c.rotary is None else _rotate(c.k, *c.rotary, c.rotary_base[seq] + index,
                                                c.rotary_interleaved)
    with torch.no_grad():
        c.k_cache[rows, pos] = keys
        c.v_cache[rows, pos] = c.v


def _run_decode(c: _KvCall, splits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _decode.forward(
        c.q_att, c.k_cache, c.v_cache, c.used_k, softmax_scale=c.cfg.softmax_scale,
        softcap=c.cfg.softcap, window=(c.cfg.window_left, c.cfg.window_right),
        page_table=None if c.pages is None else c.pages[0], kv_batch_idx=c.cache_batch_idx,
        leftpad_k=c.cache_leftpad, cu_seqlens_q=c.cu_seqlens_q if c.varlen_q else None,
        max_seqlen_q=c.seqlen_q, sinks=c.sinks,
        num_splits=c.meta_decode_splits if c.meta_decode_splits is not None else c.num_splits,
        out=c.out, return_lse=c.return_softmax_lse, descales=c.descales)


def _run_packed(c: _KvCall, splits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _packed_varlen(c.q_att, c.k_rows, c.v_rows, c.cu_k, c.seqlen_cache, c.used_k,
                          c.cache_batch_idx, c.cache_leftpad, c.batch_k, c.cfg, c.backend,
                          c.descales, splits, c.out, c.need_lse)


def _run_chunked(c: _KvCall, splits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    fp8 = c.q.dtype in FP8_DTYPES
    result, lse = _chunked(c.q_rows, c.k_cache, c.v_cache, c.cu_q, c.used_k, c.cache_batch_idx,
                           c.cache_leftpad, int(c.attention_chunk), c.cfg, c.out_rows,
                           c.descales if fp8 else None)
    return _fa3_layout(c, result, lse)


def _run_varlen(c: _KvCall, splits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    result, lse, _ = _varlen.forward(
        *c.varlen_args, out=c.out_rows, need_lse=c.need_lse, descales=c.descales,
        kv_batch_idx=c.cache_batch_idx, leftpad_k=c.cache_leftpad, batch_k=c.batch_k,
        checked=True)
    return _fa3_layout(c, result, lse)


def _fa3_layout(c: _KvCall, result: torch.Tensor,
                lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A packed-rows result in flash_attn_with_kvcache's layouts: varlen queries keep out
    (total_q, heads, d) and lse (heads, total_q), as FA3's varlen; dense ones get out (batch,
    seqlen_q, heads, d) and lse (batch, heads, seqlen_q)."""
    if c.varlen_q:
        return (c.out if c.out is not None else result), lse
    result = c.out if c.out is not None else result.view(c.batch, c.seqlen_q, c.heads_q,
                                                         c.head_dim)
    if lse is not None:
        lse = lse.view(c.heads_q, c.batch, c.seqlen_q).permute(1, 0, 2).contiguous()
    return result, lse


def _run_composite(c: _KvCall, splits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """qv (MLA's extra query) or a v_cache of its own head dim: the composite path (_qv.py)
    over the cache read in place (dense entries through cache_batch_idx, or pages through the
    table), keys [cache_leftpad, used_k) of each sequence; rotary has rotated q (c.q_att), never
    qv. No key split: num_splits and scheduler_metadata change nothing."""
    lo = c.cache_leftpad if c.cache_leftpad is not None else 0
    hi = c.used_k.clamp(0, c.seqlen_cache)  # unchecked values: within the cache
    length = c.seqlen_cache
    if _varlen.offsets_checked() and c.batch > 0:  # the loops run to the longest sequence
        length = int(hi.max())
    table = c.pages[0] if c.pages is not None else None
    keys = _qv.Rows((c.k_cache, c.v_cache), c.batch, length, lo=lo, hi=hi,
                    entry=c.cache_batch_idx, table=table)
    tensors = (c.q_att,) if c.qv is None else (c.q_att, c.qv)
    if c.varlen_q:
        start, q_len = c.cu_seqlens_q[:-1], c.cu_seqlens_q[1:] - c.cu_seqlens_q[:-1]
        queries = _qv.Rows(tensors, c.batch, c.seqlen_q, hi=q_len, start=start)
    else:
        queries = _qv.Rows(tensors, c.batch, c.seqlen_q)
    result, lse = _qv.attention(queries, keys, softmax_scale=c.cfg.softmax_scale,
                                window=(c.cfg.window_left, c.cfg.window_right),
                                softcap=c.cfg.softcap, chunk=int(c.attention_chunk))
    if c.varlen_q:
        return _qv.packed_result(result, lse, start, q_len, c.q.shape[0], c.out, c.need_lse)
    if c.out is not None:
        c.out.copy_(result)
        result = c.out
    return result, lse.float() if c.need_lse else None


_EXECUTORS = {"decode": _run_decode, "packed": _run_packed, "chunked": _run_chunked,
              "varlen": _run_varlen, "composite": _run_composite}


def _execute(c: _KvCall, route: str, splits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Append the new keys, run the route's executor, then the sinks off the decode kernel."""
    if c.total_new and c.batch:
        _append(c)
    result, lse = _EXECUTORS[route](c, splits)
    if c.sinks is not None and c.batch > 0 and route != "decode":
        # lse: (heads, total_q) varlen, (batch, heads, seqlen_q) dense
        sunk, lse = apply_sinks(result, lse, c.sinks, 0 if c.varlen_q else 1)
        result.copy_(sunk)
    return result, lse
