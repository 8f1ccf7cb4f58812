// The FP8 forward's V transposer: warps 1-3 of the producer warpgroup turn each V stage (keys x
// head_dim, as the TMA loaded it) into V^T (head_dim x keys, K-major), the B operand layout FP8
// WGMMA requires for the PV GEMM. In shared memory only: user memory is read once, by the TMA.
//
// Key order: V^T holds the keys of each 32-key slice in the order of the P register fragment
// (fp8_layout.h, key_of_slot), so P is packed without moving values between threads.
//
// Work unit (fp8_layout.h): 32 keys x 16 columns, 512 bytes per warp in one ldmatrix.trans (.x4,
// b16: each lane gets two columns of two keys), four byte permutes and one stmatrix (.x4). The byte
// permutes complete the b16 transposition to bytes and leave the keys in key_of_slot's order as
// they are: keys 2q + {0, 1, 8, 9} of a 16-key half are what one lane holds. (The first version
// moved 4 x 4 byte blocks with 32-bit loads and stores: 4x the shared-memory instructions and an
// address computation per 4 bytes; it bounded d256 far below a diagnostic kernel with the
// transposition skipped, bench/PERFLOG.md "FP8 d256, and a transposer".)
// tests/cpp/test_fp8_layout.cpp simulates both instructions on the kernel's swizzled layouts and
// counts their bank wavefronts.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/common/barriers.h"
#include "sm90/common/pipeline.h"
#include "sm90/common/utils.h"
#include "sm90/fwd/fp8_layout.h"
#include "sm90/fwd/params.h"
#include "sm90/fwd/schedule.h"
#include "sm90/fwd/timeline.h"

namespace flash_hopper::sm90 {

using namespace cute;

template <class Traits>
struct Transposer {
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kSlices = kBlockN / 32;
  static constexpr int kUnits = kSlices * (kHeadDim / 16);
  using SharedStorage = typename Traits::SharedStorage;
  using VPipe = typename Traits::VPipe;
  using VtPipe = typename Traits::VtPipe;
  SharedStorage& smem;
  int warp;  // 0 .. kTransposerWarps - 1
  ConsumerEnd<VPipe, SmemBarriers<VPipe>> v_pipe;
  WriterEnd<VtPipe, SmemBarriers<VtPipe>> vt_pipe;
  Timeline timeline;  // FH_TIMELINE builds only (timeline.h)

  CUTE_DEVICE Transposer(SharedStorage& smem_, int warp_, unsigned long long* timeline_buffer)
      : smem(smem_),
        warp(warp_),
        v_pipe{{smem_.v_full, smem_.v_empty}},
        vt_pipe{{smem_.fp8.vt_full, smem_.fp8.vt_empty}},
        timeline(timeline_buffer) {}

  static CUTE_DEVICE void ldsm_t_x4(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
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
  CUTE_DEVICE void v(TileWork const& w, KeyStep step) {
    v_pipe.wait();
    timeline.mark(Ev::kTrVReady);
    vt_pipe.acquire();
    timeline.mark(Ev::kTrVtFree);
    const uint32_t v_base = cast_smem_ptr_to_uint(smem.v.data());
    const uint32_t vt_base = cast_smem_ptr_to_uint(smem.fp8.vt.data());
    constexpr typename Traits::SmemLayoutV layout_v{};    // (N, D, PIPE)
    constexpr typename Traits::SmemLayoutVt layout_vt{};  // (D, N, PIPE)
    const int v_stage = v_pipe.stage();
    const int vt_stage = vt_pipe.stage();
    const int lane = threadIdx.x % 32;
    const StsmRow st = stsm_row(lane);
    // Register m's byte permute: the odd column where stsm_odd_column(lane, m), else the even.
    const uint32_t sel_m_even = stsm_odd_column(lane, 0) ? kPermOdd : kPermEven;
    const uint32_t sel_m_odd = stsm_odd_column(lane, 1) ? kPermOdd : kPermEven;
    // Varlen: the keys of a sequence's tail block past the sequence hold the next sequence's
    // tokens (or padding past seqused_k); P is 0 there, but 0 * NaN is NaN, so their V rows
    // are zeroed before the transposition. Each lane addresses its own row's 16 bytes of the
    // unit (ldmatrix: one row per lane), so it zeroes them itself, before the warp's load.
    const int valid = Traits::kVarlen && v_zero_tail(w.tile, step.n, kBlockN)
                          ? w.tile.seqlen_k - step.n * kBlockN
                          : kBlockN;
    CUTE_NO_UNROLL
    for (int unit = warp; unit < kUnits; unit += kTransposerWarps) {
      const int n0 = (unit % kSlices) * 32;
      const int d0 = (unit / kSlices) * 16;
      const uint32_t row_addr = v_base + offset(layout_v, n0 + lane, d0, v_stage);
      if constexpr (Traits::kVarlen) {
        if (n0 + lane >= valid) {
          asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" ::"r"(row_addr), "r"(0)
                       : "memory");
        }
        __syncwarp();
      }
      uint32_t r[4];
      ldsm_t_x4(row_addr, r);
      const uint32_t out[4] = {
          __byte_perm(r[0], r[1], sel_m_even), __byte_perm(r[0], r[1], sel_m_odd),
          __byte_perm(r[2], r[3], sel_m_even), __byte_perm(r[2], r[3], sel_m_odd)};
      stmatrix_x4(vt_base + offset(layout_vt, d0 + st.col, n0 + st.slot, vt_stage), out[0],
                  out[1], out[2], out[3]);
    }
    // The stores are read by WGMMA (the async proxy): fence them before the barrier publishes them.
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    const bool leader = threadIdx.x % 32 == 0;
    v_pipe.release(leader);
    vt_pipe.commit(leader);
    timeline.mark(Ev::kTrDone);
  }
};

template <class Traits>
CUTE_DEVICE void transposer_loop(KernelParams<Traits> const& params,
                                 typename Traits::SharedStorage& smem, int warp) {
  Transposer<Traits> transposer(smem, warp, params.fwd.timeline);
  transpose_v(cta_schedule(params), transposer);
}

}  // namespace flash_hopper::sm90
