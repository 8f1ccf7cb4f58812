"""The varlen host path: sequences of different lengths packed along one token axis.

flash_attn_varlen_func (FA3's order), flash_hopper.vllm.flash_attn_varlen_func (vLLM's order) and
the ``flash_hopper::fwd_varlen`` custom op all come down to ``forward`` here, in the four steps
of _fwd.py:

1. validate: the packed tensors as the dense path's (1, total, heads, d) views (the same rules and
   messages for dtype, head dim, heads, strides, scale, window, softcap, backend), the offsets'
   metadata (int32, 1-D, lengths batch + 1 / batch, on q's device), and -- unless a CUDA graph is
   being captured -- their values (``check_offsets``: non-decreasing from >= 0 to <= total,
   seqused within its span). That value check reads the offsets back to the host: one small
   device-to-host copy per call. FLASH_HOPPER_CHECK_OFFSETS=0 skips it (the kernels clamp every
   offset to the tensors, so bad offsets then give wrong results but never touch memory outside
   q, k, v, out, lse).
2./3. the library's policy on the dense view, and the FhFwdParams template with the varlen
   fields (batch = number of sequences, batch strides 0, lse (heads, total_q)); kept per call
   signature like the dense plans.
4. launch: the work list's workspace from torch's caching allocator (fh_fwd_workspace_size
   bytes), data and offset pointers written, fh_fwd on the current stream. The library's prepare
   kernel builds the tile list on the device: no host synchronization in the launch itself.
   Short queries may run on the decode kernel instead: with backend "auto" (and
   FLASH_HOPPER_DECODE allowing it) the library's policy is asked per call with decode_route and
   the longest sequence's queries (``_decode_route``).

Backward (``backward``): per sequence through the dense backward kernels (one launch of the
backward's three kernels per sequence with query rows, into views of dq / dk / dv), which needs
the offsets on the host (one copy per backward call). Exact, but slower than a varlen backward
kernel would be for batches of many short sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from . import _bwd, _decode, _device, _env, _fwd, _plan_cache, _validate, dispatch
from ._abi import FhBackend, FhBwdParams, FhFwdParams, FhVariant
from ._errors import UnsupportedError
from ._tables import FP8_DTYPES, KV_FP8_DTYPES

_plans = _plan_cache.PlanCache(256)


class VarlenPlan(NamedTuple):
    dense: _fwd.Plan  # the (1, total) view's plan: backend, reason, device, library, out dtype
    template: bytes | None  # FhFwdParams with the varlen fields, no data pointers
    batch: int
    out_shape: tuple[int, int, int]
    lse_shape: tuple[int, int]
    workspace_bytes: int


def _check_offsets_tensor(name: str, t: Any, length: int | None, q: torch.Tensor,
                          what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of int32 {what}, got "
                        f"{type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor of {what}, got shape {tuple(t.shape)}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name}: expected {length} entries ({what}), got {t.shape[0]}")
    if t.device != q.device:
        raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got {t.device}")
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous tensor (stride 1), got stride "
                         f"{t.stride(0)}")


def _check_packed(name: str, t: Any, total: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name}: expected a 3-D tensor ({total}, heads, head_dim) for a varlen "
                         f"call, got shape {tuple(t.shape)}")


def _check_max_seqlen(name: str, x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if not 0 <= x <= _validate.INT64_MAX:  # an int64 in the ABI and the custom op's schema
        raise ValueError(f"{name}: expected an int in [0, 2**63), got {x}")
    return x


class VarlenConfig(NamedTuple):
    cfg: _validate.FwdConfig  # of the (1, total) views
    batch: int
    fp8: _validate.Fp8Options | None = None  # FP8 (e4m3) q / k / v: descales (batch, heads_kv)


def check_args(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
               max_seqlen_k: Any, seqused_q: Any, seqused_k: Any, softmax_scale: Any,
               causal: Any, window_size: Any, softcap: Any, backend: Any, q_descale: Any = None,
               k_descale: Any = None, v_descale: Any = None,
               batch_k: int = 0, mixed_ok: bool = False) -> VarlenConfig:
    """Metadata checks of a varlen call (no data read). FP8 (e4m3) q / k / v take descales of
    shape (batch, heads_kv) (or broadcasting 0-d / (1,)); 16-bit calls ignore them, as FA3.
    mixed_ok: the caller's kernel takes 16-bit q against FP8 k / v (the decode kernel), checked as
    flash_attn_func's mixed mode (k_descale / v_descale, no q_descale, o in q's dtype)."""
    _check_packed("q", q, "total_q")
    _check_packed("k", k, "total_k")
    _check_packed("v", v, "total_k")
    fp8 = q.dtype in FP8_DTYPES
    mixed = not fp8 and (k.dtype in KV_FP8_DTYPES or v.dtype in KV_FP8_DTYPES)
    if mixed and not mixed_ok:
        raise UnsupportedError(f"k / v: varlen with FP8 k / v ({k.dtype} / {v.dtype}) against "
                               f"{q.dtype} q (the mixed mode) is not implemented yet; pass "
                               f"FP8 q, k, v or 16-bit ones")
    _check_offsets_tensor("cu_seqlens_q", cu_seqlens_q, None, q, "batch + 1 offsets")
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q: expected batch + 1 >= 1 entries, got 0")
    batch = cu_seqlens_q.shape[0] - 1
    if batch_k:  # a KV cache with an entry per sequence (kvcache.py): the cache's offsets
        _check_offsets_tensor("cu_seqlens_k", cu_seqlens_k, batch_k + 1, q,
                              "batch_cache + 1 offsets")
    else:
        _check_offsets_tensor("cu_seqlens_k", cu_seqlens_k, batch + 1, q,
                              "batch + 1 offsets, as cu_seqlens_q")
    if seqused_q is not None:
        _check_offsets_tensor("seqused_q", seqused_q, batch, q, "one length per sequence")
    if seqused_k is not None:
        _check_offsets_tensor("seqused_k", seqused_k, batch, q, "one length per sequence")
    _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    fp8_options = None
    if fp8 or mixed:
        cfg, fp8_options = _validate.check_fp8_args(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale, causal, window_size,
            softcap, backend, q_descale, k_descale, v_descale, None, "two-level",
            descale_batch=batch)
    else:
        cfg = _validate.check_fwd_args(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                       softmax_scale, causal, window_size, softcap, backend)
    if batch > 65535:
        raise ValueError(f"cu_seqlens_q: expected at most 65536 entries (65535 sequences), got "
                         f"{batch + 1}")
    return VarlenConfig(cfg, batch, fp8_options)


def offsets_checked() -> bool:
    """Whether calls read the offsets back to validate them (not while a CUDA graph is captured,
    not with FLASH_HOPPER_CHECK_OFFSETS=0)."""
    if not _env.offsets_check_on():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class HostOffsets(NamedTuple):
    cu_q: list[int]
    cu_k: list[int]
    used_q: list[int] | None
    used_k: list[int] | None


def host_offsets(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                 seqused_q: torch.Tensor | None,
                 seqused_k: torch.Tensor | None) -> HostOffsets:
    """The offsets as Python lists, in one device-to-host copy of all of them."""
    parts = [cu_seqlens_q, cu_seqlens_k] + [t for t in (seqused_q, seqused_k) if t is not None]
    host = torch.cat(parts).cpu().tolist()
    n = cu_seqlens_q.shape[0]
    pos = 2 * n
    used = []
    for t in (seqused_q, seqused_k):
        used.append(None if t is None else host[pos:pos + n - 1])
        pos += 0 if t is None else n - 1
    return HostOffsets(host[:n], host[n:2 * n], used[0], used[1])


def check_offsets(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                  seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None, total_q: int,
                  total_k: int) -> HostOffsets:
    """The offsets' values: non-decreasing from >= 0 to <= the tensor's tokens, seqused within
    [0, its span]. One device-to-host copy of all of them, returned for callers that need them."""
    h = host_offsets(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    n = len(h.cu_q)
    cu = {"cu_seqlens_q": (h.cu_q, total_q, "q.shape[0]"),
          "cu_seqlens_k": (h.cu_k, total_k, "k.shape[0]")}
    for name, (offsets, total, src) in cu.items():
        if offsets[0] < 0:
            raise ValueError(f"{name}: expected offsets >= 0, got {offsets[0]} at index 0")
        for i in range(1, n):
            if offsets[i] < offsets[i - 1]:
                raise ValueError(f"{name}: expected non-decreasing offsets, got {offsets[i - 1]} "
                                 f"then {offsets[i]} at index {i}")
        if offsets[-1] > total:
            raise ValueError(f"{name}: expected the last offset <= total tokens ({src} = "
                             f"{total}), got {offsets[-1]}")
    for name, used, key in (("seqused_q", h.used_q, "cu_seqlens_q"),
                            ("seqused_k", h.used_k, "cu_seqlens_k")):
        if used is None:
            continue
        offsets = cu[key][0]
        for b, u in enumerate(used):
            span = offsets[b + 1] - offsets[b]
            if u < 0 or u > span:
                raise ValueError(f"{name}: expected 0 <= {name}[{b}] <= its span in {key} "
                                 f"({span}), got {u}")
    return h


def _meta(t: Any) -> tuple | None:
    if t is None:
        return None
    return (type(t), t.shape, t.stride(), t.dtype, t.device)


def _key(q, k, v, cu_q, cu_k, seqused_q, seqused_k, max_q, max_k, out, softmax_scale, causal,
         window_size, softcap, backend, descales=(None, None, None)) -> tuple | None:
    """Everything the metadata checks read: a plan is reused only for a call that would pass
    them the same way (offsets' dtypes and devices included; FP8 calls' descales too)."""
    if type(window_size) not in (tuple, list) or len(window_size) != 2:
        return None
    left, right = window_size
    try:
        return ("varlen", _meta(q), _meta(k), _meta(v), _meta(cu_q), _meta(cu_k),
                _meta(seqused_q), _meta(seqused_k), _meta(out), type(max_q), max_q, type(max_k),
                max_k, type(softmax_scale), softmax_scale, type(causal), causal, type(left),
                left, type(right), right, type(softcap), softcap, type(backend), backend,
                *(_fwd._descale_key(t) for t in descales))
    except AttributeError:  # not a tensor: validation says so
        return None


def _check_out(out: Any, q: torch.Tensor, cfg: _validate.FwdConfig,
               out_dtype: torch.dtype, head_dim_v: int = 0) -> None:
    want = (cfg.seqlen_q, cfg.heads_q, head_dim_v or cfg.head_dim)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != want:
        raise ValueError(f"out: expected shape {want} (total_q, heads_q, head_dim), got "
                         f"{tuple(out.shape)}")
    if out.dtype != out_dtype:
        whose = "q's" if out_dtype == q.dtype else "the FP8 forward's output dtype"
        raise TypeError(f"out: expected dtype {out_dtype} ({whose}), got {out.dtype}")
    if out.device != q.device:
        raise ValueError(f"out: expected a tensor on q's device {q.device}, got {out.device}")
    _validate._check_strides("out", out)


def _checked_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  seqused_q, seqused_k, softmax_scale, causal, window_size, softcap, backend,
                  out, descales, batch_k, mixed_ok=False, own_head_dim_v=False) -> VarlenConfig:
    """check_args, then out against it: what plan() and check_call() both need.
    ``own_head_dim_v``: v has a head dim of its own (_dv.py's kernels): q / k checked as every
    call's (k in v's place), v as k's shape but its last dim."""
    vc = check_args(q, k, k if own_head_dim_v else v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, seqused_q, seqused_k, softmax_scale, causal, window_size,
                    softcap, backend, *descales, batch_k=batch_k, mixed_ok=mixed_ok)
    dv = _validate.check_own_head_dim_v(q, k, v) if own_head_dim_v else 0
    if out is not None:
        _check_out(out, q, vc.cfg, vc.fp8.out_dtype if vc.fp8 is not None else q.dtype, dv)
    return vc


