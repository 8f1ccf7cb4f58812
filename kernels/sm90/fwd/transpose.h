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
//
// Straight-line code: TransposerPlan (fp8_layout.h) gives each warp a fixed run of units, and each
// warp runs an instantiation of its own (Transposer<Traits, kWarp>, picked once per kernel), so
// every unit's offsets are compile-time constants. A lane's addresses in V and V^T are computed
// once (the swizzled row it gives ldmatrix / stmatrix); a unit XORs in its 16-byte chunk within
// the swizzled row (one LOP3, shared by the units of a run with the same chunk) and adds the rest
// as the instruction's immediate offset. The loads run kLoadsInFlight ahead of the permutes and
// stores. (It replaces a loop over units that recomputed every address through CuTe's layout
// functions: bench/PERFLOG.md "FP8 transposer, straight-line".)
// tests/cpp/test_fp8_layout.cpp checks the plan's addresses against the kernel's CuTe layouts
// (transposer_plan_matches below checks a sample at compile time), simulates both instructions on
// them and counts their bank wavefronts.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/common/barriers.h"
#include "sm90/common/pipeline.h"
#include "sm90/common/utils.h"
#include "sm90/fwd/fp8_layout.h"
#include "sm90/fwd/params.h"
#include "sm90/fwd/schedule.h"
#include "sm90/fwd/tile_slot.h"
#include "sm90/fwd/timeline.h"

namespace flash_hopper::sm90 {

using namespace cute;

// TransposerPlan's composed addresses against the kernel's CuTe layouts (1-byte elements: offsets
// are bytes), at compile time: every unit and stage, the lanes of one swizzle period (rows 0-7)
// and the last (the compiler's constexpr budget; tests/cpp/test_fp8_layout.cpp compares every
// lane).
template <class Traits>
constexpr bool transposer_plan_matches() {
  constexpr typename Traits::SmemLayoutV layout_v{};    // (N, D, PIPE)
  constexpr typename Traits::SmemLayoutVt layout_vt{};  // (D, N, PIPE)
  constexpr TransposerPlan plan{Traits::kBlockN, Traits::kHeadDim, kTransposerWarps};
  constexpr int kLanes[] = {0, 1, 2, 3, 4, 5, 6, 7, 31};
  for (int stage = 0; stage < Traits::kStages; ++stage) {
    const int v_stage = stage % Traits::kVStages;  // V may have fewer stages than V^T
    for (int u = 0; u < plan.units(); ++u) {
      const TransposerPlan::Unit unit = plan.unit(u);
      const UnitAddr a = plan.addr(u);
      for (int lane : kLanes) {
        const StsmRow row = stsm_row(lane);
        const uint32_t ld = layout_v.layout_a()(layout_v.layout_b()(
            uint32_t(unit.n0 + lane), uint32_t(unit.d0), uint32_t(v_stage)));
        const uint32_t st = layout_vt.layout_a()(layout_vt.layout_b()(
            uint32_t(unit.d0 + row.col), uint32_t(unit.n0 + row.slot), uint32_t(stage)));
        if (a.ld.at(v_stage * plan.v.stage_bytes(), plan.ld_lane(lane)) != ld ||
            a.st.at(stage * plan.vt.stage_bytes(), plan.st_lane(lane)) != st) {
          return false;
        }
      }
    }
  }
  return true;
}

// Warp kWarp of the transposer warps (0 .. kTransposerWarps - 1): its own instantiation, so its
// units are compile-time constants.
template <class Traits, int kWarp>
struct Transposer {
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  using SharedStorage = typename Traits::SharedStorage;
  using VPipe = typename Traits::VPipe;
  using VtPipe = typename Traits::VtPipe;
  static CUTE_HOST_DEVICE constexpr TransposerPlan plan() {
    return {kBlockN, kHeadDim, kTransposerWarps};
  }
  static_assert(transposer_plan_matches<Traits>(),
                "TransposerPlan's addresses differ from the kernel's V / V^T layouts");
  static_assert(plan().v.stage_bytes() % 1024 == 0 && plan().vt.stage_bytes() % 1024 == 0,
                "a stage's address must keep the lane's swizzled bits (st_addr below)");
  // ldmatrix issued ahead of the permutes and stores, 4 registers each, within the producer
  // warpgroup's setmaxnreg budget (tile_config.h RegisterBudget) next to the lane's addresses,
  // selectors and the schedule's state. The varlen kernels at 24 registers keep more schedule
  // state live: there ptxas serialized the two loads anyway and spilled (d128), so they load one
  // unit at a time.
  static constexpr int kLoadsInFlight =
      Traits::kVarlen && Traits::Registers::kProducer < 32 ? 1 : 2;

