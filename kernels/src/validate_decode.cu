// Validation of FhDecodeParams (fh_decode_plan, fh_decode, fh_decode_select_backend) and the plan
// fh_decode_plan answers: the key splits and the workspace they need
// (kernels/include/flash_hopper/decode_plan.h).
#include <cstdint>

#include "flash_hopper/decode_plan.h"
#include "src/decode.h"
#include "src/validate.h"

namespace flash_hopper {
namespace {

int64_t decode_row_blocks(const FhDecodeParams* p) {
  return decode::row_blocks(p->seqlen_q, p->heads_q / p->heads_kv);
}

// The FP8 fields (api.h): q_descale with e4m3 q only, k_descale / v_descale with an FP8 cache
// only (a 16-bit call has nothing for them to scale), strides >= 0; with check_data, float-aligned
// pointers.
FhStatus validate_decode_descales(const FhDecodeParams* p, bool check_data) {
  const int32_t kv_dtype = decode_kv_dtype(p);
  const bool fp8_kv = decode_fp8_kv(kv_dtype);
  const struct {
    const char* name;
    const float* ptr;
    int64_t batch_stride;
    int64_t head_stride;
    bool used;
  } descales[] = {
      {"q_descale", p->q_descale, p->q_descale_batch_stride, p->q_descale_head_stride,
       p->dtype == FH_DTYPE_E4M3},
      {"k_descale", p->k_descale, p->k_descale_batch_stride, p->k_descale_head_stride, fp8_kv},
      {"v_descale", p->v_descale, p->v_descale_batch_stride, p->v_descale_head_stride, fp8_kv},
  };
  for (const auto& d : descales) {
    const char* dtype = kv_dtype_name(d.name[0] == 'q' ? p->dtype : kv_dtype);
    FH_CHECK(d.used || d.ptr == nullptr,
             "%s: expected null with %s %s (descales scale FP8 values), got %p", d.name,
             dtype != nullptr ? dtype : "16-bit", d.name[0] == 'q' ? "q" : "k / v",
             static_cast<const void*>(d.ptr));
    FH_TRY(validate_descale(d.name, d.ptr, d.batch_stride, d.head_stride, check_data));
  }
  return FH_SUCCESS;
}

}  // namespace

FhStatus validate_decode_shapes(const FhDecodeParams* p) {
  FH_CHECK(p != nullptr, "params: expected a pointer to FhDecodeParams, got null");
  FH_TRY(validate_abi(p));
  FH_CHECK(decode_has_q_dtype(p->dtype), "dtype: expected %s for decode, got %d",
           decode_dtype_choices().c_str(), p->dtype);
  FH_CHECK(decode_has_dtype(p->dtype, decode_kv_dtype(p)),
           "kv_dtype: expected %s with dtype %s for decode, got %d",
           decode_kv_dtype_choices(p->dtype).c_str(), dtype_name(p->dtype), p->kv_dtype);
  FH_CHECK(decode_has_head_dim(p->head_dim), "head_dim: expected %s for decode, got %lld",
           decode_head_dim_choices().c_str(), (long long)p->head_dim);
  return validate_decode_layout(p);
}

FhStatus validate_decode_layout(const FhDecodeParams* p) {
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
  FH_TRY(validate_decode_descales(p, /*check_data=*/false));
  FH_CHECK(p->num_splits >= 0, "num_splits: expected >= 0, got %d", p->num_splits);
  return FH_SUCCESS;
}

int decode_splits(const FhDecodeParams* p, int num_sms) {
  if (p->num_splits > 0) {
    return p->num_splits < decode::kMaxSplits ? p->num_splits : decode::kMaxSplits;
  }
  // the CTAs over a cache: a CTA takes decode_row_tiles row blocks
  const int64_t tiles =
      p->batch * p->heads_kv * decode_row_blocks(p) / decode_row_tiles(p, num_sms);
  const int64_t keys = p->page_table != nullptr ? p->max_pages * p->page_size : p->page_size;
  // A 16-bit cache, dense or paged: one CTA per SM, though two fit at d128: as fast or faster,
  // and fewer splits to merge (bench/PERFLOG.md "where a short decode call's time goes, and the
  // graph around it"; paged since its loads compute a page's offsets once per thread and block:
  // "two row blocks per CTA"). An FP8 cache fills every CTA slot where it is paged or its rows
  // take several row blocks: its CTAs widen every key they load and are issue-bound, and run
  // measurably faster two to an SM (bench/PERFLOG.md "the combine's row groups; FP8 row blocks
  // fill the SMs").
  const bool fp8_kv = decode_fp8_kv(decode_kv_dtype(p));
  const bool fill = fp8_kv && (p->page_table != nullptr || decode_row_blocks(p) > 1);
  const int ctas_per_sm = fill ? decode_ctas_per_sm(p->head_dim, fp8_kv) : 1;
  return decode::default_splits(tiles, keys, num_sms, ctas_per_sm, /*min_keys=*/256);
}

int64_t decode_workspace_bytes(const FhDecodeParams* p, int splits) {
  return decode::decode_workspace(p->batch * p->heads_kv * decode_row_blocks(p), splits,
                                  static_cast<int>(p->head_dim))
      .bytes;
}

namespace {

// cp.async moves 16-byte vectors: every row and head start of q, k, v and o 16-byte aligned,
// which for FP8 q, k and v is 16 elements.
FhStatus validate_decode_strides(const FhDecodeParams* p) {
  const NamedStride strides[] = {FH_NAMED_STRIDES(p, q, batch), FH_NAMED_STRIDES(p, k, page),
                                 FH_NAMED_STRIDES(p, v, page), FH_NAMED_STRIDES(p, o, batch)};
  FH_TRY(validate_strides(strides));
  const int first = p->dtype == FH_DTYPE_E4M3 ? 0 : 3;            // q's three, if FP8
  const int last = decode_fp8_kv(decode_kv_dtype(p)) ? 9 : 3;     // k's and v's, if FP8
  for (int i = first; i < last; ++i) {
    FH_CHECK(strides[i].stride % 16 == 0,
             "%s: expected a multiple of 16 elements for FP8 (16-byte aligned rows), got %lld",
             strides[i].name, (long long)strides[i].stride);
  }
  return FH_SUCCESS;
}

}  // namespace

FhStatus validate(const FhDecodeParams* p, bool check_data) {
  if (check_data) {
    return validate_decode(p);
  }
  FH_CHECK(p != nullptr, "params: expected a pointer to FhDecodeParams, got null");
  FH_TRY(validate_abi(p));
  FH_TRY(validate_decode_layout(p));
  return validate_decode_strides(p);
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
  FH_TRY(validate_decode_strides(p));
  FH_TRY(validate_decode_descales(p, /*check_data=*/true));
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

}  // namespace flash_hopper
