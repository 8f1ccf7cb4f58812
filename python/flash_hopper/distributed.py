"""Context parallelism over torch.distributed: ring attention.

Each rank holds a shard of one long sequence (FA3 layout, (batch, seqlen, heads, head_dim)); the
K / V shards travel around the ranks of a process group while every rank attends its queries to
the block in hand, and the partial results merge exactly through their log-sum-exps (fp32):

    lse = log(exp(lse_a) + exp(lse_b)),    out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

The backward runs the same ring: dQ stays local, dK / dV travel with their K / V block (fp32) and
arrive home after the last step. Every block's gradient uses the merged output and LSE, so the
result is the exact gradient of full attention. Overlap: the next step's K / V travel while the
block in hand is attended (forward and backward), and the sums of dK / dV of the ranks before
while this rank's own gradients of the block collect; they meet after the step's kernels. A
persistent kernel on every SM keeps NCCL's kernels waiting until it ends (measured: a
side-stream copy waits the whole call), so ``sm_margin`` leaves SMs free for them.

Steps: a ring of W ranks takes W steps, unless no query sees the keys of the farther ranks (a
window narrower than the distance, in the contiguous layout: 2 steps when it is narrower than a
chunk): those steps are not run, their blocks not sent, and the dK / dV sums go straight home.

Merges: each call's (out, lse) merges into this rank's fp32 (out, lse) in place (the first call
on a row range is copied); neighbouring chunk pairs that one call covers run as one
(``_calls``: zigzag's home step is 2 calls instead of 3, its other steps 1 instead of 2).

Packed sequences (ring_flash_attn_varlen_func, FA3's varlen layout (total, heads, head_dim) with
cu_seqlens): every sequence is sharded on its own (shard_varlen) and attends only to itself; one
K / V exchange per step carries all of them (the ring walks each sequence's pairs in it).

Layouts: the sequence is cut into chunks of equal length. "contiguous": rank r holds chunk r of
W. "zigzag": chunks r and 2W - 1 - r of 2W, so under a causal mask every rank has the same work.
Masks: a (query chunk, key chunk) pair sees the band of the whole sequence's causal / window
mask that crosses it: none (skipped), all of it (no mask), or part, which a bottom-right aligned
window expresses on the rectangle of the rows and keys that see each other (_pair_mask; causal:
key chunks before the query chunk are full, the diagonal causal, later ones skipped).

The attention of one block pair is pluggable (``BlockAttention``): ``reference_blocks`` (plain
torch, any device, float64; what the CPU tests run over gloo) and ``KernelBlocks`` (flash-hopper's
forward and backward kernels; the default for CUDA fp16 / bf16 tensors; matched against the
reference blocks on one GPU for full, causal and window pairs (tests/test_distributed_gpu.py); the
two-GPU NCCL test awaits a 2-GPU machine; bench/ring_emulate.py times every rank's share on one
GPU).
Under torch.compile the ring runs between compiled regions (its collectives and the block
attention's custom ops are opaque to it): tests/test_distributed_ring.py checks output and
gradients against eager. A runnable example: examples/ring_attention.py (torchrun).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from . import _device, _env, _validate, reference
from ._combine import lse_weights

LAYOUTS = ("zigzag", "contiguous")
NEG_INF = float("-inf")


class BlockAttention(Protocol):
    """Attention of one (query chunk, key chunk) pair: ``fwd`` -> (out, lse (b, h, sq)), ``bwd``
    -> (dq, dk, dv) given the final (merged) out and lse. ``window``: (left, right) as
    flash_attn_func's window_size on the pair, bottom-right aligned, -1 unbounded ((-1, 0) is
    causal)."""

    def fwd(self, q, k, v, window: tuple[int, int], scale: float, softcap: float) -> tuple: ...

    def bwd(self, dout, q, k, v, out, lse, window: tuple[int, int], scale: float,
            softcap: float) -> tuple: ...


class _ReferenceBlocks:
    """The block pair in plain torch (reference.attention_ref / attention_bwd_ref)."""

    def fwd(self, q, k, v, window, scale, softcap):
        return reference.attention_ref(q, k, v, scale, window_size=window, softcap=softcap)

    def bwd(self, dout, q, k, v, out, lse, window, scale, softcap):
        return reference.attention_bwd_ref(q, k, v, out, lse, dout, scale, window_size=window,
                                           softcap=softcap)


reference_blocks = _ReferenceBlocks()


def _check_sm_margin(sm_margin: Any) -> None:
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int) or sm_margin < 0:
        raise ValueError(f"sm_margin: expected an int >= 0, got {sm_margin!r}")


class KernelBlocks:
    """The block pair on flash-hopper's kernels (CUDA, fp16 / bf16): flash_attn_func with its
    LSE forward, the backward kernels (ops.bwd_into) with the merged out and LSE. ``backend``,
    ``deterministic`` and ``sm_margin`` as in flash_attn_func (sm_margin: SMs the persistent
    kernels leave free, so that the ring's NCCL kernels find room beside them: a kernel that
    fills every SM keeps them waiting until it ends; 0 uses every SM)."""

    def __init__(self, backend: str = "auto", deterministic: bool = False, sm_margin: int = 0):
        _check_sm_margin(sm_margin)
        self.backend = backend
        self.deterministic = deterministic
        self.sm_margin = sm_margin

    def fwd(self, q, k, v, window, scale, softcap):
        from .interface import flash_attn_func

        return flash_attn_func(q, k, v, softmax_scale=scale, window_size=window, softcap=softcap,
                               return_attn_probs=True, backend=self.backend,
                               sm_margin=self.sm_margin)

    def bwd(self, dout, q, k, v, out, lse, window, scale, softcap):
        from . import ops

        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        ops.bwd_into(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, scale, window[0],
                     window[1], softcap, self.backend, self.deterministic,
                     num_sms=_device.grid_cap(q.device, self.sm_margin))
        return dq, dk, dv


def _chunk_ids(rank: int, world: int, layout: str) -> list[int]:
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def _num_chunks(world: int, layout: str) -> int:
    return world if layout == "contiguous" else 2 * world


def _check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    return layout


def shard(x: torch.Tensor, rank: int, world: int, layout: str = "zigzag",
          dim: int = 1) -> torch.Tensor:
    """This rank's shard of a full sequence tensor (seqlen along ``dim``), in ``layout``."""
    _check_layout(layout)
    n = _num_chunks(world, layout)
    if x.shape[dim] % n:
        raise ValueError(f"x: the sequence length {x.shape[dim]} (dim {dim}) must split into "
                         f"{n} equal chunks for the {layout} layout over {world} ranks")
    chunks = x.chunk(n, dim=dim)
    return torch.cat([chunks[i] for i in _chunk_ids(rank, world, layout)], dim=dim)


