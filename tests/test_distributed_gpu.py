"""Ring attention on the kernels (docs/host.md, distributed.py), on GPUs: the kernel block pair
against the reference block pair on one GPU; KernelBlocks' sm_margin (the kernels' grids); the ring
with the kernels and real data flow on one GPU, its ranks as threads and its exchanges as copies
(dense and packed sequences, 2 and 4 ranks, windows); and the ring over NCCL on two GPUs. Against
float64 attention over the whole sequence with FA3's tolerance rule (_fa3_bounds: at most twice the
error of the same computation in the input dtype, plus twice that dtype's rounding)."""

from __future__ import annotations

import os
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from flash_hopper import distributed as ring
from flash_hopper import flash_attn_func
from flash_hopper.reference import attention_ref

from tests._helpers import kernel_ctas, skip_without_kernel

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
    (without a margin they fill the GPU), with the same output (bitwise: each tile is one CTA's)
    and the same gradients as without (up to the order of dQ's sums)."""
    skip_without_kernel(lib, 128, backward=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(3)
    # 8 heads x 4096 tokens: hundreds of query and key blocks, more tiles than SMs either way
    q, k, v, dout = (torch.randn(1, 4096, 8, 128, device="cuda", dtype=BF16, generator=g)
                     for _ in range(4))
    ctas, results = {}, {}
    for margin in (0, 20):
        kern = ring.KernelBlocks(sm_margin=margin)

        def run(kern=kern, margin=margin):
            out, lse = kern.fwd(q, k, v, (-1, -1), 0.125, 0.0)
            results[margin] = (out, lse, kern.bwd(dout, q, k, v, out, lse, (-1, -1), 0.125, 0.0))

        ctas[margin] = kernel_ctas(run, tmp_path)
    assert set(ctas[0]) == set(ctas[20]) == {"flash_hopper::sm90::fwd_kernel",
                                             "flash_hopper::sm90::bwd_kernel"}, ctas
    for name, n in ctas[20].items():
        assert n <= sms - 20 < ctas[0][name], (name, ctas)
    (out, lse, grads), ref = results[20], results[0]
    assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    for got, want in zip(grads, ref[2]):
        assert (got.float() - want.float()).abs().max().item() <= 1e-2 * want.abs().max().item()
    with pytest.raises(ValueError, match=f"sm_margin: expected fewer than the device's {sms}"):
        ring.KernelBlocks(sm_margin=sms).fwd(q, k, v, (-1, -1), 0.125, 0.0)


def _fa3_bounds(q, k, v, dout, window, wants):
    """FA3's tolerance for (out, dq, dk, dv) against the float64 ``wants``: twice the error of
    the same attention computed in the input dtype (torch, no upcast; FA3's ``_pt``) plus twice
    the input dtype's rounding at the reference's magnitude (FA3's ``x + 0.3 - 0.3 - x``)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    low, _ = attention_ref(*leaves, window_size=window, upcast=False)
    low.backward(dout)
    bounds = []
    for got, want in zip([low.detach()] + [t.grad for t in leaves], wants):
        rounded = want.to(q.dtype)
        atol = 2 * (rounded + 0.3 - 0.3 - rounded).abs().max().item()
        bounds.append(2 * (got.double() - want).abs().max().item() + atol)
    return bounds


class _ThreadRing:
    """The ring's exchanges between threads on one GPU (a stand-in for NCCL between GPUs): a
    rank's n-th exchange posts copies of its tensors for the rank ``hops`` ahead and waits for
    the n-th from the rank ``hops`` behind. Same stream for every thread: a copy is ordered
    before the kernels that read it."""

    def __init__(self, world):
        self.cv = threading.Condition()
        self.box = {}
        self.count = [0] * world

    def start(self, ring_, tensors, hops=1):
        me, n = ring_.rank, self.count[ring_.rank]
        self.count[me] += 1
        with self.cv:
            self.box[((me + hops) % ring_.world, n)] = [t.clone() for t in tensors]
            self.cv.notify_all()
        cv, box = self.cv, self.box

        class Pending:
            def wait(self):
                with cv:
                    if not cv.wait_for(lambda: (me, n) in box, timeout=30):
                        raise TimeoutError(f"rank {me}: exchange {n} never arrived")
                    return box.pop((me, n))
        return Pending()


def _thread_ring(world, layout, window, shards, segments, monkeypatch):
    """Every rank's ring forward + backward in its own thread on this GPU: [(out, dq, dk, dv)]
    per rank (``shards``: per rank (q, k, v, dout), batch-first 4-D). The autograd wiring
    (_RingAttention) is the CPU tests' (gloo, processes)."""
    mail = _ThreadRing(world)
    monkeypatch.setattr(ring, "_start_exchange", mail.start)
    results, errors = [None] * world, []

    def run(rank):
        try:
            q, k, v, dout = shards[rank]
            me = ring._Ring(None, rank, world, layout, window, q.shape[-1] ** -0.5, 0.0,
                            ring.KernelBlocks(), segments)
            # _RingAttention's forward and backward called directly: autograd runs a CUDA
            # backward on one engine thread per device, where a rank waiting for another's
            # exchange would block the other's backward behind it
            out, lse = ring._ring_forward(me, q, k, v)
            out = out.to(q.dtype)
            grads = ring._ring_backward(me, dout, q, k, v, out, lse)
            results[rank] = (out, *(gr.to(t.dtype) for gr, t in zip(grads, (q, k, v))))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    torch.cuda.synchronize()
    return results


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("world", "layout", "causal", "window"), [
    (2, "zigzag", True, (-1, -1)), (2, "contiguous", False, (-1, -1)),
    (4, "zigzag", True, (-1, -1)), (4, "contiguous", True, (-1, -1)),
    (4, "zigzag", False, (-1, -1)),
    (4, "contiguous", True, (100, -1)),  # narrower than a chunk: 2 steps
    (4, "contiguous", False, (300, 40)),  # both sides, wider than a chunk
])
def test_ring_in_threads_on_one_gpu_equals_one_call(lib, monkeypatch, world, layout, causal,
                                                     window, head_dim):
    """The ring with the kernels and real data flow (ranks as threads, exchanges as copies) on
    one GPU against float64 attention over the whole sequence within FA3's tolerance
    (_fa3_bounds), batch 2, GQA 8 / 2: what the two-GPU test checks, short of NCCL."""
    skip_without_kernel(lib, head_dim, backward=True)
    g = torch.Generator(device="cuda").manual_seed(world * head_dim)
    s = 2 * world * 256 if layout == "zigzag" else world * 256
    q, dout = (torch.randn(2, s, 8, head_dim, device="cuda", dtype=BF16, generator=g)
               for _ in range(2))
    k, v = (torch.randn(2, s, 2, head_dim, device="cuda", dtype=BF16, generator=g)
            for _ in range(2))
    wl, wr = window[0], 0 if causal else window[1]
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*ref_leaves, window_size=(wl, wr))
    ref.backward(dout.double())
    wants = [ref.detach()] + [t.grad for t in ref_leaves]
    bounds = _fa3_bounds(q, k, v, dout, (wl, wr), wants)
    shards = [[ring.shard(t, r, world, layout) for t in (q, k, v, dout)] for r in range(world)]
    segments = ((0, shards[0][0].shape[1]),)
    results = _thread_ring(world, layout, (wl, wr), shards, segments, monkeypatch)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        got = ring.unshard([r[i] for r in results], layout).double()
        err = (got - wants[i]).abs().max().item()
        assert err <= bounds[i], f"{name}: ring error {err:.3g} > {bounds[i]:.3g}"


def _packed_case(world, seed):
    """Packed sequences of 2W x 96, 2W x 8 and 2W x 200 tokens (bf16, GQA 8 / 2, d128): cu,
    (q, k, v, dout) and the float64 per-sequence causal attention's (out, dq, dk, dv)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    lengths = [2 * world * 96, 2 * world * 8, 2 * world * 200]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    total = sum(lengths)
    q, dout = (torch.randn(total, 8, 128, device="cuda", dtype=BF16, generator=g)
               for _ in range(2))
    k, v = (torch.randn(total, 2, 128, device="cuda", dtype=BF16, generator=g) for _ in range(2))
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    offsets = cu.tolist()
    refs = torch.cat([attention_ref(*(t[a:b][None] for t in ref_leaves), causal=True)[0][0]
                      for a, b in zip(offsets[:-1], offsets[1:])])
    refs.backward(dout.double())
    return cu, (q, k, v, dout), [refs.detach()] + [t.grad for t in ref_leaves]


def test_ring_varlen_in_threads_on_one_gpu(lib, monkeypatch):
    """Packed sequences (lengths 2W x 96, 2W x 8, 2W x 200, zigzag, causal) through the ring in
    threads on one GPU against per-sequence float64 attention."""
    skip_without_kernel(lib, 128, backward=True)
    world = 2
    cu, (q, k, v, dout), wants = _packed_case(world, 5)
    total = q.shape[0]
    shards = [[ring.shard_varlen(t, cu, r, world)[None] for t in (q, k, v, dout)]
              for r in range(world)]
    segments = ring._local_segments(cu, world, "zigzag", total // world)
    results = _thread_ring(world, "zigzag", (-1, 0), shards, segments, monkeypatch)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        got = ring.unshard_varlen([r[i][0] for r in results], cu).double()
        err = (got - wants[i]).abs().max().item()
        assert err <= 3e-2 * wants[i].abs().max().item() + 1e-3, f"{name}: {err:.3g}"


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
        window = (-1, 0) if causal else (-1, -1)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        full = flash_attn_func(*leaves, causal=causal)
        full.backward(dout)
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref, _ = attention_ref(*ref_leaves, window_size=window)
        ref.backward(dout.double())
        wants = [ref.detach()] + [t.grad for t in ref_leaves]
        bounds = _fa3_bounds(q, k, v, dout, window, wants)
        mine = [ring.shard(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
        out = ring.ring_flash_attn_func(*mine, causal=causal, layout=layout)
        out.backward(ring.shard(dout, rank, world, layout))
        # the ring's shard and the single GPU's whole call, both within FA3's tolerance
        for name, got, single, want, bound in zip(
                ("out", "dq", "dk", "dv"), [out] + [m.grad for m in mine],
                [full] + [t.grad for t in leaves], wants, bounds):
            want_shard = ring.shard(want, rank, world, layout)
            err = (got.double() - want_shard).abs().max().item()
            assert err <= bound, f"rank {rank} {name}: ring error {err:.3g} > {bound:.3g}"
            assert (single.double() - want).abs().max().item() <= bound, name
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
        cu, (q, k, v, dout), wants = _packed_case(world, 1)
        mine = [ring.shard_varlen(t, cu, rank, world).requires_grad_() for t in (q, k, v)]
        out = ring.ring_flash_attn_varlen_func(*mine, cu, causal=True)
        out.backward(ring.shard_varlen(dout, cu, rank, world))
        for got, want in zip([out] + [m.grad for m in mine], wants):
            want = ring.shard_varlen(want, cu, rank, world)
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


def test_scaling_timeline_reads_the_kernels(lib):
    """bench/ring_scaling.py's timeline (what the two-GPU run reports as overlap evidence) on one
    GPU: a forward + backward's kernels counted as compute, no NCCL kernel, no gap between them
    longer than the call itself."""
    import importlib.util
    from pathlib import Path

    skip_without_kernel(lib, 128, backward=True)
    path = Path(__file__).resolve().parents[1] / "bench" / "ring_scaling.py"
    spec = importlib.util.spec_from_file_location("ring_scaling", path)
    scaling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scaling)
    q, k, v = (torch.randn(1, 4096, 8, 128, device="cuda", dtype=BF16, requires_grad=True)
               for _ in range(3))

    def call():
        flash_attn_func(q, k, v, causal=True).sum().backward()

    call()
    row = scaling._timeline(call)
    assert row["nccl_kernels"] == 0 and row["nccl_ctas"] == 0 and row["nccl_ms"] == 0
    assert 0 < row["compute_ms"] and 0 <= row["compute_gaps_ms"] < 10 * row["compute_ms"]
