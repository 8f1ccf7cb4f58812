"""`flash-hopper decode`: the decode sweep (bandwidth of attention against a KV cache).

Each point is batch x context: `seqlen_q` new query tokens per sequence (1 by default; 2..8 for
speculative decoding) against a full cache of `context` keys, GQA heads_q / heads_kv, one head
dim, causal (bottom-right: query i of n sees keys up to context - n + i). The metric is
bandwidth: bytes of the K and V cache read (2 * batch * context * heads_kv * head_dim * the
cache's element size: 2 for bf16 / fp16, 1 for FP8) per second of one call, the call timed as
CUDA-graph replays with the inputs resident and nothing allocated by the timing (a server's decode
step). Host time per call is measured too, eager (the Python call's own time while the GPU keeps
up) and graph-replayed.

Backends: flash-hopper's flash_attn_with_kvcache (dense cache), flash-hopper's flash_attn_func on
the same cache (the dense call, for comparison), torch SDPA's cuDNN backend on the dense cache
(enable_gqa; one query token, since SDPA's causal mask is top-left aligned). Each backend's
output is checked against a float32 reference on the first sequences of the batch (16-bit caches:
max error within 2e-2 + FA3's rule of twice the same computation in the input dtype).

FP8 caches (dtype "e4m3", FA3's convention: q, K and V e4m3 with q / k / v descales, output bf16;
"bf16+e4m3", "fp16+e5m2" ...: the mixed mode, 16-bit q against an e4m3 / e5m2 cache with k / v
descales, output in q's dtype): the values are drawn as for the 16-bit point (bf16 for e4m3, q's
dtype for the mixed mode) and quantized per (batch, kv head) as the `bench` sweep's FP8 inputs are
(fp8_inputs.py). The reference is float32 attention on the dequantized values (data * descale),
so the check measures the kernel's error, not the quantization's: e4m3 rows by the FP8 rule of
check.py (relative RMS error <= 5 %), mixed rows by the 16-bit rule above on q and the
dequantized K / V. Bytes counted: the FP8 cache, 1 byte per element (the descales, q and the
output are not counted, as q and the output are not for 16-bit caches). Backends without an FP8
path are skipped with the reason (SDPA takes no FP8 tensors; FA4 is given 16-bit caches only;
FA3 has no mixed mode): a skipped row is recorded, never timed on a dequantized copy.

--page-size P adds a "flash-hopper-paged" backend: the same cache as a pool of P-token pages
in shuffled order with a page table (flash_attn_with_kvcache's paged path). Peers on request
(--backends): "flash-attn-cute-paged", FA4's paged call (flash_attn.cute's flash_attn_varlen_func
with page_table and seqused_k, its own split choice) on the same pool, and "flash-attn-cute" on
the dense cache; "flash-attn3", FA3's flash_attn_with_kvcache on the dense cache (the module the
`bench` registry finds for its flash-attn3 peer: a source build or the fa3-fwd wheel), and
"flash-attn3-paged" on the pool, skipped where FA3's build reports no paged KV (the fa3-fwd
wheel's FLASHATTENTION_DISABLE_PAGEDKV); "flashinfer-paged" ("flashinfer", "flashinfer-python"),
FlashInfer's BatchDecodeWithPagedKVCacheWrapper on the pool, the page table given as its
indptr / indices / last_page_len and planned before timing (the timed call is its run alone). It
takes one query token per sequence, and an FP8 cache with 16-bit queries and one k / v scale
per call: e4m3 queries are skipped, and so are mixed rows whose descales differ per (sequence,
kv head), as the bench's per-head quantization gives them.
"""

from __future__ import annotations

import importlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from . import cases
from .check import METRIC_REL_RMSE
from .errors import first_line
from .fp8_inputs import Fp8Input

