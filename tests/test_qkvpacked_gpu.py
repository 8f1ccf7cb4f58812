"""flash_attn_qkvpacked_func on a GPU: the same kernels as flash_attn_func on qkv's views, so the
output and the gradient parts are bitwise equal to flash_attn_func's (deterministic=True for
dq), and the gradients pass FA3's tolerance rule against the float64 reference
(test_bwd_gpu.assert_grads_match). Every route: plain eager training (the backward into the parts
of one dqkv, poisoned first so a part left unwritten fails), inference, torch.compile."""

from __future__ import annotations

import pytest
import torch
from flash_hopper import flash_attn_func, flash_attn_qkvpacked_func
from flash_hopper._lib import FhBackend
from test_bwd_gpu import _ENUM_DTYPE, assert_grads_match, require_bwd

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]

CASES = [  # (batch, seqlen, heads_q, heads_kv or None for a 5-D qkv, head_dim, mask)
    (2, 113, 4, None, 128, {"causal": True}),
    (1, 257, 6, None, 64, {}),
    (2, 203, 4, 2, 128, {"window_size": (50, 7)}),
    (1, 129, 8, 1, 64, {"causal": True, "softcap": 15.0}),
]


def require_training(lib, dtype, head_dim):
    """Skip unless the path "auto" trains on (fa3 on cc 9.0 where built, else fa2) is built."""
    fa3 = (torch.cuda.get_device_capability() == (9, 0)
           and lib.has_bwd_kernel(FhBackend.FA3, _ENUM_DTYPE[dtype], head_dim))
    require_bwd(lib, dtype, head_dim, "fa3" if fa3 else "fa2")


def packed(b, s, hq, hkv, d, dtype):
    shape = (b, s, 3, hq, d) if hkv is None else (b, s, hq + 2 * hkv, d)
    return torch.randn(shape, dtype=dtype, device="cuda")


def views(qkv, hq, hkv):
    if hkv is None:
        return qkv.unbind(2)
    return qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]


def grads_of(fn, leaves, dout, dlse):
    out, lse = fn(*leaves)
    return torch.autograd.grad([out, lse], leaves, [dout, dlse])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "s", "hq", "hkv", "d", "mask"), CASES)
def test_equals_flash_attn_func_on_the_views(lib, seed, monkeypatch, dtype, b, s, hq, hkv, d,
                                              mask):
    require_training(lib, dtype, d)
    qkv = packed(b, s, hq, hkv, d, dtype)
    num_heads_q = None if hkv is None else hq
    dout = torch.randn(b, s, hq, d, dtype=dtype, device="cuda")
    dlse = torch.randn(b, hq, s, device="cuda")
    # every element of dqkv must be written by the kernels: poison the fresh buffer
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    leaf = qkv.detach().requires_grad_()
    got_out, got_lse = flash_attn_qkvpacked_func(leaf, deterministic=True,
                                                 num_heads_q=num_heads_q,
                                                 return_attn_probs=True, **mask)
    (dqkv,) = torch.autograd.grad([got_out, got_lse], [leaf], [dout, dlse])
    monkeypatch.setattr(torch, "empty", real_empty)
    assert dqkv.shape == qkv.shape and dqkv.dtype == dtype
    assert not dqkv.isnan().any(), "a part of dqkv was not written"

    leaves = [t.detach().requires_grad_() for t in views(qkv, hq, hkv)]
    want_out, want_lse = flash_attn_func(*leaves, deterministic=True, return_attn_probs=True,
                                         **mask)
    want = torch.autograd.grad([want_out, want_lse], leaves, [dout, dlse])
    assert torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)
    for name, part, w in zip(("dq", "dk", "dv"), views(dqkv, hq, hkv), want):
        assert torch.equal(part, w), name
    assert_grads_match(views(dqkv, hq, hkv), *views(qkv, hq, hkv), dout, dlse, **mask)

    with torch.no_grad():  # inference: the route through flash_attn_func
        assert torch.equal(flash_attn_qkvpacked_func(qkv, num_heads_q=num_heads_q, **mask),
                           want_out)


def test_unused_lse_and_sm_margin(lib, seed):
    require_training(lib, torch.bfloat16, 128)
    qkv = packed(2, 300, 4, None, 128, torch.bfloat16).requires_grad_()
    dout = torch.randn(2, 300, 4, 128, dtype=torch.bfloat16, device="cuda")
    out = flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)
    (g,) = torch.autograd.grad(out, qkv, dout)
    out_m = flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True, sm_margin=8)
    (g_m,) = torch.autograd.grad(out_m, qkv, dout)
    assert torch.equal(out, out_m) and torch.equal(g, g_m)
    assert_grads_match(g.unbind(2), *qkv.detach().unbind(2), dout, causal=True)


def test_torch_compile_equals_eager(lib, seed):
    require_training(lib, torch.bfloat16, 64)
    torch._dynamo.reset()
    qkv = packed(2, 97, 4, 2, 64, torch.bfloat16)
    dout = torch.randn(2, 97, 4, 64, dtype=torch.bfloat16, device="cuda")

    def step(t):
        return flash_attn_qkvpacked_func(t, causal=True, num_heads_q=4, deterministic=True)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaf = qkv.detach().requires_grad_()
        out = fn(leaf)
        results.append((out, torch.autograd.grad(out, leaf, dout)[0]))
    (out_e, g_e), (out_c, g_c) = results
    assert torch.equal(out_e, out_c)
    assert torch.equal(g_e, g_c)  # the same kernels; autograd assembles the traced one
