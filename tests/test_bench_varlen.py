"""`flash-hopper bench --varlen`: the drawn batch, its Case (FLOPs, sizes, labels), the
CLI options, the per-sequence reference check, each backend's varlen call (libraries mocked, CPU
tensors), and the whole command with the GPU mocked. The gpu-marked test at the end runs it for
real.

The runner tests use tiny batches (tens of tokens, a few heads of d = 16): what is under test is the
packing, the per-sequence masking and the bookkeeping, which are the same at any size.
"""

import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from _helpers import fake_build_info, mock_h200_bench, run_on_cpu
from flash_hopper import cli, reference
from flash_hopper.bench import backends, check, peers, plot, report, runner
from flash_hopper.bench import cases as sweep
from flash_hopper.bench.base import Backend
from flash_hopper.bench.cases import Case, draw_varlen_lengths
from flash_hopper.bench.flops import attention_flops

PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"


def varlen_case(seqlens, heads=2, heads_kv=None, head_dim=16, **overrides):
    longest = max(seqlens)
    heads_kv = heads if heads_kv is None else heads_kv
    return Case(batch=len(seqlens), seqlen_q=longest, seqlen_k=longest, heads=heads,
                heads_kv=heads_kv, head_dim=head_dim, seqlens=tuple(seqlens), **overrides)


# ---- the draw ------------------------------------------------------------------------------------

def test_draw_sums_exactly_within_bounds_and_is_seeded():
    for seed in range(20):
        lengths = draw_varlen_lengths(128, 8192, 16384, seed)
        assert sum(lengths) == 16384
        assert all(128 <= n <= 8192 for n in lengths[:-1])
        assert 1 <= lengths[-1] <= 8192  # the last is cut to the remainder
        assert lengths == draw_varlen_lengths(128, 8192, 16384, seed)
    draws = {draw_varlen_lengths(128, 8192, 16384, seed) for seed in range(20)}
    assert len(draws) == 20  # the seed matters
    assert all(len(set(d)) > 1 for d in draws if len(d) > 1)  # mixed lengths, not one repeated


def test_draw_is_bench_varlen_speeds():
    # bench/varlen_speed.py's loop (random.Random(seed).randint(128, 8192), cut to what is left
    # of 16k) for seed 0: the CLI's default batch is the one that script measured.
    assert draw_varlen_lengths(128, 8192, 16384, 0) == (7045, 3283, 6056)


def test_draw_cuts_the_last_and_refuses_bad_bounds():
    assert draw_varlen_lengths(5000, 5000, 16384) == (5000, 5000, 5000, 1384)
    assert draw_varlen_lengths(7, 7, 14) == (7, 7)
    for low, high in ((0, 5), (9, 8)):
        with pytest.raises(ValueError, match="1 <= MIN <= MAX"):
            draw_varlen_lengths(low, high, 100)


# ---- the Case ------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (64, 0))])
def test_flops_are_the_sum_over_sequences(causal, window):
    lengths = (300, 1024, 77, 1024, 5)
    c = varlen_case(lengths, heads=4, heads_kv=2, head_dim=64, causal=causal, window=window)
    for direction in ("fwd", "bwd"):
        expected = sum(attention_flops(1, 4, n, n, 64, causal, window, direction)
                       for n in lengths)
        assert c.flops(direction) == pytest.approx(expected, rel=1e-12)
    # Equal lengths: exactly the dense batch's count.
    equal = varlen_case((512,) * 4, heads=4, head_dim=64, causal=causal, window=window)
    dense = Case(batch=4, seqlen_q=512, seqlen_k=512, heads=4, heads_kv=4, head_dim=64,
                 causal=causal, window=window)
    assert equal.flops() == dense.flops() and equal.flops("bwd") == dense.flops("bwd")
    assert equal.input_bytes() == dense.input_bytes()
    assert equal.score_elements() == dense.score_elements()


