// Consumer warpgroups of the FA-3 path's backward (tile_config.h): the five GEMMs with
// WGMMA, P and dS (family A: in registers, dS also to shared memory for dQ; family B: both to
// shared memory), the dQ accumulation and the dK / dV epilogue. The order of every wait, GEMM,
// barrier and release is schedule.h's consume_bwd_wg(); this file supplies the operations.
//
// Per step (query head g, query block m) WG c, owning keys [64c, 64c + 64) of the tile, computes
//   S^T  = K_c Q^T            (64 keys x 64 queries, fp32)
//   P^T  = exp2(S^T * scale_log2 - lse_log2[q])    (softcap, element mask on masked steps)
//   dP^T = V_c dO^T ;  dS^T = P^T (dP^T - D[q])   (* (1 - tanh^2) with softcap)
//   dV_c += P^T dO ;  dK_c += dS^T Q              (RS: P^T, dS^T are the A operands)
//   dQ[:, cols of c] = dS K                       (SS: dS through shared memory, both WGs' keys;
//                                                  or dq_wgs = 1: dQ_c = dS_c K_c, own keys)
// and adds dQ to the fp32 accumulator in global memory (epilogue.h).
// Family B (d192 / d256, 64 x 64) computes S = Q K_c^T and dP = dO V_c^T for its 32 keys c, stores
// P and dS to shared memory, and after the PdS barrier computes head_dim columns
// [c D / 2, (c + 1) D / 2) of dV += P^T dO, dK += dS^T Q and dQ = dS K over all 64 keys / queries.
// The element math is shared: it runs on a (keys, queries) view of either accumulator.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include "flash_hopper/bwd_params.h"
#include "flash_hopper/mask.h"
#include "flash_hopper/register_ops.h"  // apply_softcap, convert_into
#include "sm90/bwd/epilogue.h"
#include "sm90/bwd/load.h"
#include "sm90/bwd/schedule.h"
#include "sm90/common/barriers.h"
#include "sm90/common/utils.h"

namespace flash_hopper::sm90 {

using namespace cute;

template <class Traits>
struct BwdConsumer {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kDqWgs = Traits::kDqWgs;
  static constexpr bool kFamilyB = Traits::kFamilyB;
  // dS from P's 16-bit copy (the dV GEMM's operand) instead of the fp32 exponentials, where the
  // fp32 P does not fit next to dP (128-query steps).
  static constexpr bool kDsFrom16BitP = kBlockM == 128;
  static constexpr bool kDqTransposed = Traits::kDqTransposed;
  static_assert(!kDsFrom16BitP || !Traits::kDvAfterDs, "dS after dV: P is 16-bit by then");
  // P and dS buffers of the P / dS array (kernel_traits.h): family A alternates dS over both.
  static constexpr int kPBuffer = 0;
  static constexpr int kdSBufferB = 1;
  using SdPShape = Shape<Int<Traits::kSdPRows>, Int<Traits::kSdPCols>>;
  using TiledMmaSdP = typename Traits::TiledMmaSdP;
  using TiledMmadKV = typename Traits::TiledMmadKV;
  using TiledMmadQ = typename Traits::TiledMmadQ;
  using SharedStorage = typename Traits::SharedStorage;
  using QPipe = typename Traits::QPipe;
  using KVPipe = typename Traits::KVPipe;
  using QEnd = ConsumerEnd<QPipe, SmemBarriers<QPipe>>;
  using KVEnd = ConsumerEnd<KVPipe, SmemBarriers<KVPipe>>;

  BwdKernelParams<Traits> const& params;
  BwdParams const& p;
  SharedStorage& smem;
  TiledMmaSdP mma_sdp;
  TiledMmadKV mma_dkv;
  TiledMmadQ mma_dq;
  QEnd q_pipe;
  QEnd do_pipe;
  KVEnd kv_pipe;
  int ds_stage = kFamilyB ? kdSBufferB : 0;  // the dS buffer of the step (family A alternates)
  int tiles_taken = 0;  // the tile slot's buffer of the next tile: tiles_taken % 2
  // This consumer warpgroup's index, derived once where the tile holds it (tile_config.h
  // hold_wg_index, and the deterministic kernels: at d128 fewer of its values spill so), else
  // derived again where used.
  int wg_held;

