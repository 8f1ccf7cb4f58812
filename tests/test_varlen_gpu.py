"""flash_attn_varlen_func on the GPU (docs/host.md "Varlen"): packed batches of sequences of
different lengths, both paths, against the reference per sequence.

Reference: attention_varlen_ref in float64 (per sequence, masks bottom-right aligned on the
sequence's own lengths); FA3's rule: the kernel's max error at most twice that of the same
computation in the input dtype, plus a small absolute term. Every test poisons the padding
between sequences (and the rows past seqused) with NaN: a kernel that reads one token of another
sequence, or lets a masked key's V row into P V (0 * NaN), fails with NaN in the output.
"""

from __future__ import annotations

import random

import pytest
import torch
from flash_hopper import _varlen, flash_attn_func, flash_attn_varlen_func
from flash_hopper import vllm as fh_vllm
from flash_hopper._errors import UnsupportedError
from flash_hopper._lib import FhBackend, FhDtype
from flash_hopper.reference import attention_varlen_ref

from tests._helpers import skip_without_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]

NEG_INF = float("-inf")
BF16 = torch.bfloat16
_ENUM_BACKEND = {"fa2": FhBackend.FA2, "fa3": FhBackend.FA3}
_ENUM_DTYPE = {torch.float16: FhDtype.FP16, torch.bfloat16: FhDtype.BF16}


@pytest.fixture(params=["fa2", "fa3"])
def backend(request, lib) -> str:
    cc = torch.cuda.get_device_capability()
    if request.param == "fa3" and cc != (9, 0):
        pytest.skip("fa3 needs compute capability 9.0")
    if not any(lib.has_fwd_kernel(_ENUM_BACKEND[request.param], _ENUM_DTYPE[BF16], d)
               for d in (64, 96, 128, 192, 256)):
        pytest.skip(f"this build has no {request.param} bf16 kernels")
    return request.param


def require_kernel(lib, backend, dtype, head_dim, backward=False):
    if not lib.has_fwd_kernel(_ENUM_BACKEND[backend], _ENUM_DTYPE[dtype], head_dim):
        pytest.skip(f"this build has no {backend} {dtype} kernel for head_dim {head_dim}")
    if backward and not lib.has_bwd_kernel(_ENUM_BACKEND[backend], _ENUM_DTYPE[dtype], head_dim):
        pytest.skip(f"this build has no {backend} {dtype} backward kernel for head_dim {head_dim}")


def packed(lengths_q, lengths_k, hq, hkv, d, dtype=BF16, pad_used=0, seed=0):
    """Packed q, k, v: sequence b's span holds its lengths[b] tokens then ``pad_used`` NaN tokens
    past its seqused (given iff pad_used > 0). Returns q, k, v, cu_q, cu_k, seqused_q, seqused_k."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def build(lengths, heads):
        cu, pos = [0], 0
        for n in lengths:
            pos += n + pad_used
            cu.append(pos)
        t = torch.full((pos, heads, d), float("nan"), dtype=dtype, device="cuda")
        for start, n in zip(cu, lengths):
            t[start:start + n] = torch.randn(n, heads, d, device="cuda", generator=g).to(dtype)
        return t, torch.tensor(cu, dtype=torch.int32, device="cuda")

    q, cq = build(lengths_q, hq)
    k, ck = build(lengths_k, hkv)
    v, _ = build(lengths_k, hkv)
    used_q = used_k = None
    if pad_used:
        used_q = torch.tensor(lengths_q, dtype=torch.int32, device="cuda")
        used_k = torch.tensor(lengths_k, dtype=torch.int32, device="cuda")
    return q, k, v, cq, ck, used_q, used_k


def reference(q, k, v, cq, ck, used_q, used_k, **mask):
    """(out64, lse64, lowp_out) of the used rows; NaN padding replaced by 0 for the reference
    (it must never matter)."""
    q0, k0, v0 = (torch.nan_to_num(t, nan=0.0) for t in (q, k, v))
    ref_out, ref_lse = attention_varlen_ref(q0.double(), k0.double(), v0.double(), cq, ck,
                                            used_q, used_k, **mask)
    low_out, _ = attention_varlen_ref(q0, k0, v0, cq, ck, used_q, used_k, upcast=False, **mask)
    return ref_out, ref_lse, low_out


def used_rows(cq, used_q, total_q):
    """Boolean (total_q,): rows inside some sequence's used prefix."""
    rows = torch.zeros(total_q, dtype=torch.bool, device="cuda")
    starts = cq.tolist()
    for b in range(len(starts) - 1):
        n = used_q[b].item() if used_q is not None else starts[b + 1] - starts[b]
        rows[starts[b]:starts[b] + n] = True
    return rows


