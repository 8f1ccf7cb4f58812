// Consumer warpgroups of the FA-3 path: S = Q K^T and O += P V with WGMMA, online softmax in
// registers, then the epilogue. The order of every wait, GEMM, softmax and release is
// schedule.h's consume(); this file supplies the operations.
//
// With intra-warpgroup overlap (FA3's order), a step issues S(n) = Q K(n)^T and the PV GEMM of
// the previous block back to back, then runs the softmax of S(n) while the PV GEMM is in flight;
// ping-pong (barriers.h), when enabled, lets one WG's softmax run while the other WG's GEMMs
// occupy the tensor cores.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "flash_hopper/mask.h"
#include "flash_hopper/register_ops.h"  // apply_softcap, apply_mask
#include "sm90/barriers.h"
#include "sm90/epilogue.h"
#include "sm90/params.h"
#include "sm90/schedule.h"
#include "sm90/softmax.h"
#include "sm90/utils.h"

namespace flash_hopper::sm90 {

using namespace cute;

// One consumer warpgroup's operations: its MMA partitions of the shared-memory stages, the ends
// of the three pipelines and the steps of the algorithm on the register state (TileState).
template <class Traits>
struct Consumer {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  using TiledMmaQK = typename Traits::TiledMmaQK;
  using TiledMmaPV = typename Traits::TiledMmaPV;
  using SharedStorage = typename Traits::SharedStorage;
  using Softmax = OnlineSoftmax</*kRows=*/2>;
  using QEnd = ConsumerEnd<typename Traits::QPipe, SmemBarriers<typename Traits::QPipe>>;
  using KVEnd = ConsumerEnd<typename Traits::KVPipe, SmemBarriers<typename Traits::KVPipe>>;

  // Only the pipeline states and a few counters live in registers across the loop: everything
  // derivable from the (constant-bank) params or the thread index is re-derived where used, which
  // keeps d256's O + S + P = 188 registers from spilling around them.
  KernelParams<Traits> const& params;
  FwdParams const& p;
  SharedStorage& smem;
  TiledMmaQK mma_qk;
  TiledMmaPV mma_pv;
  QEnd q_pipe;
  KVEnd k_pipe;
  KVEnd v_pipe;

  CUTE_DEVICE Consumer(KernelParams<Traits> const& params_, SharedStorage& smem_)
      : params(params_),
        p(params_.fwd),
        smem(smem_),
        q_pipe{{smem_.q_full, smem_.q_empty}},
        k_pipe{{smem_.k_full, smem_.k_empty}},
        v_pipe{{smem_.v_full, smem_.v_empty}} {}

  static CUTE_DEVICE int thread_idx() { return opaque_thread_idx() - 128; }
  CUTE_DEVICE PingPong<Traits::kConsumerWgs> pingpong() const {
    return {params.pingpong, cutlass::canonical_warp_group_idx() - 1};
  }
  // The one thread per warpgroup that arrives on empty barriers (PipelineSpec::kEmptyArrivals).
  static CUTE_DEVICE bool wg_leader() { return thread_idx() % 128 == 0; }

  // Shared-memory descriptors depend on the warpgroup only: slicing with its first thread, a
  // warp-uniform value, lets them live in uniform registers.
  static CUTE_DEVICE int wg_first_thread() {
    return (cutlass::canonical_warp_group_idx() - 1) * 128;
  }
  CUTE_DEVICE auto tSrQ() {  // (MMA, MMA_M, MMA_K) descriptors
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQStages{});
    return mma_qk.get_thread_slice(wg_first_thread()).partition_fragment_A(sQ)(_, _, _,
                                                                               q_pipe.stage());
  }
  CUTE_DEVICE auto tSrK() {  // (MMA, MMA_N, MMA_K, PIPE)
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    return mma_qk.get_thread_slice(wg_first_thread()).partition_fragment_B(sK);
  }
  CUTE_DEVICE auto tOrV() {  // (MMA, MMA_N, MMA_K, PIPE)
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
    return mma_pv.get_thread_slice(wg_first_thread()).partition_fragment_B(sVt);
  }

  // --- pipelines (the tile / step arguments name what the schedule expects; the host test
  //     checks them, the kernel needs only the pipeline state) ----------------------------------
  CUTE_DEVICE void wait_q(TileWork const&) { q_pipe.wait(); }
  CUTE_DEVICE void release_q(TileWork const&) { q_pipe.release(wg_leader()); }
  CUTE_DEVICE void wait_k(TileWork const&, KeyStep) { k_pipe.wait(); }
  CUTE_DEVICE void release_k(TileWork const&, KeyStep) { k_pipe.release(wg_leader()); }
  CUTE_DEVICE void wait_v(TileWork const&, KeyStep) { v_pipe.wait(); }
  CUTE_DEVICE void release_v(TileWork const&, KeyStep) { v_pipe.release(wg_leader()); }

