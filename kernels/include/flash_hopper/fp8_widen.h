// FP8 (e4m3 / e5m2) to fp16 with integer operations, for code compiled below sm_89, where PTX has
// no cvt.rn.f16x2.e4m3x2 / .e5m2x2: the decode kernel's compute_80 code, which every 8.x GPU runs
// (its sm_80 SASS) and GPUs after sm_90 JIT (its PTX). Two values at a time, each in the high byte
// of a 16-bit lane, so that one 32-bit register holds a half2. Plain C++:
// tests/cpp/test_fp8_widen.cpp checks every byte against the formats' definition.
#pragma once

#include <cstdint>

#include "flash_hopper/host_device.h"

namespace flash_hopper {
namespace fp8 {

// Bytes 0 and 1 of x as the high bytes of lanes 0 and 1 (their low bytes zero).
FH_HOST_DEVICE constexpr uint32_t low_pair_lanes(uint32_t x) {
  return ((x & 0xffu) << 8) | ((x & 0xff00u) << 16);
}

// Bytes 2 and 3 of x likewise.
FH_HOST_DEVICE constexpr uint32_t high_pair_lanes(uint32_t x) {
  return ((x >> 8) & 0xff00u) | (x & 0xff000000u);
}

// e5m2 is fp16's high byte (sign, the same 5-bit exponent and bias, 2 of the 10 mantissa bits):
// the lanes are the two fp16 values exactly, infinities and NaNs included.
FH_HOST_DEVICE constexpr uint32_t e5m2_lanes_to_half2(uint32_t lanes) { return lanes; }

// The factor that takes e4m3_lanes_to_scaled_half2's values to the e4m3 values: exact in fp16.
constexpr float kE4m3HalfScale = 256.f;

// Two e4m3 values as fp16 values 2^-8 times theirs: the sign stays in place, and e4m3's 4 exponent
// and 3 mantissa bits become fp16's low 4 exponent bits and top 3 mantissa bits. With e4m3's
// exponent bias 7 against fp16's 15, every finite e4m3 value, subnormals included (they land on
// fp16's subnormals with the same mantissa), reads as 2^-8 of itself, so a multiply by
// kE4m3HalfScale gives it exactly. e4m3 has no infinities; its NaN (exponent and mantissa all
// ones) gets fp16's top exponent bit too, i.e. stays a NaN.
FH_HOST_DEVICE constexpr uint32_t e4m3_lanes_to_scaled_half2(uint32_t lanes) {
  const uint32_t bits = (lanes & 0x80008000u) | ((lanes >> 1) & 0x3f803f80u);
  // exponent and mantissa all ones (a NaN) carry into bit 14 of its lane, and only they do
  return bits | (((bits & 0x3f803f80u) + 0x00800080u) & 0x40004000u);
}

}  // namespace fp8
}  // namespace flash_hopper
