"""The API fuzzer (tests/fuzz_api.py) in the test suite: every invalid call on FakeTensors
(CPU, no library) and on a GPU, and a fixed-seed slice of random valid calls on a GPU, each judged
by FA3's tolerance rule against the float reference. Longer runs: python tests/fuzz_api.py
--seconds N (bench/gpu_check.sh runs one, and one under compute-sanitizer)."""

from __future__ import annotations

import random

import fuzz_api
import pytest
import torch

CALLS = fuzz_api.invalid_calls("cuda")


@pytest.mark.parametrize(("desc", "arg", "call"), CALLS, ids=[c[0] for c in CALLS])
def test_invalid_call_names_the_argument(desc, arg, call):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert fuzz_api.check_invalid(desc, arg, call) is None


def test_type_fuzz_on_fake_tensors():
    assert fuzz_api.type_fuzz("fake") == []


def test_the_checker_catches_what_it_must():
    # a call that raises the wrong type, names another argument, or does not raise is a finding
    def wrong_type():
        raise RuntimeError("CUDA error: an illegal memory access")

    def wrong_name():
        raise ValueError("k: bad")

    assert "RuntimeError" in fuzz_api.check_invalid("x", "q", wrong_type)
    assert "does not name 'q'" in fuzz_api.check_invalid("x", "q", wrong_name)
    assert "no error" in fuzz_api.check_invalid("x", "q", lambda: None)


def test_the_judge_fails_wrong_results():
    ref = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    lowp = ref.to(torch.bfloat16)
    good = ref.to(torch.bfloat16)
    assert fuzz_api.fa3_check("out", good, ref, lowp, 2.0) is None
    bad = good.clone()
    bad[1, 2, 0, 3] += 0.5
    assert "max error" in fuzz_api.fa3_check("out", bad, ref, lowp, 2.0)
    nan = good.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert "NaN" in fuzz_api.fa3_check("out", nan, ref, lowp, 2.0)
    lse_ref = torch.tensor([[[1.0, float("-inf"), 2.0]]])
    assert fuzz_api.lse_check(lse_ref.clone(), lse_ref) is None
    assert "-inf rows" in fuzz_api.lse_check(torch.tensor([[[1.0, 0.0, 2.0]]]), lse_ref)
    out = torch.ones(1, 3, 1, 4)
    assert "not exactly 0" in fuzz_api.zero_rows_check(out, lse_ref)
    out[:, 1] = 0
    assert fuzz_api.zero_rows_check(out, lse_ref) is None


@pytest.mark.parametrize("mask", [{}, {"causal": True, "softcap": 20.0},
                                  {"window_size": (3, 1), "softmax_scale": 0.2}])
def test_algorithm_reference(mask):
    # FlashAttention's backward in float64 with an unrounded O is the autograd gradient; with O
    # rounded to bf16 it is not (the D = rowsum(dO * O) it reads)
    torch.manual_seed(0)
    inputs = [torch.randn(2, 9, 4, 16).bfloat16(), torch.randn(2, 7, 2, 16).bfloat16(),
              torch.randn(2, 7, 2, 16).bfloat16()]
    inputs[0] = inputs[0] * 4
    dout = torch.randn(2, 9, 4, 16).bfloat16()

    def ref(leaves, upcast):
        return fuzz_api.reference.attention_ref(*leaves, upcast=upcast, **mask)

    refs = fuzz_api.reference_and_grads(ref, inputs, dout, True)
    exact = fuzz_api.algorithm_grads(inputs, refs, dout, mask, torch.float64)
    rounded = fuzz_api.algorithm_grads(inputs, refs, dout, mask, torch.bfloat16)
    for name in ("dq", "dk", "dv"):
        torch.testing.assert_close(exact[name], refs[name], rtol=1e-9, atol=1e-9)
    assert not torch.equal(rounded["dq"], refs["dq"])
    torch.testing.assert_close(rounded["dv"], refs["dv"], rtol=1e-9, atol=1e-9)  # no D in dV


def test_draws_are_reproducible_and_in_range():
    a, b = random.Random(7), random.Random(7)
    lens = [fuzz_api.draw_len(a, False) for _ in range(200)]
    assert lens == [fuzz_api.draw_len(b, False) for _ in range(200)]
    assert min(lens) >= 1 and max(lens) <= 1100
    for _ in range(100):
        heads_q, heads_kv = fuzz_api.draw_heads(a)
        assert heads_q % heads_kv == 0
        mask = fuzz_api.draw_mask(a, 10, 20)
        assert set(mask) <= {"causal", "window_size", "softcap", "softmax_scale"}


@pytest.mark.gpu
def test_invalid_calls_on_the_gpu(lib):
    assert fuzz_api.run_invalid("cuda") == []
    assert fuzz_api.type_fuzz("cuda") == []


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_fp32_matmuls")
@pytest.mark.parametrize("kind", list(fuzz_api.VALID))
def test_random_valid_calls(lib, kind):
    outcomes = fuzz_api.run_valid(seconds=120, seed=20261202, small=True, kinds=[kind],
                                  max_cases=12)
    failed = [(o.config, o.problems) for o in outcomes if o.problems]
    assert not failed, failed
