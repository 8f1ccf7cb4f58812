// FA-3 path backward kernel (sm_90a): entry, shared memory, barrier setup, role dispatch.
//
// Pipeline contract (families A and B, tile_config.h; the kernel in prose: docs/bwd_sm90.md)
// -----------------
// Roles, T = 384 threads:
//   WG 0: all warps drop to RegisterBudget<2>::kProducer registers; warp 0 is the producer (one
//     elected lane issues every TMA load and bulk copy, load.h); in the deterministic kernel
//     warps 1 .. kDqWriterWarps are the dQ writer (mma.h BwdDqWriter, schedule.h write_dq_bwd;
//     three warps where they sum two slots, else one); the others exit.
//   WG 1, 2 = consumers c = 0, 1 (kConsumer registers). Family A: WG c owns keys [64c, 64c + 64)
//     of the tile for S^T, dP^T, dV and dK, and head_dim columns [c * D / 2, ...) of dQ (d128),
//     or the partial dQ of its own keys over all rows and columns (d64, d96; the deterministic
//     d64 kernel: rows [64c, 64c + 64) of dQ over all keys). Family B: WG c
//     computes S and dP for keys [32c, 32c + 32) and head_dim columns [c * D / 2, ...) of dV, dK
//     and dQ. Both walk every step of every tile in the same code
//     (mma.h).
// All roles walk one step schedule (schedule.h: BwdCtaSchedule -> BwdTileWork -> QueryStep;
// produce_bwd() and consume_bwd_wg() are the only places that order loads, waits, releases and
// dQ adds; tests/cpp/test_bwd_schedule.cpp simulates them against the barrier semantics).
// Pipelines (common/pipeline.h; mbarriers in SharedStorage, counts in PipelineSpec):
//   KV  1 stage: K and V of the tile on one full barrier (expect_tx 2 * kKVBytes); released by
//       each consumer WG after its last step's GEMMs completed (wait_gemms<0>).
//   Q   2 stages: Q rows and their lse_log2 (expect_tx kQBytes + kStatsBytes); released after the
//       step's dK GEMM, Q's last reader (lse_log2's, the exponentials, come before it).
//   dO  2 stages: dO rows and their D; released after the step's dV GEMM, dO's last reader (D's,
//       the dS arithmetic, comes before it).
//   The consumers read lse_log2 / D with (volatile) shared-memory loads after the stage's wait:
//   TMA writes, like Q's (compute-sanitizer's racecheck does not track the TMA's; a bulk copy or
//   the producer warp's own stores there were reported as races, it cannot pair an mbarrier with
//   them).
//   full[s]: 1 arrival (the producer's arrive_and_expect_tx; the TMA completes the bytes).
//   empty[s]: 2 arrivals, thread 0 of each consumer WG, after a barrier that orders the whole
//   WG's reads of the stage before it (PdS). Producers start every empty barrier at phase 1
//   (reported complete: buffers start free).
// Named barriers (mma.h BwdBarrier):
//   PdS     256: both consumer WGs after writing their dS^T half to sdS[step % 2] (+ proxy fence);
//           then the dQ GEMM reads both halves. Two dS buffers make it the only sync per step
//           in family A. Where each WG's dQ reads only its own half (dq_wgs = 1: default d64,
//           d96) it is the WG's own 128-thread sync (id Wg c), and the WGs share no barrier
//           within a step. With dQ slots the WG's leader first waits until its previous bulk
//           reduce-add read the WG's dQ slot (this sync frees the slot for the step's dQ).
//           Family B: after writing their halves of P and dS (one buffer each);
//           then dV, dK and dQ read both halves.
//   PdSFree 256, family B only: before writing P, both WGs completed the previous step's GEMMs
//           (wait_gemms<0>), the last readers of the single P and dS buffers.
//   DqTurn  256, the default kernels' deterministic flag (d256's deterministic mode): both WGs
//           wait for the block's semaphore (thread 0 spins), add and fence (dq_wgs = 1: WG 0,
//           sync, WG 1), sync again, thread 0 increments.
//   DqSlot c 128, WG c (dQ slots, default kernels; id Wg c): its threads stored the step's dQ
//           part into its dQ slot (+ proxy fence); then its leader issues one bulk reduce-add of
//           the slot.
//   DqStaged c 128 + 32 x the writer warps, the deterministic kernel: WG c (arrives, once its
//           part is in its slot and proxy-fenced, and WG 0's leader wrote the step's record) and
//           the dQ writer warps (sync); dq_free (an mbarrier, 1 arrival: the writer's lane 0, once
//           the step's reduce-adds read the slots) gives the slots back, and the WGs wait on it
//           before the next part.
//   DqWriters 96, the deterministic kernel with dq_wgs = 1 (id DqTurn's, which that kernel
//           does not use): the three writer warps summed the two slots (+ proxy fence) before
//           the writer's lane 0 issues the reduce-add.
//   TileSlot 288, the producer warp and both consumer WGs: the tile slot's buffer i % 2
//           (smem.tile) holds the producer's tile i, or the end of its walk; the consumers reach
//           it when done with tile i - 1, and read the buffer after it. Buffer i % 2 is written
//           again (tile i + 2) only after the next sync, which the consumers reach after the
//           read: syncs on both sides, so compute-sanitizer's racecheck sees the order. Not
//           .aligned (common/barriers.h): the roles meet it at different instructions.
// dQ goes from registers to the fp32 accumulator (the protocol, walked by the kernel and the host
// test: schedule.h add_dq, write_dq_bwd): through the WG's shared-memory slot and a bulk
// reduce-add by its leader (tile_config.h dq_slots; the leader waits for its last one to complete
// before the CTA exits), by the dQ writer warp in the block's turn on its semaphore (the
// deterministic kernel), or by red.global.add.v4.f32 (d256; the default kernels' deterministic
// flag: under the DqTurn handshake; epilogue.h).
// Tiles: the producer walks the CTA's tiles (static, or claimed from the workspace's tile counter:
// schedule.h) and publishes each one in the tile slot before its K / V load; the consumers take
// it from there. Tiles without queries load nothing and touch no pipeline: their consumers store
// dK = dV = 0.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/load.h"
#include "sm90/bwd/mma.h"
#include "sm90/common/barriers.h"
#include "sm90/common/pipeline.h"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "the FA-3 path needs sm_90a (setmaxnreg and WGMMA); compile with arch=compute_90a"
#endif

