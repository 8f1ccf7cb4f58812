"""Interleaved A/B timing of several builds of the library in one process (fa3 path).

    python bench/ab_libs.py --lib base=build/a/libflash_hopper.so --lib new=build/b/... \\
        -d 128 -s 512 1024 8192 --causal both --rounds 7 --json ab.json
    python bench/ab_libs.py --direction bwd --lib ... -d 64 128 -s 2048 16384
    python bench/ab_libs.py --dtype e4m3 --softcap 0 30 --lib ... -d 64 128 256

--dtype e4m3 (forward): q, k, v drawn as for bf16, quantized per head (the CLI's FP8 inputs,
flash_hopper/bench/fp8_inputs.py), descales passed, the output in bf16, checked by the CLI's FP8
rule (Fp8References). --softcap: each value a config of its own (0 = off).

--direction bwd times each library's fh_bwd (libraries of this package's C ABI only) on one
forward's out / lse (this package's library computes them), TFLOP/s = 2.5x the forward's FLOPs;
every library's dq, dk, dv are checked against the chunked fp32 backward reference (the
benchmark's gradient rule) in NaN-filled shared buffers.

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

--peer NAME (forward, repeatable): a benchmark backend of the CLI (`flash-attn3` = FA3's own
forward from fa3-fwd / flash_attn_3, `flash-attn-cute` = FA4, `sdpa-cudnn` ...) timed in the same
rotation on the same inputs (e4m3: the same quantized tensors and descales), its output and LSE
checked by the same rule. A peer that cannot run a config gets no entry in that row; the rotation
carries on with the rest.
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
from flash_hopper import _abi, _bwd, _fwd, _lib, _validate, ops
from flash_hopper._tables import FA3_VARIANT_NAMES
from flash_hopper.bench.cases import Case
from flash_hopper.bench.check import (
    CheckResult,
    Fp8References,
    GradCheckResult,
    GradReferences,
    References,
)
from flash_hopper.bench.fp8_inputs import quantize_inputs
from flash_hopper.bench.registry import canonical_name, known_backends

# ABI versions whose FhFwdParams has this package's layout: a library of such a version can be
# timed against the current one (ABI 2 changed only fh_fwd_select_backend's signature, ABI 3 added
# the backward's FhBwdParams and functions beside an unchanged FhFwdParams; ABI 12 changed only
# FhDecodeParams, so 11 keeps this layout).
SAME_PARAMS_LAYOUT = {1, 2, 3, 9, 11, _lib.ABI_VERSION}


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


def time_burst(run: Callable[[], None], iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
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


def check_libraries_bwd(runs: dict[str, Callable[[], None]],
                        grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                        references: GradReferences) -> tuple[dict[str, GradCheckResult],
                                                             dict[str, list[torch.Tensor]]]:
    """Run each library's backward once into the shared ``grads`` (dq, dk, dv; NaN-filled first)
    and check them: (check result, copies of its gradients) per library name."""
    results, outputs = {}, {}
    for name, run in runs.items():
        for g in grads:
            g.fill_(float("nan"))
        run()
        results[name] = references.check(grads)
        outputs[name] = [g.clone() for g in grads]
    return results, outputs


def bwd_setup(libs: dict, q, k, v, causal: bool, backend: str, sms: int,
              deterministic: frozenset = frozenset()):
    """(runs, grads, references) of one backward config: each library's fh_bwd on the same
    FhBwdParams (this package's plan, pointers filled; deterministic=1 for the names in
    `deterministic`), the shared gradient buffers, the fp32 references."""
    for name, lib in libs.items():
        if not isinstance(lib, _lib.Library):
            raise SystemExit(f"{name}: --direction bwd needs libraries of C ABI "
                             f"{_lib.ABI_VERSION} (FhBwdParams)")
    dout = torch.randn_like(q)
    right = 0 if causal else -1
    out, lse = flash_hopper_forward(q, k, v, causal)
    scale = q.shape[-1] ** -0.5
    cfg = _validate.check_bwd_args(dout, q, k, v, out, lse, None, scale, -1, right, 0.0, backend,
                                   False)
    grads = tuple(torch.empty_like(t) for t in (q, k, v))
    plan = _bwd.make_plan(cfg, dout, q, k, v, out, lse, None, grads=grads, num_sms=sms)
    per_lib = {}
    for n in libs:
        per_lib[n] = _lib.FhBwdParams.from_buffer_copy(plan.template)
        per_lib[n].deterministic = int(n in deterministic)
    workspace = torch.empty(max(lib.bwd_workspace_size(per_lib[n]) for n, lib in libs.items()),
                            dtype=torch.uint8, device=q.device)
    for params in per_lib.values():
        params.q, params.k, params.v = q.data_ptr(), k.data_ptr(), v.data_ptr()
        params.o, params.lse, params.dout, params.dlse = (out.data_ptr(), lse.data_ptr(),
                                                          dout.data_ptr(), 0)
        params.dq, params.dk, params.dv = (g.data_ptr() for g in grads)
        params.workspace, params.workspace_bytes = workspace.data_ptr(), workspace.numel()
    stream = torch.cuda.current_stream().cuda_stream
    runs = {n: functools.partial(lib.bwd, per_lib[n], stream) for n, lib in libs.items()}
    case = Case(batch=q.shape[0], seqlen_q=q.shape[1], seqlen_k=k.shape[1], heads=q.shape[2],
                heads_kv=k.shape[2], head_dim=q.shape[3], causal=causal)
    references = GradReferences(q, k, v, dout, case, References(q, k, v, case))
    keep = (dout, out, lse, workspace)  # the params point into these
    return runs, grads, references, keep


def fwd_setup(q, k, v, case: Case, backend: str, sms: int):
    """(params, out, lse, references, keep) of one forward config: FhFwdParams of this package's
    plan with every pointer filled (e4m3: the quantized inputs and their descales, out in bf16),
    the shared output buffers, the references of the CLI's rule for the dtype."""
    b, s, h, d = q.shape
    window = (-1, -1)  # causal through case.causal
    out = torch.empty(b, s, h, d, device=q.device, dtype=torch.bfloat16)
    lse = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
    if case.dtype == "e4m3":
        q8, k8, v8 = quantize_inputs(q, k, v)
        plan = _fwd.plan_fp8(q8.data, k8.data, v8.data, None, case.causal, window, case.softcap,
                             backend, q8.descale, k8.descale, v8.descale)
        params = _lib.FhFwdParams.from_buffer_copy(plan.template)
        params.q, params.k, params.v = (t.data.data_ptr() for t in (q8, k8, v8))
        params.q_descale, params.k_descale, params.v_descale = (
            t.descale.data_ptr() for t in (q8, k8, v8))
        references = Fp8References(q8, k8, v8, case)
        keep = (q8, k8, v8)
    else:
        cfg = _validate.check_fwd_args(q, k, v, None, case.causal, window, case.softcap, backend)
        params = ops.make_params(q, k, v, out, lse, cfg, backend, num_sms=sms)
        references = References(q, k, v, case)
        keep = ()
    params.o, params.lse = out.data_ptr(), lse.data_ptr()
    # A dense call's optional workspace: the tile counter masked calls claim their tiles from
    # (api.h); a library without claims ignores it. `@static-walk` runs without it.
    workspace = torch.empty(16, dtype=torch.uint8, device=q.device)
    params.workspace, params.workspace_bytes = workspace.data_ptr(), workspace.numel()
    return params, out, lse, references, keep + (workspace,)