# batch x context: one long sequence, a few mid-size ones, a large batch of short ones.
DEFAULT_POINTS = ("1x8k", "1x128k", "8x32k", "32x32k", "128x16k", "64x1k")
DEFAULT_BACKENDS = ("flash-hopper", "flash-hopper-dense", "sdpa-cudnn")
FA4_BACKENDS = ("flash-attn-cute-paged", "flash-attn-cute")
# FA3's kvcache call; "flash-attn3" is the `bench` registry's name for the same package.
FA3, FA3_PAGED = "flash-attn3", "flash-attn3-paged"
# FlashInfer's batch decode: a paged cache only.
FLASHINFER_PAGED = "flashinfer-paged"
PEER_BACKENDS = (*FA4_BACKENDS, FA3, FA3_PAGED, FLASHINFER_PAGED)
BACKENDS = (*DEFAULT_BACKENDS, "flash-hopper-paged", *PEER_BACKENDS)
PAGED_BACKENDS = ("flash-hopper-paged", "flash-attn-cute-paged", FA3_PAGED, FLASHINFER_PAGED)
# The `bench` registry's names (after registry.canonical_name) that mean another decode backend:
# its flashinfer peer is FlashInfer's prefill, whose decode counterpart here is the paged call.
DECODE_ALIASES = {"flashinfer": FLASHINFER_PAGED}
CHECK_SEQUENCES = 2  # the reference check's sequences (the first ones of the batch)
CHECK_ATOL = 2e-2  # the 16-bit rule's absolute term (bf16 outputs)
# FA3's build flags (its setup.py writes them to <package>_config.py) that refuse decode rows.
FA3_NO_PAGED = "FLASHATTENTION_DISABLE_PAGEDKV"
FA3_DTYPE_FLAGS = {"fp16": "FLASHATTENTION_DISABLE_FP16", "e4m3": "FLASHATTENTION_DISABLE_FP8"}


class DecodeError(RuntimeError):
    """A one-line reason the decode sweep cannot run here (no GPU, no library, bad arguments)."""


class DecodeSkip(DecodeError):
    """A backend that does not take this row's inputs (a peer without FP8, without paged KV ...):
    the row is recorded as skipped with this reason, which is not a failure."""


def parse_count(text: str) -> int:
    """'8k' -> 8192, '300' -> 300 (the bench's counts: cases.parse_count)."""
    try:
        return cases.parse_count(text)
    except ValueError:
        raise ValueError(f"expected a positive count like 300 or 8k, got {text!r}") from None


def parse_point(text: str) -> tuple[int, int]:
    """'32x32k' -> (32, 32768)."""
    parts = text.lower().split("x")
    if len(parts) != 2:
        raise ValueError(f"--points: expected BATCHxCONTEXT like 32x32k, got {text!r}")
    try:
        return parse_count(parts[0]), parse_count(parts[1])
    except ValueError as exc:
        raise ValueError(f"--points: {exc} in {text!r}") from None


def parse_heads(text: str) -> tuple[int, int]:
    """'32/8' -> (32, 8): query heads / KV heads, a whole ratio."""
    parts = text.split("/")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--heads: expected Q/KV like 32/8, got {text!r}")
    hq, hk = int(parts[0]), int(parts[1])
    if hq % hk:
        raise ValueError(f"--heads: query heads must be a multiple of KV heads, got {text!r}")
    return hq, hk


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: int
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    seqlen_q: int = 1
    dtype: str = "bf16"  # cases.DTYPES: bf16, fp16, e4m3 (FA3's FP8), bf16+e4m3 ... (mixed)
    page_size: int | None = None  # the flash-hopper-paged backend's pages

    @property
    def q_dtype(self) -> str:
        return cases.dtype_parts(self.dtype)[0]

    @property
    def kv_dtype(self) -> str:
        return cases.dtype_parts(self.dtype)[1]

    @property
    def is_fp8(self) -> bool:
        """FA3's FP8 convention: q, K and V e4m3, three descales."""
        return self.dtype in cases.FP8_DTYPES

    @property
    def is_mixed(self) -> bool:
        """16-bit q against an FP8 cache, k / v descales."""
        return self.dtype in cases.MIXED_DTYPES

    def kv_bytes(self) -> int:
        """Bytes of the K and V cache one call reads, at the cache's element size."""
        return 2 * self.batch * self.context * self.heads_kv * self.head_dim * \
            cases.DTYPE_BYTES[self.kv_dtype]

    def bytes_counted(self) -> str:
        """What kv_bytes counts, for the result files."""
        size = cases.DTYPE_BYTES[self.kv_dtype]
        return (f"K and V cache ({self.kv_dtype}, {size} byte{'s' if size > 1 else ''} per "
                f"element); not q, the output or the descales")

    def label(self) -> str:
        return f"{self.batch}x{cases.short_count(self.context)}"


