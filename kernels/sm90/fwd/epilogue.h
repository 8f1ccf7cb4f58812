// Consumer epilogue of the FA-3 path: O (normalized fp32 accumulator) out as 16-bit, LSE fp32.
//
// Two ways out, chosen per kernel by the shared memory its stages leave (kernel_traits.h,
// kOPasses):
// - Staged (kOPasses > 0): each consumer warpgroup writes its 64 rows into its own slab of the O
//   staging buffer with stmatrix (the hardware transposes the accumulator's column pairs into
//   rows), syncs its 128 threads on a named barrier, and copies the slab out with 16-byte loads
//   and row-contiguous 16-byte stores. Where the buffer holds a part of the head dim only (d128's
//   N = 176 tile: 18 KB free, 16 KB for two slabs of 64 columns), this runs once per part.
//   At d128 a thread issues 8 stmatrix, 8 16-byte loads and stores and 4 barriers, no shuffles:
//   the register way below took about twice as many cycles per tile boundary on the H200 (its
//   runtime-lane selects compile to branches) while both warpgroups' epilogues leave the tensor
//   cores idle (the cycle counts: bench/PERFLOG.md "O through shared memory").
//   FP8 d64 / d128 stage through their fold copy (PvFoldedToShared): a warpgroup's slab of it is
//   free once the epilogue read it, and holds its 64 rows of 16-bit O in one pass.
// - Registers (kOPasses = 0: d64, d96, d192, d256, FP8 d96 / d192 / d256 and the mixed mode;
//   tile_config.h says why for each): the 4 threads of a quad exchange their column pairs with
//   shuffles so each stores 16 contiguous bytes per row (store_row_quad,
//   common/fragment_store.h).
// Rows < seqlen_q and columns < head_dim_v (V's head dim: O's) only. Neither way touches the
// K / V stages, so no barrier orders the epilogue against the producer's next loads; in the tuned
// kernel it runs while the next tile's first QK GEMM is on the tensor cores (mma.h).
#pragma once

#include <cmath>
#include <cute/tensor.hpp>

#include "flash_hopper/fwd_params.h"
#include "sm90/common/barriers.h"
#include "sm90/common/fragment_store.h"
#include "sm90/common/utils.h"
#include "sm90/fwd/barriers.h"
#include "sm90/fwd/params.h"  // head_dim_v
#include "sm90/fwd/tile_scheduler.h"

namespace flash_hopper::sm90 {

using namespace cute;

// The quad's first thread writes the LSE of its two rows.
template <class Traits, class ThrMma>
CUTE_DEVICE void store_lse(FwdParams const& p, ThrMma const& thr_mma_pv, TileCoord tile,
                           float const (&lse)[2]) {
  if (p.lse == nullptr || threadIdx.x % 4 != 0) {
    return;
  }
  Tensor tOcO = thr_mma_pv.partition_C(
      make_identity_tensor(Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDimV>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));  // (2, (2, D/8))
  float* lse_ptr = p.lse + tile.batch * p.lse_batch_stride + tile.head * p.lse_head_stride +
                   tile.q_start;
  const int row0 = tile.m_block * Traits::kBlockM;
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + get<0>(tOcO_rc(r, 0));
    if (row < tile.seqlen_q) {
      lse_ptr[row] = lse[r];
    }
  }
}

// Writes one tile's rows: value(r, c) gives the 16-bit O element at (row, column) index (r, c) of
// the thread's PV-accumulator fragment in its row-column view (acc_rowcol), lse[r] the LSE of the
// thread's row r.
template <class Element, class Traits, class ThrMma, class ValueAt>
CUTE_DEVICE void store_rows(FwdParams const& p, ThrMma const& thr_mma_pv, TileCoord tile,
                            ValueAt value, float const (&lse)[2]) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDimV = Traits::kHeadDimV;
  Tensor tOcO =
      thr_mma_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));  // (2, (2, D/8))

  // Rows of the tile's sequence only (varlen: the next sequence's rows follow in memory; its
  // batch strides are 0 and q_start addresses the sequence).
  Element* o = static_cast<Element*>(p.o) + tile.batch * p.o_batch_stride +
               tile.head * p.o_head_stride + int64_t(tile.q_start) * p.o_row_stride;
  const int row0 = tile.m_block * kBlockM;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(tOcO_rc); ++r) {
    const int row = row0 + get<0>(tOcO_rc(r, 0));
    // head_dim % 8 == 0: whole 8-column groups are in or out
    store_row_quad<Element, kHeadDimV>(o + row * p.o_row_stride, row < tile.seqlen_q,
                                       head_dim_v<Traits>(p), [&](int c) { return value(r, c); });
  }
  store_lse<Traits>(p, thr_mma_pv, tile, lse);
}

// One consumer warpgroup's slab of the O staging buffer: 64 rows of kCols 16-bit columns, in
// 16-byte chunks. Chunk c of row r sits at chunk c ^ x(r) of its row: x(r) = r % 8 for rows of 8
// or 16 chunks, (r / 2) % 4 for rows of 4 (two rows per 128 bytes), so the 8 rows of one stmatrix
// 8 x 8 matrix, and the 8 chunks one quarter-warp reads, fall in 8 different bank groups.
template <int kCols>
struct OStageSlab {
  static constexpr int kChunks = kCols / 8;
  static_assert(kChunks == 4 || kChunks == 8 || kChunks == 16, "kernel_traits.h o_stage_passes");
  static constexpr int kBytes = 64 * kCols * 2;
  static CUTE_HOST_DEVICE constexpr int offset(int row, int chunk) {
    const int x = kChunks >= 8 ? row % 8 : (row / 2) % 4;
    return (row * kChunks + (chunk ^ x)) * 16;
  }
};