def check(out, lse, q, k, v, cq, ck, used_q=None, used_k=None, **mask):
    ref_out, ref_lse, low_out = reference(q, k, v, cq, ck, used_q, used_k, **mask)
    rows = used_rows(cq, used_q, q.shape[0])
    o, r, lo = out[rows].double(), ref_out[rows], low_out[rows].double()
    assert not o.isnan().any(), "NaN in a used row: padding or another sequence leaked in"
    err = (o - r).abs().max().item() if o.numel() else 0.0
    tol = 2 * ((lo - r).abs().max().item() if o.numel() else 0.0) + 1e-5
    assert err <= tol, f"out: max error {err:.3g} > {tol:.3g}"
    if lse is not None:
        l_, rl = lse[:, rows].double(), ref_lse[:, rows]
        empty = rl == NEG_INF
        assert torch.equal(l_ == NEG_INF, empty), "rows without keys: lse must be -inf exactly"
        assert (out[rows][empty.T.any(-1)] == 0).all() if empty.any() else True
        seen = ~empty
        if seen.any():
            lerr = (l_[seen] - rl[seen]).abs().max().item()
            assert lerr <= 1e-3 + mask.get("softcap", 0.0) * 2**-9, f"lse: max error {lerr:.3g}"


def call(q, k, v, cq, ck, used_q, used_k, backend, out=None, **mask):
    sq = (cq[1:] - cq[:-1]).max().item() if cq.numel() > 1 else 0
    sk = (ck[1:] - ck[:-1]).max().item() if ck.numel() > 1 else 0
    return flash_attn_varlen_func(q, k, v, cq, ck, sq, sk, seqused_q=used_q, seqused_k=used_k,
                                  return_attn_probs=True, backend=backend, out=out, **mask)


MIXES = {
    "edge": ([0, 1, 63, 64, 65, 0, 128, 129, 1000], [5, 1, 63, 64, 65, 0, 128, 0, 1000]),
    "long": ([3000, 17, 2048, 513], [3000, 4000, 2048, 1]),
    "one": ([777], [777]),
    "decode": ([1, 1, 1, 1, 2, 1], [300, 5000, 17, 64, 129, 1]),
}


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mix", list(MIXES))
def test_length_mixes(lib, backend, head_dim, causal, mix):
    require_kernel(lib, backend, BF16, head_dim)
    lq, lk = MIXES[mix]
    q, k, v, cq, ck, uq, uk = packed(lq, lk, 4, 2, head_dim, pad_used=3, seed=head_dim)
    out, lse = call(q, k, v, cq, ck, uq, uk, backend, causal=causal)
    check(out, lse, q, k, v, cq, ck, uq, uk, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("hints", [(1, 1), (4000, 100000)])
def test_max_seqlen_hints_only_steer_the_launch(lib, backend, head_dim, hints):
    """max_seqlen_q / max_seqlen_k pick the FA-3 launch's tile and tile order (the short masked
    tile for d128 causal up to 2048 keys, L2 sections for many long sequences); hints too small
    or too large (even past the packed tokens) must not change what is computed."""
    require_kernel(lib, backend, BF16, head_dim)
    lq, lk = MIXES["long"]
    q, k, v, cq, ck, uq, uk = packed(lq, lk, 4, 2, head_dim, pad_used=3, seed=11)
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, *hints, seqused_q=uq, seqused_k=uk,
                                      causal=True, return_attn_probs=True, backend=backend)
    check(out, lse, q, k, v, cq, ck, uq, uk, causal=True)


@pytest.mark.parametrize("window_size", [(64, 0), (100, 37), (-1, 5), (0, -1)])
@pytest.mark.parametrize("softcap", [0.0, 15.0])
def test_windows_softcap_gqa(lib, backend, window_size, softcap):
    require_kernel(lib, backend, BF16, 128)
    lq, lk = [300, 1, 129, 0, 900], [500, 77, 129, 10, 700]
    q, k, v, cq, ck, uq, uk = packed(lq, lk, 8, 2, 128, pad_used=5, seed=7)
    out, lse = call(q, k, v, cq, ck, uq, uk, backend, window_size=window_size, softcap=softcap)
    check(out, lse, q, k, v, cq, ck, uq, uk, window_size=window_size, softcap=softcap)


