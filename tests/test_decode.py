"""The decode kernel's C ABI on the CPU (docs/decode.md): its table as the library exports it,
fh_decode_plan's split choice and workspace, the policy's question (fh_decode_select_backend),
and every refusal of FhDecodeParams naming the field, the expected and the given value (nothing
is launched: validation runs before any CUDA call). The kernel itself: test_decode_gpu.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from flash_hopper import UnsupportedError, _decode, _tables
from flash_hopper._lib import ABI_VERSION, FhBackend, FhDecodeParams, FhDtype


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
    # a paged cache of the same capacity: the plan reads max_pages x page_size, one CTA per SM
    # as dense (16); an FP8 one fills both CTA slots of an SM (d128): 264 // 8 = 33, capped by
    # 8192 / 256 = 32 keys per split
    paged = params(num_splits=0, page_table=16, page_size=16, num_pages=512, max_pages=512,
                   page_table_stride=512)
    assert lib.decode_plan(paged, num_sms=132)[0] == 16
    paged.kv_dtype = int(FhDtype.E4M3)
    assert lib.decode_plan(paged, num_sms=132)[0] == 32
    # a short cache caps the splits at one per 256 keys: 2048 keys -> 8
    assert lib.decode_plan(params(num_splits=0, page_size=2048), num_sms=132)[0] == 8
    # 8 x 8 row blocks: 2 splits; a full wave (32 x 8 row blocks on 132 SMs) does not split
    assert lib.decode_plan(params(num_splits=0, batch=8), num_sms=132)[0] == 2
    assert lib.decode_plan(params(num_splits=0, batch=32), num_sms=132) == (1, 0)
    # the caller's count, capped at 128
    assert lib.decode_plan(params(num_splits=500), num_sms=132)[0] == 128
    # 64 query heads per KV head x 4 tokens: 256 rows = 16 row blocks per KV head, two per CTA:
    # 64 tiles, 132 // 64 = 2 splits; at d256 (no pairs) 128 tiles (over 80 % of the SMs): one
    assert lib.decode_plan(params(num_splits=0, heads_q=512, seqlen_q=4), num_sms=132)[0] == 2
    assert lib.decode_plan(params(num_splits=0, heads_q=512, seqlen_q=4, head_dim=256),
                           num_sms=132)[0] == 1

def test_plan_counts_a_ctas_row_blocks(lib, monkeypatch):
    """8 query tokens of GQA 4: two row blocks per KV head, one CTA over both (8 CTAs over the
    cache, FLASH_HOPPER_DECODE_PAIR=0: 16). A 16-bit cache keeps one CTA per SM (132 // 8 = 16
    splits; unpaired 132 // 16 = 8). An FP8 cache pairs only where a CTA per row block fills
    every slot (here 16 < 264: unpaired), and with several row blocks fills both of an SM's d128
    slots like a paged one (264 // 16 = 16); one row block's (q = 1) keeps one (132 // 8)."""
    fp8s = ({"dtype": int(FhDtype.E4M3)}, {"kv_dtype": int(FhDtype.E4M3)})
    assert lib.decode_plan(params(num_splits=0, seqlen_q=8), num_sms=132)[0] == 16
    for fp8 in fp8s:
        assert lib.decode_plan(params(num_splits=0, seqlen_q=8, **fp8), num_sms=132)[0] == 16
        assert lib.decode_plan(params(num_splits=0, **fp8), num_sms=132)[0] == 16
    # d256 never pairs (O of 32 rows would not fit in registers)
    assert lib.decode_plan(params(num_splits=0, seqlen_q=8, head_dim=256), num_sms=132)[0] == 8
    monkeypatch.setenv("FLASH_HOPPER_DECODE_PAIR", "0")
    assert lib.decode_plan(params(num_splits=0, seqlen_q=8), num_sms=132)[0] == 8
    for fp8 in fp8s:
        assert lib.decode_plan(params(num_splits=0, seqlen_q=8, **fp8), num_sms=132)[0] == 16


E4M3, E5M2 = int(FhDtype.E4M3), int(FhDtype.E5M2)


def fp8_params(**kw) -> FhDecodeParams:
    """params() with FA3's FP8 convention: e4m3 q, k and v (their strides as 1-byte rows)."""
    return params(dtype=E4M3, **kw)


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"dtype": int(FhDtype.FP32)},
     ("dtype: expected FH_DTYPE_FP16 (0), FH_DTYPE_BF16 (1) or FH_DTYPE_E4M3 (2) for decode, "
      "got 3")),
    # the cache's dtype for each q: its own, or an FP8 one under 16-bit q
    ({"dtype": E4M3, "kv_dtype": E5M2},
     "kv_dtype: expected 0 or FH_DTYPE_E4M3 (2) with dtype e4m3 for decode, got 4"),
    ({"dtype": int(FhDtype.FP16), "kv_dtype": int(FhDtype.BF16)},
     ("kv_dtype: expected 0 or FH_DTYPE_FP16 (0), FH_DTYPE_E4M3 (2) or FH_DTYPE_E5M2 (4) with "
      "dtype fp16 for decode, got 1")),
    # descales scale FP8 values only: q_descale with e4m3 q, k / v_descale with an FP8 cache
    ({"kv_dtype": E4M3, "q_descale": 64}, "q_descale: expected null with bf16 q"),
    ({"k_descale": 64}, "k_descale: expected null with bf16 k / v"),
    ({"dtype": E4M3, "v_descale": 64, "v_descale_head_stride": -1},
     "v_descale: expected strides >= 0 (0 broadcasts), got batch stride 0, head stride -1"),
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
    # an FP8 row is 16 elements per 16 bytes: a 16-bit multiple of 8 does not do
    ({"q": 16, "k": 16, "v": 16, "o": 16, "seqlens_k": 16, "kv_dtype": E4M3,
      "v_row_stride": 1032}, "v_row_stride: expected a multiple of 16 elements for FP8"),
    ({"q": 16, "k": 16, "v": 16, "o": 16, "seqlens_k": 16, "dtype": E4M3, "q_head_stride": 136},
     "q_head_stride: expected a multiple of 16 elements for FP8"),
    ({"q": 16, "k": 16, "v": 16, "o": 16, "seqlens_k": 16, "dtype": E4M3, "k_descale": 66},
     "k_descale: expected a 4-byte aligned pointer (float) or null, got 0x42"),
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


