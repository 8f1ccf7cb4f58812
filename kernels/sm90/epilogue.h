// Consumer epilogue of the FA-3 path: O from the accumulator straight to global memory, LSE fp32.
//
// Each thread stores its accumulator's column pairs as 32-bit words (rows < seqlen_q, columns
// < head_dim). Direct stores need no shared memory, so the O buffer does not alias the K/V stages
// and no barrier orders the epilogue against the producer's next loads.
#pragma once

#include <cute/tensor.hpp>

#include "flash_hopper/fwd_params.h"
#include "sm90/utils.h"

namespace flash_hopper::sm90 {

using namespace cute;

// acc_o: the O accumulator (fp32, already normalized); lse: this thread's 2 rows.
template <class Traits, class ThrMma, class TensorO>
CUTE_DEVICE void store_o_lse(FwdParams const& p, ThrMma const& thr_mma_pv, TensorO const& acc_o,
                             float const (&lse)[2], int m_block, int head, int batch) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  Tensor rO = make_tensor<Element>(acc_o.layout());
  convert_into(acc_o, rO);
  Tensor rO_rc = make_tensor(rO.data(), acc_rowcol(rO.layout()));  // (2, (2, D/8))
  Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor tOcO = thr_mma_pv.partition_C(cO);
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));

  Element* o = static_cast<Element*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride;
  const int row0 = m_block * kBlockM;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(rO_rc); ++r) {
    const int row = row0 + get<0>(tOcO_rc(r, 0));
    if (row < p.seqlen_q) {
      Element* o_row = o + row * p.o_row_stride;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(rO_rc); c += 2) {
        const int col = get<1>(tOcO_rc(r, c));
        if (col < p.head_dim) {  // head_dim % 8 == 0: both columns of the pair are in or out
          __nv_bfloat162 pair;  // 32-bit carrier of two 16-bit elements
          reinterpret_cast<Element*>(&pair)[0] = rO_rc(r, c);
          reinterpret_cast<Element*>(&pair)[1] = rO_rc(r, c + 1);
          *reinterpret_cast<__nv_bfloat162*>(o_row + col) = pair;
        }
      }
    }
  }
  // The quad's first thread writes the LSE of its two rows.
  if (p.lse != nullptr && threadIdx.x % 4 == 0) {
    float* lse_ptr = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + get<0>(tOcO_rc(r, 0));
      if (row < p.seqlen_q) {
        lse_ptr[row] = lse[r];
      }
    }
  }
}

}  // namespace flash_hopper::sm90
