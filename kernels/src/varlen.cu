// The varlen prepare kernel (kernels/src/varlen_prepare.h): the work list of a varlen call.
//
// Up to kSortMax pairs: a bitonic sort on (cost, sequence, query block) (deterministic,
// neighbouring query blocks of one sequence together among equal costs): up to kThreads pairs one
// key per thread in registers, their records cached in shared memory as they are enumerated
// (sort_cached: ~3x faster than sort_pairs, which sorts in shared memory and rebuilds the
// records from the keys). Beyond that, a counting sort on the cost, three passes over the pairs:
//   1. a histogram of the pairs' costs (shared memory; costs past kBins - 1 share the last bin,
//      which only blurs the order among the very longest tiles);
//   2. an exclusive scan over the bins from the highest cost down: each bin's first slot;
//   3. every pair takes the next slot of its bin (a shared atomic) and writes its record; without
//      a mask every sequence takes its pairs' slots at once, adjacent and in query-block order.
// Pairs are enumerated warp per sequence (warp w takes sequences w, w + 32, ...; its lanes stride
// over the sequence's query blocks): balanced for one long sequence and for many short ones.
// Passes 1 and 3 enumerate the same pairs in the same way, so the counts agree.
#include <cuda_runtime.h>

#include <cstdint>

#include "flash_hopper/fwd_params.h"
#include "flash_hopper/mask.h"
#include "flash_hopper/varlen.h"
#include "src/varlen_prepare.h"

namespace flash_hopper {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 4096;  // key blocks: 512k keys at block_n = 128 before costs share a bin
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kSortMax = 8192;  // pairs sorted in shared memory (64 KiB of keys)
constexpr int kCachedMax = kThreads;  // pairs sorted in registers, records cached (48 KiB)
constexpr int kSmemBytes = kSortMax * 8 + kCachedMax * int(sizeof(VarlenPair));  // cc >= 8.0

struct PrepareArgs {
  const int32_t* cu_q;
  const int32_t* cu_k;
  const int32_t* used_q;
  const int32_t* used_k;
  KvIndex kv;
  int batch;
  int total_q;
  int total_k;
  int window_left;
  int window_right;
  int block_m;
  int block_n;
  VarlenHeader* header;
  VarlenPair* pairs;
  int capacity;
};

__device__ SequenceSpan span_of(PrepareArgs const& a, int b) {
  return sequence_span(a.cu_q, a.cu_k, a.used_q, a.used_k, b, a.total_q, a.total_k, a.kv);
}

// The record of query block m of sequence b (span s): its key blocks under the sequence's mask.
__device__ VarlenPair make_pair(PrepareArgs const& a, SequenceSpan const& s, int b, int m) {
  const AttentionMask mask{s.seqlen_q, s.seqlen_k, a.window_left, a.window_right};
  const KeyBlockRange r = mask.key_blocks(m, a.block_m, a.block_n);
  const KeyBlockSplit split = mask.unmasked_blocks(r, m, a.block_m, a.block_n);
  return {b, m, s.q_start, s.k_start, s.seqlen_q, s.seqlen_k, r.n_min, r.n_max, split.n_left,
          split.n_right, r.empty() ? 0 : r.n_max - r.n_min,
          (s.seqlen_q + a.block_m - 1) / a.block_m};
}

// The counting sort's bin of a cost: costliest first, costs past kBins - 1 in the last bin.
__device__ int cost_bin(int cost) { return kBins - 1 - (cost < kBins - 1 ? cost : kBins - 1); }

// Calls f(pair, bin) for every pair this thread enumerates (the pair's record complete but for
// its position).
template <class F>
__device__ void for_each_pair(PrepareArgs const& a, F&& f) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  for (int b = warp; b < a.batch; b += kWarps) {
    const SequenceSpan s = span_of(a, b);
    const int m_blocks = (s.seqlen_q + a.block_m - 1) / a.block_m;
    for (int m = lane; m < m_blocks; m += 32) {
      const VarlenPair pair = make_pair(a, s, b, m);
      f(pair, cost_bin(pair.cost));
    }
  }
}

