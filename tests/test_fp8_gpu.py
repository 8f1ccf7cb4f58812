"""The FP8 (e4m3) forward on the GPU: against a float64 reference on the dequantized inputs, and
against a torch emulation of its one rounding that the reference does not have (P in e4m3).

The emulation computes P = exp(s - rowmax) in fp32, rounds it to e4m3 for the P V product and
sums the unrounded P for the normalization, as the kernel does. FP8's 3 mantissa bits leave a
relative RMS error of ~2-3 % in the output on N(0, 1) inputs (P's rounding alone); a kernel bug
(a wrong key order in V^T, a lost block, a wrong descale) gives errors of order 1, so the tests
bound the error relative to the emulation's own.
"""

from __future__ import annotations

import pytest
import torch
from flash_hopper import _lib, flash_attn_func, flash_attn_varlen_func
from flash_hopper.dispatch import head_dim_bucket
from flash_hopper.reference import attention_ref

# fp32 references stay fp32, not TF32 (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]

E4M3 = torch.float8_e4m3fn
HEAD_DIMS = [64, 96, 128, 192, 256]


@pytest.fixture
def fp8(lib):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 forward runs on compute capability 9.0 only")
    return lib


def require_fp8_kernel(lib, head_dim):
    if not lib.has_fwd_kernel(_lib.FhBackend.FA3, _lib.FhDtype.E4M3, head_dim):
        pytest.skip(f"this build has no e4m3 kernel for hdim bucket {head_dim_bucket(head_dim)}")


def make_fp8(b, sq, sk, hq, hkv, d):
    return (torch.randn(b, sq, hq, d, device="cuda").to(E4M3),
            torch.randn(b, sk, hkv, d, device="cuda").to(E4M3),
            torch.randn(b, sk, hkv, d, device="cuda").to(E4M3))


def dequantize(t, descale):
    """t (b, s, h, d) e4m3 -> float64 times its descale (b, heads_kv) per kv head group."""
    x = t.double()
    if descale is None:
        return x
    ds = descale.double().expand(t.shape[0], -1) if descale.dim() == 2 else descale.double()
    if ds.dim() == 2:
        ds = ds.repeat_interleave(t.shape[2] // ds.shape[1], dim=1)[:, None, :, None]
    return x * ds


def emulate(q, k, v, causal, scale, softcap=0.0):
    """Attention with P rounded to e4m3 for P V and unrounded in the row sum (float64 else)."""
    g = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(g, 1)
    vh = v.transpose(1, 2).repeat_interleave(g, 1)
    s = qh @ kh.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        sq, sk = s.shape[-2:]
        i = torch.arange(sq, device=s.device)[:, None]
        j = torch.arange(sk, device=s.device)[None]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(-1e300)
    p = torch.exp(s - m)
    p8 = p.float().to(E4M3).double()
    l = p.sum(-1, keepdim=True)
    out = (p8 @ vh) / torch.where(l == 0, torch.ones_like(l), l)
    return out.transpose(1, 2)


def rel_rms(a, b) -> float:
    diff = (a.double() - b.double()).pow(2).mean().sqrt()
    return (diff / b.double().pow(2).mean().sqrt().clamp_min(1e-30)).item()


def poisoned_call(q, k, v, **kwargs):
    """flash_attn_func with the caching allocator's next blocks full of NaN: an output element the
    kernel does not write shows up."""
    out_dtype = kwargs.get("out_dtype") or torch.bfloat16
    b, sq, hq, d = q.shape
    junk = [torch.full((b, sq, hq, d), float("nan"), dtype=out_dtype, device="cuda"),
            torch.full((b, hq, sq), float("nan"), dtype=torch.float32, device="cuda")]
    del junk
    return flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)


