// Consumer warpgroups of the FA-3 path: S = Q K^T and O += P V with WGMMA, online softmax in
// registers, then the epilogue. Key blocks run from n_max - 1 down to n_min.
//
// With intra-warpgroup overlap (FA3's order), block n's step issues S(n) = Q K(n)^T and
// O += P(n+1) V(n+1) back to back, then runs the softmax of S(n) while the PV GEMM is in flight:
//   wait K(n); [turn] issue S(n); [O *= scale]; wait V(n+1); issue PV(n+1); [pass turn]
//   wait<1> (S ready) -> release K(n); softcap; mask; max/scale; exp2/sum
//   wait<0> (PV done) -> release V(n+1); [O *= scale]; P = cvt(S(n))
// P is converted only after PV(n+1) completed: its registers are that GEMM's A operand.
// Without overlap: [turn] S(n); [pass]; wait; softmax; O *= scale; [turn] PV(n); [pass]; wait.
// [turn]/[pass] are the ping-pong barriers (pipeline.h), when enabled: one WG's softmax runs
// while the other WG's GEMMs occupy the tensor cores.
#pragma once

#include <cute/tensor.hpp>

#include "flash_hopper/block_range.h"
#include "sm80/mask.h"  // apply_softcap, apply_window_mask (layout-generic)
#include "sm90/epilogue.h"
#include "sm90/params.h"
#include "sm90/pipeline.h"
#include "sm90/softmax.h"
#include "sm90/utils.h"