_checked = _plan_cache.PlanCache(256)


def check_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
               seqused_k, softmax_scale, causal, window_size, softcap, backend, out=None,
               descales=(None, None, None), batch_k: int = 0) -> _validate.FwdConfig:
    """plan()'s checks without a kernel plan (for callers that launch another kernel, the
    decode kernel, which takes 16-bit q against FP8 k / v too): the call's FwdConfig, cached per
    call signature as plans are."""
    key = _key(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
               max_seqlen_k, out, softmax_scale, causal, window_size, softcap, backend, descales)
    cfg = _checked.get(key)
    if cfg is None:
        cfg = _checked_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            seqused_q, seqused_k, softmax_scale, causal, window_size, softcap,
                            backend, out, descales, batch_k, mixed_ok=True).cfg
        if key is not None:
            _checked.remember(key, cfg)
    return cfg


def plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
         softmax_scale, causal, window_size, softcap, backend, out=None,
         descales=(None, None, None), batch_k: int = 0, sm_margin: int = 0,
         own_head_dim_v: bool = False) -> VarlenPlan:
    """descales: FP8 calls' (q_descale, k_descale, v_descale); 16-bit calls pass none. batch_k:
    cu_seqlens_k's entries when they are a KV cache's (kvcache.py), else 0. sm_margin: FA3's
    (SMs the kernel leaves free), validated by the caller. own_head_dim_v: v's head dim differs
    from q / k's and the kernel with V's own head dim runs it (_dv.py)."""
    key = _key(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
               max_seqlen_k, out, softmax_scale, causal, window_size, softcap, backend, descales)
    if key is not None and sm_margin:
        key = (key, sm_margin)
    cached = _plans.get(key)
    if cached is not None:
        return cached
    vc = _checked_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       seqused_q, seqused_k, softmax_scale, causal, window_size, softcap, backend,
                       out, descales, batch_k, own_head_dim_v=own_head_dim_v)
    cfg = vc.cfg
    dv = v.shape[-1] if own_head_dim_v else cfg.head_dim
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    dense = _fwd.make_plan(cfg, q4, k4, v4, out=None if out is None else out.unsqueeze(0),
                           fp8=vc.fp8, num_sms=_device.grid_cap(q.device, sm_margin),
                           head_dim_v=dv)
    out_shape = (cfg.seqlen_q, cfg.heads_q, dv)
    lse_shape = (cfg.heads_q, cfg.seqlen_q)
    template = None
    workspace = 0
    if dense.template is not None and vc.batch > 0:
        p = FhFwdParams.from_buffer_copy(dense.template)
        p.batch = vc.batch
        p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = 0
        p.lse_batch_stride, p.lse_head_stride = 0, cfg.seqlen_q
        p.max_seqlen_q, p.max_seqlen_k = max_seqlen_q, max_seqlen_k
        p.cu_seqlens_q = p.cu_seqlens_k = 16  # placeholders for the size query (not read)
        workspace = dense.lib.fwd_workspace_size(p)
        p.cu_seqlens_q = p.cu_seqlens_k = None
        template = bytes(p)
    result = VarlenPlan(dense, template, vc.batch, out_shape, lse_shape, workspace)
    if key is not None:
        _plans.remember(key, result)
    return result


