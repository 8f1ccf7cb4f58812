// What a launcher (forward, backward, the backward's pre/postprocess) reports back, and how the
// C ABI turns that into an FhStatus and a message (describe_launch; errors.h: report_launch).
//
// Launchers return a LaunchResult, the library's own status, instead of a cudaError_t: "no tile
// fits this GPU's shared memory" and "TMA cannot encode this layout" are decisions the launcher
// takes before any CUDA call. Reported as CUDA codes (cudaErrorInvalidConfiguration,
// cudaErrorInvalidPitchValue, as they once were), a genuine CUDA failure with the same code would
// read as one of them. Host-only and self-contained, so tests/test_lib.py compiles it alone and
// checks the mapping on a machine without a GPU.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>

#include "flash_hopper/api.h"

namespace flash_hopper {

enum class LaunchStatus : int {
  kOk = 0,
  kNoTileFitsSmem,     // the tile the call needs takes more shared memory than the GPU allows
  kLayoutNotLoadable,  // a q/k/v stride TMA cannot encode (FA-3 path)
  kCudaError,          // a CUDA runtime call failed; cuda_error says which
  kInternalError,      // a request the caller should have refused (a bug); `what` says which
};

struct LaunchResult {
  LaunchStatus status = LaunchStatus::kOk;
  cudaError_t cuda_error = cudaSuccess;  // kCudaError
  int smem_bytes = 0;                    // kNoTileFitsSmem: what the tile needs
  const char* field = nullptr;  // kLayoutNotLoadable: the FhFwdParams / FhBwdParams stride field
  int64_t stride = 0;           // kLayoutNotLoadable: its value (elements)
  const char* what = nullptr;   // kInternalError: what was wrong

  static LaunchResult ok() { return {}; }
  // cudaSuccess gives ok: launchers pass every runtime return value through here.
  static LaunchResult cuda(cudaError_t err) {
    LaunchResult r;
    if (err != cudaSuccess) {
      r.status = LaunchStatus::kCudaError;
      r.cuda_error = err;
    }
    return r;
  }
  static LaunchResult no_tile_fits(int smem_bytes) {
    LaunchResult r;
    r.status = LaunchStatus::kNoTileFitsSmem;
    r.smem_bytes = smem_bytes;
    return r;
  }
  static LaunchResult layout_not_loadable(const char* field, int64_t stride) {
    LaunchResult r;
    r.status = LaunchStatus::kLayoutNotLoadable;
    r.field = field;
    r.stride = stride;
    return r;
  }
  static LaunchResult internal(const char* what) {
    LaunchResult r;
    r.status = LaunchStatus::kInternalError;
    r.what = what;
    return r;
  }
};

// Runs set(), a setting that sticks to a kernel on the current device (cudaFuncSetAttribute), once
// per device: `done` is the caller's set of device ordinals already set up (one per kernel). Per
// launch it would cost host time on every call for nothing. Devices past 63 are set up each time.
template <class Set>
cudaError_t once_per_device(std::atomic<uint64_t>& done, Set&& set) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) {
    return err;
  }
  const uint64_t bit = dev >= 0 && dev < 64 ? uint64_t(1) << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) {
    return cudaSuccess;
  }
  err = set();
  if (err == cudaSuccess && bit != 0) {
    done.fetch_or(bit, std::memory_order_release);
  }
  return err;
}

// Opts kKernel (a __global__ function) into `bytes` of dynamic shared memory per block
// (cudaFuncAttributeMaxDynamicSharedMemorySize): a launch asking for more than 48 KB fails
// without it. Once per device and kernel; a kernel always asks for the same bytes.
template <auto kKernel>
cudaError_t opt_in_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> set_on_devices{0};
  return once_per_device(set_on_devices, [&] {
    return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  });
}

// The FhStatus of a launch and, for a failure, its message in msg (NUL-terminated, cut to
// msg_len). `backend` ("fa2" / "fa3"), `head_dim`, `smem_limit` (bytes per block the launcher
// was allowed) and `tma_tensors` (the tensors the path loads with TMA: "q/k/v" for the forward,
// "q/k/v/dout" for the backward) only fill the message.
inline FhStatus describe_launch(LaunchResult const& r, const char* backend, int64_t head_dim,
                                int smem_limit, char* msg, size_t msg_len,
                                const char* tma_tensors = "q/k/v") {
  switch (r.status) {
    case LaunchStatus::kOk:
      if (msg_len > 0) {
        msg[0] = '\0';
      }
      return FH_SUCCESS;
    case LaunchStatus::kNoTileFitsSmem:
      snprintf(msg, msg_len,
               "head_dim %lld: no %s tile config fits this GPU's %d bytes of shared memory per "
               "block (the tile needs %d)",
               (long long)head_dim, backend, smem_limit, r.smem_bytes);
      return FH_ERROR_UNSUPPORTED;
    case LaunchStatus::kLayoutNotLoadable:
      snprintf(msg, msg_len,
               "%s: the %s path's TMA needs every %s row, head and batch stride to be a "
               "positive multiple of 16 bytes below 2^40 bytes, got %lld elements",
               r.field ? r.field : "strides", backend, tma_tensors, (long long)r.stride);
      return FH_ERROR_UNSUPPORTED;
    case LaunchStatus::kInternalError:
      snprintf(msg, msg_len, "internal error in the %s launcher: %s", backend,
               r.what ? r.what : "unknown");
      return FH_ERROR_INTERNAL;
    case LaunchStatus::kCudaError:
      snprintf(msg, msg_len, "kernel launch failed: %s (%s)", cudaGetErrorString(r.cuda_error),
               cudaGetErrorName(r.cuda_error));
      return FH_ERROR_CUDA;
  }
  snprintf(msg, msg_len, "launcher returned unknown LaunchStatus %d", static_cast<int>(r.status));
  return FH_ERROR_INTERNAL;
}

}  // namespace flash_hopper
