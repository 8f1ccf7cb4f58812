// CuTe types of one FA-3 path backward instantiation (tile_config.h): tile shapes, the four
// tiled MMAs, shared-memory layouts with their transposed views, TMA types, the shared-storage
// struct and the pipeline specs.
//
// Views: every operand lands once, row-major as in global memory (K-major for the GEMMs that read
// it along head_dim); the GEMMs that contract over another mode read the same bytes through a
// transposed view (composition with an ordered layout, the forward's V^T trick).
// Family A (d64 / d96 / d128; the WGs split the keys):
//   S^T  = K  Q^T     A = sK (keys, d)           B = sQ (q, d)             both K-major, SS
//   dP^T = V  dO^T    A = sV (keys, d)           B = sdO (q, d)            both K-major, SS
//   dV  += P^T dO     A = P^T registers          B = sdOt (d, q)           MN-major, RS
//   dK  += dS^T Q     A = dS^T registers         B = sQt (d, q)            MN-major, RS
//   dQ   = dS K       A = sdS (q, keys) q-major  B = sKt (d, keys)         MN-major, SS
//   or, the unmasked tile's 80-query steps (tile_config.h dq_transposed):
//   dQ^T = K^T dS^T   A = sKt (d, keys) MN-major B = sdS (q, keys) keys-major, SS
// Family B (d192 / d256; S and dP split the keys, dV / dK / dQ split head_dim):
//   S    = Q  K^T     A = sQ (q, d)              B = sK (keys, d)          both K-major, SS
//   dP   = dO V^T     A = sdO (q, d)             B = sV (keys, d)          both K-major, SS
//   dV  += P^T dO     A = sPt (keys, q)          B = sdOt (d, q)           MN-major, SS
//   dK  += dS^T Q     A = sdSt (keys, q)         B = sQt (d, q)            MN-major, SS
//   dQ   = dS K       A = sdS (q, keys) keys-major B = sKt (d, keys)       K / MN-major, SS
// P and dS share one array of two (q, keys) buffers: family A's two dS stages, or family B's P
// (buffer 0) and dS (buffer 1).
// kUnmasked_: the unmasked tile (tile_config.h bwd_config_unmasked) instead of the bucket's.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "sm90/bwd/schedule.h"  // PublishedTile
#include "sm90/bwd/tile_config.h"
#include "sm90/common/gmma_atoms.h"
#include "sm90/common/pipeline.h"
#include "sm90/common/smem_atoms.h"

namespace flash_hopper::sm90 {

using namespace cute;

// The (rows, cols, stages) layout re-read as (cols, rows, stages): the same bytes, transposed.
template <class Layout, int kRows, int kCols, int kStages>
using TransposedView = decltype(composition(
    Layout{}, make_ordered_layout(Shape<Int<kCols>, Int<kRows>, Int<kStages>>{},
                                  Step<_2, _1, _3>{})));

// The dV / dK GEMM's atom: family A takes P^T / dS^T from registers (RS) and gives each WG all
// head_dim columns; family B reads them from shared memory (SS) and each WG computes half.
template <class Element, bool kFamilyB, int kBlockN, int kHeadDim, int kBlockM>
CUTE_HOST_DEVICE constexpr auto dkv_mma_atom() {
  if constexpr (kFamilyB) {
    return gmma::ss_op_selector<Element, Element, float,
                                Shape<Int<kBlockN>, Int<kHeadDim / 2>, Int<kBlockM>>,
                                GMMA::Major::MN, GMMA::Major::MN>();
  } else {
    return gmma::rs_op_selector<Element, Element, float,
                                Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>, GMMA::Major::K,
                                GMMA::Major::MN>();
  }
}

// The P / dS buffers (q, keys, buffers): keys-contiguous (kKeysMajor: family B, read by dV / dK
// through the transposed view; dQ transposed, dS as its B operand), else q-contiguous (family A's
// dQ = dS K, dS as its MN-major A operand). A function: one of the two atoms need not tile the
// other's shape.
template <class Element, int kBlockM, int kBlockN, int kBuffers, bool kKeysMajor>
CUTE_HOST_DEVICE constexpr auto ds_smem_layout() {
  if constexpr (kKeysMajor) {
    return tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                         Shape<Int<kBlockM>, Int<kBlockN>, Int<kBuffers>>{});
  } else {
    return tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                         Shape<Int<kBlockM>, Int<kBlockN>, Int<kBuffers>>{}, Step<_2, _1, _3>{});
  }
}

