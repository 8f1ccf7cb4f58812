// The attention mask policy: which key columns a query row sees, and, from that one rule, which
// key blocks a query tile visits and which of them need per-element masking. Both paths use it
// (sm80/fwd_kernel.h, sm90/fwd/schedule.h and the consumers' element mask in register_ops.h), the
// host tests compile it with g++ (tests/cpp/), and python/flash_hopper/mask.py mirrors it line by
// line for the reference, the FLOP counter and the benchmark peers (tests/test_mask_policy.py
// compares the two on random configurations).
//
// The rule (docs/README.md "Numerics contract"; bottom-right aligned): with diag = seqlen_k -
// seqlen_q, query row i sees key column j iff
//   0 <= j < seqlen_k
//   and (window_left  < 0  or  j >= i + diag - window_left)
//   and (window_right < 0  or  j <= i + diag + window_right)      causal: window_right = 0
//   and (chunk <= 0  or  floor((i + diag) / chunk) == floor(j / chunk))
// `chunk` is FA3's attention_chunk (chunked-local attention: a query sees only keys of the chunk
// its diagonal falls in). The API serves it by splitting a call into independent varlen pieces
// (python/flash_hopper/_chunk.py), so the kernels construct the mask with chunk = 0 and the
// constant folds every chunk term away; the term stays for the host tests and a kernel that
// takes the chunk itself.
//
// Every term bounds j from one side, and both bounds never decrease from one row to the next, so
// a row's visible columns are one interval [lo, hi) (columns()), a tile's visible columns lie
// between its first row's lo and its last row's hi (key_blocks()), and a key block needs no
// per-element mask iff it lies inside every row's interval (unmasked_blocks()).
//
// The decode kernel (kernels/decode/decode_kernel.h) walks keys by index, not by block: keys()
// gives a row's interval clipped to the sequence, with a left pad (a KV cache's cache_leftpad:
// keys before it are never visible, and the diagonal stays on the last key) and bounds compared
// in 64 bits, so that it takes any window the API passes.
//
// Growth: varlen builds one mask per sequence (its own seqlen_q / seqlen_k), which is why the
// schedule asks for the mask per tile (sm90/fwd/schedule.h). Learnable attention sinks are logits
// added to the softmax's running max and sum, not a mask. Always-visible sink *tokens*
// (StreamingLLM) would break the single interval: they would become a second, leading key range.
#pragma once

#include <cstdint>

#include "flash_hopper/host_device.h"

namespace flash_hopper {

// Key blocks [n_min, n_max) a query tile visits; empty when n_max <= n_min.
struct KeyBlockRange {
  int n_min;
  int n_max;

  FH_HOST_DEVICE bool empty() const { return n_max <= n_min; }
};

// Key blocks [n_left, n_right) of a tile's range whose every element is visible to every row of
// the tile: they carry no mask arithmetic. n_min <= n_left <= n_right <= n_max.
struct KeyBlockSplit {
  int n_left;
  int n_right;

  FH_HOST_DEVICE bool masked(int n) const { return n < n_left || n >= n_right; }
};

// Query blocks [m_min, m_max) that visit one key block (the backward's loop); empty when
// m_max <= m_min.
struct QueryBlockRange {
  int m_min;
  int m_max;

  FH_HOST_DEVICE bool empty() const { return m_max <= m_min; }
};

// Visible key columns [lo, hi) of one query row. hi <= seqlen_k; lo may be negative (columns are
// never negative, so that only means "from column 0"); lo >= hi when the row sees no key.
struct ColumnRange {
  int lo;
  int hi;
};

// Visible keys [lo, hi) of one query row, clipped to the sequence (keys()): first <= lo and
// hi <= seqlen_k when not empty; empty when hi <= lo.
struct KeyRange {
  int lo;
  int hi;

  FH_HOST_DEVICE bool empty() const { return hi <= lo; }
  FH_HOST_DEVICE int size() const { return hi > lo ? hi - lo : 0; }
};

struct AttentionMask {
  int seqlen_q;
  int seqlen_k;
  int window_left;   // -1: unbounded
  int window_right;  // -1: unbounded; 0: causal
  int chunk = 0;     // 0: off (see the header comment)

  // The key column on query row i's diagonal is i + diag().
  FH_HOST_DEVICE int diag() const { return seqlen_k - seqlen_q; }

  // Start of the chunk that column c falls in (floor division: c may be negative).
  FH_HOST_DEVICE int chunk_start(int c) const {
    const int q = c >= 0 ? c / chunk : -((-c + chunk - 1) / chunk);
    return q * chunk;
  }

  FH_HOST_DEVICE ColumnRange columns(int row) const {
    ColumnRange r{0, seqlen_k};
    if (window_right >= 0) {
      r.hi = min_(r.hi, row + diag() + window_right + 1);
    }
    if (window_left >= 0) {
      r.lo = row + diag() - window_left;
    }
    if (chunk > 0) {
      const int c0 = chunk_start(row + diag());
      r.lo = max_(r.lo, c0);
      r.hi = min_(r.hi, c0 + chunk);
    }
    return r;
  }

  // Row `row`'s visible keys, clipped to [first, seqlen_k): keys [0, first) are a left pad. The
  // pad leaves the diagonal on the last key, so this is columns() of the seqlen_k - first keys
  // after the pad, shifted by first (the FA paths' frame: varlen.h drops the pad from the span,
  // chunks included).
  FH_HOST_DEVICE KeyRange keys(int row, int first = 0) const {
    KeyRange r = window_keys(seqlen_k, first, seqlen_q, row, window_left, window_right);
    if (chunk > 0) {
      const int c0 = first + chunk_start(row + diag() - first);
      r.lo = max_(r.lo, c0);
      if (int64_t{c0} + chunk < r.hi) {
        r.hi = c0 + chunk;
      }
    }
    return r;
  }

