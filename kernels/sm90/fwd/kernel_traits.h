// CuTe types of one FA-3 forward instantiation: tile shapes, WGMMA tiled MMAs, shared-memory
// layouts, TMA copy types and the shared-storage struct, all derived from the tuned config.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "sm90/common/gmma_atoms.h"
#include "sm90/common/pipeline.h"
#include "sm90/common/smem_atoms.h"
#include "sm90/fwd/tile_config.h"
#include "sm90/fwd/tile_scheduler.h"

namespace flash_hopper::sm90 {

using namespace cute;

struct EmptyStorage {};

// The O staging of the epilogue (epilogue.h): the fewest passes P (1, 2 or 4, at least
// min_passes) whose 16-bit block_m x (head_dim / P) buffer fits `free_bytes`, with head_dim / P a
// row of 4, 8 or 16 sixteen-byte chunks (the swizzle's shapes); 0 where none does or for
// min_passes = 0 (O then leaves from the registers).
constexpr int o_stage_passes(int free_bytes, int block_m, int head_dim, int min_passes) {
  for (int passes = min_passes; passes >= 1 && passes <= 4; passes *= 2) {
    const int cols = head_dim / passes;
    const bool shaped = head_dim % passes == 0 && (cols == 32 || cols == 64 || cols == 128);
    if (shaped && block_m * cols * 2 <= free_bytes) {
      return passes;
    }
  }
  return 0;
}

// KvElement_: the element of K and V in user memory; Element's but for the mixed mode.
// kVarlen_: the packed variable-length layout (docs/fwd_sm90.md "Varlen"): the prepare kernel's
// tile list instead of the static scheduler, per-sequence offsets and masks, V tails zeroed in
// shared memory (vtail.h). A kernel of its own: as a runtime branch it cost the dense d64 kernel
// spills.
// kHeadDimV_: V's and O's head dim where it differs from Q's and K's (DeepSeek's 192 / 128): the
// PV GEMM, V's stages and TMA box, and O are that wide, Q / K / S as kHeadDim_ gives them
// (tile_config.h fwd_config_dv). 16-bit inputs only; the default is kHeadDim_.
template <class Element_, int kHeadDim_, bool kOverlap_,
          TileFamily kFamily = TileFamily::kDefault, class KvElement_ = Element_,
          bool kVarlen_ = false, int kHeadDimV_ = kHeadDim_>
struct FwdTraits {
  using Element = Element_;
  using KvElement = KvElement_;
  static constexpr bool kVarlen = kVarlen_;
  // fp16 / bf16, or FP8 e4m3: FP8 inputs write O in bf16 or fp16 (FwdParams::o_fp16),
  // take V^T from the transposer warps and accumulate PV in two levels (mma.h).
  static constexpr bool kFp8 = sizeof(Element) == 1;
  static_assert(sizeof(Element) == 2 || cute::is_same_v<Element, cutlass::float_e4m3_t>,
                "the FA-3 path forward handles fp16 / bf16 / e4m3 inputs");
  static_assert(!kFp8 || (kOverlap_ && (kFamily == TileFamily::kDefault ||
                                         kFamily == TileFamily::kShortKeys)),
                "FP8: the tuned kernel of its bucket's config (and its short-keys tile)");
  static_assert(kFamily != TileFamily::kShortKeys || kFp8, "kShortKeys is an FP8 tile");
  // Mixed mode: 16-bit q and math against e4m3 / e5m2 K and V, which the TMA loads
  // into a staging ring and warps 1-3 of the producer warpgroup convert into the 16-bit kernel's
  // K / V stages (convert.h). The consumers are the 16-bit ones; the descales of K and V scale
  // the scores and O as in the FP8 kernel.
  static constexpr bool kMixed = !cute::is_same_v<Element, KvElement>;
  static_assert(!kMixed || (sizeof(Element) == 2 &&
                            (cute::is_same_v<KvElement, cutlass::float_e4m3_t> ||
                             cute::is_same_v<KvElement, cutlass::float_e5m2_t>)),
                "mixed mode: fp16 / bf16 q against e4m3 / e5m2 K and V");
  static_assert(!kMixed || (kOverlap_ && kFamily == TileFamily::kDefault),
                "mixed mode has one tile: the tuned kernel of its bucket's config");
  // The descales of the FP8 inputs scale the scores and O (mma.h, TileScales).
  static constexpr bool kScaled = kFp8 || kMixed;
  static_assert(!kVarlen || (!kMixed && kOverlap_),
                "varlen: the tuned kernels of the bucket (16-bit: default and short masked tile; "
                "FP8: its one tile)");
  using TileOrder = conditional_t<kVarlen, VarlenTileScheduler, StaticTileScheduler>;

