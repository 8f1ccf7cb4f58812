// Consumer warpgroups of the FA-3 path: S = Q K^T and O += P V with WGMMA, online softmax in
// registers, then the epilogue. Key blocks of a tile run from n_max - 1 down to n_min.
//
// With intra-warpgroup overlap (FA3's order), a step issues S(n) = Q K(n)^T and
// O += P(n+1) V(n+1) back to back, then runs the softmax of S(n) while the PV GEMM is in flight:
//   wait K(n); [turn] issue S(n); [O *= scale]; wait V(n+1); issue PV(n+1); [pass turn]
//   wait<1> (S ready) -> release K(n); softcap; mask; max/scale; exp2/sum
//   wait<0> (PV done) -> release V(n+1); [O *= scale]; P = cvt(S(n))
// P is converted only after PV(n+1) completed: its registers are that GEMM's A operand.
// The steps form one stream across the CTA's tiles: the step that issues the first S of tile
// t + 1 also issues the last PV of tile t, and tile t's epilogue (O / l, stores) runs while that
// S is on the tensor cores, so there is no drain-and-refill bubble between tiles.
// Without overlap (ablation): per tile, [turn] S(n); [pass]; wait; softmax; O *= scale;
// [turn] PV(n); [pass]; wait.
// [turn]/[pass] are the ping-pong barriers (pipeline.h), when enabled: one WG's softmax runs
// while the other WG's GEMMs occupy the tensor cores.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "flash_hopper/block_range.h"
#include "flash_hopper/register_ops.h"  // apply_softcap, apply_window_mask
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

// One consumer warpgroup's view of the CTA: its MMA partitions of the shared-memory stages, the
// pipeline states and the steps of the algorithm. The loops (below) only sequence these.
template <class Traits>
struct Consumer {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kStages = Traits::kStages;
  using TiledMmaQK = typename Traits::TiledMmaQK;
  using TiledMmaPV = typename Traits::TiledMmaPV;
  using SharedStorage = typename Traits::SharedStorage;
  using Softmax = OnlineSoftmax</*kRows=*/2>;

  // A tile with at least one key block.
  struct Work {
    TileCoord tile;
    BlockRange range;
    KeyBlockSplit split;
  };

  // Only the pipeline states and a few counters live in registers across the loop: everything
  // derivable from the (constant-bank) params or the thread index is re-derived where used, which
  // keeps d256's O + S + P = 188 registers from spilling around them.
  KernelParams<Traits> const& params;
  FwdParams const& p;
  SharedStorage& smem;
  TiledMmaQK mma_qk;
  TiledMmaPV mma_pv;
  PipelineState<kStages> k_state;
  PipelineState<kStages> v_state;
  PipelineState<Traits::kQStages> q_state;  // the next Q buffer to wait for
  int q_read = 0;                           // the Q buffer of the tile being computed

  CUTE_DEVICE Consumer(KernelParams<Traits> const& params_, SharedStorage& smem_)
      : params(params_), p(params_.fwd), smem(smem_) {}

  static CUTE_DEVICE int thread_idx() { return opaque_thread_idx() - 128; }
  CUTE_DEVICE WindowMask mask() const {
    return {p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
  }
  CUTE_DEVICE PingPong<Traits::kConsumerWgs> pingpong() const {
    return {params.pingpong, cutlass::canonical_warp_group_idx() - 1};
  }
  static CUTE_DEVICE bool wg_leader() { return thread_idx() % 128 == 0; }

  // Shared-memory descriptors depend on the warpgroup only: slicing with its first thread, a
  // warp-uniform value, lets them live in uniform registers.
  static CUTE_DEVICE int wg_first_thread() {
    return (cutlass::canonical_warp_group_idx() - 1) * 128;
  }
  CUTE_DEVICE auto tSrQ() {  // (MMA, MMA_M, MMA_K) descriptors
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQStages{});
    return mma_qk.get_thread_slice(wg_first_thread()).partition_fragment_A(sQ)(_, _, _, q_read);
  }
  CUTE_DEVICE auto tSrK() {  // (MMA, MMA_N, MMA_K, PIPE)
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    return mma_qk.get_thread_slice(wg_first_thread()).partition_fragment_B(sK);
  }
  CUTE_DEVICE auto tOrV() {  // (MMA, MMA_N, MMA_K, PIPE)
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
    return mma_pv.get_thread_slice(wg_first_thread()).partition_fragment_B(sVt);
  }

