"""The custom op, parameter filling and the eager host path, on CPU (no GPU).

What torch.compile relies on is checked without a GPU: the op's schema, its fake implementation
on meta tensors, and flash_attn_func running end to end on FakeTensors of a "cuda" device without
ever loading the library or querying a device (so tracing cannot hit ctypes).

The host path (_fwd.py: validate once -> choose the path -> fill params -> launch, plans cached
per call signature) runs on CPU tensors with the device parts stubbed and a recording stand-in for
the library, so each test sees exactly which structs reach fh_fwd, and that bad input reaches none.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from _helpers import raises
from flash_hopper import (
    _device,
    _fwd,
    _lib,
    _plan_cache,
    _validate,
    flash_attn_func,
    ops,
    which_backend,
)
from flash_hopper._lib import FhBackend, FhDtype, FhFwdParams, FhVariant
from flash_hopper.reference import attention_ref
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Plans cached by one test (with its stand-ins) must not serve another."""
    _fwd.clear_plans()
    yield
    _fwd.clear_plans()


@pytest.fixture
def no_library(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("touched the library or the device while tracing")

    monkeypatch.setattr(_lib, "get_library", forbidden)
    monkeypatch.setattr(_device, "device_info", forbidden)


def test_schema():
    schema = str(torch.ops.flash_hopper.fwd.default._schema)
    assert schema == (
        "flash_hopper::fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, int window_left, "
        "int window_right, float softcap, str backend, bool deterministic, int sm_margin=0) -> "
        "(Tensor, Tensor)"
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("b", "sq", "sk", "hq", "hkv", "d"),
                         [(2, 17, 113, 8, 2, 64), (1, 1, 1, 1, 1, 8), (0, 5, 5, 2, 2, 256),
                          (3, 0, 7, 4, 4, 128), (2, 9, 0, 6, 3, 72)])
def test_fake_kernel_shapes_on_meta(b, sq, sk, hq, hkv, d, dtype):
    q = torch.empty(b, sq, hq, d, dtype=dtype, device="meta")
    k = torch.empty(b, sk, hkv, d, dtype=dtype, device="meta")
    out, lse = torch.ops.flash_hopper.fwd(q, k, k, 0.125, -1, 0, 0.0, "auto", False)
    assert out.shape == (b, sq, hq, d) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert out.device.type == lse.device.type == "meta"


def test_fake_kernel_on_a_transposed_layout():
    # (b, h, s, d) storage viewed as (b, s, h, d): the outputs are still fresh contiguous tensors.
    q = torch.empty(2, 8, 33, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    out, lse = torch.ops.flash_hopper.fwd(q, q, q, 0.125, -1, -1, 0.0, "fa2", False)
    assert out.shape == (2, 33, 8, 64) and out.is_contiguous()
    assert lse.shape == (2, 8, 33)


def test_flash_attn_func_on_fake_cuda_tensors_touches_no_library(no_library):
    with FakeTensorMode():
        q = torch.empty(2, 17, 8, 96, dtype=torch.float16, device="cuda")
        k = torch.empty(2, 40, 2, 96, dtype=torch.float16, device="cuda")
        out = flash_attn_func(q, k, k, causal=True)
        out2, lse = flash_attn_func(q, k, k, window_size=(8, 8), return_attn_probs=True)
    assert out.shape == out2.shape == (2, 17, 8, 96) and out.dtype == torch.float16
    assert lse.shape == (2, 8, 17) and lse.dtype == torch.float32


def test_traced_graph_is_one_op_with_resolved_arguments(no_library):
    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(32, -1), softcap=5.0)

    with FakeTensorMode():
        q = torch.empty(2, 17, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 40, 2, 64, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(2, 40, 2, 64, dtype=torch.bfloat16, device="cuda")
        graph = make_fx(attention)(q, k, v)
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    fwd_calls = [n for n in calls if n.target is torch.ops.flash_hopper.fwd.default]
    assert len(fwd_calls) == 1
    # causal=True folded into window_right = 0; default scale 1/sqrt(64).
    assert fwd_calls[0].args[3:] == (0.125, 32, 0, 5.0, "auto", False)


@pytest.fixture
def cpu_stand_in(monkeypatch):
    """Let flash_attn_func run on CPU tensors: device check relaxed, kernel = the reference.

    Everything torch.compile traces (validation, the op call, its fake kernel) stays real, and so
    does the host path's validation and plan cache; only the path choice and the launch behind
    the op are replaced, so graph breaks show up here without a GPU.
    """

    def make_plan(cfg, q, k, v, **kwargs):
        return _fwd.Plan(cfg, "fa2", "CPU stand-in", None, q.device,
                         (cfg.batch, cfg.seqlen_q, cfg.heads_q, cfg.head_dim),
                         (cfg.batch, cfg.heads_q, cfg.seqlen_q), None, cfg.dtype)

    def run(plan, q, k, v, need_lse=True):
        cfg = plan.cfg
        out, lse = attention_ref(q, k, v, softmax_scale=cfg.softmax_scale,
                                 window_size=(cfg.window_left, cfg.window_right),
                                 softcap=cfg.softcap)
        # what the kernel gives
        return out.to(q.dtype).contiguous(), lse.contiguous() if need_lse else None

    monkeypatch.setattr(_fwd, "make_plan", make_plan)
    monkeypatch.setattr(_fwd, "_run_new_outputs", run)
    monkeypatch.setattr(_validate, "_check_device", lambda name, t, ref: None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_traces_on_cpu(cpu_stand_in, dynamic, compile_backend):
    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(8, -1), softcap=3.0,
                               return_attn_probs=True)

    compiled = torch.compile(attention, fullgraph=True, dynamic=dynamic, backend=compile_backend)
    k = torch.randn(2, 33, 2, 64, dtype=torch.bfloat16)
    for seqlen_q in (17, 29):  # a second shape: recompiles (static) or reuses (dynamic)
        q = torch.randn(2, seqlen_q, 4, 64, dtype=torch.bfloat16)
        out, lse = compiled(q, k, k)
        out_eager, lse_eager = attention(q, k, k)
        assert torch.equal(out, out_eager) and torch.equal(lse, lse_eager)


# --- FhFwdParams filling -------------------------------------------------------------------------


def _config(q, k, v, **kwargs):
    with FakeTensorMode():
        fake = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                for t in (q, k, v)]
        return _validate.check_fwd_args(*fake, **kwargs)


def test_make_params_from_a_packed_qkv_tensor():
    b, s, h, d = 2, 33, 4, 64
    qkv = torch.zeros(b, s, 3, h, d, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)  # non-contiguous views: row stride 3 * h * d
    out = torch.zeros(b, s, h, d, dtype=torch.bfloat16)
    lse = torch.zeros(b, h, s)
    cfg = _config(q, k, v, causal=True, window_size=(16, -1), softcap=2.5)
    p = ops.make_params(q, k, v, out, lse, cfg, "fa2", num_sms=132)

    assert p.abi_version == _lib.ABI_VERSION
    assert (p.q, p.k, p.v, p.o, p.lse) == (
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
    assert p.k - p.q == h * d * 2  # bytes between the q and k slices
    assert (p.dtype, p.out_dtype) == (FhDtype.BF16, FhDtype.BF16)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv) == (b, s, s, h, h)
    assert (p.head_dim, p.head_dim_v) == (d, d)
    for prefix in ("q", "k", "v"):
        strides = [getattr(p, f"{prefix}_{n}_stride") for n in ("batch", "row", "head")]
        assert strides == [s * 3 * h * d, 3 * h * d, d], prefix
    assert (p.o_batch_stride, p.o_row_stride, p.o_head_stride) == (s * h * d, h * d, d)
    assert (p.lse_batch_stride, p.lse_head_stride) == (h * s, s)
    assert p.softmax_scale == pytest.approx(d**-0.5)
    assert p.softcap == pytest.approx(2.5)
    assert (p.window_left, p.window_right) == (16, 0)
    assert (p.backend, p.variant, p.num_sms, p.decode_route) == (FhBackend.FA2, 0, 132, 0)
    unused = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "q_descale", "k_descale",
              "v_descale")
    assert all(getattr(p, name) is None for name in unused)


