"""FA3's attention_chunk on a GPU: flash_attn_func / flash_attn_qkvpacked_func against the
float64 reference's chunk mask (FA3's tolerance rule), forward (out, lse with -inf rows) and
backward, eager and torch.compile; the chunk sizes of FA3's tests (random in [1, 2 seqlen_k))."""

from __future__ import annotations

import pytest
import torch
from flash_hopper import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from flash_hopper.reference import attention_ref
from test_bwd_gpu import assert_fa3_rule, assert_grads_match, flash_grads, max_abs
from test_qkvpacked_gpu import require_training

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]

CASES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, chunk, mask)
    (2, 256, 256, 4, 2, 128, 64, {"causal": True}),
    (2, 300, 300, 4, 4, 64, 100, {}),
    (1, 113, 203, 6, 2, 128, 37, {"causal": True}),
    (2, 203, 113, 4, 1, 64, 50, {"window_size": (20, 5)}),
    (1, 1023, 1024, 2, 2, 128, 1, {}),
    (1, 128, 128, 2, 1, 64, 3, {"causal": True, "softcap": 15.0}),
    (3, 17, 700, 2, 2, 64, 640, {}),
]


def check_forward(q, k, v, chunk, mask):
    out, lse = flash_attn_func(q, k, v, attention_chunk=chunk, return_attn_probs=True, **mask)
    ref, lse_ref = attention_ref(q, k, v, attention_chunk=chunk, **mask)
    low, _ = attention_ref(q, k, v, attention_chunk=chunk, upcast=False, **mask)
    factor = 3 if mask.get("softcap") else 2
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_fa3_rule(out, ref, low, factor)
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (out.transpose(1, 2)[empty] == 0).all()
    assert max_abs(lse[~empty], lse_ref[~empty]) < 1e-3 * max(lse_ref[~empty].abs().max(), 1)
    return out


@pytest.mark.parametrize(("b", "sq", "sk", "hq", "hkv", "d", "chunk", "mask"), CASES)
def test_forward_and_backward(lib, seed, b, sq, sk, hq, hkv, d, chunk, mask):
    require_training(lib, torch.bfloat16, d)
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda")
               for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    if mask.get("softcap"):
        q = q * 4
    with torch.no_grad():
        check_forward(q, k, v, chunk, mask)
    dout = torch.randn(b, sq, hq, d, dtype=torch.bfloat16, device="cuda")
    grads = flash_grads(q, k, v, dout, attention_chunk=chunk, **mask)
    assert_grads_match(grads, q, k, v, dout, attention_chunk=chunk, **mask)


def test_fa3_test_call_forward_only_with_grad_inputs(lib, seed):
    # FA3's test_flash_attn_output: q / k / v require grad, the forward runs with a random chunk
    require_training(lib, torch.bfloat16, 128)
    q, k, v = (torch.randn(9, 239, 6, 128, dtype=torch.bfloat16, device="cuda").requires_grad_()
               for _ in range(3))
    for chunk in (1, 77, 238, 239, 478):
        check_forward(q, k, v, chunk, {"causal": True})


