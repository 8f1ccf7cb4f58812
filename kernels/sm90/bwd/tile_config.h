// The FA-3 path's backward tuned-config table (docs/bwd_sm90.md "Tiles: families A and B"): one
// entry per head-dim bucket, each with its reason. Every kernel has one producer warpgroup and two
// consumer warpgroups (24 / 240 registers, RegisterBudget<2>); a consumer thread of an m64nNk16
// WGMMA holds N/2 fp32 accumulator registers.
//
// Family A (d64, d96, d128): a tile is block_n = 128 keys of one kv head and a step block_m = 64
// or 128 queries; each consumer WG owns 64 of the keys and computes S^T = K Q^T and dP^T = V dO^T
// (its 64 keys x block_m queries), so P^T and dS^T are already in registers as the A operands of
// dV += P^T dO and dK += dS^T Q (RS GEMMs, no shared-memory round trip). dS goes to shared memory
// once, for dQ = dS K (SS). Either the WGs split dQ along head_dim (dq_wgs = 2: each over all 128
// keys, so both WGs' dS must be written first: a CTA-wide barrier per step keeps the WGs in lock
// step), or each WG adds its own keys' partial dS_c K_c over all rows and columns (dq_wgs = 1:
// twice the dQ adds, but the WGs share nothing within a step and drift apart, one WG's
// exponentials under the other's GEMMs: faster at d64 and d96, bench/PERFLOG.md "v9 (kept):
// decoupled warpgroups").
// Family B (d192, d256): dV and dK of 64 keys x 256 columns are 256 fp32 registers per thread if
// one WG owns them, so the WGs split head_dim instead. A tile is block_n = 64 keys and a step
// block_m = 64 queries; S = Q K^T and dP = dO V^T are plain (64 queries x 32 keys per WG), P and
// dS go to shared memory (one buffer each), and dV += P^T dO, dK += dS^T Q, dQ = dS K are SS GEMMs
// over all 64 keys / queries with each WG computing head_dim / 2 columns.
#pragma once

#include "sm90/common/budget.h"

