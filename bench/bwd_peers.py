"""Backward speed of flash-hopper's paths next to torch SDPA's flash / cuDNN / efficient backends,
interleaved in one process (the CLI's `--direction bwd` times one backend after another; clocks
drift 5-10 % between them, more than the changes this is for).

    python bench/bwd_peers.py OUT.json [SEQLENS] [HEAD_DIMS] [COMMIT]
    e.g. python bench/bwd_peers.py bwd.json 512,2048,16384 64,128,256 $(git rev-parse --short HEAD)

bf16, b * s = 16k, h * d = 2048 (the FA3 paper's sweep), causal off and on. Per config, every
candidate runs a ~60 ms burst per round in rotating order, 5 rounds; the median TFLOP/s is
reported (backward FLOPs = 2.5 x the forward's 4 b s^2 h d, halved when causal) with the spread
(max - min over median). flash-hopper runs its backward op alone on each path with a kernel for
the bucket (fh-fa3, fh-fa2, and fh-<path>-det with deterministic=True) on the forward's out / lse; SDPA's backends run autograd.grad through their
own forward graph (retain_graph), which is what a training step pays for them. Gradient accuracy
is the test suite's job (tests/test_bwd_gpu.py), not this script's.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import flash_hopper
import torch
import torch.nn.functional as F
from flash_hopper import _bwd
from flash_hopper.dispatch import head_dim_bucket
from torch.nn.attention import SDPBackend, sdpa_kernel

ROUNDS = 5
SDPA = (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION))


def burst_ms(fn: Callable[[], object], budget_ms: float = 60.0) -> float:
    """Mean time of one call over a burst of about budget_ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    calls = max(2, int(budget_ms / max(start.elapsed_time(end), 1e-3)))
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def fh_paths(d: int) -> list[str]:
    """flash-hopper's paths with a bf16 backward kernel for d that run on this GPU."""
    built = {k["backend"] for k in flash_hopper.build_info()["kernels"]
             if k["direction"] == "bwd" and k["dtype"] == "bf16"
             and k["head_dim"] == head_dim_bucket(d)}
    if torch.cuda.get_device_capability() != (9, 0):
        built.discard("fa3")
    return [p for p in ("fa3", "fa2") if p in built]


def candidates(d: int, s: int, causal: bool) -> dict[str, Callable[[], object]]:
    b, h = max(1, 16384 // s), 2048 // d
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k, v, dout = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    out, lse = flash_hopper.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    right = 0 if causal else -1
    found: dict[str, Callable[[], object]] = {}
    for path in fh_paths(d):
        for det in (False, True):
            found[f"fh-{path}-det" if det else f"fh-{path}"] = (
                lambda det=det, path=path: _bwd.op(dout, q, k, v, out, lse, None, d ** -0.5, -1,
                                                   right, 0.0, path, det))
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    grad = dout.transpose(1, 2)
    for name, backend in SDPA:
        try:
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        except RuntimeError as e:  # this backend does not serve the config
            print(f"{name} unavailable: {str(e)[:100]}")
            continue
        found[name] = lambda o=o: torch.autograd.grad(o, leaves, grad, retain_graph=True)
    return found


def main() -> None:
    out_path = sys.argv[1]
    seqlens = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "512,2048,16384").split(",")]
    dims = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "64,128,256").split(",")]
    results = []
    for d in dims:
        for s in seqlens:
            for causal in (False, True):
                torch.manual_seed(0)
                fns = candidates(d, s, causal)
                names = list(fns)
                times: dict[str, list[float]] = {n: [] for n in names}
                for r in range(ROUNDS):
                    for n in names[r % len(names):] + names[:r % len(names)]:
                        times[n].append(burst_ms(fns[n]))
                b, h = max(1, 16384 // s), 2048 // d
                flops = 2.5 * 4 * b * s * s * h * d / (2 if causal else 1)
                row: dict = {"d": d, "s": s, "b": b, "h": h, "causal": causal}
                for n, ts in times.items():
                    ms = statistics.median(ts)
                    row[n] = {"ms": ms, "tflops": flops / ms / 1e9,
                              "spread": (max(ts) - min(ts)) / ms}
                print(json.dumps({k: round(v["tflops"], 1) if isinstance(v, dict) else v
                                  for k, v in row.items()}), flush=True)
                results.append(row)
                del fns
                torch.cuda.empty_cache()
    record = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "commit": sys.argv[4] if len(sys.argv) > 4 else "unknown",
              "torch": torch.__version__,
              "config": {"dtype": "bf16", "b*s": 16384, "h*d": 2048, "rounds": ROUNDS},
              "build_info": flash_hopper.build_info(), "results": results}
    with open(out_path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
