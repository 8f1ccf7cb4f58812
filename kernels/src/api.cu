// The C ABI: validate FhFwdParams / FhBwdParams, choose the backend, derive the kernel-side
// FwdParams / BwdParams, launch.
//
// Validation runs entirely on the host before any CUDA call, so a bad argument is reported with
// the field's name, the expected and the given value, and nothing is launched. Python validates
// tensors first (python/flash_hopper/_validate.py, tensor-level messages, once per call signature);
// this layer protects every other caller of the ABI.
//
// The backend policy lives here and only here (select_backend, select_bwd_backend). fh_fwd and
// fh_bwd apply it to the current device; fh_fwd_select_backend and fh_bwd_select_backend expose it
// for any compute capability, which is how Python's which_backend, its plan cache and
// `flash-hopper info` ask it instead of re-implementing it.
//
// The backward's workspace layout (api.h) is computed in one place, bwd_workspace(), which both
// fh_bwd_workspace_size and the carving of BwdParams' workspace pointers use.
//
// The tables (head-dim buckets, dtype names, FA-3 variant names, arch names) come from
// kernels/src/tables.cmake through the generated fh_tables.inc; the launchers from fh_registry.inc.
#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // cuda.h's driver types and PFN_cuTensorMapEncodeTiled_v12000

#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "flash_hopper/api.h"
#include "flash_hopper/bwd_params.h"
#include "flash_hopper/fwd_params.h"
#include "fh_tables.inc"
#include "sm90/timeline.h"  // kTimelineBytes (fh_debug_set_timeline)
#include "src/bwd_common.h"
#include "src/decode.h"
#include "flash_hopper/decode_plan.h"
#include "src/registry.h"

// Declarations of every launcher this build holds, then the dispatch tables. Each inclusion of
// fh_registry.inc defines both row macros (the one a table does not want as empty).
#define FH_REGISTER_FWD(backend, dtype, kv_dtype, head_dim, variant, name) \
  FH_DEFINE_FWD_LAUNCHER(name);
#define FH_REGISTER_BWD(backend, dtype, head_dim, name) FH_DEFINE_BWD_LAUNCHER(name);
#include "fh_registry.inc"
#undef FH_REGISTER_FWD
#undef FH_REGISTER_BWD

