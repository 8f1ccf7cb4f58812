// The decode kernel's plan (kernels/decode/decode_kernel.h, docs/decode.md): which query rows a CTA
// holds, which keys each row sees, how the keys split across CTAs, where a key lives in a paged or
// dense cache. Plain C++ so that the host tests (tests/cpp/test_decode_plan.cpp) walk exactly the
// arithmetic the kernel runs.
//
// Rows. The query heads of one KV head are packed as the rows of one tile (packed GQA): row
// r = t * group + g is query token t of query head kv_head * group + g, so a CTA reads each K / V
// tile once for all of them. A CTA holds kRowsPerCta consecutive rows (one m16 MMA row block);
// more rows than that take more CTAs (row blocks) over the same keys.
//
// Keys. Sequence b's cache holds keys [lead, seqlen) (lead = cache_leftpad, 0 without). Which of
// them a query token sees is the mask policy's answer (mask.h, AttentionMask::keys with lead as
// the left pad), the rule every kernel applies: bottom-right aligned as FA3's, query token t of
// seqlen_q at key position seqlen - seqlen_q + t; a causal row sees keys up to it, a window
// (left, right) the keys within [pos - left, pos + right] (-1: unbounded).
//
// Splits. A CTA's key range (the union over its rows) is cut into num_splits chunks of whole
// key blocks; each split writes its rows' partial O and LSE, and a combine kernel launched behind
// the decode kernel merges them (decode_kernel.h).
#pragma once

#include <cstdint>

#include "flash_hopper/host_device.h"
#include "flash_hopper/mask.h"

