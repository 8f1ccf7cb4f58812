"""A V head dim of its own (FA3's dv != d) on CPU: the zero-padding decomposition (_dv.py) is
exact — with the float64 reference standing in for the kernels, split_call equals the
reference's own dv != d attention, output, LSE and gradients — and its calls have the widths
the docstring promises. The kernels' side is the same-head-dim call (tests on a GPU)."""

from __future__ import annotations

import pytest
import torch
from _helpers import raises
from flash_hopper import _dv, flash_attn_func
from flash_hopper.reference import attention_ref


def reference_call(widths):
    def call(q, k, v, softmax_scale, return_attn_probs, **mask):
        assert return_attn_probs and q.shape[-1] == k.shape[-1] == v.shape[-1]
        widths.append(q.shape[-1])
        return attention_ref(q, k, v, softmax_scale=softmax_scale, **mask)
    return call


@pytest.mark.parametrize(("d", "dv", "widths"), [(64, 256, [256]), (64, 512, [256, 256]),
                                                 (192, 128, [192]), (32, 40, [40]),
                                                 (128, 264, [256, 256]), (16, 8, [16])])
@pytest.mark.parametrize("mask", [{}, {"causal": True}, {"window_size": (5, 2), "softcap": 9.0}])
def test_split_call_is_exact(d, dv, widths, mask):
    torch.manual_seed(d + dv)
    q = torch.randn(2, 13, 4, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 17, 2, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 17, 2, dv, dtype=torch.float64, requires_grad=True)
    seen = []
    out, lse = _dv.split_call(reference_call(seen), q, k, v, None, True, **mask)
    assert seen == widths
    want, want_lse = attention_ref(q, k, v, **mask)
    assert out.shape == (2, 13, 4, dv) and out.is_contiguous()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad([out, lse], [q, k, v], [dout, dlse])
    ref = torch.autograd.grad([want, want_lse], [q, k, v], [dout, dlse])
    for name, g, r in zip("qkv", got, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10, msg=f"d{name}")


def test_scale_stays_that_of_q_head_dim():
    q, k = torch.randn(1, 3, 1, 16, dtype=torch.float64), torch.randn(1, 5, 1, 16,
                                                                      dtype=torch.float64)
    v = torch.randn(1, 5, 1, 64, dtype=torch.float64)
    out = _dv.split_call(reference_call([]), q, k, v, None, False)
    torch.testing.assert_close(out, attention_ref(q, k, v, softmax_scale=16 ** -0.5)[0])


@pytest.mark.parametrize(("dq", "dv", "name"), [(60, 64, "q"), (64, 60, "v"), (264, 128, "q")])
def test_bad_head_dims(dq, dv, name):
    q = torch.zeros(1, 4, 2, dq, dtype=torch.bfloat16)
    v = torch.zeros(1, 4, 2, dv, dtype=torch.bfloat16)
    with raises(ValueError, f"{name}: expected"):
        flash_attn_func(q, q, v)


def test_differs():
    a, b = torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 128)
    assert _dv.differs(a, b) and not _dv.differs(a, a)
    assert not _dv.differs(a, [1]) and not _dv.differs(a, torch.zeros(2, 3, 128))


def test_reaches_the_device_check():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with raises(ValueError, "q: must be a CUDA tensor"):
        flash_attn_func(q, q, torch.zeros(1, 4, 2, 256, dtype=torch.bfloat16))
