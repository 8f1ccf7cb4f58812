"""The benchmark's FP8 (e4m3) support on CPU: inputs (quantize, dequantize), the FP8 check rule,
which backends take FP8 cases and why the others are skipped, our backend's FP8 calls (the kernel
library stood in), the FP8 peaks and the FP8 GEMM ceiling's fallback.

The FP8 kernel itself is stood in by ``fp8_attention``, a torch emulation of its one rounding that
the reference does not have (P rounded to e4m3 for P V, as tests/test_fp8_gpu.py's emulate): it is
what the check must pass, at the ~2-3 % relative RMS error FP8 gives on N(0, 1) inputs, while
order-1 errors (a wrong descale, keys out of order) must fail.
"""

import functools
import math
import sys
import types

import pytest
import torch
from _helpers import emulated_attention, fake_build_info, mock_h200_bench, run_on_cpu
from flash_hopper import cli
from flash_hopper.bench import backends, check, peak, peers, registry, report, runner
from flash_hopper.bench.base import Backend
from flash_hopper.bench.cases import Case
from flash_hopper.bench.fp8_inputs import Fp8Input, dequantize
from flash_hopper.bench.runner import RunOptions
from flash_hopper.bench.timing import Stats

E4M3 = torch.float8_e4m3fn
H100 = (9, 0)
# Like the dev build: FA-3 forward kernels for bf16 and e4m3 at head dims 64 / 128 / 256, tuned (0)
# and fa3-no-pingpong (1) variants.
FP8_BUILD = {
    "version": "0.1.0", "commit": "abc", "archs": ["sm90a"], "head_dims": [64, 128, 256],
    "dtypes": ["bf16", "e4m3"], "cuda": "13.0",
    "variants": {"fa3": 0, "fa3-no-pingpong": 1, "fa3-no-overlap": 2},
    "fa3_variants": ["fa3-no-pingpong", "fa3-no-overlap"], "backward": False,
    "kernels": [{"direction": "fwd", "backend": "fa3", "dtype": dtype, "head_dim": d,
                 "variants": [0, 1]} for dtype in ("bf16", "e4m3") for d in (64, 128, 256)],
}


def fp8_case(**overrides):
    fields = {"batch": 2, "seqlen_q": 64, "seqlen_k": 64, "heads": 4, "heads_kv": 2,
              "head_dim": 64, "dtype": "e4m3"}
    fields.update(overrides)
    return Case(**fields)


def fp8_inputs(case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return runner.make_inputs(case, "cpu", gen)


def fp8_attention(q8, k8, v8, q_descale=None, k_descale=None, v_descale=None, causal=False,
                  window_size=(-1, -1), error=None):
    """The FP8 kernel emulated on CPU: exact scores of the dequantized inputs, P = exp(s - max)
    rounded to e4m3 for P V and unrounded in the row sum; (out bf16, lse). ``error``: a function
    of the fp32 output standing in for a bug."""
    q, k, v = (dequantize(t, d) for t, d in ((q8, q_descale), (k8, k_descale), (v8, v_descale)))
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh, vh = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))
    out, lse = emulated_attention(qh, kh, vh, 1 / math.sqrt(q.shape[-1]), causal, window_size,
                                  E4M3, error=error)
    return out.transpose(1, 2).to(torch.bfloat16), lse


class EmulatedFp8(Backend):
    """A backend with an FP8 path: the emulated kernel on the Fp8Inputs, with its LSE."""

    name = "emulated-fp8"
    origin = "flash-hopper"

    def __init__(self, error=None, name=None):
        self.error = error
        self.name = name or self.name

    def fp8_reason(self):
        return None

    def make_forward(self, q, k, v, case):
        return lambda: self.run_checked(q, k, v, case)[0]

    def run_checked(self, q, k, v, case):
        return fp8_attention(q.data, k.data, v.data, q.descale, k.descale, v.descale,
                             case.causal, case.window, self.error)


class HalfOnly(Backend):
    """A peer without an FP8 path (the default fp8_reason)."""

    name = "half-only"
    origin = "torch"

    def make_forward(self, q, k, v, case):
        raise AssertionError("an FP8 case must never reach a backend without an FP8 path")


run = run_on_cpu


# ---- cases and inputs ------------------------------------------------------------------------


