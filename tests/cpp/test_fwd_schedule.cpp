// Host test of the FA-3 path's step schedule (kernels/sm90/fwd/schedule.h) and pipeline ends
// (kernels/sm90/common/pipeline.h): the code the kernel's producer, relay (converter /
// transposer) and consumer warps run, with recorders in place of the TMA, WGMMA and mbarrier
// operations. The spec is the pipeline contract at the top of kernels/sm90/fwd/kernel.h.
//
// For random problems (lengths, causal / windows / chunks, GQA, batch, grid sizes) and every
// forward kernel shape the tuned-config tables instantiate (fwd/tile_config.h: fwd_config per
// bucket and tile family, fwd_config_fp8, fwd_config_mixed; overlap or not, merged tile boundary
// or not, rescale placement, Q buffers, W consumer warpgroups), each CTA's roles are recorded, then
//  1. each consumer's record is checked on its own: every GEMM reads the buffers of the key block
//     it is meant for, S is complete before the softmax reads it, P is not overwritten while its
//     PV GEMM is in flight, buffers are released only after the GEMMs reading them completed,
//     every block needing the element mask gets it, and every tile's O and statistics sum exactly
//     its key blocks (each once) before its epilogue; keyless tiles are written without a barrier;
//  2. the roles are run against each other with mbarrier semantics (phases, arrival counts,
//     transaction completion) and named-barrier semantics (ping-pong), in random interleavings:
//     every wait is eventually satisfied (no deadlock), every reader reads the payload it expects
//     (the writers visited the same steps, nothing overwritten early: no stage is written while a
//     reader holds it), and the arrivals balance (only WG 0's documented ping-pong token is left
//     pending).
// Relays between the producer and the consumers (fwd/kernel.h "Pipelines"):
//  - mixed mode (fwd/convert.h): the producer loads K and V into a ring of staging stages; three
//    converter warps walk the producer's order (produce()), each waiting for a staging stage and
//    a free K / V stage, then arriving on both (K / V full: three arrivals; ring empty: three);
//  - FP8 (fwd/transpose.h): the producer loads V into the V stages; three transposer warps walk
//    transpose_v(), each waiting for V and a free V^T stage, then releasing V (V empty: three
//    arrivals) and committing V^T (V^T full: three arrivals; V^T empty: W), which the consumers
//    read in V's place.
// K / V multicast (the kMulticast tiles, cluster_m = 2): both CTAs of a cluster are simulated
// together; each producer loads its half of every K / V block into both CTAs' stages (each CTA's
// full barrier: its producer's arrival plus both halves), and each consumer warpgroup releases a
// stage on both CTAs' empty barriers (2W arrivals), so a half lands in a stage only after both
// CTAs' consumers released it.
// Then negative controls show the checks fail on a broken schedule, relay or cluster. Prints "OK"
// on success.
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
#include "sm90/common/pipeline.h"
#include "sm90/fwd/schedule.h"
#include "sm90/fwd/tile_config.h"
#include "sm90/fwd/tile_scheduler.h"

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
enum Pipe { kQ = 0, kK = 1, kV = 2, kStaging = 3, kVt = 4, kTile = 5, kNumPipes = 6 };
static const char* kPipeName[] = {"Q", "K", "V", "staging", "V^T", "tile slot"};
// The tile slot's buffers (fwd/kernel_traits.h TilePipe).
static constexpr int kTileSlots = 2;
// The mixed mode's staging ring (fwd/tile_config.h, fwd_config_mixed): one depth for every bucket.
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
  // K / V multicast: a load's arrive_full lands half `rank` of the block in every CTA of the
  // cluster; a release arrives on the empty barrier of every CTA of the cluster
  // (common/barriers.h).
  int peers = 1;
  int rank = 0;
};

// Barrier backend of common/pipeline.h's ends that records instead of waiting. peers / rank:
// Spec::kPeers of the end and the CTA's rank in its cluster.
struct Recorder {
  std::vector<Event>* out;
  int pipe;
  int peers = 1;
  int rank = 0;
  void push(Op op, int s, uint32_t phase) {
    Event e{op, pipe, s, phase, {}};
    e.peers = peers;
    e.rank = rank;
    out->push_back(e);
  }
  void wait_empty(int s, uint32_t phase) { push(kWaitEmpty, s, phase); }
  void arrive_full_tx(int s, uint32_t) { push(kArriveFull, s, 0); }
  void arrive_full(int s) { push(kArriveFull, s, 0); }
  void wait_full(int s, uint32_t phase) { push(kWaitFull, s, phase); }
  void arrive_empty(int s) { push(kArriveEmpty, s, 0); }
};

// ------------------------------------------------------------------------------------------------
// Problem and kernel shape
// ------------------------------------------------------------------------------------------------
// The tables the kernels are instantiated from (fwd/tile_config.h), one enumerator per table.
enum class Table { k16Bit, kShortMasked, kMulticast, kFp8, kFp8ShortKeys, kMixed };
constexpr FwdConfig config_of(int head_dim, Table t) {
  return t == Table::k16Bit         ? fwd_config(head_dim)
         : t == Table::kShortMasked ? fwd_config(head_dim, TileFamily::kShortMasked)
         : t == Table::kMulticast   ? fwd_config(head_dim, TileFamily::kMulticast)
         : t == Table::kFp8         ? fwd_config_fp8(head_dim)
         : t == Table::kFp8ShortKeys ? fwd_config_fp8(head_dim, TileFamily::kShortKeys)
                                    : fwd_config_mixed(head_dim);
}

