// The step schedule of the FA-3 path's backward (docs/bwd_sm90.md "Step schedule and tile order",
// "dQ and the deterministic mode"): which tiles a CTA computes, which (query head, query block)
// steps each visits, in which order the producer loads them and the consumer warpgroups use them,
// and how the consumer warpgroups add their dQ parts into the fp32 accumulator. Every role walks
// this one schedule, so the roles cannot disagree on the steps (a disagreement hangs the GPU
// instead of failing a test).
//
// Plain C++: the kernel instantiates the role loops with its device operations, the host test
// (tests/cpp/test_bwd_schedule.cpp) with recorders, and simulates the recorded traffic (mbarriers,
// named barriers, bulk reduce-adds, red.global adds, the deterministic mode's semaphores) over the
// whole persistent grid.
//
//   BwdTileScheduler  tile t -> (batch, kv head, key block n); persistent grid, snake order or
//                     claimed at run time
//   BwdCtaSchedule    one CTA's tiles + the mask policy -> BwdTileWork
//   BwdTileWork       one tile: its query blocks query_blocks(n), their unmasked split, and the
//                     steps i = 0 .. num_steps() - 1: (g = i / L, m = m_min + i % L), g outer
//   dq_rank           the position of key block n among the contributors of dQ block m
//   produce_bwd()     the producer's load order
//   consume_bwd_wg()  a consumer warpgroup's order of waits, GEMMs, releases and dQ adds
//   detail::add_dq()  one step's dQ protocol (slot + bulk reduce-add, red.global, or the
//                     deterministic mode's turn on the block's semaphore)
//
// Pipelines and named barriers: the contract at the top of kernel.h (its one copy). The KV
// pipeline's full parity counts tiles with queries only.
//
// Producer, per tile with queries: Q(step 0), dO(step 0), the tile into the tile slot, K+V, then
// Q(i), dO(i) for i >= 1; then (dynamic order) it claims the next tile. K/V come after the first
// step's loads so that the next tile's first Q/dO load while the finishing tile still holds K/V
// (its KV buffer is released only after its last GEMM). The consumers take each tile from the
// tile slot (produce_bwd).
//
// Consumer WG, one step (family A: S^T = K Q^T, each WG owning 64 keys):
//   wait Q(s) (its rows and their lse_log2); issue S; wait dO(s) (its rows and their D); issue
//   dP; wait<1> (S done) -> exponentials (softcap on capped calls, mask on masked steps,
//   P = exp2(..)); P -> 16 bit; issue dV += P^T dO (RS); wait<1> (dP done) -> dS (times the
//   softcap's derivative on capped calls); store dS to shared; sync PdS; issue dQ = dS K;
//   issue dK += dS^T Q (RS); wait<1> (dV, dQ done) -> release dO(s); add dQ (add_dq);
//   wait<0> (dK done) -> release Q(s) (the P / dS registers are free only now: they are the RS
//   GEMMs' A operands).
//   Or (Cfg::kDvAfterDs, FA3's order; the unmasked tile): wait<0> (dP done) right after the
//   exponentials, dS from the fp32 P and stored, then P -> 16 bit and dV issued: the fp32 P, dP
//   and the 16-bit P are never live together (the 80-query step spilled holding all three).
// Consumer WG, one step (family B, d192 / d256, Cfg::kFamilyB: 64 x 64 tiles, S = Q K^T and
// dP = dO V^T with each WG owning 32 keys; P and dS live in shared memory, sP and sdS one stage
// each; dV, dQ and dK are SS GEMMs with the WGs splitting head_dim, each reading both WGs' halves):
//   wait Q(s); issue S; wait dO(s); issue dP; wait<1> (S done) -> exponentials; sync PdSFree (sP /
//   sdS free: both WGs passed step s-1's wait<0>, the last of its readers of sP / sdS); store P ->
//   sP; wait<0> (dP done) -> dS -> sdS; sync PdS (both halves of P and dS are in shared memory);
//   issue dV (SS, sP); issue dQ (SS, sdS); issue dK (SS, sdS); wait<1> (dV, dQ done) -> release
//   dO(s); add dQ; wait<0> (dK done) -> release Q(s).
// The first sync replaces family A's second dS stage: without it, a WG could write step s+1's P
// while the other WG's dV still reads step s's (both buckets have two Q / dO stages, so the Q
// pipeline does not order it: Q(s+1) may already be resident while step s's GEMMs run). The
// P / dS registers are no GEMM operands here, so there is no RS register hazard.
// Both families: a step's kind, whether it needs the element mask (the step's) and whether the
// call caps its scores (softcap, the call's), is a compile-time property of its code (kMasked,
// kCapped). The consumer reads the call's softcap once, the tile's step loop is compiled once per
// value of it, and each step branches on its mask only: nothing in a step's element math tests
// either at run time (a run-time softcap test there is one branch per element, and ptxas does
// not schedule across them).
// Tiles without queries (every row masks the key block out) load nothing and touch no pipeline:
// the producer publishes them in the tile slot, the consumers store dK = dV = 0.
//
// dQ, per step and WG (add_dq; every WG adds a part of dQ: its columns, Cfg::kDqWgs = 2, or its
// own keys' partial sum over the whole block, kDqWgs = 1):
//   default mode, dQ slots (Cfg::kDqSlots): the WG stores its part into its shared-memory slot
//     (+ proxy fence), syncs DqSlot c, and its leader issues one bulk reduce-add of the slot. The
//     slot is written again one step later, after the step's PdS sync, which the leader
//     reaches only once that reduce-add read the slot (wait_dq_slot_read); before exit the leader
//     waits until its reduce-adds completed (finish_dq: shared memory must outlive their reads).
//   default mode, no slots (d256): every thread adds its fragment with red.global.add.v4.f32.
//   deterministic mode: dQ block m of (batch, q head) receives its contributors, the key blocks
//     of key_blocks(m), one at a time in the order of dq_rank: n descending, or, the
//     deterministic kernel on a full mask, the shift order (dq_rank).
//     The deterministic kernel (Cfg::kDeterministic, the families with dQ slots): a WG stores
//     its part into its slot once the dQ writer warp's adds of the previous step read the slots
//     (wait_dq_slot_free: the writer's dq_free barrier), WG 0's leader writes the step's record
//     (the block, its semaphore, the rank), and the WG arrives on DqStaged c (publish_dq); at the
//     end of its walk it publishes the end (publish_dq_end). The writer (write_dq_bwd) syncs
//     DqStaged 0 and 1, adds WG 1's slot into WG 0's where both WGs' partials cover the same
//     positions (kDqWgs = 1: their sum in one fixed order), spins until the block's semaphore
//     reaches the rank, issues the slots' bulk reduce-adds, arrives on dq_free once they read
//     the slots, and once they completed increments the semaphore. The consumers never wait for
//     a turn or an add, and the semaphore counts contributors.
//     The default kernels, on the call's run-time flag (d256's deterministic mode; the slot
//     families' deterministic calls run their deterministic kernel): thread 0 of WG 0 spins
//     until the semaphore equals dq_rank; sync DqTurn (both WGs); the WGs add with red.global
//     and fence (kDqWgs = 2: both at once, disjoint columns; kDqWgs = 1: WG 0, sync DqTurn, then
//     WG 1); sync DqTurn (every add fenced); thread 0 increments the semaphore.
//     Every wait is on a contributor of a smaller tile index (n descending: the tile order puts
//     each kv head's key blocks in descending n; the shift order: an earlier round, or the
//     same round, whose tiles run together) or, kDqWgs = 1 on the default kernels, on the same
//     tile's WG 0, whose own part never waits for WG 1; with every CTA resident the smallest
//     unfinished tile can always run: no deadlock, whatever the hardware's block launch order.
//     Every element of dQ is then summed in one order (rank, then WG 0's partial before WG 1's):
//     bitwise reproducible.
#pragma once

