"""Result files and the terminal table: JSON and CSV round-trips, naming, skip summaries.

Rows are built with the runner's own row builders from synthetic timings (clearly not
measurements; nothing here is written outside tmp_path).
"""

import datetime
import json

import pytest
from flash_hopper.bench import report
from flash_hopper.bench.cases import Case
from flash_hopper.bench.check import CheckResult
from flash_hopper.bench.runner import RunOptions, base_row, fill_check, fill_timing
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
