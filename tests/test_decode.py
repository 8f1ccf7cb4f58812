"""The decode kernel's C ABI on the CPU (docs/decode.md): fh_decode_plan's split choice and
workspace, and every refusal of FhDecodeParams naming the field, the expected and the given value
(nothing is launched: validation runs before any CUDA call). The kernel itself:
test_decode_gpu.py."""

from __future__ import annotations

import pytest
from flash_hopper import _decode
from flash_hopper._lib import ABI_VERSION, FhDecodeParams, FhDtype


def params(**kw) -> FhDecodeParams:
    """GQA 32 / 8, d128, bf16, one token, a dense cache of 8192 keys per entry."""
    p = FhDecodeParams()
    p.abi_version = ABI_VERSION
    p.dtype = int(FhDtype.BF16)
    p.batch, p.seqlen_q, p.heads_q, p.heads_kv, p.head_dim = 1, 1, 32, 8, 128
    p.page_size, p.num_pages, p.max_pages, p.page_table_stride = 8192, 1, 1, 1
    p.q_row_stride, p.q_head_stride = 32 * 128, 128
    p.k_page_stride, p.k_row_stride, p.k_head_stride = 8192 * 8 * 128, 8 * 128, 128
    p.v_page_stride, p.v_row_stride, p.v_head_stride = 8192 * 8 * 128, 8 * 128, 128
    p.o_row_stride, p.o_head_stride = 32 * 128, 128
    p.softmax_scale = 128 ** -0.5
    p.window_left = p.window_right = -1
    p.num_splits = 1
    for name, value in kw.items():
        setattr(p, name, value)
    return p


def test_plan_splits_one_wave_and_sizes_the_workspace(lib):
    # 8 row blocks on 132 SMs, one CTA each: 132 // 8 = 16 splits (8192 / 256 = 32 would allow more)
    splits, nbytes = lib.decode_plan(params(num_splits=0), num_sms=132)
    assert splits == 16
    blocks = 1 * 8 * 1  # batch x heads_kv x row blocks
    lse = -(-(16 * blocks * 16 * 4) // 256) * 256
    assert nbytes == lse + -(-(16 * blocks * 16 * 128 * 4) // 256) * 256
    # a paged cache of the same capacity: the plan reads max_pages x page_size, and fills both
    # CTA slots of an SM (d128): 264 // 8 = 33, capped by 8192 / 256 = 32 keys per split
    paged = params(num_splits=0, page_table=16, page_size=16, num_pages=512, max_pages=512,
                   page_table_stride=512)
    assert lib.decode_plan(paged, num_sms=132)[0] == 32
    # a short cache caps the splits at one per 256 keys: 2048 keys -> 8
    assert lib.decode_plan(params(num_splits=0, page_size=2048), num_sms=132)[0] == 8
    # 8 x 8 row blocks: 2 splits; a full wave (32 x 8 row blocks on 132 SMs) does not split
    assert lib.decode_plan(params(num_splits=0, batch=8), num_sms=132)[0] == 2
    assert lib.decode_plan(params(num_splits=0, batch=32), num_sms=132) == (1, 0)
    # the caller's count, capped at 128
    assert lib.decode_plan(params(num_splits=500), num_sms=132)[0] == 128
    # 64 query heads per KV head x 4 tokens: 256 rows = 16 row blocks per KV head, 128 tiles
    # (over 80 % of the SMs): one split
    assert lib.decode_plan(params(num_splits=0, heads_q=512, seqlen_q=4), num_sms=132)[0] == 1


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"dtype": int(FhDtype.E4M3)}, "dtype: expected FH_DTYPE_FP16 (0) or FH_DTYPE_BF16 (1)"),
    ({"head_dim": 96}, "head_dim: expected 64, 128 or 256 for decode, got 96"),
    ({"heads_kv": 5}, "heads_kv: expected a divisor of heads_q (32), got 5"),
    ({"seqlen_q": 0}, "seqlen_q: expected 1.."),
    ({"page_size": 0}, "page_size: expected 1..2147483647, got 0"),
    ({"num_pages": 0}, "num_pages: expected 1.."),
    ({"page_table": 16, "max_pages": 4, "page_table_stride": 3},
     "page_table_stride: expected >= max_pages (4), got 3"),
    ({"page_table": 16, "max_pages": 1 << 20, "page_table_stride": 1 << 20, "page_size": 4096},
     "max_pages: expected max_pages * page_size <= 2147483647"),
    ({"page_table": 16, "kv_batch_idx": 32, "page_table_stride": 1},
     "kv_batch_idx: expected null with a page_table"),
    ({"softcap": -1.0}, "softcap: expected a finite float >= 0"),
    ({"softmax_scale": 0.0}, "softmax_scale: expected a finite positive float"),
    ({"window_left": -2}, "window_left: expected -1 (unbounded) or >= 0, got -2"),
    ({"num_splits": -1}, "num_splits: expected >= 0, got -1"),
    ({"abi_version": 7}, "abi_version: expected"),
])
def test_plan_refuses_bad_shapes(lib, kw, fragment):
    with pytest.raises(ValueError) as err:
        lib.decode_plan(params(**kw), num_sms=132)
    assert fragment in str(err.value), str(err.value)


