"""Backward kernels against the reference, on a GPU (every test here is marked ``gpu``).

Tolerance doctrine (FA3's rule, docs/testing.md "The tolerance doctrine"), for g in dq, dk, dv:
    max|g - g_ref| <= 2 * max|g_lowp - g_ref| + atol      (3 x with softcap)
g_ref: autograd of the naive attention_ref in float64 on the same (low-precision) inputs; g_lowp:
the same autograd with every step in the input dtype (upcast=False), a plain same-precision
PyTorch implementation; atol: FA3's rounding scale of the reference in the input dtype,
2 * max|fl(g_ref + 0.3) - 0.3 - g_ref|, floored at 1e-4. Rows that see no key (dq) and keys that
no query sees (dk, dv) are compared exactly: their gradients are 0, not small.

Gradients come from flash_attn_func(...) through autograd (the eager route: the autograd
Function over the host paths), or from ops.bwd_into into NaN-poisoned caller buffers, so an
element the kernels forget to write fails.

Grid rationale (a few minutes with -n 8 on an H200; the float64 reference dominates): one axis at
a time around a central case (bf16, hdim 128, GQA 4:2, lengths 113 x 203) instead of a product.
Both paths run every test that takes the ``path`` fixture (fa3 where this GPU is cc 9.0 and the
build has the bucket's FA-3 backward kernel, kernels/sm90/bwd/tile_config.h: family A for d64 /
d96 / d128, family B for d192 / d256; fa2 everywhere); flash_attn_func is called with
backend=path, so forward and backward run on it. "auto" trains every bucket on fa3 on cc 9.0
(test_fa3_backward_buckets); test_fa3_matches_fa2 compares the two paths directly.
"""

from __future__ import annotations

import pytest
import torch
from flash_hopper import UnsupportedError, _validate, flash_attn_func, ops
from flash_hopper._lib import FhBackend, FhDtype
from flash_hopper.dispatch import head_dim_bucket
from flash_hopper.mask import AttentionMask
from flash_hopper.reference import attention_kvcache_ref, attention_ref

# fp32 references stay fp32, not TF32 (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]

DTYPES = [torch.bfloat16, torch.float16]
BUCKETS = [64, 96, 128, 192, 256]
_ENUM_DTYPE = {torch.float16: FhDtype.FP16, torch.bfloat16: FhDtype.BF16}
CENTRAL = (2, 113, 203, 4, 2, 128)  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim)


# --- fixtures and helpers ------------------------------------------------------------------------


PATHS = ["fa3", "fa2"]
_ENUM_PATH = {"fa3": FhBackend.FA3, "fa2": FhBackend.FA2}


@pytest.fixture(params=PATHS)
def path(request) -> str:
    """The path a test runs forward and backward on."""
    return request.param


def require_bwd(lib, dtype: torch.dtype, head_dim: int, path: str = "fa2") -> None:
    """Skip unless this GPU and build can run `path`'s backward for dtype / head_dim."""
    cc = torch.cuda.get_device_capability()
    if cc < (8, 0):
        pytest.skip(f"the backward needs compute capability >= 8.0, this GPU is {cc[0]}.{cc[1]}")
    if path == "fa3" and cc != (9, 0):
        pytest.skip(f"the fa3 path needs compute capability 9.0, this GPU is {cc[0]}.{cc[1]}")
    if not lib.has_bwd_kernel(_ENUM_PATH[path], _ENUM_DTYPE[dtype], head_dim):
        pytest.skip(f"this build has no {path} backward kernel for {dtype} hdim bucket "
                    f"{head_dim_bucket(head_dim)} (FH_DIRECTIONS / FH_HEAD_DIMS / FH_DTYPES; "
                    "fa3: sm90/bwd/tile_config.h)")
    if not lib.has_fwd_kernel(_ENUM_PATH[path], _ENUM_DTYPE[dtype], head_dim):
        pytest.skip(f"this build has no {path} forward kernel for {dtype} hdim {head_dim}")


