// Score transforms of the FA-2 path applied to one S tile in registers: softcap and the window mask.
#pragma once

#include <cmath>
#include <cute/tensor.hpp>

#include "flash_hopper/block_range.h"
#include "sm80/utils.h"

namespace flash_hopper::sm80 {

using namespace cute;

// s -> softcap * tanh(s * prescale); prescale already holds softmax_scale / softcap.
template <class TensorS>
CUTE_DEVICE void apply_softcap(TensorS& scores, float softcap, float prescale) {
  CUTE_UNROLL
  for (int i = 0; i < size(scores); ++i) {
    scores(i) = softcap * fast_tanh(scores(i) * prescale);
  }
}

// Sets invisible scores to -inf. scores and coords are the same (rows, cols) fragment view;
// coords holds each element's (row, col) inside the tile, offset by the tile origin here.
// The visible range is computed once per row relative to this thread's first column, so each
// element compares a compile-time column offset: nothing per element stays live across blocks
// (per-element limits hoisted out of the loop cost ~100 registers of spills).
template <class TensorS, class TensorC>
CUTE_DEVICE void apply_window_mask(TensorS& scores, TensorC const& coords, WindowMask const& mask,
                                   int row0, int col0) {
  const int col_first = get<1>(coords(0, 0));
  const int col_base = col0 + col_first;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(scores); ++r) {
    const int row = row0 + get<0>(coords(r, 0));
    int hi = mask.seqlen_k;  // exclusive
    if (mask.window_right >= 0) {
      hi = min(hi, row + mask.diag() + mask.window_right + 1);
    }
    hi -= col_base;
    const int lo = mask.window_left >= 0 ? row + mask.diag() - mask.window_left - col_base
                                         : -col_base;  // inclusive
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c) {
      const int col = get<1>(coords(r, c)) - col_first;  // compile-time offset
      if (col >= hi || col < lo) {
        scores(r, c) = -INFINITY;
      }
    }
  }
}

}  // namespace flash_hopper::sm80
