// The forward launchers this build holds. Each generated instantiation defines one launcher;
// api.cu builds its dispatch table from the generated fh_registry.inc, so the table always lists
// exactly what was compiled.
#pragma once

#include <cuda_runtime.h>

#include "flash_hopper/fwd_params.h"

namespace flash_hopper {

using FwdLauncher = cudaError_t (*)(FwdParams const& params, int max_smem_per_block,
                                    cudaStream_t stream);

}  // namespace flash_hopper

#define FH_DEFINE_FWD_LAUNCHER(name)                                                  \
  cudaError_t name(flash_hopper::FwdParams const& params, int max_smem_per_block, \
                   cudaStream_t stream)
