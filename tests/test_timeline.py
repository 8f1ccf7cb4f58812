"""bench/timeline.py's reader on a synthetic buffer (CPU), and the debug hook's C side."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from flash_hopper._errors import UnsupportedError

ROOT = Path(__file__).resolve().parents[1]


def load_bench(name: str = "timeline"):
    """bench/<name>.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_timeline():
    return load_bench("timeline")


def test_layout_matches_the_kernel_header():
    tl = load_timeline()
    layout = (ROOT / "kernels" / "include" / "flash_hopper" / "timeline.h").read_text()
    header = (ROOT / "kernels" / "sm90" / "fwd" / "timeline.h").read_text()
    for name, value in (("kTimelineCtas", tl.CTAS), ("kTimelineWarps", tl.WARPS),
                        ("kTimelineSlots", tl.SLOTS)):
        assert f"{name} = {value};" in layout, name
    # every event id the header declares has a name here, with the same number
    import re
    declared = {int(v) for v in re.findall(r"k\w+ = (\d+),", header)}
    assert declared == set(tl.EVENTS)


def test_decode_and_transitions_of_a_synthetic_buffer():
    tl = load_timeline()
    words = [0] * (tl.BYTES // 8)
    # CTA 0, warp 4 (consumer 0): two steps
    base = (0 * tl.WARPS + 4) * tl.SLOTS
    seq = [(100, 5), (110, 8), (400, 9), (900, 10), (950, 11), (1000, 12), (1300, 5)]
    words[base] = len(seq)
    for i, (clock, ev) in enumerate(seq):
        words[base + 1 + i] = (clock << 8) | ev
    # CTA 1, warp 1 (transposer): one stage
    base = (1 * tl.WARPS + 1) * tl.SLOTS
    words[base] = 3
    words[base + 1: base + 4] = [(10 << 8) | 20, (30 << 8) | 21, (230 << 8) | 22]
    decoded = tl.decode(words)
    assert set(decoded) == {(0, 4), (1, 1)}
    assert decoded[(0, 4)][2] == (400, "s_ready")
    moves = tl.transitions(decoded[(0, 4)])
    assert moves["s_ready -> softmax_done"] == 500 and moves["pv_issued -> s_ready"] == 290
    assert tl.step_periods(decoded[(0, 4)]) == [1200]
    summary = tl.summarize(decoded, consumer_wgs=2)
    assert summary["consumer0"]["step_period_median"] == 1200
    assert summary["transposer"]["share"]["tr_vt_free -> tr_done"] == pytest.approx(200 / 220,
                                                                                     abs=1e-4)
    assert tl.role(0, 2) == "producer" and tl.role(8, 2) == "consumer1" and tl.role(12, 2) == "idle"


def test_the_debug_hook_needs_a_timeline_build(lib):
    try:
        lib.set_timeline(None, 0)
    except UnsupportedError as exc:  # a release build: refused, with the reason
        assert "fh_debug_set_timeline: this library was built without FH_TIMELINE=ON" in str(exc)
        return
    # an FH_TIMELINE=ON build: a buffer short of the layout is refused (nothing dereferenced)
    with pytest.raises(ValueError, match="bytes: expected at least"):
        lib.set_timeline(0x1000, 8)
    lib.set_timeline(None, 0)


def test_decode_timeline_layout_matches_the_kernel_header():
    import re

    dt = load_bench("decode_timeline")
    header = (ROOT / "kernels" / "decode" / "decode_kernel.h").read_text()
    layout = (ROOT / "kernels" / "include" / "flash_hopper" / "timeline.h").read_text()
    # CtaMarks<DecodeEv, kNumDecodeEvents>: the events, then the SM id and two clocks
    (events,) = re.findall(r"kNumDecodeEvents = (\d+),", header)
    (extra,) = re.findall(r"kSlots = kEvents \+ (\d+);", layout)
    assert int(events) + int(extra) == dt.SLOTS
    assert "using DecodeMarks = CtaMarks<DecodeEv, kNumDecodeEvents>;" in header
    # the decode kernel's marks fit the buffer fh_debug_set_timeline takes
    assert dt.BYTES == load_timeline().BYTES


def test_decode_timeline_phases_of_a_synthetic_buffer():
    dt = load_bench("decode_timeline")
    words = [0] * (dt.BYTES // 8)

    def cta(i, start, first, loop, published, end, sm, merged):
        words[i * dt.SLOTS:(i + 1) * dt.SLOTS] = [start, first, loop, published, end,
                                                  sm | (int(merged) << 32), 10, 510]

    cta(0, 1000, 2500, 6000, 6500, 6600, 3, False)
    cta(1, 1200, 2400, 6100, 6700, 9000, 7, True)   # merged the splits
    cta(3, 1100, 2000, 5000, 0, 5200, 9, False)     # unsplit: no publish mark
    rows = dt.phases(words, 4)
    assert [r["cta"] for r in rows] == [0, 1, 3]  # CTA 2 recorded nothing
    r0, r1, r3 = rows
    assert (r0["start"], r0["first_block"], r0["loop"], r0["publish"], r0["tail"]) == (
        0, 1500, 3500, 500, 100)
    assert (r1["start"], r1["end"], r1["sm"], r1["merged"], r1["tail"]) == (200, 8000, 7, True,
                                                                           2300)
    assert (r3["publish"], r3["tail"], r3["cycles"]) == (0, 200, 500)
    s = dt.summarize(rows)
    assert s["ctas"] == 3 and s["sms"] == 3 and s["span_ns"] == 8000
    assert s["merge"] == {"count": 1, "median": 2300, "max": 2300, "last_end": 8000}
    assert s["non_merger_last_end"] == 5600
    assert s["first_block"]["median"] == 1200
    assert dt.summarize([]) == {}
