// Host test of the FA-3 path's step schedule (kernels/sm90/schedule.h) and pipeline ends
// (kernels/sm90/pipeline.h): the code the kernel's producer and consumer warpgroups run, with
// recorders in place of the TMA, WGMMA and mbarrier operations.
//
// For random problems (lengths, causal / windows / chunks, GQA, batch, grid sizes) and every
// kernel shape of tile_config.h (overlap or not, merged tile boundary or not, rescale placement,
// Q buffers, W consumer warpgroups), each CTA's producer and consumers are recorded, then
//  1. each consumer's record is checked on its own: every GEMM reads the buffers of the key block
//     it is meant for, S is complete before the softmax reads it, P is not overwritten while its
//     PV GEMM is in flight, buffers are released only after the GEMMs reading them completed,
//     every block needing the element mask gets it, and every tile's O and statistics sum exactly
//     its key blocks (each once) before its epilogue; keyless tiles are written without a barrier;
//  2. the producer and W consumers are run against each other with mbarrier semantics (phases,
//     arrival counts, transaction completion) and named-barrier semantics (ping-pong), in random
//     interleavings: every wait is eventually satisfied (no deadlock), every consumer reads the
//     payload it expects (the producer visited the same steps, nothing overwritten early), and the
//     arrivals balance (only WG 0's documented ping-pong token is left pending).
// The mixed mode's shapes (kernels/sm90/convert.h) add a relay between the two: the producer loads
// K and V into a ring of staging stages, and three converter agents (warps 1-3 of the producer
// warpgroup) walk the producer's order, each waiting for a staging stage and a free K / V stage,
// then arriving on both (the K / V full barriers count three arrivals, the ring's empty barriers
// three). The simulation runs them with the others.
// Then negative controls show the checks fail on a broken schedule. Prints "OK" on success.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "flash_hopper/mask.h"
#include "sm90/pipeline.h"
#include "sm90/schedule.h"
#include "sm90/tile_config.h"
#include "sm90/tile_scheduler.h"

using namespace flash_hopper;
using namespace flash_hopper::sm90;

static int failures = 0;
static bool quiet = false;  // negative controls: count failures without printing them
static std::string context;

#define CHECK(cond, ...)                                    \
  do {                                                      \
    if (!(cond)) {                                          \
      if (!quiet && failures < 20) {                        \
        std::printf("FAIL [%s]: ", context.c_str());        \
        std::printf(__VA_ARGS__);                           \
        std::printf("\n");                                  \
      }                                                     \
      ++failures;                                           \
    }                                                       \
  } while (0)

// ------------------------------------------------------------------------------------------------
// Events
// ------------------------------------------------------------------------------------------------
enum Pipe { kQ = 0, kK = 1, kV = 2, kStaging = 3, kNumPipes = 4 };
static const char* kPipeName[] = {"Q", "K", "V", "staging"};
static constexpr int kRelays = 3;  // the mixed mode's converter warps (kernel_traits.h)
// The mixed mode's staging ring (tile_config.h, fwd_config_mixed): one depth for every bucket.
static constexpr int kStagingStages = fwd_config_mixed(128).staging_stages;
static_assert(fwd_config_mixed(64).staging_stages == kStagingStages &&
              fwd_config_mixed(256).staging_stages == kStagingStages);

struct Payload {
  int tile = -1;  // tile index in the scheduler's order
  int n = -1;     // key block (-1 for Q)
  int pipe = 0;   // staging stages: the pipe (kK / kV) the block is for; 0 elsewhere
  bool operator==(Payload const& o) const {
    return tile == o.tile && n == o.n && pipe == o.pipe;
  }
  bool operator!=(Payload const& o) const { return !(*this == o); }
  bool operator<(Payload const& o) const {
    return tile != o.tile ? tile < o.tile : n != o.n ? n < o.n : pipe < o.pipe;
  }
};

enum Op { kWaitEmpty, kArriveFull, kWaitFull, kArriveEmpty, kTurnStart, kTurnWait, kTurnPass };

struct Event {
  Op op;
  int pipe = 0;
  int stage = 0;
  uint32_t phase = 0;
  Payload payload;
};

// Barrier backend of pipeline.h's ends that records instead of waiting.
struct Recorder {
  std::vector<Event>* out;
  int pipe;
  void wait_empty(int s, uint32_t phase) { out->push_back({kWaitEmpty, pipe, s, phase, {}}); }
  void arrive_full_tx(int s, uint32_t) { out->push_back({kArriveFull, pipe, s, 0, {}}); }
  void arrive_full(int s) { out->push_back({kArriveFull, pipe, s, 0, {}}); }
  void wait_full(int s, uint32_t phase) { out->push_back({kWaitFull, pipe, s, phase, {}}); }
  void arrive_empty(int s) { out->push_back({kArriveEmpty, pipe, s, 0, {}}); }
};

// ------------------------------------------------------------------------------------------------
// Problem and kernel shape
// ------------------------------------------------------------------------------------------------
struct Shape {
  int block_m, block_n, stages, q_stages, wgs;
  bool overlap, merge, rescale_before;
  int staging = 0;  // the mixed mode's staging ring (stages); 0: the producer loads K / V stages
};

