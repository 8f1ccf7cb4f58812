// Host test of the FP8 forward's register and shared-memory orders (kernels/sm90/fwd/fp8_layout.h):
// - P packed in place (p_source) puts into each byte of the m64k32 e4m3 A fragment exactly the
//   S accumulator value whose key the V^T buffer holds at that byte's k slot (key_of_slot), for
//   every lane: the PV GEMM then sums P[key] V[key] over every key once;
// - the transposer's addresses (TransposerPlan: a lane's part, a unit's XOR and offset, the
//   stage's base, composed as transpose.h composes them) equal the swizzled layouts' offsets for
//   every unit, lane and stage of every FP8 tile (tile_config.h), against a plain model of the
//   layouts and, where CuTe and the CUDA headers are on the include path, against the kernel's
//   own CuTe layouts (kernel_traits.h SmemLayoutV / SmemLayoutVt); the warps' runs cover every
//   unit once; a negative control adds the unit's XOR instead and must be caught;
// - the transposer's ldmatrix.trans / byte permute / stmatrix units (simulated as PTX defines the
//   instructions, on the plan's addresses, warp by warp) leave V^T holding V transposed, keys in
//   key_of_slot's order, for every tile shape; their bank wavefronts per 8 x 16-byte phase are
//   bounded (negative controls swap the byte permutes or break the addresses).
// The fragment layouts are PTX's (wgmma m64nNk32 .e4m3 A from registers, f32 accumulator); the
// plain model's swizzles are CuTe's Swizzle<3,4,3> / <2,4,3> / <1,4,3> on 1-byte K-major atoms
// (fwd/transpose.h also checks the plan against the kernel's CuTe layouts at compile time).
#include <array>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "sm90/fwd/fp8_layout.h"
#include "sm90/fwd/tile_config.h"

#if __has_include(<cute/tensor.hpp>) && __has_include(<cuda_runtime_api.h>)
// as the kernels' translation units define it (CMakeLists.txt FH_SM90_EXT_MMA_HEAD_DIMS): the
// WGMMA atoms of N = 176 / 224
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include "sm90/fwd/kernel_traits.h"
#define FH_TEST_CUTE 1
#else
#define FH_TEST_CUTE 0
#endif

using namespace flash_hopper::sm90;

#include "host_check.h"

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
  const int mask = row_bytes / 16 - 1;  // SW128 / SW64 / SW32: Swizzle<3 / 2 / 1, 4, 3>
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

// ldmatrix.trans / stmatrix (.x4, b16) as PTX defines them, on a byte-addressed shared memory:
// matrix m's row r is the 16 bytes at the address lane 8m + r gives; with .trans lane l gets in
// register m the b16 elements (rows 2 (l % 4), 2 (l % 4) + 1; column l / 4) of matrix m, low half
// first; stmatrix writes register m of lane l to matrix m's row l / 4, b16 columns 2 (l % 4), + 1.
using Regs = std::vector<std::array<unsigned, 4>>;  // [lane][register]
static Regs ldmatrix_trans_x4(std::vector<int> const& mem, std::vector<int> const& row_addr) {
  Regs r(32);
  for (int l = 0; l < 32; ++l) {
    for (int m = 0; m < 4; ++m) {
      const int q = l % 4, c = l / 4;
      const int lo = row_addr[8 * m + 2 * q], hi = row_addr[8 * m + 2 * q + 1];
      const int bytes[4] = {mem[lo + 2 * c], mem[lo + 2 * c + 1], mem[hi + 2 * c], mem[hi + 2 * c + 1]};
      unsigned w = 0;
      for (int b = 0; b < 4; ++b) {
        w |= unsigned(bytes[b] & 0xff) << (8 * b);
      }
      r[l][m] = w;
    }
  }
  return r;
}
static void stmatrix_x4(std::vector<int>& mem, std::vector<int> const& row_addr, Regs const& r) {
  for (int l = 0; l < 32; ++l) {
    for (int m = 0; m < 4; ++m) {
      const int base = row_addr[8 * m + l / 4] + 4 * (l % 4);
      for (int b = 0; b < 4; ++b) {
        mem[base + b] = int((r[l][m] >> (8 * b)) & 0xff);
      }
    }
  }
}
static unsigned byte_perm(unsigned a, unsigned b, unsigned sel) {  // __byte_perm
  const unsigned long long x = (static_cast<unsigned long long>(b) << 32) | a;
  unsigned out = 0;
  for (int i = 0; i < 4; ++i) {
    out |= unsigned((x >> (8 * ((sel >> (4 * i)) & 7))) & 0xff) << (8 * i);
  }
  return out;
}
// Wavefronts of an 8-row phase of ldmatrix / stmatrix (8 x 16 bytes), the max over its 4 phases.
static int matrix_wavefronts(std::vector<int> const& row_addr) {
  int worst = 0;
  for (int m = 0; m < 4; ++m) {
    std::vector<int> addrs;
    for (int r = 0; r < 8; ++r) {
      for (int w = 0; w < 4; ++w) {
        addrs.push_back(row_addr[8 * m + r] + 4 * w);
      }
    }
    worst = wavefronts(addrs) > worst ? wavefronts(addrs) : worst;
  }
  return worst;
}

