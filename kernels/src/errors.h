// Errors of the C ABI: the calling thread's last error message (fh_last_error), the printf-style
// formatting every message goes through, and the mapping of failures to an FhStatus and a
// sentence: a CUDA call, a driver too old for this library's runtime, a launcher's LaunchResult.
//
// Every entry point clears the message first and fails through fail() (or FH_CHECK / FH_TRY), so
// a failed call leaves exactly one message: the field, the expected and the given value.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "flash_hopper/api.h"
#include "src/launch_result.h"

namespace flash_hopper {

// printf into a std::string; messages are cut at 1023 characters.
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Sets the thread's last error to the formatted message and returns status.
FhStatus fail(FhStatus status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// A failed CUDA runtime call `what`: FH_ERROR_CUDA with the error's text, or with the driver found
// and the one needed when the driver cannot serve this library's CUDA runtime.
FhStatus fail_cuda(cudaError_t err, const char* what);

// The FhStatus of a launch (describe_launch, launch_result.h); a failure's message becomes the
// thread's last error, after "stage: " when a stage is named.
FhStatus report_launch(LaunchResult const& r, const char* backend, int64_t head_dim,
                       int smem_limit, const char* tma_tensors = "q/k/v",
                       const char* stage = nullptr);

void clear_last_error();
const char* last_error();

}  // namespace flash_hopper

// Fails the calling function with FH_ERROR_INVALID_ARGUMENT and the message unless cond holds.
#define FH_CHECK(cond, ...)                                \
  do {                                                     \
    if (!(cond)) {                                         \
      return fail(FH_ERROR_INVALID_ARGUMENT, __VA_ARGS__); \
    }                                                      \
  } while (0)

// Returns a helper's failure from the calling function.
#define FH_TRY(expr)                  \
  do {                                \
    const FhStatus fh_try_ = (expr);  \
    if (fh_try_ != FH_SUCCESS) {      \
      return fh_try_;                 \
    }                                 \
  } while (0)
