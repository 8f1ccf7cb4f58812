// Host launch of the FA-3 path's backward for one (dtype, head-dim bucket): TMA descriptors of q,
// k, v and dout, the persistent main kernel, then the postprocess that converts its dQ
// accumulator (whose order is this kernel's). kernels/src/launch.cu runs the shared preprocess before
// them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "flash_hopper/bwd_params.h"
#include "sm90/bwd/kernel.h"
#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/postprocess.h"
#include "sm90/common/tma_descriptors.h"
#include "src/registry.h"

namespace flash_hopper::sm90 {

// FLASH_HOPPER_BWD_DET_CHUNK=k (> 0): the deterministic order's key blocks per kv head and chunk
// (BwdTileScheduler::with_chunk) instead of the rule's, for measurements; read once per process.
inline int bwd_det_chunk_override() {
  static const int k = [] {
    const char* env = std::getenv("FLASH_HOPPER_BWD_DET_CHUNK");
    return env != nullptr ? std::atoi(env) : 0;
  }();
  return k;
}

// The bytes of one (batch, kv head)'s query rows that its tiles stream (Q, dO) or add into (the
// fp32 dQ accumulator), over all its query heads: the tile order's L2 sections (schedule.h).
template <class Traits>
int64_t bwd_q_bytes_per_kv_head(BwdParams const& p) {
  constexpr int64_t kRowBytes =
      Traits::kHeadDim * (2 * int64_t(sizeof(typename Traits::Element)) + int64_t(sizeof(float)));
  return int64_t(p.seqlen_q) * p.heads_per_kv * kRowBytes;  // varlen: of the longest sequence
}

template <class Traits>
LaunchResult launch_bwd(BwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  using Element = typename Traits::Element;
  constexpr int kSmem = Traits::kSmemBytes;
  constexpr int kElem = sizeof(Element);
  static_assert(Traits::kUnmasked ? Traits::kBlockM == kBwdUnmaskedBlockM
                                  : kBwdRowPad % Traits::kBlockM == 0 &&
                                        Traits::kBlockM % kBwdSemaphoreRows == 0,
                "query blocks must tile the workspace's padded rows and its semaphores");
  if (kSmem > max_smem_per_block) {
    return LaunchResult::no_tile_fits(kSmem);
  }
  if (p.seqlen_q > 0 && p.head_dim_rounded != Traits::kHeadDim) {
    return LaunchResult::internal("dq_accum columns differ from the fa3 backward's bucket");
  }

  // Varlen: the descriptors span the packed rows (q_rows / k_rows) with one batch entry.
  const int batch = p.batch_entries();
  if (p.seqlen_k > 0 && p.k_rows() > 0) {
    // No query rows: no step loads Q or dO (every tile stores dK = dV = 0), but the descriptors
    // must still encode: they describe K's memory then, which is never read through them.
    const bool no_q = p.seqlen_q == 0 || p.q_rows() == 0;
    const void* q_ptr = no_q ? p.k : p.q;
    const void* do_ptr = no_q ? p.k : p.dout;
    const int q_rows = no_q ? p.k_rows() : p.q_rows();
    const int k_rows = p.k_rows();
    const int heads_q = no_q ? p.heads_kv : p.heads_q;
    const int64_t q_strides[3] = {
        tma_stride(no_q ? p.k_row_stride : p.q_row_stride, q_rows, kElem),
        tma_stride(no_q ? p.k_head_stride : p.q_head_stride, heads_q, kElem),
        tma_stride(no_q ? p.k_batch_stride : p.q_batch_stride, batch, kElem)};
    const int64_t do_strides[3] = {
        tma_stride(no_q ? p.k_row_stride : p.dout_row_stride, q_rows, kElem),
        tma_stride(no_q ? p.k_head_stride : p.dout_head_stride, heads_q, kElem),
        tma_stride(no_q ? p.k_batch_stride : p.dout_batch_stride, batch, kElem)};
    const int64_t k_strides[3] = {tma_stride(p.k_row_stride, k_rows, kElem),
                                  tma_stride(p.k_head_stride, p.heads_kv, kElem),
                                  tma_stride(p.k_batch_stride, batch, kElem)};
    const int64_t v_strides[3] = {tma_stride(p.v_row_stride, k_rows, kElem),
                                  tma_stride(p.v_head_stride, p.heads_kv, kElem),
                                  tma_stride(p.v_batch_stride, batch, kElem)};
    const NamedStride tma_strides[] = {
        {"q_row_stride", q_strides[0]},        {"q_head_stride", q_strides[1]},
        {"q_batch_stride", q_strides[2]},      {"k_row_stride", k_strides[0]},
        {"k_head_stride", k_strides[1]},       {"k_batch_stride", k_strides[2]},
        {"v_row_stride", v_strides[0]},        {"v_head_stride", v_strides[1]},
        {"v_batch_stride", v_strides[2]},      {"dout_row_stride", do_strides[0]},
        {"dout_head_stride", do_strides[1]},   {"dout_batch_stride", do_strides[2]},
    };
    if (LaunchResult r = check_tma_strides(tma_strides, kElem); r.status != LaunchStatus::kOk) {
      return r;
    }

    auto gmem = [&](const void* ptr, int rows, int heads, const int64_t* s) {
      return tma_gmem_tensor<Element>(ptr, rows, p.head_dim, heads, batch, s);
    };
    using TmaQ = typename Traits::TmaQ;
    using TmaKV = typename Traits::TmaKV;
    auto q_key = [&](const void* ptr, const int64_t* s) {
      return typename TmaMemo<TmaQ>::Key{ptr, {q_rows, p.head_dim, heads_q, batch},
                                          {s[0], s[1], s[2]}};
    };
    auto kv_key = [&](const void* ptr, const int64_t* s) {
      return typename TmaMemo<TmaKV>::Key{ptr, {k_rows, p.head_dim, p.heads_kv, batch},
                                           {s[0], s[1], s[2]}};
    };
    // The rows' statistics (seqlen_q_rounded, heads_q, batch); with no queries a box over K's
    // memory that nothing reads, as for Q.
    using TmaStats = typename Traits::TmaStats;
    const int stats_rows = no_q ? Traits::kBlockM : p.seqlen_q_rounded;
    const int stats_heads = no_q ? 1 : p.heads_q;
    const int stats_batch = no_q ? 1 : batch;
    const int64_t stats_strides[2] = {stats_rows, int64_t(stats_rows) * stats_heads};
    auto stats_key = [&](const void* ptr) {
      return typename TmaMemo<TmaStats>::Key{
          ptr, {stats_rows, stats_heads, stats_batch, 0}, {stats_strides[0], stats_strides[1], 0}};
    };
    auto encode_stats = [&](const void* ptr) {
      Tensor g = make_tensor(make_gmem_ptr(static_cast<float const*>(ptr)),
                             make_shape(stats_rows, stats_heads, stats_batch),
                             make_stride(_1{}, stats_strides[0], stats_strides[1]));
      return make_tma_copy(SM90_TMA_LOAD{}, g, typename Traits::SmemLayoutStats{},
                           Shape<Int<Traits::kBlockM>>{}, _1{});
    };
    const void* lse_ptr = no_q ? p.k : p.lse_log2;
    const void* dpsum_ptr = no_q ? p.k : p.dpsum;
    thread_local TmaMemo<TmaStats> lse_memo;
    thread_local TmaMemo<TmaStats> dpsum_memo;
    thread_local TmaMemo<TmaQ> q_memo;
    thread_local TmaMemo<TmaQ> do_memo;
    thread_local TmaMemo<TmaKV> k_memo;
    thread_local TmaMemo<TmaKV> v_memo;
    auto encode_q = [&](const void* ptr, const int64_t* s) {
      return make_tma_copy(SM90_TMA_LOAD{}, gmem(ptr, q_rows, heads_q, s),
                           typename Traits::SmemLayoutQ{},
                           Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}, _1{});
    };
    auto encode_kv = [&](const void* ptr, const int64_t* s) {
      return make_tma_copy(SM90_TMA_LOAD{}, gmem(ptr, k_rows, p.heads_kv, s),
                           typename Traits::SmemLayoutK{},
                           Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{}, _1{});
    };
    BwdKernelParams<Traits> kp;
    kp.bwd = p;
    kp.tma_q = q_memo.get(q_key(q_ptr, q_strides), [&] { return encode_q(q_ptr, q_strides); });
    kp.tma_do = do_memo.get(q_key(do_ptr, do_strides),
                            [&] { return encode_q(do_ptr, do_strides); });
    kp.tma_k = k_memo.get(kv_key(p.k, k_strides), [&] { return encode_kv(p.k, k_strides); });
    kp.tma_v = v_memo.get(kv_key(p.v, v_strides), [&] { return encode_kv(p.v, v_strides); });
    kp.tma_lse = lse_memo.get(stats_key(lse_ptr), [&] { return encode_stats(lse_ptr); });
    kp.tma_dpsum = dpsum_memo.get(stats_key(dpsum_ptr), [&] { return encode_stats(dpsum_ptr); });
    kp.tiles = BwdTileScheduler::make(p.seqlen_k, Traits::kBlockN, p.heads_kv, p.heads_per_kv,
                                      p.batch, p.deterministic != 0, p.num_sms,
                                      bwd_longest_first(attention_mask(p)),
                                      bwd_q_bytes_per_kv_head<Traits>(p),
                                      p.tile_counter != nullptr
                                          ? (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM *
                                                p.heads_per_kv
                                          : 0,
                                      Traits::kDeterministic && !p.varlen() &&
                                              bwd_full_mask(attention_mask(p))
                                          ? (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM
                                          : 0);
    if (const int k = bwd_det_chunk_override(); k > 0) {
      kp.tiles = kp.tiles.with_chunk(k);
    }
    if (kp.tiles.total_tiles > 0) {
      const cudaError_t err = opt_in_dynamic_smem<bwd_kernel<Traits>>(kSmem);
      if (err != cudaSuccess) {
        return LaunchResult::cuda(err);
      }
      bwd_kernel<Traits><<<kp.tiles.grid, Traits::kThreads, kSmem, stream>>>(kp);
      const cudaError_t launched = cudaGetLastError();
      if (launched != cudaSuccess) {
        return LaunchResult::cuda(launched);
      }
    }
  }
  if (p.seqlen_q > 0) {  // seqlen_k == 0 too: dq = 0 from the cleared accumulator
    const dim3 grid((p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, p.heads_q, p.batch);
    bwd_postprocess_kernel<Traits><<<grid, 128 * Traits::kDqWgs, 0, stream>>>(p);
    return LaunchResult::cuda(cudaGetLastError());
  }
  return LaunchResult::ok();
}

// Whether a call runs on the unmasked tile (tile_config.h bwd_config_unmasked), as FA3 chooses
// its d128 tile: no mask, no softcap, default mode; and dense, whose workspace rows are rounded
// for its 80-row query blocks (bwd_rows_rounded).
inline bool bwd_takes_unmasked_tile(BwdParams const& p) {
  return !p.varlen() && p.deterministic == 0 && p.softcap == 0.f &&
         bwd_full_mask(attention_mask(p));
}

// The unmasked tile's launch: explicitly instantiated in a translation unit of its own (CMake),
// which keeps each compiler job of the bucket within its memory budget.
template <class Element, int kHeadDim>
LaunchResult launch_bwd_unmasked(BwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  return launch_bwd<BwdTraits<Element, kHeadDim, /*kDeterministic=*/false, /*kUnmasked=*/true>>(
      p, max_smem_per_block, stream);
}

template <class Element, int kHeadDim>
LaunchResult run_bwd(BwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  if (p.batch == 0) {
    return LaunchResult::ok();
  }
  if constexpr (has_bwd_unmasked_config(kHeadDim)) {
    if (bwd_takes_unmasked_tile(p)) {
      if (p.seqlen_q_rounded != bwd_rows_rounded(p.seqlen_q)) {
        return LaunchResult::internal("the workspace's rows are not rounded for 80-row blocks");
      }
      return launch_bwd_unmasked<Element, kHeadDim>(p, max_smem_per_block, stream);
    }
  }
  if constexpr (BwdTraits<Element, kHeadDim>::kDqSlots) {
    if (p.deterministic) {
      return launch_bwd<BwdTraits<Element, kHeadDim, /*kDeterministic=*/true>>(
          p, max_smem_per_block, stream);
    }
  }
  return launch_bwd<BwdTraits<Element, kHeadDim>>(p, max_smem_per_block, stream);
}

}  // namespace flash_hopper::sm90
