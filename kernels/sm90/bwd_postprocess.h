// The FA-3 path's backward postprocess: dq = softmax_scale * dQacc, in the input dtype.
//
// The main kernel adds each query block's dQ in its own fragment order (bwd_epilogue.h,
// dq_fragment_offset). This kernel runs one CTA per query block with the dQ GEMM's thread count:
// thread t reads the values consumer thread t added, as float4s, and takes their (row, col) from
// the same tiled MMA's partition, so the order is defined once, by the traits.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flash_hopper/bwd_params.h"
#include "sm90/bwd_epilogue.h"

namespace flash_hopper::sm90 {

using namespace cute;

template <class Traits>
__global__ void __launch_bounds__(128 * Traits::kDqWgs)
    bwd_postprocess_kernel(__grid_constant__ const BwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  const int m_block = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int t = threadIdx.x;

  typename Traits::TiledMmadQ mma;
  Tensor coords = mma.get_thread_slice(t).partition_C(
      make_identity_tensor(Shape<Int<kBlockM>, Int<Traits::kHeadDim>>{}));
  // Values 4j .. 4j + 3: columns (c, c + 1) of row r, then of row r + 8 (m64nN accumulator).
  static_assert(decltype(size<0, 0>(coords))::value == 2 && decltype(size(coords))::value % 4 == 0);

  float const* block = p.dq_accum + p.dq_accum_offset(batch, head) +
                       int64_t(m_block) * kBlockM * Traits::kHeadDim;
  Element* dq = static_cast<Element*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride;
  const int row0 = m_block * kBlockM;
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  CUTE_UNROLL
  for (int v = 0; v < size(coords); v += 4) {
    const float4 x =
        *reinterpret_cast<float4 const*>(block + dq_fragment_offset<Traits>(t, v));
    const float vals[4] = {x.x, x.y, x.z, x.w};
    CUTE_UNROLL
    for (int h = 0; h < 4; h += 2) {
      const int row = row0 + get<0>(coords(v + h));
      const int col = get<1>(coords(v + h));
      if (row < p.seqlen_q && col < p.head_dim) {  // head_dim % 8 == 0: pairs in or out
        cutlass::Array<float, 2> pair;
        pair[0] = vals[h] * p.softmax_scale;
        pair[1] = vals[h + 1] * p.softmax_scale;
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dq + int64_t(row) * p.dq_row_stride +
                                                       col) = convert(pair);
      }
    }
  }
}

}  // namespace flash_hopper::sm90
