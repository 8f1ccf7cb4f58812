// Event timeline of the FA-3 forward, for libraries built with FH_TIMELINE=ON: its event ids and
// its recorder, the shared per-warp one (flash_hopper/timeline.h holds the buffer layout). It
// shows where each warpgroup's step spends its cycles (waits on the tensor cores, softmax,
// ping-pong turns, pipeline barriers), which the profiler's per-instruction stall counts do not
// order in time. bench/timeline.py reads the buffer and knows these ids.
#pragma once

#include <cstdint>

#include "flash_hopper/timeline.h"

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

using Timeline = WarpTimeline<Ev>;

}  // namespace flash_hopper::sm90
