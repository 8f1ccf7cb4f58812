"""The benchmark's mixed mode (bf16+e4m3, fp16+e4m3, bf16+e5m2, fp16+e5m2: 16-bit q against an FP8
K / V cache) on CPU: parsing, FLOPs, bytes and ceilings, the inputs (a per-head quantized K / V
cache that dequantizes back), the check (the 16-bit rule against fp32 on the dequantized K / V),
which backends take mixed cases and why the others are skipped, our backend's calls (the kernel
library stood in), the comparison with the 16-bit rows, and the bench command with the GPU mocked.

The mixed kernel is stood in by ``mixed_attention``, a torch emulation of what it computes (K / V
converted exactly to q's dtype, the descales folded into the fp32 score scale and output, P rounded
to q's dtype for P V): the check must pass it, and fail a lost descale, a descale applied to the
wrong head, or keys out of order.
"""

import math
import sys
import types

import pytest
import torch
from _helpers import emulated_attention, fake_build_info, mock_h200_bench, run_on_cpu
from flash_hopper import _tables, cli
from flash_hopper.bench import backends, cases, check, peak, peers, registry, report, runner
from flash_hopper.bench.base import Backend
from flash_hopper.bench.cases import Case
from flash_hopper.bench.fp8_inputs import Fp8Input, dequantize, quantize_kv_cache
from flash_hopper.bench.runner import RunOptions
from flash_hopper.bench.timing import Stats
from flash_hopper.reference import attention_ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
H100 = (9, 0)
MIXED = ("bf16+e4m3", "fp16+e4m3", "bf16+e5m2", "fp16+e5m2")
# Like a mixed-mode dev build: FA-2 and FA-3 bf16 kernels and the FA-3 bf16+e4m3 forward at head
# dims 64 / 128, its entry listing the tuned (0) and fa3-no-pingpong (1) variants as the real
# build_info does (the host path still runs the mixed mode on the tuned kernel only).
MIXED_BUILD = {
    "version": "0.1.0", "commit": "abc", "archs": ["sm80", "sm90a"], "head_dims": [64, 128],
    "dtypes": ["bf16", "bf16+e4m3"], "cuda": "13.0",
    "variants": {"fa3": 0, "fa3-no-pingpong": 1},
    "fa3_variants": ["fa3-no-pingpong"], "backward": False,
    "kernels": [{"direction": "fwd", "backend": backend, "dtype": dtype, "head_dim": d,
                 "variants": [0, 1]}
                for backend, dtype in (("fa2", "bf16"), ("fa3", "bf16"), ("fa3", "bf16+e4m3"))
                for d in (64, 128)],
}


def mixed_case(**overrides):
    fields = {"batch": 2, "seqlen_q": 64, "seqlen_k": 64, "heads": 4, "heads_kv": 2,
              "head_dim": 64, "dtype": "bf16+e4m3"}
    fields.update(overrides)
    return Case(**fields)


def make_inputs(case, seed=0):
    return runner.make_inputs(case, "cpu", torch.Generator().manual_seed(seed))