  CUTE_DEVICE BwdConsumer(BwdKernelParams<Traits> const& params_, SharedStorage& smem_)
      : params(params_),
        p(params_.bwd),
        smem(smem_),
        q_pipe{{smem_.q_full, smem_.q_empty}},
        do_pipe{{smem_.do_full, smem_.do_empty}},
        kv_pipe{{smem_.kv_full, smem_.kv_empty}},
        wg_held(cutlass::canonical_warp_group_idx() - 1) {}

  static CUTE_DEVICE int thread_idx() { return opaque_thread_idx() - 128; }
  static CUTE_DEVICE bool wg_leader() { return thread_idx() % 128 == 0; }
  // Shared-memory descriptors depend on the warpgroup only (uniform registers).
  CUTE_DEVICE int wg() const {
    if constexpr (Traits::kConfig.hold_wg_index || Traits::kDeterministic) {
      __builtin_assume(wg_held >= 0 && wg_held < Traits::kConsumerWgs);
      return wg_held;
    } else {
      return cutlass::canonical_warp_group_idx() - 1;
    }
  }
  CUTE_DEVICE int wg_first_thread() const { return wg() * 128; }

  // --- shared-memory operands (each buffer through the layout a GEMM reads it with) ------------
  template <class Layout, class T>
  static CUTE_DEVICE auto view(T* ptr) {
    return make_tensor(make_smem_ptr(ptr), Layout{});
  }
  CUTE_DEVICE auto sQ() { return view<typename Traits::SmemLayoutQStages>(smem.q.data()); }
  CUTE_DEVICE auto sdO() { return view<typename Traits::SmemLayoutQStages>(smem.dout.data()); }
  CUTE_DEVICE auto sQt() { return view<typename Traits::SmemLayoutQt>(smem.q.data()); }
  CUTE_DEVICE auto sdOt() { return view<typename Traits::SmemLayoutQt>(smem.dout.data()); }
  CUTE_DEVICE auto sK() { return view<typename Traits::SmemLayoutK>(smem.k.data()); }
  CUTE_DEVICE auto sV() { return view<typename Traits::SmemLayoutK>(smem.v.data()); }
  CUTE_DEVICE auto sKt() { return view<typename Traits::SmemLayoutKt>(smem.k.data()); }
  CUTE_DEVICE auto sdS() { return view<typename Traits::SmemLayoutdS>(smem.ds.data()); }
  CUTE_DEVICE auto sdSt() { return view<typename Traits::SmemLayoutdSt>(smem.ds.data()); }

  // --- register state of a tile ------------------------------------------------------------
  struct TileState {
    decltype(partition_fragment_C(TiledMmaSdP{}, SdPShape{})) s;
    decltype(partition_fragment_C(TiledMmaSdP{}, SdPShape{})) dp;
    decltype(make_tensor<Element>(s.layout())) pt;  // P (16-bit): family A the dV GEMM's A operand
    decltype(make_tensor<Element>(s.layout())) dst;  // dS (16-bit): family A the dK GEMM's A
    decltype(partition_fragment_C(TiledMmadKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{})) dv;
    decltype(partition_fragment_C(TiledMmadKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{})) dk;
    decltype(partition_fragment_C(TiledMmadQ{}, typename Traits::DqShape{})) dq;
    // One m64 atom per WG: the RS view keeps the accumulator's register order (acc_as_rs_a).
    static_assert(decltype(size<1>(s))::value == 1 && decltype(size<2>(s))::value == 1);
  };
  template <class T>
  static CUTE_DEVICE auto rs_a(T& t) {
    return make_tensor(t.data(), acc_as_rs_a(t.layout()));
  }

