// The FA-3 forward's tile slot: how the producer's walk reaches the CTA's other roles
// (schedule.h produce() and take_tile_with_keys; kernel.h "Pipelines").
//
// Two buffers of a tile index in shared memory, each behind a full and an empty mbarrier
// (Traits::TilePipe): the producer warp's leader waits until buffer i % 2 is empty, writes the
// walk's i-th tile index (past the last tile: the end of the walk) into it and arrives on its full
// barrier; every reading warp (each warp
// of the consumer warpgroups, and the relay warps: FP8's transposers, the mixed mode's converters,
// varlen's tail-zeroing warp) waits on the full barrier, reads the buffer into a register and
// arrives on the empty barrier, every thread (the buffer is rewritten only after every thread of
// every reader read it). Tile i is read only once its readers
// are done with tile i - 1, so two buffers let the producer publish a tile while the last one is
// still being read.
//
// The mbarrier operations are asm without a memory clobber: the compiler fences around the
// buffer's reads and write keep them between the barrier operations.
#pragma once

#include <cute/config.hpp>

#include "sm90/common/barriers.h"

namespace flash_hopper::sm90 {

CUTE_DEVICE void compiler_fence() { asm volatile("" ::: "memory"); }

// The ends hold a counter only (the barriers' and buffers' addresses are recomputed from the
// shared storage where used): a pointer kept across the consumer's loop costs registers the
// consumers do not have.
//
// The producer's end: tile `published` goes into buffer published % 2 (a writer waits for parity
// 1 of a fresh buffer's empty barrier first, pipeline.h).
template <class Traits>
struct TileSlotWriter {
  using TilePipe = typename Traits::TilePipe;
  static_assert(TilePipe::kStages == 2);
  int published = 0;

  template <class SharedStorage>
  CUTE_DEVICE void publish(SharedStorage& smem, int tile, bool leader) {
    const SmemBarriers<TilePipe> bar{smem.tile_full, smem.tile_empty};
    const int s = published & 1;
    bar.wait_empty(s, ((published >> 1) & 1) ^ 1);
    compiler_fence();
    if (leader) {
      smem.tile[s] = tile;
      compiler_fence();
      bar.arrive_full(s);
    }
    ++published;
  }
};

// A reading thread's end: every thread of the readers arrives once it read the buffer (its own
// read ordered before its own arrival; no warp-level sync, no branch on the lane).
template <class Traits>
struct TileSlotReader {
  using TilePipe = typename Traits::TilePipe;
  int taken = 0;

  // The walk's next tile index (past the last tile: its end).
  template <class SharedStorage>
  CUTE_DEVICE int take(SharedStorage& smem) {
    const SmemBarriers<TilePipe> bar{smem.tile_full, smem.tile_empty};
    const int s = taken & 1;
    bar.wait_full(s, (taken >> 1) & 1);
    compiler_fence();
    const int tile = smem.tile[s];
    compiler_fence();
    bar.arrive_empty(s);
    ++taken;
    return tile;
  }
};

}  // namespace flash_hopper::sm90