def per_head(descale, batch, heads):
    """A (batch, heads_kv) descale (or None) as (batch, heads, 1, 1), repeated over the query
    heads of each kv head."""
    if descale is None:
        return torch.ones(batch, heads, 1, 1)
    return descale.float().repeat_interleave(heads // descale.shape[1], dim=1)[:, :, None, None]


def mixed_attention(q, k8, v8, k_descale=None, v_descale=None, causal=False,
                    window_size=(-1, -1), error=None):
    """The mixed kernel emulated on CPU: K / V converted to q's dtype (exact), scores in fp32 with
    k_descale folded into the scale, P = exp(s - max) rounded to q's dtype for P V, the output
    times v_descale in fp32, then rounded to q's dtype; (out, lse). ``error``: a function of the
    fp32 output standing in for a bug."""
    batch, _, heads, head_dim = q.shape
    group = heads // k8.shape[2]
    qh = q.float().transpose(1, 2)
    kh, vh = (t.to(q.dtype).float().repeat_interleave(group, dim=2).transpose(1, 2)
              for t in (k8, v8))
    out, lse = emulated_attention(qh, kh, vh, per_head(k_descale, batch, heads) / math.sqrt(head_dim),
                                  causal, window_size, q.dtype, per_head(v_descale, batch, heads),
                                  error)
    return out.transpose(1, 2).to(q.dtype), lse


class EmulatedMixed(Backend):
    """A backend with a mixed-mode path: the emulated kernel on q and the k, v Fp8Inputs."""

    name = "emulated-mixed"
    origin = "flash-hopper"

    def __init__(self, error=None):
        self.error = error

    def mixed_reason(self):
        return None

    def make_forward(self, q, k, v, case):
        return lambda: self.run_checked(q, k, v, case)[0]

    def run_checked(self, q, k, v, case):
        return mixed_attention(q, k.data, v.data, k.descale, v.descale, case.causal,
                               case.window, self.error)


class SameDtypeOnly(Backend):
    """A peer without a mixed-mode path (base.Backend's mixed_reason)."""

    name = "same-dtype-only"
    origin = "torch"

    def make_forward(self, q, k, v, case):
        raise AssertionError("a mixed case must never reach a backend without a mixed path")


run = run_on_cpu


# ---- dtype names, cases, FLOPs and bytes ------------------------------------------------------


def test_mixed_names_are_the_librarys():
    # The CLI spells them out (no torch at --help); they must stay build_info's names.
    assert cases.MIXED_DTYPES == MIXED
    assert set(cases.MIXED_DTYPES) == set(_tables.MIXED_DTYPES)
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": E4M3, "e5m2": E5M2}
    for name, (q_dtype, kv_dtype) in cases.MIXED_PARTS.items():
        assert (names[q_dtype], names[kv_dtype]) == _tables.MIXED_DTYPES[name]
    assert set(MIXED) <= set(cases.DTYPES)


@pytest.mark.parametrize("dtype", MIXED)
def test_mixed_case_properties(dtype):
    q_dtype, kv_dtype = dtype.split("+")
    c = mixed_case(dtype=dtype)
    assert c.is_mixed and not c.is_fp8
    assert (c.q_dtype, c.kv_dtype, c.out_dtype) == (q_dtype, kv_dtype, q_dtype)
    assert cases.gemm_dtype(dtype) == q_dtype
    assert c.no_backward_reason == cases.MIXED_NO_BACKWARD
    half = mixed_case(dtype=q_dtype)
    assert not half.is_mixed and half.no_backward_reason is None
    assert (half.q_dtype, half.kv_dtype, half.out_dtype) == (q_dtype, q_dtype, q_dtype)
    assert mixed_case(dtype="e4m3").no_backward_reason == cases.FP8_NO_BACKWARD
    assert cases.gemm_dtype("e4m3") == "e4m3" and cases.gemm_dtype("fp16") == "fp16"


@pytest.mark.parametrize("causal", [False, True])
def test_mixed_flops_are_the_16_bit_ones_and_kv_is_one_byte(causal):
    b, s, h, d = 2, 256, 4, 128
    c = mixed_case(batch=b, seqlen_q=s, seqlen_k=s, heads=h, heads_kv=h, head_dim=d,
                   causal=causal)
    # 4 b s^2 h d, halved for causal (the FA convention): the same two 16-bit GEMMs
    assert c.flops() == 4 * b * s * s * h * d / (2 if causal else 1)
    assert c.flops() == mixed_case(batch=b, seqlen_q=s, seqlen_k=s, heads=h, heads_kv=h,
                                   head_dim=d, causal=causal, dtype="bf16").flops()
    gqa = mixed_case(seqlen_q=128, seqlen_k=256)  # heads 4, heads_kv 2, d 64
    q_or_o = 2 * 128 * 4 * 64
    k_and_v = 2 * 2 * 256 * 2 * 64
    assert gqa.input_bytes() == 2 * q_or_o + 2 * q_or_o + k_and_v  # bf16 q and out, 1-byte k, v
    assert mixed_case(seqlen_q=128, seqlen_k=256, dtype="bf16").input_bytes() == (
        2 * (2 * q_or_o + k_and_v))
    assert mixed_case(seqlen_q=128, seqlen_k=256, dtype="fp16+e5m2").input_bytes() == (
        gqa.input_bytes())


def parse_bench(*argv):
    args = cli.build_parser().parse_args(["bench", *argv])
    return args, cases.expand(cli.sweep_spec(args))


def test_cli_parses_mixed_dtypes_next_to_bf16():
    args, sweep = parse_bench("--dtype", "bf16", "bf16+e4m3", "fp16+e5m2", "-d", "64,128",
                              "-s", "1k", "--causal", "on")
    assert [c.dtype for c in sweep] == ["bf16"] * 2 + ["bf16+e4m3"] * 2 + ["fp16+e5m2"] * 2
    for half, mixed in zip(sweep[:2], sweep[2:4]):
        assert mixed.is_mixed and not half.is_mixed
        assert (mixed.batch, mixed.heads, mixed.head_dim) == (half.batch, half.heads,
                                                                half.head_dim)
        assert mixed.flops() == half.flops()
    cli.check_directions(cli.sweep_spec(args).dtypes, cli.directions(args))  # fwd: accepted


def test_cli_refuses_unknown_mixed_names(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["bench", "--dtype", "bf16+e6m1"])
    assert exit_info.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "argument --dtype: expected one of fp16, bf16, e4m3, bf16+e4m3" in err, err
    assert "got 'bf16+e6m1'" in err, err


@pytest.mark.parametrize("directions", [["bwd"], ["fwd", "fwd+bwd"]])
def test_mixed_with_a_backward_direction_is_refused(capsys, directions):
    argv = ["bench", "--dry-run", "--dtype", "bf16", "bf16+e4m3", "--direction", *directions]
    assert cli.main(argv) == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert "--dtype bf16+e4m3 is forward only (the mixed mode has no backward)" in err
    assert f"--direction asks for {' '.join(d for d in directions if 'bwd' in d)}" in err
    with pytest.raises(ValueError, match="the FP8 path and the mixed mode have no backward"):
        cli.check_directions(["e4m3", "fp16+e5m2"], ["bwd"])


def test_mixed_dry_run_lists_the_plan(capsys):
    assert cli.main(["bench", "--dry-run", "--dtype", "bf16", "bf16+e4m3", "-s", "2k", "-d",
                     "128", "--causal", "on", "--backends", "fa3"]) == 0
    out = capsys.readouterr().out
    assert "2 configurations x 1 direction(s) x backends fa3" in out
    assert "bf16+e4m3 d=128 s=2048 b=8 h=16/16 causal" in out


def test_help_documents_the_mixed_dtypes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "bf16+e4m3 / fp16+e4m3 / bf16+e5m2 / fp16+e5m2 = the mixed mode" in text
    assert "'--dtype bf16 bf16+e4m3' times both and compares them" in text


# ---- ceilings --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", MIXED)
def test_mixed_rows_use_the_16_bit_peak(dtype):
    assert peak.lookup_peak("NVIDIA H200", dtype) == (989.4,
                                                      "datasheet H100/H200 SXM dense bf16/fp16")
    # An A100 has no FP8 tensor cores, but the mixed mode's GEMMs are 16-bit: its peak applies.
    assert peak.lookup_peak("NVIDIA A100-SXM4-80GB", dtype)[0] == 312.0


def test_mixed_gemm_ceiling_is_a_16_bit_mm(monkeypatch):
    seen = []
    mm = torch.mm

    def recording(a, b, out=None):
        seen.append((a.dtype, b.dtype))
        return mm(a, b, out=out)

    monkeypatch.setattr(torch, "mm", recording)

    class OnceTimer:
        def measure(self, fns):
            for fn in fns:
                fn()
            return Stats(median=2.0, p20=2.0, p80=2.0, n=1)

    gemm = peak.measure_gemm_ceiling(OnceTimer(), dtype="fp16+e5m2", size=32, device="cpu")
    assert (gemm["dtype"], gemm["op"]) == ("fp16", "torch.mm")
    assert seen == [(torch.float16, torch.float16)]


# ---- inputs: a K / V cache quantized per head -------------------------------------------------


@pytest.mark.parametrize("dtype", MIXED)
def test_mixed_inputs_are_the_16_bit_inputs_with_a_quantized_kv_cache(dtype):
    c = mixed_case(dtype=dtype)
    q, k8, v8 = make_inputs(c)
    # Same seed, same draws: the row of q's dtype times the same q, and k, v up to FP8 rounding.
    half_q, half_k, half_v = make_inputs(mixed_case(dtype=c.q_dtype))
    torch_q = {"bf16": torch.bfloat16, "fp16": torch.float16}[c.q_dtype]
    torch_kv = {"e4m3": E4M3, "e5m2": E5M2}[c.kv_dtype]
    assert isinstance(q, torch.Tensor) and q.dtype == torch_q and torch.equal(q, half_q)
    # e4m3 keeps 3 mantissa bits, e5m2 2: half an ulp is 2^-4 / 2^-3 of a value; near zero, half
    # the smallest subnormal (2^-10 / 2^-17) times the descale.
    relative, subnormal = {"e4m3": (2**-4, 2**-10), "e5m2": (2**-3, 2**-17)}[c.kv_dtype]
    for t8, t in ((k8, half_k), (v8, half_v)):
        assert isinstance(t8, Fp8Input)
        assert t8.data.dtype == torch_kv and t8.data.shape == t.shape
        assert t8.descale.dtype == torch.float32 and t8.descale.shape == (2, 2)  # (b, heads_kv)
        real = t8.dequantize()
        bound = relative * t.float().abs() + subnormal * t8.descale.max()
        assert torch.all((real - t.float()).abs() <= bound)
        # a KV cache's per-head scale: each (batch, kv head) reaches the dtype's largest value
        amax = t8.data.float().abs().amax(dim=(1, 3))
        assert torch.all(amax == torch.finfo(torch_kv).max)


def test_quantize_kv_cache_round_trips_other_scales():
    gen = torch.Generator().manual_seed(1)
    # heads of very different magnitudes: a per-head scale keeps each one's relative precision
    k = torch.randn(1, 32, 3, 16, generator=gen) * torch.tensor([1e-3, 1.0, 300.0])[:, None]
    v = torch.randn(1, 32, 3, 16, generator=gen)
    k8, v8 = quantize_kv_cache(k, v, "e5m2")
    assert k8.data.dtype == v8.data.dtype == E5M2
    ratio = k8.descale[0] / k8.descale[0, 0]
    assert ratio[1] > 100 and ratio[2] > 1e4  # scales follow the heads
    real = dequantize(k8.data, k8.descale)
    assert torch.all((real - k).abs() <= 2**-3 * k.abs() + 2**-17 * k8.descale.max(dim=1).values)
    assert torch.allclose(v8.dequantize(), v, rtol=2**-3, atol=1e-4)
    with pytest.raises(ValueError, match="dtype: expected an FP8 K / V dtype, one of e4m3, e5m2, torch.float8_e4m3fn, "
                                         "torch.float8_e5m2, got 'e2m1'"):
        quantize_kv_cache(k, v, "e2m1")


# ---- the check: the 16-bit rule against fp32 on q and the dequantized k, v ---------------------


@pytest.mark.parametrize("causal", [False, True])
def test_mixed_reference_is_fp32_attention_on_the_dequantized_cache(causal):
    c = mixed_case(seqlen_q=48, seqlen_k=80, causal=causal)
    q, k, v = make_inputs(c)
    refs = check.MixedReferences(q, k, v, c)
    out, lse = attention_ref(q.float(), k.dequantize(), v.dequantize(), causal=causal)
    assert refs.out.dtype == torch.float32
    assert torch.allclose(refs.out, out, atol=1e-6) and torch.allclose(refs.lse, lse, atol=1e-5)
    # the same-precision error: bf16 attention on q and the dequantized k, v rounded to bf16
    lowp, _ = attention_ref(q, k.dequantize().to(q.dtype), v.dequantize().to(q.dtype),
                            causal=causal, upcast=False)
    assert refs.ref_err == pytest.approx(check.max_abs_diff(lowp, out), rel=1e-3, abs=1e-6)
    assert refs.ref_err > 1e-4  # a real bf16 baseline, not zero
    assert refs.shape == "b2 sq48 sk80"


@pytest.mark.parametrize("dtype", ["bf16+e4m3", "fp16+e5m2"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (16, 8))])
def test_emulated_mixed_kernel_passes_and_bugs_fail(dtype, causal, window):
    c = mixed_case(seqlen_q=192, seqlen_k=192, causal=causal, window=window, dtype=dtype)
    q, k, v = make_inputs(c)
    refs = check.MixedReferences(q, k, v, c)
    good = refs.check(*mixed_attention(q, k.data, v.data, k.descale, v.descale, causal, window))
    assert good.passed and good.metric == check.METRIC_MAX_ABS, good
    assert good.err <= good.tol == check.tolerance(refs.ref_err)
    assert good.lse_err < 1e-4
    # v_descale ignored: the output off by a factor 1 / descale (~1e2 for e4m3, ~1e4 for e5m2).
    assert not refs.check(*mixed_attention(q, k.data, v.data, k.descale, None, causal,
                                           window)).passed
    # k_descale ignored: scores ~1e2 / 1e4 times too large; the LSE shows it first.
    assert not refs.check(*mixed_attention(q, k.data, v.data, None, v.descale, causal,
                                           window)).passed
    # A kv head's descale applied to the other head's values (heads of different scales).
    skewed = Fp8Input(v.data, v.descale * torch.tensor([1.0, 3.0]))
    refs = check.MixedReferences(q, k, skewed, c)
    swapped = mixed_attention(q, k.data, v.data, k.descale, skewed.descale.flip(1), causal,
                              window)
    assert not refs.check(*swapped).passed
    # Keys of v out of order (a transpose bug).
    flipped = mixed_attention(q, k.data, v.data.flip(1), k.descale, v.descale, causal, window)
    assert not refs.check(*flipped).passed
    # An output a few bf16 ulps off everywhere: beyond 2x the bf16 baseline's error.
    assert not refs.check(*mixed_attention(q, k.data, v.data, k.descale, v.descale, causal,
                                           window, error=lambda out: out * 1.05)).passed


