// Host test of the FA-3 backward's schedule (kernels/sm90/bwd/schedule.h): the tile order, the
// steps of every tile, dq_rank and the role loops the kernel's producer and consumer warpgroups
// run, dQ protocol included (detail::add_dq), with recorders in place of the TMA, WGMMA, barrier,
// bulk-copy, red.global and semaphore operations. The simulated families are the kernel's, taken
// from the tuned-config table (bwd/tile_config.h bwd_config for d64 / d96 / d128 / d192 / d256).
//  a. every tile exactly once for grids of 1, 3, 7 and 132 CTAs, both orders;
//  b. deterministic order: inside every (batch, kv head) the tile index grows as n falls (the
//     deadlock-freedom condition, docs/bwd_sm90.md "dQ and the deterministic mode");
//  c. random problems (lengths 0..700, causal / windows / chunks, GQA 1..8): each tile's steps
//     are exactly {(g, m) : n in key_blocks(m)} (brute force, not query_blocks), g outer; masked
//     == block_masked, unmasked blocks fully visible; first / last; every visible (row, col) of
//     every query head lies in exactly one visited (tile, step);
//  d. the whole grid (producer and two consumer WGs per CTA) recorded and simulated in random
//     interleavings with mbarrier, named-barrier (count-based), sdS / sP buffer, dQ-slot, bulk
//     reduce-add (read and complete as separate events), red.global (performed at some later
//     point, or at a fence) and global-semaphore semantics, plus per-consumer checks (buffers
//     of the right step, RS register hazards in family A, releases after the last reader, dK /
//     dV sum each step once, every step in the code of its call's softcap), for every built
//     family. A vector clock per CTA orders its agents' events (happens-before through
//     mbarriers and named barriers): every write of sdS / sP must follow every completed GEMM
//     that read the previous contents, and every read must follow both WGs' writes. The dQ
//     protocol: no deadlock, every dQ block receives each contributor's part of each WG exactly
//     once, no dQ slot rewritten before its reduce-add read it, no bulk reduce-add in flight
//     when its WG exits; deterministic mode: the semaphore passes only after the holder's adds
//     were performed, each element's adds come in the order (n descending, WG ascending), and
//     the sums are bitwise equal over two interleavings;
//  e. negative controls: broken variants of the schedule and of the protocol that must be
//     caught.
// Prints "OK" on success.
#include <algorithm>
#include <array>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "flash_hopper/mask.h"
#include "sm90/bwd/schedule.h"
#include "sm90/bwd/tile_config.h"
#include "sm90/common/pipeline.h"

using namespace flash_hopper;
using namespace flash_hopper::sm90;

static int failures = 0;
static bool quiet = false;  // negative controls: count failures without printing them
static std::string context;

#define CHECK(cond, ...)                               \
  do {                                                 \
    if (!(cond)) {                                     \
      if (!quiet && failures < 20) {                   \
        std::printf("FAIL [%s]: ", context.c_str());   \
        std::printf(__VA_ARGS__);                      \
        std::printf("\n");                             \
      }                                                \
      ++failures;                                      \
    }                                                  \
  } while (0)

// ------------------------------------------------------------------------------------------------
// Problems and the (sabotageable) schedule
// ------------------------------------------------------------------------------------------------
struct Problem {
  int batch, kv_heads, q_per_kv, seqlen_q, seqlen_k, grid_sms;
  AttentionMask mask;  // varlen: with the bounds of the sequences' lengths
  bool deterministic;
  bool softcap = false;  // every step of the call must run the capped code, none of another call
  int det_chunk = 0;     // > 0: the deterministic order's chunk overridden (with_chunk)
  // Varlen: batch + 1 offsets each (seqlen_q / seqlen_k are then the lengths' bounds, which
  // some sequences exceed: the kernel clamps them); empty: dense.
  std::vector<int32_t> cu_q, cu_k;
  int q_heads() const { return kv_heads * q_per_kv; }
  bool varlen() const { return !cu_q.empty(); }
  BwdSpans spans() const {
    BwdSpans s;
    if (varlen()) {
      s.cu_q = cu_q.data();
      s.cu_k = cu_k.data();
      s.total_q = cu_q.back();
      s.total_k = cu_k.back();
    }
    s.seqlen_q = seqlen_q;
    s.seqlen_k = seqlen_k;
    return s;
  }
  // The mask of sequence b: the call's on its own lengths.
  AttentionMask seq_mask(int b) const {
    AttentionMask m = mask;
    if (varlen()) {
      const BwdSpan s = spans()(b);
      m.seqlen_q = s.seqlen_q;
      m.seqlen_k = s.seqlen_k;
    }
    return m;
  }
};

static Problem random_problem(std::mt19937& rng) {
  Problem p;
  p.batch = 1 + int(rng() % 2);
  p.kv_heads = 1 + int(rng() % 2);
  p.q_per_kv = 1 + int(rng() % 8);
  const int len_kind = int(rng() % 4);
  auto len = [&]() {
    return len_kind == 0 ? int(rng() % 3) : len_kind == 1 ? int(rng() % 200) : int(rng() % 701);
  };
  p.seqlen_q = len();
  p.seqlen_k = rng() % 5 == 0 ? p.seqlen_q : len();
  const int grids[] = {1, 2, 3, 7, 132};
  p.grid_sms = grids[rng() % 5];
  const int kind = int(rng() % 6);
  int wl = -1, wr = -1, chunk = 0;
  if (kind == 1) {
    wr = 0;  // causal
  } else if (kind == 2) {
    wl = int(rng() % 400);
    wr = rng() % 3 == 0 ? 0 : int(rng() % 400);
  } else if (kind == 3) {
    wl = int(rng() % 400);
  } else if (kind == 4) {
    wr = int(rng() % 400);
  } else if (kind == 5) {
    chunk = 1 + int(rng() % 300);
    wr = rng() % 2 ? 0 : -1;
  }
  p.mask = AttentionMask{p.seqlen_q, p.seqlen_k, wl, wr, chunk};
  p.deterministic = rng() % 2 == 0;
  p.softcap = rng() % 2 == 0;
  p.det_chunk = rng() % 3 == 0 ? 1 + int(rng() % 8) : 0;
  if (rng() % 3 == 0) {  // varlen: 1..5 sequences up to the bounds, a few past them
    p.batch = 1 + int(rng() % 5);
    p.cu_q.assign(1, 0);
    p.cu_k.assign(1, 0);
    for (int b = 0; b < p.batch; ++b) {
      auto length = [&](int bound) {
        const int over = rng() % 8 == 0 ? int(rng() % 60) : 0;
        return int(rng() % uint32_t(bound + 1)) + over;
      };
      p.cu_q.push_back(p.cu_q.back() + length(p.seqlen_q));
      p.cu_k.push_back(p.cu_k.back() + length(p.seqlen_k));
    }
  }
  return p;
}

static std::string describe(Problem const& p, int bm, int bn) {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "%dx%d | b %d hkv %d gq %d sq %d sk %d wl %d wr %d chunk %d sms %d det %d (k %d) "
                "cap %d%s",
                bm, bn, p.batch, p.kv_heads, p.q_per_kv, p.seqlen_q, p.seqlen_k,
                p.mask.window_left, p.mask.window_right, p.mask.chunk, p.grid_sms,
                int(p.deterministic), p.det_chunk, int(p.softcap), p.varlen() ? " varlen" : "");
  std::string d = buf;
  for (size_t b = 0; b + 1 < p.cu_q.size(); ++b) {
    d += " (" + std::to_string(p.cu_q[b + 1] - p.cu_q[b]) + "," +
         std::to_string(p.cu_k[b + 1] - p.cu_k[b]) + ")";
  }
  return d;
}

// The kernel's scheduler (launch.h): its L2 sections sized by a bf16 d128 row (the section size is
// a balance question, not a correctness one) and tiles claimed at run time where the kernel
// claims them (a masked default-mode call with query rows).
// det_kernel: the deterministic kernel's launch, which passes the query blocks of a full mask
// (the shift order).
static BwdTileScheduler make_tiles(Problem const& p, int bm, int bn, bool det_kernel = false) {
  const int64_t q_bytes = int64_t(p.seqlen_q) * p.q_per_kv * 128 * 8;
  const bool full = bwd_full_mask(p.mask);
  const BwdTileScheduler s = BwdTileScheduler::make(
      p.seqlen_k, bn, p.kv_heads, p.q_per_kv, p.batch, p.deterministic, p.grid_sms,
      bwd_longest_first(p.mask), q_bytes, (p.seqlen_q + bm - 1) / bm * p.q_per_kv,
      det_kernel && full && !p.varlen() ? (p.seqlen_q + bm - 1) / bm : 0);
  // launch.h: FLASH_HOPPER_BWD_DET_CHUNK overrides the deterministic order's chunk
  return p.det_chunk > 0 ? s.with_chunk(p.det_chunk) : s;
}

// A dynamic walk's claims as a run might hand them out: claim value v (tile grid + v) goes to a
// random CTA that has not yet failed to claim; each CTA's last claim is one of the last grid
// values (its first index past the tiles), so every CTA gets exactly one of those.
static std::vector<std::deque<int>> random_claims(BwdTileScheduler const& tiles,
                                                  std::mt19937& rng) {
  const int g = tiles.grid;
  std::vector<std::deque<int>> claims(size_t(g > 0 ? g : 0));
  std::vector<int> open(size_t(g > 0 ? g : 0));
  for (int c = 0; c < g; ++c) {
    open[size_t(c)] = c;
  }
  const int values = tiles.total_tiles > g ? tiles.total_tiles : g;  // up to the last failing one
  for (int v = 0; v < values && !open.empty(); ++v) {
    const size_t i = rng() % open.size();
    claims[size_t(open[i])].push_back(v);
    if (g + v >= tiles.total_tiles) {  // past the last tile: this CTA's walk ends
      open.erase(open.begin() + long(i));
    }
  }
  return claims;
}

// Negative controls, applied on top of the real schedule and protocol.
struct Sabotage {
  bool ascending = false;   // deterministic order with n ascending inside every kv head
  int rank_offset = 0;      // dq_rank off by this much
  bool drop_block = false;  // every tile's step range loses its last query block
  int skip_load = -1;       // the producer forgets its load with this index
  int wrong_load = -1;      // the producer loads the next query block instead
  int skip_release = -1;    // a consumer forgets its Q release with this index
  bool no_pds = false;      // the consumers skip the PdS barrier
  bool dq_reads_all = false;  // dq_wgs = 1: the dQ GEMM reads both WGs' sdS parts (WG-local PdS)
  bool no_free_sync = false;  // family B: no PdS sync before overwriting sP / sdS
  // The dQ protocol (step indices count a WG's steps over its whole walk):
  int skip_add = -1;          // WG 0 adds nothing on this step
  bool no_slot_wait = false;  // the leader does not wait for its last reduce-add to read the slot
  bool no_finish = false;     // the leader exits without waiting for its reduce-adds to complete
  bool no_fence = false;      // deterministic: no fence after the adds
  int skip_pass = -1;         // deterministic: thread 0 does not pass the turn on this step
  int pass_by = 1;            // deterministic: thread 0 adds this to the semaphore
  // The deterministic kernel's dQ writer warp:
  bool no_complete = false;   // the writer passes the turn without waiting for its adds
  bool no_read_wait = false;  // the writer frees the slots without waiting for its adds' reads
  bool default_kernel = false;  // a slot family's deterministic call on its default kernel
  bool no_handoff = false;    // default kernel, dq_wgs = 1: no DqTurn sync between WG 0 and WG 1
  bool softcap_misread = false;  // the consumers' softcapped() answers the opposite of the call
  bool no_empty_publish = false;  // the producer publishes no tile without queries
  bool single_tile_slot = false;  // the tile slot has one buffer
  bool skip_claim = false;        // the producer drops its first claimed tile
};

template <int BM, int BN, bool kShiftOrder = false>
struct TestSchedule {
  BwdCtaSchedule<BM, BN, kShiftOrder> base;
  Sabotage sab;

  bool work(int t, BwdTileWork& w) const {
    if (!base.work(t, w)) {
      return false;
    }
    if (sab.ascending) {
      BwdTileCoord c = w.tile;
      c.n_block = base.tiles.num_n_blocks - 1 - c.n_block;
      w = base.make_work(c);
    }
    if (sab.drop_block && !w.range.empty()) {
      --w.range.m_max;
      w.split.m_right = std::min(w.split.m_right, w.range.m_max);
      w.split.m_left = std::min(w.split.m_left, w.split.m_right);
    }
    return true;
  }
  int first_tile() const { return base.first_tile(); }
  bool claims() const { return base.claims(); }
  template <class Claim>
  int next_tile(int round, Claim&& claim) const {
    return base.next_tile(round, claim);
  }
};

static int tile_id(Problem const& p, BwdTileCoord c, int num_n) {
  return (c.batch * p.kv_heads + c.kv_head) * num_n + c.n_block;
}

// dQ block (batch, q head, m): the semaphore / accumulator index.
static int dq_key(Problem const& p, int bm, BwdTileWork const& w, QueryStep s) {
  const int num_m = (p.seqlen_q + bm - 1) / bm;
  return (w.tile.batch * p.q_heads() + w.dq_head(s)) * num_m + s.m;
}