def test_qkvpacked_and_chunks_that_hide_nothing(lib, seed):
    require_training(lib, torch.bfloat16, 64)
    qkv = torch.randn(2, 96, 3, 4, 64, dtype=torch.bfloat16, device="cuda")
    want = flash_attn_func(*qkv.unbind(2), attention_chunk=32, causal=True)
    assert torch.equal(flash_attn_qkvpacked_func(qkv, causal=True, attention_chunk=32), want)
    plain = flash_attn_func(*qkv.unbind(2), causal=True)
    assert torch.equal(flash_attn_func(*qkv.unbind(2), causal=True, attention_chunk=96), plain)
    leaf = qkv.detach().requires_grad_()
    out = flash_attn_qkvpacked_func(leaf, causal=True, attention_chunk=32)
    (g,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
    assert_grads_match(g.unbind(2), *qkv.unbind(2), torch.ones_like(out), causal=True,
                       attention_chunk=32)


def test_torch_compile_equals_eager(lib, seed):
    require_training(lib, torch.bfloat16, 64)
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 130, 4, 64, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    dout = torch.randn_like(q)

    def step(q, k, v):
        return flash_attn_func(q, k, v, causal=True, attention_chunk=48, deterministic=True)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        results.append((out, torch.autograd.grad(out, leaves, dout)))
    (out_e, g_e), (out_c, g_c) = results
    # Not bitwise: the traced varlen op may route the short pieces to the decode kernel, which
    # the eager route (offsets built here) does not.
    torch.testing.assert_close(out_c, out_e, atol=1e-2, rtol=1e-2)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_varlen_with_unused_tails(lib, seed):
    require_training(lib, torch.bfloat16, 128)
    from flash_hopper import flash_attn_varlen_func

    lens_q, lens_k, used_q, used_k = [40, 0, 130, 7], [55, 9, 130, 300], [33, 0, 130, 7], \
        [50, 9, 129, 300]
    cu_q = torch.tensor([0, 40, 40, 170, 177], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 55, 64, 194, 494], dtype=torch.int32, device="cuda")
    sq_used = torch.tensor(used_q, dtype=torch.int32, device="cuda")
    sk_used = torch.tensor(used_k, dtype=torch.int32, device="cuda")
    q = torch.randn(177, 4, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(494, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    dout = torch.randn_like(q)
    mask = {"causal": True, "window_size": (40, -1)}
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_varlen_func(*leaves, cu_q, cu_k, 130, 300, sq_used, sk_used,
                                      attention_chunk=24, return_attn_probs=True, **mask)
    grads = torch.autograd.grad(out, leaves, dout)
    q0 = k0 = 0
    for sq, sk, uq, uk in zip(lens_q, lens_k, used_q, used_k):
        if uq:
            rows, keys = slice(q0, q0 + uq), slice(k0, k0 + uk)
            seq = [t[None] for t in (q[rows], k[keys], v[keys])]
            grads_seq = [grads[0][None, rows], grads[1][None, keys], grads[2][None, keys]]
            ref, lse_ref = attention_ref(*seq, attention_chunk=24, **mask)
            low, _ = attention_ref(*seq, attention_chunk=24, upcast=False, **mask)
            assert_fa3_rule(out[None, rows], ref, low)
            empty = torch.isneginf(lse_ref[0])
            assert torch.equal(torch.isneginf(lse[:, rows]), empty)
            assert_grads_match(grads_seq, *seq, dout[None, rows], attention_chunk=24, **mask)
        q0, k0 = q0 + sq, k0 + sk


def test_kvcache_with_leftpad_batch_index_and_new_keys(lib, seed):
    require_training(lib, torch.bfloat16, 128)
    from flash_hopper import flash_attn_with_kvcache
    from flash_hopper.reference import attention_kvcache_ref

    b, sq, cap, new, hq, hkv, d, chunk = 3, 37, 400, 5, 6, 2, 128, 53
    q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16, device="cuda")
    kn, vn = (torch.randn(b, new, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    seqlens = torch.tensor([300, 7, 180], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([20, 0, 179], dtype=torch.int32, device="cuda")
    rows = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    mask = {"causal": True, "window_size": (90, -1)}
    kc, vc = (torch.randn(5, cap, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    _, _, ref_k, ref_v = attention_kvcache_ref(q, kc, vc, kn, vn, seqlens, rows, leftpad, **mask)
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens,
                                       cache_batch_idx=rows, cache_leftpad=leftpad,
                                       attention_chunk=chunk, return_softmax_lse=True, **mask)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)  # the append
    for i in range(b):
        keys = slice(int(leftpad[i]), int(seqlens[i]) + new)  # counted from the left padding
        kk, vv = ref_k[int(rows[i])][None, keys], ref_v[int(rows[i])][None, keys]
        ref, lse_ref = attention_ref(q[i:i + 1], kk, vv, attention_chunk=chunk, **mask)
        low, _ = attention_ref(q[i:i + 1], kk, vv, attention_chunk=chunk, upcast=False, **mask)
        assert_fa3_rule(out[i:i + 1], ref, low, what=f"batch {i}: ")
        assert torch.equal(torch.isneginf(lse[i]), torch.isneginf(lse_ref[0])), i


def test_kvcache_paged_equals_its_dense_copy(lib, seed):
    require_training(lib, torch.bfloat16, 128)
    from flash_hopper import flash_attn_with_kvcache

    b, sq, page, hkv, d, chunk = 2, 3, 16, 1, 128, 20
    pages = torch.randperm(2 * 8, device="cuda").to(torch.int32).view(2, 8)
    kp, vp = (torch.randn(16, page, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    dense_k, dense_v = (t[pages.long()].reshape(b, 8 * page, hkv, d) for t in (kp, vp))
    q = torch.randn(b, sq, 4, d, dtype=torch.bfloat16, device="cuda")
    kn, vn = (torch.randn(b, sq, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    seqlens = torch.tensor([100, 61], dtype=torch.int32, device="cuda")
    want = flash_attn_with_kvcache(q, dense_k, dense_v, kn, vn, cache_seqlens=seqlens,
                                   causal=True, attention_chunk=chunk)
    got = flash_attn_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=seqlens, page_table=pages,
                                  causal=True, attention_chunk=chunk)
    assert torch.equal(got, want)
    assert torch.equal(kp[pages.long()].reshape(b, 8 * page, hkv, d), dense_k)  # the append


@pytest.mark.parametrize(("sq", "sk", "chunk", "mask"), [(256, 256, 64, {"causal": True}),
                                                         (113, 203, 37, {"causal": True}),
                                                         (203, 113, 50, {"window_size": (20, 5)})])
def test_fp8_chunks_against_the_dequantized_reference(lib, seed, sq, sk, chunk, mask):
    """e4m3 q / k / v with (batch, heads_kv) descales and a chunk: within three times the error
    the same FP8 call without the chunk makes against its own reference (the P rounding's; a
    chunk's rows average fewer keys, so their errors are larger), plus 1e-3, with sequence 1's
    descales three times sequence 0's (a piece taking another sequence's would be far off);
    varlen (each sequence its own descales) equals the dense call bit for bit."""
    from test_fp8_gpu import dequantize, make_fp8, require_fp8_kernel

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 forward runs on compute capability 9.0 only")
    require_fp8_kernel(lib, 128)
    b, hq, hkv = 2, 4, 2
    q, k, v = make_fp8(b, sq, sk, hq, hkv, 128)
    ds = [(torch.rand(1, hkv, device="cuda") + 0.5) * torch.tensor([[1.0], [3.0]], device="cuda")
          for _ in range(3)]
    deq = [dequantize(t, d).to(torch.bfloat16) for t, d in zip((q, k, v), ds)]
    scale = 128 ** -0.5
    kw = {"q_descale": ds[0], "k_descale": ds[1], "v_descale": ds[2], "softmax_scale": scale}
    out = flash_attn_func(q, k, v, attention_chunk=chunk, **kw, **mask)
    ref, _ = attention_ref(*deq, scale, attention_chunk=chunk, **mask)
    plain = flash_attn_func(q, k, v, **kw, **mask)
    plain_ref, _ = attention_ref(*deq, scale, **mask)
    err, bound = max_abs(out, ref), 3 * max_abs(plain, plain_ref) + 1e-3
    assert out.dtype == torch.bfloat16 and not out.isnan().any() and err <= bound, (err, bound)
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device="cuda")
    cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device="cuda")
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    varlen = flash_attn_varlen_func(*flat, cu_q, cu_k, sq, sk, attention_chunk=chunk, **kw,
                                    **mask)
    assert torch.equal(varlen.view(out.shape), out)
