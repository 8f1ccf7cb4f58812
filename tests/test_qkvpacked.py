"""flash_attn_qkvpacked_func on CPU: FA3's signature, the views it takes of qkv, and every error
naming qkv / num_heads_q; the metadata-only path (FakeTensors on a "cuda" device, what
torch.compile traces) without the kernel library. The GPU half: tests/test_qkvpacked_gpu.py."""

from __future__ import annotations

import inspect

import pytest
import torch
from _helpers import raises
from flash_hopper import _device, _fwd, _lib, flash_attn_qkvpacked_func, interface
from torch._subclasses.fake_tensor import FakeTensorMode

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _no_library(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("validation touched the library or the device")

    monkeypatch.setattr(_lib, "get_library", forbidden)
    monkeypatch.setattr(_device, "device_info", forbidden)
    _fwd.clear_plans()


# hopper/flash_attn_interface.py's flash_attn_qkvpacked_func (FlashAttention @ 0251105a).
FA3_SIGNATURE = [
    ("qkv", inspect.Parameter.empty), ("softmax_scale", None), ("causal", False),
    ("q_descale", None), ("k_descale", None), ("v_descale", None), ("window_size", (-1, -1)),
    ("attention_chunk", 0), ("softcap", 0.0), ("deterministic", False), ("num_heads_q", None),
    ("sm_margin", 0), ("return_attn_probs", False),
]


def test_has_fa3s_signature():
    params = list(inspect.signature(flash_attn_qkvpacked_func).parameters.values())
    assert [(p.name, p.default) for p in params
            if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD] == FA3_SIGNATURE
    assert [(p.name, p.kind, p.default) for p in params
            if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD] == [
        ("backend", inspect.Parameter.KEYWORD_ONLY, "auto")]


def test_five_dims_unbind_the_third():
    qkv = torch.randn(2, 7, 3, 4, 16)
    q, k, v = interface._split_qkv(qkv, None)
    for i, t in enumerate((q, k, v)):
        assert t.shape == (2, 7, 4, 16)
        assert torch.equal(t, qkv[:, :, i])
        assert t.data_ptr() == qkv[:, :, i].data_ptr()  # a view, no copy
    assert interface._split_qkv(qkv, 4)[0].shape == (2, 7, 4, 16)  # num_heads_q may agree


@pytest.mark.parametrize(("heads_q", "heads_kv"), [(4, 2), (4, 1), (3, 3), (1, 1)])
def test_four_dims_split_the_heads(heads_q, heads_kv):
    qkv = torch.randn(2, 5, heads_q + 2 * heads_kv, 8)
    q, k, v = interface._split_qkv(qkv, heads_q)
    assert torch.equal(q, qkv[:, :, :heads_q])
    assert torch.equal(k, qkv[:, :, heads_q:heads_q + heads_kv])
    assert torch.equal(v, qkv[:, :, heads_q + heads_kv:])
    assert v.data_ptr() == qkv[:, :, heads_q + heads_kv:].data_ptr()


@pytest.mark.parametrize(("qkv", "num_heads_q", "exc", "fragments"), [
    ([[1.0]], None, TypeError, ("qkv: expected a torch.Tensor", "list")),
    (torch.zeros(2, 5, 2, 4, 8), None, ValueError,
     ("qkv: expected shape (batch, seqlen, 3, heads, head_dim)", "(2, 5, 2, 4, 8)")),
    (torch.zeros(2, 5, 3, 4, 8), 2, ValueError,
     ("num_heads_q: expected None or qkv.shape[3] (4)", "got 2")),
    (torch.zeros(2, 5, 8, 8), None, ValueError, ("num_heads_q: expected an int for a 4-D qkv",)),
    (torch.zeros(2, 5, 8, 8), 5, ValueError,
     ("num_heads_q: expected", "positive even", "num_heads_q=5", "qkv.shape[2]=8")),
    (torch.zeros(2, 5, 8, 8), 8, ValueError, ("num_heads_q=8",)),
    (torch.zeros(2, 5, 8, 8), 0, ValueError, ("num_heads_q=0",)),
    (torch.zeros(2, 5, 8, 8), True, TypeError, ("num_heads_q: expected None or an int", "True")),
    (torch.zeros(2, 5, 8, 8), 2.0, TypeError, ("num_heads_q: expected None or an int", "2.0")),
    (torch.zeros(5, 8, 8), 4, ValueError, ("qkv: expected 5 dims", "or 4", "(5, 8, 8)")),
])
def test_bad_qkv(qkv, num_heads_q, exc, fragments):
    with raises(exc, *fragments):
        flash_attn_qkvpacked_func(qkv, num_heads_q=num_heads_q)


@pytest.mark.parametrize(("kwargs", "exc", "fragment"), [
    ({"return_attn_probs": 1}, TypeError, "return_attn_probs: expected a bool"),
    ({"deterministic": "yes"}, TypeError, "deterministic: expected a bool"),
    ({"attention_chunk": -1}, ValueError, "attention_chunk: expected an int >= 0"),
    ({"sm_margin": -1}, TypeError, "sm_margin: expected an int >= 0"),
    ({"causal": 1}, TypeError, "causal"),
    ({"window_size": (1, 2, 3)}, TypeError, "window_size: expected a pair"),
])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_arguments_are_checked_on_both_routes(kwargs, exc, fragment, requires_grad):
    # requires_grad takes the eager training route (the packed autograd Function), else the
    # route through flash_attn_func: both name the argument.
    qkv = torch.zeros(2, 5, 3, 4, 8, dtype=BF16, requires_grad=requires_grad)
    with raises(exc, fragment):
        flash_attn_qkvpacked_func(qkv, **kwargs)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_valid_cpu_tensors_fail_only_on_the_device(requires_grad):
    qkv = torch.zeros(2, 5, 6, 8, dtype=BF16, requires_grad=requires_grad)
    with raises(ValueError, "q: must be a CUDA tensor", "cpu"):
        flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=4)


@pytest.mark.parametrize(("shape", "num_heads_q", "heads_q"), [((2, 9, 3, 4, 64), None, 4),
                                                               ((2, 9, 8, 64), 4, 4),
                                                               ((1, 3, 10, 128), 8, 8)])
def test_traced_shapes(shape, num_heads_q, heads_q):
    # What torch.compile sees: the custom op on the views, out (b, s, heads_q, d), lse (b, h, s).
    with FakeTensorMode():
        qkv = torch.empty(shape, dtype=BF16, device="cuda")
        out, lse = flash_attn_qkvpacked_func(qkv, causal=True, num_heads_q=num_heads_q,
                                             return_attn_probs=True)
        assert out.shape == (shape[0], shape[1], heads_q, shape[-1])
        assert out.dtype == BF16
        assert lse.shape == (shape[0], heads_q, shape[1]) and lse.dtype == torch.float32
