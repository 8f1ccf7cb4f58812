// Host test of the FA-3 path's static persistent tile scheduler (kernels/sm90/tile_scheduler.h):
// for several shapes and grid sizes, every tile is visited exactly once, each CTA's sequence is
// what the kernel's loop walks, masked schedules run longest-first inside each section, and the
// load balance of causal schedules stays near ideal. Prints "OK" and exits 0 on success.
#include <cstdio>
#include <vector>

#include "sm90/tile_scheduler.h"

using flash_hopper::sm90::StaticTileScheduler;
using flash_hopper::sm90::TileCoord;

static int failures = 0;
#define CHECK(cond, ...)                  \
  do {                                    \
    if (!(cond)) {                        \
      std::printf("FAIL: " __VA_ARGS__);  \
      std::printf("\n");                  \
      ++failures;                         \
    }                                     \
  } while (0)

static void check(int seqlen_q, int block_m, int heads, int heads_per_kv, int batch,
                  long long kv_bytes, bool longest_first, int num_sms) {
  const StaticTileScheduler s = StaticTileScheduler::make(
      seqlen_q, block_m, heads, heads_per_kv, batch, kv_bytes, longest_first, num_sms);
  const int num_m = (seqlen_q + block_m - 1) / block_m;
  CHECK(s.total_tiles == num_m * heads * batch, "total_tiles %d", s.total_tiles);
  CHECK(s.grid == (s.total_tiles < num_sms ? s.total_tiles : num_sms), "grid %d", s.grid);
  std::vector<int> seen(s.total_tiles, 0);
  std::vector<long long> load(s.grid, 0);
  for (int cta = 0; cta < s.grid; ++cta) {
    for (int round = 0;; ++round) {  // the kernel's loop
      const int t = s.index(round, cta);
      if (t >= s.total_tiles) {
        break;
      }
      const TileCoord c = s.coord(t);
      CHECK(c.m_block >= 0 && c.m_block < num_m && c.head >= 0 && c.head < heads &&
                c.batch >= 0 && c.batch < batch,
            "coord out of range t=%d", t);
      const int id = (c.batch * heads + c.head) * num_m + c.m_block;
      ++seen[id];
      load[cta] += c.m_block + 1 + 2;  // causal cost: key blocks (block_n == block_m) + overhead
    }
  }
  for (int i = 0; i < s.total_tiles; ++i) {
    CHECK(seen[i] == 1, "tile %d visited %d times (G=%d, sq=%d, h=%d, b=%d)", i, seen[i], s.grid,
          seqlen_q, heads, batch);
  }
  if (longest_first && s.grid > 1 && s.total_tiles >= 8 * s.grid) {
    long long total = 0, worst = 0;
    for (long long l : load) {
      total += l;
      worst = l > worst ? l : worst;
    }
    const double balance = double(total) / s.grid / worst;
    CHECK(balance > 0.9, "causal balance %.3f (G=%d, sq=%d, h=%d, b=%d)", balance, s.grid,
          seqlen_q, heads, batch);
  }
  if (longest_first) {  // the last section is descending: the final tile is a shortest one
    const TileCoord last = s.coord(s.total_tiles - 1);
    CHECK(last.m_block == 0, "last tile has m_block %d, expected 0", last.m_block);
  } else {  // heads major, query block fastest
    CHECK(s.coord(1).m_block == (num_m > 1 ? 1 : 0), "non-causal order");
  }
}

int main() {
  const int grids[] = {1, 3, 132};
  for (int g : grids) {
    for (bool lf : {false, true}) {
      check(16384, 128, 16, 1, 1, 16384LL * 128 * 4, lf, g);  // d128 s16k: 4 L2 sections
      check(512, 128, 16, 1, 32, 512LL * 128 * 4, lf, g);
      check(2048, 192, 32, 1, 8, 2048LL * 64 * 4, lf, g);     // d64, 3 consumer WGs
      check(611, 128, 4, 2, 2, 397LL * 128 * 4, lf, g);       // GQA, odd lengths
      check(1, 128, 3, 3, 5, 17LL * 64 * 4, lf, g);
      check(8192, 128, 8, 4, 3, 100LL << 20, lf, g);           // a KV head over the L2 budget
    }
  }
  if (failures == 0) {
    std::printf("OK\n");
  }
  return failures == 0 ? 0 : 1;
}
