// The C ABI: validate FhFwdParams, derive the kernel-side FwdParams, pick a backend, launch.
//
// Validation runs entirely on the host before any CUDA call, so a bad argument is reported with
// the field's name, the expected and the given value, and nothing is launched. Python validates
// the same things first (python/flash_hopper/_validate.py) with tensor-level messages; this layer
// protects every other caller of the ABI.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "flash_hopper/api.h"
#include "flash_hopper/fwd_params.h"
#include "fh_build_info.inc"
#include "src/registry.h"

// Declarations of every launcher this build holds, then the dispatch table.
#define FH_REGISTER_FWD(backend, dtype, head_dim, variant, name) FH_DEFINE_FWD_LAUNCHER(name);
#include "fh_registry.inc"
#undef FH_REGISTER_FWD

namespace flash_hopper {
namespace {

struct RegistryEntry {
  int32_t backend;
  int32_t dtype;
  int32_t head_dim_bucket;
  int32_t variant;  // FhVariant: one launcher may serve several (ping-pong is a runtime flag)
  FwdLauncher launch;
};

#define FH_REGISTER_FWD(backend, dtype, head_dim, variant, name) \
  {backend, dtype, head_dim, variant, &name},
constexpr RegistryEntry kRegistry[] = {
#include "fh_registry.inc"
    {-1, -1, -1, -1, nullptr},  // sentinel: keeps the array non-empty in a build with no kernels
};
#undef FH_REGISTER_FWD

constexpr int64_t kHeadDimBuckets[] = {64, 96, 128, 192, 256};
constexpr int64_t kMaxGridYZ = 65535;  // heads and batch map to gridDim.y / gridDim.z
constexpr int64_t kMaxSeqlen = INT32_MAX;

thread_local std::string g_last_error;

FhStatus fail(FhStatus status, const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  g_last_error = buf;
  return status;
}

FhStatus fail_cuda(cudaError_t err, const char* what) {
  return fail(FH_ERROR_CUDA, "%s failed: %s (%s)", what, cudaGetErrorString(err),
              cudaGetErrorName(err));
}

int64_t head_dim_bucket(int64_t head_dim) {
  for (int64_t b : kHeadDimBuckets) {
    if (head_dim <= b) {
      return b;
    }
  }
  return -1;
}

const RegistryEntry* find_kernel(int32_t backend, int32_t dtype, int64_t head_dim,
                                 int32_t variant = FH_VARIANT_TUNED) {
  const int64_t bucket = head_dim_bucket(head_dim);
  for (const RegistryEntry& e : kRegistry) {
    if (e.launch != nullptr && e.backend == backend && e.dtype == dtype &&
        e.head_dim_bucket == bucket && e.variant == variant) {
      return &e;
    }
  }
  return nullptr;
}

const char* dtype_name(int32_t dtype) {
  switch (dtype) {
    case FH_DTYPE_FP16: return "fp16";
    case FH_DTYPE_BF16: return "bf16";
    case FH_DTYPE_E4M3: return "e4m3";
    case FH_DTYPE_FP32: return "fp32";
    default: return "unknown";
  }
}

const char* backend_name(int32_t backend) {
  switch (backend) {
    case FH_BACKEND_AUTO: return "auto";
    case FH_BACKEND_FA2: return "fa2";
    case FH_BACKEND_FA3: return "fa3";
    default: return "unknown";
  }
}

#define FH_CHECK(cond, ...)                                \
  do {                                                     \
    if (!(cond)) {                                         \
      return fail(FH_ERROR_INVALID_ARGUMENT, __VA_ARGS__); \
    }                                                      \
  } while (0)

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// Host-only checks, in the order documented in api.h's users' tests: ABI, dtype, shapes, head dim,
// heads, mask/scale, strides, pointers, reserved fields.
FhStatus validate(const FhFwdParams* p) {
  FH_CHECK(p != nullptr, "params: expected a non-null FhFwdParams pointer, got null");
  FH_CHECK(p->abi_version == FH_ABI_VERSION,
           "abi_version: expected %d (this library's FH_ABI_VERSION), got %d", FH_ABI_VERSION,
           p->abi_version);
  FH_CHECK(p->dtype == FH_DTYPE_FP16 || p->dtype == FH_DTYPE_BF16,
           "dtype: expected FH_DTYPE_FP16 (0) or FH_DTYPE_BF16 (1), got %d (%s)", p->dtype,
           dtype_name(p->dtype));
  FH_CHECK(p->out_dtype == p->dtype, "out_dtype: expected %d (%s, same as dtype), got %d (%s)",
           p->dtype, dtype_name(p->dtype), p->out_dtype, dtype_name(p->out_dtype));

  FH_CHECK(p->batch >= 0 && p->batch <= kMaxGridYZ, "batch: expected 0..%lld, got %lld",
           (long long)kMaxGridYZ, (long long)p->batch);
  FH_CHECK(p->seqlen_q >= 0 && p->seqlen_q <= kMaxSeqlen, "seqlen_q: expected 0..%lld, got %lld",
           (long long)kMaxSeqlen, (long long)p->seqlen_q);
  FH_CHECK(p->seqlen_k >= 0 && p->seqlen_k <= kMaxSeqlen, "seqlen_k: expected 0..%lld, got %lld",
           (long long)kMaxSeqlen, (long long)p->seqlen_k);
  FH_CHECK(p->heads_q >= 1 && p->heads_q <= kMaxGridYZ, "heads_q: expected 1..%lld, got %lld",
           (long long)kMaxGridYZ, (long long)p->heads_q);
  FH_CHECK(p->heads_kv >= 1 && p->heads_kv <= p->heads_q,
           "heads_kv: expected 1..heads_q (%lld), got %lld", (long long)p->heads_q,
           (long long)p->heads_kv);
  FH_CHECK(p->heads_q % p->heads_kv == 0,
           "heads_kv: expected a divisor of heads_q (%lld) for GQA/MQA, got %lld",
           (long long)p->heads_q, (long long)p->heads_kv);
  FH_CHECK(p->head_dim >= 8 && p->head_dim <= 256 && p->head_dim % 8 == 0,
           "head_dim: expected a multiple of 8 in 8..256, got %lld", (long long)p->head_dim);
  FH_CHECK(p->head_dim_v == p->head_dim,
           "head_dim_v: expected %lld (== head_dim; asymmetric head dims are not supported yet), "
           "got %lld",
           (long long)p->head_dim, (long long)p->head_dim_v);

  FH_CHECK(std::isfinite(p->softmax_scale) && p->softmax_scale > 0.f,
           "softmax_scale: expected a finite positive float, got %g", (double)p->softmax_scale);
  FH_CHECK(std::isfinite(p->softcap) && p->softcap >= 0.f,
           "softcap: expected a finite float >= 0 (0 = off), got %g", (double)p->softcap);
  FH_CHECK(p->window_left >= -1, "window_left: expected -1 (unbounded) or >= 0, got %lld",
           (long long)p->window_left);
  FH_CHECK(p->window_right >= -1, "window_right: expected -1 (unbounded) or >= 0, got %lld",
           (long long)p->window_right);

  // cp.async and TMA move 16-byte vectors: every row and head start must be 16-byte aligned.
  const int64_t strides[] = {p->q_batch_stride, p->q_row_stride, p->q_head_stride,
                             p->k_batch_stride, p->k_row_stride, p->k_head_stride,
                             p->v_batch_stride, p->v_row_stride, p->v_head_stride,
                             p->o_batch_stride, p->o_row_stride, p->o_head_stride};
  const char* stride_names[] = {"q_batch_stride", "q_row_stride", "q_head_stride",
                                "k_batch_stride", "k_row_stride", "k_head_stride",
                                "v_batch_stride", "v_row_stride", "v_head_stride",
                                "o_batch_stride", "o_row_stride", "o_head_stride"};
  for (int i = 0; i < 12; ++i) {
    FH_CHECK(strides[i] % 8 == 0,
             "%s: expected a multiple of 8 elements (16-byte aligned rows), got %lld",
             stride_names[i], (long long)strides[i]);
  }

  const bool empty = p->batch == 0 || p->seqlen_q == 0;
  if (!empty) {
    FH_CHECK(p->q != nullptr, "q: expected a device pointer, got null");
    FH_CHECK(p->o != nullptr, "o: expected a device pointer, got null");
    FH_CHECK(aligned16(p->q), "q: expected a 16-byte aligned pointer, got %p", p->q);
    FH_CHECK(aligned16(p->o), "o: expected a 16-byte aligned pointer, got %p", p->o);
    if (p->seqlen_k > 0) {
      FH_CHECK(p->k != nullptr, "k: expected a device pointer, got null");
      FH_CHECK(p->v != nullptr, "v: expected a device pointer, got null");
      FH_CHECK(aligned16(p->k), "k: expected a 16-byte aligned pointer, got %p", p->k);
      FH_CHECK(aligned16(p->v), "v: expected a 16-byte aligned pointer, got %p", p->v);
    }
  }

  if (p->cu_seqlens_q || p->cu_seqlens_k || p->seqused_k) {
    return fail(FH_ERROR_UNSUPPORTED,
                "cu_seqlens_q/cu_seqlens_k/seqused_k: expected null (varlen is not implemented "
                "yet), got a pointer");
  }
  if (p->page_table || p->page_size != 0 || p->page_table_batch_stride != 0) {
    return fail(FH_ERROR_UNSUPPORTED,
                "page_table/page_size: expected null/0 (paged KV is not implemented yet), got "
                "page_size %lld",
                (long long)p->page_size);
  }
  if (p->q_descale || p->k_descale || p->v_descale) {
    return fail(FH_ERROR_UNSUPPORTED,
                "q_descale/k_descale/v_descale: expected null (FP8 is not implemented yet), got "
                "a pointer");
  }
  if (p->num_splits > 1 || p->o_accum || p->lse_accum) {
    return fail(FH_ERROR_UNSUPPORTED,
                "num_splits: expected 0 or 1 (split-KV is not implemented yet), got %d",
                p->num_splits);
  }
  FH_CHECK(p->backend == FH_BACKEND_AUTO || p->backend == FH_BACKEND_FA2 ||
               p->backend == FH_BACKEND_FA3,
           "backend: expected FH_BACKEND_AUTO (0), FA2 (1) or FA3 (2), got %d", p->backend);
  FH_CHECK(p->variant >= FH_VARIANT_TUNED && p->variant <= FH_VARIANT_NO_PINGPONG_NO_OVERLAP,
           "variant: expected 0 (tuned) .. 3 (FhVariant), got %d", p->variant);
  FH_CHECK(p->variant == FH_VARIANT_TUNED || p->backend == FH_BACKEND_FA3,
           "variant: ablation variant %d needs backend FH_BACKEND_FA3 (2), got backend %d",
           p->variant, p->backend);
  return FH_SUCCESS;
}

struct DeviceInfo {
  int major = 0;
  int minor = 0;
  int sm_count = 0;
  int max_smem_optin = 0;
};

FhStatus query_device(DeviceInfo* info) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) {
    return fail_cuda(err, "cudaGetDevice");
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
  return FH_SUCCESS;
}

// The fa3 path loads q, k and v with TMA, whose descriptors need a positive stride on every
// dimension that is stepped along; a broadcast (expand()ed) tensor has stride 0 there and runs on
// fa2, which reads through pointers. Returns the first offending stride field, or null.
struct StrideProblem {
  const char* field;
  int64_t stride;
  int64_t extent;
};

bool fa3_layout_problem(const FhFwdParams* p, StrideProblem* problem) {
  const StrideProblem checks[] = {
      {"q_batch_stride", p->q_batch_stride, p->batch},
      {"q_row_stride", p->q_row_stride, p->seqlen_q},
      {"q_head_stride", p->q_head_stride, p->heads_q},
      {"k_batch_stride", p->k_batch_stride, p->batch},
      {"k_row_stride", p->k_row_stride, p->seqlen_k},
      {"k_head_stride", p->k_head_stride, p->heads_kv},
      {"v_batch_stride", p->v_batch_stride, p->batch},
      {"v_row_stride", p->v_row_stride, p->seqlen_k},
      {"v_head_stride", p->v_head_stride, p->heads_kv},
  };
  for (const StrideProblem& c : checks) {
    if (c.extent > 1 && c.stride <= 0) {
      *problem = c;
      return true;
    }
  }
  return false;
}

FhStatus fail_fa3_layout(StrideProblem const& layout) {
  return fail(FH_ERROR_UNSUPPORTED,
              "%s: the fa3 path loads q/k/v with TMA, which needs a positive stride on every "
              "dimension of size > 1; got %lld on a dimension of size %lld (a broadcast tensor); "
              "make it contiguous or use backend fa2 / auto",
              layout.field, (long long)layout.stride, (long long)layout.extent);
}

FhStatus select_backend(const FhFwdParams* p, const DeviceInfo& dev, int32_t* out) {
  const int cc = dev.major * 10 + dev.minor;
  const int64_t bucket = head_dim_bucket(p->head_dim);
  StrideProblem layout{};
  const bool fa3_layout_bad = fa3_layout_problem(p, &layout);
  const bool fa3_built =
      cc == 90 && find_kernel(FH_BACKEND_FA3, p->dtype, p->head_dim, p->variant) != nullptr;
  const bool fa3_ok = fa3_built && !fa3_layout_bad;
  const bool fa2_ok = cc >= 80 && find_kernel(FH_BACKEND_FA2, p->dtype, p->head_dim) != nullptr;
  switch (p->backend) {
    case FH_BACKEND_AUTO:
      if (fa3_ok || fa2_ok) {
        *out = fa3_ok ? FH_BACKEND_FA3 : FH_BACKEND_FA2;
        return FH_SUCCESS;
      }
      break;
    case FH_BACKEND_FA3:
      if (fa3_ok) {
        *out = FH_BACKEND_FA3;
        return FH_SUCCESS;
      }
      if (cc != 90) {
        return fail(FH_ERROR_UNSUPPORTED,
                    "backend: fa3 needs a compute capability 9.0 GPU (sm90a), this one is %d.%d",
                    dev.major, dev.minor);
      }
      if (fa3_layout_bad) {
        return fail_fa3_layout(layout);
      }
      break;
    case FH_BACKEND_FA2:
      if (fa2_ok) {
        *out = FH_BACKEND_FA2;
        return FH_SUCCESS;
      }
      if (cc < 80) {
        return fail(FH_ERROR_UNSUPPORTED,
                    "backend: fa2 needs compute capability >= 8.0, this GPU is %d.%d", dev.major,
                    dev.minor);
      }
      break;
  }
  if (cc < 80) {
    return fail(FH_ERROR_UNSUPPORTED,
                "device: flash-hopper needs compute capability >= 8.0, this GPU is %d.%d",
                dev.major, dev.minor);
  }
  if (fa3_layout_bad && fa3_built) {
    return fail_fa3_layout(layout);  // auto: fa3 is built but cannot load it, no fa2 kernel
  }
  if (p->variant != FH_VARIANT_TUNED) {
    return fail(FH_ERROR_UNSUPPORTED,
                "variant: this build has no fa3 ablation variant %d for dtype %s, head_dim %lld; "
                "rebuild with it in FH_FA3_ABLATION_DTYPES / FH_FA3_ABLATION_HEAD_DIMS",
                p->variant, dtype_name(p->dtype), (long long)p->head_dim);
  }
  return fail(FH_ERROR_UNSUPPORTED,
              "backend %s: this build has no kernel for dtype %s, head_dim %lld (bucket %lld); "
              "rebuild with it in FH_DTYPES / FH_HEAD_DIMS / FH_ARCHS",
              backend_name(p->backend), dtype_name(p->dtype), (long long)p->head_dim,
              (long long)bucket);
}

FwdParams derive(const FhFwdParams* p, const DeviceInfo& dev) {
  constexpr float kLog2e = 1.4426950408889634f;
  FwdParams k{};
  k.q = p->q;
  k.k = p->k;
  k.v = p->v;
  k.o = p->o;
  k.lse = p->lse;
  k.batch = int(p->batch);
  k.seqlen_q = int(p->seqlen_q);
  k.seqlen_k = int(p->seqlen_k);
  k.heads_q = int(p->heads_q);
  k.heads_kv = int(p->heads_kv);
  k.heads_per_kv = int(p->heads_q / p->heads_kv);
  k.head_dim = int(p->head_dim);
  k.q_batch_stride = p->q_batch_stride;
  k.q_row_stride = p->q_row_stride;
  k.q_head_stride = p->q_head_stride;
  k.k_batch_stride = p->k_batch_stride;
  k.k_row_stride = p->k_row_stride;
  k.k_head_stride = p->k_head_stride;
  k.v_batch_stride = p->v_batch_stride;
  k.v_row_stride = p->v_row_stride;
  k.v_head_stride = p->v_head_stride;
  k.o_batch_stride = p->o_batch_stride;
  k.o_row_stride = p->o_row_stride;
  k.o_head_stride = p->o_head_stride;
  k.lse_batch_stride = p->lse_batch_stride;
  k.lse_head_stride = p->lse_head_stride;
  if (p->softcap > 0.f) {
    k.softcap = p->softcap;
    k.softcap_prescale = p->softmax_scale / p->softcap;
    k.scale_log2 = kLog2e;
    k.lse_scale = 1.f;
  } else {
    k.softcap = 0.f;
    k.softcap_prescale = 0.f;
    k.scale_log2 = p->softmax_scale * kLog2e;
    k.lse_scale = p->softmax_scale;
  }
  // A window wider than the sequence is the same as no bound: keep the int32 math overflow-free.
  k.window_left = p->window_left >= p->seqlen_k + p->seqlen_q ? -1 : int(p->window_left);
  k.window_right = p->window_right >= p->seqlen_k + p->seqlen_q ? -1 : int(p->window_right);
  k.num_sms = p->num_sms > 0 ? p->num_sms : dev.sm_count;
  k.variant = p->variant;
  return k;
}

}  // namespace
}  // namespace flash_hopper

using namespace flash_hopper;

extern "C" {

FH_EXPORT FhStatus fh_fwd_select_backend(const FhFwdParams* params, int32_t* backend_out) {
  g_last_error.clear();
  FhStatus st = validate(params);
  if (st != FH_SUCCESS) {
    return st;
  }
  if (backend_out == nullptr) {
    return fail(FH_ERROR_INVALID_ARGUMENT, "backend_out: expected a non-null pointer, got null");
  }
  DeviceInfo dev;
  st = query_device(&dev);
  if (st != FH_SUCCESS) {
    return st;
  }
  return select_backend(params, dev, backend_out);
}

FH_EXPORT FhStatus fh_fwd(const FhFwdParams* params, void* stream) {
  g_last_error.clear();
  FhStatus st = validate(params);
  if (st != FH_SUCCESS) {
    return st;
  }
  if (params->batch == 0 || params->seqlen_q == 0) {
    return FH_SUCCESS;  // nothing to compute
  }
  DeviceInfo dev;
  st = query_device(&dev);
  if (st != FH_SUCCESS) {
    return st;
  }
  int32_t backend = FH_BACKEND_AUTO;
  st = select_backend(params, dev, &backend);
  if (st != FH_SUCCESS) {
    return st;
  }
  const RegistryEntry* entry = find_kernel(backend, params->dtype, params->head_dim, params->variant);
  const FwdParams kparams = derive(params, dev);
  // FH_DEBUG_SMEM_LIMIT (bytes) lowers the shared-memory limit that tile selection sees, so a large
  // GPU can run and test the configs meant for smaller ones (e.g. 101376 = sm86/sm89's opt-in).
  int smem_limit = dev.max_smem_optin;
  if (const char* env = std::getenv("FH_DEBUG_SMEM_LIMIT")) {
    const int v = std::atoi(env);
    if (v > 0 && v < smem_limit) {
      smem_limit = v;
    }
  }
  cudaError_t err = entry->launch(kparams, smem_limit, static_cast<cudaStream_t>(stream));
  if (err == cudaErrorInvalidPitchValue) {
    return fail(FH_ERROR_UNSUPPORTED,
                "strides: the fa3 path's TMA needs every q/k/v row, head and batch stride to be a "
                "positive multiple of 16 bytes below 2^40 bytes");
  }
  if (err == cudaErrorInvalidConfiguration) {
    return fail(FH_ERROR_UNSUPPORTED,
                "head_dim %lld: no %s tile config fits this GPU's %d bytes of shared memory per "
                "block",
                (long long)params->head_dim, backend_name(backend), smem_limit);
  }
  if (err != cudaSuccess) {
    return fail_cuda(err, "kernel launch");
  }
  return FH_SUCCESS;
}

FH_EXPORT const char* fh_last_error(void) { return g_last_error.c_str(); }

FH_EXPORT int32_t fh_abi_version(void) { return FH_ABI_VERSION; }

FH_EXPORT const char* fh_build_info(void) { return FH_BUILD_INFO_JSON; }

FH_EXPORT int32_t fh_has_fwd_kernel(int32_t backend, int32_t dtype, int64_t head_dim) {
  return find_kernel(backend, dtype, head_dim) != nullptr ? 1 : 0;
}

}  // extern "C"
