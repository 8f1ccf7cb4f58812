// What one CTA of the FA-3 path may hold on sm_90 (H100 / H200 SXM), forward and backward: the
// opt-in shared memory per block, the register file, and the setmaxnreg split of the registers
// between the producer warpgroup and the consumer warpgroups. The tuned-config tables
// (fwd/tile_config.h, bwd/tile_config.h) size their tiles against these.
#pragma once

namespace flash_hopper::sm90 {

// Shared memory a block may opt into on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin).
inline constexpr int kSmemOptinBytes = 232448;
inline constexpr int kRegistersPerSm = 65536;

// Register budget moved by setmaxnreg. The launch gives every thread R0 = floor(65536 / T / 8) * 8
// registers (T = 128 * (1 + W) threads); the producer warpgroup gives back down to kProducer and
// the W consumer warpgroups grow to kConsumer, within the CTA's allocation:
//   128 * kProducer + 128 * W * kConsumer <= T * R0
// (setmaxnreg.inc blocks until the pool has the registers, so an over-ask hangs: checked below).
template <int kConsumerWgs, bool kWideProducer = false>
struct RegisterBudget {
  static constexpr int kThreads = 128 * (1 + kConsumerWgs);
  static constexpr int kLaunch = kRegistersPerSm / kThreads / 8 * 8;
  // 2 WGs: 24 / 240 (168 at launch); 3 WGs: 32 / 160 (128 at launch). The producer needs only
  // addressing and loop state (FP8's transposer warps too: two ldmatrix units in flight at most,
  // one in the 24-register varlen kernels, fwd/transpose.h); the consumers hold O, S and P (FP8
  // d256 needs all 240: O 128 + its two-level accumulator's part 64 + P 16 and the WGMMA
  // descriptors; 232 spilled).
  // kWideProducer (the mixed mode's converter warps, fwd/convert.h: several 16-byte loads in
  // flight): 40 / 232 with 2 WGs.
  static_assert(!kWideProducer || kConsumerWgs == 2, "a wide producer leaves 2 WGs 232 each");
  static constexpr int kProducer = kConsumerWgs == 2 ? (kWideProducer ? 40 : 24) : 32;
  static constexpr int kConsumer = kConsumerWgs == 2 ? (kWideProducer ? 232 : 240) : 160;
  static_assert(128 * kProducer + 128 * kConsumerWgs * kConsumer <= kThreads * kLaunch,
                "setmaxnreg budget exceeds the CTA's register allocation (would hang)");
  static_assert(kConsumer % 8 == 0 && kProducer % 8 == 0 && kConsumer <= 256 && kProducer >= 24);
};

}  // namespace flash_hopper::sm90