def tbps(nbytes: int, seconds: float) -> float:
    """Terabytes (1e12 B) per second."""
    return nbytes / seconds / 1e12


@dataclass
class DecodeRow:
    point: DecodePoint
    backend: str
    device_us: float | None = None  # per call, CUDA-graph replay
    # The Python call's own time; flash-hopper's flash_attn_with_kvcache checks its values on the
    # host (one device-to-host copy: it waits for the GPU) unless FLASH_HOPPER_CHECK_OFFSETS=0.
    host_us_eager: float | None = None
    host_us_graph: float | None = None  # a graph replay's launch, per captured call
    tbps: float | None = None
    check_err: float | None = None
    check_tol: float | None = None
    check_metric: str | None = None  # check.METRIC_MAX_ABS or check.METRIC_REL_RMSE (e4m3)
    passed: bool | None = None
    error: str | None = None
    skipped: str | None = None  # why the backend does not take this row (not a failure)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["point"] = asdict(self.point) | {"label": self.point.label(),
                                           "kv_dtype": self.point.kv_dtype,
                                           "kv_bytes": self.point.kv_bytes(),
                                           "bytes_counted": self.point.bytes_counted()}
        return d


# --- the GPU side ---------------------------------------------------------------------------------


def make_inputs(point: DecodePoint, seed: int = 0, device: str = "cuda"):
    """q (b, sq, hq, d), k / v caches (b, context, hk, d) full, cache_seqlens (b,) int32.

    FP8 points draw the values of the 16-bit point they come from (runner.FP8_SOURCE_DTYPE for
    e4m3, q's dtype for the mixed mode; same shapes, seed and generator calls) and quantize them
    per (batch, kv head) as the `bench` sweep's FP8 inputs are: q, k and v become
    fp8_inputs.Fp8Input for e4m3 (q's descale per kv head, FA3's), k and v for the mixed mode."""
    import torch

    from .fp8_inputs import quantize_inputs, quantize_kv_cache
    from .runner import FP8_SOURCE_DTYPE, TORCH_DTYPES

    source = FP8_SOURCE_DTYPE if point.is_fp8 else point.q_dtype
    dtype = getattr(torch, TORCH_DTYPES[source])
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(point.batch, point.seqlen_q, point.heads_q, point.head_dim, device=device,
                    dtype=dtype, generator=g)
    kc, vc = (torch.randn(point.batch, point.context, point.heads_kv, point.head_dim,
                          device=device, dtype=dtype, generator=g) for _ in range(2))
    lengths = torch.full((point.batch,), point.context, dtype=torch.int32, device=device)
    if point.is_fp8:
        q, kc, vc = quantize_inputs(q, kc, vc)
    elif point.is_mixed:
        kc, vc = quantize_kv_cache(kc, vc, point.kv_dtype)
    return q, kc, vc, lengths


def unpack(q, kc, vc):
    """(q, k, v tensors, descale keywords): Fp8Inputs' data, their descales as FA3's
    q_descale / k_descale / v_descale (only the FP8 ones: k and v for the mixed mode)."""
    tensors, descales = [], {}
    for prefix, t in (("q", q), ("k", kc), ("v", vc)):
        if isinstance(t, Fp8Input):
            descales[f"{prefix}_descale"] = t.descale
            t = t.data
        tensors.append(t)
    return (*tensors, descales)


