"""The sweep loop on CPU with stand-in backends and a stand-in timer: row assembly, the reference
check, skip/error classification. Real GPU timing is covered by the gpu-marked test in
test_cli.py."""

import pytest
import torch
from flash_hopper.bench import check
from flash_hopper.bench.backends import Backend
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


def test_check_off_and_proxy():
    (row,) = run([Naive()], check="off")
    assert row["check_pass"] is None and row["status"] == "ok"
    big = Case(batch=4, seqlen_q=4096, seqlen_k=4096, heads=8, heads_kv=8, head_dim=16)
    proxy = check.check_case(big, "auto")
    assert (proxy.batch, proxy.seqlen_q, proxy.seqlen_k) == (1, 1024, 1024)
    assert check.check_case(big, "full") is big
    assert check.check_case(CASE, "auto") is CASE
    rect = Case(batch=1, seqlen_q=2048, seqlen_k=8192, heads=8, heads_kv=8, head_dim=16)
    assert (rect.proxy(1024).seqlen_q, rect.proxy(1024).seqlen_k) == (256, 1024)


def test_compare_rule():
    ref = torch.zeros(4)
    result = check.compare(torch.full((4,), 3e-3), ref, torch.full((4,), 2e-3))
    assert result.tol == pytest.approx(4e-3 + 1e-5)
    assert result.passed
    assert not check.compare(torch.full((4,), 5e-3), ref, torch.full((4,), 2e-3)).passed
    assert not check.compare(torch.full((4,), float("nan")), ref, ref).passed
