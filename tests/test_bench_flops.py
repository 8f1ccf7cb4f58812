"""FLOP accounting: closed-form visible-pair counts against brute force, and the FA convention.

Grid: lengths cover 1 (degenerate), odd, equal and both orders of seqlen_q vs seqlen_k (bottom-right
alignment shifts the diagonal either way); windows cover each bound alone, both, zero-width, and
wider than the sequence.
"""

import itertools

import pytest
from flash_hopper.bench.flops import (
    attention_flops,
    effective_window,
    visible_pairs,
    visible_pairs_exact,
)

LENGTHS = (1, 2, 5, 17, 64)
WINDOWS = ((-1, -1), (0, 0), (3, 0), (0, 3), (5, 2), (-1, 4), (7, -1), (100, 100))


def brute_force_pairs(seqlen_q, seqlen_k, causal, window):
    """Count straight from DESIGN.md's rule: i + sk - sq - left <= j <= i + sk - sq + right."""
    left, right = window
    if causal:
        right = 0
    count = 0
    for i in range(seqlen_q):
        for j in range(seqlen_k):
            diag = i + seqlen_k - seqlen_q
            if (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right):
                count += 1
    return count


@pytest.mark.parametrize("seqlen_q,seqlen_k", list(itertools.product(LENGTHS, LENGTHS)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_closed_form_matches_brute_force(seqlen_q, seqlen_k, causal, window):
    expected = brute_force_pairs(seqlen_q, seqlen_k, causal, window)
    assert visible_pairs_exact(seqlen_q, seqlen_k, causal, window) == expected


def test_closed_form_large_lengths_against_row_sum():
    # O(sq) row sums stand in for brute force at sizes where O(sq*sk) would be slow.
    for sq, sk, causal, window in [(16384, 16384, True, (-1, -1)), (1000, 3000, True, (-1, -1)),
                                   (3000, 1000, True, (-1, -1)), (4096, 4096, False, (256, 0)),
                                   (4096, 8192, False, (1024, 1024))]:
        left, right = effective_window(causal, window)
        total = 0
        for i in range(sq):
            diag = i + sk - sq
            lo = 0 if left < 0 else max(0, diag - left)
            hi = sk - 1 if right < 0 else min(sk - 1, diag + right)
            total += max(0, hi - lo + 1)
        assert visible_pairs_exact(sq, sk, causal, window) == total


def test_causal_square_uses_fa_convention():
    s = 4096
    assert visible_pairs_exact(s, s, causal=True) == s * (s + 1) // 2
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


def test_empty_sequences():
    assert visible_pairs_exact(0, 10) == 0
    assert visible_pairs_exact(10, 0, causal=True) == 0