  // --- pipelines -----------------------------------------------------------------------------
  CUTE_DEVICE void wait_kv(BwdTileWork const&) { kv_pipe.wait(); }
  // The tile slot (kernel.h, TileSlot): the producer's next tile; false at the end of the walk.
  CUTE_DEVICE bool take_tile(BwdTileWork& w) {
    named_barrier_sync_unaligned(static_cast<uint32_t>(BwdBarrier::kTileSlot), kTileSlotThreads);
    PublishedTile const& tile = smem.tile[tiles_taken % 2];
    ++tiles_taken;
    w = tile.work;
    return !tile.end;
  }
  CUTE_DEVICE void release_kv(BwdTileWork const&) { kv_pipe.release(wg_leader()); }
  // The current tile's sequence (where its rows are, its lengths), read from its tile-slot buffer
  // where a step needs a field of it: volatile, so that nothing of it is held in registers
  // across the steps. The buffer holds the tile until the next take_tile.
  CUTE_DEVICE int span_field(int BwdSpan::*field) const {
    BwdSpan const& span = smem.tile[(tiles_taken + 1) % 2].work.span;
    return *static_cast<volatile int const*>(&(span.*field));
  }
  CUTE_DEVICE BwdSpan tile_span() const {
    return {span_field(&BwdSpan::batch),    span_field(&BwdSpan::q_start),
            span_field(&BwdSpan::k_start),  span_field(&BwdSpan::seqlen_q),
            span_field(&BwdSpan::seqlen_k), span_field(&BwdSpan::ws_row0)};
  }
  // The call's mask on the tile's sequence (varlen: its own lengths).
  CUTE_DEVICE AttentionMask tile_mask() const {
    AttentionMask mask = attention_mask(p);
    mask.seqlen_q = span_field(&BwdSpan::seqlen_q);
    mask.seqlen_k = span_field(&BwdSpan::seqlen_k);
    return mask;
  }
  CUTE_DEVICE void wait_q(BwdTileWork const&, QueryStep) { q_pipe.wait(); }
  CUTE_DEVICE void release_q(BwdTileWork const&, QueryStep) {
    q_pipe.release(wg_leader());
    if constexpr (!kFamilyB) {
      ds_stage ^= 1;  // the step ends here for this WG (schedule.h)
    }
  }
  CUTE_DEVICE void wait_dout(BwdTileWork const&, QueryStep) { do_pipe.wait(); }
  CUTE_DEVICE void release_dout(BwdTileWork const&, QueryStep) { do_pipe.release(wg_leader()); }

  // --- GEMMs (common/utils.h forget(): a zero-initializing GEMM's accumulator is not live) ------

  // S^T = K Q^T (family A) or S = Q K^T (family B); dP alike with V and dO.
  template <class TensorKV, class TensorQ, class TensorAcc>
  CUTE_DEVICE void issue_sdp(TensorKV const& kv, TensorQ const& q, TensorAcc& acc) {
    // Family B measured slower with it (bench/PERFLOG.md "v9 (kept): decoupled warpgroups").
    if constexpr (!kFamilyB) {
      forget(acc);
    }
    auto thr = mma_sdp.get_thread_slice(wg_first_thread());
    if constexpr (kFamilyB) {
      wgmma</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, thr.partition_fragment_A(q),
                                               thr.partition_fragment_B(kv), acc);
    } else {
      wgmma<true, -1>(mma_sdp, thr.partition_fragment_A(kv), thr.partition_fragment_B(q), acc);
    }
  }
  CUTE_DEVICE void issue_s(TileState& f) { issue_sdp(sK(), sQ()(_, _, q_pipe.stage()), f.s); }
  CUTE_DEVICE void issue_dp(TileState& f) {
    issue_sdp(sV(), sdO()(_, _, do_pipe.stage()), f.dp);
  }
  // dV += P^T dO and dK += dS^T Q: A from registers (family A) or from the P / dS buffer's
  // transposed view (family B).
  template <class TensorRegs, class TensorB, class TensorAcc>
  CUTE_DEVICE void issue_dkv(TensorRegs& a_regs, int buffer, TensorB const& b, TensorAcc& acc) {
    auto thr = mma_dkv.get_thread_slice(wg_first_thread());
    if constexpr (kFamilyB) {
      wgmma<false, -1>(mma_dkv, thr.partition_fragment_A(sdSt()(_, _, buffer)),
                       thr.partition_fragment_B(b), acc);
    } else {
      auto a = rs_a(a_regs);
      wgmma<false, -1>(mma_dkv, a, thr.partition_fragment_B(b), acc);
    }
  }
  CUTE_DEVICE void issue_dv(TileState& f) {
    issue_dkv(f.pt, kPBuffer, sdOt()(_, _, do_pipe.stage()), f.dv);
  }
  CUTE_DEVICE void issue_dk(TileState& f) {
    issue_dkv(f.dst, ds_stage, sQt()(_, _, q_pipe.stage()), f.dk);
  }
  // kDqWgs == 2: WG c computes columns [c D / 2, (c + 1) D / 2) of dQ = dS K (128-query steps:
  // rows [64c, 64c + 64)) over all the tile's keys (both WGs' dS halves); the tiled MMA's atom
  // layout places it. kDqWgs == 1 (d96): WG c computes the partial dQ of its own 64 keys,
  // dS_c K_c, over all D columns, and both add into the same accumulator block.
  CUTE_DEVICE void issue_dq(TileState& f) {
    if constexpr (!kFamilyB) {
      forget(f.dq);
    }
    if constexpr (kDqTransposed) {  // dQ^T = K^T dS^T: WG c rows [c D / 2, ...) of dQ^T
      auto thr = mma_dq.get_thread_slice(wg_first_thread());
      wgmma<true, -1>(mma_dq, thr.partition_fragment_A(sKt()),
                      thr.partition_fragment_B(sdS()(_, _, ds_stage)), f.dq);
    } else if constexpr (kDqWgs == 2) {
      auto thr = mma_dq.get_thread_slice(wg_first_thread());
      wgmma<true, -1>(mma_dq, thr.partition_fragment_A(sdS()(_, _, ds_stage)),
                      thr.partition_fragment_B(sKt()), f.dq);
    } else {
      const int c = wg();
      auto thr = mma_dq.get_thread_slice(0);
      Tensor a = local_tile(sdS()(_, _, ds_stage), Shape<Int<kBlockM>, _64>{}, make_coord(0, c));
      Tensor b = local_tile(sKt(), Shape<Int<kHeadDim>, _64>{}, make_coord(0, c));
      wgmma<true, -1>(mma_dq, thr.partition_fragment_A(a), thr.partition_fragment_B(b), f.dq);
    }
  }
  template <int kInFlight>
  CUTE_DEVICE void wait_gemms() {
    warpgroup_wait<kInFlight>();
  }

