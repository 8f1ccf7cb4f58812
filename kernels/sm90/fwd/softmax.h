// Online softmax of the FA-3 path, in registers, split into the pieces the pipelined consumer
// needs in different places: the new row max and rescale factor (before the PV GEMM of the
// previous block finishes), exp2 and row sums, and the O rescale (after the PV GEMM finished).
//
// A thread holds 2 rows (r, r + 8) of its warp's 16; the 4 threads of a quad share each row, so
// the max is reduced over the quad every block (all four must agree on the scale) and the sum only
// once, in finalize. p = exp2(s * scale_log2 - m * scale_log2): one FFMA and one MUFU.EX2.
//
// Lazy rescaling: m is the max the exponentials are taken against, not necessarily the true
// running max. A block moves m only when its own max exceeds m by more than kMaxStaleLog2 (in
// log2 units); otherwise m stays, the block's p are <= 2^kMaxStaleLog2 = 256 and O and l need no
// rescale. Exact, not an approximation: O, l and the LSE all use the same m, and
// O / l = sum(exp2(s - m) v) / sum(exp2(s - m)) for any m. Safe: p <= 256 is far inside bf16 /
// fp16 range; l <= 256 * seqlen_k and |O| <= 256 * sum |v| are far inside fp32; the smallest
// p of a row only gets larger (m is never above the true max). With random or trained scores the
// max rarely jumps by 2^8 after the first block, so most blocks skip the O rescale (d/2 FMULs per
// thread; 128 at d256) and the exp2 of the scale.
#pragma once

#include <cmath>
#include <cute/tensor.hpp>

#include "flash_hopper/register_ops.h"

namespace flash_hopper::sm90 {

using namespace cute;

// kMaxStaleLog2_: the lazy rescale's slack (above). kOffsetLog2: p = exp2(s - m + offset), so
// p <= 2^offset (l and O carry the same factor; the LSE takes it out). The FP8 kernel's P is
// e4m3: it takes slack 0 and offset 8 (mma.h), so every block's largest p is exactly 2^8 (an
// e4m3 value; with slack it would be 2^frac, rounded by up to 1/16: a whole-row error of a
// row dominated by one key) and p down to 2^-17 stays representable (e4m3's smallest
// subnormal is 2^-9: without the offset every key more than 6.2 nats below the max would be 0).
template <int kRows, int kMaxStaleLog2_ = 8, int kOffsetLog2 = 0>
struct OnlineSoftmax {
  static constexpr float kMaxStaleLog2 = float(kMaxStaleLog2_);
  static constexpr float kOffset = float(kOffsetLog2);
  static_assert(kMaxStaleLog2_ + kOffsetLog2 <= 8, "p <= 2^8: inside e4m3's range (448)");

  float row_max[kRows];
  float row_sum[kRows];
  float scale[kRows];  // exp2((m_old - m_new) * scale_log2), pending for O
  float scale_log2;
  bool rescale_pending = false;  // some scale[r] != 1 since the last rescale_o

  OnlineSoftmax() = default;  // assigned before use (Consumer::start_tile)
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
      float m_scaled = (kCheckInf && m == -INFINITY) ? 0.f : m * scale_log2;
      if constexpr (!kFirst) {
        const float m_old_scaled = row_max[r] * scale_log2;
        // Keep the old max when the new one is at most kMaxStaleLog2 above it (false for NaN:
        // an old max of -inf always moves).
        if (m_scaled - m_old_scaled <= kMaxStaleLog2) {
          m = row_max[r];
          m_scaled = m_old_scaled;
        } else {
          // Old max -inf: nothing accumulated yet (O and l are 0); exp2(-inf) = 0 keeps them 0.
          scale[r] = exp2f(m_old_scaled - m_scaled);
          row_sum[r] *= scale[r];
          rescale_pending = true;
        }
      }
      row_max[r] = m;
      const float sub = m_scaled - kOffset;
      float sum;  // from the first p: 0 + p is an instruction the compiler must keep (-0)
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const float p = exp2f(scores(r, c) * scale_log2 - sub);
        scores(r, c) = p;
        sum = c == 0 ? p : sum + p;
      }
      row_sum[r] += sum;
    }
  }

  // acc_o: (rows, D) view of O. Skipped by the whole warp when none of its rows moved its max
  // (a warp-uniform branch: no divergence around the accumulator registers).
  template <class TensorO>
  CUTE_DEVICE void rescale_o(TensorO& acc_o) {
    if (!__any_sync(0xffffffffu, rescale_pending)) {
      return;
    }
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o); ++c) {
        acc_o(r, c) *= scale[r];
      }
      scale[r] = 1.f;
    }
    rescale_pending = false;
  }

  // O /= l and LSE (flash_hopper::finalize_rows), the offset's factor 2^offset out of the LSE.
  template <class TensorO>
  CUTE_DEVICE void finalize(TensorO& acc_o, float lse_scale, float (&lse)[kRows]) {
    finalize_rows(row_max, row_sum, acc_o, lse_scale, lse, kOffset * 0.693147181f);  // ln 2
  }
};

}  // namespace flash_hopper::sm90
