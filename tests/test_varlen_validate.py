"""Varlen argument checks and the C ABI's varlen fields, on the CPU (docs/host.md "Varlen").

The offsets' metadata and values are checked before anything is launched, each failure naming
the argument, the expected and the actual value; the library refuses what it does not implement
(the mixed mode in varlen, the FA-3 ablation kernels) and sizes the work list's workspace. FP8
(e4m3) varlen takes descales of shape (batch, heads_kv), batch = the sequences.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from flash_hopper import _varlen, flash_attn_varlen_func
from flash_hopper import vllm as fh_vllm
from flash_hopper._errors import UnsupportedError
from flash_hopper._lib import ABI_VERSION, FhBackend, FhDtype, FhFwdParams, FhStatus
from torch._subclasses.fake_tensor import FakeTensorMode

from tests._helpers import raises

I32 = torch.int32


def qkv(total_q=100, total_k=120, hq=4, hkv=2, d=64, dtype=torch.bfloat16):
    return (torch.zeros(total_q, hq, d, dtype=dtype), torch.zeros(total_k, hkv, d, dtype=dtype),
            torch.zeros(total_k, hkv, d, dtype=dtype))


def cu(*offsets):
    return torch.tensor(offsets, dtype=I32)


def args(**over):
    q, k, v = qkv()
    a = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu(0, 40, 100), "cu_seqlens_k": cu(0, 60, 120),
             "max_seqlen_q": 60, "max_seqlen_k": 60, "seqused_q": None, "seqused_k": None,
             "softmax_scale": None, "causal": False, "window_size": (-1, -1), "softcap": 0.0,
             "backend": "auto"}
    a.update(over)
    return a


@pytest.mark.parametrize(("over", "exc", "fragments"), [
    ({"q": torch.zeros(1, 100, 4, 64)}, ValueError,
     ("q: expected a 3-D tensor (total_q, heads, head_dim)", "got shape (1, 100, 4, 64)")),
    ({"k": torch.zeros(120, 2, 64, dtype=torch.float8_e4m3fn)}, UnsupportedError,
     ("k / v: varlen with FP8 k / v", "(the mixed mode) is not implemented yet")),
    ({"cu_seqlens_q": [0, 40, 100]}, TypeError, ("cu_seqlens_q: expected a torch.Tensor",)),
    ({"cu_seqlens_q": cu(0, 40, 100).long()}, TypeError,
     ("cu_seqlens_q: expected dtype torch.int32, got torch.int64",)),
    ({"cu_seqlens_k": cu(0, 60)}, ValueError,
     ("cu_seqlens_k: expected 3 entries", "got 2")),
    ({"cu_seqlens_q": cu(0, 40, 100).reshape(1, 3)}, ValueError,
     ("cu_seqlens_q: expected a 1-D tensor", "got shape (1, 3)")),
    ({"cu_seqlens_q": torch.zeros(0, dtype=I32)}, ValueError,
     ("cu_seqlens_q: expected batch + 1 >= 1 entries, got 0",)),
    ({"cu_seqlens_q": torch.tensor([0, 0, 40, 0, 100, 0], dtype=I32)[::2]}, ValueError,
     ("cu_seqlens_q: expected a contiguous tensor (stride 1), got stride 2",)),
    ({"seqused_k": cu(1, 2, 3)}, ValueError, ("seqused_k: expected 2 entries",)),
    ({"seqused_q": torch.tensor([1.0, 2.0])}, TypeError,
     ("seqused_q: expected dtype torch.int32",)),
    ({"max_seqlen_q": 60.0}, TypeError, ("max_seqlen_q: expected an int, got float",)),
    ({"max_seqlen_k": True}, TypeError, ("max_seqlen_k: expected an int, got bool",)),
    ({"max_seqlen_k": -1}, ValueError, ("max_seqlen_k: expected an int in [0, 2**63), got -1",)),
])
def test_metadata_errors_name_the_argument(over, exc, fragments):
    with raises(exc, *fragments):
        _varlen.check_args(**args(**over))


@pytest.mark.parametrize(("cu_q", "cu_k", "used_q", "used_k", "fragments"), [
    (cu(0, 60, 50), cu(0, 60, 120), None, None,
     ("cu_seqlens_q: expected non-decreasing offsets, got 60 then 50 at index 2",)),
    (cu(0, 40, 101), cu(0, 60, 120), None, None,
     ("cu_seqlens_q: expected the last offset <= total tokens (q.shape[0] = 100), got 101",)),
    (cu(0, 40, 100), cu(-3, 60, 120), None, None,
     ("cu_seqlens_k: expected offsets >= 0, got -3 at index 0",)),
    (cu(0, 40, 100), cu(0, 60, 121), None, None,
     ("cu_seqlens_k: expected the last offset <= total tokens (k.shape[0] = 120), got 121",)),
    (cu(0, 40, 100), cu(0, 60, 120), cu(40, 61), None,
     ("seqused_q: expected 0 <= seqused_q[1] <= its span in cu_seqlens_q (60), got 61",)),
    (cu(0, 40, 100), cu(0, 60, 120), None, cu(-1, 0),
     ("seqused_k: expected 0 <= seqused_k[0] <= its span in cu_seqlens_k (60), got -1",)),
])
def test_offset_values(cu_q, cu_k, used_q, used_k, fragments):
    with raises(ValueError, *fragments):
        _varlen.check_offsets(cu_q, cu_k, used_q, used_k, 100, 120)


def test_good_offsets_pass():
    _varlen.check_offsets(cu(0, 40, 40, 100), cu(0, 0, 60, 120), cu(10, 0, 60),
                          cu(0, 60, 60), 100, 120)
    _varlen.check_offsets(cu(0), cu(0), None, None, 0, 0)  # no sequence


def test_offsets_check_can_be_switched_off(monkeypatch):
    assert _varlen.offsets_checked()
    monkeypatch.setenv("FLASH_HOPPER_CHECK_OFFSETS", "0")
    assert not _varlen.offsets_checked()


@pytest.mark.parametrize(("kwargs", "exc", "fragment"), [
    ({"block_table": torch.zeros(2, 3, dtype=I32)}, UnsupportedError,
     "cu_seqlens_k: expected None with block_table"),
    ({"block_table": torch.zeros(2, 3, dtype=I32), "cu_seqlens_k": None}, UnsupportedError,
     "seqused_k: expected a tensor with block_table"),
    ({"cu_seqlens_k": None}, UnsupportedError,
     "cu_seqlens_k: expected a tensor, or block_table with seqused_k"),
    ({"s_aux": torch.zeros(3)}, ValueError, "s_aux: expected 4 entries (heads_q), got 3"),
    ({"dropout_p": 0.1}, UnsupportedError, "dropout_p: expected 0.0"),
    ({"alibi_slopes": torch.zeros(4)}, UnsupportedError, "alibi_slopes: expected None"),
    ({"q_v": torch.zeros(1)}, ValueError, "qv: expected a 3-D tensor"),  # served: checked
    ({"cp_world_size": 2}, UnsupportedError, "cp_world_size: expected 1"),
    ({"return_attn_probs": True}, UnsupportedError, "return_attn_probs: expected False"),
    ({"fa_version": 4}, ValueError, "fa_version: expected 2 or 3, got 4"),
    ({"num_splits": -1}, TypeError, "num_splits: expected an int >= 0, got -1"),
])
def test_vllm_module_refuses_what_is_not_implemented(kwargs, exc, fragment):
    q, k, v = qkv()
    call = {"q": q, "k": k, "v": v, "max_seqlen_q": 60, "cu_seqlens_q": cu(0, 40, 100), "max_seqlen_k": 60,
                "cu_seqlens_k": cu(0, 60, 120)}
    call.update(kwargs)
    with raises(exc, fragment):
        fh_vllm.flash_attn_varlen_func(**call)


def test_vllm_paged_call_is_flash_attn_with_kvcache(monkeypatch):
    """vLLM's paged call (block_table, seqused_k, no cu_seqlens_k) maps onto
    flash_attn_with_kvcache's paged path argument by argument (s_aux as its sinks)."""
    from flash_hopper import kvcache

    seen = {}
    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache",
                        lambda *a, **kw: seen.update(args=a, kw=kw) or "result")
    q = torch.zeros(7, 4, 64, dtype=torch.bfloat16)
    pool = torch.zeros(10, 16, 2, 64, dtype=torch.bfloat16)
    table, used, cu_q = torch.zeros(2, 3, dtype=I32), torch.tensor([5, 40], dtype=I32), cu(0, 3, 7)
    sinks = torch.zeros(4)
    got = fh_vllm.flash_attn_varlen_func(q, pool, pool, 4, cu_q, 48, seqused_k=used,
                                         block_table=table, causal=True, window_size=[8, 0],
                                         softcap=3.0, return_softmax_lse=True, s_aux=sinks)
    assert got == "result" and seen["args"] == (q, pool, pool)
    kw = seen["kw"]
    assert kw["page_table"] is table and kw["cache_seqlens"] is used and kw["sinks"] is sinks
    assert kw["cu_seqlens_q"] is cu_q and kw["max_seqlen_q"] == 4 and kw["causal"] is True
    assert kw["window_size"] == (8, 0) and kw["softcap"] == 3.0 and kw["return_softmax_lse"]


