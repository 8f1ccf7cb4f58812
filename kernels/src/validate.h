// Host-only validation of the C ABI's parameter structs, before any CUDA call: a bad argument is
// reported with the field's name, the expected and the given value, and nothing is launched.
// Python validates tensors first (python/flash_hopper/_validate.py, tensor-level messages, once per
// call signature); this layer protects every other caller of the ABI.
//
// Here: the limits and the rules FhFwdParams, FhBwdParams and FhDecodeParams share under the same
// field names, and one validate per entry point (validate_fwd.cu, validate_bwd.cu,
// validate_decode.cu). The backward's workspace layout lives with its validation: the size check
// and the carving of the pointers (derive.cu) read the one description, bwd_workspace().
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "flash_hopper/api.h"
#include "src/errors.h"
#include "src/tables.h"

namespace flash_hopper {

constexpr int64_t kHeadDimMultiple = 8;  // 16-byte rows of 2-byte elements
constexpr int64_t kMaxGridYZ = 65535;    // heads and batch map to gridDim.y / gridDim.z
constexpr int64_t kMaxSeqlen = INT32_MAX;

inline bool aligned(const void* ptr, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(ptr) & (bytes - 1)) == 0;
}

// Whether k / v are in another dtype than q (FhFwdParams::kv_dtype: 0 means dtype's).
inline bool is_mixed(const FhFwdParams* p) { return p->kv_dtype != 0 && p->kv_dtype != p->dtype; }

inline bool is_varlen(const FhFwdParams* p) {
  return p->cu_seqlens_q != nullptr || p->cu_seqlens_k != nullptr || p->seqused_q != nullptr ||
         p->seqused_k != nullptr;
}

// A dense forward call's workspace (api.h, fh_fwd_workspace_size): the tile counter that masked
// calls on the FA-3 path claim their tiles from (sm90/fwd/tile_scheduler.h); calls without a mask
// need none. The workspace stays optional: without it tiles are walked statically.
constexpr int64_t kFwdTileCounterBytes = 4;
inline int64_t dense_fwd_workspace_bytes(const FhFwdParams* p) {
  return p->window_left >= 0 || p->window_right >= 0 ? kFwdTileCounterBytes : 0;
}

// The struct was filled for this library's layout of it.
template <class Params>
FhStatus validate_abi(const Params* p) {
  FH_CHECK(p->abi_version == FH_ABI_VERSION,
           "abi_version: expected %d (this library's FH_ABI_VERSION), got %d", FH_ABI_VERSION,
           p->abi_version);
  return FH_SUCCESS;
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
  if constexpr (std::is_same_v<Params, FhFwdParams>) {
    // Which (head_dim, head_dim_v) pairs have a kernel is the policy's answer (policy.cu).
    FH_CHECK(p->head_dim_v >= kHeadDimMultiple && p->head_dim_v <= kMaxHeadDim &&
                 p->head_dim_v % kHeadDimMultiple == 0,
             "head_dim_v: expected a multiple of %lld in %lld..%lld, got %lld",
             (long long)kHeadDimMultiple, (long long)kHeadDimMultiple, (long long)kMaxHeadDim,
             (long long)p->head_dim_v);
  } else {
    FH_CHECK(p->head_dim_v == p->head_dim,
             "head_dim_v: expected %lld (== head_dim: the backward has no V head dim of its own), "
             "got %lld",
             (long long)p->head_dim, (long long)p->head_dim_v);
  }
  return FH_SUCCESS;
}

// Score transform and mask: the same rules for every entry point.
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