# ---- the runner on mixed cases ----------------------------------------------------------------


def test_runner_times_mixed_backends_and_skips_the_others():
    c = mixed_case(causal=True)
    rows = run([EmulatedMixed(), SameDtypeOnly()], [c],
               peak_tflops={"bf16+e4m3": 989.4, "e4m3": 1978.9}, gemm_tflops={"bf16+e4m3": 700})
    mixed_row, skipped = rows
    assert mixed_row["status"] == "ok" and mixed_row["dtype"] == "bf16+e4m3"
    assert mixed_row["check_pass"] is True and mixed_row["check_metric"] == "max-abs"
    assert mixed_row["check_ref_err"] > 0 and mixed_row["check_lse_tol"] == check.LSE_ATOL
    assert mixed_row["flops"] == c.flops()
    assert mixed_row["pct_peak"] == pytest.approx(100 * mixed_row["tflops"] / 989.4)
    assert mixed_row["pct_gemm"] == pytest.approx(100 * mixed_row["tflops"] / 700)
    assert skipped["status"] == "skipped"
    assert skipped["reason"] == (
        "unsupported (no mixed mode): no mixed-mode path: q, k and v must share one dtype")


def test_a_wrong_mixed_output_fails_its_check():
    (row,) = run([EmulatedMixed(error=lambda out: out * 1.2)], [mixed_case()])
    assert row["status"] == "ok" and row["check_pass"] is False
    assert row["check_err"] > row["check_tol"]


