// The FP8 forward's V transposer: warps 1-3 of the producer warpgroup turn each V stage (keys x
// head_dim, as the TMA loaded it) into V^T (head_dim x keys, K-major), the B operand layout FP8
// WGMMA requires for the PV GEMM. In shared memory only: user memory is read once, by the TMA.
//
// Key order: V^T holds the keys of each 32-key slice in the order of the P register fragment
// (fp8_layout.h, key_of_slot), so P is packed without moving values between threads.
//
// Work unit: 64 keys (two slices) x 32 columns per warp; four iterations of one 4 x 4 byte block
// per lane: 4 LDS.32 (4 keys x 4 columns), 8 PRMT, 4 STS.32 (4 columns x 4 slots). The lane ->
// (slot group, column group) map below makes every LDS and STS of a warp hit 32 distinct banks
// under the 128-byte swizzle of both buffers (d128 / d256; 2-way under the 64-byte rows of d64's
// V and, at N = 64, V^T), checked by tests/cpp/test_fp8_layout.cpp against the same layouts.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/barriers.h"
#include "sm90/fp8_layout.h"
#include "sm90/params.h"
#include "sm90/pipeline.h"
#include "sm90/schedule.h"

namespace flash_hopper::sm90 {

using namespace cute;

// 4 x 4 byte transposition: out[j] byte i = in[i] byte j.
CUTE_DEVICE void transpose_4x4_bytes(uint32_t const (&in)[4], uint32_t (&out)[4]) {
  const uint32_t ab_lo = __byte_perm(in[0], in[1], 0x5140);  // a0 b0 a1 b1
  const uint32_t ab_hi = __byte_perm(in[0], in[1], 0x7362);  // a2 b2 a3 b3
  const uint32_t cd_lo = __byte_perm(in[2], in[3], 0x5140);
  const uint32_t cd_hi = __byte_perm(in[2], in[3], 0x7362);
  out[0] = __byte_perm(ab_lo, cd_lo, 0x5410);  // a0 b0 c0 d0
  out[1] = __byte_perm(ab_lo, cd_lo, 0x7632);  // a1 b1 c1 d1
  out[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
  out[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

template <class Traits>
struct Transposer {
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kUnitsN = kBlockN / 64;
  static constexpr int kUnits = kUnitsN * (kHeadDim / 32);
  static constexpr int kBatch = Traits::Registers::kProducer >= 40 ? 4 : 2;
  using SharedStorage = typename Traits::SharedStorage;
  using VPipe = typename Traits::VPipe;
  using VtPipe = typename Traits::VtPipe;
  SharedStorage& smem;
  int warp;  // 0 .. kTransposerWarps - 1
  ConsumerEnd<VPipe, SmemBarriers<VPipe>> v_pipe;
  WriterEnd<VtPipe, SmemBarriers<VtPipe>> vt_pipe;

  CUTE_DEVICE Transposer(SharedStorage& smem_, int warp_)
      : smem(smem_),
        warp(warp_),
        v_pipe{{smem_.v_full, smem_.v_empty}},
        vt_pipe{{smem_.fp8.vt_full, smem_.fp8.vt_empty}} {}

  static CUTE_DEVICE uint32_t lds32(uint32_t addr) {
    uint32_t x;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x) : "r"(addr) : "memory");
    return x;
  }
  static CUTE_DEVICE void sts32(uint32_t addr, uint32_t x) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(x) : "memory");
  }

  // Byte offset of a coordinate in a swizzled shared-memory layout (1-byte elements: element
  // offsets are byte offsets). The layouts are ComposedLayout<Swizzle, smem_ptr_flag, Layout>
  // (tile_to_shape of a GMMA atom); the swizzle acts on offsets from the 1024-byte aligned base.
  // Unsigned coordinates: the layout's divisions become shifts.
  template <class ComposedLayout>
  static CUTE_DEVICE uint32_t offset(ComposedLayout const& layout, int row, int col, int stage) {
    return layout.layout_a()(layout.layout_b()(uint32_t(row), uint32_t(col), uint32_t(stage)));
  }

  // V(step) -> V^T, in the order the producer loads V and the consumers use V^T. Addresses are
  // 32-bit shared-window offsets (generic 64-bit pointers cost ~40 instructions per access).
  CUTE_DEVICE void v(TileWork const&, KeyStep) {
    v_pipe.wait();
    vt_pipe.acquire();
    const uint32_t v_base = cast_smem_ptr_to_uint(smem.v.data());
    const uint32_t vt_base = cast_smem_ptr_to_uint(smem.fp8.vt.data());
    constexpr typename Traits::SmemLayoutV layout_v{};    // (N, D, PIPE)
    constexpr typename Traits::SmemLayoutVt layout_vt{};  // (D, N, PIPE)
    const int v_stage = v_pipe.stage();
    const int vt_stage = vt_pipe.stage();
    const int lane = threadIdx.x % 32;
    CUTE_NO_UNROLL
    for (int unit = warp; unit < kUnits; unit += kTransposerWarps) {
      const int n0 = (unit % kUnitsN) * 64;
      const int d0 = (unit / kUnitsN) * 32;
      // The loads of kBatch 4 x 4 blocks first (in flight together), then their transpositions
      // and stores: all four blocks at the 40 registers of a 2-WG producer, two at 32 (3 WGs).
      CUTE_UNROLL
      for (int m0 = 0; m0 < 4; m0 += kBatch) {
        uint32_t in[kBatch][4];
        CUTE_UNROLL
        for (int mm = 0; mm < kBatch; ++mm) {
          const TransposeLane l = transpose_lane(lane, m0 + mm);
          const int slot = n0 + 4 * l.u;  // 4 slots of one 32-key slice
          const int col = d0 + 4 * l.q;
          CUTE_UNROLL
          for (int i = 0; i < 4; ++i) {
            const int key = (slot & ~31) + key_of_slot((slot & 31) + i);
            in[mm][i] = lds32(v_base + offset(layout_v, key, col, v_stage));
          }
        }
        CUTE_UNROLL
        for (int mm = 0; mm < kBatch; ++mm) {
          const TransposeLane l = transpose_lane(lane, m0 + mm);
          const int slot = n0 + 4 * l.u;
          const int col = d0 + 4 * l.q;
          uint32_t out[4];
          transpose_4x4_bytes(in[mm], out);
          CUTE_UNROLL
          for (int j = 0; j < 4; ++j) {
            sts32(vt_base + offset(layout_vt, col + j, slot, vt_stage), out[j]);
          }
        }
      }
    }
    // The stores are read by WGMMA (the async proxy): fence them before the barrier publishes them.
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    const bool leader = threadIdx.x % 32 == 0;
    v_pipe.release(leader);
    vt_pipe.commit(leader);
  }
};

// The transposer walks the tiles with keys and their steps in the producer's V order.
template <class Schedule, class Ops>
FH_ROLE void transpose_v(Schedule const& sched, Ops& ops) {
  TileWork w;
  FH_NO_UNROLL
  for (int round = 0; sched.next_with_keys(round, w, [](TileWork const&) {}); ++round) {
    FH_NO_UNROLL
    for (int i = 0; i < w.num_steps(); ++i) {
      ops.v(w, w.step(i));
    }
  }
}

template <class Traits>
CUTE_DEVICE void transposer_loop(KernelParams<Traits> const& params,
                                 typename Traits::SharedStorage& smem, int warp) {
  Transposer<Traits> transposer(smem, warp);
  transpose_v(cta_schedule(params), transposer);
}

}  // namespace flash_hopper::sm90
