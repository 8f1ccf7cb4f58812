"""The benchmark sweep: one `Case` per attention configuration, expanded from CLI options.

Defaults reproduce the FA3 paper's forward sweep (Figure 5): total tokens b*s = 16k, hidden
h*d = 2048, s in {512 ... 16k}, d in {64, 128, 256}, causal and not, bf16.

dtype e4m3 is FP8 inference (FA3 paper, Figure 6): forward only; fp8_inputs.py says how its inputs
are made and checked. Its FLOPs are counted as for bf16: the same two GEMMs per visible pair.

The mixed dtypes, "<q>+<kv>" (bf16+e4m3, fp16+e4m3, bf16+e5m2, fp16+e5m2: build_info's names), are
the mixed mode: 16-bit q against an FP8 K / V cache with per-head descales, forward only. K and V
are converted to q's dtype before the GEMMs, so the FLOPs, the peak and the GEMM ceiling are q's
dtype's (``gemm_dtype``); only K and V are 1 byte per element.

Varlen cases (``Case.seqlens``, --varlen): one batch of self-attention sequences of different
lengths packed along one token axis (FA's varlen layout), drawn by ``draw_varlen_lengths``: lengths
uniform in [min_len, max_len] until the batch holds total_tokens. seqlen_q = seqlen_k = the
longest (max_seqlen) and batch = the number of sequences; FLOPs, bytes and scores are summed per
sequence, masks apply per sequence. 16-bit dtypes only, forward only (backward rows are skipped
with VARLEN_NO_BACKWARD).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from flash_hopper._tables import canonical_dtype
from flash_hopper.mask import AttentionMask

from .flops import attention_flops

DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_TOTAL_TOKENS = 16384
DEFAULT_HIDDEN = 2048
HALF_DTYPES = ("bf16", "fp16")  # forward and backward; what `info` and `demo` take
FP8_DTYPES = ("e4m3",)  # torch.float8_e4m3fn q, k, v with descales: forward only
# The mixed mode's dtypes (flash_hopper._tables.MIXED_DTYPES, spelled out here so that the CLI's
# --help imports no torch): name -> (q's dtype, K / V's FP8 dtype). Forward only.
MIXED_PARTS = {
    "bf16+e4m3": ("bf16", "e4m3"), "fp16+e4m3": ("fp16", "e4m3"),
    "bf16+e5m2": ("bf16", "e5m2"), "fp16+e5m2": ("fp16", "e5m2"),
}
MIXED_DTYPES = tuple(MIXED_PARTS)
DTYPES = (*HALF_DTYPES, *FP8_DTYPES, *MIXED_DTYPES)
# Element size in bytes of one tensor's dtype, for memory estimates (do inputs fit in L2? is
# sdpa-math too big?); a mixed case's tensors are sized by their parts (Case.q_dtype, kv_dtype).
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "e4m3": 1, "e5m2": 1}
# An FP8 case's output dtype: flash_attn_func's out_dtype default (and FA3's) for FP8 inputs.
FP8_OUT_DTYPE = "bf16"
# Why a forward-only case's backward rows are skipped.
FP8_NO_BACKWARD = "the FP8 (e4m3) forward has no backward"
MIXED_NO_BACKWARD = "the mixed-mode forward (16-bit q, FP8 K / V) has no backward"
VARLEN_NO_BACKWARD = "varlen backward rows are not measured yet"
# --varlen without bounds: a realistic mixed batch, lengths from 128 to 8192.
DEFAULT_VARLEN = (128, 8192)


def dtype_parts(dtype: Any) -> tuple[str, str]:
    """(q's dtype, K / V's dtype) of a sweep dtype: ('bf16', 'e4m3') for 'bf16+e4m3', the dtype
    twice otherwise. It may be spelled in any form flash_hopper.supports takes (torch.bfloat16,
    (torch.bfloat16, torch.float8_e4m3fn), "bfloat16": _tables.canonical_dtype)."""
    dtype = canonical_dtype(dtype)
    return MIXED_PARTS.get(dtype, (dtype, dtype))


def gemm_dtype(dtype: Any) -> str:
    """The dtype of a sweep dtype's tensor-core GEMMs, which picks its peak and GEMM ceiling: q's
    (the mixed mode converts K / V to q's dtype before its 16-bit GEMMs)."""
    return dtype_parts(dtype)[0]


@dataclass(frozen=True)
class Case:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_kv: int
    head_dim: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    dtype: str = "bf16"  # a DTYPES name; other spellings (torch.bfloat16) are converted to it
    # A varlen batch's per-sequence lengths (self-attention: q and k alike), or None (dense).
    seqlens: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))  # frozen: set once here
        if self.seqlens is None:
            return
        longest = max(self.seqlens, default=0)
        if (self.batch, self.seqlen_q, self.seqlen_k) != (len(self.seqlens), longest, longest):
            raise ValueError(f"a varlen case has batch = len(seqlens) and seqlen_q = seqlen_k = "
                             f"max(seqlens) = ({len(self.seqlens)}, {longest}, {longest}), got "
                             f"({self.batch}, {self.seqlen_q}, {self.seqlen_k})")

    @property
    def is_varlen(self) -> bool:
        return self.seqlens is not None

    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def is_mixed(self) -> bool:
        """16-bit q against FP8 K / V (the mixed mode)."""
        return self.dtype in MIXED_PARTS

    @property
    def no_backward_reason(self) -> str | None:
        """Why this case has no backward rows, or None when it has them."""
        if self.is_fp8:
            return FP8_NO_BACKWARD
        if self.is_mixed:
            return MIXED_NO_BACKWARD
        return VARLEN_NO_BACKWARD if self.is_varlen else None

    @property
    def q_dtype(self) -> str:
        return dtype_parts(self.dtype)[0]

    @property
    def kv_dtype(self) -> str:
        return dtype_parts(self.dtype)[1]

    @property
    def out_dtype(self) -> str:
        """FP8: bf16 (flash_attn_func's default); otherwise q's dtype (the mixed mode's too)."""
        return FP8_OUT_DTYPE if self.is_fp8 else self.q_dtype

    @property
    def has_window(self) -> bool:
        return self.window != (-1, -1)

    @property
    def mask_label(self) -> str:
        """Short mask description used in tables and plot panel titles."""
        parts = ["causal" if self.causal else "non-causal"]
        if self.has_window:
            parts.append(f"window{self.window[0]},{self.window[1]}")
        if self.softcap:
            parts.append(f"softcap{self.softcap:g}")
        if self.is_varlen:
            parts.append("varlen")
        return " ".join(parts)

    @property
    def seqlen_label(self) -> str:
        """The lengths as tables print them: '512', '512/2048', or a varlen batch's summary."""
        if self.is_varlen:
            return varlen_label(self.seqlens)
        if self.seqlen_q == self.seqlen_k:
            return str(self.seqlen_q)
        return f"{self.seqlen_q}/{self.seqlen_k}"

    def attention_mask(self) -> AttentionMask:
        """The mask of one (the longest, for varlen) sequence."""
        return AttentionMask.from_args(self.seqlen_q, self.seqlen_k, self.causal, self.window)

    def _sequences(self) -> list[tuple[int, int, int]]:
        """(count, seqlen_q, seqlen_k) per distinct shape: one entry for a dense case. Grouping
        equal lengths makes a varlen batch of equal lengths count exactly the dense FLOPs."""
        if not self.is_varlen:
            return [(self.batch, self.seqlen_q, self.seqlen_k)]
        return [(n, s, s) for s, n in sorted(Counter(self.seqlens).items())]

    def flops(self, direction: str = "fwd") -> float:
        """Per sequence by the FA convention (flops.py), summed over the batch."""
        return sum(attention_flops(n, self.heads, sq, sk, self.head_dim, self.causal,
                                   self.window, direction) for n, sq, sk in self._sequences())

    @property
    def tokens_q(self) -> int:
        return sum(n * sq for n, sq, _ in self._sequences())

    @property
    def tokens_k(self) -> int:
        return sum(n * sk for n, _, sk in self._sequences())

    def cu_seqlens(self) -> list[int]:
        """A varlen batch's offsets: sequence i is tokens [cu[i], cu[i + 1]) (FA's cu_seqlens)."""
        return list(itertools.accumulate(self.seqlens or (), initial=0))

    def input_bytes(self) -> int:
        """Bytes of q, k, v and the output: what one forward call touches at least once (FP8:
        1-byte inputs, a 2-byte output; mixed: 1-byte K / V, 2-byte q and output)."""
        q_or_o = self.tokens_q * self.heads * self.head_dim
        k_and_v = 2 * self.tokens_k * self.heads_kv * self.head_dim
        return (q_or_o * (DTYPE_BYTES[self.q_dtype] + DTYPE_BYTES[self.out_dtype])
                + k_and_v * DTYPE_BYTES[self.kv_dtype])

    def score_elements(self) -> int:
        """h * sum of sq*sk per sequence (b*h*sq*sk when dense): the size of the score matrices
        a naive implementation materializes."""
        return self.heads * sum(n * sq * sk for n, sq, sk in self._sequences())

    def as_dict(self) -> dict[str, object]:
        fields = asdict(self)
        fields["window"] = list(self.window)
        if self.is_varlen:
            fields["seqlens"] = list(self.seqlens)
        return fields


