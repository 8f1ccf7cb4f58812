// The FA-2 path's backward postprocess: dq = softmax_scale * dQacc, in the input dtype.
//
// The main kernel (bwd_kernel.h) adds each query block's dQ into dQacc in fragment order: value i
// of thread t of its dQ tiled MMA at [i * kNThreads + t] of the block's kBlockM x bucket floats,
// so a warp's adds are 128 contiguous bytes. This kernel walks the same tiled MMA (one CTA per
// query block, the same thread count), so thread t reads its values contiguously and knows their
// (row, col) from the MMA's own partition: the layout is defined once, by the traits. The
// converted block is staged in shared memory and written out in 16-byte row pieces.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flash_hopper/bwd_params.h"

namespace flash_hopper::sm80 {

using namespace cute;

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads)
    bwd_postprocess_kernel(__grid_constant__ const BwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  const int m_block = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int tidx = threadIdx.x;

  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma = tiled_mma_dq.get_thread_slice(tidx);
  Tensor coords = thr_mma.partition_C(
      make_identity_tensor(Shape<Int<kBlockM>, Int<Traits::kHeadDim>>{}));  // (MMA,MMA_M,MMA_D)
  static_assert(decltype(size<0>(coords))::value == 4, "m16n8 accumulator: 2 x 2 values");

  // The block goes through shared memory in (row, col) order, so the global stores are whole
  // 16-byte pieces of rows (pair-wise 4-byte stores half-filled every 32-byte sector, which made
  // the sm90 postprocess far slower than cuDNN's conversion: bench/PERFLOG.md "v10 (kept): the
  // sm90 postprocess writes whole sectors"). 8 elements of row padding keep the pair stores
  // conflict-free.
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kPitch = kHeadDim + 8;
  __shared__ __align__(16) Element tile[kBlockM * kPitch];
  float const* acc = p.dq_accum + p.dq_accum_offset(batch, head) +
                     int64_t(m_block) * kBlockM * p.head_dim_rounded + tidx;
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  CUTE_UNROLL
  for (int i = 0; i < size(coords); i += 2) {
    cutlass::Array<float, 2> pair;
    pair[0] = __ldcs(acc + i * Traits::kNThreads) * p.softmax_scale;
    pair[1] = __ldcs(acc + (i + 1) * Traits::kNThreads) * p.softmax_scale;
    *reinterpret_cast<cutlass::Array<Element, 2>*>(
        tile + get<0>(coords(i)) * kPitch + get<1>(coords(i))) = convert(pair);
  }
  __syncthreads();
  Element* dq = static_cast<Element*>(p.dq) + batch * p.dq_batch_stride + head * p.dq_head_stride;
  const int row0 = m_block * kBlockM;
  constexpr int kChunksPerRow = kHeadDim / 8;
  CUTE_UNROLL
  for (int c = tidx; c < kBlockM * kChunksPerRow; c += Traits::kNThreads) {
    const int r = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    if (row0 + r < p.seqlen_q && col < p.head_dim) {  // head_dim % 8 == 0: whole chunks
      *reinterpret_cast<uint4*>(dq + int64_t(row0 + r) * p.dq_row_stride + col) =
          *reinterpret_cast<uint4 const*>(tile + r * kPitch + col);
    }
  }
}

}  // namespace flash_hopper::sm80
