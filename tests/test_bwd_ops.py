"""The backward's plumbing on CPU (no GPU): the bwd op, the autograd wiring, the routes of
flash_attn_func, and the backward's host path (_bwd.py).

What torch.compile and autograd rely on is checked without a GPU: the ops' schemas, the bwd op's
fake implementation, a traced forward + backward (make_fx on FakeTensors of a "cuda" device)
holding flash_hopper::bwd with the right arguments, and a compiled training step on CPU whose
kernels are stood in for by the reference. The host path runs on CPU tensors against a recording
stand-in for the library, so each test sees exactly which FhBwdParams reach fh_bwd.
"""

from __future__ import annotations

import types

import pytest
import torch
from _helpers import raises
from flash_hopper import _autograd, _bwd, _device, _fwd, _lib, _validate, flash_attn_func, ops
from flash_hopper._lib import FhBackend, FhBwdParams, FhDtype, FhFwdParams
from flash_hopper.reference import attention_bwd_ref, attention_ref
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh_plans():
    _fwd.clear_plans()
    _bwd.clear_plans()
    yield
    _fwd.clear_plans()
    _bwd.clear_plans()


@pytest.fixture
def no_library(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("touched the library or the device while tracing")

    monkeypatch.setattr(_lib, "get_library", forbidden)
    monkeypatch.setattr(_device, "device_info", forbidden)


# --- the ops -------------------------------------------------------------------------------------


def test_schemas():
    assert str(torch.ops.flash_hopper.fwd.default._schema) == (
        "flash_hopper::fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, int window_left, "
        "int window_right, float softcap, str backend, bool deterministic, int sm_margin=0) -> "
        "(Tensor, Tensor)"
    )
    assert str(torch.ops.flash_hopper.bwd.default._schema) == (
        "flash_hopper::bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? dlse, float softmax_scale, int window_left, int window_right, float softcap, "
        "str backend, bool deterministic, int sm_margin=0) -> (Tensor, Tensor, Tensor)"
    )


def _bwd_inputs(b, sq, sk, hq, hkv, d, dtype=BF16, device="cuda", q_layout="bshd"):
    if q_layout == "bhsd":  # (b, h, s, d) storage viewed as (b, s, h, d)
        q = torch.empty(b, hq, sq, d, dtype=dtype, device=device).transpose(1, 2)
    else:
        q = torch.empty(b, sq, hq, d, dtype=dtype, device=device)
    k = torch.empty(b, sk, hkv, d, dtype=dtype, device=device)
    v = torch.empty(b, sk, hkv, d, dtype=dtype, device=device)
    out = torch.empty(b, sq, hq, d, dtype=dtype, device=device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=device)
    return q, k, v, out, lse


@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize(("b", "sq", "sk", "hq", "hkv", "d", "layout"),
                         [(2, 17, 113, 8, 2, 64, "bshd"), (1, 1, 1, 1, 1, 8, "bshd"),
                          (0, 5, 5, 2, 2, 256, "bshd"), (3, 0, 7, 4, 4, 128, "bshd"),
                          (2, 9, 0, 6, 3, 72, "bshd"), (2, 33, 40, 8, 8, 96, "bhsd")])
def test_bwd_fake_shapes_under_fake_tensor_mode(b, sq, sk, hq, hkv, d, layout, with_dlse,
                                                no_library):
    with FakeTensorMode():
        q, k, v, out, lse = _bwd_inputs(b, sq, sk, hq, hkv, d, q_layout=layout)
        dout = torch.empty_like(out)
        dlse = torch.empty_like(lse) if with_dlse else None
        dq, dk, dv = torch.ops.flash_hopper.bwd(dout, q, k, v, out, lse, dlse, 0.125, -1, 0,
                                                0.0, "auto", False)
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        assert grad.shape == like.shape and grad.dtype == like.dtype
        assert grad.is_contiguous() and grad.device.type == "cuda"


def test_bwd_fake_on_meta():
    q, k, v, out, lse = _bwd_inputs(2, 17, 33, 4, 2, 64, device="meta")
    dq, dk, dv = torch.ops.flash_hopper.bwd(out, q, k, v, out, lse, None, 0.125, -1, -1, 0.0,
                                            "fa2", True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.device.type == "meta"


def test_double_backward_raises_naming_the_op():
    q = torch.randn(1, 4, 2, 64, dtype=BF16, device="meta", requires_grad=True)
    out, _ = torch.ops.flash_hopper.fwd(q, q, q, 0.125, -1, -1, 0.0, "auto", False)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert dq.requires_grad
    with raises(NotImplementedError, "flash_hopper::bwd", "double backward"):
        dq.sum().backward()


# --- the traced forward + backward ---------------------------------------------------------------


def _traced_training(attention, *shape, dtype=BF16):
    """make_fx of attention + torch.autograd.grad on fake tensors: the graph's calls.

    The tensors are CPU fakes with the device check relaxed: autograd of fake "cuda" tensors
    needs the CUDA device guard that a CPU-only torch lacks (the engine aborts)."""
    b, sq, sk, hq, hkv, d = shape

    def step(q, k, v, dout):
        out, lse = attention(q, k, v)
        loss = (out.float() * dout.float()).sum() + lse.sum() * 0.5
        return torch.autograd.grad(loss, (q, k, v))

    with FakeTensorMode():
        q = torch.empty(b, sq, hq, d, dtype=dtype, requires_grad=True)
        k = torch.empty(b, sk, hkv, d, dtype=dtype, requires_grad=True)
        v = torch.empty(b, sk, hkv, d, dtype=dtype, requires_grad=True)
        dout = torch.empty(b, sq, hq, d, dtype=dtype)
        graph = make_fx(step)(q, k, v, dout)
    return [n for n in graph.graph.nodes if n.op == "call_function"]


@pytest.fixture
def any_device(monkeypatch):
    monkeypatch.setattr(_validate, "_check_device", lambda name, t, ref: None)


def _only(calls, op):
    found = [n for n in calls if n.target is op]
    assert len(found) == 1, found
    return found[0]


def test_traced_backward_calls_the_bwd_op_with_the_forwards_arguments(no_library, any_device):
    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(32, -1), softcap=5.0,
                               deterministic=True, return_attn_probs=True)

    calls = _traced_training(attention, 2, 17, 40, 8, 2, 64)
    fwd = _only(calls, torch.ops.flash_hopper.fwd.default)
    bwd = _only(calls, torch.ops.flash_hopper.bwd.default)
    assert fwd.args[3:] == (0.125, 32, 0, 5.0, "auto", True)
    assert bwd.args[7:] == (0.125, 32, 0, 5.0, "auto", True)
    # q, k, v, out and lse are the forward's; the loss used the lse, so a dlse is passed.
    assert bwd.args[1:4] == fwd.args[:3]
    assert bwd.args[6] is not None
    assert calls.index(fwd) < calls.index(bwd)


def test_traced_backward_passes_no_dlse_when_the_lse_is_unused(no_library, any_device):
    def step(q, k, v):
        out = flash_attn_func(q, k, v)
        return torch.autograd.grad(out.float().square().sum(), (q, k, v))

    with FakeTensorMode():
        q = torch.empty(1, 9, 2, 32, dtype=BF16, requires_grad=True)
        graph = make_fx(step)(q, q.detach().clone().requires_grad_(),
                              q.detach().clone().requires_grad_())
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    bwd = _only(calls, torch.ops.flash_hopper.bwd.default)
    assert bwd.args[6] is None
    assert bwd.args[-1] is False  # deterministic's default


# --- routes of flash_attn_func -------------------------------------------------------------------


def _cpu_qkv(requires_grad=False, b=2, sq=17, sk=33, hq=8, hkv=2, d=64):
    q = torch.randn(b, sq, hq, d, dtype=BF16)
    k = torch.randn(b, sk, hkv, d, dtype=BF16)
    v = torch.randn(b, sk, hkv, d, dtype=BF16)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


class _Routes(list):
    margins: list


@pytest.fixture
def routes(monkeypatch):
    """Record which route flash_attn_func takes; every route returns stand-in outputs."""
    taken = _Routes()
    taken.margins = []  # sm_margin as each route received it

    def eager(q, k, v, *args, need_lse=True, sm_margin=0):
        taken.append(("eager", need_lse))
        taken.margins.append(sm_margin)
        return torch.zeros_like(q), (q.new_zeros(1) if need_lse else None)

    class Function:
        @staticmethod
        def apply(q, k, v, *args):  # ..., deterministic, sm_margin
            taken.append(("autograd", args[-2]))
            taken.margins.append(args[-1])
            return torch.zeros_like(q), q.new_zeros(1)

    def op(*args):  # ..., deterministic, sm_margin
        taken.append(("op", args[-2]))
        taken.margins.append(args[-1])
        return torch.zeros_like(args[0]), args[0].new_zeros(1)

    monkeypatch.setattr(_fwd, "eager", eager)
    monkeypatch.setattr(_autograd, "FlashAttnFunction", Function)
    monkeypatch.setattr(ops, "fwd", op)
    monkeypatch.setattr(_validate, "_check_device", lambda name, t, ref: None)
    return taken


def test_no_grad_takes_the_eager_path_without_an_lse(routes):
    q, k, v = _cpu_qkv(requires_grad=True)
    with torch.no_grad():
        flash_attn_func(q, k, v, deterministic=True)
    flash_attn_func(*_cpu_qkv())  # grad enabled, nothing requires it
    flash_attn_func(*_cpu_qkv(), return_attn_probs=True)
    assert routes == [("eager", False), ("eager", False), ("eager", True)]


def test_grad_takes_the_autograd_function(routes):
    q, k, v = _cpu_qkv()
    flash_attn_func(q, k.requires_grad_(), v, deterministic=True)
    flash_attn_func(*_cpu_qkv(requires_grad=True))
    assert routes == [("autograd", True), ("autograd", False)]


def test_traced_calls_take_the_op(routes):
    with FakeTensorMode():
        q = torch.empty(1, 9, 2, 64, dtype=BF16, device="cuda")
        flash_attn_func(q, q, q, deterministic=True)
    assert routes == [("op", True)]


def test_sm_margin_reaches_every_route(routes):
    """FA3's sm_margin goes down every route (the kernels' grid cap, forward and backward), and
    a value that is not an int >= 0 is refused naming it."""
    q, k, v = _cpu_qkv()
    flash_attn_func(q, k, v, sm_margin=4)
    flash_attn_func(*_cpu_qkv(requires_grad=True), sm_margin=6)
    with FakeTensorMode():
        t = torch.empty(1, 9, 2, 64, dtype=BF16, device="cuda")
        flash_attn_func(t, t, t, sm_margin=8)
    assert [r for r, _ in routes] == ["eager", "autograd", "op"]
    assert routes.margins == [4, 6, 8]
    for bad in (-1, 2.0, True):
        with raises(TypeError, "sm_margin: expected an int >= 0", repr(bad)):
            flash_attn_func(q, k, v, sm_margin=bad)


@pytest.mark.parametrize("value", [1, None, "yes"])
def test_deterministic_must_be_a_bool(value):
    with raises(TypeError, "deterministic: expected a bool", repr(value)):
        flash_attn_func(*_cpu_qkv(), deterministic=value)


# --- the host path on CPU tensors, against a recording library -----------------------------------


class RecordingLibrary:
    """Stands in for _lib.Library: its policies answer ``choice``; fh_fwd / fh_bwd record every
    struct; the workspace is WORKSPACE bytes."""

    WORKSPACE = 4096

    def __init__(self, choice=FhBackend.FA2):
        self.choice = choice
        self.policy_calls = []
        self.launches = []
        self.bwd_launches = []

    def policy(self, params, capability):
        self.policy_calls.append((type(params).__name__, bytes(params), capability))
        return self.choice, f"stand-in policy on cc {capability[0]}.{capability[1]}"

    def bwd_workspace_size(self, params):
        assert isinstance(params, FhBwdParams) and params.workspace is None
        return self.WORKSPACE

    def fh_fwd(self, params, stream):
        self.launches.append((FhFwdParams.from_buffer_copy(bytes(params)), stream))
        return 0

    def fh_bwd(self, params, stream):
        self.bwd_launches.append((FhBwdParams.from_buffer_copy(bytes(params)), stream))
        return 0

    def check(self, status, what):
        raise AssertionError(f"{what} failed with {status}")


STREAM = 0x5EED


@pytest.fixture
def host(monkeypatch):
    """Both host paths on CPU tensors: a cc 9.0 device, the recording library, stream STREAM."""
    lib = RecordingLibrary()
    monkeypatch.setattr(_lib, "get_library", lambda: lib)
    info = types.SimpleNamespace(capability=(9, 0), sm_count=132)
    monkeypatch.setattr(_device, "device_info", lambda index: info)
    monkeypatch.setattr(_validate, "_check_device", lambda name, t, ref: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for module in (_fwd, _bwd):
        monkeypatch.setattr(module, "_current_device", lambda: None)  # CPU: device index None
        monkeypatch.setattr(module, "_raw_stream", lambda index: STREAM)
    return lib


def _bwd_policy_calls(lib):
    return [c for c in lib.policy_calls if c[0] == "FhBwdParams"]


def test_training_step_reaches_fh_bwd_with_the_forwards_tensors(host):
    q, k, v = _cpu_qkv(requires_grad=True)
    for _ in range(3):
        out, _ = flash_attn_func(q, k, v, causal=True, softcap=2.0, return_attn_probs=True)
        dout = torch.randn_like(out)
        (out.float() * dout.float()).sum().backward()
    assert len(host.launches) == len(host.bwd_launches) == 3
    assert len(_bwd_policy_calls(host)) == 1  # validated, chosen and sized once
    p, stream = host.bwd_launches[-1]
    assert stream == STREAM and p.abi_version == _lib.ABI_VERSION
    fwd_params = host.launches[-1][0]
    assert (p.q, p.k, p.v) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert (p.o, p.lse) == (fwd_params.o, fwd_params.lse)  # the forward's saved out and lse
    assert p.dlse is None  # the loss did not use the lse
    assert None not in (p.dq, p.dk, p.dv, p.dout) and len({p.dq, p.dk, p.dv}) == 3
    assert p.workspace is not None and p.workspace_bytes == RecordingLibrary.WORKSPACE
    assert (p.dtype, p.deterministic, p.backend, p.variant) == (FhDtype.BF16, 0, FhBackend.FA2, 0)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim) == (
        2, 17, 33, 8, 2, 64)
    assert (p.window_left, p.window_right) == (-1, 0)
    assert p.softmax_scale == pytest.approx(0.125) and p.softcap == pytest.approx(2.0)
    assert (p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride) == (17 * 8 * 64, 8 * 64, 64)
    assert (p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride) == (33 * 2 * 64, 2 * 64, 64)
    assert (p.lse_batch_stride, p.lse_head_stride) == (8 * 17, 17)
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_the_lse_gradient_reaches_fh_bwd(host):
    q, k, v = _cpu_qkv(requires_grad=True)
    out, lse = flash_attn_func(q, k, v, deterministic=True, return_attn_probs=True)
    (out.float().sum() + (lse * torch.randn_like(lse)).sum()).backward()
    p, _ = host.bwd_launches[-1]
    assert p.dlse is not None and p.deterministic == 1
    assert (p.dlse_batch_stride, p.dlse_head_stride) == (8 * 17, 17)


def test_only_the_lse_used_gives_a_zero_dout(host):
    q, k, v = _cpu_qkv(requires_grad=True)
    _, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    lse.sum().backward()  # a broadcast dlse: made contiguous
    p, _ = host.bwd_launches[-1]
    assert p.dout is not None and p.dlse is not None


def test_dout_the_kernels_cannot_load_is_copied(host):
    q, k, v = _cpu_qkv(requires_grad=True)
    out = flash_attn_func(q, k, v)
    out.sum().backward()  # dout: ones broadcast over every dim (all strides 0)
    p, _ = host.bwd_launches[-1]
    assert (p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride) == (17 * 8 * 64, 8 * 64,
                                                                            64)


def test_bwd_into_writes_the_callers_buffers_and_names_the_backend(host):
    host.choice = FhBackend.FA3
    q, k, v = _cpu_qkv()
    out, lse = torch.empty_like(q), torch.empty(2, 8, 17)
    # dout: a (b, h, s, d) storage viewed as (b, s, h, d): loadable, passed as is.
    dout = torch.randn(2, 8, 17, 64, dtype=BF16).transpose(1, 2)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ran = ops.bwd_into(dout, q, k, v, out, lse, dq, dk, dv, 0.125, -1, -1, 0.0,
                       backend="fa3-no-pingpong", deterministic=True, num_sms=3)
    assert ran == "fa3"
    p, _ = host.bwd_launches[-1]
    assert (p.dq, p.dk, p.dv, p.dout) == (dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                          dout.data_ptr())
    assert (p.dout_batch_stride, p.dout_row_stride, p.dout_head_stride) == (8 * 17 * 64, 64,
                                                                            17 * 64)
    assert (p.backend, p.variant, p.num_sms, p.deterministic) == (FhBackend.FA3, 0, 3, 1)
    # The ablation variant asked the policy for the tuned FA-3 backward.
    asked = FhBwdParams.from_buffer_copy(_bwd_policy_calls(host)[-1][1])
    assert (asked.backend, asked.variant) == (FhBackend.FA3, 0)


def test_bwd_into_checks_caller_buffers_before_anything(host):
    q, k, v = _cpu_qkv()
    out, lse = torch.empty_like(q), torch.empty(2, 8, 17)
    with raises(ValueError, "dk: expected shape (2, 33, 2, 64) (k's shape)"):
        ops.bwd_into(out, q, k, v, out, lse, torch.empty_like(q), torch.empty_like(q),
                     torch.empty_like(v), 0.125, -1, -1, 0.0)
    assert host.bwd_launches == [] and host.policy_calls == []


def test_a_misaligned_dout_is_copied_per_call(host):
    q, k, v = _cpu_qkv()
    out, lse = torch.empty_like(q), torch.empty(2, 8, 17)
    base = torch.randn(q.numel() + 8, dtype=BF16)
    ops_args = (q, k, v, out, lse, None, 0.125, -1, -1, 0.0, "auto", False)
    aligned = base[8:8 + q.numel()].view(q.shape)
    misaligned = base[1:1 + q.numel()].view(q.shape)  # 2 bytes past a 16-byte boundary
    _bwd.op(aligned, *ops_args)
    _bwd.op(misaligned, *ops_args)
    assert len(_bwd_policy_calls(host)) == 1  # same metadata: one plan
    first, second = (p for p, _ in host.bwd_launches)
    assert first.dout == aligned.data_ptr()
    assert second.dout != misaligned.data_ptr() and second.dout % 16 == 0


def test_a_misaligned_input_is_named(host):
    q, k, v = _cpu_qkv()
    base = torch.empty(q.numel() + 8, dtype=BF16)
    out = base[1:1 + q.numel()].view(q.shape)
    with raises(ValueError, "out: data pointer must be 16-byte aligned"):
        _bwd.op(torch.empty_like(q), q, k, v, out, torch.empty(2, 8, 17), None, 0.125, -1, -1,
                0.0, "auto", False)
    assert host.bwd_launches == []


def test_batch_zero_launches_nothing(host):
    q, k, v = _cpu_qkv(b=0)
    out, lse = torch.empty_like(q), torch.empty(0, 8, 17)
    dq, dk, dv = _bwd.op(out, q, k, v, out, lse, None, 0.125, -1, -1, 0.0, "auto", False)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert host.bwd_launches == [] and host.policy_calls == []


def test_each_signature_gets_its_own_bwd_plan(host):
    q, k, v = _cpu_qkv()
    out, lse = torch.empty_like(q), torch.empty(2, 8, 17)
    args = [out, q, k, v, out, lse, None, 0.125, -1, -1, 0.0, "auto", False]
    _bwd.op(*args)
    _bwd.op(*args)
    assert len(_bwd_policy_calls(host)) == 1
    for i, value in ((6, torch.empty(2, 8, 17)), (12, True), (9, 0), (10, 1.0)):
        changed = list(args)
        changed[i] = value
        _bwd.op(*changed)
    assert len(_bwd_policy_calls(host)) == 5
    with raises(TypeError, "deterministic: expected a bool, got int 1"):
        _bwd.op(*args[:12], 1)  # equal to True as a dict key: never served by True's plan


def test_a_failing_policy_names_the_backward(host, monkeypatch):
    def refuse(params, capability):
        raise _lib.UnsupportedError("backend: fa3 has no backward kernel yet")

    monkeypatch.setattr(host, "policy", refuse)
    q, k, v = _cpu_qkv()
    out, lse = torch.empty_like(q), torch.empty(2, 8, 17)
    with raises(NotImplementedError, "fa3", "backward"):
        _bwd.op(out, q, k, v, out, lse, None, 0.125, -1, -1, 0.0, "fa3", False)


# --- a compiled training step on CPU, kernels stood in for by the reference ----------------------


@pytest.fixture
def cpu_kernels(monkeypatch):
    """Both host paths on CPU tensors with the reference as the kernels: everything traced
    (validation, the ops, their fakes and autograd) is real; only the plans' path choice and the
    launches are replaced."""

    def fwd_plan(cfg, q, k, v, **kwargs):
        return _fwd.Plan(cfg, "fa2", "CPU stand-in", None, q.device,
                         (cfg.batch, cfg.seqlen_q, cfg.heads_q, cfg.head_dim),
                         (cfg.batch, cfg.heads_q, cfg.seqlen_q), None, cfg.dtype)

    def fwd_run(plan, q, k, v, need_lse=True):
        cfg = plan.cfg
        out, lse = attention_ref(q, k, v, softmax_scale=cfg.softmax_scale,
                                 window_size=(cfg.window_left, cfg.window_right),
                                 softcap=cfg.softcap)
        return out.to(q.dtype).contiguous(), lse.contiguous() if need_lse else None

    def bwd_plan(cfg, dout, q, k, v, out, lse, dlse, **kwargs):
        return _bwd.Plan(cfg, "fa2", "CPU stand-in", None, 0, False, q.device, None)

    def bwd_run(plan, dout, q, k, v, out, lse, dlse):
        cfg = plan.cfg.fwd
        grads = attention_bwd_ref(q, k, v, out, lse, dout, softmax_scale=cfg.softmax_scale,
                                  window_size=(cfg.window_left, cfg.window_right),
                                  softcap=cfg.softcap, dlse=dlse)
        return tuple(g.to(t.dtype).contiguous() for g, t in zip(grads, (q, k, v)))

    monkeypatch.setattr(_fwd, "make_plan", fwd_plan)
    monkeypatch.setattr(_fwd, "_run_new_outputs", fwd_run)
    monkeypatch.setattr(_bwd, "make_plan", bwd_plan)
    monkeypatch.setattr(_bwd, "_run_new_grads", bwd_run)
    monkeypatch.setattr(_validate, "_check_device", lambda name, t, ref: None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _loss(q, k, v, w, with_lse):
    out, lse = flash_attn_func(q, k, v, causal=True, window_size=(8, -1), softcap=3.0,
                               return_attn_probs=True)
    y = out.float().flatten(2) @ w
    loss = y.square().mean()
    if with_lse:
        loss = loss + lse.mean() * 0.1
    return loss


@pytest.mark.parametrize("with_lse", [False, True])
def test_compiled_training_step_equals_eager_on_cpu(cpu_kernels, with_lse):
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch.manual_seed(0)
    base = [torch.randn(2, 19, 4, 32), torch.randn(2, 23, 2, 32), torch.randn(2, 23, 2, 32)]
    w0 = torch.randn(4 * 32, 8)

    def train(loss_fn):
        q, k, v = (t.to(BF16).requires_grad_() for t in base)
        w = w0.clone().requires_grad_()
        losses = []
        for _ in range(2):  # two SGD steps
            loss = loss_fn(q, k, v, w, with_lse)
            loss.backward()
            losses.append(loss.detach())
            with torch.no_grad():
                for t in (q, k, v, w):
                    t -= 0.1 * t.grad.to(t.dtype)
                    t.grad = None
        return losses, [q.detach(), k.detach(), v.detach(), w.detach()]

    eager_losses, eager_params = train(_loss)
    graphs = AotEagerAndRecordGraphs()
    compiled_losses, compiled_params = train(torch.compile(_loss, fullgraph=True, backend=graphs))
    for a, b in zip(eager_losses + eager_params, compiled_losses + compiled_params):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(eager_params[0], base[0].to(BF16))  # the steps moved q
    # One graph each way: the forward op in the forward graph, the bwd op in the backward's.
    targets = [[n.target for n in g.graph.nodes] for g in (*graphs.fw_graphs, *graphs.bw_graphs)]
    assert any(torch.ops.flash_hopper.fwd.default in t for t in targets[:len(graphs.fw_graphs)])
    assert any(torch.ops.flash_hopper.bwd.default in t for t in targets[len(graphs.fw_graphs):])


def test_eager_gradients_on_cpu_match_autograd_of_the_reference(cpu_kernels):
    # The autograd Function wires dout, dlse and the outputs to the right gradients.
    q, k, v = (torch.randn(*s, dtype=torch.float32).to(BF16).requires_grad_()
               for s in ((1, 9, 4, 16), (1, 13, 2, 16), (1, 13, 2, 16)))
    out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention_ref(q64, k64, v64, causal=True)
    expected = torch.autograd.grad((out64, lse64), (q64, k64, v64), (dout.double(),
                                                                     dlse.double()))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e, atol=5e-2, rtol=5e-2)
