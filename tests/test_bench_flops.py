"""FLOP accounting: visible-pair counts (flash_hopper.mask's interval sums) against brute force,
and the FA convention.

Grid: lengths cover 1 (degenerate), odd, equal and both orders of seqlen_q vs seqlen_k (bottom-right
alignment shifts the diagonal either way); windows cover each bound alone, both, zero-width, and
wider than the sequence; chunks cover off, 1 (the diagonal's own chunk only), odd and wider than
the sequence.
"""

import itertools

import pytest
from flash_hopper.bench.flops import attention_flops, visible_pairs
from flash_hopper.mask import AttentionMask

LENGTHS = (1, 2, 5, 17, 64)
WINDOWS = ((-1, -1), (0, 0), (3, 0), (0, 3), (5, 2), (-1, 4), (7, -1), (100, 100))
CHUNKS = (0, 1, 6, 100)


def brute_force_pairs(seqlen_q, seqlen_k, causal, window, chunk=0):
    """Count straight from the numerics contract's rule (docs/README.md):
    i + sk - sq - left <= j <= i + sk - sq + right, and with attention_chunk, j in the chunk of the
    diagonal key i + sk - sq."""
    left, right = window
    if causal:
        right = 0
    count = 0
    for i in range(seqlen_q):
        diag = i + seqlen_k - seqlen_q
        for j in range(seqlen_k):
            in_window = (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)
            in_chunk = chunk <= 0 or diag // chunk == j // chunk
            count += in_window and in_chunk
    return count


def exact_pairs(seqlen_q, seqlen_k, causal=False, window=(-1, -1), chunk=0):
    return AttentionMask.from_args(seqlen_q, seqlen_k, causal, window, chunk).visible_pairs()


@pytest.mark.parametrize("seqlen_q,seqlen_k", list(itertools.product(LENGTHS, LENGTHS)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_exact_count_matches_brute_force(seqlen_q, seqlen_k, causal, window):
    for chunk in CHUNKS:
        expected = brute_force_pairs(seqlen_q, seqlen_k, causal, window, chunk)
        assert exact_pairs(seqlen_q, seqlen_k, causal, window, chunk) == expected, chunk


def test_flop_counter_uses_the_exact_count_off_the_convention():
    # Everything but plain square causal: FLOPs = 4 * b * h * d * (brute-force pairs).
    for sq, sk, causal, window, chunk in [(17, 64, True, (-1, -1), 0), (64, 17, False, (3, 0), 0),
                                          (17, 17, True, (5, -1), 0), (17, 17, True, (-1, -1), 6),
                                          (64, 64, False, (-1, -1), 5)]:
        pairs = brute_force_pairs(sq, sk, causal, window, chunk)
        assert attention_flops(2, 3, sq, sk, 16, causal, window, chunk=chunk) == \
            4 * 2 * 3 * 16 * pairs


def test_exact_count_large_lengths_against_row_sum():
    # O(sq) row sums written out here stand in for brute force where O(sq*sk) would be slow.
    for sq, sk, causal, window in [(16384, 16384, True, (-1, -1)), (1000, 3000, True, (-1, -1)),
                                   (3000, 1000, True, (-1, -1)), (4096, 4096, False, (256, 0)),
                                   (4096, 8192, False, (1024, 1024))]:
        left, right = window[0], 0 if causal else window[1]
        total = 0
        for i in range(sq):
            diag = i + sk - sq
            lo = 0 if left < 0 else max(0, diag - left)
            hi = sk - 1 if right < 0 else min(sk - 1, diag + right)
            total += max(0, hi - lo + 1)
        assert exact_pairs(sq, sk, causal, window) == total


def test_causal_square_uses_fa_convention():
    s = 4096
    assert exact_pairs(s, s, causal=True) == s * (s + 1) // 2
    assert visible_pairs(s, s, causal=True) == s * s / 2
    b, h, d = 4, 16, 128
    assert attention_flops(b, h, s, s, d, causal=True) == 4 * b * s * s * h * d / 2


def test_causal_rectangular_is_exact_bottom_right():
    # sq=2, sk=5: row 0 sees keys 0..3, row 1 sees 0..4.
    assert visible_pairs(2, 5, causal=True) == 9
    # sq=5, sk=2: rows 0..2 see nothing, row 3 sees key 0, row 4 sees keys 0..1.
    assert visible_pairs(5, 2, causal=True) == 3
    assert attention_flops(1, 1, 2, 5, 64, causal=True) == 4 * 9 * 64


def test_window_counts_attended_keys():
    # Local window (256, 0) at s=4096: row i sees min(i, 256) + 1 keys.
    s, left = 4096, 256
    expected = sum(min(i, left) + 1 for i in range(s))
    assert visible_pairs(s, s, window=(left, 0)) == expected
    # A causal window keeps the exact count: the s^2/2 convention is for plain causal only.
    assert visible_pairs(s, s, causal=True, window=(left, -1)) == expected


def test_noncausal_and_directions():
    b, h, s, d = 1, 16, 16384, 128
    fwd = attention_flops(b, h, s, s, d)
    assert fwd == 4 * b * h * s * s * d
    assert attention_flops(b, h, s, s, d, direction="bwd") == 2.5 * fwd
    assert attention_flops(b, h, s, s, d, direction="fwd+bwd") == 3.5 * fwd
    with pytest.raises(ValueError, match="direction"):
        attention_flops(b, h, s, s, d, direction="sideways")


def test_head_dim_v_counts_pv_gemm_separately():
    assert attention_flops(1, 1, 8, 8, 64, head_dim_v=128) == 2 * 64 * (64 + 128)


def test_convention_is_for_plain_causal_only():
    s = 64
    assert visible_pairs(s, s, causal=True, chunk=16) == exact_pairs(s, s, True, chunk=16)
    assert visible_pairs(s, s + 1, causal=True) == exact_pairs(s, s + 1, True)


def test_empty_sequences():
    assert visible_pairs(0, 10) == 0
    assert visible_pairs(10, 0, causal=True) == 0
    assert visible_pairs(0, 0, causal=True) == 0
