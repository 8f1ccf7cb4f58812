"""The sweep loop on CPU with stand-in backends and a stand-in timer: row assembly, the reference
check (of the timed configuration, on the timed inputs, with the LSE where a backend returns it),
skip/error classification. Real GPU timing is covered by the gpu-marked test in test_cli.py."""

import pytest
import torch
from flash_hopper.bench import check
from flash_hopper.bench.base import Backend
from flash_hopper.bench.cases import Case
from flash_hopper.bench.runner import Runner, RunOptions
from flash_hopper.bench.timing import Stats


class FixedTimer:
    """Calls each function once (so failures surface) and reports 2 ms."""

    def __init__(self):
        self.calls = 0

    def sets_for(self, nbytes):
        return 2

    def measure(self, fns):
        for fn in fns:
            fn()
        self.calls += 1
        return Stats(median=2.0, p20=1.9, p80=2.1, min=1.8, max=2.5, mean=2.0, n=10)


class Naive(Backend):
    """Same-precision naive attention: passes the tolerance rule by construction."""

    name = "naive"
    origin = "torch"

    def make_forward(self, q, k, v, case):
        from flash_hopper.reference import attention_ref

        return lambda: attention_ref(q, k, v, causal=case.causal, window_size=case.window,
                                     upcast=False)[0]


class Noisy(Naive):
    """Output off by far more than bf16 rounding: must fail the check."""

    name = "noisy"

    def make_forward(self, q, k, v, case):
        run = super().make_forward(q, k, v, case)
        return lambda: run() + 0.5


class Broken(Backend):
    name = "broken"
    origin = "external"

    def make_forward(self, q, k, v, case):
        def run():
            raise RuntimeError("No available kernel. Aborting execution.")
        return run


class OursBroken(Broken):
    name = "ours-broken"
    origin = "flash-hopper"


class OursUnsupported(Broken):
    name = "ours-unsupported"
    origin = "flash-hopper"

    def make_forward(self, q, k, v, case):
        def run():
            raise NotImplementedError("this build has no fa3 kernel for bf16 hdim 96")
        return run


class NoWindows(Naive):
    name = "nowindow"

    def unsupported(self, case, direction=None):
        return "no windows here" if case.has_window else None


CASE = Case(batch=2, seqlen_q=64, seqlen_k=96, heads=4, heads_kv=2, head_dim=32, causal=True)


def run(backends, cases=(CASE,), **options):
    opts = RunOptions(device="cpu", peak_tflops=1000.0, gemm_tflops=500.0, **options)
    return Runner(backends, FixedTimer(), opts).run(list(cases))


def test_timed_row_with_passing_check():
    (row,) = run([Naive()])
    assert row["status"] == "ok"
    assert row["ms"] == 2.0 and row["ms_p20"] == 1.9 and row["iters"] == 10
    assert row["tflops"] == pytest.approx(CASE.flops() / 2e-3 / 1e12)
    assert row["pct_peak"] == pytest.approx(row["tflops"] / 10)
    assert row["pct_gemm"] == pytest.approx(row["tflops"] / 5)
    assert row["check_pass"] is True
    assert row["check_err"] <= row["check_tol"]
    assert row["check_shape"] == "b2 sq64 sk96"  # small enough to check at full size


def test_failing_check_is_reported():
    (row,) = run([Noisy()])
    assert row["status"] == "ok"
    assert row["check_pass"] is False
    assert row["check_err"] > 0.4


def test_setup_failures_are_skips_for_peers_and_errors_for_us():
    rows = run([Broken(), OursBroken(), OursUnsupported()])
    by_name = {r["backend"]: r for r in rows}
    assert by_name["broken"]["status"] == "skipped"
    assert "No available kernel" in by_name["broken"]["reason"]
    assert by_name["ours-broken"]["status"] == "error"
    assert by_name["ours-unsupported"]["status"] == "skipped"
    assert "hdim 96" in by_name["ours-unsupported"]["reason"]


def test_unsupported_config_and_directions():
    windowed = Case(batch=1, seqlen_q=32, seqlen_k=32, heads=2, heads_kv=2, head_dim=16,
                    window=(8, 0))
    rows = run([NoWindows()], cases=(CASE, windowed), directions=("fwd", "bwd"))
    assert [(r["direction"], r["status"]) for r in rows] == [
        ("fwd", "ok"), ("bwd", "ok"), ("fwd", "skipped"), ("bwd", "skipped")]
    assert rows[1]["flops"] == 2.5 * rows[0]["flops"]
    assert rows[2]["reason"] == "no windows here"


