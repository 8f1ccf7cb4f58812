// CuTe types of one FA-3 path backward instantiation (family A, bwd_tile_config.h): tile shapes,
// the four tiled MMAs, shared-memory layouts with their transposed views, TMA types, the
// shared-storage struct and the pipeline specs.
//
// Views: every operand lands once, row-major as in global memory (K-major for the GEMMs that read
// it along head_dim); the GEMMs that contract over another mode read the same bytes through a
// transposed view (composition with an ordered layout, the forward's V^T trick):
//   S^T  = K  Q^T     A = sK (keys, d)           B = sQ (q, d)             both K-major, SS
//   dP^T = V  dO^T    A = sV (keys, d)           B = sdO (q, d)            both K-major, SS
//   dV  += P^T dO     A = P^T registers          B = sdOt (d, q)           MN-major, RS
//   dK  += dS^T Q     A = dS^T registers         B = sQt (d, q)            MN-major, RS
//   dQ   = dS K       A = sdS (q, keys) q-major  B = sKt (d, keys)         MN-major, SS
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "sm90/bwd_tile_config.h"
#include "sm90/kernel_traits.h"  // k_major_smem_atom
#include "sm90/pipeline.h"

namespace flash_hopper::sm90 {

using namespace cute;

// The (rows, cols, stages) layout re-read as (cols, rows, stages): the same bytes, transposed.
template <class Layout, int kRows, int kCols, int kStages>
using TransposedView = decltype(composition(
    Layout{}, make_ordered_layout(Shape<Int<kCols>, Int<kRows>, Int<kStages>>{},
                                  Step<_2, _1, _3>{})));

template <class Element_, int kHeadDim_>
struct BwdTraits {
  using Element = Element_;
  static_assert(sizeof(Element) == 2, "the FA-3 path backward handles fp16 / bf16 inputs");

  static constexpr BwdConfig kConfig = bwd_config(kHeadDim_);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kConfig.block_m;
  static constexpr int kBlockN = kConfig.block_n;
  static constexpr int kStages = kConfig.q_stages;  // Q, dO and dS buffers
  static constexpr int kDqWgs = kConfig.dq_wgs;
  static constexpr int kConsumerWgs = 2;
  static constexpr bool kFamilyB = false;  // bwd_schedule.h's Cfg

  using Registers = RegisterBudget<kConsumerWgs>;
  static constexpr int kThreads = Registers::kThreads;
  static constexpr int kConsumerThreads = 128 * kConsumerWgs;
  static_assert(kBlockN == 64 * kConsumerWgs, "each consumer warpgroup owns 64 keys");
  static_assert(kBlockM == 64 || (kBlockM == 128 && kDqWgs == 2),
                "64-query steps, or 128-query steps whose dQ the WGs split by rows");
  // How the WGs share dQ: kBlockM == 128: rows [64c, 64c + 64) each (all keys, all columns);
  // kDqWgs == 2: columns [c D / 2, ...) each; kDqWgs == 1: each WG its own 64 keys' partial sum.
  static constexpr bool kDqByRows = kBlockM == 128;
  static_assert(kStages == 2, "dS is double-buffered: bwd_mma.h's sync_pds argument needs 2");
  static_assert(kHeadDim % kDqWgs == 0 && (kHeadDim / kDqWgs) % 32 == 0);

  // S^T / dP^T: (keys, queries, d), one m64 atom per WG stacked along the keys.
  using TileShapeSdP = Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileShapeSdP>(),
      Layout<Shape<Int<kConsumerWgs>, _1, _1>>{}));
  // dV / dK: (keys, d, queries), A from registers.
  using TileShapedKV = Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>;
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileShapedKV, GMMA::Major::K,
                           GMMA::Major::MN>(),
      Layout<Shape<Int<kConsumerWgs>, _1, _1>>{}));
  // dQ: (queries, d, keys); the WGs' shares as kDqByRows / kDqWgs say (one atom per WG).
  using TileShapedQWg =
      conditional_t<kDqByRows, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>,
                    Shape<Int<kBlockM>, Int<kHeadDim / kDqWgs>, Int<kBlockN / (3 - kDqWgs)>>>;
  using AtomLayoutdQ =
      conditional_t<kDqByRows, Layout<Shape<_2, _1, _1>>, Layout<Shape<_1, Int<kDqWgs>, _1>>>;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileShapedQWg, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      AtomLayoutdQ{}));

  // The selectors fall back to narrower atoms when a shape is missing: insist on one atom per WG
  // (Shape_MNK is the atom's).
  static_assert(decltype(size<1>(typename TiledMmaSdP::Shape_MNK{}))::value == kBlockM);
  static_assert(decltype(size<1>(typename TiledMmadKV::Shape_MNK{}))::value == kHeadDim);
  static_assert(decltype(size<1>(typename TiledMmadQ::Shape_MNK{}))::value ==
                (kDqByRows ? kHeadDim : kHeadDim / kDqWgs));

  using SmemAtom = decltype(k_major_smem_atom<Element, kHeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutQStages = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));  // (M, D, PIPE)
  using SmemLayoutQt = TransposedView<SmemLayoutQStages, kBlockM, kHeadDim, kStages>;  // (D, M, PIPE)
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // dS (q, keys, PIPE) q-major (the MN-major A operand of dQ); written through its transposed view
  // (keys, q, PIPE) from the dS^T accumulator with stmatrix.
  using SmemLayoutdS = decltype(tile_to_shape(
      GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>, Int<kStages>>{},
      Step<_2, _1, _3>{}));
  using SmemLayoutdSt = TransposedView<SmemLayoutdS, kBlockM, kBlockN, kStages>;
  using R2SCopydS = decltype(make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{},
                                               TiledMmaSdP{}));

  // Global tensors as the TMA sees them: (seqlen, head_dim, heads, batch), head_dim contiguous.
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                          ShapeQKV{}, StrideQKV{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{},
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  // Bytes each TMA load brings (expect_tx counts the full box, also where it zero-fills).
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);
  static_assert(kQBytes * kStages == cosize_v<SmemLayoutQStages> * sizeof(Element));
  static_assert(kKVBytes == cosize_v<SmemLayoutK> * sizeof(Element));

  using QPipe = PipelineSpec<kStages, kConsumerWgs>;  // Q + lse_log2 rows; dO + D rows alike
  using KVPipe = PipelineSpec<1, kConsumerWgs>;       // K and V of the tile, one barrier

  struct SharedStorage {
    // 1024-byte alignment: the period of the 128-byte swizzle pattern.
    array_aligned<Element, cosize_v<SmemLayoutQStages>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutQStages>, 1024> dout;
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> v;
    array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> ds;
    // Per consumer WG: the step's lse_log2 rows, then its D rows (bwd_mma.h load_stats).
    array_aligned<float, 2 * kBlockM * kConsumerWgs, 16> stats;
    cutlass::arch::ClusterTransactionBarrier q_full[kStages];
    cutlass::arch::ClusterBarrier q_empty[kStages];
    cutlass::arch::ClusterTransactionBarrier do_full[kStages];
    cutlass::arch::ClusterBarrier do_empty[kStages];
    cutlass::arch::ClusterTransactionBarrier kv_full[1];
    cutlass::arch::ClusterBarrier kv_empty[1];
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kSmemOptinBytes, "tile config exceeds sm_90 shared memory");
};

}  // namespace flash_hopper::sm90