struct Problem {
  int batch, heads, heads_per_kv, seqlen_q, seqlen_k, grid_sms;
  AttentionMask mask;
  bool pingpong;
};

static int tile_id(StaticTileScheduler const& s, TileCoord c) {
  return (c.batch * s.heads + c.head) * s.num_m_blocks + c.m_block;
}

// ------------------------------------------------------------------------------------------------
// Producer recorder
// ------------------------------------------------------------------------------------------------
template <int QS, int S>
struct MockProducer {
  using QSpec = PipelineSpec<QS, 1>;  // the consumer count does not matter on this end
  using KVSpec = PipelineSpec<S, 1>;
  StaticTileScheduler const& sched;
  std::vector<Event> ev;
  ProducerEnd<QSpec, Recorder> q_pipe{{&ev, kQ}};
  ProducerEnd<KVSpec, Recorder> k_pipe{{&ev, kK}};
  ProducerEnd<KVSpec, Recorder> v_pipe{{&ev, kV}};
  // The mixed mode: K and V blocks go into the staging ring in load order (convert.h).
  bool relay = false;
  ProducerEnd<PipelineSpec<kStagingStages, 1>, Recorder> staging_pipe{{&ev, kStaging}};
  // Sabotage for the negative controls: skip the load with this index, or load the next key
  // block instead of the scheduled one.
  int skip_load = -1;
  int wrong_block_load = -1;
  int loads = 0;

  explicit MockProducer(StaticTileScheduler const& s) : sched(s) {}

  TileWork tile(TileWork const& w) { return w; }
  template <class End>
  void load(End& end, Payload payload) {
    if (loads == skip_load) {
      ++loads;
      return;
    }
    if (loads++ == wrong_block_load) {
      ++payload.n;
    }
    end.load(/*leader=*/true, 0, [&](int) { ev.back().payload = payload; });
  }
  void q(TileWork const& view, TileWork const&) { load(q_pipe, {tile_id(sched, view.tile), -1}); }
  void k(TileWork const& view, KeyStep s) {
    if (relay) {
      load(staging_pipe, {tile_id(sched, view.tile), s.n, kK});
    } else {
      load(k_pipe, {tile_id(sched, view.tile), s.n});
    }
  }
  void v(TileWork const& view, KeyStep s) {
    if (relay) {
      load(staging_pipe, {tile_id(sched, view.tile), s.n, kV});
    } else {
      load(v_pipe, {tile_id(sched, view.tile), s.n});
    }
  }
  void prefetch(TileWork const&) {}
};

// ------------------------------------------------------------------------------------------------
// Converter recorder (the mixed mode's relay, convert.h): the producer's operations, converting
// instead of loading, with convert.h's order of waits and arrivals.
// ------------------------------------------------------------------------------------------------
template <int S>
struct MockConverter {
  using StagingSpec = PipelineSpec<kStagingStages, kRelays>;
  using KVSpec = PipelineSpec<S, 1, kRelays>;
  StaticTileScheduler const& sched;
  std::vector<Event> ev;
  ConsumerEnd<StagingSpec, Recorder> staging{{&ev, kStaging}};
  WriterEnd<KVSpec, Recorder> k_out{{&ev, kK}};
  WriterEnd<KVSpec, Recorder> v_out{{&ev, kV}};
  // Sabotage for the negative controls: convert the blocks with this index and the next in
  // swapped order.
  int swap_at = -1;
  int converts = 0;
  std::vector<std::pair<int, Payload>> pending;  // a held-back conversion (swap sabotage)

  explicit MockConverter(StaticTileScheduler const& s) : sched(s) {}

  TileWork tile(TileWork const& w) { return w; }
  void q(TileWork const&, TileWork const&) {}
  void prefetch(TileWork const&) {}
  void k(TileWork const& view, KeyStep s) { convert(kK, {tile_id(sched, view.tile), s.n}); }
  void v(TileWork const& view, KeyStep s) { convert(kV, {tile_id(sched, view.tile), s.n}); }
  void convert(int pipe, Payload payload) {
    if (converts++ == swap_at) {
      pending.push_back({pipe, payload});
      return;
    }
    record(pipe, payload);
    for (auto const& [p, pl] : pending) {
      record(p, pl);
    }
    pending.clear();
  }
  // convert.h: staging.wait(); out.acquire(); stores; staging.release(); out.commit().
  void record(int pipe, Payload payload) {
    auto& out = pipe == kK ? k_out : v_out;
    staging.wait();
    ev.back().payload = {payload.tile, payload.n, pipe};
    out.acquire();
    staging.release(/*leader=*/true);
    ev.back().payload = {payload.tile, payload.n, pipe};
    out.commit(/*leader=*/true);
    ev.back().payload = payload;
  }
};

// ------------------------------------------------------------------------------------------------
// Consumer recorder with the single-agent checks (1.)
// ------------------------------------------------------------------------------------------------
template <int QS, int S>
struct MockConsumer {
  using QSpec = PipelineSpec<QS, 1>;
  using KVSpec = PipelineSpec<S, 1>;
  struct TileState {};