  // The next tile with keys at or after `round` of this CTA's schedule; tiles without any
  // visible key on the way are written here (O = 0, LSE = -inf) and touch no barrier.
  CUTE_DEVICE bool next_work(int& round, Work& w) {
    for (;; ++round) {
      const int t = params.scheduler.index(round, blockIdx.x);
      if (t >= params.scheduler.total_tiles) {
        return false;
      }
      w.tile = params.scheduler.coord(t);
      w.range = mask().key_blocks(w.tile.m_block, kBlockM, kBlockN);
      if (w.range.n_max > w.range.n_min) {
        w.split = split_key_blocks(mask(), w.range, w.tile.m_block, kBlockM, kBlockN);
        return true;
      }
      store_empty_tile<Traits>(p, mma_pv.get_thread_slice(thread_idx()), w.tile);
    }
  }

  CUTE_DEVICE void wait_q() {
    smem.q_full[q_state.index].wait(q_state.phase);
    q_read = q_state.index;
    q_state.advance();
  }
  CUTE_DEVICE void wait_k() { smem.k_full[k_state.index].wait(k_state.phase); }
  CUTE_DEVICE void wait_v() { smem.v_full[v_state.index].wait(v_state.phase); }
  // One arrival per warpgroup, once its WGMMAs reading the stage completed.
  CUTE_DEVICE void release_k() {
    if (wg_leader()) {
      smem.k_empty[k_state.index].arrive();
    }
    k_state.advance();
  }
  CUTE_DEVICE void release_v() {
    if (wg_leader()) {
      smem.v_empty[v_state.index].arrive();
    }
    v_state.advance();
  }
  // After the tile's last QK GEMM completed: the producer may reuse its Q buffer.
  CUTE_DEVICE void release_q() {
    if (wg_leader()) {
      smem.q_empty[q_read].arrive();
    }
  }

