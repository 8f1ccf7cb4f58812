// The FA-3 forward's tuned-config table: one entry per head-dim bucket, each with its reason.
//
// Numbers for H100/H200 SXM (common/budget.h): 64 Ki 32-bit registers per SM, 227 KB (232,448 B)
// opt-in shared memory per block. Every CTA holds one producer warpgroup and `consumer_wgs`
// consumer warpgroups of 64 query rows each, so block_m = 64 * consumer_wgs. A consumer thread of
// an m64nNk16 WGMMA holds N/2 fp32 accumulator registers: O costs d/2, S costs block_n/2, P
// (bf16/fp16, the A operand of the PV GEMM in registers) block_n/4.
#pragma once

#include "sm90/common/budget.h"

namespace flash_hopper::sm90 {

// FP8: warps 1-3 of the producer warpgroup transpose V into V^T (transpose.h); in mixed mode
// they convert the FP8 K / V staging stages into 16-bit ones (convert.h). The pipelines' arrival
// counts and the host simulation (tests/cpp/test_fwd_schedule.cpp) take these.
inline constexpr int kTransposerWarps = 3;
inline constexpr int kConverterWarps = 3;

// One entry of the table. An entry starts from FwdConfig::tile(block_m, block_n) and names every
// field that differs from the defaults below with its with_*() setter, so no entry depends on the
// order of the fields (C++17: no designated initializers).
struct FwdConfig {
  int block_m = 128;     // query rows per CTA tile (64 per consumer warpgroup)
  int block_n = 128;     // keys per pipeline stage
  int stages = 2;        // K and V pipeline depth
  int q_stages = 2;      // Q buffers: 2 lets the next tile's Q load while this tile computes
  int consumer_wgs = 2;  // consumer warpgroups
  bool pingpong = true;  // default of the runtime ping-pong flag (variants can turn it off)
  // O *= scale before issuing the PV GEMM (hides the FMULs under QK)
  bool rescale_o_before_pv = false;
  // The step at a tile boundary issues the next tile's first S with this tile's last PV and
  // runs the epilogue under it (mma.h). It holds both tiles' softmax statistics: off where O
  // is so large that this spills (d256: O alone is 128 registers).
  bool merge_tile_boundary = true;
  // Intra-warpgroup overlap (S(i) issued with PV(i - 1), mma.h) in the tuned kernel; off where
  // S and the PV GEMM's operands do not fit the registers together (FP8 d256), which then
  // relies on ping-pong alone to hide one warpgroup's softmax under the other's GEMMs.
  bool intra_wg_overlap = true;
  // The PV GEMM runs in this many head-dim parts, one after the other, each into the same
  // accumulator of d / pv_parts columns (FP8 d256: its two-level accumulator at full width
  // would be 128 registers next to O's 128).
  int pv_parts = 1;
  // FP8 with the intra-warpgroup overlap: the PV GEMMs accumulate in O (the tensor core's chain,
  // rescaled as 16-bit O is), and every `pv_fold_every` of them O is added into an fp32 copy in
  // shared memory and the chain restarts from zero (mma.h, PvFoldedToShared): the tensor core's
  // narrower accumulation then only ever sums that many blocks, at the registers of a
  // single-level kernel; its truncation bias grows with the chain, which therefore stays within
  // kFp8MaxChainKeys (below). 0: each PV GEMM into an accumulator of its own, added into O in
  // registers (PvTwoLevel), or the sequential kernels' fold.
  int pv_fold_every = 0;
  // The fold copy's precision: false = fp32 in O's scale; true = fp16 divided by the row's
  // running sum (a weighted mean of V's values, so |x| <= max |v|: inside fp16's range for e4m3
  // and e5m2, rounded to nearest, half of the fp32 copy's shared memory).
  bool fold_fp16 = false;
  // FP8: stages of V as loaded, the transposer's input (0: `stages`). The transposer frees a V
  // stage as soon as it wrote V^T, long before the PV GEMM frees V^T's, so one V stage can feed
  // two V^T stages where shared memory is short.
  int v_stages = 0;
  // Mixed mode (16-bit q against an FP8 K / V cache): stages of the ring the producer's TMA
  // loads FP8 K and V blocks into, in its load order, before the converter warps write them into
  // the 16-bit K / V stages (convert.h). 0 for every other kernel.
  int staging_stages = 0;
  // The epilogue's O staging in shared memory (kernel_traits.h, o_stage_passes): the fewest
  // passes it may take; 0 keeps O leaving straight from the registers (epilogue.h).
  int o_passes_min = 1;
  // The consumer holds its warpgroup index in a register for the whole loop (mma.h, Consumer::wg())
  // instead of deriving it again in every step (a shuffle, then the tiled MMA's division by the
  // warpgroup count for Q's descriptor and the ping-pong barrier ids: ~20 instructions). Off
  // where that register spills: the 16-bit d256 tile (O alone is 128 registers) measured slower
  // holding it, d192 is as tight (bench/PERFLOG.md "The consumer's warpgroup index").
  bool hold_wg_index = true;
  // CTAs per cluster along the query blocks (kMulticast tiles): the cluster's CTAs compute
  // adjacent query blocks of one head, so each loads 1 / cluster_m of every K / V block and the
  // TMA multicasts it into all of them (half the L2 -> SM traffic for K / V at 2).
  int cluster_m = 1;