// Sort keys: (bin, batch, m_block), ascending = costliest first, then by sequence and query
// block. 12 + 20 + 28 bits: bins < 4096, batch <= 65535 (validate.h), m_block < 2^25
// (seqlen < 2^31).
__device__ uint64_t pair_key(int bin, int b, int m) {
  return (uint64_t(bin) << 48) | (uint64_t(b) << 28) | uint64_t(m);
}

// Up to kCachedMax pairs: one key per thread, the bitonic sort's exchanges by warp shuffles up to
// a distance of 16 and through shared memory beyond (padded: a power of two >= 32, block
// uniform; threads past it sort sentinels among themselves), the slot of each pair's cached
// record in the key's low 10 bits (m_block < 1024 here, so (bin, batch, m_block) keeps its 12 +
// 20 + 18 bits above them).
__device__ void sort_cached(PrepareArgs const& a, uint64_t* keys, VarlenPair const* cache,
                            int total) {
  int padded = 32;
  while (padded < total) {
    padded <<= 1;
  }
  const int i = threadIdx.x;
  uint64_t x = ~uint64_t(0);
  if (i < total) {
    const uint64_t key = keys[i];
    x = (key & ~uint64_t(0xFFFFFFF)) | ((key & 0xFFFFFFF) << 10) | uint64_t(i);
  }
  __syncthreads();  // every key read before the exchanges reuse the buffer
  for (int k = 2; k <= padded; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      uint64_t y;
      if (j >= 32) {
        keys[i] = x;
        __syncthreads();
        y = keys[i ^ j];
        __syncthreads();
      } else {
        y = __shfl_xor_sync(0xffffffffu, x, j);
      }
      const bool keep_min = ((i & j) == 0) == ((i & k) == 0);
      x = keep_min == (x < y) ? x : y;
    }
  }
  if (i < total && i < a.capacity) {
    a.pairs[i] = cache[x & (kCachedMax - 1)];
  }
}

// The sorted path beyond kCachedMax pairs: every pair's key in shared memory, a bitonic sort, the
// records rebuilt from the keys. Deterministic: equal-cost tiles stay in (sequence, query block) order, so the CTAs
// running together work on neighbouring query blocks of one sequence and share its K / V in L2
// (in the scattered order of the counting sort the equal-length batch ran up to 25 % slower).
__device__ void sort_pairs(PrepareArgs const& a, uint64_t* keys, int total) {
  int padded = 1;
  while (padded < total) {
    padded <<= 1;
  }
  for (int i = total + threadIdx.x; i < padded; i += kThreads) {
    keys[i] = ~uint64_t(0);
  }
  __syncthreads();
  for (int k = 2; k <= padded; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < padded; i += kThreads) {
        const int partner = i ^ j;
        if (partner > i) {
          const uint64_t x = keys[i];
          const uint64_t y = keys[partner];
          if ((x > y) == ((i & k) == 0)) {
            keys[i] = y;
            keys[partner] = x;
          }
        }
      }
      __syncthreads();
    }
  }
  for (int i = threadIdx.x; i < total && i < a.capacity; i += kThreads) {
    const uint64_t key = keys[i];
    const int b = int((key >> 28) & 0xFFFFF);
    const int m = int(key & 0xFFFFFFF);
    a.pairs[i] = make_pair(a, span_of(a, b), b, m);
  }
}