// A kernel shape as fwd/kernel_traits.h derives it from its table entry (kOverlapVariant: the
// template's overlap switch, off in the 16-bit no-overlap ablation).
template <int kHeadDim_, Table kTable_, bool kOverlapVariant = true>
struct Built {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr Table kTable = kTable_;
  static constexpr FwdConfig kConfig = config_of(kHeadDim, kTable);
  static constexpr int kBlockM = kConfig.block_m;
  static constexpr int kBlockN = kConfig.block_n;
  static constexpr int kStages = kConfig.stages;
  static constexpr int kQStages = kConfig.q_stages;
  static constexpr int kWgs = kConfig.consumer_wgs;
  static constexpr int kClusterM = kConfig.cluster_m;
  static constexpr int kStaging = kConfig.staging_stages;  // the mixed mode's ring, else 0
  static constexpr bool kFp8 = kTable == Table::kFp8 || kTable == Table::kFp8ShortKeys;
  // FP8: V as loaded may have fewer stages than K and V^T (kernel_traits.h kVStages)
  static constexpr int kVStages = kFp8 && kConfig.v_stages > 0 ? kConfig.v_stages : kStages;
  static constexpr bool kOverlap = kOverlapVariant && kConfig.intra_wg_overlap;
  static constexpr bool kVLag = kOverlap && !kFp8;
  static constexpr bool kRescaleOBeforePv = kConfig.rescale_o_before_pv;
  static constexpr bool kMergeTileBoundary = kConfig.merge_tile_boundary;
  static_assert(kClusterM == 1 || (kTable == Table::kMulticast && kClusterM == 2));
  static_assert((kStaging > 0) == (kTable == Table::kMixed));
};

struct Problem {
  int batch, heads, heads_per_kv, seqlen_q, seqlen_k, grid_sms;
  AttentionMask mask;
  bool pingpong;
  bool softcap;  // every transform of the call must apply it, none of another call may
  bool claimed;  // the call has a tile counter: masked walks claim their tiles at run time
};

// Tiles are numbered by query block (not by scheduler tile: with multicast a scheduler tile is a
// pair of query blocks, one per CTA of the cluster).
template <class Cfg>
static int tile_id(StaticTileScheduler const& s, TileCoord c) {
  return (c.batch * s.heads + c.head) * (s.num_m_blocks * Cfg::kClusterM) + c.m_block;
}

// Negative controls. (The order of K loads relative to V loads is not one: K and V have separate
// pipelines, so either order is correct; it only changes when V arrives.)
struct Sabotage {
  int skip_load = -1;         // the producer forgets a load
  int wrong_block_load = -1;  // the producer loads the wrong key block
  int skip_release_k = -1;    // a consumer forgets to release a K buffer
  bool bad_split = false;     // the consumers run one masked block without the mask
  bool extra_q_stage = false;  // the producer counts one Q buffer more than the consumers
  int swap_relay = -1;         // a converter agent converts two blocks out of order (mixed)
  int skip_vt_acquire = -1;    // FP8: a transposer writes this V^T without waiting for it free
  bool vt_full_one = false;    // FP8: V^T full barriers count one transposer warp, not all
  bool peers_forgotten = false;  // multicast: the consumers release their own CTA's stage only
  bool own_half_only = false;    // multicast: a full barrier completes on its own half
  bool softcap_misread = false;  // the consumers' softcapped() answers the opposite of the call
  int drop_claim = -1;           // a claimed walk: the producer drops the claim with this index
  bool one_slot = false;         // the producer counts one tile slot buffer, the readers two
};

// What the tile slot holds: a tile index of the scheduler's order (past the last: the end).
static Payload slot_payload(int t) { return {t, -2}; }

// The tile slot's reading end for every role but the producer (schedule.h take_tile_with_keys):
// the producer's publications in order, each waited for, read and released.
struct SlotReader {
  using Spec = PipelineSpec<kTileSlots, 1>;
  std::vector<int> const* published = nullptr;
  size_t taken = 0;

  int take(ConsumerEnd<Spec, Recorder>& end, std::vector<Event>& ev) {
    CHECK(published != nullptr && taken < published->size(),
          "a role takes a tile the producer did not publish");
    if (published == nullptr || taken >= published->size()) {
      return 1 << 28;  // the end
    }
    const int t = (*published)[taken++];
    end.wait();
    ev.back().payload = slot_payload(t);
    end.release(/*leader=*/true);
    ev.back().payload = slot_payload(t);
    return t;
  }
};

// ------------------------------------------------------------------------------------------------
// Producer recorder
// ------------------------------------------------------------------------------------------------
template <class Cfg, int kQStages = Cfg::kQStages, int kSlots = kTileSlots>
struct MockProducer {
  using QSpec = PipelineSpec<kQStages, 1>;  // the consumer count does not matter on this end
  using KVSpec = PipelineSpec<Cfg::kStages, 1, 1, Cfg::kClusterM>;
  StaticTileScheduler const& sched;
  std::vector<Event> ev;
  int rank;  // in the cluster
  ProducerEnd<QSpec, Recorder> q_pipe{{&ev, kQ}};
  ProducerEnd<KVSpec, Recorder> k_pipe{{&ev, kK, Cfg::kClusterM, rank}};
  ProducerEnd<PipelineSpec<Cfg::kVStages, 1, 1, Cfg::kClusterM>, Recorder> v_pipe{
      {&ev, kV, Cfg::kClusterM, rank}};
  // The mixed mode: K and V blocks go into the staging ring in load order (fwd/convert.h).
  ProducerEnd<PipelineSpec<kStagingStages, 1>, Recorder> staging_pipe{{&ev, kStaging}};
  WriterEnd<PipelineSpec<kSlots, 1>, Recorder> slot{{&ev, kTile}};
  std::vector<int> published;
  // A claimed walk: the counter values this CTA's claims return, in order (draw_claims).
  std::vector<int> const* claims = nullptr;
  size_t claimed = 0;
  // Sabotage for the negative controls: skip the load with this index, or load the next key
  // block instead of the scheduled one; drop the claim with this index.
  int skip_load = -1;
  int wrong_block_load = -1;
  int drop_claim = -1;
  int loads = 0;

