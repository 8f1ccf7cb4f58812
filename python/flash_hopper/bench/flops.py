"""FLOP counts for attention, by the FlashAttention convention.

Forward work is two GEMMs per visible (query i, key j) pair: S = QK^T costs 2*d_qk FLOPs per pair
and O = PV costs 2*d_v, so fwd = 2 * batch * heads * pairs * (d_qk + d_v) = 4 * b * h * pairs * d.
Backward is counted as 2.5x forward (five GEMMs instead of two), again the FA papers' convention.

Visible pairs follow the numerics contract (DESIGN.md): with o = seqlen_k - seqlen_q (bottom-right
alignment), query i sees key j iff i + o - left <= j <= i + o + right, -1 meaning unbounded; causal
is right = 0. The count is exact, with one deliberate exception: plain causal with seqlen_q ==
seqlen_k (no left window) counts s^2 / 2 pairs instead of the exact s * (s + 1) / 2, because that is
how FlashAttention 2/3 and the papers report causal TFLOP/s, and our numbers must be comparable with
theirs. The difference is s / 2 pairs, under 0.1 % at s = 512.
"""

from __future__ import annotations

DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
# Backward = 2.5 x forward; fwd+bwd is therefore 3.5 x forward.
DIRECTION_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def effective_window(causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    """(left, right) with -1 for unbounded; causal caps right at 0 as FA3's interface does."""
    left, right = window
    left = -1 if left < 0 else left
    right = -1 if right < 0 else right
    if causal:
        right = 0
    return left, right


def _clamped_prefix(y: int, n: int) -> int:
    """sum_{x=1..y} min(x, n), and 0 for y <= 0: the building block of the closed form."""
    if y <= 0:
        return 0
    if y <= n:
        return y * (y + 1) // 2
    return n * (n + 1) // 2 + (y - n) * n


def _pairs_at_or_below(c: int, seqlen_q: int, seqlen_k: int) -> int:
    """#{(i, j): 0 <= i < seqlen_q, 0 <= j < seqlen_k, j - i <= c}.

    Row i contributes clamp(i + c + 1, 0, seqlen_k); summing that arithmetic run with clamping is a
    difference of two clamped prefix sums.
    """
    return _clamped_prefix(c + seqlen_q, seqlen_k) - _clamped_prefix(c, seqlen_k)


def visible_pairs_exact(seqlen_q: int, seqlen_k: int, causal: bool = False,
                        window: tuple[int, int] = (-1, -1)) -> int:
    """Exact number of visible (i, j) pairs per (batch, head), in closed form (O(1))."""
    if seqlen_q <= 0 or seqlen_k <= 0:
        return 0
    left, right = effective_window(causal, window)
    offset = seqlen_k - seqlen_q
    upper = seqlen_q * seqlen_k if right < 0 else _pairs_at_or_below(offset + right, seqlen_q,
                                                                     seqlen_k)
    lower = 0 if left < 0 else _pairs_at_or_below(offset - left - 1, seqlen_q, seqlen_k)
    return upper - lower


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False,
                  window: tuple[int, int] = (-1, -1)) -> float:
    """Pairs used for FLOP accounting: exact, except the FA convention s^2/2 for plain causal."""
    left, _ = effective_window(causal, window)
    if causal and seqlen_q == seqlen_k and left < 0:
        return seqlen_q * seqlen_k / 2
    return float(visible_pairs_exact(seqlen_q, seqlen_k, causal, window))


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool = False, window: tuple[int, int] = (-1, -1),
                    direction: str = "fwd", head_dim_v: int = 0) -> float:
    """FLOPs of one attention call (see the module docstring for the convention)."""
    if direction not in DIRECTION_FACTOR:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    d_v = head_dim_v or head_dim
    pairs = visible_pairs(seqlen_q, seqlen_k, causal, window)
    return 2.0 * batch * heads * pairs * (head_dim + d_v) * DIRECTION_FACTOR[direction]