// ------------------------------------------------------------------------------------------------
// a, b: the tile order
// ------------------------------------------------------------------------------------------------
// chunk > 0: the deterministic order's chunk overridden (FLASH_HOPPER_BWD_DET_CHUNK).
static void check_tile_order(int seqlen_k, int bn, int kv_heads, int batch, bool det, int sms,
                             int longest_first = 0, int steps = 0, int64_t q_bytes = 0,
                             int chunk = 0) {
  const BwdTileScheduler made = BwdTileScheduler::make(seqlen_k, bn, kv_heads, 1, batch, det, sms,
                                                       longest_first, q_bytes, steps);
  const BwdTileScheduler s = chunk > 0 ? made.with_chunk(chunk) : made;
  const int num_n = (seqlen_k + bn - 1) / bn;
  CHECK(s.total_tiles == num_n * kv_heads * batch, "total_tiles %d", s.total_tiles);
  CHECK(s.grid == std::min(s.total_tiles, sms), "grid %d", s.grid);
  std::vector<int> seen(s.total_tiles, 0);
  std::vector<int> index_of(s.total_tiles, -1);
  for (int cta = 0; cta < s.grid; ++cta) {
    for (int round = 0;; ++round) {
      const int t = s.index(round, cta);
      if (t >= s.total_tiles) {
        break;
      }
      const BwdTileCoord c = s.coord(t);
      const bool in_range = c.n_block >= 0 && c.n_block < num_n && c.kv_head >= 0 &&
                            c.kv_head < kv_heads && c.batch >= 0 && c.batch < batch;
      CHECK(in_range, "coord out of range t=%d", t);
      if (in_range) {
        const int id = (c.batch * kv_heads + c.kv_head) * num_n + c.n_block;
        ++seen[id];
        index_of[id] = t;
      }
    }
  }
  for (int i = 0; i < s.total_tiles; ++i) {
    CHECK(seen[i] == 1, "tile %d visited %d times (G %d sk %d bn %d hkv %d b %d det %d)", i,
          seen[i], s.grid, seqlen_k, bn, kv_heads, batch, int(det));
  }
  for (int hb = 0; hb < batch * kv_heads; ++hb) {
    for (int n = 0; n + 1 < num_n; ++n) {
      const int t_n = index_of[hb * num_n + n], t_next = index_of[hb * num_n + n + 1];
      if (det) {  // b: t increases as n decreases
        CHECK(t_n > t_next, "det order: hb %d n %d at t %d, n %d at t %d (G %d k %d)", hb, n, t_n,
              n + 1, t_next, s.grid, s.chunk);
      } else if (s.longest_first != 0) {  // per section: n major, heads inner, asked direction
        const int heads = std::min(s.section, batch * kv_heads - hb / s.section * s.section);
        const int step = s.longest_first > 0 ? heads : -heads;
        CHECK(t_next == t_n + step, "longest-first order %d: hb %d n %d at t %d, n + 1 at t %d "
              "(section %d)", longest_first, hb, n, t_n, t_next, s.section);
      } else {  // kv heads major, n ascending
        CHECK(t_next == t_n + 1, "default order: hb %d n %d at t %d, n + 1 at t %d", hb, n, t_n,
              t_next);
      }
    }
  }
  // Sectioned longest-first exactly where the tiles are claimed at run time.
  const bool claimed =
      longest_first != 0 && !det && steps > 0 && (steps >= kBwdClaimMinSteps || 4 * num_n > s.grid);
  CHECK(s.dynamic == claimed, "dynamic %d (lf %d det %d steps %d num_n %d G %d)", int(s.dynamic),
        longest_first, int(det), steps, num_n, s.grid);
  CHECK(s.longest_first == (claimed ? longest_first : 0), "longest_first %d, asked %d",
        s.longest_first, longest_first);
  if (claimed) {
    const int sec = l2_section_heads(q_bytes, 1, batch * kv_heads);
    CHECK(s.section == sec, "section %d, expected %d", s.section, sec);
  }
  if (det && num_n > 0) {
    const int rule = (s.grid + batch * kv_heads - 1) / (batch * kv_heads);
    const int k = std::max(1, std::min(chunk > 0 ? chunk : rule, num_n));
    CHECK(s.chunk == k, "chunk %d, expected %d", s.chunk, k);
  }
}

// The deterministic kernel's shift order (full masks): per dQ block the ranks of its
// contributors are 0 .. num_n - 1 once each, and with the CTAs in lockstep (round r's tiles
// together, step i of every tile at the same time) each contributor reaches the block after the
// one ranked before it: no tile waits for a turn, and every wait is on a tile of the same or an
// earlier round (no deadlock with every CTA resident).
static void check_shift_order(int num_n, int kv_heads, int batch, int sms, int query_blocks,
                              int bn) {
  const BwdTileScheduler s = BwdTileScheduler::make(num_n * bn, bn, kv_heads, 1, batch, true, sms,
                                                    0, 0, 0, query_blocks);
  const int together = std::min(num_n, s.grid);
  const bool shift = query_blocks > 0 && query_blocks >= together;
  CHECK(s.shift_blocks == (shift ? query_blocks : 0), "shift_blocks %d (M %d num_n %d G %d)",
        s.shift_blocks, query_blocks, num_n, s.grid);
  if (!shift) {
    return;
  }
  const AttentionMask full{query_blocks * 64, num_n * bn, -1, -1};
  for (int t = 0; t < s.total_tiles; ++t) {
    const BwdTileCoord c = s.shift_coord(t);
    CHECK((c.batch * kv_heads + c.kv_head) * num_n + c.n_block == t, "shift coord of t %d", t);
  }
  for (int hb = 0; hb < s.num_hb; ++hb) {
    for (int m = 0; m < query_blocks; ++m) {
      std::vector<std::pair<int, int>> order(num_n);  // (rank, n)
      for (int n = 0; n < num_n; ++n) {
        const BwdTileCoord c{n, hb % kv_heads, hb / kv_heads};
        order[n] = {dq_rank<true>(s, full, m, c, 64, bn), n};
      }
      std::sort(order.begin(), order.end());
      for (int r = 0; r < num_n; ++r) {
        CHECK(order[r].first == r, "hb %d m %d: rank %d at %d (num_n %d G %d M %d)", hb, m,
              order[r].first, r, num_n, s.grid, query_blocks);
      }
      auto reaches = [&](int n) {  // (round, step) of tile (hb, n) at block m
        const int t = hb * num_n + n;
        const int pos = s.shift_segment({n, hb % kv_heads, hb / kv_heads}).pos;
        return std::make_pair(t / s.grid, ((m - pos) % query_blocks + query_blocks) %
                                              query_blocks);
      };
      for (int r = 1; r < num_n; ++r) {
        CHECK(reaches(order[r - 1].second) < reaches(order[r].second),
              "hb %d m %d: rank %d (n %d) reaches the block no later than rank %d (n %d)", hb, m,
              r - 1, order[r - 1].second, r, order[r].second);
      }
    }
  }
}

