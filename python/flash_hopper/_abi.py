"""The C ABI's Python mirror: api.h's version, enums and parameter structs
(kernels/include/flash_hopper/api.h), and nothing else.

The one module both the loader (_lib.py) and the tables (_tables.py) build on, so neither imports
the other; tests/test_lib.py parses api.h and checks every enum value and struct field here
against it.
"""

from __future__ import annotations

import ctypes
import enum

# Must equal FH_ABI_VERSION in api.h; the library reports its own through fh_abi_version().
ABI_VERSION = 12


class FhStatus(enum.IntEnum):
    """Mirror of api.h's FhStatus."""

    SUCCESS = 0
    ERROR_INVALID_ARGUMENT = 1
    ERROR_UNSUPPORTED = 2
    ERROR_CUDA = 3
    ERROR_INTERNAL = 4


class FhDtype(enum.IntEnum):
    """Mirror of api.h's FhDtype."""

    FP16 = 0
    BF16 = 1
    E4M3 = 2
    FP32 = 3
    E5M2 = 4


class FhBackend(enum.IntEnum):
    """Mirror of api.h's FhBackend."""

    AUTO = 0
    FA2 = 1
    FA3 = 2
    DECODE = 3  # the policy's answer for calls the decode kernel runs (fh_decode)


class FhFp8Accumulation(enum.IntEnum):
    """Mirror of api.h's FhFp8Accumulation."""

    TWO_LEVEL = 0
    SINGLE_LEVEL = 1


class FhVariantFlag(enum.IntFlag):
    """Mirror of api.h's FhVariantFlag: each bit switches one FA-3 optimization off."""

    NO_PINGPONG = 1
    NO_OVERLAP = 2


class FhVariant(enum.IntEnum):
    """Mirror of api.h's FhVariant: variants of the FA-3 path, sets of FhVariantFlag bits."""

    TUNED = 0
    NO_PINGPONG = FhVariantFlag.NO_PINGPONG
    NO_OVERLAP = FhVariantFlag.NO_OVERLAP
    NO_PINGPONG_NO_OVERLAP = FhVariantFlag.NO_PINGPONG | FhVariantFlag.NO_OVERLAP


_I32, _I64, _F32, _PTR = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# The attention's own tensors, first among the data pointers of FhFwdParams, FhBwdParams and
# FhDecodeParams.
_DATA_FIELDS = [(name, _PTR) for name in ("q", "k", "v", "o", "lse")]
# The problem's shape, the same seven fields in FhFwdParams and FhBwdParams.
_SHAPE_FIELDS = [(name, _I64) for name in ("batch", "seqlen_q", "seqlen_k", "heads_q",
                                           "heads_kv", "head_dim", "head_dim_v")]
# The score transform and mask, the same four fields in FhFwdParams, FhBwdParams and
# FhDecodeParams.
_SCORE_FIELDS = [
    ("softmax_scale", _F32),
    ("softcap", _F32),
    ("window_left", _I64),
    ("window_right", _I64),
]


class FhFwdParams(ctypes.Structure):
    """Mirror of api.h's FhFwdParams: same fields, same order, same C types.

    Every pointer is ``c_void_p`` (an integer address or None); tests/test_lib.py parses api.h and
    checks names, order, types and offsets against this class, so a drift fails CI.
    """

    _fields_ = [
        ("abi_version", _I32),
        # data
        *_DATA_FIELDS,
        ("dtype", _I32),
        ("out_dtype", _I32),
        ("kv_dtype", _I32),
        # shapes
        *_SHAPE_FIELDS,
        # strides in elements; the head_dim stride is 1 and not stored
        ("q_batch_stride", _I64),
        ("q_row_stride", _I64),
        ("q_head_stride", _I64),
        ("k_batch_stride", _I64),
        ("k_row_stride", _I64),
        ("k_head_stride", _I64),
        ("v_batch_stride", _I64),
        ("v_row_stride", _I64),
        ("v_head_stride", _I64),
        ("o_batch_stride", _I64),
        ("o_row_stride", _I64),
        ("o_head_stride", _I64),
        ("lse_batch_stride", _I64),
        ("lse_head_stride", _I64),
        # score transform and mask
        *_SCORE_FIELDS,
        # varlen
        ("cu_seqlens_q", _PTR),
        ("cu_seqlens_k", _PTR),
        ("seqused_k", _PTR),
        ("seqused_q", _PTR),
        ("max_seqlen_q", _I64),
        ("max_seqlen_k", _I64),
        ("workspace", _PTR),
        ("workspace_bytes", _I64),
        # KV cache (varlen only)
        ("kv_batch_idx", _PTR),
        ("leftpad_k", _PTR),
        ("batch_k", _I64),
        # FP8 (dtype E4M3)
        ("q_descale", _PTR),
        ("k_descale", _PTR),
        ("v_descale", _PTR),
        ("q_descale_batch_stride", _I64),
        ("q_descale_head_stride", _I64),
        ("k_descale_batch_stride", _I64),
        ("k_descale_head_stride", _I64),
        ("v_descale_batch_stride", _I64),
        ("v_descale_head_stride", _I64),
        ("fp8_accumulation", _I32),
        # dispatch
        ("backend", _I32),
        ("variant", _I32),
        ("num_sms", _I32),
        ("decode_route", _I32),
    ]