  // Whether V / O have a head dim of their own.
  static constexpr bool kOwnHeadDimV = kHeadDimV_ != kHeadDim_;
  static_assert(!kOwnHeadDimV || (!kFp8 && !kMixed && kFamily == TileFamily::kDefault &&
                                  has_dv_config(kHeadDim_, kHeadDimV_)),
                "a V head dim of its own: 16-bit inputs, the (d, dv) pairs with a tile");
  static constexpr FwdConfig kConfig =
      kOwnHeadDimV ? fwd_config_dv(kHeadDim_, kHeadDimV_)
      : kFp8       ? fwd_config_fp8(kHeadDim_, kFamily)
                   : (kMixed ? fwd_config_mixed(kHeadDim_) : fwd_config(kHeadDim_, kFamily));
  static constexpr int kStagingStages = kConfig.staging_stages;
  static_assert(kMixed == (kStagingStages > 0), "the staging ring is the mixed mode's");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kConfig.block_m;
  static constexpr int kBlockN = kConfig.block_n;
  static constexpr int kStages = kConfig.stages;
  static constexpr int kQStages = kConfig.q_stages;
  // FP8: V as loaded (the transposer's input) may have fewer stages than K and V^T.
  static constexpr int kVStages = kFp8 && kConfig.v_stages > 0 ? kConfig.v_stages : kStages;
  static_assert(kVStages == kStages || kFp8, "V's own depth is the FP8 transposer's input");
  static constexpr int kConsumerWgs = kConfig.consumer_wgs;
  // Intra-warpgroup overlap of softmax and PV: the variant's flag, where the config has room.
  static constexpr bool kOverlap = kOverlap_ && kConfig.intra_wg_overlap;
  // The producer loads V(step i - 1) after K(step i) where the consumers use V a step late
  // (overlap); FP8 loads V right after K, for its transposer (schedule.h, produce()).
  static constexpr bool kVLag = kOverlap && !kFp8;
  // The PV GEMM's head-dim parts (tile_config.h): its atoms are d / kPvParts wide.
  static constexpr int kPvParts = kConfig.pv_parts;
  static_assert(kPvParts == 1 || (kFp8 && !kOverlap),
                "a PV GEMM in parts is FP8's (two-level accumulator) and waits each part");
  // FP8: the PV chain's fold into shared memory every kPvFoldEvery GEMMs (tile_config.h).
  static constexpr int kPvFoldEvery = kConfig.pv_fold_every;
  static_assert(kPvFoldEvery == 0 || (kFp8 && kOverlap && kPvParts == 1),
                "the shared-memory fold is the overlapped FP8 kernel's PV accumulator");
  static constexpr bool kRescaleOBeforePv = kConfig.rescale_o_before_pv;
  static constexpr bool kPingpongDefault = kConfig.pingpong;
  static constexpr bool kHoldWgIndex = kConfig.hold_wg_index;
  static constexpr bool kMergeTileBoundary = kConfig.merge_tile_boundary;
  // Clusters of kClusterM CTAs on adjacent query blocks of one head sharing K / V loads (the
  // kMulticast tile; tile_config.h): each CTA's TMA loads 1 / kClusterM of a K / V block into
  // every CTA of the cluster.
  static constexpr int kClusterM = kConfig.cluster_m;
  static_assert(kClusterM == 1 || (kClusterM == 2 && !kVarlen && !kFp8 && !kMixed),
                "K / V multicast: dense 16-bit calls without a mask");