  // --- the rows' statistics ----------------------------------------------------------------------
  // The step's lse_log2 rows ride on its Q stage and its D rows on its dO stage (load.h): read
  // between the stage's wait and its release.
  // Read where the element math uses them: a volatile load, which ptxas does not hoist above the
  // step's GEMM waits (hoisted, a column's value per register across the waits, the d64 step
  // spilled).
  struct StatRows {
    uint32_t base;  // shared-memory address of the step's rows
    CUTE_DEVICE float at(int q) const {
      float v;
      asm volatile("ld.volatile.shared.f32 %0, [%1];" : "=f"(v) : "r"(base + 4u * q));
      return v;
    }
    CUTE_DEVICE float2 pair(int q) const {  // rows q, q + 1 (q even)
      float2 v;
      asm volatile("ld.volatile.shared.v2.f32 {%0, %1}, [%2];"
                   : "=f"(v.x), "=f"(v.y)
                   : "r"(base + 4u * q));
      return v;
    }
  };
  // The statistic of column c (query q) of the keys_queries view. Family A's columns come in
  // pairs of adjacent queries, (2k, 2k + 1) -> (q, q + 1) with q even (the accumulator's layout:
  // a thread holds columns 2 (lane % 4) + {0, 1} of every 8): one 8-byte load at the pair's
  // first column, except with 128-query steps, whose masked step spilled with the pairs' second
  // values live (one load each there, as in family B, whose columns are the accumulator's rows).
  // c is a compile-time constant of an unrolled loop, so the branches fold.
  template <bool kPaired = !kFamilyB && kBlockM != 128>
  struct ColumnStat {
    StatRows rows;
    float2 pair = {};
    CUTE_DEVICE float operator()(int c, int q) {
      if constexpr (!kPaired) {
        return rows.at(q);
      } else {
        if (c % 2 == 0) {
          pair = rows.pair(q);
        }
        return c % 2 == 0 ? pair.x : pair.y;
      }
    }
  };
  CUTE_DEVICE StatRows lse_rows() {
    return {static_cast<uint32_t>(__cvta_generic_to_shared(smem.lse.data())) +
            q_pipe.stage() * uint32_t(Traits::kStatsStage * sizeof(float))};
  }
  CUTE_DEVICE StatRows dpsum_rows() {
    return {static_cast<uint32_t>(__cvta_generic_to_shared(smem.dpsum.data())) +
            do_pipe.stage() * uint32_t(Traits::kStatsStage * sizeof(float))};
  }