#include "flash_hopper/bwd_params.h"
#include "flash_hopper/host_device.h"
#include "flash_hopper/mask.h"
#include "sm90/common/tile_order.h"

// Same definitions as fwd/schedule.h (identical redefinitions are allowed if both are included).
#if defined(__CUDACC__)
#define FH_NO_UNROLL _Pragma("unroll 1")
#define FH_ROLE __forceinline__ __device__
#else
#define FH_NO_UNROLL
#define FH_ROLE inline
#endif

namespace flash_hopper::sm90 {

struct BwdTileCoord {
  int n_block;
  int kv_head;
  int batch;
};

// Tiles claimed at run time need a tile of this many steps at least (unless there are many key
// blocks): with fewer, the claim's round trip and the one-tile commitment cost more than the
// balance gains (d64 at 1k-2k, bench/PERFLOG.md "the backward's tiles claimed at run time").
inline constexpr int kBwdClaimMinSteps = 32;

// Persistent scheduler over (batch, kv head, key block n) tiles: a static walk, or claimed at run
// time (`dynamic`).
// Default order, static: (batch, kv head) major, n ascending: the CTAs running together share one
// kv group's Q, dO and dQ accumulator in L2. Unmasked tiles all cost the same; masked ones take
// this walk only where they are all short and few per kv head (4 num_n <= G), and there the snake
// cycles every CTA through all of them.
// Default order, dynamic (masked calls with a tile counter whose longest tile has
// kBwdClaimMinSteps steps, or with 4 num_n > G): a CTA takes the next tile of the order when it
// is done with its last one, so the CTAs finish together whatever the tiles cost. The order:
// sections of `section` (batch, kv head)s, inside each n major, heads inner, n ascending
// (longest_first = +1: causal / a bounded right edge, key block 0 sees the most rows) or
// descending (-1: a left edge only), so tiles come in decreasing work; a section is as many
// (batch, kv head)s as keep their Q, dO and fp32 dQ accumulator (q_bytes_per_kv_head each: every
// tile of the kv head streams them or adds into them) within the L2 budget of
// common/tile_order.h. A static walk could not have both: sections of G / 8 heads (its former
// order) held several times the L2 in rows at long sequences and ran far slower than head-major
// where head-major balanced, and sections sized for L2 left it unbalanced (bench/PERFLOG.md "the
// backward's tiles claimed at run time").
// Deterministic order: n descending inside every (batch, kv head) (the dQ rank order), kv heads
// interleaved in chunks of k key blocks, k = clamp(ceil(G / (b * h_kv)), 1, num_n): about G / k
// kv heads run together, each with k consecutive key blocks, so a dQ block's contributors that
// run at the same time form a staircase of at most k - 1 handoffs.
struct BwdTileScheduler {
  // Masked default-mode calls: CTA c's first tile is c, every further one grid + the value an
  // atomic increment of the call's tile counter (zeroed by the preprocess) returns, claimed by
  // the producer after its last load of the tile before (produce_bwd). FA3's and cuDNN's
  // backwards claim their tiles so too.
  bool dynamic;
  int num_n_blocks;
  int kv_heads;
  int q_per_kv;      // query heads per kv head (G_q)
  int num_hb;        // batch * kv_heads
  int total_tiles;
  int grid;          // CTAs: min(tiles, SMs), one CTA per SM
  int chunk;         // k, deterministic order only
  bool deterministic;
  int longest_first;  // dynamic: +1 / -1 sectioned n-major, n ascending / descending; else 0
  int section;        // dynamic: (batch, kv head)s per section
  int shift_blocks;   // deterministic shift order: the query blocks every tile walks; else 0

