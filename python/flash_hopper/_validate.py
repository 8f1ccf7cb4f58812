"""All argument validation of the forward and the backward, in one place.

Every error names the argument, what was expected and what was given; nothing is launched after an
error. Two levels:

- ``check_fwd_args`` / ``check_op_args`` / ``check_bwd_args``: shapes, dtypes, strides, device
  and scalars. They read
  tensor *metadata* only, so they run unchanged on FakeTensors while torch.compile traces (no
  data_ptr, no ctypes, no device query), and on CPU or meta tensors in tests. Shape, dtype and
  stride checks come before the device check, so a CPU tensor with a bad shape reports the shape.
  The host path (_fwd.py) runs them once per call signature and caches the result.
- ``check_alignment``: data pointers 16-byte aligned; needs real storage, so it runs per call.

Which kernel path can serve a valid request is not decided here: that is the library's policy
(kernels/src/policy.cu), which the host path asks (dispatch.py).

Errors are TypeError for a wrong Python type, NotImplementedError for valid requests not
supported yet, ValueError for everything else.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ._errors import UnsupportedError
from ._tables import (
    BACKEND_NAMES,
    FP8_DTYPES,
    FP8_HEAD_DIM_MULTIPLE,
    FP8_SINGLE_LEVEL_MAX_HEAD_DIM,
    HEAD_DIM_MULTIPLE,
    KV_FP8_DTYPES,
    MAX_HEAD_DIM,
    MIN_HEAD_DIM,
    TORCH_DTYPES,
)

SUPPORTED_DTYPES = tuple(TORCH_DTYPES)
# The kernels put batch and heads on grid.z / grid.y, whose hardware limit is 65535.
MAX_GRID_DIM = 65535
# Sequence positions are 32-bit inside the kernels (offsets are 64-bit).
MAX_SEQLEN = 2**31 - 1
# cp.async (FA-2 path) and TMA (FA-3 path) move 16-byte vectors: base pointers and every
# non-unit stride must be 16-byte multiples.
ALIGN_BYTES = 16
_FLOAT32_MAX = 3.4028234663852886e38
INT64_MAX = 2**63 - 1


class FwdConfig(NamedTuple):
    """The validated, resolved forward request (window already includes ``causal``).

    A NamedTuple rather than a dataclass: torch.compile traces validation, and Dynamo handles
    named tuples natively on every torch version we support.
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: torch.dtype
    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    backend: str


# --- scalars ------------------------------------------------------------------------------------


