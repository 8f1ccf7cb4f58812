// Shared-memory swizzle atoms of the FA-3 path's operand tiles, forward and backward.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>

namespace flash_hopper::sm90 {

using namespace cute;

// K-major swizzle atom for a row of kCols elements: the widest swizzle whose row span (128, 64 or
// 32 bytes) divides the row (the same rule as CUTLASS's ss_smem_selector).
template <class Element, int kCols>
CUTE_HOST_DEVICE constexpr auto k_major_smem_atom() {
  constexpr int kRowBytes = kCols * int(sizeof(Element));
  if constexpr (kRowBytes % 128 == 0) {
    return GMMA::Layout_K_SW128_Atom<Element>{};
  } else if constexpr (kRowBytes % 64 == 0) {
    return GMMA::Layout_K_SW64_Atom<Element>{};
  } else {
    static_assert(kRowBytes % 32 == 0, "head dim bucket must span a multiple of 32 bytes");
    return GMMA::Layout_K_SW32_Atom<Element>{};
  }
}

}  // namespace flash_hopper::sm90
