"""A V head dim of its own (FA3's dv != d) on CPU: the zero-padding decomposition (_dv.py) is
exact — with the float64 reference standing in for the kernels, split_call equals the
reference's own dv != d attention, output, LSE and gradients — and its calls have the widths
the docstring promises. The kernels' side is the same-head-dim call (tests on a GPU)."""

from __future__ import annotations

import pytest
import torch
from _helpers import raises
from flash_hopper import _dv, flash_attn_func
from flash_hopper.reference import attention_ref


def reference_call(widths):
    def call(q, k, v, softmax_scale, return_attn_probs, **mask):
        assert return_attn_probs and q.shape[-1] == k.shape[-1] == v.shape[-1]
        widths.append(q.shape[-1])
        return attention_ref(q, k, v, softmax_scale=softmax_scale, **mask)
    return call


@pytest.mark.parametrize(("d", "dv", "widths"), [(64, 256, [256]), (64, 512, [256, 256]),
                                                 (192, 128, [192]), (32, 40, [40]),
                                                 (128, 264, [256, 256]), (16, 8, [16])])
@pytest.mark.parametrize("mask", [{}, {"causal": True}, {"window_size": (5, 2), "softcap": 9.0}])
def test_split_call_is_exact(d, dv, widths, mask):
    torch.manual_seed(d + dv)
    q = torch.randn(2, 13, 4, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 17, 2, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 17, 2, dv, dtype=torch.float64, requires_grad=True)
    seen = []
    out, lse = _dv.split_call(reference_call(seen), q, k, v, None, True, **mask)
    assert seen == widths
    want, want_lse = attention_ref(q, k, v, **mask)
    assert out.shape == (2, 13, 4, dv) and out.is_contiguous()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad([out, lse], [q, k, v], [dout, dlse])
    ref = torch.autograd.grad([want, want_lse], [q, k, v], [dout, dlse])
    for name, g, r in zip("qkv", got, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10, msg=f"d{name}")


def test_scale_stays_that_of_q_head_dim():
    q, k = torch.randn(1, 3, 1, 16, dtype=torch.float64), torch.randn(1, 5, 1, 16,
                                                                      dtype=torch.float64)
    v = torch.randn(1, 5, 1, 64, dtype=torch.float64)
    out = _dv.split_call(reference_call([]), q, k, v, None, False)
    torch.testing.assert_close(out, attention_ref(q, k, v, softmax_scale=16 ** -0.5)[0])


@pytest.mark.parametrize(("dq", "dv", "name"), [(60, 64, "q"), (64, 60, "v"), (264, 128, "q")])
def test_bad_head_dims(dq, dv, name):
    q = torch.zeros(1, 4, 2, dq, dtype=torch.bfloat16)
    v = torch.zeros(1, 4, 2, dv, dtype=torch.bfloat16)
    with raises(ValueError, f"{name}: expected"):
        flash_attn_func(q, q, v)


def test_differs():
    a, b = torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 128)
    assert _dv.differs(a, b) and not _dv.differs(a, a)
    assert not _dv.differs(a, [1]) and not _dv.differs(a, torch.zeros(2, 3, 128))


def test_reaches_the_device_check():
    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16)
    with raises(ValueError, "q: must be a CUDA tensor"):
        flash_attn_func(q, q, torch.zeros(1, 4, 2, 256, dtype=torch.bfloat16))


# --- the route to the kernel with V's own head dim (_dv.native_serves), on CPU ------------------


class FakeLibrary:
    """build_info's "head_dim_v_kernels" as a library with the bf16 192 / 128 kernel lists it."""

    def build_info(self):
        return {"head_dim_v_kernels": [{"direction": "fwd", "backend": "fa3", "dtype": "bf16",
                                        "head_dim": 192, "head_dim_v": 128,
                                        "variants": [0, 1]}]}


@pytest.fixture
def native_route(monkeypatch):
    """A cc 9.0 device and a library with the bf16 kernel; FLASH_HOPPER_DV_KERNEL unset."""
    import types

    from flash_hopper import _device, _lib

    info = types.SimpleNamespace(capability=(9, 0), sm_count=132)
    monkeypatch.setattr(_device, "device_info", lambda index: info)
    monkeypatch.setattr(_lib, "get_library", lambda: FakeLibrary())
    monkeypatch.delenv("FLASH_HOPPER_DV_KERNEL", raising=False)
    return info


