// Static persistent tile scheduler of the FA-3 path.
//
// The grid has min(tiles, SMs) CTAs; every CTA walks its own sequence of tiles: a static one
// (no atomics, no workspace, CUDA-graph safe), or for masked calls with a tile counter one
// claimed at run time (below). Each tile's result is the same either way (a tile is computed by
// one CTA, its key blocks in a fixed order), so outputs are bitwise reproducible in both.
//
// Order, from the tile index t:
// Without a mask every tile costs the same: (batch, head) major, query block fastest, so the
// CTAs running at the same time work on one or two heads and share their K/V in L2.
// With a causal or local mask, tiles run longest-first (the last query blocks see the most keys
// under the bottom-right aligned mask) so the short tiles fill the tail:
// 1. L2 sections: (batch, head) pairs are grouped so that the K/V of one section (heads of one
//    GQA group are adjacent) fit in ~32 MiB of the 50 MB L2; sections run one after another
//    (common/tile_order.h, l2_section_heads).
// 2. Inside a section the query-block rank is major (longest first) and the (batch, head) pair
//    fastest.
// 3. Snake (common/tile_order.h, snake_index): CTA c takes index r * G + c in even rounds and
//    r * G + (G - 1 - c) in odd ones, so with tile sizes decreasing along t no CTA gets the
//    largest tile of every round.
// 4. With longest-first, the sections alternate direction (the last one descending): otherwise
//    the round that crosses from one section's short tiles into the next one's long tiles pairs
//    long with short and the snake no longer balances (simulated and measured: bench/PERFLOG.md
//    "v1: tiles 128 x 176 (d128), ..."; tests/cpp/test_tile_scheduler.cpp asserts the balance).
// Claimed at run time (`dynamic`: masked calls given a tile counter, fwd/launch.h): CTA c's
// first tile is c, and a CTA done loading a tile claims the next one of the order from the
// call's counter (schedule.h produce()), so CTAs finish together whatever the tiles cost, as in
// FA3's dynamic persistent scheduler. The order is the sections' longest-first, every section
// descending (a claimed walk needs no alternation: no CTA is bound to a round).
// No CUDA or CuTe header is needed, so a plain C++ compiler can unit-test this file
// (tests/cpp/test_tile_scheduler.cpp).
#pragma once

#include <cstdint>

#include "flash_hopper/host_device.h"
#include "flash_hopper/mask.h"
#include "flash_hopper/varlen.h"
#include "sm90/common/tile_order.h"

namespace flash_hopper::sm90 {

// One tile: query block m_block of (batch, head), and its sequence's span (dense calls: the
// call's lengths from token 0; varlen: the packed sequence's offsets and lengths).
struct TileCoord {
  int m_block;
  int head;
  int batch;
  int pair;  // varlen: its index in the prepare kernel's list (consumers reload the span from it)
  int q_start;
  int k_start;
  int seqlen_q;
  int seqlen_k;
};

struct StaticTileScheduler {
  int num_m_blocks;
  int heads;
  int num_hb;         // batch * heads
  int section_hb;     // (batch, head) pairs per L2 section
  int num_sections;
  int total_tiles;
  int grid;           // CTAs
  bool longest_first;
  int seqlen_q;
  int seqlen_k;
  bool dynamic;  // tiles after each CTA's first claimed at run time (longest-first only)

  // kv_bytes_per_head: K + V bytes of one KV head (seqlen_k * head_dim * 2 * element size).
  // cluster_m > 1 (K / V multicast, unmasked calls only): a tile is a group of cluster_m adjacent
  // query blocks (the last group may reach past the sequence), num_sms then counts the clusters
  // that fit the GPU at once, and grid is in clusters.
  static StaticTileScheduler make(int seqlen_q, int seqlen_k, int block_m, int heads, int heads_per_kv,
                                  int batch, int64_t kv_bytes_per_head, bool longest_first,
                                  int num_sms, int cluster_m = 1, bool claimed = false) {
    StaticTileScheduler s;
    const int m_blocks = (seqlen_q + block_m - 1) / block_m;
    s.num_m_blocks = (m_blocks + cluster_m - 1) / cluster_m;
    s.heads = heads;
    s.num_hb = heads * batch;
    s.section_hb = l2_section_heads(kv_bytes_per_head, heads_per_kv, s.num_hb);
    s.num_sections = (s.num_hb + s.section_hb - 1) / s.section_hb;
    const int64_t total = int64_t(s.num_m_blocks) * s.num_hb;
    s.total_tiles = static_cast<int>(total);
    s.grid = s.total_tiles < num_sms ? s.total_tiles : num_sms;
    s.longest_first = longest_first;
    s.seqlen_q = seqlen_q;
    s.seqlen_k = seqlen_k;
    s.dynamic = claimed && longest_first && cluster_m == 1 && s.total_tiles > s.grid;
    return s;
  }