def check(out, lse, q, k, v, causal=False, q_descale=None, k_descale=None, v_descale=None,
          softcap=0.0):
    """out / lse against the float64 reference on the dequantized inputs, with bounds relative to
    the emulation's own error: over all rows, per (batch, head) (one wrong tile shows there), and
    per element (a few wrong rows pass an RMS bound, not this one)."""
    d = q.shape[-1]
    qq, kk, vv = dequantize(q, q_descale), dequantize(k, k_descale), dequantize(v, v_descale)
    ref, ref_lse = attention_ref(qq, kk, vv, causal=causal, softcap=softcap)
    emu = emulate(qq, kk, vv, causal, d**-0.5, softcap)
    assert not torch.isnan(out).any()
    seen = torch.isfinite(ref_lse)  # (b, h, sq)
    rows = seen.transpose(1, 2)  # (b, sq, h)
    # rows that see no key: exactly 0 and -inf
    assert (out[~rows] == 0).all()
    assert torch.isneginf(lse[~seen]).all()
    if not rows.any():
        return
    err, emu_err = rel_rms(out[rows], ref[rows]), rel_rms(emu[rows], ref[rows])
    assert err <= 1.5 * emu_err + 5e-3, (err, emu_err)
    assert err <= 0.045, err
    # The FP8 tensor cores accumulate q.k with ~14 mantissa bits (not fp32's 23): scores, and so
    # the LSE, carry a relative error of ~2^-13 (measured 0.005 at LSE ~ 20 with FA3's descales,
    # rand * 2); softcap's tanh is the hardware's approximation (~2^-11 of up to softcap).
    lse_tol = 2e-3 + 4e-4 * ref_lse[seen].abs() + 5e-4 * softcap
    assert ((lse[seen].double() - ref_lse[seen]).abs() <= lse_tol).all(), \
        (lse[seen].double() - ref_lse[seen]).abs().max().item()
    for b in range(out.shape[0]):
        for h in range(out.shape[2]):
            r = rows[b, :, h]
            if r.any():
                head_err = rel_rms(out[b, r, h], ref[b, r, h])
                head_emu = rel_rms(emu[b, r, h], ref[b, r, h])
                assert head_err <= 1.5 * head_emu + 1e-2, (b, h, head_err, head_emu)
    worst = (out[rows].double() - ref[rows]).abs().max().item()
    emu_worst = (emu[rows] - ref[rows]).abs().max().item()
    # The kernel rounds P to e4m3 against its running max (eager for FP8, p offset by 2^8:
    # softmax.h), the emulation against the final max: the same rounding in distribution, not
    # element by element (measured worst ratio 0.9-1.05; a lazy max for FP8, since dropped, gave
    # up to 4.9, a whole-row factor of 0.94-1.06 on rows dominated by one key; a tile with another
    # tile's descales gave 30x); bf16 output: 2^-9 relative.
    assert worst <= 3 * emu_worst + ref[rows].abs().max().item() * 2.0**-8, (worst, emu_worst)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("sq", "sk"), [(1, 1), (17, 33), (128, 128), (300, 1000), (1000, 300),
                                        (129, 2049)])
def test_fp8_matches_the_reference(fp8, head_dim, causal, sq, sk):
    require_fp8_kernel(fp8, head_dim)
    torch.manual_seed(sq * 7 + sk + head_dim)
    q, k, v = make_fp8(2, sq, sk, 4, 2, head_dim)
    out, lse = poisoned_call(q, k, v, causal=causal)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    check(out, lse, q, k, v, causal)


# FP8 d64 calls with at most 2048 keys run the short-keys tile (192 x 128 with ping-pong), longer
# ones the default (192 x 160 without): both sides of the switch, both masks, dense and varlen (the
# varlen kernel chooses by the max_seqlen_k hint).
@pytest.mark.parametrize("sk", [2048, 2049])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_short_keys_tile_switch(fp8, sk, causal):
    require_fp8_kernel(fp8, 64)
    torch.manual_seed(sk)
    q, k, v = make_fp8(1, 333, sk, 4, 2, 64)
    out, lse = poisoned_call(q, k, v, causal=causal)
    check(out, lse, q, k, v, causal)
    cu_q = torch.tensor([0, 333], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, sk], dtype=torch.int32, device="cuda")
    got = flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 333, sk, causal=causal)
    assert torch.equal(got, out[0]), "varlen: not the dense call's tile"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("layout", ["per_head", "expand", "scalar", "one", "strided"])
def test_descales(fp8, head_dim, layout):
    require_fp8_kernel(fp8, head_dim)
    torch.manual_seed(head_dim)
    b, hq, hkv = 2, 8, 2
    q, k, v = make_fp8(b, 300, 400, hq, hkv, head_dim)
    dev = "cuda"
    if layout == "per_head":
        qd, kd, vd = (torch.rand(b, hkv, device=dev) + 0.25 for _ in range(3))
    elif layout == "expand":  # what servers pass: one scale expanded to (b, h_kv), stride 0
        qd, kd, vd = (torch.tensor(s, device=dev).expand(b, hkv) for s in (0.5, 0.25, 2.0))
    elif layout == "scalar":
        qd, kd, vd = (torch.tensor(s, device=dev) for s in (0.5, 0.25, 2.0))
    elif layout == "one":
        qd, kd, vd = (torch.full((1,), s, device=dev) for s in (0.5, 0.25, 2.0))
    else:
        qd, kd, vd = (torch.rand(b, 2 * hkv, device=dev)[:, ::2] + 0.25 for _ in range(3))
    out, lse = poisoned_call(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd)
    full = [x if x.dim() == 2 else x.reshape(()).expand(b, hkv) for x in (qd, kd, vd)]
    check(out, lse, q, k, v, False, *full)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 15.0])