  using Registers = RegisterBudget<kConsumerWgs, /*kWideProducer=*/kMixed>;
  static constexpr int kThreads = Registers::kThreads;
  static constexpr int kConsumerThreads = 128 * kConsumerWgs;
  static_assert(kBlockM == 64 * kConsumerWgs, "each consumer warpgroup owns 64 query rows");
  static_assert(kStages >= 2);

  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;  // (M, N, D)
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDimV / kPvParts>, Int<kBlockN>>;  // (M, Dv, N)
  // One WGMMA atom per consumer warpgroup, stacked along M.
  using AtomLayout = Layout<Shape<Int<kConsumerWgs>, _1, _1>>;
  // S = Q K^T: both operands K-major in shared memory.
  using TiledMmaQK = decltype(make_tiled_mma(
      gmma::ss_op_selector<Element, Element, float, TileShapeQK>(), AtomLayout{}));
  // O += P V: P from registers (the converted S accumulator), V^T in shared memory: MN-major
  // (V as loaded) for 16-bit inputs, K-major (the transposer's buffer) for FP8, which WGMMA
  // supports K-major only.
  using TiledMmaPV = decltype(make_tiled_mma(
      gmma::rs_op_selector<Element, Element, float, TileShapePV, GMMA::Major::K,
                           kFp8 ? GMMA::Major::K : GMMA::Major::MN>(),
      AtomLayout{}));
  static_assert(!kFp8 || kConfig.rescale_o_before_pv == false,
                "FP8 rescales O after its PV GEMM (two-level accumulation adds that GEMM first)");
  static_assert(!kFp8 || (kBlockN % 32 == 0 && kHeadDim % 32 == 0),
                "the transposer's units (32 keys x 16 columns) and swizzle atoms (V^T rows of "
                "32, 64 or 128 bytes; V rows of at least 32 bytes) must tile V and V^T");

  // The selectors fall back to narrower atoms for a width they lack (common/gmma_atoms.h lists
  // the widths beyond CuTe's base ones): insist on one atom spanning the tile.
  static_assert(decltype(size<1>(typename TiledMmaQK::Shape_MNK{}))::value == kBlockN);
  static_assert(decltype(size<1>(typename TiledMmaPV::Shape_MNK{}))::value ==
                kHeadDimV / kPvParts);

