"""Result files and the terminal table: JSON and CSV round-trips, naming, skip summaries.

Rows are built with the runner's own row builders from synthetic timings (clearly not
measurements; nothing here is written outside tmp_path).
"""

import datetime
import json

import pytest
from flash_hopper.bench import report
from flash_hopper.bench.cases import Case
from flash_hopper.bench.check import CheckResult, GradCheckResult
from flash_hopper.bench.runner import (
    RunOptions,
    base_row,
    fill_check,
    fill_grad_check,
    fill_timing,
)
from flash_hopper.bench.timing import Stats

META = {"gpu": {"name": "NVIDIA H200"}, "date": "2030-01-01T00:00:00+00:00",
        "command": "flash-hopper bench -s 1k", "library": {"version": "0.1.0", "commit": "abc"}}


def synthetic_rows():
    options = RunOptions(peak_tflops=989.4, gemm_tflops=700.0)
    rows = []
    for causal in (False, True):
        case = Case(batch=16, seqlen_q=1024, seqlen_k=1024, heads=16, heads_kv=16, head_dim=128,
                    causal=causal)
        for i, backend in enumerate(("fa2", "sdpa-flash")):
            row = base_row(case, backend, "fwd")
            row.update({"kernel": backend, "kernel_reason": "synthetic"})
            fill_timing(row, Stats(median=0.5 + i * 0.1, p20=0.45, p80=0.55, min=0.4, max=0.7,
                                   mean=0.5, n=30, notes=["note a", "note b"]), options)
            fill_check(row, CheckResult(err=1e-3, ref_err=2e-3, tol=4.00001e-3, passed=True,
                                        shape="b1 sq1024 sk1024"))
            rows.append(row)
        skipped = base_row(case, "sdpa-cudnn", "fwd")
        skipped.update({"status": "skipped", "reason": "synthetic reason"})
        rows.append(skipped)
    bwd = base_row(case, "fa2", "bwd")
    bwd.update({"status": "skipped", "reason": "backward not available in flash-hopper yet"})
    rows.append(bwd)
    return rows


def test_rows_carry_derived_numbers():
    row = synthetic_rows()[0]
    assert row["flops"] == 4 * 16 * 1024 * 1024 * 16 * 128
    assert row["tflops"] == pytest.approx(row["flops"] / 0.5e-3 / 1e12)
    assert row["pct_peak"] == pytest.approx(100 * row["tflops"] / 989.4)
    assert row["pct_gemm"] == pytest.approx(100 * row["tflops"] / 700.0)
    assert row["notes"] == "note a; note b"


def test_json_round_trip(tmp_path):
    data = report.result_set(META, synthetic_rows())
    path = tmp_path / "r.json"
    report.write_json(str(path), data)
    back = report.read_json(str(path))
    assert back == json.loads(json.dumps(data))
    assert back["schema"] == report.SCHEMA
    assert list(back["results"][0]) == list(report.FIELD_NAMES)


def test_csv_round_trip_keeps_types_and_meta(tmp_path):
    data = report.result_set(META, synthetic_rows())
    path = tmp_path / "r.csv"
    report.write_csv(str(path), data)
    text = path.read_text()
    assert text.startswith("# flash-hopper bench results")
    assert "flash-hopper bench -s 1k" in text  # the repro command is in the file
    back = report.read_csv(str(path))
    assert back["meta"] == META
    assert back["results"] == data["results"]  # floats, ints, bools and None all survive
    assert report.read_results(str(path)) == back


def test_read_json_rejects_other_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="not a flash-hopper bench result"):
        report.read_json(str(path))


def test_table_is_aligned_and_lists_only_timed_rows():
    table = report.format_table(synthetic_rows())
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["dir", "dtype", "mask"]
    body = [line for line in lines[2:] if line]
    assert len(body) == 4
    # Right-aligned numeric columns end at the same offset in every row.
    ends = {line.index("ok") for line in body}
    assert len(ends) == 1
    assert "sdpa-cudnn" not in table
    assert report.format_table([]) == "(no timed results)"


def test_skips_are_grouped_with_reasons():
    text = report.format_skips(synthetic_rows())
    assert "skipped: sdpa-cudnn fwd (2 configs): synthetic reason" in text
    assert "skipped: fa2 bwd (1 config): backward not available in flash-hopper yet" in text


def test_kernels_listed_once():
    text = report.format_kernels(synthetic_rows())
    assert text.splitlines() == ["fa2: ran fa2 (synthetic)",
                                 "sdpa-flash: ran sdpa-flash (synthetic)"]