def test_each_tile_takes_its_own_descales(fp8, head_dim, causal, softcap):
    # More tiles than SMs: CTAs run several tiles back to back (the merged tile boundary issues
    # the next tile's first S under the last PV of the finishing one), each tile of a different
    # batch with descales drawn per (batch, kv head) as FA3's tests draw them (rand * 2). A tile
    # that scaled its first scores with the finishing tile's descales (the softcap factor read
    # before the boundary switched them; bench/PERFLOG.md "the FP8
    # defect") shows in the last batch's heads.
    require_fp8_kernel(fp8, head_dim)
    torch.manual_seed(head_dim + int(softcap) + causal)
    b, sq, sk, hq, hkv = 9, 512, 256, 6, 1
    q = (torch.randn(b, sq, hq, head_dim, device="cuda") * (softcap / 4 if softcap else 1))
    q = q.to(E4M3)
    k = torch.randn(b, sk, hkv, head_dim, device="cuda").to(E4M3)
    v = torch.randn(b, sk, hkv, head_dim, device="cuda").to(E4M3)
    qd, kd, vd = (torch.rand(b, hkv, device="cuda") * 2 for _ in range(3))
    out, lse = poisoned_call(q, k, v, causal=causal, softcap=softcap, q_descale=qd,
                             k_descale=kd, v_descale=vd)
    check(out, lse, q, k, v, causal, qd, kd, vd, softcap=softcap)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gqa_mqa_fp16_out_and_masks(fp8, head_dim):
    require_fp8_kernel(fp8, head_dim)
    torch.manual_seed(3)
    for hq, hkv in ((8, 1), (6, 3), (4, 4)):
        q, k, v = make_fp8(1, 257, 513, hq, hkv, head_dim)
        out, lse = poisoned_call(q, k, v, causal=True, out_dtype=torch.float16)
        assert out.dtype == torch.float16
        check(out, lse, q, k, v, True)
    # seqlen_q > seqlen_k, causal: the first rows see no key
    q, k, v = make_fp8(2, 300, 100, 2, 2, head_dim)
    out, lse = poisoned_call(q, k, v, causal=True)
    check(out, lse, q, k, v, True)
    assert (out[:, :200] == 0).all()


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fp8_is_deterministic(fp8, head_dim):
    require_fp8_kernel(fp8, head_dim)
    q, k, v = make_fp8(2, 1000, 1000, 4, 2, head_dim)
    first = flash_attn_func(q, k, v, causal=True)
    for _ in range(5):
        assert torch.equal(flash_attn_func(q, k, v, causal=True), first)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_two_level_accumulation_keeps_long_sums_exact(fp8, head_dim):
    # Uniform attention (q = 0) over 32k keys of one constant value: O must be that value. The FP8
    # tensor core's accumulator drops low bits once the running sum is large (ablation below);
    # two-level accumulation adds each block's PV into an fp32 O, which holds it exactly.
    require_fp8_kernel(fp8, head_dim)
    sk = 32768
    q = torch.zeros(1, 64, 1, head_dim, device="cuda").to(E4M3)
    k = torch.randn(1, sk, 1, head_dim, device="cuda").to(E4M3)
    v = torch.full((1, sk, 1, head_dim), 1.5, device="cuda").to(E4M3)
    out = flash_attn_func(q, k, v)
    assert (out.float() - 1.5).abs().max().item() <= 1e-2
    if head_dim > 128:  # the d192 / d256 kernels accumulate in two levels only
        with pytest.raises(ValueError, match="'single-level' .the ablation. exists for head_dim"):
            flash_attn_func(q, k, v, fp8_accumulation="single-level")
        return
    single = flash_attn_func(q, k, v, fp8_accumulation="single-level")
    assert not torch.isnan(single).any()  # the ablation runs; its error is measured, not bounded


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_long_uniform_attention_keeps_the_values_mean(fp8, head_dim):
    # Uniform attention (q = 0) over 32k keys of random values (mean 2): O is their mean. The FP8
    # tensor core's accumulator truncates, a bias toward zero that grows with the number of PV
    # GEMMs summed in it before the fp32 fold; the constant values of the test above hide it
    # (their partial sums are exact), random ones do not: chains of 2048 keys and more between
    # folds fail this bound (bench/PERFLOG.md), the kernels' chains of <= 1024 keys pass it.
    require_fp8_kernel(fp8, head_dim)
    torch.manual_seed(head_dim)
    sk = 32768
    q = torch.zeros(1, 64, 1, head_dim, device="cuda").to(E4M3)
    k = torch.randn(1, sk, 1, head_dim, device="cuda").to(E4M3)
    v = (torch.randn(1, sk, 1, head_dim, device="cuda") + 2).to(E4M3)
    out = flash_attn_func(q, k, v)[0, :, 0].double()
    ref = v[0, :, 0].double().mean(0)
    rel = (out - ref) / ref.abs().clamp_min(0.1)
    assert abs(rel.mean().item()) <= 3e-3, rel.mean().item()
    assert rel.abs().max().item() <= 2e-2, rel.abs().max().item()


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_row_max_jump_between_folds(fp8, head_dim):
    # Every row's max jumps by ~70-100 nats at key 1500 and stays there over 4k keys: the fold of
    # the PV chain after the jump meets a rescale far below 2^-64 since the earlier folds (whose
    # values then vanish), and the folds after it must weight the later keys alike.
    require_fp8_kernel(fp8, head_dim)
    torch.manual_seed(head_dim)
    sk, jump = 4096, 1500
    q = torch.ones(1, 64, 2, head_dim, device="cuda").to(E4M3)
    k = torch.randn(1, sk, 2, head_dim, device="cuda") * 0.3
    k[:, jump:] += 6.0 * 16 / head_dim**0.5
    k, v = k.to(E4M3), torch.randn(1, sk, 2, head_dim, device="cuda").to(E4M3)
    out, lse = poisoned_call(q, k, v)
    check(out, lse, q, k, v)


