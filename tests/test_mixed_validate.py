"""The mixed mode (fp16 / bf16 q against an FP8 K/V cache) on CPU: argument validation (every bad
input refused naming the argument, the expected and the given value, before any device work),
the C ABI fields it fills, and the library's backend policy for it. The kernels' numerics are
tests/test_mixed_gpu.py's."""

from __future__ import annotations

import pytest
import torch
from _helpers import raises
from flash_hopper import UnsupportedError, _fwd, _lib, _tables, _validate, dispatch, flash_attn_func
from flash_hopper._lib import FhDtype

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ON_DEVICE = ("q: must be a CUDA tensor",)  # what a valid CPU call reaches


def mixed_qkv(q_dtype=torch.bfloat16, kv_dtype=E4M3, b=2, sq=16, sk=24, hq=4, hkv=2, d=64):
    q = torch.randn(b, sq, hq, d).to(q_dtype)
    k = torch.randn(b, sk, hkv, d).to(kv_dtype)
    v = torch.randn(b, sk, hkv, d).to(kv_dtype)
    return q, k, v


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_valid_mixed_calls_reach_the_device_check(q_dtype, kv_dtype):
    q, k, v = mixed_qkv(q_dtype, kv_dtype)
    descale = torch.tensor(0.5).expand(2, 2)
    with raises(ValueError, *ON_DEVICE):
        flash_attn_func(q, k, v, k_descale=descale, v_descale=torch.ones(1), causal=True)


def test_the_mixed_options_reach_the_params():
    q, k, v = mixed_qkv(torch.float16, E5M2)
    cfg, fp8 = _validate.check_fp8_args(q, k, v, None, False, (-1, -1), 0.0, "auto", None,
                                        torch.ones(2, 4)[:, ::2], torch.tensor(2.0), None,
                                        "two-level", devices=False)
    assert cfg.dtype == torch.float16 and cfg.head_dim == 64
    assert fp8.kv_dtype == E5M2 and fp8.out_dtype == torch.float16
    assert fp8.q_descale is None and fp8.k_descale == (4, 2) and fp8.v_descale == (0, 0)
    p = _fwd.fill_params(cfg, (1, 1, 1), (16, 16, 16), (16, 16, 16), (1, 1, 1), None, "auto", 0,
                         fp8)
    assert (p.dtype, p.kv_dtype, p.out_dtype) == (FhDtype.FP16, FhDtype.E5M2, FhDtype.FP16)
    assert (p.k_descale_batch_stride, p.k_descale_head_stride) == (4, 2)
    assert p.fp8_accumulation == _lib.FhFp8Accumulation.TWO_LEVEL


def test_plain_calls_fill_kv_dtype_with_their_dtype():
    q, k, v = mixed_qkv(torch.bfloat16, torch.bfloat16)
    cfg = _validate._config(q, k, v, None, -1, -1, 0.0, "auto", devices=False)
    p = _fwd.fill_params(cfg, (1, 1, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1), None, "auto")
    assert p.dtype == p.kv_dtype == p.out_dtype == FhDtype.BF16


@pytest.mark.parametrize(("change", "exc", "fragments"), [
    (lambda q, k, v: (q, k, v.bfloat16()), ValueError,
     ("v: expected dtype torch.float8_e4m3fn (k's dtype", "got torch.bfloat16")),
    (lambda q, k, v: (q, k, v.to(E5M2)), ValueError,
     ("v: expected dtype torch.float8_e4m3fn (k's dtype", "got torch.float8_e5m2")),
    (lambda q, k, v: (q, k.bfloat16(), v), ValueError,
     ("v: expected dtype torch.bfloat16 (q's dtype)", "torch.float8_e4m3fn",
      "take k and v both in one FP8 dtype")),
    (lambda q, k, v: (q.float(), k, v), ValueError,
     ("q: expected dtype torch.float16 or torch.bfloat16", "torch.float32")),
    (lambda q, k, v: (q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :40]),
     NotImplementedError, ("v: head_dim (dim 3) 40 differs",)),
], ids=["v-16bit", "v-other-fp8", "k-16bit-v-fp8", "q-fp32", "asymmetric"])
def test_mixed_dtype_and_shape_errors(change, exc, fragments):
    with raises(exc, *fragments):
        flash_attn_func(*change(*mixed_qkv()))


@pytest.mark.parametrize("head_dim", [72, 40])
def test_mixed_head_dims_are_multiples_of_16(head_dim):
    with raises(ValueError, "q: expected head_dim (dim 3) a multiple of 16", "for FP8 k / v",
                f"got {head_dim}"):
        flash_attn_func(*mixed_qkv(d=head_dim))


@pytest.mark.parametrize(("kwargs", "exc", "fragments"), [
    ({"q_descale": torch.ones(2, 2)}, ValueError,
     ("q_descale: expected None in the mixed mode", "q is torch.bfloat16", "Tensor")),
    ({"out_dtype": torch.float16}, ValueError,
     ("out_dtype: expected None or torch.bfloat16 (q's dtype)", "mixed mode", "torch.float16")),
    ({"fp8_accumulation": "single-level"}, ValueError,
     ("fp8_accumulation: expected 'two-level'", "mixed mode", "'single-level'")),
    ({"k_descale": torch.ones(2, 4)}, ValueError,
     ("k_descale: expected shape (batch, heads_kv) = (2, 2)", "got (2, 4)")),
    ({"v_descale": torch.ones(2, 2, dtype=torch.float16)}, ValueError,
     ("v_descale: expected dtype torch.float32", "torch.float16")),
    ({"k_descale": 0.5}, TypeError, ("k_descale: expected None or a torch.Tensor", "float")),
], ids=["q-descale", "out-dtype", "single-level", "k-descale-shape", "v-descale-dtype",
        "k-descale-float"])