static void tile_orders(std::mt19937& rng) {
  context = "shift order";
  const int shift_grids[] = {1, 3, 7, 132};
  for (int i = 0; i < 200; ++i) {
    const int num_n = 1 + int(rng() % 40), hkv = 1 + int(rng() % 4), b = 1 + int(rng() % 3);
    for (int g : shift_grids) {
      const int together = std::min(num_n, std::min(g, num_n * hkv * b));
      const int m = std::max(1, together + int(rng() % 9) - 3);  // around the rule's bound
      check_shift_order(num_n, hkv, b, g, m, rng() % 2 ? 64 : 128);
    }
  }
  check_shift_order(128, 16, 1, 132, 128, 128);  // s16k d128
  check_shift_order(16, 32, 8, 132, 16, 128);    // s2k d64
  context = "tile order";
  const int grids[] = {1, 3, 7, 132};
  for (int i = 0; i < 400; ++i) {
    const int sk = int(rng() % 5000), bn = rng() % 2 ? 64 : 128;
    const int hkv = 1 + int(rng() % 8), b = 1 + int(rng() % 4);
    for (int g : grids) {
      // Sections of 1 .. all (batch, kv head)s: rows of 0.5-64 MiB per kv head.
      const int64_t q_bytes = int64_t(1) << (19 + rng() % 8);
      const int steps = int(rng() % 3) * kBwdClaimMinSteps / 2;  // 0, below and at the rule
      check_tile_order(sk, bn, hkv, b, false, g);
      check_tile_order(sk, bn, hkv, b, true, g);
      check_tile_order(sk, bn, hkv, b, false, g, +1, steps, q_bytes);
      check_tile_order(sk, bn, hkv, b, false, g, -1, steps, q_bytes);
      check_tile_order(sk, bn, hkv, b, true, g, +1, steps, q_bytes);  // deterministic: static
      for (int k : {1, 2, 5, 1000}) {  // the chunk overridden
        check_tile_order(sk, bn, hkv, b, true, g, +1, steps, q_bytes, k);
      }
    }
  }
  check_tile_order(16384, 128, 16, 1, true, 132);  // s16k d128: k = 9
  // Claimed at run time: masked default-mode calls with a tile counter and tiles long enough (or
  // many key blocks); sections of as many (batch, kv head)s as fit the L2 budget by their rows.
  for (int64_t q_bytes : {int64_t(0), int64_t(1) << 20, int64_t(16) << 20, int64_t(64) << 20}) {
    for (int lf : {-1, 0, 1}) {
      for (int det = 0; det < 2; ++det) {
        for (int steps : {0, 1, kBwdClaimMinSteps - 1, kBwdClaimMinSteps, 1000}) {
          for (int sk : {2048, 8192}) {  // 16 key blocks (4 num_n <= G), 64 (4 num_n > G)
            const BwdTileScheduler s =
                BwdTileScheduler::make(sk, 128, 8, 2, 4, det != 0, 132, lf, q_bytes, steps);
            const bool dynamic = steps > 0 && det == 0 && lf != 0 &&
                                 (steps >= kBwdClaimMinSteps || 4 * (sk / 128) > 132);
            CHECK(s.dynamic == dynamic, "dynamic %d (lf %d det %d steps %d sk %d)",
                  int(s.dynamic), lf, det, steps, sk);
            if (dynamic) {
              CHECK(s.longest_first == lf, "dynamic order lost its direction %d", lf);
              CHECK(s.section == l2_section_heads(q_bytes, 1, 32),
                    "dynamic section %d for %lld bytes", s.section,
                    static_cast<long long>(q_bytes));
            }
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// c: the steps of every tile against the brute force
// ------------------------------------------------------------------------------------------------
template <int BM, int BN, class Schedule>
static void check_steps(Problem const& p, BwdTileScheduler const& tiles,
                        std::vector<Schedule> const& ctas) {
  const int num_m = (p.seqlen_q + BM - 1) / BM, num_n = tiles.num_n_blocks;
  const int hq = p.q_heads();
  // Brute force per sequence (dense: one mask for all): which (m, n) blocks hold a visible
  // element, and which are fully visible.
  std::vector<std::vector<char>> any_of(size_t(p.batch)), all_of(size_t(p.batch));
  for (int b = 0; b < p.batch; ++b) {
    const AttentionMask mask = p.seq_mask(b);
    std::vector<char>& any = any_of[size_t(b)];
    std::vector<char>& all = all_of[size_t(b)];
    any.assign(size_t(num_m) * num_n, 0);
    all.assign(size_t(num_m) * num_n, 1);
    for (int m = 0; m < num_m; ++m) {
      for (int n = 0; n < num_n; ++n) {
        for (int r = m * BM; r < std::min((m + 1) * BM, mask.seqlen_q); ++r) {
          for (int c = n * BN; c < (n + 1) * BN; ++c) {
            const bool v = mask.visible(r, c);
            any[m * num_n + n] |= v;
            all[m * num_n + n] &= v;
          }
        }
      }
    }
  }
  const BwdSpans spans = p.spans();
  std::vector<int> visits(size_t(p.batch) * hq * num_m * num_n, 0);
  for (Schedule const& cs : ctas) {
    BwdTileWork w;
    for (int round = 0; cs.work(tiles.index(round, cs.base.cta), w); ++round) {  // every tile once
      const int n = w.tile.n_block;
      const AttentionMask mask = p.seq_mask(w.tile.batch);
      std::vector<char> const& all = all_of[size_t(w.tile.batch)];
      // The tile's sequence: its span (varlen: from the offsets, clamped to the bounds).
      const BwdSpan want = p.varlen() ? spans(w.tile.batch)
                                      : BwdSpan{w.tile.batch, 0, 0, p.seqlen_q, p.seqlen_k, 0};
      CHECK(w.span.batch == want.batch && w.span.q_start == want.q_start &&
                w.span.k_start == want.k_start && w.span.seqlen_q == want.seqlen_q &&
                w.span.seqlen_k == want.seqlen_k && w.span.ws_row0 == want.ws_row0,
            "tile (b %d, n %d): span (%d, %d, %d, %d, %d, %d)", w.tile.batch, n, w.span.batch,
            w.span.q_start, w.span.k_start, w.span.seqlen_q, w.span.seqlen_k, w.span.ws_row0);
      CHECK(w.span.seqlen_q <= p.seqlen_q && w.span.seqlen_k <= p.seqlen_k,
            "tile (b %d, n %d): span lengths %d / %d past the bounds", w.tile.batch, n,
            w.span.seqlen_q, w.span.seqlen_k);
      std::vector<int> ms;  // the brute-force transpose of key_blocks (the sequence's rows)
      for (int m = 0; m < (mask.seqlen_q + BM - 1) / BM; ++m) {
        const KeyBlockRange r = mask.key_blocks(m, BM, BN);
        if (n >= r.n_min && n < r.n_max) {
          ms.push_back(m);
        }
      }
      CHECK(w.num_steps() == int(ms.size()) * p.q_per_kv, "tile n %d: %d steps, expected %zu",
            n, w.num_steps(), ms.size() * p.q_per_kv);
      CHECK(w.has_queries() == !ms.empty(), "tile n %d: has_queries %d", n, int(w.has_queries()));
      // Default mode starts each query head's walk at block n (mod L), deterministic mode at m_min.
      const int L = int(ms.size());
      const int rotate = p.deterministic || L == 0 ? 0 : n % L;
      CHECK(w.rotate == rotate, "tile n %d: rotate %d, expected %d", n, w.rotate, rotate);
      QueryStep walked{};  // the step loops' walk: step(0), then next()
      for (int i = 0; i < w.num_steps(); ++i) {
        const QueryStep s = w.step(i);
        walked = i == 0 ? w.step(0) : w.next(walked, i);
        CHECK(walked.m == s.m && walked.g == s.g && walked.masked == s.masked &&
                  walked.last == s.last,
              "tile n %d step %d: next() walks to (g %d, m %d, masked %d, last %d), step() is "
              "(g %d, m %d, masked %d, last %d)", n, i, walked.g, walked.m, int(walked.masked),
              int(walked.last), s.g, s.m, int(s.masked), int(s.last));
        if (L * p.q_per_kv == w.num_steps()) {
          CHECK(s.g == i / L && s.m == ms[(i % L + rotate) % L],
                "tile n %d step %d is (g %d, m %d)", n, i, s.g, s.m);
        }
        CHECK(s.first == (i == 0) && s.last == (i == w.num_steps() - 1),
              "tile n %d step %d: first %d last %d", n, i, int(s.first), int(s.last));
        if (s.m < 0 || s.m >= num_m || s.g < 0 || s.g >= p.q_per_kv) {
          CHECK(false, "tile n %d step %d out of range (g %d, m %d)", n, i, s.g, s.m);
          continue;
        }
        CHECK(s.masked == mask.block_masked(s.m, n, BM, BN),
              "tile n %d m %d: masked %d, block_masked %d", n, s.m, int(s.masked),
              int(mask.block_masked(s.m, n, BM, BN)));
        CHECK(s.masked || all[s.m * num_n + n], "tile n %d m %d runs unmasked but needs the mask",
              n, s.m);
        const int hq_idx = w.dq_head(s);
        CHECK(hq_idx == w.tile.kv_head * p.q_per_kv + s.g, "dq_head %d", hq_idx);
        ++visits[((size_t(w.tile.batch) * hq + hq_idx) * num_m + s.m) * num_n + n];
      }
    }
  }
  for (int bh = 0; bh < p.batch * hq; ++bh) {
    for (int m = 0; m < num_m; ++m) {
      for (int n = 0; n < num_n; ++n) {
        const int v = visits[(size_t(bh) * num_m + m) * num_n + n];
        std::vector<char> const& any = any_of[size_t(bh / hq)];
        CHECK(v == (any[m * num_n + n] ? 1 : v) && v <= 1,
              "(batch*q head %d, m %d, n %d) visited %d times, holds visible elements: %d", bh, m,
              n, v, int(any[m * num_n + n]));
      }
    }
  }
}
// ------------------------------------------------------------------------------------------------
// d: the role loops recorded
// ------------------------------------------------------------------------------------------------
enum Op {
  kWaitEmpty, kArriveFull, kWaitFull, kArriveEmpty,  // mbarriers
  kBarArrive, kBarSync,                              // named barriers
  kSmemWrite, kSmemReadBegin, kSmemReadEnd,          // sdS (and family B's sP)
  kSlotWrite, kReduce, kWaitRead, kWaitComplete,     // dQ slots and bulk reduce-adds
  kRedAdd, kFence,                                   // red.global adds of dQ and their fence
  kWaitRank, kReleaseRank, kWaitCount,              // semaphores
  kTileWrite, kTileRead,                             // the tile slot
  kFreeWait, kFreeArrive, kCombine,                  // the dQ writer's barrier, its slot sum
};

struct Payload {
  int tile = -1, g = -1, m = -1;  // (tile, -1, -1): K/V of the tile
  bool operator==(Payload const& o) const { return tile == o.tile && g == o.g && m == o.m; }
  bool operator!=(Payload const& o) const { return !(*this == o); }
  bool operator<(Payload const& o) const {
    return std::tie(tile, g, m) < std::tie(o.tile, o.g, o.m);
  }
};

struct Event {
  Op op;
  int a = 0;        // pipe, named barrier id, sdS / sP stage or consumer WG (dQ events)
  int stage = 0;    // mbarrier stage; named barrier threads; sdS / sP part (WG)
  uint32_t phase = 0;
  Payload payload;
  int key = -1;     // dQ block (accumulator block and semaphore)
  int val = 0;      // rank; key block n of an add, a reduce or a turn; SmemBuf of kSmem*; amount
  unsigned parts = ~0u;  // kSmemReadBegin / End: the WG parts of sdS / sP read (bit c: WG c's)
};

static const char* kOpName[] = {"wait_empty", "arrive_full", "wait_full", "arrive_empty",
                                "bar_arrive", "bar_sync", "smem_write", "smem_read",
                                "smem_read_end", "slot_write", "reduce", "wait_read",
                                "wait_complete", "red_add", "fence", "wait_rank", "release_rank",
                                "wait_count", "tile_write", "tile_read", "free_wait",
                                "free_arrive", "combine"};

// A dQ event of a WG (a = its index) or of the dQ writer (a = its bulk list, kConsumerWgs).
static Event make_dq_event(Op op, int a, int key, int val, Payload step) {
  Event e{op};
  e.a = a;
  e.key = key;
  e.val = val;
  e.payload = step;
  return e;
}

// A built backward family, from the tuned-config table the kernels are instantiated from
// (bwd/kernel_traits.h reads the same fields); kDet: its deterministic kernel (slot families,
// tile_config.h bwd_config_deterministic); kUnm: the unmasked tile (bwd_config_unmasked).
template <int kHeadDimBucket, bool kDet = false, bool kUnm = false>
struct Family {
  static constexpr bool kDeterministic = kDet;
  static constexpr int kHeadDim = kHeadDimBucket;
  static constexpr BwdConfig kConfig = kUnm   ? bwd_config_unmasked(kHeadDim)
                                       : kDet ? bwd_config_deterministic(kHeadDim)
                                              : bwd_config(kHeadDim);
  static constexpr int kBlockM = kConfig.block_m;
  static constexpr int kBlockN = kConfig.block_n;
  static constexpr int kStages = kConfig.q_stages;
  static constexpr int kDqWgs = kConfig.dq_wgs;
  static constexpr bool kFamilyB = kConfig.family_b;
  static constexpr bool kDqSlots = kConfig.dq_slots;
  static constexpr bool kDvAfterDs = kConfig.dv_after_ds;
};
// Every head-dim bucket the FA-3 backward is built for (CMake builds these TUs).
static_assert(has_bwd_config(64) && has_bwd_config(96) && has_bwd_config(128) &&
              has_bwd_config(192) && has_bwd_config(256) && !has_bwd_config(257));

// The shared-memory buffers of P and dS that GEMMs read (Event::val of the kSmem* events).
enum SmemBuf { kBufDs = 0, kBufP = 1, kNumBufs = 2 };
static const char* kBufName[] = {"sdS", "sP"};

enum Pipe { kKV = 0, kQ = 1, kDO = 2, kNumPipes = 3 };
static const char* kPipeName[] = {"KV", "Q", "dO"};
// The named barriers of bwd/mma.h BwdBarrier that join agents: PdS, PdSFree and DqTurn (both
// WGs), PdSLocal(c) = 4 + c (WG c's own PdS sync, dq_wgs = 1), DqStaged(c) = 6 + c (WG c and the
// dQ writer warp). DqSlot c orders threads of one WG, which the simulation runs as one agent.
enum Bar {
  kPdS = 0, kPdSFree = 1, kDqTurn = 2, kTileSlot = 3, kPdSLocal = 4, kDqStaged = 6, kNumBars = 8
};
constexpr int kWgThreads = 128;
constexpr int kConsumerWgs = 2;

struct Recorder {
  std::vector<Event>* out;
  int pipe;
  void push(Op op, int s, uint32_t phase) {
    Event e{op};
    e.a = pipe;
    e.stage = s;
    e.phase = phase;
    out->push_back(e);
  }
  void wait_empty(int s, uint32_t phase) { push(kWaitEmpty, s, phase); }
  void arrive_full_tx(int s, uint32_t) { push(kArriveFull, s, 0); }
  void wait_full(int s, uint32_t phase) { push(kWaitFull, s, phase); }
  void arrive_empty(int s) { push(kArriveEmpty, s, 0); }
};

// One tile the producer published through the KV stage, with the stage's payload.
struct Published {
  PublishedTile tile;
  Payload payload;
};
constexpr int kEndTile = -7;  // the KV payload's tile of the end of a walk

template <int QS>
struct MockProducer {
  int num_n;
  Problem const& p;
  Sabotage sab;
  BwdTileScheduler const* tiles = nullptr;
  std::deque<int>* claims = nullptr;  // the CTA's claim values (dynamic order)
  std::vector<Published> published;
  std::vector<Event> ev;
  ProducerEnd<PipelineSpec<1, kConsumerWgs>, Recorder> kv_pipe{{&ev, kKV}};
  ProducerEnd<PipelineSpec<QS, kConsumerWgs>, Recorder> q_pipe{{&ev, kQ}};
  ProducerEnd<PipelineSpec<QS, kConsumerWgs>, Recorder> do_pipe{{&ev, kDO}};
  int loads = 0;

  MockProducer(int n, Problem const& pr, Sabotage s) : num_n(n), p(pr), sab(s) {}
  template <class End>
  void load(End& end, Payload payload) {
    if (loads == sab.skip_load) {
      ++loads;
      return;
    }
    if (loads++ == sab.wrong_load) {
      ++payload.m;
    }
    end.load(/*leader=*/true, 0, [&](int) { ev.back().payload = payload; });
  }
  int id(BwdTileWork const& w) const {
    CHECK(w.has_queries(), "the producer loads for tile %d, which has no queries",
          tile_id(p, w.tile, num_n));
    return tile_id(p, w.tile, num_n);
  }
  void kv(BwdTileWork const& w) { load(kv_pipe, {id(w), -1, -1}); }
  void bar(Op op, Bar id) {
    Event e{op};
    e.a = id;
    e.stage = 32;  // the producer warp
    ev.push_back(e);
  }
  // The tile slot: the write into buffer i % 2, then the TileSlot sync.
  void publish(PublishedTile const& tile) {
    if (sab.no_empty_publish && !tile.end && !tile.work.has_queries()) {
      return;
    }
    const Payload payload{tile.end ? kEndTile : tile_id(p, tile.work.tile, num_n), -1, -1};
    Event e{kTileWrite};
    e.a = sab.single_tile_slot ? 0 : int(published.size() % 2);
    e.payload = payload;
    ev.push_back(e);
    published.push_back({tile, payload});
    bar(kBarSync, kTileSlot);
  }
  int claim() {
    CHECK(tiles->dynamic, "the producer claims a tile of a static walk");
    CHECK(claims != nullptr && !claims->empty(), "the producer claims past its last claim");
    if (claims == nullptr || claims->empty()) {
      return tiles->total_tiles;
    }
    if (sab.skip_claim && !claimed_any && claims->size() > 1) {
      claims->pop_front();
    }
    claimed_any = true;
    const int v = claims->front();
    claims->pop_front();
    return v;
  }
  bool claimed_any = false;
  void q(BwdTileWork const& w, QueryStep s) { load(q_pipe, {id(w), s.g, s.m}); }
  void dout(BwdTileWork const& w, QueryStep s) { load(do_pipe, {id(w), s.g, s.m}); }
};

// The target of a step's dQ adds: the block (accumulator and semaphore index) and the step.
struct DqBlock {
  int key;
  Payload step;
  int n;
};
struct DqTurnOf {
  int key, rank, n;
};

// One consumer warpgroup with the single-agent checks. Family B (Cfg::kFamilyB): P and dS in sP /
// sdS, one stage each, read by the SS GEMMs dV, dQ and dK; family A keeps dS in sdS[Q stage] for
// dQ only.
template <class Cfg>
struct MockConsumer {
  static constexpr int BM = Cfg::kBlockM, QS = Cfg::kStages;
  static constexpr bool kB = Cfg::kFamilyB;
  struct TileState {};
  struct Gemm {
    char kind;  // S, P (dP), V (dV), Q (dQ), K (dK)
    Payload step;
    int buf;    // SmemBuf it reads, -1: none of sP / sdS
    int stage;  // its stage
    unsigned parts;  // the WG parts of it that it reads
  };
  Problem const& p;
  int num_n, wg, dq_wgs;
  Sabotage sab;
  std::vector<Event> ev;
  ConsumerEnd<PipelineSpec<1, kConsumerWgs>, Recorder> kv_pipe{{&ev, kKV}};
  ConsumerEnd<PipelineSpec<QS, kConsumerWgs>, Recorder> q_pipe{{&ev, kQ}};
  ConsumerEnd<PipelineSpec<QS, kConsumerWgs>, Recorder> do_pipe{{&ev, kDO}};
  std::vector<Payload> held[kNumPipes];
  std::vector<Gemm> in_flight;
  Payload s_reg, p_reg, p16_reg, dp_reg, ds_reg;  // what S, P, 16-bit P, dP and dS hold
  int q_stage = 0;                        // Q stage of the current step (indexes sdS, family A)
  Payload smem[kNumBufs];                 // what this WG last wrote into its part of sdS / sP
  std::set<Payload> dv, dk;               // steps summed into dV and dK
  std::vector<int> stored, zeroed;
  int releases_q = 0;
  int dq_steps = 0;     // steps whose dQ this WG added (the sabotages' step index)

  BwdTileScheduler const* tiles = nullptr;  // the walk's scheduler (the deterministic rank)
  MockConsumer(Problem const& pr, int n, int w, int d, Sabotage s)
      : p(pr), num_n(n), wg(w), dq_wgs(d), sab(s) {}
  int id(BwdTileWork const& w) const { return tile_id(p, w.tile, num_n); }
  Payload at(BwdTileWork const& w, QueryStep s) const { return {id(w), s.g, s.m}; }
  bool flying(char kind) const {
    return std::any_of(in_flight.begin(), in_flight.end(),
                       [&](Gemm const& g) { return g.kind == kind; });
  }

  template <class End>
  void wait(End& end, int pipe, Payload payload) {
    end.wait();
    ev.back().payload = payload;
    held[pipe].push_back(payload);
  }
  // reads(g): whether GEMM g reads the buffer being released.
  template <class End, class Reads>
  void release(End& end, int pipe, Payload payload, Reads&& reads) {
    CHECK(!held[pipe].empty() && held[pipe].front() == payload,
          "WG %d releases %s (tile %d g %d m %d) it does not hold as its oldest buffer", wg,
          kPipeName[pipe], payload.tile, payload.g, payload.m);
    for (Gemm const& g : in_flight) {
      CHECK(!reads(g), "WG %d releases %s (tile %d g %d m %d) while GEMM %c reads it", wg,
            kPipeName[pipe], payload.tile, payload.g, payload.m, g.kind);
    }
    if (!held[pipe].empty()) {
      held[pipe].erase(held[pipe].begin());
    }
    end.release(/*wg_leader=*/true);
    ev.back().payload = payload;
  }
  void bar(Op op, int id) {
    Event e{op};
    e.a = id;
    e.stage = kWgThreads;
    ev.push_back(e);
  }

  // Pipelines
  // The CTA's producer's published tiles (its walk ran first), read in the slot's order.
  std::vector<Published> const* published_tiles = nullptr;
  size_t next_published = 0;
  bool take_tile(BwdTileWork& w) {
    CHECK(published_tiles != nullptr && next_published < published_tiles->size(),
          "WG %d waits for a tile its producer never published", wg);
    if (published_tiles == nullptr || next_published >= published_tiles->size()) {
      return false;
    }
    Published const& e = (*published_tiles)[next_published];
    bar(kBarSync, kTileSlot);
    Event r{kTileRead};
    r.a = sab.single_tile_slot ? 0 : int(next_published % 2);
    r.payload = e.payload;
    ev.push_back(r);
    ++next_published;
    w = e.tile.work;
    return !e.tile.end;
  }
  void wait_kv(BwdTileWork const& w) {
    CHECK(w.has_queries(), "WG %d waits for K/V of tile %d, which has no queries", wg, id(w));
    wait(kv_pipe, kKV, {id(w), -1, -1});
  }
  void release_kv(BwdTileWork const& w) {
    release(kv_pipe, kKV, {id(w), -1, -1}, [](Gemm const& g) {
      return g.kind == 'S' || g.kind == 'P' || g.kind == 'Q' || g.kind == 'K';
    });
  }
  void wait_q(BwdTileWork const& w, QueryStep s) {
    q_stage = q_pipe.stage();
    wait(q_pipe, kQ, at(w, s));
  }
  void release_q(BwdTileWork const& w, QueryStep s) {
    if (releases_q++ == sab.skip_release && wg == 0) {
      held[kQ].erase(held[kQ].begin());
      return;
    }
    const Payload x = at(w, s);
    release(q_pipe, kQ, x, [&](Gemm const& g) {
      return (g.kind == 'S' || g.kind == 'K') && g.step == x;
    });
  }
  void wait_dout(BwdTileWork const& w, QueryStep s) { wait(do_pipe, kDO, at(w, s)); }
  void release_dout(BwdTileWork const& w, QueryStep s) {
    const Payload x = at(w, s);
    release(do_pipe, kDO, x, [&](Gemm const& g) {
      return (g.kind == 'P' || g.kind == 'V') && g.step == x;
    });
  }

  // GEMMs
  bool holds_step(char kind) {
    CHECK(held[kKV].size() == 1 && held[kQ].size() == 1 && held[kDO].size() <= 1,
          "WG %d issues %c holding %zu KV, %zu Q, %zu dO buffers", wg, kind, held[kKV].size(),
          held[kQ].size(), held[kDO].size());
    if (held[kKV].empty() || held[kQ].empty()) {
      return false;
    }
    CHECK(held[kKV].front().tile == held[kQ].front().tile, "WG %d: %c of Q tile %d with K/V of %d",
          wg, kind, held[kQ].front().tile, held[kKV].front().tile);
    return true;
  }
  void issue(char kind, Payload step) { in_flight.push_back({kind, step, -1, -1, 0u}); }
  // A GEMM reading sdS / sP: it must read this WG's part as written for its step (the other part
  // is checked by the simulation, which sees both WGs).
  void issue_reading(char kind, Payload step, int buf, int stage, unsigned parts = ~0u) {
    CHECK(smem[buf] == step, "WG %d: %c of step (g %d m %d) reads %s holding (g %d m %d)", wg,
          kind, step.g, step.m, kBufName[buf], smem[buf].g, smem[buf].m);
    Event e{kSmemReadBegin};
    e.a = stage;
    e.val = buf;
    e.payload = step;
    e.parts = parts;
    ev.push_back(e);
    in_flight.push_back({kind, step, buf, stage, parts});
  }
  // dq_wgs = 1 (family A): the WG's dQ reads only its own part of sdS, behind its own PdS sync.
  bool partial_dq() const { return dq_wgs == 1 && !kB; }
  void write_smem(int buf, int stage, Payload step) {
    for (Gemm const& g : in_flight) {
      CHECK(g.buf != buf || g.stage != stage, "WG %d overwrites %s while its %c GEMM reads it",
            wg, kBufName[buf], g.kind);
    }
    smem[buf] = step;
    Event e{kSmemWrite};
    e.a = stage;
    e.stage = wg;
    e.val = buf;
    e.payload = step;
    ev.push_back(e);
  }
  int ds_stage() const { return kB ? 0 : q_stage; }
  void issue_s(TileState&) {
    if (holds_step('S')) {
      CHECK(!flying('S'), "WG %d: two S GEMMs in flight", wg);
      issue('S', held[kQ].front());
      s_reg = held[kQ].front();
    }
  }
  void issue_dp(TileState&) {
    if (holds_step('P')) {
      CHECK(held[kDO].size() == 1 && held[kDO].front() == held[kQ].front(),
            "WG %d: dP with a dO of another step", wg);
      issue('P', held[kQ].front());
      dp_reg = held[kQ].front();
    }
  }
  bool softcapped() const { return p.softcap != sab.softcap_misread; }
  // A step's code is capped exactly when its call is (kCapped: schedule.h's step kind).
  void check_capped(bool capped, char const* op) {
    CHECK(capped == p.softcap, "WG %d: %s of a step of a call with softcap %d runs the code of %d",
          wg, op, int(p.softcap), int(capped));
  }
  template <bool kCapped>
  void softcap(TileState&) {
    CHECK(!flying('S'), "WG %d applies softcap to an S in flight", wg);
    check_capped(kCapped, "softcap");
  }
  template <bool kMasked>
  void transform(TileState&, BwdTileWork const& w, QueryStep s) {
    CHECK(!flying('S') && s_reg == at(w, s), "WG %d transforms an S that is not ready or not "
          "of its step", wg);
    // The rows' lse_log2 ride on the step's Q stage.
    CHECK(!held[kQ].empty() && held[kQ].front() == at(w, s), "WG %d reads lse_log2 of a Q stage "
          "it does not hold", wg);
    if constexpr (!kB) {  // RS: the P registers are dV's A operand
      CHECK(!flying('V'), "WG %d overwrites P while its dV GEMM reads it", wg);
    }
    CHECK(kMasked == s.masked, "WG %d: transform<%d> on a step with masked %d", wg, int(kMasked),
          int(s.masked));
    p_reg = s_reg;
  }
  // P's 16-bit copy (family A: dV's A operand registers).
  void convert_p(TileState&) {
    if constexpr (!kB) {
      CHECK(!flying('V'), "WG %d overwrites P's 16-bit copy while its dV GEMM reads it", wg);
    }
    p16_reg = p_reg;
  }
  void issue_dv(TileState&) {
    CHECK(held[kDO].size() == 1 && held[kDO].front() == p_reg, "WG %d: dV of P and dO of "
          "different steps", wg);
    CHECK(p16_reg == p_reg, "WG %d: dV of a P not converted to 16 bits", wg);
    CHECK(dv.insert(p_reg).second, "WG %d: step (g %d m %d) summed into dV twice", wg, p_reg.g,
          p_reg.m);
    if constexpr (kB) {
      issue_reading('V', p_reg, kBufP, 0);
    } else {
      issue('V', p_reg);
    }
  }
  void store_p(TileState&, BwdTileWork const& w, QueryStep s) {
    CHECK(kB, "WG %d: family A stores P to shared memory", wg);
    CHECK(p_reg == at(w, s), "WG %d stores a P of another step", wg);
    write_smem(kBufP, 0, p_reg);
  }
  template <bool kCapped>
  void compute_ds(TileState&, BwdTileWork const& w, QueryStep s) {
    CHECK(!flying('P') && dp_reg == at(w, s) && p_reg == at(w, s), "WG %d computes dS of an "
          "incomplete dP or another step's P", wg);
    check_capped(kCapped, "compute_ds");
    // The rows' D ride on the step's dO stage (and lse_log2, read again with softcap, on Q's).
    CHECK(!held[kDO].empty() && held[kDO].front() == at(w, s) && !held[kQ].empty() &&
              held[kQ].front() == at(w, s),
          "WG %d reads D / lse_log2 of stages it does not hold", wg);
    if constexpr (!kB) {  // RS: the dS registers are dK's A operand
      CHECK(!flying('K'), "WG %d overwrites dS while its dK GEMM reads it", wg);
    }
    if constexpr (kB) {
      CHECK(smem[kBufP] == at(w, s), "WG %d computes dS before storing the step's P", wg);
    }
    ds_reg = at(w, s);
    write_smem(kBufDs, ds_stage(), ds_reg);
  }
  void sync_pds() {
    if (!sab.no_pds) {
      bar(kBarSync, partial_dq() ? kPdSLocal + wg : kPdS);
    }
    leader_only = false;
  }
  void sync_pds_free() {
    CHECK(kB, "WG %d: family A syncs before overwriting sP", wg);
    CHECK(in_flight.size() <= 1 && !flying('V') && !flying('Q') && !flying('K'),
          "WG %d syncs PdSFree with its own sP / sdS readers in flight", wg);
    if (!sab.no_free_sync) {
      bar(kBarSync, kPdSFree);
    }
  }
  void issue_dq(TileState&) {
    const bool own = partial_dq() && !sab.dq_reads_all;
    issue_reading('Q', ds_reg, kBufDs, ds_stage(), own ? 1u << wg : ~0u);
  }
  void issue_dk(TileState&) {
    CHECK(held[kQ].size() == 1 && held[kQ].front() == ds_reg, "WG %d: dK with Q of another step",
          wg);
    CHECK(dk.insert(ds_reg).second, "WG %d: step (g %d m %d) summed into dK twice", wg, ds_reg.g,
          ds_reg.m);
    if constexpr (kB) {
      issue_reading('K', ds_reg, kBufDs, 0);
    } else {
      issue('K', ds_reg);
    }
  }
  template <int kInFlight>
  void wait_gemms() {
    while (int(in_flight.size()) > kInFlight) {
      Gemm const& g = in_flight.front();
      if (g.buf >= 0) {
        Event e{kSmemReadEnd};
        e.a = g.stage;
        e.val = g.buf;
        e.payload = g.step;
        e.parts = g.parts;
        ev.push_back(e);
      }
      in_flight.erase(in_flight.begin());
    }
  }

  // dQ (bwd/schedule.h add_dq): the events the simulation runs; WG-local barriers (DqSlot c)
  // are implied by the WG being one agent.
  void dq_event(Op op, int key = -1, int val = 0, Payload step = {}) {
    ev.push_back(make_dq_event(op, wg, key, val, step));
  }
  DqBlock dq_block(BwdTileWork const& w, QueryStep s) {
    CHECK(!flying('Q') && ds_reg == at(w, s), "WG %d adds a dQ that is not done", wg);
    ++dq_steps;
    return {dq_key(p, BM, w, s), at(w, s), w.tile.n_block};
  }
  bool deterministic() const { return p.deterministic; }
  // The WG runs as one agent; what only its leader waited for (the slot's last read) holds for
  // the WG's other threads after a WG-wide barrier (PdS, DqSlot c).
  bool leader_only = false;
  void wait_dq_slot_read() {
    if (!sab.no_slot_wait) {
      dq_event(kWaitRead);
    }
    leader_only = true;
  }
  int dq_slot() const { return wg; }
  void stage_dq(TileState&, int slot) {
    CHECK(slot == wg, "WG %d stages dQ in slot %d", wg, slot);
    CHECK(!leader_only, "WG %d writes its dQ slot after only its leader waited for the slot's "
          "last reduce-add (no WG barrier between)", wg);
    dq_event(kSlotWrite, -1, 0, ds_reg);
  }
  void sync_dq_slot(int) {
    leader_only = false;
  }
  bool skips_add() const { return wg == 0 && dq_steps - 1 == sab.skip_add; }
  void reduce_dq_slot(DqBlock const& b, int) {
    if (!skips_add()) {
      dq_event(kReduce, b.key, b.n, b.step);
    }
  }
  void finish_dq() {
    if (!sab.no_finish) {
      dq_event(kWaitComplete);
    }
  }
  void add_dq(TileState&, DqBlock const& b) {
    if (!skips_add()) {
      dq_event(kRedAdd, b.key, b.n, b.step);
    }
  }
  void fence_dq() {
    if (!sab.no_fence) {
      dq_event(kFence);
    }
  }
  DqTurnOf dq_turn(BwdTileWork const& w, QueryStep s) {
    CHECK(p.deterministic, "WG %d takes a dQ turn in default mode", wg);
    return {dq_key(p, BM, w, s),
            dq_rank<Cfg::kDeterministic>(*tiles, p.seq_mask(w.tile.batch), s.m, w.tile, BM,
                                         Cfg::kBlockN) +
            sab.rank_offset, w.tile.n_block};
  }
  void wait_dq_turn(DqTurnOf const& t) {
    turn_syncs = 0;
    if (wg == 0) {  // thread 0 of the consumers
      dq_event(kWaitRank, t.key, t.rank);
    }
  }
  int turn_syncs = 0;  // DqTurn syncs since the last wait for the turn
  void sync_dq_turn() {
    if (!(sab.no_handoff && turn_syncs == 1)) {  // the hand-off is the second of three
      bar(kBarSync, kDqTurn);
    }
    ++turn_syncs;
  }
  bool is_wg(int c) const { return c == wg; }
  void pass_dq_turn(DqTurnOf const& t) {
    if (wg == 0 && dq_steps - 1 != sab.skip_pass) {
      Event e{kReleaseRank};
      e.key = t.key;
      e.val = t.n;
      e.stage = sab.pass_by;
      e.parts = (1u << kConsumerWgs) - 1;  // both WGs' adds
      ev.push_back(e);
    }
  }
  // The deterministic kernel (bwd/mma.h publish_dq): the WG's parts for the dQ writer. WG 0
  // records what it publishes (the writer's program is built from it).
  struct Staged {
    int end = 0;
    DqBlock block;
    DqTurnOf turn;
  };
  std::vector<Staged> staged;
  int dq_parts = 0;
  void wait_dq_slot_free() {
    if (!sab.no_slot_wait) {
      Event e{kFreeWait};
      e.phase = uint32_t((dq_parts & 1) ^ 1);
      ev.push_back(e);
    }
  }
  void publish_dq(DqBlock const& b, DqTurnOf const& t) {
    CHECK(p.deterministic && Cfg::kDeterministic, "WG %d publishes a dQ part (deterministic %d)",
          wg, int(p.deterministic));
    staged.push_back({0, b, t});
    ++dq_parts;
    bar(kBarArrive, kDqStaged + wg);
  }
  void publish_dq_end() {
    staged.push_back({1, {}, {}});
    ++dq_parts;
    bar(kBarArrive, kDqStaged + wg);
  }

  // Tiles
  void clear_dkv(TileState&) {
    CHECK(dv.empty() && dk.empty(), "WG %d starts a tile with dK / dV left", wg);
  }
  void store_dkv(TileState&, BwdTileWork const& w) {
    CHECK(in_flight.empty(), "WG %d stores dK / dV with GEMMs in flight", wg);
    std::set<Payload> steps;
    for (int i = 0; i < w.num_steps(); ++i) {
      steps.insert(at(w, w.step(i)));
    }
    CHECK(dv == steps && dk == steps, "WG %d stores tile %d with %zu / %zu of its %zu steps", wg,
          id(w), dv.size(), dk.size(), steps.size());
    dv.clear();
    dk.clear();
    stored.push_back(id(w));
  }
  void store_zero(BwdTileWork const& w) {
    CHECK(!w.has_queries(), "WG %d zeroes tile %d, which has queries", wg, id(w));
    zeroed.push_back(id(w));
  }
};

// The deterministic kernel's dQ writer warp (bwd/mma.h BwdDqWriter): its program from WG 0's
// published records, through the same role function as the kernel (schedule.h write_dq_bwd).
// Its bulk groups are the CTA's list kConsumerWgs (Event::a), each naming the slot it reads
// (Event::stage) and the WG parts it adds (Event::parts).
template <class Cfg>
struct MockWriter {
  using Staged = typename MockConsumer<Cfg>::Staged;
  static constexpr int kList = kConsumerWgs;
  std::vector<Staged> const* staged = nullptr;
  size_t next = 0;
  Sabotage sab;
  std::vector<Event> ev;
  Payload current;

  void push(Op op, int key = -1, int val = 0) {
    ev.push_back(make_dq_event(op, kList, key, val, current));
  }
  Staged wait_staged() {
    for (int c = 0; c < kConsumerWgs; ++c) {
      Event e{kBarSync};
      e.a = kDqStaged + c;
      e.stage = 32;
      ev.push_back(e);
    }
    CHECK(next < staged->size(), "the dQ writer reads past WG 0's %zu records", staged->size());
    const Staged r = next < staged->size() ? (*staged)[next] : Staged{1, {}, {}};
    ++next;
    current = r.block.step;
    return r;
  }
  bool walk_ended(Staged const& r) const { return r.end != 0; }
  void combine_slots() { push(kCombine); }
  void wait_turn(Staged const& r) { push(kWaitCount, r.turn.key, r.turn.rank); }
  void reduce_slots(Staged const& r) {
    if (int(next) - 1 == sab.skip_add) {
      return;
    }
    for (int c = 0; c < Cfg::kDqWgs; ++c) {
      push(kReduce, r.block.key, r.block.n);
      ev.back().stage = c;
      ev.back().parts = Cfg::kDqWgs == 2 ? 1u << c : (1u << kConsumerWgs) - 1;
    }
  }
  void free_slots() {
    if (!sab.no_read_wait) {
      push(kWaitRead);
    }
    push(kFreeArrive);
  }
  void pass_turn(Staged const& r) {
    if (!sab.no_complete) {
      push(kWaitComplete);
    }
    if (int(next) - 1 != sab.skip_pass) {
      push(kReleaseRank, r.turn.key, r.turn.n);
      ev.back().stage = sab.pass_by;
      ev.back().parts = (1u << kConsumerWgs) - 1;  // both WGs' parts
    }
  }
};

// ------------------------------------------------------------------------------------------------
// The whole grid simulated
// ------------------------------------------------------------------------------------------------
// Happens-before inside a CTA: a vector clock over its agents (producer, consumer WGs).
// Every event ticks its agent's entry; an arrival hands the arriver's clock to the barrier phase,
// and a wait that passes joins the completed phase's clock. Event e of agent i (its entry then t)
// happens before an event with clock c iff c[i] >= t. Cross-CTA edges (semaphores) are left out:
// no shared-memory ordering may rest on them.
constexpr int kAgentsPerCta = 2 + kConsumerWgs;  // producer, consumer WGs, dQ writer
using Clock = std::array<int, kAgentsPerCta>;
static void join(Clock& a, Clock const& b) {
  for (int i = 0; i < kAgentsPerCta; ++i) {
    a[i] = std::max(a[i], b[i]);
  }
}

struct Mbarrier {
  int count = 1;
  int pending = 0;
  int completed = 0;
  Clock pending_clock{}, done_clock{};  // the arrivers of the open phase / of the last completed
  void arrive(Clock const& c) {
    join(pending_clock, c);
    if (++pending == count) {
      pending = 0;
      ++completed;
      done_clock = pending_clock;
      pending_clock = Clock{};
    }
  }
  bool passes(uint32_t phase) const { return uint32_t(completed & 1) != phase; }
};

// Count-based named barrier: a generation completes when the arrived threads reach the count.
struct NamedBarrier {
  int count = 0;
  int arrived = 0;
  int generation = 0;
  std::set<int> agents;  // arrived in this generation
  Clock pending_clock{};
  std::vector<Clock> done;  // [generation - 1]: the arrivers of that generation
};

// One stage of sdS or sP: both WGs write their part, GEMMs of both WGs read all parts.
struct SmemBuffer {
  struct Write {
    Payload payload;
    int agent = 0, time = 0;
  };
  struct ReadEnd {
    Payload payload;
    int agent, time;
    unsigned parts;    // the parts the GEMM read
    unsigned checked;  // parts whose next write was checked against this read
  };
  std::vector<Write> part;  // [wg]
  std::vector<int> readers;  // [wg]: GEMMs reading that part now
  std::vector<ReadEnd> ends;
};

// A bulk reduce-add of a slot (a WG leader's bulk group, or the dQ writer's), or a red.global
// add in flight. parts: the WG parts it adds (both: the writer's sum of the two slots).
struct BulkGroup {
  Payload payload;
  int key, n;
  bool read;
  int slot;
  unsigned parts;
};
struct RedAdd {
  int key, n;
};

// What the accumulator received: per (dQ block, part) the adds in the order they were performed
// (part: the WG's columns with dq_wgs = 2, 0 with dq_wgs = 1 where both WGs add to the same
// positions), and a float sum in that order (contribution_value): its bits tell whether two runs
// summed in the same order.
struct DqAdd {
  int n, wg;
  bool operator==(DqAdd const& o) const { return n == o.n && wg == o.wg; }
  bool operator<(DqAdd const& o) const { return std::tie(o.n, wg) < std::tie(n, o.wg); }
};
struct DqAccumulator {
  int dq_wgs = 2;
  std::vector<std::vector<DqAdd>> adds;  // [key * 2 + part]
  std::vector<float> sum;

  void reset(int keys, int wgs) {
    dq_wgs = wgs;
    adds.assign(size_t(keys) * 2, {});
    sum.assign(size_t(keys) * 2, 0.f);
  }
  // Magnitudes 2^-20 .. 2^20 and both signs: float sums of these depend on their order.
  static float contribution_value(int key, int n, int wg) {
    uint32_t h = uint32_t(key) * 2654435761u ^ uint32_t(n) * 40503u ^ uint32_t(wg) * 97u;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    const float mant = 1.f + float(h & 0xffff) / 65536.f;
    return std::ldexp((h >> 16 & 1) ? -mant : mant, int(h >> 17) % 41 - 20);
  }
  void add(int key, int n, int wg) {
    const size_t i = size_t(key) * 2 + (dq_wgs == 2 ? wg : 0);
    adds[i].push_back({n, wg});
    sum[i] += contribution_value(key, n, wg);
  }
  // dq_wgs = 1, the dQ writer: both WGs' partials of key block n summed first (WG 0's + WG
  // 1's), then added.
  void add_sum(int key, int n) {
    const size_t i = size_t(key) * 2;
    adds[i].push_back({n, 0});
    adds[i].push_back({n, 1});
    sum[i] += contribution_value(key, n, 0) + contribution_value(key, n, 1);
  }
  // The adds of key block n into dQ block `key` by WG wg performed so far (both parts).
  int performed(int key, int n, int wg) const {
    int count = 0;
    for (int part = 0; part < 2; ++part) {
      for (DqAdd const& a : adds[size_t(key) * 2 + part]) {
        count += a.n == n && a.wg == wg;
      }
    }
    return count;
  }
};

struct CtaState {
  std::vector<Mbarrier> full[kNumPipes], empty[kNumPipes];
  std::vector<Payload> buffer[kNumPipes];
  NamedBarrier bars[kNumBars];
  std::vector<SmemBuffer> smem[kNumBufs];  // [stage]
  Payload slot[kConsumerWgs];               // what WG c's dQ slot holds
  std::deque<BulkGroup> bulk[kConsumerWgs + 1];  // WG c's leader's, then the writer's, oldest first
  Mbarrier dq_free;                              // the dQ writer's slots-read barrier
  bool slot_summed = false;  // slot 0 holds both WGs' parts summed (the writer's combine)
  Payload tile_slot[2];                      // what the tile slot's buffers hold
  std::vector<RedAdd> red[kConsumerWgs];     // WG c's red.global adds not yet performed
};

struct Agent {
  int cta;
  int local;  // index in the CTA's clocks: 0 producer, 1 + c consumer WG c
  std::vector<Event> prog;
  size_t pc = 0;
  int sync_target = -1;  // generation a bar.sync in progress waits for
  Clock clock{};
};

// ds_stages: sdS stages (family A: the Q stages; family B: 1, as sP).
static bool simulate_grid(std::vector<Agent>& agents, int ctas, int q_stages, int ds_stages,
                          int dq_wgs, int keys, DqAccumulator& got, std::mt19937& rng) {
  std::vector<CtaState> st(ctas);
  const int stages[kNumPipes] = {1, q_stages, q_stages};
  for (CtaState& c : st) {
    for (int p = 0; p < kNumPipes; ++p) {
      c.full[p].assign(stages[p], Mbarrier{});
      c.empty[p].assign(stages[p], Mbarrier{kConsumerWgs});
      c.buffer[p].assign(stages[p], Payload{});
    }
    for (int i = kPdS; i < kPdSLocal; ++i) {
      c.bars[i].count = kConsumerWgs * kWgThreads + (i == kTileSlot ? 32 : 0);
    }
    for (int i = kPdSLocal; i < kDqStaged; ++i) {
      c.bars[i].count = kWgThreads;
    }
    for (int i = kDqStaged; i < kNumBars; ++i) {
      c.bars[i].count = kWgThreads + 32;
    }
    c.smem[kBufDs].assign(ds_stages, SmemBuffer{});
    c.smem[kBufP].assign(1, SmemBuffer{});
    for (int b = 0; b < kNumBufs; ++b) {
      for (SmemBuffer& buf : c.smem[b]) {
        buf.part.assign(kConsumerWgs, SmemBuffer::Write{});
        buf.readers.assign(kConsumerWgs, 0);
      }
    }
  }
  std::vector<int> sem(keys, 0);
  got.reset(keys, dq_wgs);
  bool ok = true;
  auto fail = [&](char const* what, int a, Event const& e) {
    CHECK(false, "%s: agent %d (cta %d) event %zu %s a %d stage %d (tile %d g %d m %d)", what, a,
          agents[a].cta, agents[a].pc, kOpName[e.op], e.a, e.stage, e.payload.tile, e.payload.g,
          e.payload.m);
    ok = false;
  };
  auto arrive = [&](NamedBarrier& b, int a, int threads) {
    join(b.pending_clock, agents[a].clock);
    if (!b.agents.insert(a).second) {
      CHECK(false, "agent %d arrives twice in one named-barrier generation", a);
      ok = false;
    }
    b.arrived += threads;
    if (b.arrived > b.count) {
      CHECK(false, "named barrier over-arrived (%d of %d threads)", b.arrived, b.count);
      ok = false;
    }
    if (b.arrived >= b.count) {
      b.arrived = 0;
      ++b.generation;
      b.agents.clear();
      b.done.push_back(b.pending_clock);
      b.pending_clock = Clock{};
    }
  };
  // The memory system of a CTA, one action: a WG's bulk engine reads its oldest unread group or
  // completes (performs the adds of) its oldest group, or one red.global add of a WG is
  // performed (in any order: they go to different addresses).
  auto memory_step = [&](CtaState& c) {
    const int lists = kConsumerWgs + 1;  // the WGs' leaders, the dQ writer
    const int first = int(rng() % lists);
    for (int k = 0; k < lists; ++k) {
      const int w = (first + k) % lists;
      if (w < kConsumerWgs && !c.red[w].empty() && (c.bulk[w].empty() || rng() % 2)) {
        const size_t i = rng() % c.red[w].size();
        got.add(c.red[w][i].key, c.red[w][i].n, w);
        c.red[w].erase(c.red[w].begin() + long(i));
        return true;
      }
      for (BulkGroup& g : c.bulk[w]) {
        if (!g.read) {
          if (c.slot[g.slot] != g.payload) {
            CHECK(false, "a reduce-add (list %d) reads slot %d holding (tile %d g %d m %d), "
                  "expected (tile %d g %d m %d)", w, g.slot, c.slot[g.slot].tile,
                  c.slot[g.slot].g, c.slot[g.slot].m, g.payload.tile, g.payload.g,
                  g.payload.m);
            ok = false;
          }
          if (g.parts == (1u << kConsumerWgs) - 1 && dq_wgs == 1 && !c.slot_summed) {
            CHECK(false, "the dQ writer's add of both parts reads slot %d without WG 1's part "
                  "summed in", g.slot);
            ok = false;
          }
          g.read = true;
          return true;
        }
      }
      if (!c.bulk[w].empty()) {
        // A thread's groups complete in any order (the writer's; a leader's have one in flight
        // in the deterministic sense, its slot's).
        const size_t i = w == kConsumerWgs ? rng() % c.bulk[w].size() : 0;
        BulkGroup const g = c.bulk[w][i];
        if (g.parts == (1u << kConsumerWgs) - 1 && dq_wgs == 1) {
          got.add_sum(g.key, g.n);
        } else {
          for (int p = 0; p < kConsumerWgs; ++p) {
            if (g.parts >> p & 1) {
              got.add(g.key, g.n, p);
            }
          }
        }
        c.bulk[w].erase(c.bulk[w].begin() + long(i));
        return true;
      }
    }
    return false;
  };
  std::vector<int> order(agents.size());
  for (size_t i = 0; i < order.size(); ++i) {
    order[i] = int(i);
  }
  for (;;) {
    bool progress = false, done = true;
    std::shuffle(order.begin(), order.end(), rng);
    for (int a : order) {
      Agent& ag = agents[a];
      CtaState& c = st[ag.cta];
      for (int burst = 1 + int(rng() % 4); burst > 0 && ag.pc < ag.prog.size(); --burst) {
        Event const& e = ag.prog[ag.pc];
        const int now = ++ag.clock[ag.local];  // this event's time (failed attempts tick too)
        bool ran = true;
        switch (e.op) {
          case kWaitEmpty:
            ran = c.empty[e.a][e.stage].passes(e.phase);
            if (ran) {
              join(ag.clock, c.empty[e.a][e.stage].done_clock);
            }
            break;
          case kArriveFull:
            c.buffer[e.a][e.stage] = e.payload;
            c.full[e.a][e.stage].arrive(ag.clock);
            break;
          case kWaitFull:
            ran = c.full[e.a][e.stage].passes(e.phase);
            if (ran && c.buffer[e.a][e.stage] != e.payload) {
              fail("consumer reads a buffer holding another step", a, e);
              return false;
            }
            if (ran) {
              join(ag.clock, c.full[e.a][e.stage].done_clock);
            }
            break;
          case kArriveEmpty:
            if (c.buffer[e.a][e.stage] != e.payload) {
              fail("consumer releases a buffer that was overwritten", a, e);
              return false;
            }
            c.empty[e.a][e.stage].arrive(ag.clock);
            break;
          case kBarArrive:
            arrive(c.bars[e.a], a, e.stage);
            break;
          case kBarSync:
            if (ag.sync_target < 0) {
              ag.sync_target = c.bars[e.a].generation + 1;
              arrive(c.bars[e.a], a, e.stage);
              progress = true;  // the arrival itself is progress
            }
            ran = c.bars[e.a].generation >= ag.sync_target;
            if (ran) {
              join(ag.clock, c.bars[e.a].done[ag.sync_target - 1]);
              ag.sync_target = -1;
            }
            break;
          case kTileWrite:
            c.tile_slot[e.a] = e.payload;
            break;
          case kTileRead:
            if (c.tile_slot[e.a] != e.payload) {
              fail("consumer reads a tile slot holding another tile", a, e);
              return false;
            }
            break;
          case kSmemWrite: {
            // The buffer hazard: no GEMM may still read the part, and every GEMM that read an
            // earlier content of it must have completed before this write (happens-before, not
            // only in this interleaving).
            SmemBuffer& b = c.smem[e.val][e.a];
            if (b.readers[e.stage] > 0) {
              fail(e.val == kBufP ? "sP overwritten while a GEMM reads it"
                                  : "sdS overwritten while a GEMM reads it", a, e);
              return false;
            }
            for (SmemBuffer::ReadEnd& r : b.ends) {
              if ((r.parts >> e.stage & 1) && r.payload != e.payload &&
                  !(r.checked >> e.stage & 1)) {
                if (ag.clock[r.agent] < r.time) {
                  fail(e.val == kBufP ? "sP overwritten, not ordered after a GEMM reading the "
                                        "previous contents"
                                      : "sdS overwritten, not ordered after a GEMM reading the "
                                        "previous contents", a, e);
                  return false;
                }
                r.checked |= 1u << e.stage;
              }
            }
            b.ends.erase(std::remove_if(b.ends.begin(), b.ends.end(),
                                        [&](SmemBuffer::ReadEnd const& r) {
                                          return r.checked == r.parts;
                                        }),
                         b.ends.end());
            b.part[e.stage] = {e.payload, ag.local, now};
            break;
          }
          case kSmemReadBegin: {
            SmemBuffer& b = c.smem[e.val][e.a];
            for (int w = 0; w < kConsumerWgs; ++w) {
              if (!(e.parts >> w & 1)) {
                continue;
              }
              SmemBuffer::Write const& part = b.part[w];
              if (part.payload != e.payload) {
                fail(e.val == kBufP ? "a GEMM reads an sP not fully written of its step"
                                    : "a GEMM reads an sdS not fully written of its step", a, e);
                return false;
              }
              if (ag.clock[part.agent] < part.time) {
                fail(e.val == kBufP ? "a GEMM reads sP not ordered after a WG's write"
                                    : "a GEMM reads sdS not ordered after a WG's write", a, e);
                return false;
              }
            }
            for (int w = 0; w < kConsumerWgs; ++w) {
              b.readers[w] += e.parts >> w & 1;
            }
            break;
          }
          case kSmemReadEnd: {
            SmemBuffer& b = c.smem[e.val][e.a];
            const unsigned parts = e.parts & ((1u << kConsumerWgs) - 1);
            for (int w = 0; w < kConsumerWgs; ++w) {
              b.readers[w] -= parts >> w & 1;
            }
            b.ends.push_back({e.payload, ag.local, now, parts, 0u});
            break;
          }
          case kSlotWrite:
            for (int w = 0; w <= kConsumerWgs; ++w) {
              for (BulkGroup const& g : c.bulk[w]) {
                if (!g.read && g.slot == e.a) {
                  fail("dQ slot overwritten before its reduce-add read it", a, e);
                  return false;
                }
              }
            }
            c.slot[e.a] = e.payload;
            c.slot_summed = false;
            break;
          case kReduce:
            if (e.a < kConsumerWgs) {  // a leader's add of its own slot
              c.bulk[e.a].push_back({e.payload, e.key, e.val, false, e.a, 1u << e.a});
            } else {
              c.bulk[e.a].push_back({e.payload, e.key, e.val, false, e.stage, e.parts});
            }
            break;
          case kCombine:
            for (int w = 0; w < kConsumerWgs; ++w) {
              if (c.slot[w] != e.payload) {
                fail("the dQ writer sums a slot that holds another step", a, e);
                return false;
              }
            }
            c.slot_summed = true;
            break;
          case kFreeWait:
            ran = c.dq_free.passes(e.phase);
            if (ran) {
              join(ag.clock, c.dq_free.done_clock);
            }
            break;
          case kFreeArrive:
            c.dq_free.arrive(ag.clock);
            break;
          case kWaitRead:
            ran = std::none_of(c.bulk[e.a].begin(), c.bulk[e.a].end(),
                               [](BulkGroup const& g) { return !g.read; });
            break;
          case kWaitComplete:
            ran = c.bulk[e.a].empty();
            break;
          case kRedAdd:
            c.red[e.a].push_back({e.key, e.val});
            break;
          case kFence:
            ran = c.red[e.a].empty();
            break;
          case kWaitRank:
            ran = sem[e.key] == e.val;
            break;
          case kWaitCount:
            ran = sem[e.key] >= e.val;
            break;
          case kReleaseRank:
            // The next contributor may add as soon as it sees the increment: every add this
            // release vouches for (both WGs' parts, or the releasing WG's) must have been
            // performed.
            for (int w = 0; w < kConsumerWgs; ++w) {
              if ((e.parts >> w & 1) && got.performed(e.key, e.val, w) != 1) {
                fail("the dQ turn passes before the holder's adds were performed", a, e);
                return false;
              }
            }
            sem[e.key] += e.stage;
            break;
        }
        if (!ran) {
          break;
        }
        ++ag.pc;
        progress = true;
        if (ag.pc == ag.prog.size() && ag.local > 0 && !c.bulk[ag.local - 1].empty()) {
          fail("a WG exits with a bulk reduce-add in flight (its slot may be gone)", a, e);
          return false;
        }
      }
      done = done && ag.pc == ag.prog.size();
      if (rng() % 3 == 0 && memory_step(c)) {
        progress = true;
      }
    }
    if (done) {
      break;
    }
    if (!progress) {
      for (CtaState& c : st) {
        while (memory_step(c)) {
          progress = true;
        }
      }
      if (!progress) {
        // Name a WG waiting for a dQ turn if there is one: the others wait behind it.
        int stuck = -1;
        for (size_t a = 0; a < agents.size(); ++a) {
          if (agents[a].pc < agents[a].prog.size() &&
              (stuck < 0 || agents[a].prog[agents[a].pc].op == kWaitRank ||
               agents[a].prog[agents[a].pc].op == kWaitCount)) {
            stuck = int(a);
          }
        }
        fail("deadlock", stuck, agents[stuck].prog[agents[stuck].pc]);
        return false;
      }
    }
  }
  for (CtaState& c : st) {
    while (memory_step(c)) {
    }
    for (int p = 0; p < kNumPipes; ++p) {
      for (size_t s = 0; s < c.full[p].size(); ++s) {
        if (c.full[p][s].pending != 0 || c.empty[p][s].pending != 0) {
          CHECK(false, "%s stage %zu ends with pending arrivals", kPipeName[p], s);
          ok = false;
        }
      }
    }
    for (int b = 0; b < kNumBars; ++b) {
      if (c.bars[b].arrived != 0) {
        CHECK(false, "named barrier %d ends with %d arrived threads", b, c.bars[b].arrived);
        ok = false;
      }
    }
  }
  return ok;
}

// Every dQ block received exactly its contributors' parts, each key block of key_blocks(m) once
// per WG; deterministic mode: each element's adds in the order (dq_rank ascending, WG
// ascending).
static void check_contributions(Problem const& p, int bm, int bn, BwdTileScheduler const& tiles,
                                DqAccumulator const& got, bool ordered) {
  const int num_m = (p.seqlen_q + bm - 1) / bm;
  const int parts = got.dq_wgs == 2 ? 2 : 1;
  for (int key = 0; key < int(got.adds.size() / 2); ++key) {
    const int m = key % num_m;
    const int bh = key / num_m;  // batch * q_heads + q head
    BwdTileCoord c;
    c.batch = bh / p.q_heads();
    c.kv_head = bh % p.q_heads() / p.q_per_kv;
    const AttentionMask mask = p.seq_mask(c.batch);
    // Blocks past a varlen sequence's rows have no contributors.
    const KeyBlockRange r =
        m * bm < mask.seqlen_q ? mask.key_blocks(m, bm, bn) : KeyBlockRange{0, 0};
    std::vector<int> contributors;  // n, in the deterministic order
    for (int n = r.n_max - 1; n >= r.n_min; --n) {
      contributors.push_back(n);
    }
    auto rank = [&](int n) {
      c.n_block = n;
      return dq_rank<true>(tiles, mask, m, c, bm, bn);
    };
    if (ordered) {
      std::stable_sort(contributors.begin(), contributors.end(),
                       [&](int a, int b) { return rank(a) < rank(b); });
    }
    for (int part = 0; part < 2; ++part) {
      std::vector<DqAdd> expected;
      for (size_t i = 0; i < contributors.size() && part < parts; ++i) {
        const int n = contributors[i];
        for (int wg = 0; wg < kConsumerWgs; ++wg) {
          if (parts == 1 || wg == part) {
            expected.push_back({n, wg});
          }
        }
      }
      std::vector<DqAdd> g = got.adds[size_t(key) * 2 + part];
      if (!ordered) {
        std::sort(g.begin(), g.end());
      }
      CHECK(g == expected, "dQ block %d (m %d) part %d got %zu adds, expected %zu%s", key, m,
            part, g.size(), expected.size(), ordered ? " in (rank, WG) order" : "");
    }
  }
}

// The whole grid of one problem for one family: the producer and both consumer WGs of every CTA
// walk the schedule (with the sabotage), then run together. got: the accumulator's adds and sums.
template <class Cfg>
static bool run_roles(Problem const& p, std::mt19937& rng, Sabotage sab,
                      DqAccumulator* sums = nullptr) {
  // The launcher's choice (bwd/launch.h): deterministic calls of the slot families run their
  // deterministic kernel, unless the control asks for the default kernel's run-time path.
  if constexpr (Cfg::kDqSlots && !Cfg::kDeterministic) {
    if (p.deterministic && !sab.default_kernel) {
      return run_roles<Family<Cfg::kHeadDim, true>>(p, rng, sab, sums);
    }
  }
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, QS = Cfg::kStages;
  const BwdTileScheduler tiles = make_tiles(p, BM, BN, Cfg::kDeterministic);
  const int num_n = tiles.num_n_blocks;
  std::vector<Agent> agents;
  std::vector<int> written(tiles.total_tiles, 0);
  const int before = failures;
  std::vector<std::deque<int>> claims = random_claims(tiles, rng);
  for (int cta = 0; cta < tiles.grid; ++cta) {
    std::vector<typename MockConsumer<Cfg>::Staged> staged0;
    const TestSchedule<BM, BN, Cfg::kDeterministic> cs{{tiles, p.mask, cta, p.spans()}, sab};
    MockProducer<QS> producer(num_n, p, sab);
    producer.tiles = &tiles;
    producer.claims = &claims[size_t(cta)];
    produce_bwd(cs, producer);
    CHECK(!tiles.dynamic || claims[size_t(cta)].empty(), "CTA %d left %zu claims", cta,
          claims[size_t(cta)].size());
    const std::vector<Published> published = producer.published;
    CHECK(!published.empty() && published.back().tile.end == 1,
          "CTA %d's producer did not publish the end of its walk", cta);
    agents.push_back({cta, /*local=*/0, std::move(producer.ev)});
    for (int wg = 0; wg < kConsumerWgs; ++wg) {
      MockConsumer<Cfg> consumer(p, num_n, wg, Cfg::kDqWgs, sab);
      consumer.tiles = &tiles;
      consumer.published_tiles = &published;
      consume_bwd_wg<Cfg>(cs, consumer);
      CHECK(consumer.next_published == published.size(), "WG %d read %zu of %zu published tiles",
            wg, consumer.next_published, published.size());
      for (int q = 0; q < kNumPipes; ++q) {
        CHECK(consumer.held[q].empty() || sab.skip_release >= 0, "WG %d ends holding %s", wg,
              kPipeName[q]);
      }
      CHECK(consumer.in_flight.empty(), "WG %d ends with GEMMs in flight", wg);
      if (wg == 0) {
        for (int t : consumer.stored) {
          ++written[t];
        }
        for (int t : consumer.zeroed) {
          ++written[t];
        }
      }
      agents.push_back({cta, /*local=*/1 + wg, std::move(consumer.ev)});
      if constexpr (Cfg::kDeterministic) {
        // Both WGs publish the same steps; the writer's program follows WG 0's records.
        if (wg == 0) {
          staged0 = consumer.staged;
        } else {
          bool same = consumer.staged.size() == staged0.size();
          for (size_t i = 0; same && i < staged0.size(); ++i) {
            same = consumer.staged[i].end == staged0[i].end &&
                   consumer.staged[i].block.step == staged0[i].block.step;
          }
          CHECK(same, "CTA %d: the WGs publish different dQ steps", cta);
        }
      }
    }
    if constexpr (Cfg::kDeterministic) {
      MockWriter<Cfg> writer;
      writer.staged = &staged0;
      writer.sab = sab;
      write_dq_bwd<Cfg>(writer);
      CHECK(writer.next == staged0.size(), "the dQ writer read %zu of %zu records", writer.next,
            staged0.size());
      agents.push_back({cta, /*local=*/1 + kConsumerWgs, std::move(writer.ev)});
    }
  }
  for (int t = 0; t < tiles.total_tiles; ++t) {
    CHECK(written[t] == 1, "tile %d written %d times", t, written[t]);
  }
  const int keys = p.batch * p.q_heads() * ((p.seqlen_q + BM - 1) / BM);
  DqAccumulator got;
  const int ds_stages = Cfg::kFamilyB ? 1 : QS;
  if (!simulate_grid(agents, tiles.grid, QS, ds_stages, Cfg::kDqWgs, keys, got, rng)) {
    return false;
  }
  check_contributions(p, BM, BN, tiles, got, /*ordered=*/p.deterministic);
  if (sums != nullptr) {
    *sums = std::move(got);
  }
  return failures == before;
}

// Deterministic mode's promise: two runs in different interleavings sum every dQ element in the
// same order, so the float sums are equal bit for bit. True if they are.
template <class Cfg>
static bool same_bits(Problem const& p, std::mt19937& rng, Sabotage sab = {}) {
  DqAccumulator a, b;
  if (!run_roles<Cfg>(p, rng, sab, &a) || !run_roles<Cfg>(p, rng, sab, &b)) {
    return false;
  }
  for (size_t i = 0; i < a.sum.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a.sum[i], 4);
    std::memcpy(&y, &b.sum[i], 4);
    if (x != y) {
      CHECK(false, "dQ block %zu part %zu: sums %a and %a differ between two runs", i / 2, i % 2,
            double(a.sum[i]), double(b.sum[i]));
      return false;
    }
  }
  return true;
}

// ------------------------------------------------------------------------------------------------
// Drivers
// ------------------------------------------------------------------------------------------------
template <class Cfg>
static std::string family_name() {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "d%d family %c%s", Cfg::kHeadDim, Cfg::kFamilyB ? 'B' : 'A',
                Cfg::kBlockM == kBwdUnmaskedBlockM ? " unmasked" : "");
  return buf;
}

// Per problem: the steps (c); the roles on the problem's own grid and mode; the deterministic
// protocol on one of the grid sizes 1, 2, 3, 7, 132, twice, with bitwise-equal sums.
// One problem's steps (c), then the roles on one of the grids 3 / 132 in the problem's mode.
template <class Cfg>
static void steps_and_roles(Problem& p, std::mt19937& rng) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN;
  context = family_name<Cfg>() + " | " + describe(p, BM, BN);
  const BwdTileScheduler tiles = make_tiles(p, BM, BN);
  std::vector<TestSchedule<BM, BN>> ctas;
  for (int cta = 0; cta < tiles.grid; ++cta) {
    ctas.push_back({{tiles, p.mask, cta, p.spans()}, {}});
  }
  check_steps<BM, BN>(p, tiles, ctas);
  p.grid_sms = rng() % 2 ? 3 : 132;
  context = family_name<Cfg>() + " | " + describe(p, BM, BN) + " roles";
  run_roles<Cfg>(p, rng, {});
}

template <class Cfg>
static void run_family(std::mt19937& rng, int problems) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN;
  for (int i = 0; i < problems; ++i) {
    Problem p = random_problem(rng);
    steps_and_roles<Cfg>(p, rng);
    p.deterministic = true;
    const int grids[] = {1, 2, 3, 7, 132};
    p.grid_sms = grids[rng() % 5];
    context = family_name<Cfg>() + " | " + describe(p, BM, BN) + " deterministic";
    same_bits<Cfg>(p, rng);
  }
}

// Runs `body` with failures silenced; true if it reported a failure (or returned false).
template <class Body>
static bool caught(Body&& body) {
  const int before = failures;
  quiet = true;
  const bool ok = body();
  const bool any = !ok || failures != before;
  failures = before;
  quiet = false;
  return any;
}

// A sabotage that shows in some interleavings only: caught in one of `attempts` runs.
template <class Body>
static bool caught_within(int attempts, Body&& body) {
  for (int attempt = 0; attempt < attempts; ++attempt) {
    if (caught(body)) {
      return true;
    }
  }
  return false;
}

using D64 = Family<64>;    // family A, dq_wgs = 1, dQ slots
using D96 = Family<96>;    // family A, dq_wgs = 1, dQ slots
using D128 = Family<128>;  // family A, dq_wgs = 2, dQ slots
using D192 = Family<192>;  // family B, dQ slots
using D256 = Family<256>;  // family B, red.global (no room for slots)
using D128Unmasked = Family<128, false, true>;  // family A, 80-query steps, dQ transposed

// The unmasked tile serves dense calls without a mask or softcap in default mode (launch.h
// bwd_takes_unmasked_tile): the steps and roles of such problems on its 80-query blocks, and every
// block of every kernel inside the dense workspace's rows (bwd_rows_rounded).
static void run_unmasked_family(std::mt19937& rng, int problems) {
  using Cfg = D128Unmasked;
  static_assert(Cfg::kBlockM == kBwdUnmaskedBlockM && Cfg::kBlockM % 16 == 0 &&
                Cfg::kBlockN == 128);
  for (int i = 0; i < problems; ++i) {
    Problem p = random_problem(rng);
    p.cu_q.clear();
    p.cu_k.clear();
    p.mask = AttentionMask{p.seqlen_q, p.seqlen_k, -1, -1, 0};
    p.deterministic = false;
    p.softcap = false;
    steps_and_roles<Cfg>(p, rng);
  }
  context = "dense workspace rows";
  for (int64_t s = 0; s < 5000; ++s) {
    const int64_t rows = bwd_rows_rounded(s);
    CHECK(rows % kBwdRowPad == 0 && rows >= s && rows < s + kBwdUnmaskedBlockM + kBwdRowPad,
          "seqlen_q %lld: %lld rows", (long long)s, (long long)rows);
    for (int bm : {64, kBwdUnmaskedBlockM, 128}) {
      const int64_t end = (s + bm - 1) / bm * bm;  // the last query block's end
      CHECK(end <= rows, "seqlen_q %lld: %d-row blocks end at %lld, past %lld rows", (long long)s,
            bm, (long long)end, (long long)rows);
    }
  }
}

// Family B: without the PdSFree sync before store_p, a WG writes step s+1's P (and dS) while
// nothing orders it after the other WG's dV (dQ, dK) of step s (two Q stages: the Q pipeline does
// not order it either); the happens-before check catches that in every interleaving, whether or
// not the write lands during the read.
static void family_b_controls(std::mt19937& rng) {
  Problem p{1, 2, 2, 300, 300, 3, AttentionMask{300, 300, -1, 0}, false};
  context = "family B control";
  static_assert(D192::kStages == 2 && D256::kStages == 2);
  CHECK(!caught([&] { return run_roles<D192>(p, rng, {}); }), "family B role control fails");
  Sabotage no_free;
  no_free.no_free_sync = true;
  for (int attempt = 0; attempt < 5; ++attempt) {
    CHECK(caught([&] { return run_roles<D192>(p, rng, no_free); }),
          "family B without the sync before overwriting sP went unnoticed (attempt %d)", attempt);
  }
  Sabotage no_pds;
  no_pds.no_pds = true;
  CHECK(caught_within(20, [&] { return run_roles<D256>(p, rng, no_pds); }),
        "family B without the PdS sync after writing P and dS went unnoticed");
}

// The dQ protocol's properties, each with a broken variant that must be reported.
static void dq_controls(std::mt19937& rng) {
  context = "dQ protocol control";
  Problem p{1, 2, 2, 300, 300, 7, AttentionMask{300, 300, -1, -1}, true};
  // Positive controls: the unsabotaged runs of the problems below pass, and are reproducible.
  CHECK(!caught([&] { return same_bits<D64>(p, rng); }), "deterministic d64 control fails");
  CHECK(!caught([&] { return same_bits<D128>(p, rng); }), "deterministic d128 control fails");
  CHECK(!caught([&] { return same_bits<D256>(p, rng); }), "deterministic d256 control fails");
  // No deadlock: the order rests on n descending; n ascending at one CTA waits forever.
  Sabotage ascending;
  ascending.ascending = true;
  p.grid_sms = 1;
  CHECK(caught([&] { return run_roles<D128>(p, rng, ascending); }),
        "n-ascending deterministic order at G = 1 did not deadlock");
  p.grid_sms = 7;
  // Rank order: a rank off by one, a missing hand-off of the turn, a wrong increment. The dQ
  // writer waits until the semaphore reaches its rank, so an early rank or a double increment
  // shows only where a contributor then overtakes its predecessor: within 20 interleavings.
  for (int offset : {1, -1}) {
    Sabotage s;
    s.rank_offset = offset;
    CHECK(caught_within(20, [&] { return run_roles<D128>(p, rng, s); }),
          "rank %+d went unnoticed", offset);
  }
  Sabotage no_pass;
  no_pass.skip_pass = 1;
  CHECK(caught([&] { return run_roles<D64>(p, rng, no_pass); }),
        "a turn never passed on went unnoticed");
  Sabotage by_two;
  by_two.pass_by = 2;
  CHECK(caught_within(20, [&] { return run_roles<D192>(p, rng, by_two); }),
        "a semaphore incremented by 2 went unnoticed");
  // The turn passes only after the adds were performed: without the fence (red.global adds)
  // or the wait for the bulk reduce-add's completion (slots) it may pass first.
  Sabotage no_fence;
  no_fence.no_fence = true;
  CHECK(caught_within(20, [&] { return run_roles<D256>(p, rng, no_fence); }),
        "passing the turn without fencing the adds went unnoticed");
  Sabotage no_complete;
  no_complete.no_complete = true;
  for (int family = 0; family < 2; ++family) {
    CHECK(caught_within(20, [&] {
            return family == 0 ? run_roles<D128>(p, rng, no_complete)
                               : run_roles<D64>(p, rng, no_complete);
          }),
          "the dQ writer passing the turn before its adds completed went unnoticed (d%d)",
          family == 0 ? 128 : 64);
  }
  // The deterministic kernel: a WG restages its slot only after the writer's adds read it (the
  // WGs wait for dq_free; the writer arrives on it only after its adds' reads).
  Sabotage no_free_wait;
  no_free_wait.no_slot_wait = true;
  Sabotage no_read_wait;
  no_read_wait.no_read_wait = true;
  for (int family = 0; family < 4; ++family) {
    Sabotage const& sab = family % 2 ? no_read_wait : no_free_wait;
    CHECK(caught_within(20, [&] {
            return family < 2 ? run_roles<D128>(p, rng, sab) : run_roles<D64>(p, rng, sab);
          }),
          "a slot rewritten before the dQ writer's add read it went unnoticed (d%d, %s)",
          family < 2 ? 128 : 64, family % 2 ? "no read wait" : "no free wait");
  }
  // The default kernels' run-time path (d256's deterministic mode; in the slot families code
  // their calls never run), dq_wgs = 1: WG 1 adds its partial to the same positions after WG
  // 0's (the hand-off sync); without it the partials come in either order.
  Sabotage on_default;
  on_default.default_kernel = true;
  CHECK(!caught([&] { return same_bits<D96>(p, rng, on_default); }),
        "deterministic d96 on its default kernel control fails");
  Sabotage no_handoff = on_default;
  no_handoff.no_handoff = true;
  CHECK(caught_within(20, [&] { return same_bits<D96>(p, rng, no_handoff); }),
        "WG 1 adding without the hand-off from WG 0 went unnoticed by the order check");
  // Every contribution exactly once: a skipped add, in both modes and every dQ path.
  Sabotage skip;
  skip.skip_add = 2;
  CHECK(caught([&] { return run_roles<D64>(p, rng, skip); }),
        "a skipped dQ add (deterministic) went unnoticed");
  p.deterministic = false;
  for (int family = 0; family < 2; ++family) {
    CHECK(caught([&] {
            return family == 0 ? run_roles<D128>(p, rng, skip) : run_roles<D256>(p, rng, skip);
          }),
          "a skipped dQ add (default mode, %s) went unnoticed", family == 0 ? "slots" : "red");
  }
  // dQ slots: the slot is rewritten only after its reduce-add read it, and the leader exits
  // only after its reduce-adds completed.
  Sabotage no_slot_wait;
  no_slot_wait.no_slot_wait = true;
  CHECK(caught_within(20, [&] { return run_roles<D128>(p, rng, no_slot_wait); }),
        "a dQ slot rewritten before its reduce-add read it went unnoticed");
  Sabotage no_finish;
  no_finish.no_finish = true;
  CHECK(caught_within(20, [&] { return run_roles<D64>(p, rng, no_finish); }),
        "a WG exiting with its reduce-add in flight went unnoticed");
  // The bitwise check has teeth: default mode sums in the order the adds land.
  CHECK(caught_within(20, [&] { return same_bits<D64>(p, rng); }),
        "default mode's summation order looked reproducible to the bitwise check");
}

static void negative_controls(std::mt19937& rng) {
  Problem p{1, 2, 2, 300, 300, 1, AttentionMask{300, 300, -1, -1}, true};
  context = "negative control";
  CHECK(!caught([&] { return run_roles<D128>(p, rng, {}); }), "role control fails");
  Sabotage drop;
  drop.drop_block = true;
  p.mask = AttentionMask{300, 300, 100, 0};
  p.grid_sms = 7;
  const BwdTileScheduler tiles = make_tiles(p, 64, 64);
  std::vector<TestSchedule<64, 64>> ctas;
  for (int cta = 0; cta < tiles.grid; ++cta) {
    ctas.push_back({{tiles, p.mask, cta, p.spans()}, drop});
  }
  CHECK(caught([&] {
          check_steps<64, 64>(p, tiles, ctas);
          return true;
        }),
        "a dropped query block went unnoticed by the step check");
  CHECK(caught([&] { return run_roles<D192>(p, rng, drop); }),
        "a dropped query block went unnoticed by the grid simulation");
  // Role-loop sabotages on the whole grid.
  p.grid_sms = 3;
  Sabotage role[4];
  role[0].skip_load = 5;
  role[1].wrong_load = 4;
  role[2].skip_release = 3;
  role[3].no_pds = true;
  for (Sabotage const& s : role) {
    CHECK(caught_within(20, [&] { return run_roles<D128>(p, rng, s); }),
          "role sabotage %d went unnoticed", int(&s - role));
  }
  // Softcap: a capped call runs every step in the capped code; a misread softcapped() (either
  // way) runs the other kind's code, in both families.
  Sabotage misread;
  misread.softcap_misread = true;
  for (bool cap : {false, true}) {
    p.softcap = cap;
    CHECK(!caught([&] { return run_roles<D128>(p, rng, {}); }), "softcap %d role control fails",
          int(cap));
    CHECK(caught([&] { return run_roles<D128>(p, rng, misread); }),
          "softcapped() misread (softcap %d, family A) went unnoticed", int(cap));
    CHECK(caught([&] { return run_roles<D256>(p, rng, misread); }),
          "softcapped() misread (softcap %d, family B) went unnoticed", int(cap));
  }
  p.softcap = false;
  family_b_controls(rng);
  // Per-WG partial dQ (d64, d96): the WG-local PdS sync orders only the WG's own part of sdS, so
  // a dQ GEMM reading the other WG's part too must be caught (a part not yet written, or not
  // ordered after its write).
  p.mask = AttentionMask{300, 300, -1, 0};
  p.deterministic = false;
  CHECK(!caught([&] { return run_roles<D64>(p, rng, {}); }), "partial dQ role control fails");
  Sabotage reads_all;
  reads_all.dq_reads_all = true;
  CHECK(caught_within(20, [&] { return run_roles<D96>(p, rng, reads_all); }),
        "a partial dQ reading the other WG's sdS behind a WG-local sync went unnoticed");
  dq_controls(rng);
  // The tiles reach the consumers only through the tile slot: a tile without queries the producer
  // does not publish is never zeroed, and a claimed tile the producer drops is never computed.
  p = Problem{1, 2, 2, 100, 400, 3, AttentionMask{100, 400, 50, 0}, false};
  CHECK(!caught([&] { return run_roles<D256>(p, rng, {}); }), "tile publishing control fails");
  Sabotage no_empty;
  no_empty.no_empty_publish = true;
  CHECK(caught([&] { return run_roles<D256>(p, rng, no_empty); }),
        "a tile without queries left unpublished went unnoticed");
  Sabotage single_slot;
  single_slot.single_tile_slot = true;
  CHECK(caught_within(20, [&] { return run_roles<D256>(p, rng, single_slot); }),
        "a tile slot of one buffer (rewritten before the consumers read it) went unnoticed");
  Sabotage skip_claim;
  skip_claim.skip_claim = true;
  CHECK(make_tiles(p, 64, 128).dynamic, "the publishing control's call is not claimed");
  CHECK(caught([&] { return run_roles<D128>(p, rng, skip_claim); }),
        "a claimed tile dropped by the producer went unnoticed");
}

// Varlen workspace rows (bwd_ws_row0): every query block of every sequence lies inside the
// workspace's round_up(total_q + kBwdRowPad * batch, kBwdRowPad) rows for any offsets clamped to
// the tensor, and with monotone offsets no kBwdRowPad block holds rows of two sequences.
static void check_ws_rows(std::mt19937& rng) {
  context = "varlen workspace rows";
  for (int trial = 0; trial < 2000; ++trial) {
    const int batch = 1 + int(rng() % 40);
    const int total_q = int(rng() % 3000);
    const bool monotone = rng() % 2 == 0;
    std::vector<int32_t> cu(size_t(batch) + 1), cu_k(size_t(batch) + 1, 0);
    for (int32_t& x : cu) {
      x = int32_t(rng() % uint32_t(total_q + 200)) - 100;  // some outside [0, total_q]
    }
    if (monotone) {
      for (int32_t& x : cu) {
        x = std::min(std::max(x, 0), total_q);
      }
      std::sort(cu.begin(), cu.end());
    }
    BwdSpans spans;
    spans.cu_q = cu.data();
    spans.cu_k = cu_k.data();
    spans.total_q = total_q;
    spans.seqlen_q = total_q;
    const int64_t rows = (int64_t(total_q) + kBwdRowPad * batch + kBwdRowPad - 1) / kBwdRowPad *
                         kBwdRowPad;
    int64_t last_end = 0;
    for (int b = 0; b < batch; ++b) {
      const BwdSpan sp = spans(b);
      const int blocks = (sp.seqlen_q + kBwdRowPad - 1) / kBwdRowPad;
      const int64_t end = int64_t(sp.ws_row0) + int64_t(blocks) * kBwdRowPad;
      CHECK(sp.ws_row0 >= 0 && sp.ws_row0 % kBwdRowPad == 0 && end <= rows,
            "batch %d total %d: sequence %d at rows [%d, %lld) of %lld", batch, total_q, b,
            sp.ws_row0, (long long)end, (long long)rows);
      if (monotone && blocks > 0) {
        CHECK(sp.ws_row0 >= last_end, "sequence %d starts at row %d, the last one ended at %lld",
              b, sp.ws_row0, (long long)last_end);
        last_end = end;
      }
    }
  }
}

int main(int argc, char** argv) {
  const int problems = argc > 1 ? std::atoi(argv[1]) : 60;
  std::mt19937 rng(2024);
  tile_orders(rng);
  check_ws_rows(rng);
  run_family<D64>(rng, problems);
  run_family<D96>(rng, problems);
  run_family<D128>(rng, problems);
  run_family<D192>(rng, problems);
  run_family<D256>(rng, problems);
  run_unmasked_family(rng, problems);
  negative_controls(rng);
  if (failures == 0) {
    std::printf("OK\n");
  }
  return failures == 0 ? 0 : 1;
}