def test_plain_cu_seqlens_with_nan_beyond_the_last_sequence(lib, backend):
    """No seqused: sequences back to back, NaN after the last one (inside the tensor)."""
    require_kernel(lib, backend, BF16, 64)
    lengths = [65, 200, 1, 63]
    q, k, v, cq, ck, _, _ = packed(lengths, lengths, 2, 2, 64, seed=3)
    nan_tail = torch.full((50, 2, 64), float("nan"), dtype=BF16, device="cuda")
    q2, k2, v2 = (torch.cat([t, nan_tail]) for t in (q, k, v))
    out, lse = call(q2, k2, v2, cq, ck, None, None, backend, causal=True)
    check(out, lse, q2, k2, v2, cq, ck, causal=True)


def test_rows_outside_sequences_are_not_written(lib, backend):
    require_kernel(lib, backend, BF16, 64)
    q, k, v, cq, ck, uq, uk = packed([100, 3], [100, 50], 2, 2, 64, pad_used=7)
    out = torch.full_like(q, 7.0)
    res, _ = call(q, k, v, cq, ck, uq, uk, backend, out=out)
    assert res.data_ptr() == out.data_ptr(), "out= must be written in place"
    rows = used_rows(cq, uq, q.shape[0])
    assert (out[~rows] == 7.0).all(), "a row past seqused_q was written"


@pytest.mark.parametrize("causal", [False, True])
def test_equal_lengths_match_the_dense_kernel(lib, backend, causal):
    """Same tiles, same math. Causal: the short masked tile on both sides (dense by seqlen_k,
    varlen by the max_seqlen_k hint), and five sequences as long as the longest take the FA-3
    path's L2 sections (sm90/fwd/launch.h)."""
    require_kernel(lib, backend, BF16, 128)
    b, s, h, d = 5, 700, 4, 128
    q, k, v = (torch.randn(b, s, h, d, dtype=BF16, device="cuda") for _ in range(3))
    dense, dense_lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True,
                                       backend=backend)
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(q.reshape(b * s, h, d), k.reshape(b * s, h, d),
                                      v.reshape(b * s, h, d), cu, cu, s, s, causal=causal,
                                      return_attn_probs=True, backend=backend)
    assert torch.equal(out.reshape(b, s, h, d), dense), "same tiles, same math: bitwise equal"
    assert torch.equal(lse.reshape(h, b, s).permute(1, 0, 2), dense_lse)


def test_non_contiguous_views_of_packed_qkv(lib, backend):
    require_kernel(lib, backend, BF16, 64)
    lengths = [130, 7, 64]
    total, hq, hkv, d = sum(lengths), 4, 2, 64
    qkv = torch.randn(total, hq + 2 * hkv, d, dtype=BF16, device="cuda")
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    cu = torch.tensor([0, 130, 137, 201], dtype=torch.int32, device="cuda")
    out, lse = call(q, k, v, cu, cu, None, None, backend, causal=True)
    check(out, lse, q, k, v, cu, cu, causal=True)


def test_empty_batch_and_all_empty_sequences(lib, backend):
    require_kernel(lib, backend, BF16, 64)
    q = torch.randn(10, 2, 64, dtype=BF16, device="cuda")
    cu0 = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, q, q, cu0, cu0, 0, 0, backend=backend)
    assert out.shape == q.shape
    cu_q = torch.tensor([0, 0, 10], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 0, 0], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(q, q[:0], q[:0], cu_q, cu_k, 10, 0,
                                      return_attn_probs=True, backend=backend)
    assert (out == 0).all() and (lse == NEG_INF).all(), "no keys: out 0, lse -inf"


def test_vllm_order_equals_fa3_order(lib):
    q, k, v, cq, ck, _, _ = packed([300, 50], [400, 60], 4, 4, 128, seed=11)
    a, lse_a = flash_attn_varlen_func(q, k, v, cq, ck, 300, 400, causal=True,
                                      return_attn_probs=True)  # both "auto"
    out = torch.empty_like(q)
    res = fh_vllm.flash_attn_varlen_func(q, k, v, 300, cq, 400, ck, causal=True,
                                         window_size=[-1, -1], return_softmax_lse=True, out=out,
                                         fa_version=3, num_splits=0)
    b, lse_b = res
    assert b.data_ptr() == out.data_ptr()
    rows = used_rows(cq, None, q.shape[0])
    assert torch.equal(a[rows], b[rows]) and torch.equal(lse_a[:, rows], lse_b[:, rows])
    with pytest.raises(UnsupportedError, match="block_table"):
        fh_vllm.flash_attn_varlen_func(q, k, v, 300, cq, 400, ck,
                                       block_table=torch.zeros(2, 4, dtype=torch.int32,
                                                               device="cuda"))