def test_serves_without_a_gpu_is_false():
    import torch

    q = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    assert not _decode.serves(q, q, q, None, batch=1, seqlen_q=1)


# --- the table (kernels/src/tables.cmake) as built, and the policy on it --------------------------


def test_the_table_is_what_the_library_runs(lib):
    """build_info's "decode" is the table the kernels are instantiated from: each head dim runs
    its tuned stages on a 227 KiB GPU and none other does; the plan takes its dtypes only."""
    table = _tables.decode_table(lib.build_info())
    assert table["head_dims"] == sorted(table["head_dims"]) and table["max_rows"] > 0
    assert set(table["dtypes"]) <= set(_tables.DTYPE_NAMES) | set(_tables.MIXED_DTYPES)
    for head_dim, stages, fp8 in zip(table["head_dims"], table["stages"], table["fp8_stages"]):
        assert stages in table["stage_counts"] and fp8 in table["stage_counts"]
        assert lib.decode_stages(head_dim, 227 * 1024) == stages
        assert lib.decode_stages(head_dim + 8, 227 * 1024) == 0
    rows = {name: (_tables.INPUT_DTYPES[d], 0) for name, d in _tables.DTYPE_NAMES.items()}
    rows.update({name: (_tables.TORCH_DTYPES[q], _tables.KV_FP8_DTYPES[kv])
                 for name, (q, kv) in _tables.MIXED_DTYPES.items()})
    for name, (dtype, kv_dtype) in rows.items():
        p = params(dtype=int(dtype), kv_dtype=int(kv_dtype), num_splits=0)
        if name in table["dtypes"]:
            lib.decode_plan(p, num_sms=132)
        else:
            with pytest.raises(ValueError, match="dtype: expected .* for decode, got"):
                lib.decode_plan(p, num_sms=132)
    # every FP8 cache the library takes elsewhere (FH_MIXED_TABLE) and FA3's e4m3: the kernel's
    assert {"e4m3", *_tables.MIXED_DTYPES} <= set(table["dtypes"])
    assert _tables.decode_summary(lib.build_info()) == (
        f"{' / '.join(table['dtypes'])}, head_dim {' / '.join(map(str, table['head_dims']))}, "
        f"seqlen_q * heads_q / heads_kv <= {table['max_rows']}")


def test_the_policy_serves_a_short_query(lib):
    backend, reason = lib.policy(params(seqlen_q=4), (9, 0))
    assert backend == FhBackend.DECODE
    assert reason == ("the decode kernel (cc 9.0): 4 query heads per KV head x 4 tokens packed "
                      "into 16-row tiles, keys split across SMs (the splits merged by a combine "
                      "kernel launched behind it), K / V read in place")
    paged = params(page_table=16, page_size=16, num_pages=512, max_pages=512,
                   page_table_stride=512)
    assert lib.policy(paged, (8, 0))[1].endswith(" through the page table (page size 16)")


