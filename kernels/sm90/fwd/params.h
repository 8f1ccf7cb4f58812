// Kernel parameters of the FA-3 path, passed by value as a __grid_constant__: the derived
// FwdParams, the TMA descriptors (encoded on the host, launch.h) and the tile scheduler.
#pragma once

#include <cute/config.hpp>

#include "flash_hopper/fwd_params.h"
#include "sm90/fwd/schedule.h"
#include "sm90/fwd/tile_scheduler.h"

namespace flash_hopper::sm90 {

template <class Traits>
struct KernelParams {
  FwdParams fwd;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TileOrder scheduler;  // StaticTileScheduler, or varlen's list
  bool pingpong;
};

// V's (and O's) head dim: q's, but in the kernels with a V head dim of their own (the other
// kernels read the field they always read).
template <class Traits>
CUTE_HOST_DEVICE int head_dim_v(FwdParams const& p) {
  if constexpr (Traits::kOwnHeadDimV) {
    return p.head_dim_v;
  } else {
    return p.head_dim;
  }
}

// This CTA's walk over its tiles under the call's mask: what the producer and the consumers
// iterate (schedule.h).
template <class Traits>
CUTE_DEVICE CtaSchedule<Traits::kBlockM, Traits::kBlockN, typename Traits::TileOrder> cta_schedule(
    KernelParams<Traits> const& params) {
  constexpr int kCluster = Traits::kClusterM;  // 1-D clusters: rank = blockIdx.x % kCluster
  return {params.scheduler, attention_mask(params.fwd), int(blockIdx.x) / kCluster, kCluster,
          int(blockIdx.x) % kCluster};
}

}  // namespace flash_hopper::sm90