  // keys() without the chunk term. The bounds are compared in 64 bits: a window the caller did
  // not clamp may put row + diag() + window_right + 1 past INT32_MAX. From scalars, which keys()
  // passes its fields as: a kernel that builds its mask where it uses it (the decode kernel) then
  // keeps its window's loads at that use, where its schedule wants them.
  static FH_HOST_DEVICE KeyRange window_keys(int seqlen_k, int first, int seqlen_q, int row,
                                             int window_left, int window_right) {
    const int64_t diagonal = int64_t{seqlen_k} - seqlen_q + row;
    KeyRange r{first, seqlen_k};
    if (window_right >= 0 && diagonal + window_right + 1 < r.hi) {
      r.hi = static_cast<int>(diagonal + window_right + 1);
    }
    if (window_left >= 0 && diagonal - window_left > r.lo) {
      r.lo = static_cast<int>(diagonal - window_left);
    }
    return r;
  }

  FH_HOST_DEVICE bool visible(int row, int col) const {
    const ColumnRange r = columns(row);
    return col >= 0 && col >= r.lo && col < r.hi;
  }

  // The key blocks query block m_block (rows [m_block * block_m, ...) clipped to seqlen_q) visits:
  // from the block holding its first row's first visible column to the one holding its last
  // row's last visible column.
  FH_HOST_DEVICE KeyBlockRange key_blocks(int m_block, int block_m, int block_n) const {
    const int first_row = m_block * block_m;
    const int last_row = min_(first_row + block_m, seqlen_q) - 1;
    // The last row's hi and the first row's lo (columns(), clipped to column 0), spelled out:
    // through columns() ptxas spilled 100 more bytes in the FA-2 d64 kernel on sm_80.
    int key_end = seqlen_k;  // exclusive
    if (window_right >= 0) {
      key_end = min_(key_end, last_row + diag() + window_right + 1);
    }
    int key_begin = 0;
    if (window_left >= 0) {
      key_begin = max_(key_begin, first_row + diag() - window_left);
    }
    if (chunk > 0) {
      key_begin = max_(key_begin, chunk_start(first_row + diag()));
      key_end = min_(key_end, chunk_start(last_row + diag()) + chunk);
    }
    KeyBlockRange r;
    r.n_max = key_end <= 0 ? 0 : (key_end + block_n - 1) / block_n;
    r.n_min = key_begin >= seqlen_k ? r.n_max : key_begin / block_n;
    return r;
  }

  // Which blocks of `range` need no element mask. Right side: a block must end at or before the
  // first row's hi (the right window edge, the chunk end and the sequence tail: a block past
  // seqlen_k holds zero-filled keys that must become -inf). Left side: it must start at or after
  // the lo of the tile's last row, counted over all block_m rows (rows past seqlen_q are never
  // stored, so treating them as real only masks a little more).
  FH_HOST_DEVICE KeyBlockSplit unmasked_blocks(KeyBlockRange range, int m_block, int block_m,
                                               int block_n) const {
    const int right_end = columns(m_block * block_m).hi;
    const int left_begin = columns((m_block + 1) * block_m - 1).lo;
    int n_right = right_end <= 0 ? 0 : right_end / block_n;
    int n_left = left_begin <= 0 ? 0 : (left_begin + block_n - 1) / block_n;
    n_left = max_(range.n_min, min_(n_left, range.n_max));
    n_right = max_(n_left, min_(n_right, range.n_max));
    return {n_left, n_right};
  }

  // The transpose of key_blocks: exactly the query blocks m with n_block in key_blocks(m). Both
  // ends of key_blocks(m) never decrease with m (nor does n_min across the switch to an empty
  // range, which sets n_min = n_max = ceil(seqlen_k / block_n)), so "n_block < n_max(m)" turns
  // true once and "n_min(m) <= n_block" false once: two binary searches over key_blocks itself
  // (no second formula to keep in step; ~2 log2(query blocks) evaluations, once per backward
  // tile). The backward's deterministic dq order relies on this being exact: the contributors of
  // query block m are precisely the key blocks of key_blocks(m) (tests/cpp/test_fwd_schedule.cpp).
  FH_HOST_DEVICE QueryBlockRange query_blocks(int n_block, int block_m, int block_n) const {
    const int num_m = (seqlen_q + block_m - 1) / block_m;
    int lo = 0;
    int hi = num_m;
    while (lo < hi) {  // first m with n_block < n_max(m)
      const int mid = (lo + hi) / 2;
      if (n_block < key_blocks(mid, block_m, block_n).n_max) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    const int m_min = lo;
    hi = num_m;
    while (lo < hi) {  // first m >= m_min with n_min(m) > n_block
      const int mid = (lo + hi) / 2;
      if (key_blocks(mid, block_m, block_n).n_min > n_block) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    return {m_min, lo};
  }

  // unmasked_blocks' answer for one block n of the range, computed from scratch: for a kernel that
  // would rather recompute it per block than keep the split live (the FA-2 path, whose d64 tile
  // already spills). The two agree on every block of the range (tests/cpp/test_fwd_schedule.cpp).
  FH_HOST_DEVICE bool block_masked(int m_block, int n, int block_m, int block_n) const {
    const int first_col = n * block_n;
    return first_col + block_n > columns(m_block * block_m).hi ||
           first_col < columns((m_block + 1) * block_m - 1).lo;
  }

 private:
  static FH_HOST_DEVICE int min_(int a, int b) { return a < b ? a : b; }
  static FH_HOST_DEVICE int max_(int a, int b) { return a > b ? a : b; }
};

}  // namespace flash_hopper
