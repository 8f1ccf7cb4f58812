// Host launch of the FA-2 path's forward kernel for one (dtype, head-dim bucket) instantiation.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "flash_hopper/fwd_params.h"
#include "sm80/fwd_kernel.h"
#include "sm80/kernel_traits.h"

namespace flash_hopper::sm80 {

template <class Traits>
cudaError_t launch_fwd(FwdParams const& p, cudaStream_t stream) {
  auto kernel = fwd_kernel<Traits>;
  constexpr int kSmem = Traits::kSmemBytes;
  if constexpr (kSmem > 48 * 1024) {
    cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) {
      return err;
    }
  }
  const int m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  dim3 grid(m_blocks, p.heads_q, p.batch);
  kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <class Traits>
cudaError_t launch_fwd_checked(FwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  if (Traits::kSmemBytes > max_smem_per_block) {
    return cudaErrorInvalidConfiguration;  // reported as unsupported, nothing launched
  }
  return launch_fwd<Traits>(p, stream);
}

// Launches the tuned config for this call: the narrow tile where the table says it wins.
template <class Element, int kHeadDim>
cudaError_t run_fwd(FwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  using Wide = typename FwdTraitsFor<Element, kHeadDim>::type;
  using Narrow = typename FwdTraitsFor<Element, kHeadDim, /*kNarrow=*/true>::type;
  if constexpr (!std::is_same_v<Wide, Narrow>) {
    const bool masked = p.window_left >= 0 || p.window_right >= 0;
    if (use_narrow_tile(masked, p.seqlen_k)) {
      return launch_fwd_checked<Narrow>(p, max_smem_per_block, stream);
    }
  }
  return launch_fwd_checked<Wide>(p, max_smem_per_block, stream);
}

}  // namespace flash_hopper::sm80
