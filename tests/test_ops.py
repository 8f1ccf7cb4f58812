"""The custom op's registration, fake kernel and parameter filling, on CPU (no library, no GPU).

What torch.compile relies on is checked without a GPU: the op's schema, its fake implementation
on meta tensors, and flash_attn_func running end to end on FakeTensors of a "cuda" device without
ever loading the library or querying a device (so tracing cannot hit ctypes).
"""

from __future__ import annotations

import pytest
import torch
from flash_hopper import _lib, _validate, flash_attn_func, ops
from flash_hopper._lib import FhBackend, FhDtype
from flash_hopper.reference import attention_ref
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx


@pytest.fixture
def no_library(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("touched the library or the device while tracing")

    monkeypatch.setattr(_lib, "get_library", forbidden)
    monkeypatch.setattr(ops._device, "device_info", forbidden)


def test_schema():
    schema = str(torch.ops.flash_hopper.fwd.default._schema)
    assert schema == (
        "flash_hopper::fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, int window_left, "
        "int window_right, float softcap, str backend) -> (Tensor, Tensor)"
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("b", "sq", "sk", "hq", "hkv", "d"),
                         [(2, 17, 113, 8, 2, 64), (1, 1, 1, 1, 1, 8), (0, 5, 5, 2, 2, 256),
                          (3, 0, 7, 4, 4, 128), (2, 9, 0, 6, 3, 72)])
def test_fake_kernel_shapes_on_meta(b, sq, sk, hq, hkv, d, dtype):
    q = torch.empty(b, sq, hq, d, dtype=dtype, device="meta")
    k = torch.empty(b, sk, hkv, d, dtype=dtype, device="meta")
    out, lse = torch.ops.flash_hopper.fwd(q, k, k, 0.125, -1, 0, 0.0, "auto")
    assert out.shape == (b, sq, hq, d) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert out.device.type == lse.device.type == "meta"


def test_fake_kernel_on_a_transposed_layout():
    # (b, h, s, d) storage viewed as (b, s, h, d): the outputs are still fresh contiguous tensors.
    q = torch.empty(2, 8, 33, 64, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    out, lse = torch.ops.flash_hopper.fwd(q, q, q, 0.125, -1, -1, 0.0, "fa2")
    assert out.shape == (2, 33, 8, 64) and out.is_contiguous()
    assert lse.shape == (2, 8, 33)


def test_backward_refuses_instead_of_faking_a_gradient():
    q = torch.randn(1, 4, 2, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    out, _ = torch.ops.flash_hopper.fwd(q, q, q, 0.125, -1, -1, 0.0, "auto")
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="backward lands in a later issue"):
        out.sum().backward()


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
    assert fwd_calls[0].args[3:] == (0.125, 32, 0, 5.0, "auto")


@pytest.fixture
def cpu_stand_in(monkeypatch):
    """Let flash_attn_func run on CPU tensors: device check relaxed, kernel = the reference.

    Everything torch.compile traces (validation, the op call, its fake kernel) stays real; only
    the launch behind the op is replaced, so graph breaks show up here without a GPU.
    """

    def launch(q, k, v, out, lse, cfg, num_sms=0):
        o, l = attention_ref(q, k, v, softmax_scale=cfg.softmax_scale,
                             window_size=(cfg.window_left, cfg.window_right), softcap=cfg.softcap)
        out.copy_(o)
        lse.copy_(l)
        return "fa2"

    monkeypatch.setattr(ops, "_launch", launch)
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
    assert (p.backend, p.variant, p.num_sms, p.num_splits) == (FhBackend.FA2, 0, 132, 1)
    reserved = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table", "q_descale",
                "k_descale", "v_descale", "o_accum", "lse_accum")
    assert all(getattr(p, name) is None for name in reserved)
    assert (p.page_table_batch_stride, p.page_size) == (0, 0)


def test_make_params_without_lse_and_with_empty_keys():
    q = torch.zeros(1, 5, 2, 64, dtype=torch.float16)
    k = torch.zeros(1, 0, 2, 64, dtype=torch.float16)
    out = torch.zeros_like(q)
    cfg = _config(q, k, k)
    p = ops.make_params(q, k, k, out, None, cfg, "fa3")
    assert p.lse is None and p.dtype == FhDtype.FP16 and p.backend == FhBackend.FA3
    assert p.seqlen_k == 0  # the kernel writes out = 0, lse = -inf; k/v may be null then
