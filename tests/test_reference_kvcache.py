"""attention_kvcache_ref: FA3's flash_attn_with_kvcache semantics in the
reference, checked against independent constructions on the CPU: a paged cache (any page size,
shuffled pages, NaN in every unused slot) equals the dense cache it was scattered from; appending
then attending equals attention over the explicit concatenation; cache_batch_idx and
cache_leftpad select rows and spans; sinks equal a softmax with an extra value-less logit."""

from __future__ import annotations

import math

import pytest
import torch
from flash_hopper.reference import attention_kvcache_ref, attention_ref

F64 = torch.float64
NAN = float("nan")


def dense_cache(batch, capacity, filled, hkv, d, seed=0):
    """A (batch, capacity, hkv, d) cache: positions < filled[b] random, NaN after them."""
    g = torch.Generator().manual_seed(seed)
    k = torch.full((batch, capacity, hkv, d), NAN, dtype=F64)
    v = torch.full((batch, capacity, hkv, d), NAN, dtype=F64)
    for b, n in enumerate(filled):
        k[b, :n] = torch.randn(n, hkv, d, dtype=F64, generator=g)
        v[b, :n] = torch.randn(n, hkv, d, dtype=F64, generator=g)
    return k, v


def paged(k, v, page_size, seed=0):
    """Scatter dense caches into a shuffled pool of pages (plus spare NaN pages): (k_pages,
    v_pages, page_table)."""
    batch, capacity = k.shape[:2]
    per_seq = math.ceil(capacity / page_size)
    pages = batch * per_seq + 3
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
    table = order[:batch * per_seq].view(batch, per_seq).to(torch.int32)
    kp = torch.full((pages, page_size, *k.shape[2:]), NAN, dtype=k.dtype)
    vp = torch.full_like(kp, NAN)
    for b in range(batch):
        for j in range(capacity):
            kp[table[b, j // page_size], j % page_size] = k[b, j]
            vp[table[b, j // page_size], j % page_size] = v[b, j]
    return kp, vp, table


def gather(pages, table, b, length):
    page_size = pages.shape[1]
    return torch.stack([pages[table[b, j // page_size], j % page_size] for j in range(length)])


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_cache_equals_the_dense_cache(page_size, causal):
    filled = [300, 0, 17]
    k, v = dense_cache(3, 320, filled, 2, 32)
    q = torch.randn(3, 5, 4, 32, dtype=F64)
    k_new, v_new = torch.randn(3, 5, 2, 32, dtype=F64), torch.randn(3, 5, 2, 32, dtype=F64)
    seqlens = torch.tensor(filled, dtype=torch.int32)
    want = attention_kvcache_ref(q, k, v, k_new, v_new, cache_seqlens=seqlens, causal=causal)
    kp, vp, table = paged(k, v, page_size, seed=page_size)
    got = attention_kvcache_ref(q, kp, vp, k_new, v_new, cache_seqlens=seqlens,
                                page_table=table, causal=causal)
    assert not got[0].isnan().any()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for b, n in enumerate(filled):  # the appended rows landed where the page table says
        assert torch.equal(gather(got[2], table, b, n + 5), want[2][b, :n + 5])
        assert torch.equal(gather(got[3], table, b, n + 5), want[3][b, :n + 5])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (7, 0)])
def test_append_then_attend_equals_the_concatenation(causal, window):
    filled = [40, 9]
    k, v = dense_cache(2, 64, filled, 1, 16, seed=1)
    q = torch.randn(2, 6, 3, 16, dtype=F64)
    k_new, v_new = torch.randn(2, 6, 1, 16, dtype=F64), torch.randn(2, 6, 1, 16, dtype=F64)
    out, lse, k2, v2 = attention_kvcache_ref(q, k, v, k_new, v_new, cache_seqlens=torch.tensor(
        filled, dtype=torch.int32), causal=causal, window_size=window, softcap=3.0)
    for b, n in enumerate(filled):
        keys = torch.cat([k[b, :n], k_new[b]])[None]
        values = torch.cat([v[b, :n], v_new[b]])[None]
        o, l = attention_ref(q[b:b + 1], keys, values, causal=causal, window_size=window,
                             softcap=3.0)
        assert torch.allclose(out[b], o[0], atol=1e-12) and torch.allclose(lse[b], l[0])
        assert torch.equal(k2[b, n:n + 6], k_new[b]) and torch.equal(v2[b, n:n + 6], v_new[b])
        assert torch.equal(k2[b, :n], k[b, :n])
    assert k[0, 40:].isnan().all() and v[1, 9:].isnan().all()  # the inputs are not written


def test_batch_index_and_left_padding_select_rows_and_spans():
    k, v = dense_cache(4, 50, [50, 50, 50, 50], 2, 8, seed=2)
    q = torch.randn(2, 3, 2, 8, dtype=F64)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    left = torch.tensor([10, 0], dtype=torch.int32)
    out, lse, _, _ = attention_kvcache_ref(q, k, v, cache_seqlens=torch.tensor([30, 50]),
                                           cache_batch_idx=idx, cache_leftpad=left, causal=True)
    for b, (row, lo, hi) in enumerate([(3, 10, 30), (1, 0, 50)]):
        o, l = attention_ref(q[b:b + 1], k[row:row + 1, lo:hi], v[row:row + 1, lo:hi],
                             causal=True)
        assert torch.allclose(out[b], o[0], atol=1e-12) and torch.allclose(lse[b], l[0])


def test_sinks_join_the_denominator_without_a_value():
    k, v = dense_cache(2, 20, [20, 0], 1, 8, seed=3)
    q = torch.randn(2, 4, 2, 8, dtype=F64)
    sinks = torch.tensor([0.5, -2.0], dtype=torch.float32)
    out, lse, _, _ = attention_kvcache_ref(q, k, v, cache_seqlens=torch.tensor([20, 0]),
                                           sinks=sinks)
    s = torch.einsum("qhd,khd->hqk", q[0], k[0].expand(-1, 2, -1)) / math.sqrt(8)
    logits = torch.cat([s, sinks.double().view(2, 1, 1).expand(2, 4, 1)], dim=-1)
    p = logits.softmax(-1)[..., :-1]
    want = torch.einsum("hqk,khd->qhd", p, v[0].expand(-1, 2, -1))
    assert torch.allclose(out[0], want, atol=1e-12)
    assert torch.allclose(lse[0], logits.logsumexp(-1), atol=1e-12)
    # no key: out 0, lse the sink itself
    assert (out[1] == 0).all() and torch.allclose(lse[1], sinks.double()[:, None].expand(2, 4))
