// Kernel parameters of the FA-3 path, passed by value as a __grid_constant__: the derived
// FwdParams, the TMA descriptors (encoded on the host per call) and the tile scheduler.
#pragma once

#include "flash_hopper/fwd_params.h"
#include "sm90/tile_scheduler.h"

namespace flash_hopper::sm90 {

template <class Traits>
struct KernelParams {
  FwdParams fwd;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
  StaticTileScheduler scheduler;
  bool pingpong;
};

}  // namespace flash_hopper::sm90