namespace flash_hopper {

#if !FH_BWD_COMMON_BUILT
// A build without FH_DIRECTIONS bwd has no backward kernel, so the policy never selects one and
// these never run; they stand in for bwd_common.cu so that the library links.
LaunchResult launch_bwd_preprocess(BwdParams const&, int32_t, cudaStream_t) {
  return LaunchResult::internal("backward preprocess in a build without FH_DIRECTIONS bwd");
}
#endif

namespace {

struct RegistryEntry {
  int32_t backend;
  int32_t dtype;
  int32_t kv_dtype;  // dtype's, but for the mixed mode's kernels (FP8 K / V)
  int32_t head_dim_bucket;
  int32_t variant;  // FhVariant: one launcher may serve several (runtime flags)
  FwdLauncher launch;
};

#define FH_REGISTER_FWD(backend, dtype, kv_dtype, head_dim, variant, name) \
  {backend, dtype, kv_dtype, head_dim, variant, &name},
#define FH_REGISTER_BWD(backend, dtype, head_dim, name)
constexpr RegistryEntry kRegistry[] = {
#include "fh_registry.inc"
    {-1, -1, -1, -1, -1, nullptr},  // sentinel: keeps the array non-empty in a build with no kernels
};
#undef FH_REGISTER_FWD
#undef FH_REGISTER_BWD

struct BwdRegistryEntry {
  int32_t backend;
  int32_t dtype;
  int32_t head_dim_bucket;
  BwdLauncher launch;
};

#define FH_REGISTER_FWD(backend, dtype, kv_dtype, head_dim, variant, name)
#define FH_REGISTER_BWD(backend, dtype, head_dim, name) {backend, dtype, head_dim, &name},
constexpr BwdRegistryEntry kBwdRegistry[] = {
#include "fh_registry.inc"
    {-1, -1, -1, nullptr},  // sentinel, as above (a build without backward kernels)
};
#undef FH_REGISTER_FWD
#undef FH_REGISTER_BWD

constexpr int64_t kHeadDimBuckets[] = {FH_HEAD_DIM_BUCKETS};
constexpr int kNumBuckets = sizeof(kHeadDimBuckets) / sizeof(kHeadDimBuckets[0]);
constexpr int64_t kMaxHeadDim = kHeadDimBuckets[kNumBuckets - 1];
constexpr int64_t kHeadDimMultiple = 8;  // 16-byte rows of 2-byte elements
constexpr int64_t kMaxGridYZ = 65535;    // heads and batch map to gridDim.y / gridDim.z
constexpr int64_t kMaxSeqlen = INT32_MAX;

constexpr const char* kVariantNames[] = {FH_FA3_VARIANT_NAMES};
constexpr int kNumVariants = sizeof(kVariantNames) / sizeof(kVariantNames[0]);
static_assert(kNumVariants == (FH_VARIANT_FLAG_NO_PINGPONG | FH_VARIANT_FLAG_NO_OVERLAP) + 1,
              "kernels/src/tables.cmake must list one FA-3 variant per set of FH_VARIANT_FLAG_*");
static_assert(FH_VARIANT_NO_PINGPONG_NO_OVERLAP == kNumVariants - 1,
              "FhVariant (api.h) and the variant table disagree");

thread_local std::string g_last_error;
// fh_debug_set_timeline's buffer (FH_TIMELINE builds; null otherwise and by default).
thread_local unsigned long long* g_timeline = nullptr;

std::string vformat(const char* fmt, va_list args) {
  char buf[1024];
  vsnprintf(buf, sizeof(buf), fmt, args);
  return buf;
}

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

FhStatus fail_cuda(cudaError_t err, const char* what) {
  if (err == cudaErrorInsufficientDriver || err == cudaErrorCallRequiresNewerDriver) {
    return fail_driver(err, what);
  }
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

// kv_dtype: the K / V dtype (the mixed mode's kernels); -1: dtype's.
const RegistryEntry* find_kernel(int32_t backend, int32_t dtype, int64_t head_dim,
                                 int32_t variant, int32_t kv_dtype = -1) {
  const int64_t bucket = head_dim_bucket(head_dim);
  const int32_t kv = kv_dtype < 0 ? dtype : kv_dtype;
  for (const RegistryEntry& e : kRegistry) {
    if (e.launch != nullptr && e.backend == backend && e.dtype == dtype && e.kv_dtype == kv &&
        e.head_dim_bucket == bucket && e.variant == variant) {
      return &e;
    }
  }
  return nullptr;
}

const BwdRegistryEntry* find_bwd_kernel(int32_t backend, int32_t dtype, int64_t head_dim) {
  const int64_t bucket = head_dim_bucket(head_dim);
  for (const BwdRegistryEntry& e : kBwdRegistry) {
    if (e.launch != nullptr && e.backend == backend && e.dtype == dtype &&
        e.head_dim_bucket == bucket) {
      return &e;
    }
  }
  return nullptr;
}

// Whether the source tree has a backward for the path at all (tables.cmake's direction table), as
// opposed to this build leaving it out: decides between "not implemented" and "rebuild with".
bool path_has_backward(int32_t backend) {
#define FH_BWD_PATH(value) \
  if (backend == value) {  \
    return true;           \
  }
  FH_BWD_PATHS(FH_BWD_PATH)
#undef FH_BWD_PATH
  return false;
}

// Whether the FA-3 path's backward has a tile for head_dim's bucket in the source tree
// (CMakeLists.txt FH_SM90_BWD_HEAD_DIMS, kernels/sm90/bwd_tile_config.h), whatever this build
// compiled; and the list of those buckets for messages.
bool fa3_bwd_covers(int64_t head_dim) {
  const int64_t bucket = head_dim_bucket(head_dim);
#define FH_FA3_BWD_BUCKET(value) \
  if (bucket == value) {         \
    return path_has_backward(FH_BACKEND_FA3); \
  }
  FH_FA3_BWD_HEAD_DIMS(FH_FA3_BWD_BUCKET)
#undef FH_FA3_BWD_BUCKET
  return false;
}

std::string fa3_bwd_buckets() {
  std::string list;
#define FH_FA3_BWD_BUCKET_NAME(value) \
  list += (list.empty() ? "" : ", ") + std::to_string(value);
  FH_FA3_BWD_HEAD_DIMS(FH_FA3_BWD_BUCKET_NAME)
#undef FH_FA3_BWD_BUCKET_NAME
  return list;
}

// Head-dim bucket lists of the source tree (FH_DTYPE_TABLE / FH_MIXED_TABLE in
// kernels/src/tables.cmake), whatever this build compiled: the FA-3 path's FP8 (e4m3) forward
// tiles and the mixed mode's.
#define FH_LIST_ITEM(value) value,
constexpr int64_t kFp8Buckets[] = {FH_FP8_HEAD_DIMS(FH_LIST_ITEM)};
constexpr int64_t kMixedBuckets[] = {FH_MIXED_HEAD_DIMS(FH_LIST_ITEM)};
#undef FH_LIST_ITEM

// Whether head_dim's bucket is in a list; the list for messages ("64, 128, 256").
template <size_t N>
bool bucket_listed(int64_t head_dim, const int64_t (&buckets)[N]) {
  const int64_t bucket = head_dim_bucket(head_dim);
  for (int64_t b : buckets) {
    if (b == bucket) {
      return true;
    }
  }
  return false;
}

template <size_t N>
std::string bucket_names(const int64_t (&buckets)[N]) {
  std::string list;
  for (int64_t b : buckets) {
    list += (list.empty() ? "" : ", ") + std::to_string(b);
  }
  return list;
}

bool fp8_covers(int64_t head_dim) { return bucket_listed(head_dim, kFp8Buckets); }
std::string fp8_buckets() { return bucket_names(kFp8Buckets); }
bool mixed_covers(int64_t head_dim) { return bucket_listed(head_dim, kMixedBuckets); }
std::string mixed_buckets() { return bucket_names(kMixedBuckets); }

// The mixed mode's FH_DTYPES name ("bf16+e4m3") of a (q, K / V) dtype pair, or null.
const char* mixed_name(int32_t dtype, int32_t kv_dtype) {
#define FH_MIXED_NAME(q_value, kv_value, name)   \
  if (dtype == q_value && kv_dtype == kv_value) { \
    return name;                                 \
  }
  FH_MIXED_TABLE(FH_MIXED_NAME)
#undef FH_MIXED_NAME
  return nullptr;
}

// Whether k / v are in another dtype than q (FhFwdParams::kv_dtype: 0 means dtype's).
bool is_mixed(const FhFwdParams* p) { return p->kv_dtype != 0 && p->kv_dtype != p->dtype; }

// The dtype's FH_DTYPES name, or null for an FhDtype without kernels.
const char* dtype_name(int32_t dtype) {
#define FH_DTYPE_NAME(value, name) \
  if (dtype == value) {            \
    return name;                   \
  }
  FH_DTYPE_TABLE(FH_DTYPE_NAME)
#undef FH_DTYPE_NAME
  return nullptr;
}

// "FH_DTYPE_FP16 (0, fp16) or FH_DTYPE_BF16 (1, bf16)", for messages.
const std::string& dtype_choices() {
  static const std::string choices = [] {
    std::string s;
#define FH_DTYPE_CHOICE(value, name) \
  s += format("%s%s (%d, %s)", s.empty() ? "" : " or ", #value, int(value), name);
    FH_DTYPE_TABLE(FH_DTYPE_CHOICE)
#undef FH_DTYPE_CHOICE
    return s;
  }();
  return choices;
}

// The FH_ARCHS value that builds a backend's kernels ("80", "90a").
const char* build_arch(int32_t backend) {
#define FH_ARCH_VALUE(value, arch, name) \
  if (backend == value) {                \
    return arch;                         \
  }
  FH_ARCH_TABLE(FH_ARCH_VALUE)
#undef FH_ARCH_VALUE
  return "?";
}

const char* backend_name(int32_t backend) {
  switch (backend) {
    case FH_BACKEND_AUTO: return "auto";
    case FH_BACKEND_FA2: return "fa2";
    case FH_BACKEND_FA3: return "fa3";
    default: return "unknown";
  }
}

// What the caller asked for, as Python spells it: "auto", "fa2", "fa3", "fa3-no-pingpong", ...
const char* request_name(const FhFwdParams* p) {
  return p->backend == FH_BACKEND_FA3 ? kVariantNames[p->variant] : backend_name(p->backend);
}

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

bool aligned(const void* ptr, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(ptr) & (bytes - 1)) == 0;
}

// Shapes, heads and head dim: the same rules for FhFwdParams and FhBwdParams (same field names).
template <class Params>
FhStatus validate_shapes(const Params* p) {
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
  FH_CHECK(p->head_dim >= kHeadDimMultiple && p->head_dim <= kMaxHeadDim &&
               p->head_dim % kHeadDimMultiple == 0,
           "head_dim: expected a multiple of %lld in %lld..%lld, got %lld",
           (long long)kHeadDimMultiple, (long long)kHeadDimMultiple, (long long)kMaxHeadDim,
           (long long)p->head_dim);
  FH_CHECK(p->head_dim_v == p->head_dim,
           "head_dim_v: expected %lld (== head_dim; asymmetric head dims are not supported yet), "
           "got %lld",
           (long long)p->head_dim, (long long)p->head_dim_v);
  return FH_SUCCESS;
}

// Score transform and mask: the same rules for both directions.
template <class Params>
FhStatus validate_score(const Params* p) {
  FH_CHECK(std::isfinite(p->softmax_scale) && p->softmax_scale > 0.f,
           "softmax_scale: expected a finite positive float, got %g", (double)p->softmax_scale);
  FH_CHECK(std::isfinite(p->softcap) && p->softcap >= 0.f,
           "softcap: expected a finite float >= 0 (0 = off), got %g", (double)p->softcap);
  FH_CHECK(p->window_left >= -1, "window_left: expected -1 (unbounded) or >= 0, got %lld",
           (long long)p->window_left);
  FH_CHECK(p->window_right >= -1, "window_right: expected -1 (unbounded) or >= 0, got %lld",
           (long long)p->window_right);
  return FH_SUCCESS;
}

struct NamedStride {
  const char* name;
  int64_t stride;
};

// cp.async and TMA move 16-byte vectors: every row and head start must be 16-byte aligned.
template <size_t N>
FhStatus validate_strides(const NamedStride (&strides)[N]) {
  for (const NamedStride& s : strides) {
    FH_CHECK(s.stride % 8 == 0,
             "%s: expected a multiple of 8 elements (16-byte aligned rows), got %lld", s.name,
             (long long)s.stride);
  }
  return FH_SUCCESS;
}

// q, k, v and o: the strides FhFwdParams and FhBwdParams share, under the same field names.
template <class Params>
FhStatus validate_qkvo_strides(const Params* p) {
  const NamedStride strides[] = {
      {"q_batch_stride", p->q_batch_stride}, {"q_row_stride", p->q_row_stride},
      {"q_head_stride", p->q_head_stride},   {"k_batch_stride", p->k_batch_stride},
      {"k_row_stride", p->k_row_stride},     {"k_head_stride", p->k_head_stride},
      {"v_batch_stride", p->v_batch_stride}, {"v_row_stride", p->v_row_stride},
      {"v_head_stride", p->v_head_stride},   {"o_batch_stride", p->o_batch_stride},
      {"o_row_stride", p->o_row_stride},     {"o_head_stride", p->o_head_stride},
  };
  return validate_strides(strides);
}

// A 2-byte-element tensor the kernels read or write with 16-byte vectors.
FhStatus validate_tensor(const void* ptr, const char* name) {
  FH_CHECK(ptr != nullptr, "%s: expected a device pointer, got null", name);
  FH_CHECK(aligned(ptr, 16), "%s: expected a 16-byte aligned pointer, got %p", name, ptr);
  return FH_SUCCESS;
}

// The FP8 fields: only e4m3 inputs may set them; e4m3 rows are 16-byte vectors of 16 elements
// (TMA boxes and k32 FP8 WGMMA slices), so head_dim and the q / k / v strides are multiples of 16.
// Mixed mode (16-bit q, FP8 k / v): k_descale / v_descale as for e4m3 inputs, no q_descale,
// 16-element k / v rows and strides.
FhStatus validate_fp8(const FhFwdParams* p, bool fp8, bool mixed, bool check_data) {
  const struct {
    const char* name;
    const float* ptr;
    int64_t batch_stride;
    int64_t head_stride;
  } descales[] = {
      {"q_descale", p->q_descale, p->q_descale_batch_stride, p->q_descale_head_stride},
      {"k_descale", p->k_descale, p->k_descale_batch_stride, p->k_descale_head_stride},
      {"v_descale", p->v_descale, p->v_descale_batch_stride, p->v_descale_head_stride},
  };
  if (!fp8 && !mixed) {
    for (const auto& d : descales) {
      FH_CHECK(d.ptr == nullptr,
               "%s: expected null for %s inputs (descales belong to e4m3 inputs), got %p", d.name,
               dtype_name(p->dtype), static_cast<const void*>(d.ptr));
    }
    FH_CHECK(p->fp8_accumulation == FH_FP8_ACCUM_TWO_LEVEL,
             "fp8_accumulation: expected 0 for %s inputs (it applies to e4m3 inputs), got %d",
             dtype_name(p->dtype), p->fp8_accumulation);
    return FH_SUCCESS;
  }
  const char* what = fp8 ? "e4m3 inputs" : "FP8 k / v";
  if (mixed) {
    FH_CHECK(p->q_descale == nullptr,
             "q_descale: expected null in the mixed mode (q is %s, not FP8), got %p",
             dtype_name(p->dtype), static_cast<const void*>(p->q_descale));
    FH_CHECK(p->fp8_accumulation == FH_FP8_ACCUM_TWO_LEVEL,
             "fp8_accumulation: expected 0 in the mixed mode (its GEMMs are 16-bit), got %d",
             p->fp8_accumulation);
  } else {
    FH_CHECK(p->fp8_accumulation == FH_FP8_ACCUM_TWO_LEVEL ||
                 p->fp8_accumulation == FH_FP8_ACCUM_SINGLE_LEVEL,
             "fp8_accumulation: expected FH_FP8_ACCUM_TWO_LEVEL (0) or FH_FP8_ACCUM_SINGLE_LEVEL "
             "(1), got %d",
             p->fp8_accumulation);
  }
  FH_CHECK(p->head_dim % 16 == 0,
           "head_dim: expected a multiple of 16 for %s (16-byte rows), got %lld", what,
           (long long)p->head_dim);
  // The d192 / d256 kernels' PV accumulator is split over the head dim and always two-level
  // (kernels/sm90/tile_config.h, fwd_config_fp8).
  FH_CHECK(p->fp8_accumulation == FH_FP8_ACCUM_TWO_LEVEL || p->head_dim <= 128,
           "fp8_accumulation: the single-level ablation exists for head_dim <= 128 (the d192 / "
           "d256 kernels accumulate in two levels only), got head_dim %lld",
           (long long)p->head_dim);
  const NamedStride strides[] = {
      {"q_batch_stride", p->q_batch_stride}, {"q_row_stride", p->q_row_stride},
      {"q_head_stride", p->q_head_stride},   {"k_batch_stride", p->k_batch_stride},
      {"k_row_stride", p->k_row_stride},     {"k_head_stride", p->k_head_stride},
      {"v_batch_stride", p->v_batch_stride}, {"v_row_stride", p->v_row_stride},
      {"v_head_stride", p->v_head_stride},
  };
  for (int i = mixed ? 3 : 0; i < 9; ++i) {  // the mixed mode's q is 16-bit (8-element rule)
    FH_CHECK(strides[i].stride % 16 == 0,
             "%s: expected a multiple of 16 elements for %s (16-byte aligned rows), got %lld",
             strides[i].name, what, (long long)strides[i].stride);
  }
  for (const auto& d : descales) {
    FH_CHECK(d.batch_stride >= 0 && d.head_stride >= 0,
             "%s: expected strides >= 0 (0 broadcasts), got batch stride %lld, head stride %lld",
             d.name, (long long)d.batch_stride, (long long)d.head_stride);
    if (check_data) {
      FH_CHECK(aligned(d.ptr, alignof(float)),
               "%s: expected a %d-byte aligned pointer (float) or null, got %p", d.name,
               int(alignof(float)), static_cast<const void*>(d.ptr));
    }
  }
  return FH_SUCCESS;
}

bool is_varlen(const FhFwdParams* p) {
  return p->cu_seqlens_q != nullptr || p->cu_seqlens_k != nullptr || p->seqused_q != nullptr ||
         p->seqused_k != nullptr;
}

// The varlen fields (api.h): both offsets arrays, 3-D tensors (batch strides 0), 16-bit inputs,
// and with check_data the workspace. The arrays' contents live on the device: the kernels clamp
// them to the tensors (flash_hopper/varlen.h), callers validate them.
FhStatus validate_varlen(const FhFwdParams* p, bool fp8, bool mixed, bool check_data) {
  if (!is_varlen(p)) {
    FH_CHECK(p->kv_batch_idx == nullptr && p->leftpad_k == nullptr && p->batch_k == 0,
             "kv_batch_idx / leftpad_k / batch_k: expected null / null / 0 in a dense call (the "
             "KV-cache fields belong to varlen calls: cu_seqlens_q / cu_seqlens_k), got %p / %p "
             "/ %lld",
             static_cast<const void*>(p->kv_batch_idx), static_cast<const void*>(p->leftpad_k),
             (long long)p->batch_k);
    return FH_SUCCESS;
  }
  FH_CHECK(p->cu_seqlens_q != nullptr && p->cu_seqlens_k != nullptr,
           "cu_seqlens_q / cu_seqlens_k: expected both (a varlen call; seqused_k without "
           "cu_seqlens_k is the paged KV call, not implemented yet), got %s",
           p->cu_seqlens_q ? "cu_seqlens_k null" : "cu_seqlens_q null");
  const NamedStride batch_strides[] = {
      {"q_batch_stride", p->q_batch_stride},     {"k_batch_stride", p->k_batch_stride},
      {"v_batch_stride", p->v_batch_stride},     {"o_batch_stride", p->o_batch_stride},
      {"lse_batch_stride", p->lse_batch_stride},
  };
  for (const NamedStride& st : batch_strides) {
    FH_CHECK(st.stride == 0,
             "%s: expected 0 in a varlen call (packed tensors have no batch axis), got %lld",
             st.name, (long long)st.stride);
  }
  if (mixed) {
    return fail(FH_ERROR_UNSUPPORTED,
                "cu_seqlens_q: varlen with mixed-mode inputs (16-bit q, FP8 k / v) is not "
                "implemented yet (16-bit or FP8 e4m3 q / k / v)");
  }
  if ((p->variant & FH_VARIANT_FLAG_NO_OVERLAP) != 0) {
    return fail(FH_ERROR_UNSUPPORTED,
                "variant: %d (%s) has no varlen kernel (the FA-3 ablation kernels are dense "
                "only); varlen takes the tuned kernel (0) or fa3-no-pingpong (1)",
                p->variant, kVariantNames[p->variant]);
  }
  if (p->kv_batch_idx != nullptr) {
    FH_CHECK(p->batch_k >= 1 && p->batch_k <= INT32_MAX - 1,
             "batch_k: expected the cache's entries (>= 1; cu_seqlens_k holds batch_k + 1 "
             "offsets) with kv_batch_idx, got %lld",
             (long long)p->batch_k);
  } else {
    FH_CHECK(p->batch_k == 0,
             "batch_k: expected 0 without kv_batch_idx (cu_seqlens_k then holds batch + 1 "
             "offsets), got %lld",
             (long long)p->batch_k);
  }
  FH_CHECK(p->max_seqlen_q >= 0 && p->max_seqlen_k >= 0,
           "max_seqlen_q / max_seqlen_k: expected >= 0 (0 = unknown), got %lld / %lld",
           (long long)p->max_seqlen_q, (long long)p->max_seqlen_k);
  if (check_data) {
    const int32_t* arrays[] = {p->cu_seqlens_q, p->cu_seqlens_k, p->seqused_q,
                               p->seqused_k,    p->kv_batch_idx, p->leftpad_k};
    const char* names[] = {"cu_seqlens_q", "cu_seqlens_k",  "seqused_q",
                           "seqused_k",    "kv_batch_idx", "leftpad_k"};
    for (int i = 0; i < 6; ++i) {
      FH_CHECK(aligned(arrays[i], alignof(int32_t)),
               "%s: expected a 4-byte aligned int32 pointer, got %p", names[i],
               static_cast<const void*>(arrays[i]));
    }
    const int64_t need = varlen_workspace_bytes(p->seqlen_q, p->batch);
    FH_CHECK(p->workspace != nullptr && aligned(p->workspace, 16),
             "workspace: expected a 16-byte aligned device pointer (a varlen call's work list, "
             "fh_fwd_workspace_size bytes), got %p",
             p->workspace);
    FH_CHECK(p->workspace_bytes >= need,
             "workspace_bytes: expected >= %lld (fh_fwd_workspace_size), got %lld",
             (long long)need, (long long)p->workspace_bytes);
  }
  return FH_SUCCESS;
}

// Host-only checks: ABI, dtype, shapes, head dim, heads, scale/mask, strides, pointers (only with
// check_data: the policy alone does not read them), varlen, reserved fields, dispatch fields.
FhStatus validate(const FhFwdParams* p, bool check_data) {
  FH_CHECK(p != nullptr, "params: expected a non-null FhFwdParams pointer, got null");
  FH_CHECK(p->abi_version == FH_ABI_VERSION,
           "abi_version: expected %d (this library's FH_ABI_VERSION), got %d", FH_ABI_VERSION,
           p->abi_version);
  const char* dtype = dtype_name(p->dtype);
  FH_CHECK(dtype != nullptr, "dtype: expected %s, got %d", dtype_choices().c_str(), p->dtype);
  const bool fp8 = p->dtype == FH_DTYPE_E4M3;
  const bool mixed = is_mixed(p);
  FH_CHECK(!mixed || mixed_name(p->dtype, p->kv_dtype) != nullptr,
           "kv_dtype: expected 0 or %d (%s, same as dtype), or FH_DTYPE_E4M3 (2) or FH_DTYPE_E5M2 "
           "(4) with fp16 / bf16 q (the mixed mode), got %d",
           p->dtype, dtype, p->kv_dtype);
  if (fp8) {
    FH_CHECK(p->out_dtype == FH_DTYPE_BF16 || p->out_dtype == FH_DTYPE_FP16,
             "out_dtype: expected FH_DTYPE_BF16 (1) or FH_DTYPE_FP16 (0) for e4m3 inputs, got %d",
             p->out_dtype);
  } else {
    FH_CHECK(p->out_dtype == p->dtype, "out_dtype: expected %d (%s, same as dtype), got %d",
             p->dtype, dtype, p->out_dtype);
  }
  FH_TRY(validate_shapes(p));
  FH_TRY(validate_score(p));
  FH_TRY(validate_qkvo_strides(p));
  FH_TRY(validate_fp8(p, fp8, mixed, check_data));

  const bool empty = p->batch == 0 || p->seqlen_q == 0;
  if (check_data && !empty) {
    FH_TRY(validate_tensor(p->q, "q"));
    FH_TRY(validate_tensor(p->o, "o"));
    if (p->seqlen_k > 0) {
      FH_TRY(validate_tensor(p->k, "k"));
      FH_TRY(validate_tensor(p->v, "v"));
    }
    FH_CHECK(aligned(p->lse, alignof(float)),
             "lse: expected a %d-byte aligned pointer (float) or null, got %p",
             int(alignof(float)), static_cast<const void*>(p->lse));
  }

  FH_TRY(validate_varlen(p, fp8, mixed, check_data && !empty));
  if (p->page_table || p->page_size != 0 || p->page_table_batch_stride != 0) {
    return fail(FH_ERROR_UNSUPPORTED,
                "page_table/page_size: expected null/0 (paged KV is not implemented yet), got "
                "page_size %lld",
                (long long)p->page_size);
  }
  if (p->num_splits > 1 || p->o_accum || p->lse_accum) {
    return fail(FH_ERROR_UNSUPPORTED,
                "num_splits: expected 0 or 1 (split-KV is not implemented yet), got %d",
                p->num_splits);
  }
  FH_CHECK(p->backend == FH_BACKEND_AUTO || p->backend == FH_BACKEND_FA2 ||
               p->backend == FH_BACKEND_FA3,
           "backend: expected FH_BACKEND_AUTO (0), FA2 (1) or FA3 (2), got %d", p->backend);
  FH_CHECK(p->variant >= 0 && p->variant < kNumVariants,
           "variant: expected an FhVariant 0 (tuned) .. %d (%s), got %d", kNumVariants - 1,
           kVariantNames[kNumVariants - 1], p->variant);
  FH_CHECK(p->variant == FH_VARIANT_TUNED || p->backend == FH_BACKEND_FA3,
           "variant: %d (%s) is a variant of the fa3 path and needs backend FH_BACKEND_FA3 (2), "
           "got backend %d (%s)",
           p->variant, kVariantNames[p->variant], p->backend, backend_name(p->backend));
  FH_CHECK(p->num_sms >= 0, "num_sms: expected 0 (every SM) or a positive cap, got %d",
           p->num_sms);
  return FH_SUCCESS;
}

// The backward's workspace for a validated FhBwdParams: byte offsets of the four regions api.h
// documents (bwd_params.h names them) from the workspace's start, and its size. The one place
// that knows the layout: fh_bwd_workspace_size reports `bytes`, derive_bwd carves the pointers.
struct BwdWorkspace {
  int64_t seqlen_q_rounded = 0;  // round_up(seqlen_q, kBwdRowPad)
  int64_t head_dim_rounded = 0;  // the head-dim bucket
  int64_t dq_accum = 0;          // fp32 (batch, heads_q, seqlen_q_rounded, head_dim_rounded)
  int64_t lse_log2 = 0;          // fp32 (batch, heads_q, seqlen_q_rounded)
  int64_t dpsum = 0;             // fp32 (batch, heads_q, seqlen_q_rounded)
  int64_t semaphores = 0;        // int32 (batch, heads_q, seqlen_q_rounded / kBwdSemaphoreRows)
  int64_t bytes = 0;             // the end of the last region
};

// Every region starts 256-byte aligned: the kernels' widest accesses (bulk copies, float4) and
// the caller's allocator (torch's blocks are 512-byte aligned) both agree with that.
constexpr int64_t kWorkspaceAlign = 256;

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// False when a size overflows int64 (a problem far larger than any GPU's memory).
bool bwd_workspace(const FhBwdParams* p, BwdWorkspace* ws) {
  ws->seqlen_q_rounded = round_up(p->seqlen_q, kBwdRowPad);
  ws->head_dim_rounded = head_dim_bucket(p->head_dim);
  int64_t rows = 0;  // batch * heads_q * seqlen_q_rounded
  int64_t accum_bytes = 0;
  if (__builtin_mul_overflow(p->batch * p->heads_q, ws->seqlen_q_rounded, &rows) ||
      __builtin_mul_overflow(rows, ws->head_dim_rounded * 4, &accum_bytes)) {
    return false;
  }
  // Sizes in bytes; rows * 4 cannot overflow where accum_bytes did not.
  const int64_t region_bytes[] = {
      accum_bytes,                   // dq_accum
      rows * 4,                      // lse_log2
      rows * 4,                      // dpsum
      rows / kBwdSemaphoreRows * 4,  // semaphores
  };
  int64_t* const starts[] = {&ws->dq_accum, &ws->lse_log2, &ws->dpsum, &ws->semaphores};
  int64_t offset = 0;
  for (int i = 0; i < 4; ++i) {
    offset = round_up(offset, kWorkspaceAlign);
    *starts[i] = offset;
    if (__builtin_add_overflow(offset, region_bytes[i], &offset) ||
        offset > INT64_MAX - kWorkspaceAlign) {
      return false;
    }
  }
  ws->bytes = offset;
  return true;
}

// The reserved fields of FhBwdParams (api.h): each is rejected by name until its feature lands.
FhStatus validate_bwd_reserved(const FhBwdParams* p) {
  const struct {
    const char* name;
    bool set;
    const char* feature;
  } reserved[] = {
      {"cu_seqlens_q", p->cu_seqlens_q != nullptr, "varlen"},
      {"cu_seqlens_k", p->cu_seqlens_k != nullptr, "varlen"},
      {"seqused_q", p->seqused_q != nullptr, "varlen"},
      {"seqused_k", p->seqused_k != nullptr, "varlen"},
      {"sinks", p->sinks != nullptr, "attention sinks"},
      {"dsinks", p->dsinks != nullptr, "attention sinks"},
  };
  for (const auto& r : reserved) {
    if (r.set) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "%s: expected null (%s is not implemented yet in the backward), got a pointer",
                  r.name, r.feature);
    }
  }
  const struct {
    const char* name;
    int64_t value;
    const char* feature;
  } reserved_values[] = {
      {"max_seqlen_q", p->max_seqlen_q, "varlen"},
      {"max_seqlen_k", p->max_seqlen_k, "varlen"},
      {"attention_chunk", p->attention_chunk, "chunked-local attention"},
  };
  for (const auto& r : reserved_values) {
    if (r.value != 0) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "%s: expected 0 (%s is not implemented yet in the backward), got %lld", r.name,
                  r.feature, (long long)r.value);
    }
  }
  return FH_SUCCESS;
}

