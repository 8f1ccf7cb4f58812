"""Context parallelism over torch.distributed (issue 16): ring attention.

Each rank holds a shard of one long sequence (FA3 layout, (batch, seqlen, heads, head_dim)); the
K / V shards travel around the ranks of a process group while every rank attends its queries to
the block in hand, and the partial results merge exactly through their log-sum-exps (fp32):

    lse = log(exp(lse_a) + exp(lse_b)),    out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

The backward runs the same ring: dQ stays local, dK / dV travel with their K / V block (fp32) and
arrive home after the last step. Every block's gradient uses the merged output and LSE, so the
result is the exact gradient of full attention.

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
reference blocks on one H200 for full, causal (session 13) and window pairs (session 14); the
two-GPU NCCL test awaits a 2-GPU machine).
Under torch.compile the ring runs between compiled regions (its collectives and the block
attention's custom ops are opaque to it): tests/test_distributed_ring.py checks output and
gradients against eager. A runnable example: examples/ring_attention.py (torchrun).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from . import _validate, reference
from ._combine import flash_attn_combine

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


class KernelBlocks:
    """The block pair on flash-hopper's kernels (CUDA, fp16 / bf16): flash_attn_func with its
    LSE forward, the backward kernels (ops.bwd_into) with the merged out and LSE. ``backend``
    and ``deterministic`` as in flash_attn_func."""

    def __init__(self, backend: str = "auto", deterministic: bool = False):
        self.backend = backend
        self.deterministic = deterministic

    def fwd(self, q, k, v, window, scale, softcap):
        from .interface import flash_attn_func

        return flash_attn_func(q, k, v, softmax_scale=scale, window_size=window, softcap=softcap,
                               return_attn_probs=True, backend=self.backend)

    def bwd(self, dout, q, k, v, out, lse, window, scale, softcap):
        from . import ops

        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        ops.bwd_into(dout, q, k, v, out, lse.contiguous(), dq, dk, dv, scale, window[0],
                     window[1], softcap, self.backend, self.deterministic)
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


def _merge(out, lse, o, l):
    """Merge (o, l) into the running (out (b, s, h, d) fp32, lse (b, h, s) fp32): the LSE merge
    of flash_attn_combine over the two."""
    merged, merged_lse = flash_attn_combine(torch.stack([out, o]),
                                            torch.stack([lse, l]).transpose(-1, -2))
    return merged, merged_lse.transpose(1, 2)


class _Exchange(NamedTuple):
    requests: list
    received: list[torch.Tensor]

    def wait(self) -> list[torch.Tensor]:
        for req in self.requests:
            req.wait()
        return self.received


def _start_exchange(ring: _Ring, tensors: list[torch.Tensor]) -> _Exchange:
    """Start sending ``tensors`` to the next rank and receiving the previous rank's into fresh
    buffers; the caller computes meanwhile and waits (``_Exchange.wait``) before using them."""
    def peer(r: int) -> int:
        return dist.get_global_rank(ring.group, r) if ring.group is not None else r

    nxt, prv = peer((ring.rank + 1) % ring.world), peer((ring.rank - 1) % ring.world)
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, ring.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, ring.group) for r in recv]
    return _Exchange(dist.batch_isend_irecv(ops), recv)


def _sequences(ring: _Ring):
    """(first local token, chunk length) of every non-empty local sequence: its local pieces
    (one or two chunks of this rank) follow each other from the first token."""
    pieces = len(_chunk_ids(ring.rank, ring.world, ring.layout))
    for start, length in ring.segments:
        if length:
            yield start, length // pieces


def _ring_forward(ring: _Ring, q, k, v):
    b, t, h, _ = q.shape
    out = torch.zeros(b, t, h, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, t), NEG_INF, dtype=torch.float32, device=q.device)
    kv = [k, v]
    for step in range(ring.world):
        owner = (ring.rank - step) % ring.world
        # The next block travels while this one is attended.
        pending = _start_exchange(ring, kv) if step < ring.world - 1 else None
        for start, chunk in _sequences(ring):
            for pair in _pairs(ring, owner, chunk):
                rows = slice(start + pair.i * chunk, start + pair.i * chunk + pair.rows)
                keys = slice(start + pair.j * chunk, start + pair.j * chunk + pair.keys)
                o, l = ring.blocks.fwd(q[:, rows], kv[0][:, keys], kv[1][:, keys], pair.window,
                                       ring.scale, ring.softcap)
                out[:, rows], lse[:, :, rows] = _merge(out[:, rows], lse[:, :, rows], o.float(),
                                                       l.float())
        if pending is not None:
            kv = pending.wait()
    return out, lse


def _ring_backward(ring: _Ring, dout, q, k, v, out, lse):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = [k, v]
    dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
           torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
    for step in range(ring.world):
        owner = (ring.rank - step) % ring.world
        # K / V of the next step travel during this step's compute; dK / dV after it (they are
        # this step's result).
        pending = _start_exchange(ring, kv) if step < ring.world - 1 else None
        for start, chunk in _sequences(ring):
            for pair in _pairs(ring, owner, chunk):
                rows = slice(start + pair.i * chunk, start + pair.i * chunk + pair.rows)
                keys = slice(start + pair.j * chunk, start + pair.j * chunk + pair.keys)
                gq, gk, gv = ring.blocks.bwd(dout[:, rows], q[:, rows], kv[0][:, keys],
                                             kv[1][:, keys], out[:, rows], lse[:, :, rows],
                                             pair.window, ring.scale, ring.softcap)
                dq[:, rows] += gq.float()
                dkv[0][:, keys] += gk.float()
                dkv[1][:, keys] += gv.float()
        # The last step's block belongs to the next rank: its gradients go home with this send.
        dkv = _start_exchange(ring, dkv).wait()
        if pending is not None:
            kv = pending.wait()
    return dq, dkv[0], dkv[1]


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
    import os

    cuda = device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
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
                         return_lse: bool = False, blocks: BlockAttention | None = None):
    """Attention of one sequence sharded over the ranks of ``group`` (a ProcessGroup, a 1-D
    DeviceMesh, or None for the default group): q, k, v (batch, seqlen / W, heads, head_dim),
    this rank's shard in ``layout`` (``shard``), GQA allowed. Returns this rank's out shard
    (and its lse (batch, heads, seqlen / W) with ``return_lse``), differentiable.

    causal / window_size: as flash_attn_func's over the whole sequence (FA3's semantics: causal
    sets the right bound to 0, a negative bound is unbounded). A chunk pair the window leaves
    empty is skipped (its K / V still travel: the ring passes every block on); a pair the band
    crosses runs on the rectangle of its rows and keys that see each other.

    blocks: the block-pair attention (``KernelBlocks()`` for CUDA fp16 / bf16 tensors, else
    ``reference_blocks``). ``deterministic``: the ring's order is fixed, so the result is
    reproducible whenever the block attention is.
    """
    _check_layout(layout)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {causal!r}")
    left, right = _validate._check_window(window_size, causal)
    group = _resolve_group(group)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    if blocks is None:
        kernels = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
        blocks = KernelBlocks(deterministic=deterministic) if kernels else reference_blocks
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
                                blocks: BlockAttention | None = None):
    """Ring attention over packed sequences (the varlen form of ``ring_flash_attn_func``): q, k, v
    (total / W, heads, head_dim), this rank's ``shard_varlen`` shard of sequences packed by
    ``cu_seqlens`` (int32 (batch + 1,), the whole sequences' offsets, the same on every rank;
    every sequence a multiple of the layout's chunks: 2W tokens zigzag, W contiguous). Each
    sequence attends only to itself; masks per sequence as in ring_flash_attn_func. One K / V
    exchange per step carries every sequence. Returns out (total / W, heads, head_dim) (and lse
    (heads, total / W) with ``return_lse``), differentiable. ``max_seqlen`` is accepted for
    FA3's signature and not needed."""
    _check_layout(layout)
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
        blocks = KernelBlocks(deterministic=deterministic) if kernels else reference_blocks
    ring = _Ring(group, rank, world, layout, (left, right), scale, float(softcap), blocks,
                 segments)
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    _check_ranks_agree(ring, q4, k4, v4)
    out, lse = _RingAttention.apply(q4, k4, v4, ring)
    return (out[0], lse[0]) if return_lse else out[0]


__all__ = ["LAYOUTS", "BlockAttention", "KernelBlocks", "init_from_torchrun", "reference_blocks",
           "ring_flash_attn_func", "ring_flash_attn_varlen_func", "shard", "shard_varlen",
           "unshard", "unshard_varlen"]