class WithLse(Naive):
    """Returns the same-precision LSE too, optionally shifted: the LSE part of the check."""

    name = "with-lse"

    def __init__(self, lse_shift=0.0):
        self.lse_shift = lse_shift

    def run_checked(self, q, k, v, case):
        from flash_hopper.reference import attention_ref

        out, lse = attention_ref(q, k, v, causal=case.causal, window_size=case.window)
        return out.to(q.dtype), lse + self.lse_shift


class Recording(Naive):
    """Remembers the shapes and the first element of every call it is asked to check."""

    name = "recording"

    def __init__(self):
        self.checked = []

    def run_checked(self, q, k, v, case):
        self.checked.append((tuple(q.shape), tuple(k.shape), float(q.flatten()[0])))
        return super().run_checked(q, k, v, case)


def test_lse_is_checked_where_returned():
    (row,) = run([WithLse()])
    assert row["check_pass"] is True
    assert row["check_lse_err"] < 1e-5 and row["check_lse_tol"] == check.LSE_ATOL
    (row,) = run([WithLse(lse_shift=1e-3)])
    assert row["check_pass"] is False
    assert row["check_err"] <= row["check_tol"]  # the output alone would have passed
    assert row["check_lse_err"] == pytest.approx(1e-3, rel=1e-3)
    (row,) = run([Naive()])
    assert row["check_lse_err"] is None and row["check_lse_tol"] is None


def test_the_timed_configuration_is_checked_at_full_size():
    # Longer than the old proxy limit (1024): the check still runs on the timed shapes and inputs.
    long = Case(batch=1, seqlen_q=1100, seqlen_k=1300, heads=1, heads_kv=1, head_dim=8,
                causal=True)
    backend = Recording()
    (row,) = run([backend], cases=(long,))
    assert backend.checked == [((1, 1100, 1, 8), (1, 1300, 1, 8), backend.checked[0][2])]
    assert row["check_shape"] == "b1 sq1100 sk1300" and row["check_pass"] is True


def test_check_runs_once_per_case_and_backend(monkeypatch):
    calls = []
    original = check.References.__init__

    def counting(self, *args, **kwargs):
        calls.append(args[-1])
        original(self, *args, **kwargs)

    monkeypatch.setattr(check.References, "__init__", counting)
    backend = Recording()
    rows = run([backend, Naive()], directions=("fwd", "bwd"))
    assert len(calls) == 1  # one reference for the case, shared by both backends
    assert len(backend.checked) == 1  # one check call, whatever the timing repeats
    assert [r["check_pass"] for r in rows] == [True] * 4


def test_check_off():
    backend = Recording()
    (row,) = run([backend], check="off")
    assert row["check_pass"] is None and row["status"] == "ok"
    assert backend.checked == []


def test_a_backend_that_writes_nothing_fails():
    class Unwritten(Naive):
        name = "unwritten"

        def run_checked(self, q, k, v, case):
            return torch.full_like(q, float("nan")), None  # a poisoned buffer left as it was

    (row,) = run([Unwritten()])
    assert row["check_pass"] is False


def test_chunked_references_equal_unchunked():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 37, 4, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
    c = Case(batch=2, seqlen_q=37, seqlen_k=37, heads=4, heads_kv=4, head_dim=16, causal=True,
             window=(9, -1), softcap=3.0)
    whole = check.References(q, k, v, c)
    chunked = check.References(q, k, v, c, max_scores=2 * 4 * 37 * 3)  # 3 rows per chunk
    assert torch.allclose(whole.out, chunked.out, atol=1e-6, rtol=0)
    assert torch.equal(whole.lse.isinf(), chunked.lse.isinf())
    assert whole.ref_err == pytest.approx(chunked.ref_err, abs=1e-2)


def test_lse_error_rules():
    inf = float("inf")
    ref = torch.tensor([1.0, -inf, 2.0])
    assert check.lse_error(torch.tensor([1.5, -inf, 2.0]), ref) == 0.5
    assert check.lse_error(torch.tensor([1.0, 0.0, 2.0]), ref) == inf  # a row without keys
    assert check.lse_error(torch.tensor([-inf, -inf, 2.0]), ref) == inf  # a row lost its keys
    assert check.lse_error(torch.tensor([float("nan"), -inf, 2.0]), ref) != \
        check.lse_error(torch.tensor([float("nan"), -inf, 2.0]), ref)  # NaN
    assert check.lse_tolerance(30.0) == pytest.approx(1e-4 + 30 * 2**-10)


def test_compare_rule():
    ref = torch.zeros(4)
    result = check.compare(torch.full((4,), 3e-3), ref, torch.full((4,), 2e-3))
    assert result.tol == pytest.approx(4e-3 + 1e-5)
    assert result.passed
    assert not check.compare(torch.full((4,), 5e-3), ref, torch.full((4,), 2e-3)).passed
    assert not check.compare(torch.full((4,), float("nan")), ref, ref).passed
