// The decode kernel (docs/decode.md): a few query rows against a long KV cache, paged or dense.
//
// Decode reads every cached key and value once and does little arithmetic on them (4 query rows
// of GQA 32 / 8 make 16 FLOP per byte read): the kernel is bound by how many bytes it keeps in
// flight, not by its tensor cores. So it is a plain cp.async + mma.sync kernel (sm_80 and up):
//
//   CTA = (split, kv head x row block, sequence); 4 warps; kStages-deep cp.async ring of key
//   blocks of kBlockN = 64 keys (K and V), loaded row by row through the page table, so any page
//   size and any strides load the same way (vLLM's interleaved K / V views, a page of one key).
//   Every thread loads, every warp computes: warp w takes keys [16 w, 16 w + 16) of each block
//   and keeps its own online softmax (m, l, O) over them, so the warps never wait on each other
//   inside the loop; one __syncthreads per block guards the ring.
//
//   timeline per block j:   wait block j's group; sync | issue block j + kStages - 1 | S = Q K^T
//                           (16 x 16 per warp), mask, online softmax, O += P V (16 x d per warp)
//
//   after the loop:  the 4 warps' (m, l, O) merged through shared memory (aliasing the ring);
//   one split: O / l and the LSE written; several: the partial O and LSE to the workspace, and
//   combine_kernel, launched behind it with programmatic dependent launch, merges the splits by
//   their LSEs.
//
// The query heads of a KV head are the tile's rows (packed GQA, decode_plan.h); a tile holds 16
// rows, the m16 of one MMA, whatever the number of valid ones (4 for GQA 32 / 8): the kernel has
// the tensor throughput to waste, not the bytes. A CTA holds one row block or two (kRowTiles,
// decode_plan.h row_tiles_per_cta): two share every K / V fragment a warp reads (and, for FP8,
// widens), each with its own softmax and O.
//
// FP8 caches (DecodeTypes<Fp8Cache<Q, Kv>>: e4m3 / e5m2 K and V, q in e4m3 or 16-bit). The ring
// holds the FP8 bytes as they are in HBM (half a 16-bit stage), and the MMAs read them through
// ldmatrix as they are: a phase of 8 rows x 16 bytes gives each lane 4 FP8 values, widened in
// registers (cvt per pair) into 16-bit B fragments. For K the 4 values are 4 consecutive d of
// one key, which fill two k-slot pairs of one fragment: S sums over d in that order, and Q's A
// fragments (registers, read once per CTA where they fit) follow it. For V, ldmatrix.trans gives
// two keys' byte pairs of one column pair, and one byte permute makes each half a (key, key)
// pair of one column: the accumulators' columns come out interleaved (even / odd columns of a
// 16-byte chunk in two n8 tiles), which only the merge's store into shared memory undoes. No
// 16-bit copy of the cache exists anywhere. The descales fold into the score's scale (or the
// softcap's argument) and O's normalization; the combine kernel needs none.
//
//   timeline per block j (FP8):  as above, with a cvt per FP8 pair between each ldmatrix and
//                                its mma.sync (a byte permute more per V register)
//
// FP8 tiles of at most kKeysAsMRows (8) rows run the keys-as-M form (kKeysAsM, the launch
// chooses): S^T = K Q^T and O^T = V^T P^T, a warp's 16 keys the MMA's M and the rows its N, so
// one m16n8k16 serves 8 rows (half the MMAs, exponentials and O registers of the rows-as-M step);
// S^T's accumulators reach P^T's B fragments through movmatrix.trans.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cstdint>
#include <type_traits>

#include "flash_hopper/decode_plan.h"
#include "flash_hopper/fp8_widen.h"
#include "flash_hopper/score_math.h"  // kLog2e, kLn2, fast_tanh
#include "flash_hopper/timeline.h"    // CtaMarks

namespace flash_hopper {
namespace decode {

// Kernel-side parameters (kernels/src/decode.cu derives them from FhDecodeParams).
struct DecodeParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  const int32_t* seqlens_k;
  const int32_t* leftpad_k;
  const int32_t* kv_batch_idx;
  const int32_t* page_table;
  const int32_t* cu_seqlens_q;
  const float* sinks;
  unsigned long long* timeline;  // FH_TIMELINE builds: DecodeMarks' buffer, or null
  int64_t timeline_ctas;         // the CTAs it has room for
  float* lse_partial; // (splits, row blocks, kRowsPerCta), base 2
  float* o_partial;   // (splits, row blocks, kRowsPerCta, head_dim)

  int batch;
  int seqlen_q;  // varlen: the maximum
  int total_q;   // varlen: rows of q / o / lse; cu_seqlens_q is clamped to [0, total_q]
  int heads_kv;
  int group;        // heads_q / heads_kv
  int row_blocks;   // per kv head: ceil(seqlen_q * group / kRowsPerCta)
  int capacity;     // keys a sequence's cache can hold
  int page_size;
  int page_shift;
  int num_pages;    // paged: pool pages; dense: entries
  int64_t page_table_stride;

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_page_stride, k_row_stride, k_head_stride;
  int64_t v_page_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;

  float scale_log2;     // the exponent's scale: softmax_scale * log2(e), log2(e) with softcap
  float softcap;        // 0: off
  float softcap_scale;  // softmax_scale / softcap
  int window_left;
  int window_right;
  int splits;