// O of one tile through the staging buffer (kOPasses > 0). acc_o: the normalized fp32 O
// fragment of this thread; stage: the staging buffer (all warpgroups' slabs).
template <class Element, class Traits, class ThrMma, class TensorO>
CUTE_DEVICE void store_tile_staged(FwdParams const& p, ThrMma const& thr_mma_pv,
                                   TensorO const& acc_o, float const (&lse)[2], TileCoord tile,
                                   uint8_t* stage) {
  static_assert(sizeof(Element) == 2);
  constexpr int kPasses = Traits::kOPasses;
  constexpr int kCols = Traits::kOStageCols;
  using Slab = OStageSlab<kCols>;
  constexpr int kChunks = Slab::kChunks;
  const int t = threadIdx.x % 128;  // in the warpgroup
  const int wg = cutlass::canonical_warp_group_idx() - 1;
  const int lane = t % 32;
  uint8_t* slab = stage + wg * Traits::kOStageSlabStride;
  const uint32_t slab_s = cute::cast_smem_ptr_to_uint(slab);
  const uint32_t barrier = static_cast<uint32_t>(FwdBarrier::kOStage0) + wg;
  store_lse<Traits>(p, thr_mma_pv, tile, lse);
  // O in 16 bits first (half the registers live through the passes). In the accumulator's order
  // ((2 columns, 2 rows, D/8 groups)) a 32-bit word holds a column pair: word r + 2 g is the pair
  // (2q, 2q + 1) of column group g (8 columns) in row r (+8 for r = 1).
  static_assert(decltype(stride<0, 0>(acc_o.layout()))::value == 1 &&
                decltype(stride<0, 1>(acc_o.layout()))::value == 2 &&
                decltype(stride<0, 2>(acc_o.layout()))::value == 4,
                "the m64nN accumulator's registers in (column pair, row half, group) order");
  Tensor rO = make_tensor<Element>(acc_o.layout());
  convert_into(acc_o, rO);
  Tensor words = recast<uint32_t>(rO);
  auto word = [&](int r, int g) { return words(r + 2 * g); };
  // stmatrix x4 writes a 16 x 16 block as four 8 x 8 matrices (rows +8: matrix 1, columns +8:
  // matrix 2); lane i addresses row i % 8 of matrix i / 8.
  const int st_row = 16 * (t / 32) + lane % 8 + 8 * ((lane / 8) % 2);
  const int st_half = lane / 16;
  Element* o = static_cast<Element*>(p.o) + tile.batch * p.o_batch_stride +
               tile.head * p.o_head_stride + int64_t(tile.q_start) * p.o_row_stride;
  const int row0 = tile.m_block * Traits::kBlockM + 64 * wg;
  CUTE_UNROLL
  for (int pass = 0; pass < kPasses; ++pass) {
    named_barrier_sync(barrier, 128);  // the slab's previous reads are done
    CUTE_UNROLL
    for (int j = 0; j < kCols / 16; ++j) {
      const int g = pass * (kCols / 8) + 2 * j;  // the block's first column group
      stmatrix_x4(slab_s + Slab::offset(st_row, 2 * j + st_half), word(0, g), word(1, g),
                  word(0, g + 1), word(1, g + 1));
    }
    named_barrier_sync(barrier, 128);  // the slab is written
    CUTE_UNROLL
    for (int i = 0; i < 64 * kChunks / 128; ++i) {
      const int k = t + 128 * i;
      const int r = k / kChunks;
      const int c = k % kChunks;
      const uint4 v = *reinterpret_cast<uint4 const*>(slab + Slab::offset(r, c));
      const int row = row0 + r;
      const int col = pass * kCols + 8 * c;
      // head_dim % 8 == 0: whole 8-column chunks are in or out
      if (row < tile.seqlen_q && col < head_dim_v<Traits>(p)) {
        *reinterpret_cast<uint4*>(o + int64_t(row) * p.o_row_stride + col) = v;
      }
    }
  }
  if constexpr (Traits::kOStageInFold) {
    named_barrier_sync(barrier, 128);  // the slab is read before the next tile clears the copy
  }
}

// acc_o: the O accumulator (fp32, already normalized), stored as Element (O's dtype: the
// inputs' for 16-bit inputs, bf16 or fp16 for FP8).
// stage: the O staging buffer where the kernel has one (kOPasses > 0), else unused.
template <class Element, class Traits, class ThrMma, class TensorO>
CUTE_DEVICE void store_tile(FwdParams const& p, ThrMma const& thr_mma_pv, TensorO const& acc_o,
                            float const (&lse)[2], TileCoord tile, uint8_t* stage) {
  if constexpr (Traits::kOPasses > 0) {
    store_tile_staged<Element, Traits>(p, thr_mma_pv, acc_o, lse, tile, stage);
  } else {
    Tensor rO = make_tensor<Element>(acc_o.layout());
    convert_into(acc_o, rO);
    Tensor rO_rc = make_tensor(rO.data(), acc_rowcol(rO.layout()));
    store_rows<Element, Traits>(p, thr_mma_pv, tile, [&](int r, int c) { return rO_rc(r, c); },
                                lse);
  }
}

// A tile whose rows see no key: O = 0, LSE = -inf.
template <class Element, class Traits, class ThrMma>
CUTE_DEVICE void store_empty_tile(FwdParams const& p, ThrMma const& thr_mma_pv, TileCoord tile) {
  const float lse[2] = {-INFINITY, -INFINITY};
  store_rows<Element, Traits>(p, thr_mma_pv, tile, [](int, int) { return Element(0.f); }, lse);
}

}  // namespace flash_hopper::sm90