def needle_readout(q8, k8, v8, u, **kwargs):
    """<out, u> / <u, u> per query row: the share of the needle's value in the output."""
    out = flash_attn_func(q8, k8, v8, **kwargs).double()
    return (out[0, :, 0] @ u.double()) / u.double().dot(u.double())


def make_needles(sk, head_dim, rows=8, seed=0):
    """rows queries of norm sqrt(head_dim) (each needle scores ~sqrt(head_dim) = 11 at d128, the
    noise keys ~N(0, 1)); key i_r (random) equals query r (its needle), value there is u; the other
    keys and values are N(0, 1) noise. All in e4m3, so the bf16 run sees the same numbers. The
    needle's expected share: e^11 / (e^11 + 1.65 sk): ~0.6 at 32k, ~0.27 at 128k keys."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(1, rows, 1, head_dim, generator=g)
    q = (q / q.norm(dim=-1, keepdim=True) * head_dim**0.5).to(E4M3)
    k = torch.randn(1, sk, 1, head_dim, generator=g).to(E4M3)
    v = torch.randn(1, sk, 1, head_dim, generator=g).to(E4M3)
    u = (torch.randn(head_dim, generator=g) * 2).to(E4M3)
    where = torch.randperm(sk, generator=g)[:rows]
    k[0, where, 0] = q[0, :, 0]
    v[0, where, 0] = u
    return q.cuda(), k.cuda(), v.cuda(), u.float().cuda()


@pytest.mark.parametrize("sk", [32768, 65536, 131072])
def test_needle_readout_matches_bf16(fp8, sk):
    # Long-context retrieval: the FP8 output's needle share matches the bf16 path's on the same
    # (e4m3-representable) inputs within 8 % (P's e4m3 rounding: up to 6.25 % on the needle's
    # weight) + 0.01.
    require_fp8_kernel(fp8, 128)
    if not (fp8.has_fwd_kernel(_lib.FhBackend.FA3, _lib.FhDtype.BF16, 128)
            or fp8.has_fwd_kernel(_lib.FhBackend.FA2, _lib.FhDtype.BF16, 128)):
        pytest.skip("the bf16 read-out needs a bf16 hdim-128 forward kernel (an e4m3-only build)")
    q, k, v, u = make_needles(sk, 128, seed=sk)
    r_fp8 = needle_readout(q, k, v, u)
    r_bf16 = needle_readout(q.bfloat16(), k.bfloat16(), v.bfloat16(), u)
    assert (r_bf16 > 0.1).all(), r_bf16  # the needle is findable at all
    assert ((r_fp8 - r_bf16).abs() <= 0.08 * r_bf16 + 0.01).all(), (r_fp8, r_bf16)
