// Varlen V tails of the FA-3 path's 16-bit forward: warp 1 of the producer warpgroup (idle
// otherwise) zeroes the rows of a sequence's tail V block that lie past the sequence.
//
// TMA fills a block's rows from the packed tokens, so the tail block of a sequence holds the next
// sequence's rows (or the padding past seqused_k). Their scores are masked, P is 0, but the PV
// GEMM would still add 0 * V there, and 0 * NaN or 0 * Inf is NaN: garbage in another sequence
// or in unused cache rows must never reach O. The producer sends such a block's TMA to
// v_landed[s] instead of v_full[s] (load.h; schedule.h's v_zero_tail picks the blocks, the same
// rule here); this warp walks the producer's loads (schedule.h follow_loads(), the tiles from
// the tile slot: the same loads in the same order, so it knows every V load's stage), and for
// each tail block waits for it to land, writes zeros over the rows past the sequence, fences them
// for the async proxy (WGMMA reads shared memory through it) and makes the one arrival v_full[s]
// counts. Every other block completes v_full[s] through the TMA as before: only tail blocks take
// the extra hop, and only in varlen calls (dense calls have no tail past the tensor: TMA
// zero-fills it).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/common/pipeline.h"
#include "sm90/fwd/params.h"
#include "sm90/fwd/schedule.h"
#include "sm90/fwd/tile_slot.h"

namespace flash_hopper::sm90 {

using namespace cute;

template <class Traits>
struct VTailZeroer {
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDimV = Traits::kHeadDimV;  // V's rows
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;

  SharedStorage& smem;
  PipelineState<Traits::kStages> v_state{0, 0};  // the stage of the next V load
  uint32_t landed_phase = 0;  // bit s: the parity of v_landed[s]'s next completion
  TileCoord tile_{};
  TileSlotReader<Traits> slot;  // the producer's tiles (tile_slot.h)

  CUTE_DEVICE explicit VTailZeroer(SharedStorage& smem_) : smem(smem_) {}

  // follow_loads()'s operations: only V loads matter here.
  CUTE_DEVICE int take_tile() { return slot.take(smem); }
  CUTE_DEVICE int tile(TileWork const& w) {
    tile_ = w.tile;
    return 0;
  }
  CUTE_DEVICE void q(int, TileWork const&) {}
  CUTE_DEVICE void k(int, KeyStep) {}
  CUTE_DEVICE void v(int, KeyStep step) {
    const int s = v_state.index;
    v_state.advance();
    if (!v_zero_tail(tile_, step.n, kBlockN)) {
      return;
    }
    smem.v_landed[s].wait((landed_phase >> s) & 1u);
    landed_phase ^= 1u << s;
    // Rows [valid, kBlockN) of stage s, 16 bytes at a time (8 elements of a row are contiguous
    // under every 16-bit K-major swizzle: it permutes 16-byte units).
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
    const int valid = tile_.seqlen_k - step.n * kBlockN;
    constexpr int kChunks = kHeadDimV / 8;
    const int lane = threadIdx.x % 32;
    for (int i = lane; i < (kBlockN - valid) * kChunks; i += 32) {
      const int r = valid + i / kChunks;
      const int c = (i % kChunks) * 8;
      *reinterpret_cast<uint4*>(&sV(r, c, s)) = make_uint4(0, 0, 0, 0);
    }
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    if (lane == 0) {
      smem.v_full[s].arrive();
    }
  }
};

template <class Traits>
CUTE_DEVICE void vtail_loop(KernelParams<Traits> const& params,
                            typename Traits::SharedStorage& smem) {
  VTailZeroer<Traits> zeroer(smem);
  follow_loads<Traits::kVLag>(cta_schedule(params), zeroer);
}

}  // namespace flash_hopper::sm90
