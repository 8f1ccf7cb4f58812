// Register-level helpers of the FA-3 path: WGMMA issue, accumulator views, conversions.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flash_hopper/register_ops.h"

namespace flash_hopper::sm90 {

using namespace cute;

// The m64nN accumulator fragment ((2 cols, 2 rows, N/8), MMA_M, MMA_N) viewed as
// (rows = (2, MMA_M), cols = (2, N/8, MMA_N)): a thread holds rows r and r + 8 of its warp's 16.
template <class AccLayout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(AccLayout acc) {
  static_assert(rank(AccLayout{}) == 3 && rank<0>(AccLayout{}) == 3);
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)),
                     make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

// The S accumulator re-read as the register A operand of the PV WGMMA (16-bit P): two adjacent n8
// column groups form one k16 slice. ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, N/16 * MMA_N)
template <class AccLayout>
CUTE_HOST_DEVICE constexpr auto acc_as_rs_a(AccLayout acc) {
  static_assert(decltype(size<0, 2>(acc))::value % 2 == 0);
  auto split = logical_divide(get<0, 2>(acc), cute::Layout<_2>{});  // (2, N/16)
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0>(split)), get<1>(acc),
                     coalesce(make_layout(get<1>(split), get<2>(acc))));
}

// threadIdx.x read through volatile asm: the compiler cannot hoist it out of the persistent tile
// loop, so values derived from it (fragment coordinates for the mask and the epilogue) are
// recomputed per tile instead of being kept live across it. With three consumer warpgroups at
// 160 registers, keeping them live spilled two values to local memory (d64).
CUTE_DEVICE int opaque_thread_idx() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid;
}

// stmatrix .x4 (b16): four 8 x 8 matrices to shared memory; register m of lane l holds row l / 4,
// columns 2 (l % 4), + 1 of matrix m; lane l gives the address of row l % 8 of matrix l / 8.
CUTE_DEVICE void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// A zero-initializing GEMM ignores its accumulator's old values, but the WGMMA's inline asm reads
// them ("+f"), which keeps the accumulator live across a whole loop. An empty asm that "defines"
// every register ends the old values' lifetime here, without an instruction.
template <class TensorAcc>
CUTE_DEVICE void forget(TensorAcc& acc) {
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    asm("" : "=f"(acc(i)));
  }
}

// Issues C (+)= A B as one WGMMA batch over the K slices. kZeroInit: C = A B. kWait >= 0 waits
// until at most kWait batches are in flight; -1 returns with this batch in flight (the caller
// waits later, which is how softmax overlaps the tensor cores).
template <bool kZeroInit, int kWait, class TiledMma, class TensorA, class TensorB, class TensorC>
CUTE_DEVICE void wgmma(TiledMma& tiled_mma, TensorA const& tCrA, TensorB const& tCrB,
                       TensorC& tCrC) {
  // RS atoms take A from registers; SS atoms take shared-memory descriptors for both operands.
  constexpr bool kARegisters =
      !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kARegisters) {
    warpgroup_fence_operand(const_cast<TensorA&>(tCrA));
  }
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (kZeroInit) {
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  }
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) {
    warpgroup_wait<kWait>();
  }
  warpgroup_fence_operand(tCrC);
  if constexpr (kARegisters) {
    warpgroup_fence_operand(const_cast<TensorA&>(tCrA));
  }
}

}  // namespace flash_hopper::sm90
