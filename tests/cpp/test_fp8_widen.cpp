// Host test of the integer FP8 widening (kernels/include/flash_hopper/fp8_widen.h) that the decode
// kernel runs below sm_89: every pair of bytes in both halves of a register, e4m3 and e5m2,
// against the formats' definitions (OCP FP8: e4m3 without infinities, its NaN exponent and
// mantissa all ones; e5m2 IEEE-like) decoded here from their bits, and the fp16 the kernel gets
// decoded from its bits. The e4m3 lanes times kE4m3HalfScale must be the value exactly (and a
// value fp16 holds, so the kernel's fp16 multiply is exact too); NaNs must stay NaNs.
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "flash_hopper/fp8_widen.h"
#include "host_check.h"

namespace fp8 = flash_hopper::fp8;

// A value of a sign / exponent / mantissa format with IEEE-style subnormals: exponent field e of
// e_bits bits with the given bias, mantissa field m of m_bits bits.
static double ieee_like(int sign, int e, int m, int m_bits, int bias) {
  const double frac = std::ldexp(static_cast<double>(m), -m_bits);
  const double mag = e == 0 ? std::ldexp(frac, 1 - bias) : std::ldexp(1.0 + frac, e - bias);
  return sign ? -mag : mag;
}

static double e4m3_value(unsigned b) {
  const int s = (b >> 7) & 1, e = (b >> 3) & 0xf, m = b & 7;
  if (e == 15 && m == 7) {
    return NAN;
  }
  return ieee_like(s, e, m, 3, 7);
}

static double e5m2_value(unsigned b) {
  const int s = (b >> 7) & 1, e = (b >> 2) & 0x1f, m = b & 3;
  if (e == 31) {
    return m == 0 ? (s ? -INFINITY : INFINITY) : NAN;
  }
  return ieee_like(s, e, m, 2, 15);
}

static double half_value(unsigned h) {
  const int s = (h >> 15) & 1, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 31) {
    return m == 0 ? (s ? -INFINITY : INFINITY) : NAN;
  }
  return ieee_like(s, e, m, 10, 15);
}

// Whether fp16 holds v exactly (a finite v; for the multiply's result).
static bool half_holds(double v) {
  if (v == 0.0) {
    return true;
  }
  int exp = 0;
  std::frexp(std::fabs(v), &exp);  // |v| in [2^(exp-1), 2^exp)
  const int lsb = (exp - 1 >= -14 ? exp - 1 : -14) - 10;  // the last mantissa bit's weight
  const double q = std::ldexp(std::fabs(v), -lsb);
  return std::fabs(v) < 65520.0 && q == std::floor(q);
}

static bool same(double got, double want) {
  return (std::isnan(got) && std::isnan(want)) || (got == want && std::signbit(got) == std::signbit(want));
}

int main() {
  int nan_e4m3 = 0;
  for (unsigned hi = 0; hi < 256; ++hi) {
    for (unsigned lo = 0; lo < 256; ++lo) {
      const unsigned pair = lo | (hi << 8);
      // the pair as bytes 0-1 and, with other bytes beside it, as bytes 2-3
      const uint32_t as_low = pair | (0xa5u << 16) | (0x5au << 24);
      const uint32_t as_high = (pair << 16) | 0x7fc3u;
      const uint32_t lanes[2] = {fp8::low_pair_lanes(as_low), fp8::high_pair_lanes(as_high)};
      for (uint32_t l : lanes) {
        CHECK(l == ((lo << 8) | (hi << 24)), "lanes of 0x%04x: 0x%08x", pair, l);
        const uint32_t e5 = fp8::e5m2_lanes_to_half2(l);
        const uint32_t e4 = fp8::e4m3_lanes_to_scaled_half2(l);
        const unsigned bytes[2] = {lo, hi};
        for (int k = 0; k < 2; ++k) {
          const unsigned h5 = (e5 >> (16 * k)) & 0xffffu;
          const unsigned h4 = (e4 >> (16 * k)) & 0xffffu;
          CHECK(same(half_value(h5), e5m2_value(bytes[k])), "e5m2 0x%02x: fp16 0x%04x", bytes[k],
                h5);
          const double scaled = half_value(h4);
          const double want = e4m3_value(bytes[k]);
          const double got = scaled * fp8::kE4m3HalfScale;
          CHECK(same(got, want), "e4m3 0x%02x: fp16 0x%04x x %g = %g, want %g", bytes[k], h4,
                double(fp8::kE4m3HalfScale), got, want);
          CHECK(std::isnan(want) || (half_holds(scaled) && half_holds(got)),
                "e4m3 0x%02x: %g or %g is not an fp16 value", bytes[k], scaled, got);
          nan_e4m3 += std::isnan(want) ? 1 : 0;
        }
      }
    }
  }
  // 0x7f / 0xff in either lane of either half: 2 x 2 x 2 x 256 lanes
  CHECK(nan_e4m3 == 2 * 2 * 2 * 256, "e4m3 NaN lanes seen: %d", nan_e4m3);
  // spot values that pin the formats themselves (a decoder error would pass the loop above)
  CHECK(e4m3_value(0x7e) == 448.0 && e4m3_value(0x01) == std::ldexp(1.0, -9) &&
            e4m3_value(0x38) == 1.0 && e4m3_value(0xb8) == -1.0,
        "e4m3 reference");
  CHECK(e5m2_value(0x7b) == 57344.0 && e5m2_value(0x01) == std::ldexp(1.0, -16) &&
            e5m2_value(0x3c) == 1.0 && std::isinf(e5m2_value(0x7c)),
        "e5m2 reference");
  CHECK(half_value(0x3c00) == 1.0 && half_value(0x0001) == std::ldexp(1.0, -24), "fp16 reference");
  return host_check_exit();
}