  template <class TensorS>
  CUTE_DEVICE void issue_qk(TensorS& tSrS) {
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_qk, tSrQ(), tSrK()(_, _, _, k_state.index), tSrS);
  }
  template <class TensorP, class TensorO>
  CUTE_DEVICE void issue_pv(TensorP const& tOrP, TensorO& tOrO) {
    wgmma<false, -1>(mma_pv, tOrP, tOrV()(_, _, _, v_state.index), tOrO);
  }

  CUTE_DEVICE static bool masked(Work const& w, int n) {
    return n >= w.split.n_right || n < w.split.n_left;
  }

  // Softcap (before the mask: a capped -inf would become -softcap), then the window / causal /
  // sequence-tail mask on masked blocks only.
  template <bool kMasked, class TensorS>
  CUTE_DEVICE void transform(TensorS& tSrS, Work const& w, int n) {
    if (p.softcap != 0.f) {
      apply_softcap(tSrS, p.softcap, p.softcap_prescale);
    }
    if constexpr (kMasked) {
      Tensor tScS = mma_qk.get_thread_slice(thread_idx())
                        .partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
      Tensor tSrS_rc = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
      apply_window_mask(tSrS_rc, make_tensor(tScS.data(), acc_rowcol(tScS.layout())), mask(),
                              w.tile.m_block * kBlockM, n * kBlockN);
    }
  }

  template <class TensorO>
  CUTE_DEVICE void finish(Work const& w, Softmax& softmax, TensorO& tOrO) {
    Tensor tOrO_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
    float lse[2];
    softmax.finalize(tOrO_rc, p.lse_scale, lse);
    store_tile<Traits>(p, mma_pv.get_thread_slice(thread_idx()), tOrO, lse, w.tile);
  }

  // The register state of one tile: S (fp32), P (S converted, the PV GEMM's A operand), O (fp32)
  // and the row statistics.
  struct Fragments {
    decltype(partition_fragment_C(TiledMmaQK{}, Shape<Int<kBlockM>, Int<kBlockN>>{})) s;
    decltype(make_tensor<Element>(acc_as_rs_a(s.layout()))) p;
    decltype(partition_fragment_C(TiledMmaPV{}, Shape<Int<kBlockM>, Int<kHeadDim>>{})) o;
    static_assert(decltype(size<2>(p))::value == kBlockN / 16, "P as the PV A operand");

    CUTE_DEVICE auto s_rc() { return make_tensor(s.data(), acc_rowcol(s.layout())); }
    CUTE_DEVICE auto o_rc() { return make_tensor(o.data(), acc_rowcol(o.layout())); }
  };

  // S of a tile's first (last-index) block alone; always masked: it holds the sequence tail.
  CUTE_DEVICE void first_block(Fragments& f, Softmax& softmax, Work const& w) {
    const int n = w.range.n_max - 1;
    wait_q();
    wait_k();
    pingpong().wait_turn();
    issue_qk(f.s);
    pingpong().pass_turn();
    warpgroup_wait<0>();
    if (n == w.range.n_min) {
      release_q();
    }
    release_k();
    transform<true>(f.s, w, n);
    Tensor s_rc = f.s_rc();
    softmax.template update</*kFirst=*/true, /*kCheckInf=*/true>(s_rc);
  }

  // One overlapped step inside tile w: S(n) with PV(n + 1), the softmax of S(n) under the PV.
  template <bool kMasked>
  CUTE_DEVICE void overlapped_step(Fragments& f, Softmax& softmax, Work const& w, int n) {
    Tensor o_rc = f.o_rc();
    wait_k();
    pingpong().wait_turn();
    issue_qk(f.s);
    if constexpr (Traits::kRescaleOBeforePv) {
      softmax.rescale_o(o_rc);
    }
    wait_v();
    issue_pv(f.p, f.o);
    pingpong().pass_turn();
    warpgroup_wait<1>();
    if (n == w.range.n_min) {
      release_q();
    }
    release_k();
    transform<kMasked>(f.s, w, n);
    Tensor s_rc = f.s_rc();
    softmax.template update<false, kMasked>(s_rc);
    warpgroup_wait<0>();
    release_v();
    if constexpr (!Traits::kRescaleOBeforePv) {
      softmax.rescale_o(o_rc);
    }
    convert_into(f.s, f.p);
  }

  // Tile w's last PV alone (its P is ready), then its epilogue.
  CUTE_DEVICE void drain(Fragments& f, Softmax& softmax, Work const& w) {
    if constexpr (Traits::kRescaleOBeforePv) {
      Tensor o_rc = f.o_rc();
      softmax.rescale_o(o_rc);
    }
    wait_v();
    wgmma<false, 0>(mma_pv, f.p, tOrV()(_, _, _, v_state.index), f.o);
    release_v();
    finish(w, softmax, f.o);
  }
};

// Tuned kernel (d <= 192): overlapped steps in one stream across the CTA's tiles.
template <class Traits>
CUTE_DEVICE void consumer_loop_overlap(Consumer<Traits>& c) {
  using Softmax = typename Consumer<Traits>::Softmax;
  using Work = typename Consumer<Traits>::Work;
  typename Consumer<Traits>::Fragments f;
  Tensor s_rc = f.s_rc();
  int round = 0;
  Work cur;
  if (!c.next_work(round, cur)) {
    return;
  }
  Softmax softmax(c.p.scale_log2);
  clear(f.o);
  c.first_block(f, softmax, cur);
  convert_into(f.s, f.p);
  int n = cur.range.n_max - 1;  // the block whose P feeds the next PV

#pragma unroll 1
  for (;;) {
    if (n > cur.range.n_min) {
      --n;
      if (Consumer<Traits>::masked(cur, n)) {
        c.template overlapped_step<true>(f, softmax, cur, n);
      } else {
        c.template overlapped_step<false>(f, softmax, cur, n);
      }
      continue;
    }
    int next_round = round + 1;
    Work next;
    if (!c.next_work(next_round, next)) {
      break;
    }
    // Tile boundary: S of the next tile's first block with the last PV of this one; this tile's
    // epilogue runs while that S is consumed.
    round = next_round;
    n = next.range.n_max - 1;
    c.wait_q();
    c.wait_k();
    c.pingpong().wait_turn();
    c.issue_qk(f.s);
    if constexpr (Traits::kRescaleOBeforePv) {
      Tensor o_rc = f.o_rc();
      softmax.rescale_o(o_rc);
    }
    c.wait_v();
    c.issue_pv(f.p, f.o);
    c.pingpong().pass_turn();
    warpgroup_wait<1>();
    if (n == next.range.n_min) {
      c.release_q();
    }
    c.release_k();
    c.template transform<true>(f.s, next, n);
    Softmax finished = softmax;  // this tile's statistics, for its epilogue
    softmax = Softmax(c.p.scale_log2);
    softmax.template update<true, true>(s_rc);
    warpgroup_wait<0>();
    c.release_v();
    c.finish(cur, finished, f.o);
    clear(f.o);
    convert_into(f.s, f.p);
    cur = next;
  }
  c.drain(f, softmax, cur);
}