def test_make_params_without_lse_and_with_empty_keys():
    q = torch.zeros(1, 5, 2, 64, dtype=torch.float16)
    k = torch.zeros(1, 0, 2, 64, dtype=torch.float16)
    out = torch.zeros_like(q)
    cfg = _config(q, k, k)
    p = ops.make_params(q, k, k, out, None, cfg, "fa3")
    assert p.lse is None and p.dtype == FhDtype.FP16 and p.backend == FhBackend.FA3
    assert p.seqlen_k == 0  # the kernel writes out = 0, lse = -inf; k/v may be null then


# --- the eager host path: one pass down, plans cached per call signature -------------------------


class RecordingLibrary:
    """Stands in for _lib.Library: its policy answers ``choice``; fh_fwd records every struct."""

    def __init__(self, choice=FhBackend.FA2):
        self.choice = choice
        self.policy_calls = []
        self.launches = []

    def policy(self, params, capability):
        self.policy_calls.append((bytes(params), capability))
        return self.choice, f"stand-in policy on cc {capability[0]}.{capability[1]}"

    def fh_fwd(self, params, stream):
        self.launches.append((FhFwdParams.from_buffer_copy(bytes(params)), stream))
        return 0

    def fwd_workspace_size(self, params):
        # api.h: a dense call's tile counter where a mask lets its FA-3 tiles be claimed
        return 4 if params.window_left >= 0 or params.window_right >= 0 else 0

    def check(self, status, what):
        raise AssertionError(f"{what} failed with {status}")


