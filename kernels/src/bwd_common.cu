// The backward's preprocess (contract in bwd_common.h), shared by both paths.
//
// Both are memory-bound streams over (batch, head_q, query row): plain CUDA, 16-byte vector
// accesses, one CTA per block of kRowsPerCta query rows of one (batch, head_q) on grid (x, y, z) =
// (row block, head_q, batch), like the forward kernels (validate.h: heads_q and batch <= 65535).
// What makes 16-byte vectors legal everywhere: validate_bwd.cu checks that head_dim and every
// row / head / batch stride of o, dout and dq are multiples of 8 elements, pointers 16-byte
// aligned;
// the workspace is 256-byte aligned with 256-byte aligned regions, and head_dim_rounded (a bucket)
// is a multiple of 32 floats.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "flash_hopper/api.h"
#include "flash_hopper/bwd_params.h"
#include "flash_hopper/score_math.h"  // kLog2e
#include "src/bwd_common.h"

namespace flash_hopper {
namespace {

// 128 rows: one kBwdRowPad block, so the preprocess grid tiles seqlen_q_rounded exactly and each
// CTA owns whole semaphores (kBwdSemaphoreRows divides it).
constexpr int kRowsPerCta = kBwdRowPad;
constexpr int kThreads = 256;
// Preprocess: a row's dot product is split over kThreadsPerRow threads, each taking 16-byte
// chunks kThreadsPerRow apart, so 8 threads read 128 contiguous bytes of a row per step.
constexpr int kThreadsPerRow = 8;
constexpr int kRowsPerPass = kThreads / kThreadsPerRow;
constexpr int kElemsPerChunk = 8;  // 2-byte elements per 16-byte vector

static_assert(kRowsPerCta % kBwdSemaphoreRows == 0, "a CTA must own whole semaphores");
static_assert(kRowsPerCta % kRowsPerPass == 0, "passes must tile the CTA's rows");
static_assert((kThreadsPerRow & (kThreadsPerRow - 1)) == 0 && kThreadsPerRow <= 32,
              "a row's threads reduce by xor shuffles inside one warp");

// Two-element vector conversions of the input dtype.
template <class Element>
struct Pair;

template <>
struct Pair<__half> {
  using Type = __half2;
  static __device__ float2 to_float2(Type v) { return __half22float2(v); }
  static __device__ Type from_float2(float2 v) { return __float22half2_rn(v); }
};

template <>
struct Pair<__nv_bfloat16> {
  using Type = __nv_bfloat162;
  static __device__ float2 to_float2(Type v) { return __bfloat1622float2(v); }
  static __device__ Type from_float2(float2 v) { return __float22bfloat162_rn(v); }
};

// sum(a[i] * b[i]) over the 8 elements of two 16-byte vectors, in fp32.
template <class Element>
__device__ float dot8(uint4 a, uint4 b) {
  using P = Pair<Element>;
  const auto* pa = reinterpret_cast<const typename P::Type*>(&a);
  const auto* pb = reinterpret_cast<const typename P::Type*>(&b);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = P::to_float2(pa[i]);
    const float2 y = P::to_float2(pb[i]);
    sum = fmaf(x.x, y.x, sum);
    sum = fmaf(x.y, y.y, sum);
  }
  return sum;
}

// Rows [first, end) of one head of a gradient (16-bit, head_dim elements per row) set to 0 by the
// CTA's threads, 16 bytes per store.
template <class Element>
__device__ void zero_rows(void* base, int64_t row_stride, int64_t head_stride, int head,
                          int64_t first, int64_t end, int head_dim) {
  const int chunks = head_dim / kElemsPerChunk;
  for (int64_t i = threadIdx.x; i < (end - first) * chunks; i += kThreads) {
    const int64_t row = first + i / chunks;
    auto* dst = reinterpret_cast<uint4*>(static_cast<Element*>(base) + row * row_stride +
                                         int64_t(head) * head_stride);
    dst[i % chunks] = make_uint4(0, 0, 0, 0);
  }
}

// Varlen: the rows of dq (query head h) and, for h < heads_kv, of dk / dv (kv head h) that no
// kernel writes, set to 0 (FA3's gradients of padding): those of sequence b's span past its used
// and bounded rows, and with b = 0 the rows before the first span and after the last. Offsets
// clamped to the tensors as everywhere (flash_hopper/varlen.h).
template <class Element>
__device__ void zero_gaps(BwdParams const& p, int b, int h) {
  const BwdSpan span = bwd_spans(p)(b);
  using detail::clamp_int;
  const int q_end = clamp_int(p.cu_seqlens_q[b + 1], span.q_start, p.total_q);
  zero_rows<Element>(p.dq, p.dq_row_stride, p.dq_head_stride, h,
                     int64_t(span.q_start) + span.seqlen_q, q_end, p.head_dim);
  if (b == 0) {
    zero_rows<Element>(p.dq, p.dq_row_stride, p.dq_head_stride, h, 0, span.q_start, p.head_dim);
    zero_rows<Element>(p.dq, p.dq_row_stride, p.dq_head_stride, h,
                       clamp_int(p.cu_seqlens_q[p.batch], 0, p.total_q), p.total_q, p.head_dim);
  }
  if (h < p.heads_kv) {
    const int k_end = clamp_int(p.cu_seqlens_k[b + 1], span.k_start, p.total_k);
    const int64_t k_first = int64_t(span.k_start) + span.seqlen_k;
    const int k_tail = clamp_int(p.cu_seqlens_k[p.batch], 0, p.total_k);
    void* const grads[2] = {p.dk, p.dv};
    const int64_t row_strides[2] = {p.dk_row_stride, p.dv_row_stride};
    const int64_t head_strides[2] = {p.dk_head_stride, p.dv_head_stride};
    for (int g = 0; g < 2; ++g) {
      zero_rows<Element>(grads[g], row_strides[g], head_strides[g], h, k_first, k_end,
                         p.head_dim);
      if (b == 0) {
        zero_rows<Element>(grads[g], row_strides[g], head_strides[g], h, 0, span.k_start,
                           p.head_dim);
        zero_rows<Element>(grads[g], row_strides[g], head_strides[g], h, k_tail, p.total_k,
                           p.head_dim);
      }
    }
  }
}

// Grid (seqlen_q_rounded / kRowsPerCta, heads_q, batch): every padded row, which the unmasked
// tile's last 80-row block reads past round_up(seqlen_q, kRowsPerCta) (and whose accumulator
// block, in its own order, holds valid rows' values there). Varlen: (ceil(seqlen_q /
// kRowsPerCta), ...), seqlen_q bounding the sequences; a CTA past its sequence's rows has nothing
// to do (the main kernel and the postprocess visit only the rows' 128-row blocks of each
// sequence, all of them here).
template <class Element>
__global__ void __launch_bounds__(kThreads) bwd_preprocess_kernel(const BwdParams p) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) {
    *p.tile_counter = 0;
  }
  const int m_block = blockIdx.x;
  const int h = blockIdx.y;
  const BwdSpan span = bwd_spans(p)(blockIdx.z);
  const int row0 = m_block * kRowsPerCta;
  if (p.varlen()) {
    if (m_block == 0) {
      zero_gaps<Element>(p, blockIdx.z, h);
    }
    if (row0 >= span.seqlen_q) {
      return;
    }
  }
  const int b = span.batch;
  const int64_t ws_row0 = p.row_offset(b, h) + span.ws_row0 + row0;

  // D and lse_log2: a row per kThreadsPerRow neighbouring threads.
  const int sub = threadIdx.x % kThreadsPerRow;
  const int chunks = p.head_dim / kElemsPerChunk;
  for (int r = threadIdx.x / kThreadsPerRow; r < kRowsPerCta; r += kRowsPerPass) {
    const int row = row0 + r;
    float d = 0.f;
    const int64_t token = int64_t(span.q_start) + row;  // q / o / lse row (varlen: packed)
    if (row < span.seqlen_q) {
      const auto* o = reinterpret_cast<const uint4*>(
          static_cast<const Element*>(p.o) + b * p.o_batch_stride + token * p.o_row_stride +
          h * p.o_head_stride);
      const auto* dout = reinterpret_cast<const uint4*>(
          static_cast<const Element*>(p.dout) + b * p.dout_batch_stride +
          token * p.dout_row_stride + h * p.dout_head_stride);
      for (int c = sub; c < chunks; c += kThreadsPerRow) {
        d += dot8<Element>(o[c], dout[c]);
      }
    }
#pragma unroll
    for (int offset = kThreadsPerRow / 2; offset > 0; offset /= 2) {
      d += __shfl_xor_sync(0xffffffffu, d, offset);
    }
    if (sub == 0) {
      float lse_log2 = INFINITY;  // padded rows: P = exp2(s - inf) = 0, and D = 0
      if (row < span.seqlen_q) {
        const float lse = p.lse[b * p.lse_batch_stride + h * p.lse_head_stride + token];
        // lse = -inf: the row sees no key (its forward output is 0); +inf keeps its P at 0
        // instead of exp2(-inf - -inf) = NaN.
        lse_log2 = lse == -INFINITY ? INFINITY : lse * kLog2e;
        if (p.dlse != nullptr) {
          d -= p.dlse[b * p.dlse_batch_stride + h * p.dlse_head_stride + token];
        }
      }
      p.lse_log2[ws_row0 + r] = lse_log2;
      p.dpsum[ws_row0 + r] = d;
    }
  }

  // Clear the CTA's rows of dq_accum: kRowsPerCta * head_dim_rounded contiguous floats.
  float4* acc = reinterpret_cast<float4*>(p.dq_accum + ws_row0 * p.head_dim_rounded);
  const int vectors = kRowsPerCta * p.head_dim_rounded / 4;
  for (int i = threadIdx.x; i < vectors; i += kThreads) {
    acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  constexpr int kSemaphores = kRowsPerCta / kBwdSemaphoreRows;
  if (threadIdx.x < kSemaphores) {
    p.semaphores[p.semaphore_offset(b, h) + (span.ws_row0 + row0) / kBwdSemaphoreRows +
                 threadIdx.x] = 0;
  }
}

// launch(Element{}) for the FhDtype's element type.
template <class Launch>
LaunchResult dispatch_dtype(int32_t dtype, Launch&& launch) {
  switch (dtype) {
    case FH_DTYPE_FP16: return launch(__half{});
    case FH_DTYPE_BF16: return launch(__nv_bfloat16{});
    default: return LaunchResult::internal("bwd preprocess: dtype is not fp16 or bf16");
  }
}

}  // namespace

LaunchResult launch_bwd_preprocess(BwdParams const& p, int32_t dtype, cudaStream_t stream) {
  const int rows = p.varlen() ? p.seqlen_q : p.seqlen_q_rounded;
  const dim3 grid((rows + kRowsPerCta - 1) / kRowsPerCta, p.heads_q, p.batch);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) {
    return LaunchResult::ok();
  }
  return dispatch_dtype(dtype, [&](auto element) {
    using Element = decltype(element);
    bwd_preprocess_kernel<Element><<<grid, kThreads, 0, stream>>>(p);
    return LaunchResult::cuda(cudaGetLastError());
  });
}

}  // namespace flash_hopper