def test_mixed_backward_rows_are_skipped_without_a_gradient_reference(monkeypatch):
    def no_grad_references(*args, **kwargs):
        raise AssertionError("no gradient reference for the mixed mode")

    monkeypatch.setattr(check, "GradReferences", no_grad_references)
    rows = run([EmulatedMixed()], [mixed_case()], directions=("fwd", "bwd", "fwd+bwd"))
    assert [(r["direction"], r["status"]) for r in rows] == [
        ("fwd", "ok"), ("bwd", "skipped"), ("fwd+bwd", "skipped")]
    assert rows[1]["reason"] == rows[2]["reason"] == cases.MIXED_NO_BACKWARD
    assert rows[1]["check_pass"] is True  # the forward's check still reported


# ---- which backends take mixed cases ------------------------------------------------------------


def fake_package(name):
    module = types.ModuleType(name)

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                        k_descale=None, v_descale=None, window_size=(-1, -1), softcap=0.0):
        raise AssertionError("a mixed case must not reach an FA package")

    module.flash_attn_func = flash_attn_func
    return module


def test_peers_have_no_mixed_mode(monkeypatch):
    c = mixed_case()
    for kind in peers.SDPA_KINDS:
        reason = runner.fp8_skip_reason(peers.SdpaBackend(kind), c)
        assert reason == ("unsupported (no mixed mode): torch SDPA takes q, k and v of one fp16 / "
                          "bf16 / fp32 dtype, not FP8 k / v with descales"), kind
    assert "FlexAttention takes q, k and v of one dtype" in runner.fp8_skip_reason(
        peers.FlexBackend(), c)
    assert runner.fp8_skip_reason(peers.SdpaBackend("flash"), mixed_case(dtype="bf16")) is None
    # FA packages, FA3's with descales too: q, k, v of one dtype.
    for module in ("flash_attn", "flash_attn_interface", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, module, fake_package(module))
    known = registry.known_backends(include_variants=False)
    for name, module in (("flash-attn", "flash_attn"), ("flash-attn3", "flash_attn_interface"),
                         ("flash-attn-cute", "flash_attn.cute")):
        assert known[name].probe(H100) is None
        assert runner.fp8_skip_reason(known[name], c) == (
            f"unsupported (no mixed mode): {module}.flash_attn_func takes q, k and v of one "
            f"dtype, not 16-bit q with FP8 k / v")
    assert known["flash-attn3"].fp8_reason() is None  # ... while it takes e4m3 cases
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    unimportable = registry.known_backends(include_variants=False)["flash-attn"]
    assert unimportable.mixed_reason() == "not importable"