def peer_runs(peers: dict, q, k, v, case: Case, keep, out: torch.Tensor, lse: torch.Tensor,
              references) -> tuple[dict[str, Callable[[], None]], dict[str, CheckResult],
                                   dict[str, torch.Tensor], dict[str, str]]:
    """For each peer backend that runs the config: a timed call (its own output, as in the CLI),
    its check against the config's references, a copy of its output; and why the others don't."""
    if case.dtype == "e4m3":
        q, k, v = keep[:3]  # the Fp8Input each (data, descale) the libraries run
    runs, checks, outs, skipped = {}, {}, {}, {}
    for name, backend in peers.items():
        reason = backend.software_reason() or backend.unsupported(case, "fwd")
        if reason is None and case.dtype == "e4m3":
            reason = backend.fp8_reason()
        if reason:
            skipped[name] = reason
            continue
        result, peer_lse = backend.run_checked(q, k, v, case)
        if peer_lse is not None and peer_lse.shape != lse.shape:
            peer_lse = None
        checks[name] = references.check(result, peer_lse)
        outs[name] = result.clone()
        runs[name] = backend.make_forward(q, k, v, case)
    return runs, checks, outs, skipped


FP8_SINGLE_LEVEL = "fp8-single-level"  # @fp8-single-level: the FP8 accumulation ablation
STATIC_WALK = "static-walk"  # @static-walk: no tile counter (the forward's static tile order)
DETERMINISTIC = "deterministic"  # @deterministic (backward): the call's deterministic=True


