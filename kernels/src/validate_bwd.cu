// Validation of FhBwdParams (fh_bwd, fh_bwd_select_backend, fh_bwd_workspace_size), and the
// backward's workspace layout that the size check, fh_bwd_workspace_size and derive_bwd share.
#include <cstdint>

#include "flash_hopper/bwd_params.h"
#include "src/validate.h"

namespace flash_hopper {
namespace {

// Every region starts 256-byte aligned: the kernels' widest accesses (bulk copies, float4) and
// the caller's allocator (torch's blocks are 512-byte aligned) both agree with that.
constexpr int64_t kWorkspaceAlign = 256;

int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

}  // namespace

bool bwd_workspace(const FhBwdParams* p, BwdWorkspace* ws) {
  // Varlen: one batch entry whose rows hold every sequence's padded blocks (bwd_ws_row0).
  const bool varlen = p->cu_seqlens_q != nullptr;
  ws->seqlen_q_rounded = varlen && p->seqlen_q > 0
                             ? round_up(p->seqlen_q + kBwdRowPad * p->batch, kBwdRowPad)
                             : bwd_rows_rounded(p->seqlen_q);
  ws->head_dim_rounded = head_dim_bucket(p->head_dim);
  int64_t rows = 0;  // batch entries * heads_q * seqlen_q_rounded
  int64_t accum_bytes = 0;
  if (__builtin_mul_overflow((varlen ? 1 : p->batch) * p->heads_q, ws->seqlen_q_rounded,
                             &rows) ||
      __builtin_mul_overflow(rows, ws->head_dim_rounded * 4, &accum_bytes)) {
    return false;
  }
  // Sizes in bytes; rows * 4 cannot overflow where accum_bytes did not.
  const int64_t region_bytes[] = {
      accum_bytes,                   // dq_accum
      rows * 4,                      // lse_log2
      rows * 4,                      // dpsum
      rows / kBwdSemaphoreRows * 4,  // semaphores
      rows > 0 ? 4 : 0,              // tile_counter (an empty problem needs no workspace)
  };
  int64_t* const starts[] = {&ws->dq_accum, &ws->lse_log2, &ws->dpsum, &ws->semaphores,
                             &ws->tile_counter};
  static_assert(sizeof(region_bytes) / sizeof(region_bytes[0]) ==
                sizeof(starts) / sizeof(starts[0]));
  int64_t offset = 0;
  for (size_t i = 0; i < sizeof(starts) / sizeof(starts[0]); ++i) {
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

namespace {

// The reserved fields of FhBwdParams (api.h): each is rejected by name until its feature lands.
FhStatus validate_bwd_reserved(const FhBwdParams* p) {
  const struct {
    const char* name;
    bool set;
    const char* feature;
  } reserved[] = {
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

// The varlen fields (api.h, as the forward's): both offsets arrays or neither, seqused only with
// them, packed tensors (every batch stride 0), bounds >= 0. The arrays' contents live on the
// device: the kernels clamp them to the tensors (flash_hopper/varlen.h).
FhStatus validate_bwd_varlen(const FhBwdParams* p, bool check_data) {
  if (p->cu_seqlens_q == nullptr && p->cu_seqlens_k == nullptr) {
    FH_CHECK(p->seqused_q == nullptr && p->seqused_k == nullptr,
             "seqused_q / seqused_k: expected null in a dense call (they belong to varlen calls: "
             "cu_seqlens_q / cu_seqlens_k), got %p / %p",
             static_cast<const void*>(p->seqused_q), static_cast<const void*>(p->seqused_k));
    FH_CHECK(p->max_seqlen_q == 0 && p->max_seqlen_k == 0,
             "max_seqlen_q / max_seqlen_k: expected 0 in a dense call (seqlen_q / seqlen_k are "
             "the lengths), got %lld / %lld",
             (long long)p->max_seqlen_q, (long long)p->max_seqlen_k);
    return FH_SUCCESS;
  }
  FH_CHECK(p->cu_seqlens_q != nullptr && p->cu_seqlens_k != nullptr,
           "cu_seqlens_q / cu_seqlens_k: expected both (a varlen call), got %s",
           p->cu_seqlens_q ? "cu_seqlens_k null" : "cu_seqlens_q null");
  const NamedStride batch_strides[] = {
      {"q_batch_stride", p->q_batch_stride},       {"k_batch_stride", p->k_batch_stride},
      {"v_batch_stride", p->v_batch_stride},       {"o_batch_stride", p->o_batch_stride},
      {"dout_batch_stride", p->dout_batch_stride}, {"dq_batch_stride", p->dq_batch_stride},
      {"dk_batch_stride", p->dk_batch_stride},     {"dv_batch_stride", p->dv_batch_stride},
      {"lse_batch_stride", p->lse_batch_stride},   {"dlse_batch_stride", p->dlse_batch_stride},
  };
  for (const NamedStride& st : batch_strides) {
    FH_CHECK(st.stride == 0,
             "%s: expected 0 in a varlen call (packed tensors have no batch axis), got %lld",
             st.name, (long long)st.stride);
  }
  FH_CHECK(p->max_seqlen_q >= 0 && p->max_seqlen_k >= 0,
           "max_seqlen_q / max_seqlen_k: expected >= 0 (the longest sequence's length, 0 = "
           "unknown: the totals bound them), got %lld / %lld",
           (long long)p->max_seqlen_q, (long long)p->max_seqlen_k);
  FH_CHECK(p->seqlen_q + kBwdRowPad * (p->batch + 1) <= kMaxSeqlen,
           "seqlen_q: expected total_q + %d * (batch + 1) <= %lld for the varlen backward (its "
           "padded rows count in int32), got total_q %lld with batch %lld",
           kBwdRowPad, (long long)kMaxSeqlen, (long long)p->seqlen_q, (long long)p->batch);
  if (check_data) {
    const int32_t* arrays[] = {p->cu_seqlens_q, p->cu_seqlens_k, p->seqused_q, p->seqused_k};
    const char* names[] = {"cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k"};
    for (int i = 0; i < 4; ++i) {
      FH_CHECK(aligned(arrays[i], alignof(int32_t)),
               "%s: expected a 4-byte aligned device pointer (int32), got %p", names[i],
               static_cast<const void*>(arrays[i]));
    }
  }
  return FH_SUCCESS;
}

}  // namespace

FhStatus validate(const FhBwdParams* p, bool check_data) {
  FH_CHECK(p != nullptr, "params: expected a non-null FhBwdParams pointer, got null");
  FH_TRY(validate_abi(p));
  FH_CHECK(dtype_name(p->dtype) != nullptr && p->dtype != FH_DTYPE_E4M3,
           "dtype: expected FH_DTYPE_FP16 (0) or FH_DTYPE_BF16 (1) (the backward has no FP8), "
           "got %d",
           p->dtype);
  FH_CHECK(p->deterministic == 0 || p->deterministic == 1,
           "deterministic: expected 0 or 1 (bitwise-reproducible dq), got %d", p->deterministic);
  FH_TRY(validate_shapes(p));
  // BwdParams counts the padded rows in int32.
  // (kMaxSeqlen / kBwdRowPad - 1) * kBwdRowPad rounds to at most kMaxSeqlen / kBwdRowPad *
  // kBwdRowPad: the 80-row rounding adds less than one kBwdRowPad.
  constexpr int64_t kMaxBwdSeqlenQ = (kMaxSeqlen / kBwdRowPad - 1) * kBwdRowPad;
  static_assert(bwd_rows_rounded(kMaxBwdSeqlenQ) <= kMaxSeqlen);
  FH_CHECK(p->seqlen_q <= kMaxBwdSeqlenQ,
           "seqlen_q: expected 0..%lld for the backward (its padded workspace rows must fit "
           "int32), got %lld",
           (long long)kMaxBwdSeqlenQ, (long long)p->seqlen_q);
  FH_TRY(validate_score(p));
  FH_TRY(validate_bwd_varlen(p, check_data));  // before the workspace: varlen changes its layout
  FH_TRY(validate_qkvo_strides(p));
  const NamedStride strides[] = {FH_NAMED_STRIDES(p, dout, batch), FH_NAMED_STRIDES(p, dq, batch),
                                 FH_NAMED_STRIDES(p, dk, batch), FH_NAMED_STRIDES(p, dv, batch)};
  FH_TRY(validate_strides(strides));
  BwdWorkspace ws;
  const bool workspace_fits = bwd_workspace(p, &ws);
  // The kernels count the workspace's rows in int32 (BwdSpans::dq_row0): a problem past that
  // would need more than a terabyte of it.
  FH_CHECK(!workspace_fits ||
               (p->cu_seqlens_q != nullptr ? 1 : p->batch) * p->heads_q * ws.seqlen_q_rounded <=
                   INT32_MAX,
           "batch/heads_q/seqlen_q: the backward's workspace rows (batch %lld x heads_q %lld x "
           "%lld padded rows) must fit int32",
           (long long)p->batch, (long long)p->heads_q, (long long)ws.seqlen_q_rounded);
  FH_CHECK(workspace_fits,
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

}  // namespace flash_hopper
