"""A V head dim of its own (FA3's dv != d, _dv.py) on a GPU: flash_attn_func and
flash_attn_varlen_func against the float64 reference's dv != d attention, FA3's tolerance rule,
forward (out, lse) and backward, on the shapes of FA3's grid (d64 with dv 256 / 512, d192 with
dv 128); and the kernel with V's own head dim (d 192 / dv 128) that inference calls run."""

from __future__ import annotations

import pytest
import torch
from flash_hopper import _dv, flash_attn_func, flash_attn_varlen_func
from flash_hopper._lib import FhBackend, FhDtype
from flash_hopper.reference import attention_ref
from test_bwd_gpu import assert_fa3_rule, max_abs, reference_grads

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]


def assert_matches_reference(out, lse, q, k, v, mask):
    """out by FA3's rule against the float64 reference, lse within 1e-2 with its empty rows."""
    ref, lse_ref = attention_ref(q, k, v, **mask)
    low, _ = attention_ref(q, k, v, upcast=False, **mask)
    assert_fa3_rule(out, ref, low)
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty)
    assert max_abs(lse[~empty], lse_ref[~empty]) < 1e-2


def require_width(lib, width):
    """Skip unless the padded call's bucket (max(d, min(dv, 256))) trains here."""
    backend = FhBackend.FA3 if torch.cuda.get_device_capability() == (9, 0) else FhBackend.FA2
    for has in (lib.has_fwd_kernel, lib.has_bwd_kernel):
        if not has(backend, FhDtype.BF16, width):
            pytest.skip(f"this build has no bf16 kernels for head dim {width}")


