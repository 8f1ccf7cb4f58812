"""The mixed mode on the GPU: fp16 / bf16 q against an FP8 (e4m3 / e5m2) K/V cache, K and V
converted to q's dtype in shared memory (kernels/sm90/fwd/convert.h), 16-bit GEMMs.

Reference: float64 attention on q and the dequantized K / V (k * k_descale, v * v_descale). The
bound is FA3's rule against a torch computation in q's dtype on the same dequantized K / V
(rounded to q's dtype, as a user without the mixed mode would call the 16-bit path): the
kernel's max error is at most twice that one's plus a small absolute term. The conversion is
exact (every FP8 value is an fp16 / bf16 value), so a conversion bug (a wrong byte order, a
swizzle mismatch, a lost stage) gives errors of order 1, far above the bound.
"""

from __future__ import annotations

import pytest
import torch
from flash_hopper import _tables, flash_attn_func, which_backend
from flash_hopper.dispatch import head_dim_bucket
from flash_hopper.reference import attention_ref

# fp32 references stay fp32, not TF32 (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HEAD_DIMS = [64, 128, 256]
MODES = [(torch.bfloat16, E4M3), (torch.float16, E4M3), (torch.bfloat16, E5M2),
         (torch.float16, E5M2)]
MODE_IDS = ["bf16+e4m3", "fp16+e4m3", "bf16+e5m2", "fp16+e5m2"]


def mode_name(q_dtype, kv_dtype) -> str:
    return {v: k for k, v in _tables.MIXED_DTYPES.items()}[(q_dtype, kv_dtype)]


@pytest.fixture
def mixed(lib):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the mixed mode runs on the FA-3 path: compute capability 9.0 only")
    return lib


def require_kernel(lib, q_dtype, kv_dtype, head_dim):
    name, bucket = mode_name(q_dtype, kv_dtype), head_dim_bucket(head_dim)
    built = {(k["dtype"], k["head_dim"]) for k in _tables.kernel_entries(lib.build_info())}
    if (name, bucket) not in built:
        pytest.skip(f"this build has no {name} kernel for hdim bucket {bucket}")


def make(q_dtype, kv_dtype, b, sq, sk, hq, hkv, d, kv_scale=1.0):
    q = torch.randn(b, sq, hq, d, device="cuda").to(q_dtype)
    k = (torch.randn(b, sk, hkv, d, device="cuda") * kv_scale).to(kv_dtype)
    v = (torch.randn(b, sk, hkv, d, device="cuda") * kv_scale).to(kv_dtype)
    return q, k, v


def dequantize(t, descale, dtype=torch.float64):
    """t (b, s, h_kv, d) FP8 -> dtype, times its descale ((b, h_kv), broadcast or None)."""
    x = t.to(dtype)
    if descale is None:
        return x
    ds = descale.to(dtype)
    if ds.dim() == 2:
        ds = ds.expand(t.shape[0], t.shape[2])[:, None, :, None]
    return x * ds


def poisoned_call(q, k, v, **kwargs):
    """flash_attn_func with the caching allocator's next blocks full of NaN: an output element the
    kernel does not write shows up."""
    b, sq, hq, d = q.shape
    junk = [torch.full((b, sq, hq, d), float("nan"), dtype=q.dtype, device="cuda"),
            torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device="cuda")]
    del junk
    return flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)


def check(out, lse, q, k, v, k_descale=None, v_descale=None, **mask):
    assert out.dtype == q.dtype and out.shape == q.shape
    kk, vv = dequantize(k, k_descale), dequantize(v, v_descale)
    ref, ref_lse = attention_ref(q.double(), kk, vv, **mask)
    pt, _ = attention_ref(q, kk.to(q.dtype), vv.to(q.dtype), upcast=False, **mask)
    assert not torch.isnan(out).any()
    seen = torch.isfinite(ref_lse)  # (b, h, sq)
    rows = seen.transpose(1, 2)  # (b, sq, h)
    assert (out[~rows] == 0).all()  # rows that see no key: exactly 0 and -inf
    assert torch.isneginf(lse[~seen]).all()
    if rows.any():
        err = (out[rows].double() - ref[rows]).abs().max().item()
        pt_err = (pt[rows].double() - ref[rows]).abs().max().item()
        assert err <= 2 * pt_err + 1e-4, (err, pt_err)
        assert (lse[seen].double() - ref_lse[seen]).abs().max().item() <= 2e-3


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("sq", "sk"), [(1, 1), (17, 33), (128, 128), (300, 1000), (1000, 300),
                                        (129, 2049)])
