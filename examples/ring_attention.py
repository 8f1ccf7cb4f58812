"""Ring attention (context parallelism) end to end: one sequence sharded over the ranks,
forward and backward through flash_hopper.distributed.ring_flash_attn_func, checked against
attention over the whole sequence on one rank.

    torchrun --nproc-per-node 2 examples/ring_attention.py              # GPUs: NCCL, bf16 kernels
    torchrun --nproc-per-node 2 examples/ring_attention.py --device cpu # CPU: gloo, fp32 reference

Every rank builds the same full q, k, v (one seed), keeps its zigzag shard, runs the ring; rank 0
gathers the shards of out and of the gradients and compares them with flash_attn_func (GPU) or
the torch reference (CPU) over the whole sequence.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from flash_hopper import distributed as cp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--heads", default="16/4", help="query / KV heads (default 16/4)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layout", choices=cp.LAYOUTS, default="zigzag")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    rank, world, device = cp.init_from_torchrun(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads_q, heads_kv = (int(x) for x in args.heads.split("/"))

    g = torch.Generator(device="cpu").manual_seed(0)  # the same full tensors on every rank
    q, k, v, dout = (torch.randn(1, args.seqlen, h, args.head_dim, generator=g)
                     for h in (heads_q, heads_kv, heads_kv, heads_q))
    q, k, v, dout = (t.to(device, dtype) for t in (q, k, v, dout))
    mine = [cp.shard(t, rank, world, args.layout).requires_grad_(t is not dout)
            for t in (q, k, v, dout)]
    out = cp.ring_flash_attn_func(*mine[:3], causal=args.causal, layout=args.layout)
    out.backward(mine[3])

    def gather(t: torch.Tensor) -> torch.Tensor:
        pieces = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(pieces, t.contiguous())
        return cp.unshard(pieces, args.layout)

    got = [gather(t) for t in (out.detach(), mine[0].grad, mine[1].grad, mine[2].grad)]
    if rank == 0:
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        if cuda:
            from flash_hopper import flash_attn_func

            want_out = flash_attn_func(*full, causal=args.causal)
        else:
            from flash_hopper.reference import attention_ref

            want_out = attention_ref(*full, args.head_dim ** -0.5,
                                     window_size=(-1, 0) if args.causal else (-1, -1))[0]
        want_out.backward(dout)
        want = [want_out.detach(), *(t.grad for t in full)]
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            err = (a.float() - b.float()).abs().max().item()
            print(f"{name}: max |ring - single| = {err:.3e}")
        print(f"ring attention over {world} ranks ({args.layout}, causal={args.causal}, "
              f"{args.device}): done")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