  // FP8 calls (api.h, FhDecodeParams): fp32 (batch, heads_kv) descales of q, k and v, null =
  // 1, with their (batch, head) strides. Last, so that the 16-bit kernels read every other field
  // where they always did.
  const float* descales[3];
  int64_t descale_strides[3][2];
};
enum DescaleOf : int { kDescaleQ = 0, kDescaleK = 1, kDescaleV = 2 };

// FH_TIMELINE builds (fh_debug_set_timeline): when each CTA reaches these phases, recorded by the
// shared per-CTA recorder (flash_hopper/timeline.h, CtaMarks: the global timer at each event,
// then the SM id and clock64() at start and end). bench/decode_timeline.py reads them. Other
// builds compile every mark to nothing.
enum DecodeEv : int {
  kEvStart = 0,      // entered
  kEvFirstBlock = 1, // the first key block landed
  kEvLoopDone = 2,   // the last block's P V issued
  kEvPublished = 3,  // split calls: partials written
  kEvEnd = 4,        // every thread done
  kNumDecodeEvents = 5,
};
using DecodeMarks = CtaMarks<DecodeEv, kNumDecodeEvents>;

template <class Element>
struct MmaOps;

template <>
struct MmaOps<__nv_bfloat16> {
  using Atom = cute::SM80_16x8x16_F32BF16BF16F32_TN;
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <>
struct MmaOps<__half> {
  using Atom = cute::SM80_16x8x16_F32F16F16F32_TN;
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// The element types of a call. A 16-bit call's kernel is instantiated on its element type: q,
// K, V, the MMAs and o all in it. An FP8 cache's on Fp8Cache<QStore, KvStore>: K / V stored in
// KvStore (__nv_fp8_e4m3 / __nv_fp8_e5m2); q in QStore, FP8 too (FA3's convention: the MMAs in
// fp16, which holds every e4m3 value exactly and keeps P's 10 mantissa bits, o in bf16) or 16-bit
// (the mixed mode: the MMAs and o in q's type, which holds every e4m3 / e5m2 value exactly).
template <class QStore, class KvStore>
struct Fp8Cache {};

template <class Input>
struct DecodeTypes {
  using Q = Input;
  using Kv = Input;
  using Mma = Input;
  using Out = Input;
  static constexpr bool kFp8Q = false;
  static constexpr bool kFp8Kv = false;
};

template <class QStore, class KvStore>
struct DecodeTypes<Fp8Cache<QStore, KvStore>> {
  static constexpr bool kFp8Q = sizeof(QStore) == 1;
  static constexpr bool kFp8Kv = true;
  static_assert(sizeof(KvStore) == 1, "an FP8 cache");
  using Q = QStore;
  using Kv = KvStore;
  using Mma = std::conditional_t<kFp8Q, __half, QStore>;
  using Out = std::conditional_t<kFp8Q, __nv_bfloat16, QStore>;
};

// Two FP8 values in the high bytes of a register's 16-bit lanes (fp8_widen.h) as two Mma
// values, exactly, with integer operations and one multiply: the widening of code compiled below
// sm_89, where PTX has no FP8 cvt. To bf16 through fp32, exact as well.
template <class Mma, class Fp8>
__device__ __forceinline__ uint32_t widen_lanes(uint32_t lanes) {
  constexpr bool kE4m3 = std::is_same_v<Fp8, __nv_fp8_e4m3>;
  const uint32_t bits =
      kE4m3 ? fp8::e4m3_lanes_to_scaled_half2(lanes) : fp8::e5m2_lanes_to_half2(lanes);
  const __half2 h = *reinterpret_cast<const __half2*>(&bits);
  if constexpr (std::is_same_v<Mma, __half>) {
    if constexpr (kE4m3) {
      const __half2 v = __hmul2(h, __float2half2_rn(fp8::kE4m3HalfScale));
      return *reinterpret_cast<const uint32_t*>(&v);
    } else {
      return bits;
    }
  } else {
    const float2 f = __half22float2(h);
    const float scale = kE4m3 ? fp8::kE4m3HalfScale : 1.f;
    return MmaOps<Mma>::pack(f.x * scale, f.y * scale);
  }
}

// Four FP8 values (one register, the low byte first) as two pairs of Mma values: bytes 0-1 into
// `lo`, bytes 2-3 into `hi`. On sm_89 and up each 16-bit half of the register goes to its cvt as
// it is (no shift to bring the upper pair down: one instruction less per pair).
template <class Mma, class Fp8>
__device__ __forceinline__ void widen4(uint32_t x, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h0;
  uint32_t h1;
  if constexpr (std::is_same_v<Fp8, __nv_fp8_e4m3>) {
    asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\t"
        "cvt.rn.f16x2.e4m3x2 %0, a;\n\tcvt.rn.f16x2.e4m3x2 %1, b;\n\t}"
        : "=r"(h0), "=r"(h1)
        : "r"(x));
  } else {
    asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\t"
        "cvt.rn.f16x2.e5m2x2 %0, a;\n\tcvt.rn.f16x2.e5m2x2 %1, b;\n\t}"
        : "=r"(h0), "=r"(h1)
        : "r"(x));
  }
  if constexpr (std::is_same_v<Mma, __half>) {
    lo = h0;
    hi = h1;
  } else {  // through fp32, exactly
    const float2 f0 = __half22float2(*reinterpret_cast<const __half2*>(&h0));
    const float2 f1 = __half22float2(*reinterpret_cast<const __half2*>(&h1));
    lo = MmaOps<Mma>::pack(f0.x, f0.y);
    hi = MmaOps<Mma>::pack(f1.x, f1.y);
  }
#else
  lo = widen_lanes<Mma, Fp8>(fp8::low_pair_lanes(x));
  hi = widen_lanes<Mma, Fp8>(fp8::high_pair_lanes(x));
#endif
}

// Eight FP8 values (8 bytes) as one 16-byte chunk of Mma values.
template <class Mma, class Fp8>
__device__ __forceinline__ uint4 widen8(uint2 x) {
  uint4 r;
  widen4<Mma, Fp8>(x.x, r.x, r.y);
  widen4<Mma, Fp8>(x.y, r.z, r.w);
  return r;
}

// A descale of sequence b's KV head (api.h): ptr[b * batch_stride + h_kv * head_stride], 1 for
// null.
__device__ __forceinline__ float descale(DecodeParams const& p, DescaleOf which, int b,
                                         int head_kv) {
  const float* ptr = p.descales[which];
  const int64_t* strides = p.descale_strides[which];
  return ptr == nullptr ? 1.f : ptr[b * strides[0] + head_kv * strides[1]];
}

template <int kHeadDim, int kStages, bool kFp8Kv = false, int kRowTiles = 1>
struct DecodeConfig {
  static_assert(kRowTiles == 1 || kRowTiles == 2, "one or two row blocks per CTA");
  static_assert(kHeadDim % 64 == 0, "the swizzle XORs 3 bits of a row's 16-byte chunk index");
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row of 16-bit elements
  // 16-byte chunks per cached row in the ring: an FP8 row is half a 16-bit one.
  static constexpr int kKvChunks = kFp8Kv ? kHeadDim / 16 : kChunks;
  static constexpr int kStageChunks = kBlockN * kKvChunks;
  // The merge of the warps: each thread owns kCols columns of one row.
  static constexpr int kCols = kHeadDim * kRowsPerCta / kThreads;
  static constexpr int kThreadsPerRow = kHeadDim / kCols;
  static_assert(kThreadsPerRow * kRowsPerCta == kThreads, "one row segment per thread");

  struct Ring {
    uint4 k[kStages][kStageChunks];
    uint4 v[kStages][kStageChunks];
  };

  struct SharedStorage {
    uint4 q[kRowTiles * kRowsPerCta * kChunks];  // the CTA's row blocks, one after the other
    union {
      Ring ring;
      float o[kWarps][kRowsPerCta][kHeadDim];  // after the loop: the warps' outputs
    };
    int ids[2 * kStages][kBlockN];  // paged: the page ids of block b in ids[b % (2 kStages)]
    float m[kWarps][kRowsPerCta];
    float l[kWarps][kRowsPerCta];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));

  // A row's 16-byte chunk c in a tile: chunks XOR-swizzled by the row's low 3 bits, so the 8 rows
  // one ldmatrix phase reads fall in 8 different bank groups.
  static __device__ __forceinline__ int chunk(int row, int c) {
    return row * kChunks + (c ^ (row & 7));
  }
  // Where the loads put a cached row's 16-byte chunk c in a ring stage: chunk()'s swizzle for
  // 16-bit rows; FP8 rows (kKvChunks chunks) swizzled the same way where a row holds 8 chunks or
  // more, and by the row pair where it holds 4 (d64: two 64-byte rows share a 128-byte line), so
  // that an ldmatrix phase's 8 rows of one chunk column fall in 8 bank groups either way.
  static __device__ __forceinline__ int ring_chunk(int row, int c) {
    if constexpr (kFp8Kv && kKvChunks < 8) {
      static_assert(kKvChunks == 4, "FP8 rows of 4 chunks (d64) or of 8 and more");
      return row * kKvChunks + (c ^ ((row >> 1) & 3));
    } else {
      return row * kKvChunks + (c ^ (row & 7));
    }
  }
};

