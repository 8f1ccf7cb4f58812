// FA-2 path forward kernel (sm80: cp.async + mma.sync), one CTA per (query block, head, batch),
// or per (listed pair, head) for varlen (flash_hopper/varlen.h).
//
// Algorithm (FlashAttention-2, Dao 2023), for the query tile Q_i held in shared memory:
//   for key blocks j = n_max-1 down to n_min:      (diagonal / tail blocks come first)
//     S = Q_i K_j^T                                 (mma.sync, both operands via ldmatrix)
//     softcap, and the window mask only on blocks that need it
//     m_new = max(m, rowmax S); P = exp2(S*c - m_new*c); l = l*alpha + rowsum P; O = O*alpha
//     O += P V_j                                    (P stays in registers as the A operand)
//   O /= l; lse = m*scale + log l
//
// Copy pipeline: K and V alternate through one shared-memory tile each, so every cp.async has a
// GEMM to hide under — V_j streams in during S = Q K_j^T, and K_{j-1} during softmax and P V_j:
//
//   wait K_j; sync | issue V_j | S = Q K_j^T, mask | wait V_j; sync | issue K_{j-1} | softmax, O += P V_j
//
// The first sync of each step also guarantees every warp finished reading V_{j+1} before V_j
// overwrites it; the second, that every warp finished reading K_j before K_{j-1} lands.
#pragma once

#include <cute/tensor.hpp>

#include "flash_hopper/fwd_params.h"
#include "flash_hopper/mask.h"
#include "flash_hopper/register_ops.h"  // apply_softcap, apply_mask
#include "sm80/kernel_traits.h"
#include "sm80/softmax.h"
#include "sm80/utils.h"

