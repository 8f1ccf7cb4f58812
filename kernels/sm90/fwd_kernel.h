// FA-3 path forward kernel (sm_90a): entry, shared memory, barrier setup, role dispatch.
//
// Pipeline contract
// -----------------
// Roles, T = 128 * (1 + W) threads, W consumer warpgroups (tile_config.h; a bucket may have a
// second tile for short masked calls, chosen per call in fwd_launch.h, same contract):
//   WG 0, producer: all four warps drop to RegisterBudget::kProducer registers; warps 1-3 exit;
//     warp 0 walks the tile schedule and one elected lane issues every TMA load (load.h).
//   WG 1..W, consumers: grow to RegisterBudget::kConsumer registers; WG c computes query rows
//     [64c, 64c + 64) of each tile (mma.h) and writes O and LSE (epilogue.h).
// Pipelines (mbarriers in SharedStorage):
//   q_full[QS]       1 arrival (producer expect_tx of kQBytes) per tile with keys; Q buffers
//                    are used round-robin over those tiles.
//   q_empty[QS]      W arrivals, thread 0 of each consumer WG once the tile's last QK GEMM
//                    completed; the producer waits before loading the buffer again. With
//                    QS = 2 the next tile's Q loads while the current tile computes.
//   k_full[S], v_full[S]   1 arrival (expect_tx of kKVBytes); consumers wait.
//   k_empty[S], v_empty[S] W arrivals, thread 0 of each consumer WG once its WGMMAs reading the
//                    stage completed; the producer waits before reusing the stage.
//   K and V have their own stage counters; both advance once per key block.
//   Producers start every empty barrier at phase 1 (reported complete: buffers start free).
// Named barriers (pipeline.h):
//   PingPong c   256: WG c syncs before issuing its GEMMs, WG c - 1 arrives after issuing its
//                own; WG 0 arrives once at start (order WG 0, 1, .., W-1, 0, ...).
// Tiles without a visible key touch no barrier in either role (both derive the same BlockRange).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "sm90/kernel_traits.h"
#include "sm90/load.h"
#include "sm90/mma.h"
#include "sm90/params.h"
#include "sm90/pipeline.h"

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

  const int warp_idx = cutlass::canonical_warp_idx_sync();
  if (warp_idx == 0 && cute::elect_one_sync()) {
    prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    CUTE_UNROLL
    for (int s = 0; s < Traits::kQStages; ++s) {
      smem.q_full[s].init(/*arrive_count=*/1);
      smem.q_empty[s].init(Traits::kConsumerWgs);
    }
    CUTE_UNROLL
    for (int s = 0; s < Traits::kStages; ++s) {
      smem.k_full[s].init(1);
      smem.v_full[s].init(1);
      smem.k_empty[s].init(Traits::kConsumerWgs);
      smem.v_empty[s].init(Traits::kConsumerWgs);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const int warp_group = cutlass::canonical_warp_group_idx();
  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Registers::kProducer>();
    if (warp_idx == 0) {
      producer_loop<Traits>(params, smem);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Registers::kConsumer>();
    consumer_loop<Traits>(params, smem);  // warp group 1 + c is consumer c
  }
}

}  // namespace flash_hopper::sm90
