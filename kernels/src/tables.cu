// The kernel tables (tables.h): the dispatch tables built from fh_registry.inc, so that they list
// exactly what this build compiled, and the lookups into them and into tables.cmake's tables.
#include "src/tables.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "src/errors.h"

// Declarations of every launcher this build holds, then the dispatch tables. Each inclusion of
// fh_registry.inc defines both row macros (the one a table does not want as empty).
#define FH_REGISTER_FWD(backend, dtype, kv_dtype, head_dim, head_dim_v, variant, name) \
  FH_DEFINE_FWD_LAUNCHER(name);
#define FH_REGISTER_BWD(backend, dtype, head_dim, name) FH_DEFINE_BWD_LAUNCHER(name);
#include "fh_registry.inc"
#undef FH_REGISTER_FWD
#undef FH_REGISTER_BWD

namespace flash_hopper {
namespace {

#define FH_REGISTER_FWD(backend, dtype, kv_dtype, head_dim, head_dim_v, variant, name) \
  {backend, dtype, kv_dtype, head_dim, head_dim_v, variant, &name},
#define FH_REGISTER_BWD(backend, dtype, head_dim, name)
constexpr RegistryEntry kRegistry[] = {
#include "fh_registry.inc"
    // sentinel: keeps the array non-empty in a build with no kernels
    {-1, -1, -1, -1, -1, -1, nullptr},
};
#undef FH_REGISTER_FWD
#undef FH_REGISTER_BWD

#define FH_REGISTER_FWD(backend, dtype, kv_dtype, head_dim, head_dim_v, variant, name)
#define FH_REGISTER_BWD(backend, dtype, head_dim, name) {backend, dtype, head_dim, &name},
constexpr BwdRegistryEntry kBwdRegistry[] = {
#include "fh_registry.inc"
    {-1, -1, -1, nullptr},  // sentinel, as above (a build without backward kernels)
};
#undef FH_REGISTER_FWD
#undef FH_REGISTER_BWD

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

}  // namespace

int64_t head_dim_bucket(int64_t head_dim) {
  for (int64_t b : kHeadDimBuckets) {
    if (head_dim <= b) {
      return b;
    }
  }
  return -1;
}

const RegistryEntry* find_kernel(int32_t backend, int32_t dtype, int64_t head_dim,
                                 int32_t variant, int32_t kv_dtype, int64_t head_dim_v) {
  const int64_t bucket = head_dim_bucket(head_dim);
  const int64_t bucket_v = head_dim_v < 0 || head_dim_v == head_dim ? bucket
                                                                    : head_dim_bucket(head_dim_v);
  const int32_t kv = kv_dtype < 0 ? dtype : kv_dtype;
  for (const RegistryEntry& e : kRegistry) {
    if (e.launch != nullptr && e.backend == backend && e.dtype == dtype && e.kv_dtype == kv &&
        e.head_dim_bucket == bucket && e.head_dim_v_bucket == bucket_v && e.variant == variant) {
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

bool fa3_bwd_covers(int64_t head_dim) {
  const int64_t bucket = head_dim_bucket(head_dim);
#define FH_FA3_BWD_BUCKET(value)              \
  if (bucket == value) {                      \
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

bool own_head_dim_v_covers(int64_t head_dim, int64_t head_dim_v) {
  const int64_t bucket = head_dim_bucket(head_dim);
  const int64_t bucket_v = head_dim_bucket(head_dim_v);
#define FH_DV_PAIR(d, dv)                 \
  if (bucket == (d) && bucket_v == (dv)) { \
    return true;                          \
  }
  FH_HEAD_DIM_V_PAIRS(FH_DV_PAIR)
#undef FH_DV_PAIR
  return false;
}

std::string own_head_dim_v_pairs() {
  // A pair covers head_dim in its bucket (above the previous one) and head_dim_v likewise.
  std::string list;
  auto lower = [](int64_t bucket) {
    int64_t below = 0;
    for (int64_t b : kHeadDimBuckets) {
      if (b < bucket) {
        below = b;
      }
    }
    return below + 8;
  };
#define FH_DV_PAIR_NAME(d, dv)                                                                 \
  list += (list.empty() ? "" : ", ") + std::string("head_dim ") + std::to_string(lower(d)) + \
          ".." + std::to_string(d) + " with head_dim_v " + std::to_string(lower(dv)) + ".." +  \
          std::to_string(dv);
  FH_HEAD_DIM_V_PAIRS(FH_DV_PAIR_NAME)
#undef FH_DV_PAIR_NAME
  return list;
}

bool fp8_covers(int64_t head_dim) { return bucket_listed(head_dim, kFp8Buckets); }
std::string fp8_buckets() { return bucket_names(kFp8Buckets); }
bool mixed_covers(int64_t head_dim) { return bucket_listed(head_dim, kMixedBuckets); }
std::string mixed_buckets() { return bucket_names(kMixedBuckets); }

const char* mixed_name(int32_t dtype, int32_t kv_dtype) {
#define FH_MIXED_NAME(q_value, kv_value, name)    \
  if (dtype == q_value && kv_dtype == kv_value) { \
    return name;                                  \
  }
  FH_MIXED_TABLE(FH_MIXED_NAME)
#undef FH_MIXED_NAME
  return nullptr;
}

const char* dtype_name(int32_t dtype) {
#define FH_DTYPE_NAME(value, name) \
  if (dtype == value) {            \
    return name;                   \
  }
  FH_DTYPE_TABLE(FH_DTYPE_NAME)
#undef FH_DTYPE_NAME
  return nullptr;
}

const char* kv_dtype_name(int32_t kv_dtype) {
  if (const char* name = dtype_name(kv_dtype)) {
    return name;
  }
#define FH_MIXED_KV_NAME(q_value, kv_value, name) \
  if (kv_dtype == kv_value) {                     \
    return std::strchr(name, '+') + 1;            \
  }
  FH_MIXED_TABLE(FH_MIXED_KV_NAME)
#undef FH_MIXED_KV_NAME
  return nullptr;
}

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

namespace {

// The decode table (fh_decode_table.inc) as arrays.
struct DecodeDtype {
  int32_t value;     // q's FhDtype
  int32_t kv_value;  // K / V's
  const char* enumerator;     // "FH_DTYPE_BF16"
  const char* kv_enumerator;  // "FH_DTYPE_E4M3"
  const char* name;           // "bf16+e4m3"
};
#define FH_DECODE_DTYPE_ROW(q_value, kv_value, name) {q_value, kv_value, #q_value, #kv_value, name},
constexpr DecodeDtype kDecodeDtypes[] = {FH_DECODE_DTYPES(FH_DECODE_DTYPE_ROW)};
#undef FH_DECODE_DTYPE_ROW
#define FH_DECODE_HEAD_DIM_ROW(hd, stages, fp8_stages) hd,
constexpr int64_t kDecodeHeadDims[] = {FH_DECODE_TABLE(FH_DECODE_HEAD_DIM_ROW)};
#undef FH_DECODE_HEAD_DIM_ROW

// "a, b or c" of strings, and of an array's items as `text` spells each.
std::string either(const std::vector<std::string>& items) {
  std::string s;
  for (size_t i = 0; i < items.size(); ++i) {
    s += (i == 0 ? "" : (i + 1 == items.size() ? " or " : ", ")) + items[i];
  }
  return s;
}
template <class T, size_t N, class Text>
std::string either(const T (&items)[N], Text text) {
  std::vector<std::string> spelled;
  for (const T& item : items) {
    spelled.push_back(text(item));
  }
  return either(spelled);
}

}  // namespace

bool decode_has_q_dtype(int32_t dtype) {
  for (const DecodeDtype& d : kDecodeDtypes) {
    if (d.value == dtype) {
      return true;
    }
  }
  return false;
}

bool decode_has_dtype(int32_t dtype, int32_t kv_dtype) {
  return decode_dtype_name(dtype, kv_dtype) != nullptr;
}

const char* decode_dtype_name(int32_t dtype, int32_t kv_dtype) {
  for (const DecodeDtype& d : kDecodeDtypes) {
    if (d.value == dtype && d.kv_value == kv_dtype) {
      return d.name;
    }
  }
  return nullptr;
}

bool decode_has_head_dim(int64_t head_dim) {
  for (int64_t d : kDecodeHeadDims) {
    if (d == head_dim) {
      return true;
    }
  }
  return false;
}

const std::string& decode_dtype_choices() {
  static const std::string choices = [] {
    std::vector<std::string> seen;  // q's dtypes, once each, in the table's order
    for (const DecodeDtype& d : kDecodeDtypes) {
      const std::string item = format("%s (%d)", d.enumerator, int(d.value));
      if (std::find(seen.begin(), seen.end(), item) == seen.end()) {
        seen.push_back(item);
      }
    }
    return either(seen);
  }();
  return choices;
}

std::string decode_kv_dtype_choices(int32_t dtype) {
  std::vector<std::string> items;
  for (const DecodeDtype& d : kDecodeDtypes) {
    if (d.value == dtype) {
      items.push_back(d.kv_value == dtype ? format("0 or %s (%d)", d.kv_enumerator, int(d.kv_value))
                                          : format("%s (%d)", d.kv_enumerator, int(d.kv_value)));
    }
  }
  return either(items);
}

const std::string& decode_dtype_names() {
  static const std::string names =
      either(kDecodeDtypes, [](const DecodeDtype& d) { return std::string(d.name); });
  return names;
}

const std::string& decode_head_dim_choices() {
  static const std::string choices =
      either(kDecodeHeadDims, [](int64_t d) { return std::to_string(d); });
  return choices;
}

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
    case FH_BACKEND_DECODE: return "decode";
    default: return "unknown";
  }
}

}  // namespace flash_hopper
