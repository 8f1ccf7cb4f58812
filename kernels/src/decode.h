// The decode kernel's launcher (kernels/decode/decode_kernel.h), for the C ABI: validation and the
// plan live in validate_decode.cu, the kernel's configuration and launch here, behind a header
// without CuTe.
#pragma once

#include <cuda_runtime.h>

#include "flash_hopper/api.h"
#include "src/launch_result.h"

namespace flash_hopper {

// The key-ring stages of the decode kernel at head_dim under a shared-memory limit per block
// (api.h: fh_decode_stages): the tuned count (or FLASH_HOPPER_DECODE_STAGES) where it fits, else
// the largest that fits, 0 where none does.
int decode_stages(int64_t head_dim, int max_smem_per_block);

// CTAs of that kernel one SM holds (shared memory bound; 228 KiB per SM, 1 KiB reserved per CTA).
int decode_ctas_per_sm(int64_t head_dim);

// Launches the kernel for a validated call with p->num_splits >= 1 (and its workspace), and the
// combine kernel behind it when it splits; on a device of compute capability cc_major >= 9 both
// with programmatic dependent launch. timeline: FH_TIMELINE builds' event buffer (decode_kernel.h's
// DecodeMarks) of timeline_bytes, or null.
LaunchResult launch_decode(FhDecodeParams const* p, int max_smem_per_block, int cc_major,
                           cudaStream_t stream, unsigned long long* timeline = nullptr,
                           int64_t timeline_bytes = 0);

}  // namespace flash_hopper
