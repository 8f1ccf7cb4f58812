// Register fragments to global memory in whole sectors, for every epilogue of the FA-3 path: the
// forward's O (fwd/epilogue.h), the backward's dK / dV (bwd/epilogue.h) and its dQ postprocess
// (bwd/postprocess.h).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>

namespace flash_hopper::sm90 {

using namespace cute;

// Inside a quad (4 lanes sharing rows), thread q holds words x[i] = (its pair of group i); returns
// the 4 words of group q from threads 0..3 in order. Register indices must be static, so the
// runtime lane index picks values with selects.
CUTE_DEVICE uint4 quad_transpose(uint32_t const (&x)[4], int q) {
  auto pick = [&](int i) { return i == 0 ? x[0] : i == 1 ? x[1] : i == 2 ? x[2] : x[3]; };
  // Partner q ^ k sends its word of group q; this thread sends its word of group q ^ k.
  const uint32_t r1 = __shfl_xor_sync(0xffffffff, pick(q ^ 1), 1);
  const uint32_t r2 = __shfl_xor_sync(0xffffffff, pick(q ^ 2), 2);
  const uint32_t r3 = __shfl_xor_sync(0xffffffff, pick(q ^ 3), 3);
  const uint32_t own = pick(q);
  auto from = [&](int src) {  // the word that came from thread src of the quad
    const int k = src ^ q;
    return k == 0 ? own : k == 1 ? r1 : k == 2 ? r2 : r3;
  };
  return make_uint4(from(0), from(1), from(2), from(3));
}

// One fragment row of 16-bit values, 16 contiguous bytes per store: value(c) is the element at
// column index c of the thread's row in the row-column view (acc_rowcol). Thread q of a quad holds
// columns 8j + 2q, 8j + 2q + 1 of every 8-column group j; a 4 x 4 transposition of 32-bit pairs
// inside the quad gives it all 8 columns of group 4g + q, so each row is written in pieces that
// fill whole sectors (pair-wise stores left every 32-byte sector half written: 2x the write
// traffic, ncu). Columns >= col_limit (a multiple of 8) and rows with !row_in are not written.
template <class Element, int kCols, class ValueAt>
CUTE_DEVICE void store_row_quad(Element* row_ptr, bool row_in, int col_limit, ValueAt value) {
  static_assert(kCols % 32 == 0, "quad transposition works on groups of 32 columns");
  const int q = threadIdx.x % 4;  // position in the quad that shares the thread's rows
  CUTE_UNROLL
  for (int g = 0; g < kCols / 32; ++g) {
    uint32_t x[4];
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
      cutlass::Array<Element, 2> pair;
      pair[0] = value(2 * (4 * g + i));
      pair[1] = value(2 * (4 * g + i) + 1);
      x[i] = reinterpret_cast<uint32_t const&>(pair);
    }
    const uint4 words = quad_transpose(x, q);
    const int col = 8 * (4 * g + q);
    if (row_in && col < col_limit) {
      *reinterpret_cast<uint4*>(row_ptr + col) = words;
    }
  }
}

}  // namespace flash_hopper::sm90
