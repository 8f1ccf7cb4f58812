// The step schedule of the FA-3 path: which tiles a CTA computes, which key blocks each visits
// (masked or not), and in which order the producer loads them and the consumers use them.
// Both roles walk it; neither derives the order on its own, so they cannot disagree (a
// disagreement would hang the GPU rather than fail a test).
//
// Plain C++: the kernel instantiates the role loops below with its device operations (load.h,
// mma.h), the host test (tests/cpp/test_fwd_schedule.cpp) with recorders, and simulates the
// recorded barrier traffic against the mbarrier and named-barrier semantics over random problems.
//
//   CtaSchedule      tile order (tile_scheduler.h) + mask policy (flash_hopper/mask.h) -> TileWork
//   TileWork         one tile: its key-block range, unmasked split, steps 0 .. num_steps() - 1
//   KeyStep          step i visits key block n = n_max - 1 - i (diagonal / tail blocks first)
//   produce()        the producer's walk: each tile published in the tile slot, then its loads;
//                    the next tile from the static order or claimed at run time
//   follow_loads()   the producer's load order, tile by tile from the slot (the mixed mode's
//                    converter warps, the varlen tail-zeroing warp)
//   transpose_v()    FP8's transposer warps' V order
//   consume()        the consumer warpgroups' order of waits, GEMMs, softmax and releases
//
// The producer alone decides the CTA's walk (static, or claimed at run time) and publishes each
// tile's index in the tile slot (two buffers in shared memory behind a full / empty mbarrier pair
// each, tile_slot.h; kernel.h "Pipelines") before its loads, then an index past the last tile to
// end the walk; the other roles take the indices from the slot in order (take_tile) and turn
// each into its TileWork with the same CtaSchedule. Only the index travels: a TileWork read from
// shared memory would be live in registers across the consumer's loop, where one derived from
// the index and the (constant-bank) params is recomputed instead (the consumers' registers are
// full).
//
// Load order per tile with keys (kVLag = 1 with intra-warpgroup overlap, else 0):
//   K(step 0), Q, then for i = 1 .. steps - 1 + kVLag: K(step i) if i < steps, V(step i - kVLag).
// FP8 loads V without the lag (kVLag = 0 with overlap too): its V goes through the transposer
// warps (transpose.h) before the consumers use it one step after K, so it is loaded as early as
// K to give the transposition a step of slack.
// The consumers use V one step after K with overlap (PV(i - 1) is issued with S(i)). Tiles without
// a visible key touch no pipeline but the tile slot: the consumers write them (O = 0, LSE = -inf).
//
// A consumer warpgroup's overlapped step i ([turn] / [pass]: the ping-pong barriers, when on):
//   wait K(i); [turn] issue S(i) = Q K(i)^T; [O *= scale]; wait V(i-1); issue O += P(i-1) V(i-1);
//   [pass]; wait until S(i) is done -> release K(i) (and Q after the tile's last step); softcap,
//   mask, row max, exp2, row sum of S(i) while the PV GEMM runs; wait until it is done -> release
//   V(i-1); [O *= scale]; P(i) = convert(S(i)) (only now: P's registers were that GEMM's operand).
// At a tile boundary S is the next tile's first block and the PV the finishing tile's last; the
// finishing tile's epilogue (O / l, LSE, stores) runs after that PV, under the next tile's S.
#pragma once

#include <type_traits>

#include "flash_hopper/host_device.h"
#include "flash_hopper/mask.h"
#include "sm90/fwd/tile_scheduler.h"

// The role loops run on the device only (or on the host in the test): FH_ROLE, not FH_HOST_DEVICE,
// so they may call the kernel's device-only operations.
#if defined(__CUDACC__)
#define FH_NO_UNROLL _Pragma("unroll 1")
#define FH_ROLE __forceinline__ __device__
#else
#define FH_NO_UNROLL
#define FH_ROLE inline
#endif

namespace flash_hopper::sm90 {

struct KeyStep {
  int n;        // key block
  bool masked;  // needs the element mask (crosses a window edge, the diagonal or the tail)
  bool last;    // the tile's last step: its QK GEMM is the last reader of the tile's Q
};

struct TileWork {
  TileCoord tile;
  KeyBlockRange range;
  KeyBlockSplit split;