def test_bad_offsets_raise_before_launch(lib):
    """Each bad offsets tensor after a good call of the same shapes (a cached plan must not let
    a changed dtype or device through)."""
    skip_without_kernel(lib, 64)
    q = torch.randn(100, 2, 64, dtype=BF16, device="cuda")
    good = torch.tensor([0, 50, 100], dtype=torch.int32, device="cuda")
    cases = [
        (torch.tensor([0, 60, 50], dtype=torch.int32, device="cuda"), "non-decreasing"),
        (torch.tensor([0, 50, 101], dtype=torch.int32, device="cuda"), "last offset <= total"),
        (torch.tensor([-1, 50, 100], dtype=torch.int32, device="cuda"), "offsets >= 0"),
        (good.long(), "torch.int32"),
        (good.cpu(), "q's device"),
        (good[:2], "entries"),
    ]
    for cu, msg in cases:
        flash_attn_varlen_func(q, q, q, good, good, 50, 50)
        out = torch.full_like(q, 3.0)
        with pytest.raises((ValueError, TypeError), match=msg):
            flash_attn_varlen_func(q, q, q, good, cu, 50, 50, out=out)
        torch.cuda.synchronize()
        assert (out == 3.0).all(), "nothing may be written on an error"
    with pytest.raises(ValueError, match="seqused_k"):
        flash_attn_varlen_func(q, q, q, good, good, 50, 50,
                               seqused_k=torch.tensor([10, 51], dtype=torch.int32,
                                                      device="cuda"))


def test_bad_offsets_unchecked_never_fault(lib, backend, monkeypatch):
    """Offsets the host does not check (CUDA-graph capture, FLASH_HOPPER_CHECK_OFFSETS=0) are
    clamped by the kernels: garbage in, no fault, nothing written outside out."""
    require_kernel(lib, backend, BF16, 64)
    monkeypatch.setenv("FLASH_HOPPER_CHECK_OFFSETS", "0")
    q = torch.randn(100, 2, 64, dtype=BF16, device="cuda")
    buf = torch.full((300, 2, 64), 5.0, dtype=BF16, device="cuda")
    out = buf[100:200]
    cu = torch.tensor([0, 90, 10, 5000, -7], dtype=torch.int32, device="cuda")
    flash_attn_varlen_func(q, q, q, cu, cu, 100, 100, out=out, backend=backend)
    torch.cuda.synchronize()
    assert (buf[:100] == 5.0).all() and (buf[200:] == 5.0).all()


def test_64bit_offsets(lib, backend):
    """total_k * heads_kv * d over 2^31 elements: offsets into k / v need 64 bits."""
    require_kernel(lib, backend, BF16, 128)
    total_k, hkv, d = 2**31 // (8 * 128) + 4096, 8, 128
    try:
        k = torch.empty(total_k, hkv, d, dtype=BF16, device="cuda")
        v = torch.empty(total_k, hkv, d, dtype=BF16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory")
    k.normal_()
    v.normal_()
    q = torch.randn(300, 8, d, dtype=BF16, device="cuda")
    cq = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    ck = torch.tensor([0, 1000, total_k], dtype=torch.int32, device="cuda")
    # Only the last sequence's last 700 keys matter for a causal window of 600: slice the rest.
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, 200, total_k - 1000,
                                      window_size=(600, 0), return_attn_probs=True,
                                      backend=backend)
    tail = total_k - 2000
    ck_small = torch.tensor([0, 1000, 1000 + 2000], dtype=torch.int32, device="cuda")
    k_small = torch.cat([k[:1000], k[tail:]])
    v_small = torch.cat([v[:1000], v[tail:]])
    del k, v
    check(out, lse, q, k_small, v_small, cq, ck_small, window_size=(600, 0))