def short_count(n: int) -> str:
    """16384 -> '16k', 1000 -> '1000': binary multiples as the CLI spells them."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def varlen_label(seqlens: Sequence[int]) -> str:
    """'varlen 7 seqs 128..8k (16k tok)': count, shortest..longest and total tokens."""
    count = len(seqlens)
    return (f"varlen {count} seq{'s' * (count != 1)} {short_count(min(seqlens))}.."
            f"{short_count(max(seqlens))} ({short_count(sum(seqlens))} tok)")


def draw_varlen_lengths(min_len: int, max_len: int, total_tokens: int,
                        seed: int = 0) -> tuple[int, ...]:
    """One varlen batch: lengths uniform in [min_len, max_len] from random.Random(seed), drawn
    until they hold total_tokens, the last cut to the remainder (so the sum is exact and the last
    may be shorter than min_len). bench/varlen_speed.py draws the same batch for the same seed."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"varlen bounds must satisfy 1 <= MIN <= MAX, got {min_len},{max_len}")
    rng = random.Random(seed)
    lengths: list[int] = []
    remaining = total_tokens
    while remaining > 0:
        lengths.append(min(rng.randint(min_len, max_len), remaining))
        remaining -= lengths[-1]
    return tuple(lengths)


def parse_count(text: str) -> int:
    """'512' -> 512, '16k' -> 16384, '1m' -> 1048576 (binary multiples, as in the FA papers)."""
    value = text.strip().lower()
    factor = 1
    if value.endswith("k"):
        factor, value = 1024, value[:-1]
    elif value.endswith("m"):
        factor, value = 1024 * 1024, value[:-1]
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"expected an integer such as 512 or 16k, got {text!r}") from None
    result = number * factor
    if result != int(result) or result <= 0:
        raise ValueError(f"expected a positive integer such as 512 or 16k, got {text!r}")
    return int(result)