def test_our_mixed_mode_runs_on_fa3_only(monkeypatch):
    fake_build_info(monkeypatch, MIXED_BUILD)
    known = registry.known_backends()
    c = mixed_case()
    assert runner.fp8_skip_reason(known["fa3"], c) is None
    assert known["fa3"].unsupported(c) is None and known["fa3"].unsupported(c, "fwd") is None
    assert runner.fp8_skip_reason(known["fa2"], c) == (
        "unsupported (no mixed mode): the FA-2 path has no mixed-mode kernels (the mixed mode "
        "runs on fa3)")
    # build_info lists variant 1 for the mixed kernel, but the host path runs the tuned one only.
    assert runner.fp8_skip_reason(known["fa3-no-pingpong"], c) == (
        "unsupported (no mixed mode): the FA-3 ablation variants (fa3-no-pingpong) have no "
        "mixed-mode kernels: the mixed mode runs on the tuned fa3 kernel only")
    assert "the FP8 accumulation ablation" in runner.fp8_skip_reason(
        known[backends.FP8_SINGLE_LEVEL], c)
    # the same reasons from unsupported(), for programmatic callers that skip fp8_skip_reason
    assert known["fa2"].unsupported(c) == known["fa2"].mixed_reason()
    assert known["fa3-no-pingpong"].unsupported(c) == known["fa3-no-pingpong"].mixed_reason()