// The backward's host-only checks, in the forward's order: ABI, dtype, mode, shapes, scale/mask,
// strides, workspace size, pointers and workspace (only with check_data: the policy and the
// workspace size do not read them), reserved fields, dispatch fields.
FhStatus validate(const FhBwdParams* p, bool check_data) {
  FH_CHECK(p != nullptr, "params: expected a non-null FhBwdParams pointer, got null");
  FH_CHECK(p->abi_version == FH_ABI_VERSION,
           "abi_version: expected %d (this library's FH_ABI_VERSION), got %d", FH_ABI_VERSION,
           p->abi_version);
  FH_CHECK(dtype_name(p->dtype) != nullptr && p->dtype != FH_DTYPE_E4M3,
           "dtype: expected FH_DTYPE_FP16 (0) or FH_DTYPE_BF16 (1) (the backward has no FP8), "
           "got %d",
           p->dtype);
  FH_CHECK(p->deterministic == 0 || p->deterministic == 1,
           "deterministic: expected 0 or 1 (bitwise-reproducible dq), got %d", p->deterministic);
  FH_TRY(validate_shapes(p));
  // BwdParams counts the padded rows in int32.
  constexpr int64_t kMaxBwdSeqlenQ = kMaxSeqlen / kBwdRowPad * kBwdRowPad;
  FH_CHECK(p->seqlen_q <= kMaxBwdSeqlenQ,
           "seqlen_q: expected 0..%lld for the backward (rounded up to a multiple of %d it must "
           "fit int32), got %lld",
           (long long)kMaxBwdSeqlenQ, kBwdRowPad, (long long)p->seqlen_q);
  FH_TRY(validate_score(p));
  FH_TRY(validate_qkvo_strides(p));
  const NamedStride strides[] = {
      {"dout_batch_stride", p->dout_batch_stride}, {"dout_row_stride", p->dout_row_stride},
      {"dout_head_stride", p->dout_head_stride},   {"dq_batch_stride", p->dq_batch_stride},
      {"dq_row_stride", p->dq_row_stride},         {"dq_head_stride", p->dq_head_stride},
      {"dk_batch_stride", p->dk_batch_stride},     {"dk_row_stride", p->dk_row_stride},
      {"dk_head_stride", p->dk_head_stride},       {"dv_batch_stride", p->dv_batch_stride},
      {"dv_row_stride", p->dv_row_stride},         {"dv_head_stride", p->dv_head_stride},
  };
  FH_TRY(validate_strides(strides));
  BwdWorkspace ws;
  FH_CHECK(bwd_workspace(p, &ws),
           "batch/heads_q/seqlen_q: the backward's workspace for batch %lld x heads_q %lld x "
           "seqlen_q %lld (head_dim bucket %lld) exceeds 2^63 bytes",
           (long long)p->batch, (long long)p->heads_q, (long long)p->seqlen_q,
           (long long)head_dim_bucket(p->head_dim));

  // What each launch touches: rows of the query side when seqlen_q > 0 (the preprocess, the main
  // kernel, the postprocess), the key side when seqlen_k > 0 (the main kernel writes dk, dv even
  // when seqlen_q == 0: zeros).
  if (check_data && p->batch > 0) {
    if (p->seqlen_q > 0) {
      FH_TRY(validate_tensor(p->q, "q"));
      FH_TRY(validate_tensor(p->o, "o"));
      FH_TRY(validate_tensor(p->dout, "dout"));
      FH_TRY(validate_tensor(p->dq, "dq"));
      FH_CHECK(p->lse != nullptr, "lse: expected a device pointer (the forward's LSE), got null");
      FH_CHECK(aligned(p->lse, alignof(float)),
               "lse: expected a %d-byte aligned pointer (float), got %p", int(alignof(float)),
               static_cast<const void*>(p->lse));
      FH_CHECK(aligned(p->dlse, alignof(float)),
               "dlse: expected a %d-byte aligned pointer (float) or null, got %p",
               int(alignof(float)), static_cast<const void*>(p->dlse));
    }
    if (p->seqlen_k > 0) {
      FH_TRY(validate_tensor(p->k, "k"));
      FH_TRY(validate_tensor(p->v, "v"));
      FH_TRY(validate_tensor(p->dk, "dk"));
      FH_TRY(validate_tensor(p->dv, "dv"));
    }
    if (ws.bytes > 0) {
      FH_CHECK(p->workspace != nullptr,
               "workspace: expected a device pointer to %lld bytes (fh_bwd_workspace_size), got "
               "null",
               (long long)ws.bytes);
      FH_CHECK(aligned(p->workspace, kWorkspaceAlign),
               "workspace: expected a %lld-byte aligned pointer, got %p",
               (long long)kWorkspaceAlign, p->workspace);
      FH_CHECK(p->workspace_bytes >= ws.bytes,
               "workspace_bytes: expected >= %lld bytes for this problem (call "
               "fh_bwd_workspace_size), got %lld",
               (long long)ws.bytes, (long long)p->workspace_bytes);
    }
  }

  FH_TRY(validate_bwd_reserved(p));
  FH_CHECK(p->backend == FH_BACKEND_AUTO || p->backend == FH_BACKEND_FA2 ||
               p->backend == FH_BACKEND_FA3,
           "backend: expected FH_BACKEND_AUTO (0), FA2 (1) or FA3 (2), got %d", p->backend);
  FH_CHECK(p->variant == FH_VARIANT_TUNED,
           "variant: expected 0 (FA-3 ablation variants have no backward; the tuned kernel's "
           "backward serves their forwards), got %d",
           p->variant);
  FH_CHECK(p->num_sms >= 0, "num_sms: expected 0 (every SM) or a positive cap, got %d",
           p->num_sms);
  return FH_SUCCESS;
}