def parse_varlen(text: str) -> tuple[int, int]:
    """'128,8k' -> (128, 8192): --varlen's MIN,MAX."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"--varlen takes MIN,MAX (e.g. 128,8k), got {text!r}")
    try:
        low, high = (parse_count(p) for p in parts)
    except ValueError as exc:
        raise ValueError(f"--varlen {text}: {exc}") from None
    if low > high:
        raise ValueError(f"--varlen takes MIN <= MAX, got {low} > {high}")
    return low, high


def parse_window(text: str) -> tuple[int, int]:
    """'256,0' -> (256, 0); 'none' -> (-1, -1)."""
    if text.strip().lower() in ("none", "-1,-1", "full"):
        return (-1, -1)
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"window must be LEFT,RIGHT (e.g. 256,0; -1 = unbounded), got {text!r}")
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"window must be two integers LEFT,RIGHT, got {text!r}") from None
    return (max(left, -1), max(right, -1))


def split_list(values: Sequence[str] | None) -> list[str]:
    """Flatten ['64,128', '256'] -> ['64', '128', '256'] so both spellings work on the CLI."""
    out: list[str] = []
    for value in values or ():
        out.extend(part for part in value.split(",") if part.strip())
    return out


@dataclass
class SweepSpec:
    head_dims: Sequence[int] = DEFAULT_HEAD_DIMS
    seqlens: Sequence[int] = DEFAULT_SEQLENS
    seqlens_k: Sequence[int] | None = None  # None: seqlen_k = seqlen_q
    batch: int | None = None  # None: total_tokens // max(sq, sk)
    total_tokens: int = DEFAULT_TOTAL_TOKENS
    heads: int | None = None  # None: hidden // head_dim
    hidden: int = DEFAULT_HIDDEN
    kv_heads: int | None = None  # None: heads (or heads // gqa_ratio)
    gqa_ratio: int = 1
    causal: str = "both"  # both | on | off
    windows: Sequence[tuple[int, int]] = ((-1, -1),)
    softcaps: Sequence[float] = (0.0,)
    dtypes: Sequence[str] = ("bf16",)
    # (min_len, max_len): one drawn varlen batch of total_tokens replaces the seqlen axis.
    varlen: tuple[int, int] | None = None
    seed: int = 0  # the varlen draw's


def _causal_values(mode: str) -> tuple[bool, ...]:
    return {"both": (False, True), "on": (True,), "off": (False,)}[mode]


def build_case(spec: SweepSpec, dtype: str, window: tuple[int, int], softcap: float,
               causal: bool, head_dim: int, seqlen_q: int, seqlen_k: int,
               seqlens: tuple[int, ...] | None = None) -> Case:
    heads = spec.heads if spec.heads else max(1, spec.hidden // head_dim)
    if spec.kv_heads:
        heads_kv = spec.kv_heads
    else:
        heads_kv = max(1, heads // spec.gqa_ratio)
    if heads % heads_kv:
        raise ValueError(f"heads ({heads}) must be a multiple of kv-heads ({heads_kv}) "
                         f"for head dim {head_dim}")
    if seqlens is not None:
        batch = len(seqlens)
    else:
        batch = spec.batch if spec.batch else max(1, spec.total_tokens // max(seqlen_q, seqlen_k))
    return Case(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads=heads,
                heads_kv=heads_kv, head_dim=head_dim, causal=causal, window=tuple(window),
                softcap=float(softcap), dtype=dtype, seqlens=seqlens)


def expand(spec: SweepSpec) -> list[Case]:
    """All cases, ordered so that plot panels (dtype, mask, head dim) come out contiguous. With
    ``spec.varlen``, one varlen case per (dtype, window, softcap, causal, head dim), all of the
    same drawn batch, instead of the seqlen axis."""
    if spec.varlen is not None:
        lengths = draw_varlen_lengths(*spec.varlen, spec.total_tokens, spec.seed)
        return [build_case(spec, dtype, window, softcap, causal, head_dim, max(lengths),
                           max(lengths), lengths)
                for dtype, window, softcap, causal, head_dim in itertools.product(
                    spec.dtypes, spec.windows, spec.softcaps, _causal_values(spec.causal),
                    spec.head_dims)]
    cases = []
    for dtype, window, softcap, causal, head_dim, seqlen in itertools.product(
            spec.dtypes, spec.windows, spec.softcaps, _causal_values(spec.causal),
            spec.head_dims, spec.seqlens):
        for seqlen_k in (spec.seqlens_k or (seqlen,)):
            cases.append(build_case(spec, dtype, window, softcap, causal, head_dim, seqlen,
                                    seqlen_k))
    return cases

