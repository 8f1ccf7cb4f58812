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


# ---- backward rows: the gradient check and the memory columns -----------------------------------

DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
GRAD_COLUMNS = [f"check_{g}_{x}" for g in ("dq", "dk", "dv") for x in ("err", "tol")]


class GradShift(Naive):
    """Naive's forward; its checked backward's gradient ``name`` (dq, dk or dv) off by
    ``shift``, NaN with shift=nan (a gradient left unwritten)."""

    name = "grad-shift"

    def __init__(self, grad="dk", shift=0.5):
        self.grad, self.shift = grad, shift

    def run_checked_backward(self, q, k, v, dout, case):
        grads = list(super().run_checked_backward(q, k, v, dout, case))
        index = ("dq", "dk", "dv").index(self.grad)
        grads[index] = grads[index] + self.shift
        return tuple(grads)


class BwdBroken(Naive):
    name = "bwd-broken"
    origin = "external"
    error = RuntimeError

    def run_checked_backward(self, q, k, v, dout, case):
        raise self.error("backward kernel not available")


class OursBwdBroken(BwdBroken):
    name = "ours-bwd-broken"
    origin = "flash-hopper"


class OursBwdUnsupported(OursBwdBroken):
    name = "ours-bwd-unsupported"
    error = NotImplementedError


def test_backward_rows_carry_the_gradient_check():
    rows = run([Naive()], directions=DIRECTIONS)
    fwd, bwd, both = rows
    assert all(fwd[c] is None for c in GRAD_COLUMNS) and fwd["check_grad_pass"] is None
    for row in (bwd, both):
        assert row["status"] == "ok" and row["check_pass"] is True
        assert row["check_grad_pass"] is True
        for g in ("dq", "dk", "dv"):
            assert 0 < row[f"check_{g}_err"] <= row[f"check_{g}_tol"]
        # The forward's columns stay: the backward consumes its output.
        assert row["check_err"] == fwd["check_err"]
        # No CUDA device, no memory numbers (and no note about it).
        assert row["bwd_workspace_bytes"] is None and row["bwd_extra_bytes"] is None
        assert row["notes"] is None
    assert [bwd[c] for c in GRAD_COLUMNS] == [both[c] for c in GRAD_COLUMNS]  # one check


@pytest.mark.parametrize("grad", ["dq", "dk", "dv"])
def test_a_wrong_gradient_fails_only_its_column(grad):
    fwd, bwd, both = run([GradShift(grad)], directions=DIRECTIONS)
    assert fwd["check_pass"] is True  # the forward row does not run the backward
    for row in (bwd, both):
        assert row["status"] == "ok"  # timed all the same: the check is reported, not fatal
        assert row["check_pass"] is False and row["check_grad_pass"] is False
        for g in ("dq", "dk", "dv"):
            within = row[f"check_{g}_err"] <= row[f"check_{g}_tol"]
            assert within == (g != grad), g


def test_a_small_gradient_error_passes_and_nan_fails():
    (_, row) = run([GradShift("dv", shift=1e-4)], directions=("fwd", "bwd"))
    assert row["check_pass"] is True  # below the rounding floor (GRAD_ATOL)
    (_, row) = run([GradShift("dv", shift=float("nan"))], directions=("fwd", "bwd"))
    assert row["check_pass"] is False and row["check_dv_err"] != row["check_dv_err"]


def test_a_failing_forward_fails_the_backward_rows():
    # Noisy's output is shifted by a constant, which leaves its gradients exact.
    fwd, bwd = run([Noisy()], directions=("fwd", "bwd"))
    assert fwd["check_pass"] is False
    assert bwd["check_grad_pass"] is True and bwd["check_pass"] is False


def test_a_backward_that_fails_is_classified_like_a_first_call():
    rows = run([BwdBroken(), OursBwdBroken(), OursBwdUnsupported()], directions=("fwd", "bwd"))
    by_key = {(r["backend"], r["direction"]): r for r in rows}
    for name in ("bwd-broken", "ours-bwd-broken", "ours-bwd-unsupported"):
        assert by_key[(name, "fwd")]["status"] == "ok"  # the forward is timed all the same
        assert by_key[(name, "bwd")]["ms"] is None
        reason = by_key[(name, "bwd")]["reason"]
        assert reason.startswith("backward failed to run: ") and "not available" in reason
    assert by_key[("bwd-broken", "bwd")]["status"] == "skipped"
    assert by_key[("ours-bwd-broken", "bwd")]["status"] == "error"
    assert by_key[("ours-bwd-unsupported", "bwd")]["status"] == "skipped"


class RecordingBwd(Naive):
    name = "recording-bwd"

    def __init__(self, no_backward=False):
        self.douts = []
        self.no_backward = no_backward

    def unsupported(self, case, direction=None):
        return "no backward here" if self.no_backward and direction == "bwd" else None

    def run_checked_backward(self, q, k, v, dout, case):
        self.douts.append(dout.clone())
        return super().run_checked_backward(q, k, v, dout, case)


def test_gradient_references_once_per_case_and_only_when_needed(monkeypatch):
    calls = []
    original = check.GradReferences.__init__

    def counting(self, *args, **kwargs):
        calls.append(args[-2])  # the case
        original(self, *args, **kwargs)

    monkeypatch.setattr(check.GradReferences, "__init__", counting)
    first, second = RecordingBwd(), RecordingBwd()
    run([first, second], directions=DIRECTIONS)
    assert calls == [CASE]  # shared by both backends and both backward directions
    assert len(first.douts) == len(second.douts) == 1  # one checked backward per backend
    assert torch.equal(first.douts[0], second.douts[0])  # the case's dout, the same for all
    calls.clear()
    run([RecordingBwd()], directions=("fwd",))
    run([RecordingBwd(no_backward=True)], directions=("fwd", "bwd"))
    assert calls == []  # nothing to check: no reference paid for