def test_backward_matches_reference(lib, backend):
    require_kernel(lib, backend, BF16, 64, backward=True)
    lengths_q, lengths_k = [100, 1, 0, 257], [120, 30, 5, 257]
    q, k, v, cq, ck, _, _ = packed(lengths_q, lengths_k, 4, 2, 64, seed=5)
    for t in (q, k, v):
        t.nan_to_num_(0.0)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attn_varlen_func(qg, kg, vg, cq, ck, 257, 257, causal=True, backend=backend)
    ref, _ = attention_varlen_ref(qr, kr, vr, cq, ck, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout.double())
    for name, got, want in (("dq", qg.grad, qr.grad), ("dk", kg.grad, kr.grad),
                            ("dv", vg.grad, vr.grad)):
        err = (got.double() - want).abs().max().item()
        assert err <= 0.05 * want.abs().max().item() + 1e-3, f"{name}: max error {err:.3g}"


def test_torch_compile_fullgraph(lib, backend):
    require_kernel(lib, backend, BF16, 64)
    q, k, v, cq, ck, _, _ = packed([70, 130], [70, 130], 2, 2, 64, seed=9)

    def f(q, k, v):
        return flash_attn_varlen_func(q, k, v, cq, ck, 130, 130, causal=True, backend=backend)

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert torch.equal(eager, compiled)


