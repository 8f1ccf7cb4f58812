// Epilogue of the FA-3 path's backward consumers: dQ into the fp32 accumulator (every step), dK
// and dV from registers to global memory (every tile).
//
// dQ accumulator order inside a query block (kBlockM x kHeadDim floats; postprocess.h reads it
// back through the same tiled MMA): with kDqWgs = 2, WG c's columns start at
// c * kBlockM * kHeadDim / 2; with kDqWgs = 1 both WGs add their partial sums over the same
// positions. Value v of WG thread t is at (v / 4) * 512 + 4 * t + v % 4, so each thread adds whole
// float4s (red.global.add.v4.f32) and a warp's adds cover 512 contiguous bytes; or, with dQ
// slots (tile_config.h), the WG stores its part into shared memory in the same order and one
// thread adds it with one bulk reduce-add.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flash_hopper/bwd_params.h"
#include "sm90/bwd/schedule.h"
#include "sm90/common/fragment_store.h"
#include "sm90/common/utils.h"

namespace flash_hopper::sm90 {

using namespace cute;

CUTE_DEVICE int load_acquire_gpu(int const* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// One 16-byte fire-and-forget add (atomicAdd(float4*) compiles to four returning ATOMGs).
CUTE_DEVICE void red_add_v4(float* addr, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(addr), "f"(a), "f"(b),
               "f"(c), "f"(d)
               : "memory");
}

// Float index of value v of consumer thread `thread` (0 .. 256) inside a query block.
template <class Traits>
CUTE_HOST_DEVICE constexpr int dq_fragment_offset(int thread, int v) {
  constexpr int kWgFloats = Traits::kBlockM * Traits::kHeadDim / Traits::kDqWgs;
  thread %= 128 * Traits::kDqWgs;
  return (thread / 128) * kWgFloats + (v / 4) * 512 + 4 * (thread % 128) + v % 4;
}

// Bulk reduce-add of `bytes` (a multiple of 16) contiguous bytes of shared memory into global
// memory, by the async proxy (CuTe 4.2 has no wrapper for the plain, non-tensor form), and the
// bulk-group bookkeeping of the issuing thread.
CUTE_DEVICE void bulk_reduce_add_f32(float* gmem, float const* smem, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem),
      "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes)
      : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Orders this thread's global-memory accesses of the generic proxy with those of the async proxy
// (bulk copies and reduce-adds).
CUTE_DEVICE void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
// Every bulk group this thread committed has finished reading shared memory.
CUTE_DEVICE void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Every bulk group this thread committed has completed (its global writes performed).
CUTE_DEVICE void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// This WG's dQ part into its shared-memory slot, in the accumulator's order (the slot is the WG's
// contiguous part of the query block): each warp stores 512 contiguous bytes per instruction.
template <class Traits, class TensorDq>
CUTE_DEVICE void stage_dq_fragment(float* slot, TensorDq const& dq, int thread) {
  static_assert(decltype(size(dq))::value % 4 == 0);
  CUTE_UNROLL
  for (int v = 0; v < size(dq); v += 4) {
    *reinterpret_cast<float4*>(slot + (v / 4) * 512 + 4 * (thread % 128)) =
        make_float4(dq(v), dq(v + 1), dq(v + 2), dq(v + 3));
  }
}

template <class Traits, class TensorDq>
CUTE_DEVICE void add_dq_fragment(float* block, TensorDq const& dq, int thread) {
  static_assert(decltype(size(dq))::value % 4 == 0);
  CUTE_UNROLL
  for (int v = 0; v < size(dq); v += 4) {
    red_add_v4(block + dq_fragment_offset<Traits>(thread, v), dq(v), dq(v + 1), dq(v + 2),
               dq(v + 3));
  }
}

// Rows [row0, row0 + kBlockN) of one (sequence, kv head) of dK or dV (base: its row 0): value(r,
// c) is the 16-bit element at (row, column) index (r, c) of the thread's dK/dV accumulator in its
// row-column view; rows < seqlen_k (the sequence's) and columns < head_dim are written
// (common/fragment_store.h store_row_quad).
template <class Traits, class ThrMma, class ValueAt>
CUTE_DEVICE void store_kv_rows(void* base, int64_t row_stride, int row0, int seqlen_k,
                               int head_dim, ThrMma const& thr_mma, ValueAt value) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  // Family B's WGs hold head_dim / 2 columns each, from column col0 on.
  constexpr int kCols = Traits::kFamilyB ? kHeadDim / 2 : kHeadDim;
  Tensor tc = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tc_rc = make_tensor(tc.data(), acc_rowcol(tc.layout()));  // (2, (2, kCols / 8))
  const int col0 = get<1>(tc_rc(0, 0)) - 2 * (threadIdx.x % 4);
  CUTE_UNROLL
  for (int r = 0; r < size<0>(tc_rc); ++r) {
    const int row = row0 + get<0>(tc_rc(r, 0));
    store_row_quad<Element, kCols>(
        static_cast<Element*>(base) + int64_t(row) * row_stride + col0, row < seqlen_k,
        head_dim - col0, [&](int c) { return value(r, c); });
  }
}