// Named-barrier ids of the backward (user ids: CUTLASS adds ReservedNamedBarrierCount).
enum class BwdBarrier : uint32_t {
  kPdS = 0,     // both consumer WGs: their dS halves are in shared memory
  kDqTurn = 1,  // both consumer WGs in deterministic mode: this CTA's turn on a dQ block
  kWg0 = 2,     // kWg0 + c: WG c's own 128-thread syncs
  kPdSFree = 4,  // family B, both consumer WGs: the previous step's GEMMs no longer read sP / sdS
  kTileSlot = 5,  // the producer warp and both consumer WGs: the tile slot holds the next tile
  kDqStaged0 = 6,  // kDqStaged0 + c, the deterministic kernel: WG c and the dQ writer warps
  // The deterministic kernel has no DqTurn (its writer adds dQ): its id serves the writer warps
  // (dq_wgs = 1: their sum of the two slots is complete before the reduce-adds read it).
  kDqWriters = kDqTurn,
  // WG c's 128-thread syncs share one id, kWg0 + c (its threads meet them one at a time, in
  // program order): its PdS where its dQ reads its own dS only, DqSlot c.
};
static_assert(static_cast<uint32_t>(BwdBarrier::kDqStaged0) + 2 <=
                  16 - cutlass::arch::NamedBarrier::ReservedNamedBarrierCount,
              "named barrier ids exceed the hardware's 16");
// The tile slot's barriers: the producer warp and both consumer WGs.
inline constexpr uint32_t kTileSlotThreads = 32 + 2 * 128;

// kDeterministic_: the deterministic mode's kernel of the families with dQ slots (d64-d192): the
// WGs' parts staged in their slots and added by the dQ writer warp in the block's turn
// (schedule.h add_dq, write_dq_bwd), a kernel of its own, as in FA3 (compiled into the default kernel behind the run-time flag, its
// code made the d128 step spill). The default kernels keep the call's run-time flag with the
// red.global turn handshake: d256's deterministic mode (no slots), and, in the slot families'
// default kernels, code their calls never run but without which ptxas spills the d64 / d128
// default step (bench/PERFLOG.md).
template <class Element_, int kHeadDim_, bool kDeterministic_ = false, bool kUnmasked_ = false>
struct BwdTraits {
  using Element = Element_;
  static_assert(sizeof(Element) == 2, "the FA-3 path backward handles fp16 / bf16 inputs");
  static constexpr bool kDeterministic = kDeterministic_;
  static constexpr bool kUnmasked = kUnmasked_;
  static_assert(!kUnmasked || (has_bwd_unmasked_config(kHeadDim_) && !kDeterministic),
                "the unmasked tile: its head dims, default mode");

