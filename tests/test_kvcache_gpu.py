"""flash_attn_with_kvcache on the GPU (the varlen-kernel route, docs/host.md "KV-cache routes": a
dense cache through the varlen kernels), both paths, against reference.attention_kvcache_ref.

FA3's rule: the kernel's max error at most twice that of the same computation in the input
dtype, plus a small absolute term. Every cache holds NaN past each sequence's keys (and before
its left padding): a kernel that reads one key outside them, or lets a masked key's V row into
P V (0 * NaN), fails with NaN in the output.
"""

from __future__ import annotations

import pytest
import torch
from flash_hopper import flash_attn_with_kvcache
from flash_hopper._lib import FhBackend, FhDtype
from flash_hopper.reference import attention_kvcache_ref

from tests._helpers import check_kvcache, kvcache_references, raises

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]

BF16 = torch.bfloat16
I32 = torch.int32
_BACKENDS = {"fa2": FhBackend.FA2, "fa3": FhBackend.FA3}


@pytest.fixture(params=["fa2", "fa3"])
def backend(request, lib) -> str:
    if request.param == "fa3" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fa3 needs compute capability 9.0")
    return request.param


def require(lib, backend, head_dim, dtype=FhDtype.BF16):
    if not lib.has_fwd_kernel(_BACKENDS[backend], dtype, head_dim):
        pytest.skip(f"this build has no {backend} kernel for head_dim {head_dim}")