__device__ __forceinline__ int clamp_int(int x, int lo, int hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// Launched with programmatic dependent launch (decode.cu, sm_90), a grid starts while the kernel
// before it in the stream finishes; this waits until that kernel completed and its writes are
// visible. Every global read or write comes after it. Without that launch it returns at once.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A tile's rows (packed GQA, decode_plan.h): sequence b, KV head head_kv, row block row_block;
// row i holds query token (first_row + i) / group of query head head_kv * group + (first_row + i)
// % group. Where their outputs, LSEs and sinks live; shared by the decode and combine kernels.
template <class Element>
struct TileRows {
  DecodeParams const& p;
  int b;
  int head_kv;
  int first_row;
  int seqlen_q;   // the sequence's query tokens
  int64_t q_row0;  // varlen: the sequence's first token in q / o / lse
  int tokens;      // varlen: the sequence's tokens in q (> seqlen_q: a short max_seqlen_q)
  int count;       // valid rows (<= 0: none, a varlen sequence shorter than the longest)

  __device__ TileRows(DecodeParams const& params, int b_, int head_kv_, int row_block)
      : p(params), b(b_), head_kv(head_kv_), first_row(row_block * kRowsPerCta),
        seqlen_q(params.seqlen_q), q_row0(0), tokens(params.seqlen_q) {
    if (p.cu_seqlens_q != nullptr) {  // clamped to q's rows: any offsets stay inside q / o / lse
      const int start = clamp_int(p.cu_seqlens_q[b], 0, p.total_q);
      const int stop = clamp_int(p.cu_seqlens_q[b + 1], start, p.total_q);
      tokens = stop - start;
      seqlen_q = imin(tokens, p.seqlen_q);
      q_row0 = start;
    }
    count = imin(kRowsPerCta, seqlen_q * p.group - first_row);
  }
  // The grid covers max_seqlen_q tokens of each sequence (a hint: checked calls correct it on
  // the host). A sequence longer than an unchecked hint has tokens no row block computes: they
  // get what a row without keys gets (out 0, LSE -inf), never uninitialized memory. Called by
  // one CTA per (sequence, KV head), all its threads, from row block 0 (first_row 0: row i is
  // the sequence's packed row i); inside the sequence's rows of o / lse.
  template <int kHeadDim>
  __device__ void clear_past_hint(int tid, int threads) const {
    const int first = seqlen_q * p.group;
    const int64_t elems = int64_t(tokens * p.group - first) * kHeadDim;
    for (int64_t e = tid; e < elems; e += threads) {
      const int i = first + int(e / kHeadDim);
      out_row(i)[e % kHeadDim] = Element(0.f);
      if (p.lse != nullptr && e % kHeadDim == 0) {
        write_lse(i, -INFINITY);
      }
    }
  }
  __device__ int token_of(int i) const { return (first_row + i) / p.group; }
  __device__ int head_of(int i) const { return head_kv * p.group + (first_row + i) % p.group; }
  __device__ Element* out_row(int i) const {
    const int t = token_of(i);
    const int64_t r = p.cu_seqlens_q != nullptr ? (q_row0 + t) * p.o_row_stride
                                                : b * p.o_batch_stride + t * p.o_row_stride;
    return static_cast<Element*>(p.o) + r + head_of(i) * p.o_head_stride;
  }
  __device__ void write_lse(int i, float row_lse2) const {
    const int t = token_of(i);
    const int h = head_of(i);
    const int64_t at = p.cu_seqlens_q != nullptr
                           ? h * p.lse_head_stride + q_row0 + t
                           : b * p.lse_batch_stride + h * p.lse_head_stride + t;
    p.lse[at] = row_lse2 * kLn2;
  }
  // A sink joins row i's denominator without a value (total = log2(2^lse2 + 2^sink2)): returns
  // O's factor 2^(lse2 - total) and updates the LSE. A row without keys and a sink of -inf has
  // an empty denominator: factor 0 (O is 0 there), LSE -inf.
  __device__ float sink(int i, float* row_lse2) const {
    if (p.sinks == nullptr) {
      return 1.f;
    }
    const float sink2 = p.sinks[head_of(i)] * kLog2e;
    const float top = fmaxf(*row_lse2, sink2);
    if (top == -INFINITY) {
      return 0.f;
    }
    const float total = top + __log2f(exp2f(*row_lse2 - top) + exp2f(sink2 - top));
    const float f = exp2f(*row_lse2 - total);
    *row_lse2 = total;
    return f;
  }
};

// Split calls' partials in the workspace: split sp of row block `block` (over batch x heads_kv x
// row blocks), row i: the O normalized by its own sum (head_dim floats), the LSE in base 2.
struct Partials {
  float* o;
  float* lse;
  int64_t blocks;  // row blocks of the call: batch x heads_kv x row_blocks
  int head_dim;
  __device__ Partials(DecodeParams const& p, int head_dim_)
      : o(p.o_partial), lse(p.lse_partial),
        blocks(int64_t(p.batch) * p.heads_kv * p.row_blocks), head_dim(head_dim_) {}
  __device__ float* o_at(int sp, int64_t block, int i) const {
    return o + ((sp * blocks + block) * kRowsPerCta + i) * head_dim;
  }
  __device__ float* lse_at(int sp, int64_t block, int i) const {
    return lse + (sp * blocks + block) * kRowsPerCta + i;
  }
};

// A b16 8 x 8 matrix fragment (lane l: row l / 4, columns 2 (l % 4), + 1) transposed in registers.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// The CTAs per SM a decode kernel's launch bounds ask for (0: none): 4 for a keys-as-M kernel
// whose shared memory lets four share an SM (128 registers a thread then; d64, and d128 at up to 3
// stages), so that its few registers turn into warps in flight. The others keep what ptxas gives
// (a keys-as-M d256 kernel held to 128 spilled).
template <int kHeadDim, int kStages, bool kKeysAsM>
constexpr int decode_min_ctas_per_sm() {
  constexpr int kPerSm = 228 * 1024;  // shared memory per SM, 1 KiB of it reserved per CTA
  return kKeysAsM && 4 * (DecodeConfig<kHeadDim, kStages, true>::kSmemBytes + 1024) <= kPerSm
             ? 4
             : 0;
}

// kKeysAsM (FP8 caches, at most kKeysAsMRows rows; the launch chooses): the MMAs take the keys
// as M and the tile's rows as N (S^T = K Q^T, O^T = V^T P^T), so one m16n8k16 covers a warp's 16
// keys for 8 rows where the rows-as-M form spends two on 16 rows of which a GQA group fills a
// few: half the MMAs, the exponentials and O's registers.
template <class Input, int kHeadDim, int kStages, bool kKeysAsM = false, int kRowTiles = 1>
__global__ void __launch_bounds__(kThreads, (decode_min_ctas_per_sm<kHeadDim, kStages, kKeysAsM>()))
    decode_kernel(const __grid_constant__ DecodeParams p) {
  using Types = DecodeTypes<Input>;
  static_assert(!kKeysAsM || Types::kFp8Kv, "keys as M: the FP8 caches' kernel");
  static_assert(kRowTiles == 1 || (!kKeysAsM && kHeadDim <= kMaxPairedHeadDim),
                "two row blocks per CTA: the rows-as-M form, O of both in registers");
  using Kv = typename Types::Kv;
  using Cfg = DecodeConfig<kHeadDim, kStages, Types::kFp8Kv, kRowTiles>;
  using Storage = typename Cfg::SharedStorage;
  using Ops = MmaOps<typename Types::Mma>;
  using OutOps = MmaOps<typename Types::Out>;
  using Atom = typename Ops::Atom;
  using Copy = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
  constexpr int kChunks = Cfg::kChunks;
  constexpr int kKvChunks = Cfg::kKvChunks;
  constexpr int kChunkElems = 16 / int(sizeof(Kv));  // cached elements per 16-byte chunk
  constexpr int kDTiles = kHeadDim / 8;  // n8 tiles of O

  extern __shared__ __align__(128) char smem_raw[];
  Storage& s = *reinterpret_cast<Storage*>(smem_raw);

  const int split = blockIdx.x;
  // CTAs per KV head: its row blocks kRowTiles at a time (the launch pairs even counts only)
  const int cta_rows = p.row_blocks / kRowTiles;
  const int head_kv = blockIdx.y / cta_rows;
  const int row_block = (blockIdx.y % cta_rows) * kRowTiles;  // the first of the CTA's row blocks
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  DecodeMarks marks(p.timeline, p.timeline_ctas);
  marks.mark(kEvStart);
  grid_dependency_wait();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The combine kernel of a split call (launched after this one with programmatic dependent
  // launch) may start now: its CTAs take SM slots as this grid's free up and wait (its
  // griddepcontrol.wait) for this grid to complete.
  asm volatile("griddepcontrol.launch_dependents;");
#endif

  // --- the sequence and this CTA's rows and keys ------------------------------------------
  // rows: the first row block's; a CTA of two takes the next 16 rows as rows 16..31 of it (a row's
  // token, head and output follow from first_row + i).
  const TileRows<typename Types::Out> rows(p, b, head_kv, row_block);
  const int seqlen_q = rows.seqlen_q;
  const int count =
      kRowTiles == 1 ? rows.count
                     : imin(kRowTiles * kRowsPerCta, seqlen_q * p.group - rows.first_row);
  if (rows.tokens > seqlen_q && split == 0 && row_block == 0) {
    rows.template clear_past_hint<kHeadDim>(tid, kThreads);
  }
  if (count <= 0) {
    return;  // a varlen sequence shorter than the longest: every split of the block returns
  }
  const int seqlen = clamp_int(p.seqlens_k[b], 0, p.capacity);
  const int lead = p.leftpad_k != nullptr ? clamp_int(p.leftpad_k[b], 0, seqlen) : 0;
  // The sequence's mask (mask.h through decode_plan.h), built at each use from the parameters:
  // one kept in a variable across the loads compiled to another, branchier instruction stream.
  auto mask = [&] { return sequence_mask(seqlen, seqlen_q, p.window_left, p.window_right); };
  const KeyRange all = block_keys(mask(), lead, p.group, rows.first_row, count);
  // The split's blocks start from a multiple of kKeyAlign (load_paged); keys below all.lo load as
  // zeros, like keys past the split: a cache slot no row sees may hold anything (NaN), and P's
  // zero would not keep a NaN of V out of P V.
  const KeyRange mine = split_keys(aligned_keys(all), split, p.splits, kBlockN);
  auto loads = [&](int key) { return key >= all.lo && key < mine.hi; };
  const int n_blocks = (mine.size() + kBlockN - 1) / kBlockN;

  KvPages pages;
  pages.table = nullptr;
  pages.entry = p.kv_batch_idx != nullptr ? clamp_int(p.kv_batch_idx[b], 0, p.num_pages - 1) : b;
  pages.page_size = p.page_size;
  pages.page_shift = p.page_shift;
  pages.num_pages = p.num_pages;
  if (p.page_table != nullptr) {
    pages.table = p.page_table + int64_t(b) * p.page_table_stride;
  }
  const Kv* k_head = static_cast<const Kv*>(p.k) + head_kv * p.k_head_stride;
  const Kv* v_head = static_cast<const Kv*>(p.v) + head_kv * p.v_head_stride;
  // The score's scales: an FP8 call's q_descale * k_descale folds into the exponent's scale, or
  // into the softcap's argument when softcap is on (the scale precedes tanh, fwd_params.h). A
  // 16-bit call reads p's where it uses them (locals of them compiled to another schedule).
  [[maybe_unused]] float fp8_scale_log2 = 0.f;
  [[maybe_unused]] float fp8_softcap_scale = 0.f;
  if constexpr (Types::kFp8Kv) {
    const float qk =
        descale(p, kDescaleQ, b, head_kv) * descale(p, kDescaleK, b, head_kv);
    const bool capped = p.softcap > 0.f;
    fp8_scale_log2 = capped ? p.scale_log2 : p.scale_log2 * qk;
    fp8_softcap_scale = capped ? p.softcap_scale * qk : p.softcap_scale;
  }
  auto scale_log2 = [&] {
    if constexpr (Types::kFp8Kv) {
      return fp8_scale_log2;
    } else {
      return p.scale_log2;
    }
  };
  auto softcap_scale = [&] {
    if constexpr (Types::kFp8Kv) {
      return fp8_softcap_scale;
    } else {
      return p.softcap_scale;
    }
  };

  // --- loads ---------------------------------------------------------------------------------
  // An FP8 q is widened into s.q after the K / V prologue is issued (below).
  if constexpr (!Types::kFp8Q) {  // Q: rows past `count` zero-filled
    const typename Types::Q* q = static_cast<const typename Types::Q*>(p.q);
    for (int idx = tid; idx < kRowTiles * kRowsPerCta * kChunks; idx += kThreads) {
      const int i = idx / kChunks;
      const int c = idx % kChunks;
      const bool ok = i < count;
      const int t = ok ? rows.token_of(i) : 0;
      const int h = ok ? rows.head_of(i) : 0;
      const int64_t row = p.cu_seqlens_q != nullptr ? (rows.q_row0 + t) * p.q_row_stride
                                                    : b * p.q_batch_stride + t * p.q_row_stride;
      const typename Types::Q* src = ok ? q + row + h * p.q_head_stride + c * 8 : q;
      Copy::copy(*reinterpret_cast<const cute::uint128_t*>(src),
                 *reinterpret_cast<cute::uint128_t*>(&s.q[Cfg::chunk(i, c)]), ok);
    }
  }
  // Block b of the split (keys [mine.lo + b kBlockN, + kBlockN)) into stage `stage`; keys past the
  // split zero-filled (their scores are masked; zero V rows keep NaN garbage out of P V). A thread
  // copies chunks c0, c0 + kRowThreads, ... of kPasses rows kRowsPerPass keys apart. kRowThreads
  // threads share a key's row, each copying kChunks / kRowThreads chunks kRowThreads apart (a
  // warp's copy instruction reads 128 contiguous bytes of 4 rows): a thread computes its rows'
  // addresses once for all their chunks. Measured against 4 and kChunks threads per row
  // (bench/PERFLOG.md "the split merge as a kernel of its own"): 4 doubles the L2
  // requests per byte (slower at the large points), kChunks (a row per 16 lanes) spends the paged
  // call's issue slots on page walks (slower paged).
  constexpr int kRowThreads = kKvChunks < 8 ? kKvChunks : 8;
  static_assert(kKvChunks % kRowThreads == 0 && kThreads % kRowThreads == 0, "even load split");
  constexpr int kChunksPerThread = kKvChunks / kRowThreads;
  constexpr int kRowsPerPass = kThreads / kRowThreads;
  constexpr int kPasses = kBlockN / kRowsPerPass;
  static_assert(kPasses * kRowsPerPass == kBlockN, "whole passes per block");
  static_assert(kKeyAlign % kPasses == 0, "a thread's paged rows start at a multiple of kPasses");
  const int c0 = tid % kRowThreads;
  // Paged: block b's page ids are copied into s.ids[b % (2 kStages)] (cp.async, one per key) with
  // the loads of block b - (kStages - 1), so they land kStages - 1 blocks before the loads that
  // need them. Read one block ahead into registers, the table's latency stalled the loads of a CTA
  // alone on its SM (a block takes about as long as the table read there, and paged calls lost
  // bandwidth: bench/PERFLOG.md "where a short decode call's time goes"). The ring
  // holds 2 kStages blocks: a copy never overwrites ids a load of the same iteration (or of the
  // prologue) still reads.
  using IdCopy = cute::SM80_CP_ASYNC_CACHEALWAYS_ZFILL<uint32_t>;
  static_assert(kBlockN <= kThreads, "a thread copies one key's page id");
  auto copy_ids = [&](int block) {
    if (pages.table != nullptr && tid < kBlockN) {
      const int key = mine.lo + block * kBlockN + tid;
      const bool ok = key < mine.hi;
      const int32_t* src = pages.table + (ok ? pages.index_of(key) : 0);
      IdCopy::copy(*reinterpret_cast<const uint32_t*>(src),
                   *reinterpret_cast<uint32_t*>(&s.ids[block % (2 * kStages)][tid]), ok);
    }
  };
  // Ring row `row` of stage `stage` from the cached rows at ks / vs (the thread's first chunk), or
  // zero-filled where !ok (ks / vs are not read then, but must be addresses of the cache).
  auto copy_row = [&](int stage, int row, bool ok, const Kv* ks, const Kv* vs) {
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int at = Cfg::ring_chunk(row, c0 + i * kRowThreads);
      const int step = ok ? i * kRowThreads * kChunkElems : 0;
      Copy::copy(*reinterpret_cast<const cute::uint128_t*>(ks + step),
                 *reinterpret_cast<cute::uint128_t*>(&s.ring.k[stage][at]), ok);
      Copy::copy(*reinterpret_cast<const cute::uint128_t*>(vs + step),
                 *reinterpret_cast<cute::uint128_t*>(&s.ring.v[stage][at]), ok);
    }
  };
  auto issue = [&](int stage, int pass, int key, int64_t page, int64_t slot) {
    const int row = tid / kRowThreads + pass * kRowsPerPass;
    const bool ok = loads(key);
    const Kv* ks = ok ? k_head + page * p.k_page_stride + slot * p.k_row_stride + c0 * kChunkElems
                      : k_head;
    const Kv* vs = ok ? v_head + page * p.v_page_stride + slot * p.v_row_stride + c0 * kChunkElems
                      : v_head;
    copy_row(stage, row, ok, ks, vs);
  };
  // Paged: a thread's kPasses rows are consecutive keys (rows kPasses (tid / kRowThreads) + pass;
  // a warp's copy instruction still reads 128 contiguous bytes of 4 rows). The split starts at a
  // multiple of kPasses (aligned_keys), so where pages hold a multiple of kPasses keys the rows
  // share one page: its 64-bit offsets are computed once per block, and the rows step by the row
  // stride. Other page sizes take the page of each row from its slot (PageWalk: one division per
  // block, none for power-of-two pages), the offsets again where a row starts a page. Rows
  // kRowsPerPass keys apart (the dense loads' order) took a page's offsets for every row, which
  // made paged calls issue-bound where dense ones were not (bench/PERFLOG.md "FP8 decode with
  // keys as the MMA's M").
  auto load_paged = [&](int block, int stage) {
    const int* ids = s.ids[block % (2 * kStages)];
    const int row0 = (tid / kRowThreads) * kPasses;
    const int key0 = mine.lo + block * kBlockN + row0;
    const Kv* ks;
    const Kv* vs;
    auto locate = [&](int row, int slot) {
      const int64_t page = pages.clamp_page(ids[row]);
      ks = k_head + page * p.k_page_stride + slot * p.k_row_stride + c0 * kChunkElems;
      vs = v_head + page * p.v_page_stride + slot * p.v_row_stride + c0 * kChunkElems;
    };
    auto issue_rows = [&](auto&& before_row) {
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        before_row(pass);
        // Every row's address lies in the pool, past the split too (its page ids are zero-filled:
        // page 0, and a slot of it), so rows past the split need no other address.
        copy_row(stage, row0 + pass, loads(key0 + pass), ks, vs);
        ks += p.k_row_stride;
        vs += p.v_row_stride;
      }
    };
    if (pages.page_size % kPasses == 0) {  // the thread's rows in one page
      locate(row0, pages.slot_of(key0));
      issue_rows([](int) {});
    } else {
      PageWalk w = PageWalk::start(pages, key0, 1);
      issue_rows([&](int pass) {
        if (pass == 0 || w.slot == 0) {  // the first row, or the first of the next page
          locate(row0 + pass, w.slot);
        }
        w.next();
      });
    }
  };
  auto load_block = [&](int block, int stage) {
    const int first_key = mine.lo + block * kBlockN + tid / kRowThreads;
    if (pages.table != nullptr) {
      load_paged(block, stage);
    } else if constexpr (Types::kFp8Kv) {
      // Dense FP8: the thread's rows are kRowsPerPass keys apart in one entry, so one address per
      // block, stepped by a constant per pass, instead of issue()'s 64-bit products per row (the
      // FP8 kernel's loop is bound by its instruction issue, not by its loads).
      const int64_t k0 = pages.entry * p.k_page_stride + int64_t(first_key) * p.k_row_stride;
      const int64_t v0 = pages.entry * p.v_page_stride + int64_t(first_key) * p.v_row_stride;
      const Kv* ks = k_head + k0 + c0 * kChunkElems;
      const Kv* vs = v_head + v0 + c0 * kChunkElems;
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const bool ok = loads(first_key + pass * kRowsPerPass);
        copy_row(stage, tid / kRowThreads + pass * kRowsPerPass, ok, ok ? ks : k_head,
                 ok ? vs : v_head);
        ks += kRowsPerPass * p.k_row_stride;
        vs += kRowsPerPass * p.v_row_stride;
      }
    } else {
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int key = first_key + pass * kRowsPerPass;
        issue(stage, pass, key, pages.entry, key);
      }
    }
  };

  if (pages.table != nullptr) {  // the prologue's page ids, waited for once
    for (int b = 0; b < kStages - 1 && b < n_blocks; ++b) {
      copy_ids(b);
    }
    cute::cp_async_fence();
    cute::cp_async_wait<0>();
    __syncthreads();
  }