def backend_call(name: str, point: DecodePoint, q, kc, vc, lengths) -> Callable[[], object]:
    """The timed call of a backend on resident inputs (make_inputs'). Raises DecodeSkip when the
    backend does not take the row's inputs, another exception when it cannot run."""
    if name not in BACKENDS:
        raise DecodeError(f"unknown decode backend {name!r}; expected one of "
                          f"{', '.join(BACKENDS)}")
    if name in PAGED_BACKENDS and point.page_size is None:
        raise DecodeError(f"{name}: needs --page-size")
    q, kc, vc, descales = unpack(q, kc, vc)
    if name.startswith("flash-hopper"):
        return _flash_hopper_call(name, point, q, kc, vc, lengths, descales)
    if name in FA4_BACKENDS:
        return _fa4_call(name, point, q, kc, vc, lengths, descales)
    if name in (FA3, FA3_PAGED):
        return _fa3_call(name, point, q, kc, vc, lengths, descales)
    if name == FLASHINFER_PAGED:
        return _flashinfer_call(point, q, kc, vc, lengths, descales)
    return _sdpa_cudnn_call(point, q, kc, vc, descales)


def _flash_hopper_call(name, point, q, kc, vc, lengths, descales):
    if name == "flash-hopper-dense":
        from flash_hopper import flash_attn_func

        return lambda: flash_attn_func(q, kc, vc, causal=True, **descales)
    from flash_hopper import flash_attn_with_kvcache

    if name == "flash-hopper-paged":
        pool_k, pool_v, table = paged_copy(kc, vc, point.page_size)
        return lambda: flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lengths,
                                               page_table=table, causal=True, **descales)
    return lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=True,
                                           **descales)


def _fa4_call(name, point, q, kc, vc, lengths, descales):
    if descales:
        raise DecodeSkip(f"{name}: 16-bit caches only (FA4's call is given no descales here)")
    from .peers import argv_shielded

    with argv_shielded():
        from flash_attn.cute import flash_attn_varlen_func
    if name == "flash-attn-cute-paged":
        pool_k, pool_v, table = paged_copy(kc, vc, point.page_size)
        return lambda: _first(flash_attn_varlen_func(q, pool_k, pool_v, seqused_k=lengths,
                                                     page_table=table, causal=True))
    return lambda: _first(flash_attn_varlen_func(q, kc, vc, causal=True))


def _fa3_call(name, point, q, kc, vc, lengths, descales):
    module_name, func, flags = fa3_interface()
    reason = fa3_skip_reason(name, point, module_name, flags)
    if reason is not None:
        raise DecodeSkip(reason)
    kwargs = {"cache_seqlens": lengths, "causal": True, **descales}
    if name == FA3_PAGED:
        pool_k, pool_v, table = paged_copy(kc, vc, point.page_size)
        return lambda: _first(func(q, pool_k, pool_v, page_table=table, **kwargs))
    return lambda: _first(func(q, kc, vc, **kwargs))


def fa3_interface() -> tuple[str, Callable, dict]:
    """(module name, its flash_attn_with_kvcache, its build flags) of FA3's interface, the
    module the `bench` registry's flash-attn3 peer imports (a source build, the flash_attn_3
    wheels or the fa3-fwd wheel); raises DecodeSkip naming why there is none."""
    from . import peers

    package = next(b for b in peers.external_backends() if b.name == FA3)
    reason = package.software_reason()
    if reason is not None:
        raise DecodeSkip(f"{FA3}: {reason}")
    func = getattr(importlib.import_module(package.module_name), "flash_attn_with_kvcache", None)
    if func is None:
        raise DecodeSkip(f"{FA3}: {package.module_name} has no flash_attn_with_kvcache")
    return package.module_name, func, fa3_build_flags(package.module_name)


def fa3_build_flags(module_name: str) -> dict:
    """The build flags FA3's setup.py records next to its interface (fa3_fwd_interface ->
    fa3_fwd_config.CONFIG["build_flags"]); {} where the package has no such module."""
    try:
        config = importlib.import_module(module_name.removesuffix("_interface") + "_config")
    except ImportError:
        return {}
    return dict(getattr(config, "CONFIG", {}).get("build_flags", {}))


