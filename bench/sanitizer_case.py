"""Small forward cases for compute-sanitizer (memcheck / racecheck / initcheck).

Odd lengths, a partial head dim, GQA, causal, window and softcap on every built head-dim bucket:
every predicated load/store path of the kernels runs at least once, at sizes the sanitizer can
afford. Exits non-zero if a result is NaN where it must not be.
"""

import argparse
import sys

import torch

import flash_hopper


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="fa2")
    args = ap.parse_args()

    info = flash_hopper.build_info()
    torch.manual_seed(0)
    cases = 0
    for dtype_name in info["dtypes"]:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
        for bucket in info["head_dims"]:
            for d in sorted({bucket, bucket - 8}):
                for sq, sk, causal, window, softcap in [
                    (17, 113, False, (-1, -1), 0.0),
                    (113, 17, True, (-1, -1), 0.0),
                    (65, 130, False, (20, 3), 5.0),
                    (1, 1, True, (-1, -1), 0.0),
                ]:
                    q = torch.randn(2, sq, 4, d, device="cuda", dtype=dtype)
                    k = torch.randn(2, sk, 2, d, device="cuda", dtype=dtype)
                    v = torch.randn(2, sk, 2, d, device="cuda", dtype=dtype)
                    out, lse = flash_hopper.flash_attn_func(
                        q, k, v, causal=causal, window_size=window, softcap=softcap,
                        return_attn_probs=True, backend=args.backend)
                    torch.cuda.synchronize()
                    if torch.isnan(out).any():
                        print(f"NaN in output: {dtype_name} d={d} sq={sq} sk={sk}")
                        return 1
                    cases += 1
    print(f"sanitizer cases run: {cases}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
