"""Timing statistics, input rotation and the peak table: the pure parts of the measurement."""

import pytest
from flash_hopper.bench import peak, timing
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


class _FakeCuda:
    """torch.cuda's events and sync on a recorded timeline (every event pair reads gpu_ms)."""

    def __init__(self, gpu_ms):
        self.log = []
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                pass

            def record(self):
                cuda.log.append("record")

            def elapsed_time(self, other):
                return gpu_ms

        self.Event = Event

    def synchronize(self):
        self.log.append("sync")


@pytest.mark.parametrize(("gpu_ms", "graph", "noted"), [(1.0, False, True), (50.0, False, False),
                                                         (1.0, True, False)])
def test_events_timer_notes_host_bound_calls(monkeypatch, gpu_ms, graph, noted):
    """The warm-up measures the host's time per call; an eager row whose host path is >= 70 % of its
    GPU time says it may hold host gaps (bench/PERFLOG.md "forward-speed items 4 ... and
    5": the event pair times the host too whenever the GPU queue runs dry). Graph replays are not
    noted."""
    import time

    import torch

    fake = _FakeCuda(gpu_ms)
    monkeypatch.setattr(torch, "cuda", fake)

    def call():
        time.sleep(0.002)  # a 2 ms host path
        fake.log.append("call")

    stats = Timer(TimerConfig(warmup=4, repeats=3, cuda_graph=graph))._events([call])
    assert stats.n == 3 and stats.median == gpu_ms
    assert 2.0 <= stats.host_ms < 20.0
    assert fake.log[fake.log.index("sync") + 1:] == ["record", "call", "record"] * 3 + ["sync"]
    assert any("host-bound" in n for n in stats.notes) == noted


def test_host_bound_note_names_both_times():
    note = timing.host_bound_note(0.09, 0.12)
    assert "90 us" in note and "120 us" in note and "--cuda-graph" in note
