// Device facts the host path needs: the current device's compute capability, SM count and
// shared-memory limit, queried once per device, and the limit tile selection sees.
#pragma once

#include "flash_hopper/api.h"

namespace flash_hopper {

struct DeviceInfo {
  int major = 0;
  int minor = 0;
  int sm_count = 0;
  int max_smem_optin = 0;
};

// The current device's facts; FH_ERROR_CUDA (fail_cuda) where CUDA cannot tell.
FhStatus query_device(DeviceInfo* info);

// The shared-memory limit tile selection sees: the device's opt-in limit, or
// FLASH_HOPPER_DEBUG_SMEM_LIMIT (bytes) when lower, so a large GPU can run and test the configs
// meant for smaller ones (e.g. 101376 = sm86/sm89's opt-in). Read per call: tests change it
// between calls.
int smem_limit(const DeviceInfo& dev);

// The opt-in shared memory per block of the GPUs CUDA's tables list apart (KiB), and of every
// other capability >= 8.6 (the smallest). capability_device() answers from them, and the decode
// kernel compiles the stage counts these limits select (decode.cu).
struct CapabilitySmem {
  int major;
  int minor;
  int kib;
};
inline constexpr CapabilitySmem kCapabilitySmem[] = {
    {8, 0, 163}, {8, 7, 163}, {9, 0, 227}, {10, 0, 227}, {10, 3, 227}};
inline constexpr int kOtherCapabilitySmemKib = 99;

// The opt-in shared memory per block of a GPU of compute capability cc_major.cc_minor
// (kCapabilitySmem, else kOtherCapabilitySmemKib), for the policy's questions about a GPU that is
// not here (fh_fwd_select_backend, fh_decode_select_backend). A DeviceInfo of it, for smem_limit.
DeviceInfo capability_device(int cc_major, int cc_minor);

}  // namespace flash_hopper
