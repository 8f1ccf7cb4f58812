// The FA-3 path's backward postprocess: dq = softmax_scale * dQacc, in the input dtype.
//
// The main kernel adds each query block's dQ in its own fragment order (epilogue.h,
// dq_fragment_offset). This kernel runs one CTA per query block with the dQ GEMM's thread count:
// thread t reads the values consumer thread t added, as float4s, into the dQ GEMM's accumulator
// fragment, and writes its rows with the forward epilogue's quad transposition (16 contiguous
// bytes per thread, whole 32-byte sectors: pair-wise 4-byte stores left every sector half written
// and ran far behind cuDNN's conversion kernel, bench/PERFLOG.md "v10 (kept): the sm90
// postprocess writes whole sectors"). The order is defined once, by the traits' tiled MMA.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flash_hopper/bwd_params.h"
#include "flash_hopper/register_ops.h"  // convert_into
#include "sm90/bwd/epilogue.h"
#include "sm90/common/fragment_store.h"
#include "sm90/common/utils.h"     // acc_rowcol

namespace flash_hopper::sm90 {

using namespace cute;

// The values consumer thread t added to query block row0 of (span, head), times softmax_scale,
// into `acc` (the dQ GEMM's accumulator fragment of thread t).
template <class Traits, class TensorAcc>
CUTE_DEVICE void load_dq_fragment(BwdParams const& p, BwdSpan const& span, int head, int row0,
                                  int t, TensorAcc& acc) {
  static_assert(decltype(size(acc))::value % 4 == 0);
  float const* block = p.dq_accum + p.dq_accum_offset(span.batch, head) +
                       (int64_t(span.ws_row0) + row0) * Traits::kHeadDim;
  CUTE_UNROLL
  for (int v = 0; v < size(acc); v += 4) {
    const float4 x =
        __ldcs(reinterpret_cast<float4 const*>(block + dq_fragment_offset<Traits>(t, v)));
    acc(v) = x.x * p.softmax_scale;
    acc(v + 1) = x.y * p.softmax_scale;
    acc(v + 2) = x.z * p.softmax_scale;
    acc(v + 3) = x.w * p.softmax_scale;
  }
}

// dQ computed transposed (tile_config.h dq_transposed): thread t holds (d, query) values, so
// its registers hold no contiguous part of a dq row. The block goes through shared memory in the
// input dtype, rows kHeadDim + 8 elements apart (a thread's stores of one register index then
// fall on different banks), and leaves as 16-byte pieces of rows.
template <class Traits>
CUTE_DEVICE void store_dq_transposed(BwdParams const& p, BwdSpan const& span, int head, int row0) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kRowStride = kHeadDim + 8;
  constexpr int kThreads = 128 * Traits::kDqWgs;
  __shared__ __align__(16) Element staged[kBlockM * kRowStride];
  const int t = threadIdx.x;
  typename Traits::TiledMmadQ mma;
  Tensor acc = partition_fragment_C(mma, typename Traits::DqShape{});
  Tensor coords =
      mma.get_thread_slice(t).partition_C(make_identity_tensor(typename Traits::DqShape{}));
  load_dq_fragment<Traits>(p, span, head, row0, t, acc);
  CUTE_UNROLL
  for (int v = 0; v < size(acc); ++v) {  // (d, query) -> row query, column d
    staged[get<1>(coords(v)) * kRowStride + get<0>(coords(v))] = static_cast<Element>(acc(v));
  }
  __syncthreads();
  Element* dq = static_cast<Element*>(p.dq) + span.batch * p.dq_batch_stride +
                int64_t(span.q_start) * p.dq_row_stride + head * p.dq_head_stride;
  constexpr int kPieces = kHeadDim / 8;  // 16 bytes each
  CUTE_UNROLL
  for (int i = t; i < kBlockM * kPieces; i += kThreads) {
    const int r = i / kPieces;
    const int col = 8 * (i % kPieces);
    if (row0 + r < span.seqlen_q && col < p.head_dim) {
      *reinterpret_cast<uint4*>(dq + int64_t(row0 + r) * p.dq_row_stride + col) =
          *reinterpret_cast<uint4 const*>(&staged[r * kRowStride + col]);
    }
  }
}

// The dQ GEMM's own rows (not transposed): thread t's registers hold pairs of a row's columns,
// written with the forward epilogue's quad transposition.
template <class Traits>
CUTE_DEVICE void store_dq_rows(BwdParams const& p, BwdSpan const& span, int head, int row0) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  const int t = threadIdx.x;
  typename Traits::TiledMmadQ mma;
  auto thr = mma.get_thread_slice(t);
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  load_dq_fragment<Traits>(p, span, head, row0, t, acc);
  Tensor r = make_tensor<Element>(acc.layout());
  convert_into(acc, r);
  Tensor r_rc = make_tensor(r.data(), acc_rowcol(r.layout()));
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor c_rc = make_tensor(coords.data(), acc_rowcol(coords.layout()));
  // The columns one thread's atom covers, from column col0 on (the WGs may split head_dim).
  constexpr int kCols = decltype(size<1>(typename Traits::TiledMmadQ::Shape_MNK{}))::value;
  static_assert(decltype(size<1>(r_rc))::value * 4 == kCols, "one atom along the columns");
  const int col0 = get<1>(c_rc(0, 0)) - 2 * (t % 4);
  Element* dq = static_cast<Element*>(p.dq) + span.batch * p.dq_batch_stride +
                int64_t(span.q_start) * p.dq_row_stride + head * p.dq_head_stride;
  CUTE_UNROLL
  for (int i = 0; i < size<0>(r_rc); ++i) {
    const int row = row0 + get<0>(c_rc(i, 0));
    store_row_quad<Element, kCols>(dq + int64_t(row) * p.dq_row_stride + col0, row < span.seqlen_q,
                                   p.head_dim - col0, [&](int c) { return r_rc(i, c); });
  }
}

template <class Traits>
__global__ void __launch_bounds__(128 * Traits::kDqWgs)
    bwd_postprocess_kernel(__grid_constant__ const BwdParams p) {
  constexpr int kBlockM = Traits::kBlockM;
  const int m_block = blockIdx.x;
  const int head = blockIdx.y;
  const BwdSpan span = bwd_spans(p)(blockIdx.z);
  const int row0 = m_block * kBlockM;
  if (row0 >= span.seqlen_q) {  // varlen: past the sequence's rows
    return;
  }
  if constexpr (Traits::kDqTransposed) {
    store_dq_transposed<Traits>(p, span, head, row0);
  } else {
    store_dq_rows<Traits>(p, span, head, row0);
  }
}

}  // namespace flash_hopper::sm90
