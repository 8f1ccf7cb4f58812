// Kernel-side forward parameters, shared by the FA-2 (sm80) and FA-3 (sm90) paths.
//
// kernels/src/validate_fwd.cu validates the C ABI's FhFwdParams, derive.cu derives this struct
// once per call; every kernel takes it by value as a __grid_constant__ parameter. Sequence
// lengths and head counts fit int32 (validated); offsets are computed in int64 from the int64
// strides, so tensors with more than 2^31 elements work.
#pragma once

#include <cstdint>

#include "flash_hopper/host_device.h"
#include "flash_hopper/mask.h"
#include "flash_hopper/varlen.h"

namespace flash_hopper {

struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // null: not written

  int batch;     // varlen: the number of sequences
  int seqlen_q;  // varlen: total_q, the packed q rows (each sequence's length: its VarlenPair)
  int seqlen_k;  // varlen: total_k
  int heads_q;
  int heads_kv;
  int heads_per_kv;  // heads_q / heads_kv (GQA group size)
  int head_dim;      // actual head dim (<= the kernel's bucket; the rest is zero-filled)

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;

  // Softmax in base 2 with the scale folded into one FFMA: p = exp2(s * scale_log2 - m * scale_log2).
  // Without softcap s is q.k and scale_log2 = softmax_scale * log2(e); with softcap the kernel first
  // maps s -> softcap * tanh(s * softcap_prescale) (softcap_prescale = softmax_scale / softcap), and
  // then scale_log2 = log2(e). lse = m * lse_scale + log(l), lse_scale = scale_log2 / log2(e).
  float scale_log2;
  float lse_scale;
  float softcap;  // 0 = off
  float softcap_prescale;

  // Window in key positions relative to the bottom-right aligned diagonal; -1 = unbounded.
  int window_left;
  int window_right;

  // FP8 (e4m3 q / k / v, FA-3 path only). Descales: fp32 per (batch, kv head) at
  // ptr[b * batch_stride + h_kv * head_stride] (strides may be 0: broadcast), null = 1. The
  // kernel folds q_descale * k_descale into the tile's score scale (scale_log2 and lse_scale, or
  // softcap_prescale with softcap) and v_descale into O's normalization.
  const float* q_descale;
  const float* k_descale;
  const float* v_descale;
  int64_t q_descale_batch_stride, q_descale_head_stride;
  int64_t k_descale_batch_stride, k_descale_head_stride;
  int64_t v_descale_batch_stride, v_descale_head_stride;
  int o_fp16;            // FP8: o is fp16 (else bf16)
  int fp8_single_level;  // FP8: PV accumulates in the WGMMA accumulator alone (the ablation of
                         // two-level accumulation, sm90/fwd/mma.h)

  // Varlen (flash_hopper/varlen.h; null cu_seqlens_q: a dense call). The batch strides of q, k,
  // v, o and lse are 0: every row is addressed through its sequence's start.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  const int32_t* seqused_q;  // null: the cu_seqlens spans
  const int32_t* seqused_k;
  KvIndex kv_index;  // KV-cache calls: cache entry and left padding per sequence (varlen.h)
  VarlenHeader* varlen_header;  // the workspace: the prepare kernel's output
  VarlenPair* varlen_pairs;
  int varlen_capacity;
  // The caller's max_seqlen_q / max_seqlen_k (0 = unknown): hints for the launch's choices (the
  // tile, the tile order), never bounds the kernels rely on.
  int varlen_max_seqlen_q;
  int varlen_max_seqlen_k;

  FH_HOST_DEVICE bool varlen() const { return cu_seqlens_q != nullptr; }

  // The tile counter masked calls claim their tiles from at run time (sm90/fwd/tile_scheduler.h):
  // a dense call's workspace (fh_fwd_workspace_size; the FA-3 launcher zeroes it on the call's
  // stream), a varlen call's VarlenHeader::tile_counter (the prepare kernel zeroes it); null:
  // static tile walks.
  int* tile_counter;

  int num_sms;
  // Debug: the FA-3 forward's event timeline (libraries built with FH_TIMELINE; null = off;
  // sm90/fwd/timeline.h), from fh_debug_set_timeline.
  unsigned long long* timeline;
  // FA-3 variant (FhVariant: a set of FH_VARIANT_FLAG_* bits, api.h); 0 = tuned. The launcher
  // reads the runtime flags from it (NO_PINGPONG); the FA-2 path ignores it.
  int variant;
  // V's and O's head dim: head_dim's, but for the FA-3 path's kernels with a V head dim of their
  // own (kernels/sm90/fwd/tile_config.h, has_dv_config), which alone read it. Last, so that every
  // other kernel reads its fields where it always did.
  int head_dim_v;
};

// The call's mask policy. Every kernel builds its mask here and nowhere else (attention_chunk
// will join the window when the API has it; varlen will build one per sequence).
FH_HOST_DEVICE AttentionMask attention_mask(FwdParams const& p) {
  return {p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
}

// The mask of one sequence of the call (varlen: its own lengths; dense: the call's).
FH_HOST_DEVICE AttentionMask attention_mask(FwdParams const& p, int seqlen_q, int seqlen_k) {
  return {seqlen_q, seqlen_k, p.window_left, p.window_right};
}

}  // namespace flash_hopper
