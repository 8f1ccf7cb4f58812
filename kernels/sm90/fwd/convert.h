// The mixed mode's K / V converter (fp16 / bf16 queries against an FP8 K / V cache;
// docs/fwd_sm90.md "Mixed mode"): warps 1-3 of the producer warpgroup turn each FP8 block the TMA
// loaded into the staging ring into the 16-bit K or V stage the consumers read, so the consumers
// are the 16-bit kernel's and user memory is read once, in FP8 (half the bytes of a 16-bit
// cache).
//
// Order: the converter walks the producer's load order (schedule.h's follow_loads() with these
// operations, the tiles from the tile slot), so the ring's stages arrive in the order it takes
// them, and it fills the K and V stages in the order the consumers use them. It blocks on what the
// producer would block on without the ring (a free K / V stage), so the 16-bit kernel's pipeline
// contract holds as is; the ring adds one wait (a staging stage full) that the producer satisfies
// in the same order.
//
// Conversion: exact. Every e4m3 and e5m2 value is an fp16 value (cvt.rn.f16x2.e4m3x2 /
// .e5m2x2, two values per instruction, NaN stays NaN, e5m2's infinities stay infinite), and
// every fp16 value is a bf16 value after widening to fp32 (bf16 keeps fp32's exponent range;
// e4m3 / e5m2 mantissas have 3 / 2 bits), so the bf16 path converts through fp32.
//
// Work unit: 32 rows x 16 columns: each lane loads one 16-byte chunk of its row (16 FP8 values; the
// swizzle moves 16-byte chunks whole), converts it and stores two 16-byte chunks of 8 16-bit
// values. A quarter warp's 8 lanes take 8 consecutive rows of one column chunk, which the 128-byte
// (and FP8 d64's 64-byte) swizzle spreads over 8 distinct bank groups (ncu: few extra wavefronts
// per 16-byte store or load; bench/PERFLOG.md "the mixed mode"). Each warp
// takes a contiguous range of units, row groups fastest: per column chunk the swizzled offsets are
// computed once and the row groups' loads (up to four, 16 registers: RegisterBudget's wide
// producer) issue back to back at constant offsets. The first version computed every unit's offsets
// through the layouts (~17 instructions) one unit at a time and ran at half the 16-bit path's speed
// (timeline: the converter busy most of each step, the consumers waiting for K / V); this one runs
// much closer to it (bench/PERFLOG.md "the mixed mode").
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/common/barriers.h"
#include "sm90/common/pipeline.h"
#include "sm90/fwd/kernel_traits.h"  // kConverterWarps
#include "sm90/fwd/params.h"
#include "sm90/fwd/schedule.h"
#include "sm90/fwd/tile_slot.h"
#include "sm90/fwd/timeline.h"

namespace flash_hopper::sm90 {

using namespace cute;

// Two FP8 values (the low and the high byte of x) -> two fp16 values (low and high half).
template <class KvElement>
CUTE_DEVICE uint32_t fp8x2_to_f16x2(uint16_t x) {
  uint32_t out;
  if constexpr (cute::is_same_v<KvElement, cutlass::float_e4m3_t>) {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(x));
  } else {
    static_assert(cute::is_same_v<KvElement, cutlass::float_e5m2_t>);
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(out) : "h"(x));
  }
  return out;
}

// Two fp16 values -> two bf16 values, through fp32 (exact for values that came from FP8).
CUTE_DEVICE uint32_t f16x2_to_bf16x2(uint32_t h) {
  uint32_t out;
  asm("{\n"
      "  .reg .f16 lo, hi;\n"
      "  .reg .f32 flo, fhi;\n"
      "  mov.b32 {lo, hi}, %1;\n"
      "  cvt.f32.f16 flo, lo;\n"
      "  cvt.f32.f16 fhi, hi;\n"
      "  cvt.rn.bf16x2.f32 %0, fhi, flo;\n"
      "}"
      : "=r"(out)
      : "r"(h));
  return out;
}

// PTX prmt (generic mode): byte i of the result is selector nibble i's byte of {b, a} (a: bytes
// 0-3), or with the nibble's bit 3 set that byte's sign bit replicated.
CUTE_DEVICE uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t out;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(out) : "r"(a), "r"(b), "r"(selector));
  return out;
}

