// Producer of the FA-3 path: one elected thread of warp 0 issues every TMA load.
//
// Per tile with at least one key block (key blocks run from n_max - 1 down to n_min):
//   K(n_max-1) -> [wait for a free Q buffer] Q -> then, with intra-warpgroup overlap, K(n-1) and V(n) for
//   each following block (the consumers read V one step after K), and V(n_min) last; without it
//   V(n) follows K(n). Each K / V load first waits until its stage is empty.
#pragma once

#include <cute/tensor.hpp>

#include "flash_hopper/block_range.h"
#include "sm90/params.h"
#include "sm90/pipeline.h"

namespace flash_hopper::sm90 {

using namespace cute;

template <class Traits>
CUTE_DEVICE void producer_loop(KernelParams<Traits> const& params,
                               typename Traits::SharedStorage& smem) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  FwdParams const& p = params.fwd;

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()),
                          typename Traits::SmemLayoutQStages{});  // (M, D, QPIPE)
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});  // (N, D, PIPE)
  Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});  // (N, D, PIPE)
  Tensor mQ = params.tma_q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.heads_q, p.batch));
  const int seqlen_k_tma = p.seqlen_k > 0 ? p.seqlen_k : 1;
  Tensor mK = params.tma_k.get_tma_tensor(make_shape(seqlen_k_tma, p.head_dim, p.heads_kv, p.batch));
  Tensor mV = params.tma_v.get_tma_tensor(make_shape(seqlen_k_tma, p.head_dim, p.heads_kv, p.batch));

  const WindowMask mask{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
  const StaticTileScheduler& sched = params.scheduler;
  const bool leader = cute::elect_one_sync();
  PipelineState<kStages> k_state = producer_start_state<kStages>();
  PipelineState<kStages> v_state = producer_start_state<kStages>();
  PipelineState<Traits::kQStages> q_state = producer_start_state<Traits::kQStages>();

  // Warms L2 with the Q tile and the first K / V blocks of this CTA's tile in `round`, while the
  // current tile computes. Q is read by one tile only, so its TMA load would otherwise always wait
  // on DRAM, and that wait sits between two tiles (the load may start only once the previous
  // tile's last QK GEMM finished).
  auto prefetch_next_tile = [&](int round) {
    const int t = sched.index(round, blockIdx.x);
    if (!leader || t >= sched.total_tiles) {
      return;
    }
    const TileCoord tile = sched.coord(t);
    const BlockRange range = mask.key_blocks(tile.m_block, kBlockM, kBlockN);
    if (range.n_max <= range.n_min) {
      return;
    }
    const int head_kv = tile.head / p.heads_per_kv;
    Tensor gQ = local_tile(mQ(_, _, tile.head, tile.batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                           make_coord(tile.m_block, _0{}));
    Tensor gK = local_tile(mK(_, _, head_kv, tile.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(range.n_max - 1, _0{}));
    Tensor gV = local_tile(mV(_, _, head_kv, tile.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(range.n_max - 1, _0{}));
    prefetch(params.tma_q, get<0>(tma_partition(params.tma_q, _0{}, Layout<_1>{},
                                                group_modes<0, 2>(sQ(_, _, 0)),
                                                group_modes<0, 2>(gQ))));
    prefetch(params.tma_k, get<0>(tma_partition(params.tma_k, _0{}, Layout<_1>{},
                                                group_modes<0, 2>(sK(_, _, 0)),
                                                group_modes<0, 2>(gK))));
    prefetch(params.tma_v, get<0>(tma_partition(params.tma_v, _0{}, Layout<_1>{},
                                                group_modes<0, 2>(sV(_, _, 0)),
                                                group_modes<0, 2>(gV))));
  };

#pragma unroll 1
  for (int round = 0;; ++round) {
    const int t = sched.index(round, blockIdx.x);
    if (t >= sched.total_tiles) {
      break;
    }
    const TileCoord tile = sched.coord(t);
    const BlockRange range = mask.key_blocks(tile.m_block, kBlockM, kBlockN);
    if (range.n_max <= range.n_min) {
      continue;  // the consumers write this tile without touching any barrier
    }
    const int head_kv = tile.head / p.heads_per_kv;
    Tensor gQ = local_tile(mQ(_, _, tile.head, tile.batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                           make_coord(tile.m_block, _0{}));  // (M, D)
    Tensor gK = local_tile(mK(_, _, head_kv, tile.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(_, _0{}));  // (N, D, n)
    Tensor gV = local_tile(mV(_, _, head_kv, tile.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(_, _0{}));  // (N, D, n)
    auto q_part = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                  group_modes<0, 2>(gQ));
    Tensor tQgQ = get<0>(q_part);  // (TMA)
    Tensor tQsQ = get<1>(q_part);  // (TMA, QPIPE)
    auto k_part = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                                  group_modes<0, 2>(gK));
    Tensor tKgK = get<0>(k_part);  // (TMA, n)
    Tensor tKsK = get<1>(k_part);  // (TMA, PIPE)
    auto v_part = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                                  group_modes<0, 2>(gV));
    Tensor tVgV = get<0>(v_part);  // (TMA, n)
    Tensor tVsV = get<1>(v_part);  // (TMA, PIPE)

    // One K or V block into the next stage of its pipeline, once that stage is empty.
    auto load_stage = [&](auto const& tma, auto const& tXgX, auto const& tXsX, auto& full,
                          auto& empty, auto& state, int n) {
      empty[state.index].wait(state.phase);
      if (leader) {
        full[state.index].arrive_and_expect_tx(Traits::kKVBytes);
        copy(tma.with(reinterpret_cast<uint64_t&>(full[state.index]), 0,
                      TMA::CacheHintSm90::EVICT_LAST),
             tXgX(_, n), tXsX(_, state.index));
      }
      state.advance();
    };
    auto load_k = [&](int n) {
      load_stage(params.tma_k, tKgK, tKsK, smem.k_full, smem.k_empty, k_state, n);
    };
    auto load_v = [&](int n) {
      load_stage(params.tma_v, tVgV, tVsV, smem.v_full, smem.v_empty, v_state, n);
    };

    const int n_first = range.n_max - 1;
    load_k(n_first);
    // A Q buffer is free once every consumer WG finished the last QK GEMM of the tile in it.
    smem.q_empty[q_state.index].wait(q_state.phase);
    if (leader) {
      auto& full = smem.q_full[q_state.index];
      full.arrive_and_expect_tx(Traits::kQBytes);
      copy(params.tma_q.with(reinterpret_cast<uint64_t&>(full), 0, TMA::CacheHintSm90::EVICT_FIRST),
           tQgQ, tQsQ(_, q_state.index));
    }
    q_state.advance();
    prefetch_next_tile(round + 1);
    if constexpr (Traits::kOverlap) {
#pragma unroll 1
      for (int n = n_first - 1; n >= range.n_min; --n) {
        load_k(n);
        load_v(n + 1);
      }
      load_v(range.n_min);
    } else {
      load_v(n_first);
#pragma unroll 1
      for (int n = n_first - 1; n >= range.n_min; --n) {
        load_k(n);
        load_v(n);
      }
    }
  }
}

}  // namespace flash_hopper::sm90