def make_qkv(b, sq, sk, hq, hkv, d, dtype, layout="contiguous"):
    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device="cuda")

    if layout == "contiguous":
        return rand(b, sq, hq, d), rand(b, sk, hkv, d), rand(b, sk, hkv, d)
    if layout == "packed_qkv":  # one (b, s, hq + 2 hkv, d) projection output, split by heads
        qkv = rand(b, sq, hq + 2 * hkv, d)
        return qkv[:, :, :hq], qkv[:, :, hq : hq + hkv], qkv[:, :, hq + hkv :]
    if layout == "heads_first":  # (b, h, s, d) storage viewed as (b, s, h, d)
        return (rand(b, hq, sq, d).transpose(1, 2), rand(b, hkv, sk, d).transpose(1, 2),
                rand(b, hkv, sk, d).transpose(1, 2))
    raise ValueError(layout)


def max_abs(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_fa3_rule(got, ref, low, factor=2.0, what=""):
    """FA3's rule for one result: max|got - ref| <= factor * max|low - ref| + FA3's rounding
    scale of ref in got's dtype (2 * max|fl(ref + 0.3) - 0.3 - fl(ref)|)."""
    ref_lowp = ref.to(got.dtype)
    atol = 2 * max_abs(ref_lowp + 0.3 - 0.3, ref_lowp)
    err, tol = max_abs(got, ref), factor * max_abs(low, ref) + atol
    assert err <= tol, f"{what}max error {err:.4g} > tolerance {tol:.4g}"


def flash_grads(q, k, v, dout, dlse=None, deterministic=False, backend="auto", **mask):
    """(dq, dk, dv) of flash_attn_func through autograd (fresh leaves, so q/k/v may be views)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_func(*leaves, deterministic=deterministic, return_attn_probs=True,
                               backend=backend, **mask)
    outputs, grads = ([out, lse], [dout, dlse]) if dlse is not None else ([out], [dout])
    return torch.autograd.grad(outputs, leaves, grads)


def reference_grads(q, k, v, dout, dlse=None, upcast_to=torch.float64, **mask):
    """Autograd of attention_ref: in ``upcast_to`` (float64: g_ref), or None for the input
    dtype with every step in it (upcast=False: g_lowp)."""
    dtype = upcast_to or q.dtype
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, upcast=upcast_to is not None, **mask)
    outputs, grads = [out], [dout.to(out.dtype)]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse.to(lse.dtype))
    got = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(got, leaves)]


def assert_grads_match(got, q, k, v, dout, dlse=None, **mask):
    """FA3's rule for each gradient, and exact zeros where nothing is seen."""
    ref = reference_grads(q, k, v, dout, dlse, **mask)
    lowp = reference_grads(q, k, v, dout, dlse, upcast_to=None, **mask)
    factor = 3 if mask.get("softcap", 0.0) else 2
    for name, g, r, lp, like in zip(("dq", "dk", "dv"), got, ref, lowp, (q, k, v)):
        assert g.shape == like.shape and g.dtype == like.dtype, name
        assert not g.isnan().any(), f"{name} has NaN: an element was not written (or 0/0)"
        r_lowp = r.to(g.dtype)
        rounding = 2 * max_abs(r_lowp + 0.3 - 0.3, r_lowp)
        tol = factor * max_abs(lp, r) + max(rounding, 1e-4)
        err = max_abs(g, r)
        assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"
    sq, sk = q.shape[1], k.shape[1]
    visible = AttentionMask.from_args(sq, sk, mask.get("causal", False),
                                      mask.get("window_size", (-1, -1))).dense(device=q.device)
    empty_rows, empty_keys = ~visible.any(dim=1), ~visible.any(dim=0)
    assert (got[0][:, empty_rows] == 0).all(), "dq of rows that see no key must be exactly 0"
    assert (got[1][:, empty_keys] == 0).all(), "dk of keys no query sees must be exactly 0"
    assert (got[2][:, empty_keys] == 0).all(), "dv of keys no query sees must be exactly 0"


def check(lib, shape, dtype=torch.bfloat16, layout="contiguous", with_dlse=False, path="fa2",
          **mask):
    b, sq, sk, hq, hkv, d = shape
    require_bwd(lib, dtype, d, path)
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, dtype, layout)
    dout = torch.randn(b, sq, hq, d, dtype=dtype, device="cuda")
    dlse = torch.randn(b, hq, sq, device="cuda") if with_dlse else None
    got = flash_grads(q, k, v, dout, dlse, backend=path, **mask)
    assert_grads_match(got, q, k, v, dout, dlse, **mask)