STREAM = 0x5EED


@pytest.fixture
def host(monkeypatch):
    """The host path on CPU tensors: a cc 9.0 device, the recording library, stream STREAM."""
    lib = RecordingLibrary()
    monkeypatch.setattr(_lib, "get_library", lambda: lib)
    info = types.SimpleNamespace(capability=(9, 0), sm_count=132)
    monkeypatch.setattr(_device, "device_info", lambda index: info)
    monkeypatch.setattr(_validate, "_check_device", lambda name, t, ref: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_fwd, "_current_device", lambda: None)  # CPU tensors: device index None
    monkeypatch.setattr(_fwd, "_raw_stream", lambda index: STREAM)
    return lib


def qkv(b=2, sq=17, sk=33, hq=8, hkv=2, d=64, dtype=torch.bfloat16):
    return (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype),
            torch.randn(b, sk, hkv, d, dtype=dtype))


def test_repeated_calls_reuse_one_plan_and_write_only_the_pointers(host):
    q, k, v = qkv()
    outs = [flash_attn_func(q, k, v, causal=True, return_attn_probs=True) for _ in range(3)]
    assert len(host.policy_calls) == 1  # validated and chosen once
    assert len(host.launches) == 3
    for (params, stream), (out, lse) in zip(host.launches, outs):
        assert stream == STREAM
        assert (params.q, params.k, params.v) == (q.data_ptr(), k.data_ptr(), v.data_ptr())
        assert (params.o, params.lse) == (out.data_ptr(), lse.data_ptr())
        assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
        assert lse.shape == (2, 8, 17) and lse.dtype == torch.float32 and lse.is_contiguous()
    first = host.launches[0][0]
    assert (first.window_left, first.window_right) == (-1, 0)
    assert (first.o_batch_stride, first.o_row_stride, first.o_head_stride) == (17 * 8 * 64,
                                                                               8 * 64, 64)
    assert (first.lse_batch_stride, first.lse_head_stride) == (8 * 17, 17)
    # Apart from the data pointers, every launch gets the same bytes.
    blank = [bytes(_with_pointers(p, 0)) for p, _ in host.launches]
    assert blank[0] == blank[1] == blank[2]


def _with_pointers(params, value):
    copy = FhFwdParams.from_buffer_copy(bytes(params))
    copy.q = copy.k = copy.v = copy.o = copy.lse = value
    return copy


def test_the_plan_pins_the_policys_choice(host):
    host.choice = FhBackend.FA3
    q, k, v = qkv()
    out = torch.empty_like(q)
    assert ops.fwd_into(q, k, v, out, None, 0.125, -1, -1, 0.0, "auto") == "fa3"
    params, _ = host.launches[-1]
    assert (params.backend, params.variant) == (FhBackend.FA3, FhVariant.TUNED)
    assert params.lse is None and (params.lse_batch_stride, params.lse_head_stride) == (0, 0)
    # The request went to the policy as asked ("auto"); what runs is pinned in the struct.
    asked = FhFwdParams.from_buffer_copy(host.policy_calls[-1][0])
    assert asked.backend == FhBackend.AUTO and host.policy_calls[-1][1] == (9, 0)
    assert ops.fwd_into(q, k, v, out, None, 0.125, -1, -1, 0.0, "fa3-no-pingpong") == (
        "fa3-no-pingpong")
    assert host.launches[-1][0].variant == FhVariant.NO_PINGPONG


@pytest.mark.parametrize(("choice", "causal", "bytes_"), [
    (FhBackend.FA3, True, 4), (FhBackend.FA3, False, 0), (FhBackend.FA2, True, 0)])