def test_varlen_case_sizes_labels_and_dict():
    c = varlen_case((7, 9, 3), heads=4, heads_kv=2, head_dim=16, causal=True)
    assert c.is_varlen and not Case(1, 8, 8, 1, 1, 16).is_varlen
    assert (c.tokens_q, c.tokens_k) == (19, 19)
    assert c.cu_seqlens() == [0, 7, 16, 19]
    assert c.input_bytes() == 2 * (19 * 4 * 16 * 2) + 2 * 19 * 2 * 16 * 2  # q, out; k, v
    assert c.score_elements() == 4 * (49 + 81 + 9)
    assert c.mask_label == "causal varlen"
    assert c.seqlen_label == "varlen 3 seqs 3..9 (19 tok)"
    assert c.no_backward_reason == sweep.VARLEN_NO_BACKWARD
    fields = c.as_dict()
    assert fields["seqlens"] == [7, 9, 3] and fields["batch"] == 3
    assert Case(1, 8, 8, 1, 1, 16).as_dict()["seqlens"] is None
    assert sweep.varlen_label((8192, 128, 4096, 3968)) == "varlen 4 seqs 128..8k (16k tok)"


def test_varlen_case_shape_must_follow_its_lengths():
    with pytest.raises(ValueError, match="batch = len"):
        Case(batch=2, seqlen_q=9, seqlen_k=9, heads=1, heads_kv=1, head_dim=16, seqlens=(9, 4, 2))
    with pytest.raises(ValueError, match="max"):
        Case(batch=2, seqlen_q=8, seqlen_k=9, heads=1, heads_kv=1, head_dim=16, seqlens=(9, 4))


# ---- the CLI -------------------------------------------------------------------------------------

def parse_bench(*args):
    parsed = cli.build_parser().parse_args(["bench", *args])
    return parsed, sweep.expand(cli.sweep_spec(parsed))


def test_varlen_default_and_explicit_bounds():
    args, cases = parse_bench("--varlen")
    assert args.varlen == "128,8k"
    assert cli.sweep_spec(args).varlen == (128, 8192)
    expected = draw_varlen_lengths(128, 8192, 16384, 0)
    # One case per head dim and mask, all of the same batch, replacing the seqlen axis.
    assert len(cases) == 3 * 2
    assert {(c.causal, c.head_dim) for c in cases} == {(a, d) for a in (False, True)
                                                       for d in (64, 128, 256)}
    for c in cases:
        assert c.seqlens == expected and c.batch == len(expected)
        assert c.seqlen_q == c.seqlen_k == max(expected)
        assert c.heads * c.head_dim == 2048

    _, cases = parse_bench("--varlen", "256,2k", "--total-tokens", "8k", "--seed", "3", "-d",
                           "64", "128", "--causal", "on", "--gqa-ratio", "2")
    assert [c.head_dim for c in cases] == [64, 128]
    assert cases[0].seqlens == cases[1].seqlens == draw_varlen_lengths(256, 2048, 8192, 3)
    assert (cases[1].heads, cases[1].heads_kv, cases[1].causal) == (16, 8, True)
    assert parse_bench("--varlen", "--seed", "4")[1][0].seqlens != expected


@pytest.mark.parametrize("args,message", [
    (["--varlen", "-b", "4"], "argument --varlen: not allowed with argument --batch"),
    (["--varlen", "--seqlen-k", "1k"], "argument --varlen: not allowed with argument --seqlen-k"),
    (["--varlen", "-s", "1k"], "argument --varlen: not allowed with argument --seqlen"),
    (["--varlen", "1k"], "--varlen takes MIN,MAX"),
    (["--varlen", "2k,1k"], "--varlen takes MIN <= MAX, got 2048 > 1024"),
    (["--varlen", "0,1k"], "--varlen 0,1k: expected a positive integer"),
    (["--varlen", "12x,1k"], "--varlen 12x,1k: expected an integer"),
    (["--varlen", "128,32k"], "--varlen MAX (32768) must be <= --total-tokens (16384)"),
    (["--varlen", "--dtype", "bf16", "e4m3"], "--varlen takes --dtype bf16 / fp16"),
    (["--varlen", "--dtype", "bf16+e4m3"], "varlen mode with bf16+e4m3 is not implemented"),
])
def test_bad_varlen_options_give_one_line(capsys, args, message):
    assert cli.main(["bench", "--dry-run", *args]) == cli.EXIT_FAILURE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("flash-hopper bench: error:") and message in err