  // q_bytes_per_kv_head: the Q, dO and dQ-accumulator bytes of one (batch, kv head)'s query rows
  // (all its query heads), the dynamic order's section size (<= 0: one section).
  // longest_tile_steps: the steps of the costliest tile (query blocks x G_q) where the call has a
  // zeroed tile counter, else 0 (no claims: the preprocess did not run, seqlen_q = 0).
  // full_mask_query_blocks: the deterministic kernel's calls whose every tile walks all the
  // query blocks (no causal, window or chunk mask): their number, else 0.
  static BwdTileScheduler make(int seqlen_k, int block_n, int kv_heads, int q_per_kv, int batch,
                               bool deterministic, int num_sms, int longest_first = 0,
                               int64_t q_bytes_per_kv_head = 0, int longest_tile_steps = 0,
                               int full_mask_query_blocks = 0) {
    BwdTileScheduler s;
    s.num_n_blocks = (seqlen_k + block_n - 1) / block_n;
    s.kv_heads = kv_heads;
    s.q_per_kv = q_per_kv;
    s.num_hb = batch * kv_heads;
    s.total_tiles = s.num_n_blocks * s.num_hb;
    s.grid = s.total_tiles < num_sms ? s.total_tiles : num_sms;
    s.deterministic = deterministic;
    // Claims where tiles are long enough to hide a claim's round trip, or where a static walk
    // could not balance them (many key blocks).
    s.dynamic = !deterministic && longest_first != 0 && longest_tile_steps > 0 &&
                (longest_tile_steps >= kBwdClaimMinSteps || 4 * s.num_n_blocks > s.grid);
    s.longest_first = s.dynamic ? longest_first : 0;
    s.section = s.dynamic ? l2_section_heads(q_bytes_per_kv_head, 1, s.num_hb) : 1;
    s.chunk = s.clamped_chunk(s.num_hb > 0 ? (s.grid + s.num_hb - 1) / s.num_hb : 1);
    // A round's tiles of one (batch, kv head) are at most min(num_n, G); each starts its walk at
    // its own position, so they need as many query blocks to start apart.
    const int together = s.num_n_blocks < s.grid ? s.num_n_blocks : s.grid;
    s.shift_blocks = deterministic && full_mask_query_blocks > 0 &&
                             full_mask_query_blocks >= together
                         ? full_mask_query_blocks
                         : 0;
    return s;
  }

  // A chunk of k key blocks, clamped to [1, num_n].
  int clamped_chunk(int k) const {
    k = k < num_n_blocks ? k : num_n_blocks;
    return k < 1 ? 1 : k;
  }
  // The deterministic order (not the shift order) with k consecutive key blocks of a kv head per
  // chunk instead of the rule's; other walks unchanged. Any k keeps n descending inside every kv
  // head, the order's deadlock-freedom condition (FLASH_HOPPER_BWD_DET_CHUNK, launch.h;
  // measurements of the order's L2 reuse against its handoffs).
  BwdTileScheduler with_chunk(int k) const {
    BwdTileScheduler s = *this;
    if (deterministic && shift_blocks == 0) {
      s.chunk = clamped_chunk(k);
    }
    return s;
  }

  // The shift order's segment of tile (hb, n): the (batch, kv head)'s tiles in the round of
  // tile index t = hb * num_n + n (CTA c runs round r's tile r * G + c, snake-permuted), as
  // [first, first + count) of the head's tiles, and the tile's position in it.
  struct ShiftSegment {
    int first;
    int count;
    int pos;
  };
  FH_HOST_DEVICE ShiftSegment shift_segment(BwdTileCoord c) const {
    const int hb = c.batch * kv_heads + c.kv_head;
    const int head0 = hb * num_n_blocks;
    const int t = head0 + c.n_block;
    const int round0 = t / grid * grid;
    const int start = head0 > round0 ? head0 : round0;
    const int end = head0 + num_n_blocks < round0 + grid ? head0 + num_n_blocks : round0 + grid;
    return {start - head0, end - start, t - start};
  }

  // The tile index of round r for CTA c (the forward's snake).
  FH_HOST_DEVICE int index(int round, int cta) const { return snake_index(round, cta, grid); }

