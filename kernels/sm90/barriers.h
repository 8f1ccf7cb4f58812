// Device side of the FA-3 path's synchronization: the mbarriers behind each pipeline end
// (pipeline.h) and the named barriers of the consumer ping-pong.
#pragma once

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

#include "sm90/pipeline.h"

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

// Named-barrier ids (CUTLASS reserves the first ReservedNamedBarrierCount = 8 of the 16).
inline constexpr int kMaxConsumerWgs = 3;
enum class FwdBarrier : uint32_t {
  kPingPong0 = 0,  // kPingPong0 + c: consumer WG c may issue its GEMMs
  kOStage0 = kMaxConsumerWgs,  // kOStage0 + c: consumer WG c's O staging (epilogue.h)
};
static_assert(static_cast<uint32_t>(FwdBarrier::kOStage0) + kMaxConsumerWgs <=
                  16 - cutlass::arch::NamedBarrier::ReservedNamedBarrierCount,
              "named barrier ids exceed the hardware's 16");

// bar.sync on named barrier `id` of the CTA with `threads` participants, as a compiler memory
// barrier too: shared-memory accesses are not moved across it (CUTLASS's NamedBarrier::sync has
// no "memory" clobber).
CUTE_DEVICE void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount),
               "r"(threads)
               : "memory");
}

// Ping-pong of the consumer warpgroups: WG c waits for its turn before issuing its GEMMs and
// passes the turn to WG (c + 1) % W right after issuing them. Each barrier has 256 participants:
// the 128 threads of the WG that waits and the 128 of the WG that hands over. WG 0 takes the
// first turn by arriving on its own barrier once; that token is still pending when the kernel
// exits (the last WG's final pass re-arms WG 0's barrier for a turn nobody takes), which the
// host test checks is the only unmatched arrival.
template <int kConsumerWgs>
struct PingPong {
  static constexpr int kThreads = 2 * 128;
  static_assert(kConsumerWgs >= 1 && kConsumerWgs <= kMaxConsumerWgs);
  bool enabled;
  int wg;

  static CUTE_DEVICE uint32_t id(int consumer_wg) {
    return static_cast<uint32_t>(FwdBarrier::kPingPong0) + consumer_wg;
  }
  CUTE_DEVICE void start() const {
    if (enabled && wg == 0) {
      cutlass::arch::NamedBarrier::arrive(kThreads, id(0));
    }
  }
  CUTE_DEVICE void wait_turn() const {
    if (enabled) {
      cutlass::arch::NamedBarrier::sync(kThreads, id(wg));
    }
  }
  CUTE_DEVICE void pass_turn() const {
    if (enabled) {
      cutlass::arch::NamedBarrier::arrive(kThreads, id((wg + 1) % kConsumerWgs));
    }
  }
};

}  // namespace flash_hopper::sm90
