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


def test_ring_merge_and_sinks_weigh_partials_as_combine_does():
    """The ring's running merge and the attention sink (a partial without a value) go through
    combine's weighting rule: the same results up to logaddexp vs logsumexp rounding, rows
    without keys included."""
    from flash_hopper import distributed, kvcache

    torch.manual_seed(0)
    inf = float("-inf")
    out_p = torch.randn(2, 2, 5, 3, 8)
    lse_p = torch.randn(2, 2, 5, 3)
    lse_p[0, 0, 1] = inf
    lse_p[:, 1, 2] = inf  # batch 1, row 2: no key in either partial
    want, want_lse = flash_attn_combine(out_p, lse_p)
    out, lse = out_p[0].clone(), lse_p[0].transpose(1, 2).contiguous()
    distributed._merge_into(out, lse, out_p[1], lse_p[1].transpose(1, 2))
    assert torch.allclose(out, want, atol=1e-6)
    assert torch.allclose(lse.transpose(1, 2), want_lse) and (out[1, 2] == 0).all()
    sinks = torch.tensor([0.5, inf, -1.0])
    with_sink = torch.stack((out_p[0], torch.zeros_like(out_p[0])))
    sink_lse = torch.stack((lse_p[0], sinks.expand(2, 5, 3)))
    want, want_lse = flash_attn_combine(with_sink, sink_lse)
    got, got_lse = kvcache.apply_sinks(out_p[0], lse_p[0].transpose(1, 2), sinks, 1)
    assert torch.allclose(got, want, atol=1e-6) and not got.isnan().any()
    assert torch.allclose(got_lse.transpose(1, 2), want_lse)