// The FP8 tiles the kernels are instantiated with: (block_n, head_dim) per FP8 head dim.
static std::vector<std::pair<int, int>> fp8_tiles() {
  std::vector<std::pair<int, int>> tiles;
  for (int d = 1; d <= 256; ++d) {
    if (has_fp8_config(d)) {
      tiles.push_back({fwd_config_fp8_tile(d).block_n, d});
      if (has_fp8_short_keys_tile(d)) {
        tiles.push_back({fwd_config_fp8_tile(d, TileFamily::kShortKeys).block_n, d});
      }
    }
  }
  return tiles;
}

// The plain model's row bytes (kernel_traits.h k_major_smem_atom): V rows of head_dim bytes, V^T
// rows of block_n.
static int v_row_bytes(int head_dim) {
  return head_dim % 128 == 0 ? 128 : head_dim % 64 == 0 ? 64 : 32;
}
static int vt_row_bytes(int block_n) {
  return block_n % 128 == 0 ? 128 : block_n % 64 == 0 ? 64 : 32;
}

// A buffer's shared-window address in the kernel: a multiple of 1024 (kernel_traits.h aligns the
// buffers); the checks run with 0 and with this one.
constexpr uint32_t kBufferAddress = 0x18400;

// The transposer's addresses of unit u, lane `lane` in a stage, as offsets from a buffer at
// `buffer`, composed as transpose.h does: ldmatrix with the stage's address as the base,
// stmatrix with it in the lane's part; `broken` adds the unit's XOR instead (a negative control).
static uint32_t composed(SwizzledAccess a, uint32_t base, uint32_t lane_part, bool broken) {
  return broken ? base + ((lane_part + a.pre) + a.x) + a.post : a.at(base, lane_part);
}
static uint32_t ld_addr(TransposerPlan const& p, int u, int lane, int stage, bool broken,
                        uint32_t buffer = 0) {
  return composed(p.addr(u).ld, buffer + stage * p.v.stage_bytes(), p.ld_lane(lane), broken) -
         buffer;
}
static uint32_t st_addr(TransposerPlan const& p, int u, int lane, int stage, bool broken,
                        uint32_t buffer = 0) {
  return composed(p.addr(u).st, 0, p.st_lane(lane) + buffer + stage * p.vt.stage_bytes(),
                  broken) -
         buffer;
}

constexpr int kModelStages = 2;  // every FP8 tile's K / V pipeline depth (tile_config.h)

