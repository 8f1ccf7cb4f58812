"""Forward kernels against the reference, on a GPU (every test here is marked ``gpu``).

Tolerance doctrine (FA3's, docs/testing.md "The tolerance doctrine"):
- out: ``max|out - ref| <= 2 * max|ref_lowp - ref| + 1e-5`` where ref is the naive attention in
  float64 of the same (low-precision) inputs and ref_lowp the same math done in the input dtype
  like a plain PyTorch implementation: the kernel may be at most twice as wrong as the obvious
  same-precision implementation.
- lse: the kernels never round scores to the input dtype (S = QK^T accumulates in fp32 and stays
  there), so the fair same-precision baseline is an fp32 implementation, not a bf16 one:
  ``max|lse - ref| <= 2 * max|lse_fp32 - ref| + 1e-4 (+ softcap * 2^-10)``. 1e-4 absorbs
  fast-math exp2/log2 (relative errors ~1e-7 on |lse| < 20) and summation order; the softcap
  term covers tanh.approx.f32 (relative error <= 2^-11 on a capped score <= softcap; the LSE moves
  by at most the largest score error). A mask off by one key moves the LSE by ~1/seqlen_k, well
  above this bound for the lengths used, so the LSE check is the sharp test of masking.
- rows that see no key: out exactly 0 and lse exactly -inf, compared separately (inf - inf is NaN).

Outputs are poisoned with NaN before every launch (fwd_into with caller buffers), so an element
the kernel forgets to write fails; inputs are fresh per test (seed fixture: stable per test id).

Grid rationale (~300 cases, a few minutes on an H200; the reference in float64 dominates):
one axis at a time around a central config (bf16/fp16, hdim 128, GQA 4:2, lengths 113 x 203)
instead of a full product, which would be ~10^5 cases. Each axis test sweeps its own values
(sequence lengths, head dims, GQA ratios, windows/softcap, layouts) against both dtypes and both
backends where the axis plausibly interacts with them. Long lengths (1023, 4097) appear in the
sequence-length sweep and the fa3-vs-fa2 differential only, with few heads.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from flash_hopper import UnsupportedError, _validate, flash_attn_func, ops, which_backend
from flash_hopper._lib import FhBackend, FhDtype
from flash_hopper.dispatch import head_dim_bucket
from flash_hopper.reference import attention_ref

from tests._helpers import skip_without_kernel

# fp32 references stay fp32, not TF32 (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]

NEG_INF = float("-inf")
DTYPES = [torch.bfloat16, torch.float16]
_ENUM_DTYPE = {torch.float16: FhDtype.FP16, torch.bfloat16: FhDtype.BF16}
_ENUM_BACKEND = {"fa2": FhBackend.FA2, "fa3": FhBackend.FA3}


# --- fixtures and helpers ------------------------------------------------------------------------


def _capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


def _backend_runs_here(lib, name: str) -> str | None:
    """None if ``name`` has kernels that can run on this GPU, else why not."""
    cc = _capability()
    if name == "fa3" and cc != (9, 0):
        return f"fa3 needs compute capability 9.0, this GPU is {cc[0]}.{cc[1]}"
    if name == "fa2" and cc < (8, 0):
        return f"fa2 needs compute capability >= 8.0, this GPU is {cc[0]}.{cc[1]}"
    if not any(lib.has_fwd_kernel(_ENUM_BACKEND[name], dt, hd)
               for dt in _ENUM_DTYPE.values() for hd in (64, 96, 128, 192, 256)):
        arch = {"fa2": "80", "fa3": "90a"}[name]
        return f"this build has no {name} kernels (FH_ARCHS without {arch})"
    return None


@pytest.fixture(params=["fa2", "fa3"])
def backend(request, lib) -> str:
    """Each backend that can run on this GPU with this build; the others skip with the reason."""
    why_not = _backend_runs_here(lib, request.param)
    if why_not:
        pytest.skip(why_not)
    return request.param


def require_kernel(lib, backend: str, dtype: torch.dtype, head_dim: int) -> None:
    if not lib.has_fwd_kernel(_ENUM_BACKEND[backend], _ENUM_DTYPE[dtype], head_dim):
        pytest.skip(f"this build has no {backend} kernel for {dtype} hdim bucket "
                    f"{head_dim_bucket(head_dim)} (FH_HEAD_DIMS / FH_DTYPES)")


def make_qkv(b, sq, sk, hq, hkv, d, dtype, layout="contiguous"):
    """Random q, k, v of FA layout; ``layout`` picks the memory layout behind the views."""
    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device="cuda")

    if layout == "contiguous":
        return rand(b, sq, hq, d), rand(b, sk, hkv, d), rand(b, sk, hkv, d)
    if layout == "packed_qkv":  # one (b, s, hq + 2 hkv, d) projection output, split by heads
        assert sq == sk
        qkv = rand(b, sq, hq + 2 * hkv, d)
        return qkv[:, :, :hq], qkv[:, :, hq : hq + hkv], qkv[:, :, hq + hkv :]
    if layout == "heads_first":  # (b, h, s, d) storage viewed as (b, s, h, d)
        return (rand(b, hq, sq, d).transpose(1, 2), rand(b, hkv, sk, d).transpose(1, 2),
                rand(b, hkv, sk, d).transpose(1, 2))
    if layout == "padded_head_dim":  # rows padded to d + 8 elements, e.g. a larger cache
        return (rand(b, sq, hq, d + 8)[..., :d], rand(b, sk, hkv, d + 8)[..., :d],
                rand(b, sk, hkv, d + 8)[..., :d])
    raise ValueError(layout)


def run(q, k, v, backend, causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None):
    """fwd_into with NaN-poisoned outputs; asserts the requested backend is the one that ran."""
    cfg = _validate.check_fwd_args(q, k, v, softmax_scale, causal, window_size, softcap, backend)
    b, sq, hq, _ = q.shape
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device=q.device)
    used = ops.fwd_into(q, k, v, out, lse, cfg.softmax_scale, cfg.window_left,
                        cfg.window_right, cfg.softcap, backend)
    assert used == backend
    return out, lse


def max_abs(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_matches_reference(out, lse, q, k, v, causal=False, window_size=(-1, -1), softcap=0.0,
                             softmax_scale=None):
    mask = {"causal": causal, "window_size": window_size, "softcap": softcap,
                "softmax_scale": softmax_scale}
    ref_out, ref_lse = attention_ref(q.double(), k.double(), v.double(), **mask)
    lowp_out, _ = attention_ref(q, k, v, upcast=False, **mask)
    _, fp32_lse = attention_ref(q.float(), k.float(), v.float(), **mask)

    assert not out.isnan().any(), "out has NaN: an element was not written (or 0/0)"
    assert not lse.isnan().any(), "lse has NaN: an element was not written"
    empty = ref_lse == NEG_INF  # (b, hq, sq): rows that see no key
    assert torch.equal(lse == NEG_INF, empty), "rows with lse = -inf differ from the reference"
    assert (out[empty.permute(0, 2, 1)] == 0).all(), "rows without keys must give out = 0"

    out_err, out_tol = max_abs(out, ref_out), 2 * max_abs(lowp_out, ref_out) + 1e-5
    assert out_err <= out_tol, f"out: max error {out_err:.3g} > tolerance {out_tol:.3g}"
    seen = ~empty
    lse_err = max_abs(lse[seen], ref_lse[seen])
    lse_tol = 2 * max_abs(fp32_lse[seen], ref_lse[seen]) + 1e-4 + softcap * 2**-10
    assert lse_err <= lse_tol, f"lse: max error {lse_err:.3g} > tolerance {lse_tol:.3g}"


# --- sequence lengths ----------------------------------------------------------------------------

# Odd lengths (tails in every tile), exact tiles (128), sq != sk both ways (bottom-right causal),
# decode-like sq = 1, and long ones (many key blocks; 4097 = a tile + 1 past a power of two).
SEQLENS = [(1, 1), (1, 113), (17, 17), (17, 1023), (113, 113), (113, 203), (203, 113),
           (128, 128), (1023, 1023), (4097, 4097), (1023, 4097)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("sq", "sk"), SEQLENS)
def test_seqlens(lib, backend, seed, sq, sk, causal, dtype):
    require_kernel(lib, backend, dtype, 128)
    long = sq * sk > 2**20
    b, hq, hkv = (1, 2, 1) if long else (2, 4, 2)
    q, k, v = make_qkv(b, sq, sk, hq, hkv, 128, dtype)
    out, lse = run(q, k, v, backend, causal=causal)
    assert_matches_reference(out, lse, q, k, v, causal=causal)


# --- head dims -----------------------------------------------------------------------------------

# Every bucket exactly (64, 96, 128, 192, 256) and dims that pad up to one (8, 40, 72, 136, 200).
HEAD_DIMS = [8, 40, 64, 72, 96, 128, 136, 192, 200, 256]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_head_dims(lib, backend, seed, head_dim, causal, dtype):
    require_kernel(lib, backend, dtype, head_dim)
    q, k, v = make_qkv(2, 113, 203, 4, 2, head_dim, dtype)
    out, lse = run(q, k, v, backend, causal=causal)
    assert_matches_reference(out, lse, q, k, v, causal=causal)


# Every FA-2 tile config fits 99 KB of opt-in shared memory (sm86/sm89); a device with less gets a
# clear "unsupported" error, not a failed launch. FLASH_HOPPER_DEBUG_SMEM_LIMIT lowers the limit
# the library sees, so both sides of that line run here.
def test_shared_memory_limit_is_checked_before_launch(lib, seed, monkeypatch):
    if _backend_runs_here(lib, "fa2"):
        pytest.skip(_backend_runs_here(lib, "fa2"))
    require_kernel(lib, "fa2", torch.bfloat16, 256)
    q, k, v = make_qkv(2, 113, 203, 4, 2, 256, torch.bfloat16)
    monkeypatch.setenv("FLASH_HOPPER_DEBUG_SMEM_LIMIT", str(99 * 1024))
    out, lse = run(q, k, v, "fa2")
    assert_matches_reference(out, lse, q, k, v)
    # below d-256's 96 KB tile
    monkeypatch.setenv("FLASH_HOPPER_DEBUG_SMEM_LIMIT", str(64 * 1024))
    with pytest.raises(NotImplementedError, match="shared memory"):
        run(q, k, v, "fa2")


# --- GQA / MQA -----------------------------------------------------------------------------------

# Ratios 1, 2 and 8 at small and large head counts, incl. MQA (one kv head).
HEADS = [(1, 1), (2, 1), (6, 3), (8, 1), (16, 2), (16, 8), (16, 16)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("heads_q", "heads_kv"), HEADS)
def test_gqa(lib, backend, seed, heads_q, heads_kv, causal):
    require_kernel(lib, backend, torch.bfloat16, 64)
    q, k, v = make_qkv(2, 97, 131, heads_q, heads_kv, 64, torch.bfloat16)
    out, lse = run(q, k, v, backend, causal=causal)
    assert_matches_reference(out, lse, q, k, v, causal=causal)


# K/V broadcast with expand() (stride 0 over heads or batch): valid torch, readable through
# pointers (fa2); the fa3 path's TMA needs positive strides, so "auto" runs fa2 there and an
# explicit "fa3" says which tensor and stride keep it out.
@pytest.mark.parametrize("bcast", ["heads", "batch"])
def test_expanded_kv(lib, seed, bcast, monkeypatch):
    require_kernel(lib, "fa2", torch.bfloat16, 64)
    q, k, v = make_qkv(2, 97, 131, 4, 1, 64, torch.bfloat16)
    if bcast == "heads":
        k, v = k.expand(2, 131, 4, 64), v.expand(2, 131, 4, 64)
    else:
        k, v = k[:1].expand(2, 131, 1, 64), v[:1].expand(2, 131, 1, 64)
    fa3_here = (_backend_runs_here(lib, "fa3") is None
                and lib.has_fwd_kernel(FhBackend.FA3, FhDtype.BF16, 64))
    # flash_attn_func's 97 query rows per KV head are the decode kernel's; the FA paths' answer
    # is fa2 (FLASH_HOPPER_DECODE=kvcache closes the decode route)
    assert which_backend(q, k, v)[0] == "decode"
    monkeypatch.setenv("FLASH_HOPPER_DECODE", "kvcache")
    assert which_backend(q, k, v)[0] == "fa2"
    out, lse = run(q, k, v, "fa2")
    assert_matches_reference(out, lse, q, k, v)
    out_auto, used = run_auto(q, k, v)
    assert used == "fa2" and torch.equal(out_auto, out)
    if fa3_here:
        with pytest.raises(UnsupportedError, match=r"backend='fa3': k: stride\(\d\) is 0"):
            run(q, k, v, "fa3")
        # The C ABI applies the same rule: backend FA3 names the stride field, AUTO runs fa2.
        field = "k_head_stride" if bcast == "heads" else "k_batch_stride"
        cfg = _validate.check_fwd_args(q, k, v, None, False, (-1, -1), 0.0, "fa3")
        out_c = torch.full_like(q, float("nan"))
        stream = torch.cuda.current_stream().cuda_stream
        with pytest.raises(UnsupportedError, match=f"{field}: the fa3 path loads q/k/v with TMA"):
            lib.fwd(ops.make_params(q, k, v, out_c, None, cfg, "fa3"), stream)
        assert out_c.isnan().all()
        lib.fwd(ops.make_params(q, k, v, out_c, None, cfg, "auto"), stream)
        assert torch.equal(out_c, out)


def run_auto(q, k, v):
    cfg = _validate.check_fwd_args(q, k, v, None, False, (-1, -1), 0.0, "auto")
    out = torch.full_like(q, float("nan"))
    used = ops.fwd_into(q, k, v, out, None, cfg.softmax_scale, -1, -1, 0.0, "auto")
    return out, used


# --- windows and softcap -------------------------------------------------------------------------

# (window_size, causal, softcap): left-only (sliding window), right-only, both, the diagonal only,
# causal with a left window, softcap alone and with masks. Softcap values are small because the
# scores of randn inputs are ~N(0, 1): a cap of 30 would change nothing measurable.
MASKS = [
    ((16, 0), False, 0.0),
    ((0, 16), False, 0.0),
    ((32, 8), False, 0.0),
    ((-1, 8), False, 0.0),
    ((8, -1), False, 0.0),
    ((0, 0), False, 0.0),
    ((64, -1), True, 0.0),
    ((-1, -1), False, 1.5),
    ((-1, -1), True, 1.5),
    ((24, 4), False, 5.0),
]


# Every combination in both dtypes, with odd lengths both ways and an exact-tile pair.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("sq", "sk"), [(211, 307), (307, 211), (256, 384)])
@pytest.mark.parametrize(("window_size", "causal", "softcap"), MASKS)
def test_windows_and_softcap(lib, backend, seed, window_size, causal, softcap, sq, sk, dtype):
    require_kernel(lib, backend, dtype, 128)
    q, k, v = make_qkv(2, sq, sk, 4, 2, 128, dtype)
    kwargs = {"causal": causal, "window_size": window_size, "softcap": softcap}
    out, lse = run(q, k, v, backend, **kwargs)
    assert_matches_reference(out, lse, q, k, v, **kwargs)


# Softcap's value in every head-dim bucket (each bucket is its own kernel with its own tile), with
# and without a mask, and an explicit scale (softcap divides the scaled score).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize(("causal", "softcap", "softmax_scale"),
                         [(False, 1.5, None), (True, 3.0, 0.3)])
def test_softcap_head_dims(lib, backend, seed, head_dim, causal, softcap, softmax_scale, dtype):
    require_kernel(lib, backend, dtype, head_dim)
    q, k, v = make_qkv(2, 203, 317, 4, 2, head_dim, dtype)
    kwargs = {"causal": causal, "softcap": softcap, "softmax_scale": softmax_scale}
    out, lse = run(q, k, v, backend, **kwargs)
    assert_matches_reference(out, lse, q, k, v, **kwargs)


def test_explicit_softmax_scale(lib, backend, seed):
    require_kernel(lib, backend, torch.bfloat16, 64)
    q, k, v = make_qkv(2, 113, 113, 4, 4, 64, torch.bfloat16)
    out, lse = run(q, k, v, backend, softmax_scale=0.37, causal=True)
    assert_matches_reference(out, lse, q, k, v, softmax_scale=0.37, causal=True)


# Row maxima that move, or stay put, block after block. With randn inputs the max settles in the
# first key block, so the rescale paths hardly run: here keys grow (or shrink) along the sequence
# by 12x and every third query row is 16x larger than the others (|lse| ~ 100). Falling keys make
# maxima jump past the FA-3 path's lazy-rescale threshold (2^8) in some rows of a warp and not in
# others; rising keys keep the max of the first block, where an unchanged max must rescale by
# exactly 1 (the FA-2 path's l drifted by an FFMA rounding per block: LSE 1-2e-4 off). Both d128
# fa3 tiles (seqlen_k 1500 / 2500 under causal).
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("ramp", ["rising", "falling"])
@pytest.mark.parametrize(("causal", "sk"), [(False, 1500), (True, 1500), (True, 2500)])
def test_row_max_jumps_across_key_blocks(lib, backend, seed, head_dim, ramp, causal, sk):
    require_kernel(lib, backend, torch.bfloat16, head_dim)
    q, k, v = make_qkv(1, 257, sk, 4, 4, head_dim, torch.bfloat16)
    gain = torch.linspace(0.5, 6.0, sk, device="cuda")
    gain = gain if ramp == "rising" else gain.flip(0)
    k = (k.float() * gain[None, :, None, None]).to(k.dtype)
    rows = torch.where(torch.arange(257, device="cuda") % 3 == 0, 4.0, 0.25)
    q = (q.float() * rows[None, :, None, None]).to(q.dtype)
    out, lse = run(q, k, v, backend, causal=causal)
    assert_matches_reference(out, lse, q, k, v, causal=causal)


# --- memory layouts ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["packed_qkv", "heads_first", "padded_head_dim"])
def test_non_contiguous_inputs(lib, backend, seed, layout, dtype):
    require_kernel(lib, backend, dtype, 64)
    q, k, v = make_qkv(2, 173, 173, 8, 2, 64, dtype, layout=layout)
    assert not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())
    out, lse = run(q, k, v, backend, causal=True)
    assert_matches_reference(out, lse, q, k, v, causal=True)
    # The same values laid out contiguously give bitwise the same result.
    out_c, lse_c = run(q.contiguous(), k.contiguous(), v.contiguous(), backend, causal=True)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


# --- rows that see no key ------------------------------------------------------------------------

EMPTY_ROWS = [
    # (sq, sk, causal, window_size): which rows see nothing
    (300, 77, True, (-1, -1)),  # sq > sk causal: the first 223 rows
    (200, 50, False, (0, 0)),  # diagonal-only window shifted left: the first 150 rows
    (128, 16, False, (4, 0)),  # a window ending before key 0 for the first 112 rows
]


@pytest.mark.parametrize(("sq", "sk", "causal", "window_size"), EMPTY_ROWS)
def test_rows_without_keys(lib, backend, seed, sq, sk, causal, window_size):
    require_kernel(lib, backend, torch.bfloat16, 64)
    q, k, v = make_qkv(2, sq, sk, 4, 2, 64, torch.bfloat16)
    out, lse = run(q, k, v, backend, causal=causal, window_size=window_size)
    first_seen = sq - sk  # row i's last visible key is i + sk - sq + right, right = 0 here
    assert (out[:, :first_seen] == 0).all() and (lse[:, :, :first_seen] == NEG_INF).all()
    assert (lse[:, :, first_seen:] > NEG_INF).all()
    assert_matches_reference(out, lse, q, k, v, causal=causal, window_size=window_size)


@pytest.mark.parametrize("dtype", DTYPES)
def test_seqlen_k_zero(lib, backend, dtype):
    require_kernel(lib, backend, dtype, 64)
    q, k, v = make_qkv(2, 17, 0, 4, 2, 64, dtype)
    out, lse = run(q, k, v, backend)
    assert (out == 0).all() and (lse == NEG_INF).all()


@pytest.mark.parametrize("shape", [(0, 17, 4, 64), (2, 0, 4, 64)])
def test_empty_batch_or_queries_launch_nothing(shape):
    q = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(shape[0], 9, 2, 64, dtype=torch.bfloat16, device="cuda")
    out, lse = flash_attn_func(q, k, k, return_attn_probs=True)
    assert out.shape == shape and lse.shape == (shape[0], 4, shape[1])
    assert ops.fwd_into(q, k, k, out, lse, 0.125, -1, -1, 0.0, "auto") == "none"


# --- public API, torch.compile, dispatch ---------------------------------------------------------


def test_flash_attn_func_equals_fwd_into(lib, backend, seed):
    require_kernel(lib, backend, torch.float16, 128)
    q, k, v = make_qkv(2, 113, 203, 8, 2, 128, torch.float16)
    out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, backend=backend)
    assert out.is_contiguous() and out.dtype == torch.float16 and out.shape == q.shape
    assert lse.is_contiguous() and lse.dtype == torch.float32 and lse.shape == (2, 8, 113)
    out_into, lse_into = run(q, k, v, backend, causal=True)
    assert torch.equal(out, out_into) and torch.equal(lse, lse_into)
    assert torch.equal(flash_attn_func(q, k, v, causal=True, backend=backend), out)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(lib, backend, seed, dynamic):
    require_kernel(lib, backend, torch.bfloat16, 128)

    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(64, -1), softcap=4.0,
                               return_attn_probs=True, backend=backend)

    torch._dynamo.reset()
    compiled = torch.compile(attention, fullgraph=True, dynamic=dynamic)
    for sq in (113, 241):
        q, k, v = make_qkv(2, sq, 203, 4, 2, 128, torch.bfloat16)
        out, lse = compiled(q, k, v)
        out_eager, lse_eager = attention(q, k, v)
        assert torch.equal(out, out_eager) and torch.equal(lse, lse_eager)


def test_opcheck(lib, backend, seed):
    require_kernel(lib, backend, torch.bfloat16, 64)
    q, k, v = make_qkv(2, 65, 97, 4, 2, 64, torch.bfloat16)
    torch.library.opcheck(
        torch.ops.flash_hopper.fwd.default, (q, k, v, 0.125, -1, 0, 0.0, backend, False),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_agrees_with_the_library(lib, dtype):
    """Python's policy, the backend fwd_into runs and the C side's own choice for AUTO agree."""
    if _capability() < (8, 0):
        pytest.skip("needs compute capability >= 8.0")
    require_kernel(lib, "fa2", dtype, 128)
    q, k, v = make_qkv(1, 160, 160, 2, 2, 128, dtype)  # 160 rows: past the decode kernel's
    name, reason = which_backend(q, k, v)
    assert name in ("fa2", "fa3") and reason
    out = torch.empty_like(q)
    assert ops.fwd_into(q, k, v, out, None, 0.125, -1, -1, 0.0, "auto") == name
    cfg = _validate.check_fwd_args(q, k, v)
    params = ops.make_params(q, k, v, out, None, cfg, "auto")
    with torch.cuda.device(q.device):
        assert lib.select_backend(params) == _ENUM_BACKEND[name]


def test_misaligned_input_is_rejected_before_launch(lib):
    skip_without_kernel(lib, 64)
    base = torch.randn(17 * 4 * 64 + 8, dtype=torch.bfloat16, device="cuda")
    q = base[1 : 1 + 17 * 4 * 64].view(1, 17, 4, 64)  # 2 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="q: data pointer must be 16-byte aligned"):
        flash_attn_func(q, q, q)


# --- fa3 against fa2, determinism ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("sq", "sk"), [(1, 1), (17, 17), (113, 203), (1023, 113), (4097, 4097)])
def test_fa3_matches_fa2(lib, seed, sq, sk, causal, dtype):
    for name in ("fa3", "fa2"):
        why_not = _backend_runs_here(lib, name)
        if why_not:
            pytest.skip(why_not)
        require_kernel(lib, name, dtype, 128)
    hq, hkv = (2, 1) if sq * sk > 2**20 else (8, 2)
    q, k, v = make_qkv(1, sq, sk, hq, hkv, 128, dtype)
    out3, lse3 = run(q, k, v, "fa3", causal=causal)
    out2, lse2 = run(q, k, v, "fa2", causal=causal)
    ref_out, _ = attention_ref(q.double(), k.double(), v.double(), causal=causal)
    lowp_out, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    # Two low-precision implementations of the same math: as far apart as the doctrine allows
    # each from the truth, and with identical rows-without-keys.
    assert max_abs(out3, out2) <= 2 * max_abs(lowp_out, ref_out) + 1e-5
    assert torch.equal(lse3 == NEG_INF, lse2 == NEG_INF)
    seen = lse2 > NEG_INF
    assert max_abs(lse3[seen], lse2[seen]) <= 2e-4


def test_deterministic(lib, backend, seed):
    require_kernel(lib, backend, torch.bfloat16, 128)
    q, k, v = make_qkv(2, 1023, 1023, 8, 2, 128, torch.bfloat16)
    out0, lse0 = run(q, k, v, backend, causal=True)
    # fa3: 100 runs, the bar (races between warpgroups would show up as flipped bits;
    # compute-sanitizer's racecheck does not see TMA / WGMMA traffic).
    for _ in range(99 if backend == "fa3" else 19):
        out, lse = run(q, k, v, backend, causal=True)
        assert torch.equal(out, out0) and torch.equal(lse, lse0)


# --- fa3 specifics: persistent grid, ablation variants -------------------------------------------


def _require_fa3(lib, dtype, head_dim):
    why_not = _backend_runs_here(lib, "fa3")
    if why_not:
        pytest.skip(why_not)
    require_kernel(lib, "fa3", dtype, head_dim)


def run_fa3(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0, num_sms=0, backend="fa3"):
    cfg = _validate.check_fwd_args(q, k, v, None, causal, window_size, softcap, backend)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((cfg.batch, cfg.heads_q, cfg.seqlen_q), float("nan"), device=q.device)
    ops.fwd_into(q, k, v, out, lse, cfg.softmax_scale, cfg.window_left, cfg.window_right,
                 cfg.softcap, backend, num_sms=num_sms)
    return out, lse


# A grid of 1 or 3 CTAs makes each CTA walk many tiles: barrier phases, Q reuse across tiles and
# tiles without keys in between (window) all cross tile boundaries; longest-first order (masked).
# Every bucket: each has its own tile and loop (d64 three consumer warpgroups and two Q buffers,
# d96 two Q buffers, d128 both tiles, d192 the merged tile boundary with the O rescale before
# the PV GEMM, d256 per-tile drains).
@pytest.mark.parametrize("num_sms", [1, 3])
@pytest.mark.parametrize(("causal", "window_size"),
                         [(False, (-1, -1)), (True, (-1, -1)), (False, (40, 9))])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize(("sq", "sk"), [(611, 397), (257, 2100)])
def test_fa3_persistent_grid(lib, seed, num_sms, causal, window_size, head_dim, sq, sk):
    _require_fa3(lib, torch.bfloat16, head_dim)
    q, k, v = make_qkv(2, sq, sk, 4, 2, head_dim, torch.bfloat16)
    out, lse = run_fa3(q, k, v, causal=causal, window_size=window_size, num_sms=num_sms)
    assert_matches_reference(out, lse, q, k, v, causal=causal, window_size=window_size)
    out_all, lse_all = run_fa3(q, k, v, causal=causal, window_size=window_size)
    # The grid size changes which CTA runs a tile, not the tile's arithmetic.
    assert torch.equal(out, out_all) and torch.equal(lse, lse_all)


# The FA-3 launcher reuses a recent call's TMA descriptor when an operand has the same address,
# extents and strides (sm90/fwd/launch.h): one buffer viewed with other strides, or other extents,
# at the same address must get its own descriptor, and new contents at an old address must be read.
def test_fa3_tma_descriptor_reuse_is_keyed_by_layout(lib, seed):
    _require_fa3(lib, torch.bfloat16, 64)
    b, s, h, d = 2, 160, 4, 64
    buf = torch.randn(b * s * h * d, dtype=torch.bfloat16, device="cuda")
    views = [buf.view(b, s, h, d), buf.view(b, h, s, d).transpose(1, 2),
             buf[: b * (s // 2) * h * d].view(b, s // 2, h, d)]
    k, v = (torch.randn(b, 96, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    for _ in range(2):  # the second pass hits every memo entry the first one made
        for q in views:
            assert q.data_ptr() == buf.data_ptr()
            out, lse = run(q, k, v, "fa3", causal=True)
            assert_matches_reference(out, lse, q, k, v, causal=True)
        buf.normal_()  # new contents, same addresses and layouts
        k.normal_()


# Masked calls run the short-masked tile: d64 up to 1024 keys (128 x 128 with two warpgroups;
# longer ones the default 192 x 128), both sides of that switch; d128 at every length (N = 128 with
# two Q buffers), a short and a long call. Causal and a window, fp16 and bf16.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "sk"), [(64, 1024), (64, 1025), (128, 2048), (128, 5000)])
@pytest.mark.parametrize(("causal", "window_size"), [(True, (-1, -1)), (False, (300, 40))])
def test_fa3_short_masked_tile_switch(lib, seed, sk, causal, window_size, head_dim, dtype):
    _require_fa3(lib, dtype, head_dim)
    q, k, v = make_qkv(1, 700, sk, 4, 4, head_dim, dtype)
    out, lse = run(q, k, v, "fa3", causal=causal, window_size=window_size)
    assert_matches_reference(out, lse, q, k, v, causal=causal, window_size=window_size)


def _variant_built(lib, variant: str, dtype: str, head_dim: int) -> bool:
    """Whether build_info's kernel list has ``variant`` for (fa3, dtype, head-dim bucket)."""
    info = lib.build_info()
    value = info["variants"][variant]
    bucket = head_dim_bucket(head_dim)
    return any(k["backend"] == "fa3" and k["dtype"] == dtype and k["head_dim"] == bucket
               and value in k["variants"] for k in info["kernels"])


