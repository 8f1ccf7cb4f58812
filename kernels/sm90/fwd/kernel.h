// FA-3 path forward kernel (sm_90a): entry, shared memory, barrier setup, role dispatch.
//
// Pipeline contract
// -----------------
// Roles, T = 128 * (1 + W) threads, W consumer warpgroups (tile_config.h; a bucket may have a
// second tile for short masked calls, chosen per call in launch.h, same contract):
//   WG 0, producer: all four warps drop to RegisterBudget::kProducer registers; warp 0 walks the
//     step schedule and one elected lane issues every TMA load (load.h). Warps 1-3 exit, except
//     for FP8 inputs: they transpose each V stage into V^T (transpose.h), and in mixed mode
//     (16-bit q, FP8 K / V): they convert the FP8 staging ring's K / V blocks into the K / V
//     stages (convert.h). Varlen calls of the 16-bit kernels: warp 1 zeroes the rows past the
//     sequence in each sequence's tail V block (vtail.h).
//   WG 1..W, consumers: grow to RegisterBudget::kConsumer registers; WG c computes query rows
//     [64c, 64c + 64) of each tile (mma.h) and writes O and LSE (epilogue.h).
// Both roles walk one step schedule (schedule.h: CtaSchedule -> TileWork -> KeyStep; produce() and
// consume() are the only places that order loads, waits and releases; the transposer warps walk
// transpose_v() there too; tests/cpp/test_fwd_schedule.cpp simulates all roles against the barrier
// semantics, the relays and both CTAs of a multicast cluster included).
// Pipelines (common/pipeline.h; mbarriers in SharedStorage, counts in PipelineSpec):
//   Q   QS buffers, one load per tile with keys (expect_tx kQBytes), round-robin; released by each
//       consumer WG once the tile's last QK GEMM completed. With QS = 2 the next tile's Q loads
//       while the current tile computes.
//   K   S stages, one load per key block (expect_tx kKVBytes); released after the block's QK GEMM.
//   V   S stages, one load per key block; released after the block's PV GEMM. With overlap the
//       consumers use V one step after K, so the producer issues V(step i - 1) after K(step i).
//       FP8: the producer issues V(step i) right after K(step i) (no lag: the transposition
//       needs the step), V is released by the transposer warps (kTransposerWarps arrivals) once
//       they read it, and V^T (S stages, vt_full: one arrival per transposer warp after its stores and a
//       proxy fence; vt_empty: W arrivals) takes V's place between them and the consumers.
//   full[s]: 1 arrival (the producer's arrive_and_expect_tx; the TMA completes the bytes).
//   empty[s]: W arrivals, thread 0 of each consumer WG.
//   Mixed mode: the producer's K / V loads go into a ring of FP8 staging stages (full: its
//   arrive_and_expect_tx; empty: one arrival per converter warp), K and V blocks taking the
//   ring's stages in the load order; the converter warps fill the K / V stages, so K / V full
//   barriers count one arrival per converter warp (after its stores and a proxy fence), no bytes.
//   Producers start every empty barrier at phase 1 (reported complete: buffers start free).
//   Tile slot (tile_slot.h): 2 buffers of the producer's walk, one tile index each; the producer
//       publishes every tile (keyless ones and the end of the walk too) before its loads;
//       full: the producer's one arrival; empty: one arrival per reading thread (the consumer
//       warpgroups and the relay warps, Traits::TilePipe). The other roles learn their tiles
//       only from it.
// Named barriers (barriers.h):
//   OStage c     128: WG c's O staging slab written / read (epilogue.h)
//   PingPong c   256: WG c syncs before issuing its GEMMs, WG c - 1 arrives after issuing its
//                own; WG 0 arrives once at start (order WG 0, 1, .., W-1, 0, ...).
// Tiles without a visible key touch no pipeline but the tile slot.
// K / V multicast (Traits::kClusterM = 2, the kMulticast tile of unmasked calls): the two CTAs of
// a cluster walk the same tile pairs (query blocks 2j and 2j + 1 of one head; a pair past the
// last block still runs, its rows neither loaded nor stored) and so the same key blocks. Each
// producer loads half of every K / V block into both CTAs' stages (the full barrier of each CTA
// expects the whole block), and each consumer warpgroup releases a stage on both CTAs' empty
// barriers (2W arrivals): a stage is refilled only once both CTAs are done with it. The CTAs sync
// as a cluster after the barrier setup and before exiting.
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "sm90/common/barriers.h"
#include "sm90/common/pipeline.h"
#include "sm90/fwd/convert.h"
#include "sm90/fwd/kernel_traits.h"
#include "sm90/fwd/load.h"
#include "sm90/fwd/mma.h"
#include "sm90/fwd/params.h"
#include "sm90/fwd/transpose.h"
#include "sm90/fwd/vtail.h"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "the FA-3 path needs sm_90a (setmaxnreg and WGMMA); compile with arch=compute_90a"
#endif

