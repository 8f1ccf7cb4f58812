"""Ring attention on the kernels (issue 16), on GPUs: the kernel block pair against the reference
block pair on one GPU, and the ring over NCCL on two GPUs against single-GPU full attention
(forward and gradients, FA3's tolerance rule: at most twice the error of the same computation in
the input dtype, plus a small absolute term)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from flash_hopper import distributed as ring
from flash_hopper import flash_attn_func
from flash_hopper.reference import attention_ref

from tests._helpers import skip_without_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_matmuls")]
BF16 = torch.bfloat16


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (40, 7), (0, -1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_blocks_match_the_reference_blocks(lib, window, head_dim):
    skip_without_kernel(lib, head_dim, backward=True)
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    q = torch.randn(2, 200, 4, head_dim, device="cuda", dtype=BF16, generator=g)
    k, v = (torch.randn(2, 200, 2, head_dim, device="cuda", dtype=BF16, generator=g)
            for _ in range(2))
    dout = torch.randn_like(q)
    scale = head_dim**-0.5
    kern = ring.KernelBlocks()
    out, lse = kern.fwd(q, k, v, window, scale, 0.0)
    ref_out, ref_lse = ring.reference_blocks.fwd(q.double(), k.double(), v.double(), window,
                                                 scale, 0.0)
    low, _ = attention_ref(q, k, v, scale, window_size=window, upcast=False)
    tol = 2 * (low.double() - ref_out).abs().max().item() + 1e-4
    assert (out.double() - ref_out).abs().max().item() <= tol
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-3
    grads = kern.bwd(dout, q, k, v, out, lse, window, scale, 0.0)
    ref_grads = ring.reference_blocks.bwd(dout.double(), q.double(), k.double(), v.double(),
                                          out.double(), lse.double(), window, scale, 0.0)
    for name, got, want in zip("qkv", grads, ref_grads):
        err = (got.double() - want).abs().max().item()
        assert err <= 3e-2 * want.abs().max().item() + 1e-3, f"d{name}: {err:.3g}"


def test_kernel_blocks_leave_sm_margin_free(lib, tmp_path):
    """KernelBlocks(sm_margin=m): the forward and backward kernels launch at most SMs - m CTAs
    (torch.profiler's trace of their grids; without a margin they fill the GPU), with the same
    output (bitwise: each tile is one CTA's) and the same gradients as without (up to the order
    of dQ's sums)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    skip_without_kernel(lib, 128, backward=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(3)
    # 8 heads x 4096 tokens: hundreds of query and key blocks, more tiles than SMs either way
    q, k, v, dout = (torch.randn(1, 4096, 8, 128, device="cuda", dtype=BF16, generator=g)
                     for _ in range(4))
    grids = {}
    for margin in (0, 20):
        kern = ring.KernelBlocks(sm_margin=margin)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out, lse = kern.fwd(q, k, v, (-1, -1), 0.125, 0.0)
            grads = kern.bwd(dout, q, k, v, out, lse, (-1, -1), 0.125, 0.0)
            torch.cuda.synchronize()
        trace = tmp_path / f"m{margin}.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        grids[margin] = {e["name"].split("<")[0].split()[-1]: e["args"]["grid"] for e in events
                         if e.get("cat") == "kernel" and ("fwd_kernel" in e["name"]
                                                          or "bwd_kernel" in e["name"])}
        if margin == 0:
            ref = (out, lse, grads)
    assert set(grids[0]) == set(grids[20]) == {"flash_hopper::sm90::fwd_kernel",
                                               "flash_hopper::sm90::bwd_kernel"}, grids
    for name, grid in grids[20].items():
        ctas = grid[0] * grid[1] * grid[2]
        full = grids[0][name][0] * grids[0][name][1] * grids[0][name][2]
        assert ctas <= sms - 20 < full, (name, grids)
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    for got, want in zip(grads, ref[2]):
        assert (got.float() - want.float()).abs().max().item() <= 1e-2 * want.abs().max().item()
    with pytest.raises(ValueError, match=f"sm_margin: expected fewer than the device's {sms}"):
        ring.KernelBlocks(sm_margin=sms).fwd(q, k, v, (-1, -1), 0.125, 0.0)


def _worker(rank, world, init_file, layout, causal, head_dim):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        s = 2 * world * 256
        q = torch.randn(1, s, 8, head_dim, device="cuda", dtype=BF16, generator=g)
        k, v = (torch.randn(1, s, 2, head_dim, device="cuda", dtype=BF16, generator=g)
                for _ in range(2))
        dout = torch.randn_like(q)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        full = flash_attn_func(*leaves, causal=causal)
        full.backward(dout)
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref, _ = attention_ref(*ref_leaves, causal=causal)
        ref.backward(dout.double())
        mine = [ring.shard(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
        out = ring.ring_flash_attn_func(*mine, causal=causal, layout=layout)
        out.backward(ring.shard(dout, rank, world, layout))
        pairs = [(out, full, ref)] + [(m.grad, f.grad, r.grad) for m, f, r in
                                      zip(mine, leaves, ref_leaves)]
        for got, single, want in pairs:
            got, single = got.double(), ring.shard(single.double(), rank, world, layout)
            want = ring.shard(want, rank, world, layout)
            bound = 2 * (single - want).abs().max().item() + 1e-3
            assert (got - want).abs().max().item() <= bound
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2)")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("layout", "causal"), [("zigzag", True), ("contiguous", False),
                                                ("zigzag", False), ("contiguous", True)])
def test_ring_on_two_gpus_equals_one_gpu(lib, layout, causal, head_dim):
    skip_without_kernel(lib, head_dim, backward=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), layout, causal, head_dim),
                 nprocs=2, join=True)


def _varlen_worker(rank, world, init_file):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        g = torch.Generator(device="cuda").manual_seed(1)
        lengths = [2 * world * 96, 2 * world * 8, 2 * world * 200]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
        total = sum(lengths)
        q, dout = (torch.randn(total, 8, 128, device="cuda", dtype=BF16, generator=g)
                   for _ in range(2))
        k, v = (torch.randn(total, 2, 128, device="cuda", dtype=BF16, generator=g)
                for _ in range(2))
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        refs = [attention_ref(*(t[a:b][None] for t in ref_leaves), causal=True)[0][0]
                for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:])]
        torch.cat(refs).backward(dout.double())
        mine = [ring.shard_varlen(t, cu, rank, world).requires_grad_() for t in (q, k, v)]
        out = ring.ring_flash_attn_varlen_func(*mine, cu, causal=True)
        out.backward(ring.shard_varlen(dout, cu, rank, world))
        for got, want in [(out, torch.cat(refs))] + [(m.grad, r.grad) for m, r in
                                                     zip(mine, ref_leaves)]:
            want = ring.shard_varlen(want.detach(), cu, rank, world)
            bound = 3e-2 * want.abs().max().item() + 1e-3
            assert (got.double() - want).abs().max().item() <= bound
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2)")
def test_ring_varlen_on_two_gpus(lib):
    """Packed sequences across two GPUs (NCCL, the kernels) against per-sequence float64
    attention, zigzag, causal."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_varlen_worker, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)