#pragma unroll
  for (int stage = 0; stage < kStages - 1; ++stage) {
    if (stage < n_blocks) {
      load_block(stage, stage);
      if (stage + kStages - 1 < n_blocks) {
        copy_ids(stage + kStages - 1);  // in this stage's group: waited for with it
      }
    }
    cute::cp_async_fence();  // one group per stage, empty or not: the waits count groups
  }
  if constexpr (Types::kFp8Q) {  // Q widened in registers, under the prologue's loads
    const typename Types::Q* q = static_cast<const typename Types::Q*>(p.q);
    for (int idx = tid; idx < kRowTiles * kRowsPerCta * kChunks; idx += kThreads) {
      const int i = idx / kChunks;
      const int c = idx % kChunks;  // 8 FP8 values -> one 16-byte chunk of s.q
      uint2 x = make_uint2(0u, 0u);
      if (i < count) {
        const int t = rows.token_of(i);
        const int64_t row = p.cu_seqlens_q != nullptr ? (rows.q_row0 + t) * p.q_row_stride
                                                      : b * p.q_batch_stride + t * p.q_row_stride;
        x = *reinterpret_cast<const uint2*>(q + row + rows.head_of(i) * p.q_head_stride + c * 8);
      }
      s.q[Cfg::chunk(i, c)] = widen8<typename Types::Mma, typename Types::Q>(x);
    }
  }

  // --- this warp's online softmax over its keys of every block -----------------------------
  // A lane holds rows lane / 4 and lane / 4 + 8 of the m16n8 fragments, of each row block u of
  // the CTA (rows 16 u + ...).
  KeyRange row_range[kRowTiles][2];
  float m[kRowTiles][2];
  float l[kRowTiles][2];
