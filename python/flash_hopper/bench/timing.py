"""GPU timing: CUDA events per iteration (default) or triton's do_bench, with median and spread.

Why each knob exists:
- warm-up: first calls pay for autotuning, torch.compile, cuBLAS/cuDNN plan creation, clocks ramp.
- per-iteration event pairs: gives a distribution (median, p20/p80, min/max), not just a mean.
- --flush-l2: zero a buffer larger than L2 before each timed call, so inputs come from HBM.
- input rotation: when one input set fits in L2, cycle through several sets instead (cheaper than
  flushing and still cold), see `rotation_count`.
- --cuda-graph: replay a captured graph so CPU launch overhead (several kernels for SDPA, flex)
  does not leak into the number at small sizes.
- host-bound note (events): an eager call's event pair times the host's launch too whenever the
  GPU queue runs dry, i.e. when the call's host path is about as long as its kernels: the time
  then flips between the kernels and host + kernels (flash-hopper's forward at s512 read 155-316
  us in one sweep point when its host path was ~136 us; SDPA cuDNN's s512 rows spread alike).
  The warm-up measures the host time per call; a row whose host path is >= 70 %
  of its median says so in its notes (time it with --cuda-graph). A GPU spin before each start
  event removed the spread but read 3-5 % slower for every backend (bench/PERFLOG.md: the timer
  modes, bench/results/2026-12-01-h200-fwd-s16-timer-modes.json).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

from .errors import first_line

# H100/H200 SXM have 50 MB of L2; used when torch does not report the size.
DEFAULT_L2_BYTES = 50 * 1024 * 1024
# The flush buffer is at least this big (triton's do_bench uses 256 MB for the same purpose).
MIN_FLUSH_BYTES = 256 * 1024 * 1024
# A row whose eager host path per call is at least this fraction of its median GPU time is noted
# as host-bound (its event pairs may include the host's gaps).
HOST_BOUND_FRACTION = 0.7


@dataclass
class TimerConfig:
    method: str = "events"  # events | do_bench
    warmup: int = 10
    repeats: int = 30
    flush_l2: bool = False
    cuda_graph: bool = False
    rotate: bool = True


@dataclass
class Stats:
    """Milliseconds per call. min/max are None when the timer does not report them."""

    median: float
    p20: float
    p80: float
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    n: int = 0
    notes: list[str] = field(default_factory=list)
    host_ms: float | None = None  # events timer: the host's time per call (warm-up median)


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method) without needing numpy."""
    if not values:
        raise ValueError("quantile of an empty sequence")
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(times_ms: Sequence[float]) -> Stats:
    return Stats(median=quantile(times_ms, 0.5), p20=quantile(times_ms, 0.2),
                 p80=quantile(times_ms, 0.8), min=min(times_ms), max=max(times_ms),
                 mean=sum(times_ms) / len(times_ms), n=len(times_ms))


def rotation_count(bytes_per_set: int, l2_bytes: int, max_sets: int = 8) -> int:
    """How many input sets to cycle through so a set has left L2 before its next use.

    With n sets, (n - 1) * bytes_per_set of other data is touched between two uses of one set;
    once that reaches L2 size the call sees cold inputs, as inside a real model. Large inputs
    (the default sweep moves >= 256 MB per call) need just one set.
    """
    if bytes_per_set <= 0 or l2_bytes <= 0 or bytes_per_set >= l2_bytes:
        return 1
    return int(min(max_sets, math.ceil(l2_bytes / bytes_per_set) + 1))


def l2_cache_bytes(device=None) -> int:
    import torch

    props = torch.cuda.get_device_properties(device if device is not None else 0)
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


class Timer:
    """Times a list of equivalent callables (one per input set), cycling through them."""

    def __init__(self, config: TimerConfig, device=None):
        self.config = config
        self.device = device
        self._flush = None
        self._l2 = None

    @property
    def l2_bytes(self) -> int:
        if self._l2 is None:
            self._l2 = l2_cache_bytes(self.device)
        return self._l2

    def sets_for(self, bytes_per_set: int) -> int:
        if not self.config.rotate or self.config.flush_l2 or self.config.method == "do_bench":
            return 1  # the cache is cold anyway
        return rotation_count(bytes_per_set, self.l2_bytes)

    def describe(self) -> dict:
        cfg = self.config
        return {"method": cfg.method, "warmup": cfg.warmup, "repeats": cfg.repeats,
                "flush_l2": cfg.flush_l2 or cfg.method == "do_bench",
                "cuda_graph": cfg.cuda_graph, "rotate_inputs": cfg.rotate}

    def measure(self, fns: Sequence[Callable[[], object]]) -> Stats:
        fns = list(fns)
        notes: list[str] = []
        if self.config.cuda_graph:
            try:
                fns = [_capture(fn) for fn in fns]
            except Exception as exc:  # noqa: BLE001 - capture is fragile; eager timing still works
                notes.append(f"cuda-graph capture failed, timed eagerly: {first_line(exc)}")
        if self.config.method == "do_bench":
            stats = self._do_bench(fns)
        else:
            stats = self._events(fns)
        stats.notes = notes + stats.notes
        return stats

    def _flush_buffer(self):
        import torch

        if self._flush is None:
            size = max(MIN_FLUSH_BYTES, 2 * self.l2_bytes)
            self._flush = torch.empty(size, dtype=torch.int8, device=self.device or "cuda")
        return self._flush

    def _events(self, fns: list[Callable[[], object]]) -> Stats:
        import torch

        cfg = self.config
        host = []
        for i in range(max(cfg.warmup, len(fns), 3)):
            t0 = time.perf_counter()
            fns[i % len(fns)]()
            host.append(time.perf_counter() - t0)
        host_ms = statistics.median(host[2:]) * 1e3
        flush = self._flush_buffer() if cfg.flush_l2 else None
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.repeats)]
        torch.cuda.synchronize()
        for i in range(cfg.repeats):
            if flush is not None:
                flush.zero_()  # outside the event pair: costs no measured time
            starts[i].record()
            fns[i % len(fns)]()
            ends[i].record()
        torch.cuda.synchronize()
        stats = summarize([s.elapsed_time(e) for s, e in zip(starts, ends)])
        stats.host_ms = host_ms
        if not self.config.cuda_graph and host_ms >= HOST_BOUND_FRACTION * stats.median:
            stats.notes.append(host_bound_note(host_ms, stats.median))
        return stats

    def _do_bench(self, fns: list[Callable[[], object]]) -> Stats:
        from triton import testing

        counter = [0]

        def cycle():
            fns[counter[0] % len(fns)]()
            counter[0] += 1

        quantiles = [0.5, 0.2, 0.8]
        # do_bench's warm-up and repetition arguments are milliseconds, not counts.
        median, p20, p80 = testing.do_bench(cycle, warmup=25, rep=100, quantiles=quantiles)
        return Stats(median=median, p20=p20, p80=p80, n=0,
                     notes=["triton do_bench (flushes L2 before every call)"])


def host_bound_note(host_ms: float, median_ms: float) -> str:
    return (f"host-bound: the eager call's host path ({host_ms * 1e3:.0f} us) is >= "
            f"{HOST_BOUND_FRACTION:.0%} of its GPU time ({median_ms * 1e3:.0f} us), so its event "
            f"timings may include host gaps; time it with --cuda-graph")


def _capture(fn: Callable[[], object]) -> Callable[[], object]:
    """Capture fn into a CUDA graph and return its replay.

    Warm up on a side stream first, as torch.cuda.graphs requires: lazy initialisation (cuBLAS
    handles, autotuning, allocator growth) must not happen during capture.
    """
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay

