// Host test of the decode kernel's plan (kernels/include/flash_hopper/decode_plan.h): the keys a
// row sees, from the shared mask policy (mask.h, AttentionMask::keys on sequence_mask), against a
// brute-force mask and against the FA paths' frame of the same mask (columns() of the keys after
// the left pad), a row block's range as the union of its rows', splits that cover each range
// exactly once in whole blocks, page lookups (power-of-two and other page sizes, clamped ids,
// 64-bit offsets), the split heuristic's bounds and the workspace layout.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "flash_hopper/decode_plan.h"
#include "host_check.h"

using flash_hopper::AttentionMask;
using flash_hopper::ColumnRange;
using flash_hopper::KeyRange;
using namespace flash_hopper::decode;

// Floor division (a may be negative).
static int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// FA3's bottom-right aligned mask on keys [lead, seqlen), brute force: the diagonal on the last
// key, chunks (attention_chunk) counted from the first key after the pad.
static bool visible(int seqlen, int lead, int seqlen_q, int t, int key, int wl, int wr,
                    int chunk = 0) {
  if (key < lead || key >= seqlen) {
    return false;
  }
  const int pos = seqlen - seqlen_q + t;
  if (wr >= 0 && key > pos + wr) {
    return false;
  }
  if (wl >= 0 && key < pos - wl) {
    return false;
  }
  if (chunk > 0 && floor_div(pos - lead, chunk) != floor_div(key - lead, chunk)) {
    return false;
  }
  return true;
}

// The same row in the FA paths' frame (varlen.h drops the pad from the span): columns() of the
// seqlen - lead keys after the pad, clipped to them and shifted back by lead.
static KeyRange fa_frame(int seqlen, int lead, int seqlen_q, int t, int wl, int wr, int chunk) {
  const AttentionMask fa{seqlen_q, seqlen - lead, wl, wr, chunk};
  const ColumnRange c = fa.columns(t);
  return {lead + (c.lo > 0 ? c.lo : 0), lead + c.hi};
}

// Every key of every row: the decode kernel's keys (the shared mask's keys() with the left pad)
// against the brute force and against the FA paths' frame; chunks too, which the kernels leave at
// 0 (the API splits chunked calls) but the policy keeps one rule for.
static void rows_and_blocks() {
  const int windows[][2] = {{-1, -1}, {-1, 0}, {5, 0}, {0, 0}, {30, 7}, {-1, 3}, {2, -1}};
  for (int seqlen = 0; seqlen <= 70; seqlen += 7) {
    for (int lead = 0; lead <= seqlen; lead += 9) {
      for (int seqlen_q = 1; seqlen_q <= 9; seqlen_q += 4) {
        for (const auto& w : windows) {
          for (int chunk : {0, 1, 6, 16}) {
            const AttentionMask mask{seqlen_q, seqlen, w[0], w[1], chunk};
            for (int t = 0; t < seqlen_q; ++t) {
              const KeyRange r = mask.keys(t, lead);
              for (int key = -2; key < seqlen + 2; ++key) {
                const bool in = key >= r.lo && key < r.hi;
                CHECK(in == visible(seqlen, lead, seqlen_q, t, key, w[0], w[1], chunk),
                      "keys() seqlen %d lead %d sq %d t %d key %d window (%d, %d) chunk %d",
                      seqlen, lead, seqlen_q, t, key, w[0], w[1], chunk);
              }
              const KeyRange f = fa_frame(seqlen, lead, seqlen_q, t, w[0], w[1], chunk);
              CHECK((r.empty() && f.hi <= f.lo) || (r.lo == f.lo && r.hi == f.hi),
                    "keys() [%d, %d) vs the FA frame [%d, %d): seqlen %d lead %d sq %d t %d "
                    "window (%d, %d) chunk %d",
                    r.lo, r.hi, f.lo, f.hi, seqlen, lead, seqlen_q, t, w[0], w[1], chunk);
            }
          }
          const AttentionMask mask = sequence_mask(seqlen, seqlen_q, w[0], w[1]);
          for (int group = 1; group <= 8; group *= 2) {
            const int rows = seqlen_q * group;
            for (int first = 0; first < rows; first += kRowsPerCta) {
              const int count = imin(kRowsPerCta, rows - first);
              const KeyRange b = block_keys(mask, lead, group, first, count);
              for (int i = first; i < first + count; ++i) {  // every row's keys inside
                const KeyRange r = mask.keys(i / group, lead);
                CHECK(r.empty() || (r.lo >= b.lo && r.hi <= b.hi),
                      "block_keys misses row %d's keys", i);
              }
            }
          }
        }
      }
    }
  }
}

