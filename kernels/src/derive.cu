// Kernel-side parameters (derive.h): the fields both directions share under the same names, then
// each direction's own.
#include "src/derive.h"

#include "flash_hopper/varlen.h"
#include "src/validate.h"

namespace flash_hopper {
namespace {

// A window wider than the sequence is the same as no bound: keep the int32 math overflow-free.
int clamp_window(int64_t window, int64_t seqlen_q, int64_t seqlen_k) {
  return window >= seqlen_k + seqlen_q ? -1 : int(window);
}

// What FwdParams and BwdParams share with FhFwdParams and FhBwdParams under the same names: the
// q, k, v, o and lse tensors, the shapes, the score transform, the mask and the SM cap.
// Returns the score transform it set.
template <class KernelParams, class Params>
ScoreTransform derive_shared(KernelParams& k, const Params* p, const DeviceInfo& dev) {
  const ScoreTransform score = score_transform(p->softmax_scale, p->softcap);
  k.softcap = score.softcap;
  k.softcap_prescale = score.prescale;
  k.scale_log2 = score.scale_log2;
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
  k.window_left = clamp_window(p->window_left, p->seqlen_q, p->seqlen_k);
  k.window_right = clamp_window(p->window_right, p->seqlen_q, p->seqlen_k);
  // A cap, never more CTAs than SMs: the FA-3 backward's deterministic mode waits across CTAs
  // and needs every CTA of its persistent grid resident.
  k.num_sms = p->num_sms > 0 && p->num_sms < dev.sm_count ? p->num_sms : dev.sm_count;
  return score;
}

}  // namespace

ScoreTransform score_transform(float softmax_scale, float softcap) {
  if (softcap > 0.f) {
    return {softcap, softmax_scale / softcap, kLog2e, 1.f};
  }
  return {0.f, 0.f, softmax_scale * kLog2e, softmax_scale};
}

FwdParams derive(const FhFwdParams* p, const DeviceInfo& dev) {
  FwdParams k{};
  k.lse_scale = derive_shared(k, p, dev).lse_scale;
  k.variant = p->variant;
  k.head_dim_v = int(p->head_dim_v);
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
    k.tile_counter = &k.varlen_header->tile_counter;
    k.varlen_capacity = int(varlen_capacity(p->seqlen_q, p->batch));
    // Hints past the packed tokens are no information (api's check allows any value >= 0).
    k.varlen_max_seqlen_q = int(p->max_seqlen_q <= p->seqlen_q ? p->max_seqlen_q : 0);
    k.varlen_max_seqlen_k = int(p->max_seqlen_k <= p->seqlen_k ? p->max_seqlen_k : 0);
  } else if (p->workspace != nullptr) {
    k.tile_counter = static_cast<int*>(p->workspace);
  }
  return k;
}

BwdParams derive_bwd(const FhBwdParams* p, const DeviceInfo& dev) {
  BwdWorkspace ws;
  bwd_workspace(p, &ws);
  BwdParams k{};
  derive_shared(k, p, dev);
  k.dout = p->dout;
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
    k.tile_counter = reinterpret_cast<int*>(base + ws.tile_counter);
  }
  k.seqlen_q_rounded = int(ws.seqlen_q_rounded);
  k.head_dim_rounded = int(ws.head_dim_rounded);
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
  k.dlse_batch_stride = p->dlse_batch_stride;
  k.dlse_head_stride = p->dlse_head_stride;
  k.softmax_scale = p->softmax_scale;
  k.deterministic = p->deterministic;
  if (p->cu_seqlens_q != nullptr) {  // bwd_params.h "Varlen": the lengths' bounds
    k.cu_seqlens_q = p->cu_seqlens_q;
    k.cu_seqlens_k = p->cu_seqlens_k;
    k.seqused_q = p->seqused_q;
    k.seqused_k = p->seqused_k;
    k.total_q = k.seqlen_q;
    k.total_k = k.seqlen_k;
    if (p->max_seqlen_q > 0 && p->max_seqlen_q < k.total_q) {
      k.seqlen_q = int(p->max_seqlen_q);
    }
    if (p->max_seqlen_k > 0 && p->max_seqlen_k < k.total_k) {
      k.seqlen_k = int(p->max_seqlen_k);
    }
  }
  return k;
}

}  // namespace flash_hopper
