// Errors of the C ABI (errors.h): the thread's last error, message formatting, and the sentences
// for CUDA and driver failures and for launch results.
#include "src/errors.h"

#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace flash_hopper {
namespace {

thread_local std::string g_last_error;

std::string vformat(const char* fmt, va_list args) {
  char buf[1024];
  vsnprintf(buf, sizeof(buf), fmt, args);
  return buf;
}

// The CUDA runtime is linked statically, so the driver must serve this library's CUDA major
// version: with minor-version compatibility any CUDA 12.x runtime runs on a driver >= 525.60.13
// and any 13.x runtime on a driver >= 580 (NVIDIA's CUDA Compatibility guide, minor version
// compatibility table). The flash-hopper-cu12 wheels are the ones for drivers 525 to 579.
constexpr int kRuntimeMajor = CUDART_VERSION / 1000;
constexpr int kRuntimeMinor = (CUDART_VERSION % 1000) / 10;
constexpr const char* kDriverNeeded = kRuntimeMajor >= 13 ? ">= 580" : ">= 525.60.13";
constexpr const char* kOlderDriverHint =
    kRuntimeMajor >= 13
        ? ", or install flash-hopper-cu12 (built with CUDA 12, drivers >= 525.60.13)"
        : "";

// The driver's release ("550.54.15") from the kernel module, or "" where it cannot be read.
std::string driver_release() {
  FILE* f = fopen("/proc/driver/nvidia/version", "r");
  if (f == nullptr) {
    return "";
  }
  char line[512] = {0};
  char release[64] = {0};
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024"
  if (fgets(line, sizeof(line), f) != nullptr) {
    const char* at = strstr(line, "Kernel Module");
    if (at == nullptr || sscanf(at, "Kernel Module %63s", release) != 1) {
      release[0] = '\0';
    }
  }
  fclose(f);
  return release;
}

// One sentence for a driver that cannot serve this runtime: the driver found, the one needed.
FhStatus fail_driver(cudaError_t err, const char* what) {
  int driver = 0;  // the CUDA version the driver supports, 1000 * major + 10 * minor; 0: none
  if (cudaDriverGetVersion(&driver) != cudaSuccess) {
    driver = 0;
  }
  if (driver == 0) {
    return fail(FH_ERROR_CUDA,
                "%s failed: no NVIDIA driver was found (libcuda.so.1 did not load); this "
                "flash-hopper library was built with CUDA %d.%d and needs an NVIDIA driver %s (%s)",
                what, kRuntimeMajor, kRuntimeMinor, kDriverNeeded, cudaGetErrorName(err));
  }
  const std::string release = driver_release();
  const std::string found = release.empty() ? "the NVIDIA driver" : "NVIDIA driver " + release;
  if (err == cudaErrorCallRequiresNewerDriver) {
    return fail(FH_ERROR_CUDA,
                "%s failed: %s supports CUDA %d.%d, older than the CUDA %d.%d this flash-hopper "
                "library was built with, and this call needs the newer driver; update the driver "
                "to one for CUDA %d.%d or newer (%s)",
                what, found.c_str(), driver / 1000, (driver % 1000) / 10, kRuntimeMajor,
                kRuntimeMinor, kRuntimeMajor, kRuntimeMinor, cudaGetErrorName(err));
  }
  return fail(FH_ERROR_CUDA,
              "%s failed: %s supports CUDA %d.%d, but this flash-hopper library was built with "
              "CUDA %d.%d and needs a driver %s (CUDA %d.x); update the driver%s (%s)",
              what, found.c_str(), driver / 1000, (driver % 1000) / 10, kRuntimeMajor,
              kRuntimeMinor, kDriverNeeded, kRuntimeMajor, kOlderDriverHint,
              cudaGetErrorName(err));
}

}  // namespace

std::string format(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::string s = vformat(fmt, args);
  va_end(args);
  return s;
}

FhStatus fail(FhStatus status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  g_last_error = vformat(fmt, args);
  va_end(args);
  return status;
}

FhStatus fail_cuda(cudaError_t err, const char* what) {
  if (err == cudaErrorInsufficientDriver || err == cudaErrorCallRequiresNewerDriver) {
    return fail_driver(err, what);
  }
  return fail(FH_ERROR_CUDA, "%s failed: %s (%s)", what, cudaGetErrorString(err),
              cudaGetErrorName(err));
}

FhStatus report_launch(LaunchResult const& r, const char* backend, int64_t head_dim,
                       int smem_limit, const char* tma_tensors, const char* stage) {
  char message[1024];
  const FhStatus st =
      describe_launch(r, backend, head_dim, smem_limit, message, sizeof(message), tma_tensors);
  if (st != FH_SUCCESS) {
    g_last_error = stage != nullptr ? format("%s: %s", stage, message) : std::string(message);
  }
  return st;
}

void clear_last_error() { g_last_error.clear(); }

const char* last_error() { return g_last_error.c_str(); }

}  // namespace flash_hopper