def test_fp8_case_counts_bf16_flops_and_one_byte_inputs():
    c = fp8_case(seqlen_q=128, seqlen_k=256, causal=True)
    bf16 = fp8_case(seqlen_q=128, seqlen_k=256, causal=True, dtype="bf16")
    assert c.is_fp8 and not bf16.is_fp8
    assert (c.out_dtype, bf16.out_dtype) == ("bf16", "bf16")
    assert c.flops() == bf16.flops()  # 4 b s^2 h d, halved for causal: the same work
    q_or_o = 2 * 128 * 4 * 64
    k_and_v = 2 * 2 * 256 * 2 * 64
    assert c.input_bytes() == q_or_o + k_and_v + 2 * q_or_o  # 1-byte q, k, v; bf16 out
    assert bf16.input_bytes() == 2 * (2 * q_or_o + k_and_v)


def test_fp8_inputs_are_the_bf16_inputs_quantized_per_head():
    # Same seed, same draws: an e4m3 row times the bf16 row's values, rounded to FP8.
    q8, k8, v8 = fp8_inputs(fp8_case())
    gen = torch.Generator().manual_seed(0)
    q, k, v = runner.make_inputs(fp8_case(dtype="bf16"), "cpu", gen)
    assert all(isinstance(t, Fp8Input) for t in (q8, k8, v8))
    for t8, t in ((q8, q), (k8, k), (v8, v)):
        assert t8.data.dtype == E4M3 and t8.data.shape == t.shape
        assert t8.descale.dtype == torch.float32
        assert t8.descale.shape == (2, 2)  # (batch, heads_kv): q per kv head, as FA3 takes it
        real = t8.dequantize()
        # e4m3 keeps 3 mantissa bits: within half an ulp, 2^-4 relative, of each value, or
        # 2^-10 (half the subnormal spacing) times the descale near zero
        bound = 2**-4 * t.float().abs() + 2**-10 * t8.descale.max()
        assert torch.all((real - t.float()).abs() <= bound)
        # each slice sharing a descale (for q: a kv head's query heads) reaches the FP8 maximum
        b, s, h, d = t.shape
        amax = t8.data.float().abs().reshape(b, s, 2, h // 2, d).amax(dim=(1, 3, 4))
        assert torch.all(amax == torch.finfo(E4M3).max)


def test_dequantize_repeats_a_kv_heads_descale_over_its_query_heads():
    data = torch.ones(1, 3, 4, 16).to(E4M3)
    descale = torch.tensor([[1.0, 2.0]])  # 2 kv heads: query heads 0, 1 and 2, 3
    real = dequantize(data, descale)
    assert real.dtype == torch.float32
    assert real[0, :, :, 0].tolist() == [[1.0, 1.0, 2.0, 2.0]] * 3
    assert torch.equal(dequantize(data, torch.tensor(0.5)), torch.full((1, 3, 4, 16), 0.5))
    assert dequantize(data, descale, torch.float64).dtype == torch.float64
    assert torch.equal(dequantize(data, descale.expand(1, 2)), real)  # a stride-0 expand
    assert torch.equal(dequantize(data, None), torch.ones(1, 3, 4, 16))  # None: 1.0
    with pytest.raises(ValueError, match="descale: expected shape"):
        dequantize(data, torch.ones(1, 3))  # 3 does not divide 4 heads
    with pytest.raises(ValueError, match="descale: expected shape"):
        dequantize(data, torch.ones(2, 2))  # wrong batch


# ---- the FP8 check rule ------------------------------------------------------------------------


def test_relative_rmse():
    ref = torch.tensor([3.0, 4.0])  # norm 5
    assert check.relative_rmse(ref, ref) == 0.0
    assert check.relative_rmse(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1)
    assert check.relative_rmse(ref.to(torch.bfloat16), ref) == 0.0
    assert math.isnan(check.relative_rmse(torch.tensor([math.nan, 4.0]), ref))
    assert check.relative_rmse(torch.ones(2), torch.zeros(2)) == math.inf
    assert check.relative_rmse(torch.zeros(0), torch.zeros(0)) == 0.0


def test_fp8_rule_on_synthetic_tensors():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 64, 4, 32, generator=gen)
    lse = torch.randn(2, 4, 64, generator=gen)
    noise = torch.randn(ref.shape, generator=gen)
    noise = noise / noise.norm() * ref.norm()  # relative RMS 1 exactly
    for scale, passed in ((0.03, True), (0.049, True), (0.051, False), (0.5, False)):
        result = check.compare_fp8(ref + scale * noise, ref, shape="b2")
        assert result.err == pytest.approx(scale, rel=1e-4)
        assert result.passed is passed, scale
        assert (result.tol, result.ref_err, result.metric) == (check.FP8_REL_RMSE, None,
                                                               check.METRIC_REL_RMSE)
        assert result.lse_err is None  # no LSE given: only the output is judged
    # The LSE bound is absolute, with the softcap term of the bf16 rule.
    assert check.compare_fp8(ref, ref, lse + 1e-3, lse).passed
    late = check.compare_fp8(ref, ref, lse + 3e-3, lse)
    assert not late.passed and late.lse_err == pytest.approx(3e-3, rel=1e-3)
    assert late.lse_tol == check.FP8_LSE_ATOL
    assert check.compare_fp8(ref, ref, lse + 3e-3, lse, softcap=30.0).passed  # 2e-3 + 30/1024
    # Unwritten output (NaN) fails whatever else holds.
    poisoned = ref.clone()
    poisoned[0, 0, 0, 0] = math.nan
    assert not check.compare_fp8(poisoned, ref, lse, lse).passed
    # bf16 rows keep FA3's rule and say so.
    assert check.compare(ref, ref, ref).metric == check.METRIC_MAX_ABS


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_reference_is_attention_of_the_dequantized_inputs(causal):
    from flash_hopper.reference import attention_ref

    c = fp8_case(seqlen_q=48, seqlen_k=80, causal=causal)
    q, k, v = fp8_inputs(c)
    refs = check.Fp8References(q, k, v, c)
    out, lse = attention_ref(q.dequantize(), k.dequantize(), v.dequantize(), causal=causal)
    assert refs.out.dtype == torch.float32
    assert torch.allclose(refs.out, out, atol=1e-6) and torch.allclose(refs.lse, lse, atol=1e-5)
    assert refs.shape == "b2 sq48 sk80"
    chunked = check.Fp8References(q, k, v, c, max_scores=2 * 4 * 80 * 5)  # 5 rows per chunk
    assert torch.allclose(chunked.out, refs.out, atol=1e-6)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (16, 8))])
