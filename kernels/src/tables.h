// The kernel tables on the C side: this build's launchers (the generated fh_registry.inc) and the
// source tree's tables (kernels/src/tables.cmake through the generated fh_tables.inc): head-dim
// buckets, the dtype, path and FA-3 variant names, and which buckets each path and input mode has
// kernels for whatever this build compiled. Lookups and the names that messages use.
#pragma once

#include <cstdint>
#include <string>

#include "fh_tables.inc"
#include "flash_hopper/api.h"
#include "src/registry.h"

namespace flash_hopper {

// A forward launcher of this build and what it serves.
struct RegistryEntry {
  int32_t backend;
  int32_t dtype;
  int32_t kv_dtype;  // dtype's, but for the mixed mode's kernels (FP8 K / V)
  int32_t head_dim_bucket;
  int32_t head_dim_v_bucket;  // V's: head_dim_bucket's, but for a V head dim of its own
  int32_t variant;  // FhVariant: one launcher may serve several (runtime flags)
  FwdLauncher launch;
};

// A backward launcher of this build and what it serves.
struct BwdRegistryEntry {
  int32_t backend;
  int32_t dtype;
  int32_t head_dim_bucket;
  BwdLauncher launch;
};

inline constexpr int64_t kHeadDimBuckets[] = {FH_HEAD_DIM_BUCKETS};
constexpr int kNumBuckets = sizeof(kHeadDimBuckets) / sizeof(kHeadDimBuckets[0]);
constexpr int64_t kMaxHeadDim = kHeadDimBuckets[kNumBuckets - 1];

inline constexpr const char* kVariantNames[] = {FH_FA3_VARIANT_NAMES};
constexpr int kNumVariants = sizeof(kVariantNames) / sizeof(kVariantNames[0]);
static_assert(kNumVariants == (FH_VARIANT_FLAG_NO_PINGPONG | FH_VARIANT_FLAG_NO_OVERLAP) + 1,
              "kernels/src/tables.cmake must list one FA-3 variant per set of FH_VARIANT_FLAG_*");
static_assert(FH_VARIANT_NO_PINGPONG_NO_OVERLAP == kNumVariants - 1,
              "FhVariant (api.h) and the variant table disagree");

// The smallest bucket that holds head_dim, or -1 past the largest.
int64_t head_dim_bucket(int64_t head_dim);

// This build's launcher for the request, or null. kv_dtype: the K / V dtype (the mixed mode's
// kernels); -1: dtype's. head_dim_v: V's head dim (the kernels with one of their own:
// FH_HEAD_DIM_V_TABLE); -1: head_dim's.
const RegistryEntry* find_kernel(int32_t backend, int32_t dtype, int64_t head_dim,
                                 int32_t variant, int32_t kv_dtype = -1,
                                 int64_t head_dim_v = -1);
const BwdRegistryEntry* find_bwd_kernel(int32_t backend, int32_t dtype, int64_t head_dim);

// Whether the FA-3 path's backward has a tile for head_dim's bucket in the source tree
// (CMakeLists.txt FH_SM90_BWD_HEAD_DIMS, kernels/sm90/bwd/tile_config.h), whatever this build
// compiled; and the list of those buckets for messages ("64, 96, 128").
bool fa3_bwd_covers(int64_t head_dim);
std::string fa3_bwd_buckets();

// The same for the FA-3 path's FP8 (e4m3) forward tiles and the mixed mode's (FH_DTYPE_TABLE /
// FH_MIXED_TABLE in tables.cmake).
bool fp8_covers(int64_t head_dim);
// Whether the source tree has a forward with V's own head dim for (head_dim, head_dim_v)
// (FH_HEAD_DIM_V_TABLE, by buckets), whatever this build compiled; the pairs for messages.
bool own_head_dim_v_covers(int64_t head_dim, int64_t head_dim_v);
std::string own_head_dim_v_pairs();
std::string fp8_buckets();
bool mixed_covers(int64_t head_dim);
std::string mixed_buckets();

// The mixed mode's FH_DTYPES name ("bf16+e4m3") of a (q, K / V) dtype pair, or null.
const char* mixed_name(int32_t dtype, int32_t kv_dtype);

// The dtype's FH_DTYPES name, or null for an FhDtype without kernels.
const char* dtype_name(int32_t dtype);
// The same for K / V's dtype, the mixed mode's FP8 caches included ("e5m2": FH_MIXED_TABLE's
// names after their '+').
const char* kv_dtype_name(int32_t kv_dtype);

// "FH_DTYPE_FP16 (0, fp16) or FH_DTYPE_BF16 (1, bf16)", for messages.
const std::string& dtype_choices();

// The decode kernel's table (tables.cmake: FH_DECODE_TABLE, FH_DECODE_DTYPES), built in every
// build: whether it has kernels for q's dtype, for q's with K / V's (a row of FH_DECODE_DTYPES)
// and for a head dim (exactly: it has no buckets), and the lists as messages name them
// ("FH_DTYPE_FP16 (0), FH_DTYPE_BF16 (1) or FH_DTYPE_E4M3 (2)" for q to C callers, K / V's for a
// q dtype the same way, "fp16, bf16, ... or fp16+e5m2" by FH_DTYPES names, "64, 128 or 256").
// A row's name: the FH_DTYPES name of q, k and v in one dtype, the mixed name otherwise.
bool decode_has_q_dtype(int32_t dtype);
bool decode_has_dtype(int32_t dtype, int32_t kv_dtype);
bool decode_has_head_dim(int64_t head_dim);
const char* decode_dtype_name(int32_t dtype, int32_t kv_dtype);
const std::string& decode_dtype_choices();
std::string decode_kv_dtype_choices(int32_t dtype);
const std::string& decode_dtype_names();
const std::string& decode_head_dim_choices();

// The FH_ARCHS value that builds a backend's kernels ("80", "90a").
const char* build_arch(int32_t backend);

// "auto", "fa2", "fa3", "decode" (or "unknown").
const char* backend_name(int32_t backend);

}  // namespace flash_hopper
