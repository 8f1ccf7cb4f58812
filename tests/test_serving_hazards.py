"""The serving paths' guarantees on the CPU: for any values of the index arguments, nothing
outside the caller's tensors is read or written, and a refused call changes no cache.

An inference server passes client-controlled lengths and indices through cu_seqlens_q,
cache_batch_idx, page_table, window_size and num_splits. These tests hold the host side to it with
the library's real C ABI (validation, fh_decode_stages, the decode kernel's policy) and, where a
test needs a GPU's calls, the
library's device entry points recorded instead of launched (the parameters the kernel would get).
The kernels' side of each guarantee runs on a GPU in test_decode_gpu.py (bench/gpu_check.sh, also
under compute-sanitizer)."""

from __future__ import annotations

import contextlib
import ctypes
from types import SimpleNamespace

import pytest
import torch
from flash_hopper import UnsupportedError, _decode, _device, _lib, _tables, _varlen, kvcache
from flash_hopper._lib import FhBackend, FhDecodeParams, FhDtype
from flash_hopper.kvcache import flash_attn_with_kvcache

from tests._helpers import raises
from tests.test_decode import params

I32 = torch.int32
BF16 = torch.bfloat16


def _info(cc: tuple[int, int], smem: int, sms: int = 132) -> _device.DeviceInfo:
    return _device.DeviceInfo(index=0, name=f"sm_{cc[0]}{cc[1]}", capability=cc, sm_count=sms,
                              max_smem_per_block_optin=smem, driver_version=13000, source="mock")


# The opt-in shared memory per block of the compute capabilities README lists (CUDA's tables).
DEVICES = {
    "A100 (8.0)": _info((8, 0), 163 * 1024),
    "A10 / RTX 30 (8.6)": _info((8, 6), 99 * 1024),
    "L4 / L40 / RTX 40 (8.9)": _info((8, 9), 99 * 1024),
    "H100 / H200 (9.0)": _info((9, 0), 227 * 1024),
    "B200 (10.0)": _info((10, 0), 227 * 1024),
    "RTX 50 (12.0)": _info((12, 0), 99 * 1024),
}


def decode_smem(head_dim: int, stages: int) -> int:
    """sizeof(DecodeConfig<head_dim, stages>::SharedStorage) (decode_kernel.h): Q (16 rows), the
    K / V ring (64 keys a stage) or, aliasing it, the warps' fp32 outputs, the page-id ring, the
    warps' row maxima and sums."""
    chunks = head_dim // 8  # 16-byte chunks per row
    q = 16 * chunks * 16
    ring = 2 * stages * 64 * chunks * 16
    merge = 4 * 16 * head_dim * 4
    ids = 2 * stages * 64 * 4
    return q + max(ring, merge) + ids + 2 * 4 * 16 * 4


# --- every kernel the decode policy picks fits the device ----------------------------------------


def decode_served(lib, capability: tuple[int, int], head_dim: int) -> bool:
    """The library's policy (fh_decode_select_backend) for GQA 32 / 8, one token, on a GPU of
    ``capability``: whether the decode kernel serves it."""
    try:
        return lib.policy(params(head_dim=head_dim), capability)[0] == FhBackend.DECODE
    except NotImplementedError:
        return False