  // --- element math ------------------------------------------------------------------------------
  // An S-shaped accumulator (S, dP, P) as (keys, queries): family A's S^T as it is, family B's S
  // transposed, so the element math below is one loop for both.
  template <class TensorAcc>
  static CUTE_DEVICE auto keys_queries(TensorAcc&& t) {
    auto rc = acc_rowcol(t.layout());
    if constexpr (kFamilyB) {
      return make_tensor(t.data(), select<1, 0>(rc));
    } else {
      return make_tensor(t.data(), rc);
    }
  }
  // The (key, query) of each element inside the tile, in the keys_queries view.
  CUTE_DEVICE auto coords_kq() {
    Tensor c = mma_sdp.get_thread_slice(thread_idx())
                   .partition_C(make_identity_tensor(SdPShape{}));
    return keys_queries(c);
  }
  template <class Coord>
  static CUTE_DEVICE int key_of(Coord const& c) {
    return get<kFamilyB ? 1 : 0>(c);
  }
  template <class Coord>
  static CUTE_DEVICE int query_of(Coord const& c) {
    return get<kFamilyB ? 0 : 1>(c);
  }

  // Whether the call caps its scores: the kCapped of every step's code (schedule.h).
  CUTE_DEVICE bool softcapped() const { return p.softcap != 0.f; }
  // Softcap (kCapped: the call's softcapped()) before the mask, as in the forward.
  template <bool kCapped>
  CUTE_DEVICE void softcap(TileState& f) {
    if constexpr (kCapped) {
      apply_softcap(f.s, p.softcap, p.softcap_prescale);
    }
  }
  // The element mask on masked steps, then P^T = exp2(score * scale_log2 - lse_log2).
  // A query column's visible keys are computed once per column (AttentionMask::columns); the key
  // tail is part of it (hi <= seqlen_k).
  template <bool kMasked>
  CUTE_DEVICE void transform(TileState& f, BwdTileWork const& w, QueryStep s) {
    Tensor s_rc = keys_queries(f.s);
    Tensor c_rc = coords_kq();
    ColumnStat<> lse{lse_rows()};
    const int key0 = w.tile.n_block * kBlockN;
    AttentionMask mask{};
    if constexpr (kMasked) {
      mask = tile_mask();
    }
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s_rc); ++c) {
      const int q = query_of(c_rc(0, c));
      const float col_lse = lse(c, q);
      if constexpr (kMasked) {
        const ColumnRange keys = mask.columns(s.m * kBlockM + q);
        CUTE_UNROLL
        for (int r = 0; r < size<0>(s_rc); ++r) {
          const int key = key0 + key_of(c_rc(r, c));
          if (key < keys.lo || key >= keys.hi) {
            s_rc(r, c) = -INFINITY;
          }
        }
      }
      CUTE_UNROLL
      for (int r = 0; r < size<0>(s_rc); ++r) {
        s_rc(r, c) = exp2f(s_rc(r, c) * p.scale_log2 - col_lse);
      }
    }
  }
  // P -> 16 bit: family A's dV A operand, family B's sP.
  CUTE_DEVICE void convert_p(TileState& f) { convert_into(f.s, f.pt); }

  // dS^T = P^T (dP^T - D) [* (1 - t^2) if kCapped (the call's softcapped()), t recovered from P
  // as on the FA-2 path: score * log2(e) = log2(P) + lse_log2], -> 16 bit, -> shared memory
  // (q-major, for dQ).
  // P comes from the fp32 scores' registers, or with 128-query steps from its 16-bit copy (the dV
  // GEMM's operand): keeping the fp32 P across the dP wait as well is 64 registers more than
  // the budget has there (ptxas then serializes every wgmma, C7512).
  template <bool kCapped>
  CUTE_DEVICE void compute_ds(TileState& f, BwdTileWork const&, QueryStep) {
    Tensor p_rc = [&] {
      if constexpr (kDsFrom16BitP) {
        return keys_queries(f.pt);  // 16-bit
      } else {
        return keys_queries(f.s);  // fp32
      }
    }();
    Tensor dp_rc = keys_queries(f.dp);
    Tensor c_rc = coords_kq();
    ColumnStat<> lse{lse_rows()};
    ColumnStat<> dpsum{dpsum_rows()};
    const float t_scale = kCapped ? 0.6931471805599453f / p.softcap : 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(p_rc); ++c) {
      const int q = query_of(c_rc(0, c));
      const float col_dpsum = dpsum(c, q);
      const float col_lse = kCapped ? lse(c, q) : 0.f;
      CUTE_UNROLL
      for (int r = 0; r < size<0>(p_rc); ++r) {
        const float prob = static_cast<float>(p_rc(r, c));
        float ds = prob * (dp_rc(r, c) - col_dpsum);
        if constexpr (kCapped) {
          const float t = (__log2f(prob) + col_lse) * t_scale;
          ds = prob > 0.f ? ds * (1.f - t * t) : 0.f;
        }
        dp_rc(r, c) = ds;
      }
    }
    convert_into(f.dp, f.dst);
    store_sdp(f.dst, ds_stage);
  }

  // A 16-bit S-shaped fragment (dS, or family B's P) -> buffer `buffer` of the P / dS array
  // through the view the accumulator indexes, 16-byte stmatrix rows.
  template <class TensorFrag>
  CUTE_DEVICE void store_sdp(TensorFrag const& frag, int buffer) {
    typename Traits::R2SCopydS r2s;
    auto thr = r2s.get_thread_slice(thread_idx());
    Tensor s = view<typename Traits::SmemLayoutdSAcc>(smem.ds.data());
    Tensor dst = thr.partition_D(as_position_independent_swizzle_tensor(s(_, _, buffer)));
    copy(r2s, thr.retile_S(frag), dst);
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> the WGMMA's reads
  }
  // Family B: this WG's half of P (its 32 keys) for dV's SS GEMM.
  CUTE_DEVICE void store_p(TileState& f, BwdTileWork const&, QueryStep) {
    store_sdp(f.pt, kPBuffer);
  }

  // --- barriers --------------------------------------------------------------------------------
  // Both WGs' dS are in buffer ds_stage. Two buffers make this one sync per step enough: a WG
  // writes buffer b again two steps later, after passing the next step's sync, which the other WG
  // reaches only after its dQ GEMM of this step (the last reader of b) completed.
  // With kDqWgs == 1 (each WG's dQ reads only its own dS half) the sync is the WG's own: the WGs
  // then share nothing within a step and drift apart as far as the Q / dO stages let them, so one
  // WG's exponentials run under the other's GEMMs (barrier id kWg0 + c, which the WG's DqSlot
  // sync shares: the same 128 threads, one use at a time).
  CUTE_DEVICE void sync_pds() {
    if constexpr (kDqWgs == 1 && !kFamilyB) {
      cutlass::arch::NamedBarrier::sync(
          128, static_cast<uint32_t>(BwdBarrier::kWg0) + wg());
    } else {
      cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads,
                                        static_cast<uint32_t>(BwdBarrier::kPdS));
    }
  }
  // Family B's single P and dS buffers: both WGs' GEMMs of the previous step (their readers)
  // completed before either WG overwrites them (each WG arrives after its wait_gemms<0>).
  CUTE_DEVICE void sync_pds_free() {
    cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads,
                                      static_cast<uint32_t>(BwdBarrier::kPdSFree));
  }

  // --- dQ (the order of these: schedule.h add_dq) ------------------------------------------------
  CUTE_DEVICE float* dq_block(BwdTileWork const& w, QueryStep s) {
    const int head = w.dq_head(s);
    return p.dq_accum +
           (int64_t(w.dq_row0) + int64_t(head) * p.seqlen_q_rounded + s.m * kBlockM) * kHeadDim;
  }
  // The deterministic kernel (slot families), or the call's flag (bwd/kernel_traits.h).
  CUTE_DEVICE bool deterministic() const { return Traits::kDeterministic || p.deterministic; }
  // This WG's dQ slot in shared memory.
  struct DqSlot {
    int wg;
    float* floats;
  };
  CUTE_DEVICE DqSlot dq_slot() {
    const int c = wg();
    return {c, smem.dq_slot.data() + c * Traits::kDqWgFloats};
  }
  // The WG leader's previous bulk reduce-add has read its dQ slot.
  CUTE_DEVICE void wait_dq_slot_read() {
    if (wg_leader()) {
      bulk_wait_read();
    }
  }
  // This WG's dQ part into its slot, handed to the async proxy.
  CUTE_DEVICE void stage_dq(TileState& f, DqSlot const& slot) {
    stage_dq_fragment<Traits>(slot.floats, f.dq, thread_idx());
    cutlass::arch::fence_view_async_shared();
  }
  CUTE_DEVICE void sync_dq_slot(DqSlot const& slot) {
    cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(BwdBarrier::kWg0) + slot.wg);
  }
  CUTE_DEVICE void reduce_dq_slot(float* acc, DqSlot const& slot) {
    if (wg_leader()) {
      bulk_reduce_add_f32(acc + (kDqWgs == 2 ? slot.wg * Traits::kDqWgFloats : 0), slot.floats,
                          Traits::kDqWgFloats * sizeof(float));
    }
  }
  CUTE_DEVICE void finish_dq() {
    if (wg_leader()) {
      bulk_wait_all();
    }
  }
  CUTE_DEVICE void add_dq(TileState& f, float* acc) {
    add_dq_fragment<Traits>(acc, f.dq, thread_idx());
  }
  CUTE_DEVICE void fence_dq() { __threadfence(); }
  // Deterministic mode: the block's semaphore and the rank of this tile's key block on it.
  CUTE_DEVICE bool is_wg(int c) const { return wg() == c; }
  struct DqTurn {
    int* semaphore;
    int rank;
  };
  CUTE_DEVICE DqTurn dq_turn(BwdTileWork const& w, QueryStep s) {
    const int head = w.dq_head(s);
    return {p.semaphores +
                (int64_t(w.dq_row0) + int64_t(head) * p.seqlen_q_rounded + s.m * kBlockM) /
                    kBwdSemaphoreRows,
            dq_rank<Traits::kDeterministic>(params.tiles, tile_mask(), s.m, w.tile, kBlockM,
                                             kBlockN)};
  }
  CUTE_DEVICE void wait_dq_turn(DqTurn const& t) {
    if (thread_idx() == 0) {
      while (load_acquire_gpu(t.semaphore) != t.rank) {
      }
    }
  }
  CUTE_DEVICE void sync_dq_turn() {
    // Both WGs add to every block.
    cutlass::arch::NamedBarrier::sync(Traits::kConsumerThreads,
                                      static_cast<uint32_t>(BwdBarrier::kDqTurn));
  }
  CUTE_DEVICE void pass_dq_turn(DqTurn const& t) {
    if (thread_idx() == 0) {
      atomicAdd(t.semaphore, 1);
    }
  }
  // The deterministic kernel: the WG's part goes into its slot once the dQ writer warp's
  // reduce-adds of the previous step read both slots (dq_free), and WG 0's leader publishes the
  // step's record; the writer adds the parts in the block's turn (BwdDqWriter). The consumers
  // never wait for a turn or an add.
  int dq_parts = 0;  // parts (and the walk's end) this WG published
  CUTE_DEVICE void wait_dq_slot_free() {
    smem.dq_free[0].wait(uint32_t((dq_parts & 1) ^ 1));
  }
  CUTE_DEVICE void publish_dq(float* acc, DqTurn const& t) {
    if (wg_leader() && wg() == 0) {
      smem.dq_staged.acc = acc;
      smem.dq_staged.semaphore = t.semaphore;
      smem.dq_staged.rank = t.rank;
      smem.dq_staged.end = 0;
    }
    arrive_dq_staged();
  }
  CUTE_DEVICE void publish_dq_end() {
    if (wg_leader() && wg() == 0) {
      smem.dq_staged.end = 1;
    }
    arrive_dq_staged();
  }
  CUTE_DEVICE void arrive_dq_staged() {
    ++dq_parts;
    cutlass::arch::NamedBarrier::arrive(Traits::kDqStagedThreads,
                                        static_cast<uint32_t>(BwdBarrier::kDqStaged0) + wg());
  }

  // --- tiles -----------------------------------------------------------------------------------
  CUTE_DEVICE void clear_dkv(TileState& f) {
    clear(f.dv);
    clear(f.dk);
  }
  CUTE_DEVICE void store_dkv(TileState& f, BwdTileWork const& w) {
    store_dkv_tile<Traits>(p, mma_dkv.get_thread_slice(thread_idx()), f.dk, f.dv, w.tile,
                           tile_span());
  }
  CUTE_DEVICE void store_zero(BwdTileWork const& w) {
    store_zero_dkv_tile<Traits>(p, mma_dkv.get_thread_slice(thread_idx()), w.tile, tile_span());
  }
};