def unshard(shards: Sequence[torch.Tensor], layout: str = "zigzag",
            dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (in rank order): ``shard``'s inverse."""
    _check_layout(layout)
    world = len(shards)
    chunks: dict[int, torch.Tensor] = {}
    for rank, piece in enumerate(shards):
        ids = _chunk_ids(rank, world, layout)
        for i, c in zip(ids, piece.chunk(len(ids), dim=dim)):
            chunks[i] = c
    return torch.cat([chunks[i] for i in range(_num_chunks(world, layout))], dim=dim)


class _Ring(NamedTuple):
    group: Any
    rank: int
    world: int
    layout: str
    window: tuple[int, int]  # the whole sequence's (left, right), causal folded in; -1 unbounded
    scale: float
    softcap: float
    blocks: Any
    # The sequences along the local token axis, (start, length) each: one for the dense call
    # (its batch shares it), one per packed sequence for the varlen call (batch 1).
    segments: tuple[tuple[int, int], ...]


_FULL, _CAUSAL = (-1, -1), (-1, 0)


class _Pair(NamedTuple):
    i: int  # this rank's query piece
    j: int  # the key piece
    window: tuple[int, int]  # the pair's mask for flash_attn_func, on the rectangle below
    rows: int  # the pair's query rows that see a key: the piece's first ``rows``
    keys: int  # the keys some query sees: the piece's first ``keys``


def _pair_mask(delta: int, chunk: int, left: int, right: int) -> tuple | None:
    """A chunk pair's visible band and how a bottom-right aligned window expresses it.

    Query i and key j of the pair (local positions, chunks of ``chunk`` tokens, the query chunk
    ``delta`` tokens after the key chunk) see each other when j - i lies in [a, b] = [delta -
    left, delta + right] (the whole sequence is square: its window is j - i in [-left, right];
    -1 is unbounded). The kernels' window on an nq x nk rectangle is j - i in [(nk - nq) - left',
    (nk - nq) + right'] with left', right' >= 0 (or unbounded): the rectangle's corner offset
    nk - nq must lie in the band. Cropping the rectangle's bottom rows (a > 0: rows past
    chunk - a see no key) or right keys (b < 0: keys past chunk + b are seen by none) puts it
    there. Returns (window, rows, keys) or None when nothing is visible."""
    a = delta - left if left >= 0 else None
    b = delta + right if right >= 0 else None
    if (a is not None and a > chunk - 1) or (b is not None and b < -(chunk - 1)):
        return None
    rows = chunk - a if a is not None and a > 0 else chunk
    keys = chunk + b if b is not None and b < 0 else chunk
    corner = keys - rows
    # every pair of the rectangle visible: no mask (j - i spans [-(rows - 1), keys - 1])
    left_ = -1 if a is None or a <= -(rows - 1) else corner - a
    right_ = -1 if b is None or b >= keys - 1 else b - corner
    return (left_, right_), rows, keys


def _pairs(ring: _Ring, owner: int, chunk: int):
    """The visible chunk pairs between this rank's queries and ``owner``'s keys (chunks of
    ``chunk`` tokens), each with its mask and the rectangle it covers."""
    mine = _chunk_ids(ring.rank, ring.world, ring.layout)
    theirs = _chunk_ids(owner, ring.world, ring.layout)
    left, right = ring.window
    for i, qc in enumerate(mine):
        for j, kc in enumerate(theirs):
            mask = _pair_mask((qc - kc) * chunk, chunk, left, right)
            if mask is not None:
                yield _Pair(i, j, *mask)


def _calls(ring: _Ring, owner: int, chunk: int):
    """The kernel calls of one step: ``_pairs``, with neighbours joined where one call covers
    both (fewer launches, merges and gradient sums): a full pair and the full or causal pair of
    the same query piece whose keys follow it (full, or causal bottom-right on the joined keys:
    zigzag's home step), full pairs of the same keys whose queries follow each other."""
    calls: list[_Pair] = []
    for p in _pairs(ring, owner, chunk):
        whole = p.rows == chunk and p.keys == chunk and p.window in (_FULL, _CAUSAL)
        last = calls[-1] if calls else None
        if whole and last is not None and last.i == p.i and last.window == _FULL and \
                last.rows == chunk and last.j * chunk + last.keys == p.j * chunk:
            calls[-1] = last._replace(keys=last.keys + chunk, window=p.window)
            continue
        calls.append(p)
    joined: list[_Pair] = []
    for p in calls:
        above = next((c for c in joined if c.j == p.j and c.keys == p.keys and
                      c.window == p.window == _FULL and p.rows == chunk and
                      c.i * chunk + c.rows == p.i * chunk), None)
        if above is not None:
            joined[joined.index(above)] = above._replace(rows=above.rows + chunk)
            continue
        joined.append(p)
    return joined


def _merge_into(out, lse, o, l) -> None:
    """Merge a block's (o (b, n, h, d), l (b, h, n)) into the running (out fp32, lse fp32) views
    of the same rows, in place: the LSE merge (rows no key sees keep weight 0)."""
    merged = torch.logaddexp(lse, l)
    w_out, w_o = (w.transpose(1, 2).unsqueeze(-1) for w in lse_weights(merged, lse, l))
    out.mul_(w_out).addcmul_(o, w_o)
    lse.copy_(merged)


class _Exchange(NamedTuple):
    requests: list
    received: list[torch.Tensor]
    sent: list[torch.Tensor]  # kept alive until ``wait``: the transfer reads them meanwhile

    def wait(self) -> list[torch.Tensor]:
        for req in self.requests:
            req.wait()
        return self.received


def _start_exchange(ring: _Ring, tensors: list[torch.Tensor], hops: int = 1) -> _Exchange:
    """Start sending ``tensors`` to the rank ``hops`` ahead (the next one) and receiving the
    same from the rank ``hops`` behind into fresh buffers; the caller computes meanwhile and
    waits (``_Exchange.wait``) before using them."""
    def peer(r: int) -> int:
        return dist.get_global_rank(ring.group, r) if ring.group is not None else r

    nxt, prv = peer((ring.rank + hops) % ring.world), peer((ring.rank - hops) % ring.world)
    sent = [t.contiguous() for t in tensors]
    recv = [torch.empty_like(t) for t in sent]
    ops = [dist.P2POp(dist.isend, t, nxt, ring.group) for t in sent]
    ops += [dist.P2POp(dist.irecv, r, prv, ring.group) for r in recv]
    return _Exchange(dist.batch_isend_irecv(ops), recv, sent)


def _sequences(ring: _Ring):
    """(first local token, chunk length) of every non-empty local sequence: its local pieces
    (one or two chunks of this rank) follow each other from the first token."""
    pieces = len(_chunk_ids(ring.rank, ring.world, ring.layout))
    for start, length in ring.segments:
        if length:
            yield start, length // pieces


def _steps(ring: _Ring) -> int:
    """The ring's steps: 1 + the farthest distance d at which some rank's queries see the keys of
    the rank d behind it (the block that arrives at step d). A window narrower than a chunk in
    the contiguous layout needs 2 (the previous rank's keys): the blocks no query sees neither
    travel nor wait. The same on every rank (the call's shapes and masks are)."""
    chunks = {chunk for _, chunk in _sequences(ring)}
    for d in range(ring.world - 1, 0, -1):
        for r in range(ring.world):
            other = ring._replace(rank=r)
            if any(next(_pairs(other, (r - d) % ring.world, c), None) for c in chunks):
                return d + 1
    return 1


def _ring_forward(ring: _Ring, q, k, v):
    b, t, h, _ = q.shape
    out = torch.zeros(b, t, h, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, t), NEG_INF, dtype=torch.float32, device=q.device)
    written: list[tuple[int, int]] = []  # local row ranges holding a result (the first is copied)
    kv = [k, v]
    steps = _steps(ring)
    for step in range(steps):
        owner = (ring.rank - step) % ring.world
        # The next block travels while this one is attended.
        pending = _start_exchange(ring, kv) if step < steps - 1 else None
        for start, chunk in _sequences(ring):
            for call in _calls(ring, owner, chunk):
                lo, hi = start + call.i * chunk, start + call.i * chunk + call.rows
                keys = slice(start + call.j * chunk, start + call.j * chunk + call.keys)
                o, l = ring.blocks.fwd(q[:, lo:hi], kv[0][:, keys], kv[1][:, keys], call.window,
                                       ring.scale, ring.softcap)
                if any(a < hi and lo < b for a, b in written):
                    _merge_into(out[:, lo:hi], lse[:, :, lo:hi], o, l.float())
                else:
                    out[:, lo:hi].copy_(o)
                    lse[:, :, lo:hi].copy_(l)
                    written.append((lo, hi))
        if pending is not None:
            kv = pending.wait()
    return out, lse