  StaticTileScheduler const& sched;
  Problem const& prob;
  Shape const& shape;
  int wg;
  std::vector<Event> ev;
  ConsumerEnd<QSpec, Recorder> q_pipe{{&ev, kQ}};
  ConsumerEnd<KVSpec, Recorder> k_pipe{{&ev, kK}};
  ConsumerEnd<KVSpec, Recorder> v_pipe{{&ev, kV}};
  // Sabotage for the negative controls: skip the K release with this index.
  int skip_release_k = -1;
  int releases_k = 0;

  // Buffers this WG waited for and has not released, oldest first.
  std::vector<Payload> held[kNumPipes];
  // GEMMs in flight, oldest first: 'S' or 'P' with the key block they read.
  std::vector<std::pair<char, Payload>> in_flight;
  Payload s_block, p_block;        // what S and P hold
  bool s_ready = false, p_ready = false;
  std::set<Payload> o_blocks;      // PV blocks summed into O
  std::set<Payload> stats, finishing_stats;  // blocks in the running / set-aside statistics
  bool expect_first = false;
  int scales_of = -1;  // the tile whose scales the state holds (FP8: transform's softcap factor)
  std::vector<int> finished, emptied;  // tile ids written

  MockConsumer(StaticTileScheduler const& s, Problem const& p, Shape const& sh, int wg_)
      : sched(s), prob(p), shape(sh), wg(wg_) {}

  int id(TileWork const& w) const { return tile_id(sched, w.tile); }

  template <class End>
  void wait(End& end, int pipe, Payload payload) {
    end.wait();
    ev.back().payload = payload;
    held[pipe].push_back(payload);
  }
  template <class End>
  void release(End& end, int pipe, Payload payload) {
    CHECK(!held[pipe].empty() && held[pipe].front() == payload,
          "WG %d releases %s (tile %d, n %d) it does not hold as its oldest buffer", wg,
          kPipeName[pipe], payload.tile, payload.n);
    for (auto const& g : in_flight) {
      // S reads Q and K (its payload is the K block), PV reads V.
      const bool reads = pipe == kQ   ? g.first == 'S' && g.second.tile == payload.tile
                         : pipe == kK ? g.first == 'S' && g.second == payload
                                      : g.first == 'P' && g.second == payload;
      CHECK(!reads, "WG %d releases %s (tile %d, n %d) while a GEMM reading it is in flight", wg,
            kPipeName[pipe], payload.tile, payload.n);
    }
    if (!held[pipe].empty()) {
      held[pipe].erase(held[pipe].begin());
    }
    end.release(/*wg_leader=*/true);
    ev.back().payload = payload;
  }

  void wait_q(TileWork const& w) { wait(q_pipe, kQ, {id(w), -1}); }
  void release_q(TileWork const& w) { release(q_pipe, kQ, {id(w), -1}); }
  void wait_k(TileWork const& w, KeyStep s) { wait(k_pipe, kK, {id(w), s.n}); }
  void release_k(TileWork const& w, KeyStep s) {
    if (releases_k++ == skip_release_k) {
      held[kK].erase(held[kK].begin());
      return;
    }
    release(k_pipe, kK, {id(w), s.n});
  }
  void wait_v(TileWork const& w, KeyStep s) { wait(v_pipe, kV, {id(w), s.n}); }
  void release_v(TileWork const& w, KeyStep s) { release(v_pipe, kV, {id(w), s.n}); }

  void turn_start() {
    if (prob.pingpong && wg == 0) {
      ev.push_back({kTurnStart, 0, 0, 0, {}});
    }
  }
  void turn_wait() {
    if (prob.pingpong) {
      ev.push_back({kTurnWait, 0, wg, 0, {}});
    }
  }
  void turn_pass() {
    if (prob.pingpong) {
      ev.push_back({kTurnPass, 0, (wg + 1) % shape.wgs, 0, {}});
    }
  }

  void issue_qk(TileState&) {
    CHECK(held[kQ].size() == 1 && held[kK].size() == 1,
          "WG %d issues S holding %zu Q and %zu K buffers (expected 1 and 1)", wg,
          held[kQ].size(), held[kK].size());
    if (held[kQ].empty() || held[kK].empty()) {
      return;
    }
    CHECK(held[kQ].front().tile == held[kK].front().tile, "WG %d: S of Q tile %d with K of tile %d",
          wg, held[kQ].front().tile, held[kK].front().tile);
    for (auto const& g : in_flight) {
      CHECK(g.first != 'S', "WG %d issues S while the previous S is in flight", wg);
    }
    in_flight.push_back({'S', held[kK].front()});
    s_ready = false;
    s_block = held[kK].front();
  }
  void issue_pv(TileState&) {
    CHECK(held[kV].size() == 1, "WG %d issues PV holding %zu V buffers", wg, held[kV].size());
    CHECK(p_ready, "WG %d issues PV without a converted P", wg);
    if (held[kV].empty()) {
      return;
    }
    CHECK(held[kV].front() == p_block, "WG %d: PV of P(tile %d, n %d) with V(tile %d, n %d)", wg,
          p_block.tile, p_block.n, held[kV].front().tile, held[kV].front().n);
    for (auto const& b : o_blocks) {
      CHECK(b.tile == p_block.tile, "WG %d: O mixes tiles %d and %d", wg, b.tile, p_block.tile);
    }
    CHECK(o_blocks.insert(p_block).second, "WG %d: PV of (tile %d, n %d) summed twice", wg,
          p_block.tile, p_block.n);
    in_flight.push_back({'P', held[kV].front()});
  }
  void issue_pv_and_wait(TileState& f) {
    issue_pv(f);
    wait_gemms<0>();
  }
  void complete_pv(TileState&) {
    CHECK(gemm_in_flight('P'), "WG %d completes a PV GEMM it did not issue", wg);
    wait_gemms<0>();
  }
  template <int kInFlight>
  void wait_gemms() {
    while (int(in_flight.size()) > kInFlight) {
      if (in_flight.front().first == 'S') {
        s_ready = true;
      }
      in_flight.erase(in_flight.begin());
    }
  }
  bool gemm_in_flight(char kind) const {
    for (auto const& g : in_flight) {
      if (g.first == kind) {
        return true;
      }
    }
    return false;
  }

