"""The decode kernel's CTA timeline (docs/decode.md): where a short decode call's microseconds go.

    python bench/decode_timeline.py --points 1x8192 64x1024 --out DIR [--splits N] [--page-size P]

Needs a library built with FH_TIMELINE=ON (CMake) and a GPU. Every CTA's thread 0 records the
global timer (ns) when it starts, when its first key block has landed, when its loop is done, when
its split's partials are written (split calls) and when it ends, plus its SM (bit 32 of that
word, a merge flag phases() still reads, is never set: a combine kernel merges the splits,
bench/PERFLOG.md "the split merge as a kernel of its own"; kernels/decode/decode_kernel.h,
DecodeMarks, the shared per-CTA recorder of kernels/include/flash_hopper/timeline.h). This script runs each point
(GQA 32 / 8, d128, bf16, one query token, dense or paged cache) once to warm up, once recorded,
and writes DIR/decode_timeline.json: per point the span of the grid, and the medians / maxima of
each phase over the CTAs. phases() and summarize() are plain Python (tests/test_timeline.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SLOTS = 8  # DecodeMarks::kSlots: 5 events, the SM id, clock64 at start and end
BYTES = 8 * 2 * 16 * 8192  # kTimelineBytes: the buffer fh_debug_set_timeline asks for
MAX_CTAS = BYTES // (8 * SLOTS)


def phases(words: list[int], ctas: int) -> list[dict]:
    """Buffer words (uint64) -> per CTA: start (ns, relative to the earliest), the phases' lengths
    (ns) and the SM. CTAs that recorded nothing (zero start) are left out."""
    rows = []
    for cta in range(min(ctas, MAX_CTAS)):
        w = [int(x) for x in words[cta * SLOTS:(cta + 1) * SLOTS]]
        if w[0] == 0:
            continue
        merged = bool(w[5] >> 32)
        published = w[3] if w[3] else w[2]
        rows.append({
            "cta": cta,
            "sm": w[5] & 0xFFFFFFFF,
            "merged": merged,
            "start": w[0],
            "first_block": w[1] - w[0] if w[1] else 0,
            "loop": w[2] - w[1] if w[1] else w[2] - w[0],
            "publish": published - w[2],
            "tail": w[4] - published,
            "end": w[4],
            "cycles": w[7] - w[6],
        })
    if rows:
        t0 = min(r["start"] for r in rows)
        for r in rows:
            r["start"] -= t0
            r["end"] -= t0
    return rows


def summarize(rows: list[dict]) -> dict:
    """The grid's span and, per phase, the median and maximum over the CTAs (ns); the merge is
    the tail of the CTAs that merged."""
    if not rows:
        return {}
    out = {"ctas": len(rows), "span_ns": max(r["end"] for r in rows),
           "sms": len({r["sm"] for r in rows})}
    for key in ("start", "first_block", "loop", "publish", "end"):
        vals = [r[key] for r in rows]
        out[key] = {"median": statistics.median(vals), "max": max(vals), "min": min(vals)}
    mergers = [r for r in rows if r["merged"]]
    if mergers:
        out["merge"] = {"count": len(mergers),
                        "median": statistics.median(r["tail"] for r in mergers),
                        "max": max(r["tail"] for r in mergers),
                        "last_end": max(r["end"] for r in mergers)}
        others = [r["end"] for r in rows if not r["merged"]]
        if others:
            out["non_merger_last_end"] = max(others)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", nargs="+", default=["1x8192", "64x1024", "1x131072", "32x32768"])
    ap.add_argument("--splits", type=int, default=0, help="num_splits (0: the kernel's choice)")
    ap.add_argument("--page-size", type=int, default=0, help="0: dense cache")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import flash_hopper as fh
    import torch
    from flash_hopper import _lib
    from flash_hopper.bench.decode import DecodePoint, make_inputs, paged_copy, parse_point

    lib = _lib.get_library()
    buf = torch.zeros(BYTES // 8, dtype=torch.int64, device="cuda")
    results = {}
    for point in args.points:
        # the decode sweep's inputs (GQA 32 / 8, d128, bf16, one query token, full caches)
        q, k, v, seqlens = make_inputs(DecodePoint(*parse_point(point)))
        kw = {}
        if args.page_size:  # its shuffled pool of pages
            k, v, kw["page_table"] = paged_copy(k, v, args.page_size)

        def call(q=q, k=k, v=v, seqlens=seqlens, kw=kw):
            return fh.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens,
                                              num_splits=args.splits, **kw)

        call()
        torch.cuda.synchronize()
        buf.zero_()
        lib.set_timeline(buf.data_ptr(), BYTES)
        try:
            call()
            torch.cuda.synchronize()
        finally:
            lib.set_timeline(None, 0)
        rows = phases(buf.cpu().tolist(), MAX_CTAS)
        results[point] = {"summary": summarize(rows), "ctas": rows}
        print(point, json.dumps(results[point]["summary"]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_timeline.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