// ---------------------------------------------------------------------------------------------
// Backend policy
// ---------------------------------------------------------------------------------------------

// "bf16 hdim 72 (bucket 96)": the request as messages name it.
std::string request_what(int32_t dtype, int64_t head_dim) {
  const int64_t bucket = head_dim_bucket(head_dim);
  std::string what = format("%s hdim %lld", dtype_name(dtype), (long long)head_dim);
  if (bucket != head_dim) {
    what += format(" (bucket %lld)", (long long)bucket);
  }
  return what;
}

// The FH_* build variables that add the kernel; a backward kernel also needs FH_DIRECTIONS.
std::string rebuild_hint(int32_t backend, int32_t dtype, int64_t head_dim,
                         bool backward = false) {
  return format("rebuild with %sFH_ARCHS including %s, FH_HEAD_DIMS including %lld and FH_DTYPES "
                "including %s",
                backward ? "FH_DIRECTIONS including bwd, " : "", build_arch(backend),
                (long long)head_dim_bucket(head_dim), dtype_name(dtype));
}

// The fa3 path loads q, k and v (the backward also dout) with TMA, whose descriptors need a
// positive stride on every dimension that is stepped along; a broadcast (expand()ed) tensor has
// stride 0 there and runs on fa2, which reads through pointers. Dims are those of the FA layout
// (batch, seqlen, heads, d).
struct LayoutProblem {
  const char* tensor;
  int dim;
  const char* field;
  int64_t stride;
  int64_t extent;
};

template <size_t N>
bool first_layout_problem(const LayoutProblem (&checks)[N], LayoutProblem* problem) {
  for (const LayoutProblem& c : checks) {
    if (c.extent > 1 && c.stride <= 0) {
      *problem = c;
      return true;
    }
  }
  return false;
}

// q, k and v: what both directions load with TMA (same field names in both structs).
// batch: the extent of the batch dimension as TMA sees it (1 for varlen's packed tensors).
template <class Params>
bool qkv_layout_problem(const Params* p, LayoutProblem* problem, int64_t batch) {
  const LayoutProblem checks[] = {
      {"q", 0, "q_batch_stride", p->q_batch_stride, batch},
      {"q", 1, "q_row_stride", p->q_row_stride, p->seqlen_q},
      {"q", 2, "q_head_stride", p->q_head_stride, p->heads_q},
      {"k", 0, "k_batch_stride", p->k_batch_stride, batch},
      {"k", 1, "k_row_stride", p->k_row_stride, p->seqlen_k},
      {"k", 2, "k_head_stride", p->k_head_stride, p->heads_kv},
      {"v", 0, "v_batch_stride", p->v_batch_stride, batch},
      {"v", 1, "v_row_stride", p->v_row_stride, p->seqlen_k},
      {"v", 2, "v_head_stride", p->v_head_stride, p->heads_kv},
  };
  return first_layout_problem(checks, problem);
}

bool fa3_layout_problem(const FhFwdParams* p, LayoutProblem* problem) {
  return qkv_layout_problem(p, problem, is_varlen(p) ? 1 : p->batch);
}

constexpr const char* kFwdTmaTensors = "q/k/v";
constexpr const char* kBwdTmaTensors = "q/k/v/dout";