def test_emulated_fp8_kernel_passes_and_bugs_fail(causal, window):
    c = fp8_case(seqlen_q=256, seqlen_k=256, causal=causal, window=window)
    q, k, v = fp8_inputs(c)
    refs = check.Fp8References(q, k, v, c)
    args = (q.data, k.data, v.data, q.descale, k.descale, v.descale, causal, window)
    good = refs.check(*fp8_attention(*args))
    # FP8's own error: a few percent, well inside the 5 % bound.
    assert good.passed and 0.005 < good.err < 0.035, good
    assert good.lse_err < 1e-4
    # The v descale ignored: the output off by 1 / descale (~100 for N(0, 1) inputs).
    wrong = fp8_attention(q.data, k.data, v.data, q.descale, k.descale, None, causal, window)
    assert not refs.check(*wrong).passed
    # A kv head's v descale applied to the other head's values: per-head scales of iid N(0, 1)
    # data differ by a few percent only, so this one needs heads of different scales to show.
    skewed = Fp8Input(v.data, v.descale * torch.tensor([1.0, 3.0]))
    refs = check.Fp8References(q, k, skewed, c)
    swapped = fp8_attention(q.data, k.data, v.data, q.descale, k.descale,
                            skewed.descale.flip(1), causal, window)
    assert not refs.check(*swapped).passed
    # Keys of v out of order (a transpose bug): fails too.
    flipped = fp8_attention(q.data, k.data, v.data.flip(1), q.descale, k.descale, v.descale,
                            causal, window)
    assert not refs.check(*flipped).passed


# ---- the runner on FP8 cases ------------------------------------------------------------------


def test_runner_times_fp8_backends_and_skips_the_others():
    c = fp8_case(causal=True)
    rows = run([EmulatedFp8(), HalfOnly()], [c], peak_tflops={"e4m3": 2000.0, "bf16": 1000.0},
               gemm_tflops={"bf16": 700.0})
    fp8_row, skipped = rows
    assert fp8_row["status"] == "ok" and fp8_row["dtype"] == "e4m3"
    assert fp8_row["check_pass"] is True and fp8_row["check_metric"] == "rel-rmse"
    assert fp8_row["check_err"] < check.FP8_REL_RMSE and fp8_row["check_ref_err"] is None
    assert fp8_row["check_lse_tol"] == check.FP8_LSE_ATOL
    assert fp8_row["flops"] == c.flops()
    assert fp8_row["pct_peak"] == pytest.approx(fp8_row["tflops"] / 20)  # e4m3's ceiling
    assert fp8_row["pct_gemm"] is None  # no e4m3 GEMM ceiling given
    assert skipped["status"] == "skipped"
    assert skipped["reason"] == "unsupported (no FP8): no FP8 path"


def test_a_wrong_fp8_output_fails_its_check():
    (row,) = run([EmulatedFp8(error=lambda out: out * 1.2)], [fp8_case()])
    assert row["status"] == "ok" and row["check_pass"] is False
    assert row["check_err"] == pytest.approx(0.2, rel=0.05)


