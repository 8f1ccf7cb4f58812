"""Ring attention over torch.distributed (python/flash_hopper/distributed.py), on the CPU: 2 and 4
processes over gloo with the reference block attention (float64) give the full sequence's attention
and its gradients, in the zigzag and contiguous layouts, causal and not, GQA, softcap, odd chunk
lengths; ranks that disagree on shapes get an error naming q / k / v; shard / unshard are inverses;
inside torch.compile (aot_eager) the same output and gradients as eager."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from flash_hopper import distributed as ring
from flash_hopper.reference import attention_ref

F64 = torch.float64
# (layout, causal, heads_q, heads_kv, tokens per chunk, head_dim, softcap, window_size)
CASES = [
    ("zigzag", True, 4, 2, 7, 16, 0.0, (-1, -1)),
    ("zigzag", False, 2, 2, 5, 8, 0.0, (-1, -1)),
    ("contiguous", True, 3, 1, 13, 16, 0.0, (-1, -1)),
    ("contiguous", False, 4, 4, 6, 8, 4.0, (-1, -1)),
    ("zigzag", True, 2, 1, 3, 8, 2.5, (-1, -1)),
    # windows: a left edge inside a chunk (causal), both edges crossing chunk boundaries, a band
    # right of the diagonal only, a window wider than a chunk (pairs with every key and none)
    ("zigzag", True, 4, 2, 7, 16, 0.0, (5, -1)),
    ("contiguous", False, 2, 2, 5, 8, 0.0, (3, 2)),
    ("zigzag", False, 2, 1, 6, 8, 0.0, (0, 9)),
    ("contiguous", True, 2, 2, 4, 8, 1.5, (10, 3)),
    # windows narrower than a chunk, contiguous: 2 steps (the previous rank's keys), or 1 (the
    # diagonal only): the other blocks never travel, dK / dV go straight home
    ("contiguous", True, 4, 2, 6, 16, 0.0, (4, -1)),
    ("contiguous", False, 2, 2, 6, 8, 0.0, (3, 0)),
    ("contiguous", True, 2, 1, 5, 8, 0.0, (0, -1)),
]


def _brute_steps(world, layout, chunk, left, right):
    """1 + the farthest d at which some rank's queries see a key of the rank d behind (whole
    sequence positions, brute force)."""
    tokens = {r: [c * chunk + t for c in ring._chunk_ids(r, world, layout) for t in range(chunk)]
              for r in range(world)}
    far = 0
    for r in range(world):
        for d in range(world):
            if any((left < 0 or kj - qi >= -left) and (right < 0 or kj - qi <= right)
                   for qi in tokens[r] for kj in tokens[(r - d) % world]):
                far = max(far, d)
    return far + 1


def _full_case(layout, causal, hq, hkv, chunk, d, softcap, world):
    n = world * (2 if layout == "zigzag" else 1)
    g = torch.Generator().manual_seed(n * 100 + chunk)
    s = n * chunk
    q = torch.randn(2, s, hq, d, dtype=F64, generator=g)
    k = torch.randn(2, s, hkv, d, dtype=F64, generator=g)
    v = torch.randn(2, s, hkv, d, dtype=F64, generator=g)
    dout = torch.randn(2, s, hq, d, dtype=F64, generator=g)
    return q, k, v, dout


def _worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        for layout, causal, hq, hkv, chunk, d, softcap, window in CASES:
            q, k, v, dout = _full_case(layout, causal, hq, hkv, chunk, d, softcap, world)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, _ = attention_ref(*leaves, causal=causal, softcap=softcap,
                                   window_size=(window[0], 0 if causal else window[1]))
            ref.backward(dout)
            mine = [ring.shard(t, rank, world, layout).detach().requires_grad_()
                    for t in (q, k, v)]
            sent = []
            real = ring._start_exchange
            ring._start_exchange = lambda *a, real=real, sent=sent: sent.append(1) or real(*a)
            try:
                out = ring.ring_flash_attn_func(*mine, causal=causal, softcap=softcap,
                                                layout=layout, window_size=window)
                out.backward(ring.shard(dout, rank, world, layout))
            finally:
                ring._start_exchange = real
            # forward: a K / V exchange per step but the last; backward: the same, and a dK / dV
            # one per step (none when every block stays home)
            steps = _brute_steps(world, layout, chunk, window[0], 0 if causal else window[1])
            want_sent = 2 * (steps - 1) + (steps if steps > 1 else 0)
            want = ring.shard(ref.detach(), rank, world, layout)
            label = (f"rank {rank}/{world} {layout} causal={causal} h{hq}/{hkv} softcap={softcap} "
                     f"window={window}")
            assert (out - want).abs().max().item() < 1e-5, label
            assert len(sent) == want_sent, f"{label}: {len(sent)} exchanges, want {want_sent}"
            for name, leaf, got in zip("qkv", leaves, mine):
                err = (got.grad - ring.shard(leaf.grad, rank, world, layout)).abs().max().item()
                assert err < 1e-5, f"{label}: d{name} error {err:.3g}"
        # Ranks that disagree on shapes: an error naming q / k / v on every rank.
        q, k, v, _ = _full_case("contiguous", False, 2, 2, 4 + rank, 8, 0.0, world)
        mine = [ring.shard(t, rank, world, "contiguous") for t in (q, k, v)]
        with pytest.raises(ValueError, match="q / k / v: rank"):
            ring.ring_flash_attn_func(*mine, layout="contiguous")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_equals_full_attention_over_gloo(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init")), nprocs=world, join=True)


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_and_unshard_are_inverses(layout, world):
    x = torch.arange(2 * world * 6 * 3).view(1, 2 * world * 6, 3)
    shards = [ring.shard(x, r, world, layout) for r in range(world)]
    assert torch.equal(ring.unshard(shards, layout), x)
    if layout == "zigzag":  # rank r holds chunks r and 2W - 1 - r: equal causal work
        chunk = 6
        firsts = [int(s[0, 0, 0]) // 3 // chunk for s in shards]
        seconds = [int(s[0, chunk, 0]) // 3 // chunk for s in shards]
        assert firsts == list(range(world)) and seconds == [2 * world - 1 - r for r in range(world)]


def test_argument_errors():
    with pytest.raises(ValueError, match="layout: expected one of zigzag, contiguous"):
        ring.shard(torch.zeros(1, 8, 1, 1), 0, 2, "striped")
    x = torch.zeros(1, 8, 1, 8)
    for bad in (-1, True, 2.0, "4"):
        with pytest.raises(ValueError, match="sm_margin: expected an int >= 0"):
            ring.KernelBlocks(sm_margin=bad)
        with pytest.raises(ValueError, match="sm_margin: expected an int >= 0"):
            ring.ring_flash_attn_func(x, x, x, sm_margin=bad)
    with pytest.raises(ValueError, match="must split into 4 equal chunks"):
        ring.shard(torch.zeros(1, 6, 1, 1), 0, 2, "zigzag")


def test_pair_masks_express_every_band_exactly():
    """_pair_mask against brute force: the cropped rectangle with its bottom-right aligned window
    covers exactly the chunk pair's visible (query, key) pairs, for bands that miss the pair,
    cross it anywhere, or cover it, on every side of the diagonal."""
    import itertools

    def kernel_visible(nq, nk, window):
        left, right = window
        off = nk - nq
        return {(i, j) for i in range(nq) for j in range(nk)
                if (left < 0 or j - i >= off - left) and (right < 0 or j - i <= off + right)}

    chunk = 5
    for delta_chunks, left, right in itertools.product(range(-3, 4), range(-1, 13),
                                                       range(-1, 13)):
        delta = delta_chunks * chunk
        want = {(i, j) for i in range(chunk) for j in range(chunk)
                if (left < 0 or j - (i + delta) >= -left) and (right < 0 or j - (i + delta) <= right)}
        got = ring._pair_mask(delta, chunk, left, right)
        if not want:
            assert got is None, (delta, left, right)
            continue
        window, rows, keys = got
        assert 1 <= rows <= chunk and 1 <= keys <= chunk
        assert window[0] >= -1 and window[1] >= -1
        assert kernel_visible(rows, keys, window) == want, (delta, left, right, got)


@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_ring_steps_stop_where_no_query_sees_farther_keys(layout):
    """_steps against brute force over every rank, window and ring size (chunks of 4 tokens):
    W steps without a mask or causal, fewer for narrow windows in the contiguous layout."""
    import itertools

    chunk = 4
    for world in range(1, 6):
        for left, right in itertools.product((-1, 0, 1, 3, 4, 5, 9), (-1, 0, 2, 4, 7)):
            r = ring._Ring(None, 0, world, layout, (left, right), 1.0, 0.0, None,
                           ((0, chunk * len(ring._chunk_ids(0, world, layout))),))
            want = _brute_steps(world, layout, chunk, left, right)
            assert ring._steps(r) == want, (world, left, right)
    if layout == "contiguous":
        r = ring._Ring(None, 0, 4, layout, (3, 0), 1.0, 0.0, None, ((0, chunk),))
        assert ring._steps(r) == 2  # the previous rank's last keys only


def _kernel_visible(nq, nk, window):
    """The (row, key) pairs a kernel call on an nq x nk rectangle sees (bottom-right window)."""
    left, right = window
    off = nk - nq
    return [(i, j) for i in range(nq) for j in range(nk)
            if (left < 0 or j - i >= off - left) and (right < 0 or j - i <= off + right)]


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_joined_calls_cover_every_visible_pair_once(layout, world):
    """_calls (the pairs with neighbours joined into one kernel call) against brute force over
    the whole sequence: every visible (query, key) pair of a step lies in exactly one call, no
    call sees an invisible pair; and the joins happen (zigzag causal: 2 calls for the home step's
    3 pairs)."""
    import itertools

    chunk = 4
    for left, right in itertools.product((-1, 0, 3, 6), (-1, 0, 2, 9)):
        for rank, owner in itertools.product(range(world), range(world)):
            r = ring._Ring(None, rank, world, layout, (left, right), 1.0, 0.0, None, ((0, 0),))
            # global positions of the rank's and the owner's local tokens
            mine, theirs = ([c * chunk + t for c in ring._chunk_ids(x, world, layout)
                             for t in range(chunk)] for x in (rank, owner))
            got = []
            for c in ring._calls(r, owner, chunk):
                got += [(mine[c.i * chunk + i], theirs[c.j * chunk + j])
                        for i, j in _kernel_visible(c.rows, c.keys, c.window)]
            want = [(qi, kj) for qi in mine for kj in theirs
                    if (left < 0 or kj - qi >= -left) and (right < 0 or kj - qi <= right)]
            assert sorted(got) == sorted(want), (layout, world, rank, owner, left, right)
            assert len(set(got)) == len(got)
    if layout == "zigzag" and world > 1:
        r = ring._Ring(None, 0, world, layout, (-1, 0), 1.0, 0.0, None, ((0, 0),))
        assert len(list(ring._pairs(r, 0, chunk))) == 3
        assert len(ring._calls(r, 0, chunk)) == 2
        full = ring._Ring(None, 0, world, layout, (-1, -1), 1.0, 0.0, None, ((0, 0),))
        assert [(c.rows, c.keys, c.window) for c in ring._calls(full, 1, chunk)] == \
            [(2 * chunk, 2 * chunk, (-1, -1))]


def _compile_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        q, k, v, dout = _full_case("zigzag", True, 2, 1, 8, 8, 0.0, world)
        ref, _ = attention_ref(q, k, v, causal=True)

        def layer(a, b, c):  # the per-rank attention inside a compiled model
            return ring.ring_flash_attn_func(a * 1.0, b, c, causal=True) * 2.0

        compiled = torch.compile(layer, backend="aot_eager")
        for fn in (layer, compiled):
            mine = [ring.shard(t, rank, world).detach().requires_grad_() for t in (q, k, v)]
            out = fn(*mine)
            assert (out - 2.0 * ring.shard(ref, rank, world)).abs().max().item() < 1e-5
            out.backward(ring.shard(dout, rank, world))
            if fn is layer:
                eager_grads = [m.grad for m in mine]
        for got, want in zip((m.grad for m in mine), eager_grads):
            assert torch.allclose(got, want, atol=1e-9), "compiled gradients differ from eager"
    finally:
        dist.destroy_process_group()


def test_ring_runs_inside_torch_compile():
    """torch.compile over a model that calls the ring (the collectives run between compiled
    regions): the same output and gradients as eager."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_compile_worker, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)