def fa3_skip_reason(name: str, point: DecodePoint, module_name: str, flags: dict) -> str | None:
    """Why FA3's kvcache call does not take this row, or None: the mixed mode (FA3 wants q and
    the cache in one dtype), or a feature its build left out (``flags``)."""
    if point.is_mixed:
        return (f"{name}: {module_name}.flash_attn_with_kvcache takes q and the cache in one "
                f"dtype (no 16-bit q against an FP8 cache)")
    wanted = [FA3_DTYPE_FLAGS.get(point.dtype)] + ([FA3_NO_PAGED] if name == FA3_PAGED else [])
    left_out = [flag for flag in wanted if flag and flags.get(flag)]
    if left_out:
        return f"{name}: {module_name} is built with {', '.join(left_out)}"
    return None


def _flashinfer_call(point, q, kc, vc, lengths, descales):
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper on paged_copy's pool: planned here, once;
    the returned call is run() alone, its (batch, heads_q, d) output viewed as q's shape."""
    reason = flashinfer_skip_reason(point, descales)
    if reason is not None:
        raise DecodeSkip(reason)
    # mixed rows reach here only with one descale for the whole cache (the skip reason's rule)
    scales = {f"{prefix}_scale": float(descales[f"{prefix}_descale"].flatten()[0])
              for prefix in "kv" if f"{prefix}_descale" in descales}
    from . import peers

    module, reason = peers.import_flashinfer("BatchDecodeWithPagedKVCacheWrapper")
    if module is None:
        raise DecodeSkip(f"{FLASHINFER_PAGED}: {reason}")
    import torch

    pool_k, pool_v, table = paged_copy(kc, vc, point.page_size)
    indptr, indices, last_page_len = (
        t.to(q.device) for t in flashinfer_page_indices(table, lengths, point.page_size))
    # FlashInfer wants its workspace zeroed before the first use
    workspace = torch.zeros(peers.FlashInferBackend.workspace_bytes, dtype=torch.uint8,
                            device=q.device)
    # use_cuda_graph stays off: it keeps the plan's arrays in fixed buffers so that a captured
    # graph survives a re-plan; planned once here, the captured run() replays this plan as it is
    wrapper = module.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
    wrapper.plan(indptr, indices, last_page_len, point.heads_q, point.heads_kv, point.head_dim,
                 point.page_size, pos_encoding_mode="NONE", q_data_type=q.dtype,
                 kv_data_type=kc.dtype)
    shape = q.shape  # (batch, 1, heads_q, d)
    rows = q.reshape(point.batch, point.heads_q, point.head_dim)  # one token a sequence: a view
    return lambda: wrapper.run(rows, (pool_k, pool_v), **scales).view(shape)


def flashinfer_skip_reason(point: DecodePoint, descales: dict) -> str | None:
    """Why FlashInfer's batch decode does not take this row, or None: more than one query token
    per sequence, e4m3 queries, or an FP8 cache whose descales are not one value per tensor (its
    run takes k_scale / v_scale as floats)."""
    if point.seqlen_q != 1:
        return (f"{FLASHINFER_PAGED}: timed with one query token per sequence "
                f"(BatchDecodeWithPagedKVCacheWrapper's q is (batch, heads, d)); this row has "
                f"seqlen_q {point.seqlen_q}")
    if point.is_fp8:
        return (f"{FLASHINFER_PAGED}: FlashInfer's decode takes an FP8 cache with queries in "
                f"fp16/bf16 only (this row's q is e4m3)")
    varying = [prefix for prefix in "kv" if f"{prefix}_descale" in descales
               and not _uniform(descales[f"{prefix}_descale"])]
    if varying:
        return (f"{FLASHINFER_PAGED}: FlashInfer's run takes one k_scale / v_scale per call "
                f"(floats); this cache's {' and '.join(varying)} descales differ per "
                f"(sequence, kv head); not run on a dequantized copy")
    return None


def _uniform(descale) -> bool:
    """Whether a descale tensor holds one value throughout."""
    return bool((descale == descale.flatten()[0]).all())


