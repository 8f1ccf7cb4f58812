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

// Picks the primary tile config, or the small-shared-memory fallback where the device's opt-in
// limit is below the primary's need (returns cudaErrorInvalidConfiguration if neither fits).
template <class Element, int kHeadDim>
cudaError_t run_fwd(FwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  using Primary = typename FwdTraitsFor<Element, kHeadDim>::type;
  if (Primary::kSmemBytes <= max_smem_per_block) {
    return launch_fwd<Primary>(p, stream);
  }
  if constexpr (Primary::kSmemBytes > 96 * 1024) {
    using Small = typename FwdTraitsFor<Element, kHeadDim, /*kSmallSmem=*/true>::type;
    if (Small::kSmemBytes <= max_smem_per_block) {
      return launch_fwd<Small>(p, stream);
    }
  }
  return cudaErrorInvalidConfiguration;
}

}  // namespace flash_hopper::sm80
