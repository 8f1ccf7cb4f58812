"""The ring of distributed.py on ONE device: every rank's share of the ring's fwd + bwd, timed in
turn, to predict the two-GPU speedup before two GPUs are lent (and to see where the ring's own
time goes).

    python bench/ring_emulate.py --world 2 --seqlens 131072 262144 --out e.json
    python bench/ring_emulate.py --device cpu --seqlens 256 --head-dim 16 --heads 2/1 --iters 1

Per (seqlen, mask) as bench/ring_scaling.py (causal zigzag, non-causal contiguous):
- single: flash_attn_func forward + backward over the whole sequence;
- rank r (each of --world): ring_flash_attn_func's forward + backward as rank r runs them (the
  same block pairs, masks, merges and fp32 gradient sums), with every exchange replaced by a
  loopback (the block in hand stands in for the one that would arrive: same shapes, so the same
  work; the values differ, so nothing is checked here: the CPU tests over gloo and the two-GPU
  test check the values);
- blocks: rank r's block attention alone (no merges, no sums): the kernels' share.
predicted = single / (max_r rank_r + t_home), where t_home = the last dK / dV transfer, the one
no compute hides (bytes / --link-gbps; the K / V transfers and the earlier dK / dV ones overlap
the next step's kernels on two GPUs, and the NCCL kernels' share of the SMs is not modelled).
--sm-margins: rows for kernels that leave SMs free (KernelBlocks' sm_margin; the cost of room
for NCCL). --probe: whether a kernel on another stream (a copy of one step's K / V bytes, the
NCCL kernel's stand-in) runs beside the largest forward call of rank 0 at each margin, or waits
for it to end: its latency from launch to end against the call's time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import ring_scaling  # this folder's: the same timer and single-device run
import torch
from flash_hopper import distributed as cp


@contextlib.contextmanager
def loopback():
    """Exchanges hand back what was sent (one device stands in for the ring)."""
    real = cp._start_exchange
    cp._start_exchange = lambda ring, tensors, hops=1: cp._Exchange([], list(tensors), [])
    try:
        yield
    finally:
        cp._start_exchange = real


def rank_share(ring, q, k, v, dout):
    """Rank ``ring.rank``'s ring forward + backward (call under ``loopback``)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, _ = cp._RingAttention.apply(*leaves, ring)
    out.backward(dout)