  FH_HOST_DEVICE int tile_count() const { return total_tiles; }

  // The index of round r for CTA c (snake order).
  FH_HOST_DEVICE int index(int round, int cta) const { return snake_index(round, cta, grid); }

  FH_HOST_DEVICE TileCoord coord(int t) const {
    TileCoord c;
    c.pair = 0;
    c.q_start = 0;
    c.k_start = 0;
    c.seqlen_q = seqlen_q;
    c.seqlen_k = seqlen_k;
    if (!longest_first) {
      // Equal tiles: the query blocks of one head are adjacent, so the CTAs running at the same
      // time share that head's K/V in L2 (the rank-major order re-read K/V from DRAM at short
      // lengths: bench/PERFLOG.md "v2: heads-major order for unmasked calls").
      const int hb = t / num_m_blocks;
      c.m_block = t - hb * num_m_blocks;
      c.batch = hb / heads;
      c.head = hb - c.batch * heads;
      return c;
    }
    const int section_tiles = section_hb * num_m_blocks;
    const int section = t / section_tiles;
    const int within = t - section * section_tiles;
    const int hb_first = section * section_hb;
    const int hb_in_section = num_hb - hb_first < section_hb ? num_hb - hb_first : section_hb;
    const int rank = within / hb_in_section;
    const int hb = hb_first + (within - rank * hb_in_section);
    const bool descending = dynamic || ((num_sections - 1 - section) & 1) == 0;
    c.m_block = descending ? num_m_blocks - 1 - rank : rank;
    c.batch = hb / heads;
    c.head = hb - c.batch * heads;
    return c;
  }
};

// ---------------------------------------------------------------------------------------------
// Varlen (docs/fwd_sm90.md "Tile order"). The tiles of every sequence of a packed batch in one
// persistent grid, without padding sequences to max_seqlen. The prepare kernel
// (kernels/src/varlen.cu; tests/cpp/test_tile_scheduler.cpp holds a host one) lists every
// (sequence, query block) pair that has rows, costliest first (cost: the key blocks its mask lets
// it visit, so one rule serves no mask, causal, windows and chunks), into a workspace of at most
// total_q / block_m + batch pairs. Tiles are (pair, head); the CTAs walk the linear tile index in
// the static scheduler's snake order: no atomics, reproducible, CUDA-graph safe (the prepare kernel
// runs in the graph). The order puts tiles that read the same K / V close together (the first
// order, the heads innermost over the whole list, read every head's K / V at once: on the H200 an
// order of magnitude more DRAM reads than the dense kernel for one 16k sequence at d128, and a
// large part of the kernel's time: bench/PERFLOG.md "the varlen gap") and
// keeps the costliest first:
// - Without a mask every query block of a sequence costs the same, and the list holds them
//   adjacent in query-block order (the prepare kernel keeps them so): each sequence's run of
//   pairs is walked head by head, query blocks fastest, so the CTAs running together share one
//   head's K / V of one sequence (the dense kernel's order), and costs still never increase
//   along t. One record load per tile: the run's other records differ only in m_block.
// - With a mask the list's order, pair major and the heads fastest, and when many sequences are
//   as long as the longest (the launcher's l2_sections: the caller's max_seqlen_q hint against the
//   packed tokens) in L2 sections as the dense scheduler's: as many heads (whole GQA groups) as fit
//   ~32 MiB of K / V (every sequence's), the sections alternating direction with the last one
//   costliest first. Equal lengths list the same query-block rank of every sequence together, so
//   heads innermost streamed K / V of 8 sequences x 16 heads at once and no two CTAs shared one
//   (d128, 16 x 1k causal: about twice the DRAM reads of the sections, and a slower kernel); a few
//   long sequences list one sequence's blocks together instead, and there the sections' balance
//   cost more than they saved (3-4 sequences of 1k - 8k; the figures: bench/PERFLOG.md
//   "the varlen gap"). The host test's random mixes balance >= 0.93 heads
//   innermost, >= 0.71 in sections.
// Cheaper lists than the sorted one measured worse in the host test's random mixes (causal
// balance, against >= 0.85 for the sorted list): sequences longest-first with each one's tiles
// together 0.78 (every sequence restarts at its costliest tile), query-block rank from each
// sequence's end 0.72, query-block index from the highest 0.73 (seqlen_k - seqlen_q differs per
// sequence).
// Masked calls claim their tiles at run time as dense ones do (`dynamic`; the counter lives in
// the list's header, which the prepare kernel zeroes), every section costliest first: the CTAs
// then finish together whatever the list's balance.
// ---------------------------------------------------------------------------------------------
struct VarlenTileScheduler {
  VarlenPair const* pairs;    // the prepare kernel's list (flash_hopper/varlen.h)
  VarlenHeader const* header;  // its num_pairs (the host knows only the capacity)
  int heads;
  int grid;           // CTAs: min(SMs, capacity * heads)
  bool by_sequence;   // unmasked: each sequence's run of pairs head by head
  int section_heads;  // masked: heads per L2 section (whole GQA groups; all heads: one section)
  int num_sections;
  // Masked calls with a tile counter: tiles after each CTA's first claimed at run time (the
  // dense scheduler's `dynamic`), every section costliest first.
  bool dynamic;

