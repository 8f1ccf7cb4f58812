// The score transform's constants and fast math, once for every kernel and for the host code that
// derives the kernels' parameters (kernels/src/score_transform.h). The kernels exponentiate in
// base 2 (exp2 is one MUFU instruction): scores take a factor log2(e) on the way in, LSEs a factor
// ln(2) on the way out. Softcap's tanh is the MUFU's approximation on every path.
#pragma once

namespace flash_hopper {

inline constexpr float kLog2e = 1.4426950408889634f;  // log2(e)
inline constexpr float kLn2 = 0.6931471805599453f;    // ln(2) = 1 / log2(e)

#if defined(__CUDACC__)
// tanh.approx.f32 (sm_75 and up): one MUFU.TANH.
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

}  // namespace flash_hopper
