"""The decode kernel (kernels/decode/decode_kernel.h, api.h's fh_decode) from Python.

Short queries come here: a few query rows per sequence (decode, speculative decoding) against a
dense or paged cache, the query heads of a KV head packed into one tile, the keys split across
CTAs and merged by a combine kernel the library launches behind the decode kernel (programmatic
dependent launch on sm_90). Which calls it serves is the library's policy's answer
(kernels/src/policy.cu), never this module's: flash_attn_func's plan asks it with decode_route
(_fwd.make_plan), flash_attn_varlen_func's route per call (_varlen.forward), and
flash_attn_with_kvcache's route through ``serves`` (fh_decode_select_backend); everything else
stays on the FA kernels.

The caller has validated the arguments; this module fills FhDecodeParams. Per call: one plan
lookup (cached per call signature: the split count and workspace size from fh_decode_plan), for
split calls a scratch workspace from torch's caching allocator (nothing to initialise: a captured
call's is its own for the graph's life), one library call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import _abi, _device, _env, _lib, _plan_cache, _validate
from ._abi import FhDecodeParams
from ._tables import FP8_DTYPES, INPUT_DTYPES, KV_FP8_DTYPES, TORCH_DTYPES

# num_splits travels in an int32 field; the library clamps it to the kernel's own cap
# (decode_plan.h), so larger values only need to stay representable.
INT32_MAX = 2**31 - 1

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream
)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def enabled() -> bool:
    """FLASH_HOPPER_DECODE=0 turns the kernel off (A/B measurements, a fallback while debugging)."""
    return _env.decode_mode() != "0"


def varlen_too() -> bool:
    """flash_attn_varlen_func's short queries (K / V packed by cu_seqlens_k, read as one cache
    entry with each sequence's span as [leftpad, seqlen)) run on the kernel too, unless
    FLASH_HOPPER_DECODE is 0 or "kvcache": through flash_attn_varlen_func the decode sweep's
    points run as fast as flash_attn_with_kvcache's dense call (bench/PERFLOG.md, "the split
    merge as a kernel of its own, loads of 8 threads per row")."""
    return everywhere()


def everywhere() -> bool:
    """flash_attn_func's short queries (a dense K / V as a cache of full entries) run on the
    kernel too, unless FLASH_HOPPER_DECODE is 0 or "kvcache" (flash_attn_with_kvcache only).
    On the decode sweep's points (GQA 32 / 8, d128, one query token) the kernel reads K / V
    several times faster than the FA-3 path's tiles of one valid row (bench/PERFLOG.md, "the
    decode kernel", against the baseline in "flash_attn_with_kvcache, first step")."""
    return _env.decode_mode() not in ("0", "kvcache")


def route_key() -> tuple[str, int]:
    """What the decode route's answer depends on besides a call's shapes, read per call as the
    library reads it: FLASH_HOPPER_DECODE and FLASH_HOPPER_DEBUG_SMEM_LIMIT (the policy's view of
    the GPU's shared memory). The plan caches that hold an answer key it with the call."""
    return _env.decode_mode(), _env.debug_smem_limit()


