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

// Tuned for A100/H100-class parts (>= 164 KB shared memory per SM).
constexpr FwdTileConfig fwd_tile_config(int head_dim) {
  // d 64: 128 x 128, 4 warps -- O is only 64 regs/thread, so a wide N halves the row-max/rescale
  //        work per key; 48 KB smem lets 4 CTAs share an SM.
  // d 96: 128 x 64, 4 warps -- 128-wide N would push S + O past ~170 live registers.
  // d 128: 128 x 64, 4 warps -- O 128 + S 64 regs/thread; 64 KB smem, 3 CTAs per H100 SM.
  // d 192: 128 x 64, 8 warps -- 8 warps halve rows per warp so O stays at 96 regs/thread.
  // d 256: 128 x 64, 8 warps -- O 128 regs/thread; 128 KB smem, one CTA of 8 warps per SM.
  return head_dim <= 64    ? FwdTileConfig{128, 128, 4}
         : head_dim <= 96  ? FwdTileConfig{128, 64, 4}
         : head_dim <= 128 ? FwdTileConfig{128, 64, 4}
         : head_dim <= 192 ? FwdTileConfig{128, 64, 8}
                           : FwdTileConfig{128, 64, 8};
}

// Fallback for parts whose opt-in shared memory per block is below the primary config's need
// (sm86/sm89: 99 KB): d 256 at 64 x 64 with 4 warps needs 96 KB.
constexpr FwdTileConfig fwd_tile_config_small_smem(int head_dim) {
  return FwdTileConfig{64, 64, 4};
}

constexpr int fwd_smem_bytes(FwdTileConfig c, int head_dim, int elem_bytes) {
  return (c.block_m + 2 * c.block_n) * head_dim * elem_bytes;
}

}  // namespace flash_hopper::sm80