def test_fp8_backward_rows_are_skipped_without_a_gradient_reference(monkeypatch):
    # The CLI refuses e4m3 with a backward direction; a programmatic sweep skips those rows.
    def no_grad_references(*args, **kwargs):
        raise AssertionError("no gradient reference for FP8")

    monkeypatch.setattr(check, "GradReferences", no_grad_references)
    rows = run([EmulatedFp8()], [fp8_case()], directions=("fwd", "bwd", "fwd+bwd"))
    assert [(r["direction"], r["status"]) for r in rows] == [
        ("fwd", "ok"), ("bwd", "skipped"), ("fwd+bwd", "skipped")]
    assert rows[1]["reason"] == runner.FP8_NO_BACKWARD


def test_mixed_dtype_sweep_uses_each_rows_ceiling():
    rows = run([EmulatedFp8(), HalfOnly()], [fp8_case(), fp8_case(dtype="bf16")],
               peak_tflops={"e4m3": 2000.0, "bf16": 1000.0})
    e4m3 = next(r for r in rows if r["dtype"] == "e4m3" and r["status"] == "ok")
    assert e4m3["pct_peak"] == pytest.approx(100 * e4m3["tflops"] / 2000.0)
    assert runner.ceiling_for(500.0, "e4m3") == 500.0  # a number: every dtype
    assert runner.ceiling_for({"bf16": 1.0}, "e4m3") is None
    assert runner.ceiling_for(None, "bf16") is None


# ---- which backends take FP8 cases ------------------------------------------------------------


def fake_package(name, fp8):
    module = types.ModuleType(name)
    calls = []
    if fp8:  # FA3's hopper interface: the descales after qv, as its flash_attn_func has them
        def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                            k_descale=None, v_descale=None, window_size=(-1, -1), softcap=0.0):
            calls.append({"q": q, "q_descale": q_descale, "k_descale": k_descale,
                          "v_descale": v_descale, "causal": causal})
            return torch.zeros(q.shape, dtype=torch.bfloat16), torch.zeros(q.shape[0],
                                                                           q.shape[2],
                                                                           q.shape[1])
    else:
        def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0):
            return q
    module.flash_attn_func = flash_attn_func
    module.calls = calls
    return module


def test_peers_without_fp8_say_so():
    c = fp8_case()
    for kind in peers.SDPA_KINDS:
        reason = runner.fp8_skip_reason(peers.SdpaBackend(kind), c)
        assert reason.startswith("unsupported (no FP8): torch SDPA"), kind
    assert "FlexAttention" in runner.fp8_skip_reason(peers.FlexBackend(), c)
    assert runner.fp8_skip_reason(peers.SdpaBackend("flash"), fp8_case(dtype="bf16")) is None
    fa2 = backends.FlashHopperBackend("fa2", "fa2")
    assert "FA-2 path has no FP8 kernels" in runner.fp8_skip_reason(fa2, c)
    for name in ("fa3", "fa3-no-pingpong"):
        assert backends.FlashHopperBackend(name, name).fp8_reason() is None


def test_fa_packages_take_fp8_only_with_descales(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_package("flash_attn", fp8=False))
    monkeypatch.setitem(sys.modules, "flash_attn_interface",
                        fake_package("flash_attn_interface", fp8=True))
    known = registry.known_backends(include_variants=False)
    fa2_package, fa3_package = known["flash-attn"], known["flash-attn3"]
    assert fa2_package.probe(H100) is None and fa3_package.probe(H100) is None
    assert fa2_package.fp8_reason() == (
        "flash_attn.flash_attn_func takes no q_descale / k_descale / v_descale")
    assert fa3_package.fp8_reason() is None
    # FA3 gets the FP8 data and the descales, and its LSE is checked like ours.
    c = fp8_case()
    q, k, v = fp8_inputs(c)
    out, lse = fa3_package.run_checked(q, k, v, c)
    (call,) = sys.modules["flash_attn_interface"].calls
    assert call["q"] is q.data and call["q_descale"] is q.descale
    assert call["v_descale"] is v.descale and call["causal"] is False
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 4, 64)
    assert fa3_package.kernel(q, k, v, c)[1].endswith("with q/k/v descales (FP8)")