def test_mixed_extras_errors(kwargs, exc, fragments):
    with raises(exc, *fragments):
        flash_attn_func(*mixed_qkv(), **kwargs)


def test_mixed_calls_on_inputs_that_require_grad_run_forward_only():
    """As FP8 (test_fp8_validate): validated and run like a no_grad call (here: the CPU device
    check), a backward through the result raises (_autograd.ForwardOnly)."""
    q, k, v = mixed_qkv()
    q.requires_grad_(True)
    with raises(ValueError, "must be a CUDA tensor"):
        flash_attn_func(q, k, v)


def test_mixed_names_are_known_build_dtypes():
    assert set(_tables.MIXED_DTYPES) == {"bf16+e4m3", "fp16+e4m3", "bf16+e5m2", "fp16+e5m2"}
    assert _tables.MIXED_DTYPES["fp16+e5m2"] == (torch.float16, E5M2)
    info = {"variants": {n: int(v) for n, v in _tables.FA3_VARIANT_NAMES.items()},
            "head_dim_buckets": list(_tables.HEAD_DIM_BUCKETS), "dtypes": ["bf16", "bf16+e4m3"]}
    assert _tables.build_info_mismatch(info) is None
    assert "bf16+e6m1" in _tables.build_info_mismatch(dict(info, dtypes=["bf16+e6m1"]))


def test_tables_cmake_mixed_rows_agree_with_python():
    import re
    from pathlib import Path
    tables = Path(__file__).resolve().parents[1] / "kernels" / "src" / "tables.cmake"
    if not tables.is_file():
        pytest.skip("tables.cmake not present (tests run outside the source tree)")
    text = re.sub(r"#[^\n]*", "", tables.read_text())
    body = re.search(r"set\(FH_MIXED_TABLE\s+(.*?)\)", text, re.DOTALL).group(1)
    rows = [item.strip('"').split("|") for item in body.split()]
    got = {name: (q_enum, kv_enum, tuple(int(d) for d in dims.split(",")))
           for name, q_enum, kv_enum, _, _, dims in rows}
    want = {name: (f"FH_DTYPE_{_tables.TORCH_DTYPES[q].name}",
                   f"FH_DTYPE_{_tables.KV_FP8_DTYPES[kv].name}", _tables.MIXED_HEAD_DIM_BUCKETS)
            for name, (q, kv) in _tables.MIXED_DTYPES.items()}
    assert got == want


def _mixed_kernels(lib):
    return {(k["dtype"], k["head_dim"]) for k in _tables.kernel_entries(lib.build_info())
            if k["dtype"] in _tables.MIXED_DTYPES}


def test_mixed_kernels_are_fa3_forwards_of_their_buckets(lib):
    info = lib.build_info()
    entries = [k for k in _tables.kernel_entries(info) if k["dtype"] in _tables.MIXED_DTYPES]
    assert all(k["backend"] == "fa3" and k["head_dim"] in _tables.MIXED_HEAD_DIM_BUCKETS
               and k["variants"] == [0, 1] for k in entries)
    assert not [k for k in _tables.kernel_entries(info, "bwd") if k["dtype"] in
                _tables.MIXED_DTYPES]
    if "sm90a" in info["archs"] and "fwd" in info.get("directions", ["fwd"]):
        want = {(n, d) for n in _tables.MIXED_DTYPES if n in info["dtypes"]
                for d in info["head_dims"] if d in _tables.MIXED_HEAD_DIM_BUCKETS}
        assert _mixed_kernels(lib) == want


@pytest.mark.parametrize("name", sorted(_tables.MIXED_DTYPES))
def test_the_policy_for_the_mixed_mode(lib, name):
    built = (name, 64) in _mixed_kernels(lib)
    if built:
        backend, reason = dispatch.hypothetical((9, 0), name, 64)
        assert backend == "fa3" and f"{name} (mixed mode)" in reason
    else:
        with raises(UnsupportedError, f"no fa3 kernel for {name} hdim 64",
                    f"FH_DTYPES including {name}"):
            dispatch.hypothetical((9, 0), name, 64)
    with raises(UnsupportedError, "backend='fa2'", name, "FA-3 path's tuned kernel only"):
        dispatch.hypothetical((9, 0), name, 64, "fa2")
    with raises(UnsupportedError, "backend='fa3-no-overlap'", "tuned kernel only"):
        dispatch.hypothetical((9, 0), name, 64, "fa3-no-overlap")
    with raises(UnsupportedError, "compute capability 9.0", "cc 8.0"):
        dispatch.hypothetical((8, 0), name, 64)
    with raises(UnsupportedError, "head_dim: the mixed mode", "buckets 64, 128, 256",
                f"{name} hdim 96"):
        dispatch.hypothetical((9, 0), name, 96)