# --- one axis at a time around the central case --------------------------------------------------

# Odd lengths (tails in every tile), decode-like 1, sq != sk both ways (bottom-right causal: the
# first sq - sk rows see nothing), a long one (many key blocks adding into each dq row).
SEQLENS = [(1, 1), (1, 113), (17, 17), (113, 113), (113, 203), (203, 113), (17, 1023),
           (1023, 17), (1023, 1023)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("sq", "sk"), SEQLENS)
def test_seqlens(lib, seed, sq, sk, causal, dtype, path):
    check(lib, (2, sq, sk, 4, 2, 128), dtype, causal=causal, path=path)


# Every bucket, and a head dim below each (d % 8 == 0, zero-padded to the bucket).
HEAD_DIMS = [64, 96, 128, 192, 256, 40, 72, 120, 184, 248]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_head_dims(lib, seed, head_dim, causal, dtype, path):
    check(lib, (2, 113, 203, 4, 2, head_dim), dtype, causal=causal, path=path)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads_q", "heads_kv"), [(1, 1), (4, 2), (8, 1), (6, 3)])
def test_gqa(lib, seed, heads_q, heads_kv, causal, path):
    # dk / dv are summed over the query heads of each kv head.
    check(lib, (2, 113, 203, heads_q, heads_kv, 128), causal=causal, path=path)


MASKS = [
    # (window_size, causal, softcap)
    ((-1, -1), False, 30.0),
    ((-1, -1), True, 30.0),
    ((64, 0), False, 0.0),  # sliding window
    ((17, 33), False, 0.0),
    ((-1, 5), False, 0.0),  # right-only
    ((0, 0), False, 0.0),  # the diagonal only
    ((40, 8), False, 30.0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window_size", "causal", "softcap"), MASKS)
def test_windows_and_softcap(lib, seed, window_size, causal, softcap, dtype, path):
    check(lib, CENTRAL, dtype, window_size=window_size, causal=causal, softcap=softcap,
          path=path)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", BUCKETS)
def test_softcap_head_dims(lib, seed, head_dim, causal, path):
    check(lib, (2, 113, 203, 4, 2, head_dim), causal=causal, softcap=30.0, path=path)


# Windows that leave rows seeing no key (sq > sk: offset < 0) and keys no query sees (sk > sq),
# and causal with sq > sk: those gradients are exactly 0 (checked in assert_grads_match).
EMPTY = [
    ((300, 200), (1, 0), False),  # rows 0-99 see nothing
    ((200, 300), (2, 0), False),  # keys 0-97 are seen by no query
    ((203, 113), (-1, -1), True),  # the first 90 rows see nothing
    ((113, 203), (3, 3), False),  # a band: keys outside it see nothing
]


@pytest.mark.parametrize(("lengths", "window_size", "causal"), EMPTY)
def test_rows_and_keys_that_see_nothing(lib, seed, lengths, window_size, causal, path):
    sq, sk = lengths
    visible = AttentionMask.from_args(sq, sk, causal, window_size).dense()
    assert (~visible.any(dim=1)).any() or (~visible.any(dim=0)).any()  # the case has some
    check(lib, (2, sq, sk, 4, 2, 128), window_size=window_size, causal=causal, path=path)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["packed_qkv", "heads_first"])
def test_non_contiguous_inputs(lib, seed, layout, dtype, path):
    check(lib, (2, 151, 151, 4, 2, 128), dtype, layout=layout, causal=True, path=path)


@pytest.mark.parametrize("kind", ["transposed", "broadcast", "last_dim_strided", "misaligned"])
def test_dout_layouts(lib, seed, kind, path):
    # dout as losses produce it: the kernels get a loadable copy where they need one.
    b, sq, sk, hq, hkv, d = CENTRAL
    require_bwd(lib, torch.bfloat16, d, path)
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, torch.bfloat16)
    if kind == "transposed":
        dout = torch.randn(b, hq, sq, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    elif kind == "broadcast":  # what out.sum().backward() hands the backward
        dout = torch.ones(1, 1, 1, 1, dtype=torch.bfloat16, device="cuda").expand(b, sq, hq, d)
    elif kind == "last_dim_strided":
        dout = torch.randn(b, sq, hq, 2 * d, dtype=torch.bfloat16, device="cuda")[..., ::2]
    else:  # 2 bytes past a 16-byte boundary
        n = b * sq * hq * d
        dout = torch.randn(n + 8, dtype=torch.bfloat16, device="cuda")[1 : 1 + n].view(
            b, sq, hq, d)
    got = flash_grads(q, k, v, dout, causal=True, backend=path)
    assert_grads_match(got, q, k, v, dout, causal=True)
    # The same values in a contiguous dout give the same gradients, bit for bit.
    again = flash_grads(q, k, v, dout.contiguous(), causal=True, deterministic=True, backend=path)
    ours = flash_grads(q, k, v, dout, causal=True, deterministic=True, backend=path)
    assert all(torch.equal(a, o) for a, o in zip(again, ours))


@pytest.mark.parametrize("only_lse", [False, True])
def test_lse_gradient(lib, seed, only_lse, path):
    # return_attn_probs=True and a loss that uses the lse: its gradient (dlse) flows.
    b, sq, sk, hq, hkv, d = CENTRAL
    require_bwd(lib, torch.bfloat16, d, path)
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, torch.bfloat16)
    dlse = torch.randn(b, hq, sq, device="cuda")
    dout = torch.zeros(b, sq, hq, d, dtype=torch.bfloat16, device="cuda")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attn_func(*leaves, causal=True, return_attn_probs=True, backend=path)
    if only_lse:
        got = torch.autograd.grad(lse, leaves, dlse)
    else:
        dout = torch.randn_like(dout)
        got = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    assert_grads_match(got, q, k, v, dout, dlse, causal=True)


