"""FP8 (e4m3) arguments of flash_attn_func, validated on CPU: every bad input is refused naming the
argument, the expected and the given value, before any device work (the last check is the device,
so these CPU tensors reach it only when everything else is right)."""

from __future__ import annotations

import pytest
import torch
from _helpers import raises
from flash_hopper import UnsupportedError, _autograd, _validate, flash_attn_func

E4M3 = torch.float8_e4m3fn


def fp8_qkv(b=2, sq=16, sk=24, hq=4, hkv=2, d=64):
    q = torch.randn(b, sq, hq, d).to(E4M3)
    k = torch.randn(b, sk, hkv, d).to(E4M3)
    v = torch.randn(b, sk, hkv, d).to(E4M3)
    return q, k, v


ON_DEVICE = ("q: must be a CUDA tensor",)  # what a valid CPU call reaches


@pytest.mark.parametrize("descale", [
    torch.ones(2, 2), torch.tensor(0.5), torch.ones(1), torch.tensor(2.0).expand(2, 2),
    torch.ones(2, 1).expand(2, 2), torch.ones(2, 4)[:, ::2],
], ids=["b-hkv", "0d", "one", "expand-0d", "expand-heads", "strided"])
def test_descales_in_every_layout_servers_pass(descale):
    q, k, v = fp8_qkv()
    with raises(ValueError, *ON_DEVICE):
        flash_attn_func(q, k, v, q_descale=descale, k_descale=descale, v_descale=descale)


def test_descale_strides_reach_the_params():
    q, k, v = fp8_qkv()
    cfg, fp8 = _validate.check_fp8_args(
        q, k, v, None, False, (-1, -1), 0.0, "auto", torch.tensor(2.0).expand(2, 2),
        torch.ones(2, 4)[:, ::2], None, None, "single-level", devices=False)
    assert fp8.q_descale == (0, 0)
    assert fp8.k_descale == (4, 2)
    assert fp8.v_descale is None
    assert fp8.out_dtype == torch.bfloat16 and fp8.two_level is False
    assert cfg.dtype == E4M3 and cfg.heads_kv == 2


@pytest.mark.parametrize(("kwargs", "exc", "fragments"), [
    ({"q_descale": torch.ones(2, 4)}, ValueError,
     ("q_descale: expected shape (batch, heads_kv) = (2, 2)", "got (2, 4)")),
    ({"k_descale": torch.ones(2)}, ValueError, ("k_descale: expected shape", "got (2,)")),
    ({"v_descale": torch.ones(2, 2, dtype=torch.float16)}, ValueError,
     ("v_descale: expected dtype torch.float32", "torch.float16")),
    ({"q_descale": 0.5}, TypeError, ("q_descale: expected None or a torch.Tensor", "float")),
    ({"out_dtype": torch.float32}, ValueError,
     ("out_dtype: expected None (torch.bfloat16), torch.bfloat16 or torch.float16",
      "torch.float32")),
    ({"fp8_accumulation": "fp32"}, ValueError,
     ("fp8_accumulation: expected one of two-level, single-level", "'fp32'")),
    ({"causal": 1}, TypeError, ("causal: expected a bool",)),
    ({"softcap": -1.0}, ValueError, ("softcap: expected a float >= 0",)),
])
def test_bad_fp8_arguments_name_themselves(kwargs, exc, fragments):
    q, k, v = fp8_qkv()
    with raises(exc, *fragments):
        flash_attn_func(q, k, v, **kwargs)


@pytest.mark.parametrize("head_dim", [144, 256])
def test_single_level_ablation_is_refused_past_d128(head_dim):
    # The d192 / d256 FP8 kernels split their PV accumulator over the head dim: two levels only.
    q, k, v = fp8_qkv(d=head_dim)
    with raises(ValueError, "fp8_accumulation: 'single-level' (the ablation) exists for head_dim "
                "<= 128", f"got head_dim {head_dim}"):
        flash_attn_func(q, k, v, fp8_accumulation="single-level")
    _validate.check_fp8_args(q, k, v, None, False, (-1, -1), 0.0, "auto", None, None, None, None,
                             "two-level", devices=False)


def test_fp8_inputs_must_all_be_fp8():
    q, k, v = fp8_qkv()
    with raises(ValueError, "k: expected dtype torch.float8_e4m3fn (q's dtype)", "bfloat16"):
        flash_attn_func(q, k.bfloat16(), v)
    with raises(ValueError, "v: expected dtype torch.float8_e4m3fn (q's dtype)", "float8_e5m2"):
        flash_attn_func(q, k, v.to(torch.float8_e5m2))


def test_e5m2_inputs_name_the_supported_dtypes():
    q, k, v = fp8_qkv()
    e5 = torch.float8_e5m2
    with raises(ValueError, "q: expected dtype torch.float16 or torch.bfloat16",
                "torch.float8_e4m3fn", "float8_e5m2"):
        flash_attn_func(q.to(e5), k.to(e5), v.to(e5))


@pytest.mark.parametrize("head_dim", [72, 8, 264])
def test_fp8_head_dims_are_multiples_of_16(head_dim):
    q, k, v = fp8_qkv(d=head_dim)
    with raises(ValueError, "q: expected head_dim (dim 3) a multiple of 16", "for FP8 inputs",
                f"got {head_dim}"):
        flash_attn_func(q, k, v)