bool fa3_layout_problem(const FhBwdParams* p, LayoutProblem* problem) {
  const LayoutProblem dout[] = {
      {"dout", 0, "dout_batch_stride", p->dout_batch_stride, p->batch},
      {"dout", 1, "dout_row_stride", p->dout_row_stride, p->seqlen_q},
      {"dout", 2, "dout_head_stride", p->dout_head_stride, p->heads_q},
  };
  return qkv_layout_problem(p, problem, p->batch) || first_layout_problem(dout, problem);
}

// Names the tensor dimension (as Python users see it) and the field (as C callers see it);
// `tensors`: what the path loads with TMA.
std::string describe(LayoutProblem const& l, const char* tensors = kFwdTmaTensors) {
  return format("%s: stride(%d) is %lld on a dimension of size %lld (%s: the fa3 path loads "
                "%s with TMA, which needs a positive stride on every dimension of size > 1; "
                "an expand()ed tensor has 0 there)",
                l.tensor, l.dim, (long long)l.stride, (long long)l.extent, l.field, tensors);
}

struct Choice {
  int32_t backend = FH_BACKEND_AUTO;
  const RegistryEntry* kernel = nullptr;
};

// Which kernel serves p on a GPU of compute capability cc_major.cc_minor, for validated p. Fills
// *why (if not null) with the reason on success; fails with FH_ERROR_UNSUPPORTED and a message
// that names the GPU, the build variables or the layout otherwise. The launch path passes no
// `why`, so it formats nothing on success.
FhStatus select_backend(const FhFwdParams* p, int cc_major, int cc_minor, Choice* out,
                        std::string* why) {
  // sm90a SASS runs on exactly cc 9.0; sm80 code runs on every cc >= 8.0 (SASS for 8.x and 9.0,
  // PTX JIT-compiled on later GPUs).
  const bool fa3_runs = cc_major == 9 && cc_minor == 0;
  const bool fa2_runs = cc_major >= 8;
  const RegistryEntry* fa3 = find_kernel(FH_BACKEND_FA3, p->dtype, p->head_dim, p->variant);
  const RegistryEntry* fa2 = find_kernel(FH_BACKEND_FA2, p->dtype, p->head_dim, FH_VARIANT_TUNED);
  LayoutProblem layout{};
  const bool layout_bad = fa3_layout_problem(p, &layout);
  const std::string what = request_what(p->dtype, p->head_dim);
  auto choose = [&](int32_t backend, const RegistryEntry* kernel, std::string const& reason) {
    out->backend = backend;
    out->kernel = kernel;
    if (why != nullptr) {
      *why = reason;
    }
    return FH_SUCCESS;
  };

  // Mixed mode (16-bit q, FP8 K / V): the FA-3 path's tuned forward only, in its buckets.
  if (is_mixed(p)) {
    const char* name = request_name(p);
    const char* mixed = mixed_name(p->dtype, p->kv_dtype);
    const std::string mixed_what = format("%s hdim %lld", mixed, (long long)p->head_dim);
    if (p->backend == FH_BACKEND_FA2 || p->variant != FH_VARIANT_TUNED) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='%s': %s (fp16 / bf16 q against FP8 k / v, the mixed mode) runs on the "
                  "FA-3 path's tuned kernel only (backend 'fa3' or 'auto'); the FA-2 path and "
                  "the FA-3 ablation variants have no mixed-mode kernels",
                  name, mixed);
    }
    if (!fa3_runs) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='%s': %s (the mixed mode) needs a GPU of compute capability 9.0 (the "
                  "FA-3 path), this GPU is cc %d.%d",
                  name, mixed, cc_major, cc_minor);
    }
    if (!mixed_covers(p->head_dim)) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "head_dim: the mixed mode (fp16 / bf16 q, FP8 k / v) has kernels for head-dim "
                  "buckets %s, got %s",
                  mixed_buckets().c_str(), mixed_what.c_str());
    }
    const RegistryEntry* kernel =
        find_kernel(FH_BACKEND_FA3, p->dtype, p->head_dim, FH_VARIANT_TUNED, p->kv_dtype);
    if (kernel == nullptr) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='%s': this build has no fa3 kernel for %s; rebuild with FH_ARCHS "
                  "including 90a, FH_HEAD_DIMS including %lld and FH_DTYPES including %s",
                  name, mixed_what.c_str(), (long long)head_dim_bucket(p->head_dim), mixed);
    }
    if (layout_bad) {
      return fail(FH_ERROR_UNSUPPORTED, "backend='%s': %s; call %s.contiguous()", name,
                  describe(layout).c_str(), layout.tensor);
    }
    return choose(FH_BACKEND_FA3, kernel,
                  why ? format("%s (mixed mode): cc %d.%d and fa3 kernel built for %s -> fa3",
                               mixed, cc_major, cc_minor, mixed_what.c_str())
                      : std::string());
  }

  // FP8: the FA-3 path's tuned forward only, in its FP8 buckets.
  if (p->dtype == FH_DTYPE_E4M3) {
    const char* name = request_name(p);
    if (p->backend == FH_BACKEND_FA2 || p->variant != FH_VARIANT_TUNED) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='%s': e4m3 inputs run on the FA-3 path's tuned kernel only (backend "
                  "'fa3' or 'auto'); the FA-2 path and the FA-3 ablation variants have no FP8 "
                  "kernels",
                  name);
    }
    if (!fa3_runs) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='%s': e4m3 inputs need a GPU of compute capability 9.0 (the FA-3 "
                  "path's FP8 WGMMA), this GPU is cc %d.%d",
                  name, cc_major, cc_minor);
    }
    if (!fp8_covers(p->head_dim)) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "head_dim: e4m3 inputs have kernels for head-dim buckets %s, got %s",
                  fp8_buckets().c_str(), what.c_str());
    }
    if (fa3 == nullptr) {
      return fail(FH_ERROR_UNSUPPORTED, "backend='%s': this build has no fa3 kernel for %s; %s",
                  name, what.c_str(),
                  rebuild_hint(FH_BACKEND_FA3, p->dtype, p->head_dim).c_str());
    }
    if (layout_bad) {
      return fail(FH_ERROR_UNSUPPORTED, "backend='%s': %s; call %s.contiguous()", name,
                  describe(layout).c_str(), layout.tensor);
    }
    return choose(FH_BACKEND_FA3, fa3,
                  why ? format("e4m3 inputs: cc %d.%d and fa3 kernel built for %s -> fa3",
                               cc_major, cc_minor, what.c_str())
                      : std::string());
  }

  if (p->backend == FH_BACKEND_FA3) {
    const char* name = request_name(p);
    if (!fa3_runs) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='%s' needs a GPU of compute capability 9.0 (H100/H200: sm90a code "
                  "runs on 9.0 only), this GPU is cc %d.%d; use backend='fa2' or 'auto'",
                  name, cc_major, cc_minor);
    }
    if (fa3 == nullptr) {
      if (p->variant != FH_VARIANT_TUNED &&
          find_kernel(FH_BACKEND_FA3, p->dtype, p->head_dim, FH_VARIANT_TUNED) != nullptr) {
        return fail(FH_ERROR_UNSUPPORTED,
                    "backend='%s': this build has no %s kernel for %s; rebuild with "
                    "FH_FA3_ABLATION_DTYPES including %s and FH_FA3_ABLATION_HEAD_DIMS "
                    "including %lld",
                    name, name, what.c_str(), dtype_name(p->dtype),
                    (long long)head_dim_bucket(p->head_dim));
      }
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='%s': this build has no fa3 kernel for %s; %s, or use backend='auto'",
                  name, what.c_str(), rebuild_hint(FH_BACKEND_FA3, p->dtype, p->head_dim).c_str());
    }
    if (layout_bad) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='%s': %s; call %s.contiguous(), or use backend='fa2' or 'auto'", name,
                  describe(layout).c_str(), layout.tensor);
    }
    return choose(FH_BACKEND_FA3, fa3,
                  why ? format("%s requested; cc %d.%d and %s kernel built for %s", name,
                               cc_major, cc_minor, name, what.c_str())
                      : std::string());
  }

  if (p->backend == FH_BACKEND_FA2) {
    if (!fa2_runs) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='fa2' needs a GPU of compute capability >= 8.0 (sm80 code), this GPU "
                  "is cc %d.%d",
                  cc_major, cc_minor);
    }
    if (fa2 == nullptr) {
      return fail(FH_ERROR_UNSUPPORTED, "backend='fa2': this build has no fa2 kernel for %s; %s",
                  what.c_str(), rebuild_hint(FH_BACKEND_FA2, p->dtype, p->head_dim).c_str());
    }
    return choose(FH_BACKEND_FA2, fa2,
                  why ? format("fa2 requested; cc %d.%d and fa2 kernel built for %s", cc_major,
                               cc_minor, what.c_str())
                      : std::string());
  }

  // auto: the FA-3 path where it runs, is built and can load the tensors; else the FA-2 path.
  if (fa3_runs && fa3 != nullptr && !layout_bad) {
    return choose(FH_BACKEND_FA3, fa3,
                  why ? format("cc %d.%d and fa3 kernel built for %s -> fa3", cc_major, cc_minor,
                               what.c_str())
                      : std::string());
  }
  if (!fa2_runs) {
    return fail(FH_ERROR_UNSUPPORTED,
                "flash-hopper needs a GPU of compute capability >= 8.0 (FA-2 path) or 9.0 (FA-3 "
                "path), this GPU is cc %d.%d",
                cc_major, cc_minor);
  }
  if (fa2 == nullptr) {
    if (fa3_runs && fa3 != nullptr) {  // only the layout keeps fa3 out
      return fail(FH_ERROR_UNSUPPORTED,
                  "%s; this build has no fa2 kernel for %s to run it instead (%s)",
                  describe(layout).c_str(), what.c_str(),
                  rebuild_hint(FH_BACKEND_FA2, p->dtype, p->head_dim).c_str());
    }
    return fail(FH_ERROR_UNSUPPORTED, "cc %d.%d: this build has no %s kernel for %s; %s",
                cc_major, cc_minor, fa3_runs ? "fa3 or fa2" : "fa2", what.c_str(),
                rebuild_hint(fa3_runs ? FH_BACKEND_FA3 : FH_BACKEND_FA2, p->dtype, p->head_dim).c_str());
  }
  if (why == nullptr) {
    return choose(FH_BACKEND_FA2, fa2, std::string());
  }
  std::string reason;
  if (fa3_runs && fa3 != nullptr) {
    reason = format("cc %d.%d but %s -> fa2", cc_major, cc_minor, describe(layout).c_str());
  } else if (fa3_runs) {
    reason = format("cc %d.%d but this build has no fa3 kernel for %s -> fa2", cc_major, cc_minor,
                    what.c_str());
  } else {
    reason = format("cc %d.%d: fa3 needs cc 9.0 (sm90a) -> fa2", cc_major, cc_minor);
  }
  return choose(FH_BACKEND_FA2, fa2, reason);
}

