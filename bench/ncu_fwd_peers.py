"""One forward launch of flash-hopper or of a peer (FA3's fa3_fwd_interface / flash_attn_3, FA4's
flash_attn.cute), between cudaProfilerStart and Stop, for ncu side by side on the same config:

    ncu --profile-from-start off --set full --import-source yes -o ours \\
        python bench/ncu_fwd_peers.py --backend flash-hopper --dtype e4m3 -d 128 -s 8192
    ncu --profile-from-start off --set full --import-source yes -o fa3 \\
        python bench/ncu_fwd_peers.py --backend flash-attn3 --dtype e4m3 -d 128 -s 8192
    ncu --import ours.ncu-rep --page details --csv > ours.csv   (or --page source)

b * s = 16k and h * d = 2048 as the benchmark's sweep (--batch / --heads override), causal with
--causal; e4m3 inputs quantized per head (flash_hopper.fp8.quantize, q per kv head) with their
descales passed to both. Three warm-up calls run before the profiled one (autotuning, plans, TMA
descriptors), so the profiled launch is the steady-state kernel.
"""

from __future__ import annotations

import argparse
import importlib


def peer_func(backend: str):
    if backend == "flash-hopper":
        from flash_hopper import flash_attn_func
        return flash_attn_func
    if backend == "flash-attn3":
        for name in ("fa3_fwd_interface", "flash_attn_interface", "flash_attn_3"):
            try:
                return importlib.import_module(name).flash_attn_func
            except (ImportError, AttributeError):
                continue
        raise SystemExit("flash-attn3: none of fa3_fwd_interface, flash_attn_interface, "
                         "flash_attn_3 is importable")
    if backend == "flash-attn-cute":
        from flash_attn.cute import flash_attn_func
        return flash_attn_func
    raise SystemExit(f"--backend: expected flash-hopper, flash-attn3 or flash-attn-cute, "
                     f"got {backend!r}")


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="flash-hopper")
    ap.add_argument("--dtype", choices=["bf16", "e4m3"], default="bf16")
    ap.add_argument("-d", "--head-dim", type=int, default=128)
    ap.add_argument("-s", "--seqlen", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=0, help="default 16k // seqlen")
    ap.add_argument("--heads", type=int, default=0, help="default 2048 // head_dim")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    func = peer_func(args.backend)
    batch = args.batch or max(1, 16384 // args.seqlen)
    heads = args.heads or 2048 // args.head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, args.seqlen, heads, args.head_dim, device="cuda",
                           dtype=torch.bfloat16, generator=g) for _ in range(3))
    kw = {"causal": args.causal}
    if args.dtype == "e4m3":
        from flash_hopper.fp8 import quantize

        (q, qd), (k, kd), (v, vd) = (quantize(t, "head", heads_kv=heads) for t in (q, k, v))
        kw.update(q_descale=qd, k_descale=kd, v_descale=vd)
    for _ in range(3):
        func(q, k, v, **kw)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    func(q, k, v, **kw)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