  CUTE_DEVICE void turn_start() const { pingpong().start(); }
  CUTE_DEVICE void turn_wait() const { pingpong().wait_turn(); }
  CUTE_DEVICE void turn_pass() const { pingpong().pass_turn(); }

  // The register state of the tile(s) in flight: S (fp32), P (S converted, the PV GEMM's A
  // operand), O (fp32), the row statistics, and at a tile boundary the finishing tile's.
  struct TileState {
    decltype(partition_fragment_C(TiledMmaQK{}, Shape<Int<kBlockM>, Int<kBlockN>>{})) s;
    decltype(make_tensor<Element>(acc_as_rs_a(s.layout()))) p;
    decltype(partition_fragment_C(TiledMmaPV{}, Shape<Int<kBlockM>, Int<kHeadDim>>{})) o;
    Softmax softmax;
    Softmax finishing;
    static_assert(decltype(size<2>(p))::value == kBlockN / 16, "P as the PV A operand");

    CUTE_DEVICE auto s_rc() { return make_tensor(s.data(), acc_rowcol(s.layout())); }
    CUTE_DEVICE auto o_rc() { return make_tensor(o.data(), acc_rowcol(o.layout())); }
  };

  // --- GEMMs --------------------------------------------------------------------------------
  CUTE_DEVICE void issue_qk(TileState& f) {
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_qk, tSrQ(), tSrK()(_, _, _, k_pipe.stage()), f.s);
  }
  CUTE_DEVICE void issue_pv(TileState& f) {
    wgmma<false, -1>(mma_pv, f.p, tOrV()(_, _, _, v_pipe.stage()), f.o);
  }
  CUTE_DEVICE void issue_pv_and_wait(TileState& f) {
    wgmma<false, 0>(mma_pv, f.p, tOrV()(_, _, _, v_pipe.stage()), f.o);
  }
  template <int kInFlight>
  CUTE_DEVICE void wait_gemms() {
    warpgroup_wait<kInFlight>();
  }

  // --- softmax ------------------------------------------------------------------------------
  // Softcap (before the mask: a capped -inf would become -softcap), then the window / causal /
  // sequence-tail mask on masked blocks only.
  template <bool kMasked>
  CUTE_DEVICE void transform(TileState& f, TileWork const& w, KeyStep step) {
    if (p.softcap != 0.f) {
      apply_softcap(f.s, p.softcap, p.softcap_prescale);
    }
    if constexpr (kMasked) {
      Tensor tScS = mma_qk.get_thread_slice(thread_idx())
                        .partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
      Tensor s_rc = f.s_rc();
      apply_mask(s_rc, make_tensor(tScS.data(), acc_rowcol(tScS.layout())), attention_mask(p),
                 w.tile.m_block * kBlockM, step.n * kBlockN);
    }
  }
  template <bool kFirst, bool kCheckInf>
  CUTE_DEVICE void softmax(TileState& f) {
    Tensor s_rc = f.s_rc();
    f.softmax.template update<kFirst, kCheckInf>(s_rc);
  }
  CUTE_DEVICE void rescale_o(TileState& f) {
    Tensor o_rc = f.o_rc();
    f.softmax.rescale_o(o_rc);
  }
  CUTE_DEVICE void convert_p(TileState& f) { convert_into(f.s, f.p); }

  // --- tiles --------------------------------------------------------------------------------
  CUTE_DEVICE void start_tile(TileState& f) {
    f.softmax = Softmax(p.scale_log2);
    clear(f.o);
  }
  CUTE_DEVICE void begin_next_tile(TileState& f) {
    f.finishing = f.softmax;
    f.softmax = Softmax(p.scale_log2);
  }
  CUTE_DEVICE void clear_o(TileState& f) { clear(f.o); }
  // O / l, LSE and the stores of tile w; kPrevious: w is the tile finishing at a boundary.
  template <bool kPrevious>
  CUTE_DEVICE void finish(TileState& f, TileWork const& w) {
    Tensor o_rc = f.o_rc();
    float lse[2];
    (kPrevious ? f.finishing : f.softmax).finalize(o_rc, p.lse_scale, lse);
    store_tile<Traits>(p, mma_pv.get_thread_slice(thread_idx()), f.o, lse, w.tile);
  }
  CUTE_DEVICE void store_empty(TileWork const& w) {
    store_empty_tile<Traits>(p, mma_pv.get_thread_slice(thread_idx()), w.tile);
  }
};

template <class Traits>
CUTE_DEVICE void consumer_loop(KernelParams<Traits> const& params,
                               typename Traits::SharedStorage& smem) {
  Consumer<Traits> consumer(params, smem);
  consume<Traits>(cta_schedule(params), consumer);
}

}  // namespace flash_hopper::sm90
