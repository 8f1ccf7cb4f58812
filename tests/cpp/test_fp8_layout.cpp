// Host test of the FP8 forward's register and shared-memory orders (kernels/sm90/fwd/fp8_layout.h):
// - P packed in place (p_source) puts into each byte of the m64k32 e4m3 A fragment exactly the
//   S accumulator value whose key the V^T buffer holds at that byte's k slot (key_of_slot), for
//   every lane: the PV GEMM then sums P[key] V[key] over every key once;
// - the transposer's ldmatrix.trans / byte permute / stmatrix units (simulated as PTX defines the
//   instructions) leave V^T holding V transposed, keys in key_of_slot's order, for every tile
//   shape; their bank wavefronts per 8 x 16-byte phase are bounded (a negative control swaps the
//   byte permutes).
// The fragment layouts are PTX's (wgmma m64nNk32 .e4m3 A from registers, f32 accumulator); the
// swizzles are CuTe's Swizzle<3,4,3> / <2,4,3> on 1-byte K-major atoms (the kernel checks its own
// layouts are these: fwd/transpose.h evaluates CuTe's).
#include <array>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "sm90/fwd/fp8_layout.h"

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

// The transposer (fwd/transpose.h) on one V stage: every unit (32-key slice, 16 columns) through
// the simulated instructions, then V^T must hold at (column d, slot s of slice k) the byte V had
// at (key 32k + key_of_slot(s), d).
static bool transposes(int block_n, int head_dim, unsigned perm_even, unsigned perm_odd,
                       int* worst_ld, int* worst_st) {
  // common/smem_atoms.h k_major_smem_atom: the widest swizzle row (128 / 64 / 32 bytes) dividing it
  const int v_row = head_dim % 128 == 0 ? 128 : head_dim % 64 == 0 ? 64 : 32;
  const int vt_row = block_n % 128 == 0 ? 128 : 64;
  const int bytes = block_n * head_dim;
  std::vector<int> v(bytes), vt(bytes, -1);
  for (int key = 0; key < block_n; ++key) {
    for (int d = 0; d < head_dim; ++d) {
      v[swizzled(key, d, block_n, v_row)] = (key * 7 + d * 13) & 0xff;
    }
  }
  for (int n0 = 0; n0 < block_n; n0 += 32) {
    for (int d0 = 0; d0 < head_dim; d0 += 16) {
      std::vector<int> ld(32), st(32);
      for (int lane = 0; lane < 32; ++lane) {
        ld[lane] = swizzled(n0 + lane, d0, block_n, v_row);
        const StsmRow row = stsm_row(lane);
        st[lane] = swizzled(d0 + row.col, n0 + row.slot, head_dim, vt_row);
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
      wrong += vt[swizzled(d, slot, head_dim, vt_row)] != ((key * 7 + d * 13) & 0xff);
    }
  }
  return wrong == 0;
}

static void check_transposer(int block_n, int head_dim, int max_load_ways, int max_store_ways) {
  int worst_ld = 0, worst_st = 0;
  CHECK(transposes(block_n, head_dim, kPermEven, kPermOdd, &worst_ld, &worst_st),
        "N %d d %d: V^T does not hold V transposed in key_of_slot order", block_n, head_dim);
  CHECK(worst_ld <= max_load_ways, "N %d d %d: ldmatrix %d-way", block_n, head_dim, worst_ld);
  CHECK(worst_st <= max_store_ways, "N %d d %d: stmatrix %d-way", block_n, head_dim, worst_st);
  std::printf("N %3d d %3d: ldmatrix %d, stmatrix %d wavefronts per 8 x 16-byte phase\n", block_n,
              head_dim, worst_ld, worst_st);
  // Negative control: the byte permutes swapped (odd columns where even ones belong) must fail.
  int ld = 0, st = 0;
  CHECK(!transposes(block_n, head_dim, kPermOdd, kPermEven, &ld, &st),
        "N %d d %d: swapped byte permutes pass the transposition check", block_n, head_dim);
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
  check_transposer(128, 64, 1, 1);
  check_transposer(64, 64, 1, 1);  // d64: N = 64, both buffers of 64-byte rows
  check_transposer(128, 96, 1, 1);   // d96: V rows of 96 bytes, SW32
  check_transposer(128, 192, 1, 1);  // d192: SW64
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