class FhBwdParams(ctypes.Structure):
    """Mirror of api.h's FhBwdParams (since ABI 3), checked against api.h like FhFwdParams."""

    _fields_ = [
        ("abi_version", _I32),
        # data
        *_DATA_FIELDS,
        ("dout", _PTR),
        ("dlse", _PTR),
        ("dq", _PTR),
        ("dk", _PTR),
        ("dv", _PTR),
        ("workspace", _PTR),
        ("workspace_bytes", _I64),
        ("dtype", _I32),
        ("deterministic", _I32),
        # shapes
        *_SHAPE_FIELDS,
        # strides in elements; the head_dim stride is 1 and not stored
        *[(f"{t}_{s}_stride", _I64) for t in ("q", "k", "v", "o", "dout", "dq", "dk", "dv")
          for s in ("batch", "row", "head")],
        ("lse_batch_stride", _I64),
        ("lse_head_stride", _I64),
        ("dlse_batch_stride", _I64),
        ("dlse_head_stride", _I64),
        # score transform and mask: the forward's
        *_SCORE_FIELDS,
        # reserved: varlen, chunked-local attention, sinks
        ("cu_seqlens_q", _PTR),
        ("cu_seqlens_k", _PTR),
        ("seqused_q", _PTR),
        ("seqused_k", _PTR),
        ("max_seqlen_q", _I64),
        ("max_seqlen_k", _I64),
        ("attention_chunk", _I64),
        ("sinks", _PTR),
        ("dsinks", _PTR),
        # dispatch
        ("backend", _I32),
        ("variant", _I32),
        ("num_sms", _I32),
    ]


class FhDecodeParams(ctypes.Structure):
    """Mirror of api.h's FhDecodeParams (since ABI 8), checked against api.h like FhFwdParams."""

    _fields_ = [
        ("abi_version", _I32),
        ("dtype", _I32),
        # data
        *_DATA_FIELDS,
        ("seqlens_k", _PTR),
        ("leftpad_k", _PTR),
        ("kv_batch_idx", _PTR),
        ("page_table", _PTR),
        ("cu_seqlens_q", _PTR),
        ("sinks", _PTR),
        ("workspace", _PTR),
        ("workspace_bytes", _I64),
        # shapes
        ("batch", _I64),
        ("seqlen_q", _I64),
        ("total_q", _I64),
        ("heads_q", _I64),
        ("heads_kv", _I64),
        ("head_dim", _I64),
        ("page_size", _I64),
        ("num_pages", _I64),
        ("max_pages", _I64),
        ("page_table_stride", _I64),
        # strides in elements; the head_dim stride is 1 and not stored
        *[(f"{t}_{s}_stride", _I64) for t, names in (("q", ("batch", "row", "head")),
                                                      ("k", ("page", "row", "head")),
                                                      ("v", ("page", "row", "head")),
                                                      ("o", ("batch", "row", "head")))
          for s in names],
        ("lse_batch_stride", _I64),
        ("lse_head_stride", _I64),
        # score transform and mask
        *_SCORE_FIELDS,
        # FP8 caches (since ABI 12)
        ("q_descale", _PTR),
        ("k_descale", _PTR),
        ("v_descale", _PTR),
        *[(f"{t}_descale_{s}_stride", _I64) for t in "qkv" for s in ("batch", "head")],
        # schedule
        ("num_splits", _I32),
        ("kv_dtype", _I32),
    ]
