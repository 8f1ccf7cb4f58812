"""`flash-hopper decode` (the decode sweep, docs/decode.md) on the CPU: its arguments, the bandwidth
arithmetic, the rows a sweep records (GPU pieces stood in), the outputs and the exit status. The
GPU run itself: test_decode_runs_on_the_gpu."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from flash_hopper import cli
from flash_hopper.bench import decode


def args(*argv):
    return cli.build_parser().parse_args(["decode", *argv])


def test_defaults_are_issue_14s_table():
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