// aligned_keys: the start rounded down to a multiple of kKeyAlign (never below 0), the end kept,
// an empty range left empty.
static void aligned_keys_round_the_start_down() {
  for (int lo = 0; lo < 40; ++lo) {
    for (int size = 0; size < 9; ++size) {
      const KeyRange r = aligned_keys(KeyRange{lo, lo + size});
      if (size == 0) {
        CHECK(r.lo == lo && r.hi == lo, "empty [%d, %d) became [%d, %d)", lo, lo, r.lo, r.hi);
        continue;
      }
      CHECK(r.lo % kKeyAlign == 0 && r.lo <= lo && lo - r.lo < kKeyAlign && r.lo >= 0,
            "[%d, %d) starts at %d", lo, lo + size, r.lo);
      CHECK(r.hi == lo + size, "[%d, %d) ends at %d", lo, lo + size, r.hi);
    }
  }
}

static void splits_cover_once() {
  for (int lo = 0; lo < 130; lo += 37) {
    for (int size = 0; size <= 1000; size += 61) {
      for (int splits = 1; splits <= 40; splits += 3) {
        const KeyRange r{lo, lo + size};
        int next = lo;
        int blocks = 0;
        for (int s = 0; s < splits; ++s) {
          const KeyRange k = split_keys(r, s, splits, kBlockN);
          if (k.empty()) {
            continue;
          }
          CHECK(k.lo == next, "split %d of %d starts at %d, expected %d", s, splits, k.lo, next);
          CHECK(k.hi == r.hi || (k.hi - k.lo) % kBlockN == 0, "split %d not whole blocks", s);
          blocks += (k.size() + kBlockN - 1) / kBlockN;
          next = k.hi;
        }
        CHECK(next == r.hi || size == 0, "splits end at %d, expected %d", next, r.hi);
        CHECK(blocks == (size + kBlockN - 1) / kBlockN, "splits hold %d blocks", blocks);
        if (splits > 1 && size > 0) {  // balanced: block counts differ by at most one
          int most = 0;
          int least = 1 << 30;
          for (int s = 0; s < splits; ++s) {
            const KeyRange k = split_keys(r, s, splits, kBlockN);
            const int n = (k.size() + kBlockN - 1) / kBlockN;
            most = n > most ? n : most;
            least = n < least ? n : least;
          }
          CHECK(most - least <= 1, "unbalanced splits %d..%d", least, most);
        }
      }
    }
  }
}

static void pages() {
  const int sizes[] = {1, 3, 16, 17, 64, 256};
  for (int ps : sizes) {
    std::vector<int32_t> table = {5, -7, 2, 1000000, 0, 3, 4, 1};
    KvPages p{table.data(), 0, ps, power_of_two_shift(ps), 6};
    for (int key = 0; key < int(table.size()) * ps; ++key) {
      int64_t page;
      int64_t slot;
      p.locate(key, &page, &slot);
      int32_t want = table[key / ps];
      want = want < 0 ? 0 : (want > 5 ? 5 : want);
      CHECK(page == want && slot == key % ps, "page size %d key %d -> (%lld, %lld)", ps, key,
            (long long)page, (long long)slot);
    }
  }
  for (int ps : sizes) {  // PageWalk: the same (entry, slot) as a division per key
    KvPages p{nullptr, 0, ps, power_of_two_shift(ps), 1};
    for (int first = 0; first < 40; first += 13) {
      for (int step = 1; step <= 64; step *= 4) {
        PageWalk w = PageWalk::start(p, first, step);
        for (int i = 0; i < 50; ++i) {
          const int key = first + i * step;
          CHECK(w.index == key / ps && w.slot == key % ps,
                "PageWalk page %d first %d step %d i %d -> (%d, %d)", ps, first, step, i, w.index,
                w.slot);
          w.next();
        }
      }
    }
  }
  KvPages dense{nullptr, 7, 1 << 20, -1, 9};
  int64_t page;
  int64_t slot;
  dense.locate(123456, &page, &slot);
  CHECK(page == 7 && slot == 123456, "dense lookup");
  // 64-bit offsets: a page id near 2^31 / page elements times the page stride
  const int64_t stride = int64_t(16) * 8 * 128;
  std::vector<int32_t> far = {3000000};
  KvPages big{far.data(), 0, 16, 4, 4000000};
  big.locate(5, &page, &slot);
  CHECK(page * stride > (int64_t(1) << 31) && slot == 5, "64-bit page offset");
  CHECK(power_of_two_shift(1) == 0 && power_of_two_shift(64) == 6 && power_of_two_shift(48) == -1,
        "power_of_two_shift");
}

