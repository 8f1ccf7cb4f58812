// Producer of the FA-3 path: one elected thread of warp 0 issues every TMA load, in the order
// schedule.h's produce() walks (K of the first step, Q, then K and V per step). Each load first
// waits until its buffer is empty (common/pipeline.h). Mixed mode: K and V blocks go into the FP8
// staging ring, one stage each in this order, for the converter warps (convert.h).
#pragma once

#include <cute/tensor.hpp>

#include "sm90/common/barriers.h"
#include "sm90/fwd/kernel_traits.h"  // EmptyStorage
#include "sm90/fwd/params.h"
#include "sm90/fwd/schedule.h"
#include "sm90/fwd/tile_slot.h"

namespace flash_hopper::sm90 {

using namespace cute;

template <class Traits>
struct Producer {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  using SharedStorage = typename Traits::SharedStorage;

  KernelParams<Traits> const& params;
  FwdParams const& p;
  SharedStorage& smem;
  bool leader;
  TileCoord tile_{};  // the tile whose loads are being issued
  ProducerEnd<typename Traits::QPipe, SmemBarriers<typename Traits::QPipe>> q_pipe;
  ProducerEnd<typename Traits::KVPipe, SmemBarriers<typename Traits::KVPipe>> k_pipe;
  ProducerEnd<typename Traits::VPipe, SmemBarriers<typename Traits::VPipe>> v_pipe;
  using StagingPipe = typename Traits::StagingPipe;
  using StagingEnd = ProducerEnd<StagingPipe, SmemBarriers<StagingPipe>>;
  conditional_t<Traits::kMixed, StagingEnd, EmptyStorage> staging_pipe;
  TileSlotWriter<Traits> slot;

  static CUTE_DEVICE auto staging_end(SharedStorage& smem) {
    if constexpr (Traits::kMixed) {
      return StagingEnd{{smem.staging.full, smem.staging.empty}};
    } else {
      return EmptyStorage{};
    }
  }

  CUTE_DEVICE Producer(KernelParams<Traits> const& params_, SharedStorage& smem_)
      : params(params_),
        p(params_.fwd),
        smem(smem_),
        leader(cute::elect_one_sync()),
        q_pipe{{smem_.q_full, smem_.q_empty}},
        k_pipe{{smem_.k_full, smem_.k_empty}},
        v_pipe{{smem_.v_full, smem_.v_empty}},
        staging_pipe(staging_end(smem_)) {}

  // The tile slot (tile_slot.h): the walk's next tile, or its end, for the other roles.
  CUTE_DEVICE void publish(int tile) { slot.publish(smem, tile, leader); }
  // A claimed walk: the leader's atomic increment of the call's tile counter, issued here, its
  // value read by the warp only in claim_value (the load's latency runs until then).
  CUTE_DEVICE int claim_issue() const { return leader ? atomicAdd(p.tile_counter, 1) : 0; }
  CUTE_DEVICE int claim_value(int issued) const {
    return __shfl_sync(0xffffffffu, issued, __ffs(__ballot_sync(0xffffffffu, leader)) - 1);
  }