  // A block_m x block_n tile with one consumer warpgroup per 64 query rows, the rest defaults.
  static constexpr FwdConfig tile(int block_m, int block_n) {
    FwdConfig c;
    c.block_m = block_m;
    c.block_n = block_n;
    c.consumer_wgs = block_m / 64;
    return c;
  }
  constexpr FwdConfig with_q_stages(int v) const { return with(&FwdConfig::q_stages, v); }
  constexpr FwdConfig with_pingpong(bool v) const { return with(&FwdConfig::pingpong, v); }
  constexpr FwdConfig with_rescale_o_before_pv(bool v) const {
    return with(&FwdConfig::rescale_o_before_pv, v);
  }
  constexpr FwdConfig with_merge_tile_boundary(bool v) const {
    return with(&FwdConfig::merge_tile_boundary, v);
  }
  constexpr FwdConfig with_intra_wg_overlap(bool v) const {
    return with(&FwdConfig::intra_wg_overlap, v);
  }
  constexpr FwdConfig with_pv_parts(int v) const { return with(&FwdConfig::pv_parts, v); }
  constexpr FwdConfig with_v_stages(int v) const { return with(&FwdConfig::v_stages, v); }
  constexpr FwdConfig with_pv_fold_every(int v) const {
    return with(&FwdConfig::pv_fold_every, v);
  }
  constexpr FwdConfig with_fold_fp16(bool v) const { return with(&FwdConfig::fold_fp16, v); }
  constexpr FwdConfig with_staging_stages(int v) const {
    return with(&FwdConfig::staging_stages, v);
  }
  constexpr FwdConfig with_o_passes_min(int v) const { return with(&FwdConfig::o_passes_min, v); }
  constexpr FwdConfig with_cluster_m(int v) const { return with(&FwdConfig::cluster_m, v); }
  constexpr FwdConfig with_hold_wg_index(bool v) const {
    return with(&FwdConfig::hold_wg_index, v);
  }