def flashinfer_page_indices(table, lengths, page_size: int):
    """A page table (batch, pages per sequence) int32 and the sequences' lengths (batch,) as
    FlashInfer's paged-KV arrays, int32 on the CPU: indptr (batch + 1,), each sequence's first
    entry in indices; indices, the pool slots of every sequence's used pages (the first
    ceil(length / page_size) of its row), sequence after sequence; last_page_len (batch,), the
    keys on each sequence's last page (1..page_size; 0 for an empty sequence)."""
    import torch

    table, lengths = table.cpu(), lengths.cpu().long()
    pages = (lengths + page_size - 1) // page_size
    if len(pages) and int(pages.max()) > table.shape[1]:
        raise ValueError(f"a sequence of {int(lengths.max())} keys needs "
                         f"{int(pages.max())} pages of {page_size}; the page table has "
                         f"{table.shape[1]} per sequence")
    used = torch.arange(table.shape[1]) < pages[:, None]  # (batch, pages per sequence)
    indptr = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    indptr[1:] = pages.cumsum(0)
    last_page_len = lengths - (pages - 1).clamp(min=0) * page_size
    return (indptr.to(torch.int32), table[used].to(torch.int32),
            last_page_len.to(torch.int32))


def _sdpa_cudnn_call(point, q, kc, vc, descales):
    if descales:
        raise DecodeSkip("sdpa-cudnn: SDPA takes no FP8 cache (no descales); not run on a "
                         "dequantized copy")
    if point.seqlen_q != 1:
        raise DecodeSkip("sdpa-cudnn: SDPA's causal mask is top-left aligned; decode rows "
                         "with seqlen_q > 1 need bottom-right (one query token only)")
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
    return run


def _first(result):
    """The output of a call that returns it alone or first of a tuple (out, lse)."""
    return result[0] if isinstance(result, tuple) else result


def paged_copy(kc, vc, page_size: int, seed: int = 0):
    """The dense caches (batch, context, heads_kv, d) as pools of page_size-token pages in a
    shuffled order and the page table that reads them back: (pool_k, pool_v, table int32).
    Copied as bytes, so that an FP8 cache takes the same path as a 16-bit one (its descales are
    per sequence and stay as they are)."""
    import torch

    batch, context = kc.shape[:2]
    per_seq = -(-context // page_size)
    pad = per_seq * page_size - context
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(seed))
    order = order.to(kc.device)
    pools = []
    for cache in (kc, vc):
        raw = cache.view(torch.uint8)  # (batch, context, heads_kv, d * element size)
        padded = torch.nn.functional.pad(raw, (0, 0, 0, 0, 0, pad))
        pages = padded.reshape(batch * per_seq, page_size, *raw.shape[2:])
        pool = torch.empty_like(pages)
        pool[order] = pages  # logical page i of the batch lives at pool slot order[i]
        pools.append(pool.view(cache.dtype))
    table = order.view(batch, per_seq).to(torch.int32)
    return pools[0], pools[1], table


def reference_check(point: DecodePoint, out, q, kc, vc):
    """check.CheckResult of out on the first CHECK_SEQUENCES sequences, against float32
    attention (reference.attention_ref, causal bottom-right) on the values the kernel multiplies:
    FP8 inputs dequantized (data * descale). e4m3 points: check.py's FP8 rule (relative RMS
    error <= check.FP8_REL_RMSE). 16-bit and mixed points: max |out - ref| <= twice the error of
    the same attention in q's dtype (on the dequantized K / V rounded to it) + CHECK_ATOL."""
    from flash_hopper.reference import attention_ref

    from . import check

    n = min(point.batch, CHECK_SEQUENCES)
    q, kc, vc = (_first_sequences(t, n) for t in (q, kc, vc))
    out = out[:n]
    shape = f"b{n} sq{point.seqlen_q} sk{point.context}"
    with check.ieee_fp32_matmuls():
        ref, _ = attention_ref(q, kc, vc, causal=True)
        if point.is_fp8:
            return check.compare_fp8(out, ref, shape=shape)
        low, _ = attention_ref(q, kc, vc, causal=True, upcast=False)
    return check.compare(out, ref, low, shape=shape, atol=CHECK_ATOL)


