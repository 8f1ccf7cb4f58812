"""FP8 caches on the decode kernel (kernels/decode/decode_kernel.h, docs/decode.md) through
flash_attn_with_kvcache, against a float64 reference on the dequantized values.

Grid rationale: the three conventions the kernel serves (FA3's e4m3 q, k, v with all three
descales and a bf16 output; bf16 q against an e4m3 cache; fp16 q against an e5m2 cache, the mixed
mode's k / v descales and q's output dtype), head dims 64 / 128 / 256 (one instantiation each),
GQA 32 / 8 and 8 / 1 (4 and 8 valid rows per tile), dense caches and paged ones of page sizes 1 /
16 / 128 (a shuffled table), one split and several (v_descale reaches the split partials), NaN in
every cache slot and pool page no sequence uses. Then softcap with descales (q_descale * k_descale
scales tanh's argument), masks with several query tokens, the new keys appended in FP8, and that
the call ran on the decode kernel.

Tolerance: the kernel widens the FP8 values exactly and runs 16-bit MMAs, so its error is a
16-bit computation's: at most twice that of the same attention computed in the MMA dtype on the
dequantized inputs (rounded to the output dtype) plus 2e-3 (check_kvcache, FA3's rule).
"""

from __future__ import annotations

import pytest
import torch
from flash_hopper import flash_attn_with_kvcache
from flash_hopper.reference import attention_kvcache_ref

from tests._helpers import check_kvcache

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]

I32 = torch.int32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (q's dtype, the cache's, the descales given, o's dtype, the MMAs' dtype)
CONVENTIONS = {
    "e4m3": (E4M3, E4M3, "qkv", torch.bfloat16, torch.float16),
    "bf16+e4m3": (torch.bfloat16, E4M3, "kv", torch.bfloat16, torch.bfloat16),
    "fp16+e5m2": (torch.float16, E5M2, "kv", torch.float16, torch.float16),
}


@pytest.fixture(autouse=True)
def _decode_kernel(lib):
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the decode kernel needs compute capability >= 8.0")


def run_count(fn):
    """How many decode kernels fn launched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "decode_kernel" in e.key)


def make(convention, b, seqlen_q, hq, hk, d, sc, filled, g):
    """q, the dense FP8 caches (NaN past each sequence's keys) and the descales (batch, hk)."""
    q_dtype, kv_dtype, given, _, _ = CONVENTIONS[convention]
    q = torch.randn(b, seqlen_q, hq, d, device="cuda", generator=g).to(q_dtype)
    kc, vc = (torch.randn(b, sc, hk, d, device="cuda", generator=g) for _ in range(2))
    for i, n in enumerate(filled):
        kc[i, n:] = float("nan")
        vc[i, n:] = float("nan")
    kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)  # NaN stays NaN in e4m3fn and e5m2
    descales = {f"{n}_descale": torch.rand(b, hk, device="cuda", generator=g) + 0.5
                for n in given}
    return q, kc, vc, descales


def references(convention, q, kc, vc, descales, **kw):
    """(float64 out, lse, the MMA-dtype computation's out in o's dtype) on the dequantized
    values: q * q_descale (its kv head's), k * k_descale, v * v_descale; NaN slots as 0."""
    _, _, _, out_dtype, mma = CONVENTIONS[convention]
    group = q.shape[2] // kc.shape[2]
    ones = torch.ones(q.shape[0], kc.shape[2], device="cuda")
    qd = descales.get("q_descale", ones).repeat_interleave(group, 1)[:, None, :, None]
    kd = descales.get("k_descale", ones)[:, None, :, None]
    vd = descales.get("v_descale", ones)[:, None, :, None]
    qq = q.double() * qd.double()
    kk = kc.double().nan_to_num(0.0) * kd.double()
    vv = vc.double().nan_to_num(0.0) * vd.double()
    ref_out, ref_lse = attention_kvcache_ref(qq, kk, vv, **kw)[:2]
    low = attention_kvcache_ref(qq.to(mma), kk.to(mma), vv.to(mma), upcast=False, **kw)[0]
    return ref_out, ref_lse, low.to(out_dtype)


def paged(kc, vc, page_size, g):
    """The dense caches as a pool of pages behind a shuffled table (b, max_pages); the pool's
    pages no sequence uses hold NaN."""
    b, sc, hk, d = kc.shape
    max_pages = -(-sc // page_size)
    num_pages = b * max_pages + 5
    table = torch.randperm(num_pages, device="cuda", generator=g)[:b * max_pages]
    table = table.view(b, max_pages).to(I32)
    pools = []
    for c in (kc, vc):  # built in fp32 (exact for FP8 values and NaN), then the cache's dtype
        pool = torch.full((num_pages, page_size, hk, d), float("nan"), device="cuda")
        padded = torch.full((b, max_pages * page_size, hk, d), float("nan"), device="cuda")
        padded[:, :sc] = c.float()
        pool[table.long()] = padded.view(b, max_pages, page_size, hk, d)
        pools.append(pool.to(c.dtype))
    return pools[0], pools[1], table


@pytest.mark.parametrize("convention", list(CONVENTIONS))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("heads_q", "heads_kv"), [(32, 8), (8, 1)])
@pytest.mark.parametrize("page_size", [None, 1, 16, 128])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_matches_the_reference(convention, head_dim, heads_q, heads_kv, page_size, num_splits):
    b, sc = 4, 700
    filled = [1, 64, 333, 700]
    g = torch.Generator(device="cuda").manual_seed(head_dim + heads_q + (page_size or 0))
    q, kc, vc, descales = make(convention, b, 1, heads_q, heads_kv, head_dim, sc, filled, g)
    seqlens = torch.tensor(filled, dtype=I32, device="cuda")
    ref_out, ref_lse, low = references(convention, q, kc, vc, descales, cache_seqlens=seqlens)
    kw = {}
    if page_size is not None:
        kc, vc, kw["page_table"] = paged(kc, vc, page_size, g)
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=num_splits,
                                       return_softmax_lse=True, **descales, **kw)
    assert out.dtype == CONVENTIONS[convention][3]
    check_kvcache(out, lse, ref_out, ref_lse, low)