def test_mixed_matches_the_reference(mixed, q_dtype, kv_dtype, head_dim, causal, sq, sk):
    require_kernel(mixed, q_dtype, kv_dtype, head_dim)
    torch.manual_seed(sq * 7 + sk + head_dim)
    q, k, v = make(q_dtype, kv_dtype, 2, sq, sk, 4, 2, head_dim)
    out, lse = poisoned_call(q, k, v, causal=causal)
    check(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("layout", ["per_head", "expand", "scalar", "one", "strided", "k_only"])
def test_mixed_descales(mixed, q_dtype, kv_dtype, head_dim, layout):
    require_kernel(mixed, q_dtype, kv_dtype, head_dim)
    torch.manual_seed(head_dim)
    b, hq, hkv = 2, 8, 2
    # A real cache holds values quantized to use FP8's range: scale 8 up front, descales down.
    q, k, v = make(q_dtype, kv_dtype, b, 300, 400, hq, hkv, head_dim, kv_scale=8.0)
    dev = "cuda"
    if layout == "per_head":
        kd, vd = (torch.rand(b, hkv, device=dev) * 0.2 + 0.05 for _ in range(2))
    elif layout == "expand":  # what servers pass: one scale expanded to (b, h_kv), stride 0
        kd, vd = (torch.tensor(s, device=dev).expand(b, hkv) for s in (0.125, 0.0625))
    elif layout == "scalar":
        kd, vd = (torch.tensor(s, device=dev) for s in (0.125, 0.0625))
    elif layout == "one":
        kd, vd = (torch.full((1,), s, device=dev) for s in (0.125, 0.0625))
    elif layout == "strided":
        kd, vd = (torch.rand(b, 2 * hkv, device=dev)[:, ::2] * 0.2 + 0.05 for _ in range(2))
    else:
        kd, vd = torch.tensor(0.1, device=dev), None
    out, lse = poisoned_call(q, k, v, k_descale=kd, v_descale=vd)
    full = [None if x is None else x if x.dim() == 2 else x.reshape(()).expand(b, hkv)
            for x in (kd, vd)]
    check(out, lse, q, k, v, *full)


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_mixed_gqa_windows_softcap_and_empty_rows(mixed, q_dtype, kv_dtype, head_dim):
    require_kernel(mixed, q_dtype, kv_dtype, head_dim)
    torch.manual_seed(3)
    kd = torch.tensor(0.5, device="cuda").expand(1, 1)
    for hq, hkv in ((8, 1), (6, 3), (4, 4)):
        q, k, v = make(q_dtype, kv_dtype, 1, 257, 513, hq, hkv, head_dim)
        out, lse = poisoned_call(q, k, v, causal=True)
        check(out, lse, q, k, v, causal=True)
    q, k, v = make(q_dtype, kv_dtype, 2, 300, 700, 4, 2, head_dim)
    out, lse = poisoned_call(q, k, v, window_size=(100, 20))
    check(out, lse, q, k, v, window_size=(100, 20))
    out, lse = poisoned_call(q, k, v, softcap=5.0, k_descale=kd.expand(2, 2))
    check(out, lse, q, k, v, kd.expand(2, 2), softcap=5.0)
    # seqlen_q > seqlen_k, causal: the first rows see no key
    q, k, v = make(q_dtype, kv_dtype, 2, 300, 100, 2, 2, head_dim)
    out, lse = poisoned_call(q, k, v, causal=True)
    check(out, lse, q, k, v, causal=True)
    assert (out[:, :200] == 0).all()
    # no key at all
    out, lse = poisoned_call(q, k[:, :0], v[:, :0])
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), MODES[:1] + MODES[3:], ids=MODE_IDS[:1] + MODE_IDS[3:])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_mixed_reads_strided_caches_and_is_deterministic(mixed, q_dtype, kv_dtype, head_dim):
    require_kernel(mixed, q_dtype, kv_dtype, head_dim)
    torch.manual_seed(5)
    # K and V as views of one interleaved cache buffer (vLLM's layout): rows of 2 * h * d bytes.
    b, s, hkv = 2, 777, 2
    cache = torch.randn(b, s, 2, hkv, head_dim, device="cuda").to(kv_dtype)
    k, v = cache[:, :, 0], cache[:, :, 1]
    assert not k.is_contiguous()
    q = torch.randn(b, 333, 4, head_dim, device="cuda").to(q_dtype)
    out, lse = poisoned_call(q, k, v, causal=True)
    check(out, lse, q, k, v, causal=True)
    for _ in range(3):
        assert torch.equal(flash_attn_func(q, k, v, causal=True), out)
    # NaN in the cache past seqlen_k never reaches the output: a shorter view of a poisoned cache
    poisoned = cache.clone()
    poisoned[:, 500:] = float("nan")
    out_short = flash_attn_func(q, poisoned[:, :500, 0], poisoned[:, :500, 1], causal=True)
    want = flash_attn_func(q, k[:, :500].contiguous(), v[:, :500].contiguous(), causal=True)
    assert torch.equal(out_short, want)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_mixed_agrees_with_the_16bit_kernel(mixed, head_dim):
    """Against this library's own bf16 kernel on k / v cast to bf16 (where that kernel is built):
    the same math, other tiles, so agreement within bf16's rounding of O."""
    require_kernel(mixed, torch.bfloat16, E4M3, head_dim)
    built = {(k["dtype"], k["backend"], k["head_dim"])
             for k in _tables.kernel_entries(mixed.build_info())}
    if ("bf16", "fa3", head_dim_bucket(head_dim)) not in built:
        pytest.skip("no bf16 fa3 kernel in this build to compare with")
    torch.manual_seed(7)
    q, k, v = make(torch.bfloat16, E4M3, 2, 1000, 1500, 8, 2, head_dim)
    for causal in (False, True):
        out = flash_attn_func(q, k, v, causal=causal)
        want = flash_attn_func(q, k.bfloat16(), v.bfloat16(), causal=causal, backend="fa3")
        assert (out.float() - want.float()).abs().max().item() <= 2e-2