namespace flash_hopper {
namespace decode {

constexpr int kRowsPerCta = 16;   // one m16n8k16 row block
constexpr int kWarps = 4;         // each warp walks its own 16 keys of every key block
constexpr int kKeysPerWarp = 16;  // one k16 step of P V
constexpr int kBlockN = kWarps * kKeysPerWarp;
constexpr int kThreads = kWarps * 32;
// FP8 caches whose tiles hold at most this many rows (seqlen_q x group) run the keys-as-M kernel
// (decode_kernel.h, kKeysAsM): the rows are the N of an m16n8k16 MMA.
constexpr int kKeysAsMRows = 8;
constexpr int kMaxSplits = 128;

// Row blocks per KV head: seqlen_q tokens x group query heads, kRowsPerCta rows each.
FH_HOST_DEVICE int64_t row_blocks(int64_t seqlen_q, int64_t group) {
  return (seqlen_q * group + kRowsPerCta - 1) / kRowsPerCta;
}

// Row blocks per CTA (decode_kernel.h, kRowTiles): two where a KV head's row blocks pair up and
// O of both fits in registers (head dims up to kMaxPairedHeadDim: 2 x 64 at d128), so that a CTA
// loads each key once for 32 rows (8 query tokens of GQA 4) and, for an FP8 cache, widens it
// once; one otherwise. Partials, the workspace and the combine stay per row block.
constexpr int kMaxPairedHeadDim = 128;
FH_HOST_DEVICE int row_tiles_per_cta(int64_t row_blocks, int64_t head_dim) {
  return row_blocks % 2 == 0 && head_dim <= kMaxPairedHeadDim ? 2 : 1;
}

FH_HOST_DEVICE int imin(int a, int b) { return a < b ? a : b; }
FH_HOST_DEVICE int imax(int a, int b) { return a > b ? a : b; }

// A window side as the kernel takes it: < 0 unbounded; a bound of at least `reach` keys is
// unbounded too, so that any int64 the caller passes fits the mask's int fields.
// reach: the cache's capacity for the left side (a row's position is below it), the query tokens
// of a sequence for the right side (a row's position is at least seqlen - seqlen_q).
FH_HOST_DEVICE int clamp_window(int64_t window, int64_t reach) {
  return window < 0 || window >= reach ? -1 : static_cast<int>(window);
}

// A sequence's mask: its seqlen_q query tokens against the keys [0, seqlen) of its cache, the
// first `lead` of them a left pad (mask.keys(token, lead)); windows as clamp_window gives them.
// The kernel and the host tests build it here and nowhere else.
FH_HOST_DEVICE AttentionMask sequence_mask(int seqlen, int seqlen_q, int window_left,
                                           int window_right) {
  return AttentionMask{seqlen_q, seqlen, window_left, window_right};
}

// The keys a row block sees: rows [first_row, first_row + count) hold tokens
// first_row / group .. (first_row + count - 1) / group, and both ends of a token's keys grow with
// the token (mask.h), so the block's range runs from its first token's lo to its last token's hi.
FH_HOST_DEVICE KeyRange block_keys(AttentionMask const& mask, int lead, int group, int first_row,
                                   int count) {
  if (count <= 0) {
    return {0, 0};
  }
  const KeyRange first = mask.keys(first_row / group, lead);
  const KeyRange last = mask.keys((first_row + count - 1) / group, lead);
  return {first.lo, last.hi};
}

// The keys a row block loads: block_keys' range with its start rounded down to a multiple of
// kKeyAlign (the keys before it are masked like any key outside a row's range), so that each
// thread's consecutive rows of a paged load lie in one page where pages hold a multiple of
// kKeyAlign keys (decode_kernel.h, load_paged). An empty range stays empty.
constexpr int kKeyAlign = 4;
FH_HOST_DEVICE KeyRange aligned_keys(KeyRange r) {
  return r.empty() ? r : KeyRange{r.lo - r.lo % kKeyAlign, r.hi};
}

// Split `split` of `splits` of a range: whole blocks of block_n keys, as even as blocks allow
// (the first splits take one block more); splits past the blocks are empty.
FH_HOST_DEVICE KeyRange split_keys(KeyRange r, int split, int splits, int block_n) {
  if (r.empty()) {
    return {r.lo, r.lo};
  }
  const int blocks = (r.size() + block_n - 1) / block_n;
  const int per = blocks / splits;
  const int extra = blocks % splits;
  const int first = split * per + imin(split, extra);
  const int count = per + (split < extra ? 1 : 0);
  const int lo = r.lo + first * block_n;
  return {lo, imin(r.hi, lo + count * block_n)};
}

// Where key `key` of a sequence lives. A paged cache: page table row `table` of max_pages
// entries, page_size keys per page, page ids clamped to the pool (a garbage id in an entry the
// caller promised to be used reads a wrong page of the pool, never outside it). A dense cache
// (table null): entry `entry`, key `key` of it.
struct KvPages {
  const int32_t* table;  // null: dense
  int64_t entry;         // dense: the cache entry; paged: unused
  int page_size;         // paged: keys per page
  int page_shift;        // log2(page_size) when a power of two, else -1
  int num_pages;         // paged: the pool's pages

  // The page-table entry of a paged key and its slot in that page.
  FH_HOST_DEVICE int index_of(int key) const {
    return page_shift >= 0 ? key >> page_shift : key / page_size;
  }
  FH_HOST_DEVICE int slot_of(int key) const {
    return page_shift >= 0 ? key & (page_size - 1) : key - (key / page_size) * page_size;
  }
  // A page id as read from the table, clamped into the pool.
  FH_HOST_DEVICE int64_t clamp_page(int id) const {
    return id < 0 ? 0 : (id >= num_pages ? num_pages - 1 : id);
  }

  // (page or entry, slot in it) of a key. The kernel splits this in two: it copies the table
  // entries of a key block into shared memory kStages - 1 blocks ahead (index_of) and uses them
  // (clamp_page, slot_of) when it issues that block's loads, so the table read's latency never
  // stalls an issue.
  FH_HOST_DEVICE void locate(int key, int64_t* page, int64_t* slot) const {
    if (table == nullptr) {
      *page = entry;
      *slot = key;
      return;
    }
    *page = clamp_page(table[index_of(key)]);
    *slot = slot_of(key);
  }
};

// (table entry, slot) of keys first, first + step, first + 2 step, ... of a paged sequence: one
// division for the first (none for power-of-two pages), then an add with a carry per key.
struct PageWalk {
  int index;
  int slot;
  int step_pages;  // step / page_size
  int step_slots;  // step % page_size
  int page_size;

