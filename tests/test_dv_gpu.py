"""A V head dim of its own (FA3's dv != d, _dv.py) on a GPU: flash_attn_func and
flash_attn_varlen_func against the float64 reference's dv != d attention, FA3's tolerance rule,
forward (out, lse) and backward, on the shapes of FA3's grid (d64 with dv 256 / 512, d192 with
dv 128)."""

from __future__ import annotations

import pytest
import torch
from flash_hopper import flash_attn_func, flash_attn_varlen_func
from flash_hopper._lib import FhBackend, FhDtype
from flash_hopper.reference import attention_ref
from test_bwd_gpu import assert_fa3_rule, max_abs, reference_grads

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]


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
    ref, lse_ref = attention_ref(q, k, v, **mask)
    low, _ = attention_ref(q, k, v, upcast=False, **mask)
    assert_fa3_rule(out, ref, low)
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty)
    assert max_abs(lse[~empty], lse_ref[~empty]) < 1e-2
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
