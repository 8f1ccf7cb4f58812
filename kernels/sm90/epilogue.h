// Consumer epilogue of the FA-3 path: O from the accumulator straight to global memory, LSE fp32.
//
// The 4 threads of a quad exchange their column pairs with shuffles so each stores 16 contiguous
// bytes per row (rows < seqlen_q, columns < head_dim). Direct stores need no shared memory, so the O buffer does not alias the K/V stages
// and no barrier orders the epilogue against the producer's next loads; in the tuned kernel they
// run while the next tile's first QK GEMM is on the tensor cores (mma.h).
#pragma once

#include <cmath>
#include <cute/tensor.hpp>

#include "flash_hopper/fwd_params.h"
#include "sm90/tile_scheduler.h"
#include "sm90/utils.h"

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

// Writes one tile's rows: value(r, c) gives the 16-bit O element at (row, column) index (r, c) of
// the thread's PV-accumulator fragment in its row-column view (acc_rowcol), lse[r] the LSE of the
// thread's row r.
template <class Element, class Traits, class ThrMma, class ValueAt>
CUTE_DEVICE void store_rows(FwdParams const& p, ThrMma const& thr_mma_pv, TileCoord tile,
                            ValueAt value, float const (&lse)[2]) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  Tensor tOcO = thr_mma_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));  // (2, (2, D/8))

  // Rows of the tile's sequence only (varlen: the next sequence's rows follow in memory; its
  // batch strides are 0 and q_start addresses the sequence).
  Element* o = static_cast<Element*>(p.o) + tile.batch * p.o_batch_stride +
               tile.head * p.o_head_stride + int64_t(tile.q_start) * p.o_row_stride;
  const int row0 = tile.m_block * kBlockM;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(tOcO_rc); ++r) {
    const int row = row0 + get<0>(tOcO_rc(r, 0));
    // head_dim % 8 == 0: whole 8-column groups are in or out
    store_row_quad<Element, kHeadDim>(o + row * p.o_row_stride, row < tile.seqlen_q, p.head_dim,
                                      [&](int c) { return value(r, c); });
  }
  // The quad's first thread writes the LSE of its two rows.
  if (p.lse != nullptr && threadIdx.x % 4 == 0) {
    float* lse_ptr = p.lse + tile.batch * p.lse_batch_stride + tile.head * p.lse_head_stride +
                     tile.q_start;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + get<0>(tOcO_rc(r, 0));
      if (row < tile.seqlen_q) {
        lse_ptr[row] = lse[r];
      }
    }
  }
}

// acc_o: the O accumulator (fp32, already normalized), stored as Element (O's dtype: the
// inputs' for 16-bit inputs, bf16 or fp16 for FP8).
template <class Element, class Traits, class ThrMma, class TensorO>
CUTE_DEVICE void store_tile(FwdParams const& p, ThrMma const& thr_mma_pv, TensorO const& acc_o,
                            float const (&lse)[2], TileCoord tile) {
  Tensor rO = make_tensor<Element>(acc_o.layout());
  convert_into(acc_o, rO);
  Tensor rO_rc = make_tensor(rO.data(), acc_rowcol(rO.layout()));
  store_rows<Element, Traits>(p, thr_mma_pv, tile, [&](int r, int c) { return rO_rc(r, c); },
                              lse);
}

// A tile whose rows see no key: O = 0, LSE = -inf.
template <class Element, class Traits, class ThrMma>
CUTE_DEVICE void store_empty_tile(FwdParams const& p, ThrMma const& thr_mma_pv, TileCoord tile) {
  const float lse[2] = {-INFINITY, -INFINITY};
  store_rows<Element, Traits>(p, thr_mma_pv, tile, [](int, int) { return Element(0.f); }, lse);
}

}  // namespace flash_hopper::sm90