def test_central_case_with_dlse_and_window(lib, seed, path):
    check(lib, CENTRAL, with_dlse=True, window_size=(50, 10), softcap=30.0, path=path)


# --- empty problems ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_seqlen_k_zero_gives_zero_dq(lib, dtype, path):
    require_bwd(lib, dtype, 64, path)
    q, k, v = make_qkv(2, 17, 0, 4, 2, 64, dtype)
    dq, dk, dv = flash_grads(q, k, v, torch.randn_like(q), backend=path)
    assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_seqlen_q_zero_gives_zero_dk_dv(lib, dtype, path):
    require_bwd(lib, dtype, 64, path)
    q, k, v = make_qkv(2, 0, 33, 4, 2, 64, dtype)
    dq, dk, dv = flash_grads(q, k, v, torch.randn_like(q), backend=path)
    assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()


def test_batch_zero(lib, path):
    require_bwd(lib, torch.bfloat16, 64, path)
    q, k, v = make_qkv(0, 17, 33, 4, 2, 64, torch.bfloat16)
    dq, dk, dv = flash_grads(q, k, v, torch.randn_like(q), backend=path)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    out, lse = torch.empty_like(q), torch.empty(0, 4, 17, device="cuda")
    assert ops.bwd_into(q, q, k, v, out, lse, dq, dk, dv, 0.125, -1, -1, 0.0,
                        backend=path) == "none"


# --- caller buffers, the persistent grid ---------------------------------------------------------


def bwd_into_poisoned(q, k, v, dout, dlse=None, deterministic=False, num_sms=0, backend="auto",
                      **mask):
    """The forward by flash_attn_func, the backward by ops.bwd_into into NaN-filled dq/dk/dv;
    returns (backend that ran, (dq, dk, dv))."""
    out, lse = flash_attn_func(q, k, v, return_attn_probs=True, backend=backend, **mask)
    cfg = _validate.check_fwd_args(q, k, v, None, mask.get("causal", False),
                                   mask.get("window_size", (-1, -1)), mask.get("softcap", 0.0))
    grads = [torch.full_like(t, float("nan"), memory_format=torch.contiguous_format)
             for t in (q, k, v)]
    ran = ops.bwd_into(dout, q, k, v, out, lse, *grads, cfg.softmax_scale, cfg.window_left,
                       cfg.window_right, cfg.softcap, backend=backend,
                       deterministic=deterministic, dlse=dlse, num_sms=num_sms)
    return ran, grads


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("num_sms", [0, 1, 3])
@pytest.mark.parametrize(("causal", "window_size"), [(False, (-1, -1)), (True, (-1, -1)),
                                                      (False, (100, 20))])
