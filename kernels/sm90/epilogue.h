// Consumer epilogue of the FA-3 path: O from the accumulator straight to global memory, LSE fp32.
//
// Each thread stores its accumulator's column pairs as 32-bit words (rows < seqlen_q, columns
// < head_dim). Direct stores need no shared memory, so the O buffer does not alias the K/V stages
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

// Writes one tile's rows: value(r, c) gives the 16-bit O element at (row, column) index (r, c) of
// the thread's PV-accumulator fragment in its row-column view (acc_rowcol), lse[r] the LSE of the
// thread's row r.
template <class Traits, class ThrMma, class ValueAt>
CUTE_DEVICE void store_rows(FwdParams const& p, ThrMma const& thr_mma_pv, TileCoord tile,
                            ValueAt value, float const (&lse)[2]) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  Tensor tOcO = thr_mma_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));  // (2, (2, D/8))

  Element* o = static_cast<Element*>(p.o) + tile.batch * p.o_batch_stride +
               tile.head * p.o_head_stride;
  const int row0 = tile.m_block * kBlockM;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(tOcO_rc); ++r) {
    const int row = row0 + get<0>(tOcO_rc(r, 0));
    if (row < p.seqlen_q) {
      Element* o_row = o + row * p.o_row_stride;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(tOcO_rc); c += 2) {
        const int col = get<1>(tOcO_rc(r, c));
        if (col < p.head_dim) {  // head_dim % 8 == 0: both columns of the pair are in or out
          cutlass::Array<Element, 2> pair;
          pair[0] = value(r, c);
          pair[1] = value(r, c + 1);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(o_row + col) = pair;
        }
      }
    }
  }
  // The quad's first thread writes the LSE of its two rows.
  if (p.lse != nullptr && threadIdx.x % 4 == 0) {
    float* lse_ptr = p.lse + tile.batch * p.lse_batch_stride + tile.head * p.lse_head_stride;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + get<0>(tOcO_rc(r, 0));
      if (row < p.seqlen_q) {
        lse_ptr[row] = lse[r];
      }
    }
  }
}

// acc_o: the O accumulator (fp32, already normalized).
template <class Traits, class ThrMma, class TensorO>
CUTE_DEVICE void store_tile(FwdParams const& p, ThrMma const& thr_mma_pv, TensorO const& acc_o,
                            float const (&lse)[2], TileCoord tile) {
  using Element = typename Traits::Element;
  Tensor rO = make_tensor<Element>(acc_o.layout());
  convert_into(acc_o, rO);
  Tensor rO_rc = make_tensor(rO.data(), acc_rowcol(rO.layout()));
  store_rows<Traits>(p, thr_mma_pv, tile, [&](int r, int c) { return rO_rc(r, c); }, lse);
}

// A tile whose rows see no key: O = 0, LSE = -inf.
template <class Traits, class ThrMma>
CUTE_DEVICE void store_empty_tile(FwdParams const& p, ThrMma const& thr_mma_pv, TileCoord tile) {
  using Element = typename Traits::Element;
  const float lse[2] = {-INFINITY, -INFINITY};
  store_rows<Traits>(p, thr_mma_pv, tile, [](int, int) { return Element(0.f); }, lse);
}

}  // namespace flash_hopper::sm90