def test_a_package_that_is_not_importable_has_no_fp8_path(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    backend = registry.known_backends(include_variants=False)["flash-attn"]
    assert backend.fp8_reason() == "not importable"


# ---- our backend: which FP8 cases it runs, and the calls it makes --------------------------------


def test_our_fp8_support_follows_the_kernel_list(monkeypatch):
    fake_build_info(monkeypatch, FP8_BUILD)
    known = registry.known_backends()
    fa3, single = known["fa3"], known[backends.FP8_SINGLE_LEVEL]
    assert fa3.unsupported(fp8_case(head_dim=64)) is None
    assert fa3.unsupported(fp8_case(head_dim=128), "fwd") is None
    assert single.unsupported(fp8_case(head_dim=128)) is None
    assert fa3.unsupported(fp8_case(head_dim=256)) is None
    assert single.unsupported(fp8_case(head_dim=256)) == (
        "the single-level ablation exists for head_dim <= 128 (the d192 / d256 FP8 kernels "
        "accumulate in two levels only), got 256")
    assert fa3.unsupported(fp8_case(head_dim=96)) == (
        "library built without an fa3 e4m3 forward kernel for head-dim bucket 96")
    assert fa3.unsupported(fp8_case(head_dim=72)) == (
        "FP8 needs head_dim a multiple of 16, got 72")
    assert fa3.unsupported(fp8_case(), "bwd") == "the FP8 (e4m3) forward has no backward"
    assert known["fa3-no-pingpong"].unsupported(fp8_case()) is None
    assert known["fa3-no-overlap"].unsupported(fp8_case()) == (
        "library built without the fa3-no-overlap variant of the fa3 e4m3 kernel for head-dim "
        "bucket 64")
    # The ablation takes e4m3 cases only; a build without e4m3 says so.
    assert single.unsupported(fp8_case(dtype="bf16")) == (
        "FP8 accumulation ablation: e4m3 cases only, not bf16")
    fake_build_info(monkeypatch, dict(FP8_BUILD, dtypes=["bf16"]))
    assert backends.FlashHopperBackend("fa3", "fa3").unsupported(fp8_case()) == (
        "library built without e4m3 (dtypes: bf16)")


def test_the_single_level_ablation_is_a_backend_of_its_own(monkeypatch):
    fake_build_info(monkeypatch, FP8_BUILD)
    known = registry.known_backends()
    single = known[backends.FP8_SINGLE_LEVEL]
    assert (single.path, single.fp8_accumulation, single.only_dtypes) == (
        "fa3", "single-level", ("e4m3",))
    assert single.probe(H100) is None  # not a build variant: no fa3_variants entry needed
    assert single.probe((8, 0)) == "needs an sm9x GPU; this one is sm80"
    # `all` leaves it out of a sweep without e4m3; asked for by name, it stays.
    names = [b.name for b in registry.resolve(["all"], known, dtypes=["bf16"])]
    assert backends.FP8_SINGLE_LEVEL not in names and "fa3" in names
    names = [b.name for b in registry.resolve(["all"], known, dtypes=["bf16", "e4m3"])]
    assert backends.FP8_SINGLE_LEVEL in names
    chosen = registry.resolve([backends.FP8_SINGLE_LEVEL], known, dtypes=["bf16"])
    assert [b.name for b in chosen] == [backends.FP8_SINGLE_LEVEL]


class FakeFlashAttn:
    """flash_attn_func for FP8 inputs on CPU: records each call, returns the emulated kernel's
    (out, lse) in fresh tensors and keeps them, so that a test sees what was done to them."""

    def __init__(self):
        self.calls, self.returned = [], []

    def __call__(self, q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                 k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                 softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                 return_attn_probs=False, *, backend="auto", out_dtype=None,
                 fp8_accumulation="two-level"):
        assert q.dtype == k.dtype == v.dtype == E4M3
        self.calls.append({"backend": backend, "fp8_accumulation": fp8_accumulation,
                           "causal": causal, "window_size": window_size, "softcap": softcap,
                           "descales": (q_descale, k_descale, v_descale),
                           "return_attn_probs": return_attn_probs})
        out, lse = fp8_attention(q, k, v, q_descale, k_descale, v_descale, causal, window_size)
        self.returned.append((out, lse))
        return (out, lse) if return_attn_probs else out


@pytest.fixture
def fake_fp8_call(monkeypatch):
    import flash_hopper

    fake = FakeFlashAttn()
    monkeypatch.setattr(flash_hopper, "flash_attn_func", fake)
    return fake


def test_our_fp8_calls_pass_descales_and_the_accumulation(fake_fp8_call):
    c = fp8_case(causal=True)
    q, k, v = fp8_inputs(c)
    fa3 = backends.FlashHopperBackend("fa3", "fa3")
    single = backends.FlashHopperBackend(backends.FP8_SINGLE_LEVEL, "fa3",
                                         fp8_accumulation="single-level")
    out = fa3.make_forward(q, k, v, c)()
    single.make_forward(q, k, v, c)()
    default_call, single_call = fake_fp8_call.calls
    assert default_call["descales"] == (q.descale, k.descale, v.descale)
    assert (default_call["backend"], default_call["fp8_accumulation"]) == ("fa3", "two-level")
    assert (single_call["backend"], single_call["fp8_accumulation"]) == ("fa3", "single-level")
    assert default_call["causal"] is True and default_call["return_attn_probs"] is False
    assert out.dtype == torch.bfloat16 and out.shape == q.data.shape


def test_our_fp8_check_runs_in_nan_filled_blocks(fake_fp8_call):
    c = fp8_case()
    q, k, v = fp8_inputs(c)
    fa3 = backends.FlashHopperBackend("fa3", "fa3")
    out, lse = fa3.run_checked(q, k, v, c)
    # Two calls: the first finds the blocks, which are NaN-filled and freed before the second
    # (on CUDA the second must get the same blocks: checked by address there).
    assert [call["return_attn_probs"] for call in fake_fp8_call.calls] == [True, True]
    first_out, first_lse = fake_fp8_call.returned[0]
    assert first_out.isnan().all() and first_lse.isnan().all()
    assert out is fake_fp8_call.returned[1][0] and lse is fake_fp8_call.returned[1][1]
    assert check.Fp8References(q, k, v, c).check(out, lse).passed


def test_our_fp8_kernel_name_comes_from_the_host_plan(monkeypatch):
    from flash_hopper import _fwd, _validate

    seen = {}

    def fake_check(*args):
        seen["check"] = args
        return "cfg", "fp8-options"

    def fake_make_plan(cfg, q, k, v, **kwargs):
        seen["plan"] = (cfg, q.dtype, kwargs)
        return types.SimpleNamespace(backend="fa3", reason="forced: backend='fa3'")

    monkeypatch.setattr(_validate, "check_fp8_args", fake_check)
    monkeypatch.setattr(_fwd, "make_plan", fake_make_plan)
    c = fp8_case(causal=True, window=(32, -1), softcap=5.0)
    q, k, v = fp8_inputs(c)
    single = backends.FlashHopperBackend(backends.FP8_SINGLE_LEVEL, "fa3",
                                         fp8_accumulation="single-level")
    assert single.kernel(q, k, v, c) == (
        "fa3", "forced: backend='fa3'; FP8 e4m3, single-level accumulation")
    assert seen["check"] == (q.data, k.data, v.data, None, True, (32, -1), 5.0, "fa3",
                             q.descale, k.descale, v.descale, None, "single-level")
    assert seen["plan"] == ("cfg", E4M3, {"fp8": "fp8-options"})
    assert backends.FlashHopperBackend("fa3", "fa3").kernel(q, k, v, c)[1].endswith(
        "FP8 e4m3, two-level accumulation")


# ---- ceilings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,expected", [
    ("NVIDIA H200", 1978.9), ("NVIDIA H100 80GB HBM3", 1978.9), ("NVIDIA H100 PCIe", 1513.0),
    ("NVIDIA H200 NVL", 1670.5), ("NVIDIA L40S", 733.0),
])
def test_fp8_peaks(name, expected):
    tflops, source = peak.lookup_peak(name, "e4m3")
    assert tflops == expected and source.endswith("dense FP8")
    assert peak.lookup_peak(name, "bf16")[0] == peak.lookup_peak(name)[0] < expected


