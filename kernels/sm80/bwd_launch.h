// Host launch of the FA-2 path's main backward kernel for one (dtype, head-dim bucket)
// instantiation; api.cu runs the preprocess before it and the postprocess after it.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "flash_hopper/bwd_params.h"
#include "sm80/bwd_kernel.h"
#include "sm80/bwd_kernel_traits.h"
#include "src/registry.h"

namespace flash_hopper::sm80 {

// Grid: (key blocks, kv heads, batch). A key block no query sees still gets its CTA: it writes
// dK = dV = 0 (so does every key block when seqlen_q == 0).
template <class Element, int kHeadDim>
LaunchResult run_bwd(BwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  using Traits = typename BwdTraitsFor<Element, kHeadDim>::type;
  constexpr int kSmem = Traits::kSmemBytes;
  if (kSmem > max_smem_per_block) {
    return LaunchResult::no_tile_fits(kSmem);
  }
  static_assert(kBwdRowPad % Traits::kBlockM == 0 && Traits::kBlockM % kBwdSemaphoreRows == 0,
                "query blocks must tile the workspace's padded rows and its semaphores");
  if (p.seqlen_k == 0 || p.batch == 0) {
    return LaunchResult::ok();
  }
  auto kernel = bwd_kernel<Traits>;
  static std::atomic<uint64_t> smem_set_on_devices{0};
  const cudaError_t err = once_per_device(smem_set_on_devices, [&] {
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  });
  if (err != cudaSuccess) {
    return LaunchResult::cuda(err);
  }
  const int n_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  dim3 grid(n_blocks, p.heads_kv, p.batch);
  kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(p);
  return LaunchResult::cuda(cudaGetLastError());
}

}  // namespace flash_hopper::sm80
