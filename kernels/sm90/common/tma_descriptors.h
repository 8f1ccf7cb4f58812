// Host side of the FA-3 path's TMA loads, forward and backward: the stride rules a descriptor
// needs, the (seqlen, head_dim, heads, batch) view of an operand, and the memo of recently encoded
// descriptors.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "src/launch_result.h"

namespace flash_hopper::sm90 {

using namespace cute;

// TMA needs every global stride to be a multiple of 16 bytes below 2^40; the stride of a mode of
// extent 1 is never used, so any valid value stands in for it (a broadcast stride of 0 is fine).
inline int64_t tma_stride(int64_t stride, int extent, int elem_bytes) {
  return extent == 1 ? 16 / elem_bytes : stride;
}

inline bool tma_stride_ok(int64_t stride, int elem_bytes) {
  const int64_t bytes = stride * elem_bytes;
  return bytes > 0 && bytes % 16 == 0 && bytes < (int64_t(1) << 40);
}

// One stride a TMA descriptor would use, with the params field it comes from (for the message).
struct NamedStride {
  const char* field;
  int64_t stride;
};

// The first stride TMA cannot use, in the given order, as the launch's answer; ok if none.
template <int N>
LaunchResult check_tma_strides(NamedStride const (&strides)[N], int elem_bytes) {
  for (NamedStride const& s : strides) {
    if (!tma_stride_ok(s.stride, elem_bytes)) {
      return LaunchResult::layout_not_loadable(s.field, s.stride);  // nothing launched
    }
  }
  return LaunchResult::ok();
}

// A (seqlen, head_dim, heads, batch) operand as the TMA sees it: head_dim contiguous, the row,
// head and batch strides (elements) from s.
template <class Element>
auto tma_gmem_tensor(const void* ptr, int seqlen, int head_dim, int heads, int batch,
                     const int64_t* s) {
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                     make_shape(seqlen, head_dim, heads, batch),
                     make_stride(s[0], _1{}, s[1], s[2]));
}

// The TMA descriptors of recent calls, per thread and per kernel and operand. Encoding one
// (cuTensorMapEncodeTiled, three per launch) is most of the FA-3 launch's host time
// (bench/PERFLOG.md "Host path (bench/host_path.py; ..."); a call whose operand has the address,
// extents and strides of a recent one reuses its descriptor, which is then bit-identical. That is
// the common case in a serving loop: KV caches stay put, and the caching allocator hands
// activations of one size back at the same addresses step after step. Direct-mapped on the key's
// hash; a miss encodes as before.
template <class Tma>
class TmaMemo {
 public:
  struct Key {
    const void* ptr;
    int64_t extent[4];  // seqlen, head_dim, heads, batch
    int64_t stride[3];  // row, head, batch (elements)

    bool operator==(Key const& o) const {
      bool same = ptr == o.ptr;
      for (int i = 0; i < 4; ++i) {
        same = same && extent[i] == o.extent[i];
      }
      for (int i = 0; i < 3; ++i) {
        same = same && stride[i] == o.stride[i];
      }
      return same;
    }
  };

  template <class Encode>
  Tma const& get(Key const& key, Encode&& encode) {
    uint64_t h = reinterpret_cast<uintptr_t>(key.ptr) >> 4;
    for (int64_t x : key.extent) {
      h = h * 0x9E3779B97F4A7C15ull + uint64_t(x);
    }
    for (int64_t x : key.stride) {
      h = h * 0x9E3779B97F4A7C15ull + uint64_t(x);
    }
    Entry& e = entries_[(h ^ (h >> 29)) % kEntries];
    if (!e.valid || !(e.key == key)) {
      e.tma = encode();
      e.key = key;
      e.valid = true;
    }
    return e.tma;
  }

 private:
  // A model's layers each have their own KV cache: enough entries for a few dozen layers' K and V.
  static constexpr int kEntries = 64;
  struct Entry {
    bool valid = false;
    Key key;
    Tma tma;
  };
  Entry entries_[kEntries];
};

}  // namespace flash_hopper::sm90
