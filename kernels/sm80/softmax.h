// Online softmax of the FA-2 path, in registers.
//
// Per query row a thread keeps the running max m (of raw scores) and a partial running sum l over
// the columns it holds; the 4 threads of an MMA quad share each row, so the max is reduced over the
// quad at every block (all four must rescale by the same factor) but the sum only once, at the end.
// Scores become probabilities with one FFMA and one exp2: p = exp2(s * scale_log2 - m * scale_log2).
#pragma once

#include <cmath>
#include <cute/tensor.hpp>

#include "sm80/utils.h"

namespace flash_hopper::sm80 {

using namespace cute;

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];

  CUTE_DEVICE OnlineSoftmax() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // scores: (rows, cols) view of S for one key block, turned into P in place. acc_o: (rows, D)
  // view of the O accumulator, rescaled by exp2((m_old - m_new) * scale_log2) where the max moved.
  template <class TensorS, class TensorO>
  CUTE_DEVICE void update(TensorS& scores, TensorO& acc_o, float scale_log2) {
    static_assert(decltype(size<0>(scores))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float block_max = row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        block_max = fmaxf(block_max, scores(r, c));
      }
      block_max = quad_allreduce(block_max, [](float a, float b) { return fmaxf(a, b); });
      // A row that has seen only masked keys keeps max -inf; subtracting 0 instead keeps
      // exp2(-inf - 0) = 0 rather than NaN.
      const float max_scaled = block_max == -INFINITY ? 0.f : block_max * scale_log2;
      // Old max -inf means nothing was accumulated yet (O and l are 0): use 0, not NaN. The old
      // max is scaled with the same rounding as max_scaled (__fmul_rn is never contracted), so an
      // unchanged max gives exp2(0) = 1 exactly; contracted into one FFMA the argument was
      // max_scaled's rounding error and l drifted by it every block (LSE 1-2e-4 off after ~20
      // blocks; O / l unaffected).
      const float alpha = row_max[r] == -INFINITY
                              ? 0.f
                              : exp2f(__fmul_rn(row_max[r], scale_log2) - max_scaled);
      row_sum[r] *= alpha;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o); ++c) {
        acc_o(r, c) *= alpha;
      }
      row_max[r] = block_max;
      float sum = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const float p = exp2f(scores(r, c) * scale_log2 - max_scaled);
        scores(r, c) = p;
        sum += p;
      }
      row_sum[r] += sum;
    }
  }

  // O /= l and LSE (flash_hopper::finalize_rows).
  template <class TensorO>
  CUTE_DEVICE void finalize(TensorO& acc_o, float lse_scale, float (&lse)[kRows]) {
    finalize_rows(row_max, row_sum, acc_o, lse_scale, lse);
  }
};

}  // namespace flash_hopper::sm80