def test_masked_fa3_calls_get_their_tile_counter(host, choice, causal, bytes_):
    # The FA-3 path claims a masked call's tiles from a counter in the workspace: every launch
    # gets one of its own (fh_fwd zeroes it on the stream); other calls launch without one.
    host.choice = choice
    q, k, v = qkv()
    flash_attn_func(q, k, v, causal=causal)
    flash_attn_func(q, k, v, causal=causal)
    for params, _ in host.launches[-2:]:
        assert params.workspace_bytes == bytes_
        assert (params.workspace is not None) == (bytes_ > 0)


def test_each_signature_gets_its_own_plan(host):
    q, k, v = qkv()
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v)
    flash_attn_func(q, k, v, causal=True)
    flash_attn_func(q, k, v, softcap=2.0)
    flash_attn_func(q.transpose(1, 2).contiguous().transpose(1, 2), k, v)  # other strides
    flash_attn_func(q[:1], k[:1], v[:1])  # other shape
    flash_attn_func(q.half(), k.half(), v.half())  # other dtype
    assert len(host.policy_calls) == 6
    strides = [(p.q_row_stride, p.q_head_stride) for p, _ in host.launches]
    assert strides[4] == (64, 17 * 64) and strides[0] == (8 * 64, 64)


@pytest.mark.parametrize(
    ("valid", "invalid", "exc", "fragment"),
    [
        ({"causal": True}, {"causal": 1}, TypeError, "causal: expected a bool"),
        ({"softmax_scale": 1.0}, {"softmax_scale": True}, TypeError, "softmax_scale"),
        ({"softcap": 0.0}, {"softcap": False}, TypeError, "softcap"),
        ({"window_size": (1, 0)}, {"window_size": (True, 0)}, TypeError, "window_size[0]"),
        ({"window_size": (4, -1)}, {"window_size": (4, -1.0)}, TypeError, "window_size[1]"),
    ],
)
def test_a_cached_plan_never_accepts_an_equal_value_of_a_rejected_type(host, valid, invalid, exc,
                                                                       fragment):
    # 1 == True == 1.0 as dict keys: the key carries each argument's type.
    q, k, v = qkv()
    flash_attn_func(q, k, v, **valid)
    with raises(exc, fragment):
        flash_attn_func(q, k, v, **invalid)
    assert len(host.launches) == 1


def test_lists_and_tuples_share_a_plan(host):
    q, k, v = qkv()
    flash_attn_func(q, k, v, window_size=(8, 0))
    flash_attn_func(q, k, v, window_size=[8, 0])
    assert len(host.policy_calls) == 1 and len(host.launches) == 2


def test_failed_validation_is_not_cached_and_launches_nothing(host):
    q, k, v = qkv()
    for _ in range(2):
        with raises(ValueError, "softmax_scale: expected a float > 0", "-1.0"):
            flash_attn_func(q, k, v, softmax_scale=-1.0)
        with raises(ValueError, "k: heads_kv (dim 2) must divide q's heads_q 8", "got 3"):
            flash_attn_func(q, k[:, :, :1].expand(2, 33, 3, 64), v[:, :, :1].expand(2, 33, 3, 64))
        with raises(TypeError, "window_size: expected a pair"):
            flash_attn_func(q, k, v, window_size=[1, 2, 3])
        with raises(TypeError, "softmax_scale: expected a float", "list"):
            flash_attn_func(q, k, v, softmax_scale=[0.1])  # unhashable: no cache, same message
    assert host.policy_calls == [] and host.launches == []
    assert not _fwd._plans


def test_a_misaligned_pointer_is_caught_even_with_a_cached_plan(host):
    q, k, v = qkv(b=1, sq=16, hq=4)
    flash_attn_func(q, k, v)
    base = torch.randn(q.numel() + 8, dtype=q.dtype)
    shifted = base[1:1 + q.numel()].view(q.shape)  # same shape and strides, 2 bytes off
    assert shifted.stride() == q.stride()
    with raises(ValueError, "q: data pointer must be 16-byte aligned", "storage_offset 1"):
        flash_attn_func(shifted, k, v)
    assert len(host.launches) == 1 and len(host.policy_calls) == 1


def test_the_plan_cache_is_bounded(host, monkeypatch):
    monkeypatch.setattr(_fwd, "_plans", _plan_cache.PlanCache(4))
    k, v = qkv(sq=1)[1:]
    for seqlen in range(1, 11):  # a growing sequence: one new signature per step
        flash_attn_func(torch.randn(2, seqlen, 8, 64, dtype=torch.bfloat16), k, v)
    assert len(_fwd._plans) == 4
    # the oldest went first (a key: the call's signature, sm_margin, what the decode route reads)
    assert [key[0][1][1] for key in _fwd._plans.signatures()] == [7, 8, 9, 10]