// Tuned kernel where the merged boundary does not fit the registers (d256): the same overlapped
// steps, each tile with its own first block and drain, all state scoped to the tile.
template <class Traits>
CUTE_DEVICE void consumer_loop_overlap_per_tile(Consumer<Traits>& c) {
  using Softmax = typename Consumer<Traits>::Softmax;
  typename Consumer<Traits>::Work w;
#pragma unroll 1
  for (int round = 0; c.next_work(round, w); ++round) {
    typename Consumer<Traits>::Fragments f;
    Softmax softmax(c.p.scale_log2);
    clear(f.o);
    c.first_block(f, softmax, w);
    convert_into(f.s, f.p);
#pragma unroll 1
    for (int n = w.range.n_max - 2; n >= w.range.n_min; --n) {
      if (Consumer<Traits>::masked(w, n)) {
        c.template overlapped_step<true>(f, softmax, w, n);
      } else {
        c.template overlapped_step<false>(f, softmax, w, n);
      }
    }
    c.drain(f, softmax, w);
  }
}

// Ablation (no intra-warpgroup overlap): per block, S then softmax then PV, each GEMM waited for.
template <class Traits>
CUTE_DEVICE void consumer_loop_sequential(Consumer<Traits>& c) {
  using Softmax = typename Consumer<Traits>::Softmax;
  typename Consumer<Traits>::Work w;
#pragma unroll 1
  for (int round = 0; c.next_work(round, w); ++round) {
    typename Consumer<Traits>::Fragments f;
    Tensor s_rc = f.s_rc();
    Tensor o_rc = f.o_rc();
    Softmax softmax(c.p.scale_log2);
    clear(f.o);
    c.first_block(f, softmax, w);

    auto pv = [&]() __attribute__((always_inline)) {
      convert_into(f.s, f.p);
      c.wait_v();
      c.pingpong().wait_turn();
      c.issue_pv(f.p, f.o);
      c.pingpong().pass_turn();
      warpgroup_wait<0>();
      c.release_v();
    };
    auto block = [&](int n, auto masked) __attribute__((always_inline)) {
      constexpr bool kMasked = decltype(masked)::value;
      c.wait_k();
      c.pingpong().wait_turn();
      c.issue_qk(f.s);
      c.pingpong().pass_turn();
      warpgroup_wait<0>();
      if (n == w.range.n_min) {
        c.release_q();
      }
      c.release_k();
      c.template transform<kMasked>(f.s, w, n);
      softmax.template update<false, kMasked>(s_rc);
      softmax.rescale_o(o_rc);
      pv();
    };

    pv();
#pragma unroll 1
    for (int n = w.range.n_max - 2; n >= w.range.n_min; --n) {
      if (Consumer<Traits>::masked(w, n)) {
        block(n, true_type{});
      } else {
        block(n, false_type{});
      }
    }
    c.finish(w, softmax, f.o);
  }
}

template <class Traits>
CUTE_DEVICE void consumer_loop(KernelParams<Traits> const& params,
                               typename Traits::SharedStorage& smem) {
  Consumer<Traits> c(params, smem);
  c.pingpong().start();
  if constexpr (Traits::kOverlap && Traits::kMergeTileBoundary) {
    consumer_loop_overlap(c);
  } else if constexpr (Traits::kOverlap) {
    consumer_loop_overlap_per_tile(c);
  } else {
    consumer_loop_sequential(c);
  }
}

}  // namespace flash_hopper::sm90