def test_varlen_dry_run_and_help(capsys):
    argv = ["bench", "--varlen", "--backends", "fa3", "sdpa-flash", "-d", "128", "--causal", "off"]
    assert cli.main([*argv, "--dry-run"]) == 0
    tflop = parse_bench(*argv[1:])[1][0].flops() / 1e12
    case_line = ("  bf16 d=128 s=varlen 3 seqs 3283..7045 (16k tok) b=3 h=16/16 non-causal "
                 f"varlen  fwd {tflop:.3f} TFLOP")
    assert capsys.readouterr().out.splitlines() == [
        "1 configurations x 1 direction(s) x backends fa3 sdpa-flash", case_line,
        "varlen lengths: 7045 3283 6056"]
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--varlen [MIN,MAX]" in text and "jagged nested tensors" in text


# ---- the reference check ---------------------------------------------------------------------

def packed_inputs(c, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(c.tokens_q, c.heads, c.head_dim, generator=gen).to(dtype)
    k = torch.randn(c.tokens_k, c.heads_kv, c.head_dim, generator=gen).to(dtype)
    v = torch.randn(c.tokens_k, c.heads_kv, c.head_dim, generator=gen).to(dtype)
    return q, k, v


def test_varlen_references_are_the_per_sequence_reference():
    c = varlen_case((7, 13, 1, 10), heads=4, heads_kv=2, causal=True, window=(4, -1),
                    softcap=3.0)
    q, k, v = packed_inputs(c)
    refs = check.VarlenReferences(q, k, v, c, max_scores=50)  # chunked inside sequences too
    cu = torch.tensor(c.cu_seqlens(), dtype=torch.int32)
    out, lse = reference.attention_varlen_ref(q, k, v, cu, cu, causal=True, window_size=(4, -1),
                                              softcap=3.0)
    assert refs.out.shape == (31, 4, 16) and refs.lse.shape == (4, 31)
    assert torch.allclose(refs.out, out, atol=1e-6, rtol=0)
    assert torch.allclose(refs.lse, lse, atol=1e-5, rtol=0)
    assert refs.ref_err > 0  # the same-precision reference really is bf16
    assert refs.shape == "varlen b4 total31 max13"
    assert refs.check(out.to(q.dtype), lse).passed


# ---- the runner on CPU with stand-in backends ---------------------------------------------------

class VarlenNaive(Backend):
    """Same-precision per-sequence attention of the packed batch: passes by construction."""

    name = "varlen-naive"
    origin = "torch"

    def varlen_reason(self):
        return None

    def attend(self, q, k, v, case):
        cu = torch.tensor(case.cu_seqlens(), dtype=torch.int32)
        return reference.attention_varlen_ref(q, k, v, cu, cu, causal=case.causal,
                                              window_size=case.window, upcast=False)

    def make_forward(self, q, k, v, case):
        return lambda: self.attend(q, k, v, case)[0]

    def kernel(self, q, k, v, case):
        return self.name, "attention_varlen_ref in the input dtype"


class RowsMoved(VarlenNaive):
    """The right values with one sequence's rows out of place (rolled by one): must fail."""

    name = "rows-moved"

    def make_forward(self, q, k, v, case):
        def run():
            out = self.attend(q, k, v, case)[0].clone()
            start, stop = case.cu_seqlens()[1:3]
            out[start:stop] = out[start:stop].roll(1, dims=0)
            return out

        return run


class OneSequence(VarlenNaive):
    """The classic varlen bug: the packed batch attended as one long sequence. Must fail."""

    name = "one-sequence"

    def make_forward(self, q, k, v, case):
        return lambda: reference.attention_ref(q[None], k[None], v[None], causal=case.causal,
                                               upcast=False)[0][0]


class WithLse(VarlenNaive):
    """Returns the (heads, total) LSE too, optionally shifted."""

    name = "varlen-lse"

    def __init__(self, shift=0.0):
        self.shift = shift

    def run_checked(self, q, k, v, case):
        cu = torch.tensor(case.cu_seqlens(), dtype=torch.int32)
        out, lse = reference.attention_varlen_ref(q, k, v, cu, cu, causal=case.causal)
        return out.to(q.dtype), lse + self.shift


class Dense(Backend):
    """A backend without a varlen path (base.Backend's answer)."""

    name = "dense-only"
    origin = "torch"


LENGTHS = (9, 23, 4, 14)


def run_varlen(backends_, directions=("fwd",), causal=True, lengths=LENGTHS, **case_fields):
    c = varlen_case(lengths, heads=4, heads_kv=4, causal=causal, **case_fields)
    return run_on_cpu(backends_, [c], peak_tflops=1000.0, directions=directions)


def test_varlen_rows_are_timed_and_checked():
    (row,) = run_varlen([VarlenNaive()])
    assert row["status"] == "ok" and row["check_pass"] is True
    assert row["check_err"] <= row["check_tol"]
    assert row["check_shape"] == "varlen b4 total50 max23"
    assert row["seqlens"] == "9 23 4 14"
    assert (row["batch"], row["seqlen_q"], row["seqlen_k"]) == (4, 23, 23)
    c = varlen_case(LENGTHS, heads=4, causal=True)
    assert row["flops"] == c.flops() and row["mask"] == "causal varlen"
    assert row["tflops"] == pytest.approx(c.flops() / 2e-3 / 1e12)


@pytest.mark.parametrize("backend", [RowsMoved(), OneSequence()], ids=lambda b: b.name)
@pytest.mark.parametrize("causal", [False, True])
def test_a_result_with_misplaced_sequences_fails(backend, causal):
    (row,) = run_varlen([backend], causal=causal)
    assert row["status"] == "ok" and row["check_pass"] is False
    assert row["check_err"] > 10 * row["check_tol"]


def test_the_varlen_lse_is_checked():
    (row,) = run_varlen([WithLse()])
    assert row["check_pass"] is True and row["check_lse_err"] < 1e-5
    (row,) = run_varlen([WithLse(shift=1e-3)])
    assert row["check_pass"] is False and row["check_err"] <= row["check_tol"]


def test_backends_without_varlen_and_backward_rows_are_skipped_with_reasons():
    rows = run_varlen([Dense(), VarlenNaive()], directions=("fwd", "bwd", "fwd+bwd"))
    by_key = {(r["backend"], r["direction"]): r for r in rows}
    for direction in ("fwd", "bwd", "fwd+bwd"):
        skipped = by_key[("dense-only", direction)]
        assert skipped["status"] == "skipped"
        assert skipped["reason"] == "unsupported (no varlen): no varlen path"
    assert by_key[("varlen-naive", "fwd")]["status"] == "ok"
    for direction in ("bwd", "fwd+bwd"):
        row = by_key[("varlen-naive", direction)]
        assert row["status"] == "skipped"
        assert row["reason"] == "varlen backward rows are not measured yet"


def test_timed_calls_run_in_the_backends_timing_context():
    events = []

    class Recording(VarlenNaive):
        name = "recording"

        def timing_context(self, case):
            import contextlib

            @contextlib.contextmanager
            def context():
                events.append("enter")
                yield
                events.append("exit")

            return context()

        def make_forward(self, q, k, v, case):
            run = super().make_forward(q, k, v, case)
            return lambda: events.append("call") or run()

        def run_checked(self, q, k, v, case):
            events.append("checked")
            return super().run_checked(q, k, v, case)

    (row,) = run_varlen([Recording()])
    assert row["status"] == "ok"
    # The check outside, then the timed calls (one per input set, two sets here) inside.
    assert events == ["checked", "call", "enter", "call", "call", "exit"]


def test_varlen_rows_round_trip_and_report(tmp_path):
    rows = run_varlen([VarlenNaive(), Dense()])
    data = report.result_set({"gpu": {"name": "Synthetic"}}, rows)
    report.write_json(str(tmp_path / "r.json"), data)
    report.write_csv(str(tmp_path / "r.csv"), data)
    back = report.read_json(str(tmp_path / "r.json"))["results"]
    assert back == report.read_csv(str(tmp_path / "r.csv"))["results"]
    assert report.row_seqlens(back[0]) == list(LENGTHS)
    assert report.row_seqlens({"seqlens": None}) is None
    table = report.format_table(back)
    assert "varlen 4 seqs 4..23 (50 tok)" in table and "causal varlen" in table
    assert "dense-only fwd (1 config): unsupported (no varlen)" in report.format_skips(back)


def test_plot_takes_varlen_rows(tmp_path):
    pytest.importorskip("matplotlib")
    rows = run_varlen([VarlenNaive(), Dense()]) + run_varlen([VarlenNaive()], causal=False)
    assert plot.seqlen_label(rows[0]) == "varlen 4 seqs 4..23 (50 tok)"
    counts = plot.plot_results(report.result_set({}, rows), str(tmp_path / "p.png"))
    assert counts == {"panels": 2, "bars": 2}  # a panel per mask, one x position each


# ---- flash-hopper's backends (library mocked) ----------------------------------------------------

def test_our_varlen_call_builds_the_offsets_before_timing(monkeypatch):
    import flash_hopper

    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append((cu_q, cu_k, max_q, max_k, kwargs))
        out = kwargs.get("out")
        if out is not None:
            assert bool(out.isnan().all())  # the checked call writes into NaN
            out.zero_()
        lse = torch.zeros(q.shape[1], q.shape[0])
        return (out if out is not None else q, lse) if kwargs.get("return_attn_probs") else q

    monkeypatch.setattr(flash_hopper, "flash_attn_varlen_func", fake_varlen)
    c = varlen_case((5, 9, 2), heads=4, heads_kv=2, causal=True, window=(3, 0), softcap=2.0)
    q, k, v = packed_inputs(c)
    fa2 = backends.FlashHopperBackend("fa2", "fa2")
    run = fa2.make_forward(q, k, v, c)
    assert len(calls) == 0  # nothing runs while the callable is built
    assert run() is q and run() is q
    first, second = calls
    assert first[0] is second[0] and first[0] is first[1]  # one offsets tensor, made up front
    assert first[0].dtype == torch.int32 and first[0].tolist() == [0, 5, 14, 16]
    assert first[2:4] == (9, 9)
    assert first[4] == {"causal": True, "window_size": (3, 0), "softcap": 2.0, "backend": "fa2"}
    calls.clear()
    out, lse = fa2.run_checked(q, k, v, c)
    assert len(calls) == 2  # in_nan_blocks: the second call runs in the NaN-filled blocks
    assert calls[0][4]["return_attn_probs"] is True and calls[0][4]["out"] is out
    assert out.shape == q.shape and bool((out == 0).all()) and lse.shape == (4, 16)


def test_our_timing_context_turns_the_offsets_check_off(monkeypatch):
    fa3 = backends.FlashHopperBackend("fa3", "fa3")
    c = varlen_case((4, 4))
    for before in (None, "1"):
        if before is None:
            monkeypatch.delenv(backends.CHECK_OFFSETS_ENV, raising=False)
        else:
            monkeypatch.setenv(backends.CHECK_OFFSETS_ENV, before)
        with fa3.timing_context(c):
            assert os.environ[backends.CHECK_OFFSETS_ENV] == "0"
        assert os.environ.get(backends.CHECK_OFFSETS_ENV) == before
    monkeypatch.setenv(backends.CHECK_OFFSETS_ENV, "1")
    with fa3.timing_context(Case(1, 8, 8, 1, 1, 16)):  # dense: left alone
        assert os.environ[backends.CHECK_OFFSETS_ENV] == "1"


def test_our_varlen_support(monkeypatch):
    fake_build_info(monkeypatch, {"version": "0.1.0", "archs": ["sm80", "sm90a"],
                                  "head_dims": [64, 128], "dtypes": ["bf16", "fp16"],
                                  "fa3_variants": ["fa3-noping"]})
    c = varlen_case((100, 50), heads=8, heads_kv=2, head_dim=128, window=(32, 0), softcap=5.0)
    fa3, fa2 = backends.FlashHopperBackend("fa3", "fa3"), backends.FlashHopperBackend("fa2", "fa2")
    for ours in (fa3, fa2):
        assert ours.varlen_reason() is None and runner.fp8_skip_reason(ours, c) is None
        assert ours.unsupported(c) is None  # GQA, windows, softcap: all varlen
        assert "bucket 256" in ours.unsupported(varlen_case((9,), head_dim=256))
    variant = backends.FlashHopperBackend("fa3-noping", "fa3-noping", variant=True)
    ablation = backends.FlashHopperBackend(backends.FP8_SINGLE_LEVEL, "fa3",
                                           fp8_accumulation="single-level")
    assert "ablation variant, dense only" in runner.fp8_skip_reason(variant, c)
    assert "FP8 accumulation ablation" in runner.fp8_skip_reason(ablation, c)
    assert variant.unsupported(c) == variant.varlen_reason()


def test_our_varlen_kernel_is_the_plans(monkeypatch):
    from flash_hopper import _varlen

    seen = {}

    def fake_plan(*args):
        seen["args"] = args
        return types.SimpleNamespace(dense=types.SimpleNamespace(backend="fa3", reason="forced"))

    monkeypatch.setattr(_varlen, "plan", fake_plan)
    c = varlen_case((6, 3), causal=True)
    q, k, v = packed_inputs(c)
    name, why = backends.FlashHopperBackend("fa3", "fa3").kernel(q, k, v, c)
    assert name == "fa3" and why == "forced; flash_attn_varlen_func, 2 sequences"
    assert seen["args"][3].tolist() == [0, 6, 9] and seen["args"][5:] == (
        6, 6, None, None, None, True, (-1, -1), 0.0, "fa3")


# ---- peers ---------------------------------------------------------------------------------------

def test_jagged_packing_round_trips():
    c = varlen_case((5, 1, 8))
    q, _, _ = packed_inputs(c)
    offsets = torch.tensor(c.cu_seqlens())
    nested = peers.pack_jagged(q, offsets)
    assert nested.is_nested and nested.shape[:2] == (3, 2) and nested.shape[3] == 16
    back = peers.unpack_jagged(nested)
    assert torch.equal(back, q) and back.data_ptr() == q.data_ptr()  # views, no copy


def test_sdpa_varlen_rules():
    flash, cudnn, efficient, math_ = (peers.SdpaBackend(k) for k in peers.SDPA_KINDS)
    c = varlen_case((100, 300), heads=8, heads_kv=8, causal=True)
    assert all(b.varlen_reason() is None for b in (flash, cudnn, efficient, math_))
    assert flash.unsupported(c) is None and efficient.unsupported(c) is None
    assert "refuses is_causal" in math_.unsupported(c)
    assert math_.unsupported(varlen_case((100, 300), heads=8)) is None
    assert "sliding window" in flash.unsupported(varlen_case((9, 4), window=(2, 0)))
    assert "no GQA" in flash.unsupported(varlen_case((9, 4), heads=4, heads_kv=2))
    assert "softcap" in efficient.unsupported(varlen_case((9, 4), softcap=3.0))
    assert "jagged nested tensors (2 sequences)" in flash.kernel(None, None, None, c)[1]


def test_sdpa_math_runs_a_jagged_batch_on_cpu():
    rows = run_varlen([peers.SdpaBackend("math")], causal=False)
    (row,) = rows
    assert row["status"] == "ok", row["reason"]
    assert row["check_pass"] is True


def test_flex_has_no_varlen_path():
    c = varlen_case((9, 4))
    assert runner.fp8_skip_reason(peers.FlexBackend(), c).startswith(
        "unsupported (no varlen): not wired up")


def fake_fa_package(monkeypatch, varlen=True, softcap=True):
    module = types.ModuleType("flash_attn")
    seen = {}

    def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1), softcap=0.0):
        return q

    module.flash_attn_func = flash_attn_func
    if varlen and softcap:
        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, causal=False, window_size=(-1, -1),
                                   softcap=0.0):
            seen.update(cu_q=cu_seqlens_q, cu_k=cu_seqlens_k, max=(max_seqlen_q, max_seqlen_k),
                        causal=causal, window=window_size, softcap=softcap)
            return q, torch.zeros(q.shape[1], q.shape[0])

        module.flash_attn_varlen_func = flash_attn_varlen_func
    elif varlen:
        module.flash_attn_varlen_func = lambda q, k, v, cu_seqlens_q, cu_seqlens_k, causal: q
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    backend = peers.external_backends()[0]
    assert backend.probe((9, 0)) is None
    return backend, seen