namespace flash_hopper::sm90 {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_kernel(CUTE_GRID_CONSTANT KernelParams<Traits> const params) {
  using SharedStorage = typename Traits::SharedStorage;
  using Registers = typename Traits::Registers;
  extern __shared__ __align__(1024) char smem_buf[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_buf);

  using QPipe = typename Traits::QPipe;
  using KVPipe = typename Traits::KVPipe;
  // Every empty barrier counts one arrival per consumer warpgroup (Consumer::wg_leader), every
  // full barrier the producer's one arrive_and_expect_tx.
  using VPipe = typename Traits::VPipe;
  static_assert(QPipe::kEmptyArrivals == Traits::kConsumerWgs &&
                KVPipe::kEmptyArrivals == Traits::kConsumerWgs * Traits::kClusterM);
  static_assert(QPipe::kFullArrivals == 1 &&
                KVPipe::kFullArrivals == (Traits::kMixed ? kConverterWarps : 1) &&
                VPipe::kFullArrivals == KVPipe::kFullArrivals);
  static_assert(VPipe::kEmptyArrivals ==
                (Traits::kFp8 ? kTransposerWarps : Traits::kConsumerWgs * Traits::kClusterM));
  static_assert(QPipe::kStages == Traits::kQStages && KVPipe::kStages == Traits::kStages);
  static_assert(Traits::kThreads == 128 * (1 + Traits::kConsumerWgs));

  const int warp_idx = cutlass::canonical_warp_idx_sync();
  if (warp_idx == 0 && cute::elect_one_sync()) {
    prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    SmemBarriers<QPipe>{smem.q_full, smem.q_empty}.init();
    SmemBarriers<KVPipe>{smem.k_full, smem.k_empty}.init();
    SmemBarriers<VPipe>{smem.v_full, smem.v_empty}.init();
    SmemBarriers<typename Traits::TilePipe>{smem.tile_full, smem.tile_empty}.init();
    CUTE_UNROLL
    for (int s = 0; s < KVPipe::kStages; ++s) {
      smem.v_landed[s].init(1);  // the producer's arrive_and_expect_tx (varlen tails, vtail.h)
    }
    if constexpr (Traits::kFp8) {
      using VtPipe = typename Traits::VtPipe;
      static_assert(VtPipe::kFullArrivals == kTransposerWarps &&
                    VtPipe::kEmptyArrivals == Traits::kConsumerWgs);
      SmemBarriers<VtPipe>{smem.fp8.vt_full, smem.fp8.vt_empty}.init();
    }
    if constexpr (Traits::kMixed) {
      using StagingPipe = typename Traits::StagingPipe;
      static_assert(StagingPipe::kFullArrivals == 1 &&
                    StagingPipe::kEmptyArrivals == kConverterWarps);
      SmemBarriers<StagingPipe>{smem.staging.full, smem.staging.empty}.init();
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (Traits::kClusterM > 1) {
    // The peers' loads and releases reach this CTA's barriers: all initialized first.
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  } else {
    __syncthreads();
  }
  if constexpr (Traits::kVarlen) {
    // Launched while the prepare kernel runs (programmatic dependent launch, launch.h): its
    // tile list is complete and visible past this wait, before any role reads it.
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }

  const int warp_group = cutlass::canonical_warp_group_idx();
  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Registers::kProducer>();
    if (warp_idx == 0) {
      producer_loop<Traits>(params, smem);
    } else if constexpr (Traits::kFp8) {
      transposer_loop<Traits>(params, smem, warp_idx - 1);
    } else if constexpr (Traits::kMixed) {
      converter_loop<Traits>(params, smem, warp_idx - 1);
    } else if constexpr (Traits::kVarlen) {
      if (warp_idx == 1) {
        vtail_loop<Traits>(params, smem);
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Registers::kConsumer>();
    consumer_loop<Traits>(params, smem);  // warp group 1 + c is consumer c
  }
  if constexpr (Traits::kClusterM > 1) {
    // The consumers' last releases arrive on the peers' barriers, and the peers' on this CTA's:
    // no CTA of the cluster exits (its shared memory going away) before every one got here.
    cute::cluster_arrive();
    cute::cluster_wait();
  }
}

}  // namespace flash_hopper::sm90