def test_bwd_into_nan_poisoned(lib, seed, num_sms, deterministic, causal, window_size, path):
    # num_sms caps the FA-3 path's persistent grid: 1 and 3 CTAs walk many tiles each (the FA-2
    # path's grid is not persistent; it ignores num_sms).
    b, sq, sk, hq, hkv, d = 2, 611, 397, 4, 2, 128
    require_bwd(lib, torch.bfloat16, d, path)
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, torch.bfloat16)
    dout = torch.randn_like(q)
    dlse = torch.randn(b, hq, sq, device="cuda")
    ran, got = bwd_into_poisoned(q, k, v, dout, dlse, deterministic, num_sms, path, causal=causal,
                                 window_size=window_size)
    assert ran == path
    assert_grads_match(got, q, k, v, dout, dlse, causal=causal, window_size=window_size)


@pytest.mark.parametrize("num_sms", [0, 3])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", BUCKETS)
def test_deterministic_gradients_every_bucket(lib, seed, head_dim, causal, num_sms, path):
    # Each bucket's deterministic kernel (its own tile: the dQ split may differ from the
    # default's) against the reference, with several key blocks per query block and GQA.
    b, sq, sk, hq, hkv = 2, 389, 517, 4, 2
    require_bwd(lib, torch.bfloat16, head_dim, path)
    q, k, v = make_qkv(b, sq, sk, hq, hkv, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    ran, got = bwd_into_poisoned(q, k, v, dout, None, True, num_sms, path, causal=causal)
    assert ran == path
    assert_grads_match(got, q, k, v, dout, causal=causal)


@pytest.mark.parametrize("num_sms", [0, 1, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_tiles_without_queries(lib, seed, num_sms, head_dim, path):
    # A window far left of the last keys (seqlen_k > seqlen_q) hides whole key blocks from every
    # query: the FA-3 path's producer publishes those tiles without loading K / V, and their
    # consumers store dK = dV = 0, in a walk the CTAs claim at run time (1 and 3 CTAs: each
    # claims many tiles, empty ones among them).
    b, sq, sk, hq, hkv = 2, 64, 700, 4, 2
    require_bwd(lib, torch.bfloat16, head_dim, path)
    visible = AttentionMask.from_args(sq, sk, False, (10, 0)).dense()
    assert not visible[:, :512].any()  # key blocks 0-3 (d128: tiles of 128 keys) see no query
    q, k, v = make_qkv(b, sq, sk, hq, hkv, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    ran, got = bwd_into_poisoned(q, k, v, dout, None, False, num_sms, path, window_size=(10, 0))
    assert ran == path
    assert_grads_match(got, q, k, v, dout, None, window_size=(10, 0))


# The FA-2 backward's tiles take 129-176 KB of shared memory (sm80 / sm90 class GPUs); d256's
# two-Q-buffer tile (176 KB) has a one-buffer fallback (144 KB) for the A100's 164 KB, and below
# what a bucket needs the call fails with a clear "shared memory" error before any launch.
# FLASH_HOPPER_DEBUG_SMEM_LIMIT lowers the limit the library sees (read per call), so all three
# run here.
def test_shared_memory_fallback_and_limit(lib, seed, monkeypatch):
    b, sq, sk, hq, hkv, _ = CENTRAL
    require_bwd(lib, torch.bfloat16, 256)
    q, k, v = make_qkv(b, sq, sk, hq, hkv, 256, torch.bfloat16)
    dout = torch.randn_like(q)
    out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    cfg = _validate.check_fwd_args(q, k, v, None, True, (-1, -1), 0.0)

    def backward():
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        ops.bwd_into(dout, q, k, v, out, lse, *grads, cfg.softmax_scale, cfg.window_left,
                     cfg.window_right, cfg.softcap, backend="fa2")
        return grads

    # A100: the fallback tile
    monkeypatch.setenv("FLASH_HOPPER_DEBUG_SMEM_LIMIT", str(164 * 1024))
    assert_grads_match(backward(), q, k, v, dout, causal=True)
    # sm86 / sm89: no tile fits
    monkeypatch.setenv("FLASH_HOPPER_DEBUG_SMEM_LIMIT", str(99 * 1024))
    with pytest.raises(NotImplementedError, match="shared memory"):
        backward()


def test_flash_attn_func_equals_bwd_into(lib, seed, path):
    b, sq, sk, hq, hkv, d = CENTRAL
    require_bwd(lib, torch.bfloat16, d, path)
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, torch.bfloat16)
    dout = torch.randn_like(q)
    via_autograd = flash_grads(q, k, v, dout, causal=True, deterministic=True, backend=path)
    _, via_into = bwd_into_poisoned(q, k, v, dout, deterministic=True, backend=path, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(via_autograd, via_into))


# --- deterministic mode --------------------------------------------------------------------------

DETERMINISM = [(d, hq, hkv, causal) for d in BUCKETS for causal in (False, True)
               for hq, hkv in ((4, 2),)] + [(128, 8, 2, False), (128, 8, 2, True)]  # GQA 4:1


@pytest.mark.parametrize(("head_dim", "heads_q", "heads_kv", "causal"), DETERMINISM)
def test_deterministic_is_bitwise_reproducible(lib, seed, head_dim, heads_q, heads_kv, causal,
                                               path):
    # Lengths with many key blocks per dq row, where atomic adds would reorder.
    b, sq, sk = 2, 509, 1021
    require_bwd(lib, torch.bfloat16, head_dim, path)
    q, k, v = make_qkv(b, sq, sk, heads_q, heads_kv, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, backend=path)
    scale = head_dim**-0.5
    right = 0 if causal else -1
    first = None
    for _ in range(100):
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        ops.bwd_into(dout, q, k, v, out, lse, *grads, scale, -1, right, 0.0, backend=path,
                     deterministic=True)
        if first is None:
            first = grads
            assert not any(g.isnan().any() for g in grads)
        else:
            for name, a, g in zip(("dq", "dk", "dv"), first, grads):
                assert torch.equal(a, g), f"{name} differs between deterministic runs"


def test_default_mode_dk_dv_are_reproducible(lib, seed, path):
    # dk and dv have one writer per element in every mode; only dq may vary by default.
    b, sq, sk, hq, hkv, d = 2, 509, 1021, 8, 2, 128
    require_bwd(lib, torch.bfloat16, d, path)
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, torch.bfloat16)
    dout = torch.randn_like(q)
    runs = [flash_grads(q, k, v, dout, causal=True, backend=path) for _ in range(10)]
    for dq, dk, dv in runs[1:]:
        assert torch.equal(dk, runs[0][1]) and torch.equal(dv, runs[0][2])
        assert not dq.isnan().any()


# --- torch integration ---------------------------------------------------------------------------


def test_opcheck_fwd_with_grad(lib, seed):
    require_bwd(lib, torch.bfloat16, 64)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 65, 97, 4, 2, 64, torch.bfloat16))
    torch.library.opcheck(torch.ops.flash_hopper.fwd.default,
                          (q, k, v, 0.125, -1, 0, 0.0, "auto", True))


