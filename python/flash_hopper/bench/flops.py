"""FLOP counts for attention, by the FlashAttention convention.

Forward work is two GEMMs per visible (query i, key j) pair: S = QK^T costs 2*d_qk FLOPs per pair
and O = PV costs 2*d_v, so fwd = 2 * batch * heads * pairs * (d_qk + d_v) = 4 * b * h * pairs * d.
Backward is counted as 2.5x forward (five GEMMs instead of two), again the FA papers' convention.

Visible pairs are flash_hopper.mask's (the mirror of the kernels' mask policy: bottom-right aligned
causal and windows, FA3's attention_chunk), counted exactly, with one deliberate exception: plain
causal with seqlen_q == seqlen_k (no left window, no chunk) counts s^2 / 2 pairs instead of the
exact s * (s + 1) / 2, because that is how FlashAttention 2/3 and the papers report causal
TFLOP/s, and our numbers must be comparable with theirs. The difference is s / 2 pairs, under
0.1 % at s = 512.
"""

from __future__ import annotations

from flash_hopper.mask import AttentionMask

DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
# Backward = 2.5 x forward; fwd+bwd is therefore 3.5 x forward.
DIRECTION_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False,
                  window: tuple[int, int] = (-1, -1), chunk: int = 0) -> float:
    """Pairs used for FLOP accounting: exact, except the FA convention s^2/2 for plain causal."""
    mask = AttentionMask.from_args(seqlen_q, seqlen_k, causal, window, chunk)
    if mask.is_plain_causal and seqlen_q == seqlen_k:
        return seqlen_q * seqlen_k / 2
    return float(mask.visible_pairs())


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool = False, window: tuple[int, int] = (-1, -1),
                    direction: str = "fwd", head_dim_v: int = 0, chunk: int = 0) -> float:
    """FLOPs of one attention call (see the module docstring for the convention)."""
    if direction not in DIRECTION_FACTOR:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    d_v = head_dim_v or head_dim
    pairs = visible_pairs(seqlen_q, seqlen_k, causal, window, chunk)
    return 2.0 * batch * heads * pairs * (head_dim + d_v) * DIRECTION_FACTOR[direction]
