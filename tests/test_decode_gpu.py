"""The decode kernel (kernels/decode/, docs/decode.md) through flash_attn_with_kvcache's "auto"
backend, against reference.attention_kvcache_ref.

Grid rationale: head dims 64 / 128 / 256 (one instantiation each), fp16 and bf16 (one MMA atom
each), GQA ratios 1 ... 16 (rows per tile 1 ... 16, and 32 with two query tokens: two row
blocks), splits 1 / the heuristic / more splits than key blocks (empty splits), lengths 0 / 1 /
one block / many blocks per sequence, masks (causal with several query tokens, windows),
softcap, sinks, left padding, cache_batch_idx, varlen queries; paged caches of page sizes 1, 16,
64, 256 with shuffled and shared pages, K / V interleaved in one buffer (vLLM), NaN in every slot
no sequence uses and garbage in unused table entries; a pool past 2^31 elements; CUDA graphs
replayed with new lengths. FA3's tolerance rule as in test_kvcache_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from flash_hopper import _decode, flash_attn_with_kvcache
from flash_hopper._lib import FhBackend, FhDtype

from tests._helpers import check_kvcache, kvcache_references, skip_without_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]

I32 = torch.int32


@pytest.fixture(autouse=True)
def _decode_kernel(lib):
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the decode kernel needs compute capability >= 8.0")


def reference(q, kc, vc, **kw):
    """(float64 out, lse, the input-dtype computation's out) of a call without new keys."""
    ref_out, ref_lse, _, _, low = kvcache_references(q, kc, vc, **kw)
    return ref_out, ref_lse, low


def dense_cache(b, sc, hk, d, filled, dtype, g, leftpad=None):
    kc, vc = (torch.randn(b, sc, hk, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    for i, n in enumerate(filled):
        lo = 0 if leftpad is None else leftpad[i]
        for c in (kc, vc):
            c[i, n:] = float("nan")
            c[i, :lo] = float("nan")
    return kc, vc


def run_count(fn):
    """How many decode kernels fn launched (the route is the kernel's, not the varlen path's)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "decode_kernel" in e.key)


def capture(fn):
    """(graph, fn's result) of fn captured once on a side stream."""
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        out = fn()
    torch.cuda.current_stream().wait_stream(s)
    return graph, out


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads_q", "heads_kv"), [(8, 8), (32, 8), (16, 1)])
@pytest.mark.parametrize("num_splits", [1, 0, 9])
def test_matches_the_reference(head_dim, dtype, heads_q, heads_kv, num_splits):
    b, sc = 5, 1100
    filled = [0, 1, 64, 333, 1100]
    g = torch.Generator(device="cuda").manual_seed(head_dim + heads_q + num_splits)
    q = torch.randn(b, 1, heads_q, head_dim, device="cuda", generator=g).to(dtype)
    kc, vc = dense_cache(b, sc, heads_kv, head_dim, filled, dtype, g)
    seqlens = torch.tensor(filled, dtype=I32, device="cuda")
    ref_out, ref_lse, low = reference(q, kc, vc, cache_seqlens=seqlens)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=num_splits,
                                       return_softmax_lse=True)
    check_kvcache(out, lse, ref_out, ref_lse, low)


def test_the_call_runs_on_the_decode_kernel(lib, monkeypatch):
    b, hq, hk, d = 2, 32, 8, 128
    q = torch.randn(b, 1, hq, d, device="cuda").bfloat16()
    kc, vc = (torch.randn(b, 4096, hk, d, device="cuda").bfloat16() for _ in range(2))
    seqlens = torch.tensor([4000, 17], dtype=I32, device="cuda")
    assert run_count(lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)) == 1
    pool_k, pool_v = kc.view(-1, 64, hk, d), vc.view(-1, 64, hk, d)
    table = torch.arange(pool_k.shape[0], dtype=I32, device="cuda").view(b, -1)
    assert run_count(lambda: flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=seqlens,
                                                     page_table=table)) == 1
    monkeypatch.setenv("FLASH_HOPPER_DECODE", "0")  # the varlen kernels instead
    if any(lib.has_fwd_kernel(be, FhDtype.BF16, d) for be in (FhBackend.FA2, FhBackend.FA3)):
        assert run_count(lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)) == 0


