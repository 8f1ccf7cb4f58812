// Device facts (device.h): a per-device cache of the attributes the host path reads, and the
// shared-memory limit tile selection sees.
#include "src/device.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

#include "src/errors.h"

namespace flash_hopper {
namespace {

// A device's attributes never change: they are queried once per device ordinal and read from here
// afterwards (four cudaDeviceGetAttribute calls per launch were host time for nothing).
constexpr int kCachedDevices = 64;
struct CachedDevice {
  std::atomic<bool> ready{false};
  DeviceInfo info;
};
CachedDevice g_device_cache[kCachedDevices];
std::mutex g_device_cache_mutex;

}  // namespace

FhStatus query_device(DeviceInfo* info) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) {
    return fail_cuda(err, "cudaGetDevice");
  }
  CachedDevice* cached = dev >= 0 && dev < kCachedDevices ? &g_device_cache[dev] : nullptr;
  if (cached != nullptr && cached->ready.load(std::memory_order_acquire)) {
    *info = cached->info;
    return FH_SUCCESS;
  }
  const struct {
    cudaDeviceAttr attr;
    int* out;
  } queries[] = {
      {cudaDevAttrComputeCapabilityMajor, &info->major},
      {cudaDevAttrComputeCapabilityMinor, &info->minor},
      {cudaDevAttrMultiProcessorCount, &info->sm_count},
      {cudaDevAttrMaxSharedMemoryPerBlockOptin, &info->max_smem_optin},
  };
  for (const auto& q : queries) {
    err = cudaDeviceGetAttribute(q.out, q.attr, dev);
    if (err != cudaSuccess) {
      return fail_cuda(err, "cudaDeviceGetAttribute");
    }
  }
  if (cached != nullptr) {
    std::lock_guard<std::mutex> lock(g_device_cache_mutex);
    if (!cached->ready.load(std::memory_order_relaxed)) {
      cached->info = *info;
      cached->ready.store(true, std::memory_order_release);
    }
  }
  return FH_SUCCESS;
}

int smem_limit(const DeviceInfo& dev) {
  int limit = dev.max_smem_optin;
  if (const char* env = std::getenv("FLASH_HOPPER_DEBUG_SMEM_LIMIT")) {
    const int v = std::atoi(env);
    if (v > 0 && v < limit) {
      limit = v;
    }
  }
  return limit;
}

DeviceInfo capability_device(int cc_major, int cc_minor) {
  DeviceInfo dev;
  dev.major = cc_major;
  dev.minor = cc_minor;
  dev.max_smem_optin = kOtherCapabilitySmemKib * 1024;
  for (const CapabilitySmem& row : kCapabilitySmem) {
    if (row.major == cc_major && row.minor == cc_minor) {
      dev.max_smem_optin = row.kib * 1024;
    }
  }
  return dev;
}

}  // namespace flash_hopper
