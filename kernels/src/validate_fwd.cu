// Validation of FhFwdParams (fh_fwd, fh_fwd_select_backend, fh_fwd_workspace_size): the dtype and
// its modes (FP8 inputs, the mixed mode's FP8 k / v), varlen and the dispatch fields, on top of
// the rules validate.h shares.
#include <cstdint>

#include "flash_hopper/varlen.h"
#include "sm90/fwd/tile_config.h"
#include "src/validate.h"

namespace flash_hopper {
namespace {

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
  // The d192 kernel's PV accumulator is split over the head dim and always two-level; d256's
  // folds every 10 blocks into an fp16 copy, a second level the ablation was never measured or
  // tested without (kernels/sm90/fwd/tile_config.h, fwd_config_fp8).
  FH_CHECK(p->fp8_accumulation == FH_FP8_ACCUM_TWO_LEVEL || p->head_dim <= 128,
           "fp8_accumulation: the single-level ablation exists for head_dim <= 128 (the d192 / "
           "d256 kernels accumulate in two levels only), got head_dim %lld",
           (long long)p->head_dim);
  // So do the sequential kernels of FH_FP8_SEQUENTIAL builds (the same table says which).
  FH_CHECK(p->fp8_accumulation == FH_FP8_ACCUM_TWO_LEVEL ||
               sm90::fwd_config_fp8(int(p->head_dim)).intra_wg_overlap,
           "fp8_accumulation: expected FH_FP8_ACCUM_TWO_LEVEL (0) for head_dim %lld in this "
           "build (FH_FP8_SEQUENTIAL=ON: its kernel accumulates in two levels only), got "
           "FH_FP8_ACCUM_SINGLE_LEVEL (1)",
           (long long)p->head_dim);
  const NamedStride strides[] = {FH_NAMED_STRIDES(p, q, batch), FH_NAMED_STRIDES(p, k, batch),
                                 FH_NAMED_STRIDES(p, v, batch)};
  for (int i = mixed ? 3 : 0; i < 9; ++i) {  // the mixed mode's q is 16-bit (8-element rule)
    FH_CHECK(strides[i].stride % 16 == 0,
             "%s: expected a multiple of 16 elements for %s (16-byte aligned rows), got %lld",
             strides[i].name, what, (long long)strides[i].stride);
  }
  for (const auto& d : descales) {
    FH_TRY(validate_descale(d.name, d.ptr, d.batch_stride, d.head_stride, check_data));
  }
  return FH_SUCCESS;
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
    if (check_data && p->workspace != nullptr) {  // optional: the tile counter (api.h)
      FH_CHECK(aligned(p->workspace, alignof(int32_t)),
               "workspace: expected a 4-byte aligned device pointer (a dense call's tile counter, "
               "fh_fwd_workspace_size bytes) or null, got %p",
               p->workspace);
      FH_CHECK(p->workspace_bytes >= kFwdTileCounterBytes,
               "workspace_bytes: expected >= %lld (fh_fwd_workspace_size) with a workspace, got "
               "%lld",
               (long long)kFwdTileCounterBytes, (long long)p->workspace_bytes);
    }
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

}  // namespace

// Host-only checks: ABI, dtype, shapes, head dim, heads, scale/mask, strides, pointers (only with
// check_data: the policy alone does not read them), varlen, dispatch fields.
FhStatus validate(const FhFwdParams* p, bool check_data) {
  FH_CHECK(p != nullptr, "params: expected a non-null FhFwdParams pointer, got null");
  FH_TRY(validate_abi(p));
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

  // The variant's range before anything names it (the varlen checks print its name).
  FH_CHECK(p->variant >= 0 && p->variant < kNumVariants,
           "variant: expected an FhVariant 0 (tuned) .. %d (%s), got %d", kNumVariants - 1,
           kVariantNames[kNumVariants - 1], p->variant);
  FH_TRY(validate_varlen(p, fp8, mixed, check_data && !empty));
  FH_CHECK(p->backend == FH_BACKEND_AUTO || p->backend == FH_BACKEND_FA2 ||
               p->backend == FH_BACKEND_FA3,
           "backend: expected FH_BACKEND_AUTO (0), FA2 (1) or FA3 (2), got %d", p->backend);
  FH_CHECK(p->variant == FH_VARIANT_TUNED || p->backend == FH_BACKEND_FA3,
           "variant: %d (%s) is a variant of the fa3 path and needs backend FH_BACKEND_FA3 (2), "
           "got backend %d (%s)",
           p->variant, kVariantNames[p->variant], p->backend, backend_name(p->backend));
  FH_CHECK(p->num_sms >= 0, "num_sms: expected 0 (every SM) or a positive cap, got %d",
           p->num_sms);
  FH_CHECK(p->decode_route == 0 || p->decode_route == 1,
           "decode_route: expected 0 (the FA paths) or 1 (the decode kernel where it serves the "
           "call), got %d",
           p->decode_route);
  return FH_SUCCESS;
}

}  // namespace flash_hopper
