"""The ring's scaling measurement (distributed.py): fwd + bwd of one long sequence on one GPU
against the ring on W GPUs, with the evidence that the K / V transfers hide under the kernels.

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
warm-up (wall clock on the CPU). JSON rows: one per (seqlen, causal, sm_margin).

The timeline (CUDA, every rank, one more ring iteration under torch.profiler): the NCCL kernels'
time, the part of it that ran while a compute kernel ran, and the compute stream's gaps (time
between the first and the last compute kernel that no compute kernel covers: where the ring
waited for a transfer). --sm-margins: the kernels leave that many SMs free (KernelBlocks'
sm_margin); a persistent kernel on every SM keeps an NCCL kernel waiting until it ends.
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


def kernel_overlap(kernels) -> dict:
    """From (name, start_us, end_us) of the GPU kernels of one iteration: the NCCL kernels' time
    (ms), the part of it concurrent with compute kernels, and the compute gaps (ms)."""
    nccl = [(a, b) for name, a, b in kernels if "nccl" in name.lower()]
    compute = sorted((a, b) for name, a, b in kernels if "nccl" not in name.lower())
    union: list[list[float]] = []
    for a, b in compute:
        if union and a <= union[-1][1]:
            union[-1][1] = max(union[-1][1], b)
        else:
            union.append([a, b])
    covered = sum(b - a for a, b in union)
    span = union[-1][1] - union[0][0] if union else 0.0
    shared = sum(max(0.0, min(b, ub) - max(a, ua)) for a, b in nccl for ua, ub in union)
    return {"nccl_ms": sum(b - a for a, b in nccl) / 1e3, "nccl_concurrent_ms": shared / 1e3,
            "compute_ms": covered / 1e3, "compute_gaps_ms": (span - covered) / 1e3,
            "nccl_kernels": len(nccl)}


def _timeline(fn) -> dict:
    """kernel_overlap of one call of ``fn`` (torch.profiler's trace of the CUDA kernels), and
    the most CTAs an NCCL kernel launched (the SMs it needs beside ours)."""
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    kernels = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events]
    row = kernel_overlap(kernels)
    row["nccl_ctas"] = max((e["args"]["grid"][0] * e["args"]["grid"][1] * e["args"]["grid"][2]
                            for e in events if "nccl" in e["name"].lower()), default=0)
    return row


def single_fwd_bwd(full, causal):
    """Forward + backward over the whole sequence on one device: flash_attn_func (CUDA) or the
    torch reference; ``full`` = [q, k, v, dout]."""
    def run():
        leaves = [t.detach().requires_grad_() for t in full[:3]]
        if leaves[0].is_cuda:
            from flash_hopper import flash_attn_func

            out = flash_attn_func(*leaves, causal=causal)
        else:
            from flash_hopper.reference import attention_ref

            out = attention_ref(*leaves, causal=causal)[0]
        out.backward(full[3])
    return run


def blocks_alone(ring, q, k, v, dout):
    """The ring's compute alone on ``ring.rank``: for every step, the block calls of that step on
    local tensors (this rank's K / V stand in for the owner's), forward then backward."""
    outs = []
    for step in range(cp._steps(ring)):
        owner = (ring.rank - step) % ring.world
        for start, chunk in cp._sequences(ring):
            for call in cp._calls(ring, owner, chunk):
                rows = slice(start + call.i * chunk, start + call.i * chunk + call.rows)
                keys = slice(start + call.j * chunk, start + call.j * chunk + call.keys)
                o, lse = ring.blocks.fwd(q[:, rows], k[:, keys], v[:, keys], call.window,
                                         ring.scale, 0.0)
                outs.append((rows, keys, call.window, o, lse))
    for rows, keys, window, o, lse in outs:
        ring.blocks.bwd(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], o, lse, window,
                        ring.scale, 0.0)


def local_ring(rank, world, layout, causal, scale, blocks, tokens):
    """The ring's description for rank ``rank`` of one dense sequence of ``tokens`` local tokens
    (no process group: the benches drive its steps themselves)."""
    return cp._Ring(None, rank, world, layout, (-1, 0) if causal else (-1, -1), scale, 0.0,
                    blocks, ((0, tokens),))


def _compute_only(q, k, v, dout, causal, layout, blocks):
    ring = local_ring(dist.get_rank(), dist.get_world_size(), layout, causal,
                      q.shape[-1] ** -0.5, blocks, q.shape[1])
    blocks_alone(ring, q, k, v, dout)


def _measure_case(args, seqlen, causal, layout, rank, world, device, dtype, heads, margins,
                  measure) -> list[dict]:
    """One (seqlen, mask) case on every rank, a row per margin; rank 0 returns the rows."""
    cuda = device.type == "cuda"
    heads_q, heads_kv = heads
    g = torch.Generator(device="cpu").manual_seed(seqlen)
    full = [torch.randn(1, seqlen, h, args.head_dim, generator=g).to(device, dtype)
            for h in (heads_q, heads_kv, heads_kv, heads_q)]
    single = measure(single_fwd_bwd(full, causal), args.iters) if rank == 0 else None
    dist.barrier()
    mine = [cp.shard(t, rank, world, layout) for t in full]
    full.clear()  # the whole sequence is not needed past this point
    rows = []
    for margin in margins:
        blocks = cp.KernelBlocks(sm_margin=margin) if cuda else cp.reference_blocks

        def run_ring(blocks=blocks):
            leaves = [t.detach().requires_grad_() for t in mine[:3]]
            out = cp.ring_flash_attn_func(*leaves, causal=causal, layout=layout, blocks=blocks)
            out.backward(mine[3])

        ring = measure(run_ring, args.iters)
        compute = measure(lambda blocks=blocks: _compute_only(*mine, causal, layout, blocks),
                          args.iters)
        timeline = _timeline(run_ring) if cuda else {}
        times = torch.tensor([ring, compute], dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's
        everyone = [None] * world
        dist.all_gather_object(everyone, timeline)
        rows.append({"seqlen": seqlen, "causal": causal, "layout": layout, "world": world,
                     "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": args.head_dim,
                     "sm_margin": margin, "device": args.device, "single_s": single,
                     "ring_s": times[0].item(), "compute_only_s": times[1].item(),
                     "speedup": single / times[0].item() if single else None,
                     "overlap": times[1].item() / times[0].item(), "timeline": everyone})
    return rows if rank == 0 else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--heads", default="16/4", help="query / KV heads (default 16/4)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--sm-margins", type=int, nargs="+", default=[0],
                        help="SMs the kernels leave free for NCCL (one row each; CUDA)")
    parser.add_argument("--out", help="JSON file for the rows (rank 0 writes it)")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    rank, world, device = cp.init_from_torchrun(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads_q, heads_kv = (int(x) for x in args.heads.split("/"))
    measure = _timer(cuda)
    margins = args.sm_margins if cuda else [0]
    rows = []
    for seqlen in args.seqlens:
        for causal, layout in ((True, "zigzag"), (False, "contiguous")):
            for row in _measure_case(args, seqlen, causal, layout, rank, world, device, dtype,
                                     (heads_q, heads_kv), margins, measure):
                rows.append(row)
                print(json.dumps(row), flush=True)
    if rank == 0 and args.out:
        meta = {"gpu": torch.cuda.get_device_name() if cuda else "cpu",
                "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                "command": "torchrun --nproc-per-node W bench/ring_scaling.py ...",
                "bar": "speedup >= 1.85 on two H200s (ring attention)"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