_routes = _plan_cache.PlanCache(256)


def _decode_route(vp: VarlenPlan, longest_q: int | None, seqused_q: Any, seqused_k: Any,
                  device: torch.device) -> bool:
    """Whether the library's policy sends a flash_attn_varlen_func call to the decode kernel: its
    template asked with backend "auto", decode_route and the longest sequence's queries as
    max_seqlen_q (None: unknown, the decode route then declines), once per plan, bound and
    optional array."""
    key = (vp.template, longest_q, seqused_q is not None, seqused_k is not None, device,
           _env.debug_smem_limit())
    routed = _routes.get(key)
    if routed is None:
        p = FhFwdParams.from_buffer_copy(vp.template)
        p.backend, p.variant, p.decode_route = FhBackend.AUTO, FhVariant.TUNED, 1
        p.max_seqlen_q = longest_q or 0
        p.cu_seqlens_q = p.cu_seqlens_k = 16  # placeholders: the policy reads no pointer
        p.seqused_q = 16 if seqused_q is not None else None
        p.seqused_k = 16 if seqused_k is not None else None
        index = device.index if device.index is not None else torch.cuda.current_device()
        routed = dispatch.choose(p, _device.device_info(index).capability)[0] == "decode"
        _routes.remember(key, routed)
    return routed


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
            seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None, softmax_scale: Any,
            causal: Any, window_size: Sequence[int], softcap: Any, backend: Any,
            out: torch.Tensor | None = None, need_lse: bool = True,
            descales: tuple = (None, None, None), kv_batch_idx: torch.Tensor | None = None,
            leftpad_k: torch.Tensor | None = None, batch_k: int = 0, checked: bool = False,
            sm_margin: int = 0, bounds: list | None = None, own_head_dim_v: bool = False,
            ) -> tuple[torch.Tensor, torch.Tensor | None, VarlenPlan]:
    """(out, lse, plan): out (total_q, heads_q, head_dim) written in place when given, lse fp32
    (heads_q, total_q) or None. Rows outside every used span are not written. FP8 (e4m3) q / k /
    v: descales = (q_descale, k_descale, v_descale), out in bf16. KV-cache calls (kvcache.py):
    kv_batch_idx / leftpad_k int32 (batch,) and batch_k (api.h), and ``checked``: the caller
    built or validated the offsets itself (no read-back here). sm_margin: FA3's. ``bounds``: a
    list that receives (longest query span, longest key span) for the backward: read from the
    offsets where this call checked them, else the caller's max_seqlen_q / max_seqlen_k.
    ``own_head_dim_v``: v's head dim differs from q / k's (plan(); out then has v's)."""
    vp = plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
              seqused_k, softmax_scale, causal, window_size, softcap, backend, out, descales,
              batch_k if kv_batch_idx is not None else 0, sm_margin, own_head_dim_v)
    longest_q = max_seqlen_q  # what the decode route sizes its grid by
    longest_k = max_seqlen_k
    if vp.template is not None and not checked and offsets_checked():
        h = check_offsets(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, q.shape[0],
                          k.shape[0])
        # max_seqlen_q is a hint (FA3): the grid takes the longest sequence read here, so a
        # short hint never leaves rows unwritten; unchecked calls take the hint as the bound
        longest_q = max([max_seqlen_q] + [b - a for a, b in zip(h.cu_q, h.cu_q[1:])])
        longest_k = max([max_seqlen_k] + [b - a for a, b in zip(h.cu_k, h.cu_k[1:])])
    if bounds is not None:
        bounds[:] = [longest_q, longest_k]
    device = vp.dense.device
    if out is None:
        out = torch.empty(vp.out_shape, dtype=vp.dense.out_dtype, device=device)
    cfg = vp.dense.cfg
    if (vp.template is not None and not checked and cfg.backend == "auto"
            and not own_head_dim_v and _decode.varlen_too()
            and _decode_route(vp, longest_q, seqused_q, seqused_k, q.device)):
        if not _decode.aligned(q, k, v, out):
            _validate.check_alignment(q=q, k=k, v=v, out=out)
        return (*_decode.varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, longest_q, seqused_k, cfg.softmax_scale,
            (cfg.window_left, cfg.window_right), cfg.softcap, out, need_lse), vp)
    lse = torch.empty(vp.lse_shape, dtype=torch.float32, device=device) if need_lse else None
    if vp.template is None:
        return out, lse, vp
    if (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()) & (_validate.ALIGN_BYTES - 1):
        _validate.check_alignment(q=q, k=k, v=v, out=out)
    workspace = torch.empty(vp.workspace_bytes, dtype=torch.uint8, device=device)
    p = FhFwdParams.from_buffer_copy(vp.template)
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    p.lse = lse.data_ptr() if lse is not None else None
    p.cu_seqlens_q, p.cu_seqlens_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
    p.seqused_q = seqused_q.data_ptr() if seqused_q is not None else None
    p.seqused_k = seqused_k.data_ptr() if seqused_k is not None else None
    p.workspace, p.workspace_bytes = workspace.data_ptr(), vp.workspace_bytes
    if kv_batch_idx is not None:
        p.kv_batch_idx, p.batch_k = kv_batch_idx.data_ptr(), batch_k
    if leftpad_k is not None:
        p.leftpad_k = leftpad_k.data_ptr()
    if q.dtype in FP8_DTYPES:
        p.q_descale, p.k_descale, p.v_descale = _fwd.descale_pointers(*descales)
    _fwd.launch_params(vp.dense, p)
    return out, lse, vp


