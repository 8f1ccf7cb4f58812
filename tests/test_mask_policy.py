"""The mask policy: the C++ header (kernels/include/flash_hopper/mask.h) against its Python mirror
(flash_hopper.mask), and the mirror against brute force.

- tests/cpp/mask_dump.cpp (compiled here with the host compiler, as the kernels' own header is
  plain C++) prints every tile's key-block range and unmasked split, every row's column interval,
  every row's keys with and without a left pad (the decode kernel's) and a brute-force
  visible-pair count; the mirror must give the same integers.
- The mirror's decisions are then checked element by element against ``naive_visible``, the rule
  written out here from docs/README.md "Numerics contract" (plus the chunk term), independently of
  the mirror's code: every visible element lies inside its tile's key-block range, and the range is
  tight; blocks in the unmasked split are fully visible for every row of the tile, padding rows
  included.

Grid: a few hundred seeded random configurations (lengths 0..300 with 0 and 1 over-represented
and seqlen_q != seqlen_k both ways, windows unbounded / 0 / random, causal, chunk off or random)
on the kernels' tile sizes, plus a few tiny tiles (1, 3, 16 rows or keys) that put several
tiles' worth of edges in one short sequence. A coverage guard fails if a reseed loses a kind.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from flash_hopper.mask import AttentionMask, KeyBlockRange, KeyBlockSplit

ROOT = Path(__file__).resolve().parents[1]
KERNEL_BLOCK_M = (64, 128, 192)  # sm90 tiles: 64 rows per consumer warpgroup; sm80: 64, 128
KERNEL_BLOCK_N = (64, 80, 112, 128, 176)
TINY_BLOCKS = (1, 3, 16)
N_RANDOM = 300


def _length(rng: random.Random) -> int:
    roll = rng.random()
    return 0 if roll < 0.06 else 1 if roll < 0.14 else rng.randint(2, 300)


def _bound(rng: random.Random) -> int:
    roll = rng.random()
    return -1 if roll < 0.4 else 0 if roll < 0.55 else rng.randint(1, 320)


def random_configs(n: int = N_RANDOM, seed: int = 20261201) -> list[tuple[int, ...]]:
    """(seqlen_q, seqlen_k, window_left, window_right, chunk, block_m, block_n) tuples."""
    rng = random.Random(seed)
    configs = [
        # Hand-picked edges: empty sides, single rows/keys, one tile vs many, every mask kind.
        (0, 0, -1, -1, 0, 64, 64), (0, 5, -1, 0, 0, 64, 64), (5, 0, -1, 0, 0, 64, 64),
        (1, 1, -1, 0, 0, 64, 176), (1, 300, -1, 0, 0, 128, 176), (300, 1, -1, 0, 0, 128, 176),
        (300, 300, 0, 0, 0, 192, 128), (257, 129, 5, 3, 0, 64, 80), (129, 257, -1, -1, 64, 64, 64),
        (200, 200, -1, 0, 50, 64, 112), (100, 300, 17, 0, 33, 128, 80),
    ]
    while len(configs) < n:
        right = 0 if rng.random() < 0.3 else _bound(rng)  # causal is the common case
        tiny = rng.random() < 0.2
        block_m = rng.choice(TINY_BLOCKS if tiny else KERNEL_BLOCK_M)
        block_n = rng.choice(TINY_BLOCKS if tiny else KERNEL_BLOCK_N)
        chunk = 0 if rng.random() < 0.5 else rng.randint(1, 320)
        configs.append((_length(rng), _length(rng), _bound(rng), right, chunk, block_m, block_n))
    return configs


CONFIGS = random_configs()


def _id(config) -> str:
    return "sq{}-sk{}-w{},{}-c{}-b{}x{}".format(*config)


def naive_visible(i: torch.Tensor, j: torch.Tensor, seqlen_q: int, seqlen_k: int, left: int,
                  right: int, chunk: int) -> torch.Tensor:
    """The numerics contract's rule (docs/README.md), written out: query i sees key j iff
    0 <= j < seqlen_k and i + sk - sq - left <= j <= i + sk - sq + right (-1: unbounded), and,
    with attention_chunk, j lies in the same chunk as i's diagonal key i + sk - sq."""
    d = i + seqlen_k - seqlen_q
    ok = (j >= 0) & (j < seqlen_k)
    if left >= 0:
        ok = ok & (j >= d - left)
    if right >= 0:
        ok = ok & (j <= d + right)
    if chunk > 0:
        ok = ok & (torch.div(d, chunk, rounding_mode="floor")
                   == torch.div(j, chunk, rounding_mode="floor"))
    return torch.broadcast_to(ok, torch.broadcast_shapes(i.shape, j.shape))