@pytest.mark.parametrize("with_dlse", [False, True])
def test_opcheck_bwd(lib, seed, with_dlse):
    require_bwd(lib, torch.bfloat16, 64)
    q, k, v = make_qkv(2, 65, 97, 4, 2, 64, torch.bfloat16)
    out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dlse = torch.randn_like(lse) if with_dlse else None
    torch.library.opcheck(
        torch.ops.flash_hopper.bwd.default,
        (torch.randn_like(out), q, k, v, out, lse, dlse, 0.125, -1, 0, 0.0, "auto", True),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def _loss(q, k, v, w):
    out = flash_attn_func(q, k, v, causal=True, deterministic=True)
    return ((out.float().flatten(2) @ w) ** 2).mean()


def test_torch_compile_training_step_equals_eager(lib, seed):
    require_bwd(lib, torch.bfloat16, 128)
    torch._dynamo.reset()
    base = [t.float() for t in make_qkv(2, 113, 113, 4, 2, 128, torch.bfloat16)]
    w0 = torch.randn(4 * 128, 64, device="cuda") / 16

    def train(loss_fn):
        q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in base)
        w = w0.clone().requires_grad_()
        losses = []
        for _ in range(2):  # two SGD steps
            loss = loss_fn(q, k, v, w)
            loss.backward()
            losses.append(loss.detach())
            with torch.no_grad():
                for t in (q, k, v, w):
                    t -= 0.5 * t.grad.to(t.dtype)
                    t.grad = None
        return losses + [q.detach(), k.detach(), v.detach(), w.detach()]

    eager = train(_loss)
    compiled = train(torch.compile(_loss, fullgraph=True))
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(eager[2], base[0].to(torch.bfloat16))  # the steps moved q