  template <bool kMasked>
  void transform(TileState&, TileWork const& w, KeyStep step) {
    CHECK(s_ready && !gemm_in_flight('S'), "WG %d transforms S before its GEMM completed", wg);
    CHECK((s_block == Payload{id(w), step.n}), "WG %d transforms S of (%d, %d) as (%d, %d)", wg,
          s_block.tile, s_block.n, id(w), step.n);
    CHECK(scales_of == id(w), "WG %d transforms S of tile %d with tile %d's scales", wg, id(w),
          scales_of);
    if (!kMasked) {
      // Every element of the block must be visible to every real row of the tile.
      const int r0 = w.tile.m_block * shape.block_m;
      const int r1 = std::min(r0 + shape.block_m, prob.seqlen_q);
      const int c0 = step.n * shape.block_n;
      bool all = true;
      for (int r = r0; r < r1 && all; ++r) {
        for (int c = c0; c < c0 + shape.block_n; ++c) {
          if (!prob.mask.visible(r, c)) {
            all = false;
            break;
          }
        }
      }
      CHECK(all, "WG %d: block n %d of tile m %d needs the mask but runs unmasked", wg, step.n,
            w.tile.m_block);
    }
  }
  template <bool kFirst, bool kCheckInf>
  void softmax(TileState&) {
    CHECK(kFirst == expect_first, "WG %d: softmax kFirst=%d, expected %d", wg, int(kFirst),
          int(expect_first));
    CHECK(!kFirst || kCheckInf, "WG %d: a tile's first block runs without the -inf check", wg);
    CHECK(s_ready, "WG %d: softmax of an incomplete S", wg);
    CHECK(stats.insert(s_block).second, "WG %d: block (%d, %d) in the statistics twice", wg,
          s_block.tile, s_block.n);
    for (auto const& b : stats) {
      CHECK(b.tile == s_block.tile, "WG %d: statistics mix tiles", wg);
    }
    expect_first = false;
  }
  void rescale_o(TileState&) {
    CHECK(!gemm_in_flight('P'), "WG %d rescales O while a PV GEMM accumulates into it", wg);
  }
  void convert_p(TileState&) {
    CHECK(!gemm_in_flight('P'), "WG %d overwrites P while its PV GEMM is in flight", wg);
    CHECK(s_ready, "WG %d converts an incomplete S", wg);
    p_block = s_block;
    p_ready = true;
  }

  void start_tile(TileState&, TileWork const& w) {
    CHECK(o_blocks.empty() && stats.empty(), "WG %d starts a tile with state left", wg);
    expect_first = true;
    scales_of = id(w);
  }
  void begin_next_scales(TileState&, TileWork const& w) {
    CHECK(scales_of != id(w), "WG %d loads tile %d's scales twice", wg, id(w));
    scales_of = id(w);
  }
  void begin_next_tile(TileState&, TileWork const& w) {
    CHECK(finishing_stats.empty(), "WG %d sets statistics aside twice", wg);
    CHECK(scales_of == id(w), "WG %d starts tile %d's statistics with tile %d's scales", wg,
          id(w), scales_of);
    finishing_stats.swap(stats);
    expect_first = true;
  }
  void clear_o(TileState&) {
    CHECK(o_blocks.empty(), "WG %d clears an O that was not finished", wg);
  }
  template <bool kPrevious>
  void finish(TileState&, TileWork const& w) {
    CHECK(!gemm_in_flight('P'), "WG %d finishes O with a PV in flight", wg);
    std::set<Payload> all;
    for (int n = w.range.n_min; n < w.range.n_max; ++n) {
      all.insert({id(w), n});
    }
    std::set<Payload>& st = kPrevious ? finishing_stats : stats;
    CHECK(o_blocks == all, "WG %d finishes tile %d with %zu of its %zu PV blocks", wg, id(w),
          o_blocks.size(), all.size());
    CHECK(st == all, "WG %d finishes tile %d with %zu of its %zu blocks in the statistics", wg,
          id(w), st.size(), all.size());
    o_blocks.clear();
    st.clear();
    finished.push_back(id(w));
  }
  void store_empty(TileWork const& w) {
    CHECK(!w.has_keys(), "WG %d writes tile %d as empty but it has keys", wg, id(w));
    emptied.push_back(id(w));
  }
};

