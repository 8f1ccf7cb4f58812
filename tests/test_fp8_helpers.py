"""The FP8 helpers (flash_hopper.fp8) on the CPU: quantize's calibration, saturation, shapes and
errors, and the Hadamard rotation's invariance of Q K^T and its effect on outlier features.

quantize's bounds are the formats': rounding to nearest into a format with eps = 2^-mantissa_bits
(torch.finfo: 2^-3 for e4m3fn, 2^-2 for e5m2) errs by at most eps / 2 relative on a normal value
and by eps / 2 * smallest_normal in the subnormals; in t's units, times descale. For e4m3fn the
largest error is thus amax / 16.
"""

from __future__ import annotations

import math

import pytest
import torch
from flash_hopper.fp8 import hadamard_matrix, hadamard_rotate, quantize
from flash_hopper.reference import attention_ref

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
GRANULARITIES = ["tensor", "head"]


def _descale_per_head(descale, heads):
    """(batch, heads_kv) descale -> (batch, 1, heads, 1), broadcastable against t."""
    return descale.repeat_interleave(heads // descale.shape[1], dim=1)[:, None, :, None]


def _dequantize(t_fp8, descale):
    return t_fp8.to(torch.float32) * _descale_per_head(descale, t_fp8.shape[2])


def _amax(t, granularity):
    """The reference amax, (batch, heads) either way."""
    a = t.float().abs()
    if granularity == "tensor":
        return a.amax().expand(t.shape[0], t.shape[2])
    return a.amax(dim=(1, 3))


def _assert_within_rounding(t, t_fp8, descale, dtype):
    fi = torch.finfo(dtype)
    err = (_dequantize(t_fp8, descale) - t.float()).abs()
    floor = fi.smallest_normal * _descale_per_head(descale, t.shape[2])
    # 1e-5: float32's own roundings of t * scale and of the dequantization.
    bound = fi.eps / 2 * torch.maximum(t.float().abs(), floor) * (1 + 1e-5)
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"


# --- quantize --------------------------------------------------------------------------------


# Both granularities x both formats: the bound depends on the format's eps, and the tensor-level
# scale is the one that leaves small heads closest to the subnormals.
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_roundtrip_error_is_within_rounding(seed, granularity, dtype):
    t = torch.randn(2, 128, 4, 64)
    t_fp8, descale = quantize(t, granularity, dtype)
    assert t_fp8.dtype == dtype
    _assert_within_rounding(t, t_fp8, descale, dtype)

    eps = torch.finfo(dtype).eps
    err = (_dequantize(t_fp8, descale) - t).abs()
    amax = _amax(t, granularity)  # (batch, heads)
    assert (err.amax(dim=(1, 3)) <= amax * eps / 2 * (1 + 1e-5)).all()
    # Relative error over values clear of the subnormals: uniform rounding within a binade
    # averages about eps / 6 (e4m3fn 0.021, e5m2 0.042); eps / 4 fails a scale off by a few ulps.
    normal = t.abs() > 0.01
    mean_rel = (err[normal] / t.abs()[normal]).mean().item()
    assert mean_rel < eps / 4, f"mean relative error {mean_rel:.4f}"


def test_head_descales_follow_each_heads_amax(seed):
    # Heads six orders of magnitude apart, and the two batch entries 10x apart.
    head_scale = torch.tensor([1e-2, 1.0, 1e2, 1e4])[None, None, :, None]
    batch_scale = torch.tensor([1.0, 10.0])[:, None, None, None]
    t = torch.randn(2, 64, 4, 32) * head_scale * batch_scale
    t_fp8, descale = quantize(t, "head")
    torch.testing.assert_close(descale, _amax(t, "head") / 448, rtol=1e-6, atol=0)
    assert descale.unique().numel() == 8
    # Every head gets its largest value onto fp8's largest, whatever its own scale.
    assert (t_fp8.float().abs().amax(dim=(1, 3)) == 448).all()
    _assert_within_rounding(t, t_fp8, descale, torch.float8_e4m3fn)

    _, descale_t = quantize(t, "tensor")
    torch.testing.assert_close(descale_t, _amax(t, "tensor") / 448, rtol=1e-6, atol=0)


def test_heads_kv_shares_a_descale_per_kv_head(seed):
    # FA3 takes q_descale as (batch, heads_kv): the 4 query heads of a kv head share one scale.
    t = torch.randn(2, 16, 8, 32) * torch.arange(1.0, 9.0)[None, None, :, None]
    t_fp8, descale = quantize(t, "head", heads_kv=2)
    assert descale.shape == (2, 2)
    amax = t.abs().reshape(2, 16, 2, 4, 32).amax(dim=(1, 3, 4))
    torch.testing.assert_close(descale, amax / 448, rtol=1e-6, atol=0)
    _assert_within_rounding(t, t_fp8, descale, torch.float8_e4m3fn)
    _, descale_t = quantize(t, "tensor", heads_kv=2)
    assert descale_t.shape == (2, 2)
    torch.testing.assert_close(descale_t, t.abs().amax().expand(2, 2) / 448, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3fn", "e5m2"])
def test_amax_element_saturates_to_fp8_max(seed, dtype):
    fp8_max = torch.finfo(dtype).max  # 448, 57344
    t = torch.randn(1, 32, 2, 16)
    t[0, 5, 1, 3] = -3e38  # near float32's largest: the scale must not overflow t * scale
    t[0, 7, 0, 2] = 1e30
    for granularity in GRANULARITIES:
        t_fp8, descale = quantize(t, granularity, dtype)
        values = t_fp8.float()
        assert values.isfinite().all()
        assert values.abs().max() == fp8_max
        assert values[0, 5, 1, 3] == -fp8_max
        assert torch.isfinite(descale).all() and (descale > 0).all()
    # Per head, head 0's largest value lands on fp8_max too, not just the tensor's.
    t_fp8, _ = quantize(t, "head", dtype)
    assert t_fp8[0, 7, 0, 2].float() == fp8_max


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_tiny_amax_caps_the_scale(granularity):
    # amax 1e-38: 448 / amax overflows float32; an uncapped scale gives inf * x and 0 * inf = NaN.
    t = torch.zeros(1, 4, 2, 8)
    t[0, 1, :, 3] = 1e-38
    t[0, 2, :, 5] = -5e-39
    t_fp8, descale = quantize(t, granularity)
    assert t_fp8.float().isfinite().all() and descale.isfinite().all() and (descale > 0).all()
    assert (t_fp8.float() > 0).sum() == 2 and (t_fp8.float() < 0).sum() == 2
    torch.testing.assert_close(_dequantize(t_fp8, descale), t, rtol=2 ** -4, atol=0)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_all_zero_gives_descale_one(granularity):
    t_fp8, descale = quantize(torch.zeros(2, 8, 3, 16), granularity)
    assert (descale == 1).all() and (t_fp8.float() == 0).all()
    # An empty sequence has nothing to calibrate on either.
    t_fp8, descale = quantize(torch.zeros(2, 0, 3, 16), granularity)
    assert t_fp8.shape == (2, 0, 3, 16) and descale.shape == (2, 3) and (descale == 1).all()


def test_all_zero_head_gives_descale_one_next_to_others(seed):
    t = torch.randn(2, 8, 3, 16)
    t[:, :, 1] = 0
    _, descale = quantize(t, "head")
    assert (descale[:, 1] == 1).all()
    torch.testing.assert_close(descale[:, [0, 2]], _amax(t, "head")[:, [0, 2]] / 448, rtol=1e-6,
                               atol=0)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_output_shapes_dtypes_and_layout(seed, granularity, src_dtype):
    # A (batch, heads, seqlen, dim) tensor seen as (batch, seqlen, heads, dim): not contiguous.
    t = torch.randn(3, 5, 7, 32).to(src_dtype).transpose(1, 2)
    t_fp8, descale = quantize(t, granularity)
    assert t_fp8.shape == t.shape and t_fp8.dtype == torch.float8_e4m3fn
    assert t_fp8.is_contiguous()
    assert descale.shape == (3, 5) and descale.dtype == torch.float32
    assert descale.is_contiguous() and descale.stride() == (5, 1)
    assert descale.device == t.device
    _assert_within_rounding(t, t_fp8, descale, torch.float8_e4m3fn)


def _with(index, value):
    t = torch.randn(1, 4, 2, 8)
    t[index] = value
    return t


# Each argument's checks, and that the message names it and the value it got.
@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((torch.randn(2, 3, 4),), {}, ValueError, r"^t: expected rank 4 .*\(2, 3, 4\)"),
        (([[1.0]],), {}, TypeError, r"^t: expected a torch.Tensor, got list"),
        ((torch.ones(1, 2, 2, 4, dtype=torch.int32),), {}, ValueError, r"^t: .*got torch.int32"),
        ((torch.ones(1, 2, 2, 4, dtype=torch.float64),), {}, ValueError,
         r"^t: .*got torch.float64"),
        ((_with((0, 1, 1, 2), math.nan),), {}, ValueError, r"^t: expected finite values"),
        ((_with((0, 3, 0, 0), -math.inf), "head"), {}, ValueError, r"^t: expected finite values"),
        ((torch.randn(1, 4, 2, 8), "tensor", torch.float16), {}, ValueError,
         r"^dtype: .*got torch.float16"),
        ((torch.randn(1, 4, 2, 8),), {"dtype": torch.int8}, ValueError, r"^dtype: .*torch.int8"),
        ((torch.randn(1, 4, 2, 8), "channel"), {}, ValueError, r"^granularity: .*'channel'"),
        ((torch.randn(1, 4, 2, 8), "Head"), {}, ValueError, r"^granularity: .*'Head'"),
        ((torch.randn(1, 4, 4, 8), "head"), {"heads_kv": 3}, ValueError,
         r"^heads_kv: must divide t's heads \(dim 2\) 4, got 3"),
        ((torch.randn(1, 4, 4, 8),), {"heads_kv": 0}, ValueError, r"^heads_kv: .*got 0"),
    ],
    ids=["rank", "not-tensor", "int", "float64", "nan", "neg-inf-head", "dtype-fp16",
         "dtype-int8", "granularity", "granularity-case", "heads_kv-divide", "heads_kv-zero"],
)
def test_quantize_errors_name_the_argument(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        quantize(*args, **kwargs)


# --- the Hadamard rotation -------------------------------------------------------------------


def _sylvester(n):
    """The unnormalized Walsh-Hadamard matrix, built independently of fp8.py's:
    H_2n = [[1, 1], [1, -1]] (x) H_n."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h


@pytest.mark.parametrize("n", [1, 2, 64, 128, 256])
def test_hadamard_matrix_is_orthonormal_signed_hadamard(n):
    m = hadamard_matrix(n, seed=3)
    assert m.shape == (n, n) and m.dtype == torch.float32 and m.device.type == "cpu"
    eye = torch.eye(n)
    torch.testing.assert_close(m @ m.T, eye, atol=1e-5, rtol=0)
    torch.testing.assert_close(m.T @ m, eye, atol=1e-5, rtol=0)
    # diag(s) H: row i of M is s_i times row i of H / sqrt(n).
    signs = m.double() * _sylvester(n) * math.sqrt(n)  # each row constant, +-1
    assert torch.allclose(signs, signs[:, :1].expand(n, n), atol=1e-6)
    assert torch.allclose(signs.abs(), torch.ones(n, n, dtype=torch.float64), atol=1e-6)
    if n >= 64:  # both signs occur: the random diagonal is really there
        assert (signs[:, 0] > 0).any() and (signs[:, 0] < 0).any()


def _scores(q, k):
    """(b, sq, hq, d) x (b, sk, hkv, d) -> (b, hq, sq, sk), kv heads repeated for GQA."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bshd,bthd->bhst", q.double(), k.double())


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotation_preserves_scores(seed, head_dim):
    q = torch.randn(2, 33, 4, head_dim, dtype=torch.float64)
    k = torch.randn(2, 47, 2, head_dim, dtype=torch.float64)  # GQA: 2 query heads per kv head
    q_rot, k_rot = hadamard_rotate(q, k, seed=5)
    assert q_rot.dtype == torch.float64 and q_rot.shape == q.shape and k_rot.shape == k.shape
    ref = _scores(q, k)
    tol = 1e-4 * ref.abs().max().item()
    torch.testing.assert_close(_scores(q_rot, k_rot), ref, atol=tol, rtol=0)
    # A rotation, not the identity: the vectors move, their norms do not.
    assert not torch.allclose(q_rot, q, atol=0.1)
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotation_returns_input_dtype_and_matches_the_matrix(seed, dtype):
    q = torch.randn(1, 16, 2, 128).to(dtype)
    k = torch.randn(1, 24, 2, 128).to(dtype)
    q_rot, k_rot = hadamard_rotate(q, k, seed=11)
    assert q_rot.dtype == dtype and k_rot.dtype == dtype
    # x @ hadamard_matrix(d, seed) is what hadamard_rotate does, up to one rounding to dtype.
    m = hadamard_matrix(128, seed=11)
    torch.testing.assert_close(q_rot, (q.float() @ m).to(dtype))
    torch.testing.assert_close(k_rot, (k.float() @ m).to(dtype))
    ref = _scores(q, k)
    rtol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}[dtype]
    torch.testing.assert_close(_scores(q_rot, k_rot), ref, atol=rtol * ref.abs().max().item(),
                               rtol=0)