@pytest.mark.parametrize("device", list(DEVICES), ids=list(DEVICES))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_stages_fit_every_listed_device(lib, device, head_dim):
    info = DEVICES[device]
    limit = info.max_smem_per_block_optin
    stages = lib.decode_stages(head_dim, limit)
    tuned = dict(zip(*(lib.build_info()["decode"][k] for k in ("head_dims", "stages"))))[head_dim]
    if stages:  # the largest count up to the tuned one that fits
        assert 2 <= stages <= tuned and decode_smem(head_dim, stages) <= limit
        assert stages == tuned or decode_smem(head_dim, stages + 1) > limit
    else:  # nothing fits: the route must not be taken
        assert decode_smem(head_dim, 2) > limit
    # the policy's own table of the GPU's shared memory agrees: it routes there iff it fits
    assert decode_served(lib, info.capability, head_dim) == (stages > 0)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_decode_stages_override_takes_the_compiled_counts(monkeypatch, lib, head_dim):
    """FLASH_HOPPER_DECODE_STAGES picks a count the library has kernels for: every count of the
    table that fits 227 KiB in a build with FH_DECODE_EVERY_STAGE_COUNT, else those a listed GPU
    runs (the largest up to the tuned one that fits its limit); any other count leaves the tuned
    one. Then the count a smaller limit gets is again one of those."""
    table = _tables.decode_table(lib.build_info())
    tuned = dict(zip(table["head_dims"], table["stages"]))[head_dim]
    limits = sorted({info.max_smem_per_block_optin for info in DEVICES.values()})

    def largest_fitting(limit):
        fits = [c for c in table["stage_counts"] if c <= tuned and decode_smem(head_dim, c) <= limit]
        return max(fits, default=0)

    runs = {largest_fitting(limit) for limit in limits} - {0}
    if table["every_stage_count"]:
        runs = {c for c in table["stage_counts"] if decode_smem(head_dim, c) <= 227 * 1024}
    assert tuned in runs
    for count in table["stage_counts"]:
        monkeypatch.setenv("FLASH_HOPPER_DECODE_STAGES", str(count))
        want = count if count in runs else tuned
        assert lib.decode_stages(head_dim, 227 * 1024) == want
        for limit in (100 * 1024, 150 * 1024, 200 * 1024):  # between the listed ones
            fitting = [c for c in runs if c <= want and decode_smem(head_dim, c) <= limit]
            assert lib.decode_stages(head_dim, limit) == max(fitting, default=0)


def test_decode_serves_d128_on_99_kib_devices_and_routes_d256_away(lib):
    # sm_86 / sm_89 / sm_120: d128 with 2 stages (the tuned 3 need 104448 B), d256 not at all
    assert decode_smem(128, 3) == 104448 and decode_smem(256, 2) == 140800
    assert lib.decode_stages(128, 101376) == 2
    assert lib.decode_stages(256, 101376) == 0
    assert lib.decode_stages(256, 163 * 1024) == 2  # A100
    assert lib.decode_stages(96, 232448) == 0  # not a decode head dim


def test_the_policy_sees_the_strides_the_kernel_gets(lib):
    """A dim of one is never stepped along and torch leaves any stride there: the decode route
    asks the policy with the effective strides it then launches with (as the FA path does), so
    an odd stride on it neither refuses the route nor reaches the kernel."""
    q = torch.zeros(8 * 64 + 3, dtype=BF16).as_strided((1, 1, 8, 64), (3, 5, 64, 1))
    kc = torch.zeros(1, 256, 2, 64, dtype=BF16)
    p = _decode._fill(q, kc, kc, (512, 512, 64, 1), 1, 1, None, False)
    assert (p.q_batch_stride, p.q_row_stride, p.q_head_stride) == (512, 512, 64)
    p.softmax_scale, p.window_left, p.window_right = 0.125, -1, -1  # as serves() asks
    assert lib.policy(p, (9, 0))[0] == FhBackend.DECODE


def test_debug_smem_limit_lowers_what_the_route_sees(monkeypatch, lib):
    assert decode_served(lib, (9, 0), 256)
    monkeypatch.setenv("FLASH_HOPPER_DEBUG_SMEM_LIMIT", "101376")
    assert not decode_served(lib, (9, 0), 256) and decode_served(lib, (9, 0), 128)
    with pytest.raises(NotImplementedError, match="does not fit the 101376 bytes of shared"):
        lib.policy(params(head_dim=256), (9, 0))
    monkeypatch.setenv("FLASH_HOPPER_DEBUG_SMEM_LIMIT", str(10**9))  # only ever lowers the limit
    assert decode_served(lib, (9, 0), 256)


# --- the decode ABI: bounds and the rows varlen offsets are clamped to --------------------------


