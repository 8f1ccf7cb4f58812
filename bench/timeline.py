"""The FA-3 forward's event timeline (docs/fwd_sm90.md "Timeline"): where each warp's cycles go,
step by step.

    python bench/timeline.py --dtype e4m3 -d 128 -s 8192 -b 2 --out DIR [--causal]

Needs a library built with FH_TIMELINE=ON (CMake) on an sm90 GPU. The kernel's first CTAs record,
per warp (lane 0), (clock64 << 8 | event) words (kernels/sm90/fwd/timeline.h holds the event ids,
kernels/include/flash_hopper/timeline.h the buffer layout); this script sets the buffer (fh_debug_set_timeline), runs one call after a
warm-up, and writes DIR/timeline.json (per warp: the events; per role: the time between each pair
of consecutive events, summed, and the step period) and DIR/timeline.png (the events of CTA 0 over
a window of cycles). decode() and transitions() are plain Python (tests/test_timeline.py).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

# kernels/include/flash_hopper/timeline.h (WarpTimeline); the event ids: kernels/sm90/fwd/timeline.h
CTAS, WARPS, SLOTS = 2, 16, 8192
EVENTS = {1: "k_wait", 2: "k_ready", 3: "turn_wait", 4: "turn", 5: "qk_issued", 6: "v_wait",
          7: "v_ready", 8: "pv_issued", 9: "s_ready", 10: "softmax_done", 11: "gemms_done",
          12: "p_ready", 13: "tile_done", 14: "pv_done", 20: "tr_v_ready", 21: "tr_vt_free",
          22: "tr_done"}  # tr_*: the FP8 transposer's, or the mixed mode's converter's events
BYTES = 8 * CTAS * WARPS * SLOTS


def decode(words: list[int]) -> dict[tuple[int, int], list[tuple[int, str]]]:
    """Buffer words (uint64) -> {(cta, warp): [(clock, event name), ...]} for warps that recorded."""
    out = {}
    for cta in range(CTAS):
        for warp in range(WARPS):
            base = (cta * WARPS + warp) * SLOTS
            n = min(int(words[base]), SLOTS - 1)
            if n <= 0:
                continue
            events = []
            for w in words[base + 1: base + 1 + n]:
                w = int(w)
                events.append((w >> 8, EVENTS.get(w & 0xFF, f"ev{w & 0xFF}")))
            out[(cta, warp)] = events
    return out


def role(warp: int, consumer_wgs: int) -> str:
    if warp == 0:
        return "producer"
    if warp < 4:
        return "transposer"
    return f"consumer{warp // 4 - 1}" if warp // 4 - 1 < consumer_wgs else "idle"


def transitions(events: list[tuple[int, str]]) -> dict[str, int]:
    """Cycles between consecutive events, summed by 'from -> to'."""
    acc: dict[str, int] = defaultdict(int)
    for (t0, a), (t1, b) in zip(events, events[1:]):
        acc[f"{a} -> {b}"] += t1 - t0
    return dict(acc)


def step_periods(events: list[tuple[int, str]]) -> list[int]:
    """Cycles between consecutive QK issues of one warp (its step period)."""
    t = [c for c, e in events if e == "qk_issued"]
    return [b - a for a, b in zip(t, t[1:])]


def summarize(decoded, consumer_wgs: int) -> dict:
    roles: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    periods: dict[str, list[int]] = defaultdict(list)
    for (cta, warp), events in decoded.items():
        r = role(warp, consumer_wgs)
        if r.startswith("consumer") and warp % 4:
            continue  # one warp per consumer warpgroup
        for k, v in transitions(events).items():
            roles[r][k] += v
        periods[r] += step_periods(events)
    summary = {}
    for r, acc in roles.items():
        total = sum(acc.values()) or 1
        top = sorted(acc.items(), key=lambda kv: -kv[1])[:12]
        p = sorted(periods[r])
        summary[r] = {"share": {k: round(v / total, 4) for k, v in top},
                      "step_period_median": p[len(p) // 2] if p else None, "steps": len(p)}
    return summary


def plot(decoded, path: Path, consumer_wgs: int, window: int = 30000) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((k for k in decoded if k[0] == 0 and (k[1] < 4 or k[1] % 4 == 0)),
                  key=lambda k: k[1])
    t0 = min(e[0][0] for k, e in decoded.items() if k[0] == 0)
    mid = t0 + (max(e[-1][0] for k, e in decoded.items() if k[0] == 0) - t0) // 2
    colors = {"s_ready -> softmax_done": "tab:red", "qk_issued -> s_ready": "tab:blue",
              "pv_issued -> s_ready": "tab:blue", "softmax_done -> gemms_done": "tab:cyan",
              "turn_wait -> turn": "tab:gray", "k_wait -> k_ready": "tab:olive",
              "v_wait -> v_ready": "tab:olive", "tr_v_ready -> tr_vt_free": "tab:gray",
              "tr_vt_free -> tr_done": "tab:green", "gemms_done -> p_ready": "tab:orange",
              "softmax_done -> p_ready": "tab:orange"}
    fig, ax = plt.subplots(figsize=(16, 1 + 0.6 * len(rows)))
    for y, key in enumerate(rows):
        ev = [(c - mid, e) for c, e in decoded[key] if abs(c - mid) < window]
        for (a, ea), (b, eb) in zip(ev, ev[1:]):
            ax.broken_barh([(a, b - a)], (y - 0.4, 0.8),
                           color=colors.get(f"{ea} -> {eb}", "tab:purple"))
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"w{w} {role(w, consumer_wgs)}" for _, w in rows])
    ax.set_xlabel("cycles (clock64, relative)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), fontsize=6, ncol=4, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16",
                    choices=["bf16", "fp16", "e4m3", "bf16+e4m3", "fp16+e4m3", "bf16+e5m2",
                             "fp16+e5m2"])
    ap.add_argument("-d", "--head-dim", type=int, default=128)
    ap.add_argument("-s", "--seqlen", type=int, default=8192)
    ap.add_argument("-b", "--batch", type=int, default=2)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()

    import flash_hopper as fh
    import torch
    from flash_hopper import _lib

    lib = _lib.get_library()
    h = 2048 // a.head_dim
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn,
             "e5m2": torch.float8_e5m2}
    q_name, _, kv_name = a.dtype.partition("+")  # "bf16+e4m3": the mixed mode's q and K / V
    q_dt, kv_dt = names[q_name], names[kv_name or q_name]
    q, k, v = (torch.randn(a.batch, a.seqlen, h, a.head_dim, device="cuda").to(dt)
               for dt in (q_dt, kv_dt, kv_dt))
    fh.flash_attn_func(q, k, v, causal=a.causal)  # warm-up, no recording
    buf = torch.zeros(BYTES // 8, dtype=torch.int64, device="cuda")
    lib.set_timeline(buf.data_ptr(), BYTES)
    try:
        fh.flash_attn_func(q, k, v, causal=a.causal)
        torch.cuda.synchronize()
    finally:
        lib.set_timeline(None, 0)
    words = [w & (2**64 - 1) for w in buf.cpu().tolist()]
    decoded = decode(words)
    wgs = max((w // 4 for _, w in decoded), default=1)  # consumer warpgroups that recorded
    a.out.mkdir(parents=True, exist_ok=True)
    summary = summarize(decoded, wgs)
    (a.out / "timeline.json").write_text(json.dumps(
        {"config": vars(a) | {"out": str(a.out)}, "summary": summary,
         "events": {f"{c}/{w}": e for (c, w), e in decoded.items()}}))
    for r, s in sorted(summary.items()):
        print(r, "median step", s["step_period_median"], "cycles over", s["steps"], "steps")
        for kk, v in s["share"].items():
            print(f"   {v * 100:5.1f} %  {kk}")
    plot(decoded, a.out / "timeline.png", wgs)


if __name__ == "__main__":
    main()
