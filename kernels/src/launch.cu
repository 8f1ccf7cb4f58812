// Launches (launch.h), and the driver entry point the FA-3 launchers' TMA descriptors call.
#include "src/launch.h"

#include <cudaTypedefs.h>  // cuda.h's driver types and PFN_cuTensorMapEncodeTiled_v12000

#include "fh_tables.inc"
#include "flash_hopper/timeline.h"  // kTimelineBytes
#include "src/bwd_common.h"
#include "src/decode.h"
#include "src/derive.h"
#include "src/errors.h"

namespace flash_hopper {

#if !FH_BWD_COMMON_BUILT
// A build without FH_DIRECTIONS bwd has no backward kernel, so the policy never selects one and
// these never run; they stand in for bwd_common.cu so that the library links.
LaunchResult launch_bwd_preprocess(BwdParams const&, int32_t, cudaStream_t) {
  return LaunchResult::internal("backward preprocess in a build without FH_DIRECTIONS bwd");
}
#endif

namespace {

// fh_debug_set_timeline's buffer (FH_TIMELINE builds; null otherwise and by default).
thread_local unsigned long long* g_timeline = nullptr;

}  // namespace

FhStatus launch_call(const FhFwdParams* p, Choice const& choice, const DeviceInfo& dev,
                     cudaStream_t stream) {
  if (choice.backend == FH_BACKEND_DECODE) {
    return fail(FH_ERROR_UNSUPPORTED,
                "decode_route: the policy sends this call to the decode kernel, which fh_decode "
                "runs (FhDecodeParams); fh_fwd runs the FA paths (decode_route 0)");
  }
  FwdParams k = derive(p, dev);
  k.timeline = g_timeline;
  const int limit = smem_limit(dev);
  return report_launch(choice.kernel->launch(k, limit, stream), backend_name(choice.backend),
                       p->head_dim, limit);
}

FhStatus launch_call(const FhBwdParams* p, BwdChoice const& choice, const DeviceInfo& dev,
                     cudaStream_t stream) {
  const BwdParams k = derive_bwd(p, dev);
  const int limit = smem_limit(dev);
  const char* backend = backend_name(choice.backend);
  // seqlen_q == 0: no query row to prepare or convert, but the main kernel still writes
  // dk = dv = 0. seqlen_k == 0: no key to visit (dk, dv are empty); the launcher's postprocess
  // writes dq = 0 from the cleared accumulator.
  if (p->seqlen_q > 0) {
    FH_TRY(report_launch(launch_bwd_preprocess(k, p->dtype, stream), backend, p->head_dim, limit,
                         kBwdTmaTensors, "backward preprocess"));
  }
  return report_launch(choice.kernel->launch(k, limit, stream), backend, p->head_dim, limit,
                       kBwdTmaTensors, "backward");
}

FhStatus launch_call(const FhDecodeParams* p, const DeviceInfo& dev, cudaStream_t stream) {
  const int limit = smem_limit(dev);
#ifdef FH_TIMELINE
  unsigned long long* timeline = g_timeline;
  const int64_t timeline_bytes = kTimelineBytes;
#else
  unsigned long long* timeline = nullptr;
  const int64_t timeline_bytes = 0;
#endif
  return report_launch(
      launch_decode(p, limit, dev.major, dev.sm_count, stream, timeline, timeline_bytes),
                       "decode", p->head_dim, limit);
}

FhStatus set_debug_timeline(void* device_buffer, int64_t bytes) {
#ifdef FH_TIMELINE
  FH_CHECK(device_buffer == nullptr || bytes >= kTimelineBytes,
           "bytes: expected at least %lld for the timeline buffer, got %lld",
           (long long)kTimelineBytes, (long long)bytes);
  g_timeline = static_cast<unsigned long long*>(device_buffer);
  return FH_SUCCESS;
#else
  (void)device_buffer;
  (void)bytes;
  return fail(FH_ERROR_UNSUPPORTED,
              "fh_debug_set_timeline: this library was built without FH_TIMELINE=ON");
#endif
}

}  // namespace flash_hopper

// The FA-3 launchers encode their TMA descriptors with CuTe's make_tma_copy, which calls the
// driver's cuTensorMapEncodeTiled. Unless CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL is defined,
// CUTLASS looks that function up with cudaGetDriverEntryPointByVersion on every call (three per
// launch, a large share of the FA-3 path's host time: bench/PERFLOG.md "one step schedule,
// one mask policy, one variant table, host path"); with it
// defined, CUTLASS calls the function by name, which would tie this library to libcuda at link
// time. The sm90 instantiations define it (fwd_sm90_inst.cu.in), and the name resolves here: a
// hidden forward to the entry point looked up once per process. The driver stays a run-time
// dependency, so the library still loads on a machine without one (the CPU tests need that).
extern "C" __attribute__((visibility("hidden"))) CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* tensor_map, CUtensorMapDataType data_type, cuuint32_t rank, void* global_address,
    const cuuint64_t* global_dim, const cuuint64_t* global_strides, const cuuint32_t* box_dim,
    const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2_promotion,
    CUtensorMapFloatOOBfill oob_fill) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050  // ByVersion from CUDA 12.5; 13.x has only it
    const cudaError_t err = cudaGetDriverEntryPointByVersion(
        "cuTensorMapEncodeTiled", &fn, /*cudaVersion=*/12000, cudaEnableDefault, &found);
#else
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  if (encode == nullptr) {
    return CUDA_ERROR_NOT_FOUND;
  }
  return encode(tensor_map, data_type, rank, global_address, global_dim, global_strides, box_dim,
                element_strides, interleave, swizzle, l2_promotion, oob_fill);
}