# --- the two paths --------------------------------------------------------------------------------

DIFFERENTIAL = [  # (shape, mask): odd lengths, GQA, every fa3 bucket, masks, softcap
    ((2, 113, 203, 4, 2, 128), {"causal": True}),
    ((1, 611, 397, 6, 3, 64), {}),
    ((2, 257, 700, 4, 1, 96), {"window_size": (100, 20)}),
    ((1, 1023, 1023, 2, 2, 120), {"causal": True, "softcap": 30.0}),
]


@pytest.mark.parametrize(("shape", "mask"), DIFFERENTIAL)
def test_fa3_matches_fa2(lib, seed, shape, mask):
    # Each path's forward and backward: both pass the rule, and their gradients agree within the
    # same-precision reference's error.
    b, sq, sk, hq, hkv, d = shape
    require_bwd(lib, torch.bfloat16, d, "fa3")
    require_bwd(lib, torch.bfloat16, d, "fa2")
    q, k, v = make_qkv(b, sq, sk, hq, hkv, d, torch.bfloat16)
    dout = torch.randn_like(q)
    ran3, g3 = bwd_into_poisoned(q, k, v, dout, backend="fa3", **mask)
    ran2, g2 = bwd_into_poisoned(q, k, v, dout, backend="fa2", **mask)
    assert (ran3, ran2) == ("fa3", "fa2")
    assert_grads_match(g3, q, k, v, dout, **mask)
    assert_grads_match(g2, q, k, v, dout, **mask)
    ref = reference_grads(q, k, v, dout, **mask)
    lowp = reference_grads(q, k, v, dout, upcast_to=None, **mask)
    for name, a, b2, r, lp in zip(("dq", "dk", "dv"), g3, g2, ref, lowp):
        assert max_abs(a, b2) <= 2 * max_abs(lp, r) + 1e-4, f"{name}: fa3 and fa2 disagree"


def test_fa3_backward_buckets(lib, seed):
    # Buckets with an FA-3 backward tile (all five since family B) train on fa3 under "auto"; a
    # bucket without one would refuse an explicit fa3 backward by name and train on fa2.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fa3 path needs compute capability 9.0")
    for d in BUCKETS:
        if not (lib.has_fwd_kernel(FhBackend.FA3, FhDtype.BF16, d)
                and lib.has_bwd_kernel(FhBackend.FA2, FhDtype.BF16, d)):
            continue
        q, k, v = make_qkv(1, 65, 97, 2, 2, d, torch.bfloat16)
        ran, _ = bwd_into_poisoned(q, k, v, torch.randn_like(q))
        if lib.has_bwd_kernel(FhBackend.FA3, FhDtype.BF16, d):
            assert ran == "fa3", d
            continue
        assert ran == "fa2", d
        leaves = [t.requires_grad_() for t in (q, k, v)]
        out = flash_attn_func(*leaves, backend="fa3")
        with pytest.raises(UnsupportedError, match=r"fa3[\s\S]*backward[\s\S]*buckets"):
            out.float().sum().backward()


