"""`flash-hopper decode`: the decode sweep (bandwidth of attention against a KV cache).

Each point is batch x context: `seqlen_q` new query tokens per sequence (1 by default) against a
full cache of `context` keys, GQA heads_q / heads_kv, one head dim, causal (bottom-right). The
metric is bandwidth: bytes of K and V read (2 * batch * context * heads_kv * head_dim * element
size) per second of one call, the call timed as CUDA-graph replays with the inputs resident and
nothing allocated by the timing (a server's decode step). Host time per call is measured too,
eager (the Python call's own time while the GPU keeps up) and graph-replayed.

Backends: flash-hopper's flash_attn_with_kvcache (dense cache), flash-hopper's flash_attn_func on
the same cache (the dense call, for comparison), torch SDPA's cuDNN backend on the dense cache
(enable_gqa; one query token, since SDPA's causal mask is top-left aligned). Each backend's
output is checked against a float32 reference on the first sequences of the batch (max error
within 2e-2 + FA3's rule of twice the same computation in the input dtype).

--page-size P adds a "flash-hopper-paged" backend: the same cache as a pool of P-token pages
in shuffled order with a page table (flash_attn_with_kvcache's paged path). Peers on request
(--backends): "flash-attn-cute-paged", FA4's paged call (flash_attn.cute's flash_attn_varlen_func
with page_table and seqused_k, its own split choice) on the same pool, and "flash-attn-cute" on
the dense cache.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from . import cases
from .errors import first_line

# Issue 14's table: batch x context.
DEFAULT_POINTS = ("1x8k", "1x128k", "8x32k", "32x32k", "128x16k", "64x1k")
DEFAULT_BACKENDS = ("flash-hopper", "flash-hopper-dense", "sdpa-cudnn")
PEER_BACKENDS = ("flash-attn-cute-paged", "flash-attn-cute")
BACKENDS = (*DEFAULT_BACKENDS, "flash-hopper-paged", *PEER_BACKENDS)
ELEMENT_BYTES = {"bf16": 2, "fp16": 2}
CHECK_SEQUENCES = 2  # the reference check's sequences (the first ones of the batch)


class DecodeError(RuntimeError):
    """A one-line reason the decode sweep cannot run here (no GPU, no library, bad arguments)."""


def parse_count(text: str) -> int:
    """'8k' -> 8192, '300' -> 300 (the bench's counts: cases.parse_count)."""
    try:
        return cases.parse_count(text)
    except ValueError:
        raise ValueError(f"expected a positive count like 300 or 8k, got {text!r}") from None


def parse_point(text: str) -> tuple[int, int]:
    """'32x32k' -> (32, 32768)."""
    parts = text.lower().split("x")
    if len(parts) != 2:
        raise ValueError(f"--points: expected BATCHxCONTEXT like 32x32k, got {text!r}")
    try:
        return parse_count(parts[0]), parse_count(parts[1])
    except ValueError as exc:
        raise ValueError(f"--points: {exc} in {text!r}") from None


def parse_heads(text: str) -> tuple[int, int]:
    """'32/8' -> (32, 8): query heads / KV heads, a whole ratio."""
    parts = text.split("/")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--heads: expected Q/KV like 32/8, got {text!r}")
    hq, hk = int(parts[0]), int(parts[1])
    if hq % hk:
        raise ValueError(f"--heads: query heads must be a multiple of KV heads, got {text!r}")
    return hq, hk


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    context: int
    heads_q: int = 32
    heads_kv: int = 8
    head_dim: int = 128
    seqlen_q: int = 1
    dtype: str = "bf16"
    page_size: int | None = None  # the flash-hopper-paged backend's pages

    def kv_bytes(self) -> int:
        """Bytes of K and V one call reads."""
        return 2 * self.batch * self.context * self.heads_kv * self.head_dim * \
            ELEMENT_BYTES[self.dtype]

    def label(self) -> str:
        return f"{self.batch}x{cases.short_count(self.context)}"


def tbps(nbytes: int, seconds: float) -> float:
    """Terabytes (1e12 B) per second."""
    return nbytes / seconds / 1e12


@dataclass
class DecodeRow:
    point: DecodePoint
    backend: str
    device_us: float | None = None  # per call, CUDA-graph replay
    # The Python call's own time; flash-hopper's flash_attn_with_kvcache checks its values on the
    # host (one device-to-host copy: it waits for the GPU) unless FLASH_HOPPER_CHECK_OFFSETS=0.
    host_us_eager: float | None = None
    host_us_graph: float | None = None  # a graph replay's launch, per captured call
    tbps: float | None = None
    check_err: float | None = None
    check_tol: float | None = None
    passed: bool | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["point"] = asdict(self.point) | {"label": self.point.label(),
                                           "kv_bytes": self.point.kv_bytes()}
        return d


# --- the GPU side ---------------------------------------------------------------------------------


def make_inputs(point: DecodePoint, seed: int = 0):
    """q (b, sq, hq, d), k / v caches (b, context, hk, d) full, cache_seqlens (b,) int32."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[point.dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(point.batch, point.seqlen_q, point.heads_q, point.head_dim, device="cuda",
                    dtype=dtype, generator=g)
    kc, vc = (torch.randn(point.batch, point.context, point.heads_kv, point.head_dim,
                          device="cuda", dtype=dtype, generator=g) for _ in range(2))
    lengths = torch.full((point.batch,), point.context, dtype=torch.int32, device="cuda")
    return q, kc, vc, lengths


def backend_call(name: str, point: DecodePoint, q, kc, vc, lengths) -> Callable[[], object]:
    """The timed call of a backend on resident inputs (raises when it cannot run)."""

    if name == "flash-hopper":
        from flash_hopper import flash_attn_with_kvcache

        return lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, causal=True)
    if name == "flash-hopper-paged":
        if point.page_size is None:
            raise DecodeError("flash-hopper-paged: needs --page-size")
        from flash_hopper import flash_attn_with_kvcache

        pool_k, pool_v, table = paged_copy(kc, vc, point.page_size)
        return lambda: flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lengths,
                                               page_table=table, causal=True)
    if name == "flash-hopper-dense":
        from flash_hopper import flash_attn_func

        return lambda: flash_attn_func(q, kc, vc, causal=True)
    if name in PEER_BACKENDS:
        from .peers import argv_shielded

        with argv_shielded():
            from flash_attn.cute import flash_attn_varlen_func
        if name == "flash-attn-cute-paged":
            if point.page_size is None:
                raise DecodeError(f"{name}: needs --page-size")
            pool_k, pool_v, table = paged_copy(kc, vc, point.page_size)
            return lambda: _first(flash_attn_varlen_func(q, pool_k, pool_v, seqused_k=lengths,
                                                         page_table=table, causal=True))
        return lambda: _first(flash_attn_varlen_func(q, kc, vc, causal=True))
    if name == "sdpa-cudnn":
        if point.seqlen_q != 1:
            raise DecodeError("sdpa-cudnn: SDPA's causal mask is top-left aligned; decode rows "
                              "with seqlen_q > 1 need bottom-right (one query token only)")
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
        return run
    raise DecodeError(f"unknown decode backend {name!r}; expected one of "
                      f"{', '.join(BACKENDS)}")


def _first(result):
    """The output of a call that returns it alone or first of a tuple (out, lse)."""
    return result[0] if isinstance(result, tuple) else result


def paged_copy(kc, vc, page_size: int, seed: int = 0):
    """The dense caches (batch, context, heads_kv, d) as pools of page_size-token pages in a
    shuffled order and the page table that reads them back: (pool_k, pool_v, table int32)."""
    import torch

    batch, context = kc.shape[:2]
    per_seq = -(-context // page_size)
    pad = per_seq * page_size - context
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(seed))
    order = order.to(kc.device)
    pools = []
    for cache in (kc, vc):
        padded = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, pad))
        pages = padded.reshape(batch * per_seq, page_size, *cache.shape[2:])
        pool = torch.empty_like(pages)
        pool[order] = pages  # logical page i of the batch lives at pool slot order[i]
        pools.append(pool)
    table = order.view(batch, per_seq).to(torch.int32)
    return pools[0], pools[1], table


def reference_check(point: DecodePoint, out, q, kc, vc) -> tuple[float, float]:
    """(max error, tolerance) of out on the first CHECK_SEQUENCES sequences: float32 reference,
    the tolerance twice the input-dtype computation's error + 2e-2 (bf16 outputs)."""
    import torch

    n = min(point.batch, CHECK_SEQUENCES)
    g = point.heads_q // point.heads_kv

    def attend(dtype):
        qq = q[:n].to(dtype).transpose(1, 2)
        kk = kc[:n].to(dtype).transpose(1, 2).repeat_interleave(g, 1)
        vv = vc[:n].to(dtype).transpose(1, 2).repeat_interleave(g, 1)
        s = qq @ kk.transpose(-1, -2) * point.head_dim ** -0.5
        i = torch.arange(point.seqlen_q, device=q.device)[:, None] + point.context - point.seqlen_q
        j = torch.arange(point.context, device=q.device)[None]
        s = s.masked_fill(j > i, float("-inf"))
        return (s.softmax(-1).to(dtype) @ vv).transpose(1, 2).float()

    ref = attend(torch.float32)
    low = attend(q.dtype)
    err = (out[:n].float() - ref).abs().max().item()
    tol = 2 * (low - ref).abs().max().item() + 2e-2
    return err, tol


def graph_time_us(fn: Callable[[], object], iters: int = 20, reps: int = 5) -> tuple[float, float]:
    """(device us per call, host us per call) of fn captured `iters` times in one CUDA graph
    (the replay's launch time / iters), the median over `reps` replays."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # warm-up: plans, library handles, workspaces
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(iters):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    times, hosts = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        hosts.append((time.perf_counter() - t0) * 1e6 / iters)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times), statistics.median(hosts)


def host_time_us(fn: Callable[[], object], calls: int = 50) -> float:
    """The eager call's own time (us): `calls` calls issued back to back, then one sync; on
    decode-sized calls the GPU keeps up, so this is the host's cost per call."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e6 / calls
    torch.cuda.synchronize()
    return host


def measure(point: DecodePoint, backends: list[str], timer=graph_time_us,
            host_timer=host_time_us) -> list[DecodeRow]:
    """One row per backend for one point (errors recorded per row, never raised)."""
    import torch

    q, kc, vc, lengths = make_inputs(point)
    rows = []
    for name in backends:
        row = DecodeRow(point, name)
        try:
            fn = backend_call(name, point, q, kc, vc, lengths)
            out = fn()
            row.check_err, row.check_tol = reference_check(point, out, q, kc, vc)
            row.passed = row.check_err <= row.check_tol
            del out
            row.device_us, row.host_us_graph = timer(fn)
            row.host_us_eager = host_timer(fn)
            row.tbps = tbps(point.kv_bytes(), row.device_us * 1e-6)
        except Exception as exc:  # noqa: BLE001 - recorded per row
            row.error = first_line(exc)
            row.passed = False
        rows.append(row)
    del q, kc, vc, lengths
    torch.cuda.empty_cache()
    return rows


# --- output -------------------------------------------------------------------------------------


TABLE_HEADER = (f"{'point':>9} {'backend':<19} {'TB/s':>6} {'us':>9} {'host us':>8} "
                f"{'graph us':>8}  check")


def table(rows: list[DecodeRow], header: bool = True) -> str:
    lines = [TABLE_HEADER] if header else []
    for r in rows:
        if r.error:
            lines.append(f"{r.point.label():>9} {r.backend:<19} {'-':>6} {'-':>9} {'-':>8} "
                         f"{'-':>8}  {r.error}")
            continue
        verdict = "PASS" if r.passed else "FAIL"
        lines.append(f"{r.point.label():>9} {r.backend:<19} {r.tbps:6.2f} {r.device_us:9.1f} "
                     f"{r.host_us_eager:8.1f} {r.host_us_graph:8.1f}  {verdict} "
                     f"({r.check_err:.1e} <= {r.check_tol:.1e})")
    return "\n".join(lines)


def write_json(path: str, rows: list[DecodeRow], meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [r.as_dict() for r in rows]}, f, indent=1)