def test_fa_package_varlen_call(monkeypatch):
    backend, seen = fake_fa_package(monkeypatch)
    c = varlen_case((6, 2, 5), causal=True, window=(3, 0), softcap=4.0)
    q, k, v = packed_inputs(c)
    assert backend.varlen_reason() is None and backend.unsupported(c) is None
    out, lse = backend.run_checked(q, k, v, c)
    assert out is q and lse.shape == (2, 13)  # (heads, total): checked
    assert seen["cu_q"] is seen["cu_k"] and seen["cu_q"].tolist() == [0, 6, 8, 13]
    assert seen["cu_q"].dtype == torch.int32
    assert (seen["max"], seen["causal"], seen["window"], seen["softcap"]) == (
        (6, 6), True, (3, 0), 4.0)
    assert backend.make_forward(q, k, v, c)() is q
    assert backend.kernel(q, k, v, c) == ("flash-attn", "flash_attn.flash_attn_varlen_func")


def test_fa_package_without_a_varlen_entry_point(monkeypatch):
    backend, _ = fake_fa_package(monkeypatch, varlen=False)
    assert backend.varlen_reason() == (
        "flash_attn has no flash_attn_varlen_func (no varlen entry point)")
    backend, _ = fake_fa_package(monkeypatch, softcap=False)
    assert backend.varlen_reason() is None
    assert backend.unsupported(varlen_case((3, 4), softcap=2.0)) == (
        "flash_attn.flash_attn_varlen_func has no softcap argument")
    assert backend.unsupported(Case(1, 8, 8, 2, 2, 16, softcap=2.0)) is None  # its dense call