def _ring_backward(ring: _Ring, dout, q, k, v, out, lse):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [k, v]
    incoming = None  # the block in hand's gradient sums from the ranks before, in flight
    steps = _steps(ring)
    for step in range(steps):
        owner = (ring.rank - step) % ring.world
        # The next step's K / V travel during this step's compute, and so do the sums of the
        # ranks before for the block in hand: this step's gradients of it collect on their own
        # and meet those sums after the compute, then travel on (the last step's: home, the
        # owner steps - 1 ranks behind; after W steps that is the next rank).
        pending = _start_exchange(ring, kv) if step < steps - 1 else None
        dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
        for start, chunk in _sequences(ring):
            for call in _calls(ring, owner, chunk):
                rows = slice(start + call.i * chunk, start + call.i * chunk + call.rows)
                keys = slice(start + call.j * chunk, start + call.j * chunk + call.keys)
                gq, gk, gv = ring.blocks.bwd(dout[:, rows], q[:, rows], kv[0][:, keys],
                                             kv[1][:, keys], out[:, rows], lse[:, :, rows],
                                             call.window, ring.scale, ring.softcap)
                dq[:, rows].add_(gq)
                dkv[0][:, keys].add_(gk)
                dkv[1][:, keys].add_(gv)
        if incoming is not None:
            for mine, before in zip(dkv, incoming.wait()):
                mine.add_(before)
        if step == steps - 1 == 0:  # one step: every block stayed home
            return dq, dkv[0], dkv[1]
        incoming = _start_exchange(ring, dkv, 1 if step < steps - 1 else ring.world - step)
        if pending is not None:
            kv = pending.wait()
    dk, dv = incoming.wait()
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring):
        out, lse = _ring_forward(ring, q, k, v)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dlse is not None and bool((dlse != 0).any()):
            raise NotImplementedError("lse: ring_flash_attn_func's backward takes no gradient "
                                      "through the returned lse")
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, dout, q, k, v, out, lse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def init_from_torchrun(device: str) -> tuple[int, int, torch.device]:
    """For scripts started by torchrun: the default process group on NCCL (``device`` "cuda",
    this process's GPU pinned from LOCAL_RANK) or gloo ("cpu"); returns (rank, world, device)."""

    cuda = device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(_env.local_rank(rank))
    return rank, world, torch.device("cuda" if cuda else "cpu")


