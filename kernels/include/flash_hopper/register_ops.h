// Register-level operations shared by the FA-2 (sm80) and FA-3 (sm90) paths: quad reductions,
// fragment conversion, the score transforms (softcap, the mask policy's element mask) and the
// softmax epilogue.
// Both paths hold an accumulator's rows across the 4 threads of a quad and view fragments as
// (rows, cols) tensors, so these work on either path's layouts.
#pragma once

#include <cmath>
#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flash_hopper/mask.h"
#include "flash_hopper/score_math.h"  // fast_tanh

namespace flash_hopper {

using namespace cute;

// Reduce over the 4 threads of an MMA quad (they hold the same rows, different columns).
template <class Op>
CUTE_DEVICE float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
  x = op(x, __shfl_xor_sync(0xffffffff, x, 1));
  return x;
}

// dst = convert(src), element-wise with packed conversions (cvt.rn.bf16x2.f32).
template <class EngineS, class LayoutS, class EngineD, class LayoutD>
CUTE_DEVICE void convert_into(Tensor<EngineS, LayoutS> const& src, Tensor<EngineD, LayoutD>& dst) {
  using From = typename EngineS::value_type;
  using To = typename EngineD::value_type;
  constexpr int kN = decltype(size(src))::value;
  static_assert(kN == decltype(size(dst))::value);
  cutlass::NumericArrayConverter<To, From, kN> convert;
  *reinterpret_cast<cutlass::Array<To, kN>*>(dst.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, kN> const*>(src.data()));
}

// s -> softcap * tanh(s * prescale); prescale already holds softmax_scale / softcap.
template <class TensorS>
CUTE_DEVICE void apply_softcap(TensorS& scores, float softcap, float prescale) {
  CUTE_UNROLL
  for (int i = 0; i < size(scores); ++i) {
    scores(i) = softcap * fast_tanh(scores(i) * prescale);
  }
}

// Sets the scores the mask policy hides to -inf. scores and coords are the same (rows, cols)
// fragment view; coords holds each element's (row, col) inside the tile, offset by the tile origin
// (row0, col0) here. A row's visible columns (AttentionMask::columns) are computed once, relative
// to this thread's first column, so each element compares a compile-time column offset: nothing
// per element stays live across blocks (per-element limits hoisted out of the loop cost ~100
// registers of spills).
template <class TensorS, class TensorC>
CUTE_DEVICE void apply_mask(TensorS& scores, TensorC const& coords, AttentionMask const& mask,
                            int row0, int col0) {
  const int col_first = get<1>(coords(0, 0));
  const int col_base = col0 + col_first;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(scores); ++r) {
    const ColumnRange visible = mask.columns(row0 + get<0>(coords(r, 0)));
    const int hi = visible.hi - col_base;  // exclusive
    const int lo = visible.lo - col_base;  // inclusive
    CUTE_UNROLL
    for (int c = 0; c < size<1>(scores); ++c) {
      const int col = get<1>(coords(r, c)) - col_first;  // compile-time offset
      if (col >= hi || col < lo) {
        scores(r, c) = -INFINITY;
      }
    }
  }
}

// Softmax epilogue for kRows rows held by a quad: O /= l and lse[r] = m * lse_scale + log(l)
// (natural log); a row with no visible key (l == 0) gets O = 0 and LSE = -inf. row_sum holds each
// thread's partial sum (reduced over the quad here), row_max the quad-wide max.
template <int kRows, class TensorO>
CUTE_DEVICE void finalize_rows(float const (&row_max)[kRows], float const (&row_sum)[kRows],
                               TensorO& acc_o, float lse_scale, float (&lse)[kRows],
                               float lse_offset = 0.f) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const float sum = quad_allreduce(row_sum[r], [](float a, float b) { return a + b; });
    // Only an all-masked row sums to exactly 0 (every p = exp2(-inf)); NaN inputs stay NaN.
    const bool empty = sum == 0.f;
    const float inv = empty ? 0.f : 1.f / sum;
    lse[r] = empty ? -INFINITY : row_max[r] * lse_scale + __logf(sum) - lse_offset;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(acc_o); ++c) {
      acc_o(r, c) *= inv;
    }
  }
}

}  // namespace flash_hopper
