"""Interleaved A/B timing of several builds of the library in one process (fa3 path, bf16).

    python bench/ab_libs.py --lib base=build/a/libflash_hopper.so --lib new=build/b/... \\
        -d 128 -s 512 1024 8192 --causal both --rounds 7 --json ab.json

A change worth a few percent is invisible between two `flash-hopper bench` runs: the same kernel
moves 5-10 % from run to run (clocks under the power limit). Here every library is loaded at once
(each its own ctypes handle) and, per config and round, each one runs a burst of ~25 ms in
rotating order; the median over rounds is reported with its spread (max - min over median) and
each library's largest output difference to the first. b * s = 16k, h * d = 2048 (the FA3 paper's
sweep), no L2 flush; for relative comparisons, not for the record of absolute speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from flash_hopper import _lib, _validate, ops


def time_burst(lib, params, stream, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        lib.fwd(params, stream)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", action="append", required=True, metavar="NAME=PATH",
                    help="a library to compare (the first is the baseline); repeat")
    ap.add_argument("-d", "--head-dim", type=int, nargs="+", default=[128])
    ap.add_argument("-s", "--seqlen", type=int, nargs="+",
                    default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=["both", "on", "off"], default="both")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--burst-ms", type=float, default=25.0)
    ap.add_argument("--json", type=Path, help="write every row here")
    args = ap.parse_args()

    libs = {}
    for spec in args.lib:
        name, _, path = spec.partition("=")
        libs[name] = _lib.Library(Path(path))
    names = list(libs)
    causals = {"both": [False, True], "on": [True], "off": [False]}[args.causal]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    for d in args.head_dim:
        for s in args.seqlen:
            for causal in causals:
                b, h = max(16384 // s, 1), 2048 // d
                torch.manual_seed(0)
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                out = torch.empty_like(q)
                lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
                cfg = _validate.check_fwd_args(q, k, v, None, causal, (-1, -1), 0.0, "fa3")
                params = ops.make_params(q, k, v, out, lse, cfg, "fa3", num_sms=sms)
                outs = {}
                for name, lib in libs.items():
                    for _ in range(3):  # warm-up
                        lib.fwd(params, stream)
                    outs[name] = out.clone()
                diff = {n: (outs[n].float() - outs[names[0]].float()).abs().max().item()
                        for n in names}
                once = time_burst(libs[names[0]], params, stream, 1)
                iters = max(2, int(args.burst_ms / max(once, 1e-3)))
                times = {n: [] for n in names}
                for r in range(args.rounds):
                    for n in names[r % len(names):] + names[:r % len(names)]:
                        times[n].append(time_burst(libs[n], params, stream, iters))
                flops = 4 * b * s * s * h * d / (2 if causal else 1)
                med = {n: statistics.median(times[n]) for n in names}
                row = {"head_dim": d, "seqlen": s, "causal": causal, "batch": b, "heads": h,
                       "iters": iters, "rounds": args.rounds,
                       "tflops": {n: flops / med[n] / 1e9 for n in names},
                       "spread": {n: (max(times[n]) - min(times[n])) / med[n] for n in names},
                       "max_abs_diff_vs_first": diff}
                rows.append(row)
                base = row["tflops"][names[0]]
                print(f"d{d:<4}{'c' if causal else 'n'} s{s:<6}" + " ".join(
                    f"{n}={row['tflops'][n]:5.0f} ({row['tflops'][n] / base - 1:+5.1%})"
                    for n in names), flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(0),
            "libs": {n: {"path": str(libs[n].path), "build_info": libs[n].build_info()}
                     for n in names},
            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
