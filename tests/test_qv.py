"""FA3's qv (MLA's extra query) on the composite path (_qv.py), on the CPU: the math against a
float64 reference written here, the three entry points (flash_attn_func, flash_attn_varlen_func,
flash_attn_with_kvcache: the composite runs on any device, so their whole path runs here), the
refusals naming the argument, the default scale, gradients, supports() and the scheduler
metadata.

The grids go one axis at a time around a central case (d 64, dv 512, heads 4:2, lengths
113 x 203), as docs/testing.md says: the mask axis runs over the lengths FA3's tests single out
(1 x 339, 113 x 203, 239 x 1) and a square one; head dims (d 32 / 64, dv 256 / 512) and heads
(MHA, GQA, MQA) around the central case. The math tests run in float64 with small tiles, so
the online softmax crosses many key blocks and the tails of both axes; the entry points take
bf16 and are judged by the tolerance doctrine (twice the error of the same computation in
bf16, the LSE against fp32's)."""

from __future__ import annotations

import math

import pytest
import torch
from flash_hopper import (
    _qv,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    get_scheduler_metadata,
    supports,
)
from flash_hopper._errors import UnsupportedError

from tests._helpers import raises

I32, BF16, F64 = torch.int32, torch.bfloat16, torch.float64
NEG_INF = float("-inf")


# --- the reference ------------------------------------------------------------------------------


def reference(q, k, v, qv, scale, causal=False, window=(-1, -1), softcap=0.0, chunk=0,
              dtype=F64):
    """One sequence, naively, every step in ``dtype``: q (sq, hq, d), k (sk, hk, d), v (sk, hk,
    dv), qv (sq, hq, dv) -> out (sq, hq, dv), lse (hq, sq). Query head h reads KV head
    h // (hq / hk); row i sees key j iff (with diag = i + sk - sq) diag - left <= j <= diag +
    right (negative bounds unbounded, causal: right 0) and floor(diag / chunk) == floor(j /
    chunk); a row that sees nothing gets out 0 and lse -inf."""
    sq, hq = q.shape[:2]
    sk, hk = k.shape[:2]
    group = hq // hk
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diag = i + sk - sq
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        seen &= j >= diag - left
    if right >= 0:
        seen &= j <= diag + right
    if chunk > 0:
        seen &= torch.div(diag, chunk, rounding_mode="floor") == torch.div(j, chunk,
                                                                          rounding_mode="floor")
    outs, lses = [], []
    for h in range(hq):
        kh, vh = k[:, h // group].to(dtype), v[:, h // group].to(dtype)
        s = (q[:, h].to(dtype) @ kh.T + qv[:, h].to(dtype) @ vh.T) * scale
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~seen, NEG_INF)
        lse = torch.logsumexp(s, dim=-1)
        any_key = seen.any(dim=-1, keepdim=True)
        p = torch.where(any_key, torch.exp(s - torch.where(any_key, lse[:, None], 0.0)), 0.0)
        outs.append(p @ vh)
        lses.append(lse)
    return torch.stack(outs, dim=1), torch.stack(lses)


def inputs(b, sq, sk, hq, hk, d, dv, dtype=BF16, grad=False):
    make = [(b, sq, hq, d), (b, sk, hk, d), (b, sk, hk, dv), (b, sq, hq, dv)]
    ts = [torch.randn(*shape, dtype=F64).to(dtype) for shape in make]
    return [t.requires_grad_(grad) for t in ts]


def judge(out, lse, q, k, v, qv, scale, **mask):
    """The tolerance doctrine for one sequence of a bf16 entry point: out within twice the bf16
    reference's error + 1e-5, the LSE within twice fp32's + 1e-4, rows without keys exactly
    0 / -inf, no NaN."""
    ref, ref_lse = reference(q, k, v, qv, scale, **mask)
    low, _ = reference(q, k, v, qv, scale, dtype=q.dtype, **mask)
    _, lse32 = reference(q, k, v, qv, scale, dtype=torch.float32, **mask)
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    bound = 2 * (low.double() - ref).abs().max().item() if out.numel() else 0.0
    assert err <= bound + 1e-5, (err, bound)
    if lse is None:
        return
    dead = ref_lse == NEG_INF
    assert torch.equal(lse == NEG_INF, dead)
    assert torch.equal(out[dead.t()].float(), torch.zeros_like(out[dead.t()].float()))
    live = ~dead
    if live.any():
        err = (lse.double() - ref_lse)[live].abs().max().item()
        bound = 2 * (lse32.double() - ref_lse)[live].abs().max().item()
        assert err <= bound + 1e-4 + mask.get("softcap", 0.0) * 2**-10, (err, bound)


# --- the math, float64 ---------------------------------------------------------------------------

# (causal, window, softcap, chunk): none, causal, a local window, softcap on the causal sum,
# chunked-local attention on top of causal.
MASKS = [(False, (-1, -1), 0.0, 0), (True, (-1, -1), 0.0, 0), (False, (17, 3), 0.0, 0),
         (True, (-1, -1), 5.0, 0), (True, (-1, -1), 0.0, 32)]
LENGTHS = [(1, 339), (113, 203), (239, 1), (64, 64)]


def dense_math(q, k, v, qv, scale, causal, window, softcap, chunk, block_q=16, block_k=24):
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    left, right = window
    right = 0 if causal else right
    return _qv.attention(_qv.Rows((q, qv), b, sq), _qv.Rows((k, v), b, sk), softmax_scale=scale,
                         window=(left, right), softcap=softcap, chunk=chunk, block_q=block_q,
                         block_k=block_k)


def assert_exact(out, lse, ref, ref_lse):
    assert torch.allclose(out, ref, rtol=0, atol=1e-10)
    assert torch.equal(lse == NEG_INF, ref_lse == NEG_INF)
    live = ref_lse != NEG_INF
    assert torch.allclose(lse[live], ref_lse[live], rtol=0, atol=1e-10)


@pytest.mark.parametrize(("sq", "sk"), LENGTHS)
@pytest.mark.parametrize(("causal", "window", "softcap", "chunk"), MASKS)
def test_math_matches_the_reference_over_masks_and_lengths(seed, sq, sk, causal, window,
                                                           softcap, chunk):
    q, k, v, qv = inputs(2, sq, sk, 4, 2, 64, 512, F64)
    out, lse = dense_math(q, k, v, qv, 0.07, causal, window, softcap, chunk)
    for b in range(2):
        ref, ref_lse = reference(q[b], k[b], v[b], qv[b], 0.07, causal, window, softcap, chunk)
        assert_exact(out[b], lse[b], ref, ref_lse)


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("dv", [256, 512])
@pytest.mark.parametrize(("hq", "hk"), [(4, 4), (4, 2), (4, 1)])
def test_math_matches_the_reference_over_head_dims_and_heads(seed, d, dv, hq, hk):
    q, k, v, qv = inputs(2, 113, 203, hq, hk, d, dv, F64)
    out, lse = dense_math(q, k, v, qv, (d + dv) ** -0.5, True, (-1, -1), 0.0, 0)
    for b in range(2):
        assert_exact(out[b], lse[b], *reference(q[b], k[b], v[b], qv[b], (d + dv) ** -0.5,
                                                causal=True))


def test_math_tile_sizes_do_not_change_the_result(seed):
    q, k, v, qv = inputs(1, 70, 90, 4, 2, 64, 256, F64)
    results = [dense_math(q, k, v, qv, 0.05, True, (30, -1), 0.0, 0, bq, bk)
               for bq, bk in ((1, 1), (7, 13), (70, 90), (None, None))]
    for out, lse in results[1:]:
        assert torch.allclose(out, results[0][0], rtol=0, atol=1e-12)
        assert torch.allclose(lse, results[0][1], rtol=0, atol=1e-12)


def test_block_sizes_bound_the_temporaries():
    # a (1, 8, 4096, 4096) score matrix is never materialized: each tile, key block and
    # accumulator stays within BLOCK_ELEMENTS
    budget = _qv.BLOCK_ELEMENTS
    for batch, hq, hk, sq, sk in ((1, 8, 8, 4096, 4096), (128, 128, 1, 1, 32768),
                                  (4, 16, 2, 4096, 4096)):
        bq, bk = _qv._block_sizes(batch, hq, hk, 64, 512, sq, sk, budget)
        assert batch * hq * bq * bk <= budget and batch * hk * bk * (64 + 512) <= budget
        assert batch * hq * bq * 512 <= budget


