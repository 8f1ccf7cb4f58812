"""The `flash-hopper` command: bench, decode, info, demo, plot.

Argument parsing and orchestration only; the work lives in flash_hopper.bench. Heavy imports
(torch, matplotlib, the kernel library) happen inside the commands, so `--help` is instant and
`info` works on a machine where some of them are missing. Expected failures (no GPU, no library,
bad arguments) print one line and exit non-zero; only bugs give a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
from collections.abc import Sequence

from .bench import cases as sweep
from .bench.registry import DEFAULT_BACKENDS

PROG = "flash-hopper"
# --varlen given bare: "128,8k".
VARLEN_DEFAULT = ",".join(map(sweep.short_count, sweep.DEFAULT_VARLEN))
EXIT_FAILURE = 1  # a check failed, a row errored, or the command cannot run here
EXIT_USAGE = 2  # argparse's own code for bad arguments


class CliError(Exception):
    """A one-line reason the command cannot run; printed without a traceback."""


# ---- parser ---------------------------------------------------------------------------------

def _add_sweep_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sweep (lists take spaces or commas: -s 512 1k 2k, -d 64,128)")
    g.add_argument("-d", "--head-dim", nargs="+", default=None, metavar="D",
                   help="head dims (default: 64 128 256)")
    g.add_argument("-s", "--seqlen", nargs="+", default=None, metavar="S",
                   help="query sequence lengths, k suffix = x1024 (default: 512 1k 2k 4k 8k 16k)")
    g.add_argument("--seqlen-k", nargs="+", default=None, metavar="S",
                   help="key lengths, crossed with --seqlen (default: = seqlen_q); causal is "
                        "bottom-right aligned when they differ")
    g.add_argument("-b", "--batch", type=int, default=None,
                   help="batch size (default: total tokens // max(seqlen_q, seqlen_k))")
    g.add_argument("--total-tokens", default="16k", metavar="N",
                   help="b*s when --batch is not given, and the tokens of a --varlen batch "
                        "(default: 16k)")
    g.add_argument("--varlen", nargs="?", const=VARLEN_DEFAULT, default=None,
                   metavar="MIN,MAX",
                   help="instead of the seqlen sweep, one realistic mixed batch: sequence "
                        "lengths drawn uniformly from MIN..MAX (default when given bare: "
                        f"{VARLEN_DEFAULT}; seeded by --seed) until --total-tokens, "
                        "the last cut to fit; packed self-attention, timed through fa3 / fa2's "
                        "flash_attn_varlen_func, SDPA on jagged nested tensors and FA packages' "
                        "flash_attn_varlen_func; bf16 / fp16 only; backward rows are skipped; "
                        "not with --seqlen, --seqlen-k or --batch")
    g.add_argument("--heads", type=int, default=None,
                   help="query heads (default: hidden // head_dim)")
    g.add_argument("--hidden", type=int, default=sweep.DEFAULT_HIDDEN,
                   help="h*d when --heads is not given (default: 2048)")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--kv-heads", type=int, default=None,
                    help="key/value heads for GQA/MQA (default: = heads)")
    kv.add_argument("--gqa-ratio", type=int, default=1,
                    help="heads // kv-heads, applied per head dim (default: 1)")
    g.add_argument("--causal", choices=("both", "on", "off"), default="both",
                   help="masking (default: both)")
    g.add_argument("--window", nargs="+", default=None, metavar="L,R",
                   help="sliding windows LEFT,RIGHT (-1 = unbounded); each is a sweep point")
    g.add_argument("--softcap", nargs="+", type=float, default=None, metavar="C",
                   help="tanh soft-capping values (default: 0 = off)")
    g.add_argument("--dtype", nargs="+", type=_dtype, choices=sweep.DTYPES, default=None,
                   help="input dtypes (default: bf16). e4m3 = FP8 inference, forward only: "
                        "inputs drawn as for bf16, quantized per head with "
                        "flash_hopper.fp8.quantize, passed with their descales; bf16 output; "
                        "runs on fa3, its variants and fa3-fp8-single-level, other backends are "
                        "skipped as unsupported (no FP8); %%peak and %%gemm use FP8 ceilings. "
                        f"{' / '.join(sweep.MIXED_DTYPES)} = the mixed mode, forward only: "
                        "16-bit q against a K / V cache quantized per kv head into e4m3 / e5m2, "
                        "passed with k/v descales; output in q's dtype; runs on fa3 only, other "
                        "backends are skipped as unsupported (no mixed mode); FLOPs, %%peak and "
                        "%%gemm as for q's dtype. '--dtype bf16 bf16+e4m3' times both and "
                        "compares them")
    g.add_argument("--direction", nargs="+", choices=("fwd", "bwd", "fwd+bwd"), default=None,
                   help="what to time (default: fwd); bwd = 2.5x fwd FLOPs; e4m3 and the mixed "
                        "dtypes take fwd only")


def _add_backend_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("backends")
    g.add_argument("--backends", nargs="+", default=None, metavar="NAME",
                   help="fa3, fa2, fa3 variants the build reports, fa3-fp8-single-level (e4m3 "
                        "only: fa3 with fp8_accumulation='single-level', the FP8 accumulation "
                        "ablation), sdpa-flash, sdpa-cudnn, "
                        "sdpa-efficient, sdpa-math (small sizes), flex, flash-attn "
                        "(flash_attn), flash-attn3 (flash_attn_interface / flash_attn_3; takes "
                        "e4m3 when its flash_attn_func has q/k/v_descale, never a mixed dtype), "
                        "flash-attn-cute (flash_attn.cute), flashinfer (flashinfer-python: "
                        "its ragged prefill, JIT-compiled on first use; no backward, no FP8), "
                        "or all "
                        f"(default: {' '.join(DEFAULT_BACKENDS)}); unavailable ones are "
                        "skipped with the reason")
    g.add_argument("--list-backends", action="store_true",
                   help="print every backend with its availability here, then exit")


def _add_measure_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("measurement")
    g.add_argument("--warmup", type=int, default=10, help="untimed calls first (default: 10)")
    g.add_argument("--repeats", type=int, default=30,
                   help="timed calls; median and p20/p80 are reported (default: 30)")
    g.add_argument("--timer", choices=("events", "do_bench"), default="events",
                   help="CUDA events per call, or triton.testing.do_bench (time-based, flushes "
                        "L2 itself; ignores --warmup/--repeats) (default: events)")
    g.add_argument("--flush-l2", action="store_true",
                   help="zero a buffer larger than L2 before every timed call")
    g.add_argument("--cuda-graph", action="store_true",
                   help="time CUDA-graph replays (hides CPU launch overhead)")
    g.add_argument("--no-rotate", action="store_true",
                   help="do not cycle through several input sets when one fits in L2")
    g.add_argument("--check", choices=("on", "off"), default="on",
                   help="reference check of each backend's output (and LSE where it returns one) "
                        "and, for backward rows, of its dq, dk, dv, on the timed configuration, "
                        "once per configuration, against fp32 references computed on the GPU "
                        "in chunks of query rows; e4m3 rows against fp32 on the dequantized "
                        "inputs, by relative RMS error; mixed rows against fp32 on q and the "
                        "dequantized k, v, by the 16-bit rule (default: on)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="dense peak for %%peak, for every dtype of the sweep (default: datasheet "
                        "value by GPU name: bf16/fp16, or FP8 for e4m3; q's dtype's for the "
                        "mixed dtypes)")
    g.add_argument("--gemm-size", type=int, default=8192,
                   help="N of the NxNxN matmul measured once per GEMM dtype as the GEMM ceiling "
                        "(torch.mm; torch._scaled_mm for e4m3; q's dtype's torch.mm for the "
                        "mixed dtypes) (default: 8192)")
    g.add_argument("--no-gemm", action="store_true", help="skip the GEMM ceiling measurement")
    g.add_argument("--seed", type=int, default=0, help="input RNG seed (default: 0)")


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="write results and metadata as JSON")
    g.add_argument("--csv", metavar="FILE", help="write results as CSV (metadata in a comment)")
    g.add_argument("--plot", metavar="FILE.png", help="grouped-bar figure like FA3's Figure 5")
    g.add_argument("--out-dir", metavar="DIR",
                   help="write JSON, CSV and PNG there with a timestamped name "
                        "(e.g. bench/results)")
    g.add_argument("--replot", metavar="RESULTS",
                   help="no benchmark: re-plot a saved .json/.csv to --plot or --out-dir")
    g.add_argument("--dry-run", action="store_true",
                   help="print the planned configurations and exit")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    g.add_argument("--no-hostname", action="store_true",
                   help="leave the hostname out of saved metadata")


def _capability(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        message = f"expected MAJOR.MINOR such as 9.0, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def _dtype(text: str) -> str:
    """--dtype's name ("bf16", "bf16+e4m3") from any spelling flash_hopper.supports takes:
    "bfloat16", "torch.bfloat16", "float8_e4m3fn", "bfloat16+float8_e5m2"."""
    from flash_hopper._tables import canonical_dtype

    try:
        return canonical_dtype(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).partition(": ")[2]) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="flash-hopper: FlashAttention-3-class attention kernels.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="{bench,decode,info,demo,plot}")

    bench = sub.add_parser(
        "bench", help="benchmark the FA-3/FA-2 paths against SDPA and installed peers",
        description="Time attention backends over a sweep and check them against an fp32 "
                    "reference. Defaults reproduce the FA3 paper's forward sweep: bf16, "
                    "b*s = 16k, h*d = 2048, s = 512..16k, d = 64/128/256, causal and not.",
        epilog="FLOPs: fwd = 4*b*h*d*(visible pairs), pairs = s^2/2 for plain causal (FA "
               "convention) and counted exactly otherwise; bwd = 2.5x fwd. The reference check "
               "compares each backend's forward on the timed inputs at full size, and for bwd / "
               "fwd+bwd rows its dq, dk, dv too (one backward with a fixed dout); those rows "
               "also report the backward's memory (bwd_workspace_bytes, bwd_extra_bytes). "
               "e4m3 (FP8) rows: same FLOPs as bf16; checked against an fp32 reference on the "
               "dequantized inputs (fp8 values * descale), pass when the relative RMS error "
               "<= 5% and the LSE is within 2e-3 (check_metric rel-rmse). Mixed-mode rows "
               "(bf16+e4m3, fp16+e4m3, bf16+e5m2, fp16+e5m2: 16-bit q, FP8 K / V): q's dtype's "
               "FLOPs and ceilings, K / V 1 byte per element; checked by the 16-bit rule "
               "against fp32 on q and the dequantized k, v; next to rows of q's dtype in the "
               "same sweep, a comparison of the two is printed. Exit "
               "status 1 when a check fails or a row errors.")
    _add_sweep_args(bench)
    _add_backend_args(bench)
    _add_measure_args(bench)
    _add_output_args(bench)

    decode = sub.add_parser(
        "decode", help="decode against a KV cache: K/V bandwidth vs SDPA cuDNN",
        description="Times one decode step (seqlen_q new tokens per sequence against a full "
                    "cache of CONTEXT keys, causal bottom-right, GQA) as CUDA-graph replays; "
                    "bandwidth = bytes of the K and V cache read / time. Each backend's output "
                    "is checked against a float32 reference on the first sequences. Exit status "
                    "1 when a check fails or a flash-hopper row errors; a backend that does not "
                    "take the row's inputs is recorded as skipped, with the reason.",
        epilog="FP8 caches: --dtype e4m3 is FA3's convention (q, K and V e4m3 with q / k / v "
               "descales, output bf16); bf16+e4m3, fp16+e4m3, bf16+e5m2, fp16+e5m2 the mixed "
               "mode (16-bit q, FP8 K / V with k / v descales, output in q's dtype). The cache "
               "is quantized per (batch, KV head) as the bench's FP8 inputs are; the check is "
               "against fp32 attention on the dequantized values (e4m3: relative RMS error <= "
               "5%; mixed: the 16-bit rule); bytes counted = the FP8 cache, 1 byte per element "
               "(rows record it: kv_dtype, bytes_counted). Peers without an FP8 path are "
               "skipped with the reason, never run on a dequantized 16-bit copy: sdpa-cudnn and "
               "the flash-attn-cute ones for every FP8 dtype, flash-attn3 for the mixed mode, "
               "flashinfer-paged for e4m3 queries and for caches whose descales differ per "
               "(batch, KV head) (FlashInfer takes one k / v scale per call).")
    decode.add_argument("--points", nargs="+", metavar="BxC",
                        help="batch x context points, k suffix = x1024 (default: "
                             "1x8k 1x128k 8x32k 32x32k 128x16k 64x1k)")
    decode.add_argument("--heads", default="32/8", metavar="Q/KV",
                        help="query / KV heads (default: 32/8)")
    decode.add_argument("-d", "--head-dim", type=int, default=128)
    decode.add_argument("--seqlen-q", "--q-len", type=int, default=1, dest="seqlen_q",
                        metavar="N",
                        help="new query tokens per sequence (default: 1; 2..8: speculative "
                             "decoding, query i of N sees keys up to CONTEXT - N + i; "
                             "sdpa-cudnn and flashinfer-paged are skipped above 1)")
    decode.add_argument("--dtype", choices=sweep.DTYPES, default="bf16",
                        help="q and cache dtype: bf16, fp16, e4m3 (FP8), or Q+KV for 16-bit q "
                             "against an FP8 cache (default: bf16)")
    decode.add_argument("--page-size", type=int, default=None, metavar="P",
                        help="also time the cache as shuffled P-token pages with a page table "
                             "(backend flash-hopper-paged; the paged peers need it)")
    decode.add_argument("--backends", nargs="+", metavar="NAME",
                        help="some of flash-hopper, flash-hopper-dense, sdpa-cudnn, "
                             "flash-hopper-paged (default: the first three, and the paged one "
                             "with --page-size); peers: flash-attn3 (FA3's "
                             "flash_attn_with_kvcache, e.g. the fa3-fwd wheel), flash-attn3-paged, "
                             "flash-attn-cute, flash-attn-cute-paged (FA4), flashinfer-paged "
                             "(FlashInfer's BatchDecodeWithPagedKVCacheWrapper; also spelled "
                             "flashinfer, flashinfer-python)")
    decode.add_argument("--json", metavar="FILE", help="write every row")
    decode.add_argument("--csv", metavar="FILE", help="write every row")
    decode.add_argument("--plot", metavar="PNG", help="grouped bars of TB/s")

    info = sub.add_parser("info", help="GPU, driver, built kernels, and the path a call takes",
                          description="Works without a GPU (exit 0).")
    info.add_argument("-d", "--head-dim", type=int, default=128)
    info.add_argument("--dtype", type=_dtype, choices=sweep.HALF_DTYPES, default="bf16")
    info.add_argument("--backend", choices=("auto", "fa2", "fa3"), default="auto")
    info.add_argument("--causal", action="store_true")
    info.add_argument("--capability", metavar="MAJOR.MINOR", type=_capability,
                      help="show the path for a hypothetical GPU (e.g. 9.0) instead of this one")
    info.add_argument("--json", action="store_true", help="machine-readable output")

    demo = sub.add_parser("demo", help="one flash_attn_func call: path, error vs fp32, time")
    demo.add_argument("-b", "--batch", type=int, default=2)
    demo.add_argument("-s", "--seqlen", type=sweep.parse_count, default=1024)
    demo.add_argument("--heads", type=int, default=16)
    demo.add_argument("-d", "--head-dim", type=int, default=128)
    demo.add_argument("--dtype", type=_dtype, choices=sweep.HALF_DTYPES, default="bf16")
    demo.add_argument("--causal", action="store_true")
    demo.add_argument("--backend", choices=("auto", "fa2", "fa3"), default="auto")

    plot = sub.add_parser("plot", help="plot a saved bench result (.json or .csv)")
    plot.add_argument("results", help="a file written by bench --json/--csv/--out-dir")
    plot.add_argument("-o", "--output", help="PNG to write (default: RESULTS with .png)")
    return parser


# ---- bench ----------------------------------------------------------------------------------

def sweep_spec(args: argparse.Namespace) -> sweep.SweepSpec:
    """SweepSpec from parsed bench arguments; ValueError names the bad value."""
    spec = sweep.SweepSpec()
    if args.head_dim:
        spec.head_dims = [int(sweep.parse_count(d)) for d in sweep.split_list(args.head_dim)]
    if args.seqlen:
        spec.seqlens = [sweep.parse_count(s) for s in sweep.split_list(args.seqlen)]
    if args.seqlen_k:
        spec.seqlens_k = [sweep.parse_count(s) for s in sweep.split_list(args.seqlen_k)]
    spec.batch = args.batch
    spec.total_tokens = sweep.parse_count(args.total_tokens)
    spec.heads = args.heads
    spec.hidden = args.hidden
    spec.kv_heads = args.kv_heads
    spec.gqa_ratio = args.gqa_ratio
    spec.causal = args.causal
    if args.window:
        spec.windows = [sweep.parse_window(w) for w in args.window]
    if args.softcap:
        spec.softcaps = list(args.softcap)
    if args.dtype:
        spec.dtypes = list(dict.fromkeys(args.dtype))
    for name in ("batch", "heads", "kv_heads"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.gqa_ratio <= 0:
        raise ValueError(f"--gqa-ratio must be positive, got {args.gqa_ratio}")
    spec.seed = args.seed
    if args.varlen is not None:
        spec.varlen = varlen_bounds(args, spec)
    return spec


def varlen_bounds(args: argparse.Namespace, spec: sweep.SweepSpec) -> tuple[int, int]:
    """--varlen's (MIN, MAX), after the options it excludes and the dtypes it takes;
    ValueError names the option."""
    for option, value in (("--seqlen", args.seqlen), ("--seqlen-k", args.seqlen_k),
                          ("--batch", args.batch)):
        if value is not None:
            raise ValueError(f"argument --varlen: not allowed with argument {option} (--varlen "
                             f"draws the batch's lengths; --total-tokens sets its tokens)")
    low, high = sweep.parse_varlen(args.varlen)
    if high > spec.total_tokens:
        raise ValueError(f"--varlen MAX ({high}) must be <= --total-tokens "
                         f"({spec.total_tokens})")
    other = [d for d in spec.dtypes if d not in sweep.HALF_DTYPES]
    if other:
        raise ValueError(f"--varlen takes --dtype {' / '.join(sweep.HALF_DTYPES)}: the bench's "
                         f"varlen mode with {' '.join(other)} is not implemented")
    return low, high


def directions(args: argparse.Namespace) -> list[str]:
    return list(dict.fromkeys(args.direction or ["fwd"]))


def check_directions(dtypes, dirs) -> None:
    """FP8 and the mixed mode have no backward: --dtype e4m3 (or a mixed dtype) with --direction
    bwd / fwd+bwd is a usage error (a sweep of skipped rows would hide it). ValueError names both
    options."""
    fp8 = [d for d in dtypes if d in sweep.FP8_DTYPES]
    mixed = [d for d in dtypes if d in sweep.MIXED_DTYPES]
    backward = [d for d in dirs if "bwd" in d]
    if (fp8 or mixed) and backward:
        paths = " and ".join(filter(None, ["the FP8 path" if fp8 else "",
                                           "the mixed mode" if mixed else ""]))
        raise ValueError(f"--dtype {' '.join(fp8 + mixed)} is forward only ({paths} "
                         f"{'have' if fp8 and mixed else 'has'} no backward), but --direction "
                         f"asks for {' '.join(backward)}: use --direction fwd, or time the "
                         f"backward in a separate run with --dtype bf16 / fp16")


def backend_names(args: argparse.Namespace) -> list[str]:
    return sweep.split_list(args.backends) or list(DEFAULT_BACKENDS)


def repro_command(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in [PROG, *argv])


def _print_err(message: str) -> None:
    print(message, file=sys.stderr)


def _replot(args: argparse.Namespace) -> int:
    from .bench import report

    if not (args.plot or args.out_dir):
        raise CliError("--replot needs --plot FILE.png or --out-dir DIR")
    data = _read(args.replot)
    target = args.plot or report.out_dir_paths(args.out_dir, data.get("meta") or {})["png"]
    _write_plot(data, target)
    return 0


def _read(path: str):
    from .bench import report

    try:
        return report.read_results(path)
    except (OSError, ValueError) as exc:  # missing file, not JSON, wrong schema
        raise CliError(f"cannot read {path}: {exc}") from exc


def _write_plot(data, path: str) -> bool:
    from .bench.plot import plot_results

    try:
        counts = plot_results(data, path)
    except ImportError as exc:
        _print_err(f"plot skipped: matplotlib is needed ({exc}); pip install matplotlib")
        return False
    except ValueError as exc:  # nothing was timed
        raise CliError(f"cannot plot: {exc}") from exc
    print(f"wrote {path} ({counts['panels']} panels, {counts['bars']} bars)")
    return True


def _print_plan(cases, names: Sequence[str], dirs: Sequence[str]) -> None:
    print(f"{len(cases)} configurations x {len(dirs)} direction(s) x backends {' '.join(names)}")
    for case in cases:
        print(f"  {case.dtype} d={case.head_dim} s={case.seqlen_label} b={case.batch} "
              f"h={case.heads}/{case.heads_kv} {case.mask_label}  "
              f"fwd {case.flops('fwd') / 1e12:.3f} TFLOP")
    for lengths in dict.fromkeys(c.seqlens for c in cases if c.is_varlen):
        print(f"varlen lengths: {' '.join(map(str, lengths))}")


def _list_backends(names: Sequence[str]) -> int:
    from .bench import env, registry

    gpu, reason = env.detect_gpu()
    capability = gpu.capability if gpu else None
    if gpu is None:
        print(f"(no GPU: {reason})")
    chosen = registry.resolve(names)
    width = max(16, *(len(b.name) for b in chosen))
    for backend in chosen:
        why = backend.probe(capability)
        print(f"{backend.name:{width}s} {'available' if why is None else 'unavailable: ' + why}")
    return 0


def _probe_backends(chosen, capability):
    """Split into runnable backends and {name: status} metadata; print each skip reason."""
    runnable, status = [], {}
    for backend in chosen:
        reason = backend.probe(capability)
        status[backend.name] = {"available": reason is None, "reason": reason,
                                "origin": backend.origin,
                                "version": backend.version() if reason is None else None}
        if reason is None:
            runnable.append(backend)
        else:
            _print_err(f"skipping backend {backend.name}: {reason}")
    return runnable, status


def run_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.replot:
        return _replot(args)
    names = backend_names(args)
    dirs = directions(args)
    try:
        spec = sweep_spec(args)
        check_directions(spec.dtypes, dirs)
        cases = sweep.expand(spec)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    from .bench import registry

    try:
        chosen = registry.resolve(names, dtypes=spec.dtypes)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if args.dry_run:
        _print_plan(cases, [b.name for b in chosen], dirs)
        return 0
    if args.list_backends:
        return _list_backends(names if args.backends else ["all"])

    from .bench import env

    gpu, reason = env.detect_gpu()
    if gpu is None:
        raise CliError(f"bench needs a CUDA GPU: {reason} (`flash-hopper info` works without)")
    if args.repeats < 1 or args.warmup < 0:
        raise CliError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and "
                       f"{args.warmup}")
    if args.timer == "do_bench" and importlib.util.find_spec("triton") is None:
        raise CliError("--timer do_bench needs triton, which is not installed")
    return _bench_on_gpu(args, argv, cases, chosen, dirs, gpu)


def _bench_on_gpu(args, argv, cases, chosen, dirs, gpu) -> int:
    from .bench import env, peak, report
    from .bench.progress import Progress
    from .bench.runner import Runner, RunOptions
    from .bench.timing import Timer, TimerConfig

    runnable, backend_status = _probe_backends(chosen, gpu.capability)
    if not runnable:
        raise CliError("no requested backend can run here (reasons above)")
    timer = Timer(TimerConfig(method=args.timer, warmup=args.warmup, repeats=args.repeats,
                              flush_l2=args.flush_l2, cuda_graph=args.cuda_graph,
                              rotate=not args.no_rotate))
    # Ceilings per dtype of the sweep: an e4m3 row is compared with FP8's, a bf16 row with bf16's,
    # a bf16+e4m3 row with bf16's (its GEMMs are bf16): each GEMM dtype is measured once.
    dtypes = list(dict.fromkeys(case.dtype for case in cases))
    peaks = {}
    for dtype in dtypes:
        peaks[dtype] = ((args.peak_tflops, "--peak-tflops") if args.peak_tflops
                        else peak.lookup_peak(gpu.name, dtype))
        if peaks[dtype][0] is None:
            _print_err(f"note: {peaks[dtype][1]}; %peak left empty for {dtype}")
    measured = {}
    for gemm_dtype in dict.fromkeys(sweep.gemm_dtype(d) for d in dtypes):
        measured[gemm_dtype] = (None if args.no_gemm
                                else _gemm_ceiling(timer, gemm_dtype, args.gemm_size))
    gemms = {dtype: measured[sweep.gemm_dtype(dtype)] for dtype in dtypes}
    options = RunOptions(directions=dirs, check=args.check,
                         peak_tflops={d: p[0] for d, p in peaks.items() if p[0]},
                         gemm_tflops={d: g["tflops"] for d, g in gemms.items() if g},
                         seed=args.seed)
    # Before the sweep: clocks and temperature as the run starts, not after it heated the GPU.
    meta = env.collect(repro_command(argv), include_hostname=not args.no_hostname)
    progress = Progress(len(cases) * len(runnable) * len(dirs), enabled=not args.quiet)
    runner = Runner(runnable, timer, options, progress)
    interrupted = False
    try:
        runner.run(cases)
    except KeyboardInterrupt:  # keep what a long sweep measured so far
        interrupted = True
        _print_err("\ninterrupted: saving the rows measured so far")

    # "peak" and "gemm_ceiling" are the first dtype's (as in files of bf16-only sweeps);
    # the *_by_dtype maps have every dtype's.
    first = dtypes[0]
    meta.update({"backends": backend_status, "timer": timer.describe(), "check": args.check,
                 "peak": {"tflops": peaks[first][0], "source": peaks[first][1]},
                 "gemm_ceiling": gemms[first],
                 "peak_by_dtype": {d: {"tflops": t, "source": src}
                                   for d, (t, src) in peaks.items()},
                 "gemm_ceiling_by_dtype": gemms,
                 "interrupted": interrupted, "options": vars(args)})
    data = report.result_set(meta, runner.rows)
    _print_summary(data["results"], backend_status, report)
    _save(args, data, report)
    if interrupted:
        return 130
    failed = [r for r in data["results"] if r["status"] == "error" or r["check_pass"] is False]
    if failed:
        _print_err(f"{len(failed)} row(s) failed a reference check or errored (see above)")
    return EXIT_FAILURE if failed else 0


def _gemm_ceiling(timer, dtype: str, size: int):
    from .bench import peak

    try:
        gemm = peak.measure_gemm_ceiling(timer, dtype=dtype, size=size)
    except RuntimeError as exc:  # out of memory on a small GPU, no FP8 GEMM: the sweep still runs
        _print_err(f"note: {dtype} GEMM ceiling not measured ({exc}); %gemm left empty for "
                   f"{dtype}")
        return None
    _print_err(f"GEMM ceiling: {gemm['tflops']:.1f} TFLOP/s ({gemm['size']}^3 "
               f"{gemm['dtype']} {gemm['op']}, median {gemm['ms']:.3f} ms)")
    return gemm


def _print_summary(rows, backend_status, report) -> None:
    print(report.format_table(rows))
    kernels = report.format_kernels(rows)
    if kernels:
        print("\nkernels:\n" + kernels)
    memory = report.format_memory(rows)
    if memory:
        print("\nbackward memory, MiB (ws: the library's workspace formula; extra: measured "
              "beyond the gradients):\n" + memory)
    comparison = report.format_mixed_comparison(rows)
    if comparison:
        print("\nmixed mode vs its 16-bit path (same backend and configuration):\n" + comparison)
    skips = report.format_skips(rows)
    if skips:
        print("\nnot timed:\n" + skips)
    unavailable = [f"{name}: {s['reason']}" for name, s in backend_status.items()
                   if not s["available"]]
    if unavailable:
        print("\nunavailable backends:\n" + "\n".join(unavailable))


def _save(args, data, report) -> None:
    targets = {"json": args.json, "csv": args.csv, "png": args.plot}
    paths = [(kind, path) for kind, path in targets.items() if path]
    if args.out_dir:
        paths += list(report.out_dir_paths(args.out_dir, data["meta"]).items())
    for kind, path in paths:
        if kind == "json":
            report.write_json(path, data)
            print(f"wrote {path}")
        elif kind == "csv":
            report.write_csv(path, data)
            print(f"wrote {path}")
    for kind, path in paths:  # plots last: a plotting problem must not cost the data
        if kind == "png":
            try:
                _write_plot(data, path)
            except CliError as exc:
                _print_err(f"plot skipped: {exc}")


# ---- other commands -------------------------------------------------------------------------

def run_plot(args: argparse.Namespace) -> int:
    data = _read(args.results)
    output = args.output or args.results.rsplit(".", 1)[0] + ".png"
    return 0 if _write_plot(data, output) else EXIT_FAILURE


def _version() -> str:
    from ._lib import installed_version  # flash-hopper, or a wheel's flash-hopper-cu12/-cu13

    return installed_version() or "0+unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(f"{PROG} {_version()}")
        return 0
    if args.command is None:
        parser.print_help()
        return 0
    # The arguments are parsed: peers that read sys.argv themselves (the CuTe DSL behind
    # flash_attn.cute does, on import and again when a kernel compiles) see only the program
    # name, not ours (argparse's prefix matching read `-d 128` as its `-diagnostic`).
    saved_argv, sys.argv = sys.argv, sys.argv[:1] or [PROG]
    try:
        return _run_command(args, argv)
    finally:
        sys.argv = saved_argv


def _run_command(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        if args.command == "bench":
            return run_bench(args, argv)
        if args.command == "decode":
            from .bench.decode import run_decode

            return run_decode(args)
        if args.command == "info":
            from .bench.info import run_info

            return run_info(args)
        if args.command == "demo":
            from .bench.demo import run_demo

            return run_demo(args)
        return run_plot(args)
    except KeyboardInterrupt:
        _print_err(f"{PROG} {args.command}: interrupted")
        return 130
    except Exception as exc:
        from .bench.decode import DecodeError
        from .bench.demo import DemoError

        if isinstance(exc, (CliError, DemoError, DecodeError)):
            _print_err(f"{PROG} {args.command}: error: {exc}")
            return EXIT_FAILURE
        raise


if __name__ == "__main__":
    sys.exit(main())
