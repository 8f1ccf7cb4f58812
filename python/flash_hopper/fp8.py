"""FP8 helpers for attention inference: quantize q, k, v to FP8 with descales, and rotate q and k
by a random Hadamard matrix first (FA3's incoherent processing). Pure torch, CPU or CUDA.

The FP8 forward of FlashAttention-3 (and vLLM, which calls it) takes q, k, v in float8_e4m3fn,
(batch, seqlen, heads, head_dim), plus ``q_descale``, ``k_descale``, ``v_descale``: float32
(batch, heads_kv) factors by which the FP8 values are multiplied to recover the original ones (the
kernel folds q_descale * k_descale into the softmax scale and v_descale into the output).
``quantize`` produces exactly that pair::

    q_rot, k_rot = hadamard_rotate(q, k)            # optional, see below
    q8, q_descale = quantize(q_rot, "head", heads_kv=k.shape[2])
    k8, k_descale = quantize(k_rot, "head")
    v8, v_descale = quantize(v, "head")
    out = flash_attn_func(q8, k8, v8, q_descale=q_descale, k_descale=k_descale,
                          v_descale=v_descale)

(The helpers follow FA3's convention, so their output goes unchanged to flash_hopper's
flash_attn_func or to FA3's.)

FA3 takes one q descale per kv head, even under GQA (FA3's hopper/flash_api.cpp checks
q_descale against (batch_size, num_heads_k)), because the query heads of a kv head are packed into
one tile that shares one scale; ``heads_kv=`` makes ``quantize`` calibrate q that way.

Incoherent processing (Shah et al., "FlashAttention-3", arXiv:2407.08608, after QuIP / QuIP#):
LLM activations have a few outlier features, much larger than the rest. Multiplying q and k by the
same random orthogonal matrix M leaves Q K^T unchanged, since (Q M)(K M)^T = Q M M^T K^T = Q K^T,
but spreads each outlier over the whole head dimension, so the quantization error no longer sits
on the few products that dominate the softmax. M = diag(s) H (random signs s, then the normalized
Walsh-Hadamard matrix H) costs O(d log d) per vector in a kernel; here it is a plain matmul.
On data with outliers the paper measures FP8 attention-output RMSE 9.1e-3 with block quantization
and this rotation against 2.4e-2 for per-tensor FP8, and its ablation credits the rotation.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

# The FP8 formats quantize supports: e4m3fn is what FP8 attention runs on (FA3, vLLM); e5m2 trades
# a mantissa bit for range (gradients, mostly). torch.finfo gives their largest finite values,
# 448 and 57344.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
GRANULARITIES = ("tensor", "head")
# quantize's inputs; float64 is left out on purpose: FP8 sources are activations in these dtypes.
SOURCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# hadamard_rotate's inputs (float64 too: it is computed in float64 then, for exact checks).
ROTATE_DTYPES = (*SOURCE_DTYPES, torch.float64)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return value


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...]) -> Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: expected dtype one of {names}, got {t.dtype}")
    return t


def _check_power_of_two(name: str, what: str, n: int) -> None:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{name}: expected {what}a power of two (Sylvester's Hadamard matrices "
                         f"have those sizes; the FP8 head dims 64, 128 and 256 qualify), got {n}")


def _signed_hadamard(n: int, seed: int) -> Tensor:
    """diag(s) H in float64 on the CPU (see hadamard_matrix)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
    return signs[:, None] * h / math.sqrt(n)  # (n, n)