def cudagraph_trees_on(device: torch.device) -> bool:
    """Whether torch.compile's CUDA graphs (inductor's cudagraph trees: mode "reduce-overhead",
    and what transformers' static-cache generate compiles) run on this device in this thread.
    Their warmup and recording allocate from a private pool, and a constant kept from there would
    outlive the graph (the trees refuse that: "tensor(s) in the cudagraph pool not tracked as
    outputs"), so eager_constant then makes its constant per call. Known only where the trees'
    module is loaded; a version whose manager cannot be asked counts as on."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        return trees.get_manager(index, create_if_none_exists=False) is not None
    except Exception:  # noqa: BLE001 -- a torch whose trees are not asked this way
        return True


def eager_constant(cache: dict, pinned: dict, key: tuple,
                   make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A constant device tensor (lengths, offsets, zeros) built once outside any CUDA graph capture
    and reused: a captured call takes the eagerly built one (no kernel in the graph for it) and
    pins it in ``pinned``, since a graph reads it on every replay and it must outlive a clear of
    ``cache``. One made while capturing holds its values only once the graph runs: not cached.
    ``key`` starts with the device; the current stream of that device joins it, so a tensor is
    only ever used on the stream it was made on, and freeing it (a clear of ``cache``) hands its
    memory back to the caching allocator behind every kernel that reads it (stream order)."""
    device = key[0]
    if cudagraph_trees_on(device):
        return make()
    key = (_stream_of(device),) + key
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    t = pinned.get(key) if capturing else None
    if t is None:
        t = cache.get(key)
    if t is None and capturing:
        # torch.cuda.graph captures on a stream of its own: the eager call before it made the
        # constant on another. Pinned, it is never freed, so the graph may read it from any
        # stream (capture begins after a device synchronize: its values are there)
        t = next((c for k, c in cache.items() if k[1:] == key[1:]), None)
    if t is None:
        t = make()
        if not capturing:
            if len(cache) >= 64:
                cache.clear()
            cache[key] = t
    elif capturing:
        pinned[key] = t
    return t


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _stream_of(device: Any) -> int:
    """The current stream of a CUDA device (its raw handle); 0 for anything else (and for a
    "cuda" device on a build without CUDA, as FakeTensors have)."""
    if (not isinstance(device, torch.device) or device.type != "cuda"
            or not torch.cuda.is_available()):
        return 0
    return _raw_stream(_index(device))


_full: dict[tuple, torch.Tensor] = {}  # (device, batch, seqlen_k) -> full lengths, built eagerly
_graph_full: dict[tuple, torch.Tensor] = {}  # those a captured call took: never freed


def dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
                  window: tuple[int, int], softcap: float, out: torch.Tensor,
                  need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """flash_attn_func's attention through the decode kernel, for a call the library's policy
    sent there (a "decode" plan): k / v (batch, seqlen_k, heads_kv, d) are a cache of ``batch``
    full entries. Validated by the caller, pointers included; out (batch, seqlen_q, heads_q, d)
    is written."""
    batch = q.shape[0]
    seqlen_k = k.shape[1]
    lengths = eager_constant(_full, _graph_full, (q.device, batch, seqlen_k), lambda: torch.full(
        (batch,), seqlen_k, dtype=torch.int32, device=q.device))
    return forward(q, k, v, lengths, softmax_scale=softmax_scale, softcap=softcap, window=window,
                   out=out, return_lse=need_lse)


_zeros: dict[tuple, torch.Tensor] = {}  # (device, batch) -> int32 zeros, built eagerly
_graph_zeros: dict[tuple, torch.Tensor] = {}  # those a captured call took: never freed