def test_which_backend_names_the_mixed_kernel(mixed):
    require_kernel(mixed, torch.bfloat16, E4M3, 128)
    q, k, v = make(torch.bfloat16, E4M3, 1, 64, 64, 2, 2, 128)
    name, reason = which_backend(q, k, v, causal=True)
    assert name == "fa3" and "bf16+e4m3 (mixed mode)" in reason, reason


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), MODES, ids=MODE_IDS)
def test_the_conversion_is_exact_for_every_fp8_code(mixed, q_dtype, kv_dtype):
    """Every FP8 code (NaN, infinities, subnormals, signed zeros, the largest values) through the
    kernel's conversion, exactly: with one key, O is V (softmax of one score is 1); with one-hot
    queries and softmax_scale 1, the LSE of row j is K's element j (finite codes: a NaN or an
    infinity anywhere in K makes every score of its head NaN, 0 * NaN)."""
    require_kernel(mixed, q_dtype, kv_dtype, 128)
    d = 128
    codes = torch.arange(256, dtype=torch.uint8, device="cuda").view(kv_dtype)
    every = codes.reshape(1, 1, 2, d)  # (b, s_k = 1, h_kv = 2, d): codes 0..127, 128..255
    want = every.to(q_dtype)  # torch's conversion is exact (NaN -> NaN, inf -> inf)
    zeros = torch.zeros_like(every)
    q = torch.zeros(1, 1, 2, d, device="cuda", dtype=q_dtype)
    out = flash_attn_func(q, zeros, every)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~want.isnan()], want[~want.isnan()])
    # K: row j of q is the one-hot e_j, so the one score of row j is K[j] (softmax_scale 1)
    finite = want.float().isfinite()
    k = torch.where(finite, every.view(torch.uint8), 0).view(kv_dtype)
    q = torch.eye(d, device="cuda", dtype=q_dtype)[None, :, None, :].expand(1, d, 2, d)
    _, lse = flash_attn_func(q.contiguous(), k, zeros, softmax_scale=1.0, return_attn_probs=True)
    # lse (b, h, s_q): row j of head h is K[h, j]. lse = max + log(sum) in fp32: exact up to that
    # arithmetic's rounding, while a wrong conversion is off by at least one FP8 step (>= 12.5 %).
    torch.testing.assert_close(lse[0][finite[0, 0]], want[0, 0].float()[finite[0, 0]],
                               rtol=1e-5, atol=1e-30)