def test_cuda_graph_capture_and_replay(lib, backend):
    require_kernel(lib, backend, BF16, 64)
    q, k, v, cq, ck, _, _ = packed([70, 130, 5], [70, 200, 9], 2, 2, 64, seed=2)
    out = torch.empty_like(q)
    flash_attn_varlen_func(q, k, v, cq, ck, 130, 200, causal=True, out=out, backend=backend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flash_attn_varlen_func(q, k, v, cq, ck, 130, 200, causal=True, out=out, backend=backend)
    # New lengths of the same bounds, written into the captured offset tensors.
    cq.copy_(torch.tensor([0, 10, 150, 205], dtype=torch.int32))
    ck.copy_(torch.tensor([0, 60, 100, 279], dtype=torch.int32))
    out.fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    want = torch.empty_like(q)
    flash_attn_varlen_func(q, k, v, cq, ck, 140, 179, causal=True, out=want, backend=backend)
    assert torch.equal(out, want)


def test_plan_keeps_no_stale_offsets(lib, backend):
    """Two calls of one signature with different offsets: the plan is shared, the offsets not."""
    require_kernel(lib, backend, BF16, 64)
    _varlen.clear_plans()
    q = torch.randn(200, 2, 64, dtype=BF16, device="cuda")
    a = torch.tensor([0, 100, 200], dtype=torch.int32, device="cuda")
    b = torch.tensor([0, 30, 200], dtype=torch.int32, device="cuda")
    for cu in (a, b):
        out, lse = flash_attn_varlen_func(q, q, q, cu, cu, 170, 170, return_attn_probs=True,
                                          backend=backend)
        check(out, lse, q, q, q, cu, cu)


@pytest.mark.parametrize("sequences", [60, 1500, 6500])
@pytest.mark.parametrize("causal", [False, True])
def test_each_way_of_ordering_the_list(lib, backend, sequences, causal):
    """The prepare kernel's three sorts, each with sequences of several query blocks, masked and
    not: up to 1024 pairs in registers with their records cached, up to 8192 in shared memory,
    beyond that the counting sort (unmasked, each sequence's blocks adjacent and in order: the
    FA-3 tile order walks them as runs, sm90/fwd/tile_scheduler.h)."""
    require_kernel(lib, backend, BF16, 64)
    rng = random.Random(sequences)
    lengths = [rng.randint(1, 450) for _ in range(sequences)]
    q, k, v, cq, ck, uq, uk = packed(lengths, lengths, 2, 1, 64, seed=sequences)
    out, lse = call(q, k, v, cq, ck, uq, uk, backend, causal=causal)
    check(out, lse, q, k, v, cq, ck, uq, uk, causal=causal)


def test_many_sequences_take_the_counting_sort(lib, backend):
    """More pairs than the prepare kernel sorts in shared memory (8192): its counting-sort path.
    9000 one-query sequences of two keys each, against a batched reference."""
    require_kernel(lib, backend, BF16, 64)
    n, h, d = 9000, 2, 64
    q = torch.randn(n, h, d, dtype=BF16, device="cuda")
    k = torch.randn(2 * n, h, d, dtype=BF16, device="cuda")
    v = torch.randn(2 * n, h, d, dtype=BF16, device="cuda")
    cq = torch.arange(0, n + 1, dtype=torch.int32, device="cuda")
    ck = torch.arange(0, 2 * n + 1, 2, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, 1, 2, return_attn_probs=True,
                                      backend=backend)
    kb, vb = k.double().view(n, 2, h, d), v.double().view(n, 2, h, d)
    s = torch.einsum("nhd,nkhd->nhk", q.double(), kb) / d**0.5
    ref = torch.einsum("nhk,nkhd->nhd", s.softmax(-1), vb)
    assert (out.double() - ref).abs().max().item() < 2e-2
    assert (lse.T.double() - s.logsumexp(-1)).abs().max().item() < 1e-3


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_equals_the_dense_fp8_kernel_per_sequence(lib, head_dim, causal):
    """FP8 (e4m3) varlen with per-sequence descales: each sequence's rows bitwise equal to the
    dense FP8 forward on that sequence alone (same tile, same math), NaN padding past seqused
    and between sequences never reaching a used row (the transposer zeroes the V rows past a
    sequence before V^T is formed)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FP8 runs on the FA-3 path (compute capability 9.0)")
    require_kernel_fp8(lib, head_dim)
    lq, lk = [0, 1, 65, 130, 7, 300], [3, 0, 64, 200, 129, 300]
    q, k, v, cq, ck, uq, uk = packed(lq, lk, 4, 2, head_dim, pad_used=5, seed=head_dim)
    q8, k8, v8 = (t.to(FP8) for t in (q, k, v))  # NaN stays NaN in e4m3fn
    g = torch.Generator(device="cuda").manual_seed(1)
    qd, kd, vd = (torch.rand(len(lq), 2, device="cuda", generator=g) + 0.5 for _ in range(3))
    out, lse = flash_attn_varlen_func(q8, k8, v8, cq, ck, max(lq), max(lk), seqused_q=uq,
                                      seqused_k=uk, causal=causal, q_descale=qd, k_descale=kd,
                                      v_descale=vd, return_attn_probs=True)
    assert out.dtype == torch.bfloat16
    starts_q, starts_k = cq.tolist(), ck.tolist()
    for b, (nq, nk) in enumerate(zip(lq, lk)):
        if nq == 0:
            continue
        rows = slice(starts_q[b], starts_q[b] + nq)
        keys = slice(starts_k[b], starts_k[b] + nk)
        got_o, got_lse = out[rows], lse[:, rows]
        assert not got_o.isnan().any(), f"sequence {b}: NaN leaked into a used row"
        if nk == 0:
            assert (got_o == 0).all() and (got_lse == NEG_INF).all()
            continue
        want_o, want_lse = flash_attn_func(q8[rows][None], k8[keys][None], v8[keys][None],
                                           causal=causal, q_descale=qd[b:b + 1],
                                           k_descale=kd[b:b + 1], v_descale=vd[b:b + 1],
                                           return_attn_probs=True)
        assert torch.equal(got_o, want_o[0]), f"sequence {b}: out differs from the dense kernel"
        assert torch.equal(got_lse, want_lse[0]), f"sequence {b}: lse differs"


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("softcap", [0.0, 15.0])
def test_fp8_with_more_tiles_than_sms_equals_the_dense_kernel(lib, head_dim, softcap):
    """Nine sequences x six query heads (MQA) with descales drawn per sequence: more tiles than
    SMs, so CTAs run tiles of different sequences back to back, each with its own descales (with
    softcap they scale the tanh's argument of the tile's first block too); every sequence
    bitwise equal to the dense FP8 forward on it alone (a few tiles, one per CTA)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FP8 runs on the FA-3 path (compute capability 9.0)")
    require_kernel_fp8(lib, head_dim)
    lengths = [512, 500, 512, 384, 512, 450, 512, 512, 260]
    q, k, v, cq, ck, _, _ = packed(lengths, [256] * 9, 6, 1, head_dim, seed=head_dim + 1)
    q8, k8, v8 = (t.to(FP8) for t in ((q * (softcap / 4 if softcap else 1)), k, v))
    g = torch.Generator(device="cuda").manual_seed(2)
    qd, kd, vd = (torch.rand(9, 1, device="cuda", generator=g) * 2 for _ in range(3))
    out = flash_attn_varlen_func(q8, k8, v8, cq, ck, max(lengths), 256, softcap=softcap,
                                 q_descale=qd, k_descale=kd, v_descale=vd)
    starts_q, starts_k = cq.tolist(), ck.tolist()
    for b, n in enumerate(lengths):
        rows, keys = slice(starts_q[b], starts_q[b] + n), slice(starts_k[b], starts_k[b] + 256)
        want = flash_attn_func(q8[rows][None], k8[keys][None], v8[keys][None], softcap=softcap,
                               q_descale=qd[b:b + 1], k_descale=kd[b:b + 1],
                               v_descale=vd[b:b + 1])
        assert torch.equal(out[rows], want[0]), f"sequence {b}: out differs from the dense kernel"


def require_kernel_fp8(lib, head_dim):
    if not lib.has_fwd_kernel(FhBackend.FA3, FhDtype.E4M3, head_dim):
        pytest.skip(f"this build has no fa3 e4m3 kernel for head_dim {head_dim}")


def test_fp8_on_inputs_that_require_grad_runs_forward_only(lib):
    """FA3's varlen tests pass FP8 tensors that require grad: the forward runs (the same result
    as under no_grad) and a backward through it raises, naming why."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FP8 runs on the FA-3 path (compute capability 9.0)")
    require_kernel_fp8(lib, 128)
    q, k, v, cq, ck, _, _ = packed([100, 37], [80, 200], 4, 2, 128, seed=5)
    q8, k8, v8 = (t.to(FP8) for t in (q, k, v))
    with torch.no_grad():
        want = flash_attn_varlen_func(q8, k8, v8, cq, ck, 100, 200, causal=True)
    q8.requires_grad_()
    got = flash_attn_varlen_func(q8, k8, v8, cq, ck, 100, 200, causal=True)
    assert got.requires_grad and torch.equal(got.detach(), want)
    with pytest.raises(UnsupportedError, match="the FP8 forward has no backward"):
        got.float().sum().backward()


def _dense_grads(q, k, v, cq, ck, used_q, used_k, dout, deterministic=False, **mask):
    """(dq, dk, dv) per sequence through flash_attn_func (the dense backward on each sequence's
    used rows), zeros elsewhere: what the one-call varlen backward must reproduce."""
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    starts_q, starts_k = cq.tolist(), ck.tolist()
    for b in range(len(starts_q) - 1):
        nq = used_q[b].item() if used_q is not None else starts_q[b + 1] - starts_q[b]
        nk = used_k[b].item() if used_k is not None else starts_k[b + 1] - starts_k[b]
        if nq == 0 or nk == 0:
            continue
        rows = slice(starts_q[b], starts_q[b] + nq)
        keys = slice(starts_k[b], starts_k[b] + nk)
        qs, ks, vs = (t.detach().unsqueeze(0).requires_grad_()
                      for t in (q[rows], k[keys], v[keys]))
        out = flash_attn_func(qs, ks, vs, backend="fa3", deterministic=deterministic, **mask)
        out.backward(dout[rows].unsqueeze(0))
        grads[0][rows], grads[1][keys], grads[2][keys] = qs.grad[0], ks.grad[0], vs.grad[0]
    return grads


def _one_call_inputs(lib, head_dim, lengths_q, lengths_k, hq, hkv, seed, pad_used=0):
    """packed()'s tensors for a test of the one-call varlen backward (FA-3 path, cc 9.0), the
    padding's NaN replaced by 0 (the backward reads the rows next to a span: api.h)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the one-call varlen backward runs on the FA-3 path (cc 9.0)")
    require_kernel(lib, "fa3", BF16, head_dim, backward=True)
    inputs = packed(lengths_q, lengths_k, hq, hkv, head_dim, pad_used=pad_used, seed=seed)
    for t in inputs[:3]:
        t.nan_to_num_(0.0)
    return inputs


def _assert_grads_close(got_grads, want_grads):
    for name, got, ref in zip(("dq", "dk", "dv"), got_grads, want_grads):
        err = (got.double() - ref.double()).abs().max().item()
        assert err <= 2e-2 * ref.double().abs().max().item() + 1e-3, f"{name}: {err:.3g}"


_ONE_CALL_CASES = [
    # (lengths_q, lengths_k, hq, hkv, mask): short and long sequences, empty ones, GQA
    ([100, 1, 0, 257], [120, 30, 5, 257], 4, 2, {"causal": True}),
    ([300, 64, 129, 1000], [300, 64, 129, 1000], 2, 2, {}),
    ([513, 17, 200], [40, 700, 200], 4, 1, {"window_size": (90, 30)}),
    ([5] * 60, [7] * 60, 2, 1, {"causal": True}),
]


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("case", range(len(_ONE_CALL_CASES)))
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_one_call_equals_per_sequence(lib, head_dim, case, deterministic):
    """The FA-3 path's varlen backward (one call over the packed batch, offsets read on the
    device) against the dense backward run per sequence: the same tiles over the same rows, so
    dk / dv bitwise equal and dq up to the fp32 accumulation's order; deterministic mode
    repeats its dq bit for bit."""
    lengths_q, lengths_k, hq, hkv, mask = _ONE_CALL_CASES[case]
    q, k, v, cq, ck, _, _ = _one_call_inputs(lib, head_dim, lengths_q, lengths_k, hq, hkv, case)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attn_varlen_func(qg, kg, vg, cq, ck, max(lengths_q), max(lengths_k),
                                 backend="fa3", deterministic=deterministic, **mask)
    dout = torch.randn_like(out)
    out.backward(dout)
    want = _dense_grads(q, k, v, cq, ck, None, None, dout, deterministic, **mask)
    for name, got, ref in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), want):
        assert not got.isnan().any(), f"{name}: NaN"
        # dk / dv: one CTA per key block, its steps in the same order (but for the dense
        # deterministic kernel's shift order on full masks, and the dense unmasked d128 tile's
        # 80-query steps (bwd/launch.h bwd_takes_unmasked_tile), which varlen calls do not take)
        unmasked_tile = not deterministic and not mask and 96 < head_dim <= 128
        same_order = not (deterministic and not mask) and not unmasked_tile
        if name != "dq" and same_order:
            assert torch.equal(got, ref), f"{name}: differs from the per-sequence backward"
        else:
            err = (got.double() - ref.double()).abs().max().item()
            assert err <= 2e-2 * ref.double().abs().max().item() + 1e-3, f"{name}: {err:.3g}"
    if deterministic:
        first = qg.grad.clone()
        qg.grad = None
        out = flash_attn_varlen_func(qg, kg, vg, cq, ck, max(lengths_q), max(lengths_k),
                                     backend="fa3", deterministic=True, **mask)
        out.backward(dout)
        assert torch.equal(qg.grad, first), "deterministic dq differs between two runs"


