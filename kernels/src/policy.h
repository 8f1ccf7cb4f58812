// The backend policy: which kernel serves a call on a GPU of a given compute capability, and why.
// It lives here and only here. fh_fwd and fh_bwd apply it to the current device;
// fh_fwd_select_backend and fh_bwd_select_backend expose it for any compute capability, which is
// how Python's which_backend, its plan cache and `flash-hopper info` ask it instead of
// re-implementing it.
//
// One ladder serves both directions (policy.cu): a table of the kernel paths with what each needs
// (the GPU its code runs on, whether it loads with TMA, what to use instead), weighed per call
// against what the source tree has and what this build compiled. The forward and the backward
// differ only in data: their registry, the tensors their FA-3 path loads with TMA, which buckets
// the source tree covers, and the inputs only the FA-3 forward serves (FP8, the mixed mode).
//
// The decode kernel's rules live here too (its table in tables.cmake, the GPU it fits): the
// forward's rung above the FA paths for a call that asks for it (FhFwdParams::decode_route with
// backend auto: flash_attn_func's and flash_attn_varlen_func's short queries), and the one question
// of an FhDecodeParams call (flash_attn_with_kvcache's route; fh_decode_select_backend).
#pragma once

#include <cstdint>
#include <string>

#include "flash_hopper/api.h"
#include "src/tables.h"

namespace flash_hopper {

// The tensors each direction's FA-3 path loads with TMA, as messages name them.
constexpr const char* kFwdTmaTensors = "q/k/v";
constexpr const char* kBwdTmaTensors = "q/k/v/dout";

// The policy's answer: the path and this build's launcher on it (null for FH_BACKEND_DECODE, the
// forward's answer for a call that fh_decode runs).
template <class Entry>
struct PathChoice {
  int32_t backend = FH_BACKEND_AUTO;
  const Entry* kernel = nullptr;
};
using Choice = PathChoice<RegistryEntry>;
using BwdChoice = PathChoice<BwdRegistryEntry>;

// Which kernel serves validated p on a GPU of compute capability cc_major.cc_minor. Fills *why
// (if not null) with the reason on success; fails with FH_ERROR_UNSUPPORTED and a message that
// names the GPU, the build variables or the layout otherwise. The launch path passes no `why`,
// so it formats nothing on success.
FhStatus select_backend(const FhFwdParams* p, int cc_major, int cc_minor, Choice* out,
                        std::string* why);
FhStatus select_backend(const FhBwdParams* p, int cc_major, int cc_minor, BwdChoice* out,
                        std::string* why);

// The decode question's answer: FH_BACKEND_DECODE, which fh_decode launches.
struct DecodeChoice {
  int32_t backend = FH_BACKEND_AUTO;
};

// Whether the decode kernel serves p (validate(p, false) passed) on a GPU of compute capability
// cc_major.cc_minor: FH_SUCCESS with the reason in *why (if not null), else FH_ERROR_UNSUPPORTED
// with a message naming what it lacks (dtype, head dim, rows, the GPU's shared memory).
FhStatus select_backend(const FhDecodeParams* p, int cc_major, int cc_minor, DecodeChoice* out,
                        std::string* why);

}  // namespace flash_hopper
