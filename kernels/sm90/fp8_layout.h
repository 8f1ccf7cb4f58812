// The FP8 forward's register and shared-memory orders, in plain C++ (host-testable:
// tests/cpp/test_fp8_layout.cpp checks them against the PTX fragment layouts and the
// shared-memory banks).
//
// P (the PV GEMM's A operand) comes from registers. For FP8 (k = 32) a thread's register j of a
// 32-key slice holds 4 consecutive k positions of one row: j = 0: slots 4t..4t+3 of row g, j = 1:
// the same slots of row g + 8, j = 2 / 3: slots 16 + 4t.. of rows g / g + 8 (t = lane % 4,
// g = lane / 4 within the warp's 16 rows). The S accumulator gives that thread keys 2t, 2t + 1 of
// every 8-key group instead. Rather than moving values between threads, P is packed in place
// (p_source) and the V^T buffer stores its keys in the matching order (key_of_slot): slot
// 16h + 4t + i of a 32-key slice holds key 16h + 2t + {0, 1, 8, 9}[i]. The PV GEMM sums over the
// slots, so it computes exactly sum_key P[key] V[key].
#pragma once

#include "flash_hopper/host_device.h"

namespace flash_hopper::sm90 {

// Key (within its 32-key slice) held by V^T slot s.
FH_HOST_DEVICE constexpr int key_of_slot(int s) {
  const int h = s / 16, t = (s % 16) / 4, i = s % 4;
  return 16 * h + 2 * t + (i < 2 ? i : i + 6);
}

// Index in the S accumulator fragment ((2 cols, 2 rows, N/8) flattened: col + 2 row + 4 group)
// of the value that goes to byte b of P register j in k32 slice kk.
FH_HOST_DEVICE constexpr int p_source(int kk, int j, int b) {
  return 16 * kk + (j / 2) * 8 + (j % 2) * 2 + (b < 2 ? b : b + 2);
}

// The transposer's lane -> (slot group, column group) map for one 64-key x 32-column unit at
// iteration m (0..3): slots 4u..4u+3 of the unit's 64 and columns 4q..4q+3 of its 32. Every LDS
// and STS of a warp hits 32 distinct banks under the 128-byte swizzle of both buffers.
struct TransposeLane {
  int u;
  int q;
};
FH_HOST_DEVICE constexpr TransposeLane transpose_lane(int lane, int m) {
  const int t = lane & 3, h = (lane >> 2) & 1, c = (lane >> 3) & 1, ql = (lane >> 4) & 1;
  return {8 * c + 4 * h + t, (ql + 2 * m + 2 * h + 4 * c) & 7};
}

}  // namespace flash_hopper::sm90