def test_causal_tiles_skip_the_key_blocks_nobody_sees(seed, monkeypatch):
    q, k, v, qv = inputs(1, 64, 64, 2, 2, 64, 256, F64)
    visited = []
    block = _qv.Rows.block

    def spy(self, j0, j1):
        if self.tensors[0].shape[1] == 64 and self.tensors[0] is k:
            visited.append((j0, j1))
        return block(self, j0, j1)

    monkeypatch.setattr(_qv.Rows, "block", spy)
    dense_math(q, k, v, qv, 0.1, True, (-1, -1), 0.0, 0, block_q=16, block_k=16)
    # query block m sees key blocks 0..m: 1 + 2 + 3 + 4 of the 16 pairs
    assert len(visited) == 10


def varlen_math_case(seed_lengths, hq=4, hk=2, d=64, dv=256, grad=False):
    """Packed float64 rows of sequences with (rows, keys) each, and their offsets."""
    lens_q = [a for a, _ in seed_lengths]
    lens_k = [b for _, b in seed_lengths]
    total_q, total_k = sum(lens_q), sum(lens_k)
    q = torch.randn(total_q, hq, d, dtype=F64, requires_grad=grad)
    qv = torch.randn(total_q, hq, dv, dtype=F64, requires_grad=grad)
    k = torch.randn(total_k, hk, d, dtype=F64, requires_grad=grad)
    v = torch.randn(total_k, hk, dv, dtype=F64, requires_grad=grad)
    cu_q = torch.tensor([0] + lens_q, dtype=I32).cumsum(0).to(I32)
    cu_k = torch.tensor([0] + lens_k, dtype=I32).cumsum(0).to(I32)
    return q, k, v, qv, cu_q, cu_k


def varlen_math(q, k, v, qv, cu_q, cu_k, scale, causal, window=(-1, -1), softcap=0.0, chunk=0):
    batch = cu_q.shape[0] - 1
    lens_q, lens_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    queries = _qv.Rows((q, qv), batch, int(lens_q.max()), hi=lens_q, start=cu_q[:-1])
    keys = _qv.Rows((k, v), batch, int(lens_k.max()), hi=lens_k, start=cu_k[:-1])
    padded, lse = _qv.attention(queries, keys, softmax_scale=scale,
                                window=(window[0], 0 if causal else window[1]), softcap=softcap,
                                chunk=chunk, block_q=8, block_k=16)
    return _qv.packed_result(padded, lse, cu_q[:-1], lens_q, q.shape[0], None, True)


# Sequences of their own lengths in one batch, one without keys and one without rows among them.
VARLEN = [(1, 339), (113, 203), (239, 1), (0, 17), (5, 0), (30, 30)]


@pytest.mark.parametrize(("causal", "window", "softcap", "chunk"), MASKS)
def test_math_of_packed_sequences_matches_the_reference(seed, causal, window, softcap, chunk):
    q, k, v, qv, cu_q, cu_k = varlen_math_case(VARLEN)
    out, lse = varlen_math(q, k, v, qv, cu_q, cu_k, 0.06, causal, window, softcap, chunk)
    for b in range(len(VARLEN)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref, ref_lse = reference(q[rq], k[rk], v[rk], qv[rq], 0.06, causal, window, softcap,
                                 chunk)
        assert_exact(out[rq], lse[:, rq], ref, ref_lse)


# --- gradients (autograd through the composite; FA3 has no qv backward) -------------------------


def reference_grads(q, k, v, qv, scale, weights, **mask):
    out, lse = reference(q, k, v, qv, scale, **mask)
    loss = (out * weights[0]).sum() + (torch.where(lse > NEG_INF, lse, 0.0) * weights[1]).sum()
    return torch.autograd.grad(loss, (q, k, v, qv))


@pytest.mark.parametrize(("sq", "sk", "causal", "window", "softcap"), [
    (113, 203, True, (-1, -1), 0.0), (37, 53, False, (9, 2), 3.0), (1, 339, False, (-1, -1), 0.0),
])
def test_math_gradients_match_float64_autograd_of_the_reference(seed, sq, sk, causal, window,
                                                                  softcap):
    q, k, v, qv = inputs(1, sq, sk, 4, 2, 32, 256, F64, grad=True)
    out, lse = dense_math(q, k, v, qv, 0.08, causal, window, softcap, 0)
    w_out, w_lse = torch.randn_like(out), torch.randn_like(lse)
    loss = (out * w_out).sum() + (torch.where(lse > NEG_INF, lse, 0.0) * w_lse).sum()
    grads = torch.autograd.grad(loss, (q, k, v, qv))
    refs = reference_grads(q[0], k[0], v[0], qv[0], 0.08, (w_out[0], w_lse[0]), causal=causal,
                           window=window, softcap=softcap)
    for name, g, r in zip(("q", "k", "v", "qv"), grads, refs):
        assert torch.allclose(g[0], r, rtol=0, atol=1e-9), name


def test_math_gradients_of_packed_sequences(seed):
    q, k, v, qv, cu_q, cu_k = varlen_math_case([(17, 40), (0, 5), (9, 9), (6, 0)], grad=True)
    out, lse = varlen_math(q, k, v, qv, cu_q, cu_k, 0.08, True)
    w_out, w_lse = torch.randn_like(out), torch.randn_like(lse)
    loss = (out * w_out).sum() + (torch.where(lse > NEG_INF, lse, 0.0) * w_lse).sum()
    grads = torch.autograd.grad(loss, (q, k, v, qv))
    expect = [torch.zeros_like(t) for t in (q, k, v, qv)]
    for b in range(4):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        parts = reference_grads(q[rq], k[rk], v[rk], qv[rq], 0.08,
                                (w_out[rq], w_lse[:, rq]), causal=True)
        for e, part, rows in zip(expect, parts, (rq, rk, rk, rq)):
            e[rows] += part
    for name, g, e in zip(("q", "k", "v", "qv"), grads, expect):
        assert torch.allclose(g, e, rtol=0, atol=1e-9), name


def test_gradcheck():
    torch.manual_seed(0)
    ts = [torch.randn(*s, dtype=F64, requires_grad=True)
          for s in ((1, 3, 2, 8), (1, 5, 1, 8), (1, 5, 1, 16), (1, 3, 2, 16))]

    def f(q, k, v, qv):
        return dense_math(q, k, v, qv, 0.3, True, (-1, -1), 2.0, 0, block_q=2, block_k=2)

    assert torch.autograd.gradcheck(f, ts)


def test_flash_attn_func_gradients_for_q_k_v_and_qv(seed):
    q, k, v, qv = inputs(2, 33, 47, 4, 2, 64, 256, BF16, grad=True)
    out = flash_attn_func(q, k, v, causal=True, qv=qv)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, qv), dout)
    scale = (64 + 256) ** -0.5
    for b in range(2):
        leaves = [t[b].detach().double().requires_grad_() for t in (q, k, v, qv)]
        low = [t[b].detach().requires_grad_() for t in (q, k, v, qv)]
        ref = torch.autograd.grad(reference(*leaves, scale, causal=True)[0], leaves,
                                  dout[b].double())
        ref_low = torch.autograd.grad(reference(*low, scale, causal=True, dtype=BF16)[0], low,
                                      dout[b])
        for name, g, r, r_low in zip(("q", "k", "v", "qv"), grads, ref, ref_low):
            err = (g[b].double() - r).abs().max().item()
            bound = 2 * (r_low.double() - r).abs().max().item()
            assert g[b].dtype == BF16 and err <= bound + 1e-4, (name, err, bound)


def test_kvcache_with_qv_has_no_backward(seed):
    q, _, _, qv = inputs(1, 1, 1, 4, 1, 64, 256)
    kc, vc = torch.randn(1, 8, 1, 64, dtype=BF16), torch.randn(1, 8, 1, 256, dtype=BF16)
    out = flash_attn_with_kvcache(q.requires_grad_(), kc, vc, qv=qv, cache_seqlens=5)
    with raises(UnsupportedError, "flash_attn_with_kvcache has no backward"):
        out.sum().backward()