def naive_dense(config, rows: int) -> torch.Tensor:
    """(rows, seqlen_k) truth table; rows may exceed seqlen_q (a tile's padding rows)."""
    seqlen_q, seqlen_k, left, right, chunk = config[:5]
    i = torch.arange(rows).unsqueeze(1)
    j = torch.arange(seqlen_k).unsqueeze(0)
    return naive_visible(i, j, seqlen_q, seqlen_k, left, right, chunk)


def _mask(config) -> AttentionMask:
    return AttentionMask(*config[:5])


def test_grid_covers_every_kind():
    kinds = {
        "sq == 0": any(c[0] == 0 for c in CONFIGS), "sk == 0": any(c[1] == 0 for c in CONFIGS),
        "sq == 1": any(c[0] == 1 for c in CONFIGS), "sk == 1": any(c[1] == 1 for c in CONFIGS),
        "sq < sk": any(0 < c[0] < c[1] for c in CONFIGS),
        "sq > sk": any(c[0] > c[1] > 0 for c in CONFIGS),
        "causal": any(c[3] == 0 and c[2] < 0 for c in CONFIGS),
        "window both sides": any(c[2] > 0 and c[3] > 0 for c in CONFIGS),
        "chunk": sum(c[4] > 0 for c in CONFIGS) > N_RANDOM // 3,
        "chunk and window": any(c[4] > 0 and c[2] >= 0 for c in CONFIGS),
        "several tiles": any(c[0] > 2 * c[5] for c in CONFIGS),
    }
    for bm in KERNEL_BLOCK_M:
        kinds[f"block_m {bm}"] = any(c[5] == bm for c in CONFIGS)
    for bn in KERNEL_BLOCK_N:
        kinds[f"block_n {bn}"] = any(c[6] == bn for c in CONFIGS)
    assert [k for k, present in kinds.items() if not present] == []


# ---- C++ header == Python mirror ----------------------------------------------------------------


def _compiler() -> str:
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    return cxx


@pytest.fixture(scope="module")
def cpp_dump(tmp_path_factory) -> dict[int, dict]:
    """{config index: {"m": [(m, n_min, n_max, n_left, n_right)], "n": [(n, m_min, m_max)],
    "r": [(row, lo, hi)], "k": [(row, first, lo, hi)],
    "pairs": count}} from mask_dump.cpp."""
    exe = tmp_path_factory.mktemp("mask") / "mask_dump"
    subprocess.run([_compiler(), "-std=c++17", "-O1", "-Wall", "-Werror",
                    f"-I{ROOT / 'kernels' / 'include'}", "-o", str(exe),
                    str(ROOT / "tests" / "cpp" / "mask_dump.cpp")], check=True)
    stdin = "".join(" ".join(map(str, c)) + "\n" for c in CONFIGS)
    done = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True)
    dump: dict[int, dict] = {}
    current: dict = {}
    for line in done.stdout.splitlines():
        kind, *values = line.split()
        numbers = tuple(int(v) for v in values)
        if kind == "config":
            current = dump[numbers[0]] = {"m": [], "n": [], "r": [], "k": []}
        elif kind == "pairs":
            current["pairs"] = numbers[0]
        else:
            current[kind].append(numbers)
    assert len(dump) == len(CONFIGS), "mask_dump stopped early"
    return dump