def test_no_fp8_peak_without_fp8_tensor_cores():
    assert peak.lookup_peak("NVIDIA A100-SXM4-80GB", "e4m3") == (
        None, "no dense FP8 peak for A100 (no FP8 tensor cores)")
    tflops, source = peak.lookup_peak("Some Future GPU", "e4m3")
    assert tflops is None and "FP8" in source and "--peak-tflops" in source


class CountingTimer:
    def __init__(self):
        self.calls = 0

    def measure(self, fns):
        for fn in fns:
            fn()
            self.calls += 1
        return Stats(median=2.0, p20=2.0, p80=2.0, n=1)


def test_fp8_gemm_ceiling_is_a_scaled_mm(monkeypatch):
    # torch._scaled_mm runs on CPU too: the same call the GPU times, at a tiny size.
    seen = {}
    scaled_mm = torch._scaled_mm

    def recording(a, b, **kwargs):
        seen.update(a=(a.dtype, a.is_contiguous()), b=(b.dtype, b.t().is_contiguous()),
                    kwargs=kwargs)
        return scaled_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    timer = CountingTimer()
    gemm = peak.measure_gemm_ceiling(timer, dtype="e4m3", size=32, device="cpu")
    assert gemm == {"dtype": "e4m3", "size": 32, "ms": 2.0,
                    "op": "torch._scaled_mm (bf16 out)",
                    "tflops": 2 * 32**3 / 2e-3 / 1e12}
    assert seen["a"] == (E4M3, True) and seen["b"] == (E4M3, True)  # b column-major
    assert seen["kwargs"]["out_dtype"] == torch.bfloat16
    assert seen["kwargs"]["scale_a"].item() == seen["kwargs"]["scale_b"].item() == 1.0
    assert timer.calls == 1
    bf16 = peak.measure_gemm_ceiling(CountingTimer(), dtype="bf16", size=32, device="cpu")
    assert bf16["op"] == "torch.mm"