@pytest.mark.parametrize(("kw", "fragments"), [
    ({"heads_q": 70000, "heads_kv": 70000}, ("heads_q: expected 1..65535", "got 70000")),
    ({"total_q": -1}, ("total_q: expected 0..2147483647", "got -1")),
    ({"total_q": 2**31}, ("total_q: expected 0..2147483647",)),
    # max_pages * page_size would wrap int64 to 0 and pass a product check
    ({"page_table": 16, "max_pages": 2**40, "page_size": 2**40, "page_table_stride": 2**40},
     ("page_size: expected 1..2147483647",)),
    ({"page_table": 16, "max_pages": 2**40, "page_size": 2**20, "page_table_stride": 2**40},
     ("max_pages: expected 1..2147483647 with a page_table",)),
    ({"page_table": 16, "max_pages": 2**20, "page_size": 2**12, "page_table_stride": 2**20},
     ("max_pages: expected max_pages * page_size <= 2147483647",)),
])
def test_decode_shapes_are_bounded(lib, kw, fragments):
    with raises(ValueError, *fragments):
        lib.decode_plan(params(**kw), num_sms=132)


class _RecordingLibrary:
    """The library's decode entry points, recorded: fh_decode_plan runs for real (pure host
    arithmetic), fh_decode is recorded with the device that was current when it was called."""

    def __init__(self, real: _lib.Library, current: list[int]):
        self.real, self.current, self.calls = real, current, []

    def decode_plan(self, params, num_sms=0):
        return self.real.decode_plan(params, num_sms)

    def decode_stages(self, head_dim, smem):
        return self.real.decode_stages(head_dim, smem)

    def decode(self, params, stream):
        copy = FhDecodeParams.from_buffer_copy(bytes(params))
        self.calls.append((copy, self.current[0]))


@pytest.fixture
def recorded(monkeypatch, lib):
    """_decode.forward with the GPU recorded: device 1 is the tensors' (q's index), device 0 the
    current one until a torch.cuda.device guard switches it."""
    current = [0]
    rec = _RecordingLibrary(lib, current)

    @contextlib.contextmanager
    def device(index):
        before, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(_decode._lib, "get_library", lambda: rec)
    monkeypatch.setattr(_decode, "_index", lambda dev: 1)
    monkeypatch.setattr(_decode, "_current_device", lambda: current[0])
    monkeypatch.setattr(_decode, "_raw_stream", lambda index: 1000 + index)
    monkeypatch.setattr(_decode.torch.cuda, "device", device)
    monkeypatch.setattr(_decode._device, "device_info", lambda index: DEVICES["H100 / H200 (9.0)"])
    _decode._plans.clear()
    yield rec
    _decode._plans.clear()


def test_varlen_decode_passes_q_rows_to_clamp_offsets_to(recorded):
    q = torch.zeros(100, 2, 64, dtype=BF16)
    kc = torch.zeros(1, 64, 2, 64, dtype=BF16)
    cu = torch.tensor([0, 90, 10, 5000, -7], dtype=I32)
    _decode.forward(q, kc, kc, torch.zeros(4, dtype=I32), softmax_scale=0.125,
                    cu_seqlens_q=cu, max_seqlen_q=100, out=torch.zeros_like(q))
    (p, _), = recorded.calls
    assert p.total_q == 100 and p.seqlen_q == 100 and p.batch == 4
    _decode.forward(q.view(1, 100, 2, 64), kc, kc, torch.zeros(1, dtype=I32),
                    softmax_scale=0.125)
    assert recorded.calls[-1][0].total_q == 0  # dense q: no offsets to clamp


def test_num_splits_past_int32_is_the_cap_not_a_wrapped_value(recorded):
    q = torch.zeros(1, 1, 4, 128, dtype=BF16)
    kc = torch.zeros(1, 4096, 1, 128, dtype=BF16)
    for asked, got in ((2**32 + 3, 128), (2**31, 128), (3, 3), (0, None)):
        _decode.forward(q, kc, kc, torch.full((1,), 4096, dtype=I32), softmax_scale=0.1,
                        num_splits=asked)
        splits = recorded.calls[-1][0].num_splits
        assert splits == got if got is not None else 1 <= splits <= 128


def test_decode_launches_on_the_tensors_device(recorded):
    q = torch.zeros(1, 1, 4, 64, dtype=BF16)
    kc = torch.zeros(1, 64, 1, 64, dtype=BF16)
    _decode.forward(q, kc, kc, torch.full((1,), 64, dtype=I32), softmax_scale=0.125)
    (_, device), = recorded.calls
    assert device == 1  # q's device, made current around the launch


