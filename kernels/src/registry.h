// The forward launchers this build holds. Each generated instantiation defines one launcher;
// api.cu builds its dispatch table from the generated fh_registry.inc, so the table always lists
// exactly what was compiled (kernels/src/tables.cmake says what that is).
#pragma once

#include <cuda_runtime.h>

#include "flash_hopper/fwd_params.h"
#include "src/launch_result.h"

namespace flash_hopper {

// Launches the instantiation's kernel for p on stream, on the current device, if its tile fits
// max_smem_per_block bytes of shared memory; reports what happened (launch_result.h).
using FwdLauncher = LaunchResult (*)(FwdParams const& p, int max_smem_per_block,
                                     cudaStream_t stream);

}  // namespace flash_hopper

#define FH_DEFINE_FWD_LAUNCHER(name)                                                         \
  flash_hopper::LaunchResult name(flash_hopper::FwdParams const& params, int max_smem_per_block, \
                                  cudaStream_t stream)