// Every unit, lane and stage: the plan's addresses against the plain model; the number that
// differ.
static int model_mismatches(int block_n, int head_dim, bool broken) {
  const TransposerPlan p{block_n, head_dim, kTransposerWarps};
  const int bytes = block_n * head_dim;
  int wrong = 0;
  for (int stage = 0; stage < kModelStages; ++stage) {
    for (int u = 0; u < p.units(); ++u) {
      const TransposerPlan::Unit unit = p.unit(u);
      for (int lane = 0; lane < 32; ++lane) {
        const StsmRow row = stsm_row(lane);
        const int ld = stage * bytes +
                       swizzled(unit.n0 + lane, unit.d0, block_n, v_row_bytes(head_dim));
        const int st = stage * bytes + swizzled(unit.d0 + row.col, unit.n0 + row.slot, head_dim,
                                                vt_row_bytes(block_n));
        for (uint32_t buffer : {0u, kBufferAddress}) {
          wrong += int(ld_addr(p, u, lane, stage, broken, buffer)) != ld;
          wrong += int(st_addr(p, u, lane, stage, broken, buffer)) != st;
        }
      }
    }
  }
  return wrong;
}

#if FH_TEST_CUTE
// The same against the kernel's CuTe layouts (1-byte elements: offsets are bytes): layout_a (the
// swizzle) of layout_b (the coordinates' linear offset).
template <int kHeadDim, TileFamily kFamily = TileFamily::kDefault>
static int cute_mismatches(bool broken) {
  using Traits = FwdTraits<cutlass::float_e4m3_t, kHeadDim, /*kOverlap=*/true, kFamily>;
  const typename Traits::SmemLayoutV layout_v{};    // (N, D, PIPE)
  const typename Traits::SmemLayoutVt layout_vt{};  // (D, N, PIPE)
  const TransposerPlan p{Traits::kBlockN, kHeadDim, kTransposerWarps};
  CHECK(Traits::kStages == kModelStages &&
            Traits::kBlockN == fwd_config_fp8_tile(kHeadDim, kFamily).block_n,
        "d %d: the kernel's tile is not the table's", kHeadDim);
  int wrong = 0;
  for (int stage = 0; stage < Traits::kStages; ++stage) {
    const int v_stage = stage % Traits::kVStages;  // V may have fewer stages than V^T
    for (int u = 0; u < p.units(); ++u) {
      const TransposerPlan::Unit unit = p.unit(u);
      for (int lane = 0; lane < 32; ++lane) {
        const StsmRow row = stsm_row(lane);
        const uint32_t ld = layout_v.layout_a()(layout_v.layout_b()(
            uint32_t(unit.n0 + lane), uint32_t(unit.d0), uint32_t(v_stage)));
        const uint32_t st = layout_vt.layout_a()(layout_vt.layout_b()(
            uint32_t(unit.d0 + row.col), uint32_t(unit.n0 + row.slot), uint32_t(stage)));
        for (uint32_t buffer : {0u, kBufferAddress}) {
          wrong += ld_addr(p, u, lane, v_stage, broken, buffer) != ld;
          wrong += st_addr(p, u, lane, stage, broken, buffer) != st;
        }
      }
    }
  }
  return wrong;
}

template <int kHeadDim, TileFamily kFamily = TileFamily::kDefault>
static void check_cute() {
  const int wrong = cute_mismatches<kHeadDim, kFamily>(false);
  CHECK(wrong == 0, "d %d: %d plan addresses differ from the kernel's CuTe layouts", kHeadDim,
        wrong);
  const int broken_wrong = cute_mismatches<kHeadDim, kFamily>(true);
  CHECK(broken_wrong > 0,
        "d %d: the unit's XOR added instead passes the CuTe comparison", kHeadDim);
}
#endif

