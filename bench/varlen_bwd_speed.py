"""Varlen backward speed on the GPU (docs/bwd_sm90.md "Varlen"): the FA-3 path's one-call varlen
backward against the dense backward on the same tokens.

  python bench/varlen_bwd_speed.py --out results.json [--quick]

1. Equal lengths: b * s = 16k tokens, h * d = 2048, d = 64 / 128, s = 1k / 4k / 16k (--quick:
   1k and 16k), causal and not: the dense backward and the varlen backward of the same forward
   (the tokens reshaped). The bar: varlen within 5 % of dense.
2. Many short sequences: 10k sequences of 1 .. 64 tokens (seeded), h = 16, d = 128, causal and
   not: varlen against the dense backward of the batch padded to 64 tokens. The bar: at least as
   fast as the padded dense backward.
3. A mixed batch: varlen_speed.py's lengths (128 .. 8k until 16k tokens, seeded), h = 16,
   d = 128, causal and not: the one call against the dense backward run per sequence (what the
   varlen backward was before it, and what a user without one would write).
Each side is one backward call (its gradients allocated inside, as in training: the varlen
side's zero-filled), timed with CUDA events around 20 calls after 5 warm-ups, the two sides
alternating rep by rep (median of 7 each). TFLOP/s: 2.5x the forward's FLOPs over the visible
pairs (bench/varlen_speed.py's count).
"""

# ruff: noqa: B023  (every lambda is timed inside the iteration that defines it)
from __future__ import annotations

import argparse
import json
import os
import random

import torch
from flash_hopper import _bwd, _varlen, flash_attn_func, flash_attn_varlen_func
from varlen_speed import flops, mixed_lengths, timed_pair  # bench/: the script's directory

BF16 = torch.bfloat16


def window(causal: bool) -> tuple[int, int]:
    return (-1, 0) if causal else (-1, -1)


def dense_bwd(q, k, v, causal):
    """A closure running the dense backward of one forward of (b, s, h, d) tensors."""
    out, lse = flash_attn_func(q, k, v, causal=causal, backend="fa3", return_attn_probs=True)
    dout = torch.randn_like(out)
    scale = q.shape[-1] ** -0.5
    wl, wr = window(causal)
    return lambda: _bwd.op(dout, q, k, v, out, lse, None, scale, wl, wr, 0.0, "fa3", False)


def varlen_bwd(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    """A closure running the one-call varlen backward of one forward of packed tensors."""
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal,
                                      backend="fa3", return_attn_probs=True)
    dout = torch.randn_like(out)
    scale = q.shape[-1] ** -0.5
    wl, wr = window(causal)
    return lambda: _varlen.backward(dout, q, k, v, out, lse, None, cu_q, cu_k, None, None, scale,
                                    wl, wr, 0.0, "fa3", False, 0, max_q, max_k)


def equal_lengths(results, quick):
    for d in (64, 128):
        h = 2048 // d
        for s in ((1024, 16384) if quick else (1024, 4096, 16384)):
            b = 16384 // s
            q, k, v = (torch.randn((b, s, h, d), dtype=BF16, device="cuda") for _ in range(3))
            qp, kp, vp = (t.reshape(b * s, h, d) for t in (q, k, v))
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
            for causal in (False, True):
                fl = 2.5 * flops([s] * b, [s] * b, h, d, causal)
                dense, var = timed_pair(dense_bwd(q, k, v, causal),
                                        varlen_bwd(qp, kp, vp, cu, cu, s, s, causal))
                row = {"case": "equal", "d": d, "s": s, "b": b, "h": h, "causal": causal,
                       "dense_ms": dense, "varlen_ms": var, "dense_tflops": fl / dense / 1e9,
                       "varlen_tflops": fl / var / 1e9, "varlen_over_dense": dense / var}
                results.append(row)
                print(json.dumps(row), flush=True)


def many_short(results, seed=0, count=10000, longest=64, h=16, d=128):
    rng = random.Random(seed)
    lengths = [rng.randint(1, longest) for _ in range(count)]
    cu_list = [0]
    for n in lengths:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    total = cu_list[-1]
    qp, kp, vp = (torch.randn((total, h, d), dtype=BF16, device="cuda") for _ in range(3))
    q, k, v = (torch.randn((count, longest, h, d), dtype=BF16, device="cuda") for _ in range(3))
    for causal in (False, True):
        fl = 2.5 * flops(lengths, lengths, h, d, causal)
        dense, var = timed_pair(dense_bwd(q, k, v, causal),
                                varlen_bwd(qp, kp, vp, cu, cu, longest, longest, causal))
        row = {"case": "short", "sequences": count, "lengths": f"1..{longest}", "h": h, "d": d,
               "causal": causal, "padded_dense_ms": dense, "varlen_ms": var,
               "varlen_tflops": fl / var / 1e9, "varlen_over_padded": dense / var}
        results.append(row)
        print(json.dumps(row), flush=True)


def mixed_batch(results, seed=0, h=16, d=128):
    lengths = mixed_lengths(seed)
    cu_list = [0]
    for n in lengths:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn((cu_list[-1], h, d), dtype=BF16, device="cuda") for _ in range(3))
    longest = max(lengths)
    for causal in (False, True):
        out, lse = flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal,
                                          backend="fa3", return_attn_probs=True)
        dout = torch.randn_like(out)
        scale = d ** -0.5
        wl, wr = window(causal)

        def one_call():
            return _varlen.backward(dout, q, k, v, out, lse, None, cu, cu, None, None, scale, wl,
                                    wr, 0.0, "fa3", False, 0, longest, longest)

        spans = [slice(a, b) for a, b in zip(cu_list, cu_list[1:])]

        def per_sequence():
            for r in spans:
                _bwd.op(dout[r].unsqueeze(0), q[r].unsqueeze(0), k[r].unsqueeze(0),
                        v[r].unsqueeze(0), out[r].unsqueeze(0), lse[:, r].unsqueeze(0), None,
                        scale, wl, wr, 0.0, "fa3", False)

        fl = 2.5 * flops(lengths, lengths, h, d, causal)
        seq, var = timed_pair(per_sequence, one_call)
        row = {"case": "mixed", "lengths": lengths, "h": h, "d": d, "causal": causal,
               "per_sequence_ms": seq, "varlen_ms": var, "per_sequence_tflops": fl / seq / 1e9,
               "varlen_tflops": fl / var / 1e9, "varlen_over_per_sequence": seq / var}
        results.append(row)
        print(json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("FLASH_HOPPER_CHECK_OFFSETS", "0")
    results = []
    equal_lengths(results, args.quick)
    many_short(results)
    mixed_batch(results)
    record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