  SharedStorage& smem;
  // Where V and V^T have the same depth they advance together (a V^T buffer per V buffer): V^T's
  // writer state is V's consumer state with the parity flipped (a writer starts on parity 1,
  // pipeline.h), so one state serves both and holds one phase register, not two. With fewer V
  // stages (Traits::kVStages) V^T keeps a state of its own.
  static constexpr bool kSharedState = VPipe::kStages == VtPipe::kStages;
  ConsumerEnd<VPipe, SmemBarriers<VPipe>> v_pipe;
  SmemBarriers<VtPipe> vt_bar;
  conditional_t<kSharedState, EmptyStorage, PipelineState<VtPipe::kStages>> vt_state;
  TileSlotReader<Traits> slot;  // the producer's tiles (tile_slot.h)
  Timeline timeline;  // FH_TIMELINE builds only (timeline.h)
  // Per lane: its ldmatrix row in V's stage 0 (TransposerPlan::ld_lane; ldmatrix adds the
  // stage's address from a uniform register), its stmatrix row in V^T's current stage as a
  // shared-window address (st_lane + the stage's address: stmatrix has no uniform-register
  // operand, so the address moves with the stage instead, one add per tile), and register m's
  // byte permute: the odd column where stsm_odd_column(lane, m), else the even. The buffers'
  // stages start at multiples of 1024 bytes (the swizzle's period; kernel_traits.h aligns them),
  // so a stage's address keeps the lane's swizzled bits and the units' XORs apply unchanged.
  uint32_t ld_lane, st_addr, sel_m_even, sel_m_odd;

  CUTE_DEVICE Transposer(SharedStorage& smem_, unsigned long long* timeline_buffer)
      : smem(smem_),
        v_pipe{{smem_.v_full, smem_.v_empty}},
        vt_bar{smem_.fp8.vt_full, smem_.fp8.vt_empty},
        timeline(timeline_buffer) {
    const int lane = threadIdx.x % 32;
    ld_lane = plan().ld_lane(lane);
    st_addr = cast_smem_ptr_to_uint(smem.fp8.vt.data()) + plan().st_lane(lane);
    sel_m_even = stsm_odd_column(lane, 0) ? kPermOdd : kPermEven;
    sel_m_odd = stsm_odd_column(lane, 1) ? kPermOdd : kPermEven;
    if constexpr (!kSharedState) {
      vt_state = {0, 1};  // a writer starts on parity 1 (pipeline.h)
    }
  }

  static CUTE_DEVICE void ldsm_t_x4(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
  }

  CUTE_DEVICE int take_tile() { return slot.take(smem); }

  // V(step) -> V^T, in the order the producer loads V and the consumers use V^T. Addresses are
  // 32-bit shared-window offsets (generic 64-bit pointers cost ~40 instructions per access).
  CUTE_DEVICE auto vt_writer() const {
    if constexpr (kSharedState) {
      return WriterEnd<VtPipe, SmemBarriers<VtPipe>>{vt_bar,
                                                     {v_pipe.state.index, v_pipe.state.phase ^ 1}};
    } else {
      return WriterEnd<VtPipe, SmemBarriers<VtPipe>>{vt_bar, vt_state};
    }
  }