struct BwdChoice {
  int32_t backend = FH_BACKEND_AUTO;
  const BwdRegistryEntry* kernel = nullptr;
};

// The backward's policy, select_backend's rules on the backward's registry: the FA-3 path where
// it runs (cc 9.0), has a kernel and can load q, k, v and dout with TMA; else the FA-2 path. A
// path without any backward in the source tree (tables.cmake's direction table) is reported as
// not implemented rather than as a build to redo; a fa3 backward plugs in by registration alone.
FhStatus select_bwd_backend(const FhBwdParams* p, int cc_major, int cc_minor, BwdChoice* out,
                            std::string* why) {
  const bool fa3_runs = cc_major == 9 && cc_minor == 0;
  const bool fa2_runs = cc_major >= 8;
  const bool fa3_written = fa3_bwd_covers(p->head_dim);
  const BwdRegistryEntry* fa3 = find_bwd_kernel(FH_BACKEND_FA3, p->dtype, p->head_dim);
  const BwdRegistryEntry* fa2 = find_bwd_kernel(FH_BACKEND_FA2, p->dtype, p->head_dim);
  LayoutProblem layout{};
  const bool layout_bad = fa3_layout_problem(p, &layout);
  const std::string what = request_what(p->dtype, p->head_dim);
  auto hint = [&](int32_t backend) {
    return rebuild_hint(backend, p->dtype, p->head_dim, /*backward=*/true);
  };
  auto choose = [&](int32_t backend, const BwdRegistryEntry* kernel, std::string const& reason) {
    out->backend = backend;
    out->kernel = kernel;
    if (why != nullptr) {
      *why = reason;
    }
    return FH_SUCCESS;
  };

  if (p->backend == FH_BACKEND_FA3) {
    if (fa3 == nullptr && !fa3_written) {  // whatever the GPU: no build has one
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='fa3': this build has no fa3 backward kernel for %s (the FA-3 path's "
                  "backward has tiles for head_dim buckets %s only so far); use backend='fa2' "
                  "or 'auto'",
                  what.c_str(), fa3_bwd_buckets().c_str());
    }
    if (!fa3_runs) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='fa3' needs a GPU of compute capability 9.0 (H100/H200: sm90a code "
                  "runs on 9.0 only), this GPU is cc %d.%d; use backend='fa2' or 'auto'",
                  cc_major, cc_minor);
    }
    if (fa3 == nullptr) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='fa3': this build has no fa3 backward kernel for %s; %s, or use "
                  "backend='auto'",
                  what.c_str(), hint(FH_BACKEND_FA3).c_str());
    }
    if (layout_bad) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='fa3': %s; call %s.contiguous(), or use backend='fa2' or 'auto'",
                  describe(layout, kBwdTmaTensors).c_str(), layout.tensor);
    }
    return choose(FH_BACKEND_FA3, fa3,
                  why ? format("fa3 requested; cc %d.%d and fa3 backward kernel built for %s",
                               cc_major, cc_minor, what.c_str())
                      : std::string());
  }

  if (p->backend == FH_BACKEND_FA2) {
    if (!fa2_runs) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='fa2' needs a GPU of compute capability >= 8.0 (sm80 code), this GPU "
                  "is cc %d.%d",
                  cc_major, cc_minor);
    }
    if (fa2 == nullptr) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='fa2': this build has no fa2 backward kernel for %s; %s", what.c_str(),
                  hint(FH_BACKEND_FA2).c_str());
    }
    return choose(FH_BACKEND_FA2, fa2,
                  why ? format("fa2 requested; cc %d.%d and fa2 backward kernel built for %s",
                               cc_major, cc_minor, what.c_str())
                      : std::string());
  }

  // auto
  if (fa3_runs && fa3 != nullptr && !layout_bad) {
    return choose(FH_BACKEND_FA3, fa3,
                  why ? format("cc %d.%d and fa3 backward kernel built for %s -> fa3", cc_major,
                               cc_minor, what.c_str())
                      : std::string());
  }
  if (!fa2_runs) {
    return fail(FH_ERROR_UNSUPPORTED,
                "flash-hopper needs a GPU of compute capability >= 8.0 (FA-2 path) or 9.0 (FA-3 "
                "path), this GPU is cc %d.%d",
                cc_major, cc_minor);
  }
  if (fa2 == nullptr) {
    if (fa3_runs && fa3 != nullptr) {  // only the layout keeps fa3 out
      return fail(FH_ERROR_UNSUPPORTED,
                  "%s; this build has no fa2 backward kernel for %s to run it instead (%s)",
                  describe(layout, kBwdTmaTensors).c_str(), what.c_str(),
                  hint(FH_BACKEND_FA2).c_str());
    }
    const bool fa3_possible = fa3_runs && fa3_written;
    return fail(FH_ERROR_UNSUPPORTED, "cc %d.%d: this build has no %s backward kernel for %s; %s",
                cc_major, cc_minor, fa3_possible ? "fa3 or fa2" : "fa2", what.c_str(),
                hint(fa3_possible ? FH_BACKEND_FA3 : FH_BACKEND_FA2).c_str());
  }
  if (why == nullptr) {
    return choose(FH_BACKEND_FA2, fa2, std::string());
  }
  std::string reason;
  if (fa3_runs && fa3 != nullptr) {
    reason = format("cc %d.%d but %s -> fa2", cc_major, cc_minor,
                    describe(layout, kBwdTmaTensors).c_str());
  } else if (fa3_runs && !fa3_written) {
    reason = format("cc %d.%d but the FA-3 path's backward has no tile for %s yet (buckets %s) "
                    "-> fa2",
                    cc_major, cc_minor, what.c_str(), fa3_bwd_buckets().c_str());
  } else if (fa3_runs) {
    reason = format("cc %d.%d but this build has no fa3 backward kernel for %s -> fa2", cc_major,
                    cc_minor, what.c_str());
  } else {
    reason = format("cc %d.%d: fa3 needs cc 9.0 (sm90a) -> fa2", cc_major, cc_minor);
  }
  return choose(FH_BACKEND_FA2, fa2, reason);
}

// ---------------------------------------------------------------------------------------------
// Device facts and kernel parameters
// ---------------------------------------------------------------------------------------------

struct DeviceInfo {
  int major = 0;
  int minor = 0;
  int sm_count = 0;
  int max_smem_optin = 0;
};

// A device's attributes never change: they are queried once per device ordinal and read from here
// afterwards (four cudaDeviceGetAttribute calls per launch were host time for nothing).
constexpr int kCachedDevices = 64;
struct CachedDevice {
  std::atomic<bool> ready{false};
  DeviceInfo info;
};
CachedDevice g_device_cache[kCachedDevices];
std::mutex g_device_cache_mutex;

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

constexpr float kLog2e = 1.4426950408889634f;

// The score transform's kernel constants, the same for both directions (fwd_params.h says how the
// kernels use them): with softcap the exponent's scale is log2(e) alone (the scale is applied
// before tanh), without it softmax_scale * log2(e).
template <class KernelParams>
void set_score_transform(KernelParams& k, float softmax_scale, float softcap) {
  if (softcap > 0.f) {
    k.softcap = softcap;
    k.softcap_prescale = softmax_scale / softcap;
    k.scale_log2 = kLog2e;
  } else {
    k.softcap = 0.f;
    k.softcap_prescale = 0.f;
    k.scale_log2 = softmax_scale * kLog2e;
  }
}

// A window wider than the sequence is the same as no bound: keep the int32 math overflow-free.
int clamp_window(int64_t window, int64_t seqlen_q, int64_t seqlen_k) {
  return window >= seqlen_k + seqlen_q ? -1 : int(window);
}

FwdParams derive(const FhFwdParams* p, const DeviceInfo& dev) {
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
  set_score_transform(k, p->softmax_scale, p->softcap);
  k.lse_scale = p->softcap > 0.f ? 1.f : p->softmax_scale;
  k.window_left = clamp_window(p->window_left, p->seqlen_q, p->seqlen_k);
  k.window_right = clamp_window(p->window_right, p->seqlen_q, p->seqlen_k);
  // A cap, never more CTAs than SMs: the FA-3 backward's deterministic mode waits across CTAs
  // and needs every CTA of its persistent grid resident.
  k.num_sms = p->num_sms > 0 && p->num_sms < dev.sm_count ? p->num_sms : dev.sm_count;
  k.variant = p->variant;
  k.q_descale = p->q_descale;
  k.k_descale = p->k_descale;
  k.v_descale = p->v_descale;
  k.q_descale_batch_stride = p->q_descale_batch_stride;
  k.q_descale_head_stride = p->q_descale_head_stride;
  k.k_descale_batch_stride = p->k_descale_batch_stride;
  k.k_descale_head_stride = p->k_descale_head_stride;
  k.v_descale_batch_stride = p->v_descale_batch_stride;
  k.v_descale_head_stride = p->v_descale_head_stride;
  k.o_fp16 = p->dtype == FH_DTYPE_E4M3 && p->out_dtype == FH_DTYPE_FP16;
  k.fp8_single_level = p->fp8_accumulation == FH_FP8_ACCUM_SINGLE_LEVEL;
  k.timeline = g_timeline;
  if (p->cu_seqlens_q != nullptr) {
    k.cu_seqlens_q = p->cu_seqlens_q;
    k.cu_seqlens_k = p->cu_seqlens_k;
    k.seqused_q = p->seqused_q;
    k.seqused_k = p->seqused_k;
    k.kv_index.batch_idx = p->kv_batch_idx;
    k.kv_index.leftpad = p->leftpad_k;
    k.kv_index.batch_k = int(p->batch_k);
    k.varlen_header = static_cast<VarlenHeader*>(p->workspace);
    k.varlen_pairs = reinterpret_cast<VarlenPair*>(static_cast<char*>(p->workspace) +
                                                   sizeof(VarlenHeader));
    k.varlen_capacity = int(varlen_capacity(p->seqlen_q, p->batch));
    // Hints past the packed tokens are no information (api's check allows any value >= 0).
    k.varlen_max_seqlen_q = int(p->max_seqlen_q <= p->seqlen_q ? p->max_seqlen_q : 0);
    k.varlen_max_seqlen_k = int(p->max_seqlen_k <= p->seqlen_k ? p->max_seqlen_k : 0);
  }
  return k;
}

