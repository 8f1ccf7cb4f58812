// The decode kernel's launcher (kernels/decode/decode_kernel.h), for the C ABI: validation and the
// plan live in validate_decode.cu, the kernel's configuration and launch here, behind a header
// without CuTe.
#pragma once

#include <cuda_runtime.h>

#include "flash_hopper/api.h"
#include "src/launch_result.h"

namespace flash_hopper {

// K / V's FhDtype of a decode call (FhDecodeParams::kv_dtype: 0 means dtype's).
inline int32_t decode_kv_dtype(const FhDecodeParams* p) {
  return p->kv_dtype == 0 ? p->dtype : p->kv_dtype;
}

// Whether K / V in kv_dtype are an FP8 cache (the kernels with the widened tiles and their stages).
bool decode_fp8_kv(int32_t kv_dtype);

// The key-ring stages of the decode kernel at head_dim under a shared-memory limit per block
// (api.h: fh_decode_stages, 16-bit caches): the tuned count (or FLASH_HOPPER_DECODE_STAGES) where
// it fits, else the largest that fits, 0 where none does; fp8_kv: those of an FP8 cache's kernel.
int decode_stages(int64_t head_dim, int max_smem_per_block, bool fp8_kv = false);

// Row blocks per CTA of a decode call on num_sms SMs (decode_plan.h, row_tiles_per_cta; an FP8
// cache pairs only where a CTA per row block fills every slot); 1 with
// FLASH_HOPPER_DECODE_PAIR=0 (for measurements). The split heuristic and the launch both ask it.
int decode_row_tiles(const FhDecodeParams* p, int num_sms);

// CTAs of that kernel one SM holds (shared memory bound; 228 KiB per SM, 1 KiB reserved per CTA).
int decode_ctas_per_sm(int64_t head_dim, bool fp8_kv);

// Launches the kernel for a validated call with p->num_splits >= 1 (and its workspace), and the
// combine kernel behind it when it splits (its grid sized for num_sms SMs); on a device of
// compute capability cc_major >= 9 both with programmatic dependent launch. timeline: FH_TIMELINE
// builds' event buffer (decode_kernel.h's DecodeMarks) of timeline_bytes, or null.
LaunchResult launch_decode(FhDecodeParams const* p, int max_smem_per_block, int cc_major,
                           int num_sms, cudaStream_t stream, unsigned long long* timeline = nullptr,
                           int64_t timeline_bytes = 0);

}  // namespace flash_hopper
