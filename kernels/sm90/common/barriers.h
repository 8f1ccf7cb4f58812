// Device side of the FA-3 path's synchronization, forward and backward: the mbarriers behind each
// pipeline end (pipeline.h) and a named-barrier sync. The forward's named-barrier ids and its
// consumer ping-pong: fwd/barriers.h.
#pragma once

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/common/pipeline.h"

namespace flash_hopper::sm90 {

// The full / empty mbarrier arrays of one pipeline in shared memory.
template <class Spec>
struct SmemBarriers {
  cutlass::arch::ClusterTransactionBarrier* full;
  cutlass::arch::ClusterBarrier* empty;

  // Once per CTA, by one thread, before the block-wide barrier that publishes them.
  CUTE_DEVICE void init() const {
    CUTE_UNROLL
    for (int s = 0; s < Spec::kStages; ++s) {
      full[s].init(Spec::kFullArrivals);
      empty[s].init(Spec::kEmptyArrivals);
    }
  }
  CUTE_DEVICE void wait_empty(int s, uint32_t phase) const { empty[s].wait(phase); }
  CUTE_DEVICE void arrive_full_tx(int s, uint32_t bytes) const {
    full[s].arrive_and_expect_tx(bytes);
  }
  CUTE_DEVICE void arrive_full(int s) const { full[s].arrive(); }
  CUTE_DEVICE void wait_full(int s, uint32_t phase) const { full[s].wait(phase); }
  CUTE_DEVICE void arrive_empty(int s) const {
    if constexpr (Spec::kPeers == 1) {
      empty[s].arrive();
    } else {
      CUTE_UNROLL
      for (int peer = 0; peer < Spec::kPeers; ++peer) {  // this CTA's barrier among them
        empty[s].arrive(peer, 1);
      }
    }
  }
  // The barrier a TMA load into stage s completes its bytes on.
  CUTE_DEVICE uint64_t& tma_barrier(int s) const { return reinterpret_cast<uint64_t&>(full[s]); }
};

// bar.sync on named barrier `id` of the CTA with `threads` participants, as a compiler memory
// barrier too: shared-memory accesses are not moved across it (CUTLASS's NamedBarrier::sync has
// no "memory" clobber).
CUTE_DEVICE void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount),
               "r"(threads)
               : "memory");
}
// The same without .aligned: each thread arrives on its own, so a warp whose lanes may reach it
// apart (after per-lane mbarrier waits, as the producer warp's) counts right, and the
// participants may meet it at different instructions (.aligned requires one instruction for all,
// which compute-sanitizer's synccheck enforces).
CUTE_DEVICE void named_barrier_sync_unaligned(uint32_t id, uint32_t threads) {
  asm volatile("barrier.sync %0, %1;" ::"r"(
                   id + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount),
               "r"(threads)
               : "memory");
}

}  // namespace flash_hopper::sm90