// The deterministic kernel's dQ writer: warp 1 of the producer WG (schedule.h write_dq_bwd).
// Lane 0 waits for the turns, issues the bulk reduce-adds and passes the turns; with dq_wgs = 1
// the whole warp first adds WG 1's slot into WG 0's (both WGs' partials of the same positions:
// one reduce-add of their sum, in one fixed order).
template <class Traits>
struct BwdDqWriter {
  static constexpr int kDqWgs = Traits::kDqWgs;
  using StagedDq = typename Traits::StagedDq;
  typename Traits::SharedStorage& smem;

  static constexpr int kThreads = 32 * Traits::kDqWriterWarps;
  // Thread t of the writer warps (warp 1 lane 0 is t = 0).
  static CUTE_DEVICE int thread() { return int(threadIdx.x) - 32; }
  // Warp 1's lane 0 waits for the turn, issues the adds, frees the slots and passes the turn.
  static CUTE_DEVICE bool lane0() { return thread() == 0; }
  CUTE_DEVICE StagedDq wait_staged() {
    CUTE_UNROLL
    for (int c = 0; c < Traits::kConsumerWgs; ++c) {
      named_barrier_sync(static_cast<uint32_t>(BwdBarrier::kDqStaged0) + c,
                         Traits::kDqStagedThreads);
    }
    StagedDq part;
    part.acc = smem.dq_staged.acc;
    part.semaphore = smem.dq_staged.semaphore;
    part.rank = smem.dq_staged.rank;
    part.end = smem.dq_staged.end;
    return part;
  }
  static CUTE_DEVICE bool walk_ended(StagedDq const& part) { return part.end != 0; }
  CUTE_DEVICE void combine_slots() {
    static_assert(Traits::kDqWriterWarps > 1, "the slot sum is the three writer warps'");
    float4* into = reinterpret_cast<float4*>(smem.dq_slot.data());
    float4 const* from = reinterpret_cast<float4 const*>(smem.dq_slot.data() + Traits::kDqWgFloats);
    FH_NO_UNROLL
    for (int i = thread(); i < Traits::kDqWgFloats / 4; i += kThreads) {
      const float4 a = into[i];
      const float4 b = from[i];
      into[i] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
    }
    cutlass::arch::fence_view_async_shared();
    // every sum before lane 0's reduce-add reads it
    named_barrier_sync(static_cast<uint32_t>(BwdBarrier::kDqWriters), kThreads);
  }
  CUTE_DEVICE void wait_turn(StagedDq const& part) {
    if (lane0()) {
      while (load_acquire_gpu(part.semaphore) < part.rank) {
      }
      fence_proxy_async_global();  // the earlier contributors' adds before this one's
    }
  }
  CUTE_DEVICE void reduce_slots(StagedDq const& part) {
    if (lane0()) {
      CUTE_UNROLL
      for (int c = 0; c < kDqWgs; ++c) {
        bulk_reduce_add_f32(part.acc + c * Traits::kDqWgFloats,
                            smem.dq_slot.data() + c * Traits::kDqWgFloats,
                            Traits::kDqWgFloats * sizeof(float));
      }
    }
  }
  CUTE_DEVICE void free_slots() {
    if (lane0()) {
      bulk_wait_read();
      smem.dq_free[0].arrive();
    }
  }
  CUTE_DEVICE void pass_turn(StagedDq const& part) {
    if (lane0()) {
      bulk_wait_all();  // the adds performed
      fence_proxy_async_global();
      __threadfence();
      atomicAdd(part.semaphore, 1);
    }
    __syncwarp();
  }
};

template <class Traits>
CUTE_DEVICE void bwd_dq_writer_loop(typename Traits::SharedStorage& smem) {
  BwdDqWriter<Traits> writer{smem};
  write_dq_bwd<Traits>(writer);
}

template <class Traits>
CUTE_DEVICE void bwd_consumer_loop(BwdKernelParams<Traits> const& params,
                                   typename Traits::SharedStorage& smem) {
  BwdConsumer<Traits> consumer(params, smem);
  consume_bwd_wg<Traits>(bwd_cta_schedule(params), consumer);
}

}  // namespace flash_hopper::sm90
