// Host launch of the FA-3 path forward kernel: TMA descriptors from FwdParams
// (common/tma_descriptors.h), persistent grid.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "flash_hopper/api.h"
#include "flash_hopper/fwd_params.h"
#include "sm90/common/tma_descriptors.h"
#include "sm90/fwd/kernel.h"
#include "sm90/fwd/kernel_traits.h"
#include "src/programmatic_launch.h"
#include "src/registry.h"
#include "src/varlen_prepare.h"

namespace flash_hopper::sm90 {

// FLASH_HOPPER_FA3_MULTICAST=0 in the environment keeps unmasked calls on the default tile in a
// build with the multicast kernels (A / B measurements); read once.
inline bool multicast_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("FLASH_HOPPER_FA3_MULTICAST");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

// The launch configuration of a grid in 1-D clusters of `cluster` CTAs (K / V multicast);
// `attribute` holds the cluster shape the configuration points to.
inline cudaLaunchConfig_t cluster_launch_config(int grid, int cluster, int threads, int smem,
                                                cudaStream_t stream,
                                                cudaLaunchAttribute& attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return config;
}

// How many clusters of the multicast kernel the current device runs at once (asked once per
// device; 0 if the query fails, and the caller then refuses the launch).
template <class Traits, class Kernel>
int max_active_clusters(Kernel kernel, int smem) {
  constexpr int kDevices = 64;  // past these, asked on every call
  static std::atomic<int> cached[kDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const bool cacheable = device >= 0 && device < kDevices;
  int n = cacheable ? cached[device].load(std::memory_order_relaxed) : 0;
  if (n > 0) {
    return n;
  }
  // The query takes a whole number of clusters as the grid (66: one per SM pair of an H100 / H200).
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = cluster_launch_config(
      Traits::kClusterM * 66, Traits::kClusterM, Traits::kThreads, smem, nullptr, attribute);
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &config) != cudaSuccess) {
    cudaGetLastError();  // clear it: the call reports its own error
    return 0;
  }
  if (cacheable) {
    cached[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// FH_VARIANT_FLAG_NO_PINGPONG in FwdParams::variant turns ping-pong off (the ablation) where the
// tile uses it; the other flags are template parameters (run_fwd).
template <class Traits>
LaunchResult launch_fwd(FwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  using Element = typename Traits::Element;
  using KvElement = typename Traits::KvElement;  // Element's but in mixed mode (FP8 K / V)
  constexpr int kSmem = Traits::kSmemBytes;
  if (kSmem > max_smem_per_block) {
    return LaunchResult::no_tile_fits(kSmem);  // errors.cu reports it; nothing launched
  }
  constexpr int kElem = sizeof(Element);
  constexpr int kKvElem = sizeof(KvElement);
  const int seqlen_k = p.seqlen_k > 0 ? p.seqlen_k : 1;  // no key: every tile is empty
  // Varlen descriptors span the packed tokens (seqlen = total) with one batch entry.
  const int tma_batch = Traits::kVarlen ? 1 : p.batch;
  const void* k_ptr = p.seqlen_k > 0 ? p.k : p.q;
  const void* v_ptr = p.seqlen_k > 0 ? p.v : p.q;
  const int64_t q_strides[3] = {tma_stride(p.q_row_stride, p.seqlen_q, kElem),
                                tma_stride(p.q_head_stride, p.heads_q, kElem),
                                tma_stride(p.q_batch_stride, tma_batch, kElem)};
  // Without keys K / V stand on q's bytes (never read): q's row stride in K / V elements.
  const int64_t q_row_as_kv = q_strides[0] * kElem / kKvElem;
  const int64_t k_strides[3] = {p.seqlen_k > 0 ? tma_stride(p.k_row_stride, seqlen_k, kKvElem)
                                               : q_row_as_kv,
                                tma_stride(p.k_head_stride, p.heads_kv, kKvElem),
                                tma_stride(p.k_batch_stride, tma_batch, kKvElem)};
  const int64_t v_strides[3] = {p.seqlen_k > 0 ? tma_stride(p.v_row_stride, seqlen_k, kKvElem)
                                               : q_row_as_kv,
                                tma_stride(p.v_head_stride, p.heads_kv, kKvElem),
                                tma_stride(p.v_batch_stride, tma_batch, kKvElem)};
  // Order of the checks: row, head, batch stride of q, then k, then v (the FhFwdParams names).
  const NamedStride q_tma_strides[] = {
      {"q_row_stride", q_strides[0]}, {"q_head_stride", q_strides[1]},
      {"q_batch_stride", q_strides[2]}};
  const NamedStride kv_tma_strides[] = {
      {"k_row_stride", k_strides[0]}, {"k_head_stride", k_strides[1]},
      {"k_batch_stride", k_strides[2]}, {"v_row_stride", v_strides[0]},
      {"v_head_stride", v_strides[1]}, {"v_batch_stride", v_strides[2]},
  };
  if (LaunchResult r = check_tma_strides(q_tma_strides, kElem); r.status != LaunchStatus::kOk) {
    return r;
  }
  if (LaunchResult r = check_tma_strides(kv_tma_strides, kKvElem);
      r.status != LaunchStatus::kOk) {
    return r;
  }

  auto gmem = [&](const void* ptr, int seqlen, int heads, const int64_t* s) {
    return tma_gmem_tensor<Element>(ptr, seqlen, p.head_dim, heads, tma_batch, s);
  };
  const int head_dim_v = sm90::head_dim_v<Traits>(p);  // V's and O's
  auto gmem_kv = [&](const void* ptr, int seqlen, int heads, const int64_t* s, int cols) {
    return tma_gmem_tensor<KvElement>(ptr, seqlen, cols, heads, tma_batch, s);
  };
  using TmaQ = typename Traits::TmaQ;
  using TmaKV = typename Traits::TmaKV;
  using TmaV = typename Traits::TmaV;
  auto key = [&](const void* ptr, int seqlen, int heads, const int64_t* s) {
    return typename TmaMemo<TmaQ>::Key{ptr, {seqlen, p.head_dim, heads, tma_batch},
                                        {s[0], s[1], s[2]}};
  };
  auto kv_key = [&](auto const& memo, const void* ptr, const int64_t* s, int cols) {
    return typename std::decay_t<decltype(memo)>::Key{
        ptr, {seqlen_k, cols, p.heads_kv, tma_batch}, {s[0], s[1], s[2]}};
  };
  thread_local TmaMemo<TmaQ> q_memo;
  thread_local TmaMemo<TmaKV> k_memo;
  thread_local TmaMemo<TmaV> v_memo;
  KernelParams<Traits> kp;
  kp.fwd = p;
  kp.tma_q = q_memo.get(key(p.q, p.seqlen_q, p.heads_q, q_strides), [&] {
    return make_tma_copy(SM90_TMA_LOAD{}, gmem(p.q, p.seqlen_q, p.heads_q, q_strides),
                         typename Traits::SmemLayoutQ{},
                         Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}, _1{});
  });
  // K / V: one part per CTA of the cluster with multicast (kClusterM), else the whole block.
  kp.tma_k = k_memo.get(kv_key(k_memo, k_ptr, k_strides, p.head_dim), [&] {
    return make_tma_copy(typename Traits::TmaKVOp{},
                         gmem_kv(k_ptr, seqlen_k, p.heads_kv, k_strides, p.head_dim),
                         take<0, 2>(typename Traits::SmemLayoutKVLoad{}),
                         Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDim>>{},
                         Int<Traits::kClusterM>{});
  });
  kp.tma_v = v_memo.get(kv_key(v_memo, v_ptr, v_strides, head_dim_v), [&] {
    return make_tma_copy(typename Traits::TmaKVOp{},
                         gmem_kv(v_ptr, seqlen_k, p.heads_kv, v_strides, head_dim_v),
                         take<0, 2>(typename Traits::SmemLayoutVLoad{}),
                         Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDimV>>{},
                         Int<Traits::kClusterM>{});
  });
  const bool masked = p.window_left >= 0 || p.window_right >= 0;
  const int64_t kv_bytes = int64_t(seqlen_k) * (p.head_dim + head_dim_v) * kKvElem;
  kp.pingpong = Traits::kPingpongDefault && (p.variant & FH_VARIANT_FLAG_NO_PINGPONG) == 0;
  auto kernel = fwd_kernel<Traits>;
  const cudaError_t err = opt_in_dynamic_smem<fwd_kernel<Traits>>(kSmem);
  if (err != cudaSuccess) {
    return LaunchResult::cuda(err);
  }
  constexpr int kCluster = Traits::kClusterM;
  if constexpr (!Traits::kVarlen) {
    // With clusters the persistent grid is as many clusters as fit the GPU at once (a 2-CTA
    // cluster needs two free SMs of one GPC, so fewer than num_sms / 2 may fit).
    int slots = p.num_sms;
    if constexpr (kCluster > 1) {
      const int fit = max_active_clusters<Traits>(kernel, kSmem);
      if (fit <= 0) {
        return LaunchResult::internal("no 2-CTA cluster of the K / V multicast kernel fits");
      }
      const int capped = p.num_sms / kCluster > 0 ? p.num_sms / kCluster : 1;  // a grid cap too
      slots = fit < capped ? fit : capped;
    }
    // Masked calls with a tile counter claim their tiles at run time (tile_scheduler.h); the
    // counter starts at 0 on the stream, ahead of the kernel.
    kp.scheduler = StaticTileScheduler::make(p.seqlen_q, p.seqlen_k, Traits::kBlockM, p.heads_q,
                                             p.heads_per_kv, p.batch, kv_bytes,
                                             /*longest_first=*/masked, slots, kCluster,
                                             /*claimed=*/p.tile_counter != nullptr);
    if (kp.scheduler.total_tiles == 0) {
      return LaunchResult::ok();
    }
    if (kp.scheduler.dynamic) {
      const cudaError_t zeroed = cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream);
      if (zeroed != cudaSuccess) {
        return LaunchResult::cuda(zeroed);
      }
    }
  } else {
    // Varlen: the prepare kernel lists the (sequence, query block) pairs on the device (the host
    // knows only their bound, varlen_capacity); the persistent grid walks the list.
    const int64_t bound_tiles = int64_t(p.varlen_capacity) * p.heads_q;
    if (bound_tiles == 0) {
      return LaunchResult::ok();
    }
    if (LaunchResult r = launch_varlen_prepare(p, Traits::kBlockM, Traits::kBlockN, stream);
        r.status != LaunchStatus::kOk) {
      return r;
    }
    const int grid = static_cast<int>(bound_tiles < p.num_sms ? bound_tiles : p.num_sms);
    // L2 sections when at least kSectionSequences sequences could be as long as the longest
    // (tile_scheduler.h: then the list interleaves many sequences' blocks of equal cost).
    constexpr int64_t kSectionSequences = 4;
    const bool l2_sections = masked && p.varlen_max_seqlen_q > 0 &&
                             int64_t(p.seqlen_q) >= kSectionSequences * p.varlen_max_seqlen_q;
    // Masked calls claim their tiles from the header's counter (the prepare kernel zeroed it;
    // the kernel's roles wait for that kernel before they start).
    kp.scheduler = VarlenTileScheduler::make(p.varlen_pairs, p.varlen_header, p.heads_q,
                                             p.heads_per_kv, kv_bytes, masked, l2_sections,
                                             grid, /*claimed=*/p.tile_counter != nullptr);
  }

  if constexpr (Traits::kVarlen) {
    // Programmatic dependent launch: the CTAs start (barriers, descriptor prefetch) while the
    // prepare kernel, which allows it at its start, still runs; they wait for its list in the
    // kernel (griddepcontrol.wait). Saves the launch gap between the two kernels.
    return LaunchResult::cuda(launch_programmatic(kernel, dim3(kp.scheduler.grid),
                                                  dim3(Traits::kThreads), kSmem, stream,
                                                  /*programmatic=*/true, kp));
  }
  if constexpr (kCluster > 1) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = cluster_launch_config(
        kp.scheduler.grid * kCluster, kCluster, Traits::kThreads, kSmem, stream, attribute);
    return LaunchResult::cuda(cudaLaunchKernelEx(&config, kernel, kp));
  }
  kernel<<<kp.scheduler.grid, Traits::kThreads, kSmem, stream>>>(kp);
  return LaunchResult::cuda(cudaGetLastError());
}