# --- the varlen decode route: max_seqlen_q is a hint, seqused_k stays in its span -----------------


def test_varlen_route_sizes_its_grid_by_the_longest_sequence(monkeypatch):
    """cu_seqlens_q = [0, 3] with max_seqlen_q = 1: the decode route must size its grid by the 3
    rows the offsets hold (read for the value check anyway), or two rows stay unwritten; the
    library's policy is asked with that bound too."""
    seen = {}

    def route(q, k, v, cu_q, cu_k, max_seqlen_q, *rest):
        seen["max_seqlen_q"] = max_seqlen_q
        return q, None

    def ask(vp, longest_q, *rest):
        seen["asked"] = longest_q
        return True

    cfg = SimpleNamespace(backend="auto", softmax_scale=0.125, window_left=-1, window_right=-1,
                          softcap=0.0)
    plan = SimpleNamespace(template=b"", dense=SimpleNamespace(cfg=cfg, device=None,
                                                               out_dtype=BF16),
                           out_shape=(3, 2, 64), lse_shape=(2, 3))
    monkeypatch.setattr(_varlen, "plan", lambda *a, **k: plan)
    monkeypatch.setattr(_varlen._decode, "varlen_forward", route)
    monkeypatch.setattr(_varlen, "_decode_route", ask)
    monkeypatch.setattr(_varlen, "offsets_checked", lambda: True)
    q, kv = torch.zeros(3, 2, 64, dtype=BF16), torch.zeros(7, 2, 64, dtype=BF16)
    cu_q, cu_k = torch.tensor([0, 3], dtype=I32), torch.tensor([0, 7], dtype=I32)
    _varlen.forward(q, kv, kv, cu_q, cu_k, 1, 7, None, None, None, False, (-1, -1), 0.0, "auto")
    assert seen["max_seqlen_q"] == seen["asked"] == 3
    monkeypatch.setattr(_varlen, "offsets_checked", lambda: False)  # unchecked: the hint is all
    _varlen.forward(q, kv, kv, cu_q, cu_k, 1, 7, None, None, None, False, (-1, -1), 0.0, "auto")
    assert seen["max_seqlen_q"] == seen["asked"] == 1


def test_packed_spans_clamp_seqused_k_to_the_span():
    cu_k = torch.tensor([0, 5, 9], dtype=I32)
    lead, seqlen = _decode.packed_spans(cu_k, torch.tensor([7, -2], dtype=I32))
    assert lead.tolist() == [0, 5] and seqlen.tolist() == [5, 5]


# --- flash_attn_with_kvcache: refusals come before the append ------------------------------------


def _paged(num_pages=32, page_size=16, heads_kv=8, d=128, rows=4, max_pages=8, b=2):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, 1, 32, d, generator=g).to(BF16)
    kc, vc = (torch.randn(num_pages, page_size, heads_kv, d, generator=g).to(BF16)
              for _ in range(2))
    kn, vn = (torch.randn(b, 1, heads_kv, d, generator=g).to(BF16) for _ in range(2))
    table = torch.randperm(num_pages, generator=g)[:rows * max_pages].view(rows, max_pages)
    return q, kc, vc, kn, vn, table.to(I32)


def test_paged_cache_batch_idx_past_the_table_is_refused_before_the_append():
    q, kc, vc, kn, vn, table = _paged()
    before = kc.clone(), vc.clone()
    with raises(ValueError, "cache_batch_idx: expected 0 <= cache_batch_idx[1] < "
                            "page_table.shape[0] (4), got 7"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([10, 10], dtype=I32),
                                cache_batch_idx=torch.tensor([0, 7], dtype=I32), page_table=table)
    with raises(ValueError, "cache_batch_idx", "got -1"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([10, 10], dtype=I32),
                                cache_batch_idx=torch.tensor([-1, 0], dtype=I32), page_table=table)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_unchecked_paged_cache_batch_idx_is_clamped_to_the_table(monkeypatch):
    monkeypatch.setattr(kvcache._varlen, "offsets_checked", lambda: False)
    q, kc, _, _, _, table = _paged()
    rows, _, _ = kvcache._check_page_table(table, kc, kc, q, None,
                                           torch.tensor([0, 7], dtype=I32), None)
    assert torch.equal(rows, table[[0, 3]])