def test_fa3_extras_are_checked():
    q, k, v = qkv()
    with raises(ValueError, "attention_chunk: expected an int >= 0", "-8"):
        flash_attn_varlen_func(q, k, v, cu(0, 100), cu(0, 120), 100, 120, attention_chunk=-8)
    with raises(UnsupportedError, "attention_chunk: expected 0 under torch.compile"), \
            FakeTensorMode():
        fq, fk, fv = (torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in (q, k, v))
        fc = torch.empty(2, dtype=torch.int32, device="cuda")
        flash_attn_varlen_func(fq, fk, fv, fc, fc, 100, 120, attention_chunk=8)
    # qv is served (tests/test_qv.py); with v of q's head dim it is refused naming v's
    with raises(ValueError, "v: expected head_dim_v a multiple of 8 in [256, 512] with qv"):
        flash_attn_varlen_func(q, k, v, cu(0, 100), cu(0, 120), 100, 120, qv=q)
    with raises(TypeError, "return_attn_probs: expected a bool"):
        flash_attn_varlen_func(q, k, v, cu(0, 100), cu(0, 120), 100, 120, return_attn_probs=1)


# --- the C ABI ------------------------------------------------------------------------------------


def _varlen_params(total_q=1000, total_k=1200, batch=5, **over) -> FhFwdParams:
    p = FhFwdParams()
    p.abi_version = ABI_VERSION
    p.dtype = p.out_dtype = FhDtype.BF16
    p.batch, p.seqlen_q, p.seqlen_k = batch, total_q, total_k
    p.heads_q, p.heads_kv, p.head_dim, p.head_dim_v = 8, 2, 128, 128
    p.q_row_stride, p.q_head_stride = 8 * 128, 128
    p.k_row_stride = p.v_row_stride = 2 * 128
    p.k_head_stride = p.v_head_stride = 128
    p.o_row_stride, p.o_head_stride = 8 * 128, 128
    p.lse_head_stride = total_q
    p.softmax_scale = 0.125
    p.window_left = p.window_right = -1
    p.cu_seqlens_q = p.cu_seqlens_k = 0x1000
    for name, value in over.items():
        setattr(p, name, value)
    return p


