"""flash_attn_with_kvcache's routes on the CPU, with every launcher replaced by a recorder: which
one a call takes (decode kernel, packed GQA / split-KV, chunked, varlen, paged fallback), that it
takes exactly one, and that the new keys are in the cache before it runs."""

from __future__ import annotations

import types

import pytest
import torch
from flash_hopper import _decode, _varlen, kvcache

I32 = torch.int32
LAUNCHERS = ("decode", "packed", "chunked", "varlen", "paged")


def _cfg(args):
    """What _varlen's checks return, from its positional arguments (scale, causal, window)."""
    left, right = (int(w) for w in args[11])
    return types.SimpleNamespace(softmax_scale=args[9] or args[0].shape[-1] ** -0.5,
                                 window_left=left, window_right=0 if args[10] else right,
                                 softcap=args[12], backend=args[13])


@pytest.fixture
def launches(monkeypatch):
    """The launchers called, in order, each with the cache's row 0 as it was at the call; the
    library's policy counts the decode kernel as serving the call where ``usable[0]``."""
    calls, usable = [], [True]
    state = {}

    def record(name, result):
        def launcher(*args, **kwargs):
            calls.append((name, state["k_cache"][0].clone()))
            return result(*args, **kwargs)
        return launcher

    def rows_result(q_rows, *args, **kwargs):
        return torch.zeros_like(q_rows), torch.zeros(q_rows.shape[1], q_rows.shape[0]), None

    monkeypatch.setattr(_decode, "serves", lambda *args: usable[0])
    monkeypatch.setattr(_varlen, "check_call", lambda *args: _cfg(args))
    monkeypatch.setattr(_varlen, "plan", lambda *args: types.SimpleNamespace(
        dense=types.SimpleNamespace(cfg=_cfg(args))))
    monkeypatch.setattr(_decode, "forward", record(
        "decode", lambda q, *args, **kwargs: (torch.zeros_like(q), None)))
    monkeypatch.setattr(kvcache, "_packed_varlen", record(
        "packed", lambda q, *args: (torch.zeros_like(q), None)))
    monkeypatch.setattr(kvcache, "_chunked", record("chunked", lambda *a: rows_result(*a)[:2]))
    monkeypatch.setattr(_varlen, "forward", record("varlen", rows_result))
    monkeypatch.setattr(kvcache, "_paged", record("paged", lambda **kwargs: None))
    monkeypatch.setattr(kvcache, "_splits", lambda num_splits, *args: max(num_splits, 1))
    return types.SimpleNamespace(calls=calls, usable=usable, state=state)


def _call(launches, seqlen_q=1, heads_q=4, paged=False, **kwargs):
    torch.manual_seed(0)
    q = torch.randn(2, seqlen_q, heads_q, 64, dtype=torch.float16)
    shape = (4, 8, 2, 64) if paged else (2, 16, 2, 64)
    k_cache = torch.zeros(shape, dtype=torch.float16)
    launches.state["k_cache"] = k_cache
    if paged:
        kwargs["page_table"] = torch.tensor([[0, 1], [2, 3]], dtype=I32)
    new = torch.ones(2, 1, 2, 64, dtype=torch.float16)
    kvcache.flash_attn_with_kvcache(q, k_cache, torch.zeros_like(k_cache), new, new.clone(),
                                    cache_seqlens=3, **kwargs)
    return [name for name, _ in launches.calls]