def test_timestamped_names(tmp_path):
    when = datetime.datetime(2030, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    assert report.timestamped_stem(META, when) == "bench-nvidia-h200-20300102-030405"
    assert report.timestamped_stem({}, when).startswith("bench-nogpu-")
    paths = report.out_dir_paths(str(tmp_path / "results"), META)
    assert sorted(paths) == ["csv", "json", "png"]
    assert (tmp_path / "results").is_dir()


# ---- backward rows ----------------------------------------------------------------------------

GRAD_COLUMNS = ("check_dq_err", "check_dq_tol", "check_dk_err", "check_dk_tol", "check_dv_err",
                "check_dv_tol", "check_grad_pass", "bwd_workspace_bytes", "bwd_extra_bytes")


def backward_rows():
    """fwd, bwd and fwd+bwd rows of one synthetic config for a backend with a workspace formula
    (fa2) and one without (sdpa-flash); sdpa-flash's dk fails its check."""
    options = RunOptions(peak_tflops=989.4)
    case = Case(batch=4, seqlen_q=4096, seqlen_k=4096, heads=16, heads_kv=4, head_dim=128,
                causal=True)
    rows = []
    for backend, dk_err, workspace in (("fa2", 1e-3, 9 << 20), ("sdpa-flash", 5e-2, None)):
        for direction in ("fwd", "bwd", "fwd+bwd"):
            row = base_row(case, backend, direction)
            fill_timing(row, Stats(median=1.0, p20=1.0, p80=1.0, n=1), options)
            fill_check(row, CheckResult(err=1e-3, ref_err=2e-3, tol=4.00001e-3, passed=True,
                                        shape="b4 sq4096 sk4096"))
            if direction != "fwd":
                err = {"dq": 1e-3, "dk": dk_err, "dv": 2e-3}
                tol = {"dq": 4e-3, "dk": 6e-3, "dv": 5e-3}
                fill_grad_check(row, GradCheckResult(
                    err=err, ref_err={g: t / 3 for g, t in tol.items()}, tol=tol,
                    passed=all(err[g] <= tol[g] for g in err), shape="b4 sq4096 sk4096"))
                row.update({"bwd_workspace_bytes": workspace, "bwd_extra_bytes": 10 << 20})
            rows.append(row)
    return rows


def test_backward_columns_in_json_and_csv(tmp_path):
    data = report.result_set(META, backward_rows())
    report.write_json(str(tmp_path / "r.json"), data)
    report.write_csv(str(tmp_path / "r.csv"), data)
    header = (tmp_path / "r.csv").read_text().splitlines()[2].split(",")
    assert set(GRAD_COLUMNS) <= set(header)
    for back in (report.read_json(str(tmp_path / "r.json")), report.read_csv(str(tmp_path /
                                                                                 "r.csv"))):
        rows = {(r["backend"], r["direction"]): r for r in back["results"]}
        assert all(rows[("fa2", "fwd")][c] is None for c in GRAD_COLUMNS)
        ours, peer = rows[("fa2", "bwd")], rows[("sdpa-flash", "fwd+bwd")]
        assert ours["check_dk_err"] == 1e-3 and ours["check_dk_tol"] == 6e-3
        assert ours["check_grad_pass"] is True and ours["check_pass"] is True
        assert ours["bwd_workspace_bytes"] == 9 << 20 and ours["bwd_extra_bytes"] == 10 << 20
        assert peer["check_grad_pass"] is False and peer["check_pass"] is False
        assert peer["bwd_workspace_bytes"] is None and peer["bwd_extra_bytes"] == 10 << 20
        assert rows[("sdpa-flash", "fwd")]["check_pass"] is True
    assert report.read_csv(str(tmp_path / "r.csv"))["results"] == data["results"]


def test_files_without_backward_columns_still_read(tmp_path):
    # A CSV written before the backward columns existed: they read back empty.
    data = report.result_set(META, synthetic_rows())
    path = tmp_path / "old.csv"
    report.write_csv(str(path), data)
    lines = path.read_text().splitlines()
    header = lines[2].split(",")
    keep = [i for i, name in enumerate(header) if name not in GRAD_COLUMNS]
    old = lines[:2] + [",".join(line.split(",")[i] for i in keep) for line in lines[2:]]
    path.write_text("\n".join(old) + "\n")
    back = report.read_results(str(path))
    assert [report.normalize(r) for r in back["results"]] == data["results"]


def test_backward_memory_summary():
    text = report.format_memory(backward_rows())
    assert text.splitlines() == [
        "bf16 d=128 s=4096 b=4 h=16/4 causal: fa2 ws 9.0 extra 10.0 | sdpa-flash extra 10.0"]
    assert report.format_memory(synthetic_rows()) == ""  # forward rows only: no section


def test_table_marks_failed_gradient_checks():
    table = report.format_table(backward_rows())
    peer_backward = [line for line in table.splitlines()
                     if "sdpa-flash" in line and "bwd" in line]
    assert len(peer_backward) == 2 and all(line.endswith("FAIL") for line in peer_backward)