def _is_real(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    return isinstance(x, (numbers.Real, torch.SymInt, torch.SymFloat))


def _check_float(name: str, x: Any) -> float:
    """A finite real number that fits a C float (the ABI stores scale and softcap as float)."""
    if isinstance(x, torch.Tensor):
        raise TypeError(
            f"{name}: expected a Python float, got a torch.Tensor (a tensor value would be "
            "data-dependent under torch.compile; pass float(x))"
        )
    if not _is_real(x):
        raise TypeError(f"{name}: expected a float, got {type(x).__name__} {x!r}")
    value = x if isinstance(x, (torch.SymInt, torch.SymFloat)) else float(x)
    # Comparisons rather than math.isfinite: they also trace under torch.compile, where a float
    # may be symbolic. abs(nan) <= max is False, so NaN and +-inf both fail here.
    if not abs(value) <= _FLOAT32_MAX:
        raise ValueError(f"{name}: expected a finite float32 value, got {x!r}")
    return value


def _check_window_bound(name: str, x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name}: expected an int >= -1 (-1 = unbounded), got {x!r}")
    if not -1 <= x <= INT64_MAX:  # the ABI stores it as int64_t; ctypes would wrap silently
        raise ValueError(f"{name}: expected an int >= -1 (-1 = unbounded), got {x}")
    return int(x) if isinstance(x, numbers.Integral) else x


def _window_bound(name: str, x: Any) -> int:
    """One bound of a public window_size: an int, or a 0-d integer tensor (FA3's tests pass
    ``torch.randint(0, n, (2,))``); any negative value means unbounded, as in FA3 (-> -1)."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 0 or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name}: expected an int >= -1 (-1 = unbounded), got a tensor of "
                            f"shape {tuple(x.shape)} and dtype {x.dtype}")
        x = int(x.item())
    if isinstance(x, numbers.Integral) and not isinstance(x, bool) and x < -1:
        return -1
    return _check_window_bound(name, x)


def _check_window(window_size: Any, causal: Any) -> tuple[int, int]:
    """FA3's window semantics: (left, right), any negative bound unbounded; causal=True sets the
    right bound to 0 whatever window_size says (FA3's interface does the same) and keeps left."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__} {causal!r}")
    pair = isinstance(window_size, (tuple, list)) or (
        isinstance(window_size, torch.Tensor) and window_size.dim() == 1)
    if not pair or len(window_size) != 2:
        raise TypeError(
            f"window_size: expected a pair (left, right) of ints >= -1, got {window_size!r}"
        )
    left = _window_bound("window_size[0]", window_size[0])
    right = _window_bound("window_size[1]", window_size[1])
    return left, 0 if causal else right


def _check_backend(backend: Any) -> str:
    names = ", ".join(BACKEND_NAMES)
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, one of {names}, got {backend!r}")
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend: expected one of {names}, got {backend!r}")
    return backend


# --- tensors ------------------------------------------------------------------------------------


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_tensor(name: str, t: Any, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {_shape(t)}")


def _check_dim(name: str, t: torch.Tensor, dim: int, what: str, expected: int, src: str) -> None:
    if t.shape[dim] != expected:
        raise ValueError(
            f"{name}: expected {what} (dim {dim}) == {src}'s {expected}, got {t.shape[dim]} "
            f"(shape {_shape(t)})"
        )


def effective_strides(t: torch.Tensor) -> tuple[int, ...]:
    """t.stride() with the strides of size-0/1 dims replaced by the packed value.

    A dim of size <= 1 is never stepped along, so its stride is meaningless and torch leaves
    arbitrary values there (e.g. after transposes); the kernels still want 16-byte multiples.
    """
    strides = list(t.stride())
    for i in reversed(range(t.dim() - 1)):
        if t.shape[i] <= 1:
            strides[i] = strides[i + 1] * max(t.shape[i + 1], 1)
    return tuple(strides)


def packed_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (torch.empty's), which are effective."""
    strides = [1] * len(shape)
    for i in reversed(range(len(shape) - 1)):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


def _check_strides(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: must be contiguous in the last dimension (stride 1), got strides "
            f"{tuple(t.stride())}; call {name}.contiguous()"
        )
    multiple = ALIGN_BYTES // t.element_size()
    for dim, (size, stride) in enumerate(zip(t.shape[:-1], t.stride()[:-1])):
        if size > 1 and stride % multiple != 0:
            raise ValueError(
                f"{name}: stride({dim}) must be a multiple of {multiple} elements "
                f"({ALIGN_BYTES} bytes, for cp.async/TMA vector loads), got strides "
                f"{tuple(t.stride())}; call {name}.contiguous()"
            )


def _check_device(name: str, t: torch.Tensor, ref: torch.Tensor | None) -> None:
    if ref is None:
        if t.device.type != "cuda":
            raise ValueError(f"{name}: must be a CUDA tensor, got device {t.device}")
    elif t.device != ref.device:
        raise ValueError(f"{name}: must be on q's device {ref.device}, got device {t.device}")


def check_qkv(q: Any, k: Any, v: Any, devices: bool = True, fp8: bool = False,
              mixed: bool = False) -> tuple[int, int, int, int, int, int]:
    """Check q/k/v metadata; returns (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim).
    ``devices=False`` leaves the device checks to the caller (which has more tensors to check
    before them). ``fp8``: the FP8 forward's inputs (torch.float8_e4m3fn, head_dim % 16 == 0)
    instead of fp16 / bf16. ``mixed``: fp16 / bf16 q against FP8 k and v of one dtype
    (torch.float8_e4m3fn or torch.float8_e5m2, head_dim % 16 == 0), the mixed mode."""
    _check_tensor("q", q, 4, "(batch, seqlen_q, heads_q, head_dim)")
    _check_tensor("k", k, 4, "(batch, seqlen_k, heads_kv, head_dim)")
    _check_tensor("v", v, 4, "(batch, seqlen_k, heads_kv, head_dim)")

    if fp8:
        if q.dtype not in FP8_DTYPES:
            raise ValueError(f"q: expected dtype torch.float8_e4m3fn (FP8 inputs), got {q.dtype}")
    elif q.dtype not in SUPPORTED_DTYPES:
        hint = " (fp32 is not supported: cast with .half() or .bfloat16())"
        raise ValueError(
            f"q: expected dtype torch.float16 or torch.bfloat16 (or torch.float8_e4m3fn q, k "
            f"and v for the FP8 forward), got {q.dtype}"
            + (hint if q.dtype == torch.float32 else "")
        )
    if mixed:
        if k.dtype not in KV_FP8_DTYPES:
            raise ValueError(f"k: expected dtype torch.float8_e4m3fn or torch.float8_e5m2 (an FP8 "
                             f"K/V cache for {q.dtype} q, the mixed mode), got {k.dtype}")
        if v.dtype != k.dtype:
            raise ValueError(f"v: expected dtype {k.dtype} (k's dtype: the mixed mode takes k "
                             f"and v in one FP8 dtype), got {v.dtype}")
    for name, t in (() if mixed else (("k", k), ("v", v))):
        if t.dtype != q.dtype:
            hint = ""
            if not fp8 and t.dtype in KV_FP8_DTYPES:
                hint = (f" ({q.dtype} queries against an FP8 K/V cache, the mixed mode, take k "
                        "and v both in one FP8 dtype)")
            raise ValueError(f"{name}: expected dtype {q.dtype} (q's dtype), got {t.dtype}"
                             + hint)

    batch, seqlen_q, heads_q, head_dim = _shape(q)
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    _check_dim("k", k, 0, "batch", batch, "q")
    _check_dim("k", k, 3, "head_dim", head_dim, "q")
    _check_dim("v", v, 0, "batch", batch, "q")
    _check_dim("v", v, 1, "seqlen_k", seqlen_k, "k")
    _check_dim("v", v, 2, "heads_kv", heads_kv, "k")
    if v.shape[3] != head_dim:
        raise NotImplementedError(
            f"v: head_dim (dim 3) {v.shape[3]} differs from q/k's head_dim {head_dim}: a V "
            "head dim of its own is served by flash_attn_func / flash_attn_varlen_func, not by "
            "this entry point"
        )

    multiple = FP8_HEAD_DIM_MULTIPLE if fp8 or mixed else HEAD_DIM_MULTIPLE
    if head_dim % multiple != 0 or not max(MIN_HEAD_DIM, multiple) <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"q: expected head_dim (dim 3) a multiple of {multiple} in "
            f"[{max(MIN_HEAD_DIM, multiple)}, {MAX_HEAD_DIM}]"
            + (" for FP8 inputs" if fp8 else " for FP8 k / v" if mixed else "")
            + f", got {head_dim}"
        )
    if heads_q < 1:
        raise ValueError(f"q: expected heads_q (dim 2) >= 1, got {heads_q}")
    if heads_kv < 1:
        raise ValueError(f"k: expected heads_kv (dim 2) >= 1, got {heads_kv}")
    if heads_q % heads_kv != 0:
        raise ValueError(
            f"k: heads_kv (dim 2) must divide q's heads_q {heads_q} (GQA/MQA), got {heads_kv}"
        )
    if batch > MAX_GRID_DIM:
        raise ValueError(f"q: expected batch (dim 0) <= {MAX_GRID_DIM} (grid limit), got {batch}")
    if heads_q > MAX_GRID_DIM:
        raise ValueError(
            f"q: expected heads_q (dim 2) <= {MAX_GRID_DIM} (grid limit), got {heads_q}"
        )
    for name, dim, what, size in (("q", 1, "seqlen_q", seqlen_q), ("k", 1, "seqlen_k", seqlen_k)):
        if size > MAX_SEQLEN:
            raise ValueError(f"{name}: expected {what} (dim {dim}) <= {MAX_SEQLEN}, got {size}")

    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_strides(name, t)
    if devices:
        _check_device("q", q, None)
        _check_device("k", k, q)
        _check_device("v", v, q)
    return batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim


def check_own_head_dim_v(q: torch.Tensor, k: torch.Tensor, v: Any) -> int:
    """v of a call with V's own head dim, q and k already checked (as q / k / k): k's shape but
    the last dim, q's dtype and device, a head dim dv that is a multiple of 8 in [8, 256],
    strides as every input's. Returns dv."""
    if k.dim() == 4:
        _check_tensor("v", v, 4, "(batch, seqlen_k, heads_kv, head_dim_v)")
        names = ("batch", "seqlen_k", "heads_kv")
    else:
        _check_tensor("v", v, 3, "(total_k, heads_kv, head_dim_v)")
        names = ("total_k", "heads_kv")
    if v.dtype != q.dtype:
        raise ValueError(f"v: expected dtype {q.dtype} (q's dtype), got {v.dtype}")
    for dim, name in enumerate(names):
        _check_dim("v", v, dim, name, k.shape[dim], "k")
    dv = v.shape[-1]
    if dv % HEAD_DIM_MULTIPLE or not max(MIN_HEAD_DIM, HEAD_DIM_MULTIPLE) <= dv <= MAX_HEAD_DIM:
        raise ValueError(f"v: expected head_dim_v (last dim) a multiple of {HEAD_DIM_MULTIPLE} "
                         f"in [{max(MIN_HEAD_DIM, HEAD_DIM_MULTIPLE)}, {MAX_HEAD_DIM}], got {dv}")
    _check_strides("v", v)
    _check_device("v", v, q)
    return dv


def _check_scale_and_softcap(softmax_scale: Any, default_scale: Any,
                             softcap: Any) -> tuple[Any, float]:
    """(scale, softcap) checked: softmax_scale None takes ``default_scale`` (ours, not checked:
    symbolic under torch.compile), else a float > 0 (the kernels take the row max of unscaled
    scores, which commutes with a positive scale only); softcap a float >= 0 (0 disables it)."""
    if softmax_scale is None:
        scale = default_scale
    else:
        scale = _check_float("softmax_scale", softmax_scale)
        if not scale > 0:
            raise ValueError(f"softmax_scale: expected a float > 0, got {softmax_scale!r}")
    cap = _check_float("softcap", softcap)
    if cap < 0:
        raise ValueError(f"softcap: expected a float >= 0 (0 disables it), got {softcap!r}")
    return scale, cap


def _config(q, k, v, softmax_scale, left, right, softcap, backend, devices=True,
            fp8=False, mixed=False) -> FwdConfig:
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = check_qkv(q, k, v, devices, fp8,
                                                                       mixed)
    scale, cap = _check_scale_and_softcap(softmax_scale, head_dim**-0.5, softcap)
    return FwdConfig(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads_q=heads_q,
        heads_kv=heads_kv,
        head_dim=head_dim,
        dtype=q.dtype,
        softmax_scale=scale,
        window_left=left,
        window_right=right,
        softcap=cap,
        backend=_check_backend(backend),
    )


def check_fa3_extras(attention_chunk: Any, num_splits: Any, pack_gqa: Any, sm_margin: Any,
                     chunk_served: bool = False) -> None:
    """FA3's flash_attn_func parameters beyond the core ones, when one is not at its default:
    attention_chunk is checked (and refused where the caller does not serve it), the performance
    hints are checked for type and range only (flash_attn_func calls this only off the
    defaults). chunk_served: the caller serves attention_chunk > 0 (flash_attn_func, _chunk.py).
    qv has checks of its own (check_qv)."""
    if isinstance(attention_chunk, bool) or not isinstance(attention_chunk, numbers.Integral):
        raise TypeError(f"attention_chunk: expected an int >= 0 (0 = off), got "
                        f"{attention_chunk!r}")
    if not 0 <= attention_chunk <= INT64_MAX:
        raise ValueError(f"attention_chunk: expected an int >= 0 (0 = off) below 2**63, got "
                         f"{attention_chunk}")
    if attention_chunk != 0 and not chunk_served:
        raise UnsupportedError(f"attention_chunk: expected 0 here (chunked-local attention is "
                               f"served by flash_attn_func and flash_attn_qkvpacked_func), got "
                               f"{attention_chunk}")
    for name, value in (("num_splits", num_splits), ("sm_margin", sm_margin)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise TypeError(f"{name}: expected an int >= 0, got {value!r}")
        if value > INT64_MAX:  # the custom ops' schemas take int64
            raise ValueError(f"{name}: expected an int in [0, 2**63), got {value}")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise TypeError(f"pack_gqa: expected None or a bool, got {pack_gqa!r}")


# FA3's qv (MLA's extra query, flash_api.cpp's checks): the rope part q / k at most 64 wide, the
# latent part qv / v 256 to 512 wide; head dims multiples of 8 (16-byte rows of 2-byte elements).
QV_MAX_HEAD_DIM = 64
QV_MIN_HEAD_DIM_V = 256
QV_MAX_HEAD_DIM_V = 512


class QvConfig(NamedTuple):
    """A validated qv request: the heads and head dims, and the scalars resolved (the window
    includes ``causal``; the scale defaults to 1 / sqrt(head_dim + head_dim_v), FA3's)."""

    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float


def check_qv_head_dims(head_dim: Any, head_dim_v: Any, d_name: str = "q",
                       dv_name: str = "v") -> None:
    """FA3's (head_dim, head_dim_v) with qv: head_dim a multiple of 8 in [8, 64], head_dim_v a
    multiple of 8 in [256, 512]. The names say which argument carries each."""
    if head_dim % HEAD_DIM_MULTIPLE or not HEAD_DIM_MULTIPLE <= head_dim <= QV_MAX_HEAD_DIM:
        raise ValueError(f"{d_name}: expected head_dim a multiple of {HEAD_DIM_MULTIPLE} in "
                         f"[{HEAD_DIM_MULTIPLE}, {QV_MAX_HEAD_DIM}] with qv (FA3's MLA shapes: "
                         f"the rope part), got {head_dim}")
    if (head_dim_v % HEAD_DIM_MULTIPLE
            or not QV_MIN_HEAD_DIM_V <= head_dim_v <= QV_MAX_HEAD_DIM_V):
        raise ValueError(f"{dv_name}: expected head_dim_v a multiple of {HEAD_DIM_MULTIPLE} in "
                         f"[{QV_MIN_HEAD_DIM_V}, {QV_MAX_HEAD_DIM_V}] with qv (FA3's MLA shapes: "
                         f"the latent part), got {head_dim_v}")


def check_qv(q: Any, k: Any, v: Any, qv: Any, softmax_scale: Any, causal: Any, window_size: Any,
             softcap: Any, backend: Any, k_name: str = "k", v_name: str = "v") -> QvConfig:
    """The checks of a call with qv (MLA's extra query, FA3's semantics), common to the three
    entry points; the caller has checked the ranks and the dims other than heads and head dims
    (batch, sequence, cache layout). q (..., heads_q, d) fp16 / bf16 (FP8 q has no qv, as in
    FA3); qv (..., heads_q, dv) with q's other dims, dtype and device; k (..., heads_kv, d) and v
    (..., heads_kv, dv) of q's dtype on q's device, named k_name / v_name (k_cache / v_cache);
    heads_q a multiple of heads_kv; d and dv as check_qv_head_dims; every last dim contiguous.
    Any device: the composite path (_qv.py) runs wherever torch does. backend: "auto" (no FA
    kernel takes qv)."""
    if not isinstance(qv, torch.Tensor):
        raise TypeError(f"qv: expected None or a torch.Tensor, got {type(qv).__name__}")
    return _composite_config(q, k, v, qv, softmax_scale, causal, window_size, softcap, backend,
                             k_name, v_name)


# A KV cache whose v_cache has a head dim of its own and no qv (FA3's 192 / 128 and its d <= 64
# with dv <= 512): the composite path reads it; dv a multiple of 8 up to qv's widest.
OWN_V_MAX_HEAD_DIM_V = QV_MAX_HEAD_DIM_V


def check_own_v_head_dims(head_dim: Any, head_dim_v: Any, d_name: str = "q",
                          dv_name: str = "v_cache") -> None:
    """check_own_v_cache's head dims (qv's, check_qv_head_dims, are among them): d a multiple
    of 8 in [8, 256], dv a multiple of 8 in [8, 512]. The names say which argument carries
    each."""
    for name, dim, top in ((d_name, head_dim, MAX_HEAD_DIM),
                           (dv_name, head_dim_v, OWN_V_MAX_HEAD_DIM_V)):
        if dim % HEAD_DIM_MULTIPLE or not HEAD_DIM_MULTIPLE <= dim <= top:
            raise ValueError(f"{name}: expected a head dim that is a multiple of "
                             f"{HEAD_DIM_MULTIPLE} in [{HEAD_DIM_MULTIPLE}, {top}] with a V "
                             f"head dim of its own, got {dim}")


def check_own_v_cache(q: Any, k_cache: Any, v_cache: Any, softmax_scale: Any, causal: Any,
                      window_size: Any, softcap: Any, backend: Any) -> QvConfig:
    """flash_attn_with_kvcache with a v_cache of its own head dim dv and no qv (FA3 takes d in
    (128, 192] with dv in (96, 128], and d <= 64 with dv <= 512): check_qv's checks without qv,
    on the composite path (_qv.py). d a multiple of 8 in [8, 256], dv a multiple of 8 in
    [8, 512]; the scale defaults to 1 / sqrt(d), as for any call without qv; backend "auto"."""
    return _composite_config(q, k_cache, v_cache, None, softmax_scale, causal, window_size,
                             softcap, backend, "k_cache", "v_cache")


def _composite_config(q: Any, k: Any, v: Any, qv: Any, softmax_scale: Any, causal: Any,
                      window_size: Any, softcap: Any, backend: Any, k_name: str,
                      v_name: str) -> QvConfig:
    """check_qv's checks (qv a tensor) or check_own_v_cache's (qv None)."""
    what = "with qv" if qv is not None else f"with {v_name}'s own head dim"
    for name, t in (("q", q), (k_name, k), (v_name, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q.dtype not in SUPPORTED_DTYPES:
        fp8 = q.dtype in FP8_DTYPES
        note = (" (FP8 q takes no qv, as in FA3)" if qv is not None else
                f" (FP8 inputs take a {v_name} of {k_name}'s head dim)") if fp8 else ""
        error = UnsupportedError if fp8 else ValueError
        arg = "qv" if qv is not None else v_name
        raise error(f"{arg}: expected q of dtype torch.float16 or torch.bfloat16 {what}{note}, "
                    f"got q of dtype {q.dtype}")
    extra = (("qv", qv),) if qv is not None else ()
    for name, t in extra + ((k_name, k), (v_name, v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype} (q's dtype) {what}, got "
                             f"{t.dtype}")
    if qv is not None and (qv.dim() != q.dim() or _shape(qv)[:-1] != _shape(q)[:-1]):
        want = ", ".join(str(x) for x in _shape(q)[:-1])
        raise ValueError(f"qv: expected shape ({want}, head_dim_v) (q's dims but the last), got "
                         f"{_shape(qv)}")
    if _shape(v)[:-1] != _shape(k)[:-1]:
        raise ValueError(f"{v_name}: expected {k_name}'s dims but the last "
                         f"{_shape(k)[:-1]}, got shape {_shape(v)}")
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"{k_name}: expected head_dim (last dim) == q's {head_dim}, got "
                         f"{k.shape[-1]} (shape {_shape(k)})")
    if qv is not None:
        if qv.shape[-1] != head_dim_v:
            raise ValueError(f"qv: expected head_dim_v (last dim) == {v_name}'s {head_dim_v}, "
                             f"got {qv.shape[-1]} (shape {_shape(qv)})")
        check_qv_head_dims(head_dim, head_dim_v, "q", v_name)
    else:
        check_own_v_head_dims(head_dim, head_dim_v, "q", v_name)
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if heads_q < 1:
        raise ValueError(f"q: expected heads_q >= 1, got {heads_q}")
    if heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(f"{k_name}: heads_kv must divide q's heads_q {heads_q} (GQA/MQA), got "
                         f"{heads_kv}")
    for name, t in (("q", q),) + extra + ((k_name, k), (v_name, v)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: must be contiguous in the last dimension (stride 1), got "
                             f"strides {tuple(t.stride())}; call {name}.contiguous()")
    left, right = _check_window(window_size, causal)
    # FA3's default scale: over both dot products' dims with qv, q . k's alone without
    default = (head_dim + head_dim_v) ** -0.5 if qv is not None else head_dim ** -0.5
    scale, cap = _check_scale_and_softcap(softmax_scale, default, softcap)
    if _check_backend(backend) != "auto":
        raise UnsupportedError(f"backend: expected 'auto' {what} (it runs a composite path of "
                               f"torch GEMMs, not an FA kernel), got {backend!r}")
    for name, t in extra + ((k_name, k), (v_name, v)):
        _check_device(name, t, q)
    return QvConfig(heads_q, heads_kv, head_dim, head_dim_v, q.dtype, scale, left, right, cap)


def check_fwd_args(
    q: Any,
    k: Any,
    v: Any,
    softmax_scale: Any = None,
    causal: Any = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: Any = 0.0,
    backend: Any = "auto",
) -> FwdConfig:
    """Validate flash_attn_func's arguments (public API; ``causal`` folds into the window)."""
    left, right = _check_window(window_size, causal)
    return _config(q, k, v, softmax_scale, left, right, softcap, backend)


class Fp8Options(NamedTuple):
    """The FP8 forward's extras, validated: O's dtype, the accumulation mode and, per descale,
    its (batch, head) element strides (0 broadcasts) or None when absent (1.0)."""

    out_dtype: torch.dtype
    two_level: bool
    q_descale: tuple[int, int] | None
    k_descale: tuple[int, int] | None
    v_descale: tuple[int, int] | None
    # The mixed mode's K / V dtype (fp16 / bf16 q, FP8 k / v); None when q is FP8 too.
    kv_dtype: torch.dtype | None = None


FP8_ACCUMULATIONS = ("two-level", "single-level")


def _check_descale(name: str, t: Any, batch: int, heads_kv: int) -> tuple[int, int] | None:
    """A descale as FA3 and vLLM pass it: fp32 (batch, heads_kv) with any strides (a stride-0
    ``expand`` included), or a 0-d / (1,) tensor that broadcasts; its (batch, head) strides."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected None or a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name}: expected dtype torch.float32, got {t.dtype}")
    shape = _shape(t)
    if shape in ((), (1,)):
        return (0, 0)
    if shape != (batch, heads_kv):
        raise ValueError(
            f"{name}: expected shape (batch, heads_kv) = ({batch}, {heads_kv}), a 0-d tensor or "
            f"shape (1,), got {shape}"
        )
    # A dim of size 1 is never stepped along: its stride may be anything (even negative views
    # do not exist in torch), 0 keeps the kernel's address arithmetic in range.
    return tuple(0 if size == 1 else stride for size, stride in zip(shape, t.stride()))


def check_fp8_args(
    q: Any, k: Any, v: Any, softmax_scale: Any, causal: Any, window_size: Any, softcap: Any,
    backend: Any, q_descale: Any, k_descale: Any, v_descale: Any, out_dtype: Any,
    fp8_accumulation: Any, devices: bool = True, descale_batch: int | None = None,
) -> tuple[FwdConfig, Fp8Options]:
    """Validate an FP8 flash_attn_func call: q / k / v torch.float8_e4m3fn, descales as
    ``_check_descale`` says, out_dtype None (bf16) / torch.bfloat16 / torch.float16.
    descale_batch: the descales' batch extent when it is not q's (varlen: the sequences)."""
    left, right = _check_window(window_size, causal)
    return check_fp8_op_args(q, k, v, softmax_scale, left, right, softcap, backend, q_descale,
                             k_descale, v_descale, out_dtype, fp8_accumulation, devices,
                             descale_batch)


def check_fp8_op_args(
    q: Any, k: Any, v: Any, softmax_scale: Any, window_left: Any, window_right: Any,
    softcap: Any, backend: Any, q_descale: Any, k_descale: Any, v_descale: Any, out_dtype: Any,
    fp8_accumulation: Any, devices: bool = True, descale_batch: int | None = None,
) -> tuple[FwdConfig, Fp8Options]:
    """check_fp8_args with the window resolved (the flash_hopper::fwd_fp8 op's arguments).
    q not FP8: the mixed mode (fp16 / bf16 q, FP8 k and v): O in q's dtype, no q_descale."""
    left = _check_window_bound("window_left", window_left)
    right = _check_window_bound("window_right", window_right)
    mixed = getattr(q, "dtype", None) not in FP8_DTYPES
    cfg = _config(q, k, v, softmax_scale, left, right, softcap, backend, devices=False,
                  fp8=not mixed, mixed=mixed)
    if mixed:
        if out_dtype is not None and out_dtype != q.dtype:
            raise ValueError(f"out_dtype: expected None or {q.dtype} (q's dtype) for {q.dtype} q "
                             f"against FP8 k / v (the mixed mode), got {out_dtype!r}")
        if fp8_accumulation != "two-level":
            raise ValueError(f"fp8_accumulation: expected 'two-level' (the default) in the mixed "
                             f"mode ({q.dtype} q, FP8 k / v: its GEMMs are 16-bit), got "
                             f"{fp8_accumulation!r}")
        if q_descale is not None:
            raise ValueError(f"q_descale: expected None in the mixed mode (q is {q.dtype}, not "
                             f"FP8; k_descale / v_descale scale the FP8 k / v), got a "
                             f"{type(q_descale).__name__}")
        out_dtype = q.dtype
    if out_dtype is None:
        out_dtype = torch.bfloat16
    elif out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype: expected None (torch.bfloat16), torch.bfloat16 or "
                         f"torch.float16 for FP8 inputs, got {out_dtype!r}")
    if fp8_accumulation not in FP8_ACCUMULATIONS:
        raise ValueError(f"fp8_accumulation: expected one of {', '.join(FP8_ACCUMULATIONS)}, "
                         f"got {fp8_accumulation!r}")
    if fp8_accumulation == "single-level" and cfg.head_dim > FP8_SINGLE_LEVEL_MAX_HEAD_DIM:
        # The d192 / d256 kernels split their PV accumulator over the head dim: two levels only.
        raise ValueError(f"fp8_accumulation: 'single-level' (the ablation) exists for head_dim "
                         f"<= {FP8_SINGLE_LEVEL_MAX_HEAD_DIM}, got head_dim {cfg.head_dim}")
    batch = cfg.batch if descale_batch is None else descale_batch
    strides = [_check_descale(name, t, batch, cfg.heads_kv) for name, t in
               (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))]
    if devices:
        _check_device("q", q, None)
        for name, t in (("k", k), ("v", v), ("q_descale", q_descale),
                        ("k_descale", k_descale), ("v_descale", v_descale)):
            if t is not None:
                _check_device(name, t, q)
    return cfg, Fp8Options(out_dtype, fp8_accumulation == "two-level", *strides,
                           kv_dtype=k.dtype if mixed else None)


def check_not_fp8_extras(q: Any, q_descale: Any, k_descale: Any, v_descale: Any,
                         out_dtype: Any, fp8_accumulation: Any) -> None:
    """The FP8 arguments of a call whose inputs are not FP8. Descales are ignored there, as FA3
    does (its flash_api.cpp reads them only for float8_e4m3fn q; vLLM passes them with every
    call); an out_dtype other than q's dtype and the single-level ablation are refused."""
    dtype = getattr(q, "dtype", None)
    if out_dtype is not None and out_dtype != dtype:
        raise ValueError(f"out_dtype: expected None or {dtype} (q's dtype) for {dtype} inputs "
                         f"(another output dtype is for FP8 inputs), got {out_dtype!r}")
    if fp8_accumulation != "two-level":
        raise ValueError(f"fp8_accumulation: expected 'two-level' (the default) for {dtype} "
                         f"inputs (it applies to FP8 inputs), got {fp8_accumulation!r}")


def check_op_args(
    q: Any,
    k: Any,
    v: Any,
    softmax_scale: Any,
    window_left: Any,
    window_right: Any,
    softcap: Any,
    backend: Any,
    devices: bool = True,
) -> FwdConfig:
    """Validate the custom op's arguments (the window is already resolved, scale explicit)."""
    left = _check_window_bound("window_left", window_left)
    right = _check_window_bound("window_right", window_right)
    if softmax_scale is None:
        raise TypeError("softmax_scale: expected a float, got None")
    return _config(q, k, v, softmax_scale, left, right, softcap, backend, devices)


class BwdConfig(NamedTuple):
    """The validated backward request: the forward's (``fwd``), the mode, and whether a dlse
    takes part."""

    fwd: FwdConfig
    deterministic: bool
    has_dlse: bool


def _check_lse_like(name: str, t: Any, expected: tuple[int, int, int]) -> None:
    _check_tensor(name, t, 3, "(batch, heads_q, seqlen_q)")
    if _shape(t) != expected:
        raise ValueError(f"{name}: expected shape {expected} (batch, heads_q, seqlen_q), got "
                         f"{_shape(t)}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name}: expected dtype torch.float32, got {t.dtype}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: must be contiguous in the last dimension (stride 1), got strides "
            f"{tuple(t.stride())}; call {name}.contiguous()"
        )


def check_bwd_args(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dlse: Any,
    softmax_scale: Any,
    window_left: Any,
    window_right: Any,
    softcap: Any,
    backend: Any,
    deterministic: Any,
) -> BwdConfig:
    """Validate the backward op's arguments (metadata only, like the forward's).

    q/k/v and the scalars as the forward op's; out like q (the forward's output); dout like out
    in shape, dtype and device (its strides are the host path's business: it copies a dout the
    kernels cannot load, see ``dout_needs_copy``); lse fp32 (batch, heads_q, seqlen_q) with row
    stride 1; dlse None or like lse.
    """
    cfg = check_op_args(q, k, v, softmax_scale, window_left, window_right, softcap, backend,
                        devices=False)
    if not isinstance(deterministic, bool):
        raise TypeError(
            f"deterministic: expected a bool, got {type(deterministic).__name__} "
            f"{deterministic!r}"
        )
    _check_tensor("out", out, 4, "(batch, seqlen_q, heads_q, head_dim)")
    if _shape(out) != _shape(q):
        raise ValueError(f"out: expected shape {_shape(q)} (q's shape), got {_shape(out)}")
    if out.dtype != q.dtype:
        raise ValueError(f"out: expected dtype {q.dtype} (q's dtype), got {out.dtype}")
    _check_strides("out", out)
    _check_tensor("dout", dout, 4, "(batch, seqlen_q, heads_q, head_dim)")
    if _shape(dout) != _shape(out):
        raise ValueError(f"dout: expected shape {_shape(out)} (out's shape), got {_shape(dout)}")
    if dout.dtype != out.dtype:
        raise ValueError(f"dout: expected dtype {out.dtype} (out's dtype), got {dout.dtype}")
    lse_shape = (cfg.batch, cfg.heads_q, cfg.seqlen_q)
    _check_lse_like("lse", lse, lse_shape)
    if dlse is not None:
        _check_lse_like("dlse", dlse, lse_shape)
    _check_device("q", q, None)
    for name, t in (("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse),
                    ("dlse", dlse)):
        if t is not None:
            _check_device(name, t, q)
    return BwdConfig(cfg, deterministic, dlse is not None)


def dout_needs_copy(dout: torch.Tensor) -> bool:
    """Whether dout's layout is one the kernels cannot load: a non-unit last stride, a stride
    that is not a 16-byte multiple, or a broadcast (stride 0, which TMA cannot describe; what
    ``out.sum().backward()`` passes is all broadcast). The host path then passes
    dout.contiguous() instead, as FA3 does. Metadata only; a misaligned data pointer is checked
    per call."""
    if dout.shape[-1] > 1 and dout.stride(-1) != 1:
        return True
    multiple = ALIGN_BYTES // dout.element_size()
    for size, stride in zip(dout.shape[:-1], dout.stride()[:-1]):
        if size > 1 and (stride <= 0 or stride % multiple != 0):
            return True
    return False


def check_grads(dq: Any, dk: Any, dv: Any, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """Check caller-provided gradients of bwd_into: each shaped, typed and placed like its input,
    with the inputs' stride rules."""
    for name, t, like, src in (("dq", dq, q, "q"), ("dk", dk, k, "k"), ("dv", dv, v, "v")):
        _check_tensor(name, t, 4, f"{src}'s layout")
        if _shape(t) != _shape(like):
            raise ValueError(f"{name}: expected shape {_shape(like)} ({src}'s shape), got "
                             f"{_shape(t)}")
        if t.dtype != like.dtype:
            raise ValueError(f"{name}: expected dtype {like.dtype} ({src}'s dtype), got "
                             f"{t.dtype}")
        _check_strides(name, t)
        _check_device(name, t, q)


def check_outputs(out: Any, lse: Any | None, q: torch.Tensor, cfg: FwdConfig) -> None:
    """Check caller-provided outputs of fwd_into: out like q, lse fp32 (batch, heads, seqlen_q)."""
    _check_tensor("out", out, 4, "(batch, seqlen_q, heads_q, head_dim)")
    if _shape(out) != _shape(q):
        raise ValueError(f"out: expected shape {_shape(q)} (q's shape), got {_shape(out)}")
    if out.dtype != q.dtype:
        raise ValueError(f"out: expected dtype {q.dtype} (q's dtype), got {out.dtype}")
    _check_strides("out", out)
    _check_device("out", out, q)
    if lse is None:
        return
    _check_lse_like("lse", lse, (cfg.batch, cfg.heads_q, cfg.seqlen_q))
    _check_device("lse", lse, q)


def check_alignment(**tensors: torch.Tensor | None) -> None:
    """Data pointers 16-byte aligned (4 for lse). Real tensors only: reads data_ptr()."""
    for name, t in tensors.items():
        if t is None or t.numel() == 0:
            continue
        align = 4 if name in ("lse", "dlse") or name.endswith("_descale") else ALIGN_BYTES
        ptr = t.data_ptr()
        if ptr % align != 0:
            raise ValueError(
                f"{name}: data pointer must be {align}-byte aligned (cp.async/TMA), got address "
                f"{ptr:#x} (storage_offset {t.storage_offset()}); call {name}.contiguous() to "
                "get a fresh aligned copy"
            )
