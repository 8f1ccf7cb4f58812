// Host launch of the FA-2 path's backward for one (dtype, head-dim bucket) instantiation: the main
// kernel and the postprocess that converts its dQ accumulator (whose layout is this kernel's);
// kernels/src/launch.cu runs the shared preprocess before them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "flash_hopper/bwd_params.h"
#include "sm80/bwd_kernel.h"
#include "sm80/bwd_kernel_traits.h"
#include "sm80/bwd_postprocess.h"
#include "src/registry.h"

namespace flash_hopper::sm80 {

// Main kernel grid: (key blocks, kv heads, batch), or the same CTAs in one dimension in deterministic mode
// (bwd_kernel.h says why). A key block no query sees still gets its CTA: it writes dK = dV = 0
// (so does every key block when seqlen_q == 0).
template <class Traits>
LaunchResult launch_bwd(BwdParams const& p, cudaStream_t stream) {
  constexpr int kSmem = Traits::kSmemBytes;
  static_assert(kBwdRowPad % Traits::kBlockM == 0 && Traits::kBlockM % kBwdSemaphoreRows == 0,
                "query blocks must tile the workspace's padded rows and its semaphores");
  if (p.seqlen_k > 0) {
    auto kernel = bwd_kernel<Traits>;
    const cudaError_t err = opt_in_dynamic_smem<bwd_kernel<Traits>>(kSmem);
    if (err != cudaSuccess) {
      return LaunchResult::cuda(err);
    }
    const int n_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    const dim3 grid = p.deterministic
                          ? dim3(unsigned(n_blocks) * unsigned(p.heads_kv) * unsigned(p.batch))
                          : dim3(n_blocks, p.heads_kv, p.batch);
    kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(p);
    const cudaError_t launched = cudaGetLastError();
    if (launched != cudaSuccess) {
      return LaunchResult::cuda(launched);
    }
  }
  if (p.seqlen_q > 0) {  // seqlen_k == 0 too: dq = 0 from the cleared accumulator
    const dim3 grid((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.heads_q, p.batch);
    bwd_postprocess_kernel<Traits><<<grid, Traits::kNThreads, 0, stream>>>(p);
    return LaunchResult::cuda(cudaGetLastError());
  }
  return LaunchResult::ok();
}

// The tuned config, or its fallback on GPUs with less shared memory per block (bwd_tile_config.h).
template <class Element, int kHeadDim>
LaunchResult run_bwd(BwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  using Tuned = typename BwdTraitsFor<Element, kHeadDim>::type;
  using Fallback = typename BwdTraitsFor<Element, kHeadDim, /*kFallback=*/true>::type;
  if (p.batch == 0) {
    return LaunchResult::ok();
  }
  if (Tuned::kSmemBytes <= max_smem_per_block) {
    return launch_bwd<Tuned>(p, stream);
  }
  if constexpr (!std::is_same_v<Tuned, Fallback>) {
    if (Fallback::kSmemBytes <= max_smem_per_block) {
      return launch_bwd<Fallback>(p, stream);
    }
    return LaunchResult::no_tile_fits(Fallback::kSmemBytes);
  }
  return LaunchResult::no_tile_fits(Tuned::kSmemBytes);
}

}  // namespace flash_hopper::sm80
