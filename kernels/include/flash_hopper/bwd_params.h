// Kernel-side backward parameters, shared by the preprocess, the main kernels of both paths and
// the postprocess.
//
// kernels/src/validate_bwd.cu validates the C ABI's FhBwdParams, derive.cu derives this struct
// once per call (as FwdParams for the forward). Shapes and head counts fit int32 (validated);
// offsets are int64.
//
// The workspace (api.h documents the layout) is split here into its four regions. Rows of the
// per-query regions are padded to seqlen_q_rounded (a multiple of kBwdRowPad, the largest block_m
// of either path, that holds the unmasked tile's 80-row blocks too: every query block of every
// kernel lies inside them) and dq_accum's columns to head_dim_rounded (the kernel's bucket): the
// main kernels add whole tiles without predicates.
#pragma once

#include <cstdint>

#include "flash_hopper/host_device.h"
#include "flash_hopper/mask.h"
#include "flash_hopper/varlen.h"

namespace flash_hopper {

// seqlen_q_rounded = bwd_rows_rounded(seqlen_q); varlen: round_up(total_q + kBwdRowPad * batch,
// kBwdRowPad) (bwd_ws_row0)
constexpr int kBwdRowPad = 128;
constexpr int kBwdSemaphoreRows = 64;  // one semaphore per 64 query rows (block_m 64 / 128)
// The unmasked d128 tile's query blocks (sm90/bwd/tile_config.h bwd_config_unmasked): dense calls
// only, whose rows are rounded for them too.
constexpr int kBwdUnmaskedBlockM = 80;

// A dense call's per-query workspace rows: a multiple of kBwdRowPad that holds every query block
// of 64, 80 or 128 rows of seqlen_q rows.
FH_HOST_DEVICE constexpr int64_t bwd_rows_rounded(int64_t seqlen_q) {
  const int64_t blocks_80 = (seqlen_q + kBwdUnmaskedBlockM - 1) / kBwdUnmaskedBlockM;
  return (blocks_80 * kBwdUnmaskedBlockM + kBwdRowPad - 1) / kBwdRowPad * kBwdRowPad;
}

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

  // Varlen (cu_seqlens_q non-null; docs/bwd_sm90.md "Varlen"): batch counts the sequences,
  // seqlen_q / seqlen_k are the bounds of their lengths (the caller's max_seqlen, else the
  // totals; bwd_span clamps each sequence to them), total_q / total_k the packed tensors' rows,
  // every batch stride 0. The per-query workspace regions are one batch entry of
  // seqlen_q_rounded rows in which sequence b starts at bwd_ws_row0.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  const int32_t* seqused_q;
  const int32_t* seqused_k;
  int total_q;
  int total_k;

  FH_HOST_DEVICE bool varlen() const { return cu_seqlens_q != nullptr; }
  // The packed (varlen) or per-batch rows of q / dout and k / v, and the tensors' batch entries,
  // as the TMA descriptors see them.
  FH_HOST_DEVICE int q_rows() const { return varlen() ? total_q : seqlen_q; }
  FH_HOST_DEVICE int k_rows() const { return varlen() ? total_k : seqlen_k; }
  FH_HOST_DEVICE int batch_entries() const { return varlen() ? 1 : batch; }

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

// Where sequence b of a varlen call starts in the per-query workspace rows: its first token
// plus kBwdRowPad rows per sequence before it, rounded down to kBwdRowPad. Query blocks of
// consecutive sequences then never share a kBwdRowPad block, and for any offsets clamped to
// [0, total_q] every block of every sequence ends before total_q + kBwdRowPad * batch.
FH_HOST_DEVICE int bwd_ws_row0(int q_start, int b) {
  return (q_start + b * kBwdRowPad) / kBwdRowPad * kBwdRowPad;
}

// One tile's sequence: its batch entry of the tensors and the workspace, its first query and key
// rows there, its lengths, and its first row in its batch entry of the per-query workspace
// regions (varlen: bwd_ws_row0). Dense: (b, 0, 0, seqlen_q, seqlen_k, 0).
struct BwdSpan {
  int batch;
  int q_start;
  int k_start;
  int seqlen_q;
  int seqlen_k;
  int ws_row0;
};

// The sequences of a call (plain data: the tile schedule reads them, schedule.h). Varlen:
// sequence_span's rule (flash_hopper/varlen.h), lengths clamped to the bounds.
struct BwdSpans {
  const int32_t* cu_q = nullptr;  // null: dense
  const int32_t* cu_k = nullptr;
  const int32_t* used_q = nullptr;
  const int32_t* used_k = nullptr;
  int total_q = 0;
  int total_k = 0;
  int seqlen_q = 0;  // dense: the lengths; varlen: their bounds
  int seqlen_k = 0;
  int heads_q = 0;          // the workspace's rows: heads_q x seqlen_q_rounded per batch entry
  int seqlen_q_rounded = 0;

  FH_HOST_DEVICE BwdSpan operator()(int b) const {
    if (cu_q == nullptr) {
      return {b, 0, 0, seqlen_q, seqlen_k, 0};
    }
    const SequenceSpan s = sequence_span(cu_q, cu_k, used_q, used_k, b, total_q, total_k);
    return {0,
            s.q_start,
            s.k_start,
            s.seqlen_q < seqlen_q ? s.seqlen_q : seqlen_q,
            s.seqlen_k < seqlen_k ? s.seqlen_k : seqlen_k,
            bwd_ws_row0(s.q_start, b)};
  }
  // The workspace row (of all batch entries) of the span's row 0 in query head 0: row r of
  // query head h is this + h * seqlen_q_rounded + r. Below 2^31: the workspace's rows are
  // (validate_bwd.cu).
  FH_HOST_DEVICE int dq_row0(BwdSpan const& s) const {
    return (s.batch * heads_q) * seqlen_q_rounded + s.ws_row0;
  }
};

FH_HOST_DEVICE BwdSpans bwd_spans(BwdParams const& p) {
  BwdSpans s;
  s.cu_q = p.cu_seqlens_q;
  s.cu_k = p.cu_seqlens_k;
  s.used_q = p.seqused_q;
  s.used_k = p.seqused_k;
  s.total_q = p.total_q;
  s.total_k = p.total_k;
  s.seqlen_q = p.seqlen_q;
  s.seqlen_k = p.seqlen_k;
  s.heads_q = p.heads_q;
  s.seqlen_q_rounded = p.seqlen_q_rounded;
  return s;
}

}  // namespace flash_hopper