# (layout, causal, heads_q, heads_kv, lengths in units of the layout's chunks, window_size)
VARLEN_CASES = [
    ("zigzag", True, 4, 2, [3, 0, 1, 5], (-1, -1)),
    ("contiguous", False, 2, 2, [2, 4, 1], (-1, -1)),
    ("zigzag", False, 2, 1, [4, 2], (3, 2)),
    ("contiguous", True, 3, 1, [1, 3, 2], (5, -1)),
]


def _varlen_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        for layout, causal, hq, hkv, units, window in VARLEN_CASES:
            n = world * (2 if layout == "zigzag" else 1)
            lengths = [u * n * 2 for u in units]  # 2 tokens per chunk per unit
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            total, d = sum(lengths), 8
            g = torch.Generator().manual_seed(len(lengths) * 10 + hq)
            q, k, v, dout = (torch.randn(total, h, d, dtype=F64, generator=g)
                             for h in (hq, hkv, hkv, hq))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            refs = []
            for b in range(len(lengths)):
                lo, hi = int(cu[b]), int(cu[b + 1])
                if hi > lo:
                    o, _ = attention_ref(*(t[lo:hi][None] for t in leaves), causal=causal,
                                         window_size=(window[0], 0 if causal else window[1]))
                    refs.append(o[0])
            ref = torch.cat(refs)  # every token, in order (an empty sequence has none)
            ref.backward(dout)
            mine = [ring.shard_varlen(t, cu, rank, world, layout).detach().requires_grad_()
                    for t in (q, k, v)]
            out, lse = ring.ring_flash_attn_varlen_func(*mine, cu, causal=causal, layout=layout,
                                                        window_size=window, return_lse=True)
            assert out.shape == mine[0].shape and lse.shape == (hq, mine[0].shape[0])
            out.backward(ring.shard_varlen(dout, cu, rank, world, layout))
            label = f"rank {rank}/{world} {layout} causal={causal} lengths={lengths} {window}"
            want = ring.shard_varlen(ref.detach(), cu, rank, world, layout)
            assert (out - want).abs().max().item() < 1e-5, label
            for name, leaf, got in zip("qkv", leaves, mine):
                err = (got.grad - ring.shard_varlen(leaf.grad, cu, rank, world, layout)
                       ).abs().max().item()
                assert err < 1e-5, f"{label}: d{name} error {err:.3g}"
        with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing offsets with "
                                             "every sequence a multiple of"):
            bad = torch.tensor([0, 3], dtype=torch.int32)
            ring.ring_flash_attn_varlen_func(*(torch.zeros(3, 1, 8, dtype=F64),) * 3, bad)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_varlen_equals_per_sequence_attention_over_gloo(world):
    """Packed sequences of different lengths (an empty one included) across the ring: each
    attends only to itself, output and gradients equal per-sequence full attention."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_varlen_worker, args=(world, os.path.join(tmp, "init")), nprocs=world,
                 join=True)


def test_varlen_shard_and_unshard_are_inverses():
    cu = torch.tensor([0, 8, 8, 24], dtype=torch.int32)
    x = torch.arange(24 * 3).view(24, 3)
    for layout in ring.LAYOUTS:
        shards = [ring.shard_varlen(x, cu, r, 2, layout) for r in range(2)]
        assert all(s.shape == (12, 3) for s in shards)
        assert torch.equal(ring.unshard_varlen(shards, cu, layout), x)
