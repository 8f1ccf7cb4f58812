// The register-fragment layouts of the FA-2 backward's ten MMA operands (bwd_kernel.h), written
// out per tile config.
//
// Why: `thr_mma.partition_fragment_A/B(sX)` on a swizzled shared-memory view derives the
// fragment through CuTe's swizzle slicing (slice_and_offset of a ComposedLayout: the strides
// that hit the swizzle's bits become dynamic, which splits and reorders the modes) and costs
// cicc's front end much of its template instantiation per view. Those operations only decide the
// fragment's TYPE: the fragment is an owning register array with a static layout. Naming that
// layout here gives the kernel the identical type without the algebra (the compiler's memory:
// bench/PERFLOG.md "The FA-2 backward's compiler memory"). No cheaper CuTe derivation gives the
// same layouts: from the unswizzled layout (layout_b()), a plain row- or column-major layout of
// the view's shape, or partition_shape_A/B, 8 of the 30 (config, operand) pairs get a different
// register order (the swizzle's dynamic strides sort after the static ones).
//
// tests/cpp/test_sm80_bwd_fragments.cpp checks every entry against CuTe's own derivation
// (std::is_same of the fragment tensor types, bf16 and fp16, each config's tuned and fallback
// traits) and that every head dim of bwd_tile_config has an entry; a config without one (a new
// tile) falls back to partition_fragment_A/B (the void members below), so a missing entry costs
// compiler memory, never correctness. Regenerate the entries with the test's -DFH_PRINT_TABLE.
#pragma once

#include <cute/layout.hpp>