  CUTE_DEVICE void v(TileWork const& w, KeyStep step) {
    WriterEnd<VtPipe, SmemBarriers<VtPipe>> vt_pipe = vt_writer();
    v_pipe.wait();
    timeline.mark(Ev::kTrVReady);
    vt_pipe.acquire();
    timeline.mark(Ev::kTrVtFree);
    const int stage = v_pipe.stage();
    const int vt_stage = vt_pipe.stage();
    const uint32_t v_stage = cast_smem_ptr_to_uint(smem.v.data()) + stage * plan().v.stage_bytes();
    // Opaque per V tile: the units' XORed addresses are derived inside the tile, not hoisted out
    // of the tile loops where they would hold a register each for the warp's lifetime.
    uint32_t ld = ld_lane, st = st_addr;
    asm volatile("" : "+r"(ld), "+r"(st));
    // Varlen: the keys of a sequence's tail block past the sequence hold the next sequence's
    // tokens (or padding past seqused_k); P is 0 there, but 0 * NaN is NaN, so their V rows
    // are zeroed before the transposition.
    const int valid = Traits::kVarlen && v_zero_tail(w.tile, step.n, kBlockN)
                          ? w.tile.seqlen_k - step.n * kBlockN
                          : kBlockN;
    units(v_stage, ld, st, valid);
    // The stores are read by WGMMA (the async proxy): fence them before the barrier publishes them.
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    // One lane per warp arrives (kTransposerWarps arrivals); which one does not matter.
    const bool leader = cute::elect_one_sync();
    v_pipe.release(leader);
    vt_pipe.commit(leader);
    if constexpr (kSharedState) {
      st_addr += (v_pipe.stage() - stage) * int(plan().vt.stage_bytes());
    } else {
      vt_state = vt_pipe.state;
      st_addr += (vt_pipe.stage() - vt_stage) * int(plan().vt.stage_bytes());
    }
    timeline.mark(Ev::kTrDone);
  }

  // The warp's units of one V tile (TransposerPlan::first / count), straight-line.
  CUTE_DEVICE void units(uint32_t v_stage, uint32_t ld, uint32_t st, int valid) {
    constexpr int kFirst = plan().first(kWarp);
    constexpr int kCount = plan().count(kWarp);
    if constexpr (Traits::kVarlen) {
      // Each lane zeroes its own ldmatrix row (16 bytes of key n0 + lane) of each unit past the
      // sequence, before the warp's loads.
      if (valid < kBlockN) {
        const int lane = threadIdx.x % 32;
        for_each(make_int_sequence<kCount>{}, [&](auto i) {
          constexpr int kUnit = kFirst + decltype(i)::value;
          if (plan().unit(kUnit).n0 + lane >= valid) {
            asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" ::"r"(
                             plan().addr(kUnit).ld.at(v_stage, ld)),
                         "r"(0)
                         : "memory");
          }
        });
        __syncwarp();
      }
    }
    uint32_t r[kCount][4];
    auto load = [&](auto i) {
      constexpr UnitAddr kAddr = plan().addr(kFirst + decltype(i)::value);
      ldsm_t_x4(kAddr.ld.at(v_stage, ld), r[decltype(i)::value]);
    };
    for_each(make_int_sequence<kCount>{}, [&](auto i) {
      constexpr int kI = decltype(i)::value;
      if constexpr (kI < kLoadsInFlight) {
        load(i);
      }
    });
    for_each(make_int_sequence<kCount>{}, [&](auto i) {
      constexpr int kI = decltype(i)::value;
      constexpr UnitAddr kAddr = plan().addr(kFirst + kI);
      stmatrix_x4(kAddr.st.at(/*base=*/0, st), __byte_perm(r[kI][0], r[kI][1], sel_m_even),
                  __byte_perm(r[kI][0], r[kI][1], sel_m_odd),
                  __byte_perm(r[kI][2], r[kI][3], sel_m_even),
                  __byte_perm(r[kI][2], r[kI][3], sel_m_odd));
      if constexpr (kI + kLoadsInFlight < kCount) {
        load(Int<kI + kLoadsInFlight>{});
      }
    });
  }
};

// Warp `warp`'s instantiation (an if-else chain: no warp index stays live through a loop).
template <class Traits, int kWarp>
CUTE_DEVICE void transposer_warp(KernelParams<Traits> const& params,
                                 typename Traits::SharedStorage& smem, int warp) {
  if constexpr (kWarp + 1 < kTransposerWarps) {
    if (warp != kWarp) {
      transposer_warp<Traits, kWarp + 1>(params, smem, warp);
      return;
    }
  }
  Transposer<Traits, kWarp> transposer(smem, params.fwd.timeline);
  transpose_v(cta_schedule(params), transposer);
}

template <class Traits>
CUTE_DEVICE void transposer_loop(KernelParams<Traits> const& params,
                                 typename Traits::SharedStorage& smem, int warp) {
  transposer_warp<Traits, 0>(params, smem, warp);
}

}  // namespace flash_hopper::sm90
