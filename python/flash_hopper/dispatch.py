"""Which kernel path serves a forward or a backward, and why: the library's policy, asked, not
re-implemented.

The policy lives in C (kernels/src/policy.cu): fh_fwd applies it to the current device, and
fh_fwd_select_backend answers for any compute capability without touching a GPU. Python asks the
second one with the facts it knows:

- ``choose(params, capability)``: for a filled request (FhFwdParams, data pointers not needed);
  the host path (_fwd.py) asks once per call signature and pins the answer in its plan, so the
  backend fwd_into reports is the one that ran. A request with decode_route (flash_attn_func's
  and flash_attn_varlen_func's "auto" calls) may get "decode": the decode kernel serves it.
- ``choose_bwd(params, capability)``: the same for the backward (FhBwdParams,
  fh_bwd_select_backend); the backward's host path (_bwd.py) pins it in its plan.
- ``hypothetical(capability, dtype, head_dim, backend, causal)``: for a GPU that is not here
  (``flash-hopper info --capability 9.0``, or any info on a machine without a GPU).
- ``supports(**config)`` (``flash_hopper.supports``): (ok, reason) for a whole configuration
  (heads, lengths, masks, varlen / KV cache), for servers to ask before capturing graphs.

The rules it applies, in words (policy.cu has them in code): "decode" (the decode kernel, asked
for with decode_route and backend "auto") where it serves the call: its table's dtypes and head
dims (build_info "decode"), at most its max_rows packed rows (query tokens x query heads per KV
head), cc >= 8.0 with shared memory for its stages; "fa3" runs on compute capability 9.0 only
(sm90a code), when this build has the kernel for the dtype / head-dim bucket / variant and q/k/v
have positive strides on every dimension of size > 1 (TMA); "fa2" runs on every cc >= 8.0 with
its kernel built; "auto" takes decode where it serves the call, else fa3 where it can run, else
fa2. Errors name the GPU, the build variables to change or the stride at fault.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _abi, _env, _lib, _tables
from ._abi import FhBwdParams, FhDecodeParams, FhFwdParams
from ._tables import head_dim_bucket  # re-exported: bench/backends.py imports it from here

if TYPE_CHECKING:
    import torch

__all__ = ["choose", "choose_bwd", "head_dim_bucket", "hypothetical", "supports"]


def choose(params: FhFwdParams, capability: tuple[int, int]) -> tuple[str, str, _abi.FhBackend]:
    """(name, reason, FhBackend) the library picks for ``params`` on a GPU of ``capability``.

    ``name`` is what runs: "fa2", "fa3", the requested FA-3 variant ("fa3-no-pingpong", ...) or
    "decode" (a decode_route request the decode kernel serves).
    Raises ValueError for invalid params and UnsupportedError (a NotImplementedError) when
    nothing in this build can serve them on that GPU.
    """
    backend, reason = _lib.get_library().policy(params, capability)
    return _tables.backend_name(backend, params.variant), reason, backend


def choose_bwd(params: FhBwdParams,
               capability: tuple[int, int]) -> tuple[str, str, _abi.FhBackend]:
    """(name, reason, FhBackend) of the library's backward policy for ``params`` on a GPU of
    ``capability``: "fa2" or "fa3" (the FA-3 ablation variants train with the tuned backward).
    Raises like choose(): a backward nothing in this build can serve (e.g. "fa3" for a bucket
    whose FA-3 backward kernel this build left out, or on a GPU other than cc 9.0) is an
    UnsupportedError whose message says so."""
    backend, reason = _lib.get_library().policy(params, capability)
    return _tables.backend_name(backend), reason, backend


def _set_dtypes(p: FhFwdParams, dtype: str) -> None:
    """A request's dtype fields from a dtype name (_tables.canonical_dtype's: "bf16", "e4m3", or a
    mixed "bf16+e4m3": 16-bit q, FP8 k / v); FP8 inputs write bf16 output."""
    if dtype in _tables.MIXED_DTYPES:
        q_dtype, kv_dtype = _tables.MIXED_DTYPES[dtype]
        p.dtype = p.out_dtype = _tables.TORCH_DTYPES[q_dtype]
        p.kv_dtype = _tables.KV_FP8_DTYPES[kv_dtype]
    else:
        p.dtype = p.out_dtype = p.kv_dtype = _tables.INPUT_DTYPES[_tables.DTYPE_NAMES[dtype]]
    if p.dtype == _abi.FhDtype.E4M3:
        p.out_dtype = _abi.FhDtype.BF16


def hypothetical(
    capability: tuple[int, int], dtype: str | torch.dtype | tuple, head_dim: int, backend: str = "auto",
    causal: bool = False,
) -> tuple[str, str]:
    """(name, reason) flash_attn_func would get for a small contiguous (batch 1, 128 x 128 tokens,
    1 head) problem of ``dtype`` (a name such as "bf16", a torch dtype or a (q, K / V) pair of
    them: _tables.canonical_dtype) and ``head_dim`` on a GPU of ``capability`` (its
    128 rows are short queries: "decode" where FLASH_HOPPER_DECODE allows the route and the
    decode kernel serves them); raises like choose()."""
    from . import _decode  # torch-dependent: imported when asked

    if backend not in _tables.BACKENDS:
        raise ValueError(
            f"backend: expected one of {', '.join(_tables.BACKEND_NAMES)}, got {backend!r}"
        )
    dtype = _tables.canonical_dtype(dtype)
    seqlen = 128
    p = FhFwdParams()
    p.abi_version = _abi.ABI_VERSION
    _set_dtypes(p, dtype)
    p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv = 1, seqlen, seqlen, 1, 1
    p.head_dim = p.head_dim_v = head_dim
    for prefix in ("q", "k", "v", "o"):
        setattr(p, f"{prefix}_batch_stride", seqlen * head_dim)
        setattr(p, f"{prefix}_row_stride", head_dim)
        setattr(p, f"{prefix}_head_stride", head_dim)
    p.softmax_scale = 1.0
    p.window_left, p.window_right = -1, 0 if causal else -1
    p.backend, p.variant = _tables.BACKENDS[backend]
    p.decode_route = int(_decode.everywhere())
    name, reason, _ = choose(p, capability)
    return name, reason


def supports(
    *,
    dtype: str | torch.dtype | tuple = "bf16",
    head_dim: int = 128,
    head_dim_v: int | None = None,
    heads_q: int = 32,
    heads_kv: int | None = None,
    seqlen_q: int = 1,
    seqlen_k: int = 4096,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    backend: str = "auto",
    varlen: bool = False,
    kvcache: bool = False,
    page_size: int | None = None,
    sinks: bool = False,
    rotary: bool = False,
    capability: tuple[int, int] | None = None,
    qv: bool = False,
    _head_dim_v: int = 0,
) -> tuple[bool, str]:
    """(ok, reason): whether a forward configuration runs, and on which kernel, before a server
    captures graphs around it. The library's own validation and policy answer
    (fh_fwd_select_backend / fh_decode_select_backend on this GPU, or on ``capability``): ok is
    False with the reason a call would raise, naming the argument; True with the kernel family
    that runs and why ("fa3: cc 9.0 and fa3 kernel built for bf16 hdim 128", "decode: the decode
    kernel (cc 9.0): ...", plus how a KV-cache call is packed or split off the decode kernel).

    dtype: "fp16", "bf16", "e4m3" or a mixed name ("bf16+e4m3": 16-bit q, FP8 K / V), or the
    torch dtypes (torch.bfloat16, torch.float8_e4m3fn; "bfloat16" and "torch.bfloat16" too) and,
    for the mixed mode, a (q, K / V) pair of them: (torch.bfloat16, torch.float8_e5m2). varlen:
    flash_attn_varlen_func; kvcache: flash_attn_with_kvcache (a dense cache: varlen kernels);
    rotary / page_size: flash_attn_with_kvcache's rotary embedding (every route: it runs in
    torch before the kernel, so it changes no answer) and paged caches; sinks: sink logits
    (flash_attn_with_kvcache: in the decode kernel or from the kernels' LSE; flash_attn_func /
    flash_attn_varlen_func: from the call's LSE, on the kernel the call without sinks runs on).
    With backend "auto" short queries run on the decode kernel where the library's policy says
    it serves them (FLASH_HOPPER_DECODE allowing the route), paged caches read in place; others
    on the FA kernels (varlen kernels for KV-cache calls, paged caches gathered first).

    head_dim_v: v's head dim (None: head_dim). Without qv, flash_attn_func /
    flash_attn_varlen_func run the kernel with V's own head dim where the library has one for
    the pair (d 192 / dv 128, fp16 / bf16, cc 9.0: the answer for inference calls; calls under
    grad pad, and FLASH_HOPPER_DV_KERNEL=0 pads every call), else zero padding (_dv.py): the
    answer is then the kernel of the padded head dim. qv: a call with FA3's qv (MLA's extra
    query; head_dim <= 64, head_dim_v in [256, 512]), and with kvcache any head_dim_v of its
    own, are answered by the API's own checks (_validate.check_qv / check_own_v_cache) on
    tensors of these shapes: they run the composite path of torch GEMMs (_qv.py, no fused
    kernel), on any device, so ``capability`` does not change the answer."""
    from . import _decode  # torch-dependent: imported when asked

    try:
        dtype = _tables.canonical_dtype(dtype)
    except ValueError as exc:
        return False, str(exc)
    if page_size is not None and not kvcache:
        return False, "page_size: paged KV outside flash_attn_with_kvcache is not implemented yet"
    if backend not in _tables.BACKENDS:
        return False, (f"backend: expected one of {', '.join(_tables.BACKEND_NAMES)}, got "
                       f"{backend!r}")
    own_v = head_dim_v is not None and head_dim_v != head_dim
    if qv or (own_v and kvcache):  # the composite route
        return _supports_composite(dtype, head_dim, head_dim if head_dim_v is None else
                                   head_dim_v, heads_q, heads_q if heads_kv is None else heads_kv,
                                   seqlen_q, seqlen_k, causal, window_size, softcap, backend,
                                   varlen, kvcache, page_size, qv)
    dv_note = ""
    if own_v:  # v's own head dim: its kernel, or zero padding
        if dtype not in ("fp16", "bf16"):
            return False, (f"head_dim_v: a V head dim of its own ({head_dim_v} != head_dim "
                           f"{head_dim}) with {dtype} inputs is implemented with qv only")
        if head_dim_v < 1 or head_dim_v % 8 or head_dim % 8 or head_dim > 256:
            return False, (f"head_dim_v: expected head_dim and head_dim_v positive multiples "
                           f"of 8, head_dim <= 256, got {head_dim} and {head_dim_v}")
        if backend in ("auto", "fa3", "fa3-no-pingpong") and _env.dv_kernel_on():
            native = supports(dtype=dtype, head_dim=head_dim, heads_q=heads_q, heads_kv=heads_kv,
                              seqlen_q=seqlen_q, seqlen_k=seqlen_k, causal=causal,
                              window_size=window_size, softcap=softcap, backend=backend,
                              varlen=varlen, sinks=sinks, capability=capability,
                              _head_dim_v=head_dim_v)
            if native[0]:
                return True, (f"{native[1]} (inference calls; under grad V is zero-padded, "
                              f"_dv.py)")
        from . import _dv  # torch-dependent: imported when asked

        dv_note = _dv.padding_note(head_dim, head_dim_v)
        head_dim = _dv.padding_width(head_dim, head_dim_v)
    if varlen and dtype in _tables.MIXED_DTYPES:
        return False, ("dtype: varlen calls with 16-bit q against FP8 K / V (the mixed mode) are "
                       "not implemented yet")
    heads_kv = heads_q if heads_kv is None else heads_kv
    if capability is None:
        try:
            import torch

            from . import _device

            capability = _device.device_info(torch.cuda.current_device()).capability
        except Exception as exc:  # noqa: BLE001 - no GPU here: say so
            return False, (f"no CUDA device to answer for ({type(exc).__name__}: {exc}); pass "
                           f"capability=(9, 0) to ask for a GPU that is not here")
    left, right = (int(window_size[0]), int(window_size[1]))
    if causal:
        right = 0
    served, why_not = None, "backend is not 'auto' or FLASH_HOPPER_DECODE is 0"
    if kvcache and backend == "auto" and _decode.enabled():
        served, why_not = _kvcache_decode(dtype, head_dim, heads_q, heads_kv, seqlen_q, seqlen_k,
                                          left, right, softcap, page_size, capability)
        if served is not None:
            return True, f"decode: {served}"
    if kvcache and dtype in _tables.MIXED_DTYPES:
        return False, (f"dtype: KV-cache calls with 16-bit q against an FP8 cache ({dtype}, the "
                       f"mixed mode) run on the decode kernel only, which does not serve this "
                       f"one: {why_not}")
    p = FhFwdParams()
    p.abi_version = _abi.ABI_VERSION
    _set_dtypes(p, dtype)
    p.batch, p.seqlen_q, p.seqlen_k = 1, max(seqlen_q, 0), max(seqlen_k, 0)
    p.heads_q, p.heads_kv = heads_q, heads_kv
    p.head_dim = p.head_dim_v = head_dim
    if _head_dim_v:  # the policy's answer for the kernels with V's own head dim
        p.head_dim_v = _head_dim_v
    pad = -(-max(head_dim, p.head_dim_v) // 16) * 16  # loadable rows: 16-byte aligned
    for prefix, heads, rows in (("q", heads_q, seqlen_q), ("k", heads_kv, seqlen_k),
                                ("v", heads_kv, seqlen_k), ("o", heads_q, seqlen_q)):
        setattr(p, f"{prefix}_row_stride", heads * pad)
        setattr(p, f"{prefix}_head_stride", pad)
        setattr(p, f"{prefix}_batch_stride", 0 if (varlen or kvcache) else rows * heads * pad)
    p.lse_head_stride = seqlen_q if (varlen or kvcache) else 0
    if varlen or kvcache:  # placeholders: the policy reads no pointer
        p.cu_seqlens_q = p.cu_seqlens_k = 16
        p.max_seqlen_q = max(seqlen_q, 0)  # the one sequence's queries bound the decode route
    p.softmax_scale = float(head_dim) ** -0.5 if head_dim > 0 else 1.0
    p.softcap = softcap
    p.window_left, p.window_right = left, right
    p.backend, p.variant = _tables.BACKENDS[backend]
    # flash_attn_func's and flash_attn_varlen_func's short queries: the decode kernel where it
    # serves them (the policy's rung above the FA paths)
    if not kvcache:
        p.decode_route = int(_decode.varlen_too() if varlen else _decode.everywhere())
    try:
        name, reason, _ = choose(p, capability)
    except (ValueError, NotImplementedError) as exc:
        return False, str(exc)
    note = dv_note
    unmasked = left < 0 and (right < 0 or seqlen_q == 1)
    if kvcache and unmasked and (heads_q > heads_kv):
        note = (f"; decode rows unmasked: {heads_q // heads_kv} query heads per KV head packed "
                f"into one tile, keys split across SMs when the tiles are few")
    if kvcache and page_size is not None:
        note += "; paged: the pages gathered into a dense copy per call (off the decode kernel)"
    return True, f"{name}: {reason}{note}"


def _kvcache_decode(dtype: str, head_dim: int, heads_q: int, heads_kv: int, seqlen_q: int,
                    seqlen_k: int, left: int, right: int, softcap: float, page_size: int | None,
                    capability: tuple[int, int]) -> tuple[str | None, str | None]:
    """(reason, None) when flash_attn_with_kvcache's call of this shape runs on the decode kernel
    (fh_decode_select_backend, then fh_decode_plan's checks), else (None, why not): the call then
    runs on the varlen kernels, whose answer supports gives (the mixed mode has no other route).
    dtype: a DTYPE_NAMES or MIXED_DTYPES name."""
    d = FhDecodeParams()
    d.abi_version = _abi.ABI_VERSION
    if dtype in _tables.MIXED_DTYPES:
        q_dtype, kv_dtype = _tables.MIXED_DTYPES[dtype]
        d.dtype, d.kv_dtype = _tables.TORCH_DTYPES[q_dtype], _tables.KV_FP8_DTYPES[kv_dtype]
    else:
        d.dtype = int(_tables.INPUT_DTYPES.get(_tables.DTYPE_NAMES.get(dtype),
                                               _abi.FhDtype.FP32))
    d.batch, d.seqlen_q, d.heads_q, d.heads_kv, d.head_dim = (1, seqlen_q, heads_q, heads_kv,
                                                              head_dim)
    d.page_size = page_size if page_size is not None else max(seqlen_k, 1)
    d.num_pages = d.max_pages = d.page_table_stride = 1
    if page_size is not None:
        d.page_table = 16  # a placeholder: the policy and the plan read whether, not where
        d.max_pages = d.page_table_stride = max(-(-seqlen_k // max(page_size, 1)), 1)
    d.softmax_scale = float(head_dim) ** -0.5 if head_dim > 0 else 1.0
    d.softcap = softcap
    d.window_left, d.window_right = left, right
    lib = _lib.get_library()
    try:
        _, reason = lib.policy(d, capability)
        lib.decode_plan(d, num_sms=1)
    except (ValueError, NotImplementedError) as exc:
        return None, str(exc)
    return reason, None


def _supports_composite(dtype: str, head_dim: int, head_dim_v: int, heads_q: int,
                        heads_kv: int, seqlen_q: int, seqlen_k: int, causal: bool,
                        window_size: tuple[int, int], softcap: float, backend: str, varlen: bool,
                        kvcache: bool, page_size: int | None, qv: bool) -> tuple[bool, str]:
    """supports(qv=True), and flash_attn_with_kvcache with a V head dim of its own: the API's
    checks (_validate.check_qv / check_own_v_cache) on meta tensors of the configuration's
    shapes, so the answer is the API's by construction."""
    import torch

    from . import _validate

    q_dtype, kv_dtype = _tables.MIXED_DTYPES.get(dtype, (_tables.DTYPE_NAMES.get(dtype),) * 2)

    def meta(rows: int, heads: int, dim: int, element: torch.dtype) -> torch.Tensor:
        return torch.empty(1, max(rows, 0), max(heads, 0), max(dim, 0), dtype=element,
                           device="meta")

    names = ("k_cache", "v_cache") if kvcache else ("k", "v")
    q = meta(seqlen_q, heads_q, head_dim, q_dtype)
    k = meta(seqlen_k, heads_kv, head_dim, kv_dtype)
    v = meta(seqlen_k, heads_kv, head_dim_v, kv_dtype)
    try:
        if qv:
            _validate.check_qv(q, k, v, meta(seqlen_q, heads_q, head_dim_v, q_dtype), None,
                               causal, tuple(window_size), softcap, backend, *names)
        else:
            _validate.check_own_v_cache(q, k, v, None, causal, tuple(window_size), softcap,
                                        backend)
    except (TypeError, ValueError, NotImplementedError) as exc:
        return False, str(exc)
    entry = ("flash_attn_with_kvcache" + (", paged in place" if page_size is not None else "")
             if kvcache else "flash_attn_varlen_func" if varlen else "flash_attn_func")
    what = "qv (MLA's extra query, " if qv else "a v_cache of its own head dim ("
    return True, (f"composite: {what}d {head_dim} / dv {head_dim_v}) runs a composite path of "
                  f"torch GEMMs on q's device, not a fused kernel ({entry}; online softmax over "
                  f"key blocks in fp32)")