@pytest.mark.parametrize(("total_q", "batch"), [(1000, 5), (0, 1), (64, 0), (100000, 300)])
def test_workspace_size(lib, total_q, batch):
    p = _varlen_params(total_q=total_q, batch=batch)
    assert lib.fwd_workspace_size(p) == 32 + 48 * (total_q // 64 + batch)
    p.cu_seqlens_q = p.cu_seqlens_k = None
    p.q_batch_stride = 1000 * 8 * 128
    assert lib.fwd_workspace_size(p) == 0  # dense, no mask


@pytest.mark.parametrize(("window", "size"), [((-1, -1), 0), ((-1, 0), 4), ((100, -1), 4),
                                              ((3, 7), 4)])
def test_dense_workspace_is_the_masked_calls_tile_counter(lib, window, size):
    # Masked dense calls ask for the tile counter their FA-3 tiles are claimed from (api.h).
    p = _dense_params(window_left=window[0], window_right=window[1])
    assert lib.fwd_workspace_size(p) == size


def _dense_params(**over) -> FhFwdParams:
    p = _varlen_params(q=0x10000, k=0x20000, v=0x30000, o=0x40000)
    p.cu_seqlens_q = p.cu_seqlens_k = None
    p.batch, p.seqlen_q, p.seqlen_k = 1, 1000, 1200
    p.q_batch_stride, p.k_batch_stride = 1000 * 8 * 128, 1200 * 2 * 128
    p.v_batch_stride, p.o_batch_stride = 1200 * 2 * 128, 1000 * 8 * 128
    for name, value in over.items():
        setattr(p, name, value)
    return p


@pytest.mark.parametrize(("over", "fragment"), [
    ({"workspace": 0x50002, "workspace_bytes": 4},
     "workspace: expected a 4-byte aligned device pointer (a dense call's tile counter"),
    ({"workspace": 0x50000, "workspace_bytes": 3},
     "workspace_bytes: expected >= 4 (fh_fwd_workspace_size) with a workspace, got 3"),
])
def test_abi_rejects_a_bad_dense_workspace(lib, over, fragment):
    p = _dense_params(window_right=0, **over)
    got = lib._dll.fh_fwd(ctypes.byref(p), None)
    assert got == FhStatus.ERROR_INVALID_ARGUMENT, lib.last_error()
    assert fragment in lib.last_error()


@pytest.mark.parametrize(("over", "status", "fragment"), [
    ({"cu_seqlens_k": None}, FhStatus.ERROR_INVALID_ARGUMENT,
     "cu_seqlens_q / cu_seqlens_k: expected both"),
    ({"o_batch_stride": 1000}, FhStatus.ERROR_INVALID_ARGUMENT,
     "o_batch_stride: expected 0 in a varlen call"),
    ({"variant": 2, "backend": FhBackend.FA3}, FhStatus.ERROR_UNSUPPORTED,
     "has no varlen kernel"),
    # out of range, with the ablation bit: refused before any message names the variant
    ({"variant": 6, "backend": FhBackend.FA3}, FhStatus.ERROR_INVALID_ARGUMENT,
     "variant: expected an FhVariant 0 (tuned) .."),
    ({"variant": 2**30 + 2, "backend": FhBackend.FA3}, FhStatus.ERROR_INVALID_ARGUMENT,
     "got 1073741826"),
    ({"kv_dtype": FhDtype.E4M3, "head_dim": 128}, FhStatus.ERROR_UNSUPPORTED,
     "varlen with mixed-mode inputs (16-bit q, FP8 k / v) is not implemented yet"),
    ({"max_seqlen_q": -5}, FhStatus.ERROR_INVALID_ARGUMENT, "max_seqlen_q / max_seqlen_k"),
    ({"workspace": None}, FhStatus.ERROR_INVALID_ARGUMENT,
     "workspace: expected a 16-byte aligned device pointer"),
    ({"workspace": 0x10000, "workspace_bytes": 8}, FhStatus.ERROR_INVALID_ARGUMENT,
     "workspace_bytes: expected >= 992 (fh_fwd_workspace_size), got 8"),
    # KV-cache fields (docs/host.md "KV-cache routes"): batch_k goes with kv_batch_idx,
    # pointers int32-aligned
    ({"kv_batch_idx": 0x6000}, FhStatus.ERROR_INVALID_ARGUMENT,
     ("batch_k: expected the cache's entries (>= 1; cu_seqlens_k holds batch_k + 1 offsets) "
      "with kv_batch_idx, got 0")),
    ({"batch_k": 3}, FhStatus.ERROR_INVALID_ARGUMENT,
     ("batch_k: expected 0 without kv_batch_idx (cu_seqlens_k then holds batch + 1 "
      "offsets), got 3")),
    ({"kv_batch_idx": 0x6002, "batch_k": 4}, FhStatus.ERROR_INVALID_ARGUMENT,
     "kv_batch_idx: expected a 4-byte aligned int32 pointer, got 0x6002"),
    ({"leftpad_k": 0x6001}, FhStatus.ERROR_INVALID_ARGUMENT,
     "leftpad_k: expected a 4-byte aligned int32 pointer, got 0x6001"),
])
def test_abi_rejects_bad_varlen_fields(lib, over, status, fragment):
    fields = {"q": 0x10000, "k": 0x20000, "v": 0x30000, "o": 0x40000, "workspace": 0x50000,
                  "workspace_bytes": 10**6}
    fields.update(over)
    p = _varlen_params(**fields)
    got = lib._dll.fh_fwd(ctypes.byref(p), None)
    assert got == status, lib.last_error()
    assert fragment in lib.last_error()


def test_abi_refuses_kv_cache_fields_in_a_dense_call(lib):
    p = _varlen_params(q=0x10000, k=0x20000, v=0x30000, o=0x40000, leftpad_k=0x6000)
    p.cu_seqlens_q = p.cu_seqlens_k = None
    p.batch, p.seqlen_q, p.seqlen_k = 1, 1000, 1200
    p.q_batch_stride, p.k_batch_stride = 1000 * 8 * 128, 1200 * 2 * 128
    p.v_batch_stride, p.o_batch_stride = 1200 * 2 * 128, 1000 * 8 * 128
    got = lib._dll.fh_fwd(ctypes.byref(p), None)
    assert got == FhStatus.ERROR_INVALID_ARGUMENT, lib.last_error()
    assert ("kv_batch_idx / leftpad_k / batch_k: expected null / null / 0 in a dense call"
            in lib.last_error())


def cuda_args(dtype=torch.bfloat16, **over):
    """args() on FakeTensors of device cuda: the checks past the metadata (devices) pass."""
    with FakeTensorMode():
        q, k, v = (torch.zeros(n, h, 64, dtype=dtype, device="cuda")
                   for n, h in ((100, 4), (120, 2), (120, 2)))
        a = args(q=q, k=k, v=v,
                 cu_seqlens_q=torch.tensor([0, 40, 100], dtype=I32, device="cuda"),
                 cu_seqlens_k=torch.tensor([0, 60, 120], dtype=I32, device="cuda"))
        descales = {name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                    for name, t in over.items()}
    return a, descales


def test_fp8_descales_are_per_sequence():
    """FP8 q / k / v: descales (batch, heads_kv) with batch = the sequences (2 here), or 0-d /
    (1,); the output dtype is bf16. 16-bit calls ignore descales, as FA3."""
    a, d = cuda_args(torch.float8_e4m3fn, q_descale=torch.ones(2, 2),
                     k_descale=torch.ones(()), v_descale=torch.ones(2, 2).t())
    vc = _varlen.check_args(**a, **d)
    assert vc.batch == 2 and vc.fp8 is not None and vc.fp8.out_dtype == torch.bfloat16
    a, d = cuda_args(torch.float8_e4m3fn, q_descale=torch.ones(1, 2))
    with raises(ValueError, "q_descale: expected shape (batch, heads_kv) = (2, 2)", "(1, 2)"):
        _varlen.check_args(**a, **d)
    a, d = cuda_args(torch.float8_e4m3fn, k_descale=torch.ones(2, 2, dtype=torch.float16))
    with raises(ValueError, "k_descale: expected dtype torch.float32"):
        _varlen.check_args(**a, **d)
    a, d = cuda_args(q_descale=torch.ones(7))
    assert _varlen.check_args(**a, **d).fp8 is None


def test_fp8_varlen_checks():
    """Inputs that require grad run forward only (validated like a no_grad call: here the CPU
    device check); head_dim a multiple of 16."""
    q, k, v = (t.to(torch.float8_e4m3fn) for t in qkv())
    q.requires_grad_()
    with raises(ValueError, "must be a CUDA tensor"):
        flash_attn_varlen_func(q, k, v, cu(0, 40, 100), cu(0, 60, 120), 60, 60)
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in qkv(d=40))
    with raises(ValueError, "head_dim"):
        _varlen.check_args(**args(q=q8, k=k8, v=v8))