def test_sm_margin_leaves_sms_free_forward_and_backward(lib, tmp_path):
    """flash_attn_func(sm_margin=m) (FA3's): the FA-3 forward and backward kernels launch at
    most SMs - m CTAs where a call without it fills the GPU, with the same results (forward
    bitwise: a tile is one CTA's whichever; gradients up to the order of dQ's sums), through
    autograd and without; the varlen forward and its per-sequence backward too; m >= the SM
    count raises naming sm_margin."""
    from flash_hopper import flash_attn_varlen_func

    from tests._helpers import kernel_ctas, skip_without_kernel

    skip_without_kernel(lib, 128, backward=True, fa3_only=True)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the grid cap is the FA-3 path's (cc 9.0)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, dout = (torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16,
                                 generator=g) for _ in range(4))
    cu = torch.tensor([0, 1500, 4096], dtype=torch.int32, device="cuda")
    results, ctas = {}, {}
    for margin in (0, 24):
        def run(margin=margin):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = flash_attn_func(*leaves, causal=True, sm_margin=margin)
            out.backward(dout)
            with torch.no_grad():
                plain = flash_attn_func(q, k, v, sm_margin=margin)
            flat = [t.reshape(4096, 8, 128).clone().requires_grad_() for t in (q, k, v)]
            packed = flash_attn_varlen_func(*flat, cu, cu, 2596, 2596, causal=True,
                                            sm_margin=margin)
            packed.backward(dout.reshape(4096, 8, 128))
            results[margin] = [out, plain, packed] + [t.grad for t in leaves + flat]

        ctas[margin] = kernel_ctas(run, tmp_path)
    assert {"flash_hopper::sm90::fwd_kernel", "flash_hopper::sm90::bwd_kernel"} <= set(ctas[24])
    for name, n in ctas[24].items():
        assert n <= sms - 24 < ctas[0][name], (name, ctas)
    for i, (got, want) in enumerate(zip(results[24], results[0])):
        if i < 3:
            assert torch.equal(got, want), i
        else:
            err = (got.float() - want.float()).abs().max().item()
            assert err <= 1e-2 * want.abs().max().item(), i
    with pytest.raises(ValueError, match=f"sm_margin: expected fewer than the device's {sms}"):
        flash_attn_func(q, k, v, sm_margin=sms)


# --- attention sinks (gpt-oss): flash_attn_func(sinks=...) forward and backward -----------------

def sink_attention_ref(q, k, v, sinks, causal, dtype):
    """(out, lse) with each head's sink logit in the softmax (reference.py's KV-cache reference on
    the dense k / v), computed in ``dtype`` (float64: the reference; q's dtype: FA3's
    low-precision reference)."""
    out, lse, _, _ = attention_kvcache_ref(q.to(dtype), k.to(dtype), v.to(dtype),
                                           cache_seqlens=k.shape[1], causal=causal, sinks=sinks,
                                           upcast=False)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("sq", "sk", "hq", "hkv"), [(113, 203, 4, 2), (300, 170, 4, 4)])
def test_sinks_forward_and_gradients(lib, seed, causal, sq, sk, hq, hkv, path):
    # sq > sk with causal: the first rows see no key (out 0, lse = the sink, their grads 0)
    require_bwd(lib, torch.bfloat16, 128, path)
    q, k, v = (t.requires_grad_() for t in make_qkv(2, sq, sk, hq, hkv, 128, torch.bfloat16))
    sinks = (torch.randn(hq, device="cuda") * 2).requires_grad_()
    out, lse = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, sinks=sinks,
                               backend=path)
    ref, ref_lse = sink_attention_ref(q, k, v, sinks, causal, torch.float64)
    low, low_lse = sink_attention_ref(q, k, v, sinks, causal, torch.bfloat16)
    assert_fa3_rule(out, ref, low, what="out: ")
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse)
    grads = torch.autograd.grad((out.float() * dout).sum() + (lse * dlse).sum(), (q, k, v, sinks))
    refs = torch.autograd.grad((ref * dout.double()).sum() + (ref_lse * dlse.double()).sum(),
                               (q, k, v, sinks))
    lows = torch.autograd.grad((low.float() * dout).sum() + (low_lse.float() * dlse).sum(),
                               (q, k, v, sinks))
    for name, g, r, lo in zip(("dq", "dk", "dv", "dsinks"), grads, refs, lows):
        assert not g.isnan().any(), name
        assert_fa3_rule(g, r, lo, what=f"{name}: ")