def _resolve_group(group: Any):
    if group is not None and hasattr(group, "get_group"):  # a 1-D DeviceMesh
        if getattr(group, "ndim", 1) != 1:
            raise ValueError(f"group: expected a ProcessGroup or a 1-D DeviceMesh, got a "
                             f"{group.ndim}-D mesh")
        group = group.get_group()
    return group


def _check_ranks_agree(ring: _Ring, q, k, v) -> None:
    """One all_gather of the call's metadata: every rank must pass the same shapes and dtypes."""
    code = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
    # the packed sequences too (varlen): their count and a position-weighted sum of lengths
    lengths = [n for _, n in ring.segments]
    shape_sum = sum((i + 1) * n for i, n in enumerate(lengths)) % (1 << 61)
    meta = torch.tensor([*q.shape, *k.shape, *v.shape, code.get(q.dtype, 0),
                         _num_chunks(ring.world, ring.layout), *ring.window, len(lengths),
                         shape_sum], dtype=torch.int64, device=q.device)
    everyone = [torch.empty_like(meta) for _ in range(ring.world)]
    dist.all_gather(everyone, meta, group=ring.group)
    for rank, other in enumerate(everyone):
        if not torch.equal(other, meta):
            raise ValueError(f"q / k / v: rank {ring.rank} has shapes {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)} ({q.dtype}, window "
                             f"{ring.window}, layout {ring.layout}), rank {rank} differs "
                             f"({other.tolist()} vs {meta.tolist()})")