def _first_sequences(t, n: int):
    """The first n sequences of an input: a tensor as it is, an Fp8Input dequantized (fp32)."""
    if isinstance(t, Fp8Input):
        return Fp8Input(t.data[:n], t.descale[:n]).dequantize()
    return t[:n]


def graph_time_us(fn: Callable[[], object], iters: int = 20, reps: int = 5) -> tuple[float, float]:
    """(device us per call, host us per call) of fn captured `iters` times in one CUDA graph
    (the replay's launch time / iters), the median over `reps` replays."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # warm-up: plans, library handles, workspaces
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(iters):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    times, hosts = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        hosts.append((time.perf_counter() - t0) * 1e6 / iters)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times), statistics.median(hosts)


def host_time_us(fn: Callable[[], object], calls: int = 50) -> float:
    """The eager call's own time (us): `calls` calls issued back to back, then one sync; on
    decode-sized calls the GPU keeps up, so this is the host's cost per call."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    return host


def measure(point: DecodePoint, backends: list[str], timer=graph_time_us,
            host_timer=host_time_us) -> list[DecodeRow]:
    """One row per backend for one point (skips and errors recorded per row, never raised)."""
    import torch

    q, kc, vc, lengths = make_inputs(point)
    rows = []
    for name in backends:
        row = DecodeRow(point, name)
        try:
            fn = backend_call(name, point, q, kc, vc, lengths)
            out = fn()
            result = reference_check(point, out, q, kc, vc)
            row.check_err, row.check_tol = result.err, result.tol
            row.check_metric, row.passed = result.metric, result.passed
            del out
            row.device_us, row.host_us_graph = timer(fn)
            row.host_us_eager = host_timer(fn)
            row.tbps = tbps(point.kv_bytes(), row.device_us * 1e-6)
        except DecodeSkip as exc:
            row.skipped = str(exc)
        except Exception as exc:  # noqa: BLE001 - recorded per row
            row.error = first_line(exc)
            row.passed = False
        rows.append(row)
    del q, kc, vc, lengths
    torch.cuda.empty_cache()
    return rows


# --- output -------------------------------------------------------------------------------------


TABLE_HEADER = (f"{'point':>9} {'backend':<21} {'TB/s':>6} {'us':>9} {'host us':>8} "
                f"{'graph us':>8}  check")


def table(rows: list[DecodeRow], header: bool = True) -> str:
    lines = [TABLE_HEADER] if header else []
    for r in rows:
        if r.error or r.skipped:
            why = r.error or f"skipped: {r.skipped}"
            lines.append(f"{r.point.label():>9} {r.backend:<21} {'-':>6} {'-':>9} {'-':>8} "
                         f"{'-':>8}  {why}")
            continue
        verdict = "PASS" if r.passed else "FAIL"
        metric = "rel-rmse " if r.check_metric == METRIC_REL_RMSE else ""
        lines.append(f"{r.point.label():>9} {r.backend:<21} {r.tbps:6.2f} {r.device_us:9.1f} "
                     f"{r.host_us_eager:8.1f} {r.host_us_graph:8.1f}  {verdict} "
                     f"({metric}{r.check_err:.1e} <= {r.check_tol:.1e})")
    return "\n".join(lines)


def write_json(path: str, rows: list[DecodeRow], meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [r.as_dict() for r in rows]}, f, indent=1)


