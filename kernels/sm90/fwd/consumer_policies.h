// The two places where the consumer's arithmetic differs by input dtype, as policy types
// (mma.h's Consumer picks one of each; the step schedule, schedule.h, is the same for all):
//
//   score scales   where a tile's softmax scale, softcap factor and epilogue scales come from:
//                  the call (16-bit inputs), the tile's descales held in registers for the tile
//                  (FP8), or the tile's descales reloaded where used (mixed mode, whose d64
//                  kernel has no registers to hold them);
//   PV accumulator where the PV GEMM accumulates: into O itself (16-bit and mixed inputs), or in
//                  two levels (FP8): O folded into an fp32 copy in shared memory every few PV
//                  GEMMs (PvFoldedToShared: the overlapped d64 / d128 kernels), or each PV GEMM
//                  from zero into its own accumulator, added into O in fp32 once it completed --
//                  with the intra-warpgroup overlap in the next rescale (or the epilogue),
//                  without it right after the GEMM, one head-dim part at a time where the
//                  accumulator covers part of O (Traits::kPvParts).
//
// Policy functions take the consumer (C: its params, MMAs and pipeline ends) and the register
// state of the tiles in flight (F: Consumer::TileState).
#pragma once

#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "flash_hopper/register_ops.h"
#include "sm90/common/utils.h"
#include "sm90/fwd/kernel_traits.h"  // EmptyStorage
#include "sm90/fwd/params.h"
#include "sm90/fwd/schedule.h"  // TileWork

namespace flash_hopper::sm90 {

using namespace cute;

// ---- score scales -------------------------------------------------------------------------

// What the epilogue scales by: the LSE's scale (log2 domain to natural log) and O's (v_descale).
struct EpilogueScales {
  float lse_scale;
  float o_scale;
};

// The scales of one tile's (batch, kv head) from the FP8 / mixed descales (FwdParams; a null
// pointer is a descale of 1). Without softcap the descales scale the score like softmax_scale;
// with it they scale the tanh's argument (fwd_params.h).
struct TileScales {
  float scale_log2;
  float lse_scale;
  float softcap_prescale;
  float o_scale;  // v_descale