  static constexpr BwdConfig kConfig = kUnmasked        ? bwd_config_unmasked(kHeadDim_)
                                       : kDeterministic ? bwd_config_deterministic(kHeadDim_)
                                                        : bwd_config(kHeadDim_);
  static constexpr bool kDqTransposed = kConfig.dq_transposed;
  static constexpr bool kDvAfterDs = kConfig.dv_after_ds;  // schedule.h's Cfg
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kConfig.block_m;
  static constexpr int kBlockN = kConfig.block_n;
  static constexpr int kStages = kConfig.q_stages;  // Q and dO buffers
  static constexpr int kDqWgs = kConfig.dq_wgs;
  static constexpr int kConsumerWgs = 2;
  static constexpr bool kFamilyB = kConfig.family_b;  // also schedule.h's Cfg
  static constexpr bool kDqSlots = kConfig.dq_slots;
  // The deterministic kernel's dQ writer warps (warps 1 .. kDqWriterWarps of the producer
  // warpgroup): three where the writer sums the two warpgroups' slots (dq_wgs = 1: d96), which
  // one warp did too slowly for a step (bench/PERFLOG.md, measured at d64 before its
  // deterministic kernel split dQ by rows); else one.
  static constexpr int kDqWriterWarps = kDqWgs == 1 ? 3 : 1;
  // DqStaged c: consumer WG c and the writer warps.
  static constexpr uint32_t kDqStagedThreads = 128 + 32 * kDqWriterWarps;
  static_assert(!kDeterministic || kDqSlots,
                "the deterministic kernel holds the dQ parts in the slots");

  using Registers = RegisterBudget<kConsumerWgs>;
  static constexpr int kThreads = Registers::kThreads;
  static constexpr int kConsumerThreads = 128 * kConsumerWgs;
  static_assert(kFamilyB ? kBlockN == 64 && kBlockM == 64 && kDqWgs == 2
                         : kBlockN == 64 * kConsumerWgs,
                "family A: each consumer WG owns 64 keys; family B: 64 x 64, head_dim split");
  static_assert(kBlockM == 64 || kBlockM == 128 || (kDqTransposed && kBlockM % 16 == 0),
                "64- or 128-query steps; others (a multiple of 16) with dQ transposed");
  static_assert(!kDqTransposed || (!kFamilyB && kDqWgs == 2),
                "dQ transposed: family A, the WGs split head_dim");
  // How the WGs share dQ: kDqWgs == 1: each WG its own 64 keys' partial sum (all rows and
  // columns); kDqWgs == 2: columns [c D / 2, ...) each, or with 128-query steps rows
  // [64c, 64c + 64) each (all keys, all columns).
  static constexpr bool kDqByRows = kBlockM == 128 && kDqWgs == 2;
  static_assert(kStages == 2, "Q and dO are double-buffered");
  static_assert(kHeadDim % kDqWgs == 0 && (kHeadDim / kDqWgs) % 32 == 0);
  // Floats of one WG's dQ part of a step (contiguous in the accumulator, epilogue.h).
  static constexpr int kDqWgFloats = kBlockM * kHeadDim / kDqWgs;