// ------------------------------------------------------------------------------------------------
// Simulation of the recorded agents (2.)
// ------------------------------------------------------------------------------------------------
struct Mbarrier {
  int count = 1;
  int pending = 0;
  int completed = 0;  // completed phases
  void arrive() {
    if (++pending == count) {
      pending = 0;
      ++completed;
    }
  }
  // try_wait.parity(phase): the phase of that parity has completed.
  bool passes(uint32_t phase) const { return uint32_t(completed & 1) != phase; }
};

// relays: the mixed mode's converter agents (none otherwise), between the producer and the
// consumers through the staging ring of `staging` stages.
static bool simulate(std::vector<Event> const& producer,
                     std::vector<std::vector<Event>> const& cons, int q_stages, int stages,
                     int wgs, std::mt19937& rng,
                     std::vector<std::vector<Event>> const& relays = {}, int staging = 0) {
  const int num_stages[kNumPipes] = {q_stages, stages, stages, relays.empty() ? 0 : staging};
  std::vector<Mbarrier> full[kNumPipes], empty[kNumPipes];
  std::vector<Payload> slot[kNumPipes];
  for (int p = 0; p < kNumPipes; ++p) {
    full[p].assign(num_stages[p], Mbarrier{});
    empty[p].assign(num_stages[p], Mbarrier{});
    for (auto& b : empty[p]) {
      b.count = p == kStaging ? int(relays.size()) : wgs;
    }
    if (!relays.empty() && (p == kK || p == kV)) {
      for (auto& b : full[p]) {
        b.count = int(relays.size());
      }
    }
    slot[p].assign(num_stages[p], Payload{});
  }
  std::vector<int> turn_pending(wgs, 0);  // arrivals of the handing-over side per named barrier
  const int num_relays = int(relays.size());
  const int agents = 1 + num_relays + wgs;
  std::vector<size_t> pc(agents, 0);
  auto program = [&](int a) -> std::vector<Event> const& {
    return a == 0 ? producer : a <= num_relays ? relays[a - 1] : cons[a - 1 - num_relays];
  };
  bool ok = true;
  auto fail = [&](char const* what, int a, Event const& e) {
    CHECK(false, "%s: agent %d event %zu (op %d, %s stage %d, tile %d n %d)", what, a, pc[a],
          int(e.op), kPipeName[e.pipe], e.stage, e.payload.tile, e.payload.n);
    ok = false;
  };
  std::vector<int> order(agents);
  for (int a = 0; a < agents; ++a) {
    order[a] = a;
  }
  for (;;) {
    bool progress = false, done = true;
    std::shuffle(order.begin(), order.end(), rng);
    for (int a : order) {
      auto const& prog = program(a);
      // Run this agent a random number of events (models fast and slow roles).
      int burst = 1 + int(rng() % 4);
      while (burst-- > 0 && pc[a] < prog.size()) {
        Event const& e = prog[pc[a]];
        bool ran = true;
        switch (e.op) {
          case kWaitEmpty:
            ran = empty[e.pipe][e.stage].passes(e.phase);
            break;
          case kArriveFull:
            // Several writers of one stage (the relays) must agree on what it holds.
            if (full[e.pipe][e.stage].pending > 0 && slot[e.pipe][e.stage] != e.payload) {
              fail("writers of one stage disagree on its block", a, e);
              return false;
            }
            slot[e.pipe][e.stage] = e.payload;
            full[e.pipe][e.stage].arrive();
            break;
          case kWaitFull:
            ran = full[e.pipe][e.stage].passes(e.phase);
            if (ran && slot[e.pipe][e.stage] != e.payload) {
              fail("consumer read a buffer holding another block", a, e);
              return false;
            }
            break;
          case kArriveEmpty:
            if (slot[e.pipe][e.stage] != e.payload) {
              fail("consumer released a buffer that was overwritten", a, e);
              return false;
            }
            empty[e.pipe][e.stage].arrive();
            break;
          case kTurnStart:
            if (++turn_pending[0] > 1) {
              fail("two arrivals in one ping-pong generation", a, e);
              return false;
            }
            break;
          case kTurnWait:
            ran = turn_pending[e.stage] > 0;
            if (ran) {
              --turn_pending[e.stage];
            }
            break;
          case kTurnPass:
            if (++turn_pending[e.stage] > 1) {
              fail("two arrivals in one ping-pong generation", a, e);
              return false;
            }
            break;
        }
        if (!ran) {
          break;
        }
        ++pc[a];
        progress = true;
      }
      done = done && pc[a] == prog.size();
    }
    if (done) {
      break;
    }
    if (!progress) {
      for (int a = 0; a < agents; ++a) {
        if (pc[a] < program(a).size()) {
          fail("deadlock", a, program(a)[pc[a]]);
          break;
        }
      }
      return false;
    }
  }
  for (int p = 0; p < kNumPipes; ++p) {
    for (auto const& b : full[p]) {
      if (b.pending != 0) {
        ok = false;
      }
    }
  }
  // WG 0's first-turn token (or the last pass back to WG 0) is the only unmatched arrival.
  for (int c = 0; c < wgs; ++c) {
    const bool any_turns = !cons.empty() && std::any_of(cons[0].begin(), cons[0].end(),
                                                        [](Event const& e) {
                                                          return e.op == kTurnStart;
                                                        });
    const int expected = (c == 0 && any_turns) ? 1 : 0;
    if (turn_pending[c] != expected) {
      CHECK(false, "named barrier %d ends with %d pending arrivals, expected %d", c,
            turn_pending[c], expected);
      ok = false;
    }
  }
  if (!ok) {
    CHECK(false, "barrier arrivals do not balance");
  }
  return ok;
}

