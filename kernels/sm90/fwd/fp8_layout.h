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

#include <cstdint>

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

// A K-major shared-memory buffer of 1-byte elements as kernel_traits.h builds V and V^T:
// tile_to_shape of the widest GMMA atom whose row (128, 64 or 32 bytes) divides a buffer row
// (k_major_smem_atom: 8 rows under Swizzle<3 / 2 / 1, 4, 3>), tiled down the rows, then across the
// column blocks, then over the stages. The swizzle XORs the row within the atom (offset bits 7..)
// into the 16-byte chunk within the row (bits 4..).
struct KMajorBytes {
  int rows;  // per stage
  int cols;  // bytes per row
  FH_HOST_DEVICE constexpr int row_bytes() const {
    return cols % 128 == 0 ? 128 : cols % 64 == 0 ? 64 : 32;
  }
  FH_HOST_DEVICE constexpr uint32_t stage_bytes() const { return uint32_t(rows * cols); }
  // Byte offset of (row, col) in stage 0.
  FH_HOST_DEVICE constexpr uint32_t offset(int row, int col) const {
    const int rb = row_bytes();
    const uint32_t linear = uint32_t((col / rb) * rows * rb + row * rb + col % rb);
    return linear ^ (((linear >> 7) & uint32_t(rb / 16 - 1)) << 4);
  }
  // A warp access at rows r0 + r, columns c0 + c (r0 a multiple of 8, c0 of 16; each lane's c
  // below 16, or a bit c0 % row_bytes leaves clear) is offset(r, c) + block_rows(r0) ^
  // block_xor(c0) + block_cols(c0) or offset(r, c) ^ block_xor(c0) + block_rows(r0) +
  // block_cols(c0): the swizzle is an XOR of offset bits, so it splits over the parts; r0 moves
  // whole atoms (bits 7.. and up: added before or after the XOR alike) and leaves the atom row the
  // swizzle reads unchanged; c0's chunk within the row is XORed like the lane's own chunk; its
  // column block moves whole atom columns.
  FH_HOST_DEVICE constexpr uint32_t block_rows(int r0) const { return uint32_t(r0 * row_bytes()); }
  FH_HOST_DEVICE constexpr uint32_t block_xor(int c0) const { return uint32_t(c0 % row_bytes()); }
  FH_HOST_DEVICE constexpr uint32_t block_cols(int c0) const {
    return uint32_t((c0 / row_bytes()) * rows * row_bytes());
  }
};

// One lane's address of a unit: base + ((lane's part + pre) ^ xor) + post. The XOR reaches bits
// 4-6 only, so a base that is a multiple of 128 may as well join the lane's part: at(base, lane)
// == at(0, lane + base) (transpose.h's stmatrix addresses carry their stage that way).
struct SwizzledAccess {
  uint32_t pre, x, post;
  FH_HOST_DEVICE constexpr uint32_t at(uint32_t base, uint32_t lane_part) const {
    return base + ((lane_part + pre) ^ x) + post;
  }
};

// The transposer's addresses and work split (transpose.h) for a V tile of block_n keys x
// head_dim columns. A unit is 32 keys (n0 ..) x 16 columns (d0 ..): lane l's ldmatrix row is key
// n0 + l at columns d0.., its stmatrix row V^T row d0 + stsm_row(l).col at slot n0 +
// stsm_row(l).slot. Each lane computes its part (ld_lane / st_lane) once; a unit adds
// compile-time parts (UnitAddr), the stage a base.
// - ldmatrix: the slice's rows are added before the XOR, so units of different slices with the
//   same 16-byte chunk use different registers (the compiler would otherwise keep one register
//   per chunk alive from one slice's run to the next);
// - stmatrix: a run of units in one slice shares one register (its XOR); their columns are added
//   after it, as the instruction's immediate offset.
struct UnitAddr {
  SwizzledAccess ld;  // V
  SwizzledAccess st;  // V^T
};
struct TransposerPlan {
  KMajorBytes v;   // (block_n, head_dim, PIPE)
  KMajorBytes vt;  // (head_dim, block_n, PIPE)
  int warps;
  FH_HOST_DEVICE constexpr TransposerPlan(int block_n, int head_dim, int warps_)
      : v{block_n, head_dim}, vt{head_dim, block_n}, warps(warps_) {}
  FH_HOST_DEVICE constexpr int units() const { return v.rows / 32 * (v.cols / 16); }
  // Warp w transposes units first(w) .. first(w) + count(w) - 1 of the order below: runs as
  // even as the count allows, so each warp's list (and its code, transpose.h) is fixed at compile
  // time.
  FH_HOST_DEVICE constexpr int count(int warp) const {
    return units() / warps + (warp < units() % warps ? 1 : 0);
  }
  FH_HOST_DEVICE constexpr int first(int warp) const {
    return warp * (units() / warps) + (warp < units() % warps ? warp : units() % warps);
  }
  // Unit order: 32-key slices outer (a run of units in one slice shares the V^T XOR), then V's
  // 16-byte chunk within its row, then the column block (units that differ in the block alone
  // share the V XOR: d96 / d192 / d256).
  struct Unit {
    int n0, d0;
  };
  FH_HOST_DEVICE constexpr Unit unit(int index) const {
    const int per_slice = v.cols / 16, blocks = v.cols / v.row_bytes();
    const int j = index % per_slice;
    return {32 * (index / per_slice), (j % blocks) * v.row_bytes() + 16 * (j / blocks)};
  }
  FH_HOST_DEVICE constexpr UnitAddr addr(int index) const {
    const Unit u = unit(index);
    return {{v.block_rows(u.n0), v.block_xor(u.d0), v.block_cols(u.d0)},
            {0, vt.block_xor(u.n0), vt.block_rows(u.d0) + vt.block_cols(u.n0)}};
  }
  FH_HOST_DEVICE constexpr uint32_t ld_lane(int lane) const { return v.offset(lane, 0); }
  FH_HOST_DEVICE constexpr uint32_t st_lane(int lane) const {
    const StsmRow r = stsm_row(lane);
    return vt.offset(r.col, r.slot);
  }
};

}  // namespace flash_hopper::sm90