def test_rotation_is_deterministic_per_seed():
    assert torch.equal(hadamard_matrix(128, seed=7), hadamard_matrix(128, seed=7))
    assert not torch.equal(hadamard_matrix(128, seed=7), hadamard_matrix(128, seed=8))
    q, k = torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64)
    state = torch.get_rng_state()
    a, b = hadamard_rotate(q, k, seed=1), hadamard_rotate(q, k, seed=1)
    assert torch.equal(torch.get_rng_state(), state), "the global RNG was used"
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    c = hadamard_rotate(q, k, seed=2)
    assert not torch.equal(a[0], c[0])
    torch.testing.assert_close(_scores(*c), _scores(*a), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: hadamard_rotate(torch.randn(1, 4, 2, 96), torch.randn(1, 4, 2, 96)), ValueError,
         r"^q: expected head_dim \(last dim\) a power of two .*64, 128 and 256.*got 96"),
        (lambda: hadamard_matrix(96), ValueError, r"^n: expected a power of two .*got 96"),
        (lambda: hadamard_matrix(0), ValueError, r"^n: .*got 0"),
        (lambda: hadamard_rotate(torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 128)), ValueError,
         r"^k: expected head_dim \(last dim\) == q's head_dim 64, got shape \(1, 4, 2, 128\)"),
        (lambda: hadamard_rotate(torch.randn(1, 4, 2, 64).to(torch.float8_e4m3fn),
                                 torch.randn(1, 4, 2, 64)), ValueError,
         r"^q: .*got torch.float8_e4m3fn"),
        (lambda: hadamard_rotate(torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64), seed=-1),
         ValueError, r"^seed: .*got -1"),
    ],
    ids=["head_dim-96", "n-96", "n-0", "k-head_dim", "q-fp8", "seed"],
)
def test_rotation_errors_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_rotation_lowers_fp8_attention_error_with_outliers(seed):
    # The FA3 paper's numerical-error data: N(0, 1) plus, on 0.1% of the entries, an extra
    # N(0, std 10); per-tensor e4m3fn for q, k and v, the error of the attention output.
    shape = (1, 512, 4, 128)

    def outlier_data():
        outlier = torch.rand(shape) < 0.001
        return (torch.randn(shape) + 10 * torch.randn(shape) * outlier).double()

    q, k, v = outlier_data(), outlier_data(), outlier_data()

    def fp8(t):  # per-tensor e4m3fn, back to float64
        return _dequantize(*quantize(t.float(), "tensor")).double()

    ref, _ = attention_ref(q, k, v)
    plain, _ = attention_ref(fp8(q), fp8(k), fp8(v))
    q_rot, k_rot = hadamard_rotate(q, k, seed=seed % 2**31)
    rotated, _ = attention_ref(fp8(q_rot), fp8(k_rot), fp8(v))

    def rmse(out):
        return (out - ref).pow(2).mean().sqrt().item()

    # The scores' RMSE barely moves (FP8's error is relative and a rotation keeps sums of
    # squares); what the rotation removes is the error concentrated on the outliers' few large
    # products, which the softmax amplifies: the output's RMSE drops, to 0.64x on average and
    # 0.75x at worst over 40 seeds on this data.
    assert rmse(rotated) < 0.85 * rmse(plain), (rmse(rotated), rmse(plain))
