"""FA3's attention_chunk on CPU: the decomposition into independent, bottom-right aligned pieces
(_chunk.pieces) reproduces the chunk rule of mask.py combined with every causal / window mask,
row by row; argument checks. The GPU half is in tests/test_chunk_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch
from _helpers import raises
from flash_hopper import _chunk, flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func
from flash_hopper.mask import AttentionMask


def assembled_mask(batch, sq, sk, chunk, causal, window):
    """(batch, sq, sk) visibility of the pieces, each masked by its own bottom-right aligned
    window (what the varlen call computes)."""
    cu_q, cu_k, max_q, max_k = _chunk.pieces(batch, sq, sk, chunk)
    visible = torch.zeros(batch * sq, batch * sk, dtype=torch.bool)
    covered = torch.zeros(batch * sq, dtype=torch.int32)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        assert 0 <= q1 - q0 <= max_q and 0 <= k1 - k0 <= max_k
        covered[q0:q1] += 1
        if q1 > q0 and k1 > k0:
            visible[q0:q1, k0:k1] = AttentionMask.from_args(q1 - q0, k1 - k0, causal,
                                                            window).dense()
    assert cu_q[-1] == batch * sq and cu_k[-1] == batch * sk
    assert (covered == 1).all(), "every row in exactly one piece"
    return torch.stack([visible[b * sq:(b + 1) * sq, b * sk:(b + 1) * sk] for b in range(batch)])


CASES = [(1, 16, 16, 4), (2, 17, 17, 5), (1, 9, 20, 4), (2, 20, 9, 4), (1, 8, 8, 8),
         (1, 8, 8, 100), (1, 12, 5, 100), (3, 5, 0, 3), (1, 1, 33, 7), (1, 33, 1, 7)]


@pytest.mark.parametrize(("batch", "sq", "sk", "chunk"), CASES)
@pytest.mark.parametrize(("causal", "window"), [(False, (-1, -1)), (True, (-1, -1)),
                                                (False, (3, 2)), (True, (2, -1)),
                                                (False, (0, 0))])
def test_pieces_reproduce_the_chunk_rule(batch, sq, sk, chunk, causal, window):
    want = AttentionMask.from_args(sq, sk, causal, window, chunk).dense() if sk else \
        torch.zeros(sq, 0, dtype=torch.bool)
    got = assembled_mask(batch, sq, sk, chunk, causal, window)
    for b in range(batch):
        assert torch.equal(got[b], want), (b, got[b].int(), want.int())


def test_pieces_random():
    rng = random.Random(3)
    for _ in range(300):
        sq, sk = rng.randint(1, 40), rng.randint(0, 40)
        chunk = rng.randint(1, 2 * max(sk, 1))
        window = (rng.choice([-1, rng.randint(0, 10)]), rng.choice([-1, rng.randint(0, 10)]))
        causal = rng.random() < 0.4
        if not _chunk.restricts(chunk, sq, sk):
            continue
        want = AttentionMask.from_args(sq, sk, causal, window, chunk).dense() if sk else \
            torch.zeros(sq, 0, dtype=torch.bool)
        got = assembled_mask(2, sq, sk, chunk, causal, window)
        assert torch.equal(got[1], want), (sq, sk, chunk, causal, window)


@pytest.mark.parametrize(("chunk", "sq", "sk", "restricts"), [
    (8, 8, 8, False), (8, 4, 8, False), (7, 8, 8, True), (8, 9, 8, True), (100, 5, 3, True),
    (1, 1, 1, False)])
def test_when_the_chunk_hides_nothing(chunk, sq, sk, restricts):
    assert _chunk.restricts(chunk, sq, sk) is restricts
    if not restricts:  # then the rule itself hides nothing
        assert AttentionMask.from_args(sq, sk, False, (-1, -1), chunk).dense().all()


@pytest.mark.parametrize(("value", "exc", "fragment"), [
    (-1, ValueError, "attention_chunk: expected an int >= 0"),
    (1.5, TypeError, "attention_chunk: expected an int >= 0"),
    (True, TypeError, "attention_chunk: expected an int >= 0")])
def test_bad_chunk(value, exc, fragment):
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with raises(exc, fragment):
        flash_attn_func(q, q, q, attention_chunk=value)
    with raises(exc, fragment):
        flash_attn_qkvpacked_func(torch.zeros(1, 8, 3, 2, 64, dtype=torch.bfloat16),
                                  attention_chunk=value)


def test_chunk_reaches_validation_and_the_device_check():
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with raises(ValueError, "q: must be a CUDA tensor"):
        flash_attn_func(q, q, q, attention_chunk=3)
    with raises(ValueError, "k: expected"):
        flash_attn_func(q, q[:, :, :, :32], q, attention_chunk=3)


def test_fp8_refuses_a_chunk_and_varlen_checks_first():
    q8 = torch.zeros(1, 8, 2, 64, dtype=torch.float8_e4m3fn)
    with raises(NotImplementedError, "attention_chunk: expected 0 with FP8"):
        flash_attn_func(q8, q8, q8, attention_chunk=4)
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with raises(ValueError, "q: must be a CUDA tensor"):
        flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, attention_chunk=4)
    with raises(ValueError, "attention_chunk: expected an int >= 0"):
        flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, attention_chunk=-4)


def varlen_masks(spans, chunk, causal, window):
    """Per sequence (used rows x used keys) visibility assembled from split()'s pieces, with the
    rows and keys outside the used prefixes checked to be in no used piece."""
    cu_q, cu_k, used_q, used_k, _, _ = _chunk.split(spans, chunk, 5, 3)
    total_q, total_k = 5 + sum(s[0] for s in spans), 3 + sum(s[2] for s in spans)
    assert cu_q[-1] == total_q and cu_k[-1] == total_k
    visible = torch.zeros(total_q, total_k, dtype=torch.bool)
    for i in range(len(cu_q) - 1):
        q0, k0 = cu_q[i], cu_k[i]
        assert 0 <= used_q[i] <= cu_q[i + 1] - q0 and 0 <= used_k[i] <= cu_k[i + 1] - k0
        if used_q[i] and used_k[i]:
            visible[q0:q0 + used_q[i], k0:k0 + used_k[i]] = AttentionMask.from_args(
                used_q[i], used_k[i], causal, window).dense()
    masks, q0, k0 = [], 5, 3
    for rows, sq, keys, sk in spans:
        block = visible[q0:q0 + rows, k0:k0 + keys]
        assert not block[sq:].any() and not block[:, sk:].any()
        assert not visible[q0:q0 + rows, :k0].any() and not visible[q0:q0 + rows, k0 + keys:].any()
        masks.append(block[:sq, :sk])
        q0, k0 = q0 + rows, k0 + keys
    return masks


def test_split_of_varlen_sequences_with_unused_tails():
    rng = random.Random(5)
    for _ in range(200):
        spans = []
        for _ in range(rng.randint(1, 4)):
            rows, keys = rng.randint(0, 30), rng.randint(0, 30)
            spans.append((rows, rng.randint(0, rows), keys, rng.randint(0, keys)))
        chunk = rng.randint(1, 40)
        causal = rng.random() < 0.5
        window = (rng.choice([-1, rng.randint(0, 8)]), rng.choice([-1, rng.randint(0, 8)]))
        for (rows, sq, keys, sk), got in zip(spans, varlen_masks(spans, chunk, causal, window)):
            want = AttentionMask.from_args(sq, sk, causal, window, chunk).dense() if sk else \
                torch.zeros(sq, 0, dtype=torch.bool)
            assert torch.equal(got, want), (spans, chunk, causal, window)
