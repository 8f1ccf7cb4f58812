"""Attention sinks in flash_attn_func / flash_attn_varlen_func (gpt-oss's per-head sink logits):
the composition from a call without sinks and its LSE (interface._with_sinks), checked on CPU
against reference.py's attention with the sink in the softmax, in float64, forward and
gradients (q, k, v and the sinks; the rescaling runs in fp32, as on the GPU, hence the
tolerances), and the argument checks. The kernels' side (the LSE's gradient in the
backward) runs in tests/test_sinks_gpu.py."""

import pytest
import torch

from flash_hopper import interface, reference
from flash_hopper._errors import UnsupportedError


def _without_sinks(q, k, v, scale, causal):
    """(out (b, sq, h, d), lse (b, h, sq)) as the kernels give them (reference.py), float64."""
    return reference.attention_ref(q, k, v, scale, causal)


def _with_sink_in_softmax(q, k, v, sinks, scale, causal):
    """The definition: the sink logit is one more column of the softmax, without a value
    (reference.py's KV-cache reference on the dense k / v)."""
    out, lse, _, _ = reference.attention_kvcache_ref(q, k, v, cache_seqlens=k.shape[1],
                                                     softmax_scale=scale, causal=causal,
                                                     sinks=sinks)
    return out, lse


def _inputs(seed, b=2, sq=7, sk=11, h=3, d=8):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = make(b, sq, h, d), make(b, sk, h, d), make(b, sk, h, d)
    sinks = (make(h) * 2).float()  # the API's dtype; the arithmetic around it stays float64
    return [t.requires_grad_() for t in (q, k, v, sinks)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_composition_equals_the_sink_in_the_softmax(causal, seed):
    q, k, v, sinks = _inputs(seed)
    scale = 0.3
    got, got_lse = interface._with_sinks(lambda: _without_sinks(q, k, v, scale, causal), sinks,
                                         q, 1, True)
    want, want_lse = _with_sink_in_softmax(q, k, v, sinks, scale, causal)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6)
    # A loss over out and lse: the sinks' gradient, and q / k / v's through the LSE.
    dout, dlse = torch.randn_like(want), torch.randn_like(want_lse)
    grads_got = torch.autograd.grad((got * dout).sum() + (got_lse * dlse).sum(), (q, k, v, sinks))
    grads_want = torch.autograd.grad((want * dout).sum() + (want_lse * dlse).sum(),
                                     (q, k, v, sinks))
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads_got, grads_want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    assert grads_got[3].abs().sum() > 0  # the sinks do get a gradient


def test_without_lse_returns_out_only():
    q, k, v, sinks = _inputs(2)
    got = interface._with_sinks(lambda: _without_sinks(q, k, v, 0.3, False), sinks, q, 1, False)
    want, _ = _with_sink_in_softmax(q, k, v, sinks, 0.3, False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_rows_that_see_nothing_get_zero_and_the_sink():
    # causal with seqlen_q > seqlen_k: the first rows see no key (the kernels: out 0, lse -inf)
    q, k, v, sinks = _inputs(3, sq=9, sk=4)
    with torch.no_grad():
        out, lse = interface._with_sinks(lambda: _without_sinks(q, k, v, 0.3, True), sinks, q, 1,
                                         True)
    blind = 9 - 4  # rows 0-4 see nothing
    assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
    sink_rows = sinks.detach().double().view(1, -1, 1).expand(2, -1, blind)
    torch.testing.assert_close(lse[:, :, :blind], sink_rows)
    want, want_lse = _with_sink_in_softmax(q, k, v, sinks, 0.3, True)
    torch.testing.assert_close(out[:, blind:], want[:, blind:].detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse[:, :, blind:], want_lse[:, :, blind:].detach(), rtol=1e-12,
                               atol=1e-12)


def test_varlen_layout_heads_first_lse():
    # flash_attn_varlen_func's layout: out (total, h, d), lse (h, total)
    q, k, v, sinks = _inputs(4, b=1)
    out, lse = _without_sinks(q, k, v, 0.3, False)
    got, got_lse = interface._with_sinks(lambda: (out[0], lse[0]), sinks, q[0], 0, True)
    want, want_lse = _with_sink_in_softmax(q, k, v, sinks, 0.3, False)
    torch.testing.assert_close(got, want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_lse, want_lse[0], rtol=1e-6, atol=1e-6)


def test_sinks_are_checked_before_the_call():
    q = torch.randn(1, 4, 3, 8)
    calls = []

    def call():
        calls.append(1)
        return torch.zeros(1, 4, 3, 8), torch.zeros(1, 3, 4)

    for bad, error, words in (
        (torch.zeros(3, dtype=torch.float16), TypeError, ["sinks", "torch.float32", "float16"]),
        (torch.zeros(4), ValueError, ["sinks", "3 entries", "got 4"]),
        (torch.zeros(3, 1), ValueError, ["sinks"]),
        ([0.0, 0.0, 0.0], TypeError, ["sinks"]),
    ):
        with pytest.raises(error) as info:
            interface._with_sinks(call, bad, q, 1, False)
        for w in words:
            assert w in str(info.value), (w, str(info.value))
    assert not calls


def test_varlen_refuses_out_with_sinks():
    q = torch.randn(4, 3, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(UnsupportedError, match="out: expected None with sinks"):
        interface.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, sinks=torch.zeros(3),
                                         out=torch.empty_like(q))


def test_flags_are_checked_with_sinks():
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(TypeError, match="return_attn_probs"):
        interface.flash_attn_func(q, q, q, return_attn_probs="yes", sinks=torch.zeros(3))