  static CUTE_DEVICE TileScales of(FwdParams const& p, TileWork const& w) {
    const int h_kv = w.tile.head / p.heads_per_kv;
    auto load = [&](const float* ptr, int64_t batch_stride, int64_t head_stride) {
      return ptr == nullptr ? 1.f : ptr[w.tile.batch * batch_stride + h_kv * head_stride];
    };
    const float qk = load(p.q_descale, p.q_descale_batch_stride, p.q_descale_head_stride) *
                     load(p.k_descale, p.k_descale_batch_stride, p.k_descale_head_stride);
    const float v = load(p.v_descale, p.v_descale_batch_stride, p.v_descale_head_stride);
    const bool capped = p.softcap != 0.f;
    return {capped ? p.scale_log2 : p.scale_log2 * qk, capped ? p.lse_scale : p.lse_scale * qk,
            p.softcap_prescale * qk, v};
  }
};

// 16-bit inputs: the call's softmax scale; O is not rescaled in the epilogue.
struct CallScales {
  using Held = EmptyStorage;  // nothing kept per tile
  static constexpr bool kScalesO = false;
  template <class C>
  static CUTE_DEVICE void load(C const&, Held&, TileWork const&) {}
  template <class C>
  static CUTE_DEVICE float scale_log2(C const& c, Held const&, TileWork const&) {
    return c.p.scale_log2;
  }
  template <class C>
  static CUTE_DEVICE float softcap_prescale(C const& c, Held const&, TileWork const&) {
    return c.p.softcap_prescale;
  }
  template <class C>
  static CUTE_DEVICE EpilogueScales epilogue(C const& c, Held const&, TileWork const&) {
    return {c.p.lse_scale, 1.f};
  }
};

// FP8: the tile's scales in registers for the tile (Held), loaded when the tile starts; at a
// tile boundary the finishing tile's stay aside (Consumer::begin_next_scales) for its epilogue.
struct HeldTileScales {
  using Held = TileScales;
  static constexpr bool kScalesO = true;
  template <class C>
  static CUTE_DEVICE void load(C const& c, Held& held, TileWork const& w) {
    held = TileScales::of(c.p, w);
  }
  template <class C>
  static CUTE_DEVICE float scale_log2(C const&, Held const& held, TileWork const&) {
    return held.scale_log2;
  }
  template <class C>
  static CUTE_DEVICE float softcap_prescale(C const&, Held const& held, TileWork const&) {
    return held.softcap_prescale;
  }
  template <class C>
  static CUTE_DEVICE EpilogueScales epilogue(C const&, Held const& held, TileWork const&) {
    return {held.lse_scale, held.o_scale};
  }
};

// Mixed mode: nothing held across the tile; every use reloads the two descales it needs (cached
// loads) for tile w.
struct ReloadedTileScales {
  using Held = EmptyStorage;
  static constexpr bool kScalesO = true;
  template <class C>
  static CUTE_DEVICE void load(C const&, Held&, TileWork const&) {}
  template <class C>
  static CUTE_DEVICE float scale_log2(C const& c, Held const&, TileWork const& w) {
    return TileScales::of(c.p, w).scale_log2;
  }
  template <class C>
  static CUTE_DEVICE float softcap_prescale(C const& c, Held const&, TileWork const& w) {
    return TileScales::of(c.p, w).softcap_prescale;
  }
  template <class C>
  static CUTE_DEVICE EpilogueScales epilogue(C const& c, Held const&, TileWork const& w) {
    const TileScales sc = TileScales::of(c.p, w);
    return {sc.lse_scale, sc.o_scale};
  }
};

// ---- PV accumulators ----------------------------------------------------------------------
// issue(c, f) / issue_and_wait(c, f): the PV GEMM of P (f.p) and the V^T stage in flight;
// complete(c, f): after it completed (the sequential schedule's); rescale(c, f): O *= the
// softmax's correction; before_epilogue(c, f): the last PV result into O; clear(c, f): a
// tile's start.

// Where O holds every completed PV GEMM's result: the rescale is O's, the epilogue adds nothing.
struct OHoldsPv {
  template <class C, class F>
  static CUTE_DEVICE void rescale(C const&, F& f) {
    Tensor o_rc = f.o_rc();
    f.softmax.rescale_o(o_rc);
  }
  template <class C, class F>
  static CUTE_DEVICE void before_epilogue(C&, F&) {}
};

// 16-bit and mixed inputs: the PV GEMM accumulates into O.
struct PvIntoO : OHoldsPv {
  template <class OAcc>
  using Acc = EmptyStorage;
  template <class C, class F>
  static CUTE_DEVICE void issue(C& c, F& f) {
    wgmma<false, -1>(c.mma_pv, f.p, c.v_stage(), f.o);
  }
  template <class C, class F>
  static CUTE_DEVICE void issue_and_wait(C& c, F& f) {
    wgmma<false, 0>(c.mma_pv, f.p, c.v_stage(), f.o);
  }
  template <class C, class F>
  static CUTE_DEVICE void complete(C&, F&) {}
  template <class C, class F>
  static CUTE_DEVICE void clear(C&, F&) {}
};

// FP8 with the intra-warpgroup overlap: each PV GEMM from zero into f.o_acc, which joins O at the
// next rescale (the GEMM completed by then) or before the epilogue. FwdParams::fp8_single_level
// (the ablation) accumulates every block in f.o_acc instead, O staying zero until the epilogue.
struct PvTwoLevel {
  template <class OAcc>
  using Acc = OAcc;
  template <class C, class F>
  static CUTE_DEVICE void issue(C& c, F& f) {
    c.mma_pv.accumulate_ = c.p.fp8_single_level ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero;
    wgmma<false, -1>(c.mma_pv, f.p, c.v_stage(), f.o_acc);
  }
  template <class C, class F>
  static CUTE_DEVICE void issue_and_wait(C& c, F& f) {
    c.mma_pv.accumulate_ = c.p.fp8_single_level ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero;
    wgmma<false, 0>(c.mma_pv, f.p, c.v_stage(), f.o_acc);
  }
  template <class C, class F>
  static CUTE_DEVICE void rescale(C const& c, F& f) {
    if (!c.p.fp8_single_level) {
      add_into_o(f);
      Tensor o_rc = f.o_rc();
      f.softmax.rescale_o(o_rc);
    } else {
      Tensor acc_rc = make_tensor(f.o_acc.data(), acc_rowcol(f.o_acc.layout()));
      f.softmax.rescale_o(acc_rc);
    }
  }
  template <class C, class F>
  static CUTE_DEVICE void before_epilogue(C&, F& f) {
    add_into_o(f);
  }
  template <class C, class F>
  static CUTE_DEVICE void clear(C&, F& f) {
    cute::clear(f.o_acc);  // single level accumulates into it
  }
  template <class F>
  static CUTE_DEVICE void add_into_o(F& f) {
    CUTE_UNROLL
    for (int i = 0; i < size(f.o); ++i) {
      f.o(i) += f.o_acc(i);
    }
  }
};

// FP8 with the overlap, at a single-level kernel's registers: the PV GEMMs accumulate in O (the
// tensor core's chain, rescaled like 16-bit O), and once kEvery of them are in it (after the
// GEMM completed and P was converted: S is dead, the registers free) O is added into the tile's
// copy in shared memory (Traits::OFoldStorage, each thread its own values) and the next PV
// GEMM starts the chain from zero. Acc::scale takes the copy to O's scale: the rescales since the
// last fold (one factor per row), applied at the next fold or before the epilogue; with kFp16 the
// copy holds its rows divided by their running sums at that fold (weighted means of V's values,
// |x| <= max |v|: fp16's range holds e4m3 and e5m2), and the scale starts from that sum. The
// tensor core's narrower accumulation thus sums kEvery blocks at most; the single-level ablation
// (FwdParams::fp8_single_level) never folds.
template <int kEvery, bool kFp16 = false>
struct PvFoldedToShared : OHoldsPv {
  struct FoldState {
    float scale[2];  // rows r, r + 8: the factor taking the shared copy to O's scale
    int pending;     // PV GEMMs in O since the tile started or the last fold
  };
  template <class OAcc>
  using Acc = FoldState;
  template <class C, class F>
  static CUTE_DEVICE void issue(C& c, F& f) {
    c.mma_pv.accumulate_ = f.o_acc.pending == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    wgmma<false, -1>(c.mma_pv, f.p, c.v_stage(), f.o);
    ++f.o_acc.pending;
  }
  template <class C, class F>
  static CUTE_DEVICE void issue_and_wait(C& c, F& f) {
    c.mma_pv.accumulate_ = f.o_acc.pending == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    wgmma<false, 0>(c.mma_pv, f.p, c.v_stage(), f.o);
    ++f.o_acc.pending;
  }
  template <class C, class F>
  static CUTE_DEVICE void rescale(C const& c, F& f) {
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      f.o_acc.scale[r] *= f.softmax.scale[r];  // 1 where the row kept its max
    }
    OHoldsPv::rescale(c, f);
  }
  // After convert_p: the fold, once kEvery PV GEMMs are in O.
  template <class C, class F>
  static CUTE_DEVICE void fold_if_due(C& c, F& f) {
    if (f.o_acc.pending < kEvery || c.p.fp8_single_level) {
      return;
    }
    if constexpr (kFp16) {
      // The rows' running sums (this block's p included: any positive divisor of at least the
      // weights already in O bounds the stored mean), 1 for a row that has no weight yet.
      float sum[2], inv[2];
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        sum[r] = quad_allreduce(f.softmax.row_sum[r], [](float a, float b) { return a + b; });
        sum[r] = sum[r] > 0.f ? sum[r] : 1.f;
        inv[r] = 1.f / sum[r];
      }
      CUTE_UNROLL
      for (int j = 0; j < size(f.o) / 4; ++j) {
        const float4 h = load_copy(c, j);  // rows r, r, r + 8, r + 8
        const __half2 lo = __floats2half2_rn(fmaf(h.x, f.o_acc.scale[0], f.o(4 * j)) * inv[0],
                                             fmaf(h.y, f.o_acc.scale[0], f.o(4 * j + 1)) * inv[0]);
        const __half2 hi = __floats2half2_rn(
            fmaf(h.z, f.o_acc.scale[1], f.o(4 * j + 2)) * inv[1],
            fmaf(h.w, f.o_acc.scale[1], f.o(4 * j + 3)) * inv[1]);
        shared_copy_half(c)[j * 128] = make_uint2(*reinterpret_cast<uint32_t const*>(&lo),
                                                  *reinterpret_cast<uint32_t const*>(&hi));
      }
      f.o_acc.scale[0] = sum[0];
      f.o_acc.scale[1] = sum[1];
    } else {
      float4* copy = shared_copy(c);
      CUTE_UNROLL
      for (int j = 0; j < size(f.o) / 4; ++j) {
        const float4 h = copy[j * 128];
        // values 4j, 4j + 1 are row r's, 4j + 2, 4j + 3 row r + 8's
        copy[j * 128] = make_float4(
            fmaf(h.x, f.o_acc.scale[0], f.o(4 * j)), fmaf(h.y, f.o_acc.scale[0], f.o(4 * j + 1)),
            fmaf(h.z, f.o_acc.scale[1], f.o(4 * j + 2)),
            fmaf(h.w, f.o_acc.scale[1], f.o(4 * j + 3)));
      }
      f.o_acc.scale[0] = f.o_acc.scale[1] = 1.f;
    }
    f.o_acc.pending = 0;
  }
  // O = the shared copy (in O's scale) + the chain, for the epilogue.
  template <class C, class F>
  static CUTE_DEVICE void before_epilogue(C& c, F& f) {
    CUTE_UNROLL
    for (int j = 0; j < size(f.o) / 4; ++j) {
      const float4 h = load_copy(c, j);
      f.o(4 * j) = fmaf(h.x, f.o_acc.scale[0], f.o(4 * j));
      f.o(4 * j + 1) = fmaf(h.y, f.o_acc.scale[0], f.o(4 * j + 1));
      f.o(4 * j + 2) = fmaf(h.z, f.o_acc.scale[1], f.o(4 * j + 2));
      f.o(4 * j + 3) = fmaf(h.w, f.o_acc.scale[1], f.o(4 * j + 3));
    }
  }
  // A tile's start: the copy zeroed (after the finishing tile's epilogue read it, same thread).
  template <class C, class F>
  static CUTE_DEVICE void clear(C& c, F& f) {
    f.o_acc.scale[0] = f.o_acc.scale[1] = 1.f;
    f.o_acc.pending = 0;
    CUTE_UNROLL
    for (int j = 0; j < decltype(size(f.o))::value / 4; ++j) {
      if constexpr (kFp16) {
        shared_copy_half(c)[j * 128] = make_uint2(0u, 0u);
      } else {
        shared_copy(c)[j * 128] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }

 private:
  // This thread's first chunk of the copy: each warpgroup's values are one slab of its own
  // (chunk j of thread t at j * 128 + t: float4 chunks, or 4 halves with kFp16), which the
  // epilogue also stages O through once it read the copy (Consumer::o_stage, epilogue.h).
  template <class C>
  static CUTE_DEVICE float4* shared_copy(C& c) {
    return reinterpret_cast<float4*>(c.o_fold_slab()) + C::thread_idx() % 128;
  }
  template <class C>
  static CUTE_DEVICE uint2* shared_copy_half(C& c) {
    return reinterpret_cast<uint2*>(c.o_fold_slab()) + C::thread_idx() % 128;
  }
  // Chunk j of this thread's copy as fp32 (rows r, r, r + 8, r + 8).
  template <class C>
  static CUTE_DEVICE float4 load_copy(C& c, int j) {
    if constexpr (kFp16) {
      const uint2 h = shared_copy_half(c)[j * 128];
      const float2 lo = __half22float2(*reinterpret_cast<__half2 const*>(&h.x));
      const float2 hi = __half22float2(*reinterpret_cast<__half2 const*>(&h.y));
      return make_float4(lo.x, lo.y, hi.x, hi.y);
    } else {
      return shared_copy(c)[j * 128];
    }
  }
};

// FP8 without the overlap, two levels only (a run-time choice of accumulator here serializes
// every WGMMA, ptxas C7515; the host refuses the single-level ablation): f.o_acc is live from the
// PV GEMM's issue to complete(), which waits for it and adds it into O -- in kParts head-dim
// parts, where the accumulator covers d / kParts columns (part 0 issued by issue(), each further
// part run, waited for and added in turn).
template <int kParts>
struct PvTwoLevelSequential : OHoldsPv {
  template <class OAcc>
  using Acc = OAcc;
  template <class C, class F>
  static CUTE_DEVICE void issue(C& c, F& f) {
    forget(f.o_acc);  // dead from the last addition to here, out of the softmax's registers
    c.mma_pv.accumulate_ = GMMA::ScaleOut::Zero;
    if constexpr (kParts == 1) {
      wgmma<false, -1>(c.mma_pv, f.p, c.v_stage(), f.o_acc);
    } else {
      wgmma<false, -1>(c.mma_pv, f.p, c.template v_part<0>(), f.o_acc);
    }
  }
  template <class C, class F>
  static CUTE_DEVICE void complete(C& c, F& f) {
    warpgroup_fence_operand(f.o_acc);
    if constexpr (kParts == 1) {
      CUTE_UNROLL
      for (int i = 0; i < size(f.o); ++i) {
        f.o(i) += f.o_acc(i);
      }
      return;
    }
    for_each(make_int_sequence<kParts>{}, [&](auto part) {
      constexpr int kPart = decltype(part)::value;
      if constexpr (kPart > 0) {
        forget(f.o_acc);
        c.mma_pv.accumulate_ = GMMA::ScaleOut::Zero;
        wgmma<false, 0>(c.mma_pv, f.p, c.template v_part<kPart>(), f.o_acc);
      }
      Tensor o = C::template o_part<kPart>(f.o);
      CUTE_UNROLL
      for (int i = 0; i < size(f.o_acc); ++i) {
        o(i) += f.o_acc(i);
      }
    });
  }
  template <class C, class F>
  static CUTE_DEVICE void clear(C&, F& f) {
    cute::clear(f.o_acc);
  }
};

}  // namespace flash_hopper::sm90
