// Which key blocks a query block visits, and which of them need masking.
//
// The mask is bottom-right aligned: query row i sees key column j iff
//   i + sk - sq - window_left <= j <= i + sk - sq + window_right,
// with a negative window bound meaning unbounded on that side (causal = window_right 0).
// Both paths iterate key blocks n in [n_min, n_max); a block whose columns are all visible to every
// row of the query block carries no mask arithmetic at all.
#pragma once

#include <cute/config.hpp>

namespace flash_hopper {

struct BlockRange {
  int n_min;
  int n_max;  // exclusive; n_max <= n_min means the query block sees no key at all
};

struct WindowMask {
  int seqlen_q;
  int seqlen_k;
  int window_left;   // -1: unbounded
  int window_right;  // -1: unbounded

  // Offset between a query row and the key column on its diagonal.
  CUTE_HOST_DEVICE int diag() const { return seqlen_k - seqlen_q; }

  CUTE_HOST_DEVICE BlockRange key_blocks(int m_block, int block_m, int block_n) const {
    const int first_row = m_block * block_m;
    const int last_row = cute::min(first_row + block_m, seqlen_q) - 1;
    int key_end = seqlen_k;  // exclusive
    if (window_right >= 0) {
      key_end = cute::min(key_end, last_row + diag() + window_right + 1);
    }
    int key_begin = 0;
    if (window_left >= 0) {
      key_begin = cute::max(key_begin, first_row + diag() - window_left);
    }
    BlockRange r;
    r.n_max = key_end <= 0 ? 0 : (key_end + block_n - 1) / block_n;
    r.n_min = key_begin >= seqlen_k ? r.n_max : key_begin / block_n;
    return r;
  }

  // Whether a key block needs the mask, by side (the kernels test both; the split documents which
  // edge is involved).
  // Right side: the sequence tail, or the right window edge crossing the tile.
  CUTE_HOST_DEVICE bool needs_right_mask(int m_block, int n_block, int block_m, int block_n) const {
    const int first_row = m_block * block_m;
    const int last_col = n_block * block_n + block_n - 1;
    return last_col >= seqlen_k ||
           (window_right >= 0 && last_col > first_row + diag() + window_right);
  }
  // Left side: the left window edge crossing the tile.
  CUTE_HOST_DEVICE bool needs_left_mask(int m_block, int n_block, int block_m, int block_n) const {
    const int last_row = m_block * block_m + block_m - 1;
    return window_left >= 0 && n_block * block_n < last_row + diag() - window_left;
  }

  CUTE_HOST_DEVICE bool visible(int row, int col) const {
    if (col >= seqlen_k) {
      return false;
    }
    if (window_right >= 0 && col > row + diag() + window_right) {
      return false;
    }
    if (window_left >= 0 && col < row + diag() - window_left) {
      return false;
    }
    return true;
  }
};

}  // namespace flash_hopper