// ------------------------------------------------------------------------------------------------
// One problem on one kernel shape
// ------------------------------------------------------------------------------------------------
template <bool kO, bool kM, bool kR>
struct CfgT {
  static constexpr bool kOverlap = kO;
  static constexpr bool kMergeTileBoundary = kM;
  static constexpr bool kRescaleOBeforePv = kR;
};

// Negative controls. (The order of K loads relative to V loads is not one: K and V have separate
// pipelines, so either order is correct; it only changes when V arrives.)
struct Sabotage {
  int skip_load = -1;         // the producer forgets a load
  int wrong_block_load = -1;  // the producer loads the wrong key block
  int skip_release_k = -1;    // a consumer forgets to release a K buffer
  bool bad_split = false;     // the consumers run one masked block without the mask
  bool extra_q_stage = false;  // the producer counts one Q buffer more than the consumers
  int swap_relay = -1;         // a converter agent converts two blocks out of order (mixed)
};

// A schedule whose unmasked split claims one block too many on the right (negative control).
template <int BM, int BN>
struct BadSplitSchedule {
  CtaSchedule<BM, BN> base;
  bool work(int round, TileWork& w) const {
    if (!base.work(round, w)) {
      return false;
    }
    if (w.split.n_right < w.range.n_max) {
      ++w.split.n_right;
    }
    return true;
  }
  template <class OnKeyless>
  bool next_with_keys(int& round, TileWork& w, OnKeyless&& on_keyless) const {
    for (;; ++round) {
      if (!work(round, w)) {
        return false;
      }
      if (w.has_keys()) {
        return true;
      }
      on_keyless(w);
    }
  }
};

template <int BM, int BN, int QS, int S, class C>
static bool run_case(Problem const& prob, Shape const& shape, std::mt19937& rng, Sabotage sab) {
  const StaticTileScheduler sched = StaticTileScheduler::make(
      prob.seqlen_q, prob.seqlen_k, BM, prob.heads, prob.heads_per_kv, prob.batch,
      int64_t(prob.seqlen_k) * 128 * 4, /*longest_first=*/prob.mask.window_left >= 0 ||
                                            prob.mask.window_right >= 0 || prob.mask.chunk > 0,
      prob.grid_sms);
  std::vector<int> written(sched.total_tiles, 0);
  const int failures_before = failures;
  bool ok = true;
  for (int cta = 0; cta < sched.grid; ++cta) {
    const CtaSchedule<BM, BN> cs{sched, prob.mask, cta};
    std::vector<Event> produced;
    const bool relay = shape.staging > 0;
    if (sab.extra_q_stage) {
      MockProducer<QS + 1, S> producer(sched);
      producer.relay = relay;
      produce<C::kOverlap>(cs, producer);
      produced = std::move(producer.ev);
    } else {
      MockProducer<QS, S> producer(sched);
      producer.relay = relay;
      producer.skip_load = sab.skip_load;
      producer.wrong_block_load = sab.wrong_block_load;
      produce<C::kOverlap>(cs, producer);
      produced = std::move(producer.ev);
    }
    std::vector<std::vector<Event>> relays;
    for (int r = 0; relay && r < kRelays; ++r) {
      MockConverter<S> converter(sched);
      converter.swap_at = r == 1 ? sab.swap_relay : -1;
      produce<C::kOverlap>(cs, converter);
      relays.push_back(std::move(converter.ev));
    }
    std::vector<std::vector<Event>> cons;
    for (int wg = 0; wg < shape.wgs; ++wg) {
      MockConsumer<QS, S> consumer(sched, prob, shape, wg);
      consumer.skip_release_k = sab.skip_release_k;
      if (sab.bad_split) {
        consume<C>(BadSplitSchedule<BM, BN>{cs}, consumer);
      } else {
        consume<C>(cs, consumer);
      }
      for (int p = 0; p < kNumPipes; ++p) {
        CHECK(consumer.held[p].empty(), "WG %d ends holding %zu %s buffers", wg,
              consumer.held[p].size(), kPipeName[p]);
      }
      CHECK(consumer.in_flight.empty(), "WG %d ends with GEMMs in flight", wg);
      if (wg == 0) {
        for (int t : consumer.finished) {
          ++written[t];
        }
        for (int t : consumer.emptied) {
          ++written[t];
        }
      }
      cons.push_back(std::move(consumer.ev));
    }
    if (!simulate(produced, cons, QS + int(sab.extra_q_stage), S, shape.wgs, rng, relays,
                  shape.staging)) {
      ok = false;
    }
  }
  for (int t = 0; t < sched.total_tiles; ++t) {
    CHECK(written[t] == 1, "tile %d written %d times", t, written[t]);
  }
  return ok && failures == failures_before;
}