# --- flash_attn_func -----------------------------------------------------------------------------


@pytest.mark.parametrize(("sq", "sk"), LENGTHS)
@pytest.mark.parametrize(("causal", "window", "softcap", "chunk"), MASKS)
def test_flash_attn_func(seed, sq, sk, causal, window, softcap, chunk):
    q, k, v, qv = inputs(2, sq, sk, 4, 2, 64, 512)
    out, lse = flash_attn_func(q, k, v, None, causal, qv, window_size=window, softcap=softcap,
                               attention_chunk=chunk, return_attn_probs=True)
    assert out.shape == (2, sq, 4, 512) and out.dtype == BF16 and lse.shape == (2, 4, sq)
    assert lse.dtype == torch.float32
    for b in range(2):
        judge(out[b], lse[b], q[b], k[b], v[b], qv[b], (64 + 512) ** -0.5, causal=causal,
              window=window, softcap=softcap, chunk=chunk)


@pytest.mark.parametrize(("d", "dv", "hq", "hk"), [(32, 256, 4, 4), (64, 256, 8, 1),
                                                   (8, 512, 2, 2), (64, 512, 6, 3)])
def test_flash_attn_func_head_dims_and_heads(seed, d, dv, hq, hk):
    q, k, v, qv = inputs(1, 113, 203, hq, hk, d, dv, torch.float16)
    out, lse = flash_attn_func(q, k, v, causal=True, qv=qv, return_attn_probs=True)
    judge(out[0], lse[0], q[0], k[0], v[0], qv[0], (d + dv) ** -0.5, causal=True)


def test_default_scale_is_one_over_sqrt_d_plus_dv(seed):
    q, k, v, qv = inputs(1, 17, 29, 4, 2, 64, 512)
    default = flash_attn_func(q, k, v, qv=qv, return_attn_probs=True)
    explicit = flash_attn_func(q, k, v, (64 + 512) ** -0.5, qv=qv, return_attn_probs=True)
    d_only = flash_attn_func(q, k, v, 64 ** -0.5, qv=qv, return_attn_probs=True)
    assert torch.equal(default[0], explicit[0]) and torch.equal(default[1], explicit[1])
    assert not torch.equal(default[1], d_only[1])
    judge(d_only[0][0], d_only[1][0], q[0], k[0], v[0], qv[0], 64 ** -0.5)  # passed through
    cu = torch.tensor([0, 17], dtype=I32)
    cuk = torch.tensor([0, 29], dtype=I32)
    varlen = flash_attn_varlen_func(q[0], k[0], v[0], cu, cuk, 17, 29, qv=qv[0],
                                    return_attn_probs=True)
    assert torch.equal(varlen[1], default[1][0])
    kvc = flash_attn_with_kvcache(q, k, v, qv=qv, return_softmax_lse=True)
    assert torch.equal(kvc[1], default[1])


def test_tiles_through_the_api(seed, monkeypatch):
    q, k, v, qv = inputs(2, 70, 90, 4, 2, 64, 256)
    whole = flash_attn_func(q, k, v, causal=True, qv=qv, window_size=(40, 3))
    monkeypatch.setattr(_qv, "BLOCK_ELEMENTS", 4096)  # many small tiles
    assert _qv._block_sizes(2, 4, 2, 64, 256, 70, 90, 4096) == (2, 3)
    tiled = flash_attn_func(q, k, v, causal=True, qv=qv, window_size=(40, 3))
    assert (tiled.float() - whole.float()).abs().max() <= 2 ** -7


def test_strided_inputs(seed):
    # only the last dim must be contiguous (FA3's rule for qv)
    qv = torch.randn(2, 40, 4, 512).to(BF16)
    qt = torch.randn(2, 4, 40, 64, dtype=BF16).transpose(1, 2)
    kv = torch.randn(2, 50, 2, 512 + 64, dtype=BF16)
    kt, vt = kv[..., 512:], kv[..., :512]  # vLLM's layout: k and v views of one latent row
    out, lse = flash_attn_func(qt, kt, vt, causal=True, qv=qv, return_attn_probs=True)
    for b in range(2):
        judge(out[b], lse[b], qt[b], kt[b], vt[b], qv[b], (64 + 512) ** -0.5, causal=True)


def test_torch_compile_traces_it(seed):
    q, k, v, qv = inputs(2, 9, 13, 4, 2, 64, 256)
    compiled = torch.compile(flash_attn_func, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v, causal=True, qv=qv)
    assert torch.equal(out, flash_attn_func(q, k, v, causal=True, qv=qv))


# --- flash_attn_varlen_func ----------------------------------------------------------------------


def packed(lengths, hq=4, hk=2, d=64, dv=512):
    lens_q, lens_k = [a for a, _ in lengths], [b for _, b in lengths]
    q, qv = torch.randn(sum(lens_q), hq, d).to(BF16), torch.randn(sum(lens_q), hq, dv).to(BF16)
    k, v = torch.randn(sum(lens_k), hk, d).to(BF16), torch.randn(sum(lens_k), hk, dv).to(BF16)
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(I32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(I32)
    return q, k, v, qv, cu_q, cu_k


@pytest.mark.parametrize(("causal", "window", "softcap", "chunk"), MASKS)
def test_flash_attn_varlen_func(seed, causal, window, softcap, chunk):
    q, k, v, qv, cu_q, cu_k = packed(VARLEN)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 239, 339, causal=causal, qv=qv,
                                      window_size=window, softcap=softcap, attention_chunk=chunk,
                                      return_attn_probs=True)
    assert out.shape == (q.shape[0], 4, 512) and lse.shape == (4, q.shape[0])
    for b in range(len(VARLEN)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        judge(out[rq], lse[:, rq], q[rq], k[rk], v[rk], qv[rq], (64 + 512) ** -0.5,
              causal=causal, window=window, softcap=softcap, chunk=chunk)


def test_flash_attn_varlen_func_seqused_gaps_and_out(seed):
    # spans with gaps, seqused shorter than the spans; out= keeps the rows outside every span
    q, k, v, qv, _, _ = packed([(60, 90)])
    cu_q, cu_k = torch.tensor([0, 10, 40, 60], dtype=I32), torch.tensor([0, 30, 50, 90],
                                                                        dtype=I32)
    used_q, used_k = torch.tensor([7, 30, 0], dtype=I32), torch.tensor([30, 11, 25], dtype=I32)
    out = torch.full((60, 4, 512), float("nan"), dtype=BF16)
    result, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 40, used_q, used_k,
                                         causal=True, qv=qv, return_attn_probs=True, out=out)
    assert result is out
    for b in range(3):
        rq = slice(int(cu_q[b]), int(cu_q[b]) + int(used_q[b]))
        rk = slice(int(cu_k[b]), int(cu_k[b]) + int(used_k[b]))
        judge(out[rq], lse[:, rq], q[rq], k[rk], v[rk], qv[rq], (64 + 512) ** -0.5, causal=True)
    assert torch.isnan(out[7:10]).all() and torch.isnan(out[40:60]).all()  # not written


def test_flash_attn_varlen_func_gradients(seed):
    q, k, v, qv, cu_q, cu_k = packed([(17, 40), (9, 9)], d=32, dv=256)
    leaves = [t.requires_grad_() for t in (q, k, v, qv)]
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 40, causal=True, qv=qv)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    scale = (32 + 256) ** -0.5
    for b in range(2):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        parts = [t[r].detach().double().requires_grad_() for t, r in zip(leaves, (rq, rk, rk, rq))]
        ref = torch.autograd.grad(reference(*parts, scale, causal=True)[0], parts,
                                  dout[rq].double())
        for name, g, r, rows in zip(("q", "k", "v", "qv"), grads, ref, (rq, rk, rk, rq)):
            err = (g[rows].double() - r).abs().max().item()
            assert err <= 2e-2 * max(r.abs().max().item(), 1.0), (name, err)


# --- flash_attn_with_kvcache ---------------------------------------------------------------------