def kernel_profile(fn, top: int = 12) -> list[dict]:
    """GPU kernel time of one call of ``fn`` by kernel name (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = e.cuda_time_total
        if us > 0:
            rows.append({"name": e.key[:90], "calls": e.count, "ms": us / 1e3})
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top]


def probe(q, k, v, window, scale, margin: int, side_bytes: int) -> dict:
    """A copy of ``side_bytes`` on a side stream, launched ~1 ms after a forward call with
    ``margin`` SMs left free starts: the copy's latency and the call's time (ms)."""
    blocks = cp.KernelBlocks(sm_margin=margin)
    src = torch.empty(side_bytes, dtype=torch.uint8, device=q.device)
    dst = torch.empty_like(src)
    side = torch.cuda.Stream(device=q.device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    blocks.fwd(q, k, v, window, scale, 0.0)  # warm-up
    dst.copy_(src)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(2e6))  # ~1 ms at 1.98 GHz: the call is running by then
        events[0].record(side)
        dst.copy_(src)
        events[1].record(side)
    events[2].record()
    blocks.fwd(q, k, v, window, scale, 0.0)
    events[3].record()
    torch.cuda.synchronize()
    return {"sm_margin": margin, "copy_latency_ms": events[0].elapsed_time(events[1]),
            "call_ms": events[2].elapsed_time(events[3]),
            "copy_end_after_call_start_ms": events[2].elapsed_time(events[1])}


def _rank_row(args, mine, rank, layout, causal, scale, blocks, measure) -> dict:
    cuda = mine[0].is_cuda
    ring = ring_scaling.local_ring(rank, args.world, layout, causal, scale, blocks,
                                   mine[0].shape[1])
    with loopback():
        share = measure(lambda: rank_share(ring, *mine))
        prof = kernel_profile(lambda: rank_share(ring, *mine)) if cuda and args.profile else None
    alone = measure(lambda: ring_scaling.blocks_alone(ring, *mine))
    return {"rank": rank, "ring_s": share, "blocks_s": alone, "overhead_s": share - alone,
            "sm_margin": getattr(blocks, "sm_margin", 0), "kernels": prof}


def measure_case(args, seqlen, causal, layout, device, dtype, measure) -> dict:
    cuda = device.type == "cuda"
    heads_q, heads_kv = (int(x) for x in args.heads.split("/"))
    g = torch.Generator(device="cpu").manual_seed(seqlen)
    full = [torch.randn(1, seqlen, h, args.head_dim, generator=g).to(device, dtype)
            for h in (heads_q, heads_kv, heads_kv, heads_q)]
    scale = args.head_dim ** -0.5
    single = measure(ring_scaling.single_fwd_bwd(full, causal))
    ranks = []
    for margin in args.sm_margins if cuda else [0]:
        blocks = cp.KernelBlocks(sm_margin=margin) if cuda else cp.reference_blocks
        ranks += [_rank_row(args, [cp.shard(t, rank, args.world, layout) for t in full], rank,
                            layout, causal, scale, blocks, measure)
                  for rank in range(args.world if margin == args.sm_margins[0] else 1)]
    kv_bytes = 2 * seqlen // args.world * heads_kv * args.head_dim * full[1].element_size()
    dkv_bytes = 2 * seqlen // args.world * heads_kv * args.head_dim * 4
    t_home = dkv_bytes / (args.link_gbps * 1e9)
    first = [r for r in ranks if r["sm_margin"] == ranks[0]["sm_margin"]]  # every rank
    slowest = max(r["ring_s"] for r in first)
    probes = []
    if cuda and args.probe:
        mine = [cp.shard(t, 0, args.world, layout) for t in full[:3]]
        window = (-1, -1)  # rank 0's largest call has no mask (its home step's full part)
        probes = [probe(*mine, window, scale, m, kv_bytes) for m in args.sm_margins]
    return {"seqlen": seqlen, "causal": causal, "layout": layout, "world": args.world,
            "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": args.head_dim,
            "single_s": single, "ranks": ranks, "kv_bytes_per_step": kv_bytes,
            "dkv_bytes_per_step": dkv_bytes, "link_gbps": args.link_gbps, "t_home_s": t_home,
            "predicted_speedup": single / (slowest + t_home),
            "compute_bound_speedup": single / max(r["blocks_s"] for r in first),
            "probe": probes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--heads", default="16/4", help="query / KV heads (default 16/4)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--link-gbps", type=float, default=300.0,
                        help="assumed GB/s of one NCCL send between the GPUs (for t_home)")
    parser.add_argument("--profile", action="store_true", help="kernel times per rank (CUDA)")
    parser.add_argument("--sm-margins", type=int, nargs="+", default=[0],
                        help="KernelBlocks' sm_margin per row set (the first: every rank)")
    parser.add_argument("--probe", action="store_true",
                        help="side-stream copy beside a forward call at each margin (CUDA)")
    parser.add_argument("--out", help="JSON file for the rows")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    device = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    timer = ring_scaling._timer(cuda)

    def measure(fn):
        return timer(fn, args.iters)

    rows = []
    for seqlen in args.seqlens:
        for causal, layout in ((True, "zigzag"), (False, "contiguous")):
            row = measure_case(args, seqlen, causal, layout, device, dtype, measure)
            rows.append(row)
            brief = {k: v for k, v in row.items() if k != "ranks"}
            brief["ranks"] = [{k: v for k, v in r.items() if k != "kernels"} for r in row["ranks"]]
            print(json.dumps(brief), flush=True)
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                "command": "python bench/ring_emulate.py ...",
                "what": "ring attention: the ring's per-rank share on one device (exchanges looped "
                        "back), the predicted two-GPU speedup"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