# One case per route; "auto" takes the decode kernel where it is usable, an explicit backend the
# varlen kernels: unmasked GQA rows packed, masked rows as they are, chunks on their own path.
@pytest.mark.parametrize(("usable", "kwargs", "route"), [
    (True, {}, "decode"),
    (True, {"paged": True}, "decode"),
    (False, {}, "packed"),
    (True, {"backend": "fa2"}, "packed"),
    (True, {"backend": "fa2", "num_splits": 3, "heads_q": 2}, "packed"),
    (True, {"backend": "fa2", "heads_q": 2}, "varlen"),
    (True, {"backend": "fa2", "pack_gqa": False}, "varlen"),
    (True, {"backend": "fa2", "seqlen_q": 3, "causal": True}, "varlen"),
    (True, {"attention_chunk": 4}, "chunked"),
    (True, {"backend": "fa2", "paged": True}, "paged"),
    (False, {"paged": True}, "paged"),
])
def test_each_call_takes_one_route(launches, usable, kwargs, route):
    launches.usable[0] = usable
    assert _call(launches, **kwargs) == [route]
    if route != "paged":  # the new key (ones) at position 3 before the launch, not after
        row = launches.calls[0][1]
        assert (row[3] == 1).all() and (row[:3] == 0).all() and (row[4:] == 0).all()


@pytest.mark.parametrize("interleaved", [True, False])
def test_paged_fallback_with_rotary_writes_the_rotated_keys(monkeypatch, interleaved):
    """Off the decode kernel a paged cache runs on its gathered copy (kvcache._paged); with rotary
    the keys the copy receives are rotated (at cache_seqlens + i), and those go into the pool:
    the pool then holds what a dense cache of the same entries holds after the same call."""
    calls = []
    monkeypatch.setattr(_decode, "serves", lambda *args: False)
    monkeypatch.setattr(_varlen, "check_call", lambda *args: _cfg(args))
    monkeypatch.setattr(_varlen, "plan", lambda *args: types.SimpleNamespace(
        dense=types.SimpleNamespace(cfg=_cfg(args))))

    def forward(q_rows, *args, **kwargs):
        calls.append(q_rows.clone())  # the rotated queries the kernel would attend
        return torch.zeros_like(q_rows), None, None

    monkeypatch.setattr(_varlen, "forward", forward)
    torch.manual_seed(0)
    q = torch.randn(2, 3, 4, 64, dtype=torch.float16)
    dense_k = torch.randn(2, 16, 2, 64, dtype=torch.float16)
    dense_v = torch.randn(2, 16, 2, 64, dtype=torch.float16)
    table = torch.tensor([[3, 0, 5, 1], [2, 7, 4, 6]], dtype=I32)  # 4 pages of 4 per sequence
    pool_k = torch.full((8, 4, 2, 64), float("nan"), dtype=torch.float16)
    pool_v = pool_k.clone()
    for b in range(2):
        for j in range(16):
            pool_k[table[b, j // 4], j % 4] = dense_k[b, j]
            pool_v[table[b, j // 4], j % 4] = dense_v[b, j]
    kn = torch.randn(2, 2, 2, 64, dtype=torch.float16)
    vn = torch.randn(2, 2, 2, 64, dtype=torch.float16)
    cos, sin = torch.rand(24, 16, dtype=torch.float16), torch.rand(24, 16, dtype=torch.float16)
    seqlens = torch.tensor([5, 11], dtype=I32)
    kw = {"rotary_cos": cos, "rotary_sin": sin, "rotary_interleaved": interleaved,
          "cache_seqlens": seqlens, "causal": True}
    kvcache.flash_attn_with_kvcache(q, dense_k, dense_v, kn, vn, **kw)
    kvcache.flash_attn_with_kvcache(q, pool_k, pool_v, kn, vn, page_table=table, **kw)
    assert len(calls) == 2 and torch.equal(calls[0], calls[1])  # q rotated alike
    new_keys = kvcache._rotate(kn, cos, sin, seqlens.long()[:, None] + torch.arange(2)[None],
                               interleaved)
    for b in range(2):
        s = int(seqlens[b])
        assert torch.equal(dense_k[b, s:s + 2], new_keys[b])  # rotated, not kn
        for j in range(16):
            page, slot = table[b, j // 4], j % 4
            assert torch.equal(pool_k[page, slot], dense_k[b, j]), (b, j)
            assert torch.equal(pool_v[page, slot], dense_v[b, j]), (b, j)