// Four FP8 values (one 32-bit word, lowest byte first) -> four 16-bit Element values (two words).
// e5m2 is the high byte of an fp16 (same exponent, 2 of its 10 mantissa bits), infinities and NaN
// included: e5m2 -> fp16 needs only byte moves. The others convert on the conversion unit
// (F2FP), bf16 through fp16 and fp32. (An integer e4m3 conversion -- the magnitude bits shifted
// into the target's fields, NaN patched, one exact multiply restoring the scale -- measured slower
// than F2FP at d128: more instructions for the converter warps to issue, bench/PERFLOG.md
// "the mixed mode".)
template <class Element, class KvElement>
CUTE_DEVICE void fp8x4_to_16bit(uint32_t x, uint32_t& lo, uint32_t& hi) {
  static_assert(cute::is_same_v<Element, cutlass::half_t> ||
                cute::is_same_v<Element, cutlass::bfloat16_t>);
  if constexpr (cute::is_same_v<KvElement, cutlass::float_e5m2_t> &&
                cute::is_same_v<Element, cutlass::half_t>) {
    lo = prmt(x, 0, 0x1404);
    hi = prmt(x, 0, 0x3424);
  } else if constexpr (cute::is_same_v<Element, cutlass::half_t>) {
    lo = fp8x2_to_f16x2<KvElement>(uint16_t(x & 0xffffu));
    hi = fp8x2_to_f16x2<KvElement>(uint16_t(x >> 16));
  } else {
    lo = f16x2_to_bf16x2(fp8x2_to_f16x2<KvElement>(uint16_t(x & 0xffffu)));
    hi = f16x2_to_bf16x2(fp8x2_to_f16x2<KvElement>(uint16_t(x >> 16)));
  }
}

template <class Traits>
struct Converter {
  using Element = typename Traits::Element;
  using KvElement = typename Traits::KvElement;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kRowGroups = kBlockN / 32;
  static constexpr int kUnits = kRowGroups * (kHeadDim / 16);
  static_assert(kBlockN % 32 == 0 && kHeadDim % 16 == 0, "32-row x 16-column units");
  using SharedStorage = typename Traits::SharedStorage;
  using StagingPipe = typename Traits::StagingPipe;
  using KVPipe = typename Traits::KVPipe;
  static_assert(StagingPipe::kEmptyArrivals == kConverterWarps &&
                KVPipe::kFullArrivals == kConverterWarps);

  SharedStorage& smem;
  int warp;  // 0 .. kConverterWarps - 1
  ConsumerEnd<StagingPipe, SmemBarriers<StagingPipe>> staging;
  WriterEnd<KVPipe, SmemBarriers<KVPipe>> k_out;
  WriterEnd<KVPipe, SmemBarriers<KVPipe>> v_out;
  TileSlotReader<Traits> slot;  // the producer's tiles (tile_slot.h)
  Timeline timeline;  // FH_TIMELINE builds only (timeline.h)

  CUTE_DEVICE Converter(SharedStorage& smem_, int warp_, unsigned long long* timeline_buffer)
      : smem(smem_),
        warp(warp_),
        staging{{smem_.staging.full, smem_.staging.empty}},
        k_out{{smem_.k_full, smem_.k_empty}},
        v_out{{smem_.v_full, smem_.v_empty}},
        timeline(timeline_buffer) {}

  // Byte offset of a coordinate in a swizzled layout of kBytes-byte elements. The layouts are
  // ComposedLayout<Swizzle, smem_ptr_flag, Layout> (tile_to_shape of a GMMA atom): the Layout
  // gives element offsets, the swizzle acts on byte offsets from the 1024-byte aligned base (as
  // CuTe's swizzle_ptr applies it to the address).
  template <int kBytes, class ComposedLayout>
  static CUTE_DEVICE uint32_t byte_offset(ComposedLayout const& layout, int row, int col,
                                          int stage) {
    return layout.layout_a()(
        uint32_t(kBytes) * layout.layout_b()(uint32_t(row), uint32_t(col), uint32_t(stage)));
  }

  // follow_loads()'s operations: the converter follows the producer's K / V order and loads
  // nothing.
  CUTE_DEVICE int take_tile() { return slot.take(smem); }
  CUTE_DEVICE int tile(TileWork const&) const { return 0; }
  CUTE_DEVICE void q(int, TileWork const&) const {}
  CUTE_DEVICE void k(int, KeyStep) { convert(k_out, smem.k.data()); }
  CUTE_DEVICE void v(int, KeyStep) { convert(v_out, smem.v.data()); }