  // The S / dP accumulator's (rows, cols): family A (keys, queries) = S^T, family B (queries,
  // keys) = S. One m64 atom per WG: family A stacks the WGs along the keys (rows), family B
  // places them side by side along the keys (columns, 32 each).
  static constexpr int kSdPRows = kFamilyB ? kBlockM : kBlockN;
  static constexpr int kSdPCols = kFamilyB ? kBlockN : kBlockM;
  using SdPAtomShape = conditional_t<kFamilyB, Shape<_64, Int<kBlockN / 2>, Int<kHeadDim>>,
                                     Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>;
  using WgLayoutRows = Layout<Shape<Int<kConsumerWgs>, _1, _1>>;  // WGs along M
  using WgLayoutCols = Layout<Shape<_1, Int<kConsumerWgs>, _1>>;  // WGs along N
  using TiledMmaSdP = decltype(make_tiled_mma(
      gmma::ss_op_selector<Element, Element, float, SdPAtomShape>(),
      conditional_t<kFamilyB, WgLayoutCols, WgLayoutRows>{}));
  // dV / dK: (keys, d, queries); family A: A from registers, each WG its 64 keys; family B: A
  // (P^T, dS^T) from shared memory, each WG head_dim / 2 columns.
  using TiledMmadKV = decltype(make_tiled_mma(
      dkv_mma_atom<Element, kFamilyB, kBlockN, kHeadDim, kBlockM>(),
      conditional_t<kFamilyB, WgLayoutCols, WgLayoutRows>{}));
  // dQ: (queries, d, keys); the WGs' shares as kDqByRows / kDqWgs say (one atom per WG). dS is
  // q-major in shared memory in family A (written from dS^T), keys-major in family B and with dQ
  // transposed. Transposed, (d, queries, keys): A = K^T (MN-major), B = dS (keys-major), the WGs
  // along M (head_dim halves).
  using TileShapedQWg = conditional_t<
      kDqTransposed, Shape<Int<kHeadDim / 2>, Int<kBlockM>, Int<kBlockN>>,
      conditional_t<kDqByRows, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>,
                    Shape<Int<kBlockM>, Int<kHeadDim / kDqWgs>, Int<kBlockN / (3 - kDqWgs)>>>>;
  using AtomLayoutdQ =
      conditional_t<kDqByRows || kDqTransposed, Layout<Shape<_2, _1, _1>>,
                    Layout<Shape<_1, Int<kDqWgs>, _1>>>;
  static constexpr GMMA::Major kMajordS =
      kFamilyB || kDqTransposed ? GMMA::Major::K : GMMA::Major::MN;
  static constexpr GMMA::Major kMajordQA = kDqTransposed ? GMMA::Major::MN : kMajordS;
  static constexpr GMMA::Major kMajordQB = kDqTransposed ? kMajordS : GMMA::Major::MN;
  using TiledMmadQ = decltype(make_tiled_mma(
      gmma::ss_op_selector<Element, Element, float, TileShapedQWg, kMajordQA, kMajordQB>(),
      AtomLayoutdQ{}));
  // The dQ accumulator's (rows, cols) tile: (queries, d), or (d, queries) transposed.
  using DqShape = conditional_t<kDqTransposed, Shape<Int<kHeadDim>, Int<kBlockM>>,
                                Shape<Int<kBlockM>, Int<kHeadDim>>>;

  // The selectors fall back to narrower atoms when a shape is missing: insist on one atom per WG
  // (Shape_MNK is the atom's).
  static_assert(decltype(size<1>(typename TiledMmaSdP::Shape_MNK{}))::value ==
                kSdPCols / (kFamilyB ? kConsumerWgs : 1));
  static_assert(decltype(size<1>(typename TiledMmadKV::Shape_MNK{}))::value ==
                kHeadDim / (kFamilyB ? kConsumerWgs : 1));
  static_assert(decltype(size<1>(typename TiledMmadQ::Shape_MNK{}))::value ==
                (kDqTransposed ? kBlockM : kDqByRows ? kHeadDim : kHeadDim / kDqWgs));