#pragma unroll
  for (int u = 0; u < kRowTiles; ++u) {
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
      const int i = kRowsPerCta * u + lane / 4 + 8 * ri;
      row_range[u][ri] = i < count ? mask().keys(rows.token_of(i), lead) : KeyRange{0, 0};
      row_range[u][ri].hi = imin(row_range[u][ri].hi, mine.hi);
      m[u][ri] = -INFINITY;
      l[u][ri] = 0.f;
    }
  }
  // FP8: the keys every valid row of the tile attends, [open_lo, open_hi) (warp-uniform): a warp
  // whose keys of a block lie inside skips the mask's compares. Rows past `count` are never
  // written, so their scores need no mask; keys past the split are outside (zero-filled).
  [[maybe_unused]] int open_lo = mine.lo;
  [[maybe_unused]] int open_hi = mine.hi;
  if constexpr (Types::kFp8Kv) {
#pragma unroll
    for (int u = 0; u < kRowTiles; ++u) {
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        if (kRowsPerCta * u + lane / 4 + 8 * ri < count) {
          open_lo = imax(open_lo, row_range[u][ri].lo);
          open_hi = imin(open_hi, row_range[u][ri].hi);
        }
      }
    }
#pragma unroll
    for (int off = 4; off < 32; off *= 2) {  // lanes of a quad hold the same rows
      open_lo = imax(open_lo, __shfl_xor_sync(0xffffffffu, open_lo, off));
      open_hi = imin(open_hi, __shfl_xor_sync(0xffffffffu, open_hi, off));
    }
  }
  float o[kRowTiles][kDTiles][4];
#pragma unroll
  for (int u = 0; u < kRowTiles; ++u) {
#pragma unroll
    for (int t = 0; t < kDTiles; ++t) {
      o[u][t][0] = o[u][t][1] = o[u][t][2] = o[u][t][3] = 0.f;
    }
  }
  // Keys as M: lane (g, t) = (lane / 4, lane % 4) holds rows 2t and 2t + 1 (the columns of S^T
  // and O^T), their ranges in qrange and their statistics in m / l; O^T's 16-d chunk c in ot[c].
  [[maybe_unused]] KeyRange qrange[2];
  [[maybe_unused]] float ot[kKeysAsM ? kKvChunks : 1][4];
  if constexpr (kKeysAsM) {
#pragma unroll
    for (int jr = 0; jr < 2; ++jr) {
      const int i = 2 * (lane % 4) + jr;
      qrange[jr] = i < count ? mask().keys(rows.token_of(i), lead) : KeyRange{0, 0};
      qrange[jr].hi = imin(qrange[jr].hi, mine.hi);
    }
#pragma unroll
    for (int c = 0; c < kKvChunks; ++c) {
      ot[c][0] = ot[c][1] = ot[c][2] = ot[c][3] = 0.f;
    }
  }

  // FP8 caches: Q's A fragments in the k slot order of the widened K fragments (S = Q K^T
  // below): slots {2t, 2t + 1} and {2t + 8, 2t + 9} of 16-d chunk c are Q's 4 elements
  // 16 c + 4t .. 16 c + 4t + 3, one 8-byte load per row. Held in registers for the whole loop
  // where they fit beside O (d <= 128), read per block otherwise.
  constexpr bool kHoldQ = Types::kFp8Kv && !kKeysAsM && kHeadDim <= 128 && kRowTiles == 1;
  auto load_q_fragment = [&](int u, int c, uint32_t(&a)[4]) {  // row block u of the CTA
    const int g = kRowsPerCta * u + lane / 4;
    const int off = 8 * (lane % 2);  // bytes into the 16-bit chunk 2c + t / 2
    const uint2 top = *reinterpret_cast<const uint2*>(
        reinterpret_cast<const char*>(&s.q[Cfg::chunk(g, 2 * c + (lane % 4) / 2)]) + off);
    const uint2 bottom = *reinterpret_cast<const uint2*>(
        reinterpret_cast<const char*>(&s.q[Cfg::chunk(g + 8, 2 * c + (lane % 4) / 2)]) + off);
    a[0] = top.x;
    a[1] = bottom.x;
    a[2] = top.y;
    a[3] = bottom.y;
  };
  [[maybe_unused]] uint32_t q_held[kHoldQ ? kKvChunks : 1][4];
  if constexpr (kHoldQ) {
    cute::cp_async_wait<kStages - 2>();  // 16-bit q: its copies are in the first group
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kKvChunks; ++c) {
      load_q_fragment(0, c, q_held[c]);
    }
  }
  // Keys as M: Q^T's B fragments of chunk c (k slots {2t, 2t + 1} and {2t + 8, 2t + 9} are Q's
  // elements 16 c + 4t .. 16 c + 4t + 3 of row g, the K fragments' order), held for the loop.
  [[maybe_unused]] uint32_t qt[kKeysAsM ? kKvChunks : 1][2];
  if constexpr (kKeysAsM) {
    cute::cp_async_wait<kStages - 2>();  // 16-bit q: its copies are in the first group
    __syncthreads();
#pragma unroll
    for (int c = 0; c < kKvChunks; ++c) {
      const uint2 x = *reinterpret_cast<const uint2*>(
          reinterpret_cast<const char*>(&s.q[Cfg::chunk(lane / 4, 2 * c + (lane % 4) / 2)]) +
          8 * (lane % 2));
      qt[c][0] = x.x;
      qt[c][1] = x.y;
    }
  }
  // FP8 rings, both forms: one ldmatrix.x4 of stage `stage` at this warp's 16 keys (krow: the
  // lane's row address) and chunks c, c + 1; r[2h] holds keys 0-7 of chunk c + h, r[2h + 1] keys
  // 8-15. K as stored, V transposed (ldmatrix.trans).
  [[maybe_unused]] auto load_k_chunks = [&](int stage, int krow, int c, uint32_t(&r)[4]) {
    cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(
                                      &s.ring.k[stage][Cfg::ring_chunk(krow, c + lane / 16)]),
                                  r[0], r[1], r[2], r[3]);
  };
  [[maybe_unused]] auto load_v_chunks = [&](int stage, int krow, int c, uint32_t(&r)[4]) {
    cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(
                                      &s.ring.v[stage][Cfg::ring_chunk(krow, c + lane / 16)]),
                                  r[0], r[1], r[2], r[3]);
  };
  // Keys as M, one block: this warp's 16 keys against the tile's 8 rows.
  [[maybe_unused]] auto keys_as_m_block = [&](int stage, int key0) {
    if constexpr (kKeysAsM) {  // instantiated for the FP8 kernels only
      using Mma = typename Types::Mma;
      const int krow = warp * kKeysPerWarp + (lane / 8) % 2 * 8 + lane % 8;
      // S^T = K Q^T (16 keys x 8 rows), the even and odd chunks in two chains. ldmatrix gives lane
      // (g, t) key g's FP8 elements 4t..4t+3 of a chunk (r[2h]; key g + 8's in r[2h + 1]), which
      // widen into the A fragment's k slots {2t, 2t + 1} and {2t + 8, 2t + 9}.
      float st[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int c = 0; c < kKvChunks; c += 2) {
        uint32_t r[4];
        load_k_chunks(stage, krow, c, r);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t a[4];  // {key g, key g + 8} x {slots 2t.., slots 2t + 8..}
          widen4<Mma, Kv>(r[2 * h], a[0], a[2]);
          widen4<Mma, Kv>(r[2 * h + 1], a[1], a[3]);
          float(&acc)[4] = st[h];
          Atom::fma(acc[0], acc[1], acc[2], acc[3], a[0], a[1], a[2], a[3], qt[c + h][0],
                    qt[c + h][1], acc[0], acc[1], acc[2], acc[3]);
        }
      }
      // sc[e]: key key0 + g + 8 (e / 2) of row 2t + e % 2
      float sc[4];
      const bool open = key0 >= open_lo && key0 + kKeysPerWarp <= open_hi;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = st[0][e] + st[1][e];
        if (p.softcap > 0.f) {
          x = p.softcap * fast_tanh(x * softcap_scale());
        }
        const int key = key0 + lane / 4 + 8 * (e >> 1);
        const KeyRange& r = qrange[e & 1];
        sc[e] = open || (key >= r.lo && key < r.hi) ? x * scale_log2() : -INFINITY;
      }
      // online softmax per row: its 16 scores in the 8 lanes of one t
      float alphas[2];