# ---- the whole command with the GPU mocked -------------------------------------------------------

def test_bench_varlen_with_mocked_gpu(tmp_path, monkeypatch, capsys):
    mock_h200_bench(monkeypatch)
    argv = ["bench", "--varlen", "16,40", "--total-tokens", "96", "-d", "16", "--hidden", "32",
            "--causal", "off", "--backends", "sdpa-math", "flex", "--direction", "fwd", "bwd",
            "--no-gemm", "-q", "--json", str(tmp_path / "r.json"), "--csv",
            str(tmp_path / "r.csv")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    lengths = draw_varlen_lengths(16, 40, 96, 0)
    assert sweep.varlen_label(lengths) in out
    assert "varlen backward rows are not measured yet" in out
    data = report.read_json(str(tmp_path / "r.json"))
    rows = {(r["backend"], r["direction"]): r for r in data["results"]}
    fwd = rows[("sdpa-math", "fwd")]
    assert fwd["status"] == "ok" and fwd["check_pass"] is True
    assert fwd["seqlens"] == " ".join(map(str, lengths)) and fwd["batch"] == len(lengths)
    assert rows[("sdpa-math", "bwd")]["status"] == "skipped"
    if data["meta"]["backends"]["flex"]["available"]:
        assert rows[("flex", "fwd")]["reason"].startswith("unsupported (no varlen)")
    assert data["meta"]["options"]["varlen"] == "16,40"
    assert report.read_csv(str(tmp_path / "r.csv"))["results"] == data["results"]


# ---- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
def test_varlen_bench_end_to_end(tmp_path):
    out = tmp_path / "r.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_DIR), env.get("PYTHONPATH")]))
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "flash_hopper", "bench", "--varlen", "--backends", "fa3", "fa2",
         "sdpa-flash", "-d", "128", "--warmup", "2", "--repeats", "5", "--no-gemm", "--json",
         str(out), "-q"], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    available = {name for name, s in data["meta"]["backends"].items() if s["available"]}
    assert "sdpa-flash" in available
    timed = [r for r in data["results"] if r["status"] == "ok"]
    assert {r["backend"] for r in timed} == available
    assert len(timed) == 2 * len(available)  # causal and not
    for row in timed:
        assert row["check_pass"] is True, row
        assert row["tflops"] > 0 and row["seqlens"] and row["batch"] == len(row["seqlens"].split())
    for row in timed:
        if row["backend"] in ("fa3", "fa2"):
            assert row["check_lse_err"] is not None, row  # ours returns the LSE