def python_dump(config) -> dict:
    mask, (block_m, block_n) = _mask(config), config[5:]
    m_blocks = -(-mask.seqlen_q // block_m)
    tiles = []
    for m in range(m_blocks):
        r = mask.key_blocks(m, block_m, block_n)
        s = mask.unmasked_blocks(r, m, block_m, block_n)
        tiles.append((m, r.n_min, r.n_max, s.n_left, s.n_right))
    n_blocks = -(-mask.seqlen_k // block_n)
    key_tiles = []
    for n in range(n_blocks + 1):
        q = mask.query_blocks(n, block_m, block_n)
        key_tiles.append((n, q.m_min, q.m_max))
    columns = [mask.columns(row) for row in range(m_blocks * block_m)]
    rows = [(row, c.lo, c.hi) for row, c in enumerate(columns)]
    ranges = [(row, first, mask.keys(row, first))
              for row in range(mask.seqlen_q) for first in (0, row % 5)]
    keys = [(row, first, k.lo, k.hi) for row, first, k in ranges]
    return {"m": tiles, "n": key_tiles, "r": rows, "k": keys, "pairs": mask.visible_pairs()}


def test_cpp_header_equals_python_mirror(cpp_dump):
    mismatches = []
    for index, config in enumerate(CONFIGS):
        expected, got = cpp_dump[index], python_dump(config)
        for key in ("m", "n", "r", "k", "pairs"):
            if expected[key] != got[key]:
                first = next((e, g) for e, g in zip(expected[key], got[key]) if e != g) \
                    if key != "pairs" else (expected[key], got[key])
                mismatches.append(f"{_id(config)} {key}: C++ {first[0]} vs Python {first[1]}")
    assert mismatches == [], "\n".join(mismatches[:20])


def test_cpp_pair_count_equals_brute_force(cpp_dump):
    for index, config in enumerate(CONFIGS):
        assert cpp_dump[index]["pairs"] == int(naive_dense(config, config[0]).sum()), _id(config)


# ---- the mirror against the rule, element by element ------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_mirror_visible_equals_the_rule(config):
    mask = _mask(config)
    seqlen_q, seqlen_k = config[:2]
    # Columns one tile beyond both ends: visible() must refuse negative and >= seqlen_k keys.
    i = torch.arange(seqlen_q).unsqueeze(1)
    j = torch.arange(-3, seqlen_k + 3).unsqueeze(0)
    truth = naive_visible(i, j, *config[:5])
    assert torch.equal(torch.broadcast_to(mask.visible(i, j), truth.shape), truth)
    assert torch.equal(mask.dense(), truth[:, 3:seqlen_k + 3])
    assert mask.visible_pairs() == int(truth.sum())
    # Python ints, and 0-dim tensors as flex attention's mask_mod receives them, on a sample.
    rng = random.Random(seqlen_q * 1000 + seqlen_k)
    for _ in range(20 if seqlen_q else 0):
        row, col = rng.randrange(seqlen_q), rng.randrange(-3, seqlen_k + 3)
        expected = bool(truth[row, col + 3])
        assert mask.visible(row, col) is expected
        assert bool(mask.visible(torch.tensor(row), torch.tensor(col))) is expected


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_mirror_keys_are_the_rule_after_a_left_pad(config):
    """keys(row, first), the decode kernel's interval: keys [0, first) are a left pad and the
    rest follow the rule on the seqlen_k - first keys after it (the FA paths' frame)."""
    mask = _mask(config)
    seqlen_q, seqlen_k = config[:2]
    i = torch.arange(seqlen_q).unsqueeze(1)
    for first in sorted({0, min(1, seqlen_k), seqlen_k // 3, seqlen_k}):
        j = torch.arange(seqlen_k - first).unsqueeze(0)
        truth = naive_visible(i, j, seqlen_q, seqlen_k - first, *config[2:5])
        ranges = [mask.keys(row, first) for row in range(seqlen_q)]
        lo = torch.tensor([r.lo for r in ranges], dtype=torch.long).unsqueeze(1)
        hi = torch.tensor([r.hi for r in ranges], dtype=torch.long).unsqueeze(1)
        got = (j + first >= lo) & (j + first < hi)
        assert torch.equal(got, truth), (_id(config), first)
        assert all(r.empty() or first <= r.lo < r.hi <= seqlen_k for r in ranges)


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_mirror_tiles_are_consistent_with_the_rule(config):
    mask, (block_m, block_n) = _mask(config), config[5:]
    seqlen_q, seqlen_k = config[:2]
    m_blocks = -(-seqlen_q // block_m)
    n_blocks = -(-seqlen_k // block_n)
    truth = naive_dense(config, m_blocks * block_m)  # padding rows follow the rule too
    for m in range(m_blocks):
        rows = slice(m * block_m, min((m + 1) * block_m, seqlen_q))
        padded = slice(m * block_m, (m + 1) * block_m)
        r = mask.key_blocks(m, block_m, block_n)
        s = mask.unmasked_blocks(r, m, block_m, block_n)
        where = f"{_id(config)} m_block {m}: range {r}, split {s}"
        assert r.n_min <= r.n_max or r.empty(), where
        if r.empty():
            assert not truth[rows].any(), where + ": an empty range hides a visible element"
            continue
        assert 0 <= r.n_min <= s.n_left <= s.n_right <= r.n_max <= n_blocks, where
        for n in range(n_blocks):
            cols = slice(n * block_n, (n + 1) * block_n)
            inside = r.n_min <= n < r.n_max
            # Tight: a block is visited iff some real row of the tile sees one of its keys.
            assert bool(truth[rows, cols].any()) == inside, f"{where}: block {n}"
            if not s.masked(n):
                full_block = (n + 1) * block_n <= seqlen_k
                assert full_block and bool(truth[padded, cols].all()), (
                    f"{where}: block {n} is unmasked but not fully visible")


@pytest.mark.parametrize("config", CONFIGS, ids=_id)
def test_query_blocks_is_the_transpose_of_key_blocks(config):
    """The backward's loop (query blocks per key block) visits exactly the pairs the forward's
    does, so each dq block's contributors are the key blocks of its key_blocks range."""
    mask, (block_m, block_n) = _mask(config), config[5:]
    m_blocks, n_blocks = -(-mask.seqlen_q // block_m), -(-mask.seqlen_k // block_n)
    for n in range(n_blocks + 1):
        q = mask.query_blocks(n, block_m, block_n)
        expected = [m for m in range(m_blocks)
                    if mask.key_blocks(m, block_m, block_n).n_min <= n
                    < mask.key_blocks(m, block_m, block_n).n_max]
        assert list(range(q.m_min, max(q.m_min, q.m_max))) == expected, (_id(config), n)


def test_named_results_mirror_the_header():
    mask = AttentionMask(seqlen_q=3, seqlen_k=5, window_left=-1, window_right=0)
    assert mask.diag() == 2
    r = mask.key_blocks(0, 64, 64)
    assert r == KeyBlockRange(0, 1) and not r.empty()
    assert mask.unmasked_blocks(r, 0, 64, 64) == KeyBlockSplit(0, 0)  # the tail block is masked
    assert KeyBlockSplit(1, 3).masked(0) and not KeyBlockSplit(1, 3).masked(2)
    assert KeyBlockRange(2, 2).empty()
    chunked = AttentionMask(10, 10, chunk=4)
    assert [chunked.chunk_start(c) for c in (-5, -4, -1, 0, 3, 4, 9)] == [-8, -4, -4, 0, 0, 4, 8]
    assert (chunked.columns(5).lo, chunked.columns(5).hi) == (4, 8)
    assert (chunked.columns(9).lo, chunked.columns(9).hi) == (8, 10)  # clipped to seqlen_k
    # lo may be negative (no clipping at 0), as in the header.
    assert AttentionMask(4, 4, window_left=2, window_right=0).columns(0).lo == -2


def test_from_args_follows_flash_attn_func():
    assert AttentionMask.from_args(7, 9, causal=True, window_size=(16, 5)) == AttentionMask(
        7, 9, 16, 0, 0)
    assert AttentionMask.from_args(7, 9, window_size=(-5, -2)) == AttentionMask(7, 9, -1, -1)
    assert AttentionMask.from_args(7, 9).is_full
    assert AttentionMask.from_args(7, 9, causal=True).is_plain_causal
    assert not AttentionMask.from_args(7, 9, causal=True, chunk=4).is_plain_causal
    assert not AttentionMask.from_args(7, 9, causal=True, window_size=(3, -1)).is_plain_causal


@pytest.mark.parametrize("field,value,message", [
    ("seqlen_q", -1, "seqlen_q: expected an int >= 0, got -1"),
    ("window_left", -2, "window_left: expected an int >= -1, got -2"),
    ("window_right", 1.5, "window_right: expected an int >= -1, got 1.5"),
    ("chunk", -4, "chunk: expected an int >= 0, got -4"),
])
def test_bad_fields_name_the_argument(field, value, message):
    fields = {"seqlen_q": 4, "seqlen_k": 4, "window_left": -1, "window_right": -1, "chunk": 0}
    fields[field] = value
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        AttentionMask(**fields)