  MockProducer(StaticTileScheduler const& s, int r) : sched(s), rank(r) {}

  TileWork tile(TileWork const& w) { return w; }
  // fwd/load.h publish: acquire the slot's next buffer, write it, commit.
  void publish(int t) {
    slot.acquire();
    published.push_back(t);
    slot.commit(/*leader=*/true);
    ev.back().payload = slot_payload(t);
  }
  // fwd/load.h: the claim's atomic issued (and its value recorded) here, read in claim_value.
  bool claim_pending = false;
  int claim_issue() {
    CHECK(!claim_pending, "a claim issued while the last one was not read");
    claim_pending = true;
    if (int(claimed) == drop_claim) {
      ++claimed;
    }
    CHECK(claims != nullptr, "a static walk claims a tile");
    // Past its values the counter is past the last tile (the sabotage drops one).
    return claims != nullptr && claimed < claims->size() ? (*claims)[claimed++] : 1 << 28;
  }
  int claim_value(int issued) {
    CHECK(claim_pending, "a claim's value read without its atomic");
    claim_pending = false;
    return issued;
  }
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
  int id(TileWork const& view) const { return tile_id<Cfg>(sched, view.tile); }
  void q(TileWork const& view, TileWork const&) { load(q_pipe, {id(view), -1}); }
  void k(TileWork const& view, KeyStep s) {
    if (Cfg::kStaging > 0) {
      load(staging_pipe, {id(view), s.n, kK});
    } else {
      load(k_pipe, {kv_id(view), s.n});
    }
  }
  void v(TileWork const& view, KeyStep s) {
    if (Cfg::kStaging > 0) {
      load(staging_pipe, {id(view), s.n, kV});
    } else {
      load(v_pipe, {kv_id(view), s.n});
    }
  }
  // K / V of a multicast pair are the pair's: named by the cluster's first query block.
  int kv_id(TileWork const& view) const {
    TileCoord c = view.tile;
    c.m_block -= c.m_block % Cfg::kClusterM;
    return tile_id<Cfg>(sched, c);
  }
  void prefetch(TileWork const&) {}
};

// ------------------------------------------------------------------------------------------------
// Converter recorder (the mixed mode's relay, fwd/convert.h): the producer's operations, converting
// instead of loading, with fwd/convert.h's order of waits and arrivals.
// ------------------------------------------------------------------------------------------------
template <class Cfg>
struct MockConverter {
  using StagingSpec = PipelineSpec<kStagingStages, kConverterWarps>;
  using KVSpec = PipelineSpec<Cfg::kStages, 1, kConverterWarps>;
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
  ConsumerEnd<SlotReader::Spec, Recorder> slot{{&ev, kTile}};
  SlotReader reader;

  explicit MockConverter(StaticTileScheduler const& s) : sched(s) {}

  int take_tile() { return reader.take(slot, ev); }
  TileWork tile(TileWork const& w) { return w; }
  void q(TileWork const&, TileWork const&) {}
  void k(TileWork const& view, KeyStep s) { convert(kK, {tile_id<Cfg>(sched, view.tile), s.n}); }
  void v(TileWork const& view, KeyStep s) { convert(kV, {tile_id<Cfg>(sched, view.tile), s.n}); }
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
  // fwd/convert.h: staging.wait(); out.acquire(); stores; staging.release(); out.commit().
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
// Transposer recorder (FP8's relay, fwd/transpose.h Transposer::v): one warp's order of waits and
// arrivals per V block, walked by fwd/schedule.h's transpose_v().
// ------------------------------------------------------------------------------------------------
template <class Cfg>
struct MockTransposer {
  using VSpec = PipelineSpec<Cfg::kVStages, kTransposerWarps>;
  using VtSpec = PipelineSpec<Cfg::kStages, Cfg::kWgs, /*kFullArrivals=*/kTransposerWarps>;
  StaticTileScheduler const& sched;
  std::vector<Event> ev;
  ConsumerEnd<VSpec, Recorder> v_in{{&ev, kV}};
  WriterEnd<VtSpec, Recorder> vt_out{{&ev, kVt}};
  int skip_acquire = -1;  // sabotage: the V block with this index skips the wait for V^T
  int blocks = 0;
  ConsumerEnd<SlotReader::Spec, Recorder> slot{{&ev, kTile}};
  SlotReader reader;

  explicit MockTransposer(StaticTileScheduler const& s) : sched(s) {}

  int take_tile() { return reader.take(slot, ev); }

  // fwd/transpose.h: v_pipe.wait(); vt_pipe.acquire(); ldmatrix / stmatrix, proxy fence;
  // v_pipe.release(); vt_pipe.commit().
  void v(TileWork const& w, KeyStep s) {
    const Payload payload{tile_id<Cfg>(sched, w.tile), s.n};
    v_in.wait();
    ev.back().payload = payload;
    if (blocks++ != skip_acquire) {
      vt_out.acquire();
    }
    v_in.release(/*leader=*/true);
    ev.back().payload = payload;
    vt_out.commit(/*leader=*/true);
    ev.back().payload = payload;
  }
};

// ------------------------------------------------------------------------------------------------
// Consumer recorder with the single-agent checks (1.)
// ------------------------------------------------------------------------------------------------
template <class Cfg>
struct MockConsumer {
  using QSpec = PipelineSpec<Cfg::kQStages, 1>;
  using KVSpec = PipelineSpec<Cfg::kStages, 1>;
  struct TileState {};