  FH_HOST_DEVICE bool has_keys() const { return !range.empty(); }
  FH_HOST_DEVICE int num_steps() const { return range.n_max - range.n_min; }
  FH_HOST_DEVICE KeyStep step(int i) const {
    const int n = range.n_max - 1 - i;
    return {n, split.masked(n), n == range.n_min};
  }
  // Steps [unmasked_begin(), unmasked_end()) visit the unmasked key blocks [n_left, n_right),
  // one contiguous run (empty when n_left >= n_right).
  FH_HOST_DEVICE int unmasked_begin() const { return range.n_max - split.n_right; }
  FH_HOST_DEVICE int unmasked_end() const { return range.n_max - split.n_left; }
  // Step i of the unmasked run, its mask flag a constant and `last` a compare with the tile's
  // last step (last_step = num_steps() - 1, kept by the loop), so a loop over the run carries
  // only the step counter.
  FH_HOST_DEVICE KeyStep unmasked_step(int i, int last_step) const {
    return {range.n_max - 1 - i, false, i == last_step};
  }
};

// Varlen: whether V's key block n holds rows past the tile's sequence that TMA does not
// zero-fill (the packed layout's next sequence, or padding past seqused_k). P is 0 there, but
// 0 * NaN is NaN: those rows are zeroed in shared memory before the PV GEMM reads them (the
// producer and the zeroing warp both ask this, so they agree on which loads take the relay).
FH_HOST_DEVICE bool v_zero_tail(TileCoord const& t, int n, int block_n) {
  return t.seqlen_k % block_n != 0 && n == t.seqlen_k / block_n;
}

// One CTA's walk over the tile order, with the mask of each tile's sequence (the call's window on
// the tile's own lengths: varlen sequences differ, dense tiles all carry the call's). Tiles:
// StaticTileScheduler, or VarlenTileScheduler (tile_scheduler.h). The producer walks it
// (produce()); the other roles learn its tiles from the tile slot.
template <int kBlockM, int kBlockN, class Tiles = StaticTileScheduler>
struct CtaSchedule {
  static constexpr bool kVarlen = std::is_same_v<Tiles, VarlenTileScheduler>;
  Tiles const& tiles;
  AttentionMask mask;  // the call's window; its lengths are replaced by each tile's
  int cta;             // the CTA, or with K / V multicast its cluster
  // K / V multicast (kernel_traits.h kClusterM): the scheduler's tiles are groups of cluster_m
  // adjacent query blocks; the CTA of cluster rank `rank` computes block cluster_m * m + rank.
  int cluster_m = 1;
  int rank = 0;

  // Whether the walk's tiles after the first are claimed at run time (StaticTileScheduler's
  // `dynamic`): CTA c's first tile is c, every further one grid + the value the call's tile
  // counter's atomic increment returns.
  FH_HOST_DEVICE bool claims() const { return tiles.dynamic; }
  FH_HOST_DEVICE int first_tile() const { return tiles.index(0, cta); }
  // The tile index after round `round` (claim(): the counter's increment, asked for only when
  // the walk claims).
  template <class Claim>
  FH_HOST_DEVICE int next_tile(int round, Claim&& claim) const {
    if (claims()) {
      return tiles.grid + claim();
    }
    return tiles.index(round + 1, cta);
  }