def test_backward_one_call_seqused_and_short_bounds(lib):
    """seqused_q / seqused_k (the rest of each span is padding, left at 0 in the gradients)."""
    q, k, v, cq, ck, uq, uk = _one_call_inputs(lib, 128, [90, 0, 300, 33], [100, 12, 290, 1], 4,
                                               2, seed=11, pad_used=7)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_attn_varlen_func(qg, kg, vg, cq, ck, 307, 297, seqused_q=uq, seqused_k=uk,
                                 causal=True, backend="fa3")
    dout = torch.randn_like(out).nan_to_num_(0.0)
    out.backward(dout)
    _assert_grads_close((qg.grad, kg.grad, vg.grad),
                        _dense_grads(q, k, v, cq, ck, uq, uk, dout, causal=True))


def test_backward_cuda_graph_capture_and_replay(lib):
    """A varlen training step (forward + backward) captured in a CUDA graph and replayed with new
    lengths written into the captured offsets: no host read of the offsets anywhere."""
    q, k, v, cq, ck, _, _ = _one_call_inputs(lib, 64, [70, 130, 5], [70, 200, 9], 2, 2, seed=2)
    dout = torch.randn_like(q)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def step():
        for t in (qg, kg, vg):
            t.grad = None
        out = flash_attn_varlen_func(qg, kg, vg, cq, ck, 140, 200, causal=True, backend="fa3")
        out.backward(dout)
        return qg.grad, kg.grad, vg.grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture (plans, descriptors)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = step()
    cq.copy_(torch.tensor([0, 10, 150, 205], dtype=torch.int32))
    ck.copy_(torch.tensor([0, 60, 100, 279], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    _assert_grads_close(grads, _dense_grads(q, k, v, cq, ck, None, None, dout, causal=True))


def test_backward_torch_compile_training_step(lib):
    """torch.compile(fullgraph=True) of a varlen forward + backward (the custom ops and their
    registered autograd): the gradients equal eager's."""
    q, k, v, cq, ck, _, _ = _one_call_inputs(lib, 128, [70, 130, 300], [90, 130, 64], 4, 2,
                                             seed=4)
    dout = torch.randn_like(q)

    def step(q, k, v):
        out = flash_attn_varlen_func(q, k, v, cq, ck, 300, 130, causal=True, backend="fa3",
                                     deterministic=True)
        return (out.float() * dout.float()).sum()

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        fn(qg, kg, vg).backward()
        grads.append((qg.grad, kg.grad, vg.grad))
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), f"{name}: compiled differs from eager"