namespace flash_hopper::sm90 {

struct BwdConfig {
  int block_m;   // query rows per step
  int block_n;   // keys per tile (64 per consumer WG)
  int q_stages;  // Q and dO buffers (and dS buffers): 2 lets step i + 1 load while step i computes
  int dq_wgs;    // 2: the WGs split dQ's columns (or rows); 1: each WG adds its keys' partial dQ
  bool family_b; // P and dS through shared memory, the WGs split head_dim (d192, d256)
  // dQ leaves through a shared-memory slot per WG and one bulk reduce-add (cp.reduce.async.bulk)
  // per WG and step, instead of red.global.add.v4.f32 from registers: the registers of a red
  // stay locked until the memory system took its data, which stalled the next step's first
  // instruction at d128 (ncu source counters, bench/PERFLOG.md "Where d128 waits"). Costs
  // kBlockM * kHeadDim * 4 bytes of shared memory (d256 has no room for it).
  bool dq_slots;
  // The consumer holds its warpgroup index in a register for the whole kernel instead of deriving
  // it (a shuffle of tid / 128, then the tiled MMAs' divisions) in front of every GEMM: faster at
  // d64 and d256, slower at d128, where ptxas then keeps the tile counter on the stack
  // (bench/PERFLOG.md "the backward's step overhead").
  bool hold_wg_index;
  // dQ computed transposed, dQ^T = K^T dS^T (head_dim as the GEMM's M, split over the WGs; the
  // step's queries as N): a step of block_m queries that is no multiple of 64 (WGMMA's M) then
  // still has one dQ atom per WG. dS goes to shared memory keys-contiguous (the B operand).
  bool dq_transposed = false;
  // dV issued after dS was computed and stored (FA3's order) instead of before, its GEMM under the
  // dS arithmetic: the fp32 P, dP and the 16-bit P are then never live together
  // (schedule.h bwd_step).
  bool dv_after_ds = false;
  // The tile serves calls with softcap: its steps are compiled in both codes (schedule.h). The
  // unmasked tile does not (launch.h bwd_takes_unmasked_tile): its kernel has the uncapped
  // steps only.
  bool serves_softcap = true;
};

// Whether the bucket has an FA-3 backward tile (CMake builds fa3 backward TUs for these only).
constexpr bool has_bwd_config(int head_dim) { return head_dim <= 256; }

constexpr BwdConfig bwd_config(int head_dim) {
  // d64: 128-query steps (FA3's d64 tile): a 64-query step is half of d128's GEMM work for the
  //   same per-step costs (barriers, waits, the dS store). S^T + dP^T 2 x 64 registers, dV + dK
  //   2 x 32, P + dS 2 x 32 (16-bit, dS computed from the 16-bit P), dQ 64 (128 rows x 64
  //   columns of the WG's partial). Shared memory: K, V 16 KB each, Q, dO 2 x 16 KB each, dS
  //   2 x 32 KB, dQ slots 2 x 32 KB = 224 KB.
  if (head_dim <= 64) {
    return {/*block_m=*/128, /*block_n=*/128, /*q_stages=*/2, /*dq_wgs=*/1, /*family_b=*/false,
            /*dq_slots=*/true, /*hold_wg_index=*/true};
  }
  // d96: dV + dK 2 x 48, dQ 48 (the WG's partial, n96; a column split would need n48, a width
  //   common/gmma_atoms.h does not have). Shared memory 128 KB + dQ slots 2 x 24 KB.
  if (head_dim <= 96) {
    return {/*block_m=*/64, /*block_n=*/128, /*q_stages=*/2, /*dq_wgs=*/1, /*family_b=*/false,
            /*dq_slots=*/true, /*hold_wg_index=*/true};
  }
  // d128: dV + dK 2 x 64 + S^T 32 + dP^T 32 = 192 live fp32 registers at the exponentials, then
  //   dV + dK + P + dS + dQ(64 x 64 per WG) = 128 + 16 + 16 + 32; the 240-register budget holds it
  //   (FA3's d128 tile is also 64 x 128). Shared memory: K, V 32 KB each, Q, dO 2 x 16 KB each,
  //   dS 2 x 16 KB, dQ slots 2 x 16 KB = 192 KB. dq_wgs = 1 (a 64-register partial dQ) fits 240
  //   registers only with dQ issued after dV completed, and measured slower than the lock step
  //   (bench/PERFLOG.md "Tried and reverted: d128 with per-WG partial dQ").
  if (head_dim <= 128) {
    return {/*block_m=*/64, /*block_n=*/128, /*q_stages=*/2, /*dq_wgs=*/2, /*family_b=*/false,
            /*dq_slots=*/true, /*hold_wg_index=*/false};
  }
  // d192 / d256 (family B): per WG dV + dK 2 x d / 4 registers (128 at d256), dQ d / 4 (64),
  //   S and dP 16 each (64 queries x 32 keys); dQ is only live after S and dP went to shared
  //   memory, so the peak is d256's 192 + 16. dQ from registers (no staging buffer) leaves room
  //   for 2 Q / dO stages even at d256: Q, dO 2 x 32 KB each, K, V 32 KB each, P, dS 8 KB each =
  //   208 KB (d192: 160 KB). FA3 takes 64 x 80 at d256 (dQ by atomics, one Q / dO stage) and
  //   64 x 96 with 3 WGs at d192; FA4 64 x 64 at d256 as here. dQ slots: d192 48 KB more (208
  //   KB); d256 would need 64 KB more than the 227 KB it has, so its dQ stays on red.global.
  return {/*block_m=*/64, /*block_n=*/64, /*q_stages=*/2, /*dq_wgs=*/2, /*family_b=*/true,
          /*dq_slots=*/head_dim <= 192, /*hold_wg_index=*/true};
}

// The deterministic kernel's tile (kernel_traits.h kDeterministic): the bucket's, except that d64
// splits dQ's rows over the WGs (dq_wgs = 2 with 128-query steps: each WG 64 rows x 64 columns
// over all 128 keys, FA3's and FA4's d64 dQ). With the default kernel's per-WG partials
// (dq_wgs = 1) the dQ writer would sum two 32 KB slots every step before its turn; the row split
// hands it two disjoint 16 KB halves and nothing to sum, for a CTA-wide PdS barrier per step
// (bench/PERFLOG.md "the deterministic d64 dQ by rows"). The default d64 kernel keeps its
// partials: the row split measured slower there, with the leader's reduce-add and with a writer.
constexpr BwdConfig bwd_config_deterministic(int head_dim) {
  BwdConfig c = bwd_config(head_dim);
  if (head_dim <= 64) {
    c.dq_wgs = 2;
  }
  return c;
}

// The unmasked tile (FA3's and FA4's d128 tile for calls without a mask or softcap): 80-query
// steps over the same 128 keys, a quarter more queries per step for the same per-step costs
// (waits, barriers, the dS store, the dQ handoff). S^T / dP^T are 64 keys x 80 queries per WG (40
// registers each), dV / dK take K = 80 from registers, dQ is computed transposed (dq_transposed:
// 80 is no multiple of WGMMA's M = 64), each WG half of head_dim over all 128 keys. Shared
// memory: K, V 32 KB each, Q, dO 2 x 20 KB each, dS 2 x 20 KB, dQ slots 2 x 20 KB = 224 KB.
// Served where the call has no mask (bwd_full_mask), no softcap and no varlen or deterministic
// mode (launch.h bwd_takes_unmasked_tile); its query blocks need the workspace's rows rounded
// for 80 (bwd_params.h bwd_rows_rounded).
constexpr bool has_bwd_unmasked_config(int head_dim) { return head_dim > 96 && head_dim <= 128; }

constexpr BwdConfig bwd_config_unmasked(int head_dim) {
  return {/*block_m=*/80, /*block_n=*/128, /*q_stages=*/2, /*dq_wgs=*/2, /*family_b=*/false,
          /*dq_slots=*/true, /*hold_wg_index=*/false, /*dq_transposed=*/true,
          /*dv_after_ds=*/true, /*serves_softcap=*/false};
}

}  // namespace flash_hopper::sm90