  // The next staging stage -> the next stage of `out` (at `out_data`).
  template <class Out>
  CUTE_DEVICE void convert(Out& out, Element* out_data) {
    staging.wait();
    timeline.mark(Ev::kTrVReady);
    out.acquire();
    timeline.mark(Ev::kTrVtFree);
    constexpr typename Traits::SmemLayoutStaging layout_in{};  // (N, D, STAGING), 1-byte
    constexpr typename Traits::SmemLayoutK layout_out{};       // (N, D, PIPE), 16-bit
    constexpr int kOutBytes = int(sizeof(Element));
    const uint32_t in_base = cast_smem_ptr_to_uint(smem.staging.kv.data());
    const uint32_t out_base = cast_smem_ptr_to_uint(out_data);
    const int in_stage = staging.stage();
    const int out_stage = out.stage();
    const int lane = threadIdx.x % 32;
    // 32 rows further is whole swizzle atoms further (8 rows each): the same offset plus a
    // constant that leaves the swizzled bits alone, so a column chunk's offsets are computed once
    // and the row groups step by these (kRowGroupBytes below).
    const uint32_t in_group = byte_offset<1>(layout_in, 32, 0, 0) - byte_offset<1>(layout_in, 0, 0, 0);
    const uint32_t out_group = byte_offset<kOutBytes>(layout_out, 32, 0, 0) -
                               byte_offset<kOutBytes>(layout_out, 0, 0, 0);
    // This warp's units: a contiguous range of (column chunk, row group), row groups fastest.
    constexpr int kPerWarp = (kUnits + kConverterWarps - 1) / kConverterWarps;
    const int begin = warp * kPerWarp;
    const int end = begin + kPerWarp < kUnits ? begin + kPerWarp : kUnits;
    CUTE_NO_UNROLL
    for (int chunk = begin / kRowGroups; chunk * kRowGroups < end; ++chunk) {
      const int col = chunk * 16;
      const uint32_t src = in_base + byte_offset<1>(layout_in, lane, col, in_stage);
      const uint32_t dst[2] = {
          out_base + byte_offset<kOutBytes>(layout_out, lane, col, out_stage),
          out_base + byte_offset<kOutBytes>(layout_out, lane, col + 8, out_stage)};
      const int g_begin = begin - chunk * kRowGroups;  // may be < 0: from the chunk's first
      const int g_end = end - chunk * kRowGroups;      // may be > kRowGroups: to its last
      uint32_t x[kRowGroups][4];
      CUTE_UNROLL
      for (int g = 0; g < kRowGroups; ++g) {
        if (g >= g_begin && g < g_end) {  // warp-uniform
          // Not volatile: the loads issue back to back; the stores' "memory" clobbers keep them
          // after the staging wait and before the release.
          asm("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
              : "=r"(x[g][0]), "=r"(x[g][1]), "=r"(x[g][2]), "=r"(x[g][3])
              : "r"(src + g * in_group)
              : "memory");
        }
      }
      CUTE_UNROLL
      for (int g = 0; g < kRowGroups; ++g) {
        if (g >= g_begin && g < g_end) {
          CUTE_UNROLL
          for (int half = 0; half < 2; ++half) {  // 8 values: one 16-byte store
            uint32_t y[4];
            fp8x4_to_16bit<Element, KvElement>(x[g][2 * half], y[0], y[1]);
            fp8x4_to_16bit<Element, KvElement>(x[g][2 * half + 1], y[2], y[3]);
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst[half] + g * out_group),
                         "r"(y[0]), "r"(y[1]), "r"(y[2]), "r"(y[3])
                         : "memory");
          }
        }
      }
    }
    // The stores are read by WGMMA (the async proxy): fence them before the barrier publishes them.
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    const bool leader = lane == 0;
    staging.release(leader);
    out.commit(leader);
    timeline.mark(Ev::kTrDone);
  }
};

template <class Traits>
CUTE_DEVICE void converter_loop(KernelParams<Traits> const& params,
                                typename Traits::SharedStorage& smem, int warp) {
  Converter<Traits> converter(smem, warp, params.fwd.timeline);
  follow_loads<Traits::kVLag>(cta_schedule(params), converter);
}

}  // namespace flash_hopper::sm90