def _checked_with_out(out, dtype=torch.bfloat16, dv=64):
    """_varlen's checks of a call with a caller's out, on FakeTensors of device cuda."""
    with FakeTensorMode():
        q, k, v = (torch.zeros(n, h, d, dtype=dtype, device="cuda")
                   for n, h, d in ((100, 4, 64), (120, 2, 64), (120, 2, dv)))
        cq, ck = (torch.tensor(c, dtype=I32, device="cuda") for c in ([0, 40, 100], [0, 60, 120]))
        return _varlen._checked_args(
            q, k, v, cq, ck, 60, 60, None, None, None, False, (-1, -1), 0.0, "auto", out(),
            (None, None, None), 0, own_head_dim_v=dv != 64)


def test_out_of_an_fp8_call_is_bf16():
    """FP8 varlen writes bf16 (FA3's output dtype): a bf16 out passes, an e4m3 out is refused."""
    vc = _checked_with_out(lambda: torch.zeros(100, 4, 64, dtype=torch.bfloat16, device="cuda"),
                           torch.float8_e4m3fn)
    assert vc.fp8.out_dtype == torch.bfloat16
    with raises(TypeError, "out: expected dtype torch.bfloat16 (the FP8 forward's output dtype)",
                "torch.float8_e4m3fn"):
        _checked_with_out(lambda: torch.zeros(100, 4, 64, dtype=torch.float8_e4m3fn,
                                              device="cuda"), torch.float8_e4m3fn)


def test_out_has_vs_head_dim():
    """With V's own head dim, out is (total_q, heads_q, head_dim_v); q's width is refused, and
    out's rows must be 16-byte aligned as every output's."""
    _checked_with_out(lambda: torch.zeros(100, 4, 48, device="cuda", dtype=torch.bfloat16), dv=48)
    with raises(ValueError, "out: expected shape (100, 4, 48)", "got (100, 4, 64)"):
        _checked_with_out(lambda: torch.zeros(100, 4, 64, device="cuda", dtype=torch.bfloat16),
                          dv=48)
    with raises(ValueError, "out: stride(1) must be a multiple of 8 elements"):
        _checked_with_out(lambda: torch.empty_strided((100, 4, 48), (208, 52, 1), device="cuda",
                                                      dtype=torch.bfloat16), dv=48)
