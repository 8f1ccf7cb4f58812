"""Timing statistics, input rotation and the peak table: the pure parts of the measurement."""

import pytest
from flash_hopper.bench import peak
from flash_hopper.bench.timing import (
    Stats,
    Timer,
    TimerConfig,
    quantile,
    rotation_count,
    summarize,
)


def test_quantile_interpolates_like_numpy():
    np = pytest.importorskip("numpy")
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 7.5]
    for q in (0.0, 0.2, 0.5, 0.8, 1.0):
        assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)))
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_summarize():
    stats = summarize([3.0, 1.0, 2.0, 4.0, 5.0])
    assert isinstance(stats, Stats)
    assert (stats.median, stats.min, stats.max, stats.n) == (3.0, 1.0, 5.0, 5)
    assert stats.p20 == pytest.approx(1.8)
    assert stats.p80 == pytest.approx(4.2)
    assert stats.mean == pytest.approx(3.0)


def test_rotation_count():
    l2 = 50 << 20
    assert rotation_count(256 << 20, l2) == 1  # default sweep: far larger than L2
    assert rotation_count(l2, l2) == 1
    assert rotation_count(20 << 20, l2) == 4  # 3 other sets x 20 MB >= 50 MB
    assert rotation_count(1 << 10, l2) == 8  # capped
    assert rotation_count(0, l2) == 1


def test_timer_uses_one_set_when_cache_is_flushed():
    timer = Timer(TimerConfig(flush_l2=True))
    timer._l2 = 50 << 20
    assert timer.sets_for(1 << 20) == 1
    timer = Timer(TimerConfig())
    timer._l2 = 50 << 20
    assert timer.sets_for(1 << 20) == 8
    assert Timer(TimerConfig(rotate=False)).sets_for(1) == 1
    assert Timer(TimerConfig(method="do_bench")).describe()["flush_l2"] is True


@pytest.mark.parametrize("name,expected", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H200", 989.4), ("NVIDIA GH200 480GB", 989.4),
    ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H100 NVL", 835.5), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A10", 125.0), ("NVIDIA L40S", 362.1), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0),
])
def test_peak_table(name, expected):
    tflops, source = peak.lookup_peak(name)
    assert tflops == expected
    assert "datasheet" in source


def test_unknown_gpu_has_no_peak_and_says_how_to_set_it():
    tflops, source = peak.lookup_peak("Some Future GPU")
    assert tflops is None
    assert "--peak-tflops" in source


def test_gemm_flops():
    assert peak.gemm_flops(8192) == 2 * 8192 ** 3
