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

// The transposer's unit: one 32-key slice x 16 columns of V (512 bytes) per warp instruction pair.
// - ldmatrix.trans (.x4, b16): matrix m is keys 8m..8m+7 of the slice, 16 column bytes each (lane l
//   gives the address of key l); lane l (q = l % 4, c = l / 4) then holds in register m the bytes
//   (key 8m + 2q, column 2c), (8m + 2q, 2c + 1), (8m + 2q + 1, 2c), (8m + 2q + 1, 2c + 1).
// - Byte permutes of registers 2h, 2h + 1 (kPermEven / kPermOdd) give column 2c (2c + 1) at keys
//   16h + 2q + {0, 1, 8, 9}: exactly V^T slots 16h + 4q .. 16h + 4q + 3 (key_of_slot).
// - stmatrix (.x4, b16): register m of lane l is row l / 4, bytes 4 (l % 4) .. + 3 of matrix m;
//   matrix m's row j is V^T row (column of V) 2j + odd (odd = (j / 4) ^ (m % 2)) at slots
//   16 (m / 2) .. + 15 of the slice, so lane l stores its odd column in register m where
//   stsm_odd_column(l, m) and gives the address of row l % 8 of matrix l / 8 (stsm_row). Rows 2j
//   alone (odd = m % 2) would put two rows of a phase on the same banks under the 128-byte
//   swizzle; this mix makes every phase conflict-free (tests/cpp/test_fp8_layout.cpp).
inline constexpr unsigned kPermEven = 0x6420;  // bytes 0, 2 of the first register, 0, 2 of the second
inline constexpr unsigned kPermOdd = 0x7531;
FH_HOST_DEVICE constexpr int stsm_odd_column(int lane, int m) { return (lane / 16) ^ (m % 2); }
struct StsmRow {
  int col;   // column of V (row of V^T) relative to the unit's first
  int slot;  // slot relative to the slice's first
};
FH_HOST_DEVICE constexpr StsmRow stsm_row(int lane) {
  const int m = lane / 8, j = lane % 8;
  return {2 * j + ((j / 4) ^ (m % 2)), 16 * (m / 2)};
}

}  // namespace flash_hopper::sm90
