// Event timeline of the FA-3 forward, for libraries built with FH_TIMELINE=ON (CMake; it defines
// FH_TIMELINE). Other builds compile every mark to nothing. It shows where each warpgroup's step
// spends its cycles (waits on the tensor cores, softmax, ping-pong turns, pipeline barriers), which
// the profiler's per-instruction stall counts do not order in time.
//
// The first kTimelineCtas CTAs record, lane 0 of each warp: slot 0 of the warp's kTimelineSlots
// holds the number of events, slots 1.. the events as (clock64() << 8) | event id. clock64 is the
// SM's cycle counter, so the events of one CTA share one clock. The buffer (FwdParams::timeline,
// set with fh_debug_set_timeline) is read by bench/timeline.py, which knows these ids.
#pragma once

#include <cute/config.hpp>
#include <cstdint>

namespace flash_hopper::sm90 {

enum class Ev : uint32_t {
  // consumer warpgroups (their first warp records)
  kKWait = 1,      // before waiting for a K stage
  kKReady = 2,     // it is full
  kTurnWait = 3,   // before waiting for the ping-pong turn
  kTurn = 4,       // the turn is ours
  kQkIssued = 5,   // S = Q K^T issued
  kVWait = 6,      // before waiting for a V (FP8: V^T) stage
  kVReady = 7,
  kPvIssued = 8,   // O += P V issued
  kSReady = 9,      // S complete, PV may still run (wait_group 1)
  kSoftmaxDone = 10,
  kGemmsDone = 11,  // every issued GEMM complete (wait_group 0: PV, or S in the sequential loop)
  kPReady = 12,     // P converted for the next PV
  kTileDone = 13,   // a tile's epilogue stored
  kPvDone = 14,     // a PV GEMM waited for where it is issued (drain, FP8 d256's parts)
  // transposer warps (FP8)
  kTrVReady = 20,  // a V stage arrived
  kTrVtFree = 21,  // its V^T stage is free
  kTrDone = 22,    // V^T written and published
};

inline constexpr int kTimelineCtas = 2;
inline constexpr int kTimelineWarps = 16;     // the largest CTA: 4 warpgroups
inline constexpr int kTimelineSlots = 8192;   // per warp, slot 0 the count
inline constexpr long long kTimelineBytes =
    8LL * kTimelineCtas * kTimelineWarps * kTimelineSlots;

struct Timeline {
#ifdef FH_TIMELINE
  unsigned long long* slots = nullptr;  // this warp's, or null (not recording)
  int count = 0;
  CUTE_DEVICE explicit Timeline(unsigned long long* buffer) {
    if (buffer != nullptr && blockIdx.x < kTimelineCtas && threadIdx.x % 32 == 0) {
      slots = buffer + (int64_t(blockIdx.x) * kTimelineWarps + threadIdx.x / 32) * kTimelineSlots;
    }
  }
  CUTE_DEVICE void mark(Ev e) {
    if (slots != nullptr && count < kTimelineSlots - 1) {
      slots[1 + count] = (static_cast<unsigned long long>(clock64()) << 8) | uint32_t(e);
      slots[0] = ++count;
    }
  }
#else
  CUTE_DEVICE explicit Timeline(unsigned long long*) {}
  CUTE_DEVICE void mark(Ev) {}
#endif
};

}  // namespace flash_hopper::sm90