def test_fp8_strides_are_16_byte_multiples():
    _q, k, v = fp8_qkv(d=64)
    q_wide = torch.randn(2, 16, 4, 80).to(E4M3)[..., :64]  # head stride 80: 16-byte multiple
    with raises(ValueError, *ON_DEVICE):
        flash_attn_func(q_wide, k, v)
    q_odd = torch.randn(2, 16, 4, 72).to(E4M3)[..., :64]  # head stride 72: not
    with raises(ValueError, "q: stride(2) must be a multiple of 16 elements"):
        flash_attn_func(q_odd, k, v)


def test_fp8_inputs_that_require_grad_run_forward_only():
    """FA3's tests call the FP8 forward on inputs that require grad: the call is validated and
    runs like one under no_grad (here on the CPU: the device check), and a backward through its
    result raises, naming why (_autograd.ForwardOnly)."""
    q, k, v = fp8_qkv()
    if not torch.is_floating_point(q):  # pragma: no cover - torch always calls float8 floating
        pytest.skip("float8 is not a floating dtype in this torch")
    try:
        q.requires_grad_(True)
    except RuntimeError:
        pytest.skip("this torch does not let float8 tensors require grad")
    with raises(ValueError, *ON_DEVICE):
        flash_attn_func(q, k, v)
    with torch.no_grad(), raises(ValueError, *ON_DEVICE):
        flash_attn_func(q, k, v)


def test_forward_only_results_refuse_a_backward():
    x = torch.randn(3, requires_grad=True)
    out, lse = _autograd.ForwardOnly.apply(lambda: (x.detach() * 2, None), x, x, x)
    assert lse is None and out.requires_grad and torch.equal(out, x.detach() * 2)
    with raises(UnsupportedError, "the FP8 forward has no backward", "torch.no_grad()"):
        out.sum().backward()


def test_fp8_traces_as_one_custom_op():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def attention(q, k, v, qd):
        return flash_attn_func(q, k, v, causal=True, window_size=(32, -1), q_descale=qd,
                               out_dtype=torch.float16, fp8_accumulation="single-level",
                               return_attn_probs=True)

    with FakeTensorMode():
        q = torch.empty(2, 17, 4, 64, dtype=E4M3, device="cuda")
        k = torch.empty(2, 40, 2, 64, dtype=E4M3, device="cuda")
        qd = torch.empty(2, 2, device="cuda")
        graph = make_fx(attention)(q, k, k, qd)
    calls = [n for n in graph.graph.nodes if n.op == "call_function"
             and n.target is torch.ops.flash_hopper.fwd_fp8.default]
    assert len(calls) == 1
    # causal folded into window_right = 0; default scale 1/sqrt(64); fp16 out, single level
    assert calls[0].args[6:] == (0.125, 32, 0, 0.0, "auto", torch.float16, False)
    out, lse = (n for n in graph.graph.nodes if n.op == "call_function"
                and n.target.__name__ == "getitem")
    assert out.meta["val"].dtype == torch.float16 and lse.meta["val"].dtype == torch.float32


@pytest.fixture
def cpu_stand_in(monkeypatch):
    """The FP8 host path on CPU: device check relaxed, the launch replaced by the dequantized
    reference; validation, the op, its fake kernel and the plan cache stay real."""
    from flash_hopper import _fwd
    from flash_hopper.reference import attention_ref

    def make_plan(cfg, q, k, v, fp8=None, **kwargs):
        return _fwd.Plan(cfg, "fa3", "CPU stand-in", None, q.device,
                         (cfg.batch, cfg.seqlen_q, cfg.heads_q, cfg.head_dim),
                         (cfg.batch, cfg.heads_q, cfg.seqlen_q), None, fp8.out_dtype)

    def run(plan, q, k, v, qd, kd, vd, need_lse):
        cfg = plan.cfg
        out, lse = attention_ref(q.float(), k.float(), v.float(),
                                 softmax_scale=cfg.softmax_scale,
                                 window_size=(cfg.window_left, cfg.window_right))
        return out.to(plan.out_dtype).contiguous(), lse.contiguous() if need_lse else None

    monkeypatch.setattr(_fwd, "make_plan", make_plan)
    monkeypatch.setattr(_fwd, "_run_fp8", run)
    monkeypatch.setattr(_validate, "_check_device", lambda name, t, ref: None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("dynamic", [False, True])
def test_fp8_torch_compile_fullgraph_on_cpu(cpu_stand_in, dynamic):
    def attention(q, k, v, qd):
        return flash_attn_func(q, k, v, causal=True, q_descale=qd, return_attn_probs=True)

    compiled = torch.compile(attention, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    _, k, v = fp8_qkv()
    qd = torch.ones(2, 2)
    for seqlen_q in (16, 29):
        q = torch.randn(2, seqlen_q, 4, 64).to(E4M3)
        out, lse = compiled(q, k, v, qd)
        out_eager, lse_eager = attention(q, k, v, qd)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, out_eager) and torch.equal(lse, lse_eager)
