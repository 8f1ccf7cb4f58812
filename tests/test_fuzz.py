"""The API fuzzer (tests/fuzz_api.py) in the test suite: every invalid call on FakeTensors
(CPU, no library) and on a GPU, and a fixed-seed slice of random valid calls on a GPU, each judged
by FA3's tolerance rule against the float reference. Serving hazards: their draws (every
category, well-formed, reproducible), the contract they are judged by, and their checks on CPU --
against a stand-in library that keeps the contract (no finding) and ones that break it one way
each (the finding) -- and a fixed-seed slice of them on a GPU. Longer runs: python
tests/fuzz_api.py --seconds N (bench/gpu_check.sh runs one, and one under compute-sanitizer)."""

from __future__ import annotations

import dataclasses
import json
import os
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


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on a GPU machine FakeTensors of a cuda device pass the device query "
                           "and reach the value reads; test_invalid_calls_on_the_gpu runs this "
                           "fuzz on real tensors there")
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


# --- serving hazards -----------------------------------------------------------------------------

# What a build with every fp16 / bf16 forward would offer (hazard draws need no GPU).
CPU_CAP = fuzz_api.Capability(
    dtypes=[torch.bfloat16, torch.float16], table=[64, 96, 128, 192, 256],
    buckets=[64, 96, 128, 192, 256],
    fwd={(t, d) for t in (torch.bfloat16, torch.float16) for d in (64, 96, 128, 192, 256)})


def hazard_draws(count, start=0):
    return [fuzz_api.draw_hazard(random.Random(seed), CPU_CAP, True)
            for seed in range(start, start + count)]


def first_draw(accept):
    return next(d for d in hazard_draws(400) if accept(d))


class StandIn:
    """flash_hopper's three entry points in plain torch on CPU, as their contract says: a draw
    the fuzzer would not judge under this call's value checks (the variable) is refused naming
    an argument at fault; a judged one is answered with the float64 reference, written into
    out= and the caches in place. ``fault`` breaks it one way, to see the hazard checks report
    it."""

    def __init__(self, draw, fault=None):
        self.draw, self.fault, self.env = draw, fault, []

    def _start(self, kw):
        env = os.environ.get(fuzz_api.CHECK_OFFSETS_ENV)
        self.env.append(env)
        if self.fault == "runtime_error":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if self.fault == "unnamed":
            raise ValueError("a value is out of range")
        if self.fault == "refuse_after_append":
            kw["k_cache"][0, 0] += 1
            raise ValueError("cache_seqlens: refused after writing the cache")
        if self.fault == "changes_input":
            kw["q"][(0,) * kw["q"].dim()] += 1
        if not dataclasses.replace(self.draw, checks=env != "0").judged:
            why = self.draw.violations + self.draw.unspecified + ["max_seqlen_q: a short hint"]
            raise ValueError(f"{why[0].split(':')[0]}: refused by the stand-in")

    def _finish(self, kw, out, lse, want_lse):
        if self.fault == "nan":
            out[(0,) * out.dim()] = float("nan")
        if self.fault == "wrong":
            out[(0,) * out.dim()] += 1
        if self.fault == "outside_out":  # the element before out's slice in its buffer
            out.as_strided((1,), (1,), out.storage_offset() - 1).fill_(0)
        if self.fault == "cache_guard":  # the element before k_cache in its buffer
            k = kw["k_cache"]
            k.as_strided((1,), (1,), k.storage_offset() - 1).fill_(0)
        lse = lse.float()
        if self.fault == "lse_nan_outside":  # row 0 before the first sequence: never written
            lse[:, 0] = float("nan")
        if self.fault == "lse_nan_inside":
            lse[:, -1] = float("nan")
        return (out, lse) if want_lse else out

    def flash_attn_func(self, q, k, v, return_attn_probs=False, **mask):
        kw = {"q": q}
        self._start(kw)
        out, lse = fuzz_api.reference.attention_ref(q.double(), k.double(), v.double(), **mask)
        return self._finish(kw, out.to(q.dtype), lse, return_attn_probs)

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, seqused_k=None, return_attn_probs=False, out=None,
                               **mask):
        kw = {"q": q}
        self._start(kw)
        ref, lse = fuzz_api.reference.attention_varlen_ref(
            q.double(), k.double(), v.double(), cu_seqlens_q, cu_seqlens_k, None, seqused_k,
            **mask)
        bounds = cu_seqlens_q.tolist()
        for a, b in zip(bounds, bounds[1:]):  # rows outside every sequence keep what out held
            out[a:b] = ref[a:b].to(out.dtype)
        return self._finish(kw, out, lse, return_attn_probs)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                                cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                cu_seqlens_q=None, max_seqlen_q=None, return_softmax_lse=False,
                                out=None, **mask):
        kw = {"q": q, "k_cache": k_cache}
        self._start(kw)
        ref, lse, k_after, v_after = fuzz_api.kvcache_reference(
            q.double(), k_cache.double(), v_cache.double(), None if k is None else k.double(),
            None if v is None else v.double(), cache_seqlens, cache_batch_idx, cache_leftpad,
            page_table, cu_seqlens_q, mask)
        k_cache.copy_(k_after)
        v_cache.copy_(v_after)
        out.copy_(ref)
        return self._finish(kw, out, lse, return_softmax_lse)