@pytest.mark.parametrize(("d", "dv"), [(64, 256), (64, 512), (192, 128), (64, 128)])
@pytest.mark.parametrize("mask", [{"causal": True}, {"window_size": (30, 4), "softcap": 20.0}])
def test_forward_and_backward(lib, seed, d, dv, mask):
    require_width(lib, max(d, min(dv, 256)))
    b, sq, sk, hq, hkv = 2, 173, 211, 6, 2
    q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(b, sk, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(b, sk, hkv, dv, dtype=torch.bfloat16, device="cuda")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_func(*leaves, return_attn_probs=True, **mask)
    assert out.shape == (b, sq, hq, dv)
    assert_matches_reference(out.detach(), lse, q, k, v, mask)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    want = reference_grads(q, k, v, dout, **mask)
    lowp = reference_grads(q, k, v, dout, upcast_to=None, **mask)
    factor = 3.0 if mask.get("softcap") else 2.0
    for g, r, lp in zip(got, want, lowp):
        assert_fa3_rule(g, r, lp, factor)


def test_varlen(lib, seed):
    require_width(lib, 256)
    lens = [100, 1, 257]
    cu = torch.tensor([0, 100, 101, 358], dtype=torch.int32, device="cuda")
    q = torch.randn(358, 4, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(358, 1, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(358, 1, 256, dtype=torch.bfloat16, device="cuda")
    out = flash_attn_varlen_func(q, k, v, cu, cu, 257, 257, causal=True)
    assert out.shape == (358, 4, 256)
    start = 0
    for n in lens:
        rows = slice(start, start + n)
        ref, _ = attention_ref(q[None, rows], k[None, rows], v[None, rows], causal=True)
        low, _ = attention_ref(q[None, rows], k[None, rows], v[None, rows], causal=True,
                               upcast=False)
        assert_fa3_rule(out[None, rows], ref, low)
        start += n


@pytest.fixture
def dv_kernel_on(monkeypatch):
    """The default: inference calls run the kernel with V's own head dim."""
    monkeypatch.delenv("FLASH_HOPPER_DV_KERNEL", raising=False)


def require_native(lib, dtype=torch.bfloat16):
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the kernels with V's own head dim are the FA-3 path's (cc 9.0)")
    built = {(k["dtype"], k["head_dim"], k["head_dim_v"])
             for k in lib.build_info().get("head_dim_v_kernels", [])}
    if (name, 192, 128) not in built:
        pytest.skip(f"this build has no {name} kernel for head_dim 192 / head_dim_v 128")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("d", "dv"), [(192, 128), (136, 104), (184, 120)])
@pytest.mark.parametrize("mask", [{}, {"causal": True},
                                  {"window_size": (70, 9), "softcap": 15.0}])
def test_native_forward(lib, seed, monkeypatch, dv_kernel_on, dtype, d, dv, mask):
    """Inference calls of (d in 136..192, dv in 104..128) run the kernel with V's own head dim
    (no zero padding: split_call is not reached) and match the float64 reference."""
    require_native(lib, dtype)
    monkeypatch.setattr(_dv, "split_call", lambda *a, **kw: pytest.fail("padded, not native"))
    b, sq, sk, hq, hkv = 2, 300, 389, 6, 2
    q = torch.randn(b, sq, hq, d, dtype=dtype, device="cuda")
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn(b, sk, hkv, dv, dtype=dtype, device="cuda")
    out, lse = flash_attn_func(q, k, v, return_attn_probs=True, **mask)
    assert out.shape == (b, sq, hq, dv) and lse.shape == (b, hq, sq)
    assert_matches_reference(out, lse, q, k, v, mask)
    assert torch.equal(flash_attn_func(q, k, v, **mask), out)  # the cached plan, no LSE


def test_native_forward_strided_v_and_garbage_past_dv(lib, seed, monkeypatch, dv_kernel_on):
    """v as a view of a wider buffer (its rows strided, NaN in the columns past dv): the kernel
    reads dv columns only; q / k / v from one packed projection as DeepSeek's prefill has them."""
    require_native(lib)
    monkeypatch.setattr(_dv, "split_call", lambda *a, **kw: pytest.fail("padded, not native"))
    b, s, h = 1, 517, 4
    buf = torch.randn(b, s, h, 192 + 192 + 136, dtype=torch.bfloat16, device="cuda")
    buf[..., 192 + 192 + 128:] = float("nan")
    q, k, v = buf[..., :192], buf[..., 192:384], buf[..., 384:384 + 128]
    out = flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_ref(q, k, v, causal=True)
    low, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert torch.isfinite(out).all()
    assert_fa3_rule(out, ref, low)


def test_native_and_padded_agree_and_grad_takes_the_padded_path(lib, seed, dv_kernel_on):
    """Under grad the padded path runs (it has the backward); its forward agrees with the
    native one to the FA3 rule."""
    require_native(lib)
    require_width(lib, 192)
    q = torch.randn(2, 129, 4, 192, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(2, 257, 4, 192, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(2, 257, 4, 128, dtype=torch.bfloat16, device="cuda")
    native = flash_attn_func(q, k, v, causal=True)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    padded = flash_attn_func(*leaves, causal=True)
    ref, _ = attention_ref(q, k, v, causal=True)
    low, _ = attention_ref(q, k, v, causal=True, upcast=False)
    assert_fa3_rule(native, ref, low)
    assert_fa3_rule(padded.detach(), ref, low)
    padded.sum().backward()
    assert leaves[2].grad.shape == v.shape


def test_native_varlen(lib, seed, monkeypatch, dv_kernel_on):
    """flash_attn_varlen_func with d 192 / dv 128: the varlen kernel with V's own head dim, one
    sequence empty, one shorter than a tile, GQA, a given out (its rows past the sequences kept)."""
    require_native(lib)
    monkeypatch.setattr(_dv, "split_call", lambda *a, **kw: pytest.fail("padded, not native"))
    lens_q, lens_k = [100, 0, 1, 300], [150, 7, 130, 300]
    cu_q = torch.tensor([0, 100, 100, 101, 401], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 150, 157, 287, 587], dtype=torch.int32, device="cuda")
    q = torch.randn(405, 8, 192, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(587, 2, 192, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(587, 2, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.full((405, 8, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    got, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 300, causal=True, out=out,
                                      return_attn_probs=True)
    assert got.data_ptr() == out.data_ptr() and lse.shape == (8, 405)
    assert (out[401:] == 7.0).all()
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0:
            continue
        rq = slice(int(cu_q[i]), int(cu_q[i]) + nq)
        rk = slice(int(cu_k[i]), int(cu_k[i]) + nk)
        ref, _ = attention_ref(q[None, rq], k[None, rk], v[None, rk], causal=True)
        low, _ = attention_ref(q[None, rq], k[None, rk], v[None, rk], causal=True, upcast=False)
        assert_fa3_rule(out[None, rq], ref, low)