def write_csv(path: str, rows: list[DecodeRow]) -> None:
    import csv

    fields = ["label", "batch", "context", "heads_q", "heads_kv", "head_dim", "seqlen_q",
              "dtype", "page_size", "kv_bytes", "backend", "tbps", "device_us", "host_us_eager",
              "host_us_graph", "check_err", "check_tol", "passed", "error"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            d = r.as_dict()
            w.writerow({**{k: d["point"][k] for k in fields if k in d["point"]},
                        **{k: d[k] for k in fields if k in d and k != "point"}})


def plot(path: str, rows: list[DecodeRow]) -> None:
    """Grouped bars: TB/s per point, one bar per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r.point.label() for r in rows))
    names = list(dict.fromkeys(r.backend for r in rows))
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(1.6 * len(labels) + 2, 4))
    for i, name in enumerate(names):
        values = [next((r.tbps or 0.0 for r in rows
                        if r.backend == name and r.point.label() == lab), 0.0) for lab in labels]
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_ylabel("K/V bandwidth (TB/s)")
    ax.set_xlabel("batch x context")
    first = rows[0].point
    ax.set_title(f"decode: GQA {first.heads_q}/{first.heads_kv}, d{first.head_dim}, "
                 f"{first.dtype}, q len {first.seqlen_q}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the command --------------------------------------------------------------------------------


def points_from_args(args) -> list[DecodePoint]:
    hq, hk = parse_heads(args.heads)
    specs = args.points or list(DEFAULT_POINTS)
    points = []
    for spec in cases.split_list(specs):
        batch, context = parse_point(spec)
        if args.seqlen_q > context:
            raise ValueError(f"--seqlen-q ({args.seqlen_q}) must be <= the context ({context})")
        points.append(DecodePoint(batch, context, hq, hk, args.head_dim, args.seqlen_q,
                                  args.dtype, args.page_size))
    return points


def run_decode(args) -> int:
    try:
        points = points_from_args(args)
    except ValueError as exc:
        raise DecodeError(str(exc)) from None
    default = (*DEFAULT_BACKENDS, "flash-hopper-paged") if args.page_size else DEFAULT_BACKENDS
    backends = list(dict.fromkeys(cases.split_list(args.backends or default)))
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise DecodeError(f"--backends: unknown {', '.join(unknown)}; expected some of "
                          f"{', '.join(BACKENDS)}")
    if args.page_size is not None and args.page_size < 1:
        raise DecodeError(f"--page-size: expected an int >= 1, got {args.page_size}")
    from . import env

    gpu, reason = env.detect_gpu()
    if gpu is None:
        raise DecodeError(f"needs a CUDA GPU: {reason}")
    rows = []
    print(TABLE_HEADER, flush=True)
    for point in points:
        new = measure(point, backends)
        rows.extend(new)
        print(table(new, header=False), flush=True)
    import torch

    meta = {"gpu": gpu.name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "metric": "K/V bytes read / time of one CUDA-graph-replayed call (1e12 B/s)"}
    try:
        import flash_hopper

        meta["flash_hopper"] = flash_hopper.build_info().get("commit")
    except Exception as exc:  # noqa: BLE001
        meta["flash_hopper"] = first_line(exc)
    if args.json:
        write_json(args.json, rows, meta)
    if args.csv:
        write_csv(args.csv, rows)
    if args.plot:
        plot(args.plot, rows)
    return exit_status(rows)


def exit_status(rows: list[DecodeRow]) -> int:
    """1 when a check fails or a flash-hopper row errors (a peer that cannot run is recorded)."""
    failed = any(r.error is None and not r.passed for r in rows)
    broken = any(r.error is not None and r.backend.startswith("flash-hopper") for r in rows)
    return 1 if failed or broken else 0