// The plan's work split: the warps' runs cover every unit once, as evenly as the count allows.
static void check_split(int block_n, int head_dim) {
  const TransposerPlan p{block_n, head_dim, kTransposerWarps};
  std::vector<int> seen(p.units(), 0);
  int next = 0;
  for (int w = 0; w < kTransposerWarps; ++w) {
    CHECK(p.first(w) == next, "N %d d %d: warp %d starts at %d, not %d", block_n, head_dim, w,
          p.first(w), next);
    CHECK(p.count(w) <= (p.units() + kTransposerWarps - 1) / kTransposerWarps,
          "N %d d %d: warp %d has %d of %d units", block_n, head_dim, w, p.count(w), p.units());
    for (int i = 0; i < p.count(w); ++i) {
      const TransposerPlan::Unit unit = p.unit(p.first(w) + i);
      const int index = (unit.n0 / 32) * (head_dim / 16) + unit.d0 / 16;
      CHECK(unit.n0 % 32 == 0 && unit.n0 < block_n && unit.d0 % 16 == 0 && unit.d0 < head_dim,
            "N %d d %d: unit %d at (%d, %d)", block_n, head_dim, p.first(w) + i, unit.n0,
            unit.d0);
      if (index >= 0 && index < p.units()) {
        ++seen[index];
      }
    }
    next = p.first(w) + p.count(w);
  }
  for (int u = 0; u < p.units(); ++u) {
    CHECK(seen[u] == 1, "N %d d %d: unit (%d, %d) transposed %d times", block_n, head_dim,
          32 * (u / (head_dim / 16)), 16 * (u % (head_dim / 16)), seen[u]);
  }
}

// The transposer (transpose.h) on one V stage: every warp's units (32-key slice, 16 columns)
// through the simulated instructions at the plan's addresses, V stage 1 into V^T stage 0; then
// V^T must hold at (column d, slot s of slice k) the byte V had at (key 32k + key_of_slot(s), d),
// and its other stage nothing.
static bool transposes(int block_n, int head_dim, unsigned perm_even, unsigned perm_odd,
                       bool broken_addresses, int* worst_ld, int* worst_st) {
  const TransposerPlan p{block_n, head_dim, kTransposerWarps};
  const int v_row = v_row_bytes(head_dim), vt_row = vt_row_bytes(block_n);
  const int bytes = block_n * head_dim;
  const int v_stage = 1, vt_stage = 0;
  std::vector<int> v(kModelStages * bytes, -2), vt(kModelStages * bytes, -1);
  for (int key = 0; key < block_n; ++key) {
    for (int d = 0; d < head_dim; ++d) {
      v[v_stage * bytes + swizzled(key, d, block_n, v_row)] = (key * 7 + d * 13) & 0xff;
    }
  }
  for (int w = 0; w < kTransposerWarps; ++w) {
    for (int u = p.first(w); u < p.first(w) + p.count(w); ++u) {
      std::vector<int> ld(32), st(32);
      for (int lane = 0; lane < 32; ++lane) {
        ld[lane] = int(ld_addr(p, u, lane, v_stage, broken_addresses));
        st[lane] = int(st_addr(p, u, lane, vt_stage, broken_addresses));
        if (ld[lane] < 0 || ld[lane] + 16 > int(v.size()) || st[lane] < 0 ||
            st[lane] + 16 > int(vt.size())) {
          return false;
        }
      }
      const Regs r = ldmatrix_trans_x4(v, ld);
      Regs out(32);
      for (int lane = 0; lane < 32; ++lane) {
        for (int m = 0; m < 4; ++m) {
          const int h = m / 2;
          out[lane][m] = byte_perm(r[lane][2 * h], r[lane][2 * h + 1],
                                   stsm_odd_column(lane, m) ? perm_odd : perm_even);
        }
      }
      stmatrix_x4(vt, st, out);
      *worst_ld = matrix_wavefronts(ld) > *worst_ld ? matrix_wavefronts(ld) : *worst_ld;
      *worst_st = matrix_wavefronts(st) > *worst_st ? matrix_wavefronts(st) : *worst_st;
    }
  }
  int wrong = 0;
  for (int d = 0; d < head_dim; ++d) {
    for (int slot = 0; slot < block_n; ++slot) {
      const int key = (slot & ~31) + key_of_slot(slot & 31);
      wrong += vt[vt_stage * bytes + swizzled(d, slot, head_dim, vt_row)] !=
               ((key * 7 + d * 13) & 0xff);
    }
  }
  for (int i = 0; i < bytes; ++i) {
    wrong += vt[(1 - vt_stage) * bytes + i] != -1;
  }
  return wrong == 0;
}