 private:
  template <class T>
  constexpr FwdConfig with(T FwdConfig::*field, T value) const {
    FwdConfig c = *this;
    c.*field = value;
    return c;
  }
};

// Masked (causal / local) calls with at most short_masked_max_seqlen_k(d) keys run the
// kShortMasked tile of their bucket where it differs (launch.h picks at run time; varlen calls
// by the caller's max_seqlen_k hint): a short sequence's query tiles hold 1-16 key blocks, half
// of them crossing the diagonal, so a key block wider than the 128-row query tile (or a 192-row
// query tile) computes and streams masked columns for nothing. d128's masked tile runs at every
// length (FA3's causal d128 tile).
// Calls without any mask (no causal or local window; dense, 16-bit) on buckets with a kMulticast
// tile run it (launch.h): the default tile in clusters of two CTAs sharing K / V loads (FA3
// does this for non-causal d >= 128). Masked calls cannot: the two query blocks would see
// different key blocks.
// FP8 d64 calls with at most kFp8ShortKeysMaxSeqlenK keys (any mask; varlen by the max_seqlen_k
// hint) run the kShortKeys tile: the default 192 x 160 computes up to 159 columns past a short
// sequence's last key (1120 columns for 1024 keys) where 192 x 128 computes none.
enum class TileFamily { kDefault, kShortMasked, kMulticast, kShortKeys };

// The largest key length that runs a bucket's kShortMasked tile: d64's up to 1k (its 128 x 128
// tile beat the 192-row tile at 512 and 1k causal keys and lost at 2k; bench/PERFLOG.md "O through
// shared memory"); d128's at every length (bench/PERFLOG.md "FA3's causal tile for bf16 d128").
constexpr int short_masked_max_seqlen_k(int head_dim) {
  return head_dim <= 64 ? 1024 : 0x7fffffff;
}

constexpr FwdConfig fwd_config(int head_dim, TileFamily family = TileFamily::kDefault) {
  // kMulticast: the default tile in clusters of two CTAs, on the buckets that have it (d128, d256).
  const int multicast_cluster = family == TileFamily::kMulticast ? 2 : 1;
  // d64: GEMM time per score (4d FLOP / 4096 FLOP/clk) equals exp time (1/16 clk per score), so
  //   three consumer warpgroups ping-pong to keep one WG's softmax under the others' GEMMs;
  //   O + S + P = 32 + 64 + 32 = 128 of the 160 registers three WGs can have. Shared memory has
  //   room for two Q buffers (2 x 24 K + 4 x 16 K = 112 KB): the next tile's Q loads early.
  // Short masked (causal / local, <= 1k keys: short_masked_max_seqlen_k): 128 x 128 with two WGs, as
  //   cuDNN runs d64 there: a 192-row tile of a short causal sequence is mostly diagonal blocks.
  //   Two WGs leave room (240 registers) for the staged epilogue that cost the 3-WG tile at 160
  //   (bench/PERFLOG.md "O through shared memory"). Smem 2 x 16 K + 4 x 16 K + O 16 K =
  //   112 KB.
  if (head_dim <= 64) {
    if (family == TileFamily::kShortMasked) {
      return FwdConfig::tile(/*block_m=*/128, /*block_n=*/128);
    }
    // O from the registers: with the staged epilogue (24 KB, or 12 KB in two passes) d64 gained at
    // s512 but lost from s2k on (the same main loop, scheduled differently at 160 registers;
    // bench/PERFLOG.md "O through shared memory").
    return FwdConfig::tile(/*block_m=*/192, /*block_n=*/128).with_o_passes_min(0);
  }
  // d96: 3 WGs would leave 160 registers for O + S + P = 48 + 64 + 32 plus addressing (spills);
  //   two WGs with N = 128: 144 live of 240. Two Q buffers: 2 x 24 K + 4 x 24 K = 144 KB.
  if (head_dim <= 96) {
    return FwdConfig::tile(/*block_m=*/128, /*block_n=*/128);
  }
  // d128: N = 176, the largest N whose K and V stages fit next to Q (32 K + 2 x 2 x 44 K =
  //   208 KB); O + S + P = 64 + 88 + 44 = 196 of 240 (N = 192 would leave too few for addressing).
  //   The 18 KB left stage O in two passes of 64 columns (the short tile: one pass of 128): the
  //   epilogue then no longer idles the tensor cores for long at each tile boundary, which matters
  //   most for short sequences (bench/PERFLOG.md "O through shared memory").
  // Masked (causal / local): N = 128, FA3's tile for them: at s512 / 1k causal, N = 176 covers
  //   24 % / 15 % more columns (the diagonal blocks' masked part), and from 4k on the 128-wide
  //   step measured faster too since the lazy rescale and the step kinds (interleaved A/Bs in
  //   bench/PERFLOG.md "v5b: d128 tile N = 128 for masked calls" and "FA3's causal tile for bf16
  //   d128"). Smem 2 x 32 K (two Q buffers) + 4 x 32 K = 192 KB.
  if (head_dim <= 128) {
    if (family == TileFamily::kShortMasked) {
      return FwdConfig::tile(/*block_m=*/128, /*block_n=*/128);
    }
    return FwdConfig::tile(/*block_m=*/128, /*block_n=*/176)
        .with_q_stages(1)
        .with_cluster_m(multicast_cluster);
  }
  // d192: N = 112: 48 K + 2 x 2 x 42 K = 216 KB (N = 128 would need 240 KB);
  //   O + S + P = 96 + 56 + 28 = 180.
  if (head_dim <= 192) {
    return FwdConfig::tile(/*block_m=*/128, /*block_n=*/112)
        .with_q_stages(1)
        .with_pingpong(false)
        .with_rescale_o_before_pv(true)
        .with_hold_wg_index(false);
  }
  // d256: N = 80: 64 K + 2 x 2 x 40 K = 224 KB, 3 KB left for barriers; O + S + P = 128 + 40 + 20
  //   = 188. O is rescaled before the PV GEMM so its 128 FMULs per thread run under the QK GEMM.
  //   The merged tile boundary (both tiles' row statistics live) spilled here: each tile keeps
  //   its own prologue and drain.
  return FwdConfig::tile(/*block_m=*/128, /*block_n=*/80)
      .with_q_stages(1)
      .with_pingpong(false)
      .with_rescale_o_before_pv(true)
      .with_merge_tile_boundary(false)
      .with_hold_wg_index(false)
      .with_cluster_m(multicast_cluster);
}

// A V head dim of its own (16-bit inputs; FA3's hdimdiff kernels): the (d, dv) pairs with a tile
// whose V, PV GEMM and O are dv wide while Q, K and S stay d wide. Other pairs are served by zero
// padding (python/flash_hopper/_dv.py).
// (192, 128), DeepSeek's prefill: FA3's 128 x 128 with the overlap, RS PV. O + S + P = 64 + 64 +
//   32 = 160 of 240: the d128 masked tile's registers. Q 1 x 48 K, K 2 x 48 K, V 2 x 32 K =
//   208 KB (two Q buffers would be 256 KB); O leaves in two passes of 64 columns through the
//   16 KB left.
constexpr bool has_dv_config(int head_dim, int head_dim_v) {
  return head_dim == 192 && head_dim_v == 128;
}

constexpr FwdConfig fwd_config_dv(int /*head_dim: 192*/, int /*head_dim_v: 128*/) {
  return FwdConfig::tile(/*block_m=*/128, /*block_n=*/128).with_q_stages(1);
}

// FP8 (e4m3) forward (docs/fwd_sm90.md "FP8 (e4m3)"): both GEMMs are FP8 WGMMAs (k = 32), so a key
// block costs half the tensor-core time of a 16-bit one while the softmax's exponentials cost the
// same: the exp unit bounds FP8 earlier, and the consumer's instructions per key (each consumer
// warp is a serial stream: its time follows its instruction count, bench/PERFLOG.md "FP8 d128 as
// FA3 runs it") make wide key blocks pay. V is transposed in shared memory by warps 1-3 of the
// producer warpgroup (transpose.h), into its own buffers (the PV GEMM needs V^T K-major in FP8).
// d64 / d128 (overlapped): the PV GEMMs accumulate in O and are folded into an fp32 copy in shared
//       memory every 4 (pv_fold_every; PvFoldedToShared, mma.h), so the registers are a
//       single-level kernel's, O (d/2) + S (N/2) + P (e4m3, N/8), and the copy is
//       consumer_wgs x 128 x d/2 fp32 of shared memory.
// d64:  192 x 160 (FA3's tile), three WGs (the exponentials bound d64: more WGs in flight), no
//       ping-pong (FA3's choice for FP8 below d128: at d64 the GEMMs are short next to the
//       softmax, and the turn costs more than it hides; measured slower with it at 192 x 128 and
//       faster without it at 192 x 160 from 8k, bench/PERFLOG.md "The consumer's warpgroup
//       index"): O + S + P = 32 + 80 + 20 = 132 of 160. Q 2 x 24 K, K / V / V^T 2 x 10 K, copy
//       48 K: 126 KB. Calls with at most 2k keys (kShortKeys) run 192 x 128 with ping-pong, which
//       measured faster there.
// d128: 128 x 224 (FA3's tile), two WGs: 64 + 112 + 28 = 204 of 240. Q 1 x 16 K, K / V^T 2 x 28 K,
//       V 1 x 28 K (v_stages: the transposer frees a V stage as soon as it wrote V^T), copy 64 K:
//       220 KB. Chosen over 128 x 192 with two V stages by the A/B in bench/PERFLOG.md ("FP8
//       d128 as FA3 runs it"): slower at 1k-2k keys, faster from 8k. The fp16 copy with FA3's two
//       V stages in the freed 32 K measured slower (bench/PERFLOG.md, "the fold copy in fp16").
// d96:  128 x 128, two WGs, each PV GEMM into an accumulator of its own added into O in registers
//       (PvTwoLevel): 48 + 48 + 64 + 16 = 176 of 240. Rows of 96 bytes take the 32-byte swizzle
//       (conflict-free in the transposer: tests/cpp/test_fp8_layout.cpp). Q 2 x 12 K, K / V / V^T
//       2 x 12 K: 96 KB.
// d192: the overlap would hold O + O_acc + S + P = 96 + 96 + 64 + 16 (or 224 with the PV GEMM in
//       two parts), and an fp32 fold copy would be 96 K: no intra-warpgroup overlap, the PV GEMM
//       in two parts of 96 columns: 96 + 64 + 16 = 176 converting, 96 + 48 + 16 = 160 during PV.
//       N = 128; Q 2 x 24 K, K / V / V^T 2 x 24 K: 192 KB.
// d256: overlapped at 128 x 96: O + S + P = 128 + 48 + 12 of 240; an fp32 fold copy would be
//       128 K, the fp16 one is 64 K. Folds every 10 PV GEMMs (960 keys). Q 1 x 32 K, K / V^T
//       2 x 24 K, V 1 x 24 K, copy 64 K: 216 KB; O leaves from the registers.
constexpr bool has_fp8_config(int head_dim) {
  return head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 192 ||
         head_dim == 256;
}

// Builds with CMake FH_FP8_SEQUENTIAL=ON run FP8 d64 / d128 in the sequential step (no
// intra-warpgroup overlap; ping-pong hides one warpgroup's softmax under the other's GEMMs) on
// wider tiles: S and the two-level accumulator are then never live together (mma.h folds the
// accumulator into O as its GEMM completes), which leaves the registers for FA3-like widths
// where the overlapped 128 x 128 step is issue-bound (bench/PERFLOG.md, "FP8 without
// intra-warpgroup overlap, wider tiles"). Not built by default until measured. Its kernels are
// two-level only (validate_fwd.cu refuses the single-level ablation for them).
#if defined(FH_FP8_SEQUENTIAL) && FH_FP8_SEQUENTIAL
inline constexpr bool kFp8SequentialBuilt = true;
#else
inline constexpr bool kFp8SequentialBuilt = false;
#endif

constexpr FwdConfig fp8_sequential_tile(int block_m, int block_n) {
  return FwdConfig::tile(block_m, block_n)
      .with_merge_tile_boundary(false)
      .with_intra_wg_overlap(false);
}

inline constexpr int kFp8ShortKeysMaxSeqlenK = 2048;

constexpr FwdConfig fwd_config_fp8_tile(int head_dim,
                                        TileFamily family = TileFamily::kDefault) {
  if (head_dim <= 64) {
    if (kFp8SequentialBuilt) {
      return fp8_sequential_tile(/*block_m=*/192, /*block_n=*/128);
    }
    if (family == TileFamily::kShortKeys) {
      return FwdConfig::tile(/*block_m=*/192, /*block_n=*/128).with_pv_fold_every(4);
    }
    return FwdConfig::tile(/*block_m=*/192, /*block_n=*/160)
        .with_pv_fold_every(4)
        .with_pingpong(false);
  }
  if (head_dim <= 96) {
    return FwdConfig::tile(/*block_m=*/128, /*block_n=*/128);
  }
  if (head_dim <= 128) {
    return kFp8SequentialBuilt ? fp8_sequential_tile(/*block_m=*/128, /*block_n=*/192)
                               : FwdConfig::tile(/*block_m=*/128, /*block_n=*/224)
                                     .with_q_stages(1)
                                     .with_v_stages(1)
                                     .with_pv_fold_every(4);
  }
  const FwdConfig parts = fp8_sequential_tile(/*block_m=*/128, /*block_n=*/128).with_pv_parts(2);
  if (head_dim <= 192) {
    return parts;
  }
  return FwdConfig::tile(/*block_m=*/128, /*block_n=*/96)
      .with_q_stages(1)
      .with_v_stages(1)
      .with_merge_tile_boundary(false)
      .with_pv_fold_every(10)
      .with_fold_fp16(true);
}

// FP8 has no room for a staging buffer of its own (o_passes_min = 0): d64 / d128 stage O through
// their fold copy once it is read (kernel_traits.h kOStageInFold; measured in bench/PERFLOG.md
// "O staged in the fold copy"), d96 / d192 / d256 store it from the registers.
constexpr FwdConfig fwd_config_fp8(int head_dim, TileFamily family = TileFamily::kDefault) {
  return fwd_config_fp8_tile(head_dim, family).with_o_passes_min(0);
}

// Whether an FP8 bucket has its own kShortKeys tile (d64).
constexpr bool has_fp8_short_keys_tile(int head_dim) {
  const FwdConfig a = fwd_config_fp8(head_dim);
  const FwdConfig b = fwd_config_fp8(head_dim, TileFamily::kShortKeys);
  return a.block_m != b.block_m || a.block_n != b.block_n || a.pingpong != b.pingpong;
}

// The keys one PV chain sums in the FP8 tensor core between two folds into fp32. Its accumulator
// truncates, a bias toward zero that grows faster than the chain (uniform attention over random
// values; docs/fwd_sm90.md "Two-level accumulation", the GPU test
// test_long_uniform_attention_keeps_the_values_mean): no FP8 tile may chain more keys than this.
inline constexpr int kFp8MaxChainKeys = 1024;
constexpr bool fp8_chain_within_bound(int head_dim, TileFamily family) {
  const FwdConfig c = fwd_config_fp8(head_dim, family);
  return c.pv_fold_every * c.block_n <= kFp8MaxChainKeys;
}
static_assert(fp8_chain_within_bound(64, TileFamily::kDefault) &&
                  fp8_chain_within_bound(64, TileFamily::kShortKeys) &&
                  fp8_chain_within_bound(96, TileFamily::kDefault) &&
                  fp8_chain_within_bound(128, TileFamily::kDefault) &&
                  fp8_chain_within_bound(192, TileFamily::kDefault) &&
                  fp8_chain_within_bound(256, TileFamily::kDefault),
              "an FP8 tile's PV chain exceeds kFp8MaxChainKeys");

// Mixed mode (fp16 / bf16 q, e4m3 / e5m2 K and V; docs/fwd_sm90.md "Mixed mode"): the 16-bit
// kernel's consumers on 16-bit K / V stages, plus a ring of FP8 staging stages the TMA loads into
// (K and V blocks in the producer's order), which warps 1-3 of the producer warpgroup convert
// (convert.h). The ring costs N * d bytes per stage, so each bucket's tile shrinks to make room:
// d64:  128 x 128, two WGs (the 16-bit tile's three WGs at 160 registers spilled with the mixed
//       mode's per-tile scale, and leave the converter warps 32 registers): Q 2 x 16 K + 4 x 16 K
//       + ring 2 x 8 K = 112 KB.
// Every mixed tile has two consumer WGs at 232 registers and the converter warps 40
// (RegisterBudget's wide producer: four conversion units in flight, convert.h).
// d128: N = 128 (the 16-bit tile's N = 176 leaves no room for the ring): Q 2 x 32 K + 4 x 32 K +
//       ring 2 x 16 K = 224 KB; O + S + P = 64 + 64 + 32.
// d256: N = 64 (16-bit: 80): Q 64 K + 4 x 32 K + ring 2 x 16 K = 224 KB; O + S + P = 128 + 32
//       + 16; as the 16-bit tile, O rescaled before the PV GEMM and no merged tile boundary.
constexpr bool has_mixed_config(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

constexpr FwdConfig fwd_config_mixed_tile(int head_dim) {
  if (head_dim <= 128) {  // d64 and d128
    return FwdConfig::tile(/*block_m=*/128, /*block_n=*/128).with_staging_stages(2);
  }
  return FwdConfig::tile(/*block_m=*/128, /*block_n=*/64)
      .with_q_stages(1)
      .with_pingpong(false)
      .with_rescale_o_before_pv(true)
      .with_merge_tile_boundary(false)
      .with_hold_wg_index(false)
      .with_staging_stages(2);
}

// As FP8's, the mixed mode's O leaves from the registers (its d128 / d256 stages leave no room
// either).
constexpr FwdConfig fwd_config_mixed(int head_dim) {
  return fwd_config_mixed_tile(head_dim).with_o_passes_min(0);
}

// Whether a bucket has a kMulticast tile (d128 and d256: FA3's choice for unmasked calls), in
// builds that ask for them (CMake FH_FA3_MULTICAST=ON: measured no faster on the H200,
// bench/PERFLOG.md "O through shared memory", so not built by default).
#if defined(FH_FA3_MULTICAST) && FH_FA3_MULTICAST
inline constexpr bool kMulticastBuilt = true;
#else
inline constexpr bool kMulticastBuilt = false;
#endif
constexpr bool has_multicast_tile(int head_dim) {
  return kMulticastBuilt && fwd_config(head_dim, TileFamily::kMulticast).cluster_m > 1;
}

// Whether a bucket has its own kShortMasked tile (only where it measured faster).
constexpr bool has_short_masked_tile(int head_dim) {
  const FwdConfig a = fwd_config(head_dim);
  const FwdConfig b = fwd_config(head_dim, TileFamily::kShortMasked);
  return a.block_m != b.block_m || a.block_n != b.block_n || a.stages != b.stages ||
         a.q_stages != b.q_stages || a.consumer_wgs != b.consumer_wgs;
}

}  // namespace flash_hopper::sm90
