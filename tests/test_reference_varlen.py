"""attention_varlen_ref (the varlen reference) against attention_ref per sequence, on the
CPU: packed sequences of mixed lengths (0, 1, 63-65, longer), seqused shorter than the packed
span (the tokens past it must not matter), causal / windows / softcap, GQA, and gradients."""

from __future__ import annotations

import pytest
import torch
from flash_hopper.reference import attention_ref, attention_varlen_ref


def packed(lengths_q, lengths_k, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lengths_k), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lengths_k), hkv, d, generator=g, dtype=torch.float64)
    cu = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu(lengths_q), cu(lengths_k)


@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window_size": (7, 3)},
                                    {"softcap": 2.0, "causal": True}],
                         ids=["full", "causal", "window", "softcap-causal"])
def test_each_sequence_is_attention_ref_on_its_rows(kwargs):
    lengths_q, lengths_k = [0, 1, 63, 64, 65, 130], [5, 0, 64, 70, 1, 200]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, **kwargs)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for b in range(len(lengths_q)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows.start == rows.stop:
            continue
        want, want_lse = attention_ref(q[None, rows], k[None, keys], v[None, keys], **kwargs)
        torch.testing.assert_close(out[rows], want[0])
        torch.testing.assert_close(lse[:, rows], want_lse[0])
    # the sequence with no keys: zeros and -inf
    assert (out[int(cu_q[1]):int(cu_q[2])] == 0).all()
    assert torch.isneginf(lse[:, int(cu_q[1]):int(cu_q[2])]).all()


def test_tokens_past_seqused_do_not_matter_and_stay_unwritten():
    lengths = [40, 70, 33]
    q, k, v, cu_q, cu_k = packed(lengths, lengths, seed=1)
    seqused_q = torch.tensor([30, 70, 0], dtype=torch.int32)
    seqused_k = torch.tensor([35, 50, 10], dtype=torch.int32)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, seqused_q, seqused_k, causal=True)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for b in range(3):  # NaN past each sequence's used keys
        poisoned_k[int(cu_k[b]) + int(seqused_k[b]):int(cu_k[b + 1])] = float("nan")
        poisoned_v[int(cu_k[b]) + int(seqused_k[b]):int(cu_k[b + 1])] = float("nan")
    out2, lse2 = attention_varlen_ref(q, poisoned_k, poisoned_v, cu_q, cu_k, seqused_q,
                                      seqused_k, causal=True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert (out[30:40] == 0).all() and torch.isneginf(lse[:, 30:40]).all()
    assert (out[110:] == 0).all()  # the third sequence uses no query row


def test_gradients_flow_per_sequence():
    q, k, v, cu_q, cu_k = packed([3, 9], [4, 12], seed=2)
    q.requires_grad_(True)
    out, _ = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    out.sum().backward()
    want_q = q.detach().clone().requires_grad_(True)
    o1, _ = attention_ref(want_q[None, :3], k[None, :4], v[None, :4], causal=True)
    o2, _ = attention_ref(want_q[None, 3:], k[None, 4:], v[None, 4:], causal=True)
    (o1.sum() + o2.sum()).backward()
    torch.testing.assert_close(q.grad, want_q.grad)
