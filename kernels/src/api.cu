// The C ABI's entry points (api.h). Each validates its parameters (validate.h), asks the backend
// policy (policy.h) where a kernel is to be chosen, and launches (launch.h); the rules live in
// those files, the entry points only put them in order. Every entry point that can fail clears
// the thread's last error first (errors.h).
//
// Files by role, all in kernels/src: errors (messages, fh_last_error), tables (the kernel
// registry and tables.cmake's tables), validate_fwd / validate_bwd / validate_decode, policy,
// device (the current device's facts), derive (kernel parameters), launch.
#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "flash_hopper/api.h"
#include "flash_hopper/varlen.h"
#include "src/decode.h"
#include "src/device.h"
#include "src/errors.h"
#include "src/launch.h"
#include "src/policy.h"
#include "src/tables.h"
#include "src/validate.h"

namespace flash_hopper {
namespace {

// The select functions' own argument checks (answer_policy, both directions).
FhStatus check_select_args(int32_t cc_major, int32_t cc_minor, const int32_t* backend_out) {
  if (backend_out == nullptr) {
    return fail(FH_ERROR_INVALID_ARGUMENT, "backend_out: expected a non-null pointer, got null");
  }
  if (cc_major < 0 || cc_minor < 0) {
    return fail(FH_ERROR_INVALID_ARGUMENT,
                "cc_major/cc_minor: expected a compute capability such as 9.0, got %d.%d",
                cc_major, cc_minor);
  }
  return FH_SUCCESS;
}

// fh_fwd_select_backend / fh_bwd_select_backend / fh_decode_select_backend: validate without data
// pointers, ask the policy, write the backend and (when asked) why.
template <class ChoiceT, class Params>
FhStatus answer_policy(const Params* params, int32_t cc_major, int32_t cc_minor,
                       int32_t* backend_out, char* reason, size_t reason_len) {
  clear_last_error();
  FH_TRY(validate(params, /*check_data=*/false));
  FH_TRY(check_select_args(cc_major, cc_minor, backend_out));
  ChoiceT choice;
  std::string why;
  FH_TRY(select_backend(params, cc_major, cc_minor, &choice, reason != nullptr ? &why : nullptr));
  *backend_out = choice.backend;
  if (reason != nullptr && reason_len > 0) {
    snprintf(reason, reason_len, "%s", why.c_str());
  }
  return FH_SUCCESS;
}

// Calls without work succeed without a device. The backward of seqlen_q == 0 still writes
// dk = dv = 0.
bool nothing_to_compute(const FhFwdParams* p) { return p->batch == 0 || p->seqlen_q == 0; }
bool nothing_to_compute(const FhBwdParams* p) { return p->batch == 0; }

// fh_fwd / fh_bwd: validate with data pointers, apply the policy to the current device, launch.
template <class ChoiceT, class Params>
FhStatus run(const Params* params, void* stream) {
  clear_last_error();
  FH_TRY(validate(params, /*check_data=*/true));
  if (nothing_to_compute(params)) {
    return FH_SUCCESS;
  }
  DeviceInfo dev;
  FH_TRY(query_device(&dev));
  ChoiceT choice;
  FH_TRY(select_backend(params, dev.major, dev.minor, &choice, /*why=*/nullptr));
  return launch_call(params, choice, dev, static_cast<cudaStream_t>(stream));
}

}  // namespace
}  // namespace flash_hopper

using namespace flash_hopper;