template <int BM, int BN, int QS, int S, class C>
static void run_shape(Shape const& shape, std::mt19937& rng, int problems) {
  for (int i = 0; i < problems; ++i) {
    Problem prob;
    const int len_kind = int(rng() % 4);
    auto len = [&](int max) {
      return len_kind == 0 ? int(rng() % 3) : len_kind == 1 ? 1 + int(rng() % 300)
                                                            : 1 + int(rng() % max);
    };
    prob.seqlen_q = len(1500);
    prob.seqlen_k = rng() % 5 == 0 ? prob.seqlen_q : len(1500);
    prob.heads_per_kv = 1 + int(rng() % 4);
    prob.heads = prob.heads_per_kv * (1 + int(rng() % 3));
    prob.batch = 1 + int(rng() % 3);
    const int grids[] = {1, 2, 3, 7, 132};
    prob.grid_sms = grids[rng() % 5];
    const int kind = int(rng() % 6);
    int wl = -1, wr = -1, chunk = 0;
    if (kind == 1) {
      wr = 0;  // causal
    } else if (kind == 2) {
      wl = int(rng() % 400);
      wr = int(rng() % 3) == 0 ? 0 : int(rng() % 400);
    } else if (kind == 3) {
      wl = int(rng() % 400);
    } else if (kind == 4) {
      wr = int(rng() % 400);
    } else if (kind == 5) {
      chunk = 1 + int(rng() % 500);
      wr = rng() % 2 ? 0 : -1;
    }
    prob.mask = AttentionMask{prob.seqlen_q, prob.seqlen_k, wl, wr, chunk};
    prob.pingpong = rng() % 4 != 0;
    if (prob.seqlen_q == 0 || prob.batch == 0) {
      continue;  // the launcher returns before the kernel
    }
    char buf[256];
    std::snprintf(buf, sizeof(buf),
                  "BM %d BN %d QS %d S %d W %d ov %d merge %d | b %d h %d g %d sq %d sk %d wl %d "
                  "wr %d chunk %d grid %d pp %d",
                  BM, BN, QS, S, shape.wgs, int(C::kOverlap), int(C::kMergeTileBoundary),
                  prob.batch, prob.heads, prob.heads_per_kv, prob.seqlen_q, prob.seqlen_k, wl, wr,
                  chunk, prob.grid_sms, int(prob.pingpong));
    context = buf;
    run_case<BM, BN, QS, S, C>(prob, shape, rng, Sabotage{});
  }
}

// The checks must be able to fail: each sabotage of a valid schedule is caught.
template <int BM, int BN, int QS, int S, class C>
static void negative_controls(Shape const& shape, std::mt19937& rng) {
  Problem prob;
  prob.batch = 1;
  prob.heads = 2;
  prob.heads_per_kv = 1;
  prob.seqlen_q = 700;
  prob.seqlen_k = 900;
  prob.grid_sms = 3;
  prob.mask = AttentionMask{700, 900, -1, 0};
  prob.pingpong = true;
  Sabotage sabotages[6];
  sabotages[0].skip_load = 5;
  sabotages[1].wrong_block_load = 4;
  sabotages[2].skip_release_k = 3;
  sabotages[3].bad_split = true;
  sabotages[4].extra_q_stage = true;
  sabotages[5].swap_relay = 4;
  for (Sabotage const& s : sabotages) {
    if (s.swap_relay >= 0 && shape.staging == 0) {
      continue;  // no relay to sabotage
    }
    const int before = failures;
    quiet = true;
    const bool ok = run_case<BM, BN, QS, S, C>(prob, shape, rng, s);
    const bool caught = !ok || failures != before;
    failures = before;
    quiet = false;
    context = "negative control";
    CHECK(caught, "sabotage %d went unnoticed", int(&s - sabotages));
  }
}

// AttentionMask::block_masked (the FA-2 path's per-block form) agrees with unmasked_blocks (the
// FA-3 path's split) on every block of every tile's range.
static void block_masked_agrees(std::mt19937& rng, int problems) {
  const int tiles[][2] = {{128, 128}, {128, 64}, {64, 64}, {192, 128}, {128, 176}, {128, 80}};
  for (int i = 0; i < problems * 20; ++i) {
    const int sq = 1 + int(rng() % 700), sk = int(rng() % 700);
    const int wl = int(rng() % 3) == 0 ? -1 : int(rng() % 300);
    const int wr = int(rng() % 3) == 0 ? -1 : int(rng() % 300);
    const int chunk = rng() % 4 == 0 ? 1 + int(rng() % 300) : 0;
    const AttentionMask mask{sq, sk, wl, wr, chunk};
    const int bm = tiles[i % 6][0], bn = tiles[i % 6][1];
    for (int m = 0; m * bm < sq; ++m) {
      const KeyBlockRange range = mask.key_blocks(m, bm, bn);
      const KeyBlockSplit split = mask.unmasked_blocks(range, m, bm, bn);
      for (int n = range.n_min; n < range.n_max; ++n) {
        CHECK(mask.block_masked(m, n, bm, bn) == split.masked(n),
              "block_masked != split (sq %d sk %d wl %d wr %d chunk %d, %dx%d, m %d n %d)", sq, sk,
              wl, wr, chunk, bm, bn, m, n);
      }
    }
  }
}