def run_on_cpu(draw, fault=None):
    torch.manual_seed(0)
    stand_in = StandIn(draw, fault)
    problems, facts, fatal = fuzz_api.run_hazard(draw, "cpu", stand_in)
    assert not fatal
    return problems, facts, stand_in


def test_guard_check_finds_a_change_outside_the_slice():
    buffer = torch.full((300, 4, 8), fuzz_api.OUT_SENTINEL, dtype=torch.bfloat16)
    inside = (slice(100, 200),)
    assert fuzz_api.guard_check(buffer, inside, fuzz_api.OUT_SENTINEL) is None
    buffer[150].normal_()  # inside the slice: allowed
    assert fuzz_api.guard_check(buffer, inside, fuzz_api.OUT_SENTINEL) is None
    buffer[250, 1, 3] = 4.0
    problem = fuzz_api.guard_check(buffer, inside, fuzz_api.OUT_SENTINEL, "out's buffer")
    assert "out's buffer: 1 element(s)" in problem and "(250, 1, 3)" in problem
    # a NaN sentinel is compared bit for bit; two slices (K and V in one buffer)
    guard = torch.full((4, 2, 3), float("nan"), dtype=torch.float16)
    parts = [(slice(1, 3), 0), (slice(1, 3), 1)]
    assert fuzz_api.guard_check(guard, parts, float("nan")) is None
    guard[0, 1, 2] = -float("nan")
    assert "(0, 1, 2)" in fuzz_api.guard_check(guard, parts, float("nan"))
    guard[0, 1, 2] = float("nan")
    guard[1:3] = 0.0
    assert fuzz_api.guard_check(guard, parts, float("nan")) is None


def test_cache_unchanged_finds_a_changed_cache():
    cache = torch.randn(3, 16, 2, 8).to(torch.bfloat16)
    before = {"k_cache": cache.clone(), "v_cache": cache.clone()}
    assert fuzz_api.cache_unchanged(before, {"k_cache": cache, "v_cache": cache}) is None
    changed = cache.clone()
    changed[2, 5, 1, 0] += 1
    problem = fuzz_api.cache_unchanged(before, {"k_cache": cache, "v_cache": changed})
    assert problem.startswith("v_cache: 1 of") and "k_cache" not in problem
    signed = torch.tensor([0.0, -0.0])  # equal as numbers, not bit for bit
    assert "1 of 2" in fuzz_api.cache_unchanged({"x": torch.zeros(2)}, {"x": signed})


def test_refusal_problem_wants_an_allowed_type_naming_an_argument():
    from flash_hopper._errors import UnsupportedError

    args = ["q", "k_cache", "cache_seqlens", "window_size"]
    assert fuzz_api.refusal_problem(ValueError("cache_seqlens: expected 0 <= ..."), args) is None
    assert fuzz_api.refusal_problem(TypeError("window_size[0]: expected an int"), args) is None
    assert fuzz_api.refusal_problem(UnsupportedError("q: not yet"), args) is None
    assert fuzz_api.refusal_problem(ValueError("k / v: expected both"), ["v"]) is None
    assert fuzz_api.refusal_problem(ValueError("expected q's dtype"), ["q"]) is None
    assert "names none" in fuzz_api.refusal_problem(ValueError("a value is bad"), args)
    assert "names none" in fuzz_api.refusal_problem(ValueError("index out of range"), ["out"])
    # a word, not a fragment: "k" is not named by "k_cache", "q" not by "max_seqlen_q"
    assert "names none" in fuzz_api.refusal_problem(ValueError("k_cache: bad"), ["k"])
    assert "names none" in fuzz_api.refusal_problem(ValueError("max_seqlen_q: x"), ["q"])
    assert "RuntimeError" in fuzz_api.refusal_problem(RuntimeError("q: CUDA error"), args)


