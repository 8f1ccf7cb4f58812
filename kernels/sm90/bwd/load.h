// Producer of the FA-3 path's backward: one elected thread of warp 0 issues every TMA load, in the
// order schedule.h's produce_bwd() walks: per tile Q(step 0), dO(step 0), the tile into the tile
// slot (the consumers read it from shared memory), K + V, then Q and dO of every further step,
// then the next tile's claim (dynamic order). Each load first waits until its buffer is empty
// (common/pipeline.h). A step's Q rows come with their lse_log2 and its dO rows with their D, each
// pair on its stage's full barrier (a second TMA box of kBlockM floats from the workspace).
#pragma once

#include <cute/tensor.hpp>

#include "flash_hopper/bwd_params.h"
#include "sm90/bwd/schedule.h"
#include "sm90/common/barriers.h"

namespace flash_hopper::sm90 {

using namespace cute;

// Kernel parameters, passed by value as a __grid_constant__: the derived BwdParams, the TMA
// descriptors (encoded on the host, launch.h) and the tile scheduler.
template <class Traits>
struct BwdKernelParams {
  BwdParams bwd;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaQ tma_do;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
  typename Traits::TmaStats tma_lse;
  typename Traits::TmaStats tma_dpsum;
  BwdTileScheduler tiles;
};

template <class Traits>
CUTE_DEVICE BwdCtaSchedule<Traits::kBlockM, Traits::kBlockN, Traits::kDeterministic>
bwd_cta_schedule(
    BwdKernelParams<Traits> const& params) {
  return {params.tiles, attention_mask(params.bwd), int(blockIdx.x), bwd_spans(params.bwd)};
}

template <class Traits>
struct BwdProducer {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  using SharedStorage = typename Traits::SharedStorage;
  using QPipe = typename Traits::QPipe;
  using KVPipe = typename Traits::KVPipe;

  BwdKernelParams<Traits> const& params;
  BwdParams const& p;
  SharedStorage& smem;
  bool leader;
  ProducerEnd<QPipe, SmemBarriers<QPipe>> q_pipe;
  ProducerEnd<QPipe, SmemBarriers<QPipe>> do_pipe;
  ProducerEnd<KVPipe, SmemBarriers<KVPipe>> kv_pipe;
  int tiles_published = 0;  // the tile slot's buffer of the next tile: tiles_published % 2

  CUTE_DEVICE BwdProducer(BwdKernelParams<Traits> const& params_, SharedStorage& smem_)
      : params(params_),
        p(params_.bwd),
        smem(smem_),
        leader(cute::elect_one_sync()),
        q_pipe{{smem_.q_full, smem_.q_empty}},
        do_pipe{{smem_.do_full, smem_.do_empty}},
        kv_pipe{{smem_.kv_full, smem_.kv_empty}} {}

  CUTE_DEVICE int k_rows_tma() const { return p.k_rows() > 0 ? p.k_rows() : 1; }

