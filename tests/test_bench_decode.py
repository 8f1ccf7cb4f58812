"""`flash-hopper decode` (the decode sweep, docs/decode.md) on the CPU: its arguments, the bandwidth
arithmetic, the rows a sweep records (GPU pieces stood in), the outputs and the exit status. The
GPU run itself: test_decode_runs_on_the_gpu."""

from __future__ import annotations

import csv
import json
from typing import ClassVar

import pytest
import torch
from flash_hopper import cli
from flash_hopper.bench import decode


def args(*argv):
    return cli.build_parser().parse_args(["decode", *argv])


def test_default_points():
    points = decode.points_from_args(args())
    assert [p.label() for p in points] == ["1x8k", "1x128k", "8x32k", "32x32k", "128x16k", "64x1k"]
    p = points[3]
    assert (p.heads_q, p.heads_kv, p.head_dim, p.seqlen_q, p.dtype) == (32, 8, 128, 1, "bf16")
    # 2 (K and V) * batch * context * heads_kv * head_dim * 2 bytes
    assert p.kv_bytes() == 2 * 32 * 32768 * 8 * 128 * 2 == 4_294_967_296
    assert decode.tbps(p.kv_bytes(), 1e-3) == pytest.approx(4.294967296)


def test_points_heads_and_counts():
    points = decode.points_from_args(args("--points", "2x300", "4x1k,3x2K", "--heads", "64/8",
                                          "-d", "64", "--seqlen-q", "4", "--dtype", "fp16"))
    assert [(p.batch, p.context) for p in points] == [(2, 300), (4, 1024), (3, 2048)]
    assert {(p.heads_q, p.heads_kv, p.head_dim, p.seqlen_q, p.dtype) for p in points} == {
        (64, 8, 64, 4, "fp16")}
    assert points[0].label() == "2x300"


@pytest.mark.parametrize(("argv", "message"), [
    (["--points", "32"], "--points: expected BATCHxCONTEXT like 32x32k, got '32'"),
    (["--points", "0x8k"], "expected a positive count like 300 or 8k, got '0'"),
    (["--points", "2xk"], "in '2xk'"),
    (["--heads", "32/5"], "--heads: query heads must be a multiple of KV heads, got '32/5'"),
    (["--heads", "32"], "--heads: expected Q/KV like 32/8, got '32'"),
    (["--points", "1x8", "--seqlen-q", "9"], "--seqlen-q (9) must be <= the context (8)"),
    (["--backends", "flash-hopper,fa9"], "--backends: unknown fa9"),
])
def test_bad_arguments_give_one_line(capsys, argv, message):
    assert cli.main(["decode", *argv]) == cli.EXIT_FAILURE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("flash-hopper decode: error:") and message in err, err


def test_without_a_gpu_the_command_says_so(capsys, monkeypatch):
    from flash_hopper.bench import env

    monkeypatch.setattr(env, "detect_gpu", lambda: (None, "no CUDA device"))
    assert cli.main(["decode", "--points", "1x1k"]) == cli.EXIT_FAILURE
    assert "needs a CUDA GPU: no CUDA device" in capsys.readouterr().err


def _stand_in(monkeypatch, broken=(), wrong=()):
    """measure() on the CPU: small CPU inputs, backends computing exact attention (or raising,
    or returning a wrong result), fixed timings."""
    def inputs(point, seed=0):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(point.batch, point.seqlen_q, point.heads_q, point.head_dim, generator=g)
        kc, vc = (torch.randn(point.batch, point.context, point.heads_kv, point.head_dim,
                              generator=g) for _ in range(2))
        return q, kc, vc, torch.full((point.batch,), point.context, dtype=torch.int32)

    def call(name, point, q, kc, vc, lengths):
        if name in broken:
            raise RuntimeError(f"{name} cannot run here")
        g = point.heads_q // point.heads_kv

        def run():
            s = q.transpose(1, 2) @ kc.transpose(1, 2).repeat_interleave(g, 1).transpose(-1, -2)
            s = s * point.head_dim ** -0.5
            o = s.softmax(-1) @ vc.transpose(1, 2).repeat_interleave(g, 1)
            return o.transpose(1, 2) + (1.0 if name in wrong else 0.0)
        return run

    monkeypatch.setattr(decode, "make_inputs", inputs)
    monkeypatch.setattr(decode, "backend_call", call)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_measure_records_bandwidth_checks_and_errors(monkeypatch):
    _stand_in(monkeypatch, broken=("sdpa-cudnn",), wrong=("flash-hopper-dense",))
    point = decode.DecodePoint(batch=3, context=64, heads_q=4, heads_kv=2, head_dim=16)
    rows = decode.measure(point, list(decode.DEFAULT_BACKENDS),
                          timer=lambda fn: (10.0, 2.0),
                          host_timer=lambda fn: 30.0)
    fh, dense, sdpa = rows
    assert fh.passed and fh.error is None and fh.check_err <= 1e-5
    assert fh.device_us == 10.0 and fh.host_us_graph == 2.0 and fh.host_us_eager == 30.0
    assert fh.tbps == pytest.approx(point.kv_bytes() / 10e-6 / 1e12)
    assert dense.error is None and not dense.passed and dense.check_err > 0.5  # wrong by 1.0
    assert sdpa.error == "RuntimeError: sdpa-cudnn cannot run here" and sdpa.tbps is None
    assert decode.exit_status(rows) == 1  # a failed check
    assert decode.exit_status([fh, sdpa]) == 0  # a peer that cannot run is only recorded
    fh_broken = decode.DecodeRow(point, "flash-hopper", error="RuntimeError: x", passed=False)
    assert decode.exit_status([fh_broken]) == 1
    text = decode.table(rows)
    assert "3x64" in text and "PASS" in text and "FAIL" in text and "cannot run here" in text