def test_offset_checks_set_and_restore_the_variable(monkeypatch):
    env = fuzz_api.CHECK_OFFSETS_ENV
    monkeypatch.setenv(env, "1")
    with fuzz_api.offset_checks(False):
        assert os.environ[env] == "0"
    assert os.environ[env] == "1"
    with fuzz_api.offset_checks(True):
        assert env not in os.environ
    assert os.environ[env] == "1"
    monkeypatch.delenv(env)
    with pytest.raises(KeyError), fuzz_api.offset_checks(False):
        raise KeyError
    assert env not in os.environ


def test_hazard_draws_cover_every_category():
    draws = hazard_draws(500)
    seen = {category for draw in draws for category in draw.hazards}
    assert seen == set(fuzz_api.HAZARD_CATEGORIES)
    assert {draw.entry for draw in draws} == {"dense", "varlen", "kvcache", "paged"}
    # every kind of draw the judge distinguishes occurs: valid, out of contract, without one
    # right answer, with a short max_seqlen hint alone
    assert any(not (d.violations or d.unspecified or d.hint) for d in draws)
    assert any(d.violations for d in draws) and any(d.unspecified for d in draws)
    assert any(d.hint and not (d.violations or d.unspecified) for d in draws)
    # about half of the varlen / KV-cache draws are decode shapes at its head dims
    served = [d for d in draws if d.entry != "dense"]
    decode = [d for d in served if d.decode]
    assert 0.35 < len(decode) / len(served) < 0.65
    group = {id(d): d.heads_q // d.heads_kv for d in draws}
    for d in served:
        lens = d.sizes.get("lens_q") or [d.sizes["seqlen_q"]]
        rows = max(lens) * group[id(d)]
        assert rows == 0 or (rows <= fuzz_api.DECODE_ROWS) == d.decode, d.config()
        assert not d.decode or d.head_dim in fuzz_api.DECODE_HEAD_DIMS


def test_decode_shapes_follow_the_librarys_table(lib):
    table = lib.build_info()["decode"]
    assert fuzz_api.DECODE_HEAD_DIMS == tuple(table["head_dims"])
    assert fuzz_api.DECODE_ROWS == table["max_rows"]


def test_hazard_draws_are_well_formed():
    for draw in hazard_draws(500):
        config = draw.config()
        assert json.loads(json.dumps(config)) == json.loads(json.dumps(draw.config()))
        assert draw.heads_q % draw.heads_kv == 0 and draw.head_dim % 8 == 0
        assert set(draw.hazards) <= set(fuzz_api.HAZARD_CATEGORIES)
        sizes, values = draw.sizes, draw.values
        for name, value in values.items():
            flat = ([x for row in value for x in row] if name == "page_table" else
                    [value] if isinstance(value, int) else value)
            assert all(fuzz_api.INT32_MIN <= x <= fuzz_api.INT32_MAX for x in flat), name
        batch = sizes["batch"]
        if "cu_seqlens_q" in values:
            assert len(values["cu_seqlens_q"]) == batch + 1
        if draw.entry == "varlen":
            assert len(values["cu_seqlens_k"]) == batch + 1
            assert len(values.get("seqused_k", [0] * batch)) == batch
        if draw.entry in ("kvcache", "paged"):
            for name in ("cache_seqlens", "cache_batch_idx", "cache_leftpad"):
                assert len(values.get(name, [0] * batch)) == batch, name
        if draw.entry == "paged":
            table = values["page_table"]
            assert len(table) == sizes["table_rows"]
            assert {len(row) for row in table} == {sizes["max_pages"]}
            assert sizes["capacity"] == sizes["max_pages"] * sizes["page_size"]
        for name, layout in draw.layouts.items():
            if layout == "expanded":
                rows = values[name] if name == "page_table" else [[x] for x in values[name]]
                assert all(row == rows[0] for row in rows), name
        window = draw.mask.get("window_size")
        if {"window_huge", "window_huge_causal"} & set(draw.hazards):
            assert set(window) & set(fuzz_api.HUGE_WINDOWS)
        assert not draw.judged or not (draw.violations or draw.unspecified)


def test_seqused_after_a_broken_offset_stays_int32():
    # cu_seqlens_k[0] broken to -2^31 first: the spans after it exceed int32, and seqused_k
    # drawn from them must still be int32 values (the tensor holding them is int32)
    for seed in range(50):
        draw = fuzz_api.HazardDraw("varlen", torch.bfloat16, 64, 2, 1, checks=True,
                                   decode=False, junk=7)
        draw.values["cu_seqlens_k"] = [fuzz_api.INT32_MIN, 847, 1230]
        fuzz_api._seqused(random.Random(seed), draw, past=seed % 2 == 0)
        assert all(fuzz_api.INT32_MIN <= x <= fuzz_api.INT32_MAX
                   for x in draw.values["seqused_k"])


def test_hazard_draws_are_reproducible():
    assert [d.config() for d in hazard_draws(50, 1000)] == [d.config()
                                                            for d in hazard_draws(50, 1000)]


def test_hazard_violations_follow_the_contract():
    def varlen(cu_q, cu_k, seqused_k=None, max_q=4, max_k=4):
        draw = fuzz_api.HazardDraw("varlen", torch.bfloat16, 64, 2, 1, True, True, -1)
        draw.sizes.update(batch=len(cu_q) - 1, total_q=10, total_k=12)
        draw.values.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                           max_seqlen_k=max_k)
        if seqused_k is not None:
            draw.values["seqused_k"] = seqused_k
        return fuzz_api.hazard_violations(draw)

    assert varlen([1, 4, 8], [0, 4, 8]) == ([], [], False)  # gaps at both ends: valid
    assert varlen([0, 4, 8], [0, 4, 8], max_q=3) == ([], [], True)
    assert varlen([0, 5, 3], [0, 4, 8])[0][0].startswith("cu_seqlens_q: 5 then 3")
    assert varlen([-1, 4, 8], [0, 4, 8])[0][0].startswith("cu_seqlens_q: cu_seqlens_q[0]")
    assert "past the 12 tokens" in varlen([0, 4, 8], [0, 4, 13], max_k=9)[0][0]
    assert varlen([0, 4, 8], [0, 4, 8], [4, 5])[0][0].startswith("seqused_k: seqused_k[1]")
    assert varlen([0, 4, 8], [0, 4, 8], [0, 4])[0] == []

    def paged(lengths, table, idx=None, new=0, leftpad=None):
        draw = fuzz_api.HazardDraw("paged", torch.bfloat16, 64, 2, 1, True, True, -1)
        draw.sizes.update(batch=len(lengths), new=new, capacity=8, page_size=4, max_pages=2,
                          num_pages=5, table_rows=len(table))
        draw.values.update(cache_seqlens=lengths, page_table=table)
        if idx is not None:
            draw.values["cache_batch_idx"] = idx
        if leftpad is not None:
            draw.values["cache_leftpad"] = leftpad
        return fuzz_api.hazard_violations(draw)

    assert paged([3, 8], [[0, -1], [1, 2]]) == ([], [], False)  # an unused entry: anything
    assert paged([5, 8], [[0, -1], [1, 2]])[0][0].startswith("page_table: page_table[0][1]")
    assert paged([3, 4], [[0, 9], [1, 2]], new=1)[0] == []
    assert paged([3, 3], [[0, 1], [0, 2]], new=1)[1]  # page 0 written by both: unspecified
    assert paged([3, 3], [[0, 1], [0, 2]]) == ([], [], False)  # only read by both: valid
    assert paged([3, 3], [[0, 1], [2, 3]], idx=[1, 2])[0][0].startswith("cache_batch_idx")
    assert paged([3, 9], [[0, 1], [2, 3]])[0][0].startswith("cache_seqlens: cache_seqlens[1]")
    assert paged([3, 3], [[0, 1], [2, 3]], leftpad=[0, 4])[0][0].startswith("cache_leftpad")


