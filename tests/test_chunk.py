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
    cu_q, cu_k, max_q, max_k, _ = _chunk.pieces(batch, sq, sk, chunk)
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


@pytest.fixture
def fp8_pieces(monkeypatch):
    """The varlen launch of the pieces replaced by a recorder of its offsets and descales (CPU
    tensors passing the device checks); returns the recorded calls."""
    from flash_hopper import _validate, _varlen

    calls = []

    def forward(q, k, v, cu_q, cu_k, *args, descales=None, out=None, need_lse=True, **kwargs):
        calls.append((cu_q.tolist(), cu_k.tolist(), descales))
        rows = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.bfloat16)
        return rows, torch.zeros(q.shape[1], q.shape[0]), None

    monkeypatch.setattr(_varlen, "forward", forward)
    monkeypatch.setattr(_validate, "_check_device", lambda *args: None)
    return calls


def test_fp8_chunks_take_their_sequences_descales(fp8_pieces):
    """FA3 takes attention_chunk with e4m3 inputs: every piece runs with its own sequence's
    (q, k, v) descales rows (a (batch, heads_kv) descale gathered per piece; 0-d ones as they
    are), dense and varlen, checked against the call's batch first."""
    e4m3 = torch.float8_e4m3fn
    q = torch.randn(3, 10, 4, 64).to(e4m3)
    k = torch.randn(3, 12, 2, 64).to(e4m3)
    q_descale = torch.rand(3, 2) + 0.5
    k_descale = torch.rand(3, 1).expand(3, 2)  # any strides
    v_descale = torch.tensor(0.75)
    out = flash_attn_func(q, k, k, causal=True, attention_chunk=4, q_descale=q_descale,
                          k_descale=k_descale, v_descale=v_descale)
    assert out.shape == (3, 10, 4, 64) and out.dtype == torch.bfloat16
    (cu_q, cu_k, descales), = fp8_pieces
    owners = _chunk.split([(10, 10, 12, 12)] * 3, 4)[6]
    assert len(cu_q) - 1 == len(owners) and descales[2] is v_descale
    for p, b in enumerate(owners):  # piece p: rows / keys inside its sequence, its descales
        assert 10 * b <= cu_q[p] <= cu_q[p + 1] <= 10 * (b + 1)
        assert 12 * b <= cu_k[p] <= cu_k[p + 1] <= 12 * (b + 1)
        assert torch.equal(descales[0][p], q_descale[b])
        assert torch.equal(descales[1][p], k_descale[b])
    with raises(ValueError, "k_descale: expected shape (batch, heads_kv) = (3, 2)", "got (2, 2)"):
        flash_attn_func(q, k, k, causal=True, attention_chunk=4, k_descale=q_descale[:2])
    # varlen: sequences of 7 and 3 rows against 12 and 5 keys
    qv, kv = torch.randn(10, 4, 64).to(e4m3), torch.randn(17, 2, 64).to(e4m3)
    cu_q, cu_k = (torch.tensor(x, dtype=torch.int32) for x in ([0, 7, 10], [0, 12, 17]))
    flash_attn_varlen_func(qv, kv, kv, cu_q, cu_k, 7, 12, causal=True, attention_chunk=4,
                           q_descale=q_descale[:2], k_descale=k_descale[:2])
    pieces_q, _, descales = fp8_pieces[-1]
    owners = _chunk.split([(7, 7, 12, 12), (3, 3, 5, 5)], 4)[6]
    for p, b in enumerate(owners):
        assert torch.equal(descales[0][p], q_descale[b]) and descales[2] is None
        assert (0, 7, 10)[b] <= pieces_q[p] <= pieces_q[p + 1] <= (0, 7, 10)[b + 1]


def test_fp8_chunk_refusals_and_varlen_checks_first():
    q8 = torch.zeros(1, 8, 2, 64, dtype=torch.float8_e4m3fn)
    with raises(NotImplementedError, "attention_chunk: expected 0 with 16-bit q against FP8 k / v "
                "or FP8 options"):
        flash_attn_func(q8, q8, q8, attention_chunk=4, out_dtype=torch.float16)
    with raises(NotImplementedError, "attention_chunk: expected 0 with 16-bit q against FP8 k / v"):
        flash_attn_func(q8.bfloat16(), q8, q8, attention_chunk=4)
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with raises(ValueError, "q: must be a CUDA tensor"):
        flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, attention_chunk=4)
    with raises(ValueError, "attention_chunk: expected an int >= 0"):
        flash_attn_varlen_func(q, q, q, cu, cu, 8, 8, attention_chunk=-4)


def varlen_masks(spans, chunk, causal, window):
    """Per sequence (used rows x used keys) visibility assembled from split()'s pieces, with the
    rows and keys outside the used prefixes checked to be in no used piece, and each piece's
    owner the sequence whose rows and keys it lies in (FP8 pieces take its descales)."""
    cu_q, cu_k, used_q, used_k, _, _, owners = _chunk.split(spans, chunk, 5, 3)
    total_q, total_k = 5 + sum(s[0] for s in spans), 3 + sum(s[2] for s in spans)
    assert cu_q[-1] == total_q and cu_k[-1] == total_k
    visible = torch.zeros(total_q, total_k, dtype=torch.bool)
    for i in range(len(cu_q) - 1):
        q0, k0 = cu_q[i], cu_k[i]
        assert 0 <= used_q[i] <= cu_q[i + 1] - q0 and 0 <= used_k[i] <= cu_k[i + 1] - k0
        if used_q[i] and used_k[i]:
            visible[q0:q0 + used_q[i], k0:k0 + used_k[i]] = AttentionMask.from_args(
                used_q[i], used_k[i], causal, window).dense()
    assert len(owners) == len(cu_q) - 1
    starts_q, starts_k = [5], [3]
    for rows, _, keys, _ in spans:
        starts_q.append(starts_q[-1] + rows)
        starts_k.append(starts_k[-1] + keys)
    for i, b in enumerate(owners):
        assert starts_q[b] <= cu_q[i] <= cu_q[i + 1] <= starts_q[b + 1], (i, b)
        assert starts_k[b] <= cu_k[i] <= cu_k[i + 1] <= starts_k[b + 1], (i, b)
    assert owners == sorted(owners)
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