def test_outputs(tmp_path, monkeypatch):
    _stand_in(monkeypatch, broken=("sdpa-cudnn",))
    rows = []
    for context in (64, 128):
        point = decode.DecodePoint(batch=2, context=context, heads_q=4, heads_kv=4, head_dim=8)
        rows += decode.measure(point, ["flash-hopper", "sdpa-cudnn"],
                               timer=lambda fn: (5.0, 1.0), host_timer=lambda fn: 20.0)
    decode.write_json(tmp_path / "d.json", rows, {"gpu": "stand-in"})
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["meta"] == {"gpu": "stand-in"} and len(data["rows"]) == 4
    first = data["rows"][0]
    assert first["point"]["label"] == "2x64" and first["point"]["kv_bytes"] == 2 * 2 * 64 * 4 * 8 * 2
    assert first["backend"] == "flash-hopper" and first["tbps"] > 0 and first["passed"] is True
    decode.write_csv(tmp_path / "d.csv", rows)
    with open(tmp_path / "d.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["label"] for r in table] == ["2x64", "2x64", "2x128", "2x128"]
    assert table[1]["error"].startswith("RuntimeError") and table[0]["tbps"]
    decode.plot(str(tmp_path / "d.png"), rows)
    assert (tmp_path / "d.png").stat().st_size > 1000


@pytest.mark.gpu
def test_decode_runs_on_the_gpu(lib, tmp_path):
    """The real sweep on one small point: every backend checked, bandwidth recorded."""
    rc = cli.main(["decode", "--points", "4x2k", "--heads", "8/2", "--page-size", "16",
                   "--json", str(tmp_path / "d.json")])
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    for name in ("flash-hopper", "flash-hopper-paged"):
        fh = next(r for r in rows if r["backend"] == name)
        assert fh["error"] is None and fh["passed"] and fh["tbps"] > 0, fh
    assert rc == 0


@pytest.mark.parametrize("page_size", [1, 16, 5])
def test_paged_copy_reads_back_the_cache(page_size):
    """The flash-hopper-paged backend's pool: shuffled pages whose table reads every sequence's
    keys back in order (the last page padded)."""
    g = torch.Generator().manual_seed(page_size)
    kc, vc = (torch.randn(3, 37, 2, 8, generator=g) for _ in range(2))
    pool_k, pool_v, table = decode.paged_copy(kc, vc, page_size)
    per_seq = -(-37 // page_size)
    assert table.dtype == torch.int32 and table.shape == (3, per_seq)
    assert sorted(table.flatten().tolist()) == list(range(3 * per_seq))  # each page once
    for cache, pool in ((kc, pool_k), (vc, pool_v)):
        back = pool[table.long()].reshape(3, per_seq * page_size, 2, 8)[:, :37]
        assert torch.equal(back, cache)


def test_page_size_adds_the_paged_backend(capsys):
    points = decode.points_from_args(args("--points", "2x1k", "--page-size", "16"))
    assert points[0].page_size == 16
    assert cli.main(["decode", "--page-size", "0"]) == cli.EXIT_FAILURE
    assert "--page-size: expected an int >= 1, got 0" in capsys.readouterr().err


def test_fa4_peers_call_its_varlen_entry_with_the_pool(monkeypatch):
    """flash-attn-cute-paged: FA4's flash_attn_varlen_func on the same shuffled pool and table as
    flash-hopper-paged, with seqused_k; the (out, lse) it returns reduced to out."""
    import sys
    import types

    seen = {}

    def varlen(q, k, v, **kw):
        seen["k"], seen["kw"] = k, kw
        return q + 1, None

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = varlen
    package = types.ModuleType("flash_attn")
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    point = decode.DecodePoint(2, 64, 4, 2, 8, 1, "bf16", 16)
    q = torch.zeros(2, 1, 4, 8)
    kc, vc = torch.randn(2, 64, 2, 8), torch.randn(2, 64, 2, 8)
    lengths = torch.full((2,), 64, dtype=torch.int32)
    monkeypatch.setattr(decode, "paged_copy", lambda k, v, page: ("pool_k", "pool_v", "table"))
    out = decode.backend_call("flash-attn-cute-paged", point, q, kc, vc, lengths)()
    assert torch.equal(out, q + 1)
    assert seen["k"] == "pool_k"
    assert seen["kw"] == {"seqused_k": lengths, "page_table": "table", "causal": True}
    out = decode.backend_call("flash-attn-cute", point, q, kc, vc, lengths)()
    assert seen["k"] is kc and seen["kw"] == {"causal": True}
    no_pages = decode.DecodePoint(2, 64, 4, 2, 8, 1, "bf16", None)
    with pytest.raises(decode.DecodeError, match="flash-attn-cute-paged: needs --page-size"):
        decode.backend_call("flash-attn-cute-paged", no_pages, q, kc, vc, lengths)


def test_decode_ab_variants():
    """bench/decode_ab.py's variant grammar: dense / paged / pagedP, then :sN and :stM."""
    import importlib.util
    import re
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "decode_ab.py"
    spec = importlib.util.spec_from_file_location("decode_ab", path)
    ab = importlib.util.module_from_spec(spec)
    sys.modules["decode_ab"] = ab  # dataclasses look their module up there
    try:
        spec.loader.exec_module(ab)
    finally:
        del sys.modules["decode_ab"]
    V = ab.Variant
    assert ab.parse_variant("dense") == V("dense", None, 0, None)
    assert ab.parse_variant("paged") == V("paged", 16, 0, None)
    assert ab.parse_variant("paged64:s33:st2") == V("paged64:s33:st2", 64, 33, 2)
    assert ab.parse_variant("dense:st5:s16") == V("dense:st5:s16", None, 16, 5)
    for bad, fragment in (("cache", "expected dense, paged or pagedP"),
                          ("pagedx", "expected paged or pagedP"),
                          ("paged0", "page size must be >= 1"),
                          ("dense:x3", "expected :sN (splits) or :stM (stages)")):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            ab.parse_variant(bad)


# --- FP8 caches, speculative rows, FA3's kvcache ---------------------------------------------------


def test_fp8_dtypes_and_q_len_parse():
    """--dtype takes the bench's dtypes (e4m3, the mixed ones); --q-len is --seqlen-q."""
    for dtype in ("e4m3", "bf16+e4m3", "fp16+e4m3", "bf16+e5m2", "fp16+e5m2"):
        (point,) = decode.points_from_args(args("--points", "2x1k", "--dtype", dtype))
        assert point.dtype == dtype
    (point,) = decode.points_from_args(args("--points", "2x1k", "--q-len", "4"))
    assert point.seqlen_q == 4
    assert args("--seqlen-q", "3").seqlen_q == 3
    with pytest.raises(SystemExit):
        args("--dtype", "e5m2")  # FP8 q takes e4m3 only (FA3's convention)
    p = decode.DecodePoint(1, 64, dtype="fp16+e5m2")
    assert (p.q_dtype, p.kv_dtype, p.is_fp8, p.is_mixed) == ("fp16", "e5m2", False, True)
    p = decode.DecodePoint(1, 64, dtype="e4m3")
    assert (p.q_dtype, p.kv_dtype, p.is_fp8, p.is_mixed) == ("e4m3", "e4m3", True, False)


@pytest.mark.parametrize("argv", [["--seqlen-q", "0"], ["--q-len", "-1"]])
def test_q_len_must_be_positive(capsys, argv):
    assert cli.main(["decode", *argv]) == cli.EXIT_FAILURE
    assert "--seqlen-q: expected an int >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["e4m3", "bf16+e4m3", "fp16+e5m2"])
def test_fp8_bytes_are_half_of_bf16s(dtype):
    """The bandwidth counts the FP8 cache at 1 byte per element, and the rows say so."""
    shape = {"batch": 32, "context": 32768, "heads_q": 32, "heads_kv": 8, "head_dim": 128}
    fp8, bf16 = decode.DecodePoint(**shape, dtype=dtype), decode.DecodePoint(**shape)
    assert fp8.kv_bytes() * 2 == bf16.kv_bytes() == 4_294_967_296
    row = decode.DecodeRow(fp8, "flash-hopper").as_dict()["point"]
    assert row["kv_bytes"] == 2_147_483_648 and row["kv_dtype"] == fp8.kv_dtype
    assert row["bytes_counted"].startswith(f"K and V cache ({fp8.kv_dtype}, 1 byte per element)")
    assert "descales" in row["bytes_counted"]
    assert "2 bytes per element" in decode.DecodeRow(bf16, "x").as_dict()["point"]["bytes_counted"]


def _attention(q, k, v, causal_from=None):
    """Exact fp32 attention, query by query: query i sees keys [0, causal_from + i] (all keys
    when causal_from is None). GQA by repeating the kv heads."""
    q, k, v = (t.float() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    rows = []
    for i in range(q.shape[1]):
        stop = k.shape[1] if causal_from is None else causal_from + i + 1
        s = torch.einsum("bhd,bkhd->bhk", q[:, i], k[:, :stop]) * q.shape[-1] ** -0.5
        rows.append(torch.einsum("bhk,bkhd->bhd", s.softmax(-1), v[:, :stop]))
    return torch.stack(rows, 1)


def test_make_inputs_quantizes_the_cache_per_kv_head():
    """e4m3: q, k, v Fp8Inputs with (batch, heads_kv) descales (q's per kv head, FA3's) of the
    bf16 point's values; mixed: q as drawn in its dtype, k / v in the cache's FP8 dtype."""
    from flash_hopper.bench.fp8_inputs import Fp8Input

    shape = {"batch": 2, "context": 48, "heads_q": 4, "heads_kv": 2, "head_dim": 16,
             "seqlen_q": 3}
    q16, k16, v16, lengths = decode.make_inputs(decode.DecodePoint(**shape), device="cpu")
    q8, k8, v8, _ = decode.make_inputs(decode.DecodePoint(**shape, dtype="e4m3"), device="cpu")
    for t8, t16 in ((q8, q16), (k8, k16), (v8, v16)):
        assert isinstance(t8, Fp8Input) and t8.data.dtype == torch.float8_e4m3fn
        assert t8.descale.shape == (2, 2) and t8.descale.dtype == torch.float32
        assert torch.allclose(t8.dequantize(), t16.float(), rtol=0.07, atol=0.02)
    assert lengths.tolist() == [48, 48] and lengths.dtype == torch.int32
    q, k5, v5, _ = decode.make_inputs(decode.DecodePoint(**shape, dtype="fp16+e5m2"),
                                      device="cpu")
    q_fp16, k_fp16, _, _ = decode.make_inputs(decode.DecodePoint(**shape, dtype="fp16"),
                                              device="cpu")
    assert torch.equal(q, q_fp16) and not isinstance(q, Fp8Input)
    assert k5.data.dtype == v5.data.dtype == torch.float8_e5m2 and k5.descale.shape == (2, 2)
    assert torch.allclose(k5.dequantize(), k_fp16.float(), rtol=0.15, atol=0.02)


@pytest.mark.parametrize("dtype", ["e4m3", "bf16+e4m3", "fp16+e5m2"])
def test_fp8_reference_check(dtype):
    """The check on FP8 rows: fp32 attention on the dequantized values (FA3's convention: the
    FP8 rule, relative RMS error; the mixed mode: the 16-bit rule on q and the dequantized K / V).
    The exact result passes, one with a wrong descale or a lost key block fails."""
    from flash_hopper.bench import check

    point = decode.DecodePoint(3, 64, 4, 2, 16, seqlen_q=2, dtype=dtype)
    q, kc, vc, _ = decode.make_inputs(point, device="cpu")
    n = decode.CHECK_SEQUENCES
    real = [t.dequantize() if hasattr(t, "dequantize") else t for t in (q, kc, vc)]
    exact = _attention(*real, causal_from=64 - 2)
    out_dtype = torch.float16 if point.q_dtype == "fp16" else torch.bfloat16  # e4m3: bf16
    result = decode.reference_check(point, exact.to(out_dtype), q, kc, vc)
    metric = check.METRIC_REL_RMSE if point.is_fp8 else check.METRIC_MAX_ABS
    assert result.passed and result.metric == metric, result
    assert result.shape == f"b{n} sq2 sk64"
    if point.is_fp8:
        assert result.tol == check.FP8_REL_RMSE and result.err < 0.01
    # The descale of k ignored: scores off by a factor per (sequence, kv head).
    undone = [real[0], kc.data.float(), real[2]]
    assert not decode.reference_check(point, _attention(*undone, causal_from=62), q, kc, vc).passed
    # The second half of the cache lost.
    lost = _attention(real[0], real[1][:, :32], real[2][:, :32])
    assert not decode.reference_check(point, lost, q, kc, vc).passed


def test_speculative_rows_check_bottom_right_causal():
    """seqlen_q = 4 against a cache of 40: query i sees keys up to 40 - 4 + i (FA's bottom-right
    alignment). The reference agrees with attention computed query by query; top-left alignment
    (query i sees keys 0..i) and no mask both fail."""
    point = decode.DecodePoint(2, 40, 4, 1, 16, seqlen_q=4, dtype="fp16")
    q, kc, vc, _ = decode.make_inputs(point, device="cpu")
    bottom_right = _attention(q, kc, vc, causal_from=40 - 4)
    result = decode.reference_check(point, bottom_right.half(), q, kc, vc)
    assert result.passed and result.err < 1e-2, result
    for wrong in (_attention(q, kc, vc, causal_from=0), _attention(q, kc, vc)):
        assert not decode.reference_check(point, wrong.half(), q, kc, vc).passed


def test_paged_copy_of_an_fp8_cache():
    """The paged backends' pool of an FP8 cache: the same bytes, read back through the table."""
    kc, vc = (torch.randn(2, 21, 2, 16).to(torch.float8_e4m3fn) for _ in range(2))
    pool_k, pool_v, table = decode.paged_copy(kc, vc, 8)
    assert pool_k.dtype == torch.float8_e4m3fn and pool_k.shape == (6, 8, 2, 16)
    back = pool_v[table.long()].reshape(2, 24, 2, 16)[:, :21]
    assert torch.equal(back.view(torch.uint8), vc.view(torch.uint8))


def _fp8_point(dtype="e4m3", seqlen_q=1, page_size=None):
    return decode.DecodePoint(2, 32, 4, 2, 16, seqlen_q, dtype, page_size)


@pytest.mark.parametrize(("name", "point", "reason"), [
    ("sdpa-cudnn", _fp8_point(), "sdpa-cudnn: SDPA takes no FP8 cache"),
    ("sdpa-cudnn", _fp8_point("bf16+e5m2"), "not run on a dequantized copy"),
    ("sdpa-cudnn", _fp8_point("bf16", seqlen_q=4), "seqlen_q > 1 need bottom-right"),
    ("flash-attn-cute", _fp8_point(), "flash-attn-cute: 16-bit caches only"),
    ("flash-attn-cute-paged", _fp8_point("fp16+e4m3", page_size=16),
     "flash-attn-cute-paged: 16-bit caches only"),
])
def test_peers_without_the_rows_inputs_are_skipped(name, point, reason):
    """A peer that takes no FP8 cache (or no bottom-right mask) raises DecodeSkip naming why,
    before it imports anything: the row is recorded as skipped."""
    q, kc, vc, lengths = decode.make_inputs(point, device="cpu")
    with pytest.raises(decode.DecodeSkip, match=reason):
        decode.backend_call(name, point, q, kc, vc, lengths)


def _fa3_stub(monkeypatch, flags):
    """A stand-in fa3-fwd wheel: fa3_fwd_interface with flash_attn_func and
    flash_attn_with_kvcache (recording its arguments), fa3_fwd_config with ``flags``; FA3's other
    module names made unimportable, so the registry's search ends at the wheel."""
    import sys
    import types

    seen = {}

    def with_kvcache(q, k_cache, v_cache, **kw):
        seen["k"], seen["kw"] = k_cache, kw
        return q.float() + 1

    interface = types.ModuleType("fa3_fwd_interface")
    interface.flash_attn_func = lambda *a, **kw: None
    interface.flash_attn_with_kvcache = with_kvcache
    config = types.ModuleType("fa3_fwd_config")
    config.CONFIG = {"build_flags": flags}
    for name in ("flash_attn_interface", "flash_attn_3.flash_attn_interface", "flash_attn_3"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", interface)
    monkeypatch.setitem(sys.modules, "fa3_fwd_config", config)
    return seen


def test_fa3_kvcache_gets_the_cache_and_descales(monkeypatch):
    """flash-attn3: FA3's flash_attn_with_kvcache on the dense cache, cache_seqlens, causal, and
    for e4m3 the FP8 data with q / k / v descales (FA3's convention is flash-hopper's)."""
    seen = _fa3_stub(monkeypatch, {decode.FA3_NO_PAGED: True})
    assert decode.backends_from_args(args("--backends", "fa3-fwd", "fa3_fwd_interface",
                                          "flash-attn3")) == ["flash-attn3"]
    for dtype in ("bf16", "e4m3"):
        point = _fp8_point(dtype, seqlen_q=4)
        q, kc, vc, lengths = decode.make_inputs(point, device="cpu")
        out = decode.backend_call(decode.FA3, point, q, kc, vc, lengths)()
        q_data = q.data if dtype == "e4m3" else q
        assert torch.equal(out, q_data.float() + 1)
        assert seen["kw"].pop("cache_seqlens") is lengths and seen["kw"].pop("causal") is True
        if dtype == "e4m3":
            assert seen["k"] is kc.data and len(seen["kw"]) == 3
            assert all(seen["kw"][f"{prefix}_descale"] is t.descale
                       for prefix, t in zip("qkv", (q, kc, vc)))
        else:
            assert seen["k"] is kc and seen["kw"] == {}


@pytest.mark.parametrize(("name", "dtype", "reason"), [
    ("flash-attn3-paged", "bf16",
     "flash-attn3-paged: fa3_fwd_interface is built with FLASHATTENTION_DISABLE_PAGEDKV"),
    ("flash-attn3", "fp16", "fa3_fwd_interface is built with FLASHATTENTION_DISABLE_FP16"),
    ("flash-attn3", "bf16+e4m3", "takes q and the cache in one dtype"),
])
def test_fa3_rows_its_build_leaves_out_are_skipped(monkeypatch, name, dtype, reason):
    """The fa3-fwd wheel's build config (fa3_fwd_config) names what it left out: paged KV and
    fp16; FA3 has no mixed mode at all."""
    _fa3_stub(monkeypatch, {decode.FA3_NO_PAGED: True, "FLASHATTENTION_DISABLE_FP16": True,
                            "FLASHATTENTION_DISABLE_FP8": False})
    point = _fp8_point(dtype, page_size=16)
    q, kc, vc, lengths = decode.make_inputs(point, device="cpu")
    with pytest.raises(decode.DecodeSkip) as info:
        decode.backend_call(name, point, q, kc, vc, lengths)
    assert reason in str(info.value)


def test_fa3_without_its_module_is_skipped_with_the_reason(monkeypatch):
    import sys

    for name in ("flash_attn_interface", "flash_attn_3.flash_attn_interface", "flash_attn_3",
                 "fa3_fwd_interface"):
        monkeypatch.setitem(sys.modules, name, None)
    point = _fp8_point("bf16")
    q, kc, vc, lengths = decode.make_inputs(point, device="cpu")
    with pytest.raises(decode.DecodeSkip, match=r"flash-attn3: not importable \(.*fa3_fwd_in"):
        decode.backend_call("flash-attn3", point, q, kc, vc, lengths)


def test_fp8_rows_record_skips_checks_and_bytes(tmp_path, monkeypatch):
    """measure() of an e4m3 point with CPU stand-ins for the timing and flash-hopper's calls:
    flash-hopper passes the FP8 rule, sdpa-cudnn and flash-attn3 (not importable here) are
    skipped with their reasons and do not fail the run; the files say which bytes were counted."""
    import sys

    real_call = decode.backend_call

    def call(name, point, q, kc, vc, lengths):
        if not name.startswith("flash-hopper"):
            return real_call(name, point, q, kc, vc, lengths)
        real = [t.dequantize() for t in (q, kc, vc)]
        return lambda: _attention(*real, causal_from=point.context - point.seqlen_q).bfloat16()

    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", None)
    for name in ("flash_attn_interface", "flash_attn_3.flash_attn_interface", "flash_attn_3"):
        monkeypatch.setitem(sys.modules, name, None)
    make = decode.make_inputs
    monkeypatch.setattr(decode, "make_inputs", lambda point: make(point, device="cpu"))
    monkeypatch.setattr(decode, "backend_call", call)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    point = decode.DecodePoint(2, 64, 4, 2, 16, seqlen_q=2, dtype="e4m3")
    rows = decode.measure(point, ["flash-hopper", "sdpa-cudnn", "flash-attn3"],
                          timer=lambda fn: (10.0, 2.0), host_timer=lambda fn: 30.0)
    fh, sdpa, fa3 = rows
    assert fh.passed and fh.check_metric == "rel-rmse" and fh.check_err < 0.01
    assert fh.tbps == pytest.approx(2 * 2 * 64 * 2 * 16 * 1 / 10e-6 / 1e12)
    assert sdpa.skipped.startswith("sdpa-cudnn: SDPA takes no FP8 cache") and sdpa.error is None
    assert fa3.skipped.startswith("flash-attn3: not importable") and fa3.tbps is None
    assert sdpa.passed is None and decode.exit_status(rows) == 0
    text = decode.table(rows)
    assert "PASS (rel-rmse" in text and "skipped: sdpa-cudnn: SDPA takes no FP8 cache" in text
    decode.write_json(tmp_path / "d.json", rows, {})
    data = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert {r["point"]["bytes_counted"] for r in data} == {
        "K and V cache (e4m3, 1 byte per element); not q, the output or the descales"}
    assert [r["skipped"] is None for r in data] == [True, False, False]
    decode.write_csv(tmp_path / "d.csv", rows)
    with open(tmp_path / "d.csv") as f:
        table = list(csv.DictReader(f))
    assert table[0]["kv_dtype"] == "e4m3" and table[0]["kv_bytes"] == str(point.kv_bytes())
    assert table[0]["check_metric"] == "rel-rmse" and table[1]["skipped"].startswith("sdpa")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["e4m3", "bf16+e4m3", "fp16+e5m2"])
def test_fp8_decode_runs_on_the_gpu(lib, tmp_path, dtype):
    """FP8 caches on the GPU, speculative rows with pages: flash-hopper's rows pass their check
    and count 1 byte per cache element; peers record a result or a reason."""
    rc = cli.main(["decode", "--points", "4x2k", "--heads", "8/2", "--q-len", "4", "--dtype",
                   dtype, "--page-size", "16", "--backends", "flash-hopper",
                   "flash-hopper-paged", "flash-hopper-dense", "sdpa-cudnn", "flash-attn3",
                   "--json", str(tmp_path / "d.json")])
    rows = json.loads((tmp_path / "d.json").read_text())["rows"]
    for r in rows:
        assert r["point"]["kv_bytes"] == 2 * 4 * 2048 * 2 * 128
        if r["backend"].startswith("flash-hopper"):
            assert r["error"] is None and r["passed"] and r["tbps"] > 0, r
        else:
            assert r["skipped"] or r["error"] or r["passed"] is not None, r
    assert next(r for r in rows if r["backend"] == "sdpa-cudnn")["skipped"]
    assert rc == 0


# --- FlashInfer's batch decode --------------------------------------------------------------------


def test_flashinfer_page_indices_of_ragged_lengths():
    """The page table as FlashInfer's indptr / indices / last_page_len: lengths 1, 16, 17, 40
    on pages of 16 use 1, 1, 2 and 3 pages (the first of each table row), the last holding 1,
    16, 1 and 8 keys; an empty sequence uses none."""
    table = torch.tensor([[7, 3, 11], [0, 5, 2], [9, 4, 1], [6, 8, 10]], dtype=torch.int32)
    lengths = torch.tensor([1, 16, 17, 40], dtype=torch.int32)
    indptr, indices, last = decode.flashinfer_page_indices(table, lengths, 16)
    assert indptr.tolist() == [0, 1, 2, 4, 7]
    assert indices.tolist() == [7, 0, 9, 4, 6, 8, 10]
    assert last.tolist() == [1, 16, 1, 8]
    assert {t.dtype for t in (indptr, indices, last)} == {torch.int32}
    indptr, indices, last = decode.flashinfer_page_indices(table[:2], torch.tensor([0, 33]), 16)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 0, 3], [0, 5, 2], [0, 1])
    with pytest.raises(ValueError, match="needs 4 pages of 16; the page table has 3"):
        decode.flashinfer_page_indices(table, torch.tensor([1, 1, 1, 49]), 16)


class FakeDecodeWrapper:
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper as far as the decode sweep uses it: records
    its construction, plan and runs; run() gathers each sequence's keys through the planned
    indices and returns, per query head, the sum of q and the mean of its kv head's V rows, so
    the output depends on the pages the plan names."""

    instances: ClassVar[list] = []

    def __init__(self, workspace, kv_layout="NHD"):
        self.workspace, self.kv_layout = workspace, kv_layout
        self.plan_args, self.runs = None, []
        FakeDecodeWrapper.instances.append(self)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, **kwargs):
        self.plan_args = (indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                          page_size, kwargs)

    def run(self, q, paged_kv_cache, **kwargs):
        self.runs.append((q, paged_kv_cache, kwargs))
        indptr, indices, last, hq, hk, _, page, _ = self.plan_args
        _, v_pool = paged_kv_cache
        out = []
        for b in range(q.shape[0]):
            pages = indices[indptr[b]:indptr[b + 1]].long()
            n = (len(pages) - 1) * page + int(last[b])
            v = v_pool[pages].reshape(-1, *v_pool.shape[2:])[:n].float().mean(0)  # (hk, d)
            out.append(q[b].float() + v.repeat_interleave(hq // hk, 0))
        return torch.stack(out).to(q.dtype)


def fake_flashinfer():
    import types

    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    return module


def test_flashinfer_paged_plans_once_and_times_run_alone(monkeypatch):
    """flashinfer-paged: the wrapper planned on the pool's page table before the call is
    returned (NHD, heads, page size, q / kv dtypes); the call is run() alone, on q as
    (batch, heads_q, d) and the (pool_k, pool_v) pair, and its output has q's shape."""
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    point = decode.DecodePoint(3, 40, 4, 2, 8, 1, "bf16", 16)
    q, kc, vc, lengths = decode.make_inputs(point, device="cpu")
    fn = decode.backend_call("flashinfer-paged", point, q, kc, vc, lengths)
    wrapper = FakeDecodeWrapper.instances[-1]
    assert wrapper.runs == [] and wrapper.kv_layout == "NHD"
    assert wrapper.workspace.dtype == torch.uint8 and wrapper.workspace.numel() == 128 * 2**20
    indptr, indices, last, hq, hk, d, page, kwargs = wrapper.plan_args
    _, _, table = decode.paged_copy(kc, vc, 16)
    assert indptr.tolist() == [0, 3, 6, 9] and last.tolist() == [8, 8, 8]
    assert indices.tolist() == table.flatten().tolist()
    assert (hq, hk, d, page) == (4, 2, 8, 16)
    assert kwargs == {"pos_encoding_mode": "NONE", "q_data_type": torch.bfloat16,
                      "kv_data_type": torch.bfloat16}
    out = fn()
    assert len(wrapper.runs) == 1 and wrapper.plan_args[1] is indices  # no plan in the call
    q_rows, (pool_k, pool_v), run_kwargs = wrapper.runs[0]
    assert q_rows.shape == (3, 4, 8) and q_rows.data_ptr() == q.data_ptr() and run_kwargs == {}
    assert pool_k.shape == (9, 16, 2, 8) and not torch.equal(pool_k, pool_v)
    expected = q.float() + vc.float().mean(1, keepdim=True).repeat_interleave(2, 2)
    assert out.shape == q.shape
    assert torch.allclose(out.float(), expected, atol=2e-2)  # every page read back, in order
    fn()
    assert len(wrapper.runs) == 2 and len(FakeDecodeWrapper.instances[-1].runs) == 2


def test_flashinfer_paged_takes_one_scale_per_fp8_cache(monkeypatch):
    """A mixed row whose cache has one descale throughout runs with k_scale / v_scale floats
    on the FP8 pool; descales that differ per (sequence, kv head), as the bench's inputs have
    them, skip the row naming why."""
    import sys

    from flash_hopper.bench.fp8_inputs import Fp8Input

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    point = decode.DecodePoint(2, 32, 4, 2, 16, 1, "bf16+e4m3", 16)
    q, kc, vc, lengths = decode.make_inputs(point, device="cpu")
    assert not torch.all(kc.descale == kc.descale[0, 0])
    with pytest.raises(decode.DecodeSkip, match=r"flashinfer-paged: FlashInfer's run takes one "
                       r"k_scale / v_scale per call \(floats\); this cache's k and v descales "
                       r"differ per \(sequence, kv head\)"):
        decode.backend_call("flashinfer-paged", point, q, kc, vc, lengths)
    kc1 = Fp8Input(kc.data, torch.full_like(kc.descale, 0.5))
    vc1 = Fp8Input(vc.data, torch.full_like(vc.descale, 0.25))
    decode.backend_call("flashinfer-paged", point, q, kc1, vc1, lengths)()
    wrapper = FakeDecodeWrapper.instances[-1]
    _, (pool_k, _), run_kwargs = wrapper.runs[0]
    assert run_kwargs == {"k_scale": 0.5, "v_scale": 0.25}
    assert pool_k.dtype == torch.float8_e4m3fn
    assert wrapper.plan_args[-1]["kv_data_type"] == torch.float8_e4m3fn
    assert wrapper.plan_args[-1]["q_data_type"] == torch.bfloat16


@pytest.mark.parametrize(("point", "reason"), [
    (_fp8_point("e4m3", page_size=16),
     "flashinfer-paged: FlashInfer's decode takes an FP8 cache with queries in fp16/bf16 only"),
    (_fp8_point("bf16", seqlen_q=4, page_size=16),
     "flashinfer-paged: timed with one query token per sequence"),
])
def test_flashinfer_paged_rows_it_does_not_take(monkeypatch, point, reason):
    """e4m3 queries and speculative rows are skipped before FlashInfer is imported."""
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer", None)
    q, kc, vc, lengths = decode.make_inputs(point, device="cpu")
    with pytest.raises(decode.DecodeSkip, match=reason):
        decode.backend_call("flashinfer-paged", point, q, kc, vc, lengths)


def test_flashinfer_paged_missing_says_why(monkeypatch):
    import sys
    import types

    point = _fp8_point("bf16", page_size=16)
    q, kc, vc, lengths = decode.make_inputs(point, device="cpu")
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    with pytest.raises(decode.DecodeSkip, match=r"flashinfer-paged: not importable \(flashinfer:"):
        decode.backend_call("flashinfer-paged", point, q, kc, vc, lengths)
    old = types.ModuleType("flashinfer")  # a release without the 0.2 decode wrapper
    monkeypatch.setitem(sys.modules, "flashinfer", old)
    with pytest.raises(decode.DecodeSkip, match="flashinfer-paged: flashinfer has no "
                       "BatchDecodeWithPagedKVCacheWrapper"):
        decode.backend_call("flashinfer-paged", point, q, kc, vc, lengths)
    no_pages = decode.DecodePoint(2, 64, 4, 2, 8, 1, "bf16", None)
    with pytest.raises(decode.DecodeError, match="flashinfer-paged: needs --page-size"):
        decode.backend_call("flashinfer-paged", no_pages, q, kc, vc, lengths)


def test_flashinfer_spellings_name_the_paged_backend():
    """The `bench` registry's spellings of FlashInfer (flashinfer, flashinfer-python) name its
    decode backend here, once."""
    chosen = decode.backends_from_args(args("--page-size", "16", "--backends", "flashinfer",
                                            "flashinfer-python", "flashinfer-paged",
                                            "flash-hopper-paged"))
    assert chosen == ["flashinfer-paged", "flash-hopper-paged"]
    assert "flashinfer-paged" in decode.PAGED_BACKENDS
