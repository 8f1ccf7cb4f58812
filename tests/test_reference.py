"""The reference implementations against each other and against independent oracles (CPU).

The reference is the oracle of every kernel test, so it gets its own: the tiled online-softmax
forward must equal the naive one in float64 to rounding, the mask convention is pinned by
hand-written matrices, naive attention agrees with torch's SDPA where their conventions meet, and
the recomputation backward equals autograd through the naive forward. The chunked references (the
benchmark's full-size oracles, forward and backward) equal the naive ones, in both precisions.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from flash_hopper.mask import AttentionMask, KeyBlockSplit
from flash_hopper.reference import (
    attention_bwd_ref,
    attention_bwd_ref_chunked,
    attention_ref,
    attention_ref_chunked,
    attention_tiled_fwd,
)

NEG_INF = float("-inf")


def visible_mask(seqlen_q, seqlen_k, left=-1, right=-1, chunk=0):
    return AttentionMask(seqlen_q, seqlen_k, left, right, chunk).dense()


def _qkv(b, sq, sk, hq, hkv, d, dtype=torch.float64):
    q = torch.randn(b, sq, hq, d, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, dtype=dtype)
    v = torch.randn(b, sk, hkv, d, dtype=dtype)
    return q, k, v


def _assert_same_attention(out, lse, out_ref, lse_ref, atol):
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=0)
    empty = lse_ref == NEG_INF
    assert torch.equal(lse == NEG_INF, empty), "rows without visible keys differ"
    torch.testing.assert_close(lse[~empty], lse_ref[~empty], atol=atol, rtol=0)


# --- the mask convention -------------------------------------------------------------------------


def test_mask_causal_is_bottom_right_aligned():
    # sq < sk: the last query sees every key, the first sees sk - sq + 1 keys.
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(visible_mask(3, 5, -1, 0), expected)
    # sq > sk: the first sq - sk queries see nothing.
    expected = torch.tensor([[0, 0], [0, 0], [1, 0], [1, 1]], dtype=torch.bool)
    assert torch.equal(visible_mask(4, 2, -1, 0), expected)


def test_mask_sliding_window():
    # i sees j iff i + sk - sq - left <= j <= i + sk - sq + right; here sk - sq = 1.
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0],
            [0, 1, 1, 1, 0],
            [0, 0, 1, 1, 1],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(visible_mask(4, 5, 1, 1), expected)
    # One-sided windows: -1 leaves that side unbounded.
    assert torch.equal(visible_mask(3, 3, 0, -1), torch.ones(3, 3, dtype=torch.bool).triu())
    assert torch.equal(visible_mask(3, 3, -1, -1), torch.ones(3, 3, dtype=torch.bool))


def test_mask_chunked_local_attention():
    # attention_chunk = 3, sk - sq = 1: row i's diagonal key is i + 1; it sees the keys of that
    # key's chunk up to the diagonal (causal), so rows 2..4 restart at keys 3 and 6.
    expected = torch.tensor(
        [
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [0, 0, 0, 1, 0, 0, 0],
            [0, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(visible_mask(6, 7, -1, 0, chunk=3), expected)


def test_mask_tile_matches_full_mask():
    mask = AttentionMask(37, 53, 5, 3, 11)
    assert torch.equal(mask.dense(rows=(8, 24), cols=(16, 48)), mask.dense()[8:24, 16:48])


# --- naive reference against independent oracles ------------------------------------------------


@pytest.mark.parametrize(("sq", "sk"), [(1, 1), (17, 17), (33, 17), (17, 33)])
@pytest.mark.parametrize("causal", [False, True])
def test_naive_matches_sdpa(seed, sq, sk, causal):
    b, hq, hkv, d = 2, 4, 2, 16
    q, k, v = _qkv(b, sq, sk, hq, hkv, d)
    out, lse = attention_ref(q, k, v, causal=causal)
    # SDPA in its (b, h, s, d) layout, GQA by repetition, our bottom-right mask given explicitly.
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(hq // hkv, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(hq // hkv, dim=2).transpose(1, 2)
    mask = visible_mask(sq, sk, -1, 0 if causal else -1)
    empty = ~mask.any(dim=-1)
    expected = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).transpose(1, 2)
    expected[:, empty] = 0  # SDPA gives NaN on rows without keys; the contract is 0
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    scores = (qh @ kh.transpose(-1, -2) / d**0.5).masked_fill(~mask, NEG_INF)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-12, rtol=0)


def test_softcap_is_applied_to_the_scaled_score(seed):
    q, k, v = _qkv(1, 5, 7, 1, 1, 8)
    scale, cap = 0.7, 1.3
    out, lse = attention_ref(q, k, v, softmax_scale=scale, softcap=cap)
    s = cap * torch.tanh(torch.einsum("bqhd,bkhd->bhqk", q, k) * scale / cap)
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), atol=1e-12, rtol=0)
    expected = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)


def test_gqa_maps_query_head_to_kv_head_by_group(seed):
    # heads_q = 4, heads_kv = 2: query heads 0, 1 use kv head 0 and 2, 3 use kv head 1.
    q, k, v = _qkv(1, 3, 5, 4, 2, 8)
    out, _ = attention_ref(q, k, v)
    for h in range(4):
        single, _ = attention_ref(q[:, :, h : h + 1], k[:, :, h // 2 : h // 2 + 1],
                                  v[:, :, h // 2 : h // 2 + 1])
        torch.testing.assert_close(out[:, :, h : h + 1], single, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_upcast_controls_the_compute_dtype(seed, dtype):
    q, k, v = _qkv(2, 17, 33, 2, 1, 16, dtype=dtype)
    out_hi, lse_hi = attention_ref(q, k, v, causal=True)
    out_lo, lse_lo = attention_ref(q, k, v, causal=True, upcast=False)
    assert out_hi.dtype == lse_hi.dtype == torch.float32
    assert out_lo.dtype == lse_lo.dtype == dtype
    # Same math, low precision: close but not equal (else the tolerance rule would be vacuous).
    err = (out_lo.float() - out_hi).abs().max().item()
    assert 0 < err < 0.05


# --- fully masked rows ---------------------------------------------------------------------------

EMPTY_ROW_CASES = [
    # (sq, sk, causal, window, rows that see nothing)
    (10, 4, True, (-1, -1), range(6)),  # sq > sk causal: the first sq - sk rows
    (8, 2, False, (1, 0), range(6)),  # a window that ends before key 0 for early rows
    (6, 0, False, (-1, -1), range(6)),  # no keys at all
]


@pytest.mark.parametrize(("sq", "sk", "causal", "window", "empty_rows"), EMPTY_ROW_CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_rows_without_keys_give_zero_and_neg_inf(seed, sq, sk, causal, window, empty_rows, dtype):
    q, k, v = _qkv(2, sq, sk, 4, 2, 16, dtype=dtype)
    empty = torch.zeros(sq, dtype=torch.bool)
    empty[list(empty_rows)] = True
    results = [
        attention_ref(q, k, v, causal=causal, window_size=window),
        attention_ref(q, k, v, causal=causal, window_size=window, upcast=False),
        attention_tiled_fwd(q, k, v, causal=causal, window_size=window, block_m=4, block_n=2),
    ]
    for out, lse in results:
        assert not out.isnan().any() and not lse.isnan().any()
        assert (out[:, empty] == 0).all()
        assert (lse[:, :, empty] == NEG_INF).all()
        assert (lse[:, :, ~empty] > NEG_INF).all()


# --- tiled online softmax == naive ---------------------------------------------------------------

SEQLENS = [(1, 1), (1, 17), (17, 1), (17, 17), (113, 113), (113, 47), (47, 113), (128, 64)]
MASKS = [
    {},
    {"causal": True},
    {"window_size": (8, 0)},  # left-only window (sliding window attention)
    {"window_size": (-1, 5)},  # right-only window
    {"window_size": (3, 7)},
    {"window_size": (0, 0)},  # the diagonal only
    {"softcap": 1.5},
    {"causal": True, "window_size": (16, -1), "softcap": 0.8},
    {"causal": True, "attention_chunk": 24},  # chunked-local (FA3's attention_chunk)
    {"window_size": (5, 40), "attention_chunk": 7},
]


def _mask_id(mask):
    return "-".join(f"{k}={v}" for k, v in mask.items()).replace(" ", "") or "full"


# Heads, head dims and tile sizes rotate through the grid instead of multiplying it: every value
# meets several sequence lengths and masks, and the grid stays at 64 cases of a few ms each.
HEADS = [(1, 1), (4, 2), (8, 1), (6, 3)]
HEAD_DIMS = [8, 24, 40]
BLOCKS = [(64, 64), (16, 32), (32, 16), (1, 7)]
TILED_CASES = [
    pytest.param(
        sq, sk, mask, HEADS[i % 4], HEAD_DIMS[i % 3], BLOCKS[(i // 4) % 4],
        id=f"sq{sq}-sk{sk}-{_mask_id(mask)}-h{HEADS[i % 4]}-d{HEAD_DIMS[i % 3]}-"
        f"blk{BLOCKS[(i // 4) % 4]}".replace(" ", ""),
    )
    for i, ((sq, sk), mask) in enumerate(itertools.product(SEQLENS, MASKS))
]


@pytest.mark.parametrize(("sq", "sk", "mask", "heads", "d", "blocks"), TILED_CASES)
def test_tiled_matches_naive(seed, sq, sk, mask, heads, d, blocks):
    hq, hkv = heads
    q, k, v = _qkv(2, sq, sk, hq, hkv, d)
    out_ref, lse_ref = attention_ref(q, k, v, **mask)
    out, lse = attention_tiled_fwd(q, k, v, **mask, block_m=blocks[0], block_n=blocks[1])
    assert out.shape == (2, sq, hq, d) and lse.shape == (2, hq, sq)
    _assert_same_attention(out, lse, out_ref, lse_ref, atol=1e-12)


def test_tiled_walks_the_kernels_blocks(monkeypatch):
    # The tiled forward asks the mask policy for its blocks; a policy that calls a partially
    # visible block unmasked must make it differ from the naive reference (so the tiled tests
    # above do check the split, not just the online softmax).
    q, k, v = _qkv(1, 40, 70, 1, 1, 8)
    out_ref, _ = attention_ref(q, k, v, causal=True)

    def too_wide(self, block_range, m_block, block_m, block_n):
        return KeyBlockSplit(block_range.n_min, block_range.n_max)

    monkeypatch.setattr(AttentionMask, "unmasked_blocks", too_wide)
    out, _ = attention_tiled_fwd(q, k, v, causal=True, block_m=16, block_n=16)
    assert (out - out_ref).abs().max() > 1e-3


# --- the chunked reference == naive --------------------------------------------------------------

CHUNKED_CASES = [
    # (sq, sk, mask, max_scores): budgets of one row, a few rows, and more than the whole matrix
    (37, 53, {"causal": True}, 1),
    (53, 37, {"causal": True, "window_size": (7, -1)}, 2 * 4 * 37 * 5),
    (64, 64, {"window_size": (3, 9), "softcap": 1.5}, 1 << 20),
    (29, 41, {"attention_chunk": 8}, 2 * 4 * 41 * 3),
    (17, 0, {}, 100),  # no keys: rows give 0 and -inf
]


@pytest.mark.parametrize(("sq", "sk", "mask", "max_scores"), CHUNKED_CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_chunked_matches_naive(seed, sq, sk, mask, max_scores, dtype):
    q, k, v = _qkv(2, sq, sk, 4, 2, 16, dtype=dtype)
    for upcast in (True, False):
        out_ref, lse_ref = attention_ref(q, k, v, upcast=upcast, **mask)
        out, lse = attention_ref_chunked(q, k, v, upcast=upcast, max_scores=max_scores, **mask)
        assert out.dtype == out_ref.dtype and lse.dtype == lse_ref.dtype
        # Same operations on the same rows; a matmul of fewer rows may sum in another order.
        atol = {torch.float64: 1e-12, torch.float32: 1e-6}.get(out_ref.dtype, 1e-2)
        _assert_same_attention(out, lse, out_ref, lse_ref, atol=atol)


# --- backward by recomputation == autograd -------------------------------------------------------

BWD_CASES = [
    # (sq, sk, hq, hkv, d, mask): causal, windows, softcap, GQA / MQA, sq != sk both ways
    (17, 17, 2, 2, 16, {}),
    (17, 33, 4, 2, 16, {"causal": True}),
    (33, 17, 4, 1, 8, {"causal": True}),  # rows without keys
    (40, 40, 4, 2, 24, {"window_size": (5, 3)}),
    (23, 31, 8, 1, 16, {"window_size": (-1, 2), "softcap": 1.2}),
    (1, 17, 2, 1, 8, {"softcap": 0.5}),
    (17, 1, 2, 2, 8, {"causal": True, "softcap": 2.0}),
    (31, 31, 2, 1, 8, {"causal": True, "attention_chunk": 6}),
    (30, 20, 4, 2, 8, {"window_size": (1, 0)}),  # rows 0-9 see no key
    (20, 30, 4, 2, 8, {"window_size": (2, 0), "softcap": 1.5}),  # keys 0-7 seen by no query
    (9, 0, 2, 1, 8, {}),  # no keys at all
]


def _case_id(case):
    sq, sk, hq, hkv, d, mask = case
    return f"sq{sq}-sk{sk}-h{hq}:{hkv}-d{d}-{_mask_id(mask)}".replace(" ", "")


@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
@pytest.mark.parametrize(("sq", "sk", "hq", "hkv", "d", "mask"), BWD_CASES,
                         ids=[_case_id(c) for c in BWD_CASES])
def test_backward_recomputation_matches_autograd(seed, sq, sk, hq, hkv, d, mask, with_dlse):
    q, k, v = (t.requires_grad_() for t in _qkv(2, sq, sk, hq, hkv, d))
    out, lse = attention_ref(q, k, v, softmax_scale=0.3, **mask)
    dout = torch.randn_like(out)
    # The gradient of the returned lse (return_attn_probs users who backprop through it); on
    # every row, also those with lse = -inf, where it must change nothing.
    dlse = torch.randn_like(lse) if with_dlse else None
    outputs, grads = ((out, lse), (dout, dlse)) if with_dlse else ((out,), (dout,))
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(outputs, (q, k, v), grads, allow_unused=True)
    dq_ref, dk_ref, dv_ref = (torch.zeros_like(t) if g is None else g
                              for g, t in ((dq_ref, q), (dk_ref, k), (dv_ref, v)))
    dq, dk, dv = attention_bwd_ref(
        q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dout,
        softmax_scale=0.3, dlse=dlse, **mask,
    )
    for got, expected in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert not got.isnan().any() and not expected.isnan().any()
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)

    # Rows that see no key and keys no query sees get gradients of exactly 0.
    visible = AttentionMask.from_args(sq, sk, mask.get("causal", False),
                                      mask.get("window_size", (-1, -1)),
                                      mask.get("attention_chunk", 0)).dense()
    empty_rows, empty_keys = ~visible.any(dim=1), ~visible.any(dim=0)
    assert (dq[:, empty_rows] == 0).all()
    assert (dk[:, empty_keys] == 0).all() and (dv[:, empty_keys] == 0).all()


def test_the_grids_rows_and_keys_that_see_nothing():
    # The grid above must hold both kinds of empty line, or its exact-zero checks check nothing.
    rows = AttentionMask.from_args(30, 20, False, (1, 0), 0).dense()
    keys = AttentionMask.from_args(20, 30, False, (2, 0), 0).dense()
    assert (~rows.any(dim=1)).nonzero().flatten().tolist() == list(range(10))
    assert (~keys.any(dim=0)).nonzero().flatten().tolist() == list(range(8))


def test_dlse_changes_the_gradients_as_p_times_dlse(seed):
    # dlse enters as D - dlse: with dO = 0 the whole gradient is the lse's, dS = P * dlse, so
    # dV = 0 and dQ = scale * (P * dlse) K, which pins the sign and the scale.
    q, k, v = _qkv(1, 5, 7, 1, 1, 8)
    out, lse = attention_ref(q, k, v, softmax_scale=0.5)
    dlse = torch.randn_like(lse)
    dq, dk, dv = attention_bwd_ref(q, k, v, out, lse, torch.zeros_like(out), softmax_scale=0.5,
                                   dlse=dlse)
    p = torch.softmax(q[0, :, 0] @ k[0, :, 0].T * 0.5, dim=-1)  # (sq, sk)
    ds = p * dlse[0, 0].unsqueeze(-1)
    torch.testing.assert_close(dq[0, :, 0], ds @ k[0, :, 0] * 0.5, atol=1e-12, rtol=0)
    torch.testing.assert_close(dk[0, :, 0], ds.T @ q[0, :, 0] * 0.5, atol=1e-12, rtol=0)
    assert (dv == 0).all()


# --- the chunked backward == attention_bwd_ref ---------------------------------------------------

# Budgets: 1 score (less than one row's: one row per block), three rows, and more than the whole
# matrix (one block). For the three-row budget 2 * hq * sk * 3 is the batch-2 row count times 3.
CHUNK_BUDGETS = ["one-row", "three-rows", "whole"]


def _chunk_scores(budget, hq, sk):
    return {"one-row": 1, "three-rows": 2 * hq * sk * 3, "whole": 1 << 30}[budget]


def _bwd_inputs(sq, sk, hq, hkv, d, mask, dtype=torch.float64, with_dlse=False):
    q, k, v = _qkv(2, sq, sk, hq, hkv, d, dtype=dtype)
    out, lse = attention_ref(q, k, v, softmax_scale=0.3, **mask)
    dout = torch.randn(out.shape, dtype=dtype)
    dlse = torch.randn_like(lse) if with_dlse else None
    return q, k, v, out, lse, dout, dlse


@pytest.mark.parametrize("budget", CHUNK_BUDGETS)
@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
@pytest.mark.parametrize(("sq", "sk", "hq", "hkv", "d", "mask"), BWD_CASES,
                         ids=[_case_id(c) for c in BWD_CASES])
def test_chunked_backward_matches_unchunked(seed, sq, sk, hq, hkv, d, mask, with_dlse, budget):
    q, k, v, out, lse, dout, dlse = _bwd_inputs(sq, sk, hq, hkv, d, mask, with_dlse=with_dlse)
    expected = attention_bwd_ref(q, k, v, out, lse, dout, softmax_scale=0.3, dlse=dlse, **mask)
    got = attention_bwd_ref_chunked(q, k, v, out, lse, dout, softmax_scale=0.3, dlse=dlse,
                                    chunk_scores=_chunk_scores(budget, hq, sk), **mask)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype == torch.float64, name
        assert not g.isnan().any(), name
        torch.testing.assert_close(g, e, atol=1e-10, rtol=0, msg=name)


def test_chunked_backward_walks_blocks_of_rows(monkeypatch):
    # The budget must really split the rows: count the blocks _bwd_rows is called with.
    from flash_hopper import reference

    calls = []
    original = reference._bwd_rows

    def counting(qh, *args):
        calls.append(qh.shape[2])
        return original(qh, *args)

    monkeypatch.setattr(reference, "_bwd_rows", counting)
    q, k, v, out, lse, dout, _ = _bwd_inputs(10, 7, 2, 1, 8, {"causal": True})
    attention_bwd_ref_chunked(q, k, v, out, lse, dout, chunk_scores=1)
    assert calls == [1] * 10
    calls.clear()
    attention_bwd_ref_chunked(q, k, v, out, lse, dout, chunk_scores=2 * 2 * 7 * 4)
    assert calls == [4, 4, 2]


@pytest.mark.parametrize("budget", ["one-row", "whole"])
def test_chunked_backward_in_fp32_and_in_the_input_dtype(seed, budget):
    # bf16 inputs: upcast=True is attention_bwd_ref in fp32; upcast=False is a same-precision
    # implementation, bf16 out, off by bf16 roundings (not 0, not more), whatever the block size.
    sq, sk, hq, hkv, d, mask = 33, 41, 4, 2, 16, {"causal": True, "softcap": 1.5}
    q, k, v = _qkv(2, sq, sk, hq, hkv, d, dtype=torch.bfloat16)
    out, lse = attention_ref(q, k, v, **mask)  # fp32
    dout = torch.randn(out.shape).to(torch.bfloat16)
    scores = _chunk_scores(budget, hq, sk)
    exact = attention_bwd_ref(q.double(), k.double(), v.double(), out.double(), lse.double(),
                              dout.double(), **mask)
    fp32 = attention_bwd_ref_chunked(q, k, v, out, lse, dout, chunk_scores=scores, **mask)
    lowp = attention_bwd_ref_chunked(q, k, v, out, lse, dout, chunk_scores=scores, upcast=False,
                                     **mask)
    for name, e, g32, glow in zip(("dq", "dk", "dv"), exact, fp32, lowp):
        assert g32.dtype == torch.float32 and glow.dtype == torch.bfloat16, name
        torch.testing.assert_close(g32.double(), e, atol=1e-5, rtol=0, msg=name)
        lowp_err = (glow.double() - e).abs().max().item()
        scale = e.abs().max().item()
        assert 2**-12 * scale < lowp_err < 2**-4 * scale, (name, lowp_err, scale)