@torch.no_grad()
def quantize(t: Tensor, granularity: str = "tensor", dtype: torch.dtype = torch.float8_e4m3fn,
             *, heads_kv: int | None = None) -> tuple[Tensor, Tensor]:
    """Amax-calibrated FP8 quantization: (t_fp8, descale), with t ~= t_fp8.float() * descale.

    t: (batch, seqlen, heads, head_dim), float32 / float16 / bfloat16, finite (checked: a NaN or
    inf would poison its amax and with it every value that shares its scale; on CUDA the check
    synchronizes).
    granularity: "tensor" (one scale for all of t) or "head" (one per batch entry and head, the
    amax over seqlen and head_dim).
    dtype: torch.float8_e4m3fn or torch.float8_e5m2.
    heads_kv (keyword only): for q under GQA, the number of kv heads: the descale then has one
    entry per kv head, shared by its heads // heads_kv query heads ("head": the amax over all of
    them), as FA3's q_descale is. None: one per head of t.

    Each slice that shares a scale is multiplied by scale = fp8_max / amax (fp8_max =
    torch.finfo(dtype).max: 448 for e4m3fn, 57344 for e5m2), so that its largest magnitude lands
    on fp8_max, clamped to [-fp8_max, fp8_max] and cast. The clamp is a guard: float32 rounding
    overshoots by an ulp at most, which rounds back, but what a cast does past fp8_max is the
    build's (torch 2.13's CPU cast saturates e4m3fn and gives inf for e5m2). An all-zero slice
    gets scale 1; a scale that float32 cannot hold (amax < fp8_max / 3.4e38) is capped at
    float32's largest value.

    Returns t_fp8, contiguous, t's shape, in ``dtype``; descale = 1 / scale, float32, contiguous,
    (batch, heads) or (batch, heads_kv), on t's device, also for "tensor" (the one value repeated)
    so that it can be passed as q_descale / k_descale / v_descale as it is.
    """
    _check_tensor("t", t, SOURCE_DTYPES)
    if t.dim() != 4:
        raise ValueError(f"t: expected rank 4 (batch, seqlen, heads, head_dim), got shape "
                         f"{tuple(t.shape)}")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype: expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected 'tensor' or 'head', got {granularity!r}")
    batch, seqlen, heads, head_dim = t.shape
    if heads_kv is None:
        heads_kv = heads
    _check_int("heads_kv", heads_kv, 1)
    if heads % heads_kv:
        raise ValueError(f"heads_kv: must divide t's heads (dim 2) {heads}, got {heads_kv}")
    # (batch, seqlen, heads_kv, group, head_dim): a scale per (batch, kv head) broadcasts over it.
    x = t.to(torch.float32).reshape(batch, seqlen, heads_kv, heads // heads_kv, head_dim)
    if x.numel() == 0:  # amax of nothing is an error; nothing to scale, descale 1
        amax = x.new_zeros(() if granularity == "tensor" else (batch, heads_kv))
    elif granularity == "tensor":
        amax = x.abs().amax()
    else:
        amax = x.abs().amax(dim=(1, 3, 4))  # (batch, heads_kv)
    # amax propagates NaN and inf: checking it checks every element of t.
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("t: expected finite values, got NaN or inf")
    fp8_max = torch.finfo(dtype).max
    scale = torch.where(amax > 0, fp8_max / amax, torch.ones_like(amax))
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
    scale = scale.expand(batch, heads_kv)  # (batch, heads_kv)
    x_fp8 = (x * scale[:, None, :, None, None]).clamp(-fp8_max, fp8_max).to(dtype)
    descale = (1.0 / scale).contiguous()
    return x_fp8.reshape(t.shape).contiguous(), descale


def hadamard_matrix(n: int, seed: int = 0, device: torch.device | str | None = None) -> Tensor:
    """The float32 (n, n) orthonormal matrix M = diag(s) H that hadamard_rotate multiplies by,
    ``x_rot = x @ M`` on the last dimension, for rotating other tensors consistently.

    H: the Walsh-Hadamard matrix of Sylvester's construction, scaled by 1 / sqrt(n) so that it is
    orthonormal (and symmetric). s: n random signs from a CPU torch.Generator seeded with
    ``seed`` (the same matrix on every device and machine). On a column vector, M^T x = H diag(s) x:
    flip signs at random, then mix every entry into every other, the randomized Hadamard transform
    of QuIP# and FA3. n must be a power of two. device: where to return it (None: CPU).
    """
    _check_int("n", n, 1)
    _check_power_of_two("n", "", n)
    _check_int("seed", seed, 0)
    # Built in float64 and rounded once: 1 / sqrt(n) is inexact for odd powers of two.
    return _signed_hadamard(n, seed).to(dtype=torch.float32, device=device)


@torch.no_grad()
def hadamard_rotate(q: Tensor, k: Tensor, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(q @ M, k @ M) with M = hadamard_matrix(head_dim, seed): q_rot @ k_rot^T == q @ k^T up to
    rounding, with outlier features spread over the head dimension before FP8 quantization.

    q, k: (..., head_dim), the same head_dim, a power of two (64, 128 and 256, FP8 attention's
    head dims, qualify), float32 / float16 / bfloat16 / float64, on one device. The usual
    (batch, seqlen, heads, head_dim) works for any heads and heads_kv (GQA: each vector is rotated
    on its own), and so do varlen's (total, heads, head_dim) and a paged cache's blocks.
    Computed in float32 (float64 for float64 inputs), returned in the inputs' dtypes; the norms,
    and so the softmax scale, are unchanged.

    V is not rotated: the rotation has to cancel, and it does so only inside Q K^T. The output is
    P V; with V M it would be (P V) M, the output rotated, to be undone by a further multiply by
    M^T after the kernel. The same seed for q and k is what makes M M^T = I: use this function, or
    hadamard_matrix with one seed for both, never two seeds.
    """
    _check_tensor("q", q, ROTATE_DTYPES)
    _check_tensor("k", k, ROTATE_DTYPES)
    if q.dim() == 0:
        raise ValueError("q: expected a tensor whose last dimension is head_dim, got a 0-d tensor")
    head_dim = q.shape[-1]
    if k.dim() == 0 or k.shape[-1] != head_dim:
        raise ValueError(f"k: expected head_dim (last dim) == q's head_dim {head_dim}, got shape "
                         f"{tuple(k.shape)}")
    if k.device != q.device:
        raise ValueError(f"k: must be on q's device {q.device}, got device {k.device}")
    _check_power_of_two("q", "head_dim (last dim) ", head_dim)
    _check_int("seed", seed, 0)
    m = _signed_hadamard(head_dim, seed)  # float64, rounded to each compute dtype once

    def rotate(t: Tensor) -> Tensor:
        compute = torch.promote_types(t.dtype, torch.float32)
        return (t.to(compute) @ m.to(dtype=compute, device=t.device)).to(t.dtype)

    return rotate(q), rotate(k)
