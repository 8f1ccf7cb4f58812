"""flash_hopper.supports (docs/host.md "Backend policy"): a server's question before it captures
graphs, answered by the built library's validation and policy for a GPU of a given compute
capability (CPU)."""

from __future__ import annotations

import pytest
from flash_hopper import supports
from flash_hopper._lib import FhBackend, FhDtype


def first_bucket(lib, backend, dtype=FhDtype.BF16):
    return next((d for d in (64, 96, 128, 192, 256) if lib.has_fwd_kernel(backend, dtype, d)),
                None)


def test_a_built_kernel_is_named(lib):
    d = first_bucket(lib, FhBackend.FA3)
    if d is None:
        pytest.skip("this build has no bf16 FA-3 kernel")
    ok, reason = supports(capability=(9, 0), head_dim=d, heads_q=16, heads_kv=4, seqlen_q=512)
    assert ok and reason.startswith("fa3: cc 9.0 and fa3 kernel built for bf16"), reason
    # flash_attn_func's and flash_attn_varlen_func's short queries: the decode kernel, whatever
    # FA kernels the build holds (the family that runs, from the library's policy)
    for varlen in (False, True):
        ok, reason = supports(capability=(9, 0), head_dim=128, heads_q=16, heads_kv=4,
                              varlen=varlen)
        assert ok and reason.startswith("decode: the decode kernel (cc 9.0): 4 query heads per "
                                        "KV head x 1 tokens"), reason
    # explicit FA-3 backend: the varlen kernels (packed at the API level when rows are unmasked)
    ok, reason = supports(capability=(9, 0), head_dim=d, heads_q=16, heads_kv=4, kvcache=True,
                          causal=True, seqlen_q=1, backend="fa3")
    assert ok and "4 query heads per KV head packed into one tile" in reason, reason
    ok, reason = supports(capability=(9, 0), head_dim=d, kvcache=True, causal=True, seqlen_q=4,
                          backend="fa3")
    assert ok and "packed" not in reason  # masked multi-token rows: not packed
    ok, reason = supports(capability=(9, 0), head_dim=d, kvcache=True, page_size=16,
                          backend="fa3")
    assert ok and "paged: the pages gathered into a dense copy" in reason, reason
    # "auto": short queries on the decode kernel, paged caches read in place, rotary included
    ok, reason = supports(capability=(9, 0), head_dim=128, heads_q=32, heads_kv=8, kvcache=True,
                          causal=True, seqlen_q=4, page_size=16, rotary=True)
    assert ok and reason.startswith("decode: the decode kernel (cc 9.0): 4 query heads per KV "
                                    "head x 4 tokens") and "page size 16" in reason, reason
    ok, reason = supports(capability=(8, 0), head_dim=64, dtype="fp16", kvcache=True)
    assert ok and reason.startswith("decode:"), reason
    ok, reason = supports(capability=(9, 0), head_dim=d, kvcache=True, seqlen_q=512)
    assert ok and not reason.startswith("decode:"), reason  # 512 rows: the varlen kernels
    ok, reason = supports(capability=(9, 0), head_dim=d, varlen=True, window_size=(64, 0),
                          softcap=30.0)
    assert ok, reason


def test_what_cannot_run_says_why(lib):
    fp8_d = first_bucket(lib, FhBackend.FA3, FhDtype.E4M3) or 128
    cases = [
        ({"page_size": 16}, "page_size: paged KV outside flash_attn_with_kvcache is not"),
        ({"page_size": 16, "kvcache": True, "rotary": True, "backend": "fa3"},
         "rotary: rotary with a paged cache off the decode kernel is not implemented"),
        ({"sinks": True}, "sinks: attention sinks outside flash_attn_with_kvcache is not"),
        ({"rotary": True, "dtype": "e4m3"}, "rotary: rotary with FP8 inputs is not implemented"),
        ({"dtype": "fp8"}, "dtype: expected one of fp16, bf16, e4m3"),
        ({"backend": "fa4"}, "backend: expected one of auto, fa2, fa3"),
        ({"heads_q": 32, "heads_kv": 5}, "heads_kv: expected a divisor of heads_q (32)"),
        ({"softcap": -1.0}, "softcap: expected a finite float >= 0"),
        ({"head_dim": 300}, "head_dim"),
        ({"dtype": "e4m3", "capability": (8, 0), "head_dim": fp8_d},
         "need a GPU of compute capability 9.0"),
        ({"dtype": "bf16+e4m3", "varlen": True}, "the mixed mode) are not implemented yet"),
        ({"backend": "fa3", "capability": (8, 9)}, "cc 8.9"),
    ]
    for kwargs, fragment in cases:
        kwargs = {"capability": (9, 0), **kwargs}
        ok, reason = supports(**kwargs)
        assert not ok and fragment in reason, (kwargs, reason)


def test_a_bucket_this_build_lacks_names_the_build_variables(lib):
    missing = next((d for d in (64, 96, 128, 192, 256)
                    if not lib.has_fwd_kernel(FhBackend.FA3, FhDtype.BF16, d)
                    and not lib.has_fwd_kernel(FhBackend.FA2, FhDtype.BF16, d)), None)
    if missing is None:
        pytest.skip("this build has every bf16 bucket")
    ok, reason = supports(capability=(9, 0), head_dim=missing, seqlen_q=4096)
    assert not ok and f"FH_HEAD_DIMS including {missing}" in reason, reason


def test_the_route_env_closes_the_decode_kernel(lib, monkeypatch):
    # FLASH_HOPPER_DECODE: "kvcache" keeps flash_attn_func's short queries on the FA paths, "0"
    # every call; supports answers as the calls would run.
    short = {"capability": (9, 0), "head_dim": 128, "heads_q": 16, "heads_kv": 4}
    for env, plain, kv in (("1", True, True), ("kvcache", False, True), ("0", False, False)):
        monkeypatch.setenv("FLASH_HOPPER_DECODE", env)
        assert supports(**short)[1].startswith("decode:") == plain, env
        assert supports(**short, kvcache=True)[1].startswith("decode:") == kv, env
