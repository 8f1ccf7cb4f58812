// Launches of validated calls on the current device, in the caller's stream: the kernel
// parameters derived (derive.h), the chosen path's launcher run, its result turned into an
// FhStatus and message (errors.h). Also the debug timeline buffer those launches record into.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash_hopper/api.h"
#include "src/device.h"
#include "src/policy.h"

namespace flash_hopper {

// The chosen FA path's launcher; a call the policy sends to the decode kernel (decode_route) is
// refused with FH_ERROR_UNSUPPORTED: fh_decode runs it, with its own parameters.
FhStatus launch_call(const FhFwdParams* p, Choice const& choice, const DeviceInfo& dev,
                     cudaStream_t stream);

// The launches of a backward in stream order (the preprocess, then the path's launcher: its main
// kernel and its postprocess); the first failure stops it (what already ran wrote only the
// caller's workspace and outputs, which a failed call leaves undefined).
FhStatus launch_call(const FhBwdParams* p, BwdChoice const& choice, const DeviceInfo& dev,
                     cudaStream_t stream);

// For a validated call with a planned num_splits on a device of cc >= 8.0.
FhStatus launch_call(const FhDecodeParams* p, const DeviceInfo& dev, cudaStream_t stream);

// fh_debug_set_timeline: the buffer this thread's FA-3 forward and decode launches record their
// event timeline into (FH_TIMELINE builds; FH_ERROR_UNSUPPORTED otherwise).
FhStatus set_debug_timeline(void* device_buffer, int64_t bytes);

}  // namespace flash_hopper
