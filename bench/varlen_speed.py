"""Varlen forward speed on the GPU (docs/host.md "Varlen"): flash_attn_varlen_func against the
dense kernel on the same tokens, and a realistic mixed batch against torch SDPA's jagged (nested
tensor) path.

  python bench/varlen_speed.py --out results.json

1. Equal lengths: b * s = 16k tokens, h * d = 2048, s = 1k .. 16k, d = 64 / 128 / 256, causal
   and not: the dense flash_attn_func and the varlen call on the same tokens (reshaped), same
   backend. The bar: varlen within 5 % of dense.
2. Mixed batches: lengths drawn uniformly from 128 .. 8k until 16k tokens (seeded), d = 128,
   h = 16: varlen (fa3 and fa2) vs torch SDPA on a jagged nested tensor (its flash backend) and
   the dense kernel run per sequence (the no-varlen fallback a user would write).
TFLOP/s by the FA convention per sequence (4 * sq * sk * h * d, halved when causal, i.e. the
mask's visible pairs). Each timing: CUDA events around 20 calls after 5 warm-ups, median of 5;
dense and varlen of one point alternate rep by rep (median of 7 each).
The offsets check (one device-to-host copy per call) is off while timing
(FLASH_HOPPER_CHECK_OFFSETS=0) and its cost is reported on its own.
"""

# ruff: noqa: B023  (every lambda is timed inside the iteration that defines it)
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import flash_hopper
import torch
import torch.nn.functional as F
from ab_libs import time_burst as _once  # bench/ is the script's directory: on sys.path
from flash_hopper import flash_attn_func, flash_attn_varlen_func


def timed(fn, iters=20, warmup=5, reps=5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_once(fn, iters) for _ in range(reps))  # ms


def timed_pair(fa, fb, iters=20, warmup=5, reps=7) -> tuple[float, float]:
    """Medians (ms) of two calls timed alternately, rep by rep: a drift of the GPU's clock or of
    the machine's load hits both sides alike (run-to-run noise at s <= 4k is 5-10 %)."""
    for _ in range(warmup):
        fa()
        fb()
    torch.cuda.synchronize()
    a, b = [], []
    for _ in range(reps):
        a.append(_once(fa, iters))
        b.append(_once(fb, iters))
    return statistics.median(a), statistics.median(b)


def flops(lengths_q, lengths_k, heads, d, causal) -> float:
    total = 0.0
    for sq, sk in zip(lengths_q, lengths_k):
        if causal:  # bottom-right aligned: visible pairs
            pairs = sum(max(0, min(sk, i + sk - sq + 1)) for i in range(sq)) if sq != sk \
                else sq * (sq + 1) / 2
        else:
            pairs = sq * sk
        total += 4 * pairs * heads * d
    return total


def inputs(shape, dtype):
    """Three N(0, 1) tensors in bf16, or rounded to e4m3 (FP8: no descales, bf16 out)."""
    t = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    return [x.to(dtype) for x in t] if dtype != torch.bfloat16 else t


def equal_lengths(backends, results, dtype=torch.bfloat16):
    for d in (64, 128, 256):
        h = 2048 // d
        for s in (1024, 2048, 4096, 8192, 16384):
            b = 16384 // s
            q, k, v = inputs((b, s, h, d), dtype)
            qp, kp, vp = (t.reshape(b * s, h, d) for t in (q, k, v))
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
            for causal in (False, True):
                fl = flops([s] * b, [s] * b, h, d, causal)
                for backend in backends:
                    dense, var = timed_pair(
                        lambda: flash_attn_func(q, k, v, causal=causal, backend=backend),
                        lambda: flash_attn_varlen_func(qp, kp, vp, cu, cu, s, s, causal=causal,
                                                       backend=backend))
                    row = {"case": "equal", "backend": backend, "d": d, "s": s, "b": b,
                           "h": h, "causal": causal, "dense_ms": dense, "varlen_ms": var,
                           "dense_tflops": fl / dense / 1e9, "varlen_tflops": fl / var / 1e9,
                           "varlen_over_dense": dense / var}
                    results.append(row)
                    print(json.dumps(row), flush=True)