def kv_reference(q, qv, k_cache, v_cache, k_new, v_new, seqlens, batch_idx, leftpad):
    """The caches after the append (new tensors) and each sequence's (out, lse) from them:
    entry batch_idx[b] of dense (batch_cache, seqlen, hk, d) caches; keys [leftpad[b],
    seqlens[b] + new) attended."""
    kc, vc = k_cache.clone(), v_cache.clone()
    new = 0 if k_new is None else k_new.shape[1]
    results = []
    for b in range(q.shape[0]):
        e, s, lo = batch_idx[b], seqlens[b], leftpad[b]
        if new:
            kc[e, s:s + new], vc[e, s:s + new] = k_new[b], v_new[b]
        results.append((q[b], kc[e, lo:s + new], vc[e, lo:s + new], qv[b]))
    return kc, vc, results


def kv_case(batch=3, sq=4, hq=4, hk=2, d=64, dv=512, capacity=64, new=3, batch_cache=5):
    q = torch.randn(batch, sq, hq, d).to(BF16)
    qv = torch.randn(batch, sq, hq, dv).to(BF16)
    kc = torch.randn(batch_cache, capacity, hk, d).to(BF16)
    vc = torch.randn(batch_cache, capacity, hk, dv).to(BF16)
    kn = torch.randn(batch, new, hk, d).to(BF16) if new else None
    vn = torch.randn(batch, new, hk, dv).to(BF16) if new else None
    return q, qv, kc, vc, kn, vn


def poison_unused(kc, vc, seqlens, batch_idx, leftpad, new):
    """NaN in every slot a sequence does not attend (before leftpad, past its keys)."""
    for b, e in enumerate(batch_idx):
        for c in (kc, vc):
            c[e, :leftpad[b]] = float("nan")
            c[e, seqlens[b] + new:] = float("nan")