namespace flash_hopper::sm80 {

using cute::Int;
using cute::Layout;
using cute::Shape;
using cute::Stride;

// Keyed by the tile config's fields that the fragments depend on (not the stages, not the dtype).
template <int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kAtomMSdP, int kAtomNdKV,
          int kAtomMdQ>
struct BwdFragmentLayouts {
  using SdpA = void;  // (MMA,MMA_M,MMA_K) of sQ / sdO, tiled MMA SdP
  using SdpB = void;  // (MMA,MMA_N,MMA_K) of sK / sV
  using DkvA = void;  // (MMA,MMA_N,MMA_M) of sPt / sdSt, tiled MMA dKV
  using DkvB = void;  // (MMA,MMA_D,MMA_M) of sdOt / sQt
  using DqA = void;   // (MMA,MMA_M,MMA_N) of sdS, tiled MMA dQ
  using DqB = void;   // (MMA,MMA_D,MMA_N) of sKt
};

template <>
struct BwdFragmentLayouts<64, 128, 128, 8, 2, 4, 4> {
  using SdpA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<4>, Shape<Int<2>, Int<2>>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<8>, Stride<Int<32>, Int<64>>>>;
  using SdpB = Layout<Shape<Shape<Int<2>, Int<2>>, Int<4>, Shape<Int<2>, Int<2>>>, Stride<Stride<Int<1>, Int<2>>, Int<4>, Stride<Int<16>, Int<32>>>>;
  using DkvA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<2>, Int<8>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<64>, Int<8>>>;
  using DkvB = Layout<Shape<Shape<Int<2>, Int<2>>, Shape<Int<2>, Int<2>>, Int<8>>, Stride<Stride<Int<1>, Int<2>>, Stride<Int<32>, Int<64>>, Int<4>>>;
  using DqA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<2>, Shape<Shape<Int<2>, Int<2>>, Int<2>>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<8>, Stride<Stride<Int<32>, Int<64>>, Int<16>>>>;
  using DqB = Layout<Shape<Shape<Int<2>, Int<2>>, Shape<Int<2>, Int<2>>, Int<8>>, Stride<Stride<Int<1>, Int<2>>, Stride<Int<32>, Int<64>>, Int<4>>>;
};

template <>
struct BwdFragmentLayouts<96, 64, 128, 8, 2, 4, 4> {
  using SdpA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<2>, Shape<Int<2>, Int<3>>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<8>, Stride<Int<48>, Int<16>>>>;
  using SdpB = Layout<Shape<Shape<Int<2>, Int<2>>, Int<4>, Shape<Int<2>, Int<3>>>, Stride<Stride<Int<1>, Int<2>>, Int<4>, Stride<Int<48>, Int<16>>>>;
  using DkvA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<2>, Int<4>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<32>, Int<8>>>;
  using DkvB = Layout<Shape<Shape<Int<2>, Int<2>>, Shape<Int<2>, Int<3>>, Int<4>>, Stride<Stride<Int<1>, Int<2>>, Stride<Int<48>, Int<16>>, Int<4>>>;
  using DqA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<1>, Shape<Shape<Int<2>, Int<2>>, Int<2>>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<0>, Stride<Stride<Int<16>, Int<32>>, Int<8>>>>;
  using DqB = Layout<Shape<Shape<Int<2>, Int<2>>, Shape<Int<2>, Int<3>>, Int<8>>, Stride<Stride<Int<1>, Int<2>>, Stride<Int<96>, Int<32>>, Int<4>>>;
};

template <>
struct BwdFragmentLayouts<128, 64, 128, 8, 2, 4, 2> {
  using SdpA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<2>, Shape<Shape<Int<2>, Int<2>>, Int<2>>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<8>, Stride<Stride<Int<32>, Int<64>>, Int<16>>>>;
  using SdpB = Layout<Shape<Shape<Int<2>, Int<2>>, Int<4>, Shape<Shape<Int<2>, Int<2>>, Int<2>>>, Stride<Stride<Int<1>, Int<2>>, Int<4>, Stride<Stride<Int<32>, Int<64>>, Int<16>>>>;
  using DkvA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<2>, Int<4>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<32>, Int<8>>>;
  using DkvB = Layout<Shape<Shape<Int<2>, Int<2>>, Shape<Shape<Int<2>, Int<2>>, Int<2>>, Int<4>>, Stride<Stride<Int<1>, Int<2>>, Stride<Stride<Int<32>, Int<64>>, Int<16>>, Int<4>>>;
  using DqA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<2>, Shape<Shape<Int<2>, Int<2>>, Int<2>>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<8>, Stride<Stride<Int<32>, Int<64>>, Int<16>>>>;
  using DqB = Layout<Shape<Shape<Int<2>, Int<2>>, Shape<Int<2>, Int<2>>, Int<8>>, Stride<Stride<Int<1>, Int<2>>, Stride<Int<64>, Int<32>>, Int<4>>>;
};

template <>
struct BwdFragmentLayouts<192, 64, 64, 8, 4, 2, 2> {
  using SdpA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<1>, Shape<Shape<Int<2>, Int<2>>, Int<3>>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<0>, Stride<Stride<Int<24>, Int<48>>, Int<8>>>>;
  using SdpB = Layout<Shape<Shape<Int<2>, Int<2>>, Int<4>, Shape<Shape<Int<2>, Int<2>>, Int<3>>>, Stride<Stride<Int<1>, Int<2>>, Int<4>, Stride<Stride<Int<48>, Int<96>>, Int<16>>>>;
  using DkvA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<2>, Int<4>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<8>, Int<16>>>;
  using DkvB = Layout<Shape<Shape<Int<2>, Int<2>>, Shape<Int<2>, Int<3>>, Int<4>>, Stride<Stride<Int<1>, Int<2>>, Stride<Int<48>, Int<16>>, Int<4>>>;
  using DqA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<2>, Shape<Int<2>, Int<2>>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<8>, Stride<Int<16>, Int<32>>>>;
  using DqB = Layout<Shape<Shape<Int<2>, Int<2>>, Shape<Int<2>, Int<3>>, Int<4>>, Stride<Stride<Int<1>, Int<2>>, Stride<Int<48>, Int<16>>, Int<4>>>;
};

template <>
struct BwdFragmentLayouts<256, 64, 64, 8, 4, 2, 2> {
  using SdpA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<1>, Shape<Shape<Int<2>, Int<2>>, Int<4>>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<0>, Stride<Stride<Int<32>, Int<64>>, Int<8>>>>;
  using SdpB = Layout<Shape<Shape<Int<2>, Int<2>>, Int<4>, Shape<Shape<Int<2>, Int<2>>, Int<4>>>, Stride<Stride<Int<1>, Int<2>>, Int<4>, Stride<Stride<Int<64>, Int<128>>, Int<16>>>>;
  using DkvA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<2>, Int<4>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<8>, Int<16>>>;
  using DkvB = Layout<Shape<Shape<Int<2>, Int<2>>, Shape<Int<2>, Int<4>>, Int<4>>, Stride<Stride<Int<1>, Int<2>>, Stride<Int<64>, Int<16>>, Int<4>>>;
  using DqA = Layout<Shape<Shape<Int<2>, Int<2>, Int<2>>, Int<2>, Shape<Int<2>, Int<2>>>, Stride<Stride<Int<1>, Int<2>, Int<4>>, Int<8>, Stride<Int<16>, Int<32>>>>;
  using DqB = Layout<Shape<Shape<Int<2>, Int<2>>, Shape<Int<2>, Int<4>>, Int<4>>, Stride<Stride<Int<1>, Int<2>>, Stride<Int<64>, Int<16>>, Int<4>>>;
};

}  // namespace flash_hopper::sm80