@pytest.mark.parametrize("variant", ["fa3-no-pingpong", "fa3-no-overlap",
                                     "fa3-no-pingpong-no-overlap"])
@pytest.mark.parametrize("causal", [False, True])
def test_fa3_ablation_variants(lib, seed, variant, causal):
    _require_fa3(lib, torch.bfloat16, 128)
    # Skip only what the build says it lacks; a built variant that fails to launch fails here.
    if not _variant_built(lib, variant, "bf16", 128):
        pytest.skip(f"{variant} not built for bf16 d128 (FH_FA3_ABLATION_*)")
    q, k, v = make_qkv(2, 1000, 1000, 4, 2, 128, torch.bfloat16)
    out, lse = run_fa3(q, k, v, causal=causal, backend=variant)
    assert_matches_reference(out, lse, q, k, v, causal=causal)
    if variant == "fa3-no-pingpong":  # scheduling only: the arithmetic is the tuned kernel's
        out0, lse0 = run_fa3(q, k, v, causal=causal)
        assert torch.equal(out, out0) and torch.equal(lse, lse0)


# --- tiles claimed at run time -------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_claimed_tiles_in_a_graph_replay_bitwise(lib, head_dim):
    """Masked FA-3 calls claim their tiles from a counter in the call's workspace, which fh_fwd
    zeroes on the stream: a CUDA graph replays that memset with the kernel, so every replay
    computes every tile. On 3 CTAs each claims many tiles; the result equals the eager call and
    the static walk (the workspace left out) bit for bit, replay after replay."""
    if _backend_runs_here(lib, "fa3"):
        pytest.skip(_backend_runs_here(lib, "fa3"))
    require_kernel(lib, "fa3", torch.bfloat16, head_dim)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v = make_qkv(2, 777, 1031, 4, 2, head_dim, torch.bfloat16)
    kw = {"causal": True, "sm_margin": sms - 3, "backend": "fa3"}
    eager = flash_attn_func(q, k, v, **kw)
    cfg = _validate.check_fwd_args(q, k, v, None, True, (-1, -1), 0.0, "fa3")
    b, sq, hq, _ = q.shape
    static = torch.empty_like(q)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    p = ops.make_params(q, k, v, static, lse, cfg, "fa3", num_sms=3)
    assert p.workspace is None  # ops.make_params fills no workspace: the static walk
    status = lib._dll.fh_fwd(ctypes.byref(p), torch.cuda.current_stream().cuda_stream)
    assert status == 0, lib.last_error()
    torch.cuda.synchronize()
    assert torch.equal(eager, static)
    graph = torch.cuda.CUDAGraph()
    out = torch.empty_like(q)
    with torch.cuda.graph(graph):
        out.copy_(flash_attn_func(q, k, v, **kw))
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
