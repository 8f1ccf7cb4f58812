// Host launch of the FA-2 path's forward kernel for one (dtype, head-dim bucket) instantiation.
#pragma once

#include <cuda_runtime.h>

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

// Launches the tuned config, or returns cudaErrorInvalidConfiguration (reported as unsupported)
// when the device's opt-in shared memory per block is below its need.
template <class Element, int kHeadDim>
cudaError_t run_fwd(FwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  using Traits = typename FwdTraitsFor<Element, kHeadDim>::type;
  if (Traits::kSmemBytes > max_smem_per_block) {
    return cudaErrorInvalidConfiguration;
  }
  return launch_fwd<Traits>(p, stream);
}

}  // namespace flash_hopper::sm80