namespace flash_hopper::sm80 {

using namespace cute;

template <class Traits>
CUTE_DEVICE void write_empty_rows(FwdParams const& p, int m_block, int head, int batch,
                                  SequenceSpan const& seq) {
  // A query block that sees no key: O = 0 and LSE = -inf, never NaN.
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  const int rows = min(kBlockM, seq.seqlen_q - m_block * kBlockM);
  Element* o = static_cast<Element*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride +
               (int64_t(m_block) * kBlockM + seq.q_start) * p.o_row_stride;
  for (int i = threadIdx.x; i < rows * p.head_dim; i += Traits::kNThreads) {
    const int r = i / p.head_dim;
    o[r * p.o_row_stride + i % p.head_dim] = Element(0.f);
  }
  if (p.lse != nullptr) {
    float* lse = p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_start;
    for (int r = threadIdx.x; r < rows; r += Traits::kNThreads) {
      lse[m_block * kBlockM + r] = -INFINITY;
    }
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kNThreads)
    fwd_kernel(__grid_constant__ const FwdParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  using SharedStorage = typename Traits::SharedStorage;

  // Dense: reverse order, since under a causal mask the last query blocks see the most keys, so
  // they start first and the grid's tail is made of short blocks. Varlen: x is the index in the
  // prepare kernel's list (costliest first; flash_hopper/varlen.h), past its end nothing to do.
  int m_block;
  int batch;
  SequenceSpan seq;
  if (p.varlen()) {
    if (int(blockIdx.x) >= p.varlen_header->num_pairs) {
      return;
    }
    VarlenPair const pair = p.varlen_pairs[blockIdx.x];
    m_block = pair.m_block;
    batch = pair.batch;
    seq = {pair.q_start, pair.k_start, pair.seqlen_q, pair.seqlen_k};
  } else {
    m_block = gridDim.x - 1 - blockIdx.x;
    batch = blockIdx.z;
    seq = {0, 0, p.seqlen_q, p.seqlen_k};
  }
  const int head = blockIdx.y;
  const int head_kv = head / p.heads_per_kv;
  const int tidx = threadIdx.x;

  const AttentionMask mask = attention_mask(p, seq.seqlen_q, seq.seqlen_k);
  const KeyBlockRange range = mask.key_blocks(m_block, kBlockM, kBlockN);
  if (range.empty()) {
    write_empty_rows<Traits>(p, m_block, head, batch, seq);
    return;
  }

  extern __shared__ char smem_buf[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_buf);

  // ---- Global tensors (64-bit strides), the tile's sequence only ----
  // (Varlen: batch strides are 0, the span's start addresses the sequence; loads past its rows
  // are predicated off and zero-filled, so the next sequence's tokens never enter.)
  Tensor mQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.q) +
                                        batch * p.q_batch_stride + head * p.q_head_stride +
                                        seq.q_start * p.q_row_stride),
                          make_shape(seq.seqlen_q, p.head_dim),
                          make_stride(p.q_row_stride, _1{}));  // (SEQ_Q,D)
  Tensor mK = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.k) +
                                        batch * p.k_batch_stride + head_kv * p.k_head_stride +
                                        seq.k_start * p.k_row_stride),
                          make_shape(seq.seqlen_k, p.head_dim),
                          make_stride(p.k_row_stride, _1{}));  // (SEQ_K,D)
  Tensor mV = make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v) +
                                        batch * p.v_batch_stride + head_kv * p.v_head_stride +
                                        seq.k_start * p.v_row_stride),
                          make_shape(seq.seqlen_k, p.head_dim),
                          make_stride(p.v_row_stride, _1{}));  // (SEQ_K,D)
  Tensor mO = make_tensor(make_gmem_ptr(static_cast<Element*>(p.o) + batch * p.o_batch_stride +
                                        head * p.o_head_stride + seq.q_start * p.o_row_stride),
                          make_shape(seq.seqlen_q, p.head_dim),
                          make_stride(p.o_row_stride, _1{}));  // (SEQ_Q,D)

  auto tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
  auto tile_kv = Shape<Int<kBlockN>, Int<kHeadDim>>{};
  Tensor gQ = local_tile(mQ, tile_q, make_coord(m_block, 0));   // (BLK_M,D)
  Tensor gO = local_tile(mO, tile_q, make_coord(m_block, 0));   // (BLK_M,D)
  Tensor gK = local_tile(mK, tile_kv, make_coord(_, 0));        // (BLK_N,D,n)
  Tensor gV = local_tile(mV, tile_kv, make_coord(_, 0));        // (BLK_N,D,n)

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});   // (BLK_M,D)
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});  // (BLK_N,D)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});  // (BLK_N,D)
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{}); // (D,BLK_N)
  Tensor sO = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutO{});   // (BLK_M,D)

  // ---- Global -> shared copies (cp.async, 16 B per thread) ----
  typename Traits::GmemTiledCopyQKV gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);  // (CPY,CPY_M,CPY_D)
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);
  Tensor tKgK = gmem_thr_copy.partition_S(gK);  // (CPY,CPY_N,CPY_D,n)
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVgV = gmem_thr_copy.partition_S(gV);  // (CPY,CPY_N,CPY_D,n)
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  // Coordinates of every copied element, for the sequence-tail and head-dim predicates.
  Tensor tQcQ = gmem_thr_copy.partition_S(make_identity_tensor(tile_q));    // (CPY,CPY_M,CPY_D)
  Tensor tKcK = gmem_thr_copy.partition_S(make_identity_tensor(tile_kv));   // (CPY,CPY_N,CPY_D)

  const int q_rows = seq.seqlen_q - m_block * kBlockM;
  const bool full_d = p.head_dim == kHeadDim;
  auto kv_rows = [&](int n_block) { return seq.seqlen_k - n_block * kBlockN; };
  auto kv_full = [&](int n_block) { return full_d && kv_rows(n_block) >= kBlockN; };

  // ---- MMA partitions ----
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);   // (MMA,MMA_M,MMA_K)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);   // (MMA,MMA_N,MMA_K)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVt); // (MMA,MMA_D,MMA_N)

  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_q = smem_copy_q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_q.partition_S(sQ);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_k = smem_copy_k.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_k.partition_S(sK);
  auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_v = smem_copy_v.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_copy_v.partition_S(sVt);

  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA,MMA_M,MMA_D)
  clear(acc_o);
  Tensor acc_o_rc = make_tensor(acc_o.data(), acc_layout_rowcol(acc_o.layout()));  // (ROWS,D)

  // Each S element's (row, col) inside the tile, in the same (rows, cols) view as the scores.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_layout_rowcol(tScS.layout()));

  constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
  OnlineSoftmax<kRows> softmax;

  // ---- Prologue: Q and the first (highest) K block ----
  int n_block = range.n_max - 1;
  copy_tile_g2s(gmem_tiled_copy, tQgQ, tQsQ, tQcQ, q_rows, p.head_dim, full_d && q_rows >= kBlockM);
  copy_tile_g2s(gmem_tiled_copy, tKgK(_, _, _, n_block), tKsK, tKcK, kv_rows(n_block), p.head_dim,
                kv_full(n_block));
  cp_async_fence();

  // ---- Main loop over key blocks, highest first ----
  // One step per key block, in two compiled forms: kTransform applies softcap and the window mask,
  // the other carries no trace of either. As plain runtime branches ptxas if-converted both into
  // predicated code that every block issued (bench/PERFLOG.md "v2: a compiled "transform" step
  // and a clean step"); a templated step per loop section spilled instead.
  const bool softcap_on = p.softcap != 0.f;
  auto step = [&](int n_block, auto transform_tag) __attribute__((always_inline)) {
    constexpr bool kTransform = decltype(transform_tag)::value;
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA,MMA_M,MMA_N)
    clear(acc_s);

    cp_async_wait<0>();  // K_j (and Q) landed
    __syncthreads();
    copy_tile_g2s(gmem_tiled_copy, tVgV(_, _, _, n_block), tVsV, tKcK, kv_rows(n_block),
                  p.head_dim, kv_full(n_block));
    cp_async_fence();

    gemm_ss(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, smem_copy_q, smem_copy_k, smem_thr_copy_q,
            smem_thr_copy_k);

    Tensor scores = make_tensor(acc_s.data(), acc_layout_rowcol(acc_s.layout()));  // (ROWS,COLS)
    if constexpr (kTransform) {
      if (softcap_on) {
        apply_softcap(scores, p.softcap, p.softcap_prescale);
      }
      if (mask.block_masked(m_block, n_block, kBlockM, kBlockN)) {
        apply_mask(scores, tScS_rc, mask, m_block * kBlockM, n_block * kBlockN);
      }
    }

    cp_async_wait<0>();  // V_j landed
    __syncthreads();     // ... and every warp is done reading K_j
    if (n_block > range.n_min) {
      copy_tile_g2s(gmem_tiled_copy, tKgK(_, _, _, n_block - 1), tKsK, tKcK, kv_rows(n_block - 1),
                    p.head_dim, kv_full(n_block - 1));
      cp_async_fence();
    }

    // One code path for every block, the first included (its old max is -inf, so alpha is 0 on
    // an all-zero O): a peeled first iteration doubled the softmax code and pushed ptxas into
    // spilling the row statistics (240 -> 88 spilled bytes at d 128).
    softmax.update(scores, acc_o_rc, p.scale_log2);

    // P in the input precision, re-read in place as the A operand of O += P V.
    Tensor rP = convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_layout_as_A(rP.layout()));  // (MMA,MMA_M,MMA_N/2)
    gemm_rs(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, smem_copy_v, smem_thr_copy_v);
  };

  for (; n_block >= range.n_min; --n_block) {
    if (softcap_on || mask.block_masked(m_block, n_block, kBlockM, kBlockN)) {
      step(n_block, cute::true_type{});
    } else {
      step(n_block, cute::false_type{});
    }
  }

  // ---- Epilogue: normalize, LSE, O through shared memory with 16-byte stores ----
  float lse[kRows];
  softmax.finalize(acc_o_rc, p.lse_scale, lse);

  Tensor rO = convert_fragment<Element>(acc_o);
  // sO aliases sQ. Every warp passed the last step's second barrier after its final read of Q,
  // and P V reads only V, so Q's buffer is free.
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_copy_o = smem_copy_o.get_thread_slice(tidx);
  Tensor taccOrO = smem_thr_copy_o.retile_S(rO);
  Tensor taccOsO = smem_thr_copy_o.partition_D(sO);
  copy(smem_copy_o, taccOrO, taccOsO);

  if (p.lse != nullptr) {
    float* lse_ptr =
        p.lse + batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_start;
    // Column 0 of the quad holds each row's final value; the other three skip the store.
    if (get<1>(tScS_rc(0, 0)) == 0) {
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = m_block * kBlockM + get<0>(tScS_rc(r, 0));
        if (row < seq.seqlen_q) {
          lse_ptr[row] = lse[r];
        }
      }
    }
  }

  __syncthreads();
  typename Traits::GmemTiledCopyO gmem_tiled_copy_o;
  auto gmem_thr_copy_o = gmem_tiled_copy_o.get_thread_slice(tidx);
  Tensor tOsO = gmem_thr_copy_o.partition_S(sO);  // (CPY,CPY_M,CPY_D)
  Tensor tOgO = gmem_thr_copy_o.partition_D(gO);
  Tensor tOrO = make_tensor<Element>(shape(tOgO));
  copy(gmem_tiled_copy_o, tOsO, tOrO);
  Tensor tOcO = gmem_thr_copy_o.partition_D(make_identity_tensor(tile_q));
  copy_tile_r2g(gmem_tiled_copy_o, tOrO, tOgO, tOcO, q_rows, p.head_dim,
                full_d && q_rows >= kBlockM);
}

}  // namespace flash_hopper::sm80