// The first row of the tile's (sequence, kv head) in dK or dV.
template <class Element>
CUTE_DEVICE void* kv_head_base(void* ptr, int64_t batch_stride, int64_t row_stride,
                               int64_t head_stride, BwdTileCoord tile, BwdSpan const& span) {
  return static_cast<Element*>(ptr) + span.batch * batch_stride +
         int64_t(span.k_start) * row_stride + tile.kv_head * head_stride;
}

// One accumulator (fp32) converted to the input dtype and stored as the tile's rows of `ptr`.
template <class Traits, class ThrMma, class TensorAcc>
CUTE_DEVICE void store_kv_acc(BwdParams const& p, ThrMma const& thr_mma, TensorAcc const& acc,
                              void* base, int64_t row_stride, BwdTileCoord tile,
                              BwdSpan const& span) {
  Tensor r = make_tensor<typename Traits::Element>(acc.layout());
  convert_into(acc, r);
  Tensor r_rc = make_tensor(r.data(), acc_rowcol(r.layout()));
  store_kv_rows<Traits>(base, row_stride, tile.n_block * Traits::kBlockN, span.seqlen_k,
                        p.head_dim, thr_mma, [&](int rr, int cc) { return r_rc(rr, cc); });
}

// dK = softmax_scale * dK_acc and dV, both in the input dtype. The scale goes last (FA3's
// arrangement): with softcap dc/ds = scale * (1 - tanh^2), so one multiplication at the end
// serves both cases, none per element (docs/bwd_sm90.md "Three launches" for dQ's).
template <class Traits, class ThrMma, class TensorAcc>
CUTE_DEVICE void store_dkv_tile(BwdParams const& p, ThrMma const& thr_mma, TensorAcc& dk,
                                TensorAcc const& dv, BwdTileCoord tile, BwdSpan const& span) {
  using Element = typename Traits::Element;
  CUTE_UNROLL
  for (int i = 0; i < size(dk); ++i) {
    dk(i) *= p.softmax_scale;
  }
  store_kv_acc<Traits>(
      p, thr_mma, dk,
      kv_head_base<Element>(p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, tile,
                            span),
      p.dk_row_stride, tile, span);
  store_kv_acc<Traits>(
      p, thr_mma, dv,
      kv_head_base<Element>(p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, tile,
                            span),
      p.dv_row_stride, tile, span);
}

// A key block no query row sees: dK = dV = 0.
template <class Traits, class ThrMma>
CUTE_DEVICE void store_zero_dkv_tile(BwdParams const& p, ThrMma const& thr_mma,
                                     BwdTileCoord tile, BwdSpan const& span) {
  using Element = typename Traits::Element;
  const int row0 = tile.n_block * Traits::kBlockN;
  auto zero = [](int, int) { return Element(0.f); };
  store_kv_rows<Traits>(
      kv_head_base<Element>(p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride, tile,
                            span),
      p.dk_row_stride, row0, span.seqlen_k, p.head_dim, thr_mma, zero);
  store_kv_rows<Traits>(
      kv_head_base<Element>(p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, tile,
                            span),
      p.dv_row_stride, row0, span.seqlen_k, p.head_dim, thr_mma, zero);
}

}  // namespace flash_hopper::sm90
