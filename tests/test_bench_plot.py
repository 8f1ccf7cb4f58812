"""The Figure-5-style plot from a saved result file: the PNG exists, is non-trivial, and has one
panel per (mask, head dim) with a bar per timed row. Synthetic timings in tmp_path only."""

import pytest
from flash_hopper.bench import plot, report
from flash_hopper.bench.cases import Case
from flash_hopper.bench.runner import RunOptions, base_row, fill_timing
from flash_hopper.bench.timing import Stats

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
BACKENDS = ("fa3", "fa2", "sdpa-flash", "sdpa-cudnn")


def synthetic_result_set():
    """The default sweep's shape with invented speeds (not measurements)."""
    rows = []
    for causal in (False, True):
        for head_dim in (64, 128, 256):
            for s in SEQLENS:
                case = Case(batch=16384 // s, seqlen_q=s, seqlen_k=s, heads=2048 // head_dim,
                            heads_kv=2048 // head_dim, head_dim=head_dim, causal=causal)
                for i, backend in enumerate(BACKENDS):
                    row = base_row(case, backend, "fwd")
                    if backend == "fa3":
                        row.update({"status": "skipped", "reason": "synthetic: not built"})
                    else:
                        speed = 100.0 + 40 * i + 10 * SEQLENS.index(s)  # TFLOP/s, invented
                        ms = row["flops"] / (speed * 1e12) * 1e3
                        fill_timing(row, Stats(median=ms, p20=ms, p80=ms, n=1), RunOptions())
                    rows.append(row)
    meta = {"gpu": {"name": "Synthetic GPU"}, "torch": "x", "date": "2030-01-01",
            "library": {"version": "0.0.0", "commit": "synthetic"}}
    return report.result_set(meta, rows)


def test_layout_orders_panels_and_seqlens():
    panel_rows, head_dims, backends, seqlens = plot.layout(synthetic_result_set()["results"])
    assert panel_rows == [("fwd", "bf16", "non-causal"), ("fwd", "bf16", "causal")]
    assert head_dims == [64, 128, 256]
    assert backends == list(BACKENDS)
    assert seqlens == ["512", "1k", "2k", "4k", "8k", "16k"]


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_plot_from_saved_file(tmp_path, suffix):
    from matplotlib import image

    data = synthetic_result_set()
    saved = tmp_path / f"results{suffix}"
    (report.write_json if suffix == ".json" else report.write_csv)(str(saved), data)
    png = tmp_path / "plot.png"
    counts = plot.plot_results(report.read_results(str(saved)), str(png))
    assert counts["panels"] == 6  # 2 masks x 3 head dims
    assert counts["bars"] == 2 * 3 * len(SEQLENS) * 3  # fa3 skipped everywhere
    assert png.stat().st_size > 10_000
    pixels = image.imread(str(png))
    height, width = pixels.shape[:2]
    assert width > height > 500  # a 2 x 3 grid, landscape
    assert pixels.std() > 0.05  # not a blank canvas


def test_plot_refuses_results_without_timings(tmp_path):
    data = synthetic_result_set()
    for row in data["results"]:
        row["status"] = "skipped"
    with pytest.raises(ValueError, match="no timed results"):
        plot.plot_results(data, str(tmp_path / "x.png"))


def test_seqlen_labels():
    assert plot.seqlen_label({"seqlen_q": 16384, "seqlen_k": 16384}) == "16k"
    assert plot.seqlen_label({"seqlen_q": 1000, "seqlen_k": 1000}) == "1000"
    assert plot.seqlen_label({"seqlen_q": 512, "seqlen_k": 2048}) == "512/2k"


def training_result_set():
    """fwd, bwd and fwd+bwd rows in the order a sweep makes them (every direction of a case
    before the next case); invented speeds, and sdpa-flash without a backward for causal."""
    rows = []
    for causal in (False, True):
        for head_dim in (64, 128):
            for s in (1024, 4096):
                case = Case(batch=16384 // s, seqlen_q=s, seqlen_k=s, heads=2048 // head_dim,
                            heads_kv=2048 // head_dim, head_dim=head_dim, causal=causal)
                for backend in ("fa2", "sdpa-flash"):
                    for direction in ("fwd", "bwd", "fwd+bwd"):
                        row = base_row(case, backend, direction)
                        if backend == "sdpa-flash" and causal and direction != "fwd":
                            row.update({"status": "skipped", "reason": "synthetic"})
                        else:
                            ms = row["flops"] / (200e12 if direction == "fwd" else 150e12) * 1e3
                            fill_timing(row, Stats(median=ms, p20=ms, p80=ms, n=1),
                                        RunOptions())
                        rows.append(row)
    return report.result_set({"gpu": {"name": "Synthetic GPU"}}, rows)


def test_backward_panels_are_grouped_by_direction():
    panel_rows, head_dims, backends, seqlens = plot.layout(training_result_set()["results"])
    assert panel_rows == [("fwd", "bf16", "non-causal"), ("fwd", "bf16", "causal"),
                          ("bwd", "bf16", "non-causal"), ("bwd", "bf16", "causal"),
                          ("fwd+bwd", "bf16", "non-causal"), ("fwd+bwd", "bf16", "causal")]
    assert head_dims == [64, 128] and backends == ["fa2", "sdpa-flash"]
    assert seqlens == ["1k", "4k"]


def test_plot_with_backward_rows(tmp_path):
    from matplotlib import image

    png = tmp_path / "train.png"
    counts = plot.plot_results(training_result_set(), str(png))
    assert counts["panels"] == 3 * 2 * 2  # directions x masks x head dims
    # 2 seqlens per panel: 2 backends everywhere but the causal backward panels (fa2 alone).
    assert counts["bars"] == 2 * (2 * 2 * 2 + 2 * (2 * 2 + 1 * 2))
    height, width = image.imread(str(png)).shape[:2]
    assert height > width  # six panel rows, two columns