  // One query block (M, D) of Q or dO through `tma` into stage `stage` of `buf`: rows from the
  // sequence's first (varlen: the packed rows past the sequence belong to the next one; their
  // lse_log2 = +inf keeps their P at 0).
  template <class Tma>
  CUTE_DEVICE void load_rows(Tma const& tma, uint64_t& bar, typename Traits::Element* buf,
                             int stage, int head, BwdSpan const& span, int m) const {
    Tensor s = make_tensor(make_smem_ptr(buf), typename Traits::SmemLayoutQStages{});
    Tensor mX =
        tma.get_tma_tensor(make_shape(p.q_rows(), p.head_dim, p.heads_q, p.batch_entries()));
    Tensor gX = local_tile(domain_offset(make_coord(span.q_start, _0{}), mX(_, _, head, span.batch)),
                           Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m, _0{}));
    auto part = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s(_, _, stage)),
                              group_modes<0, 2>(gX));
    copy(tma.with(bar, 0, TMA::CacheHintSm90::EVICT_LAST), get<0>(part), get<1>(part));
  }
  // The same rows' lse_log2 or D (kBlockM floats) through `tma` into stage `stage` of `buf`.
  // The sequence's workspace rows start at a multiple of kBwdRowPad (bwd_ws_row0), so of kBlockM
  // (the unmasked tile's 80-row blocks: dense calls only, whose rows start at 0).
  CUTE_DEVICE void load_stats(typename Traits::TmaStats const& tma, uint64_t& bar, float* buf,
                              int stage, int head, BwdSpan const& span, int m) const {
    Tensor s = make_tensor(make_smem_ptr(buf + stage * Traits::kStatsStage),
                           typename Traits::SmemLayoutStats{});
    Tensor mX = tma.get_tma_tensor(make_shape(p.seqlen_q_rounded, p.heads_q, p.batch_entries()));
    Tensor gX = local_tile(mX(_, head, span.batch), Shape<Int<kBlockM>>{},
                           make_coord(span.ws_row0 / kBlockM + m));
    auto part = tma_partition(tma, _0{}, Layout<_1>{}, s, gX);
    copy(tma.with(bar, 0, TMA::CacheHintSm90::EVICT_LAST), get<0>(part), get<1>(part));
  }
  CUTE_DEVICE void q(BwdTileWork const& w, QueryStep s) {
    q_pipe.load(leader, Traits::kQBytes + Traits::kStatsBytes, [&](int stage) {
      uint64_t& bar = q_pipe.bar.tma_barrier(stage);
      load_rows(params.tma_q, bar, smem.q.data(), stage, w.dq_head(s), w.span, s.m);
      load_stats(params.tma_lse, bar, smem.lse.data(), stage, w.dq_head(s), w.span, s.m);
    });
  }
  CUTE_DEVICE void dout(BwdTileWork const& w, QueryStep s) {
    do_pipe.load(leader, Traits::kQBytes + Traits::kStatsBytes, [&](int stage) {
      uint64_t& bar = do_pipe.bar.tma_barrier(stage);
      load_rows(params.tma_do, bar, smem.dout.data(), stage, w.dq_head(s), w.span, s.m);
      load_stats(params.tma_dpsum, bar, smem.dpsum.data(), stage, w.dq_head(s), w.span, s.m);
    });
  }
  CUTE_DEVICE void kv(BwdTileWork const& w) {
    kv_pipe.load(leader, 2 * Traits::kKVBytes, [&](int stage) {
      uint64_t& bar = kv_pipe.bar.tma_barrier(stage);
      load_kv(params.tma_k, bar, smem.k.data(), w);
      load_kv(params.tma_v, bar, smem.v.data(), w);
    });
  }
  // The tile slot (kernel.h, TileSlot): the leader writes the tile into the next buffer, then the
  // warp syncs with both consumer WGs (who are done with the last tile when they reach it).
  CUTE_DEVICE void publish(PublishedTile const& tile) {
    if (leader) {
      smem.tile[tiles_published % 2] = tile;
    }
    ++tiles_published;
    named_barrier_sync_unaligned(static_cast<uint32_t>(BwdBarrier::kTileSlot), kTileSlotThreads);
  }
  // The tile counter's atomic increment (dynamic order), by the leader, for the whole warp.
  CUTE_DEVICE int claim() const {
    const int claimed = leader ? atomicAdd(p.tile_counter, 1) : 0;
    return __shfl_sync(0xffffffffu, claimed, __ffs(__ballot_sync(0xffffffffu, leader)) - 1);
  }
  template <class Tma>
  CUTE_DEVICE void load_kv(Tma const& tma, uint64_t& bar, typename Traits::Element* buf,
                           BwdTileWork const& w) const {
    Tensor s = make_tensor(make_smem_ptr(buf), typename Traits::SmemLayoutK{});
    Tensor mX =
        tma.get_tma_tensor(make_shape(k_rows_tma(), p.head_dim, p.heads_kv, p.batch_entries()));
    Tensor gX = local_tile(
        domain_offset(make_coord(w.span.k_start, _0{}), mX(_, _, w.tile.kv_head, w.span.batch)),
        Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(w.tile.n_block, _0{}));
    auto part = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s),
                              group_modes<0, 2>(gX));
    copy(tma.with(bar, 0, TMA::CacheHintSm90::EVICT_FIRST), get<0>(part), get<1>(part));
  }
};

template <class Traits>
CUTE_DEVICE void bwd_producer_loop(BwdKernelParams<Traits> const& params,
                                   typename Traits::SharedStorage& smem) {
  BwdProducer<Traits> producer(params, smem);
  produce_bwd(bwd_cta_schedule(params), producer);
}

}  // namespace flash_hopper::sm90