def test_our_mixed_support_follows_the_rules_and_the_kernel_list(monkeypatch):
    fake_build_info(monkeypatch, MIXED_BUILD)
    fa3 = backends.FlashHopperBackend("fa3", "fa3")
    assert fa3.unsupported(mixed_case(head_dim=128)) is None
    assert fa3.unsupported(mixed_case(), "bwd") == cases.MIXED_NO_BACKWARD
    assert fa3.unsupported(mixed_case(), "fwd+bwd") == cases.MIXED_NO_BACKWARD
    assert fa3.unsupported(mixed_case(head_dim=72)) == (
        "the mixed mode needs head_dim a multiple of 16 (16-byte rows of FP8 K / V), got 72")
    assert fa3.unsupported(mixed_case(head_dim=80)) == (
        "the mixed mode has kernels for head-dim buckets 64, 128, 256, got d=80 (bucket 96)")
    assert fa3.unsupported(mixed_case(dtype="fp16+e5m2")) == (
        "library built without fp16+e5m2 (dtypes: bf16, bf16+e4m3)")
    only_128 = dict(MIXED_BUILD, kernels=[e for e in MIXED_BUILD["kernels"]
                                          if (e["dtype"], e["head_dim"]) != ("bf16+e4m3", 64)])
    fake_build_info(monkeypatch, only_128)
    fa3 = backends.FlashHopperBackend("fa3", "fa3")
    assert fa3.unsupported(mixed_case(head_dim=64)) == (
        "library built without an fa3 bf16+e4m3 forward kernel for head-dim bucket 64")
    assert fa3.unsupported(mixed_case(head_dim=128)) is None


class FakeFlashAttn:
    """flash_attn_func on CPU: mixed calls (FP8 k, v) through mixed_attention, 16-bit ones
    through the fp32 reference rounded to q's dtype; records each call and keeps what it
    returned."""

    def __init__(self):
        self.calls, self.returned = [], []

    def __call__(self, q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                 k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                 softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                 return_attn_probs=False, *, backend="auto", out_dtype=None,
                 fp8_accumulation="two-level"):
        self.calls.append({"dtypes": (q.dtype, k.dtype, v.dtype), "backend": backend,
                           "descales": (q_descale, k_descale, v_descale), "causal": causal,
                           "window_size": window_size, "return_attn_probs": return_attn_probs,
                           "fp8_accumulation": fp8_accumulation, "out_dtype": out_dtype})
        if k.dtype in (E4M3, E5M2):
            out, lse = mixed_attention(q, k, v, k_descale, v_descale, causal, window_size)
        else:
            out, lse = attention_ref(q, k, v, causal=causal, window_size=window_size)
            out = out.to(q.dtype)
        self.returned.append((out, lse))
        return (out, lse) if return_attn_probs else out


def fake_host_plan(monkeypatch):
    """_validate.check_fp8_args run for real but without the CUDA device checks (CPU tensors),
    and a stand-in plan naming fa3; returns what each saw."""
    from flash_hopper import _fwd, _validate

    seen = {}
    real_check = _validate.check_fp8_args

    def checking(*args):
        seen["check"] = args
        return real_check(*args, devices=False)

    def planning(cfg, q, k, v, **kwargs):
        seen["plan"] = (cfg, q.dtype, k.dtype, kwargs["fp8"])
        return types.SimpleNamespace(backend="fa3", reason="forced: backend='fa3'")

    monkeypatch.setattr(_validate, "check_fp8_args", checking)
    monkeypatch.setattr(_fwd, "make_plan", planning)
    return seen


@pytest.fixture
def fake_call(monkeypatch):
    import flash_hopper

    fake = FakeFlashAttn()
    monkeypatch.setattr(flash_hopper, "flash_attn_func", fake)
    return fake


