// The forward and backward launchers this build holds. Each generated instantiation defines one
// launcher; tables.cu builds its dispatch tables from the generated fh_registry.inc, so the tables
// always list exactly what was compiled (kernels/src/tables.cmake says what that is).
#pragma once

#include <cuda_runtime.h>

#include "flash_hopper/bwd_params.h"
#include "flash_hopper/fwd_params.h"
#include "src/launch_result.h"

namespace flash_hopper {

// Launches the instantiation's kernel for p on stream, on the current device, if its tile fits
// max_smem_per_block bytes of shared memory; reports what happened (launch_result.h).
using FwdLauncher = LaunchResult (*)(FwdParams const& p, int max_smem_per_block,
                                     cudaStream_t stream);

// Launches the instantiation's backward for p on stream after launch.cu's shared preprocess
// (bwd_common.h): the main kernel (dk, dv written, dq accumulated into p.dq_accum in the layout
// the path chooses; skipped when seqlen_k == 0) and the postprocess that converts that
// accumulator into dq (skipped when seqlen_q == 0). Same contract as FwdLauncher otherwise.
using BwdLauncher = LaunchResult (*)(BwdParams const& p, int max_smem_per_block,
                                     cudaStream_t stream);

}  // namespace flash_hopper

#define FH_DEFINE_FWD_LAUNCHER(name)                                                         \
  flash_hopper::LaunchResult name(flash_hopper::FwdParams const& params, int max_smem_per_block, \
                                  cudaStream_t stream)

#define FH_DEFINE_BWD_LAUNCHER(name)                                                         \
  flash_hopper::LaunchResult name(flash_hopper::BwdParams const& params, int max_smem_per_block, \
                                  cudaStream_t stream)
