"""The `flash-hopper` command: argument parsing, GPU-less behaviour, re-plotting, and (on a GPU)
a tiny sweep end to end.

GPU-less subprocess tests hide any GPU with CUDA_VISIBLE_DEVICES="" so they mean the same thing on
the CPU CI machine and on a GPU box.
"""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import StandInTimer, mock_h200_bench
from flash_hopper import cli
from flash_hopper.bench import cases as sweep
from flash_hopper.bench import report

PYTHON_DIR = Path(__file__).resolve().parents[1] / "python"


def run_module(*args, hide_gpu=True, timeout=240):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_DIR), env.get("PYTHONPATH")]))
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-m", "flash_hopper", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, check=False)


def parse_bench(*args):
    parsed = cli.build_parser().parse_args(["bench", *args])
    return parsed, sweep.expand(cli.sweep_spec(parsed))


# ---- parsing --------------------------------------------------------------------------------

def test_defaults_reproduce_fa3_paper_sweep():
    args, cases = parse_bench()
    seqlens = (512, 1024, 2048, 4096, 8192, 16384)
    assert len(cases) == 2 * 3 * 6
    assert {(c.causal, c.head_dim, c.seqlen_q) for c in cases} == set(
        itertools.product((False, True), (64, 128, 256), seqlens))
    for c in cases:
        assert c.seqlen_q == c.seqlen_k
        assert c.batch * c.seqlen_q == 16384
        assert c.heads * c.head_dim == 2048
        assert c.heads_kv == c.heads
        assert (c.dtype, c.window, c.softcap) == ("bf16", (-1, -1), 0.0)
    assert cli.directions(args) == ["fwd"]
    assert cli.backend_names(args) == ["fa3", "fa2", "sdpa-flash", "sdpa-cudnn"]
    assert (args.timer, args.check, args.flush_l2, args.cuda_graph) == (
        "events", "on", False, False)


def test_lists_suffixes_and_gqa():
    args, cases = parse_bench("-s", "1k,2k", "4k", "-d", "64", "128", "--causal", "on",
                              "--gqa-ratio", "4", "--dtype", "fp16", "--direction", "fwd",
                              "bwd", "--window", "256,0", "--softcap", "30")
    assert len(cases) == 3 * 2
    assert {c.seqlen_q for c in cases} == {1024, 2048, 4096}
    c = next(c for c in cases if c.head_dim == 128)
    assert (c.heads, c.heads_kv, c.dtype, c.causal) == (16, 4, "fp16", True)
    assert (c.window, c.softcap) == ((256, 0), 30.0)
    assert cli.directions(args) == ["fwd", "bwd"]


def test_explicit_batch_heads_and_seqlen_k():
    _, cases = parse_bench("-s", "512", "--seqlen-k", "512", "2k", "-b", "3", "--heads", "8",
                           "--kv-heads", "2", "-d", "64")
    assert [(c.seqlen_q, c.seqlen_k) for c in cases] == [(512, 512), (512, 2048)] * 2
    assert all((c.batch, c.heads, c.heads_kv) == (3, 8, 2) for c in cases)
    _, cases = parse_bench("-s", "1k", "--seqlen-k", "4k", "-d", "64")
    assert cases[0].batch == 16384 // 4096  # tokens are counted on the longer side


@pytest.mark.parametrize("args,message", [
    (["--window", "7"], "LEFT,RIGHT"),
    (["-s", "12x"], "16k"),
    (["--kv-heads", "5", "-d", "128"], "multiple of kv-heads"),
    (["--backends", "nope"], "unknown backend 'nope'"),
    (["--replot", "missing.json"], "--plot"),
])
def test_bad_values_give_one_line(capsys, args, message):
    assert cli.main(["bench", "--dry-run", *args]) == cli.EXIT_FAILURE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("flash-hopper bench: error:") and message in err


def test_check_is_on_or_off():
    # The check always runs on the timed configuration: no proxy or size-dependent mode remains.
    assert parse_bench("--check", "off")[0].check == "off"
    for retired in ("auto", "full", "proxy"):
        with pytest.raises(SystemExit) as exc:
            cli.build_parser().parse_args(["bench", "--check", retired])
        assert exc.value.code == cli.EXIT_USAGE


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--causal", "maybe"])
    assert exc.value.code == cli.EXIT_USAGE


