"""Issue 16's scaling measurement: fwd + bwd of one long sequence on one GPU against the ring on
W GPUs, with the evidence that the K / V transfers hide under the kernels.

    torchrun --nproc-per-node 2 bench/ring_scaling.py --seqlens 131072 262144 --out r.json
    torchrun --nproc-per-node 2 bench/ring_scaling.py --device cpu --seqlens 256 --iters 1

Per sequence length and mask (causal with the zigzag layout, non-causal):
- single: rank 0 alone, flash_attn_func forward + backward over the whole sequence (the other
  ranks wait);
- ring: every rank its shard, ring_flash_attn_func forward + backward;
- compute: the same ring schedule with the block attention timed alone (the ring's blocks run on
  each rank without any exchange: what the ring would take if the transfers were free);
speedup = single / ring (the bar: >= 1.85 on two H200s); overlap = compute / ring (1.0: the
transfers fully hidden). Times are medians of --iters CUDA-event-timed iterations after a
warm-up (wall clock on the CPU). JSON rows: one per (seqlen, causal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from flash_hopper import distributed as cp


def _timer(cuda: bool):
    def measure(fn, iters: int) -> float:
        fn()  # warm-up: plans, NCCL channels
        times = []
        for _ in range(iters):
            if cuda:
                torch.cuda.synchronize()
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return measure


def _compute_only(q, k, v, dout, causal, layout, blocks):
    """The ring's compute alone: for every step, the block pairs of that step on local tensors
    (this rank's K / V stand in for the owner's), forward then backward."""
    ring = cp._Ring(None, dist.get_rank(), dist.get_world_size(), layout,
                    (-1, 0) if causal else (-1, -1), q.shape[-1] ** -0.5, 0.0, blocks,
                    ((0, q.shape[1]),))
    outs = []
    for step in range(ring.world):
        owner = (ring.rank - step) % ring.world
        for start, chunk in cp._sequences(ring):
            for pair in cp._pairs(ring, owner, chunk):
                rows = slice(start + pair.i * chunk, start + pair.i * chunk + pair.rows)
                keys = slice(start + pair.j * chunk, start + pair.j * chunk + pair.keys)
                o, lse = blocks.fwd(q[:, rows], k[:, keys], v[:, keys], pair.window, ring.scale,
                                    0.0)
                outs.append((rows, keys, pair.window, o, lse))
    for rows, keys, window, o, lse in outs:
        blocks.bwd(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], o, lse, window, ring.scale,
                   0.0)


def _measure_case(args, seqlen, causal, layout, rank, world, device, dtype, heads, blocks,
                  measure) -> dict | None:
    """One (seqlen, mask) case on every rank; rank 0 returns its row."""
    cuda = device.type == "cuda"
    heads_q, heads_kv = heads
    g = torch.Generator(device="cpu").manual_seed(seqlen)
    full = [torch.randn(1, seqlen, h, args.head_dim, generator=g).to(device, dtype)
            for h in (heads_q, heads_kv, heads_kv, heads_q)]
    single = None
    if rank == 0:
        def run_single():
            leaves = [t.detach().requires_grad_() for t in full[:3]]
            if cuda:
                from flash_hopper import flash_attn_func

                out = flash_attn_func(*leaves, causal=causal)
            else:
                from flash_hopper.reference import attention_ref

                out = attention_ref(*leaves, causal=causal)[0]
            out.backward(full[3])
        single = measure(run_single, args.iters)
    dist.barrier()
    mine = [cp.shard(t, rank, world, layout) for t in full]
    full.clear()  # the whole sequence is not needed past this point

    def run_ring():
        leaves = [t.detach().requires_grad_() for t in mine[:3]]
        out = cp.ring_flash_attn_func(*leaves, causal=causal, layout=layout, blocks=blocks)
        out.backward(mine[3])

    ring = measure(run_ring, args.iters)
    compute = measure(lambda: _compute_only(*mine, causal, layout, blocks), args.iters)
    times = torch.tensor([ring, compute], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's
    if rank != 0:
        return None
    return {"seqlen": seqlen, "causal": causal, "layout": layout, "world": world,
            "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": args.head_dim,
            "device": args.device, "single_s": single, "ring_s": times[0].item(),
            "compute_only_s": times[1].item(), "speedup": single / times[0].item(),
            "overlap": times[1].item() / times[0].item()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--heads", default="16/4", help="query / KV heads (default 16/4)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--out", help="JSON file for the rows (rank 0 writes it)")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    rank, world, device = cp.init_from_torchrun(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads_q, heads_kv = (int(x) for x in args.heads.split("/"))
    measure = _timer(cuda)
    blocks = cp.KernelBlocks() if cuda else cp.reference_blocks
    rows = []
    for seqlen in args.seqlens:
        for causal, layout in ((True, "zigzag"), (False, "contiguous")):
            row = _measure_case(args, seqlen, causal, layout, rank, world, device, dtype,
                                (heads_q, heads_kv), blocks, measure)
            if row is not None:
                rows.append(row)
                print(json.dumps(row), flush=True)
    if rank == 0 and args.out:
        meta = {"gpu": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                "command": "torchrun --nproc-per-node W bench/ring_scaling.py ...",
                "bar": "speedup >= 1.85 on two H200s (issue 16)"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