  FH_HOST_DEVICE static PageWalk start(KvPages const& pages, int first, int step) {
    const int q = step / pages.page_size;  // per call; the kernel hoists it out of its loops
    return {pages.index_of(first), pages.slot_of(first), q, step - q * pages.page_size,
            pages.page_size};
  }
  FH_HOST_DEVICE void next() {
    index += step_pages;
    slot += step_slots;
    if (slot >= page_size) {
      slot -= page_size;
      ++index;
    }
  }
};

// log2(n) when n is a power of two, else -1.
FH_HOST_DEVICE int power_of_two_shift(int64_t n) {
  if (n <= 0 || (n & (n - 1)) != 0) {
    return -1;
  }
  int s = 0;
  while ((int64_t{1} << s) < n) {
    ++s;
  }
  return s;
}

// Splits when the caller leaves the choice (num_splits = 0): from shapes only, so a CUDA graph
// captured with one batch's lengths stays right for another's. One wave of CTAs: tiles
// (batch x heads_kv x row blocks) below ~80 % of the resident slots (SMs x CTAs per SM) split the
// keys so that tiles x splits fills the slots without starting a second wave, each split keeping
// at least min_keys keys (the pipeline's ramp and the merge must stay small next to the loads).
FH_HOST_DEVICE int default_splits(int64_t tiles, int64_t max_keys, int num_sms, int ctas_per_sm,
                                  int min_keys) {
  const int64_t slots = int64_t{num_sms} * ctas_per_sm;
  if (tiles <= 0 || tiles * 5 >= slots * 4) {
    return 1;
  }
  int64_t splits = slots / tiles;
  const int64_t by_keys = max_keys / (min_keys > 0 ? min_keys : 1);
  splits = splits < by_keys ? splits : by_keys;
  splits = splits < kMaxSplits ? splits : kMaxSplits;
  return splits > 1 ? static_cast<int>(splits) : 1;
}

// The combine kernel's grid (decode_kernel.h, combine_kernel): per row block, the CTAs that share
// its valid rows (`rows`: seqlen_q x group, at most kRowsPerCta), each merging rows_per_pass rows
// per pass. A few row blocks spread their rows over more SMs (one pass each, not several on one
// SM); the grid stays within one CTA per SM, so that many row blocks keep one CTA each (more CTAs
// there measured slower).
FH_HOST_DEVICE constexpr int combine_rows_per_pass(int head_dim) {
  return kThreads / (head_dim / 4);
}
FH_HOST_DEVICE int combine_row_groups(int rows, int rows_per_pass, int64_t row_blocks,
                                      int num_sms) {
  const int passes = (imin(rows, kRowsPerCta) + rows_per_pass - 1) / rows_per_pass;
  const int64_t fit = row_blocks > 0 ? num_sms / row_blocks : 1;
  return imax(1, fit < passes ? static_cast<int>(fit) : passes);
}

// The workspace of a split call (api.h: fh_decode_plan): fp32 LSEs (splits x row blocks x
// kRowsPerCta), then fp32 partial outputs (splits x row blocks x kRowsPerCta x head_dim), each
// 256-byte aligned.
struct DecodeWorkspace {
  int64_t lse;  // byte offsets
  int64_t partial;
  int64_t bytes;  // total (0 without splits)
};

FH_HOST_DEVICE int64_t align256(int64_t x) { return (x + 255) / 256 * 256; }

FH_HOST_DEVICE DecodeWorkspace decode_workspace(int64_t row_blocks, int splits, int head_dim) {
  DecodeWorkspace w{0, 0, 0};
  if (splits <= 1) {
    return w;
  }
  w.partial = align256(int64_t{splits} * row_blocks * kRowsPerCta * 4);
  w.bytes = w.partial + align256(int64_t{splits} * row_blocks * kRowsPerCta * head_dim * 4);
  return w;
}

}  // namespace decode
}  // namespace flash_hopper