  StaticTileScheduler const& sched;
  Problem const& prob;
  int wg;
  int peers;  // the CTAs whose empty barriers a K / V release arrives on (multicast: 2)
  std::vector<Event> ev;
  ConsumerEnd<QSpec, Recorder> q_pipe{{&ev, kQ}};
  ConsumerEnd<KVSpec, Recorder> k_pipe{{&ev, kK, peers}};
  // FP8: the consumers read V^T, the transposer's output, in V's place (fwd/mma.h).
  ConsumerEnd<KVSpec, Recorder> v_pipe{{&ev, Cfg::kFp8 ? kVt : kV, peers}};
  // Sabotage for the negative controls: skip the K release with this index; softcapped() lies.
  int skip_release_k = -1;
  bool softcap_misread = false;
  int releases_k = 0;
  ConsumerEnd<SlotReader::Spec, Recorder> slot{{&ev, kTile}};
  SlotReader reader;

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

  MockConsumer(StaticTileScheduler const& s, Problem const& p, int wg_, int peers_)
      : sched(s), prob(p), wg(wg_), peers(peers_) {}

  int id(TileWork const& w) const { return tile_id<Cfg>(sched, w.tile); }
  int take_tile() { return reader.take(slot, ev); }
  // K / V of a multicast pair are named by the pair's first query block (MockProducer::kv_id).
  int kv_of(int tile) const {
    return tile - tile % (sched.num_m_blocks * Cfg::kClusterM) % Cfg::kClusterM;
  }
  int kv_id(TileWork const& w) const { return kv_of(id(w)); }

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
      const bool reads = pipe == kQ   ? g.first == 'S' && g.second.tile == kv_of(payload.tile)
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
  void wait_k(TileWork const& w, KeyStep s) { wait(k_pipe, kK, {kv_id(w), s.n}); }
  void release_k(TileWork const& w, KeyStep s) {
    if (releases_k++ == skip_release_k) {
      held[kK].erase(held[kK].begin());
      return;
    }
    release(k_pipe, kK, {kv_id(w), s.n});
  }
  void wait_v(TileWork const& w, KeyStep s) { wait(v_pipe, kV, {kv_id(w), s.n}); }
  void release_v(TileWork const& w, KeyStep s) { release(v_pipe, kV, {kv_id(w), s.n}); }

  void turn_start() {
    if (prob.pingpong && wg == 0) {
      ev.push_back({kTurnStart, 0, 0, 0, {}, 1, 0});
    }
  }
  void turn_wait() {
    if (prob.pingpong) {
      ev.push_back({kTurnWait, 0, wg, 0, {}, 1, 0});
    }
  }
  void turn_pass() {
    if (prob.pingpong) {
      ev.push_back({kTurnPass, 0, (wg + 1) % Cfg::kWgs, 0, {}, 1, 0});
    }
  }

