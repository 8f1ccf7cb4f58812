// The FA-2 path's backward tuned-config table: one entry per head-dim bucket, each with its reason.
//
// A CTA owns one key block (block_n keys of one kv head) and walks the query blocks (block_m rows)
// that see it. Per step it computes S = Q K^T and dP = dO V^T (tiled-MMA "SdP"), writes P and dS to
// shared memory, and runs dV += P^T dO, dK += dS^T Q (tiled-MMA "dKV": dK and dV live in registers
// for the whole tile) and dQ = dS K (tiled-MMA "dQ", added to the fp32 accumulator in global memory).
// 8 warps; each tiled MMA lays them out (atoms along its M, the rest along its N), which sets the
// register cost per thread:
//   S + dP:  2 * block_m * block_n / 256      dK + dV: 2 * block_n * head_dim / 256
//   dQ:      block_m * head_dim / 256 (live only during its GEMM and the atomics)
// Shared memory: K, V (block_n x d each), Q and dO (block_m x d each, `stages` buffers), P and dS
// (block_m x block_n each), all 16-bit.
//
// The tile shapes and warp layouts are FlashAttention-2's choices for sm80 (its
// flash_bwd_launch_template.h, the sizes for >= 144 KB of shared memory), which is what torch's
// SDPA flash backend runs: the bar of the issue. Every entry fits A100 / H100 / H200 (164 KB,
// 227 KB); GPUs with 99 KB of shared memory per block (sm86 / sm89) get LaunchResult::no_tile_fits.
#pragma once

namespace flash_hopper::sm80 {

struct BwdTileConfig {
  int block_m;
  int block_n;
  int warps;
  int atom_m_sdp;  // warps along M of S / dP (the rest along N)
  int atom_n_dkv;  // warps along N (keys) of dK / dV (the rest along head_dim)
  int atom_m_dq;   // warps along M of dQ (the rest along head_dim)
  int stages;      // Q / dO buffers: 2 prefetches the next step's under this one's GEMMs
};

constexpr BwdTileConfig bwd_tile_config(int head_dim) {
  // d 64: 64 x 128 -- S + dP 64, dK + dV 64 registers. FlashAttention-2's 128 x 128 (S + dP
  //        128) spilled 436 bytes here: the softcap factor 1 - t^2 takes another M * N / 256. 96 KB.
  // d 96: 64 x 128 -- S + dP 64, dK + dV 96. 128 KB.
  // d 128: 64 x 128 -- S + dP 64, dK + dV 128 (the register bound). 160 KB.
  // d 192: 64 x 64 -- S + dP 32, dK + dV 96; 128 keys would need 192. 160 KB.
  // d 256: 64 x 64, one Q / dO buffer -- dK + dV 128 registers; two buffers would need 208 KB,
  //        more than an A100 has. 144 KB.
  return head_dim <= 64    ? BwdTileConfig{64, 128, 8, 2, 4, 4, 2}
         : head_dim <= 96  ? BwdTileConfig{64, 128, 8, 2, 4, 4, 2}
         : head_dim <= 128 ? BwdTileConfig{64, 128, 8, 2, 4, 2, 2}
         : head_dim <= 192 ? BwdTileConfig{64, 64, 8, 4, 2, 2, 2}
                           : BwdTileConfig{64, 64, 8, 4, 2, 2, 1};
}

constexpr int bwd_smem_bytes(BwdTileConfig c, int head_dim, int elem_bytes) {
  return (2 * c.block_n * head_dim + 2 * c.stages * c.block_m * head_dim +
          2 * c.block_m * c.block_n) *
         elem_bytes;
}

}  // namespace flash_hopper::sm80