def test_no_subcommand_prints_help(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "usage: flash-hopper" in out and "bench" in out and "info" in out


def test_dry_run_lists_plan(capsys):
    assert cli.main(["bench", "--dry-run", "-s", "512", "-d", "64", "--causal", "off"]) == 0
    out = capsys.readouterr().out
    assert "1 configurations x 1 direction(s)" in out
    assert "d=64 s=512 b=32 h=32/32 non-causal" in out


def test_repro_command_quotes():
    assert cli.repro_command(["bench", "--window", "256,0", "--json", "a b.json"]) == \
        "flash-hopper bench --window 256,0 --json 'a b.json'"


# ---- re-plotting (no GPU needed) ---------------------------------------------------------------

def saved_results(tmp_path):
    """A minimal result file with synthetic timings (never a measurement)."""
    from flash_hopper.bench.runner import RunOptions, base_row, fill_timing
    from flash_hopper.bench.timing import Stats

    rows = []
    for causal, s in itertools.product((False, True), (512, 1024)):
        case = sweep.Case(batch=16384 // s, seqlen_q=s, seqlen_k=s, heads=16, heads_kv=16,
                          head_dim=128, causal=causal)
        row = base_row(case, "sdpa-flash", "fwd")
        fill_timing(row, Stats(median=1.0, p20=1.0, p80=1.0, n=1), RunOptions())
        rows.append(row)
    path = tmp_path / "results.json"
    report.write_json(str(path), report.result_set({"gpu": {"name": "Synthetic"}}, rows))
    return path


def test_replot_and_plot_subcommand(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    saved = saved_results(tmp_path)
    out = tmp_path / "replot.png"
    assert cli.main(["bench", "--replot", str(saved), "--plot", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert "2 panels" in capsys.readouterr().out
    assert cli.main(["plot", str(saved)]) == 0
    assert (tmp_path / "results.png").exists()
    assert cli.main(["bench", "--replot", str(saved), "--out-dir", str(tmp_path / "d")]) == 0
    assert len(list((tmp_path / "d").glob("bench-synthetic-*.png"))) == 1


def test_plot_of_unreadable_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli.main(["plot", str(bad)]) == cli.EXIT_FAILURE
    assert cli.main(["plot", str(tmp_path / "absent.json")]) == cli.EXIT_FAILURE
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("flash-hopper plot: error: cannot read")
                                   for line in lines)


# ---- the installed entry points, without a GPU ----------------------------------------------

def test_help_works_without_gpu():
    result = run_module("bench", "--help")
    assert result.returncode == 0, result.stderr
    for flag in ("--head-dim", "--seqlen", "--backends", "--flush-l2", "--cuda-graph",
                 "--json", "--csv", "--plot", "--out-dir", "--replot", "--peak-tflops"):
        assert flag in result.stdout


def test_info_without_gpu_exits_0_and_says_so():
    result = run_module("info")
    assert result.returncode == 0, result.stderr
    assert "no GPU" in result.stdout
    assert "path for head_dim=128 dtype=bf16 backend=auto" in result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [["bench"], ["bench", "-s", "512", "-d", "64"], ["demo"]])
def test_gpu_commands_without_gpu_fail_with_one_line(command):
    result = run_module(*command)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "needs a CUDA GPU" in lines[0]
    assert "Traceback" not in result.stderr


# ---- the whole bench command with the GPU mocked: CPU tensors, a stand-in timer ------------------

def test_bench_pipeline_with_mocked_gpu(tmp_path, monkeypatch, capsys):

    pytest.importorskip("matplotlib")

    mock_h200_bench(monkeypatch)
    # sdpa-flash must be unavailable here whatever torch runs the test (a CUDA build has it).
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False,
                        raising=False)  # torch < 2.5 has no such function
    out_dir = tmp_path / "results"
    argv = ["bench", "-s", "64", "128", "-d", "16", "-b", "2", "--hidden", "32", "--backends",
            "sdpa-math", "sdpa-flash", "--direction", "fwd", "bwd", "--no-gemm", "-q",
            "--json", str(tmp_path / "r.json"), "--out-dir", str(out_dir)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "skipping backend sdpa-flash" in captured.err
    assert "unavailable backends:" in captured.out
    data = report.read_json(str(tmp_path / "r.json"))
    meta = data["meta"]
    assert meta["command"] == cli.repro_command(argv)
    assert meta["peak"] == {"tflops": 989.4, "source": "datasheet H100/H200 SXM dense bf16/fp16"}
    assert meta["backends"]["sdpa-math"]["available"] is True
    assert meta["backends"]["sdpa-flash"]["available"] is False
    rows = data["results"]
    assert len(rows) == 2 * 2 * 2  # seqlens x causal x directions, one backend
    assert all(r["status"] == "ok" and r["backend"] == "sdpa-math" for r in rows)
    assert all(r["check_pass"] is True for r in rows)
    for row in rows:  # backward rows: their gradients checked; no memory numbers off a GPU
        assert (row["check_grad_pass"] is True) == (row["direction"] == "bwd")
        assert (row["check_dq_tol"] is not None) == (row["direction"] == "bwd")
        assert row["bwd_extra_bytes"] is None
    (csv_path,) = out_dir.glob("*.csv")
    assert report.read_csv(str(csv_path))["results"] == rows  # the new columns included
    fwd = next(r for r in rows if r["direction"] == "fwd" and not r["causal"])
    assert fwd["pct_peak"] == pytest.approx(100 * fwd["tflops"] / 989.4)
    assert sorted(p.suffix for p in out_dir.iterdir()) == [".csv", ".json", ".png"]
    assert "fwd  bf16" in captured.out  # the table


def test_bench_exits_1_when_a_gradient_check_fails(tmp_path, monkeypatch, capsys):

    from flash_hopper.bench import peers

    mock_h200_bench(monkeypatch)
    checked = peers.SdpaBackend.run_checked_backward

    def wrong_dv(self, q, k, v, dout, case):
        dq, dk, dv = checked(self, q, k, v, dout, case)
        return dq, dk, dv * 1.5

    monkeypatch.setattr(peers.SdpaBackend, "run_checked_backward", wrong_dv)
    argv = ["bench", "-s", "64", "-d", "16", "-b", "2", "--hidden", "32", "--causal", "off",
            "--backends", "sdpa-math", "--direction", "fwd", "fwd+bwd", "--no-gemm", "-q",
            "--json", str(tmp_path / "r.json")]
    assert cli.main(argv) == cli.EXIT_FAILURE
    assert "1 row(s) failed a reference check" in capsys.readouterr().err
    fwd, both = report.read_json(str(tmp_path / "r.json"))["results"]
    assert fwd["check_pass"] is True and both["check_pass"] is False
    assert both["check_dv_err"] > both["check_dv_tol"]
    assert both["check_dq_err"] <= both["check_dq_tol"]


# ---- on a GPU ---------------------------------------------------------------------------------

def _cuda_available():
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU")
def test_tiny_sweep_end_to_end(tmp_path):
    import flash_hopper

    out = tmp_path / "r.json"
    result = run_module("bench", "-s", "512", "-d", "64", "--causal", "off", "--backends",
                        "fa2", "sdpa-flash", "--warmup", "2", "--repeats", "5", "--no-gemm",
                        "--json", str(out), "--csv", str(tmp_path / "r.csv"), "-q",
                        hide_gpu=False, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["schema"] == report.SCHEMA
    meta = data["meta"]
    assert meta["gpu"]["name"] and meta["command"].startswith("flash-hopper bench -s 512")
    rows = {r["backend"]: r for r in data["results"]}
    expected = {"sdpa-flash"}
    try:
        flash_hopper.build_info()
        expected.add("fa2")
    except Exception:  # noqa: BLE001 - without a built library fa2 must be skipped, not timed
        assert meta["backends"]["fa2"]["available"] is False
    for name in expected:
        row = rows[name]
        assert row["status"] == "ok", row
        assert row["tflops"] > 0 and row["ms"] > 0
        assert row["check_pass"] is True, row
        assert (row["seqlen_q"], row["head_dim"], row["batch"], row["heads"]) == (512, 64, 32,
                                                                                  32)
    assert report.read_csv(str(tmp_path / "r.csv"))["results"] == data["results"]


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU")
def test_tiny_backward_sweep_end_to_end(tmp_path):
    # GQA 2:1 and both masks at a length with tails: the backward's dK / dV accumulators, the
    # gradient check of every timed row, and both memory numbers.
    import flash_hopper

    out = tmp_path / "r.json"
    result = run_module("bench", "-s", "1000", "-d", "64", "128", "--gqa-ratio", "2",
                        "--backends", "fa2", "sdpa-flash", "--direction", "bwd", "fwd+bwd",
                        "--warmup", "2", "--repeats", "5", "--no-gemm", "--json", str(out),
                        "-q", hide_gpu=False, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "backward memory, MiB" in result.stdout
    rows = json.loads(out.read_text())["results"]
    try:
        has_backward = bool(flash_hopper.build_info().get("backward"))
    except Exception:  # noqa: BLE001 - without a built library fa2 is skipped, not timed
        has_backward = False
    backends = {"sdpa-flash", "fa2"} if has_backward else {"sdpa-flash"}
    timed = [r for r in rows if r["status"] == "ok"]
    assert {r["backend"] for r in timed} == backends
    for row in timed:
        assert row["check_pass"] is True and row["check_grad_pass"] is True, row
        for grad in ("dq", "dk", "dv"):
            assert row[f"check_{grad}_err"] <= row[f"check_{grad}_tol"], row
        assert row["bwd_extra_bytes"] is not None and row["bwd_extra_bytes"] >= 0, row
        if row["backend"] == "fa2":
            # The workspace comes from torch's allocator during the backward: measured with it.
            assert 0 < row["bwd_workspace_bytes"] <= row["bwd_extra_bytes"], row
        else:
            assert row["bwd_workspace_bytes"] is None


# ---- FP8 (e4m3): parsing, the forward-only rule, and the bench command with the GPU mocked ------

def test_e4m3_parses_into_fp8_cases():
    args, cases = parse_bench("--dtype", "e4m3", "bf16", "-d", "64", "128", "-s", "2k", "16k",
                              "--causal", "off")
    assert [c.dtype for c in cases] == ["e4m3"] * 4 + ["bf16"] * 4  # dtype-major: plot panels
    assert [(c.head_dim, c.seqlen_q) for c in cases[:4]] == [(64, 2048), (64, 16384),
                                                             (128, 2048), (128, 16384)]
    for fp8, bf16 in zip(cases[:4], cases[4:]):
        assert fp8.is_fp8 and not bf16.is_fp8
        assert (fp8.batch, fp8.heads, fp8.heads_kv) == (bf16.batch, bf16.heads, bf16.heads_kv)
        assert fp8.flops() == bf16.flops()
    cli.check_directions(cli.sweep_spec(args).dtypes, cli.directions(args))  # fwd: accepted


@pytest.mark.parametrize("directions", [["bwd"], ["fwd", "fwd+bwd"], ["fwd", "bwd"]])
def test_e4m3_with_a_backward_direction_is_refused(capsys, directions):
    argv = ["bench", "--dry-run", "--dtype", "bf16", "e4m3", "--direction", *directions]
    assert cli.main(argv) == cli.EXIT_FAILURE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("flash-hopper bench: error:")
    assert "--dtype e4m3 is forward only" in err and "--direction" in err
    assert "bwd" in err
    assert cli.main(["bench", "--dry-run", "--dtype", "bf16", "--direction", *directions]) == 0


def test_e4m3_dry_run_lists_the_plan_and_the_ablation(capsys):
    assert cli.main(["bench", "--dry-run", "--dtype", "e4m3", "-s", "2k", "-d", "128",
                     "--causal", "on", "--backends", "fa3", "fa3-fp8-single-level"]) == 0
    out = capsys.readouterr().out
    assert "backends fa3 fa3-fp8-single-level" in out
    assert "e4m3 d=128 s=2048 b=8 h=16/16 causal" in out


def test_info_and_demo_keep_the_half_dtypes():
    for command in (["info", "--dtype", "e4m3"], ["demo", "--dtype", "e4m3"]):
        with pytest.raises(SystemExit) as exc:
            cli.build_parser().parse_args(command)
        assert exc.value.code == cli.EXIT_USAGE


def test_help_documents_e4m3(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "e4m3" in text and "fa3-fp8-single-level" in text
    assert "relative RMS error" in text and "unsupported (no FP8)" in text


def test_fp8_gemm_ceiling_missing_is_a_note(monkeypatch, capsys):
    monkeypatch.delattr(torch, "_scaled_mm")
    assert cli._gemm_ceiling(StandInTimer(None), "e4m3", 64) is None
    err = capsys.readouterr().err
    assert err.startswith("note: e4m3 GEMM ceiling not measured (torch ")
    assert "has no torch._scaled_mm" in err and "%gemm left empty for e4m3" in err


def test_commands_run_with_a_bare_sys_argv(monkeypatch):
    """Peers that parse sys.argv themselves (the CuTe DSL behind flash_attn.cute does when its
    backward compiles, long after the import) must not see the CLI's arguments: `-d 128` read as
    its `-diagnostic` ended a backward run. While a command runs sys.argv is the program name
    alone; afterwards it is back."""
    seen = []
    monkeypatch.setattr(cli, "_run_command", lambda args, argv: seen.append(list(sys.argv)) or 0)
    argv = ["flash-hopper", "bench", "-d", "128", "--direction", "bwd"]
    monkeypatch.setattr(sys, "argv", list(argv))
    assert cli.main() == 0
    assert seen == [["flash-hopper"]]
    assert sys.argv == argv