def poisoned_cache(batch_cache, seqlen_cache, heads_kv, d, filled, leftpad=None, idx=None,
                   dtype=BF16, seed=0):
    """k / v caches of N(0, 1) keys at each entry's filled positions, NaN elsewhere."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kc, vc = (torch.randn(batch_cache, seqlen_cache, heads_kv, d, device="cuda", generator=g)
              .to(BF16) for _ in range(2))
    keep = torch.zeros(batch_cache, seqlen_cache, dtype=torch.bool, device="cuda")
    rows = list(range(len(filled))) if idx is None else idx
    for b, n in enumerate(filled):
        lo = 0 if leftpad is None else leftpad[b]
        keep[rows[b], lo:n] = True
    for c in (kc, vc):
        c[~keep] = float("nan")
    return kc.to(dtype), vc.to(dtype)  # NaN stays NaN in e4m3fn


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("seqlen_q", "new"), [(1, 0), (1, 1), (4, 4), (37, 0), (16, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_the_reference(lib, backend, head_dim, seqlen_q, new, causal):
    require(lib, backend, head_dim)
    b, hq, hk, sc = 5, 8, 2, 700
    filled = [0, 1, 130, 300, 700 - new]
    g = torch.Generator(device="cuda").manual_seed(head_dim + seqlen_q + new)
    q = torch.randn(b, seqlen_q, hq, head_dim, device="cuda", generator=g).to(BF16)
    kc, vc = poisoned_cache(b, sc, hk, head_dim, filled, seed=head_dim)
    kn = vn = None
    if new:
        kn, vn = (torch.randn(b, new, hk, head_dim, device="cuda", generator=g).to(BF16)
                  for _ in range(2))
    seqlens = torch.tensor(filled, dtype=I32, device="cuda")
    ref_out, ref_lse, _, _, low = kvcache_references(q, kc, vc, kn, vn, cache_seqlens=seqlens,
                                             causal=causal)
    want_k, want_v = kc.clone(), vc.clone()
    if new:
        for b_, n in enumerate(filled):
            want_k[b_, n:n + new], want_v[b_, n:n + new] = kn[b_], vn[b_]
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=causal,
                                       return_softmax_lse=True, backend=backend)
    assert out.shape == q.shape and lse.shape == (b, hq, seqlen_q)
    check_kvcache(out, lse, ref_out, ref_lse, low)
    # the new keys landed in place and nothing else changed (NaN slots compared as 7)
    for got, want in ((kc, want_k), (vc, want_v)):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_batch_idx_leftpad_window_softcap(lib, backend, head_dim):
    require(lib, backend, head_dim)
    b, bc, hq, hk, sc, sq, new = 4, 6, 6, 3, 300, 3, 2
    idx = [5, 0, 3, 2]
    filled = [100, 0, 298, 37]
    pad = [10, 0, 200, 39]  # sequence 3: every key (37 cached + 2 new) left-padded away
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    q = torch.randn(b, sq, hq, head_dim, device="cuda", generator=g).to(BF16)
    kc, vc = poisoned_cache(bc, sc, hk, head_dim, [n + new for n in filled],
                            leftpad=pad, idx=idx, seed=1)
    kn, vn = (torch.randn(b, new, hk, head_dim, device="cuda", generator=g).to(BF16)
              for _ in range(2))
    kw = {"cache_seqlens": torch.tensor(filled, dtype=I32, device="cuda"),
          "cache_batch_idx": torch.tensor(idx, dtype=I32, device="cuda"),
          "cache_leftpad": torch.tensor(pad, dtype=I32, device="cuda")}
    for mask in ({"causal": True}, {"window_size": (50, 0)}, {"window_size": (7, 3)},
                 {"softcap": 5.0, "causal": True}):
        k_in, v_in = kc.clone(), vc.clone()
        ref_out, ref_lse, _, _, low = kvcache_references(q, k_in, v_in, kn, vn, **kw, **mask)
        out, lse = flash_attn_with_kvcache(q, k_in, v_in, kn, vn, **kw, **mask,
                                           return_softmax_lse=True, backend=backend)
        check_kvcache(out, lse, ref_out, ref_lse, low)
        # sequence 3: every key left-padded away -> no keys: out 0, lse -inf
        assert (out[3] == 0).all() and torch.isneginf(lse[3]).all()
        # the untouched cache entries (1, 4) kept their bits
        for e in (1, 4):
            assert torch.equal(k_in[e].nan_to_num(7.0), kc[e].nan_to_num(7.0))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_queries_and_new_keys(lib, backend, head_dim):
    """q packed with cu_seqlens_q, new keys packed with cu_seqlens_k_new (FA3's varlen kvcache
    call), cache entries through cache_batch_idx: each sequence against the reference on it
    alone. Sequences without queries, without new keys, and without any key."""
    require(lib, backend, head_dim)
    lq, lnew = [3, 0, 17, 1, 5], [2, 1, 0, 4, 0]
    filled = [40, 10, 0, 255 - 4, 0]
    idx = [4, 2, 0, 5, 1]
    bc, sc, hq, hk = 6, 256, 8, 4
    g = torch.Generator(device="cuda").manual_seed(head_dim + 7)
    q = torch.randn(sum(lq), hq, head_dim, device="cuda", generator=g).to(BF16)
    kn, vn = (torch.randn(sum(lnew), hk, head_dim, device="cuda", generator=g).to(BF16)
              for _ in range(2))
    kc, vc = poisoned_cache(bc, sc, hk, head_dim, filled, idx=idx, seed=head_dim)
    kc0, vc0 = kc.clone(), vc.clone()
    cu = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=I32,
                                 device="cuda")
    cu_q, cu_new = cu(lq), cu(lnew)
    seqlens = torch.tensor(filled, dtype=I32, device="cuda")
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, kn, vn, cache_seqlens=seqlens, cache_batch_idx=torch.tensor(idx, dtype=I32,
                                                                              device="cuda"),
        cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new, max_seqlen_q=max(lq), causal=True,
        return_softmax_lse=True, backend=backend)
    assert out.shape == q.shape and lse.shape == (hq, sum(lq))
    sq, sn = cu_q.tolist(), cu_new.tolist()
    for b in range(len(lq)):
        e = idx[b]
        # the new keys are in the entry, nothing else of it changed
        want = kc0[e].clone()
        want[filled[b]:filled[b] + lnew[b]] = kn[sn[b]:sn[b + 1]]
        assert torch.equal(kc[e].nan_to_num(7.0), want.nan_to_num(7.0)), b
        if lq[b] == 0:
            continue
        qb = q[sq[b]:sq[b + 1]][None]
        knb, vnb = kn[sn[b]:sn[b + 1]][None], vn[sn[b]:sn[b + 1]][None]
        one = torch.tensor([filled[b]], dtype=I32, device="cuda")
        ref_out, ref_lse, _, _, low = kvcache_references(
            qb, kc0[e:e + 1], vc0[e:e + 1], knb if lnew[b] else None, vnb if lnew[b] else None,
            cache_seqlens=one, causal=True)
        check_kvcache(out[sq[b]:sq[b + 1]][None], lse[:, sq[b]:sq[b + 1]][None], ref_out,
                      ref_lse, low)


@pytest.mark.parametrize(("seqlen_q", "causal", "num_splits"), [
    (1, True, 0), (1, False, 5), (1, True, 1), (3, False, 0), (3, False, 4), (1, False, 64)])
@pytest.mark.parametrize(("heads_q", "heads_kv"), [(32, 8), (6, 1), (4, 4)])
def test_decode_packed_gqa_and_split_kv(lib, backend, seqlen_q, causal, num_splits, heads_q,
                                        heads_kv):
    """Unmasked rows (one token, or non-causal) take the packed-GQA path (a KV head's query heads
    as the rows of one sequence) and, with few tiles or num_splits > 1, the key splits merged by
    their LSEs: the same results as the reference, with leftpad, batch_idx, NaN past the keys,
    sequences without keys and a split count above some sequences' keys."""
    require(lib, backend, 128)
    b, bc, sc, d = 3, 4, 8192, 128
    filled = [8000, 0, 37]
    idx, pad = [2, 0, 3], [100, 0, 37]  # sequence 2: every key left-padded away
    g = torch.Generator(device="cuda").manual_seed(heads_q * 10 + seqlen_q + num_splits)
    q = torch.randn(b, seqlen_q, heads_q, d, device="cuda", generator=g).to(BF16)
    kc, vc = poisoned_cache(bc, sc, heads_kv, d, filled, leftpad=pad, idx=idx, seed=heads_q)
    kw = {"cache_seqlens": torch.tensor(filled, dtype=I32, device="cuda"),
          "cache_batch_idx": torch.tensor(idx, dtype=I32, device="cuda"),
          "cache_leftpad": torch.tensor(pad, dtype=I32, device="cuda"), "causal": causal}
    ref_out, ref_lse, _, _, low = kvcache_references(q, kc, vc, None, None, **kw)
    out, lse = flash_attn_with_kvcache(q, kc, vc, **kw, num_splits=num_splits,
                                       return_softmax_lse=True, backend=backend)
    check_kvcache(out, lse, ref_out, ref_lse, low)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    unpacked = flash_attn_with_kvcache(q, kc, vc, **kw, pack_gqa=False, num_splits=1,
                                       backend=backend)
    assert (unpacked.float() - out.float()).abs().max().item() <= 2e-2