def same_bytes(a, b):
    """Equal bytes (NaN included, which torch.equal never calls equal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize(("causal", "window", "chunk"), [(False, (-1, -1), 0), (True, (-1, -1), 0),
                                                         (False, (5, 2), 0), (True, (-1, -1), 8)])
def test_kvcache_append_batch_idx_leftpad(seed, causal, window, chunk):
    q, qv, kc, vc, kn, vn = kv_case()
    seqlens, batch_idx, leftpad = [10, 0, 40], [4, 0, 2], [3, 0, 17]
    poison_unused(kc, vc, seqlens, batch_idx, leftpad, 3)
    ref_k, ref_v, seqs = kv_reference(q, qv, kc, vc, kn, vn, seqlens, batch_idx, leftpad)
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, kn, vn, qv, cache_seqlens=torch.tensor(seqlens, dtype=I32),
        cache_batch_idx=torch.tensor(batch_idx, dtype=I32),
        cache_leftpad=torch.tensor(leftpad, dtype=I32), causal=causal, window_size=window,
        attention_chunk=chunk, return_softmax_lse=True)
    assert same_bytes(kc, ref_k) and same_bytes(vc, ref_v)  # the append, and nothing else
    assert out.shape == (3, 4, 4, 512) and lse.shape == (3, 4, 4)
    for b, (qb, kb, vb, qvb) in enumerate(seqs):
        judge(out[b], lse[b], qb, kb, vb, qvb, (64 + 512) ** -0.5, causal=causal, window=window,
              chunk=chunk)


def pool_from(kc, vc, page_size, table_width, seed_perm):
    """A paged pool holding the dense caches' entries (one table row each, pages in a random
    order, NaN in every slot the dense caches do not give and in spare pages), and its table
    (garbage past the pages used)."""
    batch, capacity = kc.shape[:2]
    pages_per_seq = -(-capacity // page_size)
    num_pages = batch * pages_per_seq + 3
    order = torch.randperm(num_pages, generator=seed_perm)[:batch * pages_per_seq]
    table = torch.full((batch, table_width), -7, dtype=I32)
    table[:, :pages_per_seq] = order.view(batch, pages_per_seq).to(I32)
    pools = []
    for c in (kc, vc):
        pool = torch.full((num_pages, page_size, *c.shape[2:]), float("nan"), dtype=c.dtype)
        for b in range(batch):
            for j in range(capacity):
                pool[table[b, j // page_size], j % page_size] = c[b, j]
        pools.append(pool)
    return pools[0], pools[1], table


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_kvcache_paged_with_nan_in_unused_pages(seed, page_size):
    q, qv, kc, vc, kn, vn = kv_case(batch=3, sq=2, capacity=64, batch_cache=3)
    seqlens, leftpad = [10, 0, 50], [2, 0, 33]
    poison_unused(kc, vc, seqlens, range(3), leftpad, 3)
    width = 64 // page_size + 2
    k_pool, v_pool, table = pool_from(kc, vc, page_size, width, torch.Generator().manual_seed(3))
    ref_k, ref_v, seqs = kv_reference(q, qv, kc, vc, kn, vn, seqlens, range(3), leftpad)
    expect_k, expect_v, _ = pool_from(ref_k, ref_v, page_size, width,
                                      torch.Generator().manual_seed(3))
    out, lse = flash_attn_with_kvcache(
        q, k_pool, v_pool, kn, vn, qv, cache_seqlens=torch.tensor(seqlens, dtype=I32),
        cache_leftpad=torch.tensor(leftpad, dtype=I32), page_table=table, causal=True,
        return_softmax_lse=True)
    assert not torch.isnan(out).any()
    assert same_bytes(k_pool, expect_k) and same_bytes(v_pool, expect_v)
    for b, (qb, kb, vb, qvb) in enumerate(seqs):
        judge(out[b], lse[b], qb, kb, vb, qvb, (64 + 512) ** -0.5, causal=True)


def test_kvcache_paged_with_batch_idx(seed):
    # cache_batch_idx picks the page table's rows
    q, qv, kc, vc, _, _ = kv_case(batch=2, sq=1, hq=8, hk=1, capacity=48, new=0, batch_cache=4)
    k_pool, v_pool, table = pool_from(kc, vc, 16, 3, torch.Generator().manual_seed(5))
    idx = torch.tensor([3, 1], dtype=I32)
    out = flash_attn_with_kvcache(q, k_pool, v_pool, qv=qv, cache_seqlens=torch.tensor(
        [48, 20], dtype=I32), cache_batch_idx=idx, page_table=table)
    dense = flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=torch.tensor(
        [48, 20], dtype=I32), cache_batch_idx=idx)
    assert torch.equal(out, dense)


def test_kvcache_varlen_queries_and_packed_new_keys(seed):
    _, _, kc, vc, _, _ = kv_case(batch=3, sq=1, capacity=40, new=0, batch_cache=3)
    lens_q, lens_new = [3, 0, 5], [2, 4, 0]
    qp, qvp = torch.randn(8, 4, 64).to(BF16), torch.randn(8, 4, 512).to(BF16)
    kn, vn = torch.randn(6, 2, 64).to(BF16), torch.randn(6, 2, 512).to(BF16)
    cu_q = torch.tensor([0, 3, 3, 8], dtype=I32)
    cu_new = torch.tensor([0, 2, 6, 6], dtype=I32)
    seqlens = [7, 30, 12]
    before_k = kc.clone()
    out, lse = flash_attn_with_kvcache(
        qp, kc, vc, kn, vn, qvp, cache_seqlens=torch.tensor(seqlens, dtype=I32),
        cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new, max_seqlen_q=5, causal=True,
        return_softmax_lse=True)
    assert out.shape == (8, 4, 512) and lse.shape == (4, 8)
    for b in range(3):
        s, n = seqlens[b], lens_new[b]
        k_new, v_new = kn[cu_new[b]:cu_new[b + 1]], vn[cu_new[b]:cu_new[b + 1]]
        assert torch.equal(kc[b, s:s + n], k_new) and torch.equal(vc[b, s:s + n], v_new)
        assert torch.equal(kc[b, :s], before_k[b, :s]) and torch.equal(kc[b, s + n:],
                                                                       before_k[b, s + n:])
        rq = slice(cu_q[b], cu_q[b + 1])
        judge(out[rq], lse[:, rq], qp[rq], kc[b, :s + n], vc[b, :s + n], qvp[rq],
              (64 + 512) ** -0.5, causal=True)
    assert lens_q == (cu_q[1:] - cu_q[:-1]).tolist()


def test_kvcache_num_splits_and_scheduler_metadata_change_nothing(seed):
    q, qv, kc, vc, _, _ = kv_case(batch=2, sq=1, hq=16, hk=1, capacity=300, new=0,
                                  batch_cache=2)
    lengths = torch.tensor([300, 123], dtype=I32)
    base = flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=lengths)
    for splits in (1, 3, 64, 0):
        assert torch.equal(flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=lengths,
                                                   num_splits=splits), base)
    meta = get_scheduler_metadata(2, 1, 300, 16, 1, 64, lengths, headdim_v=512, num_splits=4)
    assert meta.flash_hopper_schedule["head_dim_v"] == 512
    assert torch.equal(flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=lengths,
                                               scheduler_metadata=meta), base)
    other = get_scheduler_metadata(2, 1, 300, 16, 1, 64, lengths, headdim_v=256)
    with raises(ValueError, "scheduler_metadata: made for head_dim_v = 256, this call has 512"):
        flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=lengths,
                                scheduler_metadata=other)
    with raises(ValueError, "headdim_v: expected a head dim that is a multiple of 8 in [8, 512]",
                "got 520"):
        get_scheduler_metadata(2, 1, 300, 16, 1, 128, lengths, headdim_v=520)
    plain = get_scheduler_metadata(2, 1, 300, 16, 1, 64, lengths)
    with raises(ValueError, "scheduler_metadata: made for head_dim_v = 64, this call has 512"):
        flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=lengths,
                                scheduler_metadata=plain)


def test_kvcache_rotary_rotates_q_and_k_never_qv(seed):
    from flash_hopper.kvcache import _rotate

    q, qv, kc, vc, kn, vn = kv_case(batch=2, sq=3, capacity=32, new=2, batch_cache=2)
    cos, sin = torch.randn(40, 16).to(BF16), torch.randn(40, 16).to(BF16)
    seqlens = torch.tensor([5, 11], dtype=I32)
    kc2, vc2 = kc.clone(), vc.clone()
    out = flash_attn_with_kvcache(q, kc, vc, kn, vn, qv, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=seqlens, causal=True)
    pos = seqlens.long()[:, None] + torch.arange(3)[None]  # q at cache_seqlens + i (causal)
    q_rot = _rotate(q, cos, sin, pos)
    k_rot = _rotate(kn, cos, sin, seqlens.long()[:, None] + torch.arange(2)[None])
    expect = flash_attn_with_kvcache(q_rot, kc2, vc2, k_rot, vn, qv, cache_seqlens=seqlens,
                                     causal=True)
    assert torch.equal(out, expect) and same_bytes(kc, kc2) and same_bytes(vc, vc2)


def test_kvcache_sinks(seed):
    q, qv, kc, vc, _, _ = kv_case(batch=2, sq=2, capacity=20, new=0, batch_cache=2)
    sinks = torch.randn(4)
    out, lse = flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=15, sinks=sinks,
                                       return_softmax_lse=True)
    for b in range(2):
        ref, ref_lse = reference(q[b], kc[b, :15], vc[b, :15], qv[b], (64 + 512) ** -0.5)
        total = torch.logaddexp(ref_lse, sinks.double()[:, None])
        ref = ref * torch.exp(ref_lse - total).t()[..., None]
        assert (out[b].double() - ref).abs().max() <= 2e-2
        assert (lse[b].double() - total).abs().max() <= 1e-4


def test_kvcache_out(seed):
    q, qv, kc, vc, _, _ = kv_case(batch=2, sq=2, capacity=20, new=0, batch_cache=2)
    out = torch.full((2, 2, 4, 512), float("nan"), dtype=BF16)
    result = flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=9, out=out)
    assert result is out
    assert torch.equal(out, flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=9))
    with raises(ValueError, "out: expected shape (2, 2, 4, 512)"):
        flash_attn_with_kvcache(q, kc, vc, qv=qv, cache_seqlens=9, out=torch.empty_like(q))


def test_vllm_mla_decode_call(seed):
    # vLLM's FA3-MLA backend: one latent cache (num_blocks, block_size, 576) per layer, v its
    # first 512 columns and k its last 64 (views, row stride 576), varlen queries, block_table
    from flash_hopper import vllm

    buf = torch.randn(9, 16, 1, 576).to(BF16)
    buf[7:] = float("nan")  # pages no sequence uses
    k_view, v_view = buf[..., 512:], buf[..., :512]
    table = torch.tensor([[3, 0, 5, 6], [1, 4, 2, -1]], dtype=I32)
    seqused = torch.tensor([50, 40], dtype=I32)
    cu_q = torch.tensor([0, 1, 3], dtype=I32)
    q, qv = torch.randn(3, 8, 64).to(BF16), torch.randn(3, 8, 512).to(BF16)
    out, lse = vllm.flash_attn_varlen_func(q, k_view, v_view, 2, cu_q, 50, seqused_k=seqused,
                                           q_v=qv, softmax_scale=0.1, causal=True,
                                           block_table=table, return_softmax_lse=True)
    assert out.shape == (3, 8, 512) and lse.shape == (8, 3) and not torch.isnan(out).any()
    for b in range(2):
        pos = torch.arange(int(seqused[b]))
        rows = buf[table[b].long()[pos // 16], pos % 16]  # (keys, 1, 576)
        rq = slice(cu_q[b], cu_q[b + 1])
        judge(out[rq], lse[:, rq], q[rq], rows[..., 512:], rows[..., :512], qv[rq], 0.1,
              causal=True)


def test_empty_shapes_and_rows_without_keys():
    def t(*shape):
        return torch.randn(*shape).to(BF16)

    for b, sq, sk in ((0, 5, 7), (2, 0, 7), (2, 5, 0)):
        out, lse = flash_attn_func(t(b, sq, 4, 64), t(b, sk, 2, 64), t(b, sk, 2, 256),
                                   qv=t(b, sq, 4, 256), causal=True, return_attn_probs=True)
        assert out.shape == (b, sq, 4, 256) and lse.shape == (b, 4, sq)
        assert not out.any() and (lse == NEG_INF).all()
    none = torch.zeros(1, dtype=I32)
    out = flash_attn_varlen_func(t(0, 4, 64), t(0, 2, 64), t(0, 2, 256), none, none, 0, 0,
                                 qv=t(0, 4, 256))
    assert out.shape == (0, 4, 256)
    out, lse = flash_attn_with_kvcache(t(2, 1, 4, 64), t(2, 8, 2, 64), t(2, 8, 2, 256),
                                       qv=t(2, 1, 4, 256), cache_seqlens=0,
                                       return_softmax_lse=True)
    assert not out.any() and (lse == NEG_INF).all()


def test_unchecked_values_stay_within_the_tensors(seed, monkeypatch):
    # FLASH_HOPPER_CHECK_OFFSETS=0 (as under graph capture): bad values give wrong rows at
    # worst, never an index error, a read outside the tensors or NaN from unused slots
    monkeypatch.setenv("FLASH_HOPPER_CHECK_OFFSETS", "0")
    q, qv, kc, vc, kn, vn = kv_case(batch=2, sq=2, capacity=16, batch_cache=2)
    kc[:, 12:], vc[:, 12:] = float("nan"), float("nan")
    out = flash_attn_with_kvcache(q, kc, vc, kn, vn, qv,
                                  cache_seqlens=torch.tensor([9, -4], dtype=I32),
                                  cache_batch_idx=torch.tensor([5, -1], dtype=I32),
                                  cache_leftpad=torch.tensor([30, 2], dtype=I32), causal=True)
    assert out.shape == (2, 2, 4, 512) and not torch.isnan(out).any()
    k_pool, v_pool, table = pool_from(kc.nan_to_num(), vc.nan_to_num(), 4, 4,
                                      torch.Generator().manual_seed(2))
    table[0, 1] = 10**6
    out = flash_attn_with_kvcache(q, k_pool, v_pool, qv=qv, page_table=table,
                                  cache_seqlens=torch.tensor([40, 7], dtype=I32))
    assert not torch.isnan(out).any()
    qp, qvp = q.reshape(4, 4, 64), qv.reshape(4, 4, 512)
    bad = torch.tensor([0, 9, 2], dtype=I32)
    out = flash_attn_varlen_func(qp, kc[0].nan_to_num(), vc[0].nan_to_num(), bad, bad, 1, 1,
                                 qv=qvp)
    assert out.shape == (4, 4, 512) and not torch.isnan(out).any()


# --- refusals: each names the argument; a refused KV-cache call writes nothing -------------------


def dense_args(**change):
    q, k, v, qv = inputs(2, 5, 9, 4, 2, 64, 512)
    args = {"q": q, "k": k, "v": v, "qv": qv}
    for name, value in change.items():
        args[name] = value(args) if callable(value) else value
    return args


REFUSALS = [
    ({"qv": "x"}, TypeError, "qv: expected a torch.Tensor, got str"),
    ({"qv": lambda a: a["qv"][0]}, ValueError, "qv: expected rank 4"),
    ({"qv": lambda a: a["qv"].float()}, ValueError,
     "qv: expected dtype torch.bfloat16 (q's dtype) with qv, got torch.float32"),
    ({"qv": lambda a: a["qv"][:, :4]}, ValueError,
     "qv: expected shape (2, 5, 4, head_dim_v) (q's dims but the last), got (2, 4, 4, 512)"),
    ({"qv": lambda a: a["qv"][..., :256]}, ValueError,
     "qv: expected head_dim_v (last dim) == v's 512, got 256"),
    ({"qv": lambda a: a["qv"].transpose(1, 3).contiguous().transpose(1, 3)}, ValueError,
     "qv: must be contiguous in the last dimension"),
    ({"qv": lambda a: a["qv"].to("meta")}, ValueError,
     "qv: must be on q's device cpu, got device meta"),
    ({"q": lambda a: a["q"].to(torch.float8_e4m3fn), "k": lambda a: a["k"].to(
        torch.float8_e4m3fn), "v": lambda a: a["v"].to(torch.float8_e4m3fn)}, UnsupportedError,
     "qv: expected q of dtype torch.float16 or torch.bfloat16 with qv (FP8 q takes no qv"),
    ({"q": lambda a: a["q"].float(), "k": lambda a: a["k"].float(),
      "v": lambda a: a["v"].float(), "qv": lambda a: a["qv"].float()}, ValueError,
     "qv: expected q of dtype torch.float16 or torch.bfloat16 with qv,",
     "got q of dtype torch.float32"),
    ({"k": lambda a: a["k"].to(torch.float8_e4m3fn)}, ValueError,
     "k: expected dtype torch.bfloat16 (q's dtype) with qv, got torch.float8_e4m3fn"),
    ({"v": lambda a: a["v"].half()}, ValueError, "v: expected dtype torch.bfloat16"),
    ({"q": lambda a: torch.randn(2, 5, 4, 128).to(BF16), "k": lambda a: torch.randn(
        2, 9, 2, 128).to(BF16)}, ValueError,
     "q: expected head_dim a multiple of 8 in [8, 64] with qv", "got 128"),
    ({"q": lambda a: a["q"][..., :60], "k": lambda a: a["k"][..., :60]}, ValueError,
     "q: expected head_dim a multiple of 8 in [8, 64]"),
    ({"v": lambda a: a["v"][..., :128], "qv": lambda a: a["qv"][..., :128]}, ValueError,
     "v: expected head_dim_v a multiple of 8 in [256, 512] with qv", "got 128"),
    ({"v": lambda a: torch.randn(2, 9, 2, 520).to(BF16), "qv": lambda a: torch.randn(
        2, 5, 4, 520).to(BF16)}, ValueError, "v: expected head_dim_v", "got 520"),
    ({"v": lambda a: a["v"][..., :260], "qv": lambda a: a["qv"][..., :260]}, ValueError,
     "v: expected head_dim_v a multiple of 8"),
    ({"k": lambda a: a["k"][..., :32]}, ValueError, "k: expected head_dim (last dim) == q's 64"),
    ({"k": lambda a: a["k"][:, :, :1].expand(2, 9, 3, 64), "v": lambda a: a["v"][:, :, :1]
      .expand(2, 9, 3, 512)}, ValueError, "k: heads_kv must divide q's heads_q 4 (GQA/MQA)"),
    ({"v": lambda a: a["v"][:, :8]}, ValueError, "v: expected k's dims but the last"),
    ({"k": lambda a: a["k"][:1], "v": lambda a: a["v"][:1]}, ValueError,
     "k: expected batch (dim 0) == q's 2"),
    ({"softmax_scale": -1.0}, ValueError, "softmax_scale: expected a float > 0"),
    ({"softcap": -2.0}, ValueError, "softcap: expected a float >= 0"),
    ({"window_size": (1.5, 0)}, TypeError, "window_size[0]: expected an int"),
    ({"backend": "fa3"}, UnsupportedError, "backend: expected 'auto' with qv", "got 'fa3'"),
    ({"out_dtype": torch.float16}, ValueError, "out_dtype: expected None or torch.bfloat16"),
    ({"attention_chunk": -1}, ValueError, "attention_chunk: expected an int >= 0"),
    ({"num_splits": -1}, TypeError, "num_splits: expected an int >= 0"),
]


@pytest.mark.parametrize(("change", "exc", "fragments"), [(c, e, f) for c, e, *f in REFUSALS],
                         ids=[str(i) for i in range(len(REFUSALS))])
def test_flash_attn_func_refusals_name_the_argument(change, exc, fragments):
    names = ("q", "k", "v", "qv")
    tensors = {n: v for n, v in change.items() if n in names}
    args = dense_args(**tensors)
    extra = {n: v for n, v in change.items() if n not in names}
    with raises(exc, *fragments):
        flash_attn_func(args["q"], args["k"], args["v"], qv=args["qv"], **extra)


def test_flash_attn_varlen_func_refusals_name_the_argument():
    q, k, v, qv, cu_q, cu_k = packed([(5, 9), (3, 4)])
    call = flash_attn_varlen_func
    with raises(ValueError, "qv: expected a 3-D tensor (total_q, heads, head_dim)"):
        call(q, k, v, cu_q, cu_k, 5, 9, qv=qv[None])
    with raises(ValueError, "qv: expected shape (8, 4, head_dim_v)"):
        call(q, k, v, cu_q, cu_k, 5, 9, qv=qv[:7])
    with raises(ValueError, "cu_seqlens_k: expected 3 entries"):
        call(q, k, v, cu_q, cu_k[:2], 5, 9, qv=qv)
    with raises(ValueError, "cu_seqlens_q: expected non-decreasing offsets"):
        call(q, k, v, torch.tensor([0, 6, 5], dtype=I32), cu_k, 5, 9, qv=qv)
    with raises(ValueError, "seqused_k: expected 0 <= seqused_k[1] <= its span"):
        call(q, k, v, cu_q, cu_k, 5, 9, seqused_k=torch.tensor([2, 9], dtype=I32), qv=qv)
    with raises(ValueError, "out: expected shape (8, 4, 512)"):
        call(q, k, v, cu_q, cu_k, 5, 9, qv=qv, out=torch.empty_like(q))
    with raises(UnsupportedError, "out: expected None when q, k, v or qv requires grad"):
        call(q, k, v, cu_q, cu_k, 5, 9, qv=qv.clone().requires_grad_(), out=torch.empty(
            8, 4, 512, dtype=BF16))


def kv_refusals():
    """(kwargs change, exception, fragment) of flash_attn_with_kvcache calls with new keys."""
    return [
        ({"qv": lambda a: a["qv"].half()}, ValueError, "qv: expected dtype torch.bfloat16"),
        ({"qv": lambda a: a["qv"][..., :256]}, ValueError,
         "qv: expected head_dim_v (last dim) == v_cache's 512"),
        ({"v_cache": lambda a: a["v_cache"][..., :128], "qv": lambda a: a["qv"][..., :128],
          "v": lambda a: a["v"][..., :128]}, ValueError, "v_cache: expected head_dim_v"),
        ({"k_cache": lambda a: a["k_cache"][..., :48], "k": lambda a: a["k"][..., :48]},
         ValueError, "k_cache: expected head_dim (last dim) == q's 64"),
        ({"v_cache": lambda a: a["v_cache"][:, :30]}, ValueError,
         "v_cache: expected k_cache's dims but the last"),
        ({"v": lambda a: a["v"][..., :64]}, ValueError,
         "with batch 3, heads_kv 2, head_dim 512"),
        ({"k_cache": lambda a: a["k_cache"].to(torch.float8_e4m3fn),
          "v_cache": lambda a: a["v_cache"].to(torch.float8_e4m3fn),
          "k": lambda a: a["k"].to(torch.float8_e4m3fn),
          "v": lambda a: a["v"].to(torch.float8_e4m3fn)}, ValueError,
         "k_cache: expected dtype torch.bfloat16 (q's dtype) with qv"),
        ({"backend": "fa2"}, UnsupportedError, "backend: expected 'auto' with qv"),
        ({"cache_seqlens": lambda a: torch.tensor([10, 0, 62], dtype=I32)}, ValueError,
         "cache_seqlens: expected 0 <= cache_seqlens[2] <= seqlen_cache - its new keys"),
        ({"cache_leftpad": lambda a: torch.tensor([0, 0, 60], dtype=I32)}, ValueError,
         "cache_leftpad: expected 0 <= cache_leftpad[2]"),
        ({"out": lambda a: torch.empty(3, 4, 4, 64, dtype=BF16)}, ValueError,
         "out: expected shape (3, 4, 4, 512)"),
        ({"softcap": -1.0}, ValueError, "softcap: expected a float >= 0"),
        ({"rotary_cos": lambda a: torch.randn(70, 40), "rotary_sin": lambda a: torch.randn(
            70, 40)}, ValueError, "rotary_cos: expected rotary_dim"),
    ]


@pytest.mark.parametrize("paged", [False, True])
def test_a_refused_kvcache_call_changes_no_cache_byte(seed, paged):
    for change, exc, fragment in kv_refusals():
        q, qv, kc, vc, kn, vn = kv_case(batch=3, capacity=64, batch_cache=3)
        poison_unused(kc, vc, [10, 0, 40], range(3), [0, 0, 0], 3)
        args = {"q": q, "k_cache": kc, "v_cache": vc, "k": kn, "v": vn, "qv": qv,
                "cache_seqlens": torch.tensor([10, 0, 40], dtype=I32)}
        if paged:
            kp, vp, table = pool_from(kc, vc, 16, 4, torch.Generator().manual_seed(1))
            args.update(k_cache=kp, v_cache=vp, page_table=table)
            if "v_cache" in change and "qv" not in change:
                continue  # the dense cache's slicing: covered unpaged
        for name, value in change.items():
            args[name] = value(args) if callable(value) else value
        before = args["k_cache"].clone(), args["v_cache"].clone()
        with raises(exc, fragment):
            flash_attn_with_kvcache(**args)
        assert same_bytes(args["k_cache"], before[0]), fragment
        assert same_bytes(args["v_cache"], before[1]), fragment


# --- flash_attn_with_kvcache with a v_cache of its own head dim, no qv ---------------------------
# (FA3's d 192 / dv 128 and d <= 64 / dv <= 512): the composite path with no qv term, the scale
# 1 / sqrt(d); judged against the qv reference with qv = 0.


def own_v_case(batch=3, sq=4, hq=4, hk=2, d=192, dv=128, capacity=64, new=3, batch_cache=5):
    q, _, kc, vc, kn, vn = kv_case(batch, sq, hq, hk, d, dv, capacity, new, batch_cache)
    return q, kc, vc, kn, vn


@pytest.mark.parametrize(("d", "dv"), [(192, 128), (64, 256), (136, 104)])
@pytest.mark.parametrize(("causal", "window", "chunk"), [(False, (-1, -1), 0), (True, (-1, -1), 0),
                                                         (False, (5, 2), 0), (True, (-1, -1), 8)])
def test_kvcache_own_head_dim_v_append_batch_idx_leftpad(seed, d, dv, causal, window, chunk):
    q, kc, vc, kn, vn = own_v_case(d=d, dv=dv)
    seqlens, batch_idx, leftpad = [10, 0, 40], [4, 0, 2], [3, 0, 17]
    poison_unused(kc, vc, seqlens, batch_idx, leftpad, 3)
    zero_qv = torch.zeros(3, 4, 4, dv, dtype=BF16)
    ref_k, ref_v, seqs = kv_reference(q, zero_qv, kc, vc, kn, vn, seqlens, batch_idx, leftpad)
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=torch.tensor(seqlens, dtype=I32),
        cache_batch_idx=torch.tensor(batch_idx, dtype=I32),
        cache_leftpad=torch.tensor(leftpad, dtype=I32), causal=causal, window_size=window,
        attention_chunk=chunk, return_softmax_lse=True)
    assert same_bytes(kc, ref_k) and same_bytes(vc, ref_v)  # the append, and nothing else
    assert out.shape == (3, 4, 4, dv) and lse.shape == (3, 4, 4)
    for b, (qb, kb, vb, qvb) in enumerate(seqs):
        judge(out[b], lse[b], qb, kb, vb, qvb, d ** -0.5, causal=causal, window=window,
              chunk=chunk)


@pytest.mark.parametrize("page_size", [1, 16])
def test_kvcache_own_head_dim_v_paged_with_nan_in_unused_pages(seed, page_size):
    q, kc, vc, kn, vn = own_v_case(batch=3, sq=2, capacity=64, batch_cache=3)
    seqlens, leftpad = [10, 0, 50], [2, 0, 33]
    poison_unused(kc, vc, seqlens, range(3), leftpad, 3)
    width = 64 // page_size + 2
    k_pool, v_pool, table = pool_from(kc, vc, page_size, width, torch.Generator().manual_seed(3))
    zero_qv = torch.zeros(3, 2, 4, 128, dtype=BF16)
    ref_k, ref_v, seqs = kv_reference(q, zero_qv, kc, vc, kn, vn, seqlens, range(3), leftpad)
    expect_k, expect_v, _ = pool_from(ref_k, ref_v, page_size, width,
                                      torch.Generator().manual_seed(3))
    out, lse = flash_attn_with_kvcache(
        q, k_pool, v_pool, kn, vn, cache_seqlens=torch.tensor(seqlens, dtype=I32),
        cache_leftpad=torch.tensor(leftpad, dtype=I32), page_table=table, causal=True,
        softcap=3.0, return_softmax_lse=True)
    assert not torch.isnan(out).any()
    assert same_bytes(k_pool, expect_k) and same_bytes(v_pool, expect_v)
    for b, (qb, kb, vb, qvb) in enumerate(seqs):
        judge(out[b], lse[b], qb, kb, vb, qvb, 192 ** -0.5, causal=True, softcap=3.0)


def test_kvcache_own_head_dim_v_varlen_queries_rotary_sinks_out(seed):
    from flash_hopper.kvcache import _rotate

    _, kc, vc, _, _ = own_v_case(batch=2, sq=1, capacity=40, new=0, batch_cache=2)
    qp = torch.randn(5, 4, 192).to(BF16)
    kn, vn = torch.randn(3, 2, 192).to(BF16), torch.randn(3, 2, 128).to(BF16)
    cu_q, cu_new = torch.tensor([0, 2, 5], dtype=I32), torch.tensor([0, 1, 3], dtype=I32)
    seqlens = torch.tensor([7, 30], dtype=I32)
    cos, sin = torch.randn(48, 32).to(BF16), torch.randn(48, 32).to(BF16)
    sinks = torch.randn(4)
    kc2, vc2 = kc.clone(), vc.clone()
    out = torch.full((5, 4, 128), float("nan"), dtype=BF16)
    result, lse = flash_attn_with_kvcache(
        qp, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens,
        cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new, max_seqlen_q=3, causal=True, sinks=sinks,
        out=out, return_softmax_lse=True)
    assert result is out and lse.shape == (4, 5)
    for b in range(2):
        s, n = int(seqlens[b]), int(cu_new[b + 1] - cu_new[b])
        rows_new = slice(int(cu_new[b]), int(cu_new[b + 1]))
        k_rot = _rotate(kn[rows_new][None], cos, sin, s + torch.arange(n)[None])[0]
        kc2[b, s:s + n], vc2[b, s:s + n] = k_rot, vn[rows_new]
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        nq = rq.stop - rq.start
        q_rot = _rotate(qp[rq][None], cos, sin, s + torch.arange(nq)[None])[0]  # FA3's positions
        ref, ref_lse = reference(q_rot, kc2[b, :s + n], vc2[b, :s + n],
                                 torch.zeros(nq, 4, 128, dtype=BF16), 192 ** -0.5, causal=True)
        total = torch.logaddexp(ref_lse, sinks.double()[:, None])
        ref = ref * torch.exp(ref_lse - total).t()[..., None]
        assert (out[rq].double() - ref).abs().max() <= 2e-2
        assert (lse[:, rq].double() - total).abs().max() <= 1e-4
    assert same_bytes(kc, kc2) and same_bytes(vc, vc2)


def test_kvcache_own_head_dim_v_refusals_change_no_cache_byte(seed):
    q, kc, vc, kn, vn = own_v_case(batch=3, capacity=64, batch_cache=3)

    def to_fp8(name):
        return lambda a: a[name].to(torch.float8_e4m3fn)

    refusals = [
        ({"v": lambda a: a["v"][..., :64]}, ValueError, "with batch 3, heads_kv 2, head_dim 128"),
        ({"v_cache": lambda a: a["v_cache"][:, :30]}, ValueError,
         "v_cache: expected k_cache's dims but the last"),
        ({"v_cache": lambda a: torch.zeros(3, 64, 2, 132, dtype=BF16),
          "v": lambda a: torch.zeros(3, 3, 2, 132, dtype=BF16)}, ValueError,
         "v_cache: expected a head dim that is a multiple of 8 in [8, 512]", "got 132"),
        ({"v_cache": lambda a: torch.zeros(3, 64, 2, 520, dtype=BF16),
          "v": lambda a: torch.zeros(3, 3, 2, 520, dtype=BF16)}, ValueError,
         "v_cache: expected a head dim that is a multiple of 8 in [8, 512]", "got 520"),
        ({"out": lambda a: torch.empty(3, 4, 4, 192, dtype=BF16)}, ValueError,
         "out: expected shape (3, 4, 4, 128)"),
        ({"backend": "fa3"}, UnsupportedError,
         "backend: expected 'auto' with v_cache's own head dim"),
        ({name: to_fp8(name) for name in ("q", "k_cache", "v_cache", "k", "v")},
         UnsupportedError, ("v_cache: expected q of dtype torch.float16 or torch.bfloat16 with "
                            "v_cache's own head dim (FP8 inputs take a v_cache of k_cache's head "
                            "dim)")),
        ({"v_cache": lambda a: a["v_cache"].half(), "v": lambda a: a["v"].half()}, ValueError,
         "v_cache: expected q's dtype torch.bfloat16"),
        ({"softmax_scale": -1.0}, ValueError, "softmax_scale: expected a float > 0"),
    ]
    for change, exc, *fragments in refusals:
        kc_, vc_ = kc.clone(), vc.clone()
        args = {"q": q, "k_cache": kc_, "v_cache": vc_, "k": kn, "v": vn, "cache_seqlens": 10}
        for name, value in change.items():
            args[name] = value(args) if callable(value) else value
        before = args["k_cache"].clone(), args["v_cache"].clone()
        with raises(exc, *fragments):
            flash_attn_with_kvcache(**args)
        assert same_bytes(args["k_cache"], before[0]), fragments
        assert same_bytes(args["v_cache"], before[1]), fragments


def test_kvcache_own_head_dim_v_supports_and_metadata(seed):
    ok, reason = supports(kvcache=True, head_dim=192, head_dim_v=128, capability=(9, 0))
    assert ok and reason.startswith("composite: a v_cache of its own head dim (d 192 / dv 128)")
    ok, reason = supports(kvcache=True, head_dim=64, head_dim_v=512, page_size=16)
    assert ok and "flash_attn_with_kvcache, paged in place" in reason, reason
    ok, reason = supports(kvcache=True, dtype="e4m3", head_dim=192, head_dim_v=128)
    assert not ok and "FP8 inputs take a v_cache of k_cache's head dim" in reason, reason
    ok, reason = supports(kvcache=True, head_dim=192, head_dim_v=128, backend="fa2")
    assert not ok and reason.startswith("backend: expected 'auto'"), reason
    q, kc, vc, _, _ = own_v_case(batch=2, sq=1, hq=8, hk=2, capacity=48, new=0, batch_cache=2)
    lengths = torch.tensor([48, 20], dtype=I32)
    base = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths)
    meta = get_scheduler_metadata(2, 1, 48, 8, 2, 192, lengths, headdim_v=128, num_splits=3)
    assert meta.flash_hopper_schedule["head_dim_v"] == 128
    assert torch.equal(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths,
                                               scheduler_metadata=meta, num_splits=3), base)


# --- supports() and the API agree ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "e4m3", "bf16+e4m3"])
@pytest.mark.parametrize(("d", "dv"), [(64, 512), (32, 256), (128, 512), (64, 128), (60, 256),
                                       (64, 520), (8, 264)])
@pytest.mark.parametrize(("hq", "hk", "backend"), [(4, 2, "auto"), (4, 3, "auto"),
                                                   (4, 1, "fa3")])
def test_supports_answers_as_the_api(dtype, d, dv, hq, hk, backend):
    from flash_hopper import _tables

    if dtype in _tables.MIXED_DTYPES:
        q_dtype, kv_dtype = _tables.MIXED_DTYPES[dtype]
    else:
        q_dtype = kv_dtype = _tables.DTYPE_NAMES[dtype]
    q, qv = torch.zeros(1, 2, hq, d, dtype=q_dtype), torch.zeros(1, 2, hq, dv, dtype=q_dtype)
    k, v = torch.zeros(1, 3, hk, d, dtype=kv_dtype), torch.zeros(1, 3, hk, dv, dtype=kv_dtype)
    try:
        flash_attn_func(q, k, v, causal=True, qv=qv, backend=backend)
        runs, why = True, ""
    except (TypeError, ValueError, NotImplementedError) as exc:
        runs, why = False, str(exc)
    ok, reason = supports(qv=True, dtype=dtype, head_dim=d, head_dim_v=dv, heads_q=hq,
                          heads_kv=hk, seqlen_q=2, seqlen_k=3, causal=True, backend=backend)
    assert ok == runs, (reason, why)
    if ok:
        assert reason.startswith("composite:") and "composite path of torch GEMMs" in reason
        assert "not a fused kernel" in reason
    else:
        assert reason == why


def test_supports_for_the_kvcache_and_varlen_entry_points():
    ok, reason = supports(qv=True, head_dim=64, head_dim_v=512, heads_q=128, heads_kv=1,
                          kvcache=True, page_size=16, capability=(8, 0))
    assert ok and "flash_attn_with_kvcache, paged in place" in reason, reason
    ok, reason = supports(qv=True, head_dim=64, head_dim_v=512, varlen=True)
    assert ok and "flash_attn_varlen_func" in reason, reason
    ok, reason = supports(qv=True, head_dim=64, kvcache=True)  # head_dim_v defaults to 64
    assert not ok and reason.startswith("v_cache: expected head_dim_v"), reason
    ok, reason = supports(qv=True, head_dim=64, head_dim_v=512, page_size=16)
    assert not ok and reason.startswith("page_size: paged KV outside"), reason


@pytest.mark.gpu
def test_cuda_matches_cpu(seed):
    q, k, v, qv = inputs(2, 113, 203, 4, 2, 64, 512)
    cpu, cpu_lse = flash_attn_func(q, k, v, causal=True, qv=qv, return_attn_probs=True)
    gpu, gpu_lse = flash_attn_func(*(t.cuda() for t in (q, k, v)), causal=True, qv=qv.cuda(),
                                   return_attn_probs=True)
    assert (gpu.cpu().float() - cpu.float()).abs().max() <= 2 ** -6
    assert (gpu_lse.cpu() - cpu_lse).abs().max() <= 1e-4
    assert math.isfinite(float(gpu_lse.max()))
