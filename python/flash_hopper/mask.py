"""The attention mask policy in Python: a mirror of kernels/include/flash_hopper/mask.h.

One rule decides which key column j a query row i sees (docs/README.md, the numerics contract; bottom-right aligned): with
diag = seqlen_k - seqlen_q,

    0 <= j < seqlen_k
    and (window_left  < 0  or  j >= i + diag - window_left)
    and (window_right < 0  or  j <= i + diag + window_right)      causal: window_right = 0
    and (chunk <= 0  or  floor((i + diag) / chunk) == floor(j / chunk))

``chunk`` is FA3's ``attention_chunk`` (chunked-local attention). ``AttentionMask`` has the C++
struct's fields and methods with the same names and the same integer results (floor division in
``chunk_start``; ``columns(row).lo`` may be negative, ``hi`` is clipped to seqlen_k; ``keys`` is
the decode kernel's clipped interval with a left pad), so the
reference walks key blocks exactly like the kernels, and tests/test_mask_policy.py compares the
two on random configurations. On top of the mirror sit the vectorized forms the rest of Python
needs: ``visible`` and ``columns`` work elementwise on torch tensors as well as on ints (flex
attention's mask_mod, SDPA's explicit masks), ``dense`` builds a boolean (rows, cols) tile for
the reference, and ``visible_pairs`` counts visible (i, j) pairs exactly for the FLOP counter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch

# A row or column index: a Python int, or a tensor of them (results then broadcast elementwise).
Index = Union[int, torch.Tensor]


@dataclass(frozen=True)
class KeyBlockRange:
    """Key blocks [n_min, n_max) a query tile visits; empty when n_max <= n_min."""

    n_min: int
    n_max: int

    def empty(self) -> bool:
        return self.n_max <= self.n_min


@dataclass(frozen=True)
class KeyBlockSplit:
    """Key blocks [n_left, n_right) of a tile's range that need no element mask."""

    n_left: int
    n_right: int

    def masked(self, n: int) -> bool:
        return n < self.n_left or n >= self.n_right


@dataclass(frozen=True)
class QueryBlockRange:
    """Query blocks [m_min, m_max) that visit one key block (the backward); empty when
    m_max <= m_min."""

    m_min: int
    m_max: int

    def empty(self) -> bool:
        return self.m_max <= self.m_min


@dataclass(frozen=True)
class ColumnRange:
    """Visible key columns [lo, hi) of a row (or of each row, for a tensor of rows).

    hi <= seqlen_k; lo may be negative (it then means "from column 0"); lo >= hi: no key.
    """

    lo: Index
    hi: Index


@dataclass(frozen=True)
class KeyRange(ColumnRange):
    """Visible keys [lo, hi) of a row clipped to the sequence (``keys``; ints): the mask.h
    struct of that name, empty when hi <= lo."""

    def empty(self) -> bool:
        return self.hi <= self.lo

    def size(self) -> int:
        return max(self.hi - self.lo, 0)


def _minimum(a: Index, b: Index) -> Index:
    # torch.minimum wants two tensors; clamp takes a tensor and a Python number.
    if isinstance(a, torch.Tensor):
        return torch.minimum(a, b) if isinstance(b, torch.Tensor) else a.clamp(max=b)
    if isinstance(b, torch.Tensor):
        return b.clamp(max=a)
    return min(a, b)


