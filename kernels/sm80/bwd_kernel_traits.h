// CuTe layouts, MMAs and copies of the FA-2 path's backward kernel, derived from one tile config
// (bwd_tile_config.h).
//
// The five GEMMs of a step and the operand views they read (every operand from shared memory;
// "t" = the same bytes seen transposed, read with ldmatrix.trans):
//   S  = Q  K^T    (M x N, k = d)   A sQ   B sK          tiled MMA SdP
//   dP = dO V^T    (M x N, k = d)   A sdO  B sV          tiled MMA SdP
//   dV += P^T dO   (N x d, k = M)   A sPt  B sdOt        tiled MMA dKV
//   dK += dS^T Q   (N x d, k = M)   A sdSt B sQt         tiled MMA dKV
//   dQ  = dS K     (M x d, k = N)   A sdS  B sKt         tiled MMA dQ
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "sm80/bwd_fragment_layouts.h"
#include "sm80/bwd_tile_config.h"

namespace flash_hopper::sm80 {

using namespace cute;

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kAtomMSdP,
          int kAtomNdKV, int kAtomMdQ, int kQStages_, int kDoStages_>
struct BwdTraits {
  using Element = Element_;
  using ElementAccum = float;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kQStages = kQStages_;
  static constexpr int kDoStages = kDoStages_;
  static_assert(kHeadDim % 32 == 0, "head-dim buckets are multiples of 32");
  static_assert((kQStages == 1 || kQStages == 2) && (kDoStages == 1 || kDoStages == 2));

  // ---- MMAs: m16n8k16; each tile covers 16 rows x 16 columns per warp per iteration ----
  using MmaAtomOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                       SM80_16x8x16_F32F16F16F32_TN,
                                       SM80_16x8x16_F32BF16BF16F32_TN>;
  template <int kAtomM>
  using WarpTiledMma =
      TiledMMA<MMA_Atom<MmaAtomOp>, Layout<Shape<Int<kAtomM>, Int<kNWarps / kAtomM>, _1>>,
               Tile<Int<16 * kAtomM>, Int<16 * kNWarps / kAtomM>, _16>>;
  using TiledMmaSdP = WarpTiledMma<kAtomMSdP>;  // (M, N)
  using TiledMmadKV = WarpTiledMma<kAtomNdKV>;  // (N, d)
  using TiledMmadQ = WarpTiledMma<kAtomMdQ>;    // (M, d)
  static_assert(kBlockM % (16 * kAtomMSdP) == 0 && kBlockN % (16 * kNWarps / kAtomMSdP) == 0);
  static_assert(kBlockN % (16 * kAtomNdKV) == 0 && kHeadDim % (16 * kNWarps / kAtomNdKV) == 0);
  static_assert(kBlockM % (16 * kAtomMdQ) == 0 && kHeadDim % (16 * kNWarps / kAtomMdQ) == 0);
  // The accumulators' layouts: what partition_fragment_C(WarpTiledMma<kAtomM>, (kRows, kCols))
  // returns (m16n8 atoms: (2,2) values x MMA_M x MMA_N, column-major), spelled out for the
  // compiler's memory like the operands' below; tests/cpp/test_sm80_bwd_fragments.cpp checks it.
  template <int kAtomM, int kRows, int kCols>
  using AccLayout = Layout<Shape<Shape<_2, _2>, Int<kRows / (16 * kAtomM)>,
                                 Int<kCols / (8 * (kNWarps / kAtomM))>>>;
  using AccLayoutSdP = AccLayout<kAtomMSdP, kBlockM, kBlockN>;   // S, dP
  using AccLayoutdKV = AccLayout<kAtomNdKV, kBlockN, kHeadDim>;  // dK, dV
  using AccLayoutdQ = AccLayout<kAtomMdQ, kBlockM, kHeadDim>;    // dQ
  // The MMA operands' register-fragment layouts, spelled out (void: derive them).
  using FragmentLayouts = BwdFragmentLayouts<kHeadDim, kBlockM, kBlockN, kNWarps, kAtomMSdP,
                                             kAtomNdKV, kAtomMdQ>;

