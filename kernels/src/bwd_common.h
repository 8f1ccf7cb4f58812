// The backward's preprocess, shared by both paths (kernels/src/bwd_common.cu,
// plain CUDA compiled for compute_80: SASS for sm_80 and sm_90, PTX for later GPUs).
//
// - preprocess: for every (batch, head_q, row < seqlen_q_rounded): dpsum = rowsum(dout * o) in
//   fp32 minus dlse (if given), lse_log2 = lse * log2(e) (+inf where lse is -inf), padded rows
//   dpsum 0 / lse_log2 +inf; clears dq_accum (all seqlen_q_rounded x head_dim_rounded) and the
//   semaphores.
// The postprocess (dq = softmax_scale * dq_accum) belongs to each path's launcher: the
// accumulator's layout inside a query block is the main kernel's (sm80/bwd_postprocess.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash_hopper/bwd_params.h"
#include "src/launch_result.h"

namespace flash_hopper {

// dtype: FhDtype (fp16 or bf16).
LaunchResult launch_bwd_preprocess(BwdParams const& p, int32_t dtype, cudaStream_t stream);

}  // namespace flash_hopper