def test_fp8_gemm_ceiling_falls_back_cleanly(monkeypatch):
    monkeypatch.delattr(torch, "_scaled_mm")
    with pytest.raises(peak.GemmUnavailable, match="has no torch._scaled_mm"):
        peak.measure_gemm_ceiling(CountingTimer(), dtype="e4m3", size=32, device="cpu")

    def old_signature(a, b, bias=None, out_dtype=None):
        raise TypeError("_scaled_mm() got an unexpected keyword argument 'scale_a'")

    monkeypatch.setattr(torch, "_scaled_mm", old_signature, raising=False)
    timer = CountingTimer()
    with pytest.raises(peak.GemmUnavailable, match="torch._scaled_mm failed: TypeError"):
        peak.measure_gemm_ceiling(timer, dtype="e4m3", size=32, device="cpu")
    assert timer.calls == 0  # nothing timed
    assert issubclass(peak.GemmUnavailable, RuntimeError)  # what the CLI catches


# ---- results: table and plot ---------------------------------------------------------------------


def mixed_rows():
    """bf16 and e4m3 rows of one configuration, synthetic timings and checks."""
    rows = []
    for dtype, result in (("bf16", check.compare(torch.ones(2), torch.ones(2), torch.ones(2))),
                          ("e4m3", check.compare_fp8(torch.ones(2) * 1.02, torch.ones(2)))):
        row = runner.base_row(fp8_case(dtype=dtype, seqlen_q=1024, seqlen_k=1024), "fa3", "fwd")
        runner.fill_timing(row, Stats(median=0.5, p20=0.5, p80=0.5, n=1), RunOptions())
        runner.fill_check(row, result)
        rows.append(row)
    return rows


def test_table_shows_the_fp8_error_as_a_relative_rms():
    table = report.format_table(mixed_rows())
    bf16_line, fp8_line = (line for line in table.splitlines() if " fa3 " in line)
    assert "0.0e+00" in bf16_line and bf16_line.endswith("ok")
    assert "2.00% rms" in fp8_line and fp8_line.endswith("ok")
    assert table.splitlines()[-1].startswith("err: max |out - ref_fp32| (FA3's rule), or with")
    assert "rms" not in report.format_table(mixed_rows()[:1])  # no FP8 row: no legend


def test_plot_puts_fp8_rows_in_panels_of_their_own(tmp_path):
    pytest.importorskip("matplotlib")
    from flash_hopper.bench import plot

    rows = mixed_rows()
    panel_rows, head_dims, backends_, seqlens = plot.layout(rows)
    assert panel_rows == [("fwd", "bf16", "non-causal"), ("fwd", "e4m3", "non-causal")]
    assert (head_dims, backends_, seqlens) == ([64], ["fa3"], ["1k"])
    counts = plot.plot_results(report.result_set({}, rows), str(tmp_path / "p.png"))
    assert counts == {"panels": 2, "bars": 2}


# ---- the bench command on e4m3, with the GPU mocked: CPU tensors, a stand-in timer --------------


def _fp8_library(monkeypatch):
    """The FP8-capable build (bf16 / e4m3, FA-3 forward, head dims 64 / 128) stood in, with its
    flash_attn_func emulated on CPU (tests/test_bench_fp8.py) and its host plan named."""
    import types

    import flash_hopper
    from flash_hopper import _fwd, _validate
    fake = FakeFlashAttn()
    fake_build_info(monkeypatch, FP8_BUILD)
    monkeypatch.setattr(flash_hopper, "flash_attn_func", fake)
    monkeypatch.setattr(_validate, "check_fp8_args", lambda *args: ("cfg", "fp8"))
    monkeypatch.setattr(_fwd, "make_plan", lambda *args, **kwargs: types.SimpleNamespace(
        backend="fa3", reason="forced: backend='fa3'"))
    return fake


