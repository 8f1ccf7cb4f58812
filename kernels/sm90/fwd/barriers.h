// The FA-3 forward's named barriers: their ids and the consumer warpgroups' ping-pong. The
// mbarriers of its pipelines and named_barrier_sync: common/barriers.h.
#pragma once

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

namespace flash_hopper::sm90 {

// Named-barrier ids (CUTLASS reserves the first ReservedNamedBarrierCount = 8 of the 16).
inline constexpr int kMaxConsumerWgs = 3;
enum class FwdBarrier : uint32_t {
  kPingPong0 = 0,  // kPingPong0 + c: consumer WG c may issue its GEMMs
  kOStage0 = kMaxConsumerWgs,  // kOStage0 + c: consumer WG c's O staging (epilogue.h)
};
static_assert(static_cast<uint32_t>(FwdBarrier::kOStage0) + kMaxConsumerWgs <=
                  16 - cutlass::arch::NamedBarrier::ReservedNamedBarrierCount,
              "named barrier ids exceed the hardware's 16");

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