def write_csv(path: str, rows: list[DecodeRow]) -> None:
    import csv

    fields = ["label", "batch", "context", "heads_q", "heads_kv", "head_dim", "seqlen_q",
              "dtype", "kv_dtype", "page_size", "kv_bytes", "bytes_counted", "backend", "tbps",
              "device_us", "host_us_eager", "host_us_graph", "check_metric", "check_err",
              "check_tol", "passed", "skipped", "error"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            d = r.as_dict()
            w.writerow({**{k: d["point"][k] for k in fields if k in d["point"]},
                        **{k: d[k] for k in fields if k in d and k != "point"}})


def plot(path: str, rows: list[DecodeRow]) -> None:
    """Grouped bars: TB/s per point, one bar per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r.point.label() for r in rows))
    names = list(dict.fromkeys(r.backend for r in rows))
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 2, 4))
    for i, name in enumerate(names):
        values = [next((r.tbps or 0.0 for r in rows
                        if r.backend == name and r.point.label() == lab), 0.0) for lab in labels]
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_ylabel(f"K/V cache bandwidth, {rows[0].point.kv_dtype} (TB/s)")
    ax.set_xlabel("batch x context")
    first = rows[0].point
    ax.set_title(f"decode: GQA {first.heads_q}/{first.heads_kv}, d{first.head_dim}, "
                 f"{first.dtype}, q len {first.seqlen_q}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the command --------------------------------------------------------------------------------


def points_from_args(args) -> list[DecodePoint]:
    hq, hk = parse_heads(args.heads)
    specs = args.points or list(DEFAULT_POINTS)
    points = []
    if args.seqlen_q < 1:
        raise ValueError(f"--seqlen-q: expected an int >= 1, got {args.seqlen_q}")
    for spec in cases.split_list(specs):
        batch, context = parse_point(spec)
        if args.seqlen_q > context:
            raise ValueError(f"--seqlen-q ({args.seqlen_q}) must be <= the context ({context})")
        points.append(DecodePoint(batch, context, hq, hk, args.head_dim, args.seqlen_q,
                                  args.dtype, args.page_size))
    return points


def backends_from_args(args) -> list[str]:
    """--backends as decode backend names, in order, once each; the `bench` registry's module
    spellings (fa3-fwd, fa3_fwd_interface, flash_attn.cute ...) map to its names."""
    from .registry import canonical_name

    def decode_name(name: str) -> str:
        name = canonical_name(name)
        return DECODE_ALIASES.get(name, name)

    default = (*DEFAULT_BACKENDS, "flash-hopper-paged") if args.page_size else DEFAULT_BACKENDS
    names = cases.split_list(args.backends or default)
    unknown = [b for b in names if decode_name(b) not in BACKENDS]
    if unknown:
        raise DecodeError(f"--backends: unknown {', '.join(unknown)}; expected some of "
                          f"{', '.join(BACKENDS)}")
    return list(dict.fromkeys(decode_name(b) for b in names))


def run_decode(args) -> int:
    try:
        points = points_from_args(args)
    except ValueError as exc:
        raise DecodeError(str(exc)) from None
    backends = backends_from_args(args)
    if args.page_size is not None and args.page_size < 1:
        raise DecodeError(f"--page-size: expected an int >= 1, got {args.page_size}")
    from . import env

    gpu, reason = env.detect_gpu()
    if gpu is None:
        raise DecodeError(f"needs a CUDA GPU: {reason}")
    rows = []
    print(TABLE_HEADER, flush=True)
    for point in points:
        new = measure(point, backends)
        rows.extend(new)
        print(table(new, header=False), flush=True)
    import torch

    meta = {"gpu": gpu.name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "metric": "K/V cache bytes read (the cache's element size: 1 for FP8) / time of "
                      "one CUDA-graph-replayed call (1e12 B/s)"}
    try:
        import flash_hopper

        meta["flash_hopper"] = flash_hopper.build_info().get("commit")
    except Exception as exc:  # noqa: BLE001
        meta["flash_hopper"] = first_line(exc)
    if args.json:
        write_json(args.json, rows, meta)
    if args.csv:
        write_csv(args.csv, rows)
    if args.plot:
        plot(args.plot, rows)
    return exit_status(rows)


def exit_status(rows: list[DecodeRow]) -> int:
    """1 when a check fails or a flash-hopper row errors (a peer that cannot run is recorded, a
    skipped row is not a failure)."""
    failed = any(r.error is None and r.skipped is None and not r.passed for r in rows)
    broken = any(r.error is not None and r.backend.startswith("flash-hopper") for r in rows)
    return 1 if failed or broken else 0
