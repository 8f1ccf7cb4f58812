"""Forward speed of a V head dim of its own (d 192 / dv 128, DeepSeek's prefill), one process:
the kernel with V's own head dim (flash_attn_func's inference path; native_nopp: with ping-pong
off, FA3's choice at d192), the zero-padded path it
replaces (flash_attn_func's padding: V padded to 192, a d192 call, O sliced), the d192 kernel
alone on a V padded beforehand (the padding's copies not timed), and FA3's hdim 192 / dv 128
kernel (fa3-fwd's fa3_fwd_interface, or any FA3 interface module) where it imports.

    python bench/dv_speed.py -s 1024 2048 4096 8192 16384 --rounds 5 --json dv.json

b * s = 16k tokens, 16 heads (--heads), bf16; TFLOP/s = 2 b s^2 h (d + dv) (halved causal). Each
round runs every variant in rotating order, a burst of ~20 ms each (CUDA events); the median
over rounds is reported. Every variant's output is compared with the native one (max abs
difference) and with an fp32 reference on the first 128 query rows of the first sequence.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from flash_hopper import _dv, flash_attn_func

os.environ["FLASH_HOPPER_DV_KERNEL"] = "1"  # the native rows; the padded ones call split_call


def fa3_module():
    for name in ("fa3_fwd_interface", "flash_attn_interface", "flash_attn_3.flash_attn_interface"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def variants(q, k, v, v_padded, causal, fa3) -> dict:
    """The timed calls of one configuration, by name."""
    dv = v.shape[-1]
    fns = {
        "native": lambda: flash_attn_func(q, k, v, causal=causal),
        "native_nopp": lambda: flash_attn_func(q, k, v, causal=causal,
                                               backend="fa3-no-pingpong"),
        "padded": lambda: _dv.split_call(flash_attn_func, q, k, v, None, False, causal=causal),
        "d192_kernel": lambda: flash_attn_func(q, k, v_padded, causal=causal)[..., :dv],
    }
    if fa3 is not None:
        def fa3_call():
            out = fa3.flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out
        fns["fa3"] = fa3_call
    return fns


def burst_ms(fn, target_ms: float = 20.0) -> float:
    """Milliseconds per call over a burst sized to about target_ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    n = max(1, min(200, int(target_ms / max(start.elapsed_time(end), 1e-3))))
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def reference_rows(q, k, v, causal, rows=128):
    """fp32 attention of the first sequence's first `rows` queries (bottom-right causal)."""
    qf, kf, vf = (t[0].float().transpose(0, 1) for t in (q, k, v))  # (h, s, d)
    group = qf.shape[0] // kf.shape[0]
    kf, vf = kf.repeat_interleave(group, 0), vf.repeat_interleave(group, 0)
    s = torch.einsum("hqd,hkd->hqk", qf[:, :rows], kf) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(rows, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    return torch.einsum("hqk,hkd->hqd", s.softmax(-1), vf).transpose(0, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-s", "--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--causal", choices=["on", "off", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    d, dv = 192, 128
    fa3 = fa3_module()
    rows, failed = [], False
    masks = {"on": [True], "off": [False], "both": [False, True]}[args.causal]
    for s in args.seqlens:
        for causal in masks:
            b = max(1, args.tokens // s)
            torch.manual_seed(s)
            q = torch.randn(b, s, args.heads, d, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(b, s, args.heads, d, dtype=torch.bfloat16, device="cuda")
            v = torch.randn(b, s, args.heads, dv, dtype=torch.bfloat16, device="cuda")
            v_padded = F.pad(v, (0, d - dv))
            fns = variants(q, k, v, v_padded, causal, fa3)
            outs, errors = {}, {}
            for name, fn in list(fns.items()):
                try:
                    outs[name] = fn()
                except Exception as exc:  # noqa: BLE001 - a peer that cannot run it: recorded
                    errors[name] = f"{type(exc).__name__}: {exc}"[:300]
                    del fns[name]
            torch.cuda.synchronize()
            ref = reference_rows(q, k, v, causal)
            check = {}
            for name, out in outs.items():
                err = (out[0, :128].float() - ref).abs().max().item()
                diff = (out.float() - outs["native"].float()).abs().max().item()
                check[name] = {"max_abs_vs_fp32": err, "max_abs_vs_native": diff,
                               "passed": err < 2e-2}
                failed |= not err < 2e-2
            times = {name: [] for name in fns}
            names = list(fns)
            for r in range(args.rounds):
                for i in range(len(names)):
                    name = names[(i + r) % len(names)]
                    times[name].append(burst_ms(fns[name]))
            flops = 2.0 * b * s * s * args.heads * (d + dv) * (0.5 if causal else 1.0)
            row = {"seqlen": s, "batch": b, "heads": args.heads, "head_dim": d, "head_dim_v": dv,
                   "causal": causal, "ms": {}, "tflops": {}, "spread": {}, "check": check,
                   "errors": errors}
            for name, ts in times.items():
                med = statistics.median(ts)
                row["ms"][name] = med
                row["tflops"][name] = flops / med / 1e9
                row["spread"][name] = (max(ts) - min(ts)) / med
            rows.append(row)
            tf = row["tflops"]
            line = " ".join(f"{n} {tf[n]:.0f}" for n in tf)
            ratio = tf["native"] / tf["padded"]
            peer = f" native/fa3 {tf['native'] / tf['fa3']:.3f}" if "fa3" in tf else ""
            print(f"s{s} {'c' if causal else 'n'} b{b}: {line} | native/padded {ratio:.3f}{peer}"
                  + (f" errors {errors}" if errors else ""), flush=True)
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "fa3": getattr(fa3, "__name__", None),
                "flops": "2 b s^2 h (d + dv), halved causal"}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