  // Tile t of the shift order: (batch, kv head) major, n ascending.
  FH_HOST_DEVICE BwdTileCoord shift_coord(int t) const {
    const int hb = t / num_n_blocks;
    BwdTileCoord c;
    c.n_block = t - hb * num_n_blocks;
    c.batch = hb / kv_heads;
    c.kv_head = hb - c.batch * kv_heads;
    return c;
  }

  FH_HOST_DEVICE BwdTileCoord coord(int t) const {
    int hb;
    int n;
    if (!deterministic && longest_first == 0) {
      hb = t / num_n_blocks;
      n = t - hb * num_n_blocks;
    } else if (!deterministic) {
      const int sec = t / (section * num_n_blocks);  // the last section may hold fewer heads
      const int hb0 = sec * section;
      const int heads = num_hb - hb0 < section ? num_hb - hb0 : section;
      const int within = t - hb0 * num_n_blocks;
      const int j = within / heads;
      hb = hb0 + (within - j * heads);
      n = longest_first > 0 ? j : num_n_blocks - 1 - j;
    } else {
      // Full chunks first (chunk index major, (batch, kv head) next, position in the chunk
      // fastest), then the partial last chunk of every (batch, kv head). pos counts key blocks
      // from the last one, so it grows with t inside every (batch, kv head).
      const int full_chunks = num_n_blocks / chunk;
      const int full_tiles = full_chunks * num_hb * chunk;
      int pos;
      if (t < full_tiles) {
        const int j = t / (num_hb * chunk);
        const int within = t - j * num_hb * chunk;
        hb = within / chunk;
        pos = j * chunk + (within - hb * chunk);
      } else {
        const int tail = num_n_blocks - full_chunks * chunk;
        const int within = t - full_tiles;
        hb = within / tail;
        pos = full_chunks * chunk + (within - hb * tail);
      }
      n = num_n_blocks - 1 - pos;
    }
    BwdTileCoord c;
    c.n_block = n;
    c.batch = hb / kv_heads;
    c.kv_head = hb - c.batch * kv_heads;
    return c;
  }
};

// The default mode's longest-first direction for a mask (BwdTileScheduler::longest_first): key
// block 0 sees the most rows when the right edge is bounded (causal, a window's right side, a
// chunk), the last key block when only the left edge is; unmasked tiles are all alike.
FH_HOST_DEVICE int bwd_longest_first(AttentionMask const& mask) {
  if (mask.window_right >= 0 || mask.chunk > 0) {
    return +1;
  }
  return mask.window_left >= 0 ? -1 : 0;
}

// Every row sees every column (no causal, window or chunk mask): every tile walks all the query
// blocks (the deterministic kernel's shift order).
FH_HOST_DEVICE bool bwd_full_mask(AttentionMask const& mask) {
  return mask.window_left < 0 && mask.window_right < 0 && mask.chunk == 0;
}

// Query blocks [m_left, m_right) of a tile's range whose every element is visible: they carry no
// mask arithmetic. m_min <= m_left <= m_right <= m_max.
struct QueryBlockSplit {
  int m_left;
  int m_right;

