"""A / B of decode-kernel variants side by side with cuDNN, in one process (the decode
kernel's tuning, docs/decode.md).

    python bench/decode_ab.py --out ab.json [--points 1x8k 1x128k 8x32k 64x1k] \
        [--variants dense paged:s32 paged16:s16:st3 ...] [--reps 3]

A variant is NAME[:sN][:stM]: NAME "dense" (a dense cache) or "paged" / "pagedP" (a pool of P-key
pages, default 16, shuffled, read through a page table); sN passes num_splits=N (default 0: the
library's choice); stM sets FLASH_HOPPER_DECODE_STAGES=M for the call (the kernel reads it per
call; counts other than those a known GPU runs need a library built with
FH_DECODE_EVERY_STAGE_COUNT=ON, and the script refuses a count the library would not run). Every point runs each variant and cuDNN (SDPA, dense cache) as CUDA-graph replays
(bench/decode's timer), interleaved over --reps repeats, and reports the median. GQA 32 / 8, d128,
bf16, one query token unless --heads / -d / --seqlen-q say otherwise. parse_variant() is plain
Python (tests/test_bench_decode.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variant:
    label: str
    page_size: int | None  # None: a dense cache
    splits: int = 0
    stages: int | None = None


def parse_variant(text: str) -> Variant:
    """'dense', 'paged', 'paged64', with ':sN' / ':stM' parts in any order."""
    name, *parts = text.split(":")
    if name == "dense":
        page = None
    elif name.startswith("paged"):
        digits = name[len("paged"):]
        if digits and not digits.isdigit():
            raise ValueError(f"variant {text!r}: expected paged or pagedP (P an int >= 1)")
        page = int(digits) if digits else 16
        if page < 1:
            raise ValueError(f"variant {text!r}: the page size must be >= 1")
    else:
        raise ValueError(f"variant {text!r}: expected dense, paged or pagedP first")
    splits, stages = 0, None
    for part in parts:
        if part.startswith("st") and part[2:].isdigit():
            stages = int(part[2:])
        elif part.startswith("s") and part[1:].isdigit():
            splits = int(part[1:])
        else:
            raise ValueError(f"variant {text!r}: expected :sN (splits) or :stM (stages), "
                             f"got {part!r}")
    return Variant(text, page, splits, stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", nargs="+", default=["1x8k", "1x128k", "8x32k", "64x1k"])
    ap.add_argument("--variants", nargs="+", default=["dense", "paged"])
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("-d", "--head-dim", type=int, default=128)
    ap.add_argument("--seqlen-q", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variants]

    import flash_hopper as fh
    import torch
    import torch.nn.functional as F
    from flash_hopper import _device, _lib
    from flash_hopper.bench.decode import graph_time_us, paged_copy, parse_heads, parse_point
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hk = parse_heads(args.heads)
    d, sq = args.head_dim, args.seqlen_q
    # A stage count the library did not compile leaves the tuned one (FH_DECODE_EVERY_STAGE_COUNT
    # builds them all): refuse rather than time the tuned count under another label.
    lib = _lib.get_library()
    smem = _device.device_info(torch.cuda.current_device()).max_smem_per_block_optin or 227 * 1024
    for x in variants:
        if x.stages is not None:
            os.environ["FLASH_HOPPER_DECODE_STAGES"] = str(x.stages)
            got = lib.decode_stages(d, smem)
            os.environ.pop("FLASH_HOPPER_DECODE_STAGES", None)
            if got != x.stages:
                raise SystemExit(f"{x.label}: this library runs {got} stages at d{d} for "
                                 f"FLASH_HOPPER_DECODE_STAGES={x.stages}; build it with "
                                 "FH_DECODE_EVERY_STAGE_COUNT=ON to time other counts")

    def measure(spec: str) -> list[dict]:
        b, c = parse_point(spec)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, c, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        lengths = torch.full((b,), c, dtype=torch.int32, device="cuda")
        pools = {p: paged_copy(k, v, p) for p in {x.page_size for x in variants} if p}
        nbytes = 2 * b * c * hk * d * 2
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        def make(x: Variant):
            if x.page_size is None:
                return lambda: fh.flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths,
                                                          causal=True, num_splits=x.splits)
            pk, pv, table = pools[x.page_size]
            return lambda: fh.flash_attn_with_kvcache(q, pk, pv, cache_seqlens=lengths,
                                                      page_table=table, causal=True,
                                                      num_splits=x.splits)

        times: dict[str, list[float]] = {x.label: [] for x in variants}
        times["cudnn"] = []
        for _ in range(args.reps):
            for x in variants:
                if x.stages is None:
                    os.environ.pop("FLASH_HOPPER_DECODE_STAGES", None)
                else:
                    os.environ["FLASH_HOPPER_DECODE_STAGES"] = str(x.stages)
                times[x.label].append(graph_time_us(make(x))[0])
            os.environ.pop("FLASH_HOPPER_DECODE_STAGES", None)
            if sq == 1:  # SDPA's causal mask is top-left aligned: one query token only
                times["cudnn"].append(graph_time_us(cudnn)[0])
        out = []
        for label, ts in times.items():
            if ts:
                us = statistics.median(ts)
                out.append({"point": spec, "variant": label, "us": us,
                            "tbps": nbytes / us * 1e-6, "all_us": ts})
                print(f"{spec:>8} {label:<18} {us:9.1f} us {nbytes / us * 1e-6:5.2f} TB/s",
                      flush=True)
        return out

    rows = []
    for spec in args.points:
        rows.extend(measure(spec))
        torch.cuda.empty_cache()
    meta = {"gpu": torch.cuda.get_device_name(), "heads": args.heads, "head_dim": d,
            "seqlen_q": sq, "reps": args.reps, "flash_hopper": fh.build_info().get("commit"),
            "metric": "us per CUDA-graph-replayed call, median over interleaved repeats"}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