  // ---- Shared memory (the forward's swizzled atoms: 8 rows of 64 or 32 elements) ----
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kBlockKSmem == 64 ? 3 : 2;
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSwizzleBits, 3, 3>{},
      Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{},
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // Q, dO
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{},
                                              Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // K, V
  static_assert(kBlockN % 64 == 0);
  using SmemLayoutAtomPdS = decltype(composition(
      Swizzle<3, 3, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{}));
  using SmemLayoutPdS = decltype(tile_to_shape(SmemLayoutAtomPdS{},
                                               Shape<Int<kBlockM>, Int<kBlockN>>{}));  // P, dS

  // Transposed views: the same bytes as (cols, rows).
  template <class L, int kRows, int kCols>
  using Transposed =
      decltype(composition(L{}, make_layout(Shape<Int<kCols>, Int<kRows>>{}, GenRowMajor{})));
  using SmemLayoutQt = Transposed<SmemLayoutQ, kBlockM, kHeadDim>;      // (d, M): Q^T, dO^T
  using SmemLayoutKt = Transposed<SmemLayoutKV, kBlockN, kHeadDim>;     // (d, N): K^T
  using SmemLayoutPdSt = Transposed<SmemLayoutPdS, kBlockM, kBlockN>;   // (N, M): P^T, dS^T

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomStore = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // ---- Global memory: 16-byte cp.async per thread ----
  static constexpr int kGmemElemsPerLoad = 16 / int(sizeof(Element));
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerLoad;
  using GmemLayoutAtom = Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                                Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopy = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, Int<kGmemElemsPerLoad>>>{}));
  using GmemTiledCopyStore = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<uint128_t>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, Int<kGmemElemsPerLoad>>>{}));
  static_assert(kBlockM % (kNThreads / kGmemThreadsPerRow) == 0);
  static_assert(kBlockN % (kNThreads / kGmemThreadsPerRow) == 0);

  static constexpr int kQElems = int(cosize_v<SmemLayoutQ>);
  static_assert(kBlockM % 4 == 0 && kBlockM / 4 <= kNThreads, "lse / D rows: one 16 B copy each");
  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;  // dK in the epilogue
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;  // dV in the epilogue
    cute::array_aligned<Element, kQElems * kQStages> q;
    cute::array_aligned<Element, kQElems * kDoStages> dout;
    cute::array_aligned<Element, cosize_v<SmemLayoutPdS>> p;
    cute::array_aligned<Element, cosize_v<SmemLayoutPdS>> ds;
    cute::array_aligned<float, kBlockM * kQStages> lse;     // lse_log2 rows, with Q
    cute::array_aligned<float, kBlockM * kDoStages> dpsum;  // D rows, with dO
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
};

template <class Element, int kHeadDim, bool kFallback = false>
struct BwdTraitsFor {
  static constexpr BwdTileConfig kConfig =
      kFallback ? bwd_tile_config_fallback(kHeadDim) : bwd_tile_config(kHeadDim);
  using type = BwdTraits<Element, kHeadDim, kConfig.block_m, kConfig.block_n, kConfig.warps,
                         kConfig.atom_m_sdp, kConfig.atom_n_dkv, kConfig.atom_m_dq,
                         kConfig.q_stages, kConfig.do_stages>;
  static_assert(type::kSmemBytes == bwd_smem_bytes(kConfig, kHeadDim, int(sizeof(Element))));
};

// An MMA operand's register fragment for the shared-memory view `s`: a tensor of the spelled-out
// layout `FragLayout` (bwd_fragment_layouts.h), or partition_fragment_A/B(s) where it is void.
template <class FragLayout, bool kOperandA, class ThrMma, class SmemTensor>
CUTE_HOST_DEVICE auto mma_fragment(ThrMma const& thr_mma, SmemTensor const& s) {
  if constexpr (!std::is_void_v<FragLayout>) {
    return make_tensor<typename SmemTensor::value_type>(FragLayout{});
  } else if constexpr (kOperandA) {
    return thr_mma.partition_fragment_A(s);
  } else {
    return thr_mma.partition_fragment_B(s);
  }
}

}  // namespace flash_hopper::sm80
