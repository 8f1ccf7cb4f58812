// Pieces of the tile order that the FA-3 path's persistent schedulers share: the snake walk of a
// linear tile index (the forward's StaticTileScheduler and VarlenTileScheduler,
// fwd/tile_scheduler.h; the backward's BwdTileScheduler, bwd/schedule.h) and the L2 budget of
// the forward's longest-first sections. Plain C++ (tests/cpp/test_tile_scheduler.cpp,
// tests/cpp/test_bwd_schedule.cpp).
#pragma once

#include <cstdint>

#include "flash_hopper/host_device.h"

namespace flash_hopper::sm90 {

// The linear tile index CTA `cta` of a grid of `grid` CTAs takes in `round`: r * G + c in even
// rounds, r * G + (G - 1 - c) in odd ones. Tile costs decrease along the index under a
// longest-first order, so no CTA gets the largest tile of every round.
FH_HOST_DEVICE int snake_index(int round, int cta, int grid) {
  return round * grid + ((round & 1) ? grid - 1 - cta : cta);
}

// The K / V bytes one L2 section may hold: ~32 MiB of the 50 MB L2.
inline constexpr int64_t kL2SectionBytes = int64_t(32) << 20;

// Query heads (or (batch, head) pairs) per L2 section, out of `all`: as many whole GQA groups of
// heads_per_kv as keep their K / V within kL2SectionBytes, at least one; kv_bytes_per_head <= 0
// gives one section of all of them.
FH_HOST_DEVICE int l2_section_heads(int64_t kv_bytes_per_head, int heads_per_kv, int all) {
  int64_t kv_heads = kv_bytes_per_head > 0 ? kL2SectionBytes / kv_bytes_per_head : all;
  kv_heads = kv_heads < 1 ? 1 : kv_heads;
  const int64_t heads = kv_heads * heads_per_kv;
  const int section = static_cast<int>(heads < all ? heads : all);
  return section < 1 ? 1 : section;
}

}  // namespace flash_hopper::sm90