// A tensor's strides by field name, outer (batch, or page for a paged cache) then row then head:
// FH_NAMED_STRIDES(p, q, batch) is {"q_batch_stride", p->q_batch_stride}, {"q_row_stride", ...},
// {"q_head_stride", ...}.
#define FH_NAMED_STRIDES(p, tensor, outer)                               \
  NamedStride{#tensor "_" #outer "_stride", (p)->tensor##_##outer##_stride}, \
      NamedStride{#tensor "_row_stride", (p)->tensor##_row_stride},        \
      NamedStride{#tensor "_head_stride", (p)->tensor##_head_stride}

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
  const NamedStride strides[] = {FH_NAMED_STRIDES(p, q, batch), FH_NAMED_STRIDES(p, k, batch),
                                 FH_NAMED_STRIDES(p, v, batch), FH_NAMED_STRIDES(p, o, batch)};
  return validate_strides(strides);
}

// A descale of FhFwdParams or FhDecodeParams (the same fields, api.h): strides >= 0 (0
// broadcasts) and, with check_data, a float-aligned pointer or null.
inline FhStatus validate_descale(const char* name, const float* ptr, int64_t batch_stride,
                                 int64_t head_stride, bool check_data) {
  FH_CHECK(batch_stride >= 0 && head_stride >= 0,
           "%s: expected strides >= 0 (0 broadcasts), got batch stride %lld, head stride %lld",
           name, (long long)batch_stride, (long long)head_stride);
  FH_CHECK(!check_data || aligned(ptr, alignof(float)),
           "%s: expected a %d-byte aligned pointer (float) or null, got %p", name,
           int(alignof(float)), static_cast<const void*>(ptr));
  return FH_SUCCESS;
}

// A 2-byte-element tensor the kernels read or write with 16-byte vectors.
inline FhStatus validate_tensor(const void* ptr, const char* name) {
  FH_CHECK(ptr != nullptr, "%s: expected a device pointer, got null", name);
  FH_CHECK(aligned(ptr, 16), "%s: expected a 16-byte aligned pointer, got %p", name, ptr);
  return FH_SUCCESS;
}

// --- forward (validate_fwd.cu) ---------------------------------------------------------------

// Host-only checks: ABI, dtype, shapes, head dim, heads, scale/mask, strides, pointers (only with
// check_data: the policy alone does not read them), varlen, reserved fields, dispatch fields.
FhStatus validate(const FhFwdParams* p, bool check_data);

// --- backward (validate_bwd.cu) --------------------------------------------------------------

// The backward's workspace for a validated FhBwdParams: byte offsets of the five regions api.h
// documents (bwd_params.h names them) from the workspace's start, and its size. The one place
// that knows the layout: fh_bwd_workspace_size reports `bytes`, derive_bwd carves the pointers.
struct BwdWorkspace {
  int64_t seqlen_q_rounded = 0;  // bwd_rows_rounded(seqlen_q); varlen: bwd_ws_row0's rows
  int64_t head_dim_rounded = 0;  // the head-dim bucket
  int64_t dq_accum = 0;          // fp32 (batch, heads_q, seqlen_q_rounded, head_dim_rounded)
  int64_t lse_log2 = 0;          // fp32 (batch, heads_q, seqlen_q_rounded)
  int64_t dpsum = 0;             // fp32 (batch, heads_q, seqlen_q_rounded)
  int64_t semaphores = 0;        // int32 (batch, heads_q, seqlen_q_rounded / kBwdSemaphoreRows)
  int64_t tile_counter = 0;      // int32, one
  int64_t bytes = 0;             // the end of the last region
};

// False when a size overflows int64 (a problem far larger than any GPU's memory).
bool bwd_workspace(const FhBwdParams* p, BwdWorkspace* ws);

// The backward's host-only checks, in the forward's order: ABI, dtype, mode, shapes, scale/mask,
// strides, workspace size, pointers and workspace (only with check_data: the policy and the
// workspace size do not read them), reserved fields, dispatch fields.
FhStatus validate(const FhBwdParams* p, bool check_data);

// --- decode (validate_decode.cu) -------------------------------------------------------------

// Everything fh_decode_plan needs (no data pointers): the dtype and head dim the decode table
// has, shapes, the cache's geometry, the score.
FhStatus validate_decode_shapes(const FhDecodeParams* p);

// The same but the dtype and head dim, after the struct's pointer and abi_version.
FhStatus validate_decode_layout(const FhDecodeParams* p);

// The decode call as the policy takes it (fh_decode_select_backend): the pointer, abi_version,
// layout and strides, not the dtype and head dim (the policy weighs those: policy.cu); with
// check_data, everything fh_decode needs.
FhStatus validate(const FhDecodeParams* p, bool check_data);

// Everything fh_decode needs: the shapes, a planned num_splits, pointers, strides, workspace.
FhStatus validate_decode(const FhDecodeParams* p);

// fh_decode_plan's answer for validated shapes: the splits (the caller's, capped, or chosen for
// num_sms SMs) and the workspace they need.
int decode_splits(const FhDecodeParams* p, int num_sms);
int64_t decode_workspace_bytes(const FhDecodeParams* p, int splits);

}  // namespace flash_hopper
