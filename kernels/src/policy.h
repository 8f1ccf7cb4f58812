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
#pragma once

#include <cstdint>
#include <string>

#include "flash_hopper/api.h"
#include "src/tables.h"

namespace flash_hopper {

// The tensors each direction's FA-3 path loads with TMA, as messages name them.
constexpr const char* kFwdTmaTensors = "q/k/v";
constexpr const char* kBwdTmaTensors = "q/k/v/dout";

// The policy's answer: the path and this build's launcher on it.
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

}  // namespace flash_hopper