__global__ void __launch_bounds__(kThreads, 1) varlen_prepare_kernel(PrepareArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The FA-3 kernel after this one may launch now (programmatic dependent launch): its CTAs
  // wait for this grid's completion before reading the list (sm90/fwd/kernel.h).
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  extern __shared__ __align__(16) unsigned char smem[];
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);  // kSortMax
  VarlenPair* cache = reinterpret_cast<VarlenPair*>(smem + kSortMax * 8);  // kCachedMax
  __shared__ int bins[kBins];
  __shared__ int warp_sums[kWarps];
  __shared__ int count;
  for (int i = threadIdx.x; i < kBins; i += kThreads) {
    bins[i] = 0;
  }
  if (threadIdx.x == 0) {
    count = 0;
  }
  __syncthreads();
  for_each_pair(a, [&](VarlenPair const& pair, int bin) {
    const int slot = atomicAdd(&count, 1);
    if (slot < kSortMax) {
      keys[slot] = pair_key(bin, pair.batch, pair.m_block);
    }
    if (slot < kCachedMax) {
      cache[slot] = pair;
    }
  });
  __syncthreads();
  const int listed = count;
  if (listed <= kSortMax) {
    if (listed <= kCachedMax) {
      sort_cached(a, keys, cache, listed);
    } else {
      sort_pairs(a, keys, listed);
    }
    if (threadIdx.x == 0) {
      a.header->num_pairs = listed < a.capacity ? listed : a.capacity;
      a.header->overflow = listed > a.capacity ? 1 : 0;
      a.header->tile_counter = 0;
    }
    return;
  }
  // More pairs than the sort holds: the counting sort (ties in arbitrary order).
  for_each_pair(a, [&](VarlenPair const&, int bin) { atomicAdd(&bins[bin], 1); });
  __syncthreads();

  // Exclusive scan: each thread owns kBinsPerThread consecutive bins.
  int local[kBinsPerThread];
  int sum = 0;
  for (int i = 0; i < kBinsPerThread; ++i) {
    local[i] = sum;
    sum += bins[threadIdx.x * kBinsPerThread + i];
  }
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  int incl = sum;  // inclusive scan of the threads' sums inside the warp
  for (int d = 1; d < 32; d *= 2) {
    const int x = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) {
      incl += x;
    }
  }
  if (lane == 31) {
    warp_sums[warp] = incl;
  }
  __syncthreads();
  if (warp == 0) {
    int w = warp_sums[lane];
    for (int d = 1; d < 32; d *= 2) {
      const int x = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) {
        w += x;
      }
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int base = (warp > 0 ? warp_sums[warp - 1] : 0) + incl - sum;
  for (int i = 0; i < kBinsPerThread; ++i) {
    bins[threadIdx.x * kBinsPerThread + i] = base + local[i];
  }
  const int total = warp_sums[kWarps - 1];
  __syncthreads();

  if (a.window_left < 0 && a.window_right < 0) {
    // Unmasked: a sequence's pairs all cost the same; they take adjacent slots in query-block
    // order, as in the sorted path (the FA-3 scheduler's sequence runs rely on it).
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    for (int b = warp; b < a.batch; b += kWarps) {
      const SequenceSpan s = span_of(a, b);
      const int m_blocks = (s.seqlen_q + a.block_m - 1) / a.block_m;
      if (m_blocks == 0) {
        continue;
      }
      int first = 0;
      if (lane == 0) {
        first = atomicAdd(&bins[cost_bin(make_pair(a, s, b, 0).cost)], m_blocks);
      }
      first = __shfl_sync(0xffffffffu, first, 0);
      for (int m = lane; m < m_blocks; m += 32) {
        if (first + m < a.capacity) {
          a.pairs[first + m] = make_pair(a, s, b, m);
        }
      }
    }
  } else {
    for_each_pair(a, [&](VarlenPair const& pair, int bin) {
      const int slot = atomicAdd(&bins[bin], 1);
      if (slot < a.capacity) {
        a.pairs[slot] = pair;
      }
    });
  }
  if (threadIdx.x == 0) {
    a.header->num_pairs = total < a.capacity ? total : a.capacity;
    a.header->overflow = total > a.capacity ? 1 : 0;
    a.header->tile_counter = 0;
  }
}

}  // namespace

LaunchResult launch_varlen_prepare(FwdParams const& p, int block_m, int block_n,
                                   cudaStream_t stream) {
  PrepareArgs a;
  a.cu_q = p.cu_seqlens_q;
  a.cu_k = p.cu_seqlens_k;
  a.used_q = p.seqused_q;
  a.used_k = p.seqused_k;
  a.kv = p.kv_index;
  a.batch = p.batch;
  a.total_q = p.seqlen_q;
  a.total_k = p.seqlen_k;
  a.window_left = p.window_left;
  a.window_right = p.window_right;
  a.block_m = block_m;
  a.block_n = block_n;
  a.header = p.varlen_header;
  a.pairs = p.varlen_pairs;
  a.capacity = p.varlen_capacity;
  const cudaError_t err = opt_in_dynamic_smem<varlen_prepare_kernel>(kSmemBytes);
  if (err != cudaSuccess) {
    return LaunchResult::cuda(err);
  }
  varlen_prepare_kernel<<<1, kThreads, kSmemBytes, stream>>>(a);
  return LaunchResult::cuda(cudaGetLastError());
}

}  // namespace flash_hopper