  using SmemAtom = decltype(k_major_smem_atom<Element, kHeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutQStages = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQStages>>{}));  // (M, D, QPIPE)
  using SmemLayoutK = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));  // (N, D, PIPE)
  // V lands like K (rows of D contiguous elements). 16-bit: the PV GEMM reads the same bytes as
  // V^T (D, N, PIPE), which is the MN-major B operand. FP8: V^T is a buffer of its own, K-major
  // (rows of N keys), written by the transposer with the keys of each 32-key slice in the order
  // of the P register fragment (transpose.h).
  // With a V head dim of its own, V's rows are kHeadDimV wide: a layout (and swizzle atom) of
  // their own.
  using SmemLayoutV = conditional_t<
      (kVStages == kStages && !kOwnHeadDimV), SmemLayoutK,
      decltype(tile_to_shape(k_major_smem_atom<Element, kHeadDimV>(),
                             Shape<Int<kBlockN>, Int<kHeadDimV>, Int<kVStages>>{}))>;
  using SmemLayoutVt = conditional_t<
      kFp8,
      decltype(tile_to_shape(k_major_smem_atom<Element, kBlockN>(),
                             Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{})),
      decltype(composition(SmemLayoutV{},
                           make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{},
                                               Step<_2, _1, _3>{})))>;  // (Dv, N, PIPE)

  // Global tensors as the TMA sees them: (seqlen, head_dim, heads, batch), head_dim contiguous.
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                          ShapeQKV{}, StrideQKV{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  // Mixed mode: the FP8 staging ring, (N, D, STAGING) with FP8 rows; K and V blocks take its
  // stages in the producer's load order.
  using SmemLayoutStaging = decltype(tile_to_shape(
      k_major_smem_atom<KvElement, kHeadDim>(),
      Shape<Int<kBlockN>, Int<kHeadDim>, Int<kMixed ? kStagingStages : 1>>{}));
  using GmemTensorKV = decltype(make_tensor(make_gmem_ptr(static_cast<KvElement const*>(nullptr)),
                                            ShapeQKV{}, StrideQKV{}));
  // K / V land in their stages, or in mixed mode in the staging ring.
  using SmemLayoutKVLoad = conditional_t<kMixed, SmemLayoutStaging, SmemLayoutK>;
  using TmaKVOp = conditional_t<(kClusterM > 1), SM90_TMA_LOAD_MULTICAST, SM90_TMA_LOAD>;
  using TmaKV = decltype(make_tma_copy(TmaKVOp{}, GmemTensorKV{}, take<0, 2>(SmemLayoutKVLoad{}),
                                       Shape<Int<kBlockN>, Int<kHeadDim>>{},
                                       Int<kClusterM>{}));
  // Where V blocks land and their TMA: K's, but for a V head dim of its own (its own stages, a
  // box kHeadDimV wide); without one, TmaV is TmaKV's type.
  using SmemLayoutVLoad = conditional_t<kOwnHeadDimV, SmemLayoutV, SmemLayoutKVLoad>;
  using TmaV = decltype(make_tma_copy(TmaKVOp{}, GmemTensorKV{}, take<0, 2>(SmemLayoutVLoad{}),
                                     Shape<Int<kBlockN>, Int<kHeadDimV>>{}, Int<kClusterM>{}));
  static_assert(kOwnHeadDimV || cute::is_same_v<TmaV, TmaKV>);

  // Bytes each TMA load brings (expect_tx counts the full box, also where it zero-fills).
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(KvElement);
  static constexpr uint32_t kVBytes = kBlockN * kHeadDimV * sizeof(KvElement);  // a V block
  static_assert(kQBytes == cosize_v<SmemLayoutQ> * sizeof(Element));
  static_assert(kQBytes * kQStages == cosize_v<SmemLayoutQStages> * sizeof(Element));
  static_assert(kMixed || kKVBytes * kStages == cosize_v<SmemLayoutK> * sizeof(Element));
  static_assert(kMixed || kVBytes * kVStages == cosize_v<SmemLayoutV> * sizeof(Element));
  static_assert(!kMixed || kKVBytes * kStagingStages == cosize_v<SmemLayoutStaging>);

  // Q buffers and K / V stages between the producer and the consumer warpgroups
  // (common/pipeline.h).
  // FP8: V goes from the producer to the transposer warps (VPipe), V^T from them to the
  // consumers (VtPipe, full barriers without transaction bytes).
  // Mixed mode: the producer loads into the staging ring (StagingPipe, released by the converter
  // warps), the converter warps write the K / V stages (KVPipe's full barriers: one arrival per
  // converter warp, no transaction bytes).
  using QPipe = PipelineSpec<kQStages, kConsumerWgs>;
  using KVPipe = PipelineSpec<kStages, kConsumerWgs, /*kFullArrivals=*/kMixed ? kConverterWarps : 1,
                              /*kPeers=*/kClusterM>;
  using VPipe = conditional_t<kFp8, PipelineSpec<kVStages, kTransposerWarps>, KVPipe>;
  using VtPipe = PipelineSpec<kStages, kConsumerWgs, /*kFullArrivals=*/kTransposerWarps>;
  using StagingPipe = PipelineSpec<kMixed ? kStagingStages : 1, kConverterWarps>;
  // The tile slot (tile_slot.h): the producer's one arrival per tile; an arrival from every
  // thread that reads it (the consumer warpgroups and the relay warps: FP8's transposers, the
  // mixed mode's converters, the varlen 16-bit kernels' tail-zeroing warp).
  static constexpr int kRelayWarps = kFp8 ? kTransposerWarps : kMixed ? kConverterWarps
                                                          : kVarlen   ? 1
                                                                      : 0;
  using TilePipe = PipelineSpec<2, 128 * kConsumerWgs + 32 * kRelayWarps>;

  struct VtStorage {
    array_aligned<Element, cosize_v<SmemLayoutVt>, 1024> vt;
    cutlass::arch::ClusterTransactionBarrier vt_full[VtPipe::kStages];
    cutlass::arch::ClusterBarrier vt_empty[VtPipe::kStages];
  };
  struct StagingStorage {
    array_aligned<KvElement, cosize_v<SmemLayoutStaging>, 1024> kv;
    cutlass::arch::ClusterTransactionBarrier full[StagingPipe::kStages];
    cutlass::arch::ClusterBarrier empty[StagingPipe::kStages];
  };
  // The fold's copy of O (PvFoldedToShared): one slab per consumer warpgroup, its threads' d / 2
  // values as chunks of 4 (fp32, or fp16 with kFoldFp16), chunk j of the warpgroup's thread t at
  // j * 128 + t (a warp's 32 lanes: one contiguous run). The epilogue stages O through an fp32
  // slab once read.
  static constexpr bool kFoldFp16 = kConfig.fold_fp16;
  static constexpr int kOFoldSlabBytes = 128 * kHeadDim / 2 * (kFoldFp16 ? 2 : 4);
  struct OFoldStorage {
    array_aligned<float, kConsumerWgs * kOFoldSlabBytes / 4, 128> o;  // fp16 pairs as floats
  };
  struct MainStorage {
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
    // Varlen: a sequence's tail V block lands here; the zeroing warp arrives on v_full (vtail.h).
    cutlass::arch::ClusterTransactionBarrier v_landed[KVPipe::kStages];
    // The tile slot (tile_slot.h).
    int tile[TilePipe::kStages];
    cutlass::arch::ClusterTransactionBarrier tile_full[TilePipe::kStages];
    cutlass::arch::ClusterBarrier tile_empty[TilePipe::kStages];
    conditional_t<kFp8, VtStorage, EmptyStorage> fp8;
    conditional_t<kMixed, StagingStorage, EmptyStorage> staging;
    conditional_t<(kPvFoldEvery > 0), OFoldStorage, EmptyStorage> o_fold;
  };
  // O's way out (epilogue.h): through shared memory where the stages leave room for every
  // consumer warpgroup's 64 rows of kHeadDimV / kOPasses columns (written kOPasses times per
  // tile), else straight from the registers (kOPasses = 0).
  // FP8 with an fp32 fold copy stages O in one pass through it: a warpgroup's slab (128 threads x
  // kHeadDim / 2 fp32) is free once the epilogue read it and holds twice the warpgroup's 64 x
  // kHeadDim 16-bit O. The fp16 copy (d256) stages nothing: O leaves from the registers there.
  static constexpr bool kOStageInFold = kPvFoldEvery > 0 && !kFoldFp16;
  static constexpr int kOPasses =
      kOStageInFold ? 1
                    : o_stage_passes(kSmemOptinBytes - int(sizeof(MainStorage)), kBlockM,
                                     kHeadDimV, kConfig.o_passes_min);
  static constexpr int kOStageCols = kOPasses > 0 ? kHeadDimV / kOPasses : 0;
  static constexpr int kOStageBytes = kBlockM * kOStageCols * 2;  // O is 16-bit (FP8: bf16 / fp16)
  // A warpgroup's slab of the staging buffer starts here, from the buffer's start.
  static constexpr int kOStageSlabStride = kOStageInFold ? kOFoldSlabBytes : 64 * kOStageCols * 2;
  static_assert(!kOStageInFold || (64 * kHeadDim * 2 <= kOFoldSlabBytes &&
                                   (kHeadDim == 32 || kHeadDim == 64 || kHeadDim == 128)),
                "O staged through the fold copy: one pass of whole rows in a warpgroup's slab");
  struct OStageStorage {
    array_aligned<uint8_t, kOStageBytes, 128> o;
  };
  struct SharedStorage : MainStorage {
    conditional_t<(kOPasses > 0 && !kOStageInFold), OStageStorage, EmptyStorage> o_stage;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kSmemOptinBytes, "tile config exceeds sm_90 shared memory");
};

}  // namespace flash_hopper::sm90