// For validated p (bwd_workspace succeeded in validate): the workspace pointers are carved with
// bwd_workspace's offsets, the one description of the layout. A zero-byte workspace (seqlen_q ==
// 0) leaves them null: no kernel reads a query row then.
BwdParams derive_bwd(const FhBwdParams* p, const DeviceInfo& dev) {
  BwdWorkspace ws;
  bwd_workspace(p, &ws);
  BwdParams k{};
  k.q = p->q;
  k.k = p->k;
  k.v = p->v;
  k.o = p->o;
  k.dout = p->dout;
  k.lse = p->lse;
  k.dlse = p->dlse;
  k.dq = p->dq;
  k.dk = p->dk;
  k.dv = p->dv;
  if (ws.bytes > 0) {
    char* base = static_cast<char*>(p->workspace);
    k.dq_accum = reinterpret_cast<float*>(base + ws.dq_accum);
    k.lse_log2 = reinterpret_cast<float*>(base + ws.lse_log2);
    k.dpsum = reinterpret_cast<float*>(base + ws.dpsum);
    k.semaphores = reinterpret_cast<int*>(base + ws.semaphores);
  }
  k.batch = int(p->batch);
  k.seqlen_q = int(p->seqlen_q);
  k.seqlen_k = int(p->seqlen_k);
  k.heads_q = int(p->heads_q);
  k.heads_kv = int(p->heads_kv);
  k.heads_per_kv = int(p->heads_q / p->heads_kv);
  k.head_dim = int(p->head_dim);
  k.seqlen_q_rounded = int(ws.seqlen_q_rounded);
  k.head_dim_rounded = int(ws.head_dim_rounded);
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
  k.dout_batch_stride = p->dout_batch_stride;
  k.dout_row_stride = p->dout_row_stride;
  k.dout_head_stride = p->dout_head_stride;
  k.dq_batch_stride = p->dq_batch_stride;
  k.dq_row_stride = p->dq_row_stride;
  k.dq_head_stride = p->dq_head_stride;
  k.dk_batch_stride = p->dk_batch_stride;
  k.dk_row_stride = p->dk_row_stride;
  k.dk_head_stride = p->dk_head_stride;
  k.dv_batch_stride = p->dv_batch_stride;
  k.dv_row_stride = p->dv_row_stride;
  k.dv_head_stride = p->dv_head_stride;
  k.lse_batch_stride = p->lse_batch_stride;
  k.lse_head_stride = p->lse_head_stride;
  k.dlse_batch_stride = p->dlse_batch_stride;
  k.dlse_head_stride = p->dlse_head_stride;
  k.softmax_scale = p->softmax_scale;
  set_score_transform(k, p->softmax_scale, p->softcap);
  k.window_left = clamp_window(p->window_left, p->seqlen_q, p->seqlen_k);
  k.window_right = clamp_window(p->window_right, p->seqlen_q, p->seqlen_k);
  k.deterministic = p->deterministic;
  // A cap, never more CTAs than SMs: the FA-3 backward's deterministic mode waits across CTAs
  // and needs every CTA of its persistent grid resident.
  k.num_sms = p->num_sms > 0 && p->num_sms < dev.sm_count ? p->num_sms : dev.sm_count;
  return k;
}

// The shared-memory limit tile selection sees: the device's opt-in limit, or FH_DEBUG_SMEM_LIMIT
// (bytes) when lower, so a large GPU can run and test the configs meant for smaller ones (e.g.
// 101376 = sm86/sm89's opt-in). Read per call: tests change it between calls.
int smem_limit(const DeviceInfo& dev) {
  int limit = dev.max_smem_optin;
  if (const char* env = std::getenv("FH_DEBUG_SMEM_LIMIT")) {
    const int v = std::atoi(env);
    if (v > 0 && v < limit) {
      limit = v;
    }
  }
  return limit;
}

// The launches of a backward on `stream`, in stream order (the preprocess, then the path's
// launcher: its main kernel and its postprocess); the first failure stops it (what
// already ran wrote only the caller's workspace and outputs, which a failed call leaves undefined).
FhStatus launch_bwd(const FhBwdParams* params, BwdChoice const& choice, const DeviceInfo& dev,
                    cudaStream_t stream) {
  const BwdParams p = derive_bwd(params, dev);
  const int limit = smem_limit(dev);
  const char* backend = backend_name(choice.backend);
  char message[1024];
  auto report = [&](LaunchResult const& r, const char* stage) {
    const FhStatus st = describe_launch(r, backend, params->head_dim, limit, message,
                                        sizeof(message), kBwdTmaTensors);
    if (st != FH_SUCCESS) {
      g_last_error = format("%s: %s", stage, message);
    }
    return st;
  };
  // seqlen_q == 0: no query row to prepare or convert, but the main kernel still writes dk = dv = 0.
  // seqlen_k == 0: no key to visit (dk, dv are empty); the launcher's postprocess writes dq = 0
  // from the cleared accumulator.
  if (params->seqlen_q > 0) {
    FH_TRY(report(launch_bwd_preprocess(p, params->dtype, stream), "backward preprocess"));
  }
  FH_TRY(report(choice.kernel->launch(p, limit, stream), "backward"));
  return FH_SUCCESS;
}

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

// fh_fwd_select_backend / fh_bwd_select_backend: validate without data pointers, ask the
// direction's policy, write the backend and (when asked) why.
template <class ChoiceT, class Params, class Select>
FhStatus answer_policy(const Params* params, int32_t cc_major, int32_t cc_minor,
                       int32_t* backend_out, char* reason, size_t reason_len, Select select) {
  g_last_error.clear();
  FhStatus st = validate(params, /*check_data=*/false);
  if (st != FH_SUCCESS) {
    return st;
  }
  st = check_select_args(cc_major, cc_minor, backend_out);
  if (st != FH_SUCCESS) {
    return st;
  }
  ChoiceT choice;
  std::string why;
  st = select(params, cc_major, cc_minor, &choice, reason != nullptr ? &why : nullptr);
  if (st != FH_SUCCESS) {
    return st;
  }
  *backend_out = choice.backend;
  if (reason != nullptr && reason_len > 0) {
    snprintf(reason, reason_len, "%s", why.c_str());
  }
  return FH_SUCCESS;
}

// --- decode (FhDecodeParams) ---------------------------------------------------------------

int64_t decode_row_blocks(const FhDecodeParams* p) {
  return decode::row_blocks(p->seqlen_q, p->heads_q / p->heads_kv);
}

// Everything fh_decode_plan needs (no data pointers): shapes, the cache's geometry, the score.
FhStatus validate_decode_shapes(const FhDecodeParams* p) {
  FH_CHECK(p != nullptr, "params: expected a pointer to FhDecodeParams, got null");
  FH_CHECK(p->abi_version == FH_ABI_VERSION,
           "abi_version: expected %d (this library's FH_ABI_VERSION), got %d", FH_ABI_VERSION,
           p->abi_version);
  FH_CHECK(p->dtype == FH_DTYPE_FP16 || p->dtype == FH_DTYPE_BF16,
           "dtype: expected FH_DTYPE_FP16 (0) or FH_DTYPE_BF16 (1) for decode, got %d", p->dtype);
  FH_CHECK(p->head_dim == 64 || p->head_dim == 128 || p->head_dim == 256,
           "head_dim: expected 64, 128 or 256 for decode, got %lld", (long long)p->head_dim);
  FH_CHECK(p->batch >= 0 && p->batch <= kMaxGridYZ, "batch: expected 0..%lld, got %lld",
           (long long)kMaxGridYZ, (long long)p->batch);
  FH_CHECK(p->heads_q >= 1 && p->heads_q <= kMaxGridYZ, "heads_q: expected 1..%lld, got %lld",
           (long long)kMaxGridYZ, (long long)p->heads_q);
  FH_CHECK(p->heads_kv >= 1 && p->heads_q % p->heads_kv == 0,
           "heads_kv: expected a divisor of heads_q (%lld), got %lld", (long long)p->heads_q,
           (long long)p->heads_kv);
  FH_CHECK(p->seqlen_q >= 1 && p->seqlen_q <= kMaxSeqlen, "seqlen_q: expected 1..%lld, got %lld",
           (long long)kMaxSeqlen, (long long)p->seqlen_q);
  FH_CHECK(p->heads_kv * decode_row_blocks(p) <= kMaxGridYZ,
           "seqlen_q: expected seqlen_q * heads_q / 16 rounded up per kv head <= %lld, got "
           "seqlen_q %lld with heads_q %lld",
           (long long)kMaxGridYZ, (long long)p->seqlen_q, (long long)p->heads_q);
  FH_CHECK(p->page_size >= 1 && p->page_size <= INT32_MAX, "page_size: expected 1..%d, got %lld",
           INT32_MAX, (long long)p->page_size);
  FH_CHECK(p->num_pages >= 1 && p->num_pages <= INT32_MAX, "num_pages: expected 1..%d, got %lld",
           INT32_MAX, (long long)p->num_pages);
  // total_q: the varlen rows the kernel clamps cu_seqlens_q to (int32 offsets)
  FH_CHECK(p->total_q >= 0 && p->total_q <= INT32_MAX, "total_q: expected 0..%d, got %lld",
           INT32_MAX, (long long)p->total_q);
  if (p->page_table != nullptr) {
    // both factors <= INT32_MAX before their product is formed: it cannot overflow int64
    FH_CHECK(p->max_pages >= 1 && p->max_pages <= INT32_MAX,
             "max_pages: expected 1..%d with a page_table, got %lld", INT32_MAX,
             (long long)p->max_pages);
    FH_CHECK(p->page_table_stride >= p->max_pages,
             "page_table_stride: expected >= max_pages (%lld), got %lld", (long long)p->max_pages,
             (long long)p->page_table_stride);
    FH_CHECK(p->max_pages * p->page_size <= INT32_MAX,
             "max_pages: expected max_pages * page_size <= %d keys per sequence, got %lld * %lld",
             INT32_MAX, (long long)p->max_pages, (long long)p->page_size);
    FH_CHECK(p->kv_batch_idx == nullptr,
             "kv_batch_idx: expected null with a page_table (pass the page-table rows of the "
             "batch instead), got %p", (const void*)p->kv_batch_idx);
  }
  FH_TRY(validate_score(p));
  FH_CHECK(p->num_splits >= 0, "num_splits: expected >= 0, got %d", p->num_splits);
  return FH_SUCCESS;
}