def test_bench_e4m3_pipeline_with_mocked_gpu(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")

    mock_h200_bench(monkeypatch)
    gemm_tflops = {"e4m3": 1435.0}
    monkeypatch.setattr(peak, "measure_gemm_ceiling", lambda timer, dtype, size: {
        "dtype": dtype, "size": size, "ms": 1.0, "op": "stand-in", "tflops": gemm_tflops[dtype]})
    fake = _fp8_library(monkeypatch)
    argv = ["bench", "--dtype", "e4m3", "-s", "64", "128", "-d", "64", "-b", "2", "--hidden",
            "128", "--gqa-ratio", "2", "--backends", "fa3", "fa3-fp8-single-level",
            "sdpa-math", "-q", "--json", str(tmp_path / "r.json"), "--csv",
            str(tmp_path / "r.csv"), "--plot", str(tmp_path / "r.png")]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    data = report.read_json(str(tmp_path / "r.json"))
    rows = data["results"]
    assert len(rows) == 2 * 2 * 3  # seqlens x causal x backends
    for row in rows:
        assert row["dtype"] == "e4m3" and (row["heads"], row["heads_kv"]) == (2, 1)
        if row["backend"] == "sdpa-math":
            assert row["status"] == "skipped"
            assert row["reason"].startswith("unsupported (no FP8): torch SDPA")
            continue
        assert row["status"] == "ok", row
        assert row["check_pass"] is True and row["check_metric"] == "rel-rmse"
        assert row["check_err"] < 0.05 and row["check_lse_err"] <= row["check_lse_tol"]
        assert row["pct_peak"] == pytest.approx(100 * row["tflops"] / 1978.9)
        assert row["pct_gemm"] == pytest.approx(100 * row["tflops"] / 1435.0)
        assert row["kernel"] == "fa3"
    accumulations = {c["fp8_accumulation"] for c in fake.calls}
    assert accumulations == {"two-level", "single-level"}
    meta = data["meta"]
    assert meta["peak"] == {"tflops": 1978.9, "source": "datasheet H100/H200 SXM dense FP8"}
    assert meta["gemm_ceiling"]["tflops"] == 1435.0
    assert set(meta["peak_by_dtype"]) == set(meta["gemm_ceiling_by_dtype"]) == {"e4m3"}
    assert report.read_csv(str(tmp_path / "r.csv"))["results"] == rows
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert "% rms" in captured.out and "e4m3 rows: pass <= 5%" in captured.out
    assert "fa3-fp8-single-level: ran fa3 (forced: backend='fa3'; FP8 e4m3, single-level " \
           "accumulation)" in captured.out
    assert "skipped: sdpa-math fwd (4 configs): unsupported (no FP8)" in captured.out


def test_bench_mixed_dtypes_use_each_dtypes_ceilings(tmp_path, monkeypatch, capsys):
    # bf16 rows against bf16's ceilings, e4m3 rows against FP8's; a missing FP8 GEMM is a note.

    mock_h200_bench(monkeypatch)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False,
                        raising=False)
    measure = peak.measure_gemm_ceiling
    monkeypatch.setattr(peak, "measure_gemm_ceiling", functools.partial(measure, device="cpu"))
    monkeypatch.delattr(torch, "_scaled_mm")
    _fp8_library(monkeypatch)
    argv = ["bench", "--dtype", "bf16", "e4m3", "-s", "64", "-d", "64", "-b", "2", "--hidden",
            "128", "--causal", "off", "--backends", "sdpa-math", "fa3-fp8-single-level",
            "--gemm-size", "64",
            "-q", "--json", str(tmp_path / "r.json")]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "GEMM ceiling: " in err and "bf16 torch.mm" in err
    assert "note: e4m3 GEMM ceiling not measured" in err
    data = report.read_json(str(tmp_path / "r.json"))
    rows = {(r["dtype"], r["backend"]): r for r in data["results"]}
    bf16, fp8 = rows[("bf16", "sdpa-math")], rows[("e4m3", "fa3-fp8-single-level")]
    assert bf16["status"] == fp8["status"] == "ok"
    assert bf16["pct_peak"] == pytest.approx(100 * bf16["tflops"] / 989.4)
    assert fp8["pct_peak"] == pytest.approx(100 * fp8["tflops"] / 1978.9)
    assert bf16["pct_gemm"] is not None and fp8["pct_gemm"] is None
    assert bf16["check_metric"] == "max-abs" and fp8["check_metric"] == "rel-rmse"
    assert rows[("e4m3", "sdpa-math")]["status"] == "skipped"
    assert rows[("bf16", "fa3-fp8-single-level")]["reason"] == (
        "FP8 accumulation ablation: e4m3 cases only, not bf16")
    meta = data["meta"]
    assert meta["peak"]["tflops"] == 989.4 and meta["gemm_ceiling"]["dtype"] == "bf16"
    assert meta["gemm_ceiling_by_dtype"]["e4m3"] is None
    assert meta["peak_by_dtype"]["e4m3"]["tflops"] == 1978.9