@pytest.mark.parametrize(("kw", "fragment"), [
    ({}, "q: expected a device pointer, got null"),
    ({"q": 16, "k": 16, "v": 16, "o": 16}, "seqlens_k: expected an int32 device array"),
    ({"q": 16, "k": 16, "v": 16, "o": 8}, "o: expected a 16-byte aligned pointer"),
    ({"q": 16, "k": 16, "v": 16, "o": 16, "seqlens_k": 16, "k_row_stride": 1028},
     "k_row_stride: expected a multiple of 8 elements"),
    ({"q": 16, "k": 16, "v": 16, "o": 16, "seqlens_k": 16, "num_splits": 0},
     "num_splits: expected 1..128 (fh_decode_plan chooses), got 0"),
    ({"q": 16, "k": 16, "v": 16, "o": 16, "seqlens_k": 16, "num_splits": 4},
     "workspace: expected a 256-byte aligned device pointer with num_splits 4"),
    ({"q": 16, "k": 16, "v": 16, "o": 16, "seqlens_k": 16, "num_splits": 4, "workspace": 256,
      "workspace_bytes": 100}, "workspace_bytes: expected >= "),
])
def test_decode_refuses_before_any_launch(lib, kw, fragment):
    with pytest.raises(ValueError) as err:
        lib.decode(params(**kw), None)
    assert fragment in str(err.value), str(err.value)


def test_usable_without_a_gpu_is_false():
    import torch

    q = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    assert not _decode.usable(q, q, q, 8)


def test_packed_spans_read_packed_keys_as_one_cache_entry():
    """flash_attn_varlen_func's packed K / V as the decode kernel's one cache entry: sequence b's
    keys are [leftpad[b], seqlen[b]), views of cu_seqlens_k, or cut to seqused_k[b]."""
    import torch

    cu_k = torch.tensor([0, 500, 502, 502, 1802], dtype=torch.int32)
    leftpad, seqlen = _decode.packed_spans(cu_k, None)
    assert leftpad.tolist() == [0, 500, 502, 502] and seqlen.tolist() == [500, 502, 502, 1802]
    assert leftpad.data_ptr() == cu_k.data_ptr()  # views: nothing launched
    assert seqlen.data_ptr() == cu_k.data_ptr() + 4
    used = torch.tensor([400, 2, 0, 1000], dtype=torch.int32)
    leftpad, seqlen = _decode.packed_spans(cu_k, used)
    assert seqlen.dtype == torch.int32 and seqlen.tolist() == [400, 502, 502, 1502]


def test_short_queries_take_the_decode_kernel_everywhere_by_default(monkeypatch):
    monkeypatch.delenv("FLASH_HOPPER_DECODE", raising=False)
    assert _decode.everywhere() and _decode.varlen_too()
    monkeypatch.setenv("FLASH_HOPPER_DECODE", "all")  # the earlier opt-in spelling, still accepted
    assert _decode.everywhere() and _decode.varlen_too()
    monkeypatch.setenv("FLASH_HOPPER_DECODE", "kvcache")
    assert not _decode.everywhere() and not _decode.varlen_too() and _decode.enabled()
    monkeypatch.setenv("FLASH_HOPPER_DECODE", "0")
    assert not _decode.everywhere() and not _decode.enabled()


def test_eager_constant_builds_once_outside_capture():
    import torch

    cache, pinned, made = {}, {}, []

    def make():
        made.append(1)
        return torch.zeros(3, dtype=torch.int32)

    a = _decode.eager_constant(cache, pinned, ("cpu", 3), make)
    b = _decode.eager_constant(cache, pinned, ("cpu", 3), make)
    # keyed by the device's current stream too (0 for a non-CUDA device)
    assert a is b and len(made) == 1 and cache == {(0, "cpu", 3): a} and pinned == {}
    for i in range(64):  # a full cache starts over (graphs keep theirs in `pinned`)
        _decode.eager_constant(cache, pinned, ("cpu", 100 + i), make)
    assert len(cache) == 1 and (0, "cpu", 3) not in cache
