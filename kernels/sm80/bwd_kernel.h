// FA-2 path backward kernel (sm80: cp.async + mma.sync), one CTA per (key block, kv head, batch).
//
// Algorithm (FlashAttention-2, Dao 2023, backward by recomputation), for the key block K_n, V_n
// held in shared memory, dK and dV accumulating in registers:
//   for g in the kv head's query heads (GQA group), for m in query_blocks(n):
//     S  = Q_m K_n^T ; softcap ; element mask on blocks that need it
//     P  = exp2(S * scale_log2 - lse_log2)           (lse_log2 from the preprocess, +inf = no key)
//     dP = dO_m V_n^T ;  dS = P * (dP - D)  (* (1 - tanh^2) with softcap)
//     P, dS -> shared memory (input dtype)
//     dV += P^T dO_m ;  dK += dS^T Q_m ;  dQacc_m += dS K_n   (fp32, global: atomics, or ordered)
//   dK *= softmax_scale; dK, dV stored (zeros for a key block no query sees)
// The GQA group's dK / dV are summed in registers (fp32, one conversion): no dK / dV workspace.
//
// Copy pipeline: Q (with its rows' lse_log2) and dO (with D) of the next step stream into the
// other buffer while this step computes (kQStages = kDoStages = 2):
//   wait Q/dO(i); sync | issue Q/dO(i+1) | S, dP | P, dS -> smem; sync | dV | dQ | dK
// The first sync also guarantees every warp finished step i-1 (its reads of buffer (i+1) % 2 and
// of sP / sdS) before anything overwrites them. With one buffer, the next dO is issued after this
// step's dV GEMM (its last reader) and the next Q after the dK GEMM, each behind a sync. lse_log2
// and D come through shared memory, not registers: kept in registers across the GEMMs they made
// the d128 kernel spill in its main loop (bench/PERFLOG.md "the FA-2 path's
// backward").
//
// dQ: dQacc (workspace, fp32, a (b, h, seqlen_q_rounded, bucket) region holding each query block
// in fragment order) is cleared by the preprocess and converted by bwd_postprocess.h's kernel.
// Default mode: atomicAdd from registers. Deterministic mode: the
// contributions to query block m arrive in key-block-descending order: the CTA of key block n
// waits until m's semaphore equals its rank n_max(m) - 1 - n, adds with plain loads and stores
// (it owns the block now), and releases. The 1-D grid runs each (batch, kv head)'s key blocks in
// descending n, so every CTA waits only on CTAs with a smaller block index; the GPU dispatches
// blocks in index order, so those are running or done (FlashAttention-2/3 rely on the same).
// The key blocks of one (batch, kv head) are interleaved with the other heads' in that order.
#pragma once

#include <cute/tensor.hpp>

#include "flash_hopper/bwd_params.h"
#include "flash_hopper/mask.h"
#include "flash_hopper/register_ops.h"  // apply_softcap, apply_mask
#include "sm80/bwd_kernel_traits.h"
#include "sm80/utils.h"