static void heuristic_and_workspace() {
  // One wave: tiles x splits never past the slots, at least min_keys per split, capped.
  for (int64_t tiles = 1; tiles <= 600; tiles += 13) {
    for (int64_t keys = 0; keys <= 300000; keys += 7777) {
      const int s = default_splits(tiles, keys, 132, 2, 256);
      CHECK(s >= 1 && s <= kMaxSplits, "splits %d out of range", s);
      if (s > 1) {
        CHECK(tiles * s <= 264, "tiles %lld x splits %d past one wave", (long long)tiles, s);
        CHECK(keys / s >= 256, "splits %d of %lld keys below min_keys", s, (long long)keys);
      }
    }
  }
  CHECK(default_splits(8, 8192, 132, 2, 256) == 32, "batch 1, GQA 32/8, 8k: 32 splits");
  CHECK(default_splits(256, 32768, 132, 2, 256) == 1, "a full wave does not split");
  const DecodeWorkspace w = decode_workspace(10, 3, 128);
  CHECK(w.lse == 0 && w.partial == align256(3 * 10 * kRowsPerCta * 4), "workspace offsets");
  CHECK(w.bytes == w.partial + align256(int64_t(3) * 10 * kRowsPerCta * 128 * 4), "bytes");
  CHECK(decode_workspace(10, 1, 128).bytes == 0, "no workspace without splits");
}

// The combine grid: the kernel's walk (CTA y of `groups` takes rows y R + k groups R + [0, R))
// merges every valid row of a row block exactly once, one pass per CTA where the grid fits the
// SMs, and never puts more CTAs than SMs on a call that has more than one per row block.
static void combine_grid() {
  for (int head_dim : {64, 128, 256}) {
    const int per = combine_rows_per_pass(head_dim);
    CHECK(per * (head_dim / 4) == kThreads, "d%d: %d rows per pass fill the CTA", head_dim, per);
    for (int rows = 1; rows <= 3 * kRowsPerCta; ++rows) {
      for (int64_t blocks : {1, 8, 16, 33, 64, 132, 1000}) {
        const int groups = combine_row_groups(rows, per, blocks, 132);
        const int valid = imin(rows, kRowsPerCta);
        CHECK(groups >= 1, "groups %d", groups);
        CHECK(groups == 1 || blocks * groups <= 132, "d%d rows %d blocks %lld: %d groups past "
              "the SMs", head_dim, rows, (long long)blocks, groups);
        CHECK(groups * per < valid + per, "d%d rows %d: group %d has no row", head_dim, rows,
              groups - 1);
        std::vector<int> seen(valid, 0);
        int passes = 0;
        for (int y = 0; y < groups; ++y) {
          int mine = 0;
          for (int i0 = y * per; i0 < valid; i0 += groups * per, ++mine) {
            for (int i = i0; i < i0 + per && i < valid; ++i) {
              ++seen[i];
            }
          }
          passes = imax(passes, mine);
        }
        for (int i = 0; i < valid; ++i) {
          CHECK(seen[i] == 1, "d%d rows %d groups %d: row %d merged %d times", head_dim, rows,
                groups, i, seen[i]);
        }
        if (blocks * ((valid + per - 1) / per) <= 132) {
          CHECK(passes == 1, "d%d rows %d blocks %lld: %d passes where the grid fits",
                head_dim, rows, (long long)blocks, passes);
        }
      }
    }
  }
  CHECK(combine_row_groups(16, 4, 8, 132) == 4, "1 x GQA 32/8, q 4, d128: 4 CTAs per row block");
  // two row blocks per CTA: even counts at d <= 128 only
  CHECK(row_tiles_per_cta(2, 128) == 2 && row_tiles_per_cta(4, 64) == 2, "pairs");
  CHECK(row_tiles_per_cta(1, 128) == 1 && row_tiles_per_cta(3, 128) == 1 &&
            row_tiles_per_cta(2, 256) == 1,
        "no pairs: one or an odd count of row blocks, d256");
  CHECK(combine_row_groups(16, 4, 128, 132) == 1, "128 row blocks: one CTA each");
}