  // kv_bytes_per_head: K + V bytes of one KV head over the whole packed batch. l2_sections: a
  // masked call's tiles in L2 sections (else heads innermost over the whole list).
  static VarlenTileScheduler make(VarlenPair const* pairs, VarlenHeader const* header, int heads,
                                  int heads_per_kv, int64_t kv_bytes_per_head, bool masked,
                                  bool l2_sections, int grid, bool claimed = false) {
    VarlenTileScheduler s;
    s.pairs = pairs;
    s.header = header;
    s.heads = heads;
    s.grid = grid;
    s.by_sequence = !masked;
    s.dynamic = claimed && masked;
    s.section_heads = l2_section_heads(l2_sections ? kv_bytes_per_head : 0,
                                       heads_per_kv > 0 ? heads_per_kv : 1, heads);
    s.num_sections = (heads + s.section_heads - 1) / s.section_heads;
    return s;
  }

  FH_HOST_DEVICE int tile_count() const { return header->num_pairs * heads; }
  FH_HOST_DEVICE int index(int round, int cta) const { return snake_index(round, cta, grid); }
  FH_HOST_DEVICE TileCoord coord(int t) const {
    KeyBlockRange range;
    KeyBlockSplit split;
    return coord(t, range, split);
  }
  // Tile t with its key-block range and split (the prepare kernel computed them for this tile).
  FH_HOST_DEVICE TileCoord coord(int t, KeyBlockRange& range, KeyBlockSplit& split) const {
    int pair;
    int head;
    int m_block = -1;  // by_sequence: the run's query block (the loaded record is the run's)
    if (by_sequence) {
      // Run [first, first + m_blocks) of the list covers tiles [first, first + m_blocks) * heads,
      // so pair t / heads lies in t's run. Clamped: offsets the host did not check (graph
      // capture) may break the runs; the tile is then wrong but inside the sequence.
      pair = t / heads;
      VarlenPair const& r = pairs[pair];
      const int blocks = r.m_blocks > 0 ? r.m_blocks : 1;
      const int first = pair - r.m_block;
      const int within = t - first * heads;
      head = within / blocks;
      m_block = within - head * blocks;
      head = head < 0 ? 0 : head >= heads ? heads - 1 : head;
      m_block = m_block < 0 ? 0 : m_block >= blocks ? blocks - 1 : m_block;
    } else {
      const int num_pairs = header->num_pairs;
      const int section_tiles = section_heads * num_pairs;
      const int section = t / section_tiles;
      const int within = t - section * section_tiles;
      const int head_first = section * section_heads;
      const int in_section =
          heads - head_first < section_heads ? heads - head_first : section_heads;
      const int rank = within / in_section;
      const bool costliest_first = dynamic || ((num_sections - 1 - section) & 1) == 0;
      pair = costliest_first ? rank : num_pairs - 1 - rank;
      head = head_first + (within - rank * in_section);
    }
    VarlenPair const& v = pairs[pair];
    range = {v.n_min, v.n_max};
    split = {v.n_left, v.n_right};
    TileCoord c;
    c.head = head;
    c.pair = pair;
    c.batch = v.batch;
    c.m_block = m_block >= 0 ? m_block : v.m_block;
    c.q_start = v.q_start;
    c.k_start = v.k_start;
    c.seqlen_q = v.seqlen_q;
    c.seqlen_k = v.seqlen_k;
    return c;
  }
};

}  // namespace flash_hopper::sm90