  // The swizzle atom suits the narrowest head_dim slice any view gives one WG (family B's WGs read
  // Q^T / dO^T / K^T from column D / 2 on: d192's 96 columns need 64-byte atoms).
  using SmemAtom = decltype(k_major_smem_atom<Element, kFamilyB ? kHeadDim / 2 : kHeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutQStages = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));  // (M, D, PIPE)
  using SmemLayoutQt = TransposedView<SmemLayoutQStages, kBlockM, kHeadDim, kStages>;  // (D, M, PIPE)
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // P / dS buffers (q, keys, 2): family A q-major (the MN-major A operand of dQ), written through
  // the transposed view (keys, q, 2) from the dS^T accumulator with stmatrix; family B keys-major,
  // written from the S-shaped accumulators directly, read transposed by dV / dK.
  static constexpr int kPdSBuffers = 2;
  using SmemLayoutdS = decltype(ds_smem_layout<Element, kBlockM, kBlockN, kPdSBuffers,
                                               kFamilyB || kDqTransposed>());
  using SmemLayoutdSt = TransposedView<SmemLayoutdS, kBlockM, kBlockN, kPdSBuffers>;
  // The view the S / dP accumulator's (rows, cols) index, for the stmatrix stores.
  using SmemLayoutdSAcc = conditional_t<kFamilyB, SmemLayoutdS, SmemLayoutdSt>;
  // Family A's dS^T (keys, q) accumulator into a keys-contiguous buffer (dQ transposed): each 8 x 8
  // transposed on its way (stmatrix .trans).
  using R2SCopydS = decltype(make_tiled_copy_C(
      Copy_Atom<conditional_t<kDqTransposed, SM90_U16x8_STSM_T, SM90_U32x4_STSM_N>, Element>{},
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

  // The rows' lse_log2 / D as the TMA sees them: (seqlen_q_rounded, heads_q, batch) floats, rows
  // contiguous (the workspace's layout, bwd_params.h); one box is a step's kBlockM rows.
  using StatsGmem = decltype(make_tensor(make_gmem_ptr(static_cast<float const*>(nullptr)),
                                         Shape<int32_t, int32_t, int32_t>{},
                                         Stride<_1, int64_t, int64_t>{}));
  using SmemLayoutStats = Layout<Shape<Int<kBlockM>>>;
  // Floats between the stages' rows in shared memory: a TMA box starts 128-byte aligned.
  static constexpr int kStatsStage = (kBlockM + 31) / 32 * 32;
  using TmaStats = decltype(make_tma_copy(SM90_TMA_LOAD{}, StatsGmem{}, SmemLayoutStats{},
                                          Shape<Int<kBlockM>>{}, _1{}));

  // Bytes each TMA load brings (expect_tx counts the full box, also where it zero-fills).
  static constexpr uint32_t kStatsBytes = kBlockM * sizeof(float);
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);
  static_assert(kQBytes * kStages == cosize_v<SmemLayoutQStages> * sizeof(Element));
  static_assert(kKVBytes == cosize_v<SmemLayoutK> * sizeof(Element));

  // Q with its rows' lse_log2 on one full barrier per stage; dO with its rows' D alike.
  using QPipe = PipelineSpec<kStages, kConsumerWgs>;
  using KVPipe = PipelineSpec<1, kConsumerWgs>;       // K and V of the tile, one barrier

  // The deterministic kernel's step part, published by WG 0's leader for the dQ writer warp:
  // the dQ block in the accumulator, its semaphore and this key block's rank on it, or the end of
  // the walk (end = 1).
  struct StagedDq {
    float* acc;
    int* semaphore;
    int rank;
    int end;
  };

  struct SharedStorage {
    // 1024-byte alignment: the period of the 128-byte swizzle pattern.
    array_aligned<Element, cosize_v<SmemLayoutQStages>, 1024> q;
    array_aligned<Element, cosize_v<SmemLayoutQStages>, 1024> dout;
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    array_aligned<Element, cosize_v<SmemLayoutK>, 1024> v;
    array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> ds;  // P / dS buffers
    // The rows' lse_log2 of each Q stage and D of each dO stage (the TMA writes them with the
    // stage's rows; a box must start 128-byte aligned).
    array_aligned<float, kStages * kStatsStage, 128> lse;
    array_aligned<float, kStages * kStatsStage, 128> dpsum;
    // Per consumer WG: its dQ part of the step in the accumulator's order (epilogue.h).
    array_aligned<float, kDqSlots ? kDqWgFloats * kConsumerWgs : 4, 128> dq_slot;
    cutlass::arch::ClusterTransactionBarrier q_full[kStages];
    cutlass::arch::ClusterBarrier q_empty[kStages];
    cutlass::arch::ClusterTransactionBarrier do_full[kStages];
    cutlass::arch::ClusterBarrier do_empty[kStages];
    // The tile slot: the producer's tiles, or the end of its walk, in turn (kernel.h, TileSlot).
    PublishedTile tile[2];
    cutlass::arch::ClusterTransactionBarrier kv_full[1];
    cutlass::arch::ClusterBarrier kv_empty[1];
    // The deterministic kernel: the step's part for the dQ writer warp, and the writer's
    // barrier, one phase per step: its reduce-adds read both WGs' slots (kernel.h).
    StagedDq dq_staged;
    cutlass::arch::ClusterBarrier dq_free[1];
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kSmemOptinBytes, "tile config exceeds sm_90 shared memory");
};

}  // namespace flash_hopper::sm90