// Windows of any int64 the API takes: clamp_window turns every bound at or past its reach into
// "unbounded" (what it means there), and the mask's keys() bounds never wrap, even with a cache
// of INT32_MAX keys. A window of 2^32 must not become 0 (one key) and one of 2^31 - 1 on the
// right must not overflow into an empty row.
static void huge_windows() {
  const int64_t huge[] = {int64_t{1} << 32, (int64_t{1} << 31) - 1, int64_t{1} << 40,
                          int64_t{1} << 62};
  for (int64_t w : huge) {
    CHECK(clamp_window(w, /*reach=*/1000) == -1, "clamp_window(%lld) bounded", (long long)w);
  }
  CHECK(clamp_window(-5, 1000) == -1 && clamp_window(999, 1000) == 999 &&
            clamp_window(1000, 1000) == -1,
        "clamp_window at its reach");
  // causal, window_left 2^32: every key of the row (the FA path's answer), not one
  const int capacity = 4096;
  KeyRange r = sequence_mask(100, 1, clamp_window(int64_t{1} << 32, capacity), 0).keys(0, 0);
  CHECK(r.lo == 0 && r.hi == 100, "causal + window 2^32: [%d, %d)", r.lo, r.hi);
  // window_right 2^31 - 1 unclamped: pos + w + 1 passes INT32_MAX, computed in 64 bits
  r = sequence_mask(100, 1, -1, INT32_MAX).keys(0, 0);
  CHECK(r.lo == 0 && r.hi == 100, "window_right INT32_MAX: [%d, %d)", r.lo, r.hi);
  r = sequence_mask(INT32_MAX, 1, INT32_MAX - 1, 0).keys(0, 0);
  CHECK(r.lo == 0 && r.hi == INT32_MAX, "a cache of INT32_MAX keys: [%d, %d)", r.lo, r.hi);
  // the same past INT32_MAX with a left pad: the pad bounds the row, the window does not wrap
  r = sequence_mask(INT32_MAX, 2, INT32_MAX - 1, INT32_MAX).keys(1, 1000);
  CHECK(r.lo == 1000 && r.hi == INT32_MAX, "a padded cache of INT32_MAX keys: [%d, %d)", r.lo,
        r.hi);
  // every clamped window agrees with the brute-force mask at its reach and past it, left pad
  // or not
  for (int seqlen_q = 1; seqlen_q <= 4; ++seqlen_q) {
    for (int seqlen = 0; seqlen <= 40; seqlen += 5) {
      const int cap = 40;
      for (int64_t wl : {int64_t{-1}, int64_t{cap - 1}, int64_t{cap}, int64_t{1} << 33}) {
        for (int64_t wr : {int64_t{-1}, int64_t{0}, int64_t{seqlen_q}, int64_t{1} << 33}) {
          const int l = clamp_window(wl, cap);
          const int rr = clamp_window(wr, seqlen_q);
          for (int lead = 0; lead <= seqlen; lead += 7) {
            for (int t = 0; t < seqlen_q; ++t) {
              const KeyRange k = sequence_mask(seqlen, seqlen_q, l, rr).keys(t, lead);
              for (int key = 0; key < seqlen; ++key) {
                const int pos = seqlen - seqlen_q + t;
                const bool want = key >= lead && (wr < 0 || key <= pos + wr) &&
                                  (wl < 0 || key >= pos - wl);
                CHECK((key >= k.lo && key < k.hi) == want,
                      "clamped window (%lld, %lld) seqlen %d lead %d sq %d t %d key %d",
                      (long long)wl, (long long)wr, seqlen, lead, seqlen_q, t, key);
              }
            }
          }
        }
      }
    }
  }
}

int main() {
  rows_and_blocks();
  aligned_keys_round_the_start_down();
  splits_cover_once();
  pages();
  heuristic_and_workspace();
  combine_grid();
  huge_windows();
  return host_check_exit();
}
