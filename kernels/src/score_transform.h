// The score transform's kernel constants, derived once for every kernel from softmax_scale and
// softcap (derive.cu defines it): FwdParams and BwdParams (derive.cu) and the decode kernel's
// DecodeParams (decode.cu). Host code on the kernels' own constants (score_math.h: log2(e)), and
// free of kernel headers, so that a kernel translation unit can include it.
#pragma once

#include "flash_hopper/score_math.h"

namespace flash_hopper {

// fwd_params.h says how the kernels use them: with softcap the exponent's scale is log2(e) alone
// (the scale is applied before tanh), without it softmax_scale * log2(e).
struct ScoreTransform {
  float softcap;     // 0: off
  float prescale;    // softmax_scale / softcap, the score's scale before tanh; 0 without softcap
  float scale_log2;  // the exponent's scale
  float lse_scale;   // scale_log2 / log2(e): what turns the row max into the LSE's units
};

ScoreTransform score_transform(float softmax_scale, float softcap);

}  // namespace flash_hopper