namespace flash_hopper::sm90 {

using namespace cute;

// Which key blocks of a query block need mask arithmetic: block n is unmasked iff
// n_left <= n < n_right (every column visible to every row of the tile).
struct KeyBlockSplit {
  int n_left;
  int n_right;
};

CUTE_DEVICE KeyBlockSplit split_key_blocks(WindowMask const& mask, BlockRange range, int m_block,
                                           int block_m, int block_n) {
  // Right: the last visible column of the tile's first row bounds the unmasked blocks (and the
  // sequence tail: a block past seqlen_k holds zero-filled keys that must become -inf).
  int right_end = mask.seqlen_k;  // exclusive
  if (mask.window_right >= 0) {
    right_end = min(right_end, m_block * block_m + mask.diag() + mask.window_right + 1);
  }
  int n_right = right_end <= 0 ? 0 : right_end / block_n;
  // Left: the first visible column of the tile's last row.
  int n_left = range.n_min;
  if (mask.window_left >= 0) {
    const int left_begin = (m_block + 1) * block_m - 1 + mask.diag() - mask.window_left;
    n_left = left_begin <= 0 ? 0 : (left_begin + block_n - 1) / block_n;
  }
  n_left = max(range.n_min, min(n_left, range.n_max));
  n_right = max(n_left, min(n_right, range.n_max));
  return {n_left, n_right};
}

template <class Traits>
CUTE_DEVICE void consumer_loop(KernelParams<Traits> const& params,
                               typename Traits::SharedStorage& smem, int wg, int thread_idx) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  FwdParams const& p = params.fwd;

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});    // (M, D)
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});    // (N, D, PIPE)
  Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});  // (D, N, PIPE)

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(thread_idx);
  auto thr_pv = mma_pv.get_thread_slice(thread_idx);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K) descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, PIPE)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, PIPE)
  // Coordinates of this thread's S elements inside the tile, for the mask.
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));

  const WindowMask mask{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
  const StaticTileScheduler& sched = params.scheduler;
  const PingPong<Traits::kConsumerWgs> pingpong{params.pingpong, wg};
  const bool wg_leader = thread_idx % 128 == 0;
  constexpr int kQueryEmptyThreads = Traits::kConsumerThreads + 32;
  PipelineState<kStages> k_state;
  PipelineState<kStages> v_state;
  int tiles_with_keys = 0;

  pingpong.start();
  barrier_arrive(FwdBarrier::kQueryEmpty, kQueryEmptyThreads);  // sQ starts free

#pragma unroll 1
  for (int round = 0;; ++round) {
    const int t = sched.index(round, blockIdx.x);
    if (t >= sched.total_tiles) {
      break;
    }
    const TileCoord tile = sched.coord(t);
    const BlockRange range = mask.key_blocks(tile.m_block, kBlockM, kBlockN);
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // fp32
    Tensor tOrO_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
    clear(tOrO);
    if (range.n_max <= range.n_min) {
      // No visible key for any row: O = 0, LSE = -inf; no barrier is touched.
      const float lse[2] = {-INFINITY, -INFINITY};
      store_o_lse<Traits>(p, thr_pv, tOrO, lse, tile.m_block, tile.head, tile.batch);
      continue;
    }
    const KeyBlockSplit split = split_key_blocks(mask, range, tile.m_block, kBlockM, kBlockN);
    const int row0 = tile.m_block * kBlockM;
    OnlineSoftmax<2> softmax(p.scale_log2);
    const bool softcap = p.softcap != 0.f;

    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tSrS_rc = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
    Tensor tOrP = make_tensor<Element>(acc_as_rs_a(tSrS.layout()));
    static_assert(decltype(size<2>(tOrP))::value == kBlockN / 16, "P as the PV A operand");

    auto wait_k = [&]() { smem.k_full[k_state.index].wait(k_state.phase); };
    auto wait_v = [&]() { smem.v_full[v_state.index].wait(v_state.phase); };
    auto release_k = [&]() {
      if (wg_leader) {
        smem.k_empty[k_state.index].arrive();
      }
      k_state.advance();
    };
    auto release_v = [&]() {
      if (wg_leader) {
        smem.v_empty[v_state.index].arrive();
      }
      v_state.advance();
    };
    auto transform = [&](int n, auto masked) {
      if (softcap) {
        sm80::apply_softcap(tSrS, p.softcap, p.softcap_prescale);
      }
      if constexpr (decltype(masked)::value) {
        sm80::apply_window_mask(tSrS_rc, tScS_rc, mask, row0, n * kBlockN);
      }
    };

    smem.q_full.wait(tiles_with_keys & 1);
    ++tiles_with_keys;

    // Prologue: the first (last-index) block, always masked: it holds the sequence tail.
    const int n_first = range.n_max - 1;
    wait_k();
    pingpong.wait_turn();
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, k_state.index), tSrS);
    pingpong.pass_turn();
    warpgroup_wait<0>();
    if (range.n_min == n_first) {
      barrier_arrive(FwdBarrier::kQueryEmpty, kQueryEmptyThreads);  // the tile's last QK is done
    }
    release_k();
    transform(n_first, true_type{});
    softmax.template update</*kFirst=*/true, /*kCheckInf=*/true>(tSrS_rc);
    if constexpr (Traits::kOverlap) {
      convert_into(tSrS, tOrP);
    }

    auto step = [&](int n, auto masked) __attribute__((always_inline)) {
      constexpr bool kMasked = decltype(masked)::value;
      const bool last_qk = n == range.n_min;
      wait_k();
      if constexpr (Traits::kOverlap) {
        pingpong.wait_turn();
        wgmma<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, k_state.index), tSrS);
        if constexpr (Traits::kRescaleOBeforePv) {
          softmax.rescale_o(tOrO_rc);
        }
        wait_v();
        wgmma<false, -1>(mma_pv, tOrP, tOrV(_, _, _, v_state.index), tOrO);
        pingpong.pass_turn();
        warpgroup_wait<1>();
        if (last_qk) {
          barrier_arrive(FwdBarrier::kQueryEmpty, kQueryEmptyThreads);
        }
        release_k();
        transform(n, masked);
        softmax.template update<false, kMasked>(tSrS_rc);
        warpgroup_wait<0>();
        release_v();
        if constexpr (!Traits::kRescaleOBeforePv) {
          softmax.rescale_o(tOrO_rc);
        }
        convert_into(tSrS, tOrP);
      } else {
        // Block n + 1's PV first (its P is ready), then S(n): no overlap inside the warpgroup.
        convert_into(tSrS, tOrP);
        softmax.rescale_o(tOrO_rc);
        wait_v();
        pingpong.wait_turn();
        wgmma<false, -1>(mma_pv, tOrP, tOrV(_, _, _, v_state.index), tOrO);
        pingpong.pass_turn();
        warpgroup_wait<0>();
        release_v();
        pingpong.wait_turn();
        wgmma<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, k_state.index), tSrS);
        pingpong.pass_turn();
        warpgroup_wait<0>();
        if (last_qk) {
          barrier_arrive(FwdBarrier::kQueryEmpty, kQueryEmptyThreads);
        }
        release_k();
        transform(n, masked);
        softmax.template update<false, kMasked>(tSrS_rc);
      }
    };

#pragma unroll 1
    for (int n = n_first - 1; n >= range.n_min; --n) {
      if (n >= split.n_right || n < split.n_left) {
        step(n, true_type{});
      } else {
        step(n, false_type{});
      }
    }

    // Tail: the last block's PV.
    if constexpr (Traits::kOverlap) {
      if constexpr (Traits::kRescaleOBeforePv) {
        softmax.rescale_o(tOrO_rc);
      }
    } else {
      convert_into(tSrS, tOrP);
      softmax.rescale_o(tOrO_rc);
    }
    wait_v();
    wgmma<false, 0>(mma_pv, tOrP, tOrV(_, _, _, v_state.index), tOrO);
    release_v();
    float lse[2];
    softmax.finalize(tOrO_rc, p.lse_scale, lse);
    store_o_lse<Traits>(p, thr_pv, tOrO, lse, tile.m_block, tile.head, tile.batch);
  }
}

}  // namespace flash_hopper::sm90