def test_hazard_calls_build_on_the_cpu():
    for draw in hazard_draws(80):
        call = fuzz_api.build_hazard(draw, "cpu", StandIn(draw))
        kw = call.kwargs
        for name, layout in draw.layouts.items():
            t = kw[name]
            assert t.dtype == torch.int32
            assert t.tolist() == draw.values[name], name
            if layout == "expanded":
                assert t.stride()[0] == 0 or t.shape[0] == 1
            if layout == "strided":
                assert t.stride()[-1] == 2
            if layout == "transposed":
                assert t.stride() == (1, t.shape[0])
            if layout == "offset":
                assert t.storage_offset() == 1
        for name in ("q", "k", "v", "k_cache", "v_cache"):
            if name in kw:
                assert not kw[name].isnan().any(), name  # the NaN is around the tensors only
        if draw.entry == "dense":
            assert call.out is None and "out" not in kw
        else:
            assert kw["out"] is call.out and call.out.shape == kw["q"].shape
            assert (call.out == fuzz_api.OUT_SENTINEL).all()
            assert call.out.untyped_storage().nbytes() > call.out.numel() * 2
        if draw.entry == "paged":
            assert kw["k_cache"].shape[:2] == (draw.sizes["num_pages"], draw.sizes["page_size"])
        for _, buffer, inside, sentinel in call.guards:
            assert fuzz_api.guard_check(buffer, inside, sentinel) is None