extern "C" {

FH_EXPORT FhStatus fh_fwd_select_backend(const FhFwdParams* params, int32_t cc_major,
                                         int32_t cc_minor, int32_t* backend_out, char* reason,
                                         size_t reason_len) {
  return answer_policy<Choice>(params, cc_major, cc_minor, backend_out, reason, reason_len);
}

FH_EXPORT FhStatus fh_fwd_workspace_size(const FhFwdParams* params, int64_t* bytes) {
  clear_last_error();
  FH_CHECK(bytes != nullptr, "bytes: expected a non-null int64_t pointer, got null");
  FH_TRY(validate(params, /*check_data=*/false));
  *bytes = params->cu_seqlens_q != nullptr ? varlen_workspace_bytes(params->seqlen_q, params->batch)
                                           : dense_fwd_workspace_bytes(params);
  return FH_SUCCESS;
}

FH_EXPORT FhStatus fh_fwd(const FhFwdParams* params, void* stream) {
  return run<Choice>(params, stream);
}

FH_EXPORT FhStatus fh_bwd_select_backend(const FhBwdParams* params, int32_t cc_major,
                                         int32_t cc_minor, int32_t* backend_out, char* reason,
                                         size_t reason_len) {
  return answer_policy<BwdChoice>(params, cc_major, cc_minor, backend_out, reason, reason_len);
}

FH_EXPORT FhStatus fh_bwd_workspace_size(const FhBwdParams* params, int64_t* bytes) {
  clear_last_error();
  FH_TRY(validate(params, /*check_data=*/false));
  if (bytes == nullptr) {
    return fail(FH_ERROR_INVALID_ARGUMENT, "bytes: expected a non-null pointer, got null");
  }
  BwdWorkspace ws;
  bwd_workspace(params, &ws);  // validate checked that it fits
  *bytes = ws.bytes;
  return FH_SUCCESS;
}

FH_EXPORT FhStatus fh_bwd(const FhBwdParams* params, void* stream) {
  return run<BwdChoice>(params, stream);
}

FH_EXPORT const char* fh_last_error(void) { return last_error(); }

FH_EXPORT int32_t fh_abi_version(void) { return FH_ABI_VERSION; }

FH_EXPORT const char* fh_build_info(void) { return FH_BUILD_INFO_JSON; }

FH_EXPORT FhStatus fh_debug_set_timeline(void* device_buffer, int64_t bytes) {
  return set_debug_timeline(device_buffer, bytes);
}

FH_EXPORT int32_t fh_has_fwd_kernel(int32_t backend, int32_t dtype, int64_t head_dim) {
  return find_kernel(backend, dtype, head_dim, FH_VARIANT_TUNED) != nullptr ? 1 : 0;
}

FH_EXPORT int32_t fh_has_bwd_kernel(int32_t backend, int32_t dtype, int64_t head_dim) {
  return find_bwd_kernel(backend, dtype, head_dim) != nullptr ? 1 : 0;
}

FH_EXPORT FhStatus fh_decode_plan(const FhDecodeParams* params, int32_t num_sms,
                                  int32_t* num_splits_out, int64_t* workspace_bytes_out) {
  clear_last_error();
  FH_TRY(validate_decode_shapes(params));
  FH_CHECK(num_splits_out != nullptr && workspace_bytes_out != nullptr,
           "num_splits_out, workspace_bytes_out: expected pointers, got null");
  FH_CHECK(num_sms >= 0, "num_sms: expected >= 0 (0 = the current device's), got %d", num_sms);
  if (num_sms == 0 && params->num_splits == 0) {
    DeviceInfo dev;
    FH_TRY(query_device(&dev));
    num_sms = dev.sm_count;
  }
  const int splits = decode_splits(params, num_sms);
  *num_splits_out = splits;
  *workspace_bytes_out = decode_workspace_bytes(params, splits);
  return FH_SUCCESS;
}

FH_EXPORT FhStatus fh_decode_select_backend(const FhDecodeParams* params, int32_t cc_major,
                                            int32_t cc_minor, int32_t* backend_out, char* reason,
                                            size_t reason_len) {
  return answer_policy<DecodeChoice>(params, cc_major, cc_minor, backend_out, reason, reason_len);
}

FH_EXPORT int32_t fh_decode_stages(int64_t head_dim, int32_t max_smem_per_block) {
  if (max_smem_per_block <= 0) {
    DeviceInfo dev;
    if (query_device(&dev) != FH_SUCCESS) {
      return 0;
    }
    max_smem_per_block = smem_limit(dev);
  }
  return decode_stages(head_dim, max_smem_per_block);
}

FH_EXPORT FhStatus fh_decode(const FhDecodeParams* params, void* stream) {
  clear_last_error();
  FH_TRY(validate_decode(params));
  if (params->batch == 0) {
    return FH_SUCCESS;
  }
  DeviceInfo dev;
  FH_TRY(query_device(&dev));
  FH_CHECK(dev.major >= 8, "device: the decode kernel needs compute capability >= 8.0, got %d.%d",
           dev.major, dev.minor);
  return launch_call(params, dev, static_cast<cudaStream_t>(stream));
}

}  // extern "C"
