// Register-level helpers of the FA-2 path: fragment layouts, type conversion, pipelined GEMMs,
// predicated tile copies.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flash_hopper/register_ops.h"

namespace flash_hopper::sm80 {

using namespace cute;

// The m16n8 accumulator fragment ((2 cols, 2 rows), MMA_M, MMA_N) viewed as
// (rows = (2, MMA_M), cols = (2, MMA_N)), so softmax can walk rows and columns.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_layout_rowcol(Layout acc) {
  static_assert(rank(Layout{}) == 3 && rank<0>(Layout{}) == 2);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<2>(acc)));
}

// The same accumulator fragment re-read as the A operand of an m16n8k16 MMA: two adjacent n8 tiles
// form one k16 slice, so S's registers feed P.V without a trip through shared memory.
// ((2, 2), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, MMA_N / 2)
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_layout_as_A(Layout acc) {
  static_assert(size<2>(Layout{}) % 2 == 0);
  auto split = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // (.., .., (2, MMA_N/2))
  return make_layout(make_layout(get<0, 0>(split), get<0, 1>(split), get<2, 0>(split)),
                     get<1>(split), get<2, 1>(split));
}

// Element-wise conversion of a register fragment into a new one of the same layout.
template <class To, class Engine, class Layout>
CUTE_DEVICE auto convert_fragment(Tensor<Engine, Layout> const& src) {
  Tensor dst = make_tensor<To>(src.layout());
  convert_into(src, dst);
  return dst;
}

// acc += A * B with both operands in shared memory. The ldmatrix of k-slice i+1 is issued before
// the MMAs of slice i, so shared-memory latency hides under tensor-core work.
template <class TiledMma, class TensorAcc, class TensorRA, class TensorRB, class TensorSA,
          class TensorSB, class CopyA, class CopyB, class ThrCopyA, class ThrCopyB>
CUTE_DEVICE void gemm_ss(TiledMma& tiled_mma, TensorAcc& acc, TensorRA& tCrA, TensorRB& tCrB,
                         TensorSA const& tCsA, TensorSB const& tCsB, CopyA const& copy_a,
                         CopyB const& copy_b, ThrCopyA const& thr_copy_a,
                         ThrCopyB const& thr_copy_b) {
  Tensor tCrA_view = thr_copy_a.retile_D(tCrA);
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  copy(copy_a, tCsA(_, _, _0{}), tCrA_view(_, _, _0{}));
  copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k < size<2>(tCrA) - 1) {
      copy(copy_a, tCsA(_, _, k + 1), tCrA_view(_, _, k + 1));
      copy(copy_b, tCsB(_, _, k + 1), tCrB_view(_, _, k + 1));
    }
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// acc += A * B with A already in registers (P) and B in shared memory (V). B is loaded one k-slice
// at a time: the O accumulator and P already hold ~160 registers, and a second slice buffer
// (another 32 at d 128) pushed the row statistics into local memory; the warp scheduler hides
// the ldmatrix latency behind the other resident warps instead.
template <class TiledMma, class TensorAcc, class TensorRA, class TensorRB, class TensorSB,
          class CopyB, class ThrCopyB>
CUTE_DEVICE void gemm_rs(TiledMma& tiled_mma, TensorAcc& acc, TensorRA const& tCrA,
                         TensorRB& tCrB, TensorSB const& tCsB, CopyB const& copy_b,
                         ThrCopyB const& thr_copy_b) {
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    copy(copy_b, tCsB(_, _, k), tCrB_view(_, _, k));
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// Global -> shared tile copy, (CPY, CPY_ROWS, CPY_COLS) partitions. Rows at or past `row_limit`
// and columns at or past `col_limit` (coordinates from the identity tensor tCoord) are not read;
// their shared-memory slots are zeroed so stale bits (possibly NaN) never reach an MMA.
// `full` says the whole tile is in bounds: then every predicate is skipped.
template <class TiledCopy, class TensorG, class TensorS, class TensorC>
CUTE_DEVICE void copy_tile_g2s(TiledCopy const& tiled_copy, TensorG const& tCg, TensorS& tCs,
                               TensorC const& tCoord, int row_limit, int col_limit, bool full) {
  if (full) {
    copy(tiled_copy, tCg, tCs);
    return;
  }
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tCs); ++m) {
    const bool row_ok = get<0>(tCoord(0, m, 0)) < row_limit;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCs); ++k) {
      if (row_ok && get<1>(tCoord(0, m, k)) < col_limit) {
        copy(tiled_copy, tCg(_, m, k), tCs(_, m, k));
      } else {
        clear(tCs(_, m, k));
      }
    }
  }
}

// Register -> global tile store with the same row / column predicates.
template <class TiledCopy, class TensorR, class TensorG, class TensorC>
CUTE_DEVICE void copy_tile_r2g(TiledCopy const& tiled_copy, TensorR const& tCr, TensorG& tCg,
                               TensorC const& tCoord, int row_limit, int col_limit, bool full) {
  if (full) {
    copy(tiled_copy, tCr, tCg);
    return;
  }
  CUTE_UNROLL
  for (int m = 0; m < size<1>(tCr); ++m) {
    if (get<0>(tCoord(0, m, 0)) < row_limit) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tCr); ++k) {
        if (get<1>(tCoord(0, m, k)) < col_limit) {
          copy(tiled_copy, tCr(_, m, k), tCg(_, m, k));
        }
      }
    }
  }
}

}  // namespace flash_hopper::sm80
