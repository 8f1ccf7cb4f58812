// The FA-2 path's tuned-config table: one entry per head-dim bucket, each with its reason.
//
// Shared memory per CTA = (kBlockM + 2 * kBlockN) * kHeadDim * 2 bytes (Q tile, one K and one V
// tile; K and V alternate, see fwd_kernel.h). Registers: each warp owns 16 * (kBlockM / 16 / warps)
// query rows; the fp32 O accumulator costs rows_per_warp * kHeadDim / 32 registers per thread and the
// S tile rows_per_warp * kBlockN / 32, which must stay well under 255 together.
#pragma once

namespace flash_hopper::sm80 {

struct FwdTileConfig {
  int block_m;
  int block_n;
  int warps;
};

// Tuned on the H200 (bench/PERFLOG.md has the measurements); every entry also fits the 99 KB
// opt-in shared memory of sm86/sm89 parts, so one table serves every cc >= 8.0 GPU.
constexpr FwdTileConfig fwd_tile_config(int head_dim) {
  // d 64: 128 x 128, 4 warps -- O is only 64 regs/thread, so a wide N halves the row-max/rescale
  //        work per key; 48 KB smem. Best for short unmasked sequences (see the narrow variant).
  // d 96: 128 x 64, 4 warps -- 128-wide N would push S + O past ~170 live registers.
  // d 128: 128 x 64, 4 warps -- O 128 + S 64 regs/thread; 64 KB smem, 2 CTAs per SM (registers).
  // d 192: 128 x 64, 8 warps -- 8 warps halve rows per warp so O stays at 96 regs/thread; 96 KB.
  // d 256: 64 x 64, 4 warps -- O 128 regs/thread, 96 KB smem, 2 independent CTAs per SM: finer
  //        query tiles balance the causal triangle and two CTAs hide each other's barriers; it
  //        beat 128 x 64 with 8 warps and 64 x 32 (bench/PERFLOG.md "v3: d256 on 64 x 64 tiles
  //        with 4 warps").
  return head_dim <= 64    ? FwdTileConfig{128, 128, 4}
         : head_dim <= 96  ? FwdTileConfig{128, 64, 4}
         : head_dim <= 128 ? FwdTileConfig{128, 64, 4}
         : head_dim <= 192 ? FwdTileConfig{128, 64, 8}
                           : FwdTileConfig{64, 64, 4};
}

// A second, narrower tile where it measured faster; equal to fwd_tile_config where it did not.
// d 64: 128 x 64 -- the 128 x 128 tile spills row statistics; without them the narrow tile wins
//        with a causal or window mask and on unmasked keys from 8k on, but loses on shorter
//        unmasked sequences, where the wide tile's fewer row reductions per key win
//        (bench/PERFLOG.md "v4: d64 picks a 128 x 64 tile for masked or long calls").
constexpr FwdTileConfig fwd_tile_config_narrow(int head_dim) {
  return head_dim <= 64 ? FwdTileConfig{128, 64, 4} : fwd_tile_config(head_dim);
}

// Which of the two serves a call (runtime; both are compiled where they differ).
constexpr bool use_narrow_tile(bool masked, int seqlen_k) { return masked || seqlen_k >= 8192; }

constexpr int fwd_smem_bytes(FwdTileConfig c, int head_dim, int elem_bytes) {
  return (c.block_m + 2 * c.block_n) * head_dim * elem_bytes;
}

}  // namespace flash_hopper::sm80