def test_the_policy_serves_fp8_caches(lib):
    """FA3's FP8 convention (e4m3 q, k, v) and 16-bit q against an e4m3 / e5m2 cache: the decode
    kernel, saying so. The FP8 kernels hold only the cache's bytes in shared memory (widened in
    registers), so a 99 KiB device runs them at every head dim of the table: d128 with all 5
    stages (89088 bytes), d256 with 2 (75264 bytes; 3 would need 108544)."""
    for kw in ({"dtype": E4M3}, {"kv_dtype": E4M3}, {"dtype": int(FhDtype.FP16), "kv_dtype": E5M2}):
        backend, reason = lib.policy(params(**kw), (9, 0))
        kv = "e5m2" if kw.get("kv_dtype") == E5M2 else "e4m3"
        assert backend == FhBackend.DECODE
        assert reason.endswith(f", in {kv} and widened to 16 bits in registers"), reason
    assert lib.policy(params(kv_dtype=E4M3), (8, 6))[0] == FhBackend.DECODE
    assert lib.policy(params(kv_dtype=E4M3, head_dim=256), (8, 6))[0] == FhBackend.DECODE
    assert lib.policy(params(dtype=E4M3, head_dim=256), (8, 9))[0] == FhBackend.DECODE
    assert lib.policy(params(kv_dtype=E4M3, head_dim=256), (8, 0))[0] == FhBackend.DECODE


def test_flash_attn_funcs_fp8_calls_stay_off_the_decode_route(lib):
    """flash_attn_func's FP8 calls carry their descales in FhFwdParams, which the decode route
    does not forward: decode_route leaves them on the FA-3 path."""
    from flash_hopper import supports

    _, reason = supports(dtype="e4m3", head_dim=64, heads_q=32, heads_kv=8, seqlen_q=1,
                          seqlen_k=4096, capability=(9, 0))
    assert not reason.startswith("decode:"), reason


@pytest.mark.parametrize(("kw", "capability", "fragment"), [
    ({"dtype": int(FhDtype.FP32)}, (9, 0),
     ("dtype: the decode kernel takes fp16, bf16, e4m3, bf16+e4m3, fp16+e4m3, bf16+e5m2 or "
      "fp16+e5m2 (q, k and v in one dtype, or 16-bit q + FP8 k / v), got another dtype")),
    ({"head_dim": 96}, (9, 0),
     "head_dim: the decode kernel takes head_dim 64, 128 or 256, got 96"),
    ({"seqlen_q": 33}, (9, 0),
     "at most 128 packed rows (query tokens x query heads per KV head), got 33 x 4"),
    ({}, (7, 5),
     "the decode kernel needs a GPU of compute capability >= 8.0, this GPU is cc 7.5"),
    ({"head_dim": 256}, (8, 6),
     "at head_dim 256 does not fit the 101376 bytes of shared memory per block of cc 8.6"),
])
def test_the_policy_says_why_not(lib, kw, capability, fragment):
    with pytest.raises(UnsupportedError) as err:
        lib.policy(params(**kw), capability)
    assert fragment in str(err.value), str(err.value)


def test_the_policy_refuses_bad_shapes_as_the_plan_does(lib):
    with pytest.raises(ValueError, match="heads_kv: expected a divisor of heads_q"):
        lib.policy(params(heads_kv=5), (9, 0))
    with pytest.raises(ValueError, match="k_row_stride: expected a multiple of 8 elements"):
        lib.policy(params(k_row_stride=1028), (9, 0))


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


def _fake_trees(get_manager):
    module = types.ModuleType("torch._inductor.cudagraph_trees")
    module.get_manager = get_manager
    return module


def test_constants_are_made_per_call_where_cudagraph_trees_run(monkeypatch):
    """torch.compile's CUDA graphs (cudagraph trees) allocate their warmup's and recording's
    tensors from a private pool and refuse any that outlives the graph: eager_constant keeps
    nothing while a tree manager exists on the device."""
    dev = torch.device("cuda", 0)
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees", raising=False)
    assert not _decode.cudagraph_trees_on(dev)
    asked = []
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", _fake_trees(
        lambda index, create_if_none_exists=True: asked.append((index, create_if_none_exists))))
    assert not _decode.cudagraph_trees_on(dev) and asked == [(0, False)]
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", _fake_trees(
        lambda index, create_if_none_exists=True: object()))
    assert _decode.cudagraph_trees_on(dev)
    made = []
    cache, pinned = {}, {}
    for _ in range(2):
        t = _decode.eager_constant(cache, pinned, (dev, 3),
                                   lambda: made.append(1) or torch.zeros(3))
        assert t.shape == (3,)
    assert len(made) == 2 and not cache and not pinned

    def unknown(*args, **kwargs):
        raise TypeError("get_manager() got an unexpected keyword argument")

    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", _fake_trees(unknown))
    assert _decode.cudagraph_trees_on(dev)  # a torch it cannot ask: no caching