def test_a_correct_call_passes_the_hazard_checks(monkeypatch):
    # the stand-in keeps the contract: no problem, neither for answers nor for refusals; each
    # draw runs with the checks on, then off, and the variable is as it was after
    monkeypatch.setenv(fuzz_api.CHECK_OFFSETS_ENV, "1")
    results = []
    for draw in hazard_draws(80):
        torch.manual_seed(0)
        stand_in = StandIn(draw)
        outcome = fuzz_api.hazard_outcome(draw, "cpu", stand_in)
        assert outcome.problems == [] and not outcome.fatal, (outcome.config, outcome.problems)
        assert stand_in.env == [None, "0"]
        assert os.environ[fuzz_api.CHECK_OFFSETS_ENV] == "1"
        json.dumps(outcome.config)
        results += [outcome.config["result (checks on)"], outcome.config["result (checks off)"]]
    assert "returned" in results and any(r.startswith("ValueError") for r in results)


def test_both_runs_of_a_draw_are_reported():
    # a draw judged with the checks on only (a short max_seqlen_q hint): refused when off
    draw = first_draw(lambda d: d.hint and not (d.violations or d.unspecified))
    outcome = fuzz_api.hazard_outcome(draw, "cpu", StandIn(draw))
    assert outcome.problems == []
    assert outcome.config["judged (checks on)"] and not outcome.config["judged (checks off)"]
    assert outcome.config["result (checks on)"] == "returned"
    assert outcome.config["result (checks off)"].startswith("ValueError: max_seqlen_q")
    broken = fuzz_api.hazard_outcome(draw, "cpu", StandIn(draw, "unnamed"))
    assert [p.split(":")[0] for p in broken.problems] == ["checks on", "checks off"]


@pytest.mark.parametrize(("fault", "accept", "finding"), [
    ("runtime_error", lambda d: True, "raised RuntimeError"),
    ("unnamed", lambda d: True, "names none of the call's arguments"),
    ("refuse_after_append", lambda d: d.entry == "kvcache",
     "a refused call changed the cache: k_cache buffer: "),
    ("changes_input", lambda d: True, "inputs changed: q: 1 of"),
    ("nan", lambda d: d.judged, "out: NaN"),
    ("wrong", lambda d: d.judged and d.entry == "kvcache" and not d.sizes["packed_q"],
     "out: max error"),
    ("wrong", lambda d: d.judged and d.entry == "varlen" and d.values["cu_seqlens_q"][0] > 0,
     "out rows outside every sequence: 1 element(s)"),  # a row no sequence covers written
    ("outside_out", lambda d: d.judged and d.entry == "paged",
     "out's buffer: 1 element(s) outside the slice changed"),
    ("cache_guard", lambda d: d.judged and d.entry == "kvcache" and not d.kv_one_buffer,
     "k_cache buffer: 1 element(s) outside the slice changed"),
])
def test_the_hazard_checks_catch_a_broken_call(fault, accept, finding):
    problems, _, _ = run_on_cpu(first_draw(accept), fault)
    assert any(finding in p for p in problems), problems