def ring_flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None,
                         causal: bool = False, window_size: Sequence[int] = (-1, -1),
                         softcap: float = 0.0, softmax_scale: float | None = None,
                         layout: str = "zigzag", deterministic: bool = False,
                         return_lse: bool = False, blocks: BlockAttention | None = None,
                         sm_margin: int = 0):
    """Attention of one sequence sharded over the ranks of ``group`` (a ProcessGroup, a 1-D
    DeviceMesh, or None for the default group): q, k, v (batch, seqlen / W, heads, head_dim),
    this rank's shard in ``layout`` (``shard``), GQA allowed. Returns this rank's out shard
    (and its lse (batch, heads, seqlen / W) with ``return_lse``), differentiable.

    causal / window_size: as flash_attn_func's over the whole sequence (FA3's semantics: causal
    sets the right bound to 0, a negative bound is unbounded). A chunk pair the window leaves
    empty is skipped, and so are the ring's last steps when no query sees their blocks (those
    blocks do not travel); a pair the band crosses runs on the rectangle of its rows and keys
    that see each other.

    blocks: the block-pair attention (``KernelBlocks()`` for CUDA fp16 / bf16 tensors, else
    ``reference_blocks``). ``deterministic``: the ring's order is fixed, so the result is
    reproducible whenever the block attention is. ``sm_margin``: SMs the kernels leave to the
    ring's NCCL transfers (``KernelBlocks``; FA3's argument of that name); 0 uses every SM.
    """
    _check_layout(layout)
    _check_sm_margin(sm_margin)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    left, right = _validate._check_window(window_size, causal)
    group = _resolve_group(group)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if blocks is None:
        kernels = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        blocks = KernelBlocks(deterministic=deterministic, sm_margin=sm_margin) if kernels \
            else reference_blocks
    ring = _Ring(group, rank, world, layout, (left, right), scale, float(softcap), blocks,
                 ((0, q.shape[1]),))
    pieces = len(_chunk_ids(rank, world, layout))
    if q.shape[1] % pieces or k.shape[1] != q.shape[1]:
        raise ValueError(f"q / k: expected equal shard lengths divisible by {pieces} (the "
                         f"{layout} layout's chunks per rank), got {q.shape[1]} and "
                         f"{k.shape[1]}")
    _check_ranks_agree(ring, q, k, v)
    out, lse = _RingAttention.apply(q, k, v, ring)
    return (out, lse) if return_lse else out