namespace flash_hopper::sm80 {

using namespace cute;

// The same tensor with its data pointer moved by `offset` elements (a stage of a multi-buffer).
template <class Engine, class Layout>
CUTE_DEVICE auto shifted(Tensor<Engine, Layout> const& t, int offset) {
  return make_tensor(t.data() + offset, t.layout());
}

CUTE_DEVICE int load_acquire(int const* ptr) {
  int value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads)
    bwd_kernel(__grid_constant__ const BwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kQElems = Traits::kQElems;
  using SharedStorage = typename Traits::SharedStorage;

  const bool deterministic = p.deterministic != 0;
  const int n_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
  int n_block, head_kv, batch;
  if (!deterministic) {  // grid (key blocks, kv heads, batch): one head's CTAs run together
    n_block = blockIdx.x;
    head_kv = blockIdx.y;
    batch = blockIdx.z;
  } else {
    // 1-D grid, key blocks descending per (batch, kv head) and the heads interleaved: the CTAs
    // that run together belong to as many heads as possible, so fewer of them wait on each
    // other's dQ hand-offs (the wait chain per head is only as long as its CTAs in flight).
    const int heads = p.heads_kv * p.batch;
    const int bh = blockIdx.x % heads;
    n_block = n_blocks - 1 - int(blockIdx.x / heads);
    head_kv = bh % p.heads_kv;
    batch = bh / p.heads_kv;
  }
  const int tidx = threadIdx.x;

  const AttentionMask mask = attention_mask(p);
  const QueryBlockRange range = mask.query_blocks(n_block, kBlockM, kBlockN);
  const int blocks_per_head = range.empty() ? 0 : range.m_max - range.m_min;
  const int num_steps = blocks_per_head * p.heads_per_kv;

  extern __shared__ char smem_buf[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_buf);

  // ---- Shared-memory tensors (stage 0; shifted() selects stage 1) ----
  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});      // (M,d)
  Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});    // (d,M)
  Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});  // (M,d)
  Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQt{});
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});     // (N,d)
  Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{});    // (d,N)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});     // (N,d)
  Tensor sP = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutPdS{});    // (M,N)
  Tensor sPt = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutPdSt{});  // (N,M)
  Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutPdS{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutPdSt{});

  // ---- Global -> shared copies ----
  auto tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
  auto tile_kv = Shape<Int<kBlockN>, Int<kHeadDim>>{};
  typename Traits::GmemTiledCopy gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);    // (CPY,CPY_M,CPY_D)
  Tensor tQsdO = gmem_thr_copy.partition_D(sdO);
  Tensor tKsK = gmem_thr_copy.partition_D(sK);    // (CPY,CPY_N,CPY_D)
  Tensor tKsV = gmem_thr_copy.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(tile_q));
  Tensor tKcK = gmem_thr_copy.partition_S(make_identity_tensor(tile_kv));
  const bool full_d = p.head_dim == kHeadDim;
  const int kv_rows = p.seqlen_k - n_block * kBlockN;

  // The rows' lse_log2 (with Q) or D (with dO) of query block m of head h: kBlockM floats, one
  // 16-byte cp.async per thread of the first kBlockM / 4 (the workspace rows are padded).
  auto load_rows = [&](float const* region, int h, int m, float* dst) {
    if (tidx < kBlockM / 4) {
      float const* src = region + p.row_offset(batch, h) + int64_t(m) * kBlockM + 4 * tidx;
      SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>::copy(*reinterpret_cast<uint128_t const*>(src),
                                                 *reinterpret_cast<uint128_t*>(dst + 4 * tidx));
    }
  };
  // Q (and lse_log2) / dO (and D) of query block m of query head h into buffer `stage`.
  auto load_q = [&](int h, int m, int stage) {
    const int64_t row0 = int64_t(m) * kBlockM;
    Tensor gQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.q) +
                                          batch * p.q_batch_stride + h * p.q_head_stride +
                                          row0 * p.q_row_stride),
                            tile_q, make_stride(p.q_row_stride, _1{}));
    const int rows = p.seqlen_q - int(row0);
    Tensor tQsQ_s = shifted(tQsQ, stage * kQElems);
    copy_tile_g2s(gmem_tiled_copy, gmem_thr_copy.partition_S(gQ), tQsQ_s, tQcQ, rows, p.head_dim,
                  full_d && rows >= kBlockM);
    load_rows(p.lse_log2, h, m, smem.lse.data() + stage * kBlockM);
  };
  auto load_do = [&](int h, int m, int stage) {
    const int64_t row0 = int64_t(m) * kBlockM;
    Tensor gdO = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.dout) +
                                           batch * p.dout_batch_stride + h * p.dout_head_stride +
                                           row0 * p.dout_row_stride),
                             tile_q, make_stride(p.dout_row_stride, _1{}));
    const int rows = p.seqlen_q - int(row0);
    Tensor tQsdO_s = shifted(tQsdO, stage * kQElems);
    copy_tile_g2s(gmem_tiled_copy, gmem_thr_copy.partition_S(gdO), tQsdO_s, tQcQ, rows,
                  p.head_dim, full_d && rows >= kBlockM);
    load_rows(p.dpsum, h, m, smem.dpsum.data() + stage * kBlockM);
  };

  // ---- MMA partitions ----
  // The register fragments: the layouts of Traits::FragmentLayouts (bwd_fragment_layouts.h),
  // the very types partition_fragment_A/B(sX) would return (a host test checks every entry)
  // without the swizzled views' layout algebra, which was a quarter of the compiler's memory.
  using Frags = typename Traits::FragmentLayouts;
  typename Traits::TiledMmaSdP tiled_mma_sdp;
  auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(tidx);
  Tensor tSrQ = mma_fragment<typename Frags::SdpA, true>(thr_mma_sdp, sQ);    // (MMA,MMA_M,MMA_K)
  Tensor tSrK = mma_fragment<typename Frags::SdpB, false>(thr_mma_sdp, sK);   // (MMA,MMA_N,MMA_K)
  Tensor tdPrdO = mma_fragment<typename Frags::SdpA, true>(thr_mma_sdp, sdO);
  Tensor tdPrV = mma_fragment<typename Frags::SdpB, false>(thr_mma_sdp, sV);

  typename Traits::TiledMmadKV tiled_mma_dkv;
  auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(tidx);
  Tensor tdVrPt = mma_fragment<typename Frags::DkvA, true>(thr_mma_dkv, sPt);     // (MMA,MMA_N,MMA_M)
  Tensor tdVrdOt = mma_fragment<typename Frags::DkvB, false>(thr_mma_dkv, sdOt);  // (MMA,MMA_D,MMA_M)
  Tensor tdKrdSt = mma_fragment<typename Frags::DkvA, true>(thr_mma_dkv, sdSt);
  Tensor tdKrQt = mma_fragment<typename Frags::DkvB, false>(thr_mma_dkv, sQt);

  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(tidx);
  Tensor tdQrdS = mma_fragment<typename Frags::DqA, true>(thr_mma_dq, sdS);    // (MMA,MMA_M,MMA_N)
  Tensor tdQrKt = mma_fragment<typename Frags::DqB, false>(thr_mma_dq, sKt);   // (MMA,MMA_D,MMA_N)

  // ldmatrix copies, one per operand view.
  using LdsmN = typename Traits::SmemCopyAtom;
  using LdsmT = typename Traits::SmemCopyAtomTransposed;
  auto copy_sdp_a = make_tiled_copy_A(LdsmN{}, tiled_mma_sdp);
  auto thr_copy_sdp_a = copy_sdp_a.get_thread_slice(tidx);
  Tensor tSsQ = thr_copy_sdp_a.partition_S(sQ);
  Tensor tdPsdO = thr_copy_sdp_a.partition_S(sdO);
  auto copy_sdp_b = make_tiled_copy_B(LdsmN{}, tiled_mma_sdp);
  auto thr_copy_sdp_b = copy_sdp_b.get_thread_slice(tidx);
  Tensor tSsK = thr_copy_sdp_b.partition_S(sK);
  Tensor tdPsV = thr_copy_sdp_b.partition_S(sV);

  auto copy_dkv_a = make_tiled_copy_A(LdsmT{}, tiled_mma_dkv);
  auto thr_copy_dkv_a = copy_dkv_a.get_thread_slice(tidx);
  Tensor tdVsPt = thr_copy_dkv_a.partition_S(sPt);
  Tensor tdKsdSt = thr_copy_dkv_a.partition_S(sdSt);
  auto copy_dkv_b = make_tiled_copy_B(LdsmT{}, tiled_mma_dkv);
  auto thr_copy_dkv_b = copy_dkv_b.get_thread_slice(tidx);
  Tensor tdVsdOt = thr_copy_dkv_b.partition_S(sdOt);
  Tensor tdKsQt = thr_copy_dkv_b.partition_S(sQt);

  auto copy_dq_a = make_tiled_copy_A(LdsmN{}, tiled_mma_dq);
  auto thr_copy_dq_a = copy_dq_a.get_thread_slice(tidx);
  Tensor tdQsdS = thr_copy_dq_a.partition_S(sdS);
  auto copy_dq_b = make_tiled_copy_B(LdsmT{}, tiled_mma_dq);
  auto thr_copy_dq_b = copy_dq_b.get_thread_slice(tidx);
  Tensor tdQsKt = thr_copy_dq_b.partition_S(sKt);

  // P and dS: registers -> shared memory.
  auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, tiled_mma_sdp);
  auto thr_copy_pds = copy_pds.get_thread_slice(tidx);
  Tensor tPsP = thr_copy_pds.partition_D(sP);
  Tensor tdSsdS = thr_copy_pds.partition_D(sdS);

  Tensor acc_dk = make_tensor<float>(typename Traits::AccLayoutdKV{});
  Tensor acc_dv = make_tensor<float>(typename Traits::AccLayoutdKV{});
  clear(acc_dk);
  clear(acc_dv);

  // Each S element's (row, col) in the tile, in the scores' (rows, cols) view.
  Tensor tScS = thr_mma_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_layout_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;

  const bool softcap_on = p.softcap != 0.f;
  const float inv_softcap = softcap_on ? 1.f / p.softcap : 0.f;

  // One step: (h, m) with its Q in buffer q_stage and dO in do_stage; (next_h, next_m) is the
  // next step's (has_next), loaded here into single buffers once their last reader is done.
  auto step = [&](int h, int m, int q_stage, int do_stage, bool has_next, int next_h, int next_m,
                  auto transform_tag) __attribute__((always_inline)) {
    constexpr bool kTransform = decltype(transform_tag)::value;
    const int q_off = q_stage * kQElems;
    const int do_off = do_stage * kQElems;
    float const* lse = smem.lse.data() + q_stage * kBlockM;
    float const* dpsum = smem.dpsum.data() + do_stage * kBlockM;

    Tensor acc_s = make_tensor<float>(typename Traits::AccLayoutSdP{});
    Tensor acc_dp = make_tensor<float>(typename Traits::AccLayoutSdP{});
    clear(acc_s);
    clear(acc_dp);
    gemm_ss(tiled_mma_sdp, acc_s, tSrQ, tSrK, shifted(tSsQ, q_off), tSsK, copy_sdp_a, copy_sdp_b,
            thr_copy_sdp_a, thr_copy_sdp_b);
    gemm_ss(tiled_mma_sdp, acc_dp, tdPrdO, tdPrV, shifted(tdPsdO, do_off), tdPsV, copy_sdp_a,
            copy_sdp_b, thr_copy_sdp_a, thr_copy_sdp_b);

    Tensor scores = make_tensor(acc_s.data(), acc_layout_rowcol(acc_s.layout()));  // (ROWS,COLS)
    Tensor dp = make_tensor(acc_dp.data(), acc_layout_rowcol(acc_dp.layout()));    // (ROWS,COLS)
    if constexpr (kTransform) {
      if (softcap_on) {
        apply_softcap(scores, p.softcap, p.softcap_prescale);
      }
      if (mask.block_masked(m, n_block, kBlockM, kBlockN)) {
        apply_mask(scores, tScS_rc, mask, m * kBlockM, n_block * kBlockN);
      }
    }
    // P = exp2(score * scale_log2 - lse_log2) in place; dS = P (dP - D) in dp's place. With
    // softcap the score is softcap * t, t = tanh(s * prescale), and dS picks up d(score)/ds /
    // softmax_scale = 1 - t^2. t is recovered from P itself (score * log2(e) = log2(P) +
    // lse_log2, scale_log2 being log2(e) then) instead of being kept: a register copy of the
    // scores across the exponentials cost M * N / 256 registers and made the 128 x 128 d64 tile
    // spill. One extra MUFU per element, softcap steps only; P = 0 (masked, underflowed)
    // contributes 0 without it.
    const float t_scale = inv_softcap * 0.6931471805599453f;  // 1 / (softcap * log2(e))
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(tScS_rc(r, 0));
      const float row_lse = lse[row];
      const float row_dpsum = dpsum[row];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const float prob = exp2f(scores(r, c) * p.scale_log2 - row_lse);
        scores(r, c) = prob;
        float ds = prob * (dp(r, c) - row_dpsum);
        if constexpr (kTransform) {
          if (softcap_on) {
            const float t = (__log2f(prob) + row_lse) * t_scale;
            ds = prob > 0.f ? ds * (1.f - t * t) : 0.f;
          }
        }
        dp(r, c) = ds;
      }
    }

    // P and dS to shared memory in the input dtype: the A / B operands of the transposed GEMMs.
    Tensor rP = convert_fragment<Element>(acc_s);
    Tensor rdS = convert_fragment<Element>(acc_dp);
    copy(copy_pds, thr_copy_pds.retile_S(rP), tPsP);
    copy(copy_pds, thr_copy_pds.retile_S(rdS), tdSsdS);
    __syncthreads();

    gemm_ss(tiled_mma_dkv, acc_dv, tdVrPt, tdVrdOt, tdVsPt, shifted(tdVsdOt, do_off), copy_dkv_a,
            copy_dkv_b, thr_copy_dkv_a, thr_copy_dkv_b);
    if constexpr (Traits::kDoStages == 1) {
      if (has_next) {
        __syncthreads();  // every warp is done with this dO (dV was its last reader)
        load_do(next_h, next_m, 0);
        cp_async_fence();
      }
    }

    Tensor acc_dq = make_tensor<float>(typename Traits::AccLayoutdQ{});
    clear(acc_dq);
    gemm_ss(tiled_mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copy_dq_a, copy_dq_b,
            thr_copy_dq_a, thr_copy_dq_b);
    // dQacc of this block in fragment order (bwd_postprocess.h): value i of this thread at
    // [i * kNThreads + tidx], so every warp-wide add covers 128 contiguous bytes (in the
    // accumulator's own (row, col) order a warp's atomics touched 8 rows, 8 L2 sectors each).
    float* dq_accum = p.dq_accum + p.dq_accum_offset(batch, h) +
                      int64_t(m) * kBlockM * p.head_dim_rounded + tidx;
    if (!deterministic) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dq); ++i) {
        atomicAdd(dq_accum + i * Traits::kNThreads, acc_dq(i));
      }
    } else {
      int* semaphore = p.semaphores + p.semaphore_offset(batch, h) +
                       m * (kBlockM / kBwdSemaphoreRows);
      const int rank = mask.key_blocks(m, kBlockM, kBlockN).n_max - 1 - n_block;
      if (tidx == 0) {
        while (load_acquire(semaphore) != rank) {
        }
      }
      __syncthreads();
      // This CTA owns the block until it releases it. L2 loads and stores (.cg): another CTA on
      // this SM may have read these lines into L1 before the previous contributor wrote them.
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dq); ++i) {
        float* addr = dq_accum + i * Traits::kNThreads;
        __stcg(addr, __ldcg(addr) + acc_dq(i));
      }
      __threadfence();
      __syncthreads();
      if (tidx == 0) {
        atomicAdd(semaphore, 1);
      }
    }

    gemm_ss(tiled_mma_dkv, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, shifted(tdKsQt, q_off), copy_dkv_a,
            copy_dkv_b, thr_copy_dkv_a, thr_copy_dkv_b);
    if constexpr (Traits::kQStages == 1) {
      if (has_next) {
        __syncthreads();  // every warp is done with this Q (dK was its last reader)
        load_q(next_h, next_m, 0);
        cp_async_fence();
      }
    }
  };

  // ---- Prologue: K, V and the first step's Q, dO ----
  if (num_steps > 0) {
    Tensor gK = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.k) +
                                          batch * p.k_batch_stride + head_kv * p.k_head_stride +
                                          int64_t(n_block) * kBlockN * p.k_row_stride),
                            tile_kv, make_stride(p.k_row_stride, _1{}));
    Tensor gV = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v) +
                                          batch * p.v_batch_stride + head_kv * p.v_head_stride +
                                          int64_t(n_block) * kBlockN * p.v_row_stride),
                            tile_kv, make_stride(p.v_row_stride, _1{}));
    const bool kv_full = full_d && kv_rows >= kBlockN;
    copy_tile_g2s(gmem_tiled_copy, gmem_thr_copy.partition_S(gK), tKsK, tKcK, kv_rows, p.head_dim,
                  kv_full);
    copy_tile_g2s(gmem_tiled_copy, gmem_thr_copy.partition_S(gV), tKsV, tKcK, kv_rows, p.head_dim,
                  kv_full);
    load_q(head_kv * p.heads_per_kv, range.m_min, 0);
    load_do(head_kv * p.heads_per_kv, range.m_min, 0);
    cp_async_fence();
  }

  // ---- Main loop: (query head of the group, query block), m fastest ----
  int g = 0;
  int m = range.m_min;
  for (int i = 0; i < num_steps; ++i) {
    const int q_stage = Traits::kQStages == 2 ? (i & 1) : 0;
    const int do_stage = Traits::kDoStages == 2 ? (i & 1) : 0;
    const int h = head_kv * p.heads_per_kv + g;
    int next_g = g;
    int next_m = m + 1;
    if (next_m == range.m_max) {
      next_m = range.m_min;
      ++next_g;
    }
    const bool has_next = i + 1 < num_steps;
    const int next_h = head_kv * p.heads_per_kv + next_g;
    cp_async_wait<0>();
    __syncthreads();
    if (has_next && (Traits::kQStages == 2 || Traits::kDoStages == 2)) {
      if constexpr (Traits::kQStages == 2) {
        load_q(next_h, next_m, q_stage ^ 1);
      }
      if constexpr (Traits::kDoStages == 2) {
        load_do(next_h, next_m, do_stage ^ 1);
      }
      cp_async_fence();
    }
    if (softcap_on || mask.block_masked(m, n_block, kBlockM, kBlockN)) {
      step(h, m, q_stage, do_stage, has_next, next_h, next_m, cute::true_type{});
    } else {
      step(h, m, q_stage, do_stage, has_next, next_h, next_m, cute::false_type{});
    }
    g = next_g;
    m = next_m;
  }

  // ---- Epilogue: dK * scale and dV through shared memory (K / V's buffers) to global ----
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) {
    acc_dk(i) *= p.softmax_scale;
  }
  Tensor rdK = convert_fragment<Element>(acc_dk);
  Tensor rdV = convert_fragment<Element>(acc_dv);
  __syncthreads();  // every warp is done reading K and V
  auto copy_dkv_store = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, tiled_mma_dkv);
  auto thr_copy_dkv_store = copy_dkv_store.get_thread_slice(tidx);
  copy(copy_dkv_store, thr_copy_dkv_store.retile_S(rdK), thr_copy_dkv_store.partition_D(sK));
  copy(copy_dkv_store, thr_copy_dkv_store.retile_S(rdV), thr_copy_dkv_store.partition_D(sV));
  __syncthreads();

  Tensor gdK = make_tensor(make_gmem_ptr(static_cast<Element*>(p.dk) + batch * p.dk_batch_stride +
                                         head_kv * p.dk_head_stride +
                                         int64_t(n_block) * kBlockN * p.dk_row_stride),
                           tile_kv, make_stride(p.dk_row_stride, _1{}));
  Tensor gdV = make_tensor(make_gmem_ptr(static_cast<Element*>(p.dv) + batch * p.dv_batch_stride +
                                         head_kv * p.dv_head_stride +
                                         int64_t(n_block) * kBlockN * p.dv_row_stride),
                           tile_kv, make_stride(p.dv_row_stride, _1{}));
  typename Traits::GmemTiledCopyStore gmem_tiled_store;
  auto gmem_thr_store = gmem_tiled_store.get_thread_slice(tidx);
  Tensor tKgdK = gmem_thr_store.partition_D(gdK);
  Tensor tKgdV = gmem_thr_store.partition_D(gdV);
  Tensor tKrdK = make_tensor<Element>(shape(tKgdK));
  Tensor tKrdV = make_tensor<Element>(shape(tKgdV));
  copy(gmem_tiled_store, gmem_thr_store.partition_S(sK), tKrdK);
  copy(gmem_tiled_store, gmem_thr_store.partition_S(sV), tKrdV);
  Tensor tKcdK = gmem_thr_store.partition_D(make_identity_tensor(tile_kv));
  const bool kv_full_store = full_d && kv_rows >= kBlockN;
  copy_tile_r2g(gmem_tiled_store, tKrdK, tKgdK, tKcdK, kv_rows, p.head_dim, kv_full_store);
  copy_tile_r2g(gmem_tiled_store, tKrdV, tKgdV, tKcdK, kv_rows, p.head_dim, kv_full_store);
}

}  // namespace flash_hopper::sm80
