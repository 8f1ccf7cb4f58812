// Consumer warpgroups of the FA-3 path: S = Q K^T and O += P V with WGMMA, online softmax in
// registers, then the epilogue. The order of every wait, GEMM, softmax and release is
// schedule.h's consume(); this file supplies the operations.
//
// With intra-warpgroup overlap (FA3's order), a step issues S(n) = Q K(n)^T and the PV GEMM of
// the previous block back to back, then runs the softmax of S(n) while the PV GEMM is in flight;
// ping-pong (barriers.h), when enabled, lets one WG's softmax run while the other WG's GEMMs
// occupy the tensor cores.
//
// What differs by input dtype is two policy types (consumer_policies.h): the score scales (the
// call's for 16-bit inputs, the tile's descales for FP8 and mixed mode) and the PV accumulator
// (O itself, or FP8's two levels, so O never sums more than a few blocks in the FP8 tensor core's
// narrower accumulation -- vLLM measured long-context retrieval collapsing without it: O folded
// into an fp32 copy in shared memory every few PV GEMMs (d64 / d128), or each PV GEMM from zero
// in its own accumulator added into O in registers).
// FP8 (e4m3) inputs (Traits::kFp8) also pack P to e4m3 in place (the V^T buffer's key order
// matches, transpose.h) and store O in 16 bits (FwdParams::o_fp16). Mixed mode (Traits::kMixed:
// 16-bit q against FP8 K / V converted in shared memory, convert.h) runs the 16-bit consumers
// with the FP8 kernel's tile scales (k_descale into the scores, v_descale into O).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "flash_hopper/mask.h"
#include "flash_hopper/register_ops.h"  // apply_softcap, apply_mask
#include "sm90/common/barriers.h"
#include "sm90/common/utils.h"
#include "sm90/fwd/barriers.h"
#include "sm90/fwd/consumer_policies.h"
#include "sm90/fwd/epilogue.h"
#include "sm90/fwd/fp8_layout.h"
#include "sm90/fwd/params.h"
#include "sm90/fwd/schedule.h"
#include "sm90/fwd/softmax.h"
#include "sm90/fwd/tile_slot.h"
#include "sm90/fwd/timeline.h"

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
  static constexpr int kHeadDimV = Traits::kHeadDimV;  // O's columns
  using TiledMmaQK = typename Traits::TiledMmaQK;
  using TiledMmaPV = typename Traits::TiledMmaPV;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr bool kFp8 = Traits::kFp8;
  // FP8: an eager max and p offset by 2^8 (softmax.h: every block's largest p exact in e4m3)
  using Softmax = conditional_t<kFp8, OnlineSoftmax<2, /*kMaxStaleLog2=*/0, /*kOffsetLog2=*/8>,
                                OnlineSoftmax</*kRows=*/2>>;
  static constexpr int kPvParts = Traits::kPvParts;
  // The policies (consumer_policies.h).
  using Scales = conditional_t<kFp8, HeldTileScales,
                               conditional_t<Traits::kScaled, ReloadedTileScales, CallScales>>;
  static constexpr int kPvFoldEvery = Traits::kPvFoldEvery;
  static constexpr int kConsumerThreads = Traits::kConsumerThreads;
  using Pv = conditional_t<
      !kFp8, PvIntoO,
      conditional_t<!Traits::kOverlap, PvTwoLevelSequential<kPvParts>,
                    conditional_t<(kPvFoldEvery > 0),
                                  PvFoldedToShared<kPvFoldEvery, Traits::kFoldFp16>, PvTwoLevel>>>;
  using QEnd = ConsumerEnd<typename Traits::QPipe, SmemBarriers<typename Traits::QPipe>>;
  using KVEnd = ConsumerEnd<typename Traits::KVPipe, SmemBarriers<typename Traits::KVPipe>>;
  // The PV GEMM's B operand comes from the producer (16-bit) or the transposer (FP8).
  using VSpec = conditional_t<kFp8, typename Traits::VtPipe, typename Traits::KVPipe>;
  using VEnd = ConsumerEnd<VSpec, SmemBarriers<VSpec>>;

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
  VEnd v_pipe;
  // This consumer's warpgroup (0 .. kConsumerWgs - 1), read once where the tile holds it
  // (Traits::kHoldWgIndex, tile_config.h), else derived again where used.
  int wg_held;
  TileSlotReader<Traits> slot;  // the producer's tiles (tile_slot.h)
  Timeline timeline;  // FH_TIMELINE builds only (timeline.h)

  static CUTE_DEVICE SmemBarriers<VSpec> v_barriers(SharedStorage& smem) {
    if constexpr (kFp8) {
      return {smem.fp8.vt_full, smem.fp8.vt_empty};
    } else {
      return {smem.v_full, smem.v_empty};
    }
  }
  static CUTE_DEVICE auto* vt_data(SharedStorage& smem) {
    if constexpr (kFp8) {
      return smem.fp8.vt.data();
    } else {
      return smem.v.data();
    }
  }

  CUTE_DEVICE Consumer(KernelParams<Traits> const& params_, SharedStorage& smem_)
      : params(params_),
        p(params_.fwd),
        smem(smem_),
        q_pipe{{smem_.q_full, smem_.q_empty}},
        k_pipe{{smem_.k_full, smem_.k_empty}},
        v_pipe{v_barriers(smem_)},
        wg_held(cutlass::canonical_warp_group_idx() - 1),
        timeline(params_.fwd.timeline) {}

  CUTE_DEVICE int take_tile() { return slot.take(smem); }

  // The tile's sequence span (q_start, seqlen_q, seqlen_k), loaded where it is used rather than
  // kept in the tile state across the steps (register pressure): dense calls take the call's
  // lengths from the params, varlen calls the pair's record.
  CUTE_DEVICE TileCoord spanned(TileCoord t) const {
    if constexpr (Traits::kVarlen) {
      VarlenPair const& v = params.scheduler.pairs[t.pair];
      t.q_start = v.q_start;
      t.seqlen_q = v.seqlen_q;
      t.seqlen_k = v.seqlen_k;
    } else {
      t.q_start = 0;
      t.seqlen_q = p.seqlen_q;
      t.seqlen_k = p.seqlen_k;
    }
    return t;
  }

  static CUTE_DEVICE int thread_idx() { return opaque_thread_idx() - 128; }
  // The epilogue's O staging buffer (kernel_traits.h: kOPasses > 0; FP8 with the fold: the fold
  // copy, each warpgroup's slab), else null.
  CUTE_DEVICE uint8_t* o_stage() const {
    if constexpr (Traits::kOStageInFold) {
      return reinterpret_cast<uint8_t*>(smem.o_fold.o.data());
    } else if constexpr (Traits::kOPasses > 0) {
      return smem.o_stage.o.data();
    } else {
      return nullptr;
    }
  }
  // This warpgroup's slab of the FP8 fold copy (PvFoldedToShared).
  CUTE_DEVICE float* o_fold_slab() const {
    return reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(smem.o_fold.o.data()) +
                                    wg() * Traits::kOFoldSlabBytes);
  }
  CUTE_DEVICE PingPong<Traits::kConsumerWgs> pingpong() const {
    return {params.pingpong, wg()};
  }
  CUTE_DEVICE int wg() const {
    if constexpr (Traits::kHoldWgIndex) {
      __builtin_assume(wg_held >= 0 && wg_held < Traits::kConsumerWgs);
      return wg_held;
    } else {
      return cutlass::canonical_warp_group_idx() - 1;
    }
  }
  // The one thread per warpgroup that arrives on empty barriers (PipelineSpec::kEmptyArrivals),
  // derived at each release: held as a predicate it saved 4 instructions per step but let ptxas
  // move the PV GEMM's wait above every exponential of the row (bench/PERFLOG.md).
  static CUTE_DEVICE bool wg_leader() { return thread_idx() % 128 == 0; }

  // Shared-memory descriptors depend on the warpgroup only: slicing with its first thread, a
  // warp-uniform value, lets them live in uniform registers.
  CUTE_DEVICE int wg_first_thread() const { return wg() * 128; }
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
    Tensor sVt = make_tensor(make_smem_ptr(vt_data(smem)), typename Traits::SmemLayoutVt{});
    return mma_pv.get_thread_slice(wg_first_thread()).partition_fragment_B(sVt);
  }
  CUTE_DEVICE auto v_stage() { return tOrV()(_, _, _, v_pipe.stage()); }
  // Head-dim part kPart of a PV GEMM in parts (MMA_N = kPvParts atoms of d / kPvParts columns):
  // the V^T stage's rows (MMA, 1, MMA_K) and O's columns (MMA, MMA_M, 1).
  template <int kPart>
  CUTE_DEVICE auto v_part() {
    Tensor b = v_stage();
    return make_tensor(b(_, kPart, _).data(),
                       make_layout(layout<0>(b), Layout<_1>{}, layout<2>(b)));
  }
  template <int kPart, class TensorO>
  static CUTE_DEVICE auto o_part(TensorO& o) {
    return make_tensor(o(_, _, kPart).data(), make_layout(layout<0>(o), layout<1>(o), Layout<_1>{}));
  }

  // --- pipelines (the tile / step arguments name what the schedule expects; the host test
  //     checks them, the kernel needs only the pipeline state) ----------------------------------
  CUTE_DEVICE void wait_q(TileWork const&) { q_pipe.wait(); }
  CUTE_DEVICE void release_q(TileWork const&) { q_pipe.release(wg_leader()); }
  CUTE_DEVICE void wait_k(TileWork const&, KeyStep) {
    timeline.mark(Ev::kKWait);
    k_pipe.wait();
    timeline.mark(Ev::kKReady);
  }
  CUTE_DEVICE void release_k(TileWork const&, KeyStep) { k_pipe.release(wg_leader()); }
  CUTE_DEVICE void wait_v(TileWork const&, KeyStep) {
    timeline.mark(Ev::kVWait);
    v_pipe.wait();
    timeline.mark(Ev::kVReady);
  }
  CUTE_DEVICE void release_v(TileWork const&, KeyStep) { v_pipe.release(wg_leader()); }

  CUTE_DEVICE void turn_start() const { pingpong().start(); }
  CUTE_DEVICE void turn_wait() {
    timeline.mark(Ev::kTurnWait);
    pingpong().wait_turn();
    timeline.mark(Ev::kTurn);
  }
  CUTE_DEVICE void turn_pass() const { pingpong().pass_turn(); }

  // P as the PV GEMM's A operand: 16-bit, the S accumulator re-read (acc_as_rs_a); FP8, one
  // k32 slice's 16 bytes per thread in the order of the m64k32 A fragment ((4, 2, 2): 4 slots,
  // rows +8, slots +16), filled by convert_p.
  using PLayout = conditional_t<
      kFp8, Layout<Shape<Shape<_4, _2, _2>, _1, Int<kBlockN / 32>>>,
      decltype(acc_as_rs_a(
          partition_fragment_C(TiledMmaQK{}, Shape<Int<kBlockM>, Int<kBlockN>>{}).layout()))>;
  using OFragment =
      decltype(partition_fragment_C(TiledMmaPV{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  // A two-level PV accumulator: one PV GEMM part's output.
  using OAccFragment = decltype(partition_fragment_C(
      TiledMmaPV{}, Shape<Int<kBlockM>, Int<kHeadDimV / kPvParts>>{}));

  // The register state of the tile(s) in flight: S (fp32), P (S converted, the PV GEMM's A
  // operand), O (fp32), the row statistics, and at a tile boundary the finishing tile's; the
  // policies' state: the PV GEMM's own accumulator, the held scales of the tile and the
  // finishing tile.
  struct TileState {
    decltype(partition_fragment_C(TiledMmaQK{}, Shape<Int<kBlockM>, Int<kBlockN>>{})) s;
    decltype(make_tensor<Element>(PLayout{})) p;
    OFragment o;
    typename Pv::template Acc<OAccFragment> o_acc;
    Softmax softmax;
    Softmax finishing;
    typename Scales::Held scales;
    typename Scales::Held finishing_scales;
    static_assert(decltype(size<2>(p))::value == kBlockN / (kFp8 ? 32 : 16),
                  "P as the PV A operand");

    CUTE_DEVICE auto s_rc() { return make_tensor(s.data(), acc_rowcol(s.layout())); }
    CUTE_DEVICE auto o_rc() { return make_tensor(o.data(), acc_rowcol(o.layout())); }
  };

  // --- GEMMs --------------------------------------------------------------------------------
  CUTE_DEVICE void issue_qk(TileState& f) {
    // S's previous values are dead here (P holds them since convert_p): without this the GEMM's
    // accumulator operands keep them alive until its issue, and ptxas packs FP8 P in S's
    // registers and moves it into the PV GEMM's operand with a PRMT per word. FP8 only: in the
    // 16-bit kernels it removes nothing (their P packs without PRMT), changes the d128 / d256
    // loops' register assignment only, and measured no gain there (bench/PERFLOG.md).
    if constexpr (kFp8) {
      forget(f.s);
    }
    wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_qk, tSrQ(), tSrK()(_, _, _, k_pipe.stage()), f.s);
    timeline.mark(Ev::kQkIssued);
  }
  CUTE_DEVICE void issue_pv(TileState& f) {
    Pv::issue(*this, f);
    timeline.mark(Ev::kPvIssued);
  }
  CUTE_DEVICE void issue_pv_and_wait(TileState& f) {
    static_assert(kPvParts == 1, "the overlapped schedule's drain; parts use complete_pv");
    Pv::issue_and_wait(*this, f);
    timeline.mark(Ev::kPvDone);
  }
  template <int kInFlight>
  CUTE_DEVICE void wait_gemms() {
    warpgroup_wait<kInFlight>();
    timeline.mark(kInFlight == 0 ? Ev::kGemmsDone : Ev::kSReady);
  }
  // The sequential schedule's end of a PV GEMM: until it completed (then, two-level, its
  // accumulator joins O, part by part).
  CUTE_DEVICE void complete_pv(TileState& f) {
    warpgroup_wait<0>();
    Pv::complete(*this, f);
    timeline.mark(Ev::kPvDone);
  }

  // --- softmax ------------------------------------------------------------------------------
  CUTE_DEVICE bool softcapped() const { return p.softcap != 0.f; }
  // Softcap (kCapped: the call's softcapped(); before the mask: a capped -inf would become
  // -softcap), then the window / causal / sequence-tail mask on masked blocks only.
  template <bool kMasked, bool kCapped>
  CUTE_DEVICE void transform(TileState& f, TileWork const& w, KeyStep step) {
    if constexpr (kCapped) {
      apply_softcap(f.s, p.softcap, Scales::softcap_prescale(*this, f.scales, w));
    }
    if constexpr (kMasked) {
      Tensor tScS = mma_qk.get_thread_slice(thread_idx())
                        .partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
      Tensor s_rc = f.s_rc();
      const TileCoord t = spanned(w.tile);
      apply_mask(s_rc, make_tensor(tScS.data(), acc_rowcol(tScS.layout())),
                 attention_mask(p, t.seqlen_q, t.seqlen_k),
                 w.tile.m_block * kBlockM, step.n * kBlockN);
    }
  }
  template <bool kFirst, bool kCheckInf>
  CUTE_DEVICE void softmax(TileState& f) {
    Tensor s_rc = f.s_rc();
    f.softmax.template update<kFirst, kCheckInf>(s_rc);
    timeline.mark(Ev::kSoftmaxDone);
  }
  // After the PV GEMM completed (two-level: its accumulator joins O first).
  CUTE_DEVICE void rescale_o(TileState& f) { Pv::rescale(*this, f); }
  CUTE_DEVICE void convert_p(TileState& f) {
    if constexpr (kFp8) {
      convert_p_fp8(f.s, f.p);
    } else {
      convert_into(f.s, f.p);
    }
    timeline.mark(Ev::kPReady);
    if constexpr (kPvFoldEvery > 0) {
      Pv::fold_if_due(*this, f);  // S is dead here: the fold's registers are free
    }
  }

  // S (fp32, ((2, 2, N/8), 1, 1)) -> P (e4m3, ((4, 2, 2), 1, N/32)) without moving values
  // between threads (fp8_layout.h): in k32 slice kk register j of the A fragment takes the four
  // accumulator values p_source(kk, j, 0..3), whose keys are the ones the V^T buffer holds at
  // that register's slots (j = 0: d0 d1 d4 d5, 1: d2 d3 d6 d7, 2: d8 d9 d12 d13, 3: d10 d11 d14
  // d15 of the slice's 16 values).
  template <class TensorS, class TensorP>
  static CUTE_DEVICE void convert_p_fp8(TensorS const& s, TensorP& p_frag) {
    static_assert(decltype(size(s))::value == kBlockN / 2 &&
                  decltype(size(p_frag))::value == kBlockN / 2);
    Tensor p_words = recast<uint32_t>(p_frag);
    cutlass::NumericArrayConverter<Element, float, 4> convert;
    CUTE_UNROLL
    for (int kk = 0; kk < kBlockN / 32; ++kk) {
      CUTE_UNROLL
      for (int j = 0; j < 4; ++j) {
        cutlass::Array<float, 4> v;
        CUTE_UNROLL
        for (int b = 0; b < 4; ++b) {
          v[b] = s(p_source(kk, j, b));
        }
        const cutlass::Array<Element, 4> packed = convert(v);
        p_words(4 * kk + j) = reinterpret_cast<uint32_t const&>(packed);
      }
    }
  }

  // --- tiles --------------------------------------------------------------------------------
  CUTE_DEVICE void start_tile(TileState& f, TileWork const& w) {
    Scales::load(*this, f.scales, w);
    f.softmax = Softmax(Scales::scale_log2(*this, f.scales, w));
    Pv::clear(*this, f);
    clear(f.o);
  }
  // At a tile boundary, before w's first S is transformed: held scales (the softcap factor among
  // them) are w's from here, the finishing tile's go aside (the other policies hold nothing; the
  // statistics move in begin_next_tile, after the transform, where the d192 kernel has the
  // registers).
  CUTE_DEVICE void begin_next_scales(TileState& f, TileWork const& w) {
    f.finishing_scales = f.scales;
    Scales::load(*this, f.scales, w);
  }
  CUTE_DEVICE void begin_next_tile(TileState& f, TileWork const& w) {
    f.finishing = f.softmax;
    f.softmax = Softmax(Scales::scale_log2(*this, f.scales, w));
  }
  CUTE_DEVICE void clear_o(TileState& f) {
    clear(f.o);
    Pv::clear(*this, f);
  }
  // The output's element type: FP8 kernels store 16-bit O (FwdParams::o_fp16), the others their
  // input's. fn(OutElement{}).
  template <class Fn>
  CUTE_DEVICE void with_output_element(Fn&& fn) const {
    if constexpr (kFp8) {
      if (p.o_fp16) {
        fn(cutlass::half_t{});
      } else {
        fn(cutlass::bfloat16_t{});
      }
    } else {
      fn(Element{});
    }
  }
  // O / l, LSE and the stores of tile w; kPrevious: w is the tile finishing at a boundary.
  template <bool kPrevious>
  CUTE_DEVICE void finish(TileState& f, TileWork const& w) {
    Pv::before_epilogue(*this, f);
    const EpilogueScales sc =
        Scales::epilogue(*this, kPrevious ? f.finishing_scales : f.scales, w);
    Tensor o_rc = f.o_rc();
    float lse[2];
    (kPrevious ? f.finishing : f.softmax).finalize(o_rc, sc.lse_scale, lse);
    if constexpr (Scales::kScalesO) {
      CUTE_UNROLL
      for (int i = 0; i < size(f.o); ++i) {
        f.o(i) *= sc.o_scale;
      }
    }
    auto thr = mma_pv.get_thread_slice(thread_idx());
    with_output_element([&](auto out) {
      store_tile<decltype(out), Traits>(p, thr, f.o, lse, spanned(w.tile), o_stage());
    });
    timeline.mark(Ev::kTileDone);
  }
  CUTE_DEVICE void store_empty(TileWork const& w) {
    auto thr = mma_pv.get_thread_slice(thread_idx());
    with_output_element([&](auto out) {
      store_empty_tile<decltype(out), Traits>(p, thr, spanned(w.tile));
    });
  }
};

template <class Traits>
CUTE_DEVICE void consumer_loop(KernelParams<Traits> const& params,
                               typename Traits::SharedStorage& smem) {
  Consumer<Traits> consumer(params, smem);
  consume<Traits>(cta_schedule(params), consumer);
}

}  // namespace flash_hopper::sm90