// One instantiation per kernel of kernels/src/tables.cmake's variant table: kKernelVariant is the
// FhVariant whose template flags it compiles in (FH_VARIANT_FLAG_NO_OVERLAP -> kOverlap = false);
// the runtime flags (FH_VARIANT_FLAG_NO_PINGPONG) arrive in p.variant. Masked calls with short key
// sequences run the bucket's kShortMasked tile where it has one (tile_config.h); the no-overlap
// ablation kernels keep the default tile. KvElement differs from Element in mixed mode only
// (16-bit q against FP8 K / V: its own tile, tile_config.h).
template <class Element, int kHeadDim, int kKernelVariant, class KvElement = Element>
LaunchResult run_fwd(FwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  static_assert((kKernelVariant & FH_VARIANT_FLAG_NO_PINGPONG) == 0,
                "ping-pong is a runtime switch: the kernel without the flag serves it");
  constexpr bool kOverlap = (kKernelVariant & FH_VARIANT_FLAG_NO_OVERLAP) == 0;
  if constexpr (!cute::is_same_v<Element, KvElement>) {
    static_assert(kOverlap && has_mixed_config(kHeadDim), "mixed mode: tuned kernel, its buckets");
    return launch_fwd<FwdTraits<Element, kHeadDim, kOverlap, TileFamily::kDefault, KvElement>>(
        p, max_smem_per_block, stream);
  } else {
    if constexpr (sizeof(Element) == 1) {
      static_assert(kOverlap && has_fp8_config(kHeadDim), "FP8: tuned kernel, fp8 buckets only");
      if constexpr (has_fp8_short_keys_tile(kHeadDim)) {
        // Short key sequences (varlen: by the caller's max_seqlen_k hint; the tile is right for
        // any length) take the short-keys tile (tile_config.h).
        const int64_t keys = p.varlen() ? p.varlen_max_seqlen_k : p.seqlen_k;
        if (keys > 0 && keys <= kFp8ShortKeysMaxSeqlenK) {
          if (p.varlen()) {
            return launch_fwd<FwdTraits<Element, kHeadDim, kOverlap, TileFamily::kShortKeys,
                                        Element, /*kVarlen=*/true>>(p, max_smem_per_block,
                                                                    stream);
          }
          return launch_fwd<FwdTraits<Element, kHeadDim, kOverlap, TileFamily::kShortKeys>>(
              p, max_smem_per_block, stream);
        }
      }
      if (p.varlen()) {  // FP8's default tile over the packed layout
        return launch_fwd<FwdTraits<Element, kHeadDim, kOverlap, TileFamily::kDefault, Element,
                                    /*kVarlen=*/true>>(p, max_smem_per_block, stream);
      }
    } else if constexpr (kOverlap) {
      if (p.varlen()) {  // the packed layout's kernels: the short masked tile as dense calls
        // choose it, by the caller's max_seqlen_k hint (the tile is right for any length)
        if constexpr (has_short_masked_tile(kHeadDim)) {
          const bool masked = p.window_left >= 0 || p.window_right >= 0;
          if (masked && p.varlen_max_seqlen_k > 0 &&
              p.varlen_max_seqlen_k <= short_masked_max_seqlen_k(kHeadDim)) {
            return launch_fwd<FwdTraits<Element, kHeadDim, kOverlap, TileFamily::kShortMasked,
                                        Element, /*kVarlen=*/true>>(p, max_smem_per_block,
                                                                    stream);
          }
        }
        return launch_fwd<FwdTraits<Element, kHeadDim, kOverlap, TileFamily::kDefault, Element,
                                    /*kVarlen=*/true>>(p, max_smem_per_block, stream);
      }
    }
    if (p.varlen()) {  // validate_fwd.cu refuses varlen calls of mixed inputs and ablation variants
      return LaunchResult::internal("varlen call reached a kernel without a varlen instance");
    }
    if constexpr (sizeof(Element) == 2 && kOverlap && has_short_masked_tile(kHeadDim)) {
      const bool masked = p.window_left >= 0 || p.window_right >= 0;
      if (masked && p.seqlen_k <= short_masked_max_seqlen_k(kHeadDim)) {
        return launch_fwd<FwdTraits<Element, kHeadDim, kOverlap, TileFamily::kShortMasked>>(
            p, max_smem_per_block, stream);
      }
    }
    if constexpr (sizeof(Element) == 2 && kOverlap && has_multicast_tile(kHeadDim)) {
      const bool masked = p.window_left >= 0 || p.window_right >= 0;
      if (!masked && multicast_enabled()) {
        return launch_fwd<FwdTraits<Element, kHeadDim, kOverlap, TileFamily::kMulticast>>(
            p, max_smem_per_block, stream);
      }
    }
    return launch_fwd<FwdTraits<Element, kHeadDim, kOverlap>>(p, max_smem_per_block, stream);
  }
}

// The kernels with a V head dim of their own (16-bit, the (d, dv) pairs of tile_config.h's
// has_dv_config): the tuned kernel (its ping-pong a runtime flag as above), dense or varlen.
template <class Element, int kHeadDim, int kHeadDimV>
LaunchResult run_fwd_dv(FwdParams const& p, int max_smem_per_block, cudaStream_t stream) {
  static_assert(sizeof(Element) == 2 && has_dv_config(kHeadDim, kHeadDimV));
  if (p.head_dim_v > kHeadDimV || p.head_dim > kHeadDim) {
    return LaunchResult::internal("head dims past the kernel's (d, dv) reached it");
  }
  if (p.varlen()) {
    return launch_fwd<FwdTraits<Element, kHeadDim, /*kOverlap=*/true, TileFamily::kDefault,
                                Element, /*kVarlen=*/true, kHeadDimV>>(p, max_smem_per_block,
                                                                      stream);
  }
  return launch_fwd<FwdTraits<Element, kHeadDim, /*kOverlap=*/true, TileFamily::kDefault, Element,
                              /*kVarlen=*/false, kHeadDimV>>(p, max_smem_per_block, stream);
}

}  // namespace flash_hopper::sm90
