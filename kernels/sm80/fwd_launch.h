// Host launch of the FA-2 path's forward kernel for one (dtype, head-dim bucket) instantiation.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "flash_hopper/fwd_params.h"
#include "sm80/fwd_kernel.h"
#include "sm80/kernel_traits.h"
#include "src/registry.h"
#include "src/varlen_prepare.h"

namespace flash_hopper::sm80 {

// Checks the tile against the device's shared memory first: a tile that does not fit is reported
// as such (kernels/src/errors.cu, report_launch: FH_ERROR_UNSUPPORTED naming the limit), never
// launched to fail in CUDA.
template <class Traits>
LaunchResult launch_fwd(FwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  constexpr int kSmem = Traits::kSmemBytes;
  if (kSmem > max_smem_per_block) {
    return LaunchResult::no_tile_fits(kSmem);
  }
  auto kernel = fwd_kernel<Traits>;
  if constexpr (kSmem > 48 * 1024) {
    const cudaError_t err = opt_in_dynamic_smem<fwd_kernel<Traits>>(kSmem);
    if (err != cudaSuccess) {
      return LaunchResult::cuda(err);
    }
  }
  dim3 grid;
  if (p.varlen()) {
    // One CTA per (listed pair, head): the prepare kernel writes the list (flash_hopper/varlen.h),
    // CTAs past its length return at once.
    if (p.varlen_capacity == 0) {
      return LaunchResult::ok();
    }
    if (LaunchResult r = launch_varlen_prepare(p, Traits::kBlockM, Traits::kBlockN, stream);
        r.status != LaunchStatus::kOk) {
      return r;
    }
    grid = dim3(p.varlen_capacity, p.heads_q, 1);
  } else {
    const int m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
    grid = dim3(m_blocks, p.heads_q, p.batch);
  }
  kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(p);
  return LaunchResult::cuda(cudaGetLastError());
}

// Launches the tuned config for this call: the narrow tile where the table says it wins.
template <class Element, int kHeadDim>
LaunchResult run_fwd(FwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  using Wide = typename FwdTraitsFor<Element, kHeadDim>::type;
  using Narrow = typename FwdTraitsFor<Element, kHeadDim, /*kNarrow=*/true>::type;
  if constexpr (!std::is_same_v<Wide, Narrow>) {
    const bool masked = p.window_left >= 0 || p.window_right >= 0;
    if (use_narrow_tile(masked, p.seqlen_k)) {
      return launch_fwd<Narrow>(p, max_smem_per_block, stream);
    }
  }
  return launch_fwd<Wide>(p, max_smem_per_block, stream);
}

}  // namespace flash_hopper::sm80