def with_variant(params, variant):
    """params, or a copy of them that runs the FA-3 variant `variant` (or the FP8 single-level
    ablation; None: params itself)."""
    if variant is None:
        return params
    copy = type(params).from_buffer_copy(params)
    if variant == FP8_SINGLE_LEVEL:
        copy.fp8_accumulation = _abi.FhFp8Accumulation.SINGLE_LEVEL
    elif variant == STATIC_WALK:
        copy.workspace, copy.workspace_bytes = None, 0
    else:
        copy.variant = variant
    return copy


def flash_hopper_forward(q, k, v, causal: bool):
    from flash_hopper import flash_attn_func

    return flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", action="append", required=True, metavar="NAME=PATH[@VARIANT]",
                    help="a library to compare (the first is the baseline); repeat. @VARIANT "
                         "(forward): run this entry as that FA-3 variant ('fa3-no-pingpong', "
                         "...), with the FP8 single-level accumulation ('fp8-single-level', "
                         "the ablation; the library's kernel decides what that runs) or without "
                         "the tile counter ('static-walk'), so one library's variants are timed "
                         "side by side; backward: 'deterministic' (the call's deterministic=True)")
    ap.add_argument("-d", "--head-dim", type=int, nargs="+", default=[128])
    ap.add_argument("-s", "--seqlen", type=int, nargs="+",
                    default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=["both", "on", "off"], default="both")
    ap.add_argument("--direction", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--dtype", choices=["bf16", "e4m3"], default="bf16",
                    help="e4m3: the FP8 forward (descales per head, out bf16)")
    ap.add_argument("--softcap", type=float, nargs="+", default=[0.0],
                    help="softcap values, each a config (forward; 0 = off)")
    ap.add_argument("--backend", default="fa3", help="the path every library runs (default fa3)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--burst-ms", type=float, default=25.0)
    ap.add_argument("--peer", action="append", default=[], metavar="NAME",
                    help="a benchmark backend (flash-attn3, flash-attn-cute, sdpa-cudnn ...) "
                         "timed in the same rotation (forward); repeat")
    ap.add_argument("--json", type=Path, help="write every row here")
    args = ap.parse_args()

    known = known_backends(include_variants=False)
    peers = {}
    for raw in args.peer:
        name = canonical_name(raw)
        if name not in known or args.direction != "fwd":
            raise SystemExit(f"--peer {raw}: expected a forward benchmark backend of "
                             f"{sorted(known)}, got {raw!r}"
                             + (" (the backward times libraries only)"
                                if args.direction != "fwd" else ""))
        peers[name] = known[name]
    choices = {**{n: int(v) for n, v in FA3_VARIANT_NAMES.items()},
               FP8_SINGLE_LEVEL: FP8_SINGLE_LEVEL, STATIC_WALK: STATIC_WALK}
    libs, variants = {}, {}
    for spec in args.lib:
        name, _, rest = spec.partition("=")
        path, _, variant = rest.partition("@")
        if variant and args.direction == "bwd":
            if variant != DETERMINISTIC:
                raise SystemExit(f"--lib {spec}: expected the backward variant "
                                 f"{DETERMINISTIC!r}, got {variant!r}")
            variants[name] = DETERMINISTIC
        elif variant:
            if variant not in choices:
                raise SystemExit(f"--lib {spec}: expected a forward variant of {sorted(choices)}, "
                                 f"got {variant!r}")
            variants[name] = choices[variant]
        libs[name] = load(Path(path))
    names = list(libs)
    causals = {"both": [False, True], "on": [True], "off": [False]}[args.causal]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = torch.cuda.current_stream().cuda_stream
    if args.direction == "bwd" and (args.dtype != "bf16" or args.softcap != [0.0]):
        raise SystemExit("--direction bwd times bf16 without softcap only")
    rows = []
    configs = [(d, s, causal, softcap) for d in args.head_dim for s in args.seqlen
               for causal in causals for softcap in args.softcap]
    for d, s, causal, softcap in configs:
        b, h = max(16384 // s, 1), 2048 // d
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        case = Case(batch=b, seqlen_q=s, seqlen_k=s, heads=h, heads_kv=h, head_dim=d,
                    causal=causal, softcap=softcap, dtype=args.dtype)
        if args.direction == "fwd":
            params, out, lse, references, _alive = fwd_setup(q, k, v, case,
                                                             args.backend, sms)
            runs = {n: functools.partial(lib.fwd, with_variant(params, variants.get(n)), stream)
                    for n, lib in libs.items()}
            checks, outs = check_libraries(runs, out, lse, references)
            p_runs, p_checks, p_outs, skipped = peer_runs(peers, q, k, v, case, _alive, out, lse,
                                                          references)
            runs.update(p_runs)
            checks.update(p_checks)
            outs.update(p_outs)
            for n, why in skipped.items():
                print(f"{n}: skipped d{d} s{s} causal={causal}: {why}", flush=True)
            diff = {n: (outs[n].float() - outs[names[0]].float()).abs().max().item()
                    for n in runs}
        else:
            # _alive: the tensors the params point into, kept until the next config
            det = frozenset(n for n, v in variants.items() if v == DETERMINISTIC)
            runs, grads, references, _alive = bwd_setup(libs, q, k, v, causal,
                                                        args.backend, sms, det)
            checks, outs = check_libraries_bwd(runs, grads, references)
            diff = {n: max((a.float() - b0.float()).abs().max().item()
                           for a, b0 in zip(outs[n], outs[names[0]])) for n in names}
        del references, outs
        for run in runs.values():
            for _ in range(3):  # warm-up
                run()
        once = time_burst(runs[names[0]], 1)
        iters = max(2, int(args.burst_ms / max(once, 1e-3)))
        order = list(runs)  # the libraries, then the peers that run this config
        times = {n: [] for n in order}
        for r in range(args.rounds):
            for n in order[r % len(order):] + order[:r % len(order)]:
                times[n].append(time_burst(runs[n], iters))
        flops = case.flops() * (2.5 if args.direction == "bwd" else 1.0)
        med = {n: statistics.median(times[n]) for n in order}
        row = {"direction": args.direction, "backend": args.backend, "dtype": args.dtype,
               "softcap": softcap,
               "head_dim": d, "seqlen": s, "causal": causal, "batch": b, "heads": h,
               "iters": iters, "rounds": args.rounds,
               "tflops": {n: flops / med[n] / 1e9 for n in order},
               "spread": {n: (max(times[n]) - min(times[n])) / med[n] for n in order},
               "check": {n: vars(checks[n]) for n in order},
               "max_abs_diff_vs_first": diff}
        rows.append(row)
        base = row["tflops"][names[0]]
        print(f"{args.dtype} d{d:<4}{'c' if causal else 'n'} s{s:<6}"
              + (f"cap{softcap:g} " if softcap else "") + " ".join(
            f"{n}={row['tflops'][n]:5.0f} ({row['tflops'][n] / base - 1:+5.1%})"
            + ("" if checks[n].passed else " CHECK FAILED") for n in order), flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "gpu": torch.cuda.get_device_name(0),
            "libs": {n: {"path": str(libs[n].path), "build_info": libs[n].build_info()}
                     for n in names},
            "peers": {n: {"label": p.label, "version": p.version()} for n, p in peers.items()},
            "rows": rows}, indent=1))
    failed = [(r["head_dim"], r["seqlen"], r["causal"], n) for r in rows
              for n, c in r["check"].items() if not c["passed"]]
    for d, s, causal, name in failed:
        print(f"check failed: {name} d{d} s{s} causal={causal}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
