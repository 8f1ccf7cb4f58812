// The FA-3 path's shared-memory pipelines (Q, K, V): stages, arrival counts and the stage / phase
// bookkeeping of both ends. Plain C++: the kernel instantiates the ends with the mbarriers of
// barriers.h, the host test (tests/cpp/test_fwd_schedule.cpp) with a recorder, so what the test
// walks is this code.
//
// One pipeline of kStages buffers between the producer warp and kConsumerWgs consumer warpgroups:
//   full[s]   kFullArrivals = 1: the producer's elected thread arrives with the transaction bytes
//             (arrive_and_expect_tx) and issues the TMA load, which completes the bytes.
//   empty[s]  kEmptyArrivals = kConsumerWgs (x kPeers with multicast): one thread per consumer
//             warpgroup arrives once the warpgroup's reads of the buffer (its WGMMAs) completed.
// The FP8 forward's V^T pipeline is written by threads, not by TMA (WriterEnd): kFullArrivals is
// then the number of writer warps, each arriving once its stores are fenced; its V pipeline's
// "consumers" (kEmptyArrivals) are those warps.
// Phases: consumers first wait on parity 0 of full[s]; the producer starts on parity 1 of
// empty[s], which an mbarrier reports as already completed, so fresh buffers are free.
#pragma once

#include <cstdint>

#include "flash_hopper/host_device.h"

namespace flash_hopper::sm90 {

template <int kStages>
struct PipelineState {
  int index = 0;
  uint32_t phase = 0;

  FH_HOST_DEVICE void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1;
    }
  }
};

// kPeers: the CTAs of a cluster whose buffers one load fills (K / V multicast, fwd/kernel_traits.h
// kClusterM): each CTA's loads write every peer's stage, so a stage is empty once the consumer
// warpgroups of every peer released it; they arrive on each peer's empty barrier.
template <int kStages_, int kConsumerWgs_, int kFullArrivals_ = 1, int kPeers_ = 1>
struct PipelineSpec {
  static constexpr int kStages = kStages_;
  static constexpr int kConsumerWgs = kConsumerWgs_;
  static constexpr int kFullArrivals = kFullArrivals_;
  static constexpr int kPeers = kPeers_;
  static constexpr int kEmptyArrivals = kConsumerWgs_ * kPeers_;
  static_assert(kStages >= 1 && kConsumerWgs >= 1 && kFullArrivals >= 1 && kPeers >= 1);
};

// Barriers: the mbarrier operations on stage s of one pipeline (device: barriers.h):
//   wait_empty(s, phase), arrive_full_tx(s, bytes), arrive_full(s), wait_full(s, phase),
//   arrive_empty(s).

// The producer's end: acquire the next buffer, announce its bytes and issue its load, advance.
template <class Spec, class Barriers>
struct ProducerEnd {
  Barriers bar;
  PipelineState<Spec::kStages> state{0, 1};

  // Waits until the next buffer is free; then the leader thread announces `bytes` on its full
  // barrier and calls issue(stage) to start the load that completes them.
  template <class Issue>
  FH_HOST_DEVICE void load(bool leader, uint32_t bytes, Issue&& issue) {
    bar.wait_empty(state.index, state.phase);
    if (leader) {
      bar.arrive_full_tx(state.index, bytes);
      issue(state.index);
    }
    state.advance();
  }
};

// The end of a pipeline whose buffers threads write (FP8's V^T): acquire() waits until the next
// buffer is free, the writers store and fence, then each writer group's leader commits.
template <class Spec, class Barriers>
struct WriterEnd {
  Barriers bar;
  PipelineState<Spec::kStages> state{0, 1};

  FH_HOST_DEVICE int stage() const { return state.index; }
  FH_HOST_DEVICE void acquire() { bar.wait_empty(state.index, state.phase); }
  FH_HOST_DEVICE void commit(bool leader) {
    if (leader) {
      bar.arrive_full(state.index);
    }
    state.advance();
  }
};

// A consumer warpgroup's end: wait until the next buffer is full, read it (stage()), release it.
// Buffers are released in the order they were waited for, each exactly once.
template <class Spec, class Barriers>
struct ConsumerEnd {
  Barriers bar;
  PipelineState<Spec::kStages> state{0, 0};

  FH_HOST_DEVICE int stage() const { return state.index; }
  FH_HOST_DEVICE void wait() { bar.wait_full(state.index, state.phase); }
  // wg_leader: the one thread of the warpgroup that arrives (kEmptyArrivals counts warpgroups).
  FH_HOST_DEVICE void release(bool wg_leader) {
    if (wg_leader) {
      bar.arrive_empty(state.index);
    }
    state.advance();
  }
};

}  // namespace flash_hopper::sm90
