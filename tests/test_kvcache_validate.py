"""flash_attn_with_kvcache's arguments, on the CPU (docs/host.md "KV-cache routes"): FA3's
signature, each refusal naming the argument, and a refused call never writing the cache."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from flash_hopper import flash_attn_with_kvcache
from flash_hopper._errors import UnsupportedError

from tests._helpers import raises

I32 = torch.int32

# FA3's hopper/flash_attn_interface.py flash_attn_with_kvcache, in order (FA3 HEAD 0251105).
FA3_PARAMETERS = [
    "q", "k_cache", "v_cache", "k", "v", "qv", "rotary_cos", "rotary_sin", "cache_seqlens",
    "cache_batch_idx", "cache_leftpad", "page_table", "cu_seqlens_q", "cu_seqlens_k_new",
    "max_seqlen_q", "rotary_seqlens", "q_descale", "k_descale", "v_descale", "softmax_scale",
    "causal", "window_size", "attention_chunk", "softcap", "rotary_interleaved",
    "scheduler_metadata", "num_splits", "pack_gqa", "sm_margin", "return_softmax_lse",
]


def test_signature_is_fa3s():
    sig = inspect.signature(flash_attn_with_kvcache)
    positional = [n for n, p in sig.parameters.items()
                  if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == FA3_PARAMETERS
    defaults = {n: p.default for n, p in sig.parameters.items()}
    assert defaults["window_size"] == (-1, -1) and defaults["num_splits"] == 0
    assert defaults["causal"] is False and defaults["return_softmax_lse"] is False
    keyword_only = [n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == ["sinks", "out", "backend"]


def make(b=2, sq=1, h=4, hk=2, d=64, sc=32, new=0):
    q = torch.randn(b, sq, h, d, dtype=torch.bfloat16)
    kc, vc = (torch.randn(b, sc, hk, d, dtype=torch.bfloat16) for _ in range(2))
    kn = vn = None
    if new:
        kn, vn = (torch.randn(b, new, hk, d, dtype=torch.bfloat16) for _ in range(2))
    return q, kc, vc, kn, vn


@pytest.mark.parametrize(("name", "value", "exc", "fragment"), [
    # qv is served (tests/test_qv.py), not with a v_cache of k_cache's head dim 64
    ("qv", torch.zeros(2, 1, 4, 64, dtype=torch.bfloat16), ValueError,
     "v_cache: expected head_dim_v a multiple of 8 in [256, 512] with qv"),
    ("qv", torch.zeros(2, 1, 4, 64), ValueError, "qv: expected dtype torch.bfloat16"),
])
def test_refused_arguments_are_refused_before_anything_is_written(name, value, exc, fragment):
    q, kc, vc, kn, vn = make(new=3)
    before = kc.clone(), vc.clone()
    with raises(exc, fragment):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=5, **{name: value})
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_chunk_with_sinks_is_refused_before_anything_is_written():
    q, kc, vc, kn, vn = make(new=3)
    before = kc.clone(), vc.clone()
    with raises(UnsupportedError, "attention_chunk: expected 0 with 16-bit q against an FP8 cache "
                "or sinks", "64"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=5, attention_chunk=64,
                                sinks=torch.zeros(q.shape[2]))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_rotary_seqlens_alone_is_ignored_as_in_fa3():
    # FA3's own tests pass rotary_seqlens with every call; without rotary_cos it does nothing.
    q, kc, vc, _, _ = make()
    with raises(ValueError, "must be a CUDA tensor"):  # past the argument checks
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5,
                                rotary_seqlens=torch.zeros(2, dtype=I32))


def test_performance_hints_are_checked_for_type_only():
    q, kc, vc, _, _ = make()
    for name, value in (("num_splits", -1), ("sm_margin", 1.5), ("pack_gqa", "yes")):
        with raises(TypeError, f"{name}:"):
            flash_attn_with_kvcache(q, kc, vc, **{name: value})
    with raises(TypeError, "return_softmax_lse: expected a bool, got 1"):
        flash_attn_with_kvcache(q, kc, vc, return_softmax_lse=1)


@pytest.mark.parametrize(("change", "exc", "fragments"), [
    (lambda a: a.update(q=a["q"][0]), ValueError,
     ("q: expected a 4-D tensor (batch, seqlen_q, heads_q, head_dim)", "(1, 4, 64)")),
    (lambda a: a.update(v_cache=a["v_cache"][:, :16]), ValueError,
     ("v_cache: expected k_cache's shape (2, 32, 2, 64)", "(2, 16, 2, 64)")),
    (lambda a: a.update(k_cache=a["k_cache"].half(), v_cache=a["v_cache"].half()), ValueError,
     ("k_cache: expected q's dtype torch.bfloat16, got torch.float16",)),
    (lambda a: a.update(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]), ValueError,
     ("k_cache: expected batch_cache = q's batch (2) without cache_batch_idx, got 1",)),
    (lambda a: a.update(k_cache=a["k_cache"][..., ::2], v_cache=a["v_cache"][..., ::2]),
     ValueError, ("k_cache: expected a contiguous last dimension (stride 1), got stride 2",)),
    (lambda a: a.update(v=None), ValueError, ("k / v: expected both or neither",)),
    (lambda a: a.update(k=a["k"][:, :, :1], v=a["v"][:, :, :1]), ValueError,
     ("k: expected shape (batch, seqlen_new, heads_kv, head_dim) with batch 2, heads_kv 2",
      "(2, 3, 1, 64)")),
    (lambda a: a.update(v=a["v"][:, :2]), ValueError, ("v: expected k's shape (2, 3, 2, 64), got (2, 2, 2, 64)",)),
    (lambda a: a.update(cache_seqlens=30), ValueError,
     ("cache_seqlens: expected 0 <= cache_seqlens <= seqlen_cache - seqlen_new (29), got 30",)),
    (lambda a: a.update(cache_seqlens=torch.zeros(2, dtype=torch.int64)), TypeError,
     ("cache_seqlens: expected dtype torch.int32, got torch.int64",)),
    (lambda a: a.update(cache_seqlens=torch.zeros(3, dtype=I32)), ValueError,
     ("cache_seqlens: expected 2 entries (q's batch), got 3",)),
    (lambda a: a.update(cache_seqlens=2.5), TypeError,
     ("cache_seqlens: expected None, an int or an int32 tensor (batch,), got float",)),
    (lambda a: a.update(cache_batch_idx=torch.zeros(2, 1, dtype=I32)), ValueError,
     ("cache_batch_idx: expected a 1-D tensor of int32 (batch,), got shape (2, 1)",)),
    (lambda a: a.update(cache_leftpad=[0, 0]), TypeError,
     ("cache_leftpad: expected a torch.Tensor of int32 (batch,), got list",)),
    (lambda a: a.update(k_cache=a["k_cache"].transpose(0, 1).contiguous().transpose(0, 1),
                        v_cache=a["v_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
     ValueError, (("k_cache: expected an entry stride that is a whole number of rows of at "
                   "least seqlen_cache (32)"),)),
    (lambda a: None, ValueError, ("must be a CUDA tensor",)),  # CPU tensors: the kernels' check
    (lambda a: a.update(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=I32)), ValueError,
     ("q: expected a 3-D tensor (total_q, heads_q, head_dim) with cu_seqlens_q",)),
    (lambda a: a.update(q=a["q"][:, 0], cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int64)),
     TypeError, ("cu_seqlens_q: expected dtype torch.int32, got torch.int64",)),
    (lambda a: a.update(cu_seqlens_k_new=torch.tensor([0, 3, 6], dtype=I32)), ValueError,
     ("k: expected a 3-D tensor (total_new, heads_kv, head_dim) with cu_seqlens_k_new",)),
    (lambda a: a.update(k=a["k"].flatten(0, 1), v=a["v"].flatten(0, 1),
                        cu_seqlens_k_new=torch.tensor([0, 6], dtype=I32)), ValueError,
     ("cu_seqlens_k_new: expected 3 entries (batch + 1 offsets), got 2",)),
    (lambda a: a.update(k=None, v=None, cu_seqlens_k_new=torch.tensor([0, 3, 6], dtype=I32)),
     ValueError, ("cu_seqlens_k_new: expected None without new k / v",)),
])
def test_bad_arguments_raise_naming_them_and_write_nothing(change, exc, fragments):
    q, kc, vc, kn, vn = make(new=3)
    a = {"q": q, "k_cache": kc, "v_cache": vc, "k": kn, "v": vn, "cache_seqlens": 5}
    change(a)
    before = [t.clone() for t in (a["k_cache"], a["v_cache"])]
    with raises(exc, *fragments):
        flash_attn_with_kvcache(**a)
    assert torch.equal(a["k_cache"], before[0]) and torch.equal(a["v_cache"], before[1])


def test_scheduler_metadata_is_fa3s_and_checked_against_the_call():
    from flash_hopper import get_scheduler_metadata

    params = list(inspect.signature(get_scheduler_metadata).parameters)
    assert params == [  # FA3's hopper/flash_attn_interface.py, in order
        "batch_size", "max_seqlen_q", "max_seqlen_k", "num_heads_q", "num_heads_kv", "headdim",
        "cache_seqlens", "qkv_dtype", "headdim_v", "cu_seqlens_q", "cu_seqlens_k_new",
        "cache_leftpad", "page_size", "max_seqlen_k_new", "causal", "window_size",
        "attention_chunk", "has_softcap", "num_splits", "pack_gqa", "sm_margin"]
    lengths = torch.full((2,), 5, dtype=I32)
    meta = get_scheduler_metadata(2, 1, 32, 4, 2, 64, lengths, num_splits=3)
    assert meta.dtype == I32 and meta.shape == (10,) and meta[1].item() == 3
    assert meta.flash_hopper_schedule["splits"] == 3
    assert meta.flash_hopper_schedule["decode_splits"] == 3  # the decode kernel takes it as is
    # beyond the kernel's cap: passed on, the library's plan clamps it (test_decode.py)
    big = get_scheduler_metadata(2, 1, 32, 4, 2, 64, lengths, num_splits=1000)
    assert big.flash_hopper_schedule["decode_splits"] == 1000
    # num_splits=0: the decode kernel's own heuristic at each call (0), not the varlen path's
    assert get_scheduler_metadata(2, 1, 32, 4, 2, 64, lengths).flash_hopper_schedule[
        "decode_splits"] == 0
    q, kc, vc, _, _ = make()  # batch 2, heads 4 / 2, d64: the metadata's shapes
    with raises(ValueError, "must be a CUDA tensor"):  # accepted: on to the kernels' checks
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, scheduler_metadata=meta)
    before = kc.clone()
    other = get_scheduler_metadata(3, 1, 32, 4, 2, 64, torch.zeros(3, dtype=I32))
    with raises(ValueError, "scheduler_metadata: made for batch = 3, this call has 2"):
        flash_attn_with_kvcache(q, kc, vc, *make(new=1)[3:], cache_seqlens=5,
                                scheduler_metadata=other)
    assert torch.equal(kc, before)
    with raises(ValueError, "scheduler_metadata: expected the tensor flash_hopper's"):
        flash_attn_with_kvcache(q, kc, vc, scheduler_metadata=torch.zeros(9, dtype=I32))
    assert get_scheduler_metadata(2, 1, 32, 4, 2, 64, lengths, page_size=16).shape == (10,)
    with raises(TypeError, "page_size: expected None or an int >= 1, got 0"):
        get_scheduler_metadata(2, 1, 32, 4, 2, 64, lengths, page_size=0)
    with raises(ValueError, "num_heads_kv: expected a divisor of num_heads_q (4), got 3"):
        get_scheduler_metadata(2, 1, 32, 4, 3, 64, lengths)



def _complex_rotary(x, cos, sin, interleaved):
    """Rotary embedding as complex multiplication (an independent reference): feature pairs as
    complex numbers times (cos + i sin), cos / sin (..., r/2) per position, broadcast over
    heads."""
    half = cos.shape[-1]
    xr = x[..., :2 * half].double()
    if interleaved:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2])
    else:
        z = torch.complex(xr[..., :half], xr[..., half:])
    z = z * torch.complex(cos.double(), sin.double()).unsqueeze(-2)
    rot = (torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved
           else torch.cat((z.real, z.imag), -1))
    return torch.cat((rot, x[..., 2 * half:].double()), -1)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_is_the_complex_rotation_at_each_position(interleaved):
    from flash_hopper.kvcache import _rotate

    g = torch.Generator().manual_seed(int(interleaved))
    seqlen_ro, half, d = 50, 16, 64
    theta = torch.rand(seqlen_ro, half, generator=g, dtype=torch.float64) * 6.3
    cos, sin = theta.cos().float(), theta.sin().float()
    x = torch.randn(3, 7, 4, d, generator=g)
    pos = torch.randint(0, seqlen_ro, (3, 7), generator=g)
    got = _rotate(x, cos, sin, pos, interleaved)
    want = _complex_rotary(x, theta[pos].cos(), theta[pos].sin(), interleaved)
    assert (got.double() - want).abs().max().item() < 1e-5
    assert torch.equal(got[..., 2 * half:], x[..., 2 * half:])  # past rotary_dim: untouched
    # packed (total, heads, d) with positions (total,): the same rotation per token
    flat = _rotate(x.reshape(21, 4, d), cos, sin, pos.reshape(21), interleaved)
    assert torch.equal(flat, got.reshape(21, 4, d))
    # positions outside cos / sin are clamped, never an index error
    far = _rotate(x, cos, sin, pos + 1000, interleaved)
    assert torch.equal(far, _rotate(x, cos, sin, torch.full_like(pos, seqlen_ro - 1),
                                    interleaved))


@pytest.mark.parametrize(("change", "exc", "fragment"), [
    (lambda a: a.update(rotary_sin=None), ValueError, "rotary_cos / rotary_sin: expected both"),
    (lambda a: a.update(k=None, v=None), ValueError, "rotary_cos: expected new k / v with it"),
    (lambda a: a.update(rotary_cos=torch.zeros(32, 12), rotary_sin=torch.zeros(32, 12)),
     ValueError, "a multiple of 16 in [16, head_dim = 64], got 24"),
    (lambda a: a.update(rotary_cos=torch.zeros(32, 40), rotary_sin=torch.zeros(32, 40)),
     ValueError, "got 80"),
    (lambda a: a.update(rotary_cos=torch.zeros(32, 16, dtype=torch.float16)), ValueError,
     "rotary_cos: expected q's dtype torch.bfloat16 or torch.float32, got torch.float16"),
    (lambda a: a.update(rotary_sin=torch.zeros(31, 16)), ValueError,
     "rotary_sin: expected rotary_cos's shape (32, 16), got (31, 16)"),
    (lambda a: a.update(rotary_seqlens=torch.zeros(3, dtype=I32)), ValueError,
     "rotary_seqlens: expected 2 entries (q's batch), got 3"),
])
def test_rotary_arguments(change, exc, fragment):
    q, kc, vc, kn, vn = make(new=3)
    a = {"q": q, "k_cache": kc, "v_cache": vc, "k": kn, "v": vn, "cache_seqlens": 5,
         "rotary_cos": torch.zeros(32, 16), "rotary_sin": torch.zeros(32, 16)}
    change(a)
    before = kc.clone()
    with raises(exc, fragment):
        flash_attn_with_kvcache(**a)
    assert torch.equal(kc, before)


def test_sinks_follow_exactly_from_the_lse():
    """apply_sinks on attention without a sink equals the reference with the sink (rows with
    keys, rows without), in the dense and the varlen LSE layouts."""
    from flash_hopper.kvcache import apply_sinks
    from flash_hopper.reference import attention_kvcache_ref

    g = torch.Generator().manual_seed(0)
    b, sq, hq, hk, d, sc = 3, 2, 4, 2, 16, 20
    q = torch.randn(b, sq, hq, d, generator=g, dtype=torch.float64)
    kc, vc = (torch.randn(b, sc, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.tensor([0.5, -3.0, 2.0, 9.0])
    lengths = torch.tensor([20, 0, 7], dtype=I32)  # sequence 1: no keys
    kw = {"cache_seqlens": lengths, "causal": True}
    out, lse, _, _ = attention_kvcache_ref(q, kc, vc, **kw)
    want, want_lse, _, _ = attention_kvcache_ref(q, kc, vc, sinks=sinks, **kw)
    got, got_lse = apply_sinks(out, lse, sinks.double(), 1)
    assert (got - want).abs().max().item() < 1e-6  # the factor applied in fp32
    assert (got_lse - want_lse).abs().max().item() < 1e-12
    assert torch.equal(got_lse[1], sinks.double()[:, None].expand(hq, sq))  # no keys: lse = sink
    # varlen layout: out (total, heads, d), lse (heads, total)
    got_v, got_lse_v = apply_sinks(out.reshape(b * sq, hq, d),
                                   lse.permute(1, 0, 2).reshape(hq, b * sq), sinks.double(), 0)
    assert torch.equal(got_v, got.reshape(b * sq, hq, d))
    assert torch.equal(got_lse_v, got_lse.permute(1, 0, 2).reshape(hq, b * sq))


def test_sinks_arguments():
    q, kc, vc, _, _ = make()
    for value, exc, fragment in (
            (torch.zeros(4, dtype=torch.float16), TypeError,
             "sinks: expected dtype torch.float32, got torch.float16"),
            (torch.zeros(3), ValueError, "sinks: expected 4 entries (heads_q), got 3"),
            (torch.zeros(2, 2), ValueError, "sinks: expected a 1-D tensor of fp32 (heads_q,)")):
        with raises(exc, fragment):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, sinks=value)


def _paged_case(num_pages=12, page_size=4, b=2, max_pages=3, new=2):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, 1, 4, 64, generator=g).to(torch.bfloat16)
    kc, vc = (torch.randn(num_pages, page_size, 2, 64, generator=g).to(torch.bfloat16)
              for _ in range(2))
    kn, vn = (torch.randn(b, new, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    table = torch.randperm(num_pages, generator=g)[:b * max_pages].view(b, max_pages).to(I32)
    return q, kc, vc, kn, vn, table


@pytest.mark.parametrize(("change", "exc", "fragment"), [
    (lambda a: a.update(page_table=a["page_table"].long()), ValueError,
     "page_table: expected an int32 2-D tensor (batch, max_pages), got torch.int64"),
    (lambda a: a.update(page_table=a["page_table"][:1]), ValueError,
     "page_table: expected 2 rows (q's batch) without cache_batch_idx, got 1"),
    (lambda a: a.update(v_cache=a["v_cache"][:5]), ValueError, "v_cache: expected k_cache's"),
    (lambda a: None, ValueError, "must be a CUDA tensor"),  # the dense path's checks, first
])
def test_paged_arguments_and_nothing_written_on_refusal(change, exc, fragment):
    q, kc, vc, kn, vn, table = _paged_case()
    a = {"q": q, "k_cache": kc, "v_cache": vc, "k": kn, "v": vn, "page_table": table,
         "cache_seqlens": torch.tensor([3, 9], dtype=I32)}
    change(a)
    before = a["k_cache"].clone(), a["v_cache"].clone()
    with raises(exc, fragment):
        flash_attn_with_kvcache(**a)
    assert torch.equal(a["k_cache"], before[0]) and torch.equal(a["v_cache"], before[1])


def test_paged_pool_gets_the_new_keys(monkeypatch):
    """The paged path around the dense one (stood in here: it appends into the gathered copy as
    the real one does): the gathered copy holds each sequence's pages in table order, and the
    new keys land in the pool at (page_table[b][pos // page_size], pos % page_size); nothing
    else of the pool changes. Garbage in unused table entries is never an index error."""
    from flash_hopper import kvcache

    q, kc, vc, kn, vn, table = _paged_case()
    table[1, 2] = 99999  # unused by sequence 1 (3 + 2 keys fit in its first two pages)
    seqlens = torch.tensor([9, 3], dtype=I32)
    seen = {}

    def dense(**call):
        dk, dv = call["k_cache"], call["v_cache"]
        seen["k"] = dk.clone()
        for b in range(2):
            n = int(call["cache_seqlens"][b])
            dk[b, n:n + 2], dv[b, n:n + 2] = call["k"][b], call["v"][b]
        return torch.zeros_like(call["q"])

    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache", dense)
    monkeypatch.setattr(kvcache._varlen, "offsets_checked", lambda: False)
    pool_k, pool_v = kc.clone(), vc.clone()
    kvcache._paged(page_table=table, k_cache=kc, v_cache=vc, cache_batch_idx=None,
                   q=q, k=kn, v=vn, cache_seqlens=seqlens, cu_seqlens_q=None,
                   cu_seqlens_k_new=None, rotary_cos=None)
    for b in range(2):  # the copy: the sequence's pages in table order
        pages = table[b].long().clamp(0, 11)
        assert torch.equal(seen["k"][b], pool_k[pages].reshape(12, 2, 64))
    for b, n in enumerate([9, 3]):
        for i in range(2):
            pos = n + i
            page, slot = int(table[b, pos // 4]), pos % 4
            pool_k[page, slot], pool_v[page, slot] = kn[b, i], vn[b, i]
    assert torch.equal(kc, pool_k) and torch.equal(vc, pool_v)


def test_used_page_entries_are_checked():
    from flash_hopper.kvcache import _check_pages

    table = torch.tensor([[3, 1, -1], [0, 7, 2]], dtype=I32)
    _check_pages(table, torch.tensor([8, 5], dtype=I32), None, None, 4, 8)  # -1 unused: fine
    with raises(ValueError, "page_table: expected page_table[0][2] (a page holding sequence 0's "
                            "keys) in [0, num_pages = 8), got -1"):
        _check_pages(table, torch.tensor([9, 5], dtype=I32), None, None, 4, 8)
    with raises(ValueError, "page_table[1][1]", "got 7"):
        _check_pages(table, torch.tensor([0, 3], dtype=I32), torch.zeros(2, 2, 1, 1), None, 4, 7)


def test_varlen_queries_longer_than_max_seqlen_q_are_refused():
    """The decode kernel sizes its grid by max_seqlen_q: a sequence with more queries would leave
    output rows unwritten, so the value check refuses it (kvcache._check_values, CPU tensors)."""
    from flash_hopper.kvcache import _check_values

    seqlens = torch.tensor([10, 10], dtype=I32)
    cu = torch.tensor([0, 3, 8], dtype=I32)
    _check_values(seqlens, 0, 64, 2, None, None, cu, 8, None, 0, max_seqlen_q=5)
    with raises(ValueError, "max_seqlen_q: expected at least every sequence's query count, got 4",
                "sequence 1 of 5"):
        _check_values(seqlens, 0, 64, 2, None, None, cu, 8, None, 0, max_seqlen_q=4)


# --- FP8 caches on the decode route: FA3's convention and the mixed mode --------------------------

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture
def decode_route(monkeypatch):
    """The decode kernel taken (its policy answers "serves") and launched as a recorder of its
    keyword arguments, tensors on the CPU passing the device checks: every other check real."""
    from flash_hopper import _decode, _validate

    seen = []

    def forward(q, *args, **kwargs):
        seen.append(kwargs)
        return torch.zeros(q.shape, dtype=_decode.out_dtype(q)), None

    monkeypatch.setattr(_decode, "serves", lambda *args: True)
    monkeypatch.setattr(_decode, "forward", forward)
    monkeypatch.setattr(_validate, "_check_device", lambda *args: None)
    return seen


def fp8_make(q_dtype, cache_dtype=E4M3, new=1):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 1, 8, 64, generator=g).to(q_dtype)
    kc, vc = (torch.randn(2, 32, 2, 64, generator=g).to(cache_dtype) for _ in range(2))
    kn, vn = (torch.randn(2, new, 2, 64, generator=g).to(cache_dtype) for _ in range(2))
    return q, kc, vc, kn, vn


@pytest.mark.parametrize(("q_dtype", "cache_dtype", "descales", "out_dtype"), [
    (E4M3, E4M3, ("q", "k", "v"), torch.bfloat16),  # FA3's: all three, o in bf16
    (torch.bfloat16, E4M3, ("k", "v"), torch.bfloat16),  # the mixed mode: o in q's dtype
    (torch.float16, E5M2, ("v",), torch.float16),
])
def test_fp8_caches_reach_the_decode_kernel_with_their_descales(decode_route, q_dtype, cache_dtype,
                                                                descales, out_dtype):
    q, kc, vc, kn, vn = fp8_make(q_dtype, cache_dtype)
    given = {f"{n}_descale": torch.rand(2, 2) + 0.5 for n in descales}
    out = flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=5, **given)
    (kw,), want = decode_route, tuple(given.get(f"{n}_descale") for n in "qkv")
    assert out.dtype == out_dtype and all(a is b for a, b in zip(kw["descales"], want))
    # the new keys appended bit for bit before the launch
    assert torch.equal(kc[:, 5].view(torch.uint8), kn[:, 0].view(torch.uint8))
    assert torch.equal(vc[:, 5].view(torch.uint8), vn[:, 0].view(torch.uint8))


@pytest.mark.parametrize(("q_dtype", "change", "exc", "fragment"), [
    # the mixed mode's descales as flash_attn_func's: k_descale / v_descale only
    (torch.bfloat16, {"q_descale": torch.ones(2, 2)}, ValueError,
     "q_descale: expected None in the mixed mode (q is torch.bfloat16, not FP8"),
    (torch.bfloat16, {"k_descale": torch.ones(2, 8)}, ValueError,
     ("k_descale: expected shape (batch, heads_kv) = (2, 2), a 0-d tensor or shape (1,), got "
      "(2, 8)")),
    (E4M3, {"v_descale": torch.ones(2, 2, dtype=torch.float64)}, ValueError,
     "v_descale: expected dtype torch.float32, got torch.float64"),
    (E4M3, {"out": torch.zeros(2, 1, 8, 64, dtype=torch.float16)}, TypeError,
     "out: expected dtype torch.bfloat16 (the FP8 forward's output dtype), got torch.float16"),
    # k and v of one cache in one FP8 dtype; an FP8 q takes an FP8 cache of its own dtype
    (torch.bfloat16, {"v_cache": torch.zeros(2, 32, 2, 64, dtype=E5M2)}, ValueError,
     ("v_cache: expected k_cache's dtype torch.float8_e4m3fn (an FP8 cache under torch.bfloat16 "
      "q holds k and v in one FP8 dtype), got torch.float8_e5m2")),
    (E4M3, {"k_cache": torch.zeros(2, 32, 2, 64, dtype=torch.bfloat16)}, ValueError,
     "k_cache: expected q's dtype torch.float8_e4m3fn, got torch.bfloat16"),
    (torch.bfloat16, {"attention_chunk": 16}, UnsupportedError,
     "attention_chunk: expected 0 with 16-bit q against an FP8 cache or sinks"),
])
def test_fp8_refusals_name_the_argument_and_write_nothing(decode_route, q_dtype, change, exc,
                                                          fragment):
    q, kc, vc, kn, vn = fp8_make(q_dtype)
    a = {"q": q, "k_cache": kc, "v_cache": vc, "k": kn, "v": vn, "cache_seqlens": 5, **change}
    before = [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone()
              for t in (a["k_cache"], a["v_cache"])]
    with raises(exc, fragment):
        flash_attn_with_kvcache(**a)
    after = [t.view(torch.uint8) if t.element_size() == 1 else t
             for t in (a["k_cache"], a["v_cache"])]
    assert all(torch.equal(x, y) for x, y in zip(after, before)) and not decode_route


@pytest.mark.parametrize(("q_dtype", "cache_dtype"), [(E4M3, E4M3), (torch.bfloat16, E4M3),
                                                   (torch.float16, E5M2)])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_with_fp8_inputs_rotates_in_fp32_and_saturates(monkeypatch, q_dtype, cache_dtype,
                                                              interleaved):
    """FA3 takes rotary with FP8 q / caches (cos / sin in q's dtype): the new keys and q rotated
    in fp32 (their descales, one per head, commute with the rotation), rounded once into their
    dtype, a rotated pair past the FP8 range saturated; checked against the complex-number
    rotation in float64 to one rounding of the stored dtype."""
    from flash_hopper import _decode, _validate

    queries = []

    def forward(q, *args, **kwargs):
        queries.append(q.clone())
        return torch.zeros(q.shape, dtype=_decode.out_dtype(q)), None

    monkeypatch.setattr(_decode, "serves", lambda *args: True)
    monkeypatch.setattr(_decode, "forward", forward)
    monkeypatch.setattr(_validate, "_check_device", lambda *args: None)
    q, kc, vc, kn, vn = fp8_make(q_dtype, cache_dtype, new=2)
    top = torch.finfo(cache_dtype).max
    pair = (0, 1) if interleaved else (0, 16)  # a feature pair (GPT-J / GPT-NeoX), rotary_dim 32
    kn[0, 0, 0, pair[0]] = kn[0, 0, 0, pair[1]] = top  # rotated by 45 degrees: top * sqrt(2)
    g = torch.Generator().manual_seed(int(interleaved))
    theta = torch.rand(32, 16, generator=g, dtype=torch.float64) * 6.3
    theta[5] = math.pi / 4
    cos, sin = theta.cos().to(q_dtype), theta.sin().to(q_dtype)
    seqlens = torch.tensor([5, 20], dtype=I32)
    kc_before = kc.clone()
    flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, rotary_cos=cos,
                            rotary_sin=sin, rotary_interleaved=interleaved, causal=True)
    # one rounding into the stored dtype: its relative spacing, and its smallest subnormal
    rel = {E4M3: 2**-3, E5M2: 2**-2, torch.bfloat16: 2**-7, torch.float16: 2**-10}
    tiny = {E4M3: 2**-9, E5M2: 2**-16, torch.bfloat16: 0.0, torch.float16: 2**-24}

    def close(got, want, dtype):
        return bool(((got.double() - want).abs() <= rel[dtype] * want.abs() + tiny[dtype]).all())

    for b in range(2):
        s = int(seqlens[b])
        pos = s + torch.arange(2)
        want = _complex_rotary(kn[b].double(), cos.double()[pos], sin.double()[pos],
                               interleaved).clamp(-top, top)
        assert close(kc[b, s:s + 2], want, cache_dtype), b
        rest = torch.ones(32, dtype=torch.bool)
        rest[s:s + 2] = False
        assert torch.equal(kc[b].view(torch.uint8)[rest], kc_before[b].view(torch.uint8)[rest])
    assert kc[0, 5, 0, pair[1]].double() == top  # saturated, not NaN
    want_q = _complex_rotary(q.double(), cos.double()[seqlens.long()][:, None],
                             sin.double()[seqlens.long()][:, None], interleaved)
    if q_dtype == E4M3:
        want_q = want_q.clamp(-top, top)
    assert queries[0].dtype == q_dtype and close(queries[0], want_q, q_dtype)
