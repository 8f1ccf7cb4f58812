"""Interleaved A/B timing of several builds of the library in one process (fa3 path, bf16).

    python bench/ab_libs.py --lib base=build/a/libflash_hopper.so --lib new=build/b/... \\
        -d 128 -s 512 1024 8192 --causal both --rounds 7 --json ab.json

A change worth a few percent is invisible between two `flash-hopper bench` runs: the same kernel
moves 5-10 % from run to run (clocks under the power limit). Here every library is loaded at once
(each its own ctypes handle) and, per config and round, each one runs a burst of ~25 ms in
rotating order; the median over rounds is reported with its spread (max - min over median).
b * s = 16k, h * d = 2048 (the FA3 paper's sweep), no L2 flush; for relative comparisons, not for
the record of absolute speed.

Every library's result is checked against an fp32 reference of the config (the benchmark's rule
and chunked reference, flash_hopper/bench/check.py), output and LSE, not against another
library's: the shared output buffers are NaN-filled before each library's checked run, so a
library that writes nothing fails instead of reporting the previous library's result. The exit
status is 1 when any check fails. The largest output difference to the first library is reported
too (0 between builds that should be bitwise identical).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from flash_hopper import _lib, _validate, ops
from flash_hopper.bench.cases import Case
from flash_hopper.bench.check import CheckResult, References

# ABI versions whose FhFwdParams has this package's layout: a library of such a version can be
# timed against the current one (ABI 2 changed only fh_fwd_select_backend's signature, ABI 3 added
# the backward's FhBwdParams and functions beside an unchanged FhFwdParams).
SAME_PARAMS_LAYOUT = {1, 2, 3, _lib.ABI_VERSION}


class BaselineLibrary:
    """fh_fwd of a library built before an ABI bump that kept FhFwdParams' layout (e.g. the tree
    a structural change started from): loaded with plain ctypes, called with this package's struct
    carrying the library's own abi_version."""

    def __init__(self, path: Path, abi_version: int):
        self.path = path
        self._dll = ctypes.CDLL(str(path))
        self._dll.fh_fwd.argtypes = [ctypes.POINTER(_lib.FhFwdParams), ctypes.c_void_p]
        self._dll.fh_fwd.restype = ctypes.c_int
        self._dll.fh_last_error.restype = ctypes.c_char_p
        self._dll.fh_build_info.restype = ctypes.c_char_p
        self.abi_version = abi_version

    def fwd(self, params, stream) -> None:
        own = _lib.FhFwdParams.from_buffer_copy(params)
        own.abi_version = self.abi_version
        status = self._dll.fh_fwd(ctypes.byref(own), stream)
        if status != 0:
            raise RuntimeError(f"{self.path}: fh_fwd: {self._dll.fh_last_error().decode()}")

    def build_info(self) -> dict:
        return json.loads(self._dll.fh_build_info().decode())


def load(path: Path):
    """The library at ``path``: a full Library when it has this package's ABI, else a
    BaselineLibrary when its parameter struct has the same layout."""
    abi = int(ctypes.CDLL(str(path)).fh_abi_version())
    if abi == _lib.ABI_VERSION:
        return _lib.Library(path)
    if abi in SAME_PARAMS_LAYOUT:
        return BaselineLibrary(path, abi)
    raise SystemExit(f"{path}: C ABI {abi} has another FhFwdParams layout than this package's "
                     f"({_lib.ABI_VERSION}); time it with the checkout it was built from")


def time_burst(lib, params, stream, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        lib.fwd(params, stream)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def check_libraries(runs: dict[str, Callable[[], None]], out: torch.Tensor, lse: torch.Tensor,
                    references: References) -> tuple[dict[str, CheckResult],
                                                     dict[str, torch.Tensor]]:
    """Run each library once into the shared ``out`` / ``lse`` (NaN-filled first) and check it:
    (check result, copy of its output) per library name."""
    results, outputs = {}, {}
    for name, run in runs.items():
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        run()
        results[name] = references.check(out, lse)
        outputs[name] = out.clone()
    return results, outputs


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
        libs[name] = load(Path(path))
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
                case = Case(batch=b, seqlen_q=s, seqlen_k=s, heads=h, heads_kv=h, head_dim=d,
                            causal=causal)
                references = References(q, k, v, case)
                checks, outs = check_libraries(
                    {n: functools.partial(lib.fwd, params, stream) for n, lib in libs.items()},
                    out, lse, references)
                del references
                diff = {n: (outs[n].float() - outs[names[0]].float()).abs().max().item()
                        for n in names}
                del outs
                for lib in libs.values():
                    for _ in range(3):  # warm-up
                        lib.fwd(params, stream)
                once = time_burst(libs[names[0]], params, stream, 1)
                iters = max(2, int(args.burst_ms / max(once, 1e-3)))
                times = {n: [] for n in names}
                for r in range(args.rounds):
                    for n in names[r % len(names):] + names[:r % len(names)]:
                        times[n].append(time_burst(libs[n], params, stream, iters))
                flops = case.flops()
                med = {n: statistics.median(times[n]) for n in names}
                row = {"head_dim": d, "seqlen": s, "causal": causal, "batch": b, "heads": h,
                       "iters": iters, "rounds": args.rounds,
                       "tflops": {n: flops / med[n] / 1e9 for n in names},
                       "spread": {n: (max(times[n]) - min(times[n])) / med[n] for n in names},
                       "check": {n: vars(checks[n]) for n in names},
                       "max_abs_diff_vs_first": diff}
                rows.append(row)
                base = row["tflops"][names[0]]
                print(f"d{d:<4}{'c' if causal else 'n'} s{s:<6}" + " ".join(
                    f"{n}={row['tflops'][n]:5.0f} ({row['tflops'][n] / base - 1:+5.1%})"
                    + ("" if checks[n].passed else " CHECK FAILED") for n in names), flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(0),
            "libs": {n: {"path": str(libs[n].path), "build_info": libs[n].build_info()}
                     for n in names},
            "rows": rows}, indent=1))
    failed = [(r["head_dim"], r["seqlen"], r["causal"], n) for r in rows
              for n, c in r["check"].items() if not c["passed"]]
    for d, s, causal, name in failed:
        print(f"check failed: {name} d{d} s{s} causal={causal}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
