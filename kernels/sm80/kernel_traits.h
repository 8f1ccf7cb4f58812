// CuTe layouts, MMAs and copies of the FA-2 path's forward kernel, derived from one tile config.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "sm80/tile_config.h"

namespace flash_hopper::sm80 {

using namespace cute;

template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_>
struct FwdTraits {
  using Element = Element_;
  using ElementAccum = float;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0, "head-dim buckets are multiples of 32");
  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row MMA tiles");
  static_assert(kBlockN % 16 == 0, "P feeds the PV MMA in k16 slices");

  // ---- MMA: m16n8k16, warps stacked along M (each warp owns its rows: softmax stays in-warp) ----
  using MmaAtomOp = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                       SM80_16x8x16_F32F16F16F32_TN,
                                       SM80_16x8x16_F32BF16BF16F32_TN>;
  using TiledMma = TiledMMA<MMA_Atom<MmaAtomOp>, Layout<Shape<Int<kNWarps>, _1, _1>>,
                            Tile<Int<16 * kNWarps>, _16, _16>>;

  // ---- Shared memory ----
  // Rows of 64 elements (128 B) when the head dim allows, else 32 (64 B). The XOR swizzle spreads
  // the 8 rows that one ldmatrix phase reads (16 B each) over all 32 banks.
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kBlockKSmem == 64 ? 3 : 2;
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSwizzleBits, 3, 3>{},
      Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{},
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // (BLK_M,D)
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{},
                                              Shape<Int<kBlockN>, Int<kHeadDim>>{}));  // (BLK_N,D)
  // V seen as the (D, BLK_N) B operand of O = P V: the same bytes, read with ldmatrix.trans.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutO = SmemLayoutQ;  // O is staged in Q's buffer once Q is no longer read

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // ---- Global memory: 16-byte cp.async per thread, a row of kBlockKSmem elements per thread group ----
  static constexpr int kGmemElemsPerLoad = 16 / int(sizeof(Element));
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerLoad;
  static_assert(kNThreads % kGmemThreadsPerRow == 0);
  using GmemLayoutAtom = Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                                Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopyQKV = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, Int<kGmemElemsPerLoad>>>{}));
  using GmemTiledCopyO = decltype(make_tiled_copy(
      Copy_Atom<UniversalCopy<uint128_t>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, Int<kGmemElemsPerLoad>>>{}));
  static_assert(kBlockM % (kNThreads / kGmemThreadsPerRow) == 0);
  static_assert(kBlockN % (kNThreads / kGmemThreadsPerRow) == 0);

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>> q;  // also O in the epilogue
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutKV>> v;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
};

template <class Element, int kHeadDim, bool kNarrow = false>
struct FwdTraitsFor {
  static constexpr FwdTileConfig kConfig =
      kNarrow ? fwd_tile_config_narrow(kHeadDim) : fwd_tile_config(kHeadDim);
  using type = FwdTraits<Element, kHeadDim, kConfig.block_m, kConfig.block_n, kConfig.warps>;
};

}  // namespace flash_hopper::sm80
