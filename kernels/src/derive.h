// The kernel-side parameters of a validated call: FwdParams / BwdParams from FhFwdParams /
// FhBwdParams on a device, and the score transform's constants every kernel takes (the decode
// kernel's DecodeParams too, decode.cu), derived in one place.
#pragma once

#include <cstdint>

#include "flash_hopper/api.h"
#include "flash_hopper/bwd_params.h"
#include "flash_hopper/fwd_params.h"
#include "src/device.h"
#include "src/score_transform.h"

namespace flash_hopper {

// For validated p; the debug timeline is the launch's to set (launch.cu).
FwdParams derive(const FhFwdParams* p, const DeviceInfo& dev);

// For validated p (bwd_workspace succeeded in validate): the workspace pointers are carved with
// bwd_workspace's offsets, the one description of the layout. A zero-byte workspace (seqlen_q ==
// 0) leaves them null: no kernel reads a query row then.
BwdParams derive_bwd(const FhBwdParams* p, const DeviceInfo& dev);

}  // namespace flash_hopper