@pytest.mark.parametrize("convention", list(CONVENTIONS))
@pytest.mark.parametrize(("seqlen_q", "causal", "window", "softcap"), [
    (1, False, (-1, -1), 15.0), (4, True, (-1, -1), 0.0), (3, False, (50, 0), 8.0),
    (2, True, (-1, -1), 5.0), (1, False, (40, 0), 0.0), (8, True, (-1, -1), 0.0),
    (7, False, (50, 3), 6.0)])
@pytest.mark.parametrize("num_splits", [1, 5])
def test_softcap_and_masks_with_descales(convention, seqlen_q, causal, window, softcap,
                                         num_splits):
    b, hq, hk, d, sc = 3, 16, 4, 128, 600
    filled = [600, 7, 257]
    g = torch.Generator(device="cuda").manual_seed(seqlen_q + num_splits)
    q, kc, vc, descales = make(convention, b, seqlen_q, hq, hk, d, sc, filled, g)
    kw = {"cache_seqlens": torch.tensor(filled, dtype=I32, device="cuda"), "causal": causal,
          "window_size": window, "softcap": softcap}
    ref_out, ref_lse, low = references(convention, q, kc, vc, descales, **kw)
    out, lse = flash_attn_with_kvcache(q, kc, vc, num_splits=num_splits,
                                       return_softmax_lse=True, **descales, **kw)
    check_kvcache(out, lse, ref_out, ref_lse, low)


@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_new_keys_are_appended_in_fp8_and_attended(convention):
    """New k / v in the cache's FP8 dtype land bit for bit at cache_seqlens (dense and paged)
    and are attended with the cache's descales."""
    b, hq, hk, d, sc, new = 2, 32, 8, 128, 300, 2
    filled = [100, 250]
    g = torch.Generator(device="cuda").manual_seed(11)
    q, kc, vc, descales = make(convention, b, 1, hq, hk, d, sc, filled, g)
    kn, vn = (torch.randn(b, new, hk, d, device="cuda", generator=g).to(kc.dtype)
              for _ in range(2))
    seqlens = torch.tensor(filled, dtype=I32, device="cuda")
    after_k, after_v = kc.clone(), vc.clone()
    for i, n in enumerate(filled):
        after_k[i, n:n + new], after_v[i, n:n + new] = kn[i], vn[i]
    ref_out, ref_lse, low = references(convention, q, after_k, after_v, descales,
                                       cache_seqlens=seqlens + new)
    pool_k, pool_v, table = paged(kc, vc, 16, g)
    for caches, kw in (((kc, vc), {}), ((pool_k, pool_v), {"page_table": table})):
        out, lse = flash_attn_with_kvcache(q, *caches, kn, vn, cache_seqlens=seqlens,
                                           return_softmax_lse=True, **descales, **kw)
        check_kvcache(out, lse, ref_out, ref_lse, low)
    assert torch.equal(kc.view(torch.uint8), after_k.view(torch.uint8))
    dense_pool = pool_v.view(torch.uint8)[table.long()].view(b, -1, hk, d)[:, :sc]
    assert torch.equal(dense_pool, after_v.view(torch.uint8))


@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_fp8_calls_run_on_the_decode_kernel(convention):
    b, hq, hk, d = 2, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    q, kc, vc, descales = make(convention, b, 1, hq, hk, d, 4096, [4000, 17], g)
    seqlens = torch.tensor([4000, 17], dtype=I32, device="cuda")
    assert run_count(lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                                     **descales)) == 1


def decode_kernel_names(fn):
    """The names of the decode kernels fn launched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key for e in prof.key_averages() if "decode_kernel" in e.key]


@pytest.mark.parametrize(("seqlen_q", "wide", "form"), [
    (1, False, "true,1"), (2, False, "true,1"), (3, False, "false,1"), (8, False, "false,1"),
    (8, True, "false,2")])
def test_tiles_of_at_most_8_rows_take_keys_as_m(seqlen_q, wide, form):
    """GQA 32 / 8: 4 rows per query token. Up to 8 rows the kernel's keys-as-M form runs (its
    last template arguments: keys as M, row blocks per CTA), above it the rows-as-M one; 8 tokens
    (32 rows, two row blocks) take one CTA over both where a CTA per row block would fill every
    slot (`wide`: a batch of SMs / 8 + 1), one each below; all match the reference."""
    b = torch.cuda.get_device_properties(0).multi_processor_count // 8 + 1 if wide else 2
    hq, hk, d, sc = 32, 8, 128, 900
    filled = [900, 130] * (b // 2) + [517] * (b % 2)
    g = torch.Generator(device="cuda").manual_seed(seqlen_q)
    q, kc, vc, descales = make("e4m3", b, seqlen_q, hq, hk, d, sc, filled, g)
    kw = {"cache_seqlens": torch.tensor(filled, dtype=I32, device="cuda"), "causal": True}
    names = decode_kernel_names(lambda: flash_attn_with_kvcache(q, kc, vc, **descales, **kw))
    assert len(names) == 1
    assert f",{form}>" in names[0].replace(" ", ""), names[0]
    ref_out, ref_lse, low = references("e4m3", q, kc, vc, descales, **kw)
    out, lse = flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=True, **descales, **kw)
    check_kvcache(out, lse, ref_out, ref_lse, low)