int decode_splits(const FhDecodeParams* p, int num_sms) {
  if (p->num_splits > 0) {
    return p->num_splits < decode::kMaxSplits ? p->num_splits : decode::kMaxSplits;
  }
  const int64_t tiles = p->batch * p->heads_kv * decode_row_blocks(p);
  const int64_t keys = p->page_table != nullptr ? p->max_pages * p->page_size : p->page_size;
  // A dense cache: one CTA per SM, though two fit at d128: as fast or faster and fewer splits to
  // merge (GQA 32 / 8, d128, H200: 1 x 128k 16 splits 4.23 TB/s vs 33 splits 4.14, 8 x 32k 2
  // vs 4 splits 4.40 vs 4.33). A paged cache fills every CTA slot: a paged CTA alone on its SM
  // is issue-bound (its page arithmetic; ncu: +42 % instructions) and lost a sixth (1 x 128k
  // 3.45 vs 4.14, 8 x 32k 3.55 vs 4.27; bench/PERFLOG.md session 15).
  const int ctas_per_sm = p->page_table != nullptr ? decode_ctas_per_sm(p->head_dim) : 1;
  return decode::default_splits(tiles, keys, num_sms, ctas_per_sm, /*min_keys=*/256);
}

int64_t decode_workspace_bytes(const FhDecodeParams* p, int splits) {
  return decode::decode_workspace(p->batch * p->heads_kv * decode_row_blocks(p), splits,
                                  static_cast<int>(p->head_dim))
      .bytes;
}

FhStatus validate_decode(const FhDecodeParams* p) {
  FH_TRY(validate_decode_shapes(p));
  FH_CHECK(p->num_splits >= 1 && p->num_splits <= decode::kMaxSplits,
           "num_splits: expected 1..%d (fh_decode_plan chooses), got %d", decode::kMaxSplits,
           p->num_splits);
  FH_TRY(validate_tensor(p->q, "q"));
  FH_TRY(validate_tensor(p->k, "k"));
  FH_TRY(validate_tensor(p->v, "v"));
  FH_TRY(validate_tensor(p->o, "o"));
  FH_CHECK(p->seqlens_k != nullptr, "seqlens_k: expected an int32 device array, got null");
  const NamedStride strides[] = {
      {"q_batch_stride", p->q_batch_stride}, {"q_row_stride", p->q_row_stride},
      {"q_head_stride", p->q_head_stride},   {"k_page_stride", p->k_page_stride},
      {"k_row_stride", p->k_row_stride},     {"k_head_stride", p->k_head_stride},
      {"v_page_stride", p->v_page_stride},   {"v_row_stride", p->v_row_stride},
      {"v_head_stride", p->v_head_stride},   {"o_batch_stride", p->o_batch_stride},
      {"o_row_stride", p->o_row_stride},     {"o_head_stride", p->o_head_stride},
  };
  FH_TRY(validate_strides(strides));
  if (p->num_splits > 1) {
    const int64_t need = decode_workspace_bytes(p, p->num_splits);
    FH_CHECK(p->workspace != nullptr && aligned(p->workspace, 256),
             "workspace: expected a 256-byte aligned device pointer with num_splits %d, got %p",
             p->num_splits, p->workspace);
    FH_CHECK(p->workspace_bytes >= need,
             "workspace_bytes: expected >= %lld (fh_decode_plan) for num_splits %d, got %lld",
             (long long)need, p->num_splits, (long long)p->workspace_bytes);
  }
  return FH_SUCCESS;
}

}  // namespace
}  // namespace flash_hopper

using namespace flash_hopper;

// The FA-3 launchers encode their TMA descriptors with CuTe's make_tma_copy, which calls the
// driver's cuTensorMapEncodeTiled. Unless CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL is defined,
// CUTLASS looks that function up with cudaGetDriverEntryPointByVersion on every call (three per
// launch, a large share of the FA-3 path's host time: bench/PERFLOG.md, session 4); with it
// defined, CUTLASS calls the function by name, which would tie this library to libcuda at link
// time. The sm90 instantiations define it (fwd_sm90_inst.cu.in), and the name resolves here: a
// hidden forward to the entry point looked up once per process. The driver stays a run-time
// dependency, so the library still loads on a machine without one (the CPU tests need that).
extern "C" __attribute__((visibility("hidden"))) CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* tensor_map, CUtensorMapDataType data_type, cuuint32_t rank, void* global_address,
    const cuuint64_t* global_dim, const cuuint64_t* global_strides, const cuuint32_t* box_dim,
    const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2_promotion,
    CUtensorMapFloatOOBfill oob_fill) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050  // ByVersion from CUDA 12.5; 13.x has only it
    const cudaError_t err = cudaGetDriverEntryPointByVersion(
        "cuTensorMapEncodeTiled", &fn, /*cudaVersion=*/12000, cudaEnableDefault, &found);
#else
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  if (encode == nullptr) {
    return CUDA_ERROR_NOT_FOUND;
  }
  return encode(tensor_map, data_type, rank, global_address, global_dim, global_strides, box_dim,
                element_strides, interleave, swizzle, l2_promotion, oob_fill);
}

extern "C" {

FH_EXPORT FhStatus fh_fwd_select_backend(const FhFwdParams* params, int32_t cc_major,
                                         int32_t cc_minor, int32_t* backend_out, char* reason,
                                         size_t reason_len) {
  return answer_policy<Choice>(params, cc_major, cc_minor, backend_out, reason, reason_len,
                               select_backend);
}

FH_EXPORT FhStatus fh_fwd_workspace_size(const FhFwdParams* params, int64_t* bytes) {
  g_last_error.clear();
  FH_CHECK(bytes != nullptr, "bytes: expected a non-null int64_t pointer, got null");
  FhStatus st = validate(params, /*check_data=*/false);
  if (st != FH_SUCCESS) {
    return st;
  }
  *bytes = params->cu_seqlens_q != nullptr ? varlen_workspace_bytes(params->seqlen_q, params->batch)
                                           : 0;
  return FH_SUCCESS;
}

FH_EXPORT FhStatus fh_fwd(const FhFwdParams* params, void* stream) {
  g_last_error.clear();
  FhStatus st = validate(params, /*check_data=*/true);
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
  Choice choice;
  st = select_backend(params, dev.major, dev.minor, &choice, /*why=*/nullptr);
  if (st != FH_SUCCESS) {
    return st;
  }
  const int limit = smem_limit(dev);
  const LaunchResult result =
      choice.kernel->launch(derive(params, dev), limit, static_cast<cudaStream_t>(stream));
  char message[1024];
  st = describe_launch(result, backend_name(choice.backend), params->head_dim, limit, message,
                       sizeof(message));
  if (st != FH_SUCCESS) {
    g_last_error = message;
  }
  return st;
}

FH_EXPORT FhStatus fh_bwd_select_backend(const FhBwdParams* params, int32_t cc_major,
                                         int32_t cc_minor, int32_t* backend_out, char* reason,
                                         size_t reason_len) {
  return answer_policy<BwdChoice>(params, cc_major, cc_minor, backend_out, reason, reason_len,
                                  select_bwd_backend);
}

FH_EXPORT FhStatus fh_bwd_workspace_size(const FhBwdParams* params, int64_t* bytes) {
  g_last_error.clear();
  const FhStatus st = validate(params, /*check_data=*/false);
  if (st != FH_SUCCESS) {
    return st;
  }
  if (bytes == nullptr) {
    return fail(FH_ERROR_INVALID_ARGUMENT, "bytes: expected a non-null pointer, got null");
  }
  BwdWorkspace ws;
  bwd_workspace(params, &ws);  // validate checked that it fits
  *bytes = ws.bytes;
  return FH_SUCCESS;
}

FH_EXPORT FhStatus fh_bwd(const FhBwdParams* params, void* stream) {
  g_last_error.clear();
  FhStatus st = validate(params, /*check_data=*/true);
  if (st != FH_SUCCESS) {
    return st;
  }
  if (params->batch == 0) {
    return FH_SUCCESS;  // nothing to compute
  }
  DeviceInfo dev;
  st = query_device(&dev);
  if (st != FH_SUCCESS) {
    return st;
  }
  BwdChoice choice;
  st = select_bwd_backend(params, dev.major, dev.minor, &choice, /*why=*/nullptr);
  if (st != FH_SUCCESS) {
    return st;
  }
  return launch_bwd(params, choice, dev, static_cast<cudaStream_t>(stream));
}

FH_EXPORT const char* fh_last_error(void) { return g_last_error.c_str(); }

FH_EXPORT int32_t fh_abi_version(void) { return FH_ABI_VERSION; }

FH_EXPORT const char* fh_build_info(void) { return FH_BUILD_INFO_JSON; }

FH_EXPORT FhStatus fh_debug_set_timeline(void* device_buffer, int64_t bytes) {
#ifdef FH_TIMELINE
  FH_CHECK(device_buffer == nullptr || bytes >= flash_hopper::sm90::kTimelineBytes,
           "bytes: expected at least %lld for the timeline buffer, got %lld",
           (long long)flash_hopper::sm90::kTimelineBytes, (long long)bytes);
  g_timeline = static_cast<unsigned long long*>(device_buffer);
  return FH_SUCCESS;
#else
  (void)device_buffer;
  (void)bytes;
  return fail(FH_ERROR_UNSUPPORTED,
              "fh_debug_set_timeline: this library was built without FH_TIMELINE=ON");
#endif
}

FH_EXPORT int32_t fh_has_fwd_kernel(int32_t backend, int32_t dtype, int64_t head_dim) {
  return find_kernel(backend, dtype, head_dim, FH_VARIANT_TUNED) != nullptr ? 1 : 0;
}

FH_EXPORT int32_t fh_has_bwd_kernel(int32_t backend, int32_t dtype, int64_t head_dim) {
  return find_bwd_kernel(backend, dtype, head_dim) != nullptr ? 1 : 0;
}

}  // extern "C"

FH_EXPORT FhStatus fh_decode_plan(const FhDecodeParams* params, int32_t num_sms,
                                  int32_t* num_splits_out, int64_t* workspace_bytes_out) {
  g_last_error.clear();
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
  g_last_error.clear();
  FH_TRY(validate_decode(params));
  if (params->batch == 0) {
    return FH_SUCCESS;
  }
  DeviceInfo dev;
  FH_TRY(query_device(&dev));
  FH_CHECK(dev.major >= 8, "device: the decode kernel needs compute capability >= 8.0, got %d.%d",
           dev.major, dev.minor);
  const int limit = smem_limit(dev);
#ifdef FH_TIMELINE
  unsigned long long* timeline = g_timeline;
  const int64_t timeline_bytes = flash_hopper::sm90::kTimelineBytes;
#else
  unsigned long long* timeline = nullptr;
  const int64_t timeline_bytes = 0;
#endif
  const LaunchResult result = launch_decode(params, limit, dev.major,
                                            static_cast<cudaStream_t>(stream), timeline,
                                            timeline_bytes);
  char message[1024];
  const FhStatus st = describe_launch(result, "decode", params->head_dim, limit, message,
                                      sizeof(message));
  if (st != FH_SUCCESS) {
    g_last_error = message;
  }
  return st;
}