def test_scheduler_metadata_carries_the_split_decision(lib, backend):
    """get_scheduler_metadata(num_splits=4) once, then calls with it: bitwise the calls with
    num_splits=4 (FA3's precompute_metadata path), for every step's new cache_seqlens."""
    from flash_hopper import get_scheduler_metadata

    require(lib, backend, 128)
    q = torch.randn(2, 1, 8, 128, device="cuda").to(BF16)
    kc, vc = (torch.randn(2, 4096, 2, 128, device="cuda").to(BF16) for _ in range(2))
    lengths = torch.tensor([4000, 17], dtype=I32, device="cuda")
    meta = get_scheduler_metadata(2, 1, 4096, 8, 2, 128, lengths, causal=True, num_splits=4)
    for step in range(3):
        lengths += step
        a = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=True,
                                    scheduler_metadata=meta, backend=backend)
        b = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=True, num_splits=4,
                                    backend=backend)
        assert torch.equal(a, b)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize(("causal", "varlen"), [(True, False), (False, False), (True, True)])
def test_rotary_matches_the_rotated_reference(lib, backend, interleaved, causal, varlen):
    """FA3's rotary semantics: the new keys rotated at positions cache_seqlens + i before they
    land in the cache, the queries at cache_seqlens + i (causal / local) or all at
    cache_seqlens (neither); the reference rotates by complex multiplication."""
    from tests.test_kvcache_validate import _complex_rotary

    require(lib, backend, 128)
    b, sq, new, hq, hk, d, sc, half = 3, 4, 4, 8, 2, 128, 300, 32
    filled = [0, 100, 250]
    g = torch.Generator(device="cuda").manual_seed(int(interleaved) + 2 * causal + 4 * varlen)
    q = torch.randn(b, sq, hq, d, device="cuda", generator=g).to(BF16)
    kn, vn = (torch.randn(b, new, hk, d, device="cuda", generator=g).to(BF16) for _ in range(2))
    kc, vc = poisoned_cache(b, sc, hk, d, filled, seed=5)
    theta = torch.rand(sc, half, device="cuda", generator=g, dtype=torch.float64) * 6.3
    cos, sin = theta.cos().to(BF16), theta.sin().to(BF16)
    seqlens = torch.tensor(filled, dtype=I32, device="cuda")
    base = seqlens.long()[:, None]
    k_pos = base + torch.arange(new, device="cuda")
    steps = torch.arange(sq, device="cuda") if causal else torch.zeros(sq, dtype=torch.long,
                                                                        device="cuda")
    q_pos = base + steps
    k_rot = _complex_rotary(kn, cos[k_pos], sin[k_pos], interleaved).to(BF16)
    q_rot = _complex_rotary(q, cos[q_pos], sin[q_pos], interleaved).to(BF16)
    ref_out, ref_lse, _, _, low = kvcache_references(q_rot, kc, vc, k_rot, vn, cache_seqlens=seqlens,
                                             causal=causal)
    kw = {"rotary_cos": cos, "rotary_sin": sin, "rotary_interleaved": interleaved,
          "cache_seqlens": seqlens, "causal": causal, "backend": backend}
    if varlen:
        cu = torch.arange(0, (b + 1) * sq, sq, dtype=I32, device="cuda")
        cu_new = torch.arange(0, (b + 1) * new, new, dtype=I32, device="cuda")
        out = flash_attn_with_kvcache(q.reshape(b * sq, hq, d), kc, vc,
                                      kn.reshape(b * new, hk, d), vn.reshape(b * new, hk, d),
                                      cu_seqlens_q=cu, cu_seqlens_k_new=cu_new, max_seqlen_q=sq,
                                      **kw).view(b, sq, hq, d)
    else:
        out = flash_attn_with_kvcache(q, kc, vc, kn, vn, **kw)
    check_kvcache(out, None, ref_out, ref_lse, low)
    for i, n in enumerate(filled):  # the cache holds the rotated keys (fp32 math, one rounding)
        err = (kc[i, n:n + new].double() - k_rot[i].double()).abs().max().item()
        assert err <= 2 ** -7 * k_rot[i].double().abs().max().item(), (i, err)