def test_gradient_check_off():
    backend = RecordingBwd()
    rows = run([backend], check="off", directions=DIRECTIONS)
    assert backend.douts == []
    assert all(r["check_pass"] is None and r["check_grad_pass"] is None for r in rows)
    assert all(r["status"] == "ok" for r in rows)


def test_gradient_reference_failure_is_a_note(monkeypatch):
    def failing(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")

    monkeypatch.setattr(check.GradReferences, "__init__", failing)
    fwd, bwd = run([Naive()], directions=("fwd", "bwd"))
    assert fwd["check_pass"] is True and bwd["status"] == "ok"
    assert bwd["check_grad_pass"] is None and bwd["check_pass"] is True
    assert bwd["notes"].startswith("gradient reference unavailable: OutOfMemoryError: CUDA")


def test_chunked_gradient_references_equal_unchunked():
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 37, 4, 16, generator=gen).to(torch.bfloat16)
                     for _ in range(4))
    c = Case(batch=2, seqlen_q=37, seqlen_k=37, heads=4, heads_kv=4, head_dim=16, causal=True,
             window=(9, -1), softcap=3.0)
    fwd = check.References(q, k, v, c)
    whole = check.GradReferences(q, k, v, dout, c, fwd)
    chunked = check.GradReferences(q, k, v, dout, c, fwd, max_scores=2 * 4 * 37 * 3)
    for a, b in zip(whole.grads, chunked.grads):
        assert a.dtype == torch.float32 and torch.allclose(a, b, atol=1e-5, rtol=0)
    for g in check.GRAD_NAMES:
        assert whole.tol[g] == pytest.approx(chunked.tol[g], rel=0.5)


def test_gradient_rule_on_synthetic_tensors():
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, 20, 2, 8, generator=gen).to(torch.bfloat16)
                     for _ in range(4))
    for softcap in (0.0, 2.0):
        c = Case(batch=1, seqlen_q=20, seqlen_k=20, heads=2, heads_kv=2, head_dim=8,
                 softcap=softcap)
        refs = check.GradReferences(q, k, v, dout, c, check.References(q, k, v, c))
        factor = 3.0 if softcap else 2.0
        for g, ref in zip(check.GRAD_NAMES, refs.grads):
            atol = max(check.rounding_scale(ref, torch.bfloat16), check.GRAD_ATOL)
            assert refs.tol[g] == pytest.approx(factor * refs.ref_err[g] + atol)
            assert refs.ref_err[g] > 0  # the same-precision reference really is bf16
        exact = refs.check(refs.grads)
        assert exact.passed and all(e == 0 for e in exact.err.values())
        # Just inside and just outside the tolerance, on one element of dk.
        for fraction, passed in ((0.9, True), (1.1, False)):
            dk = refs.grads[1].clone()
            dk[0, 3, 1, 2] += fraction * refs.tol["dk"]
            result = refs.check((refs.grads[0], dk, refs.grads[2]))
            assert result.passed is passed and result.err["dk"] == pytest.approx(
                fraction * refs.tol["dk"], rel=1e-3)


def test_gradient_tolerance_helpers():
    assert check.grad_tolerance(0.01, 0.0, softcap=0.0) == pytest.approx(0.02 + check.GRAD_ATOL)
    assert check.grad_tolerance(0.01, 0.004, softcap=30.0) == pytest.approx(0.03 + 0.004)
    assert check.tolerance(0.01) == pytest.approx(0.02 + check.ATOL)  # the forward's, unchanged
    # bf16 near 1.3 has an ulp of 2^-7: 1 + 0.3 - 0.3 comes back 2^-8 off, doubled.
    assert check.rounding_scale(torch.tensor([1.0, 0.0]), torch.bfloat16) == 2**-7
    assert check.rounding_scale(torch.zeros(3), torch.bfloat16) == 0.0
    assert check.rounding_scale(torch.ones(3), torch.float32) <= 2**-22


def test_backward_memory_arithmetic(monkeypatch):
    # memory.measure_bwd_extra_bytes on CPU tensors with the allocator's counters stood in: peak
    # during the backward - allocated before it - the three gradients' bytes.
    from flash_hopper.bench import memory

    grad_bytes = 3 * 2 * 4 * 1 * 16 * 4  # dq, dk, dv: fp32 (2, 4, 1, 16)
    counters = {"allocated": 1000, "peak": 1000 + 4096 + grad_bytes}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["peak"])
    case = Case(batch=2, seqlen_q=4, seqlen_k=4, heads=1, heads_kv=1, head_dim=16)
    inputs = tuple(torch.randn(2, 4, 1, 16) for _ in range(3))
    extra = memory.measure_bwd_extra_bytes(Naive(), inputs, torch.randn(2, 4, 1, 16), case)
    assert extra == 4096


def test_backward_memory_is_not_measured_off_cuda():
    from flash_hopper.bench import memory

    inputs = tuple(torch.randn(1, 4, 1, 8) for _ in range(3))
    case = Case(batch=1, seqlen_q=4, seqlen_k=4, heads=1, heads_kv=1, head_dim=8)
    assert memory.bwd_memory(Naive(), inputs, inputs[0], case) == (
        {"bwd_workspace_bytes": None, "bwd_extra_bytes": None}, None)
