// Kernel-side backward parameters, shared by the preprocess, the main kernels of both paths and
// the postprocess.
//
// kernels/src/validate_bwd.cu validates the C ABI's FhBwdParams, derive.cu derives this struct
// once per call (as FwdParams for the forward). Shapes and head counts fit int32 (validated);
// offsets are int64.
//
// The workspace (api.h documents the layout) is split here into its four regions. Rows of the
// per-query regions are padded to seqlen_q_rounded (a multiple of kBwdRowPad, the largest block_m
// of either path, so every query block of every kernel lies inside them) and dq_accum's columns
// to head_dim_rounded (the kernel's bucket): the main kernels add whole tiles without predicates.
#pragma once

#include <cstdint>

#include "flash_hopper/host_device.h"
#include "flash_hopper/mask.h"

namespace flash_hopper {

constexpr int kBwdRowPad = 128;      // seqlen_q_rounded = round_up(seqlen_q, kBwdRowPad)
constexpr int kBwdSemaphoreRows = 64;  // one semaphore per 64 query rows (block_m >= 64)

struct BwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  const float* lse;   // natural log, forward layout
  const float* dlse;  // null: 0
  void* dq;
  void* dk;
  void* dv;

  // Workspace regions (api.h); index with the helpers below.
  float* dq_accum;  // (batch, heads_q, seqlen_q_rounded, head_dim_rounded), zeroed by preprocess;
                    // each query block's block_m * head_dim_rounded floats are in the path's own
                    // order (its postprocess reads them back)
  float* lse_log2;  // (batch, heads_q, seqlen_q_rounded): lse * log2(e); +inf for a row that sees
                    // no key and for padded rows, so P = exp2(s - lse_log2) = 0 there
  float* dpsum;     // (batch, heads_q, seqlen_q_rounded): D = rowsum(dO * O) - dlse; 0 when padded
  int* semaphores;  // (batch, heads_q, seqlen_q_rounded / kBwdSemaphoreRows), zeroed by preprocess
  int* tile_counter;  // one int32, zeroed by preprocess: the FA-3 path's tile claims

  int batch;
  int seqlen_q;
  int seqlen_k;
  int heads_q;
  int heads_kv;
  int heads_per_kv;
  int head_dim;
  int seqlen_q_rounded;
  int head_dim_rounded;

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t dout_batch_stride, dout_row_stride, dout_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int64_t lse_batch_stride, lse_head_stride;
  int64_t dlse_batch_stride, dlse_head_stride;

  // As FwdParams: without softcap the score is s * softmax_scale and scale_log2 = softmax_scale *
  // log2(e); with softcap the score is softcap * tanh(s * softcap_prescale), scale_log2 = log2(e).
  // P = exp2(score_unscaled * scale_log2 - lse_log2). dq and dk get one final * softmax_scale.
  float scale_log2;
  float softmax_scale;
  float softcap;  // 0 = off
  float softcap_prescale;

  int window_left;
  int window_right;

  int deterministic;
  int num_sms;

  // Offsets of row 0 of (batch, head_q) in the per-query workspace regions.
  FH_HOST_DEVICE int64_t row_offset(int b, int h) const {
    return (int64_t(b) * heads_q + h) * seqlen_q_rounded;
  }
  FH_HOST_DEVICE int64_t dq_accum_offset(int b, int h) const {
    return row_offset(b, h) * head_dim_rounded;
  }
  FH_HOST_DEVICE int64_t semaphore_offset(int b, int h) const {
    return (int64_t(b) * heads_q + h) * (seqlen_q_rounded / kBwdSemaphoreRows);
  }
};

FH_HOST_DEVICE AttentionMask attention_mask(BwdParams const& p) {
  return {p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
}

}  // namespace flash_hopper