def _local_segments(cu_seqlens: Any, world: int, layout: str, total: int
                    ) -> tuple[tuple[int, int], ...]:
    """The local (start, length) of every packed sequence from the whole sequences' offsets
    (one device-to-host copy), each length split into the layout's chunks."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or \
            cu_seqlens.dtype != torch.int32 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens: expected an int32 1-D tensor of batch + 1 offsets, got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} of shape "
                         f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    offsets = cu_seqlens.tolist()
    n = _num_chunks(world, layout)
    segments = []
    for b in range(len(offsets) - 1):
        length = offsets[b + 1] - offsets[b]
        if offsets[b] % n or length < 0 or length % n:
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets with every sequence "
                             f"a multiple of {n} tokens (the {layout} layout's chunks over "
                             f"{world} ranks), got sequence {b} at {offsets[b]} of {length}")
        segments.append((offsets[b] // world, length // world))
    if offsets[0] != 0 or offsets[-1] != total * world:
        raise ValueError(f"cu_seqlens: expected offsets from 0 to the whole packed length "
                         f"({total} local tokens x {world} ranks = {total * world}), got "
                         f"{offsets[0]} .. {offsets[-1]}")
    return tuple(segments)


def shard_varlen(x: torch.Tensor, cu_seqlens: torch.Tensor, rank: int, world: int,
                 layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of packed sequences (tokens along dim 0, sequence b at [cu_seqlens[b],
    cu_seqlens[b + 1])): every sequence sharded as ``shard`` does, the shards packed in sequence
    order."""
    _check_layout(layout)
    offsets = cu_seqlens.tolist()
    return torch.cat([shard(x[offsets[b]:offsets[b + 1]], rank, world, layout, dim=0)
                      for b in range(len(offsets) - 1)], dim=0)


def unshard_varlen(shards: Sequence[torch.Tensor], cu_seqlens: torch.Tensor,
                   layout: str = "zigzag") -> torch.Tensor:
    """The packed sequences from every rank's ``shard_varlen`` shard (in rank order)."""
    _check_layout(layout)
    world = len(shards)
    offsets = cu_seqlens.tolist()
    pieces = []
    for b in range(len(offsets) - 1):
        lo, hi = offsets[b] // world, offsets[b + 1] // world
        pieces.append(unshard([t[lo:hi] for t in shards], layout, dim=0))
    return torch.cat(pieces, dim=0)


def ring_flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                cu_seqlens: torch.Tensor, max_seqlen: int | None = None,
                                group: Any = None, causal: bool = False,
                                window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                softmax_scale: float | None = None, layout: str = "zigzag",
                                deterministic: bool = False, return_lse: bool = False,
                                blocks: BlockAttention | None = None, sm_margin: int = 0):
    """Ring attention over packed sequences (the varlen form of ``ring_flash_attn_func``): q, k, v
    (total / W, heads, head_dim), this rank's ``shard_varlen`` shard of sequences packed by
    ``cu_seqlens`` (int32 (batch + 1,), the whole sequences' offsets, the same on every rank;
    every sequence a multiple of the layout's chunks: 2W tokens zigzag, W contiguous). Each
    sequence attends only to itself; masks per sequence as in ring_flash_attn_func. One K / V
    exchange per step carries every sequence; ``sm_margin`` as there. Returns out (total / W,
    heads, head_dim) (and lse (heads, total / W) with ``return_lse``), differentiable.
    ``max_seqlen`` is accepted for FA3's signature and not needed."""
    _check_layout(layout)
    _check_sm_margin(sm_margin)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor (total / W, heads, head_dim), got "
                             f"{tuple(getattr(t, 'shape', ()))}")
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError(f"q / k / v: expected the same local token count, got {q.shape[0]}, "
                         f"{k.shape[0]}, {v.shape[0]}")
    left, right = _validate._check_window(window_size, causal)
    group = _resolve_group(group)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    segments = _local_segments(cu_seqlens, world, layout, q.shape[0])
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if blocks is None:
        kernels = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        blocks = KernelBlocks(deterministic=deterministic, sm_margin=sm_margin) if kernels \
            else reference_blocks
    ring = _Ring(group, rank, world, layout, (left, right), scale, float(softcap), blocks,
                 segments)
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    _check_ranks_agree(ring, q4, k4, v4)
    out, lse = _RingAttention.apply(q4, k4, v4, ring)
    return (out[0], lse[0]) if return_lse else out[0]


__all__ = ["LAYOUTS", "BlockAttention", "KernelBlocks", "init_from_torchrun", "reference_blocks",
           "ring_flash_attn_func", "ring_flash_attn_varlen_func", "shard", "shard_varlen",
           "unshard", "unshard_varlen"]
