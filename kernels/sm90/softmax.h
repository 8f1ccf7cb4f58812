// Online softmax of the FA-3 path, in registers, split into the pieces the pipelined consumer
// needs in different places: the new row max and rescale factor (before the PV GEMM of the
// previous block finishes), exp2 and row sums, and the O rescale (after the PV GEMM finished).
//
// A thread holds 2 rows (r, r + 8) of its warp's 16; the 4 threads of a quad share each row, so
// the max is reduced over the quad every block (all four must agree on the scale) and the sum only
// once, in finalize. p = exp2(s * scale_log2 - m * scale_log2): one FFMA and one MUFU.EX2.
#pragma once

#include <cmath>
#include <cute/tensor.hpp>

#include "flash_hopper/register_ops.h"

namespace flash_hopper::sm90 {

using namespace cute;

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];
  float scale[kRows];  // exp2((m_old - m_new) * scale_log2), pending for O
  float scale_log2;

  CUTE_DEVICE explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
      scale[r] = 1.f;
    }
  }

  // scores: (rows, cols) view of S. kCheckInf: the block may hold rows with every score -inf
  // (masked), whose max stays -inf; then 0 is subtracted instead so exp2(-inf) = 0, not NaN.
  // Unmasked blocks have finite scores only, so the new max is finite and the check is skipped.
  template <bool kFirst, bool kCheckInf, class TensorS>
  CUTE_DEVICE void update(TensorS& scores) {
    static_assert(decltype(size<0>(scores))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float m = row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        m = fmaxf(m, scores(r, c));
      }
      m = quad_allreduce(m, [](float a, float b) { return fmaxf(a, b); });
      const float m_scaled = (kCheckInf && m == -INFINITY) ? 0.f : m * scale_log2;
      if constexpr (!kFirst) {
        // Old max -inf: nothing accumulated yet (O and l are 0); exp2(-inf) = 0 keeps them 0.
        scale[r] = exp2f(row_max[r] * scale_log2 - m_scaled);
        row_sum[r] *= scale[r];
      }
      row_max[r] = m;
      float sum = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const float p = exp2f(scores(r, c) * scale_log2 - m_scaled);
        scores(r, c) = p;
        sum += p;
      }
      row_sum[r] += sum;
    }
  }

  // acc_o: (rows, D) view of O.
  template <class TensorO>
  CUTE_DEVICE void rescale_o(TensorO& acc_o) const {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o); ++c) {
        acc_o(r, c) *= scale[r];
      }
    }
  }

  // O /= l and LSE (flash_hopper::finalize_rows).
  template <class TensorO>
  CUTE_DEVICE void finalize(TensorO& acc_o, float lse_scale, float (&lse)[kRows]) {
    finalize_rows(row_max, row_sum, acc_o, lse_scale, lse);
  }
};

}  // namespace flash_hopper::sm90
