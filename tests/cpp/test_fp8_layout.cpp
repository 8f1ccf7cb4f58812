// Host test of the FP8 forward's register and shared-memory orders (kernels/sm90/fp8_layout.h):
// - P packed in place (p_source) puts into each byte of the m64k32 e4m3 A fragment exactly the
//   S accumulator value whose key the V^T buffer holds at that byte's k slot (key_of_slot), for
//   every lane: the PV GEMM then sums P[key] V[key] over every key once;
// - the transposer's lane map covers each (slot, column) of a 64-key x 32-column unit once;
// - its loads / stores per warp instruction hit distinct shared-memory banks under the 128-byte
//   swizzle (d128 / d256 V rows, V^T rows of 128 keys), at most 2-way under d64's 64-byte rows.
// The fragment layouts are PTX's (wgmma m64nNk32 .e4m3 A from registers, f32 accumulator); the
// swizzles are CuTe's Swizzle<3,4,3> / <2,4,3> on 1-byte K-major atoms (the kernel checks its own
// layouts are these: transpose.h evaluates CuTe's).
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "sm90/fp8_layout.h"

using namespace flash_hopper::sm90;

static int failures = 0;
#define CHECK(cond, ...)                  \
  do {                                    \
    if (!(cond)) {                        \
      std::printf("FAIL: " __VA_ARGS__);  \
      std::printf("\n");                  \
      ++failures;                         \
    }                                     \
  } while (0)

// f32 accumulator of m64nN: value v = c + 2 r + 4 g of lane l: (row, col) inside the warp's 16
// rows and the tile's N columns.
static std::pair<int, int> acc_coord(int lane, int v) {
  const int c = v % 2, r = (v / 2) % 2, g = v / 4;
  return {lane / 4 + 8 * r, 8 * g + 2 * (lane % 4) + c};
}
// e4m3 A fragment of m64k32: byte b of register j of lane l: (row, k) inside the warp's rows and
// the k32 slice.
static std::pair<int, int> a_coord(int lane, int j, int b) {
  return {lane / 4 + 8 * (j % 2), 4 * (lane % 4) + b + 16 * (j / 2)};
}

static void check_p_packing(int block_n) {
  for (int lane = 0; lane < 32; ++lane) {
    std::set<int> used;
    for (int kk = 0; kk < block_n / 32; ++kk) {
      for (int j = 0; j < 4; ++j) {
        for (int b = 0; b < 4; ++b) {
          const int v = p_source(kk, j, b);
          CHECK(v >= 0 && v < block_n / 2, "p_source(%d, %d, %d) = %d out of range", kk, j, b, v);
          used.insert(v);
          const auto acc = acc_coord(lane, v);
          const auto a = a_coord(lane, j, b);
          CHECK(acc.first == a.first, "lane %d kk %d j %d b %d: row %d vs %d", lane, kk, j, b,
                acc.first, a.first);
          CHECK(acc.second == 32 * kk + key_of_slot(a.second),
                "lane %d kk %d j %d b %d: key %d at slot %d (holds key %d)", lane, kk, j, b,
                acc.second, a.second, 32 * kk + key_of_slot(a.second));
        }
      }
    }
    CHECK(int(used.size()) == block_n / 2, "lane %d packs %zu of its %d values", lane,
          used.size(), block_n / 2);
  }
}

// Byte offset in a K-major swizzled atom of row_bytes-byte rows (1-byte elements), tiled over rows
// then column blocks.
static int swizzled(int row, int col, int rows, int row_bytes) {
  const int mask = row_bytes == 128 ? 7 : 3;
  const int x = (((row * row_bytes) >> 7) & mask) << 4;
  return (col / row_bytes) * rows * row_bytes + row * row_bytes + ((col % row_bytes) ^ x);
}

// Wavefronts of one warp access: distinct 4-byte words per bank, the max over banks.
static int wavefronts(std::vector<int> const& addrs) {
  std::map<int, std::set<int>> banks;
  for (int a : addrs) {
    banks[(a / 4) % 32].insert(a / 4);
  }
  int worst = 0;
  for (auto const& b : banks) {
    worst = b.second.size() > size_t(worst) ? int(b.second.size()) : worst;
  }
  return worst;
}

static void check_transposer(int block_n, int head_dim, int max_load_ways, int max_store_ways) {
  const int v_row = head_dim % 128 == 0 ? 128 : 64;
  const int vt_row = block_n % 128 == 0 ? 128 : 64;
  std::set<std::pair<int, int>> covered;  // (key, column)
  int worst_ld = 0, worst_st = 0;
  for (int n0 = 0; n0 < block_n; n0 += 64) {
    for (int d0 = 0; d0 < head_dim; d0 += 32) {
      for (int m = 0; m < 4; ++m) {
        std::vector<std::vector<int>> ld(4), st(4);
        for (int lane = 0; lane < 32; ++lane) {
          const TransposeLane l = transpose_lane(lane, m);
          const int slot = n0 + 4 * l.u;
          const int col = d0 + 4 * l.q;
          for (int i = 0; i < 4; ++i) {
            const int key = (slot & ~31) + key_of_slot((slot & 31) + i);
            ld[i].push_back(swizzled(key, col, block_n, v_row));
            st[i].push_back(swizzled(col + i, slot, head_dim, vt_row));
            for (int c = 0; c < 4; ++c) {
              const bool fresh = covered.insert({key, col + c}).second;
              CHECK(fresh, "key %d column %d transposed twice", key, col + c);
            }
          }
        }
        for (int i = 0; i < 4; ++i) {
          worst_ld = wavefronts(ld[i]) > worst_ld ? wavefronts(ld[i]) : worst_ld;
          worst_st = wavefronts(st[i]) > worst_st ? wavefronts(st[i]) : worst_st;
        }
      }
    }
  }
  CHECK(int(covered.size()) == block_n * head_dim, "N %d d %d: %zu of %d elements transposed",
        block_n, head_dim, covered.size(), block_n * head_dim);
  CHECK(worst_ld <= max_load_ways, "N %d d %d: loads %d-way", block_n, head_dim, worst_ld);
  CHECK(worst_st <= max_store_ways, "N %d d %d: stores %d-way", block_n, head_dim, worst_st);
  std::printf("N %3d d %3d: loads %d, stores %d wavefronts per instruction\n", block_n, head_dim,
              worst_ld, worst_st);
}

int main() {
  // key_of_slot: a permutation of each 32-key slice
  std::set<int> keys;
  for (int s = 0; s < 32; ++s) {
    keys.insert(key_of_slot(s));
  }
  CHECK(keys.size() == 32 && *keys.begin() == 0 && *keys.rbegin() == 31,
        "key_of_slot is not a permutation of 0..31");
  for (int n : {64, 128, 256}) {
    check_p_packing(n);
  }
  check_transposer(128, 128, 1, 1);
  check_transposer(128, 256, 1, 1);
  check_transposer(128, 64, 2, 1);
  check_transposer(64, 64, 2, 2);  // d64: N = 64, both buffers of 64-byte rows
  // Negative control: the identity key order (slot s holds key s) must not pass the packing
  // check; the permuted one is what makes in-place packing correct.
  {
    int mismatches = 0;
    for (int lane = 0; lane < 32; ++lane) {
      for (int j = 0; j < 4; ++j) {
        for (int b = 0; b < 4; ++b) {
          mismatches += acc_coord(lane, p_source(0, j, b)).second != a_coord(lane, j, b).second;
        }
      }
    }
    CHECK(mismatches > 0, "the identity key order passes the packing check");
  }
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
