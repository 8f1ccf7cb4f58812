// The varlen prepare kernel (kernels/src/varlen.cu), shared by both forward paths: plain CUDA
// compiled for compute_80 (SASS for sm_80 and sm_90, PTX for later GPUs).
//
// One CTA reads cu_seqlens / seqused and writes the call's work list into the workspace
// (flash_hopper/varlen.h): every (sequence, query block) pair with query rows, costliest first
// (cost: the key blocks the sequence's mask lets the block visit; ties in any order, which
// changes no result: each tile is computed by one CTA from its own inputs), each with its
// sequence's span, and the header's num_pairs. Runs on the caller's stream before the attention
// kernel: no host synchronization, so a CUDA graph captures both.
#pragma once

#include <cuda_runtime.h>

#include "flash_hopper/fwd_params.h"
#include "src/launch_result.h"

namespace flash_hopper {

// block_m / block_n: the tile of the attention kernel that will walk the list.
LaunchResult launch_varlen_prepare(FwdParams const& p, int block_m, int block_n,
                                   cudaStream_t stream);

}  // namespace flash_hopper
