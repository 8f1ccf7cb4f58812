// Debug event timelines, for libraries built with FH_TIMELINE=ON (CMake; it defines FH_TIMELINE).
// Other builds compile every mark to nothing. One device buffer of at least kTimelineBytes
// (fh_debug_set_timeline, kernels/src/launch.cu) serves every kernel that records; each family
// keeps its event ids and records with one of two recorders:
//
// - WarpTimeline<Event>: what each warp's cycles go to. The first kTimelineCtas CTAs record, lane
//   0 of each warp: slot 0 of the warp's kTimelineSlots holds the number of events, slots 1.. the
//   events as (clock64() << 8) | event id. clock64 is the SM's cycle counter, so the events of
//   one CTA share one clock. The FA-3 forward (sm90/fwd/timeline.h's events; bench/timeline.py).
// - CtaMarks<Event, kEvents>: when each CTA reaches its phases, across the whole grid. Thread 0 of
//   every CTA the buffer has room for records kSlots words at kSlots * (linear CTA id): the
//   global timer (ns) at each of the kEvents events, then the SM id, then clock64() at the start
//   and at the end. The decode kernel (kernels/decode/decode_kernel.h, DecodeEv;
//   bench/decode_timeline.py).
#pragma once

#include <cstdint>

namespace flash_hopper {

inline constexpr int kTimelineCtas = 2;
inline constexpr int kTimelineWarps = 16;    // the largest CTA: 4 warpgroups
inline constexpr int kTimelineSlots = 8192;  // per warp, slot 0 the count
inline constexpr long long kTimelineBytes =
    8LL * kTimelineCtas * kTimelineWarps * kTimelineSlots;

#if defined(__CUDACC__)

template <class Event>
struct WarpTimeline {
#ifdef FH_TIMELINE
  unsigned long long* slots = nullptr;  // this warp's, or null (not recording)
  int count = 0;
  __device__ __forceinline__ explicit WarpTimeline(unsigned long long* buffer) {
    if (buffer != nullptr && blockIdx.x < kTimelineCtas && threadIdx.x % 32 == 0) {
      slots = buffer + (int64_t(blockIdx.x) * kTimelineWarps + threadIdx.x / 32) * kTimelineSlots;
    }
  }
  __device__ __forceinline__ void mark(Event e) {
    if (slots != nullptr && count < kTimelineSlots - 1) {
      slots[1 + count] = (static_cast<unsigned long long>(clock64()) << 8) | uint32_t(e);
      slots[0] = ++count;
    }
  }
#else
  __device__ __forceinline__ explicit WarpTimeline(unsigned long long*) {}
  __device__ __forceinline__ void mark(Event) {}
#endif
};

template <class Event, int kEvents>
struct CtaMarks {
  static constexpr int kSlots = kEvents + 3;  // the events, the SM id, clock64 at start and end

#ifdef FH_TIMELINE
  unsigned long long* slots = nullptr;
  __device__ CtaMarks(unsigned long long* buffer, int64_t capacity_ctas) {
    const int64_t cta =
        (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    if (buffer != nullptr && threadIdx.x == 0 && cta < capacity_ctas) {
      slots = buffer + cta * kSlots;
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      slots[kEvents] = sm;
      slots[kEvents + 1] = clock64();
    }
  }
  __device__ static unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  __device__ void mark(Event e) {
    if (slots != nullptr) {
      slots[e] = now();
    }
  }
  // The last event, once every thread of the CTA is done: every thread calls it.
  __device__ void end(Event e) {
    __syncthreads();
    if (slots != nullptr) {
      slots[e] = now();
      slots[kEvents + 2] = clock64();
    }
  }
#else
  __device__ CtaMarks(unsigned long long*, int64_t) {}
  __device__ void mark(Event) {}
  __device__ void end(Event) {}
#endif
};

#endif  // __CUDACC__

}  // namespace flash_hopper
