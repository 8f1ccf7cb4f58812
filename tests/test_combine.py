"""flash_attn_combine (FA3's signature): attention over disjoint key sets merged
through the LSEs equals attention over their union; FA3's layouts, strides and edge rules (a
partial of masked keys weighs 0, a row that sees no key gets 0 / -inf); errors name the argument.
CPU (the function is torch; the decode kernel merges its own splits in a combine kernel)."""

from __future__ import annotations

import pytest
import torch
from flash_hopper import flash_attn_combine
from flash_hopper.reference import attention_ref

from tests._helpers import raises


def partials(q, k, v, bounds, softcap=0.0):
    """Attention of q over each key range [a, b) of ``bounds``: out (n, b, sq, h, d) and lse
    (n, b, sq, h), fp32; an empty range gives out 0 and lse -inf (what a split with no key
    writes)."""
    outs, lses = [], []
    b, sq, h, d = q.shape
    for lo, hi in bounds:
        if hi == lo:
            outs.append(torch.zeros(b, sq, h, d, dtype=torch.float64))
            lses.append(torch.full((b, h, sq), float("-inf"), dtype=torch.float64))
            continue
        o, lse = attention_ref(q, k[:, lo:hi], v[:, lo:hi], softmax_scale=d**-0.5,
                               softcap=softcap)
        outs.append(o)
        lses.append(lse)
    return (torch.stack(outs).float(), torch.stack(lses).transpose(-1, -2).float())


@pytest.mark.parametrize("bounds", [[(0, 300)], [(0, 1), (1, 300)], [(0, 97), (97, 97),
                                    (97, 250), (250, 300)], [(i, i + 30) for i in range(0, 300, 30)]])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_split_keys_merge_to_full_attention(bounds, softcap):
    torch.manual_seed(len(bounds))
    q = torch.randn(2, 37, 6, 64, dtype=torch.float64)
    k = torch.randn(2, 300, 2, 64, dtype=torch.float64)
    v = torch.randn(2, 300, 2, 64, dtype=torch.float64)
    out_p, lse_p = partials(q, k, v, bounds, softcap)
    out, lse = flash_attn_combine(out_p, lse_p)
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=64**-0.5, softcap=softcap)
    assert out.dtype == torch.float32 and out.shape == (2, 37, 6, 64)
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert (lse.double() - ref_lse.transpose(1, 2)).abs().max().item() < 1e-5


def test_fa3_layouts_and_rows_without_keys():
    """FA3's test builds non-contiguous partials and sets some splits' LSE to -inf; the LSE comes
    back as a (batch, seqlen, heads) view of a (batch, heads, seqlen) tensor."""
    torch.manual_seed(1)
    n, b, h, s, d = 5, 4, 3, 17, 40
    out_p = torch.randn(n * 2, b, h, s, d).transpose(2, 3)[:n]
    lse_p = torch.randn(n, b, h * 2, s).transpose(-1, -2)[:, :, :, :h]
    lse_p[n // 2:, :1] = float("-inf")
    lse_p[:, 3, 5] = float("-inf")  # batch 3, row 5: no split saw a key
    out, lse = flash_attn_combine(out_p, lse_p, out_dtype=torch.bfloat16)
    want_lse = torch.logsumexp(lse_p, 0)
    scale = torch.exp(lse_p - want_lse)
    scale = torch.where(torch.isfinite(scale), scale, torch.zeros_like(scale))
    want = (scale.unsqueeze(-1) * out_p).sum(0)
    assert out.dtype == torch.bfloat16 and lse.shape == (b, s, h) and lse.stride() == (h * s, 1, s)
    assert torch.allclose(lse, want_lse, atol=1e-5, rtol=1e-5)
    assert (out.float() - want).abs().max().item() <= 2 * (want.bfloat16().float() - want).abs().max().item()
    assert (out[3, 5] == 0).all() and torch.isneginf(lse[3, 5]).all()
    assert not out.isnan().any()


def test_out_is_written_in_place():
    out_p, lse_p = torch.randn(3, 2, 4, 5, 8), torch.randn(3, 2, 4, 5)
    out = torch.full((2, 4, 5, 8), 7.0, dtype=torch.float16)
    got, _ = flash_attn_combine(out_p, lse_p, out=out, out_dtype=torch.float16)
    assert got.data_ptr() == out.data_ptr() and not (out == 7.0).all()
    assert torch.allclose(out.float(), flash_attn_combine(out_p, lse_p)[0], atol=2e-3)


@pytest.mark.parametrize(("args", "kwargs", "exc", "fragments"), [
    ((torch.randn(2, 3, 4, 5, 8, dtype=torch.float64), torch.randn(2, 3, 4, 5)), {}, TypeError,
     ("out_partial: expected dtype torch.float32", "torch.float64")),
    ((torch.randn(2, 3, 4, 5, 8), torch.randn(2, 3, 4, 5).half()), {}, TypeError,
     ("lse_partial: expected dtype torch.float32",)),
    ((torch.randn(3, 4, 5, 8), torch.randn(2, 3, 4, 5)), {}, ValueError,
     ("out_partial: expected a 5-D tensor", "(3, 4, 5, 8)")),
    ((torch.randn(2, 3, 4, 5, 8), torch.randn(2, 3, 5, 4)), {}, ValueError,
     ("lse_partial: expected shape (2, 3, 4, 5)", "(2, 3, 5, 4)")),
    ((torch.randn(2, 3, 4, 5, 8), torch.randn(2, 3, 4, 5)), {"out_dtype": torch.int8}, ValueError,
     ("out_dtype: expected None", "torch.int8")),
    ((torch.randn(2, 3, 4, 5, 8), torch.randn(2, 3, 4, 5)), {"out": torch.empty(3, 4, 5, 9)},
     ValueError, ("out: expected shape (3, 4, 5, 8)", "(3, 4, 5, 9)")),
    ((torch.randn(2, 3, 4, 5, 8), torch.randn(2, 3, 4, 5)),
     {"out": torch.empty(3, 4, 5, 8, dtype=torch.bfloat16)}, TypeError,
     ("out: expected dtype torch.float32 (out_dtype)", "torch.bfloat16")),
    (([1.0], torch.randn(2, 3, 4, 5)), {}, TypeError, ("out_partial: expected a torch.Tensor",)),
])
def test_errors_name_the_argument(args, kwargs, exc, fragments):
    with raises(exc, *fragments):
        flash_attn_combine(*args, **kwargs)
