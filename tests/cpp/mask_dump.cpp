// Dumps what the mask policy (kernels/include/flash_hopper/mask.h) decides, for
// tests/test_mask_policy.py to compare with the Python mirror (python/flash_hopper/mask.py).
//
// stdin: one configuration per line, "seqlen_q seqlen_k window_left window_right chunk block_m
// block_n". stdout, per configuration:
//   config <index>
//   m <m_block> <n_min> <n_max> <n_left> <n_right>     every query tile
//   n <n_block> <m_min> <m_max>                         every key tile (and one past the last)
//   r <row> <lo> <hi>                                   every row of every tile, padding included
//   k <row> <first> <lo> <hi>                           keys() of every row, pads 0 and row % 5
//   pairs <count>                                       visible() summed over the full matrix
// Every value comes from the header's own methods; the counting loop is the only logic here.
#include <cstdio>
#include <initializer_list>

#include "flash_hopper/mask.h"

int main() {
  int seqlen_q, seqlen_k, window_left, window_right, chunk, block_m, block_n;
  int index = 0;
  while (std::scanf("%d %d %d %d %d %d %d", &seqlen_q, &seqlen_k, &window_left, &window_right,
                    &chunk, &block_m, &block_n) == 7) {
    const flash_hopper::AttentionMask mask{seqlen_q, seqlen_k, window_left, window_right, chunk};
    std::printf("config %d\n", index++);
    const int m_blocks = (seqlen_q + block_m - 1) / block_m;
    for (int m = 0; m < m_blocks; ++m) {
      const flash_hopper::KeyBlockRange range = mask.key_blocks(m, block_m, block_n);
      const flash_hopper::KeyBlockSplit split = mask.unmasked_blocks(range, m, block_m, block_n);
      std::printf("m %d %d %d %d %d\n", m, range.n_min, range.n_max, split.n_left,
                  split.n_right);
    }
    const int n_blocks = (seqlen_k + block_n - 1) / block_n;
    for (int n = 0; n <= n_blocks; ++n) {
      const flash_hopper::QueryBlockRange range = mask.query_blocks(n, block_m, block_n);
      std::printf("n %d %d %d\n", n, range.m_min, range.m_max);
    }
    // Rows past seqlen_q too: unmasked_blocks() reads the lo of a tile's last padded row.
    for (int row = 0; row < m_blocks * block_m; ++row) {
      const flash_hopper::ColumnRange c = mask.columns(row);
      std::printf("r %d %d %d\n", row, c.lo, c.hi);
    }
    for (int row = 0; row < seqlen_q; ++row) {
      for (int first : {0, row % 5}) {
        const flash_hopper::KeyRange k = mask.keys(row, first);
        std::printf("k %d %d %d %d\n", row, first, k.lo, k.hi);
      }
    }
    long long pairs = 0;
    for (int row = 0; row < seqlen_q; ++row) {
      for (int col = 0; col < seqlen_k; ++col) {
        pairs += mask.visible(row, col) ? 1 : 0;
      }
    }
    std::printf("pairs %lld\n", pairs);
  }
  return 0;
}
