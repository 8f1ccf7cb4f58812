"""flash_hopper.supports (docs/host.md "Backend policy"): a server's question before it captures
graphs, answered by the built library's validation and policy for a GPU of a given compute
capability (CPU)."""

from __future__ import annotations

import pytest
import torch
from flash_hopper import dispatch, supports
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


def test_sinks_run_on_the_kernel_of_the_call_without_them(lib):
    # flash_attn_func / flash_attn_varlen_func compose sinks from the call's LSE
    for varlen in (False, True):
        assert (supports(capability=(9, 0), head_dim=128, varlen=varlen, sinks=True)
                == supports(capability=(9, 0), head_dim=128, varlen=varlen))


def test_what_cannot_run_says_why(lib):
    fp8_d = first_bucket(lib, FhBackend.FA3, FhDtype.E4M3) or 128
    cases = [
        ({"page_size": 16}, "page_size: paged KV outside flash_attn_with_kvcache is not"),
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


def test_rotary_with_a_paged_cache_off_the_decode_kernel_runs(lib):
    # the paged fallback's gathered copy takes the rotated keys into the pool (kvcache._paged)
    ok, reason = supports(capability=(9, 0), head_dim=128, page_size=16, kvcache=True,
                          rotary=True, backend="fa3")
    plain = supports(capability=(9, 0), head_dim=128, page_size=16, kvcache=True, backend="fa3")
    assert (ok, reason) == plain, reason


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


# Each dtype name with the other forms users pass for it: torch dtypes, torch's spellings, and
# for the mixed mode (16-bit q, FP8 K / V) pairs and "q+kv" strings of any of those.
DTYPE_FORMS = {
    "bf16": (torch.bfloat16, "bfloat16", "torch.bfloat16", " BF16 ",
             (torch.bfloat16, torch.bfloat16)),
    "fp16": (torch.float16, "float16", "torch.float16"),
    "e4m3": (torch.float8_e4m3fn, "float8_e4m3fn", "torch.float8_e4m3fn"),
    "bf16+e4m3": ((torch.bfloat16, torch.float8_e4m3fn), ["bf16", "e4m3"],
                  "bfloat16+float8_e4m3fn"),
    "fp16+e4m3": ((torch.float16, torch.float8_e4m3fn),),
    "bf16+e5m2": ((torch.bfloat16, torch.float8_e5m2), "torch.bfloat16+torch.float8_e5m2"),
    "fp16+e5m2": (("fp16", torch.float8_e5m2), "float16+e5m2"),
}
# Configurations whose answers depend on the dtype: a long forward (the FA kernels' tables), a
# decode step (the decode kernel's, the mixed mode's only route), a varlen call (the mixed mode
# refused), on a GPU of each path.
DTYPE_PROBES = (
    {"capability": (9, 0), "head_dim": 128, "seqlen_q": 512},
    {"capability": (9, 0), "head_dim": 128, "heads_kv": 8, "kvcache": True},
    {"capability": (9, 0), "head_dim": 64, "varlen": True, "seqlen_q": 512},
    {"capability": (8, 0), "head_dim": 64, "seqlen_q": 512},
)


@pytest.mark.parametrize("name", list(DTYPE_FORMS))
def test_every_dtype_form_gets_its_names_answer(lib, name):
    names_answers = [supports(dtype=name, **probe) for probe in DTYPE_PROBES]
    assert not any(reason.startswith("dtype: expected") for _, reason in names_answers)
    for form in DTYPE_FORMS[name]:
        answers = [supports(dtype=form, **probe) for probe in DTYPE_PROBES]
        assert answers == names_answers, (form, answers)
        assert hypothetical(form) == hypothetical(name), form


def hypothetical(dtype):
    """dispatch.hypothetical's answer for cc 9.0, hdim 128, or the message it raises."""
    try:
        return dispatch.hypothetical((9, 0), dtype, 128)
    except (ValueError, NotImplementedError) as exc:
        return str(exc)


@pytest.mark.parametrize("value", [
    "fp8", "float32", torch.float32, None, 3,
    torch.float8_e5m2,  # e5m2 is a K / V dtype of the mixed mode only
    (torch.float8_e4m3fn, torch.bfloat16),  # FP8 q against 16-bit K / V: no such mode
    (torch.bfloat16,), (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e4m3fn),
    "bf16+e4m3+e4m3", "bf16+",
], ids=repr)
def test_a_bad_dtype_names_the_argument_the_forms_and_the_value(lib, value):
    ok, reason = supports(capability=(9, 0), dtype=value)
    assert not ok, reason
    assert reason.startswith("dtype: expected one of fp16, bf16, e4m3, bf16+e4m3"), reason
    assert "torch.bfloat16" in reason and "(torch.bfloat16, torch.float8_e4m3fn)" in reason
    assert reason.endswith(f"got {value!r}"), reason
    with pytest.raises(ValueError, match="^dtype: expected one of"):
        dispatch.hypothetical((9, 0), value, 128)


def test_own_head_dim_v_names_its_kernel_or_the_padding(lib, monkeypatch):
    monkeypatch.setenv("FLASH_HOPPER_DV_KERNEL", "0")  # the padding on request
    ok, reason = supports(capability=(9, 0), head_dim=192, head_dim_v=128, seqlen_q=512)
    assert "q / k zero-padded to 192" in reason or not ok, reason
    monkeypatch.delenv("FLASH_HOPPER_DV_KERNEL")  # the default
    built = {(k["dtype"], k["head_dim"], k["head_dim_v"])
             for k in lib.build_info().get("head_dim_v_kernels", [])}
    ok, reason = supports(capability=(9, 0), head_dim=192, head_dim_v=128, seqlen_q=512)
    if ("bf16", 192, 128) in built:
        assert ok and reason.startswith("fa3: bf16 head_dim 192 / head_dim_v 128: cc 9.0"), reason
        assert reason.endswith("(inference calls; under grad V is zero-padded, _dv.py)")
    else:
        assert "q / k zero-padded to 192, V in 1 block of 192 (_dv.py)" in reason or not ok
    # no kernel of its own for the pair, or an FA-2 GPU: the padded call's answer
    for d, dv, capability in ((64, 256, (9, 0)), (192, 128, (8, 0))):
        ok, reason = supports(capability=capability, head_dim=d, head_dim_v=dv, seqlen_q=512)
        assert "zero-padded to" in reason or not ok, reason
        assert "head_dim_v" not in reason.split(";")[0] or not ok, reason