def test_our_mixed_calls_pass_q_and_the_kv_cache_with_its_descales(fake_call):
    c = mixed_case(causal=True, dtype="fp16+e5m2")
    q, k, v = make_inputs(c)
    out = backends.FlashHopperBackend("fa3", "fa3").make_forward(q, k, v, c)()
    (call,) = fake_call.calls
    assert call["dtypes"] == (torch.float16, E5M2, E5M2)
    assert call["descales"] == (None, k.descale, v.descale)  # no q_descale: q is not FP8
    assert (call["backend"], call["causal"], call["return_attn_probs"]) == ("fa3", True, False)
    assert call["fp8_accumulation"] == "two-level" and call["out_dtype"] is None
    assert out.dtype == torch.float16 and out.shape == q.shape


def test_our_mixed_check_runs_in_nan_filled_blocks(fake_call):
    c = mixed_case()
    q, k, v = make_inputs(c)
    out, lse = backends.FlashHopperBackend("fa3", "fa3").run_checked(q, k, v, c)
    assert [call["return_attn_probs"] for call in fake_call.calls] == [True, True]
    first_out, first_lse = fake_call.returned[0]
    assert first_out.isnan().all() and first_lse.isnan().all()
    assert out is fake_call.returned[1][0] and lse is fake_call.returned[1][1]
    assert check.MixedReferences(q, k, v, c).check(out, lse).passed


def test_our_mixed_kernel_name_comes_from_the_host_plan(monkeypatch):
    seen = fake_host_plan(monkeypatch)
    c = mixed_case(causal=True, window=(32, -1), softcap=5.0, dtype="bf16+e5m2")
    q, k, v = make_inputs(c)
    assert backends.FlashHopperBackend("fa3", "fa3").kernel(q, k, v, c) == (
        "fa3", "forced: backend='fa3'; mixed mode: bf16 q, e5m2 K / V, 16-bit GEMMs")
    assert seen["check"] == (q, k.data, v.data, None, True, (32, -1), 5.0, "fa3", None,
                             k.descale, v.descale, None, "two-level")
    cfg, q_dtype, k_dtype, options = seen["plan"]
    assert (q_dtype, k_dtype) == (torch.bfloat16, E5M2)
    # the real validation took them as the mixed mode: output in q's dtype, K / V in e5m2
    assert (options.out_dtype, options.kv_dtype) == (torch.bfloat16, E5M2)
    assert (cfg.heads_q, cfg.heads_kv, cfg.head_dim) == (4, 2, 64)


# ---- reported next to the 16-bit rows -----------------------------------------------------------


def timed_row(dtype, ms, backend="fa3", seqlen=1024):
    row = runner.base_row(mixed_case(dtype=dtype, seqlen_q=seqlen, seqlen_k=seqlen), backend,
                          "fwd")
    runner.fill_timing(row, Stats(median=ms, p20=ms, p80=ms, n=1), RunOptions())
    return row


def test_comparison_pairs_each_mixed_row_with_its_16_bit_row():
    rows = [timed_row("bf16", 1.2), timed_row("bf16+e4m3", 1.0), timed_row("fp16+e5m2", 0.5),
            timed_row("fp16", 0.4), timed_row("bf16+e4m3", 0.9, backend="other"),
            timed_row("bf16+e4m3", 0.9, seqlen=2048), timed_row("bf16", 2.0, seqlen=4096)]
    lines = report.format_mixed_comparison(rows).splitlines()
    assert lines == [
        "fa3 fwd non-causal d=64 s=1024 b=2 h=4/2: bf16+e4m3 1.000 ms vs bf16 1.200 ms, 1.20x",
        "fa3 fwd non-causal d=64 s=1024 b=2 h=4/2: fp16+e5m2 0.500 ms vs fp16 0.400 ms, 0.80x",
    ]
    skipped = dict(timed_row("bf16", 1.0), status="skipped")
    assert report.format_mixed_comparison([skipped, timed_row("bf16+e4m3", 1.0)]) == ""
    assert report.format_mixed_comparison([timed_row("e4m3", 1.0), timed_row("bf16", 1.0)]) == ""


# ---- the bench command with the GPU mocked: CPU tensors, a stand-in timer -----------------------


def _mixed_library(monkeypatch):
    """MIXED_BUILD stood in: flash_attn_func emulated on CPU (FakeFlashAttn), the host plan of
    mixed calls named (fake_host_plan), and the 16-bit check and kernel entry points (ops.fwd_into,
    which_backend) answered from the reference."""
    import flash_hopper
    from flash_hopper import ops

    fake_build_info(monkeypatch, MIXED_BUILD)
    fake = FakeFlashAttn()
    monkeypatch.setattr(flash_hopper, "flash_attn_func", fake)
    fake_host_plan(monkeypatch)

    def fwd_into(q, k, v, out, lse, softmax_scale, left, right, softcap, backend):
        ref_out, ref_lse = attention_ref(q, k, v, softmax_scale, window_size=(left, right))
        out.copy_(ref_out)
        lse.copy_(ref_lse)
        return backend

    monkeypatch.setattr(ops, "fwd_into", fwd_into)
    monkeypatch.setattr(flash_hopper, "which_backend",
                        lambda q, k, v, backend="auto", **kwargs: (backend, "stand-in"))
    return fake