def cuda_inputs(d=192, dv=128, dtype=torch.bfloat16, grad=False):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 64, 4, d, dtype=dtype, device="cuda", requires_grad=grad)
        k = torch.empty(2, 80, 4, d, dtype=dtype, device="cuda")
        v = torch.empty(2, 80, 4, dv, dtype=dtype, device="cuda")
    return q, k, v


def test_native_route_takes_inference_calls_of_a_built_pair_only(native_route, monkeypatch):
    assert _dv.native_serves(*cuda_inputs(), "auto")
    assert _dv.native_serves(*cuda_inputs(160, 112), "fa3-no-pingpong")  # the pair's buckets
    refused = [
        (cuda_inputs(), "fa2"),                        # the FA-2 path has no such kernel
        (cuda_inputs(), "fa3-no-overlap"),             # nor the ablation
        (cuda_inputs(dtype=torch.float16), "auto"),    # not in this (fake) build
        (cuda_inputs(128, 96), "auto"),                # no kernel for the pair
        (cuda_inputs(64, 256), "auto"),
        (cuda_inputs(grad=True), "auto"),              # training pads (it has the backward)
    ]
    for (q, k, v), backend in refused:
        assert not _dv.native_serves(q, k, v, backend), (q.shape[-1], v.shape[-1], backend)
    with torch.no_grad():  # inputs that require grad, under no_grad: inference
        assert _dv.native_serves(*cuda_inputs(grad=True), "auto")
    native_route.capability = (8, 0)
    assert not _dv.native_serves(*cuda_inputs(), "auto")
    native_route.capability = (9, 0)
    monkeypatch.setenv("FLASH_HOPPER_DV_KERNEL", "0")  # padding on request
    assert not _dv.native_serves(*cuda_inputs(), "auto")
    monkeypatch.delenv("FLASH_HOPPER_DV_KERNEL")  # the default: the kernel
    assert _dv.native_serves(*cuda_inputs(), "auto")


def test_native_route_needs_tensors_on_a_gpu(native_route):
    q = torch.zeros(1, 4, 2, 192, dtype=torch.bfloat16)
    v = torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16)
    assert not _dv.native_serves(q, q, v, "auto")
    assert not _dv.native_serves(q, q, None, "auto")


def test_which_backend_answers_for_v_own_head_dim(lib, monkeypatch):
    """which_backend on a dv != d call: the padded call's kernel with the padding named
    (FLASH_HOPPER_DV_KERNEL=0), or the kernel with V's own head dim where an inference call runs
    it (the default)."""
    import types

    from flash_hopper import _device, _fwd, which_backend
    from flash_hopper._errors import UnsupportedError

    info = types.SimpleNamespace(capability=(9, 0), sm_count=132)
    monkeypatch.setattr(_device, "device_info", lambda index: info)
    _fwd.clear_plans()
    q, k, v = cuda_inputs()
    monkeypatch.setenv("FLASH_HOPPER_DV_KERNEL", "0")
    try:
        name, reason = which_backend(q, k, v)
        assert reason.endswith("; v's head dim 128: q / k zero-padded to 192, V in 1 block of "
                               "192 (_dv.py)"), reason
    except UnsupportedError as exc:  # a build without d192 kernels: the padded call's refusal
        assert "192" in str(exc)
    built = {(e["dtype"], e["head_dim"], e["head_dim_v"])
             for e in lib.build_info().get("head_dim_v_kernels", [])}
    monkeypatch.delenv("FLASH_HOPPER_DV_KERNEL")
    if ("bf16", 192, 128) in built:
        name, reason = which_backend(q, k, v)
        assert name == "fa3" and "head_dim 192 / head_dim_v 128" in reason, reason
    with raises(ValueError, "k: expected head_dim (last dim) == q's 192, got 128"):
        which_backend(q, v, v)
    _fwd.clear_plans()
