// CuTe types of one FA-3 path instantiation: tile shapes, WGMMA tiled MMAs, shared-memory layouts,
// TMA copy types and the shared-storage struct, all derived from the tuned config.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "sm90/pipeline.h"
#include "sm90/tile_config.h"

namespace flash_hopper::sm90 {

using namespace cute;

// K-major swizzle atom for a row of kCols 16-bit elements: the widest swizzle whose row span
// divides kCols (the same rule as CUTLASS's ss_smem_selector).
template <class Element, int kCols>
CUTE_HOST_DEVICE constexpr auto k_major_smem_atom() {
  if constexpr (kCols % 64 == 0) {
    return GMMA::Layout_K_SW128_Atom<Element>{};
  } else if constexpr (kCols % 32 == 0) {
    return GMMA::Layout_K_SW64_Atom<Element>{};
  } else {
    static_assert(kCols % 16 == 0, "head dim bucket must be a multiple of 16");
    return GMMA::Layout_K_SW32_Atom<Element>{};
  }
}

template <class Element_, int kHeadDim_, bool kOverlap_,
          TileFamily kFamily = TileFamily::kDefault>
struct FwdTraits {
  using Element = Element_;
  static_assert(sizeof(Element) == 2, "the FA-3 path forward handles fp16 / bf16 inputs");

  static constexpr FwdConfig kConfig = fwd_config(kHeadDim_, kFamily);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kConfig.block_m;
  static constexpr int kBlockN = kConfig.block_n;
  static constexpr int kStages = kConfig.stages;
  static constexpr int kQStages = kConfig.q_stages;
  static constexpr int kConsumerWgs = kConfig.consumer_wgs;
  static constexpr bool kOverlap = kOverlap_;  // intra-warpgroup overlap of softmax and PV
  static constexpr bool kRescaleOBeforePv = kConfig.rescale_o_before_pv;
  static constexpr bool kPingpongDefault = kConfig.pingpong;
  static constexpr bool kMergeTileBoundary = kConfig.merge_tile_boundary;

  using Registers = RegisterBudget<kConsumerWgs>;
  static constexpr int kThreads = Registers::kThreads;
  static constexpr int kConsumerThreads = 128 * kConsumerWgs;
  static_assert(kBlockM == 64 * kConsumerWgs, "each consumer warpgroup owns 64 query rows");
  static_assert(kStages >= 2);

  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // (M, N, D)
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;  // (M, D, N)
  // One WGMMA atom per consumer warpgroup, stacked along M.
  using AtomLayout = Layout<Shape<Int<kConsumerWgs>, _1, _1>>;
  // S = Q K^T: both operands K-major in shared memory.
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileShapeQK>(), AtomLayout{}));
  // O += P V: P from registers (the converted S accumulator), V^T MN-major in shared memory.
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileShapePV, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AtomLayout{}));

  // The selectors fall back to narrower atoms when a shape is missing (e.g. N = 176 without
  // CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED): insist on one atom spanning the tile.
  static_assert(decltype(size<1>(typename TiledMmaQK::Shape_MNK{}))::value == kBlockN);
  static_assert(decltype(size<1>(typename TiledMmaPV::Shape_MNK{}))::value == kHeadDim);

  using SmemAtom = decltype(k_major_smem_atom<Element, kHeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutQStages = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQStages>>{}));  // (M, D, QPIPE)
  using SmemLayoutK = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));  // (N, D, PIPE)
  // V lands like K (rows of D contiguous elements); the PV GEMM reads the same bytes as V^T
  // (D, N, PIPE), which is the MN-major B operand.
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                         Step<_2, _1, _3>{})));  // (D, N, PIPE)

  // Global tensors as the TMA sees them: (seqlen, head_dim, heads, batch), head_dim contiguous.
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                          ShapeQKV{}, StrideQKV{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{},
                                       take<0, 2>(SmemLayoutK{}),
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  // Bytes each TMA load brings (expect_tx counts the full box, also where it zero-fills).
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);
  static_assert(kQBytes == cosize_v<SmemLayoutQ> * sizeof(Element));
  static_assert(kQBytes * kQStages == cosize_v<SmemLayoutQStages> * sizeof(Element));
  static_assert(kKVBytes * kStages == cosize_v<SmemLayoutK> * sizeof(Element));

  // Q buffers and K / V stages between the producer and the consumer warpgroups (pipeline.h).
  using QPipe = PipelineSpec<kQStages, kConsumerWgs>;
  using KVPipe = PipelineSpec<kStages, kConsumerWgs>;

  struct SharedStorage {
    // 1024-byte alignment: the period of the 128-byte swizzle pattern.
    array_aligned<Element, cosize_v<SmemLayoutQStages>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    cutlass::arch::ClusterTransactionBarrier q_full[QPipe::kStages];
    cutlass::arch::ClusterBarrier q_empty[QPipe::kStages];
    cutlass::arch::ClusterTransactionBarrier k_full[KVPipe::kStages];
    cutlass::arch::ClusterTransactionBarrier v_full[KVPipe::kStages];
    cutlass::arch::ClusterBarrier k_empty[KVPipe::kStages];
    cutlass::arch::ClusterBarrier v_empty[KVPipe::kStages];
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kSmemOptinBytes, "tile config exceeds sm_90 shared memory");
};

}  // namespace flash_hopper::sm90