@pytest.mark.parametrize("batch_idx", [None, [2, 0, 1]])
def test_the_packed_kvcache_reference_reads_each_sequences_cache(batch_idx):
    # packed queries of equal lengths are the batched call's: the same outputs and caches,
    # each sequence reading (and appending to) its own cache entry, cache_batch_idx or not
    torch.manual_seed(0)
    batch, sq, heads, d, new = 3, 4, 2, 16, 2
    q = torch.randn(batch, sq, heads, d, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(batch, 12, heads, d, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(batch, new, heads, d, dtype=torch.float64) for _ in range(2))
    seqlens = torch.tensor([4, 9, 1], dtype=torch.int32)
    idx = None if batch_idx is None else torch.tensor(batch_idx, dtype=torch.int32)
    cu = torch.arange(0, batch * sq + 1, sq, dtype=torch.int32)
    mask = {"causal": True}
    want = fuzz_api.reference.attention_kvcache_ref(q, k_cache, v_cache, k, v, seqlens, idx,
                                                    None, None, **mask)
    got = fuzz_api.kvcache_reference(q.flatten(0, 1), k_cache, v_cache, k, v, seqlens, idx,
                                     None, None, cu, mask)
    torch.testing.assert_close(got[0], want[0].flatten(0, 1), rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], want[1].transpose(0, 1).flatten(1), rtol=0, atol=1e-12)
    for after, expected in zip(got[2:], want[2:]):
        assert torch.equal(after, expected)


def test_lse_rows_outside_every_sequence_may_hold_anything():
    # flash_attn_varlen_func leaves them unwritten (a fresh lse: uninitialized memory)
    def gap(d):
        return (d.judged and d.entry == "varlen" and d.want_lse
                and 0 < d.values["cu_seqlens_q"][0] and d.values["cu_seqlens_q"][-1] > 0)

    draw = first_draw(gap)
    assert run_on_cpu(draw, "lse_nan_outside")[0] == []
    assert "lse: NaN (the inputs hold none)" in run_on_cpu(
        first_draw(lambda d: d.judged and d.entry == "kvcache" and d.want_lse),
        "lse_nan_inside")[0]


def test_a_call_that_accepts_bad_values_with_the_checks_on_is_reported():
    # a paged call out of contract that returned (out= as given) although its values were checked
    draw = first_draw(lambda d: d.violations and d.entry == "paged")
    call = fuzz_api.build_hazard(draw, "cpu", StandIn(draw))
    problems = fuzz_api._judge_hazard(draw, call, None, (call.out, None))
    assert any(p.startswith("returned with the value checks on") for p in problems), problems


def test_a_device_fault_stops_the_run(monkeypatch):
    # after a fault the CUDA context is poisoned: the run records it and makes no more calls
    syncs = []

    def synchronize():
        syncs.append(1)
        if len(syncs) == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(fuzz_api.Capability, "detect", staticmethod(lambda: CPU_CAP))
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setitem(fuzz_api.VALID, "stand-in", lambda rng, cap, small: fuzz_api.Outcome(
        "stand-in", {}, [], 0.0))
    outcomes = fuzz_api.run_valid(60, 0, True, ["stand-in"], max_cases=10)
    assert len(outcomes) == 3 and [o.fatal for o in outcomes] == [False, False, True]
    assert "device fault: CUDA error" in outcomes[-1].problems[0]


@pytest.mark.gpu
@pytest.mark.usefixtures("exact_fp32_matmuls")
def test_hazard_calls_on_the_gpu(lib):
    before = os.environ.get(fuzz_api.CHECK_OFFSETS_ENV)
    outcomes = fuzz_api.run_valid(seconds=240, seed=20261203, small=True, kinds=["hazard"],
                                  max_cases=60)
    assert os.environ.get(fuzz_api.CHECK_OFFSETS_ENV) == before
    failed = [(o.config, o.problems) for o in outcomes if o.problems]
    assert not failed, failed