  // Tile t of the order, or false past the last tile (the end of every CTA's walk).
  FH_HOST_DEVICE bool work(int t, TileWork& w) const {
    if (t >= tiles.tile_count()) {
      return false;
    }
    if constexpr (kVarlen) {  // the prepare kernel computed the tile's blocks
      w.tile = tiles.coord(t, w.range, w.split);
      return true;
    }
    w.tile = tiles.coord(t);
    w.tile.m_block = w.tile.m_block * cluster_m + rank;
    const AttentionMask m = tile_mask(w.tile);
    w.range = m.key_blocks(w.tile.m_block, kBlockM, kBlockN);
    w.split = m.unmasked_blocks(w.range, w.tile.m_block, kBlockM, kBlockN);
    return true;
  }
  FH_HOST_DEVICE AttentionMask tile_mask(TileCoord const& c) const {
    AttentionMask m = mask;
    m.seqlen_q = c.seqlen_q;
    m.seqlen_k = c.seqlen_k;
    return m;
  }
};

// The roles that read the tile slot: the next tile with keys (false at the end of the walk);
// keyless tiles on the way go to on_keyless(w). Ops: take_tile() (the producer's next index).
template <class Schedule, class Ops, class OnKeyless>
FH_ROLE bool take_tile_with_keys(Schedule const& sched, Ops& ops, TileWork& w,
                                 OnKeyless&& on_keyless) {
  FH_NO_UNROLL
  for (;;) {
    if (!sched.work(ops.take_tile(), w)) {
      return false;
    }
    if (w.has_keys()) {
      return true;
    }
    on_keyless(w);
  }
}

// One tile's loads in the producer's order (kVLag: V(step i - 1) after K(step i), else V(step i)
// right after K(step i)); after_q() runs right after Q's load, before_last_v() between the tile's
// last K load and its last V load.
template <bool kVLag, class Ops, class AfterQ, class BeforeLastV>
FH_ROLE void tile_loads(Ops& ops, TileWork const& w, AfterQ&& after_q,
                        BeforeLastV&& before_last_v) {
  auto view = ops.tile(w);
  const int steps = w.num_steps();
  ops.k(view, w.step(0));
  ops.q(view, w);
  after_q();
  if constexpr (kVLag) {
    FH_NO_UNROLL
    for (int i = 1; i < steps; ++i) {
      ops.k(view, w.step(i));
      ops.v(view, w.step(i - 1));
    }
  } else {
    FH_NO_UNROLL
    for (int i = 0; i < steps - 1; ++i) {
      if (i > 0) {
        ops.k(view, w.step(i));
      }
      ops.v(view, w.step(i));
    }
    if (steps > 1) {
      ops.k(view, w.step(steps - 1));
    }
  }
  before_last_v();
  ops.v(view, w.step(steps - 1));
}

// ---------------------------------------------------------------------------------------------
// Producer. Ops: publish(t) (waits until the slot's next buffer is free, writes tile index t,
// arrives on its full barrier); auto tile(TileWork) -> per-tile view; q(view, TileWork);
// k(view, KeyStep); v(view, KeyStep); prefetch(TileWork) (L2 warm-up of a later tile, no
// barrier); claim_issue() (the leader's atomic increment of the tile counter) and
// claim_value(issued) (its value, for the whole warp).
// Every tile of the walk, keyless ones and then the end included, is published before its loads.
// Static walks warm L2 with the next tile right after the current tile's Q. Claimed walks issue
// the next tile's claim between the tile's last K load and its last V load, so the atomic's
// round trip overlaps that load's wait for a free stage (FA3's producer claims at the same point),
// take its value after the load and warm L2 with the claimed tile then. Claimed earlier, a CTA
// commits to its next tile a tile's time sooner and the tail balances worse.
// ---------------------------------------------------------------------------------------------
template <bool kVLag, class Schedule, class Ops>
FH_ROLE void produce(Schedule const& sched, Ops& ops) {
  const bool claims = sched.claims();
  int t = sched.first_tile();
  TileWork w;
  bool more = sched.work(t, w);
  FH_NO_UNROLL
  for (int round = 0;; ++round) {
    ops.publish(t);
    if (!more) {
      return;
    }
    int issued = 0;  // the claim's raw value (the leader's)
    if (w.has_keys()) {
      tile_loads<kVLag>(
          ops, w,
          [&] {
            TileWork next;
            if (!claims && sched.work(sched.next_tile(round, [] { return 0; }), next) &&
                next.has_keys()) {
              ops.prefetch(next);
            }
          },
          [&] {
            if (claims) {
              issued = ops.claim_issue();
            }
          });
    } else if (claims) {
      issued = ops.claim_issue();
    }
    t = sched.next_tile(round, [&] { return ops.claim_value(issued); });
    TileWork next;
    more = sched.work(t, next);
    if (claims && more && next.has_keys() && w.has_keys()) {
      ops.prefetch(next);
    }
    w = next;
  }
}

// The producer's loads, tile by tile from the slot, for the roles that follow them (the mixed
// mode's converter warps, the varlen tail-zeroing warp). Ops: take_tile(), tile, q, k, v.
template <bool kVLag, class Schedule, class Ops>
FH_ROLE void follow_loads(Schedule const& sched, Ops& ops) {
  TileWork w;
  FH_NO_UNROLL
  while (take_tile_with_keys(sched, ops, w, [](TileWork const&) {})) {
    tile_loads<kVLag>(ops, w, [] {}, [] {});
  }
}

// ---------------------------------------------------------------------------------------------
// FP8's V transposer warps (transpose.h): the tiles with keys, from the slot, and their steps in
// the producer's V order (produce() without the lag). Ops: take_tile(); v(TileWork, KeyStep):
// wait V, acquire V^T, transpose, release V, commit V^T.
// ---------------------------------------------------------------------------------------------
template <class Schedule, class Ops>
FH_ROLE void transpose_v(Schedule const& sched, Ops& ops) {
  TileWork w;
  FH_NO_UNROLL
  while (take_tile_with_keys(sched, ops, w, [](TileWork const&) {})) {
    FH_NO_UNROLL
    for (int i = 0; i < w.num_steps(); ++i) {
      ops.v(w, w.step(i));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Consumers. Each consumer warpgroup walks the same steps (WG c holds query rows [64c, 64c + 64)).
// Ops (mma.h; the host test's recorder):
//   tile slot   take_tile() (the producer's next tile index; past the last tile: the end)
//   pipelines   wait_q(w) / release_q(w), wait_k(w, step) / release_k, wait_v(w, step) / release_v
//   ping-pong   turn_start(), turn_wait(), turn_pass()
//   GEMMs       issue_qk(f), issue_pv(f), issue_pv_and_wait(f), wait_gemms<kInFlight>(),
//               complete_pv(f) (the sequential loop's wait for its PV GEMM)
//   softmax     softcapped() (whether the call caps its scores), transform<kMasked, kCapped>(f,
//               w, step) (softcap, then the element mask), softmax<kFirst, kCheckInf>(f),
//               rescale_o(f), convert_p(f)
//   tiles       start_tile(f, w) (fresh statistics and w's scales, O = 0), begin_next_scales(f, w)
//               (FP8: keep the finishing tile's scales aside, load w's), begin_next_tile(f, w)
//               (keep the finishing tile's statistics aside, start w's), finish<kPrevious>(f, w) (O / l, LSE, stores),
//               clear_o(f), store_empty(w)
// f is the register state of the tile(s) in flight (Ops::TileState).
// ---------------------------------------------------------------------------------------------
// Cfg (the kernel's Traits; a plain struct in the host test) chooses the loop:
//   kOverlap            intra-warpgroup overlap: S(i) issued with PV(i - 1)
//   kMergeTileBoundary  one step stream across tiles (tile_config.h)
//   kRescaleOBeforePv   O *= scale before issuing the PV GEMM, else after it completed
//
// Softcap and the element mask are compile-time properties of a step's code (kCapped, kMasked):
// the loops branch once per step, on the step's kind, and nothing branches between a step's GEMM
// issue and its waits. (A run-time test of the softcap there let ptxas move the PV GEMM's wait
// above the softmax it should overlap.)

namespace detail {

// After the QK GEMM of `step` completed: its K buffer is free, and after the tile's last step its
// Q buffer too.
template <class Ops>
FH_ROLE void qk_done(Ops& ops, TileWork const& w, KeyStep step) {
  if (step.last) {
    ops.release_q(w);
  }
  ops.release_k(w, step);
}

// S of a tile's first block alone (always masked: it holds the sequence tail or the diagonal).
template <class Ops, class State>
FH_ROLE void first_step(Ops& ops, State& f, TileWork const& w) {
  const KeyStep step = w.step(0);
  ops.wait_q(w);
  ops.wait_k(w, step);
  ops.turn_wait();
  ops.issue_qk(f);
  ops.turn_pass();
  ops.template wait_gemms<0>();
  qk_done(ops, w, step);
  if (ops.softcapped()) {
    ops.template transform<true, true>(f, w, step);
  } else {
    ops.template transform<true, false>(f, w, step);
  }
  ops.template softmax</*kFirst=*/true, /*kCheckInf=*/true>(f);
}

// One overlapped step: S(step) of tile w issued with the PV GEMM of (pv_tile, pv_step), the
// previous step, and the softmax of S under that PV. At a tile boundary (kBoundary) `step` is the
// first step of tile w, the PV is the last of pv_tile, and pv_tile's epilogue runs once it is done.
// P is converted only after the PV completed: its registers are that GEMM's A operand.
template <bool kMasked, bool kCapped, bool kBoundary, class Cfg, class Ops, class State>
FH_ROLE void overlapped_step(Ops& ops, State& f, TileWork const& w, KeyStep step,
                                    TileWork const& pv_tile, KeyStep pv_step) {
  if constexpr (kBoundary) {
    ops.wait_q(w);
  }
  ops.wait_k(w, step);
  ops.turn_wait();
  ops.issue_qk(f);
  if constexpr (Cfg::kRescaleOBeforePv) {
    ops.rescale_o(f);
  }
  ops.wait_v(pv_tile, pv_step);
  ops.issue_pv(f);
  ops.turn_pass();
  ops.template wait_gemms<1>();  // S done, PV in flight
  qk_done(ops, w, step);
  if constexpr (kBoundary) {
    // w's scales before its S is transformed: FP8's softcap factor is w's (q_descale *
    // k_descale of its batch and kv head), not the finishing tile's.
    ops.begin_next_scales(f, w);
  }
  ops.template transform<kMasked, kCapped>(f, w, step);
  if constexpr (kBoundary) {
    ops.begin_next_tile(f, w);
    ops.template softmax<true, true>(f);
  } else {
    ops.template softmax<false, kMasked>(f);
  }
  ops.template wait_gemms<0>();
  ops.release_v(pv_tile, pv_step);
  if constexpr (kBoundary) {
    ops.template finish</*kPrevious=*/true>(f, pv_tile);
    ops.clear_o(f);
  } else if constexpr (!Cfg::kRescaleOBeforePv) {
    ops.rescale_o(f);
  }
  ops.convert_p(f);
}

// Steps i >= 1 of tile w from step i on (each with the PV GEMM of the step before it), in the
// code of their kind: a masked step alone (the call's softcap or not), or the whole unmasked run
// that starts at i in one loop whose only per-step work besides the step is its counter (the
// kind's branches and the softcap test leave the loop). Returns the next step. Plain branches,
// no lambdas: the compiler need not inline a lambda, and a GEMM in flight across a call is
// serialized.
template <class Cfg, class Ops, class State>
FH_ROLE int overlapped_steps_of_kind(Ops& ops, State& f, bool capped, TileWork const& w, int i) {
  const KeyStep step = w.step(i);
  if (step.masked) {
    if (capped) {
      overlapped_step<true, true, false, Cfg>(ops, f, w, step, w, w.step(i - 1));
    } else {
      overlapped_step<true, false, false, Cfg>(ops, f, w, step, w, w.step(i - 1));
    }
    return i + 1;
  }
  const int end = w.unmasked_end();
  const int last = w.num_steps() - 1;
  if (capped) {
    FH_NO_UNROLL
    for (; i < end; ++i) {
      overlapped_step<false, true, false, Cfg>(ops, f, w, w.unmasked_step(i, last), w,
                                               w.step(i - 1));
    }
  } else {
    FH_NO_UNROLL
    for (; i < end; ++i) {
      overlapped_step<false, false, false, Cfg>(ops, f, w, w.unmasked_step(i, last), w,
                                                w.step(i - 1));
    }
  }
  return i;
}

template <class Cfg, class Ops, class State>
FH_ROLE void overlapped_steps_after_first(Ops& ops, State& f, TileWork const& w) {
  const bool capped = ops.softcapped();
  FH_NO_UNROLL
  for (int i = 1; i < w.num_steps();) {
    i = overlapped_steps_of_kind<Cfg>(ops, f, capped, w, i);
  }
}

// A tile's last PV alone (its P is ready), then its epilogue.
template <class Cfg, class Ops, class State>
FH_ROLE void drain(Ops& ops, State& f, TileWork const& w) {
  const KeyStep last = w.step(w.num_steps() - 1);
  if constexpr (Cfg::kRescaleOBeforePv) {
    ops.rescale_o(f);
  }
  ops.wait_v(w, last);
  ops.issue_pv_and_wait(f);
  ops.release_v(w, last);
  ops.template finish<false>(f, w);
}

// Tuned kernel (d <= 192): overlapped steps in one stream across the CTA's tiles. The step that
// issues the first S of the next tile also issues the last PV of this one, and this tile's
// epilogue runs while that S is on the tensor cores: no drain-and-refill bubble between tiles.
template <class Cfg, class Schedule, class Ops>
FH_ROLE void consume_merged(Schedule const& sched, Ops& ops) {
  auto on_keyless = [&](TileWork const& w) { ops.store_empty(w); };
  typename Ops::TileState f;
  TileWork cur;
  if (!take_tile_with_keys(sched, ops, cur, on_keyless)) {
    return;
  }
  ops.start_tile(f, cur);
  first_step(ops, f, cur);
  ops.convert_p(f);
  const bool capped = ops.softcapped();
  int i = 1;  // the next step of cur
  FH_NO_UNROLL
  for (;;) {
    if (i < cur.num_steps()) {
      i = overlapped_steps_of_kind<Cfg>(ops, f, capped, cur, i);
      continue;
    }
    TileWork next;
    if (!take_tile_with_keys(sched, ops, next, on_keyless)) {
      break;
    }
    if (capped) {
      overlapped_step<true, true, true, Cfg>(ops, f, next, next.step(0), cur,
                                             cur.step(cur.num_steps() - 1));
    } else {
      overlapped_step<true, false, true, Cfg>(ops, f, next, next.step(0), cur,
                                              cur.step(cur.num_steps() - 1));
    }
    cur = next;
    i = 1;
  }
  drain<Cfg>(ops, f, cur);
}

// Tuned kernel where the merged boundary does not fit the registers (d256): the same overlapped
// steps, each tile with its own first step and drain, all state scoped to the tile.
template <class Cfg, class Schedule, class Ops>
FH_ROLE void consume_per_tile(Schedule const& sched, Ops& ops) {
  auto on_keyless = [&](TileWork const& w) { ops.store_empty(w); };
  TileWork w;
  FH_NO_UNROLL
  while (take_tile_with_keys(sched, ops, w, on_keyless)) {
    typename Ops::TileState f;
    ops.start_tile(f, w);
    first_step(ops, f, w);
    ops.convert_p(f);
    overlapped_steps_after_first<Cfg>(ops, f, w);
    drain<Cfg>(ops, f, w);
  }
}

// No intra-warpgroup overlap (the 16-bit ablation; FP8 d256, where S and the PV GEMM do not fit
// the registers together): per block S, softmax, then PV, each GEMM waited for. complete_pv waits
// for the PV GEMM (and runs the parts after the first of a PV GEMM in parts, mma.h) after the
// turn passed, so the other warpgroup's GEMMs queue behind them.
template <class Ops, class State>
FH_ROLE void sequential_pv(Ops& ops, State& f, TileWork const& w, KeyStep step) {
  ops.convert_p(f);
  ops.wait_v(w, step);
  ops.turn_wait();
  ops.issue_pv(f);
  ops.turn_pass();
  ops.complete_pv(f);
  ops.release_v(w, step);
}

template <bool kMasked, bool kCapped, class Ops, class State>
FH_ROLE void sequential_step(Ops& ops, State& f, TileWork const& w, KeyStep step) {
  ops.wait_k(w, step);
  ops.turn_wait();
  ops.issue_qk(f);
  ops.turn_pass();
  ops.template wait_gemms<0>();
  qk_done(ops, w, step);
  ops.template transform<kMasked, kCapped>(f, w, step);
  ops.template softmax<false, kMasked>(f);
  ops.rescale_o(f);
  sequential_pv(ops, f, w, step);
}

template <class Schedule, class Ops>
FH_ROLE void consume_sequential(Schedule const& sched, Ops& ops) {
  auto on_keyless = [&](TileWork const& w) { ops.store_empty(w); };
  TileWork w;
  FH_NO_UNROLL
  while (take_tile_with_keys(sched, ops, w, on_keyless)) {
    typename Ops::TileState f;
    ops.start_tile(f, w);
    first_step(ops, f, w);
    sequential_pv(ops, f, w, w.step(0));
    const bool capped = ops.softcapped();
    FH_NO_UNROLL
    for (int i = 1; i < w.num_steps();) {
      const KeyStep step = w.step(i);
      if (step.masked) {  // a masked step alone
        if (capped) {
          sequential_step<true, true>(ops, f, w, step);
        } else {
          sequential_step<true, false>(ops, f, w, step);
        }
        ++i;
        continue;
      }
      const int end = w.unmasked_end();  // the unmasked run from i, in one loop
      const int last = w.num_steps() - 1;
      if (capped) {
        FH_NO_UNROLL
        for (; i < end; ++i) {
          sequential_step<false, true>(ops, f, w, w.unmasked_step(i, last));
        }
      } else {
        FH_NO_UNROLL
        for (; i < end; ++i) {
          sequential_step<false, false>(ops, f, w, w.unmasked_step(i, last));
        }
      }
    }
    ops.template finish<false>(f, w);
  }
}

}  // namespace detail

template <class Cfg, class Schedule, class Ops>
FH_ROLE void consume(Schedule const& sched, Ops& ops) {
  ops.turn_start();
  if constexpr (Cfg::kOverlap && Cfg::kMergeTileBoundary) {
    detail::consume_merged<Cfg>(sched, ops);
  } else if constexpr (Cfg::kOverlap) {
    detail::consume_per_tile<Cfg>(sched, ops);
  } else {
    detail::consume_sequential(sched, ops);
  }
}

}  // namespace flash_hopper::sm90