def test_page_table_of_any_strides_reaches_the_kernel_contiguous():
    q, kc, _, _, _, table = _paged(rows=2, max_pages=16)
    for view in (table[:, ::2], table[:1].expand(2, 16), table.t().contiguous().t()):
        rows, _, _ = kvcache._check_page_table(view, kc, kc, q, None, None, None)
        assert torch.equal(rows, view) and rows.stride() == (rows.shape[1], 1)


def test_paged_capacity_past_int32_is_refused():
    q = torch.zeros(1, 1, 4, 64, dtype=BF16)
    kc = torch.zeros(1, 1, 1, 64, dtype=BF16).expand(8, 4096, 1, 64)  # a pool of no memory
    table = torch.zeros(1, 2**19 + 1, dtype=I32)
    with raises(ValueError, "page_table: expected max_pages * page_size <= 2**31 - 1",
                "524289 * 4096"):
        kvcache._check_page_table(table, kc, kc, q, None, None, None)


def test_packed_path_splits_stay_within_the_varlen_grid():
    cpu = torch.device("cpu")
    assert kvcache._splits(2**40, 40000, 4, 8, 4096, cpu) == 1
    assert kvcache._splits(64, 1000, 4, 8, 4096, cpu) == 64
    assert kvcache._splits(64, 2000, 4, 8, 4096, cpu) == 32
    assert kvcache._splits(5, 70000, 4, 8, 4096, cpu) == 1  # a batch the varlen check refuses


def test_heuristic_splits_of_no_rows_is_one(monkeypatch):
    """An unchecked max_seqlen_q of 0 (checks off, as under graph capture) gives no rows: one
    split, not a division by zero tiles."""
    monkeypatch.setattr(kvcache._device, "device_info",
                        lambda index: type("Info", (), {"sm_count": 132})())
    cuda0 = torch.device("cuda", 0)
    assert kvcache._heuristic_splits(1, 0, 1, 4096, cuda0) == 1
    assert kvcache._heuristic_splits(1, 4, 1, 65536, cuda0) > 1  # the heuristic itself runs


def test_append_slots_are_clamped_into_the_cache():
    """Unchecked values (graph capture, FLASH_HOPPER_CHECK_OFFSETS=0): an entry index past the
    cache or negative, a length past the capacity, a page id outside the pool all land inside."""
    seq = torch.tensor([0, 1, 2, 2])
    index = torch.tensor([0, 0, 0, 1])
    lengths = torch.tensor([5, 1000, -9], dtype=I32)
    rows, pos = kvcache._append_slots(seq, index, lengths, 16, 3,
                                      torch.tensor([7, -4, 2], dtype=I32), None)
    assert rows.tolist() == [2, 0, 2, 2] and pos.tolist() == [5, 15, 0, 0]
    table = torch.tensor([[1, 99], [-5, 2], [0, 3]], dtype=I32)
    page, slot = kvcache._append_slots(seq, index, lengths, 2 * 8, 3, None, (table, 4, 8))
    assert page.tolist() == [1, 2, 0, 0] and slot.tolist() == [5, 7, 0, 0]


# --- index tensors of any strides -------------------------------------------------------------


def test_index_tensors_of_any_strides_are_passed_contiguous():
    q = torch.zeros(4, 1, 8, 64, dtype=BF16)
    beam = torch.zeros(1, dtype=I32).expand(4)  # beam search: every beam reads entry 0
    got = kvcache._check_index("cache_batch_idx", beam, 4, q)
    assert got.is_contiguous() and got.tolist() == [0, 0, 0, 0]
    layers = torch.arange(16, dtype=torch.float32).view(8, 2)
    sinks = kvcache.check_sinks(layers[:, 1], q)
    assert sinks.is_contiguous() and torch.equal(sinks, layers[:, 1])
    lens = torch.arange(8, dtype=I32)[::2]
    assert kvcache._check_index("cache_seqlens", lens, 4, q).is_contiguous()


# --- the fallback's gather follows the used pages ----------------------------------------------