static void check_transposer(int block_n, int head_dim, int max_load_ways, int max_store_ways) {
  check_split(block_n, head_dim);
  const int wrong = model_mismatches(block_n, head_dim, false);
  CHECK(wrong == 0, "N %d d %d: %d plan addresses differ from the layout model", block_n,
        head_dim, wrong);
  // Negative control: the unit's XOR added instead of XORed must differ from the model.
  CHECK(model_mismatches(block_n, head_dim, true) > 0,
        "N %d d %d: the unit's XOR added instead passes the address check", block_n, head_dim);
  int worst_ld = 0, worst_st = 0;
  CHECK(transposes(block_n, head_dim, kPermEven, kPermOdd, false, &worst_ld, &worst_st),
        "N %d d %d: V^T does not hold V transposed in key_of_slot order", block_n, head_dim);
  CHECK(worst_ld <= max_load_ways, "N %d d %d: ldmatrix %d-way", block_n, head_dim, worst_ld);
  CHECK(worst_st <= max_store_ways, "N %d d %d: stmatrix %d-way", block_n, head_dim, worst_st);
  const TransposerPlan p{block_n, head_dim, kTransposerWarps};
  std::printf("N %3d d %3d: %2d units, warps' runs %d / %d / %d; ldmatrix %d, stmatrix %d "
              "wavefronts per 8 x 16-byte phase\n",
              block_n, head_dim, p.units(), p.count(0), p.count(1), p.count(2), worst_ld,
              worst_st);
  // Negative controls: the byte permutes swapped (odd columns where even ones belong), and the
  // addresses with the unit's XOR added, must fail.
  int ld = 0, st = 0;
  CHECK(!transposes(block_n, head_dim, kPermOdd, kPermEven, false, &ld, &st),
        "N %d d %d: swapped byte permutes pass the transposition check", block_n, head_dim);
  CHECK(!transposes(block_n, head_dim, kPermEven, kPermOdd, true, &ld, &st),
        "N %d d %d: broken addresses pass the transposition check", block_n, head_dim);
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
  // Every FP8 tile (d64: N = 160 and the short-keys N = 128, both buffers of 64-byte rows; d96:
  // V rows of 96 bytes, SW32; d192: SW64; the rest SW128), conflict-free; and N = 128 at d64.
  for (auto const& tile : fp8_tiles()) {
    check_transposer(tile.first, tile.second, 1, 1);
  }
  check_transposer(128, 64, 1, 1);
#if FH_TEST_CUTE
  static_assert(has_fp8_config(64) && has_fp8_config(96) && has_fp8_config(128) &&
                has_fp8_config(192) && has_fp8_config(256) && !has_fp8_config(160));
  static_assert(has_fp8_short_keys_tile(64) == !kFp8SequentialBuilt &&
                !has_fp8_short_keys_tile(96) && !has_fp8_short_keys_tile(128) &&
                !has_fp8_short_keys_tile(192) && !has_fp8_short_keys_tile(256));
  CHECK(fp8_tiles().size() == (kFp8SequentialBuilt ? 5u : 6u),
        "FP8 tiles beyond the CuTe checks below");
  check_cute<64>();
  check_cute<64, TileFamily::kShortKeys>();
  check_cute<96>();
  check_cute<128>();
  check_cute<192>();
  check_cute<256>();
  std::printf("plan addresses checked against the kernel's CuTe layouts\n");
#else
  std::printf("plan addresses checked against the plain layout model (no CuTe on the include "
              "path)\n");
#endif
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
  return host_check_exit();
}