  FH_HOST_DEVICE bool masked(int m) const { return m < m_left || m >= m_right; }
};

// The transpose of AttentionMask::unmasked_blocks: the m of `range` with block_masked(m, n) false.
// block_masked has two terms: "the block ends after the first row's hi" turns false once as m
// grows, "it starts before the last row's lo" turns true once (both row bounds never decrease), so
// the unmasked m form one interval, found by two binary searches over the same two terms
// (tests/cpp/test_bwd_schedule.cpp compares it with block_masked on every step).
FH_HOST_DEVICE QueryBlockSplit unmasked_query_blocks(AttentionMask const& mask,
                                                     QueryBlockRange range, int n, int block_m,
                                                     int block_n) {
  const int first_col = n * block_n;
  int lo = range.m_min;
  int hi = range.m_max < range.m_min ? range.m_min : range.m_max;
  while (lo < hi) {  // first m whose first row's hi covers the whole block
    const int mid = (lo + hi) / 2;
    if (first_col + block_n <= mask.columns(mid * block_m).hi) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const int m_left = lo;
  hi = range.m_max < range.m_min ? range.m_min : range.m_max;
  while (lo < hi) {  // first m >= m_left whose last row's lo is past the block's first column
    const int mid = (lo + hi) / 2;
    if (first_col < mask.columns((mid + 1) * block_m - 1).lo) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return {m_left, lo};
}

struct QueryStep {
  int m;        // query block
  int g;        // query head within the kv group: dQ head kv_head * G_q + g
  bool masked;  // needs the element mask (diagonal, window edge, chunk edge or key tail)
  bool first;   // the tile's first step
  bool last;    // the tile's last step: its GEMMs are the last readers of K and V
};

// A tile's steps walk its query blocks from m_min + rotate (mod the range) for every query head
// of the group. Default mode rotates by n: the tiles running together (consecutive n of one kv
// head when unmasked) then add into different dQ blocks at any moment instead of all into the
// same one (same-address reductions serialize in L2). Deterministic mode does not rotate: a dQ
// block's contributors come in descending n, and each would wait for its predecessor's whole
// walk.
struct BwdTileWork {
  BwdTileCoord tile;
  BwdSpan span;  // the tile's sequence: where its rows are, its lengths
  int dq_row0;   // the workspace row of the sequence's row 0, query head 0 (BwdSpans::dq_row0)
  QueryBlockRange range;
  QueryBlockSplit split;
  int group;   // G_q
  int rotate;  // 0 <= rotate < blocks()

  // The call's mask on the tile's sequence (varlen: each sequence's own lengths).
  FH_HOST_DEVICE AttentionMask mask(AttentionMask m) const {
    m.seqlen_q = span.seqlen_q;
    m.seqlen_k = span.seqlen_k;
    return m;
  }

  FH_HOST_DEVICE bool has_queries() const { return !range.empty(); }
  FH_HOST_DEVICE int blocks() const { return range.empty() ? 0 : range.m_max - range.m_min; }
  FH_HOST_DEVICE int num_steps() const { return blocks() * group; }
  FH_HOST_DEVICE QueryStep step(int i) const {
    const int g = i / blocks();
    int j = i - g * blocks() + rotate;
    j = j >= blocks() ? j - blocks() : j;
    const int m = range.m_min + j;
    return {m, g, split.masked(m), i == 0, i == num_steps() - 1};
  }
  // step(i) from s = step(i - 1), 0 < i < num_steps(): the next query block, wrapping from the
  // range's end to its start, and the next query head once the walk is back at its first block.
  // The step loops advance this way: step(i)'s division by blocks() sat on every step's path
  // (an integer division is ~40 instructions, one of them a MUFU.RCP beside the exponentials).
  FH_HOST_DEVICE QueryStep next(QueryStep s, int i) const {
    const int m = s.m + 1 == range.m_max ? range.m_min : s.m + 1;
    const int g = m == range.m_min + rotate ? s.g + 1 : s.g;
    return {m, g, split.masked(m), false, i == num_steps() - 1};
  }
  FH_HOST_DEVICE int dq_head(QueryStep s) const { return tile.kv_head * group + s.g; }
};

// What the producer publishes in the tile slot (produce_bwd): a tile, or the end of its walk.
struct PublishedTile {
  BwdTileWork work;
  int end;  // 1: no tile; the walk is over
};

// The position of key block n among the contributors of dQ block m in deterministic mode.
// Descending n: contributors are the key blocks of key_blocks(m) (query_blocks is its exact
// transpose), added in descending n. The shift order (tiles.shift_blocks): a (batch, kv head)'s
// tiles of earlier rounds first (their positions in their own rounds); in the tile's round, the
// order in which the round's tiles reach block m when each starts its walk at its position in
// the segment (rotate): segment position pos reaches block m at step (m - pos) mod blocks, so
// for m >= count - 1 the order is pos descending, and below it m, m - 1, .., 0, count - 1, ..,
// m + 1. Running together, no tile waits for another: each block's predecessor added one step
// earlier.
// kShiftOrder: compiled with the shift order (the deterministic kernel; the default kernels'
// run-time deterministic path never gets it).
template <bool kShiftOrder>
FH_HOST_DEVICE int dq_rank(BwdTileScheduler const& tiles, AttentionMask const& mask, int m,
                           BwdTileCoord c, int block_m, int block_n) {
  if constexpr (kShiftOrder) {
    if (tiles.shift_blocks > 0) {
      const BwdTileScheduler::ShiftSegment g = tiles.shift_segment(c);
      const int row = m < g.count - 1 ? m : g.count - 1;
      const int behind = row - g.pos;
      return g.first + (behind < 0 ? behind + g.count : behind);
    }
  }
  return mask.key_blocks(m, block_m, block_n).n_max - 1 - c.n_block;
}

// One CTA's walk over the tile order, with the mask applied per tile. kShiftOrder: compiled with
// the shift order (the deterministic kernel).
// Varlen (spans.cu_q non-null): the tiles of (sequence b, kv head, n) for n below the bound of
// the key blocks; the tiles past a sequence's keys have no queries and no rows.
template <int kBlockM, int kBlockN, bool kShiftOrder = false>
struct BwdCtaSchedule {
  BwdTileScheduler const& tiles;
  AttentionMask mask;  // the call's; dense: its lengths, varlen: their bounds
  int cta;
  BwdSpans spans{};    // varlen: the sequences (dense: cu_q null, the mask's lengths)

  FH_HOST_DEVICE BwdSpan span(int b) const {
    return spans.cu_q != nullptr ? spans(b) : BwdSpan{b, 0, 0, mask.seqlen_q, mask.seqlen_k, 0};
  }

  FH_HOST_DEVICE BwdTileWork make_work(BwdTileCoord c) const {
    BwdTileWork w;
    w.tile = c;
    w.span = span(c.batch);
    w.dq_row0 = spans.dq_row0(w.span);
    const AttentionMask m = w.mask(mask);
    w.range = m.query_blocks(c.n_block, kBlockM, kBlockN);
    w.split = unmasked_query_blocks(m, w.range, c.n_block, kBlockM, kBlockN);
    w.group = tiles.q_per_kv;
    w.rotate = tiles.deterministic || w.range.empty() ? 0 : c.n_block % w.blocks();
    if constexpr (kShiftOrder) {
      if (tiles.shift_blocks > 0) {
        w.rotate = tiles.shift_segment(c).pos;  // < count <= shift_blocks = blocks()
      }
    }
    return w;
  }

  // Tile t, or false for an index past the last tile (the end of every CTA's walk).
  FH_HOST_DEVICE bool work(int t, BwdTileWork& w) const {
    if (t >= tiles.total_tiles) {
      return false;
    }
    if constexpr (kShiftOrder) {
      w = make_work(tiles.shift_blocks > 0 ? tiles.shift_coord(t) : tiles.coord(t));
    } else {
      w = make_work(tiles.coord(t));
    }
    return true;
  }

  // The producer's walk: its first tile, and the tile after round `round` (claim(): the value of
  // the tile counter's atomic increment, asked for only when the order is dynamic).
  FH_HOST_DEVICE int first_tile() const { return tiles.index(0, cta); }
  FH_HOST_DEVICE bool claims() const { return tiles.dynamic; }
  template <class Claim>
  FH_HOST_DEVICE int next_tile(int round, Claim&& claim) const {
    return tiles.dynamic ? tiles.grid + claim() : tiles.index(round + 1, cta);
  }
};

// ---------------------------------------------------------------------------------------------
// Producer. Ops: publish(tile) (into the tile slot, then the TileSlot sync with both consumer
// WGs), q(w, step) (Q rows), dout(w, step) (dO rows), kv(w) (K and V), claim() (dynamic order:
// the tile counter's atomic increment, for the whole warp).
// Every tile of the CTA's walk, and then the end of the walk, goes to the consumers through the
// tile slot in shared memory (a PublishedTile, two buffers; kernel.h): the consumers learn their
// tiles from it, whether the walk is static or claimed at run time, and do not recompute a
// tile's query blocks between two tiles. The producer writes tile i into buffer i % 2 and syncs
// with the consumers, who then read it: they reach that sync only when done with tile i - 1, so
// the producer publishes a tile with queries between its first Q / dO loads and its K / V (whose
// buffer frees at the same moment), and buffer i % 2 is rewritten only after every consumer
// thread passed the next sync, after its read. The next tile is claimed after the tile's last
// load: claimed earlier, a CTA commits to it a tile's time sooner and the tail balances worse
// (bench/PERFLOG.md "the backward's tiles claimed at run time").
// ---------------------------------------------------------------------------------------------
template <class Schedule, class Ops>
FH_ROLE void produce_bwd(Schedule const& sched, Ops& ops) {
  int t = sched.first_tile();
  FH_NO_UNROLL
  for (int round = 0;; ++round) {
    PublishedTile tile{};
    tile.end = sched.work(t, tile.work) ? 0 : 1;
    BwdTileWork const& w = tile.work;
    if (tile.end || !w.has_queries()) {  // no tile; or the consumers store dK = dV = 0
      ops.publish(tile);
      if (tile.end) {
        return;
      }
    } else {
      ops.q(w, w.step(0));
      ops.dout(w, w.step(0));
      ops.publish(tile);
      ops.kv(w);
      QueryStep s = w.step(0);
      FH_NO_UNROLL
      for (int i = 1; i < w.num_steps(); ++i) {
        s = w.next(s, i);
        ops.q(w, s);
        ops.dout(w, s);
      }
    }
    t = sched.next_tile(round, [&] { return ops.claim(); });
  }
}

// ---------------------------------------------------------------------------------------------
// Consumers (families A and B). Each consumer warpgroup walks the same steps. Ops:
//   tiles       take_tile(w) (the TileSlot sync, then the tile slot's next buffer; false: the
//               end of the walk)
//   pipelines   wait_kv(w) / release_kv(w), wait_q(w, s) / release_q(w, s),
//               wait_dout(w, s) / release_dout(w, s)
//   GEMMs       issue_s(f), issue_dp(f), issue_dv(f), issue_dq(f), issue_dk(f),
//               wait_gemms<kInFlight>()
//   math        softcapped() (whether the call caps its scores), softcap<kCapped>(f) (nothing
//               unless kCapped); transform<kMasked>(f, w, s) (element mask, P = exp2),
//               convert_p(f) (P -> 16 bit: family A dV's A operand, family B sP's),
//               compute_ds<kCapped>(f, w, s) (dS = P (dP - D), times softcap' if kCapped,
//               dS -> 16 bit, dS -> shared), family B: store_p(f, w, s) (P -> sP)
//   barriers    sync_pds(); family B: sync_pds_free()
//   dQ          dq_block(w, s): the step's block of the accumulator (the adds' target);
//               dQ slots: wait_dq_slot_read() (the leader: its last bulk reduce-add read the
//               slot), dq_slot() (the WG's slot), stage_dq(f, slot) (the WG's part -> its slot
//               + proxy fence), sync_dq_slot(slot) (DqSlot c), reduce_dq_slot(b, slot) (the
//               leader: one bulk reduce-add), finish_dq() (the leader: every bulk reduce-add
//               completed);
//               add_dq(f, b) (red.global.add.v4.f32 of the thread's fragment), fence_dq();
//               deterministic mode: deterministic(), dq_turn(w, s) (the block's semaphore and
//               this key block's dq_rank); the deterministic kernel: wait_dq_slot_free() (the
//               writer's adds of the WG's previous part read the slots), publish_dq(b, t) (WG
//               0's leader: the record; DqStaged c), publish_dq_end(); the default
//               kernels: wait_dq_turn(t) (thread 0: spin until the semaphore equals the rank),
//               sync_dq_turn() (DqTurn), pass_dq_turn(t) (thread 0: + 1), is_wg(c) (this is
//               consumer WG c)
//   tiles       clear_dkv(f), store_dkv(f, w), store_zero(w) (tile without queries)
// f is the register state of the tile (Ops::TileState). Cfg supplies kFamilyB (family B's step,
// bwd_step_b, for d192 / d256), kDqWgs and kDqSlots (tile_config.h) and kDeterministic (the
// deterministic kernel, bwd/kernel_traits.h). Both WGs run the same code and meet at the same
// barrier instructions.
// ---------------------------------------------------------------------------------------------
namespace detail {

// Both families open a step alike: Q, S, dO, dP, then S is ready (dP in flight).
template <class Ops, class State>
FH_ROLE void start_step(Ops& ops, State& f, BwdTileWork const& w, QueryStep s) {
  ops.wait_q(w, s);
  ops.issue_s(f);
  ops.wait_dout(w, s);
  ops.issue_dp(f);
  ops.template wait_gemms<1>();  // S done, dP in flight
}

// The exponentials: softcap (capped calls), then the mask and P (the rows' lse_log2 from the
// step's Q stage).
template <bool kMasked, bool kCapped, class Ops, class State>
FH_ROLE void exponentials(Ops& ops, State& f, BwdTileWork const& w, QueryStep s) {
  ops.template softcap<kCapped>(f);
  ops.template transform<kMasked>(f, w, s);
}

// dS is in shared memory: the PdS sync. The same sync frees the WG's dQ slot for this step's dQ:
// its leader reaches it only after the previous step's bulk reduce-add read the slot (default
// mode; deterministic mode frees it in add_dq).
template <class Cfg, class Ops>
FH_ROLE void ds_written(Ops& ops) {
  if constexpr (Cfg::kDqSlots && !Cfg::kDeterministic) {
    ops.wait_dq_slot_read();
  }
  ops.sync_pds();
}

// One step's dQ part of this WG into the fp32 accumulator (the protocol in the header comment).
template <class Cfg, class Ops, class State>
FH_ROLE void add_dq(Ops& ops, State& f, BwdTileWork const& w, QueryStep s) {
  if constexpr (Cfg::kDeterministic) {  // added by the dQ writer warp (write_dq_bwd)
    const auto slot = ops.dq_slot();
    ops.wait_dq_slot_free();  // the writer's adds of the previous step read the slots
    ops.stage_dq(f, slot);
    // The record (WG 0's leader) and DqStaged c; the target and turn derived after the staging
    // (not held across it).
    ops.publish_dq(ops.dq_block(w, s), ops.dq_turn(w, s));
    return;
  }
  const auto block = ops.dq_block(w, s);
  if (!ops.deterministic()) {
    if constexpr (Cfg::kDqSlots) {
      const auto slot = ops.dq_slot();
      ops.stage_dq(f, slot);
      ops.sync_dq_slot(slot);
      ops.reduce_dq_slot(block, slot);  // runs under the next step's GEMMs
    } else {
      ops.add_dq(f, block);
    }
    return;
  }
  const auto turn = ops.dq_turn(w, s);
  {  // red.global adds from registers under the DqTurn handshake
    ops.wait_dq_turn(turn);
    ops.sync_dq_turn();
    if constexpr (Cfg::kDqWgs == 2) {  // disjoint columns: both WGs at once
      ops.add_dq(f, block);
      ops.fence_dq();
    } else {  // the same positions: WG 0's partial, then WG 1's, always in this order
      for (int wg = 0; wg < 2; ++wg) {
        if (ops.is_wg(wg)) {
          ops.add_dq(f, block);
          ops.fence_dq();
        }
        if (wg == 0) {
          ops.sync_dq_turn();
        }
      }
    }
    ops.sync_dq_turn();  // every add of the CTA performed
    ops.pass_dq_turn(turn);
  }
}

// Both families close a step alike, once dV is in flight and dS is in shared memory: dQ and dK
// issued, dO released when dV and dQ completed, dQ added under dK, then Q released when dK
// completed (the last reader of Q, and of family A's P / dS registers and family B's sP / sdS).
template <class Cfg, class Ops, class State>
FH_ROLE void finish_step(Ops& ops, State& f, BwdTileWork const& w, QueryStep s) {
  ops.issue_dq(f);
  ops.issue_dk(f);
  ops.template wait_gemms<1>();  // dV and dQ done, dK in flight
  ops.release_dout(w, s);
  add_dq<Cfg>(ops, f, w, s);
  ops.template wait_gemms<0>();  // dK done
  ops.release_q(w, s);
}

template <class Cfg, bool kMasked, bool kCapped, class Ops, class State>
FH_ROLE void bwd_step(Ops& ops, State& f, BwdTileWork const& w, QueryStep s) {
  start_step(ops, f, w, s);
  exponentials<kMasked, kCapped>(ops, f, w, s);
  if constexpr (Cfg::kDvAfterDs) {
    ops.template wait_gemms<0>();  // dP done
    ops.template compute_ds<kCapped>(f, w, s);
    ops.convert_p(f);
    ops.issue_dv(f);
  } else {
    ops.convert_p(f);
    ops.issue_dv(f);               // the dS arithmetic below runs under this GEMM
    ops.template wait_gemms<1>();  // dP done, dV in flight
    ops.template compute_ds<kCapped>(f, w, s);
  }
  ds_written<Cfg>(ops);          // both WGs' dS are in shared memory
  finish_step<Cfg>(ops, f, w, s);
}

// Family B: P and dS go through the single-stage sP / sdS, read by both WGs' SS GEMMs.
template <class Cfg, bool kMasked, bool kCapped, class Ops, class State>
FH_ROLE void bwd_step_b(Ops& ops, State& f, BwdTileWork const& w, QueryStep s) {
  start_step(ops, f, w, s);
  exponentials<kMasked, kCapped>(ops, f, w, s);
  ops.convert_p(f);
  ops.sync_pds_free();           // both WGs' GEMMs of the previous step (sP / sdS readers) done
  ops.store_p(f, w, s);
  ops.template wait_gemms<0>();  // dP done
  ops.template compute_ds<kCapped>(f, w, s);
  ds_written<Cfg>(ops);          // both WGs' halves of P and dS are in shared memory
  ops.issue_dv(f);
  finish_step<Cfg>(ops, f, w, s);
}

template <class Cfg, bool kMasked, bool kCapped, class Ops, class State>
FH_ROLE void step(Ops& ops, State& f, BwdTileWork const& w, QueryStep s) {
  if constexpr (Cfg::kFamilyB) {
    bwd_step_b<Cfg, kMasked, kCapped>(ops, f, w, s);
  } else {
    bwd_step<Cfg, kMasked, kCapped>(ops, f, w, s);
  }
}

// A tile's steps in the code of the call's softcap (kCapped), each masked or not. Plain
// branches, no lambdas: the compiler need not inline a lambda, and a GEMM in flight across a
// call is serialized.
template <class Cfg, bool kCapped, class Ops, class State>
FH_ROLE void tile_steps(Ops& ops, State& f, BwdTileWork const& w) {
  QueryStep s = w.step(0);
  FH_NO_UNROLL
  for (int i = 0; i < w.num_steps(); ++i) {
    if (i > 0) {
      s = w.next(s, i);
    }
    if (s.masked) {
      step<Cfg, true, kCapped>(ops, f, w, s);
    } else {
      step<Cfg, false, kCapped>(ops, f, w, s);
    }
  }
}

}  // namespace detail

template <class Cfg, class Schedule, class Ops>
FH_ROLE void consume_bwd_wg(Schedule const& sched, Ops& ops) {
  const bool capped = ops.softcapped();
  FH_NO_UNROLL
  for (;;) {
    BwdTileWork w;
    if (!ops.take_tile(w)) {
      break;  // the end of the walk
    }
    if (!w.has_queries()) {
      ops.store_zero(w);
      continue;
    }
    typename Ops::TileState f;
    ops.clear_dkv(f);
    ops.wait_kv(w);
    if (Cfg::kConfig.serves_softcap && capped) {  // else no capped code is compiled
      detail::tile_steps<Cfg, Cfg::kConfig.serves_softcap>(ops, f, w);
    } else {
      detail::tile_steps<Cfg, false>(ops, f, w);
    }
    ops.release_kv(w);  // after the last step's wait_gemms<0>: no GEMM reads K or V any more
    ops.store_dkv(f, w);
  }
  if constexpr (Cfg::kDeterministic) {  // the end of the walk for the dQ writer
    ops.wait_dq_slot_free();
    ops.publish_dq_end();
  } else if constexpr (Cfg::kDqSlots) {
    ops.finish_dq();  // the CTA's shared memory must outlive the last reduce-add's reads
  }
}

// The deterministic kernel's dQ writer warp: per step, once both WGs staged their parts (and WG
// 0 the record), the parts' sum (dq_wgs = 1: WG 1's slot added into WG 0's) or both halves
// (dq_wgs = 2) go to the accumulator in the block's turn; the slots are free again once the
// reduce-adds read them, and the turn passes once they completed. Ops: wait_staged() (DqStaged
// 0 and 1: the record), walk_ended(r), combine_slots(), wait_turn(r) (spin until the block's
// semaphore reaches the rank), reduce_slots(r) (the bulk reduce-adds), free_slots() (their
// reads done: dq_free), pass_turn(r) (completed: semaphore + 1).
template <class Cfg, class Ops>
FH_ROLE void write_dq_bwd(Ops& ops) {
  FH_NO_UNROLL
  for (;;) {
    const auto part = ops.wait_staged();
    if (ops.walk_ended(part)) {
      break;
    }
    if constexpr (Cfg::kDqWgs == 1) {
      ops.combine_slots();
    }
    ops.wait_turn(part);
    ops.reduce_slots(part);
    ops.free_slots();
    ops.pass_turn(part);
  }
}

}  // namespace flash_hopper::sm90
