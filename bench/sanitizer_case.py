"""Small cases for compute-sanitizer (memcheck / racecheck / synccheck), forward or backward.

Odd lengths, a partial head dim, GQA, causal, window and softcap on every built head-dim bucket:
every predicated load/store path of the kernels runs at least once, at sizes the sanitizer can
afford. Outputs and LSE (backward: dq, dk, dv, in both the default and the deterministic mode)
are NaN-filled before each launch; exits non-zero if one is left NaN (an element not written),
or if no case ran at all (a sanitizer step that checked nothing must not pass: a build without
the requested path fails here instead).
"""

import argparse
import sys

import flash_hopper
import torch
from flash_hopper import _validate, ops


# (seqlen_q, seqlen_k, causal, window, softcap) of every bucket and dtype.
CASES = [
    (17, 113, False, (-1, -1), 0.0),
    (113, 17, True, (-1, -1), 0.0),
    (65, 130, False, (20, 3), 5.0),
    (1, 1, True, (-1, -1), 0.0),
    (300, 300, True, (-1, -1), 0.0),
    # masked with seqlen_k > 2048: the fa3 default tile where a bucket has a separate short one
    # (16-bit d128's short-masked tile, FP8 d64's short-keys tile)
    (40, 2100, True, (-1, -1), 0.0),
]


def fp8_cases(d: int, num_sms: int) -> int:
    """The FP8 forward on CASES (flash_attn_func with per-head descales; the
    grid capped through sm_margin), out and LSE checked for unwritten (NaN) elements: the
    caching allocator hands out blocks that were just filled with NaN."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    margin = max(0, sms - num_sms) if num_sms else 0
    cases = 0
    for sq, sk, causal, window, softcap in CASES:
        q, k, v = (torch.randn(2, s, h, d, device="cuda").to(torch.float8_e4m3fn)
                   for s, h in ((sq, 4), (sk, 2), (sk, 2)))
        descales = [torch.rand(2, 2, device="cuda") + 0.5 for _ in range(3)]
        junk = [torch.full((2, sq, 4, d), float("nan"), device="cuda", dtype=torch.bfloat16),
                torch.full((2, 4, sq), float("nan"), device="cuda")]
        del junk
        out, lse = flash_hopper.flash_attn_func(
            q, k, v, causal=causal, window_size=window, softcap=softcap, q_descale=descales[0],
            k_descale=descales[1], v_descale=descales[2], return_attn_probs=True,
            sm_margin=margin)
        torch.cuda.synchronize()
        if torch.isnan(out).any() or torch.isnan(lse).any():
            print(f"NaN left in out or lse: e4m3 d={d} sq={sq} sk={sk}")
            raise SystemExit(1)
        cases += 1
    return cases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="fa2", help="fa2, fa3 or an fa3 variant")
    ap.add_argument("--num-sms", type=int, default=0,
                    help="cap the fa3 persistent grid (3: each CTA walks several tiles)")
    ap.add_argument("--direction", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--head-dims", type=int, nargs="+", default=None,
                    help="buckets to run (default: every built one); racecheck is slow")
    ap.add_argument("--dtypes", nargs="+", default=None, help="default: every built one")
    args = ap.parse_args()

    info = flash_hopper.build_info()
    arch = "90" if args.backend.startswith("fa3") else "80"
    if not any(str(a).lstrip("sm").startswith(arch) for a in info.get("archs", ())):
        print(f"sanitizer cases run: 0 ({args.backend}: library built without sm{arch} kernels; "
              "choose the paths with FH_SANITIZER_BACKENDS)")
        return 1
    torch.manual_seed(0)
    cases = 0
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
    for dtype_name in args.dtypes or [d for d in info["dtypes"] if d in dtypes]:
        dtype = dtypes[dtype_name]
        buckets = args.head_dims or info["head_dims"]
        if dtype_name == "e4m3":  # the FA-3 path's forward only, its own buckets
            if not args.backend.startswith("fa3") or args.direction != "fwd":
                continue
            buckets = [b for b in buckets if any(
                k["direction"] == "fwd" and k["backend"] == "fa3" and k["dtype"] == "e4m3"
                and k["head_dim"] == b for k in info["kernels"])]
            for bucket in buckets:
                cases += fp8_cases(bucket, args.num_sms)
            continue
        if args.direction == "bwd":  # the buckets this path has a backward kernel for
            path = "fa3" if args.backend.startswith("fa3") else "fa2"
            buckets = [b for b in buckets if any(
                k["direction"] == "bwd" and k["backend"] == path and k["dtype"] == dtype_name
                and k["head_dim"] == b for k in info["kernels"])]
        for bucket in buckets:
            for d in sorted({bucket, bucket - 8}):
                for sq, sk, causal, window, softcap in CASES:
                    q = torch.randn(2, sq, 4, d, device="cuda", dtype=dtype)
                    k = torch.randn(2, sk, 2, d, device="cuda", dtype=dtype)
                    v = torch.randn(2, sk, 2, d, device="cuda", dtype=dtype)
                    cfg = _validate.check_fwd_args(q, k, v, None, causal, window, softcap,
                                                   args.backend)
                    out = torch.full_like(q, float("nan"))
                    lse = torch.full((2, 4, sq), float("nan"), device="cuda")
                    ops.fwd_into(q, k, v, out, lse, cfg.softmax_scale, cfg.window_left,
                                 cfg.window_right, cfg.softcap, args.backend,
                                 num_sms=args.num_sms)
                    torch.cuda.synchronize()
                    if torch.isnan(out).any() or torch.isnan(lse).any():
                        print(f"NaN left in out or lse: {dtype_name} d={d} sq={sq} sk={sk}")
                        return 1
                    if args.direction == "bwd":
                        dout = torch.randn_like(out)
                        for deterministic in (False, True):
                            grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
                            ops.bwd_into(dout, q, k, v, out, lse, *grads, cfg.softmax_scale,
                                         cfg.window_left, cfg.window_right, cfg.softcap,
                                         args.backend, deterministic, num_sms=args.num_sms)
                            torch.cuda.synchronize()
                            if any(torch.isnan(g).any() for g in grads):
                                print(f"NaN left in dq/dk/dv: {dtype_name} d={d} sq={sq} "
                                      f"sk={sk} deterministic={deterministic}")
                                return 1
                    cases += 1
    print(f"sanitizer cases run: {cases}")
    return 0 if cases else 1


if __name__ == "__main__":
    sys.exit(main())
