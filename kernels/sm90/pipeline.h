// Synchronization of the FA-3 path: the K/V stage pipelines (mbarriers) and the named barriers.
//
// Counts (asserted where the kernel is assembled, fwd_kernel.h):
//   full[s]  (ClusterTransactionBarrier): 1 arrival, the producer's arrive_and_expect_tx; the TMA
//            completes the transaction bytes.
//   empty[s] (ClusterBarrier): one arrival per consumer warpgroup (thread 0 of the WG, after the
//            WG's WGMMAs reading the stage completed).
// Phases: consumers start waiting on parity 0 of full; the producer starts on parity 1 of empty,
// which an mbarrier reports as already completed, so fresh stages are free.
#pragma once

#include <cute/config.hpp>
#include <cutlass/arch/barrier.h>

namespace flash_hopper::sm90 {

template <int kStages>
struct PipelineState {
  int index = 0;
  uint32_t phase = 0;

  CUTE_DEVICE void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1;
    }
  }
};

template <int kStages>
CUTE_DEVICE PipelineState<kStages> producer_start_state() {
  return {0, 1};
}

// Named-barrier ids (CUTLASS adds its ReservedNamedBarrierCount = 8; the hardware has 16).
enum class FwdBarrier : uint32_t {
  kPingPong0 = 0,  // kPingPong0 + c: consumer WG c may issue its GEMMs
};
inline constexpr int kMaxConsumerWgs = 3;
static_assert(static_cast<uint32_t>(FwdBarrier::kPingPong0) + kMaxConsumerWgs <=
                  16 - cutlass::arch::NamedBarrier::ReservedNamedBarrierCount,
              "named barrier ids exceed the hardware's 16");

CUTE_DEVICE void barrier_sync(FwdBarrier id, int num_threads) {
  cutlass::arch::NamedBarrier::sync(num_threads, static_cast<uint32_t>(id));
}
CUTE_DEVICE void barrier_arrive(FwdBarrier id, int num_threads) {
  cutlass::arch::NamedBarrier::arrive(num_threads, static_cast<uint32_t>(id));
}
CUTE_DEVICE FwdBarrier pingpong_barrier(int consumer_wg) {
  return static_cast<FwdBarrier>(static_cast<uint32_t>(FwdBarrier::kPingPong0) + consumer_wg);
}

// Ping-pong of the consumer warpgroups: WG c waits for its turn before issuing its GEMMs and
// passes the turn to WG (c + 1) % W right after issuing them. Each barrier has 256 participants:
// the 128 threads of the WG that waits and the 128 of the WG that hands over.
template <int kConsumerWgs>
struct PingPong {
  static constexpr int kThreads = 2 * 128;
  bool enabled;
  int wg;

  CUTE_DEVICE void wait_turn() const {
    if (enabled) {
      barrier_sync(pingpong_barrier(wg), kThreads);
    }
  }
  CUTE_DEVICE void pass_turn() const {
    if (enabled) {
      barrier_arrive(pingpong_barrier((wg + 1) % kConsumerWgs), kThreads);
    }
  }
  // WG 0 takes the first turn: it arrives on its own barrier once, so its first wait passes.
  CUTE_DEVICE void start() const {
    if (enabled && wg == 0) {
      barrier_arrive(pingpong_barrier(0), kThreads);
    }
  }
};

}  // namespace flash_hopper::sm90