@pytest.mark.parametrize("page_size", [1, 16])
def test_rotary_with_a_paged_cache_off_the_decode_kernel(lib, backend, page_size):
    """A paged cache the decode kernel does not serve (64 query tokens) runs on its gathered copy:
    with rotary the pool gets the rotated keys, and out equals the dense cache's bit for bit."""
    require(lib, backend, 128)
    b, sq, new, hq, hk, d, sc = 2, 64, 3, 4, 2, 128, 256
    g = torch.Generator(device="cuda").manual_seed(page_size)
    q = torch.randn(b, sq, hq, d, device="cuda", generator=g).to(BF16)
    kn, vn = (torch.randn(b, new, hk, d, device="cuda", generator=g).to(BF16) for _ in range(2))
    kc, vc = poisoned_cache(b, sc, hk, d, [100, 200], seed=9)
    theta = torch.rand(sc, 32, device="cuda", generator=g, dtype=torch.float64) * 6.3
    per_seq = sc // page_size
    order = torch.randperm(b * per_seq + 5, device="cuda", generator=g)[:b * per_seq]
    table = order.view(b, per_seq).to(I32)
    pool_k = torch.full((b * per_seq + 5, page_size, hk, d), float("nan"), device="cuda",
                        dtype=BF16)
    pool_v = pool_k.clone()
    pool_k[table.long()] = kc.view(b, per_seq, page_size, hk, d)
    pool_v[table.long()] = vc.view(b, per_seq, page_size, hk, d)
    kw = {"rotary_cos": theta.cos().to(BF16), "rotary_sin": theta.sin().to(BF16),
          "cache_seqlens": torch.tensor([100, 200], dtype=I32, device="cuda"), "causal": True,
          "backend": backend}
    paged = flash_attn_with_kvcache(q, pool_k, pool_v, kn, vn, page_table=table, **kw)
    dense = flash_attn_with_kvcache(q, kc, vc, kn, vn, **kw)
    assert torch.equal(paged, dense) and not paged.isnan().any()
    for pool, cache in ((pool_k, kc), (pool_v, vc)):  # bit for bit, NaN included
        assert torch.equal(pool[table.long()].view(b, sc, hk, d).view(torch.int16),
                           cache.view(torch.int16))