def test_bench_bf16_and_mixed_side_by_side_with_mocked_gpu(tmp_path, monkeypatch, capsys):
    mock_h200_bench(monkeypatch)
    gemm_dtypes = []

    def gemm(timer, dtype, size):
        gemm_dtypes.append(dtype)
        return {"dtype": dtype, "size": size, "ms": 1.0, "op": "stand-in", "tflops": 700.0}

    monkeypatch.setattr(peak, "measure_gemm_ceiling", gemm)
    fake = _mixed_library(monkeypatch)
    argv = ["bench", "--dtype", "bf16", "bf16+e4m3", "-s", "64", "128", "-d", "64", "-b", "2",
            "--hidden", "128", "--gqa-ratio", "2", "--causal", "off", "--backends", "fa3", "fa2",
            "fa3-no-pingpong", "sdpa-math", "-q", "--json", str(tmp_path / "r.json"), "--csv",
            str(tmp_path / "r.csv")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    data = report.read_json(str(tmp_path / "r.json"))
    rows = {(r["dtype"], r["backend"], r["seqlen_q"]): r for r in data["results"]}
    assert len(rows) == len(data["results"]) == 2 * 4 * 2  # dtypes x backends x seqlens
    for seqlen in (64, 128):
        for name in ("fa3", "fa2", "fa3-no-pingpong", "sdpa-math"):
            half = rows[("bf16", name, seqlen)]
            assert half["status"] == "ok" and half["check_pass"] is True, half
        mixed = rows[("bf16+e4m3", "fa3", seqlen)]
        assert mixed["status"] == "ok" and mixed["kernel"] == "fa3", mixed
        assert mixed["check_pass"] is True and mixed["check_metric"] == "max-abs"
        assert mixed["check_err"] <= mixed["check_tol"] and mixed["check_ref_err"] > 0
        # the 16-bit FLOPs, peak and GEMM ceiling
        flops = 4 * 2 * seqlen**2 * 2 * 64  # 4 b s^2 h d
        assert mixed["flops"] == rows[("bf16", "fa3", seqlen)]["flops"] == flops
        assert mixed["pct_peak"] == pytest.approx(100 * mixed["tflops"] / 989.4)
        assert mixed["pct_gemm"] == pytest.approx(100 * mixed["tflops"] / 700.0)
        for name, why in (("fa2", "the FA-2 path has no mixed-mode kernels"),
                          ("fa3-no-pingpong", "the FA-3 ablation variants (fa3-no-pingpong)"),
                          ("sdpa-math", "torch SDPA takes q, k and v of one")):
            skipped = rows[("bf16+e4m3", name, seqlen)]
            assert skipped["status"] == "skipped"
            assert skipped["reason"].startswith(f"unsupported (no mixed mode): {why}"), skipped
    mixed_calls = [c for c in fake.calls if c["dtypes"][1] == E4M3]
    assert mixed_calls and all(c["backend"] == "fa3" and c["descales"][0] is None
                               for c in mixed_calls)
    assert gemm_dtypes == ["bf16"]  # one bf16 GEMM serves both dtypes
    meta = data["meta"]
    assert meta["peak_by_dtype"]["bf16+e4m3"] == {
        "tflops": 989.4, "source": "datasheet H100/H200 SXM dense bf16/fp16"}
    assert meta["gemm_ceiling_by_dtype"]["bf16+e4m3"]["dtype"] == "bf16"
    assert report.read_csv(str(tmp_path / "r.csv"))["results"] == data["results"]
    # one table with both dtypes, the comparison, and the skips with their reasons
    table = out.split("\nkernels:")[0].splitlines()
    assert [line.split()[1] for line in table[2:] if line].count("bf16") == 8
    assert [line.split()[1] for line in table[2:] if line].count("bf16+e4m3") == 2
    assert ("mixed mode vs its 16-bit path (same backend and configuration):\n"
            "fa3 fwd non-causal d=64 s=64 b=2 h=2/1: bf16+e4m3 1.000 ms vs bf16 1.000 ms, "
            "1.00x\n") in out
    assert "fa3: ran fa3 (forced: backend='fa3'; mixed mode: bf16 q, e4m3 K / V, 16-bit " \
           "GEMMs)" in out
    assert "skipped: fa2 fwd (2 configs): unsupported (no mixed mode)" in out