def mixed_lengths(seed, tokens=16384, shortest=128, longest=8192) -> list[int]:
    """Lengths drawn uniformly from shortest .. longest (seeded), the last one cut so that they
    sum to `tokens`."""
    rng = random.Random(seed)
    lengths, total = [], 0
    while total < tokens:
        n = min(rng.randint(shortest, longest), tokens - total)
        lengths.append(n)
        total += n
    return lengths


def mixed_batch(backends, results, seed, dtype=torch.bfloat16):
    lengths = mixed_lengths(seed)
    total = sum(lengths)
    d, h = 128, 16
    q, k, v = inputs((total, h, d), dtype)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32,
                      device="cuda")
    smax = max(lengths)
    for causal in (False, True):
        fl = flops(lengths, lengths, h, d, causal)
        row = {"case": "mixed", "lengths": lengths, "d": d, "h": h, "causal": causal}
        for backend in backends:
            ms = timed(lambda: flash_attn_varlen_func(q, k, v, cu, cu, smax, smax,
                                                      causal=causal, backend=backend))
            row[f"{backend}_varlen_ms"] = ms
            row[f"{backend}_varlen_tflops"] = fl / ms / 1e9
            starts = cu.tolist()

            def per_sequence():
                for i, n in enumerate(lengths):
                    a = starts[i]
                    flash_attn_func(q[None, a:a + n], k[None, a:a + n], v[None, a:a + n],
                                    causal=causal, backend=backend)

            ms = timed(per_sequence, iters=5)
            row[f"{backend}_per_sequence_ms"] = ms
            row[f"{backend}_per_sequence_tflops"] = fl / ms / 1e9
        if dtype != torch.bfloat16:  # SDPA has no FP8 attention
            results.append(row)
            print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "lengths"}), flush=True)
            continue
        try:  # torch SDPA on a jagged nested tensor: (B, j, h, d) -> transpose to (B, h, j, d)
            offsets = cu.long()
            nq, nk, nv = (torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2)
                          for t in (q, k, v))
            ms = timed(lambda: F.scaled_dot_product_attention(nq, nk, nv, is_causal=causal))
            row["sdpa_jagged_ms"] = ms
            row["sdpa_jagged_tflops"] = fl / ms / 1e9
        except Exception as e:  # noqa: BLE001 - record why the peer did not run
            row["sdpa_jagged_error"] = f"{type(e).__name__}: {e}"[:300]
        results.append(row)
        print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "lengths"}), flush=True)


def check_cost(results):
    """Host time per call with the offsets check on and off (a small varlen call)."""
    q = torch.randn(512, 8, 128, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, 100, 300, 512], dtype=torch.int32, device="cuda")
    row = {"case": "offsets_check"}
    for flag in ("1", "0"):
        os.environ["FLASH_HOPPER_CHECK_OFFSETS"] = flag
        for _ in range(20):
            flash_attn_varlen_func(q, q, q, cu, cu, 212, 212)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            flash_attn_varlen_func(q, q, q, cu, cu, 212, 212)
        torch.cuda.synchronize()
        row[f"check_{flag}_us_per_call"] = (time.perf_counter() - t0) / 200 * 1e6
    os.environ["FLASH_HOPPER_CHECK_OFFSETS"] = "0"
    results.append(row)
    print(json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backends", default="fa3,fa2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-equal", action="store_true")
    ap.add_argument("--dtype", choices=["bf16", "e4m3"], default="bf16",
                    help="e4m3: FP8 inputs (FA-3 path only; bf16 out, no descales)")
    args = ap.parse_args()
    backends = args.backends.split(",")
    dtype = torch.float8_e4m3fn if args.dtype == "e4m3" else torch.bfloat16
    if args.dtype == "e4m3":
        backends = [b for b in backends if b == "fa3"]
    results = []
    check_cost(results)
    os.environ["FLASH_HOPPER_CHECK_OFFSETS"] = "0"
    if not args.skip_equal:
        equal_lengths(backends, results, dtype)
    mixed_batch(backends, results, args.seed, dtype)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "build": flash_hopper.build_info().get("commit"),
            "config": f"{args.dtype}; equal: b*s = 16k, h*d = 2048; mixed: lengths 128..8k, 16k tokens, "
                      "h 16, d 128; CUDA events, 20 calls x median of 5"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