class BwdPlan(NamedTuple):
    dense: _bwd.Plan  # the (1, total) views' plan: backend, reason, device, library
    template: bytes | None  # FhBwdParams with the varlen fields, no data pointers (None: fa2)


_bwd_plans = _plan_cache.PlanCache(256)


def _bwd_plan(dout, q, k, v, out, lse, dlse, dq, dk, dv, batch, bounds, softmax_scale,
              window_left, window_right, softcap, backend, deterministic, num_sms,
              seqused) -> BwdPlan:
    """The dense views' plan (validation and the library's choice), and for the FA-3 path the
    varlen call's template: batch = sequences, batch strides 0, the lengths' bounds."""
    tensors = (dout, q, k, v, out, lse, dlse, dq, dk, dv)
    key = ("bwd", *(m for t in tensors for m in _bwd._meta(t)),
           batch, bounds, type(softmax_scale), softmax_scale, window_left, window_right,
           type(softcap), softcap, backend, deterministic, num_sms, seqused)
    vp = _bwd_plans.get(key)
    if vp is not None:
        return vp
    views = [t.unsqueeze(0) for t in (dout, q, k, v, out, lse)]
    dlse4 = dlse.unsqueeze(0) if dlse is not None else None
    cfg = _validate.check_bwd_args(*views, dlse4, softmax_scale, window_left, window_right,
                                   softcap, backend, deterministic)
    grads = tuple(t.unsqueeze(0) for t in (dq, dk, dv))
    dense = _bwd.make_plan(cfg, views[0], *views[1:], dlse4, grads=grads, num_sms=num_sms)
    template = None
    if dense.backend == "fa3":
        p = FhBwdParams.from_buffer_copy(dense.template)
        p.batch = batch
        for name in ("q", "k", "v", "o", "dout", "dq", "dk", "dv", "lse", "dlse"):
            setattr(p, f"{name}_batch_stride", 0)
        p.max_seqlen_q, p.max_seqlen_k = bounds
        p.cu_seqlens_q = p.cu_seqlens_k = 16  # placeholders for the size query (not read)
        p.seqused_q = 16 if seqused[0] else None
        p.seqused_k = 16 if seqused[1] else None
        p.workspace_bytes = dense.lib.bwd_workspace_size(p)
        p.cu_seqlens_q = p.cu_seqlens_k = p.seqused_q = p.seqused_k = None
        template = bytes(p)
    vp = BwdPlan(dense, template)
    _bwd_plans.remember(key, vp)
    return vp


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
             seqused_q: torch.Tensor | None, seqused_k: torch.Tensor | None,
             softmax_scale: float, window_left: int, window_right: int, softcap: float,
             backend: str, deterministic: bool, sm_margin: int = 0, max_seqlen_q: int = 0,
             max_seqlen_k: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of a varlen forward; rows outside every used span get 0. The FA-3 path: one
    backward call over the packed sequences (the library reads
    the offsets on the device: no host synchronization, CUDA-graph capturable), each sequence's
    lengths clamped to max_seqlen_q / max_seqlen_k (0: the totals). The FA-2 path: per sequence
    through the dense backward kernels (the offsets read on the host). sm_margin: FA3's, SMs the
    kernels leave free."""
    num_sms = _device.grid_cap(q.device, sm_margin)
    # The FA-3 path writes every row (the preprocess zeroes the rows outside the used spans);
    # without query rows it launches no preprocess, and the FA-2 path writes the spans only.
    fresh = torch.empty if q.shape[0] > 0 else torch.zeros
    dq, dk, dv = (fresh(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if dout.stride(-1) != 1 or any(s % 8 for s in dout.stride()[:-1]):
        dout = dout.contiguous()
    batch = cu_seqlens_q.shape[0] - 1
    if dlse is not None and dlse.stride(-1) != 1:
        dlse = dlse.contiguous()
    bounds = (max_seqlen_q if max_seqlen_q > 0 else q.shape[0],
              max_seqlen_k if max_seqlen_k > 0 else k.shape[0])
    vp = _bwd_plan(dout, q, k, v, out, lse, dlse, dq, dk, dv, batch, bounds, softmax_scale,
                   window_left, window_right, softcap, backend, deterministic, num_sms,
                   (seqused_q is not None, seqused_k is not None))
    if vp.template is not None:
        _launch_varlen_bwd(vp, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q,
                           cu_seqlens_k, seqused_q, seqused_k)
        return dq, dk, dv
    for t in (dq, dk, dv):
        t.zero_()
    cq, ck, used_q, used_k = host_offsets(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    for b in range(len(cq) - 1):
        q0, k0 = cq[b], ck[b]
        sq = used_q[b] if used_q is not None else cq[b + 1] - q0
        sk = used_k[b] if used_k is not None else ck[b + 1] - k0
        if sq == 0 or sk == 0:  # no dk / dv, or dq = 0: the zeros are the gradients
            continue
        rows, keys = slice(q0, q0 + sq), slice(k0, k0 + sk)
        seq_lse = lse[:, rows].unsqueeze(0)
        seq_dlse = dlse[:, rows].unsqueeze(0).contiguous() if dlse is not None else None
        _bwd.into(dout[rows].unsqueeze(0), q[rows].unsqueeze(0), k[keys].unsqueeze(0),
                  v[keys].unsqueeze(0), out[rows].unsqueeze(0), seq_lse,
                  dq[rows].unsqueeze(0), dk[keys].unsqueeze(0), dv[keys].unsqueeze(0),
                  softmax_scale, window_left, window_right, softcap, backend,
                  deterministic, seq_dlse, num_sms, cache=True)
    return dq, dk, dv


def _launch_varlen_bwd(vp: BwdPlan, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q,
                       cu_seqlens_k, seqused_q, seqused_k) -> None:
    """fh_bwd for the varlen template with these tensors' pointers (the dense views' checks of
    alignment and of dout's layout first)."""
    plan = vp.dense
    dout4, restride = _bwd._loadable_dout(plan, dout.unsqueeze(0))
    _validate.check_alignment(q=q, k=k, v=v, out=out, lse=lse, dlse=dlse, dq=dq, dk=dk, dv=dv)
    p = FhBwdParams.from_buffer_copy(vp.template)
    if restride:
        _, p.dout_row_stride, p.dout_head_stride = _validate.effective_strides(dout4)[:3]
    workspace = torch.empty(p.workspace_bytes, dtype=torch.uint8, device=plan.device)
    p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
    p.lse, p.dout = lse.data_ptr(), dout4.data_ptr()
    p.dlse = dlse.data_ptr() if dlse is not None else None
    p.dq, p.dk, p.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    p.workspace = workspace.data_ptr()
    p.cu_seqlens_q, p.cu_seqlens_k = cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr()
    p.seqused_q = seqused_q.data_ptr() if seqused_q is not None else None
    p.seqused_k = seqused_k.data_ptr() if seqused_k is not None else None
    _bwd.launch_params(plan, p)


def clear_plans() -> None:
    _plans.clear()


__all__ = [
    "BwdPlan",
    "VarlenPlan",
    "backward",
    "check_args",
    "check_offsets",
    "clear_plans",
    "forward",
    "offsets_checked",
    "plan",
]