#pragma unroll
      for (int jr = 0; jr < 2; ++jr) {
        float mx = fmaxf(sc[jr], sc[2 + jr]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m[0][jr], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        alphas[jr] = m_new == m[0][jr] ? 1.f : exp2f(m[0][jr] - m_use);
        m[0][jr] = m_new;
        sc[jr] = exp2f(sc[jr] - m_use);
        sc[2 + jr] = exp2f(sc[2 + jr] - m_use);
        l[0][jr] = l[0][jr] * alphas[jr] + (sc[jr] + sc[2 + jr]);
      }
      if (__any_sync(0xffffffffu, alphas[0] != 1.f || alphas[1] != 1.f)) {
#pragma unroll
        for (int c = 0; c < kKvChunks; ++c) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            ot[c][e] *= alphas[e & 1];
          }
        }
      }
      // P^T's B fragment: S^T's accumulators (key g; rows 2t, 2t + 1) transposed into (row g;
      // keys 2t, 2t + 1), for keys 0-7 and 8-15
      const uint32_t pb0 = transpose8x8(Ops::pack(sc[0], sc[1]));
      const uint32_t pb1 = transpose8x8(Ops::pack(sc[2], sc[3]));
      // O^T += V^T P^T. ldmatrix.trans of chunk c + h gives lane (g, t) the byte pairs 2g, 2g + 1
      // of keys 2t and 2t + 1; the byte permute makes the halves (d 2g; keys 2t, 2t + 1) and
      // (d 2g + 1; same keys): A's rows g and g + 8 are the chunk's d 2g and 2g + 1.
#pragma unroll
      for (int c = 0; c < kKvChunks; c += 2) {
        uint32_t r[4];
        load_v_chunks(stage, krow, c, r);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t a[4];  // {d 2g, d 2g + 1} x {keys 2t.., keys 2t + 8..}
          widen4<Mma, Kv>(__byte_perm(r[2 * h], 0u, 0x3120), a[0], a[1]);
          widen4<Mma, Kv>(__byte_perm(r[2 * h + 1], 0u, 0x3120), a[2], a[3]);
          float(&acc)[4] = ot[c + h];
          Atom::fma(acc[0], acc[1], acc[2], acc[3], a[0], a[1], a[2], a[3], pb0, pb1, acc[0],
                    acc[1], acc[2], acc[3]);
        }
      }
    }
  };
  [[maybe_unused]] auto q_fragment = [&](int u, int c, uint32_t(&a)[4]) {
    if constexpr (kHoldQ) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = q_held[c][i];
      }
    } else {
      load_q_fragment(u, c, a);
    }
  };

  for (int j = 0; j < n_blocks; ++j) {
    cute::cp_async_wait<kStages - 2>();
    __syncthreads();  // block j landed for every thread; block j - 1's stage is free
    if (j == 0) {
      marks.mark(kEvFirstBlock);
    }
    {
      const int next = j + kStages - 1;
      if (next < n_blocks) {
        load_block(next, next % kStages);
        if (next + kStages - 1 < n_blocks) {
          copy_ids(next + kStages - 1);  // used kStages - 1 iterations later
        }
      }
      cute::cp_async_fence();
    }
    const int stage = j % kStages;
    const int key0 = mine.lo + j * kBlockN + warp * kKeysPerWarp;
    if (key0 >= mine.hi) {
      continue;  // this warp's keys are past the split
    }
    if constexpr (kKeysAsM) {
      keys_as_m_block(stage, key0);
      continue;
    }
    // S = Q K^T: 16 rows x this warp's 16 keys (two n8 tiles), for each row block u of the CTA
    // from the same K fragments. An ldmatrix phase gives lane (g, t) = (lane / 4, lane % 4) row
    // g's 4 bytes 4t..4t+3 of a 16-byte chunk: 16-bit elements 2t, 2t + 1 of a 16-bit row (the B
    // fragment as it is), FP8 elements 4t..4t+3 of an FP8 row, widened in registers into the B
    // fragments of k slots {2t, 2t + 1} and {2t + 8, 2t + 9}. The FP8 path thus sums over d in
    // that order, and Q's A fragments (load_q_fragment) follow it.
    float sc[kRowTiles][2][4] = {};
    const int krow = warp * kKeysPerWarp + (lane / 8) % 2 * 8 + lane % 8;
    if constexpr (Types::kFp8Kv) {
      // Four MMA chains per row block: the even chunks' into sc, the odd chunks' into sc_odd,
      // added after.
      float sc_odd[kRowTiles][2][4] = {};
#pragma unroll
      for (int c = 0; c < kKvChunks; c += 2) {  // two 16-key x 16-d chunks per ldmatrix
        uint32_t r[4];
        load_k_chunks(stage, krow, c, r);
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // chunk c + h: r[2 h] keys 0-7, r[2 h + 1] keys 8-15
          uint32_t a[kRowTiles][4];
#pragma unroll
          for (int u = 0; u < kRowTiles; ++u) {
            q_fragment(u, c + h, a[u]);
          }
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            uint32_t b0;  // widened once for every row block
            uint32_t b1;
            widen4<typename Types::Mma, Kv>(r[2 * h + n], b0, b1);
#pragma unroll
            for (int u = 0; u < kRowTiles; ++u) {
              float(&acc)[4] = h == 0 ? sc[u][n] : sc_odd[u][n];
              Atom::fma(acc[0], acc[1], acc[2], acc[3], a[u][0], a[u][1], a[u][2], a[u][3], b0,
                        b1, acc[0], acc[1], acc[2], acc[3]);
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kRowTiles; ++u) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            sc[u][n][e] += sc_odd[u][n][e];
          }
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t a[kRowTiles][4];
#pragma unroll
        for (int u = 0; u < kRowTiles; ++u) {
          cute::SM75_U32x4_LDSM_N::copy(
              *reinterpret_cast<const cute::uint128_t*>(
                  &s.q[Cfg::chunk(kRowsPerCta * u + lane % 16, 2 * kk + lane / 16)]),
              a[u][0], a[u][1], a[u][2], a[u][3]);
        }
        uint32_t bk[4];
        const int row16 = warp * kKeysPerWarp + (lane / 16) * 8 + lane % 8;
        const uint4* kt = &s.ring.k[stage][Cfg::chunk(row16, 2 * kk + (lane / 8) % 2)];
        cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(kt), bk[0],
                                      bk[1], bk[2], bk[3]);
#pragma unroll
        for (int u = 0; u < kRowTiles; ++u) {
          float(&acc)[2][4] = sc[u];
          Atom::fma(acc[0][0], acc[0][1], acc[0][2], acc[0][3], a[u][0], a[u][1], a[u][2],
                    a[u][3], bk[0], bk[1], acc[0][0], acc[0][1], acc[0][2], acc[0][3]);
          Atom::fma(acc[1][0], acc[1][1], acc[1][2], acc[1][3], a[u][0], a[u][1], a[u][2],
                    a[u][3], bk[2], bk[3], acc[1][0], acc[1][1], acc[1][2], acc[1][3]);
        }
      }
    }
    // score transform and mask, in base 2
    auto transform = [&](auto masked) {
#pragma unroll
      for (int u = 0; u < kRowTiles; ++u) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key0 + 8 * n + (lane % 4) * 2 + (e & 1);
            const KeyRange& r = row_range[u][e >> 1];
            float x = sc[u][n][e];
            if (p.softcap > 0.f) {
              x = p.softcap * fast_tanh(x * softcap_scale());
            }
            if constexpr (decltype(masked)::value) {
              sc[u][n][e] = (key >= r.lo && key < r.hi) ? x * scale_log2() : -INFINITY;
            } else {
              sc[u][n][e] = x * scale_log2();
            }
          }
        }
      }
    };
    if constexpr (Types::kFp8Kv) {
      if (key0 >= open_lo && key0 + kKeysPerWarp <= open_hi) {
        transform(std::false_type{});
      } else {
        transform(std::true_type{});
      }
    } else {
      transform(std::true_type{});
    }
    // online softmax per row (a row's 16 scores live in the 4 lanes of a quad)
    [[maybe_unused]] float alphas[kRowTiles][2];