def test_paged_fallback_copies_only_the_used_pages(monkeypatch):
    """A vLLM block table is as wide as the model's context: the copy must follow the longest
    sequence's pages (its keys + new keys), not the table's width; the new keys still land in the
    pool, nothing else of it changes."""
    num_pages, page_size = 40, 4
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 1, 4, 64, generator=g).to(BF16)
    kc, vc = (torch.randn(num_pages, page_size, 2, 64, generator=g).to(BF16) for _ in range(2))
    kn, vn = (torch.randn(2, 2, 2, 64, generator=g).to(BF16) for _ in range(2))
    table = torch.randperm(num_pages, generator=g)[:32].view(2, 16).to(I32)
    seqlens = torch.tensor([9, 3], dtype=I32)  # 11 and 5 keys with the new ones: 3 pages at most
    seen = {}

    def dense(**call):
        dk, dv = call["k_cache"], call["v_cache"]
        seen["shape"], seen["lengths"] = tuple(dk.shape), call["cache_seqlens"].tolist()
        for b in range(2):
            n = int(call["cache_seqlens"][b])
            dk[b, n:n + 2], dv[b, n:n + 2] = call["k"][b], call["v"][b]
        return torch.zeros_like(call["q"])

    monkeypatch.setattr(kvcache, "flash_attn_with_kvcache", dense)
    pool_k, pool_v = kc.clone(), vc.clone()
    kvcache._paged(page_table=table, k_cache=kc, v_cache=vc, cache_batch_idx=None,
                   q=q, k=kn, v=vn, cache_seqlens=seqlens, cu_seqlens_q=None,
                   cu_seqlens_k_new=None, rotary_cos=None)
    assert seen["shape"] == (2, 3 * page_size, 2, 64) and seen["lengths"] == [9, 3]
    for b, n in enumerate([9, 3]):
        for i in range(2):
            page, slot = int(table[b, (n + i) // page_size]), (n + i) % page_size
            pool_k[page, slot], pool_v[page, slot] = kn[b, i], vn[b, i]
    assert torch.equal(kc, pool_k) and torch.equal(vc, pool_v)


# --- smaller ones ------------------------------------------------------------------------------


def test_constants_are_per_stream(monkeypatch):
    """A constant tensor is used only on the stream it was made on: freeing it (a clear of the
    cache) then returns its memory behind every kernel that reads it."""
    stream = [7]
    monkeypatch.setattr(_decode, "_stream_of", lambda device: stream[0])
    cache, pinned = {}, {}
    dev = torch.device("cuda", 0)
    a = _decode.eager_constant(cache, pinned, (dev, 3), lambda: torch.zeros(3))
    assert _decode.eager_constant(cache, pinned, (dev, 3), lambda: torch.ones(3)) is a
    stream[0] = 8
    b = _decode.eager_constant(cache, pinned, (dev, 3), lambda: torch.ones(3))
    assert b is not a and b.tolist() == [1.0, 1.0, 1.0]


def test_a_capture_on_its_own_stream_takes_the_eager_constant(monkeypatch):
    """torch.cuda.graph captures on a stream of its own: the constant the eager call made on
    another stream is taken (no kernel in the graph for it) and pinned (never freed)."""
    stream, capturing = [7], [False]
    monkeypatch.setattr(_decode, "_stream_of", lambda device: stream[0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cache, pinned = {}, {}
    dev = torch.device("cuda", 0)
    a = _decode.eager_constant(cache, pinned, (dev, 3), lambda: torch.zeros(3))
    stream[0], capturing[0] = 9, True
    assert _decode.eager_constant(cache, pinned, (dev, 3), lambda: torch.ones(3)) is a
    assert list(pinned.values()) == [a]
    cache.clear()
    assert _decode.eager_constant(cache, pinned, (dev, 3), lambda: torch.ones(3)) is a
    other = _decode.eager_constant(cache, pinned, (dev, 4), lambda: torch.ones(4))
    assert other.tolist() == [1.0] * 4 and len(pinned) == 1  # made while capturing: not kept


def test_sink_of_minus_inf_on_a_row_without_keys_is_zero_not_nan():
    out = torch.zeros(1, 2, 2, 8)
    lse = torch.tensor([[[float("-inf"), 0.5], [float("-inf"), float("-inf")]]])  # (b, h, s)
    sinks = torch.tensor([float("-inf"), 1.0])
    got, total = kvcache.apply_sinks(out + 1, lse, sinks, 1)
    assert not got.isnan().any() and not total.isnan().any()
    assert (got[0, 0, 0] == 0).all()  # head 0, row 0: no keys, sink -inf
    assert total[0, 0, 0] == float("-inf") and total[0, 1, 0] == 1.0


def test_decode_abi_struct_has_total_q_next_to_seqlen_q():
    assert FhDecodeParams.total_q.offset == FhDecodeParams.seqlen_q.offset + 8
    assert ctypes.sizeof(FhDecodeParams) == 408


@pytest.mark.parametrize(("capability", "head_dim", "decode"), [
    ((9, 0), 256, True), ((8, 0), 256, True), ((8, 6), 256, False), ((8, 9), 256, False),
    ((12, 0), 256, False), ((8, 9), 128, True), ((12, 0), 64, True)])
def test_supports_names_the_decode_kernel_only_where_it_fits(lib, capability, head_dim, decode):
    from flash_hopper import supports

    ok, reason = supports(dtype="bf16", head_dim=head_dim, heads_q=32, heads_kv=8, seqlen_q=1,
                          seqlen_k=4096, kvcache=True, capability=capability)
    assert reason.startswith("decode:") == decode, reason
    assert ok or not decode


# --- FP8 caches: what reaches the kernel, and refusals before the append -------------------------

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bytes(*caches):
    """The caches' bytes (FP8 tensors compared bit for bit, NaN included)."""
    return [c.view(torch.uint8).clone() for c in caches]


def test_fp8_calls_fill_the_dtypes_the_policy_serves(lib):
    """_decode's FhDecodeParams of FA3's FP8 convention (e4m3 q, k, v: dtype e4m3, kv_dtype 0)
    and of 16-bit q against an e4m3 / e5m2 cache (kv_dtype the cache's): the library's policy
    serves each; a 16-bit cache under FP8 q is no call the struct can say."""
    q16 = torch.zeros(1, 1, 8, 128, dtype=BF16)
    cases = ((q16.to(E4M3), E4M3, FhDtype.E4M3, 0), (q16, E4M3, FhDtype.BF16, FhDtype.E4M3),
             (q16.half(), E5M2, FhDtype.FP16, FhDtype.E5M2))
    for q, cache_dtype, dtype, kv_dtype in cases:
        kc = torch.zeros(1, 256, 2, 128, dtype=cache_dtype)
        assert _decode.expressible(q, kc, kc)
        p = _decode._fill(q, kc, kc, (1024, 1024, 128, 1), 1, 1, None, False)
        assert (p.dtype, p.kv_dtype) == (dtype, kv_dtype)
        p.softmax_scale, p.window_left, p.window_right = 0.125, -1, -1
        assert lib.policy(p, (9, 0))[0] == FhBackend.DECODE
    kc = torch.zeros(1, 256, 2, 128, dtype=E4M3)
    assert not _decode.expressible(q16.to(E4M3), q16, q16)
    assert not _decode.expressible(q16, kc, kc.view(E5M2))  # k and v in one FP8 dtype


def test_fp8_forward_passes_its_descales_and_writes_bf16(recorded):
    """FA3's convention: o in bf16, each descale's pointer and (batch, head) strides in the
    struct (0 broadcasts: an expand()ed or a (1,) descale); the mixed mode: o in q's dtype."""
    q = torch.zeros(2, 1, 8, 64, dtype=E4M3)
    kc = torch.zeros(2, 128, 2, 64, dtype=E4M3)
    qd, kd, vd = torch.rand(2, 2), torch.rand(1, 1).expand(2, 2), torch.rand(1)
    out, _ = _decode.forward(q, kc, kc, torch.full((2,), 128, dtype=I32), softmax_scale=0.125,
                             descales=(qd, kd, vd))
    (p, _), = recorded.calls
    assert out.dtype == BF16 and (p.dtype, p.kv_dtype) == (FhDtype.E4M3, 0)
    assert (p.q_descale, p.k_descale, p.v_descale) == tuple(t.data_ptr() for t in (qd, kd, vd))
    assert (p.q_descale_batch_stride, p.q_descale_head_stride) == (2, 1)
    assert (p.k_descale_batch_stride, p.k_descale_head_stride) == (0, 0)
    assert (p.v_descale_batch_stride, p.v_descale_head_stride) == (0, 0)
    q16, kc5 = torch.zeros(2, 1, 8, 64, dtype=torch.float16), kc.view(E5M2)
    out, _ = _decode.forward(q16, kc5, kc5, torch.full((2,), 128, dtype=I32), softmax_scale=0.125,
                             descales=(None, qd, None))
    p = recorded.calls[-1][0]
    assert out.dtype == torch.float16 and (p.dtype, p.kv_dtype) == (FhDtype.FP16, FhDtype.E5M2)
    assert p.q_descale is None and p.k_descale == qd.data_ptr() and p.v_descale is None


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("q_dtype", [E4M3, BF16])
def test_16_bit_new_keys_into_an_fp8_cache_are_refused_before_the_append(paged, q_dtype):
    """FA3 appends new keys of q's dtype, the cache's, only: 16-bit k into an e4m3 cache is
    refused naming k, the expected and the given dtype, under FA3's FP8 convention and the mixed
    mode, dense and paged, and no cache changes."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 1, 8, 64, generator=g).to(q_dtype)
    shape = (8, 16, 2, 64) if paged else (2, 64, 2, 64)
    kc, vc = (torch.randn(*shape, generator=g).to(E4M3) for _ in range(2))
    kn, vn = (torch.randn(2, 1, 2, 64, generator=g).to(BF16) for _ in range(2))
    kw = {"page_table": torch.arange(8, dtype=I32).view(2, 4)} if paged else {}
    before = _bytes(kc, vc)
    with raises(ValueError, "k: expected the cache's dtype torch.float8_e4m3fn, got "
                            "torch.bfloat16 (an FP8 cache takes new keys already quantized"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=5, **kw)
    assert all(torch.equal(a, b) for a, b in zip(_bytes(kc, vc), before))


@pytest.mark.parametrize("backend", ["auto", "fa3"])
def test_16_bit_q_against_an_fp8_cache_off_the_decode_kernel_is_refused(backend):
    """The mixed mode's only route is the decode kernel (the varlen kernels take no FP8 cache
    under 16-bit q): where it does not serve the call (here: no GPU; an explicit backend), the
    call is refused naming k_cache before the new keys are written."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 8, 64, generator=g).to(BF16)
    kc, vc = (torch.randn(2, 64, 2, 64, generator=g).to(E4M3) for _ in range(2))
    kn, vn = (torch.randn(2, 1, 2, 64, generator=g).to(E4M3) for _ in range(2))
    before = _bytes(kc, vc)
    with raises(UnsupportedError, "k_cache: torch.bfloat16 q against an FP8 cache "
                                  "(torch.float8_e4m3fn, the mixed mode) runs on the decode "
                                  "kernel only", f"backend '{backend}'"):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=5,
                                k_descale=torch.ones(2, 2), backend=backend)
    assert all(torch.equal(a, b) for a, b in zip(_bytes(kc, vc), before))


def test_supports_names_the_decode_kernel_for_fp8_caches(lib):
    """supports() answers FP8 KV-cache calls with the library's policy: the decode kernel for
    FA3's convention and the mixed mode; where it does not fit, the mixed mode has no other
    route and says why."""
    from flash_hopper import supports

    for dtype in ("e4m3", "bf16+e4m3", "fp16+e5m2"):
        ok, reason = supports(dtype=dtype, head_dim=128, heads_q=32, heads_kv=8, kvcache=True,
                              capability=(9, 0))
        assert ok and reason.startswith("decode:") and "widened to 16 bits" in reason, reason
    ok, reason = supports(dtype="bf16+e4m3", head_dim=256, heads_q=32, heads_kv=8, kvcache=True,
                          capability=(8, 6))
    assert ok and reason.startswith("decode:"), reason  # 2 FP8 stages fit 99 KiB
    ok, reason = supports(dtype="bf16+e4m3", head_dim=96, heads_q=32, heads_kv=8, kvcache=True,
                          capability=(9, 0))
    assert not ok and "run on the decode kernel only" in reason, reason
    assert "head_dim: the decode kernel takes head_dim" in reason and "got 96" in reason, reason
