// A kernel launch with programmatic dependent launch (sm_90): the grid may start while the kernel
// before it in the stream finishes, and its CTAs wait in griddepcontrol.wait (the kernel's part)
// before they touch anything that kernel writes. Shared by the FA-3 varlen forward (behind its
// prepare kernel, sm90/fwd/launch.h) and the decode / combine kernels (decode.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace flash_hopper {

// programmatic = false: a plain launch in stream order (GPUs before sm_90, A / B measurements).
template <class... Params, class... Args>
cudaError_t launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                cudaStream_t stream, bool programmatic, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace flash_hopper