#pragma unroll
    for (int u = 0; u < kRowTiles; ++u) {
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        float mx = fmaxf(fmaxf(sc[u][0][2 * ri], sc[u][0][2 * ri + 1]),
                         fmaxf(sc[u][1][2 * ri], sc[u][1][2 * ri + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float m_new = fmaxf(m[u][ri], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // a row without keys so far
        float alpha;
        if constexpr (Types::kFp8Kv) {  // 1 where the maximum did not move (no keys yet included)
          alpha = m_new == m[u][ri] ? 1.f : exp2f(m[u][ri] - m_use);
        } else {
          alpha = exp2f(m[u][ri] - m_use);
        }
        m[u][ri] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          sc[u][n][2 * ri] = exp2f(sc[u][n][2 * ri] - m_use);
          sc[u][n][2 * ri + 1] = exp2f(sc[u][n][2 * ri + 1] - m_use);
          sum += sc[u][n][2 * ri] + sc[u][n][2 * ri + 1];
        }
        l[u][ri] = l[u][ri] * alpha + sum;
        if constexpr (Types::kFp8Kv) {
          alphas[u][ri] = alpha;
        } else {
#pragma unroll
          for (int t = 0; t < kDTiles; ++t) {
            o[u][t][2 * ri] *= alpha;
            o[u][t][2 * ri + 1] *= alpha;
          }
        }
      }
    }
    // FP8: O is rescaled only in blocks where some row's alpha is not 1 (skipping a factor of
    // exactly 1 changes no bit): where no row's maximum moved, rows without keys included.
    if constexpr (Types::kFp8Kv) {
      bool moved = false;
#pragma unroll
      for (int u = 0; u < kRowTiles; ++u) {
        moved = moved || alphas[u][0] != 1.f || alphas[u][1] != 1.f;
      }
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int u = 0; u < kRowTiles; ++u) {
#pragma unroll
          for (int t = 0; t < kDTiles; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              o[u][t][e] *= alphas[u][e >> 1];
            }
          }
        }
      }
    }
    // O += P V: the S accumulators are the A fragment of one k16 step
    uint32_t pa[kRowTiles][4];
#pragma unroll
    for (int u = 0; u < kRowTiles; ++u) {
      pa[u][0] = Ops::pack(sc[u][0][0], sc[u][0][1]);
      pa[u][1] = Ops::pack(sc[u][0][2], sc[u][0][3]);
      pa[u][2] = Ops::pack(sc[u][1][0], sc[u][1][1]);
      pa[u][3] = Ops::pack(sc[u][1][2], sc[u][1][3]);
    }
    if constexpr (Types::kFp8Kv) {
      // ldmatrix.trans of an FP8 chunk (8 keys x 16 bytes) gives lane (g, t) the byte pairs
      // 2g, 2g + 1 of keys 2t and 2t + 1; one byte permute regroups them by column, and each
      // half widens into the B fragment (keys 2t, 2t + 1) of column 2g or 2g + 1. So chunk c
      // feeds two n8 tiles: o[u][2c] holds the chunk's even columns, o[u][2c + 1] its odd ones
      // (the merge's store puts them back in order).
#pragma unroll
      for (int c = 0; c < kKvChunks; c += 2) {
        uint32_t r[4];
        load_v_chunks(stage, krow, c, r);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t lo_even;  // keys 0-7 of the even column, then of the odd one
          uint32_t lo_odd;
          uint32_t hi_even;  // keys 8-15
          uint32_t hi_odd;
          widen4<typename Types::Mma, Kv>(__byte_perm(r[2 * h], 0u, 0x3120), lo_even, lo_odd);
          widen4<typename Types::Mma, Kv>(__byte_perm(r[2 * h + 1], 0u, 0x3120), hi_even, hi_odd);
          const int t = 2 * (c + h);
#pragma unroll
          for (int u = 0; u < kRowTiles; ++u) {
            float(&oe)[4] = o[u][t];
            float(&oo)[4] = o[u][t + 1];
            Atom::fma(oe[0], oe[1], oe[2], oe[3], pa[u][0], pa[u][1], pa[u][2], pa[u][3],
                      lo_even, hi_even, oe[0], oe[1], oe[2], oe[3]);
            Atom::fma(oo[0], oo[1], oo[2], oo[3], pa[u][0], pa[u][1], pa[u][2], pa[u][3],
                      lo_odd, hi_odd, oo[0], oo[1], oo[2], oo[3]);
          }
        }
      }
    } else {
      const int vrow = warp * kKeysPerWarp + lane % 8 + ((lane / 8) % 2) * 8;
#pragma unroll
      for (int t = 0; t < kDTiles; t += 2) {
        uint32_t bv[4];
        const uint4* vt = &s.ring.v[stage][Cfg::chunk(vrow, t + lane / 16)];
        cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(vt), bv[0],
                                      bv[1], bv[2], bv[3]);
#pragma unroll
        for (int u = 0; u < kRowTiles; ++u) {
          float(&oe)[4] = o[u][t];
          float(&oo)[4] = o[u][t + 1];
          Atom::fma(oe[0], oe[1], oe[2], oe[3], pa[u][0], pa[u][1], pa[u][2], pa[u][3], bv[0],
                    bv[1], oe[0], oe[1], oe[2], oe[3]);
          Atom::fma(oo[0], oo[1], oo[2], oo[3], pa[u][0], pa[u][1], pa[u][2], pa[u][3], bv[2],
                    bv[3], oo[0], oo[1], oo[2], oo[3]);
        }
      }
    }
  }

  // --- merge the warps, one row block of the CTA at a time ----------------------------------
  marks.mark(kEvLoopDone);
  cute::cp_async_wait<0>();