def test_split_heuristic_sees_the_paged_capacity(lib):
    """The plan of a paged call sees the table's capacity (max_pages x page_size), not one
    page: batch 1 splits paged as dense (a 16-bit cache: one CTA per SM; 8 row blocks; at most
    8192 / 256 = 32 splits)."""
    b, hq, hk, d = 1, 32, 8, 128
    q = torch.randn(b, 1, hq, d, device="cuda").bfloat16()
    kc, vc = (torch.randn(b, 8192, hk, d, device="cuda").bfloat16() for _ in range(2))
    seqlens = torch.tensor([8192], dtype=I32, device="cuda")
    table = torch.arange(8192 // 16, dtype=I32, device="cuda").view(1, -1)
    _decode._plans.clear()
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    flash_attn_with_kvcache(q, kc.view(-1, 16, hk, d), vc.view(-1, 16, hk, d),
                            cache_seqlens=seqlens, page_table=table)
    # the plan key's page-table entry follows (..., batch, seqlen_q): None for a dense cache
    splits = {key[12] is not None: _decode._plans.get(key).splits
              for key in _decode._plans.signatures()}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert splits == {False: min(sms // 8, 32), True: min(sms // 8, 32)}


@pytest.mark.parametrize(("seqlen_q", "causal", "window"), [
    (4, True, (-1, -1)), (3, False, (40, 0)), (2, False, (100, 7)), (16, True, (-1, -1)),
    (7, True, (30, -1))])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_masks_softcap_leftpad_batch_idx_sinks(seqlen_q, causal, window, num_splits):
    b, hq, hk, d, sc = 4, 16, 4, 128, 700
    filled = [700, 5, 300, 129]
    lead = [0, 2, 100, 128]
    idx = [3, 0, 2, 1]
    g = torch.Generator(device="cuda").manual_seed(seqlen_q + num_splits)
    q = torch.randn(b, seqlen_q, hq, d, device="cuda", generator=g).bfloat16()
    kc, vc = dense_cache(b, sc, hk, d, [filled[idx.index(i)] for i in range(b)], torch.bfloat16,
                         g, leftpad=[lead[idx.index(i)] for i in range(b)])
    seqlens = torch.tensor(filled, dtype=I32, device="cuda")
    kw = {"cache_seqlens": seqlens, "cache_leftpad": torch.tensor(lead, dtype=I32,
                                                                  device="cuda"),
          "cache_batch_idx": torch.tensor(idx, dtype=I32, device="cuda"), "causal": causal,
          "window_size": window, "softcap": 12.0,
          "sinks": torch.randn(hq, device="cuda", generator=g)}
    ref_out, ref_lse, low = reference(q, kc, vc, **kw)
    out, lse = flash_attn_with_kvcache(q, kc, vc, num_splits=num_splits,
                                       return_softmax_lse=True, **kw)
    check_kvcache(out, lse, ref_out, ref_lse, low)


def test_varlen_queries():
    hq, hk, d, sc = 8, 2, 64, 300
    lq = [3, 0, 1, 5]
    filled = [200, 50, 0, 300]
    g = torch.Generator(device="cuda").manual_seed(3)
    cu = torch.tensor([0, 3, 3, 4, 9], dtype=I32, device="cuda")
    q = torch.randn(9, hq, d, device="cuda", generator=g).bfloat16()
    kc, vc = dense_cache(4, sc, hk, d, filled, torch.bfloat16, g)
    seqlens = torch.tensor(filled, dtype=I32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, cu_seqlens_q=cu,
                                       max_seqlen_q=5, causal=True, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (hq, 9)
    start = 0
    for i, n in enumerate(lq):
        if n:
            qi = q[start:start + n][None]
            ref_out, ref_lse, low = reference(qi, kc[i:i + 1], vc[i:i + 1],
                                              cache_seqlens=seqlens[i:i + 1], causal=True)
            check_kvcache(out[start:start + n][None], lse[:, start:start + n][None], ref_out,
                          ref_lse, low)
        start += n


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize(("seqlen_q", "new", "causal", "num_splits"),
                         [(1, 1, True, 0), (3, 2, True, 3), (2, 0, False, 1)])
def test_paged_cache(page_size, seqlen_q, new, causal, num_splits):
    """A shuffled page table with a page shared by two sequences (a common prefix), K and V
    interleaved in one buffer (vLLM's strides), NaN in every unused slot, garbage in unused table
    entries; the new keys land in the pool."""
    b, hq, hk, d = 3, 8, 2, 128
    filled = [900, 0, 300]  # sequence 2 appends past the shared first page (page size <= 256)
    max_pages = -(-(920) // page_size)
    num_pages = b * max_pages + 3
    g = torch.Generator(device="cuda").manual_seed(page_size + 10 * seqlen_q)
    buf = torch.full((num_pages, page_size, hk, 2, d), float("nan"), device="cuda",
                     dtype=torch.bfloat16)
    kc, vc = buf[..., 0, :], buf[..., 1, :]
    table = torch.randperm(num_pages, device="cuda", generator=g)[:b * max_pages]
    table = table.view(b, max_pages).to(I32)
    table[2, 0] = table[0, 0]
    for i, n in enumerate(filled):
        pos = torch.arange(n, device="cuda")
        pos = pos[pos >= page_size] if i == 2 else pos  # the shared page holds sequence 0's keys
        page, slot = table[i].long()[pos // page_size], pos % page_size
        kc[page, slot] = torch.randn(len(pos), hk, d, device="cuda", generator=g).bfloat16()
        vc[page, slot] = torch.randn(len(pos), hk, d, device="cuda", generator=g).bfloat16()
    for i, n in enumerate(filled):
        table[i, -(-(n + new) // page_size):] = -12345
    q = torch.randn(b, seqlen_q, hq, d, device="cuda", generator=g).bfloat16()
    kn = vn = None
    if new:
        kn, vn = (torch.randn(b, new, hk, d, device="cuda", generator=g).bfloat16()
                  for _ in range(2))
    seqlens = torch.tensor(filled, dtype=I32, device="cuda")
    kw = {"cache_seqlens": seqlens, "page_table": table.clamp(min=0), "causal": causal}
    ref_out, ref_lse, _, _, low = kvcache_references(q, kc, vc, kn, vn, **kw)
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens,
                                       page_table=table, causal=causal, num_splits=num_splits,
                                       return_softmax_lse=True)
    check_kvcache(out, lse, ref_out, ref_lse, low)
    if new:
        for i, n in enumerate(filled):
            for j in range(new):
                page, slot = int(table[i, (n + j) // page_size]), (n + j) % page_size
                assert torch.equal(kc[page, slot], kn[i, j])
                assert torch.equal(vc[page, slot], vn[i, j])


def test_split_on_and_off_agree():
    b, hq, hk, d = 2, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(b, 1, hq, d, device="cuda", generator=g).bfloat16()
    kc, vc = (torch.randn(b, 20000, hk, d, device="cuda", generator=g).bfloat16()
              for _ in range(2))
    seqlens = torch.tensor([20000, 12345], dtype=I32, device="cuda")
    one, lse1 = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=1,
                                        return_softmax_lse=True)
    many, lse_n = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=37,
                                          return_softmax_lse=True)
    assert (one.float() - many.float()).abs().max().item() < 4e-3
    assert (lse1 - lse_n).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", ["bf16", "e4m3", "bf16+e4m3"])
@pytest.mark.parametrize("paged", [False, True])
def test_two_row_blocks_per_cta_equal_one(monkeypatch, dtype, paged):
    """8 query tokens of GQA 4 (32 rows, two row blocks): one CTA over both row blocks gives
    bit for bit the output and LSE of a CTA per row block (FLASH_HOPPER_DECODE_PAIR=0), given
    the same splits: each row's keys, MMAs and softmax are the same, only the loads are shared.
    A batch whose row blocks fill every CTA slot (FP8 caches pair only there)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    b, hq, hk, d, sc = sms // 8 + 1, 32, 8, 128, 256
    g = torch.Generator(device="cuda").manual_seed(17)
    q = torch.randn(b, 8, hq, d, device="cuda", generator=g).bfloat16()
    kc, vc = (torch.randn(b, sc, hk, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    lengths = torch.randint(1, sc + 1, (b,), generator=torch.Generator().manual_seed(3))
    kw = {"cache_seqlens": lengths.to(device="cuda", dtype=I32), "causal": True,
          "num_splits": 3, "return_softmax_lse": True}
    if dtype != "bf16":
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        kw |= {"k_descale": torch.full((b, hk), 0.5, device="cuda"),
               "v_descale": torch.full((b, hk), 2.0, device="cuda")}
    if dtype == "e4m3":
        q = q.to(torch.float8_e4m3fn)
    if paged:
        perm = torch.randperm(b * sc // 8, generator=torch.Generator().manual_seed(2)).cuda()
        kc, vc = (torch.empty_like(c.view(torch.uint8).view(-1, 8, hk, d * c.element_size()))
                  .index_copy_(0, perm, c.view(torch.uint8).view(-1, 8, hk, d * c.element_size()))
                  .view(c.dtype) for c in (kc, vc))
        kw["page_table"] = perm.view(b, sc // 8).to(I32)
    out2, lse2 = flash_attn_with_kvcache(q, kc, vc, **kw)
    monkeypatch.setenv("FLASH_HOPPER_DECODE_PAIR", "0")
    out1, lse1 = flash_attn_with_kvcache(q, kc, vc, **kw)
    assert torch.equal(out2, out1) and torch.equal(lse2, lse1)
    assert out1.float().abs().sum() > 0


def test_pool_past_two_to_the_31_elements():
    """Page offsets in 64 bits: the sequence's pages at the end of a pool of 2^31 + elements."""
    hk, d, ps = 1, 128, 16
    num_pages = (1 << 31) // (ps * hk * d) + 64
    try:
        kc = torch.zeros(num_pages, ps, hk, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 2^31-element pool")
    g = torch.Generator(device="cuda").manual_seed(7)
    table = torch.arange(num_pages - 32, num_pages, dtype=I32, device="cuda")[None]
    kc[num_pages - 32:] = torch.randn(32, ps, hk, d, device="cuda", generator=g).bfloat16()
    vc[num_pages - 32:] = torch.randn(32, ps, hk, d, device="cuda", generator=g).bfloat16()
    q = torch.randn(1, 1, 4, d, device="cuda", generator=g).bfloat16()
    seqlens = torch.tensor([500], dtype=I32, device="cuda")
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, page_table=table)
    dense_k = kc[num_pages - 32:].reshape(1, 32 * ps, hk, d)
    dense_v = vc[num_pages - 32:].reshape(1, 32 * ps, hk, d)
    ref_out, _, low = reference(q, dense_k, dense_v, cache_seqlens=seqlens)
    check_kvcache(out, None, ref_out, None, low)
    del kc, vc
    torch.cuda.empty_cache()


@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_replays_new_lengths(paged):
    """Captured once with split-KV on, replayed with other lengths."""
    b, hq, hk, sc, d, ps = 2, 32, 8, 8192, 128, 64
    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(b, 1, hq, d, device="cuda", generator=g).bfloat16()
    kc, vc = (torch.randn(b, sc, hk, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    kw = {}
    k_in, v_in = kc, vc
    if paged:
        k_in, v_in = kc.view(b * sc // ps, ps, hk, d), vc.view(b * sc // ps, ps, hk, d)
        kw["page_table"] = torch.arange(b * sc // ps, dtype=I32, device="cuda").view(b, -1)
    seqlens = torch.tensor([8000, 100], dtype=I32, device="cuda")
    flash_attn_with_kvcache(q, k_in, v_in, cache_seqlens=seqlens, **kw)  # warm-up
    graph, out = capture(lambda: flash_attn_with_kvcache(q, k_in, v_in, cache_seqlens=seqlens,
                                                         **kw))
    for lengths in ([1, 8192], [0, 3000], [8192, 8192]):
        seqlens.copy_(torch.tensor(lengths, dtype=I32))
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        ref_out, _, low = reference(q, kc, vc, cache_seqlens=seqlens)
        check_kvcache(out, None, ref_out, None, low)


def test_serves_refuses_what_the_kernel_does_not_serve():
    q = torch.randn(1, 33, 8, 128, device="cuda").bfloat16()  # 33 tokens x 4 heads per KV head
    kc = torch.randn(1, 64, 2, 128, device="cuda").bfloat16()
    assert _decode.serves(q[:, :1], kc, kc, None, batch=1, seqlen_q=1)
    assert not _decode.serves(q, kc, kc, None, batch=1, seqlen_q=33)  # 132 rows: past the bound
    assert not _decode.serves(q[:, :1, :, :96], kc[..., :96], kc[..., :96], None, batch=1,
                              seqlen_q=1)
    assert not _decode.serves(q[:, :1].half(), kc, kc, None, batch=1, seqlen_q=1)


@pytest.mark.parametrize("num_splits", [0, 4])
def test_scheduler_metadata_keeps_the_kernels_split_choice(num_splits):
    """get_scheduler_metadata once, then calls with it: bitwise the calls without it (num_splits
    = 0: the kernel's own shape-only heuristic, not the varlen path's) or with num_splits."""
    from flash_hopper import get_scheduler_metadata

    q = torch.randn(1, 1, 32, 128, device="cuda").bfloat16()
    kc, vc = (torch.randn(1, 8192, 8, 128, device="cuda").bfloat16() for _ in range(2))
    lengths = torch.tensor([8000], dtype=I32, device="cuda")
    meta = get_scheduler_metadata(1, 1, 8192, 32, 8, 128, lengths, num_splits=num_splits)
    for step in range(2):
        lengths += 50 * step
        a = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, scheduler_metadata=meta)
        b = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, num_splits=num_splits)
        assert torch.equal(a, b)


@pytest.mark.parametrize(("seqlen_q", "causal", "window"), [(1, True, (-1, -1)),
                                                            (4, True, (-1, -1)),
                                                            (2, False, (64, 8))])
def test_flash_attn_func_short_queries_on_the_decode_kernel(lib, monkeypatch, seqlen_q, causal,
                                                            window):
    """flash_attn_func's short queries run on the decode kernel (a dense K / V as full cache
    entries), with the FA path's results (FLASH_HOPPER_DECODE=kvcache: the FA path), and
    which_backend names the family that ran."""
    from flash_hopper import flash_attn_func, which_backend

    skip_without_kernel(lib, 128)  # the FA path's result is the reference

    q, k, v = short_query_inputs(seqlen_q)
    kw = {"causal": causal, "window_size": window, "softcap": 5.0}
    monkeypatch.setenv("FLASH_HOPPER_DECODE", "kvcache")
    want, want_lse = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert run_count(lambda: flash_attn_func(q, k, v, **kw)) == 0
    assert which_backend(q, k, v, **kw)[0] != "decode"
    monkeypatch.delenv("FLASH_HOPPER_DECODE")
    got, got_lse = flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    assert run_count(lambda: flash_attn_func(q, k, v, **kw)) == 1
    assert which_backend(q, k, v, **kw)[0] == "decode"
    assert (got.float() - want.float()).abs().max().item() < 2e-2
    assert (got_lse - want_lse).abs().max().item() < 1e-3


def short_query_inputs(seqlen_q):
    g = torch.Generator(device="cuda").manual_seed(seqlen_q)
    q = torch.randn(3, seqlen_q, 16, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(3, 3000, 4, 128, device="cuda", generator=g).bfloat16()
            for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(("seqlen_q", "causal", "window"), [(1, True, (-1, -1)),
                                                            (2, False, (64, 8))])
def test_flash_attn_func_short_queries_backward(lib, monkeypatch, seqlen_q, causal, window):
    """The gradients of flash_attn_func's short queries on the decode kernel (the backward takes
    its out and LSE) equal the FA path's."""
    from flash_hopper import flash_attn_func

    if not any(lib.has_bwd_kernel(be, FhDtype.BF16, 128) for be in (FhBackend.FA2, FhBackend.FA3)):
        pytest.skip("this build has no bf16 d128 backward kernel")
    q, k, v = short_query_inputs(seqlen_q)
    kw = {"causal": causal, "window_size": window, "softcap": 5.0}
    monkeypatch.delenv("FLASH_HOPPER_DECODE", raising=False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert run_count(lambda: flash_attn_func(*leaves, **kw)) == 1
    flash_attn_func(*leaves, **kw).float().square().sum().backward()
    monkeypatch.setenv("FLASH_HOPPER_DECODE", "kvcache")
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*ref_leaves, **kw).float().square().sum().backward()
    for a, b in zip(leaves, ref_leaves):
        assert (a.grad.float() - b.grad.float()).abs().max().item() <= (
            3e-2 * b.grad.float().abs().max().item() + 1e-3)


def test_captured_calls_replay_at_once_on_several_streams():
    """Split calls captured in two graphs, replayed at once on two streams, next to eager calls on
    a third: each owns its workspace (a captured call's for the graph's life) and its decode /
    combine pair, so every output equals the eager call's."""
    b, hq, hk, sc, d = 1, 32, 8, 8192, 128
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(b, 1, hq, d, device="cuda", generator=g).bfloat16()
    kc, vc = (torch.randn(b, sc, hk, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    seqlens = torch.tensor([8000], dtype=I32, device="cuda")

    def call():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=24)

    call()
    (graph_a, out_a), (graph_b, out_b) = capture(call), capture(call)
    want = call()
    streams = [torch.cuda.Stream() for _ in range(3)]
    for _ in range(10):
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(streams[0]):
            graph_a.replay()
        with torch.cuda.stream(streams[1]):
            graph_b.replay()
        with torch.cuda.stream(streams[2]):
            eager = call()
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        assert torch.equal(out_a, want) and torch.equal(out_b, want) and torch.equal(eager, want)


@pytest.mark.parametrize("paged", [False, True])
def test_a_captured_decode_step_is_the_decode_kernels_alone(paged):
    """After an eager call, a captured split call replays as the decode kernel and its combine
    kernel alone: no memset, no arange of offsets (the eagerly built ones) in the graph: each
    extra node cost a 1 x 8k step time (bench/PERFLOG.md "where a short decode call's
    time goes")."""
    b, hq, hk, sc, d, ps = 1, 32, 8, 8192, 128, 16
    q = torch.randn(b, 1, hq, d, device="cuda").bfloat16()
    kc, vc = (torch.randn(b, sc, hk, d, device="cuda").bfloat16() for _ in range(2))
    kw = {}
    if paged:
        kc, vc = kc.view(-1, ps, hk, d), vc.view(-1, ps, hk, d)
        kw["page_table"] = torch.arange(kc.shape[0], dtype=I32, device="cuda").view(b, -1)
    seqlens = torch.tensor([8000], dtype=I32, device="cuda")

    def call():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, **kw)

    call()
    torch.cuda.synchronize()
    graph, _ = capture(call)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(names) == 2, names
    assert "decode_kernel" in names[0] and "combine_kernel" in names[1], names


@pytest.mark.parametrize(("causal", "window", "softcap"), [(True, (-1, -1), 0.0),
                                                           (False, (-1, -1), 5.0),
                                                           (False, (30, 4), 0.0)])
@pytest.mark.parametrize("used", [False, True])
def test_varlen_short_queries_on_the_decode_kernel(lib, monkeypatch, causal, window, softcap,
                                                  used):
    """By default flash_attn_varlen_func's short queries run on the decode kernel
    (packed K / V as one cache entry, each sequence's span [cu_seqlens_k[b], + seqused_k[b] or to
    cu_seqlens_k[b + 1])) with the FA path's results: sequences with more queries than keys, one
    without keys, GQA 16 / 4."""
    from flash_hopper import flash_attn_varlen_func

    skip_without_kernel(lib, 128)  # the FA path's result is the reference

    g = torch.Generator(device="cuda").manual_seed(int(causal) + 2 * int(used))
    lens_q, lens_k = [1, 3, 2, 4], [500, 2, 0, 1300]
    cu_q = torch.tensor([0, 1, 4, 6, 10], dtype=I32, device="cuda")
    cu_k = torch.tensor([0, 500, 502, 502, 1802], dtype=I32, device="cuda")
    q = torch.randn(sum(lens_q), 16, 128, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(sum(lens_k), 4, 128, device="cuda", generator=g).bfloat16()
            for _ in range(2))
    kw = {"causal": causal, "window_size": window, "softcap": softcap,
          "return_attn_probs": True}
    if used:
        kw["seqused_k"] = torch.tensor([400, 2, 0, 1000], dtype=I32, device="cuda")

    def call():
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)

    monkeypatch.setenv("FLASH_HOPPER_DECODE", "kvcache")  # the FA path
    want, want_lse = call()
    assert run_count(call) == 0
    monkeypatch.delenv("FLASH_HOPPER_DECODE")
    got, got_lse = call()
    assert run_count(call) == 1
    assert (got.float() - want.float()).abs().max().item() < 2e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(got_lse))
    assert (got_lse[finite] - want_lse[finite]).abs().max().item() < 1e-3


# --- serving hazards: any index values stay inside the caller's tensors ---------------------------


def test_unchecked_varlen_offsets_write_nothing_outside_out(monkeypatch):
    """cu_seqlens_q out of order, past q and negative with the value check off (as under graph
    capture): the decode kernel clamps every offset to q's rows, so no row of the buffer around
    `out` changes (the FA paths: test_varlen_gpu.py's test of the same call)."""
    monkeypatch.setenv("FLASH_HOPPER_CHECK_OFFSETS", "0")
    from flash_hopper import flash_attn_varlen_func

    q = torch.randn(100, 2, 64, dtype=torch.bfloat16, device="cuda")
    buf = torch.full((300, 2, 64), 5.0, dtype=torch.bfloat16, device="cuda")
    out = buf[100:200]
    cu = torch.tensor([0, 90, 10, 5000, -7], dtype=I32, device="cuda")
    launches = run_count(lambda: flash_attn_varlen_func(q, q, q, cu, cu, 100, 100, out=out))
    # under compute-sanitizer (bench/gpu_check.sh sets the variable) CUPTI takes no second
    # subscriber: the profiler sees nothing, and the memory checks below are what is tested there
    if os.environ.get("FH_TEST_UNDER_SANITIZER") != "1":
        assert launches == 1
    assert (buf[:100] == 5.0).all() and (buf[200:] == 5.0).all()
    # and the LSE: its rows are q's, nothing past them
    _, lse = flash_attn_varlen_func(q, q, q, cu, cu, 100, 100, return_attn_probs=True)
    assert lse.shape == (2, 100)


def test_a_short_max_seqlen_q_hint_still_writes_every_row():
    """max_seqlen_q is a hint: cu_seqlens_q = [0, 3] with max_seqlen_q = 1 gives all 3 rows."""
    from flash_hopper import flash_attn_varlen_func

    g = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(3, 4, 64, device="cuda", generator=g).bfloat16()
    k, v = (torch.randn(40, 4, 64, device="cuda", generator=g).bfloat16() for _ in range(2))
    cu_q = torch.tensor([0, 3], dtype=I32, device="cuda")
    cu_k = torch.tensor([0, 40], dtype=I32, device="cuda")
    out = torch.full_like(q, float("nan"))
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 40, causal=True, out=out)
    ref_out, _, low = reference(q[None], k[None], v[None],
                                cache_seqlens=torch.tensor([40], dtype=I32, device="cuda"),
                                causal=True)
    check_kvcache(out[None], None, ref_out, None, low)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_an_unchecked_short_hint_leaves_no_row_uninitialized(monkeypatch, num_splits):
    """Unchecked (as under graph capture), the decode grid trusts max_seqlen_q: a sequence
    longer than it has rows no row block computes. They come back as a row without keys (out 0,
    LSE -inf), never what the buffers held (NaN here); the covered rows are computed."""
    monkeypatch.setenv("FLASH_HOPPER_CHECK_OFFSETS", "0")
    g = torch.Generator(device="cuda").manual_seed(9)
    lens = [5, 1, 3]  # hint 2: rows 2..4 of sequence 0 and row 2 of sequence 2 past it
    q = torch.randn(sum(lens), 8, 128, device="cuda", generator=g).bfloat16()
    kc, vc = (torch.randn(3, 64, 2, 128, device="cuda", generator=g).bfloat16()
              for _ in range(2))
    cu = torch.tensor([0, 5, 6, 9], dtype=I32, device="cuda")
    seqlens = torch.tensor([40, 17, 64], dtype=I32, device="cuda")
    out = torch.full_like(q, float("nan"))
    _, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, cu_seqlens_q=cu,
                                     max_seqlen_q=2, num_splits=num_splits, out=out,
                                     return_softmax_lse=True)
    past = torch.tensor([2, 3, 4, 8], device="cuda")
    covered = torch.tensor([0, 1, 5, 6, 7], device="cuda")
    assert (out[past] == 0).all()
    assert (lse[:, past] == float("-inf")).all()
    assert not out[covered].isnan().any() and not lse[:, covered].isnan().any()
    assert (out[covered].abs().amax(dim=(1, 2)) > 0).all()


@pytest.mark.parametrize(("window", "causal"), [((2**32, -1), True), ((-1, 2**31 - 1), False),
                                                ((2**40, 2**40), False), ((2**31, 0), False)])
def test_huge_windows_are_unbounded_not_wrapped(window, causal):
    """A window past the cache means no bound there, as on the FA path: 2^32 must not become a
    window of 0 (one key), 2^31 - 1 on the right must not overflow into an empty row."""
    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(2, 1, 8, 128, device="cuda", generator=g).bfloat16()
    kc, vc = dense_cache(2, 300, 2, 128, [300, 77], torch.bfloat16, g)
    seqlens = torch.tensor([300, 77], dtype=I32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=causal,
                                       window_size=window, return_softmax_lse=True)
    ref_out, ref_lse, low = reference(q, kc, vc, cache_seqlens=seqlens,
                                      causal=causal or window[1] == 0)
    check_kvcache(out, lse, ref_out, ref_lse, low)


@pytest.mark.parametrize(("limit", "head_dim", "decode"), [
    (101376, 128, True), (101376, 64, True), (101376, 256, False),  # sm_86 / sm_89 / sm_120
    (163 * 1024, 256, True), (163 * 1024, 128, True)])  # A100
def test_smaller_shared_memory_runs_fewer_stages_or_routes_away(monkeypatch, lib, limit,
                                                                head_dim, decode):
    """FLASH_HOPPER_DEBUG_SMEM_LIMIT shows the library a smaller GPU's shared memory: the decode
    kernel runs with the stages that fit, or (d256 on 99 KiB) the route leaves it before the
    cache is written, for the varlen kernels (on those GPUs FA-2's, whose tiles fit 99 KiB: run
    here with backend="fa2", as this H100 / H200 would otherwise pick FA-3); either way the new
    keys are appended once and the result is right."""
    monkeypatch.setenv("FLASH_HOPPER_DEBUG_SMEM_LIMIT", str(limit))
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    q = torch.randn(2, 2, 16, head_dim, device="cuda", generator=g).bfloat16()
    kc, vc = dense_cache(2, 400, 4, head_dim, [300, 41], torch.bfloat16, g)
    kn, vn = (torch.randn(2, 2, 4, head_dim, device="cuda", generator=g).bfloat16()
              for _ in range(2))
    seqlens = torch.tensor([300, 41], dtype=I32, device="cuda")
    ref_out, ref_lse, k1, v1, low = kvcache_references(q, kc, vc, kn, vn, cache_seqlens=seqlens,
                                                       causal=True)
    # the route, decided before the append
    assert _decode.serves(q, kc, vc, None, batch=2, seqlen_q=2) == decode
    backend = "auto"
    if not decode:
        if not lib.has_fwd_kernel(FhBackend.FA2, FhDtype.BF16, head_dim):
            pytest.skip(f"no FA-2 kernel for d{head_dim} in this build")
        backend = "fa2"
    calls = []
    real = _decode.forward
    monkeypatch.setattr(_decode, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True,
                                       return_softmax_lse=True, backend=backend)
    assert bool(calls) == decode
    check_kvcache(out, lse, ref_out, ref_lse, low)
    for got, want in ((kc, k1), (vc, v1)):
        for b, n in enumerate([302, 43]):
            assert torch.equal(got[b, :n].double(), want[b, :n])


def test_expanded_and_strided_index_tensors():
    """Beam search's expand()ed cache_batch_idx, a column of a per-layer sinks table: read by
    their values, not their raw memory."""
    g = torch.Generator(device="cuda").manual_seed(10)
    b, hq, hk, d = 4, 8, 2, 64
    q = torch.randn(b, 1, hq, d, device="cuda", generator=g).bfloat16()
    kc, vc = dense_cache(2, 200, hk, d, [150, 200], torch.bfloat16, g)
    idx = torch.ones(1, dtype=I32, device="cuda").expand(b)
    seqlens = torch.full((b,), 150, dtype=I32, device="cuda")[::1]
    layers = torch.randn(hq, 3, device="cuda", generator=g)
    kw = {"cache_seqlens": seqlens, "cache_batch_idx": idx, "sinks": layers[:, 1]}
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **kw)
    ref_out, ref_lse, low = reference(q, kc, vc, cache_seqlens=seqlens,
                                      cache_batch_idx=idx.contiguous(),
                                      sinks=layers[:, 1].contiguous())
    check_kvcache(out, lse, ref_out, ref_lse, low)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_no_keys_and_a_sink_of_minus_inf_give_zero(num_splits):
    q = torch.randn(2, 1, 4, 128, device="cuda").bfloat16()
    kc, vc = (torch.randn(2, 512, 2, 128, device="cuda").bfloat16() for _ in range(2))
    seqlens = torch.tensor([0, 300], dtype=I32, device="cuda")
    sinks = torch.tensor([float("-inf"), 0.5, float("-inf"), 1.0], device="cuda")
    assert run_count(lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                     sinks=sinks, num_splits=num_splits)) == 1
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, sinks=sinks,
                                       num_splits=num_splits, return_softmax_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[0] == 0).all() and lse[0, 0, 0] == float("-inf") and lse[0, 1, 0] == 0.5


@pytest.mark.parametrize("paged", [False, True])
def test_unchecked_bad_indices_stay_inside_the_caches(monkeypatch, paged):
    """cache_batch_idx past the cache (or the table), negative, with new keys and the value
    check off: the append and the kernel clamp them, nothing around the caches changes, no
    device assert (the process keeps working). compute-sanitizer runs this in gpu_check.sh."""
    monkeypatch.setenv("FLASH_HOPPER_CHECK_OFFSETS", "0")
    g = torch.Generator(device="cuda").manual_seed(11)
    hq, hk, d = 8, 2, 128
    q = torch.randn(2, 1, hq, d, device="cuda", generator=g).bfloat16()
    kn, vn = (torch.randn(2, 1, hk, d, device="cuda", generator=g).bfloat16() for _ in range(2))
    big_k, big_v = (torch.full((10, 64, hk, d), 5.0, device="cuda").bfloat16()
                    for _ in range(2))
    kc, vc = big_k[1:9], big_v[1:9]  # 8 entries (or pages of 64) inside a guarded buffer
    idx = torch.tensor([7, -3], dtype=I32, device="cuda") * (1000 if not paged else 1)
    kw = {"cache_seqlens": torch.tensor([10, 5000], dtype=I32, device="cuda"),
          "cache_batch_idx": idx}
    if paged:
        kw["page_table"] = torch.tensor([[0, 1], [2, -9], [99, 3], [4, 5]], dtype=I32,
                                        device="cuda")
    out = flash_attn_with_kvcache(q, kc, vc, kn, vn, **kw)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    for big in (big_k, big_v):
        assert (big[0] == 5.0).all() and (big[9] == 5.0).all()


def test_paged_cache_batch_idx_past_the_table_is_refused_before_the_append():
    hq, hk, d = 32, 8, 128
    q = torch.randn(2, 1, hq, d, device="cuda").bfloat16()
    kc, vc = (torch.randn(32, 16, hk, d, device="cuda").bfloat16() for _ in range(2))
    kn, vn = (torch.randn(2, 1, hk, d, device="cuda").bfloat16() for _ in range(2))
    table = torch.randperm(32, device="cuda")[:32].view(4, 8).to(I32)
    before = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match="cache_batch_idx"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn,
                                cache_seqlens=torch.tensor([10, 10], dtype=I32, device="cuda"),
                                cache_batch_idx=torch.tensor([0, 7], dtype=I32, device="cuda"),
                                page_table=table)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