@pytest.mark.parametrize(("seqlen_q", "num_splits"), [(1, 0), (1, 4), (3, 1)])
def test_sinks_match_the_reference(lib, backend, seqlen_q, num_splits):
    """A sink logit per query head (gpt-oss), on the packed / split decode path and the general
    one, rows without keys included (lse = sink, out 0)."""
    require(lib, backend, 128)
    b, hq, hk, d, sc = 3, 8, 2, 128, 3000
    filled = [2999, 0, 40]
    g = torch.Generator(device="cuda").manual_seed(seqlen_q * 10 + num_splits)
    q = torch.randn(b, seqlen_q, hq, d, device="cuda", generator=g).to(BF16)
    kc, vc = poisoned_cache(b, sc, hk, d, filled, seed=7)
    sinks = torch.randn(hq, device="cuda", generator=g) * 3
    kw = {"cache_seqlens": torch.tensor(filled, dtype=I32, device="cuda"), "causal": True}
    ref_out, ref_lse, _, _, low = kvcache_references(q, kc, vc, None, None, sinks=sinks, **kw)
    out, lse = flash_attn_with_kvcache(q, kc, vc, **kw, sinks=sinks, num_splits=num_splits,
                                       return_softmax_lse=True, backend=backend)
    check_kvcache(out, lse, ref_out, ref_lse, low)
    assert torch.equal(lse[1], sinks[:, None].expand(hq, seqlen_q)) and (out[1] == 0).all()


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize(("seqlen_q", "new", "causal"), [(1, 1, True), (3, 2, True), (2, 0, False)])
def test_paged_cache_matches_the_reference(lib, backend, page_size, seqlen_q, new, causal):
    """Paged caches (the page sizes servers use): a shuffled page table with a page shared between
    two sequences (prefix sharing), K and V interleaved in one buffer (vLLM's strides), NaN in
    every slot no sequence uses and garbage in unused table entries; the new keys land in the
    pool; results as the reference's paged semantics."""
    require(lib, backend, 128)
    b, hq, hk, d = 3, 8, 2, 128
    filled = [500, 0, 70]
    max_pages = -(-(520) // page_size)
    num_pages = b * max_pages + 3
    g = torch.Generator(device="cuda").manual_seed(page_size + 10 * seqlen_q)
    buf = torch.full((num_pages, page_size, hk, 2, d), float("nan"), device="cuda", dtype=BF16)
    kc, vc = buf[..., 0, :], buf[..., 1, :]  # strides (ps*H*2D, H*2D, 2D, 1)
    table = torch.randperm(num_pages, device="cuda", generator=g)[:b * max_pages]
    table = table.view(b, max_pages).to(I32)
    table[2, 0] = table[0, 0]  # sequences 0 and 2 share their first page (a common prefix)
    for i, n in enumerate(filled):
        for pos in range(n):
            page, slot = int(table[i, pos // page_size]), pos % page_size
            if not (i == 2 and pos < page_size):  # the shared page: sequence 0's keys
                kc[page, slot] = torch.randn(hk, d, device="cuda", generator=g).to(BF16)
                vc[page, slot] = torch.randn(hk, d, device="cuda", generator=g).to(BF16)
    used = [-(-(n + new) // page_size) for n in filled]
    for i, u in enumerate(used):  # unused entries: garbage the kernels must never follow
        table[i, u:] = -12345
    q = torch.randn(b, seqlen_q, hq, d, device="cuda", generator=g).to(BF16)
    kn = vn = None
    if new:
        kn, vn = (torch.randn(b, new, hk, d, device="cuda", generator=g).to(BF16)
                  for _ in range(2))
    seqlens = torch.tensor(filled, dtype=I32, device="cuda")
    safe = table.clamp(min=0)
    kw = {"cache_seqlens": seqlens, "page_table": safe, "causal": causal}
    ref_out, ref_lse, _, _, low = kvcache_references(q, kc, vc, kn, vn, **kw)
    out, lse = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens,
                                       page_table=table, causal=causal,
                                       return_softmax_lse=True, backend=backend)
    check_kvcache(out, lse, ref_out, ref_lse, low)
    if new:  # the new keys in the pool's pages
        for i, n in enumerate(filled):
            for j in range(new):
                page, slot = int(table[i, (n + j) // page_size]), (n + j) % page_size
                assert torch.equal(kc[page, slot], kn[i, j]) and torch.equal(vc[page, slot],
                                                                            vn[i, j])


def test_vllm_paged_and_sink_calls(lib):
    """vLLM's flash_attn_varlen_func: the paged call (block_table + seqused_k) equals
    flash_attn_with_kvcache's varlen paged call; s_aux on the packed call equals the kernel
    output with the sink applied from the reference's formula."""
    from flash_hopper import vllm as fh_vllm
    from flash_hopper.kvcache import apply_sinks

    if not any(lib.has_fwd_kernel(be, FhDtype.BF16, 128) for be in _BACKENDS.values()):
        pytest.skip("this build has no bf16 hdim-128 kernel")
    hq, hk, d, ps = 8, 2, 128, 16
    lq, lk = [3, 1], [40, 100]
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(sum(lq), hq, d, device="cuda", generator=g).to(BF16)
    pool_k, pool_v = (torch.randn(20, ps, hk, d, device="cuda", generator=g).to(BF16)
                      for _ in range(2))
    table = torch.randperm(20, device="cuda", generator=g)[:14].view(2, 7).to(I32)
    cu_q = torch.tensor([0, 3, 4], dtype=I32, device="cuda")
    used = torch.tensor(lk, dtype=I32, device="cuda")
    sinks = torch.randn(hq, device="cuda", generator=g)
    a = fh_vllm.flash_attn_varlen_func(q, pool_k, pool_v, 3, cu_q, 112, seqused_k=used,
                                       block_table=table, causal=True, s_aux=sinks)
    b = flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=used, page_table=table,
                                cu_seqlens_q=cu_q, max_seqlen_q=3, causal=True, sinks=sinks)
    assert torch.equal(a, b)
    k = torch.randn(140, hk, d, device="cuda", generator=g).to(BF16)
    cu_k = torch.tensor([0, 40, 140], dtype=I32, device="cuda")
    got = fh_vllm.flash_attn_varlen_func(q, k, k, 3, cu_q, 100, cu_seqlens_k=cu_k, s_aux=sinks)
    from flash_hopper import flash_attn_varlen_func

    plain, lse = flash_attn_varlen_func(q, k, k, cu_q, cu_k, 3, 100, return_attn_probs=True)
    want, _ = apply_sinks(plain, lse, sinks, 0)
    assert torch.equal(got, want)


def test_fp8_cache(lib):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FP8 runs on the FA-3 path (compute capability 9.0)")
    require(lib, "fa3", 128, FhDtype.E4M3)
    b, hq, hk, sc, d = 3, 8, 2, 500, 128
    filled = [1, 257, 500]
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(b, 2, hq, d, device="cuda", generator=g).to(torch.float8_e4m3fn)
    kc, vc = poisoned_cache(b, sc, hk, d, filled, dtype=torch.float8_e4m3fn, seed=3)
    qd, kd, vd = (torch.rand(b, hk, device="cuda", generator=g) + 0.5 for _ in range(3))
    seqlens = torch.tensor(filled, dtype=I32, device="cuda")
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True, q_descale=qd,
                                  k_descale=kd, v_descale=vd)
    assert out.dtype == BF16 and not out.isnan().any()
    g_ = hq // hk
    qq = q.double() * qd.repeat_interleave(g_, 1)[:, None, :, None].double()
    kk = kc.double().nan_to_num(0.0) * kd[:, None, :, None].double()
    vv = vc.double().nan_to_num(0.0) * vd[:, None, :, None].double()
    ref = attention_kvcache_ref(qq, kk, vv, cache_seqlens=seqlens, causal=True)[0]
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel <= 0.05, rel  # P in e4m3: ~2-3 % relative RMS (tests/test_fp8_gpu.py)
    # one token: packed GQA and 4 key splits, descales per (sequence, kv head) across the splits
    q1 = q[:, :1]
    out1 = flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=seqlens, q_descale=qd,
                                   k_descale=kd, v_descale=vd, num_splits=4)
    ref1 = attention_kvcache_ref(qq[:, :1], kk, vv, cache_seqlens=seqlens)[0]
    rel1 = ((out1.double() - ref1).norm() / ref1.norm()).item()
    assert rel1 <= 0.05, rel1


def test_out_and_int_seqlens(lib, backend):
    require(lib, backend, 64)
    q = torch.randn(2, 3, 4, 64, device="cuda").to(BF16)
    kc, vc = poisoned_cache(2, 100, 4, 64, [60, 60])
    out = torch.full_like(q, float("nan"))
    got = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=60, out=out, backend=backend)
    assert got is out and not out.isnan().any()
    assert torch.equal(out, flash_attn_with_kvcache(q, kc, vc, cache_seqlens=60, backend=backend))


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"cache_seqlens": [99, 0]}, ("cache_seqlens: expected 0 <= cache_seqlens[0] <= seqlen_cache "
                                  "- its new keys (100 - 2 = 98), got 99")),
    ({"cache_seqlens": [-1, 0]}, "cache_seqlens: expected 0 <= cache_seqlens[0]"),
    ({"cache_batch_idx": [0, 2]}, ("cache_batch_idx: expected 0 <= cache_batch_idx[1] < "
                                   "k_cache.shape[0] (2), got 2")),
    ({"cache_leftpad": [0, 13]}, ("cache_leftpad: expected 0 <= cache_leftpad[1] <= "
                                  "cache_seqlens[1] + its new keys (12), got 13")),
])
def test_bad_values_raise_before_the_cache_is_written(lib, kw, fragment):
    if not any(lib.has_fwd_kernel(b, FhDtype.BF16, 64) for b in _BACKENDS.values()):
        pytest.skip("this build has no bf16 hdim-64 kernel")
    q = torch.randn(2, 1, 4, 64, device="cuda").to(BF16)
    kc, vc = (torch.randn(2, 100, 2, 64, device="cuda").to(BF16) for _ in range(2))
    kn, vn = (torch.randn(2, 2, 2, 64, device="cuda").to(BF16) for _ in range(2))
    args = {"cache_seqlens": [10, 10]}
    args.update(kw)
    args = {k: torch.tensor(v, dtype=I32, device="cuda") for k, v in args.items()}
    before = kc.clone(), vc.clone()
    with raises(ValueError, fragment):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, **args)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_cuda_graph_replays_new_lengths(lib, backend):
    """A graph captured once (the values unchecked during capture) replays correctly with new
    cache_seqlens written into the same tensor: the decode loop of a server."""
    require(lib, backend, 128)
    b, hq, hk, sc, d = 4, 8, 2, 512, 128
    q = torch.randn(b, 1, hq, d, device="cuda").to(BF16)
    kc, vc = (torch.randn(b, sc, hk, d, device="cuda").to(BF16) for _ in range(2))
    kn, vn = (torch.randn(b, 1, hk, d, device="cuda").to(BF16) for _ in range(2))
    seqlens = torch.tensor([5, 100, 300, 510], dtype=I32, device="cuda")
    flash_attn_with_kvcache(q, kc.clone(), vc.clone(), kn, vn, cache_seqlens=seqlens,
                            causal=True, backend=backend)  # warm-up: plans cached
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True,
                                      backend=backend)
    torch.cuda.current_stream().wait_stream(s)
    for lengths in ([0, 1, 2, 3], [400, 7, 300, 64]):
        seqlens.copy_(torch.tensor(lengths, dtype=I32))
        k_before, v_before = kc.clone(), vc.clone()
        graph.replay()
        torch.cuda.synchronize()
        ref = attention_kvcache_ref(q.double(), k_before.double(), v_before.double(),
                                    kn.double(), vn.double(), cache_seqlens=seqlens,
                                    causal=True)[0]
        assert (out.double() - ref).abs().max().item() < 2e-2, lengths


def test_inputs_that_require_grad_run_forward_only(lib, backend):
    require(lib, backend, 64)
    q = torch.randn(1, 2, 4, 64, device="cuda").to(BF16).requires_grad_()
    kc, vc = (torch.randn(1, 50, 4, 64, device="cuda").to(BF16) for _ in range(2))
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=20, backend=backend)
    with raises(Exception, "flash_attn_with_kvcache has no backward"):
        out.sum().backward()