#pragma unroll
  for (int u = 0; u < kRowTiles; ++u) {
    // the ring is free (s.o aliases it); then the previous row block's merge read s.o
    __syncthreads();
    if constexpr (kKeysAsM) {  // rows 2t, 2t + 1 summed over the 8 lanes of t; rows 8-15 empty
#pragma unroll
      for (int jr = 0; jr < 2; ++jr) {
        l[0][jr] += __shfl_xor_sync(0xffffffff, l[0][jr], 4);
        l[0][jr] += __shfl_xor_sync(0xffffffff, l[0][jr], 8);
        l[0][jr] += __shfl_xor_sync(0xffffffff, l[0][jr], 16);
        if (lane < 4) {
          s.m[warp][2 * lane + jr] = m[0][jr];
          s.l[warp][2 * lane + jr] = l[0][jr];
        }
      }
      if (lane < kRowsPerCta - 8) {
        s.m[warp][8 + lane] = -INFINITY;
        s.l[warp][8 + lane] = 0.f;
      }
    } else {
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        l[u][ri] += __shfl_xor_sync(0xffffffff, l[u][ri], 1);
        l[u][ri] += __shfl_xor_sync(0xffffffff, l[u][ri], 2);
        if (lane % 4 == 0) {
          s.m[warp][lane / 4 + 8 * ri] = m[u][ri];
          s.l[warp][lane / 4 + 8 * ri] = l[u][ri];
        }
      }
    }
    if constexpr (kKeysAsM) {  // ot[c]: (d 16 c + 2g, 2g + 1) x (rows 2t, 2t + 1)
#pragma unroll
      for (int c = 0; c < kKvChunks; ++c) {
#pragma unroll
        for (int jr = 0; jr < 2; ++jr) {
          *reinterpret_cast<float2*>(&s.o[warp][2 * (lane % 4) + jr][16 * c + 2 * (lane / 4)]) =
              make_float2(ot[c][jr], ot[c][2 + jr]);
        }
      }
    } else if constexpr (Types::kFp8Kv) {  // o[u][2c] / o[u][2c + 1]: chunk c's even / odd columns
#pragma unroll
      for (int c = 0; c < kKvChunks; ++c) {
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          *reinterpret_cast<float4*>(&s.o[warp][lane / 4 + 8 * ri][16 * c + (lane % 4) * 4]) =
              make_float4(o[u][2 * c][2 * ri], o[u][2 * c + 1][2 * ri], o[u][2 * c][2 * ri + 1],
                          o[u][2 * c + 1][2 * ri + 1]);
        }
      }
    } else {
#pragma unroll
      for (int t = 0; t < kDTiles; ++t) {
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          *reinterpret_cast<float2*>(&s.o[warp][lane / 4 + 8 * ri][8 * t + (lane % 4) * 2]) =
              make_float2(o[u][t][2 * ri], o[u][t][2 * ri + 1]);
        }
      }
    }
    __syncthreads();

    constexpr int kCols = Cfg::kCols;
    const int row = tid / Cfg::kThreadsPerRow;  // of row block u
    const int col0 = (tid % Cfg::kThreadsPerRow) * kCols;
    float acc[kCols];
    float lse2;  // base 2, in the exponent's units
    {
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        mx = fmaxf(mx, s.m[w][row]);
      }
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        acc[c] = 0.f;
      }
      if (mx != -INFINITY) {
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          const float f = exp2f(s.m[w][row] - mx);
          sum += f * s.l[w][row];
#pragma unroll
          for (int c = 0; c < kCols; c += 4) {
            const float4 x = *reinterpret_cast<const float4*>(&s.o[w][row][col0 + c]);
            acc[c] += f * x.x;
            acc[c + 1] += f * x.y;
            acc[c + 2] += f * x.z;
            acc[c + 3] += f * x.w;
          }
        }
      }
      float inv = sum > 0.f ? 1.f / sum : 0.f;
      if constexpr (Types::kFp8Kv) {  // O of the FP8 V's values: v_descale, splits' partials too
        inv *= descale(p, kDescaleV, b, head_kv);
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        acc[c] *= inv;
      }
      lse2 = sum > 0.f ? mx + __log2f(sum) : -INFINITY;
    }
    const int i = kRowsPerCta * u + row;  // the row in the CTA's rows (rows' numbering)
    if (i >= count) {
      continue;
    }
    if (p.splits == 1) {
      const float f = rows.sink(i, &lse2);
      typename Types::Out* dst = rows.out_row(i) + col0;
#pragma unroll
      for (int c = 0; c < kCols; c += 8) {
        uint4 packed;
        packed.x = OutOps::pack(acc[c] * f, acc[c + 1] * f);
        packed.y = OutOps::pack(acc[c + 2] * f, acc[c + 3] * f);
        packed.z = OutOps::pack(acc[c + 4] * f, acc[c + 5] * f);
        packed.w = OutOps::pack(acc[c + 6] * f, acc[c + 7] * f);
        *reinterpret_cast<uint4*>(dst + c) = packed;
      }
      if (p.lse != nullptr && col0 == 0) {
        rows.write_lse(i, lse2);
      }
    } else {  // split-KV: this split's rows to the workspace; combine_kernel merges them
      const int64_t block_id =
          (int64_t(b) * p.heads_kv + head_kv) * p.row_blocks + row_block + u;
      const Partials partials(p, kHeadDim);
      float* dst = partials.o_at(split, block_id, row) + col0;
#pragma unroll
      for (int c = 0; c < kCols; c += 4) {
        *reinterpret_cast<float4*>(dst + c) =
            make_float4(acc[c], acc[c + 1], acc[c + 2], acc[c + 3]);
      }
      if (col0 == 0) {
        *partials.lse_at(split, block_id, row) = lse2;
      }
    }
  }
  if (p.splits > 1) {
    marks.mark(kEvPublished);
  }
  marks.end(kEvEnd);
}

// The rows of a row block one combine CTA merges in one pass: a thread per 4 columns of a row.
template <int kHeadDim>
constexpr int combine_rows_per_cta() {
  static_assert(kThreads % (kHeadDim / 4) == 0, "a combine CTA holds whole rows");
  return combine_rows_per_pass(kHeadDim);
}

// The merge of a split call's partials: CTA (x, y) of a grid (row blocks, groups) merges row block
// x's rows y R .. y R + R - 1, then those gridDim.y R further on (R = combine_rows_per_cta;
// decode_plan.h's combine_row_groups sizes the grid), launched right behind decode_kernel with
// programmatic dependent launch (decode.cu), so that its CTAs are resident when the last split
// finishes. A kernel boundary, not a merge inside the decode kernel: there the splits' fences, the
// atomic counter and the last split's merge under the others' loads made the call slower
// (bench/PERFLOG.md "the split merge as a kernel of its own"). A thread owns 4 columns of a row
// and folds the splits in chunks of kChunkSplits, each chunk's LSEs and partial columns loaded at
// once (one L2 round trip per chunk), under a running maximum: a CTA's round trips are those of
// its rows' passes, so the row groups spread a few row blocks' passes over more SMs.
template <class Element, int kHeadDim>
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const __grid_constant__ DecodeParams p) {
  using Ops = MmaOps<Element>;
  constexpr int kVec = kHeadDim / 4;
  constexpr int kChunkSplits = 16;
  grid_dependency_wait();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  const int64_t block_id = blockIdx.x;
  const int row_block = static_cast<int>(block_id % p.row_blocks);
  const int head_kv = static_cast<int>((block_id / p.row_blocks) % p.heads_kv);
  const int b = static_cast<int>(block_id / (int64_t(p.row_blocks) * p.heads_kv));
  const TileRows<Element> rows(p, b, head_kv, row_block);
  const Partials partials(p, kHeadDim);
  constexpr int kRowsPer = combine_rows_per_cta<kHeadDim>();
  const int c = (static_cast<int>(threadIdx.x) % kVec) * 4;
  for (int i = static_cast<int>(blockIdx.y) * kRowsPer + static_cast<int>(threadIdx.x) / kVec;
       i < rows.count; i += static_cast<int>(gridDim.y) * kRowsPer) {
    float mx = -INFINITY;
    float sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int sp0 = 0; sp0 < p.splits; sp0 += kChunkSplits) {
      float l[kChunkSplits];
      float4 x[kChunkSplits];
#pragma unroll
      for (int j = 0; j < kChunkSplits; ++j) {
        const bool ok = sp0 + j < p.splits;
        l[j] = ok ? __ldcg(partials.lse_at(sp0 + j, block_id, i)) : -INFINITY;
        x[j] = ok ? __ldcg(reinterpret_cast<const float4*>(partials.o_at(sp0 + j, block_id, i) + c))
                  : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float top = mx;
#pragma unroll
      for (int j = 0; j < kChunkSplits; ++j) {
        top = fmaxf(top, l[j]);
      }
      if (top == -INFINITY) {
        continue;  // no keys in these splits (nor before)
      }
      const float f = exp2f(mx - top);  // 0 while mx is -inf
      sum *= f;
      acc.x *= f;
      acc.y *= f;
      acc.z *= f;
      acc.w *= f;
#pragma unroll
      for (int j = 0; j < kChunkSplits; ++j) {
        const float w = exp2f(l[j] - top);
        sum += w;
        acc.x += w * x[j].x;
        acc.y += w * x[j].y;
        acc.z += w * x[j].z;
        acc.w += w * x[j].w;
      }
      mx = top;
    }
    float lse2 = sum > 0.f ? mx + __log2f(sum) : -INFINITY;
    const float with_sink = rows.sink(i, &lse2);  // a row without keys: lse = the sink
    const float scale = sum > 0.f ? with_sink / sum : 0.f;
    uint2 packed;
    packed.x = Ops::pack(acc.x * scale, acc.y * scale);
    packed.y = Ops::pack(acc.z * scale, acc.w * scale);
    *reinterpret_cast<uint2*>(rows.out_row(i) + c) = packed;
    if (c == 0 && p.lse != nullptr) {
      rows.write_lse(i, lse2);
    }
  }
}

}  // namespace decode
}  // namespace flash_hopper
