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
// Shared memory: K, V (block_n x d each), Q and dO (block_m x d each, `q_stages` / `do_stages`
// buffers), P and dS (block_m x block_n each), all 16-bit; the rows' lse_log2 and D ride with Q and
// dO (4 * block_m bytes per buffer).
//
// The tile shapes and warp layouts are FlashAttention-2's choices for sm80 (its
// flash_bwd_launch_template.h, the sizes for >= 144 KB of shared memory), which is what torch's
// SDPA flash backend runs: the bar this path is measured against. Every entry fits A100 / H100 /
// H200 (164 KB, 227 KB); GPUs with 99 KB of shared memory per block (sm86 / sm89) get
// LaunchResult::no_tile_fits.
#pragma once

namespace flash_hopper::sm80 {

struct BwdTileConfig {
  int block_m;
  int block_n;
  int warps;
  int atom_m_sdp;  // warps along M of S / dP (the rest along N)
  int atom_n_dkv;  // warps along N (keys) of dK / dV (the rest along head_dim)
  int atom_m_dq;   // warps along M of dQ (the rest along head_dim)
  int q_stages;    // Q buffers: 2 prefetches the next step's Q under this one's GEMMs; 1 loads
                   // it after this step's last GEMM (dK) reads Q
  int do_stages;   // dO buffers: likewise; 1 loads the next dO after this step's dV GEMM
};

constexpr BwdTileConfig bwd_tile_config(int head_dim) {
  // d 64: 128 x 128 -- S + dP 128, dK + dV 64 registers: a wide tile amortizes the per-step
  //        barriers over the most work. 162 KB.
  // d 96: 64 x 128 -- S + dP 64, dK + dV 96. 129 KB.
  // d 128: 64 x 128 -- S + dP 64, dK + dV 128 (the register bound). 161 KB.
  // d 192: 64 x 64 -- S + dP 32, dK + dV 96; 128 keys would need 192. 161 KB.
  // d 256: 64 x 64, two Q buffers, one dO buffer -- dK + dV 128 registers; 176 KB, so H100 /
  //        H200 only: GPUs with less (A100: 164 KB) run bwd_tile_config_fallback.
  return head_dim <= 64    ? BwdTileConfig{128, 128, 8, 2, 4, 4, 2, 2}
         : head_dim <= 96  ? BwdTileConfig{64, 128, 8, 2, 4, 4, 2, 2}
         : head_dim <= 128 ? BwdTileConfig{64, 128, 8, 2, 4, 2, 2, 2}
         : head_dim <= 192 ? BwdTileConfig{64, 64, 8, 4, 2, 2, 2, 2}
                           : BwdTileConfig{64, 64, 8, 4, 2, 2, 2, 1};
}

// The config a GPU whose shared memory per block is below bwd_tile_config's runs; equal to it
// where that one fits every cc >= 8.0 GPU with >= 164 KB. d 256: one Q buffer (144 KB, A100),
// Q's load latency exposed at the top of each step.
constexpr BwdTileConfig bwd_tile_config_fallback(int head_dim) {
  return head_dim > 192 ? BwdTileConfig{64, 64, 8, 4, 2, 2, 1, 1} : bwd_tile_config(head_dim);
}

constexpr int bwd_smem_bytes(BwdTileConfig c, int head_dim, int elem_bytes) {
  return (2 * c.block_n * head_dim + (c.q_stages + c.do_stages) * c.block_m * head_dim +
          2 * c.block_m * c.block_n) *
             elem_bytes +
         (c.q_stages + c.do_stages) * c.block_m * 4;
}

}  // namespace flash_hopper::sm80