  CUTE_DEVICE auto sQ() const {  // (M, D, QPIPE)
    return make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQStages{});
  }
  // Where K / V blocks land: their stages, or (mixed mode) the staging ring, both (N, D, PIPE).
  CUTE_DEVICE auto sK() const {
    if constexpr (Traits::kMixed) {
      return make_tensor(make_smem_ptr(smem.staging.kv.data()),
                         typename Traits::SmemLayoutStaging{});
    } else {
      return make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    }
  }
  CUTE_DEVICE auto sV() const {
    if constexpr (Traits::kMixed) {
      return sK();
    } else {
      return make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
    }
  }
  // The TMA's view of Q / K / V: (seqlen, head_dim, heads, batch) coordinates.
  CUTE_DEVICE auto mQ() const {
    return params.tma_q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.heads_q, p.batch));
  }
  CUTE_DEVICE int seqlen_k_tma() const { return p.seqlen_k > 0 ? p.seqlen_k : 1; }
  CUTE_DEVICE auto mK() const {
    return params.tma_k.get_tma_tensor(
        make_shape(seqlen_k_tma(), p.head_dim, p.heads_kv, p.batch));
  }
  CUTE_DEVICE auto mV() const {
    return params.tma_v.get_tma_tensor(
        make_shape(seqlen_k_tma(), head_dim_v<Traits>(p), p.heads_kv, p.batch));
  }
  // Varlen descriptors span the packed tokens with one batch entry: a sequence is its row offset.
  CUTE_DEVICE int tma_batch(TileWork const& w) const { return Traits::kVarlen ? 0 : w.tile.batch; }
  CUTE_DEVICE auto gQ(TileWork const& w) const {  // (M, D)
    return local_tile(domain_offset(make_coord(w.tile.q_start, _0{}),
                                    mQ()(_, _, w.tile.head, tma_batch(w))),
                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(w.tile.m_block, _0{}));
  }
  // K's blocks (N, D, n), or with kCols = kHeadDimV V's (N, Dv, n).
  template <int kCols = kHeadDim, class TensorM>
  CUTE_DEVICE auto g_kv(TensorM const& m, TileWork const& w) const {
    return local_tile(domain_offset(make_coord(w.tile.k_start, _0{}),
                                    m(_, _, w.tile.head / p.heads_per_kv, tma_batch(w))),
                      Shape<Int<kBlockN>, Int<kCols>>{}, make_coord(_, _0{}));
  }

  // K / V multicast (Traits::kClusterM > 1): this CTA's part of each K / V block, loaded into
  // every CTA of the cluster (kMcastMask); its rank in the cluster picks the part.
  static constexpr int kClusterM = Traits::kClusterM;
  static constexpr uint16_t kMcastMask = kClusterM > 1 ? (1u << kClusterM) - 1 : 0;
  static CUTE_DEVICE int cluster_rank() {
    if constexpr (kClusterM > 1) {
      return int(cute::block_rank_in_cluster());
    } else {
      return 0;
    }
  }

  // The TMA partitions of one tile: (tQgQ, tQsQ, tKgK, tKsK, tVgV, tVsV).
  CUTE_DEVICE auto tile(TileWork const& w) {
    tile_ = w.tile;
    auto q = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ()),
                           group_modes<0, 2>(gQ(w)));  // (TMA), (TMA, QPIPE)
    const int rank = cluster_rank();
    auto k = tma_partition(params.tma_k, rank, Layout<Int<kClusterM>>{}, group_modes<0, 2>(sK()),
                           group_modes<0, 2>(g_kv(mK(), w)));  // (TMA, n), (TMA, PIPE)
    auto v = tma_partition(params.tma_v, rank, Layout<Int<kClusterM>>{}, group_modes<0, 2>(sV()),
                           group_modes<0, 2>(g_kv<kHeadDimV>(mV(), w)));  // (TMA, n), (TMA, PIPE)
    return cute::make_tuple(get<0>(q), get<1>(q), get<0>(k), get<1>(k), get<0>(v), get<1>(v));
  }

  template <class View>
  CUTE_DEVICE void q(View const& view, TileWork const&) {
    q_pipe.load(leader, Traits::kQBytes, [&](int stage) {
      copy(params.tma_q.with(q_pipe.bar.tma_barrier(stage), 0, TMA::CacheHintSm90::EVICT_FIRST),
           get<0>(view), get<1>(view)(_, stage));
    });
  }
  template <class View>
  CUTE_DEVICE void k(View const& view, KeyStep step) {
    load_kv(k_end(), params.tma_k, Traits::kKVBytes, get<2>(view)(_, step.n), get<3>(view));
  }
  template <class View>
  CUTE_DEVICE void v(View const& view, KeyStep step) {
    if constexpr (Traits::kVarlen && !Traits::kFp8) {  // FP8: the transposer zeroes (transpose.h)
      if (v_zero_tail(tile_, step.n, kBlockN)) {
        // The sequence's tail block: the TMA lands on v_landed; the zeroing warp (vtail.h)
        // clears the rows past the sequence and arrives on v_full in its place.
        const int s = v_pipe.state.index;
        v_pipe.bar.wait_empty(s, v_pipe.state.phase);
        if (leader) {
          smem.v_landed[s].arrive_and_expect_tx(Traits::kVBytes);
          copy(params.tma_v.with(reinterpret_cast<uint64_t&>(smem.v_landed[s]), 0,
                                 TMA::CacheHintSm90::EVICT_LAST),
               get<4>(view)(_, step.n), get<5>(view)(_, s));
        }
        v_pipe.state.advance();
        return;
      }
    }
    load_kv(v_end(), params.tma_v, Traits::kVBytes, get<4>(view)(_, step.n), get<5>(view));
  }
  CUTE_DEVICE auto& k_end() {
    if constexpr (Traits::kMixed) {
      return staging_pipe;
    } else {
      return k_pipe;
    }
  }
  CUTE_DEVICE auto& v_end() {
    if constexpr (Traits::kMixed) {
      return staging_pipe;
    } else {
      return v_pipe;
    }
  }
  template <class End, class Tma, class TensorG, class TensorS>
  CUTE_DEVICE void load_kv(End& end, Tma const& tma, uint32_t bytes, TensorG const& g,
                          TensorS const& s) {
    const uint16_t mcast_mask = kMcastMask;  // by value: .with() takes it by reference
    end.load(leader, bytes, [&](int stage) {  // all parts land on each full barrier
      copy(tma.with(end.bar.tma_barrier(stage), mcast_mask, TMA::CacheHintSm90::EVICT_LAST), g,
           s(_, stage));
    });
  }

  // Warms L2 with a later tile's Q and first K / V blocks while the current tile computes. Q is
  // read by one tile only, so its TMA load would otherwise always wait on DRAM, and that wait sits
  // between two tiles (the load may start only once the previous tile's last QK GEMM finished).
  CUTE_DEVICE void prefetch(TileWork const& w) const {
    if (!leader) {
      return;
    }
    const int n = w.range.n_max - 1;
    prefetch_tile<1>(params.tma_q, sQ()(_, _, 0), gQ(w), 0);
    prefetch_tile<kClusterM>(params.tma_k, sK()(_, _, 0), g_kv(mK(), w)(_, _, n), cluster_rank());
    prefetch_tile<kClusterM>(params.tma_v, sV()(_, _, 0), g_kv<kHeadDimV>(mV(), w)(_, _, n),
                             cluster_rank());
  }
  // kParts > 1: this CTA's part of a multicast operand (each CTA of the cluster warms its own).
  template <int kParts, class Tma, class TensorS, class TensorG>
  static CUTE_DEVICE void prefetch_tile(Tma const& tma, TensorS const& s, TensorG const& g,
                                        int rank) {
    cute::prefetch(tma, get<0>(tma_partition(tma, rank, Layout<Int<kParts>>{},
                                             group_modes<0, 2>(s), group_modes<0, 2>(g))));
  }
};

template <class Traits>
CUTE_DEVICE void producer_loop(KernelParams<Traits> const& params,
                               typename Traits::SharedStorage& smem) {
  Producer<Traits> producer(params, smem);
  produce<Traits::kVLag>(cta_schedule(params), producer);
}

}  // namespace flash_hopper::sm90