def _maximum(a: Index, b: Index) -> Index:
    if isinstance(a, torch.Tensor):
        return torch.maximum(a, b) if isinstance(b, torch.Tensor) else a.clamp(min=b)
    if isinstance(b, torch.Tensor):
        return b.clamp(min=a)
    return max(a, b)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class AttentionMask:
    seqlen_q: int
    seqlen_k: int
    window_left: int = -1  # -1: unbounded
    window_right: int = -1  # -1: unbounded; 0: causal
    chunk: int = 0  # 0: off

    def __post_init__(self) -> None:
        _check_int("seqlen_q", self.seqlen_q, 0)
        _check_int("seqlen_k", self.seqlen_k, 0)
        _check_int("window_left", self.window_left, -1)
        _check_int("window_right", self.window_right, -1)
        _check_int("chunk", self.chunk, 0)

    @classmethod
    def from_args(cls, seqlen_q: int, seqlen_k: int, causal: bool = False,
                  window_size: Sequence[int] = (-1, -1), chunk: int = 0) -> AttentionMask:
        """The mask of flash_attn_func's arguments: any negative bound means unbounded, and
        causal sets the right bound to 0 (keeping a left window), as FA3's interface does."""
        left, right = (int(w) for w in window_size)
        left, right = max(left, -1), max(right, -1)
        return cls(int(seqlen_q), int(seqlen_k), left, 0 if causal else right, int(chunk))

    # ---- the mirror of mask.h ------------------------------------------------------------------

    def diag(self) -> int:
        """The key column on query row i's diagonal is i + diag()."""
        return self.seqlen_k - self.seqlen_q

    def chunk_start(self, c: Index) -> Index:
        """Start of the chunk that column c falls in (floor division: c may be negative)."""
        return (c // self.chunk) * self.chunk  # // floors for ints and for integer tensors

    def columns(self, row: Index) -> ColumnRange:
        lo: Index = 0
        hi: Index = self.seqlen_k
        if self.window_right >= 0:
            hi = _minimum(hi, row + self.diag() + self.window_right + 1)
        if self.window_left >= 0:
            lo = row + self.diag() - self.window_left
        if self.chunk > 0:
            c0 = self.chunk_start(row + self.diag())
            lo = _maximum(lo, c0)
            hi = _minimum(hi, c0 + self.chunk)
        return ColumnRange(lo, hi)

    def keys(self, row: int, first: int = 0) -> KeyRange:
        """Row's visible keys clipped to [first, seqlen_k), keys [0, first) a left pad (the
        decode kernel's cache_leftpad): columns() of the keys after the pad, shifted by first."""
        diagonal = self.seqlen_k - self.seqlen_q + row
        lo, hi = first, self.seqlen_k
        if self.window_right >= 0 and diagonal + self.window_right + 1 < hi:
            hi = diagonal + self.window_right + 1
        if self.window_left >= 0 and diagonal - self.window_left > lo:
            lo = diagonal - self.window_left
        if self.chunk > 0:
            c0 = first + self.chunk_start(row + self.diag() - first)
            lo = max(lo, c0)
            hi = min(hi, c0 + self.chunk)
        return KeyRange(lo, hi)

    def visible(self, row: Index, col: Index) -> bool | torch.Tensor:
        """Whether row sees col; elementwise (broadcast) when either is a tensor."""
        r = self.columns(row)
        return (col >= 0) & (col >= r.lo) & (col < r.hi)

    def key_blocks(self, m_block: int, block_m: int, block_n: int) -> KeyBlockRange:
        first_row = m_block * block_m
        last_row = min(first_row + block_m, self.seqlen_q) - 1
        key_end = self.columns(last_row).hi  # exclusive
        key_begin = max(self.columns(first_row).lo, 0)
        n_max = 0 if key_end <= 0 else (key_end + block_n - 1) // block_n
        n_min = n_max if key_begin >= self.seqlen_k else key_begin // block_n
        return KeyBlockRange(n_min, n_max)

    def unmasked_blocks(self, block_range: KeyBlockRange, m_block: int, block_m: int,
                        block_n: int) -> KeyBlockSplit:
        # Right: the first row's hi (window edge, chunk end, sequence tail); left: the lo of the
        # tile's last row counted over all block_m rows (see mask.h).
        right_end = self.columns(m_block * block_m).hi
        left_begin = self.columns((m_block + 1) * block_m - 1).lo
        n_right = 0 if right_end <= 0 else right_end // block_n
        n_left = 0 if left_begin <= 0 else (left_begin + block_n - 1) // block_n
        n_left = max(block_range.n_min, min(n_left, block_range.n_max))
        n_right = max(n_left, min(n_right, block_range.n_max))
        return KeyBlockSplit(n_left, n_right)

    def query_blocks(self, n_block: int, block_m: int, block_n: int) -> QueryBlockRange:
        """The transpose of key_blocks, by the header's two binary searches over it."""
        num_m = -(-self.seqlen_q // block_m)
        lo, hi = 0, num_m
        while lo < hi:  # first m with n_block < n_max(m)
            mid = (lo + hi) // 2
            if n_block < self.key_blocks(mid, block_m, block_n).n_max:
                hi = mid
            else:
                lo = mid + 1
        m_min, hi = lo, num_m
        while lo < hi:  # first m >= m_min with n_min(m) > n_block
            mid = (lo + hi) // 2
            if self.key_blocks(mid, block_m, block_n).n_min > n_block:
                hi = mid
            else:
                lo = mid + 1
        return QueryBlockRange(m_min, lo)

    # ---- vectorized helpers --------------------------------------------------------------------

    @property
    def is_full(self) -> bool:
        """No window and no chunk: every row sees every key (no mask to build or pass)."""
        return self.window_left < 0 and self.window_right < 0 and self.chunk <= 0

    @property
    def is_plain_causal(self) -> bool:
        """Causal and nothing else (what SDPA's is_causal and the FA FLOP convention mean when
        seqlen_q == seqlen_k)."""
        return self.window_left < 0 and self.window_right == 0 and self.chunk <= 0

    def dense(self, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
              device: torch.device | str | None = None) -> torch.Tensor:
        """Bool (rows, cols) tensor, True where the row sees the column.

        ``rows`` / ``cols`` = (start, stop) select a tile of the full (seqlen_q, seqlen_k) mask.
        """
        r0, r1 = rows if rows is not None else (0, self.seqlen_q)
        c0, c1 = cols if cols is not None else (0, self.seqlen_k)
        i = torch.arange(r0, r1, device=device).unsqueeze(1)
        j = torch.arange(c0, c1, device=device).unsqueeze(0)
        # Contiguous: callers hand it to SDPA or invert it; a broadcast view would be read-only.
        return torch.broadcast_to(self.visible(i, j), (r1 - r0, c1 - c0)).contiguous()

    def visible_pairs(self) -> int:
        """Exact number of visible (i, j) pairs: each row's interval length, summed (O(seqlen_q)
        work, no (seqlen_q, seqlen_k) tensor)."""
        if self.seqlen_q == 0:
            return 0
        r = self.columns(torch.arange(self.seqlen_q, dtype=torch.int64))
        lengths = (torch.as_tensor(r.hi) - torch.as_tensor(r.lo).clamp(min=0)).clamp(min=0)
        return int(torch.broadcast_to(lengths, (self.seqlen_q,)).sum())