// AttentionMask::query_blocks (the backward's loop over query blocks per key block) is exactly the
// transpose of key_blocks: n in key_blocks(m) <=> m in query_blocks(n), checked against the
// brute-force set for every key block (and one past the last) of random problems, chunks and
// empty rows included; plus the per-element check that every visible (row, col) lies in a visited
// (m, n) pair.
static void query_blocks_is_transpose(std::mt19937& rng, int problems) {
  const int tiles[][2] = {{128, 128}, {64, 128}, {64, 64}, {128, 64}, {192, 128}, {128, 80}};
  for (int i = 0; i < problems * 20; ++i) {
    const int sq = int(rng() % 700), sk = int(rng() % 700);
    const int wl = int(rng() % 3) == 0 ? -1 : int(rng() % 300);
    const int wr = int(rng() % 3) == 0 ? -1 : int(rng() % 300);
    const int chunk = rng() % 4 == 0 ? 1 + int(rng() % 300) : 0;
    const AttentionMask mask{sq, sk, wl, wr, chunk};
    const int bm = tiles[i % 6][0], bn = tiles[i % 6][1];
    const int num_m = (sq + bm - 1) / bm, num_n = (sk + bn - 1) / bn;
    for (int n = 0; n <= num_n; ++n) {
      const QueryBlockRange range = mask.query_blocks(n, bm, bn);
      for (int m = 0; m < num_m; ++m) {
        const KeyBlockRange keys = mask.key_blocks(m, bm, bn);
        const bool expected = n >= keys.n_min && n < keys.n_max;
        const bool got = m >= range.m_min && m < range.m_max;
        CHECK(expected == got,
              "query_blocks(%d) = [%d, %d) but key_blocks(%d) = [%d, %d) (sq %d sk %d wl %d wr %d "
              "chunk %d, %dx%d)",
              n, range.m_min, range.m_max, m, keys.n_min, keys.n_max, sq, sk, wl, wr, chunk, bm,
              bn);
      }
    }
    for (int row = 0; row < sq; row += 1 + int(rng() % 7)) {
      for (int col = 0; col < sk; col += 1 + int(rng() % 7)) {
        if (mask.visible(row, col)) {
          const QueryBlockRange range = mask.query_blocks(col / bn, bm, bn);
          CHECK(row / bm >= range.m_min && row / bm < range.m_max,
                "visible (%d, %d) not in a visited block (sq %d sk %d wl %d wr %d chunk %d)", row,
                col, sq, sk, wl, wr, chunk);
        }
      }
    }
  }
}

int main(int argc, char** argv) {
  const int problems = argc > 1 ? std::atoi(argv[1]) : 60;
  std::mt19937 rng(12345);
  context = "mask";
  block_masked_agrees(rng, problems);
  query_blocks_is_transpose(rng, problems);
  // The shapes of tile_config.h (d64, d96 / d128 short-masked, d128, d192, d256) and the
  // no-overlap ablation.
  using Merged = CfgT<true, true, false>;
  using MergedRescaleBefore = CfgT<true, true, true>;
  using PerTile = CfgT<true, false, true>;
  using Sequential = CfgT<false, true, false>;
  run_shape<192, 128, 2, 2, Merged>({192, 128, 2, 2, 3, true, true, false}, rng, problems);
  run_shape<128, 128, 2, 2, Merged>({128, 128, 2, 2, 2, true, true, false}, rng, problems);
  run_shape<128, 176, 1, 2, Merged>({128, 176, 2, 1, 2, true, true, false}, rng, problems);
  run_shape<128, 112, 1, 2, MergedRescaleBefore>({128, 112, 2, 1, 2, true, true, true}, rng,
                                                 problems);
  run_shape<128, 80, 1, 2, PerTile>({128, 80, 2, 1, 2, true, false, true}, rng, problems);
  run_shape<128, 176, 1, 2, Sequential>({128, 176, 2, 1, 2, false, true, false}, rng, problems);
  run_shape<64, 64, 1, 1, Merged>({64, 64, 1, 1, 1, true, true, false}, rng, problems / 2);
  negative_controls<128, 176, 1, 2, Merged>({128, 176, 2, 1, 2, true, true, false}, rng);
  negative_controls<128, 80, 1, 2, PerTile>({128, 80, 2, 1, 2, true, false, true}, rng);
  negative_controls<128, 176, 1, 2, Sequential>({128, 176, 2, 1, 2, false, true, false}, rng);
  // The mixed mode (tile_config.h, fwd_config_mixed): d64 / d128 / d256 with the staging ring.
  constexpr int R = kStagingStages;
  run_shape<192, 128, 2, 2, Merged>({192, 128, 2, 2, 3, true, true, false, R}, rng, problems);
  run_shape<128, 128, 2, 2, Merged>({128, 128, 2, 2, 2, true, true, false, R}, rng, problems);
  run_shape<128, 64, 1, 2, PerTile>({128, 64, 2, 1, 2, true, false, true, R}, rng, problems);
  negative_controls<128, 128, 2, 2, Merged>({128, 128, 2, 2, 2, true, true, false, R}, rng);
  negative_controls<128, 64, 1, 2, PerTile>({128, 64, 2, 1, 2, true, false, true, R}, rng);
  if (failures == 0) {
    std::printf("OK\n");
  }
  return failures == 0 ? 0 : 1;
}