namespace flash_hopper::sm90 {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    bwd_kernel(CUTE_GRID_CONSTANT BwdKernelParams<Traits> const params) {
  using SharedStorage = typename Traits::SharedStorage;
  using Registers = typename Traits::Registers;
  extern __shared__ __align__(1024) char smem_buf[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_buf);

  using QPipe = typename Traits::QPipe;
  using KVPipe = typename Traits::KVPipe;
  static_assert(QPipe::kEmptyArrivals == Traits::kConsumerWgs &&
                KVPipe::kEmptyArrivals == Traits::kConsumerWgs);
  static_assert(QPipe::kFullArrivals == 1 && KVPipe::kFullArrivals == 1);
  static_assert(Traits::kThreads == 128 * (1 + Traits::kConsumerWgs));

  const int warp_idx = cutlass::canonical_warp_idx_sync();
  if (warp_idx == 0 && cute::elect_one_sync()) {
    prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_lse.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_dpsum.get_tma_descriptor());
    SmemBarriers<QPipe>{smem.q_full, smem.q_empty}.init();
    SmemBarriers<QPipe>{smem.do_full, smem.do_empty}.init();
    SmemBarriers<KVPipe>{smem.kv_full, smem.kv_empty}.init();
    if constexpr (Traits::kDeterministic) {
      smem.dq_free[0].init(1);  // the dQ writer's lane 0, once per step
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const int warp_group = cutlass::canonical_warp_group_idx();
  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Registers::kProducer>();
    if (warp_idx == 0) {
      bwd_producer_loop<Traits>(params, smem);
    } else if constexpr (Traits::kDeterministic) {
      if (warp_idx <= Traits::kDqWriterWarps) {
        bwd_dq_writer_loop<Traits>(smem);
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Registers::kConsumer>();
    bwd_consumer_loop<Traits>(params, smem);
  }
}

}  // namespace flash_hopper::sm90