def test_the_op_and_the_eager_path_fill_the_same_struct(host):
    q, k, v = qkv()
    flash_attn_func(q, k, v, causal=True, window_size=(16, -1), softcap=3.0)
    torch.ops.flash_hopper.fwd(q, k, v, 64**-0.5, 16, 0, 3.0, "auto", False)  # the real impl
    torch.ops.flash_hopper.fwd(q, k, v, 64**-0.5, 16, 0, 3.0, "auto", False)
    eager, op, op_again = (bytes(_with_pointers(p, 0)) for p, _ in host.launches)
    assert eager == op == op_again
    assert len(host.policy_calls) == 2  # one plan per entry point's signature


def test_nothing_to_compute_asks_no_policy_and_launches_nothing(host):
    q, k, v = qkv(b=0)
    out, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (0, 8, 17)
    q, k, v = qkv(sq=0)
    assert ops.fwd_into(q, k, v, torch.empty_like(q), None, 0.1, -1, -1, 0.0) == "none"
    assert host.policy_calls == [] and host.launches == []


def test_which_backend_reports_the_plan(host):
    q, k, v = qkv()
    assert which_backend(q, k, v) == ("fa2", "stand-in policy on cc 9.0")
    flash_attn_func(q, k, v)  # the same signature: no second policy call
    assert len(host.policy_calls) == 1


def test_fwd_into_checks_caller_buffers_every_call(host):
    q, k, v = qkv()
    out = torch.empty_like(q)
    lse = torch.empty(2, 8, 17)
    assert ops.fwd_into(q, k, v, out, lse, 0.125, -1, -1, 0.0, num_sms=3) == "fa2"
    params, _ = host.launches[-1]
    assert (params.o, params.lse, params.num_sms) == (out.data_ptr(), lse.data_ptr(), 3)
    with raises(ValueError, "lse: expected shape (2, 8, 17)"):
        ops.fwd_into(q, k, v, out, torch.empty(2, 17, 8), 0.125, -1, -1, 0.0)
    assert len(host.launches) == 1


def test_launch_switches_to_the_tensors_device(host, monkeypatch):
    entered = []

    class DeviceGuard:
        def __init__(self, index):
            entered.append(index)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(_fwd, "_current_device", lambda: 1)  # another device is current
    monkeypatch.setattr(torch.cuda, "device", DeviceGuard)
    q, k, v = qkv()
    flash_attn_func(q, k, v)
    assert entered == [None] and len(host.launches) == 1  # q's device (index None on CPU)


# --- bench/host_path.py: the GPU measurement script imports and parses here --------------------


def _run_script(*args: str, **env: str) -> subprocess.CompletedProcess:
    package_root = str(Path(_fwd.__file__).resolve().parents[1])
    environ = dict(os.environ, **env)
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, str(ROOT / "bench" / "host_path.py"), *args],
                          env=environ, capture_output=True, text=True, timeout=300, check=False)


def test_host_path_script_dry_run():
    if not (ROOT / "bench" / "host_path.py").is_file():
        pytest.skip("bench/ not present (tests run outside the source tree)")
    done = _run_script("--dry", "-d", "64", "128", "--causal", "both")
    assert done.returncode == 0, done.stderr
    cases = [line for line in done.stdout.splitlines() if line.startswith("case:")]
    assert len(cases) == 4 and '"head_dim": 128' in cases[-1]
    bad = _run_script("--calls", "0")
    assert bad.returncode == 2 and "--calls: expected >= 1, got 0" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU proxy refuses to run on a GPU")
def test_host_path_script_cpu_proxy(lib, tmp_path):
    if not (ROOT / "bench" / "host_path.py").is_file():
        pytest.skip("bench/ not present (tests run outside the source tree)")
    out = tmp_path / "proxy.json"
    done = _run_script("--cpu-proxy", "-d", "64", "--calls", "20", "--rounds", "2",
                       "--warmup", "2", "--json", str(out), FLASH_HOPPER_LIB=str(lib.path))
    assert done.returncode == 0, done.stdout + done.stderr
    import json

    result = json.loads(out.read_text())
    assert result["mode"] == "cpu-proxy" and result["schema"] == "flash-hopper-host-path/1"
    assert result["library"]["kernels"]
    for row in result["results"]:
        assert row["host_us"]["median"] > 0