def packed_spans(cu_seqlens_k: torch.Tensor,
                 seqused_k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed keys as one cache entry: sequence b's keys are [leftpad[b], seqlen[b]) of it, with
    leftpad = cu_seqlens_k[:-1] and seqlen = cu_seqlens_k[1:] (views: nothing launched), or
    leftpad + seqused_k clamped to the span (FA3's rule: seqused_k counts the first keys of the
    span, never past it; unchecked values must not reach the next sequence's keys)."""
    leftpad = cu_seqlens_k[:-1]
    if seqused_k is None:
        return leftpad, cu_seqlens_k[1:]
    seqlen = torch.minimum(leftpad + seqused_k.clamp(min=0), cu_seqlens_k[1:])
    return leftpad, seqlen


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                   seqused_k: torch.Tensor | None, softmax_scale: float, window: tuple[int, int],
                   softcap: float, out: torch.Tensor,
                   need_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """flash_attn_varlen_func's attention through the decode kernel, for a call the library's
    policy sent there (_varlen.forward asks per call, with the longest sequence's queries). q
    (total_q, heads_q, d) by cu_seqlens_q; k / v (total_k, heads_kv, d) read as one cache entry
    (packed_spans). Validated by the caller (offsets and pointers included); out written."""
    batch = cu_seqlens_q.shape[0] - 1
    k1, v1 = k.unsqueeze(0), v.unsqueeze(0)
    zeros = eager_constant(_zeros, _graph_zeros, (q.device, batch), lambda: torch.zeros(
        batch, dtype=torch.int32, device=q.device))
    leftpad, seqlen = packed_spans(cu_seqlens_k, seqused_k)
    return forward(q, k1, v1, seqlen, softmax_scale=softmax_scale, softcap=softcap,
                   window=window, kv_batch_idx=zeros, leftpad_k=leftpad,
                   cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, out=out,
                   return_lse=need_lse)


def expressible(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether FhDecodeParams can say the call's dtypes: q, k and v in one dtype, or fp16 / bf16
    q against an FP8 cache (k and v in one FP8 dtype); the table's rows are the policy's."""
    if k_cache.dtype != v_cache.dtype:
        return False
    return q.dtype == k_cache.dtype or (q.dtype in TORCH_DTYPES
                                        and k_cache.dtype in KV_FP8_DTYPES)


def out_dtype(q: torch.Tensor) -> torch.dtype:
    """o's dtype: q's, bf16 for FP8 q (FA3's)."""
    return torch.bfloat16 if q.dtype in FP8_DTYPES else q.dtype


def aligned(*tensors: torch.Tensor) -> bool:
    """Whether every tensor's data starts 16-byte aligned (cp.async moves 16-byte vectors; the
    strides are the policy's to check)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _fill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_strides: tuple,
          batch: int, seqlen_q: int, page_table_shape: tuple | None, varlen: bool,
          ) -> FhDecodeParams:
    """FhDecodeParams of a call's shapes and strides (no data, score or schedule): dense caches
    (entries, capacity, heads_kv, d), one "page" per entry; paged ones (num_pages, page_size,
    heads_kv, d) with a (rows, max_pages) table (contiguous rows). The page table pointer is a
    placeholder (the policy and the plan read whether the cache is paged, not where). Strides
    are effective ones (_validate.effective_strides: a dim of one is never stepped along), as the
    FA host path's: the policy weighs the same strides the kernel is given."""
    effective = _validate.effective_strides
    p = FhDecodeParams()
    p.abi_version = _abi.ABI_VERSION
    p.dtype = int(INPUT_DTYPES.get(q.dtype, _abi.FhDtype.FP32))
    if k_cache.dtype != q.dtype:  # an FP8 cache under 16-bit q (0: q's dtype)
        p.kv_dtype = int(KV_FP8_DTYPES.get(k_cache.dtype, _abi.FhDtype.FP32))
    p.batch, p.seqlen_q, p.heads_q, p.heads_kv, p.head_dim = (
        batch, seqlen_q, q.shape[-2], k_cache.shape[2], q.shape[-1])
    p.total_q = q.shape[0] if varlen else 0
    p.num_pages, p.page_size = k_cache.shape[0], k_cache.shape[1]
    if page_table_shape is not None:
        p.max_pages = p.page_table_stride = page_table_shape[1]
        p.page_table = 16
    else:  # a dense cache: one "page" per entry
        p.max_pages = 1
    if varlen:
        p.q_batch_stride, (p.q_row_stride, p.q_head_stride) = 0, effective(q)[:2]
        p.o_batch_stride, (p.o_row_stride, p.o_head_stride) = 0, out_strides[:2]
    else:
        p.q_batch_stride, p.q_row_stride, p.q_head_stride = effective(q)[:3]
        p.o_batch_stride, p.o_row_stride, p.o_head_stride = out_strides[:3]
    p.k_page_stride, p.k_row_stride, p.k_head_stride = effective(k_cache)[:3]
    p.v_page_stride, p.v_row_stride, p.v_head_stride = effective(v_cache)[:3]
    return p


_served = _plan_cache.PlanCache(256)


def serves(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           out: torch.Tensor | None, batch: int, seqlen_q: int, varlen: bool = False,
           page_table: torch.Tensor | None = None) -> bool:
    """Whether flash_attn_with_kvcache's call runs on the decode kernel: the library's policy
    (fh_decode_select_backend: dtype, head dim, packed rows, the GPU's shared memory, strides),
    asked once per call signature, for a call it can express (FLASH_HOPPER_DECODE not 0, CUDA
    tensors, dtypes as ``expressible``) with 16-byte aligned data. q (batch, seqlen_q, heads_q, d)
    or, varlen, (total_q, heads_q, d) with ``batch`` sequences, ``seqlen_q`` the longest; the
    cache dense or paged (``page_table``). Decided before any cache is written."""
    if not enabled() or not q.is_cuda or not expressible(q, k_cache, v_cache):
        return False
    if not aligned(q, k_cache, v_cache, *((out,) if out is not None else ())):
        return False
    out_strides = _validate.effective_strides(out if out is not None else q)
    table = None if page_table is None else tuple(page_table.shape)
    key = (q.device, q.dtype, k_cache.dtype, tuple(q.shape), q.stride(), tuple(k_cache.shape),
           k_cache.stride(), tuple(v_cache.shape), v_cache.stride(), out_strides, batch, seqlen_q,
           varlen, table, _env.debug_smem_limit())
    served = _served.get(key)
    if served is None:
        try:
            p = _fill(q, k_cache, v_cache, out_strides, batch, seqlen_q, table, varlen)
            p.softmax_scale, p.window_left, p.window_right = 1.0, -1, -1
            lib = _lib.get_library()
            served = lib.policy(p, _device.device_info(_index(q.device)).capability)[0] == (
                _abi.FhBackend.DECODE)
        except Exception:  # noqa: BLE001 - refused, a shape the checks refuse, no device or
            served = False  # no library: not served
        _served.remember(key, served)
    return served


class _Plan(NamedTuple):
    template: bytes
    splits: int
    workspace_bytes: int


_plans = _plan_cache.PlanCache(256)


def _plan(lib: _lib.Library, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          out: torch.Tensor, lse_strides: tuple[int, int], batch: int, seqlen_q: int,
          page_table: torch.Tensor | None, varlen: bool, flags: tuple,
          softmax_scale: float, softcap: float, window: tuple[int, int],
          num_splits: int, descale_strides: tuple) -> _Plan:
    key = (q.device, q.dtype, k_cache.dtype, tuple(q.shape), q.stride(), tuple(k_cache.shape),
           k_cache.stride(), v_cache.stride(), out.stride(), lse_strides, batch, seqlen_q,
           None if page_table is None else (tuple(page_table.shape), page_table.stride()),
           varlen, flags, softmax_scale, softcap, window, num_splits, descale_strides)
    cached = _plans.get(key)
    if cached is not None:
        return cached
    p = _fill(q, k_cache, v_cache, _validate.effective_strides(out), batch, seqlen_q,
              None if page_table is None else tuple(page_table.shape), varlen)
    if page_table is not None:
        p.page_table_stride = page_table.stride(0)
    p.lse_batch_stride, p.lse_head_stride = lse_strides
    p.softmax_scale, p.softcap = softmax_scale, softcap
    p.window_left, p.window_right = window
    for name, strides in zip(("q", "k", "v"), descale_strides):
        if strides is not None:
            setattr(p, f"{name}_descale_batch_stride", strides[0])
            setattr(p, f"{name}_descale_head_stride", strides[1])
    p.num_splits = num_splits
    index = _index(q.device)
    splits, nbytes = lib.decode_plan(p, _device.device_info(index).sm_count)
    p.page_table = None
    p.num_splits = splits
    plan = _Plan(bytes(p), splits, nbytes)
    _plans.remember(key, plan)
    return plan


def forward(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            seqlens_k: torch.Tensor, *, softmax_scale: float, softcap: float = 0.0,
            window: tuple[int, int] = (-1, -1), page_table: torch.Tensor | None = None,
            kv_batch_idx: torch.Tensor | None = None, leftpad_k: torch.Tensor | None = None,
            cu_seqlens_q: torch.Tensor | None = None, max_seqlen_q: int | None = None,
            sinks: torch.Tensor | None = None, num_splits: int = 0,
            out: torch.Tensor | None = None, return_lse: bool = False,
            descales: tuple = (None, None, None),
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of q against a cache through the decode kernel; arguments validated by the
    caller. q (batch, seqlen_q, heads_q, d), or (total_q, heads_q, d) with cu_seqlens_q and
    max_seqlen_q; k_cache / v_cache dense (entries, capacity, heads_kv, d) or, with page_table
    (batch, max_pages) int32, paged (num_pages, page_size, heads_kv, d); seqlens_k int32
    (batch,): keys [leftpad_k, seqlens_k) of each sequence's cache entry (kv_batch_idx: which;
    dense only). sinks fp32 (heads_q,). Returns (out like q, lse fp32 (batch, heads_q, seqlen_q)
    or (heads_q, total_q) when return_lse, else None). FP8 caches (``expressible``): descales =
    (q_descale, k_descale, v_descale), fp32 (batch, heads_kv) or broadcasting, None = 1 (q_descale
    with FP8 q only); out in bf16 for FP8 q, else q's dtype."""
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.shape[0] - 1
        seqlen_q = int(max_seqlen_q) if max_seqlen_q is not None else q.shape[0]
    else:
        batch, seqlen_q = q.shape[0], q.shape[1]
    heads_q = q.shape[-2]
    if out is None:
        out = torch.empty(q.shape, dtype=out_dtype(q), device=q.device)
    lse = None
    if return_lse:
        if varlen:
            lse = torch.empty((heads_q, q.shape[0]), dtype=torch.float32, device=q.device)
            lse_strides = (0, lse.stride(0))
        else:
            lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
            lse_strides = lse.stride()[:2]
    else:
        lse_strides = (0, 0)
    if batch == 0 or seqlen_q == 0:
        if lse is not None:
            lse.fill_(float("-inf"))
        return out, lse
    lib = _lib.get_library()
    flags = (kv_batch_idx is not None, leftpad_k is not None, sinks is not None)
    # num_splits: FA3's meaning, any int >= 0; beyond the kernel's cap it is the cap (the library
    # clamps; an int32 field must never see a value that wraps)
    splits = min(max(int(num_splits), 0), INT32_MAX)
    # the descales' (batch, head) strides, 0 broadcasting (validated by the caller)
    descale_strides = tuple(_validate._check_descale(name, d, batch, k_cache.shape[2])
                            for name, d in zip(("q_descale", "k_descale", "v_descale"), descales))
    plan = _plan(lib, q, k_cache, v_cache, out, lse_strides, batch, seqlen_q, page_table, varlen,
                 flags, float(softmax_scale), float(softcap), (int(window[0]), int(window[1])),
                 splits, descale_strides)
    index = _index(q.device)
    stream = _raw_stream(index)
    p = FhDecodeParams.from_buffer_copy(plan.template)
    p.q, p.k, p.v, p.o = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()
    p.lse = lse.data_ptr() if lse is not None else None
    p.seqlens_k = seqlens_k.data_ptr()
    p.leftpad_k = _ptr(leftpad_k)
    p.kv_batch_idx = _ptr(kv_batch_idx)
    p.page_table = _ptr(page_table)
    p.cu_seqlens_q = _ptr(cu_seqlens_q)
    p.sinks = _ptr(sinks)
    p.q_descale, p.k_descale, p.v_descale = (_ptr(d) for d in descales)
    if plan.splits > 1:  # scratch from torch's caching allocator: no memset, no host sync
        ws = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=q.device)
        p.workspace, p.workspace_bytes = ws.data_ptr(), plan.workspace_bytes
    if _current_device() == index:
        lib.decode(p, stream)
    else:  # the runtime launches on the current device: make it the tensors'
        with torch.cuda.device(index):
            lib.decode(p, stream)
    return out, lse


def _ptr(t: Any) -> int | None:
    return t.data_ptr() if t is not None else None