  void issue_qk(TileState&) {
    CHECK(held[kQ].size() == 1 && held[kK].size() == 1,
          "WG %d issues S holding %zu Q and %zu K buffers (expected 1 and 1)", wg,
          held[kQ].size(), held[kK].size());
    if (held[kQ].empty() || held[kK].empty()) {
      return;
    }
    CHECK(kv_of(held[kQ].front().tile) == held[kK].front().tile,
          "WG %d: S of Q tile %d with K of tile %d", wg, held[kQ].front().tile,
          held[kK].front().tile);
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

  bool softcapped() const { return prob.softcap != softcap_misread; }
  template <bool kMasked, bool kCapped>
  void transform(TileState&, TileWork const& w, KeyStep step) {
    CHECK(s_ready && !gemm_in_flight('S'), "WG %d transforms S before its GEMM completed", wg);
    CHECK(kCapped == prob.softcap, "WG %d: a step of a call with softcap %d runs the code of %d",
          wg, int(prob.softcap), int(kCapped));
    CHECK((s_block == Payload{kv_id(w), step.n}), "WG %d transforms S of (%d, %d) as (%d, %d)",
          wg, s_block.tile, s_block.n, kv_id(w), step.n);
    CHECK(scales_of == id(w), "WG %d transforms S of tile %d with tile %d's scales", wg, id(w),
          scales_of);
    if (!kMasked) {
      // Every element of the block must be visible to every real row of the tile.
      const int r0 = w.tile.m_block * Cfg::kBlockM;
      const int r1 = std::min(r0 + Cfg::kBlockM, prob.seqlen_q);
      const int c0 = step.n * Cfg::kBlockN;
      bool all = true;
      for (int r = r0; r < r1 && all; ++r) {
        for (int c = c0; c < c0 + Cfg::kBlockN; ++c) {
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
      all.insert({kv_id(w), n});
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

// Per pipe: its stages and the arrival counts of its full and empty barriers (PipelineSpec's
// kFullArrivals and kEmptyArrivals; with multicast the full barrier's count here adds one arrival
// per half that lands, standing for the transaction bytes).
struct PipeCounts {
  int stages = 0, full = 1, empty = 1;
};

struct Agent {
  int cta;          // in the cluster
  bool reader;      // holds stages between its waits on full and its releases (consumer, relay)
  std::vector<Event> prog;
};

// The agents of one CTA, or of the CTAs of one multicast cluster, run together.
static bool simulate(std::vector<Agent> const& agents, int ctas, PipeCounts const* pipes, int wgs,
                     std::mt19937& rng) {
  struct Cta {
    std::vector<Mbarrier> full[kNumPipes], empty[kNumPipes];
    std::vector<std::vector<Payload>> slot[kNumPipes];  // [stage][half]: what each half holds
    std::vector<int> holders[kNumPipes];                // [stage]: readers holding it now
    std::vector<int> turn_pending;  // arrivals of the handing-over side per named barrier
  };
  std::vector<Cta> st(ctas);
  for (Cta& c : st) {
    for (int p = 0; p < kNumPipes; ++p) {
      c.full[p].assign(pipes[p].stages, Mbarrier{pipes[p].full});
      c.empty[p].assign(pipes[p].stages, Mbarrier{pipes[p].empty});
      c.slot[p].assign(pipes[p].stages, std::vector<Payload>(ctas));
      c.holders[p].assign(pipes[p].stages, 0);
    }
    c.turn_pending.assign(wgs, 0);
  }
  std::vector<size_t> pc(agents.size(), 0);
  bool ok = true;
  auto fail = [&](char const* what, int a, Event const& e) {
    CHECK(false, "%s: agent %d (cta %d) event %zu (op %d, %s stage %d, tile %d n %d)", what, a,
          agents[a].cta, pc[a], int(e.op), kPipeName[e.pipe], e.stage, e.payload.tile,
          e.payload.n);
    ok = false;
  };
  // The halves a write lands: with multicast its own half in every CTA of the cluster, else the
  // whole stage of its own CTA.
  auto halves_hold = [&](Cta const& c, Event const& e) {
    return std::all_of(c.slot[e.pipe][e.stage].begin(), c.slot[e.pipe][e.stage].end(),
                       [&](Payload const& h) { return h == e.payload; });
  };
  std::vector<int> order(agents.size());
  for (size_t a = 0; a < agents.size(); ++a) {
    order[a] = int(a);
  }
  for (;;) {
    bool progress = false, done = true;
    std::shuffle(order.begin(), order.end(), rng);
    for (int a : order) {
      auto const& prog = agents[a].prog;
      Cta& c = st[agents[a].cta];
      // Run this agent a random number of events (models fast and slow roles).
      int burst = 1 + int(rng() % 4);
      while (burst-- > 0 && pc[a] < prog.size()) {
        Event const& e = prog[pc[a]];
        bool ran = true;
        switch (e.op) {
          case kWaitEmpty:
            ran = c.empty[e.pipe][e.stage].passes(e.phase);
            break;
          case kArriveFull: {
            const bool multicast = e.peers > 1;
            for (int q = 0; q < ctas; ++q) {
              if (!multicast && q != agents[a].cta) {
                continue;
              }
              Cta& t = st[q];
              if (t.holders[e.pipe][e.stage] > 0) {
                fail(q == agents[a].cta ? "a stage written while a reader holds it"
                                        : "a multicast load lands in a stage a peer's reader holds",
                     a, e);
                return false;
              }
              auto& halves = t.slot[e.pipe][e.stage];
              if (multicast) {
                halves[e.rank] = e.payload;
                t.full[e.pipe][e.stage].arrive();  // the half's bytes
              } else {
                // Several writers of one stage (the relays) must agree on what it holds.
                if (t.full[e.pipe][e.stage].pending > 0 && halves[0] != e.payload) {
                  fail("writers of one stage disagree on its block", a, e);
                  return false;
                }
                std::fill(halves.begin(), halves.end(), e.payload);
              }
            }
            c.full[e.pipe][e.stage].arrive();  // the writer's own arrival (arrive_expect_tx)
            break;
          }
          case kWaitFull:
            ran = c.full[e.pipe][e.stage].passes(e.phase);
            if (ran && !halves_hold(c, e)) {
              fail("a reader read a stage holding another block", a, e);
              return false;
            }
            if (ran && agents[a].reader) {
              ++c.holders[e.pipe][e.stage];
            }
            break;
          case kArriveEmpty:
            if (!halves_hold(c, e)) {
              fail("a reader released a stage that was overwritten", a, e);
              return false;
            }
            --c.holders[e.pipe][e.stage];
            // common/barriers.h: every peer's barrier, this CTA's too
            for (int q = 0; q < ctas; ++q) {
              if (e.peers > 1 || q == agents[a].cta) {
                st[q].empty[e.pipe][e.stage].arrive();
              }
            }
            break;
          case kTurnStart:
            if (++c.turn_pending[0] > 1) {
              fail("two arrivals in one ping-pong generation", a, e);
              return false;
            }
            break;
          case kTurnWait:
            ran = c.turn_pending[e.stage] > 0;
            if (ran) {
              --c.turn_pending[e.stage];
            }
            break;
          case kTurnPass:
            if (++c.turn_pending[e.stage] > 1) {
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
      for (size_t a = 0; a < agents.size(); ++a) {
        if (pc[a] < agents[a].prog.size()) {
          fail("deadlock", int(a), agents[a].prog[pc[a]]);
          break;
        }
      }
      return false;
    }
  }
  for (Cta const& c : st) {
    for (int p = 0; p < kNumPipes; ++p) {
      for (auto const& b : c.full[p]) {
        if (b.pending != 0) {
          ok = false;
        }
      }
    }
    // WG 0's first-turn token (or the last pass back to WG 0) is the only unmatched arrival.
    const bool any_turns = std::any_of(agents.begin(), agents.end(), [](Agent const& ag) {
      return std::any_of(ag.prog.begin(), ag.prog.end(),
                         [](Event const& e) { return e.op == kTurnStart; });
    });
    for (int w = 0; w < wgs; ++w) {
      const int expected = (w == 0 && any_turns) ? 1 : 0;
      if (c.turn_pending[w] != expected) {
        CHECK(false, "named barrier %d ends with %d pending arrivals, expected %d", w,
              c.turn_pending[w], expected);
        ok = false;
      }
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
// A schedule whose unmasked split claims one block too many on the right (negative control).
template <int BM, int BN>
struct BadSplitSchedule {
  CtaSchedule<BM, BN> base;
  bool work(int t, TileWork& w) const {
    if (!base.work(t, w)) {
      return false;
    }
    if (w.split.n_right < w.range.n_max) {
      ++w.split.n_right;
    }
    return true;
  }
};

// The pipes' stages and counts as fwd/kernel_traits.h sets them (QPipe, KVPipe, VPipe, VtPipe,
// StagingPipe), with the sabotages' changes.
template <class Cfg>
static void pipe_counts(PipeCounts* pipes, Sabotage const& sab) {
  constexpr int W = Cfg::kWgs, S = Cfg::kStages, C = Cfg::kClusterM;
  pipes[kQ] = {Cfg::kQStages + int(sab.extra_q_stage), 1, W};
  const int release_peers = sab.peers_forgotten ? 1 : C;
  const int kv_full = Cfg::kStaging > 0 ? kConverterWarps
                      : C > 1           ? 1 + (sab.own_half_only ? 1 : C)
                                        : 1;
  pipes[kK] = {S, kv_full, W * release_peers};
  pipes[kV] = {Cfg::kVStages, kv_full, Cfg::kFp8 ? kTransposerWarps : W * release_peers};
  pipes[kStaging] = {Cfg::kStaging, 1, kConverterWarps};
  pipes[kVt] = {Cfg::kFp8 ? S : 0, sab.vt_full_one ? 1 : kTransposerWarps, W};
  // The tile slot: the producer's one arrival; every consumer WG and relay warp reads each tile.
  const int relays = Cfg::kFp8 ? kTransposerWarps : Cfg::kStaging > 0 ? kConverterWarps : 0;
  pipes[kTile] = {kTileSlots, 1, W + relays};
}

// A claimed walk (StaticTileScheduler::dynamic): the counter values each CTA's claims return.
// The counter hands out 0, 1, 2, ... to the CTAs in a random order of claims; a CTA whose value
// puts it past the last tile (grid + value >= tiles) stops claiming. Every CTA claims once past
// the end, so tiles - grid values name tiles and grid more end the walks.
static std::vector<std::vector<int>> draw_claims(int tiles, int grid, std::mt19937& rng) {
  std::vector<std::vector<int>> claims(grid);
  std::vector<int> active(grid);
  for (int c = 0; c < grid; ++c) {
    active[c] = c;
  }
  for (int value = 0; !active.empty(); ++value) {
    const size_t pick = rng() % active.size();
    const int c = active[pick];
    claims[c].push_back(value);
    if (grid + value >= tiles) {
      active.erase(active.begin() + pick);
    }
  }
  return claims;
}

template <class Cfg>
static bool run_case(Problem const& prob, std::mt19937& rng, Sabotage sab) {
  constexpr int BM = Cfg::kBlockM, BN = Cfg::kBlockN, C = Cfg::kClusterM;
  const StaticTileScheduler sched = StaticTileScheduler::make(
      prob.seqlen_q, prob.seqlen_k, BM, prob.heads, prob.heads_per_kv, prob.batch,
      int64_t(prob.seqlen_k) * 128 * 4, /*longest_first=*/prob.mask.window_left >= 0 ||
                                            prob.mask.window_right >= 0 || prob.mask.chunk > 0,
      prob.grid_sms, C, prob.claimed);
  CHECK(!sched.dynamic || prob.claimed, "a walk claims without a tile counter");
  const std::vector<std::vector<int>> claims =
      sched.dynamic ? draw_claims(sched.total_tiles, sched.grid, rng)
                    : std::vector<std::vector<int>>();
  const int m_blocks = (prob.seqlen_q + BM - 1) / BM;
  std::vector<int> written(size_t(sched.num_hb) * sched.num_m_blocks * C, 0);
  const int failures_before = failures;
  PipeCounts pipes[kNumPipes];
  pipe_counts<Cfg>(pipes, sab);
  bool ok = true;
  for (int cluster = 0; cluster < sched.grid; ++cluster) {
    std::vector<Agent> agents;
    for (int rank = 0; rank < C; ++rank) {
      const CtaSchedule<BM, BN> cs{sched, prob.mask, cluster, C, rank};
      std::vector<int> published;
      auto run_producer = [&](auto& producer) {
        producer.skip_load = sab.skip_load;
        producer.wrong_block_load = sab.wrong_block_load;
        producer.drop_claim = sab.drop_claim;
        producer.claims = sched.dynamic ? &claims[cluster] : nullptr;
        produce<Cfg::kVLag>(cs, producer);
        CHECK(!sched.dynamic || sab.drop_claim >= 0 || producer.claimed == claims[cluster].size(),
              "CTA %d made %zu claims, the counter gave it %zu", cluster, producer.claimed,
              claims[cluster].size());
        published = producer.published;
        agents.push_back({rank, false, std::move(producer.ev)});
      };
      if (sab.extra_q_stage) {
        MockProducer<Cfg, Cfg::kQStages + 1> producer(sched, rank);
        run_producer(producer);
      } else if (sab.one_slot) {
        MockProducer<Cfg, Cfg::kQStages, 1> producer(sched, rank);
        run_producer(producer);
      } else {
        MockProducer<Cfg> producer(sched, rank);
        run_producer(producer);
      }
      for (int r = 0; Cfg::kStaging > 0 && r < kConverterWarps; ++r) {
        MockConverter<Cfg> converter(sched);
        converter.swap_at = r == 1 ? sab.swap_relay : -1;
        converter.reader.published = &published;
        follow_loads<Cfg::kVLag>(cs, converter);
        agents.push_back({rank, true, std::move(converter.ev)});
      }
      for (int r = 0; Cfg::kFp8 && r < kTransposerWarps; ++r) {
        MockTransposer<Cfg> transposer(sched);
        transposer.skip_acquire = r == 1 ? sab.skip_vt_acquire : -1;
        transposer.reader.published = &published;
        transpose_v(cs, transposer);
        agents.push_back({rank, true, std::move(transposer.ev)});
      }
      for (int wg = 0; wg < Cfg::kWgs; ++wg) {
        MockConsumer<Cfg> consumer(sched, prob, wg, sab.peers_forgotten ? 1 : C);
        consumer.skip_release_k = sab.skip_release_k;
        consumer.softcap_misread = sab.softcap_misread;
        consumer.reader.published = &published;
        if (sab.bad_split) {
          consume<Cfg>(BadSplitSchedule<BM, BN>{cs}, consumer);
        } else {
          consume<Cfg>(cs, consumer);
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
        agents.push_back({rank, true, std::move(consumer.ev)});
      }
    }
    if (!simulate(agents, C, pipes, Cfg::kWgs, rng)) {
      ok = false;
    }
  }
  // Every query block once (a multicast pair past the last block runs too, storing nothing).
  for (size_t t = 0; t < written.size(); ++t) {
    const int m = int(t % (sched.num_m_blocks * C));
    CHECK(written[t] == (m < m_blocks ? 1 : written[t]) && written[t] <= 1,
          "tile %zu written %d times", t, written[t]);
  }
  return ok && failures == failures_before;
}

template <class Cfg>
static std::string shape_name() {
  static const char* kTableName[] = {"16-bit", "short-masked", "multicast", "FP8",
                                     "FP8 short-keys", "mixed"};
  char buf[160];
  std::snprintf(buf, sizeof(buf), "d%d %s: BM %d BN %d QS %d S %d W %d cluster %d ov %d merge %d",
                Cfg::kHeadDim, kTableName[int(Cfg::kTable)], Cfg::kBlockM, Cfg::kBlockN,
                Cfg::kQStages, Cfg::kStages, Cfg::kWgs, Cfg::kClusterM, int(Cfg::kOverlap),
                int(Cfg::kMergeTileBoundary));
  return buf;
}

template <class Cfg>
static void run_shape(std::mt19937& rng, int problems) {
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
    // The multicast tile runs calls without a mask only (fwd/launch.h).
    const int kind = Cfg::kClusterM > 1 ? 0 : int(rng() % 6);
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
    prob.softcap = rng() % 2 != 0;
    prob.claimed = rng() % 2 != 0;
    if (prob.seqlen_q == 0 || prob.batch == 0) {
      continue;  // the launcher returns before the kernel
    }
    char buf[256];
    std::snprintf(buf, sizeof(buf),
                  " | b %d h %d g %d sq %d sk %d wl %d wr %d chunk %d grid %d pp %d cap %d "
                  "claimed %d",
                  prob.batch, prob.heads, prob.heads_per_kv, prob.seqlen_q, prob.seqlen_k, wl, wr,
                  chunk, prob.grid_sms, int(prob.pingpong), int(prob.softcap),
                  int(prob.claimed));
    context = shape_name<Cfg>() + buf;
    run_case<Cfg>(prob, rng, Sabotage{});
  }
}

// Runs one sabotaged case with failures silenced; true if it reported a failure. Sabotages that
// show in some interleavings only get `attempts` runs.
template <class Cfg>
static bool caught(Problem const& prob, std::mt19937& rng, Sabotage const& s, int attempts = 1) {
  for (int attempt = 0; attempt < attempts; ++attempt) {
    const int before = failures;
    quiet = true;
    const bool ok = run_case<Cfg>(prob, rng, s);
    const bool any = !ok || failures != before;
    failures = before;
    quiet = false;
    if (any) {
      return true;
    }
  }
  return false;
}

// The checks must be able to fail: each sabotage of a valid schedule is caught.
template <class Cfg>
static void negative_controls(std::mt19937& rng) {
  Problem prob;
  prob.batch = 1;
  prob.heads = 2;
  prob.heads_per_kv = 1;
  prob.seqlen_q = 700;
  prob.seqlen_k = 900;
  prob.grid_sms = 3;
  prob.mask = AttentionMask{700, 900, -1, Cfg::kClusterM > 1 ? -1 : 0};
  prob.pingpong = true;
  prob.softcap = false;
  prob.claimed = Cfg::kClusterM == 1;  // the causal problem's tiles are claimed
  context = "negative control, " + shape_name<Cfg>();
  CHECK(!caught<Cfg>(prob, rng, {}), "the unsabotaged control fails");
  Sabotage sabotages[6];
  sabotages[0].skip_load = 5;
  sabotages[1].wrong_block_load = 4;
  sabotages[2].skip_release_k = 3;
  sabotages[3].bad_split = Cfg::kClusterM == 1;  // unmasked calls have no split to break
  sabotages[4].extra_q_stage = true;
  sabotages[5].softcap_misread = true;
  for (Sabotage const& s : sabotages) {
    if (&s == &sabotages[3] && !s.bad_split) {
      continue;
    }
    CHECK(caught<Cfg>(prob, rng, s), "sabotage %d went unnoticed", int(&s - sabotages));
  }
  // The tile slot and the claims: a producer that writes the slot's one buffer while the readers
  // expect two; a dropped claim (its tile computed by no CTA).
  Sabotage one_slot;
  one_slot.one_slot = true;
  CHECK(caught<Cfg>(prob, rng, one_slot), "a one-buffer tile slot went unnoticed");
  if (Cfg::kClusterM == 1) {
    Sabotage drop;
    drop.drop_claim = 1;
    CHECK(caught<Cfg>(prob, rng, drop), "a dropped claim went unnoticed");
  }
  if constexpr (Cfg::kStaging > 0) {
    Sabotage swap;
    swap.swap_relay = 4;
    CHECK(caught<Cfg>(prob, rng, swap), "a converter's swapped blocks went unnoticed");
  }
  if constexpr (Cfg::kFp8) {
    // The transposer relay: a warp writing V^T before the consumers released it, and V^T
    // published after one warp's part of the block.
    Sabotage early;
    early.skip_vt_acquire = 3;
    CHECK(caught<Cfg>(prob, rng, early, 20), "a V^T stage written while read went unnoticed");
    Sabotage one;
    one.vt_full_one = true;
    CHECK(caught<Cfg>(prob, rng, one, 20), "V^T published by one transposer warp went unnoticed");
  }
  if constexpr (Cfg::kClusterM > 1) {
    // The multicast peers: a stage refilled once this CTA's consumers released it, while the
    // peer's still read it; a full barrier that does not wait for the peer's half.
    Sabotage own;
    own.peers_forgotten = true;
    CHECK(caught<Cfg>(prob, rng, own, 20),
          "empty barriers without the peer's releases went unnoticed");
    Sabotage half;
    half.own_half_only = true;
    CHECK(caught<Cfg>(prob, rng, half, 20),
          "a full barrier completing on its own half went unnoticed");
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
  // Every forward kernel the tables instantiate: the 16-bit tiles per bucket, the short-masked
  // tiles where they differ, the multicast tiles (where the table has one; built on request,
  // fwd/tile_config.h kMulticastBuilt), FP8 (and its short-keys tile at d64) and the mixed mode;
  // and the 16-bit no-overlap ablation.
  static_assert(has_short_masked_tile(64) && has_short_masked_tile(128) &&
                !has_short_masked_tile(96) && !has_short_masked_tile(192) &&
                !has_short_masked_tile(256));
  static_assert(has_fp8_short_keys_tile(64) == !kFp8SequentialBuilt &&
                !has_fp8_short_keys_tile(96) &&
                !has_fp8_short_keys_tile(128) && !has_fp8_short_keys_tile(192) &&
                !has_fp8_short_keys_tile(256));
  static_assert(fwd_config(128, TileFamily::kMulticast).cluster_m == 2 &&
                fwd_config(256, TileFamily::kMulticast).cluster_m == 2 &&
                fwd_config(64, TileFamily::kMulticast).cluster_m == 1);
  run_shape<Built<64, Table::k16Bit>>(rng, problems);
  run_shape<Built<96, Table::k16Bit>>(rng, problems);
  run_shape<Built<128, Table::k16Bit>>(rng, problems);
  run_shape<Built<192, Table::k16Bit>>(rng, problems);
  run_shape<Built<256, Table::k16Bit>>(rng, problems);
  run_shape<Built<64, Table::kShortMasked>>(rng, problems / 2);
  run_shape<Built<128, Table::kShortMasked>>(rng, problems / 2);
  run_shape<Built<128, Table::kMulticast>>(rng, problems / 2);
  run_shape<Built<256, Table::kMulticast>>(rng, problems / 2);
  run_shape<Built<128, Table::k16Bit, /*kOverlapVariant=*/false>>(rng, problems / 2);
  static_assert(has_fp8_config(64) && has_fp8_config(96) && has_fp8_config(128) &&
                has_fp8_config(192) && has_fp8_config(256));
  run_shape<Built<64, Table::kFp8>>(rng, problems / 2);
  run_shape<Built<64, Table::kFp8ShortKeys>>(rng, problems / 2);
  run_shape<Built<96, Table::kFp8>>(rng, problems / 2);
  run_shape<Built<128, Table::kFp8>>(rng, problems / 2);
  run_shape<Built<192, Table::kFp8>>(rng, problems / 2);
  run_shape<Built<256, Table::kFp8>>(rng, problems / 2);
  static_assert(has_mixed_config(64) && has_mixed_config(128) && has_mixed_config(256));
  run_shape<Built<64, Table::kMixed>>(rng, problems / 2);
  run_shape<Built<128, Table::kMixed>>(rng, problems / 2);
  run_shape<Built<256, Table::kMixed>>(rng, problems / 2);
  // Negative controls on each loop structure and on every relay and the cluster.
  negative_controls<Built<128, Table::k16Bit>>(rng);                 // merged boundary
  negative_controls<Built<256, Table::k16Bit>>(rng);                 // per tile
  negative_controls<Built<128, Table::k16Bit, false>>(rng);          // sequential
  negative_controls<Built<128, Table::kMixed>>(rng);                 // converter relay
  negative_controls<Built<256, Table::kMixed>>(rng);
  negative_controls<Built<128, Table::kFp8>>(rng);                   // transposer relay
  negative_controls<Built<256, Table::kFp8>>(rng);                   // ... without overlap
  negative_controls<Built<128, Table::kMulticast>>(rng);             // multicast peers
  if (failures == 0) {
    std::printf("OK\n");
  }
  return failures == 0 ? 0 : 1;
}
