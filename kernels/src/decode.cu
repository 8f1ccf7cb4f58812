// The decode kernel's instantiations (the decode table of kernels/src/tables.cmake: its dtypes x
// head dims x stage counts) and launch.
//
// Stages (the table's tuned count per head dim): enough key blocks in flight to cover DRAM
// latency at the SM's share of the bandwidth (bench/PERFLOG.md, "Decode stages and the SM's share
// of the bandwidth") while two CTAs share an SM, so that one's merge or ramp hides under the
// other's loads:
//   d64:  4 x 16 KiB = 66 KiB per CTA (3 per SM)
//   d128: 3 x 32 KiB = 100 KiB (2 per SM)
//   d256: 3 x 64 KiB = 200 KiB (1 per SM; 2 stages would still leave 1)
// A device whose shared memory per block is smaller (sm_86 / sm_89 / sm_120: 99 KiB; sm_80:
// 163 KiB) runs the largest stage count that fits it, down to the table's fewest (d128 2 stages:
// 70 KiB, d256: 138 KiB); where not even those fit (a 16-bit d256 cache on 99 KiB; an FP8 one
// runs 2 stages there, 74 KiB), the kernel does not serve the device (fh_decode_stages answers 0
// and the library's policy sends the call elsewhere, before the caller touches any cache). The
// counts compiled are those some GPU runs: per head dim and cache width, the largest count up to
// the tuned one that fits each opt-in limit of src/device.h's table (a limit between them, from
// FLASH_HOPPER_DEBUG_SMEM_LIMIT, runs the largest compiled count that fits). A build with
// FH_DECODE_EVERY_STAGE_COUNT compiles every count of the table that fits 227 KiB, so that
// FLASH_HOPPER_DECODE_STAGES can measure the others.
//
// FP8 caches (the table's third column): a stage holds half the bytes, so the same bytes in flight
// per SM take about twice the stages; 5 stages keep the 16-bit kernels' bytes in flight at their
// CTAs per SM:
//   d64:  5 x 8 KiB = 45 KiB per CTA with Q and the page ids (4 per SM: 4 x 4 x 8 KiB in flight)
//   d128: 5 x 16 KiB = 87 KiB (2 per SM: 2 x 4 x 16 KiB, the 16-bit d128's 128 KiB)
//   d256: 5 x 32 KiB = 171 KiB (1 per SM: 4 x 32 KiB, the 16-bit d256's 128 KiB)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "decode/decode_kernel.h"
#include "fh_decode_table.inc"
#include "src/decode.h"
#include "src/device.h"
#include "src/score_transform.h"
#include "src/programmatic_launch.h"

namespace flash_hopper {
namespace {

using decode::DecodeConfig;
using decode::DecodeParams;

// The tuned stage count per head dim; FLASH_HOPPER_DECODE_STAGES (a compiled count, read per
// call) overrides it for measurements (bench/PERFLOG.md). Either gives way to fewer stages where
// it does not fit.
constexpr int kMinStages = FH_DECODE_MIN_STAGES;
constexpr int kMaxSmemPerBlock = 227 * 1024;

// The storage type of an FhDtype of the decode table.
template <int32_t kDtype>
struct Storage {
  static_assert(kDtype == FH_DTYPE_FP16 || kDtype == FH_DTYPE_BF16 || kDtype == FH_DTYPE_E4M3 ||
                    kDtype == FH_DTYPE_E5M2,
                "a dtype of the decode table");
  using Type = std::conditional_t<
      kDtype == FH_DTYPE_FP16, __half,
      std::conditional_t<kDtype == FH_DTYPE_BF16, __nv_bfloat16,
                         std::conditional_t<kDtype == FH_DTYPE_E4M3, __nv_fp8_e4m3,
                                            __nv_fp8_e5m2>>>;
};

// The kernel's Input of a table row (decode_kernel.h, DecodeTypes): a 16-bit row's element type,
// or an FP8 cache's Fp8Cache<q's storage, K / V's storage>.
template <int32_t kQ, int32_t kKv, bool kSame = kQ == kKv && sizeof(typename Storage<kQ>::Type) == 2>
struct DecodeInput {
  using Type = decode::Fp8Cache<typename Storage<kQ>::Type, typename Storage<kKv>::Type>;
};
template <int32_t kQ, int32_t kKv>
struct DecodeInput<kQ, kKv, true> {
  using Type = typename Storage<kQ>::Type;
};

// The table's head dims with their tuned stages (16-bit and FP8 caches).
struct TunedStages {
  int64_t head_dim;
  int stages;
  int fp8_stages;
};
#define FH_DECODE_TUNED(hd, stages, fp8_stages) {hd, stages, fp8_stages},
constexpr TunedStages kTunedStages[] = {FH_DECODE_TABLE(FH_DECODE_TUNED)};
#undef FH_DECODE_TUNED

constexpr int default_stages(int64_t head_dim, bool fp8_kv) {
  for (const TunedStages& t : kTunedStages) {
    if (t.head_dim == head_dim) {
      return fp8_kv ? t.fp8_stages : t.stages;
    }
  }
  return 0;
}

template <int kHeadDim, int kStages, bool kFp8Kv>
constexpr int smem_bytes() {
  return DecodeConfig<kHeadDim, kStages, kFp8Kv>::kSmemBytes;
}

// The largest stage count of the table, up to `most`, whose shared memory fits `limit` bytes; 0
// where none does.
template <int kHeadDim, bool kFp8Kv>
constexpr int largest_fitting(int most, int limit) {
  int best = 0;
#define FH_DECODE_FITTING(s)                                                 \
  if (s <= most && smem_bytes<kHeadDim, s, kFp8Kv>() <= limit) {             \
    best = s;                                                                \
  }
  FH_DECODE_STAGE_COUNTS(FH_DECODE_FITTING)
#undef FH_DECODE_FITTING
  return best;
}

// Whether the kernels of kStages stages are compiled at kHeadDim (the header says which).
template <int kHeadDim, int kStages, bool kFp8Kv>
constexpr bool compiled() {
  const int tuned = default_stages(kHeadDim, kFp8Kv);
  bool runs = FH_DECODE_EVERY_STAGE_COUNT != 0 ||
              largest_fitting<kHeadDim, kFp8Kv>(tuned, kOtherCapabilitySmemKib * 1024) == kStages;
  for (const CapabilitySmem& gpu : kCapabilitySmem) {
    runs = runs || largest_fitting<kHeadDim, kFp8Kv>(tuned, gpu.kib * 1024) == kStages;
  }
  return runs && smem_bytes<kHeadDim, kStages, kFp8Kv>() <= kMaxSmemPerBlock;
}

// The shared memory of a compiled stage count at kHeadDim; 0 for any other count.
template <int kHeadDim, bool kFp8Kv>
int smem_for(int stages) {
#define FH_DECODE_SMEM(s)                                    \
  if (stages == s && compiled<kHeadDim, s, kFp8Kv>()) {      \
    return smem_bytes<kHeadDim, s, kFp8Kv>();               \
  }
  FH_DECODE_STAGE_COUNTS(FH_DECODE_SMEM)
#undef FH_DECODE_SMEM
  return 0;
}

// The same for a head dim of the table; 0 for one it does not list.
int smem_of(int64_t head_dim, int stages, bool fp8_kv) {
#define FH_DECODE_SMEM_OF(hd, tuned, fp8_tuned)                                     \
  if (head_dim == hd) {                                                             \
    return fp8_kv ? smem_for<hd, true>(stages) : smem_for<hd, false>(stages); \
  }
  FH_DECODE_TABLE(FH_DECODE_SMEM_OF)
#undef FH_DECODE_SMEM_OF
  return 0;
}

}  // namespace

bool decode_fp8_kv(int32_t kv_dtype) {
  return kv_dtype == FH_DTYPE_E4M3 || kv_dtype == FH_DTYPE_E5M2;
}

int decode_stages(int64_t head_dim, int max_smem_per_block, bool fp8_kv) {
  const int tuned = default_stages(head_dim, fp8_kv);
  if (tuned == 0) {
    return 0;  // not a decode head dim
  }
  const int limit = max_smem_per_block < kMaxSmemPerBlock ? max_smem_per_block : kMaxSmemPerBlock;
  int want = tuned;
  if (const char* env = std::getenv("FLASH_HOPPER_DECODE_STAGES")) {
    const int v = std::atoi(env);
    if (smem_of(head_dim, v, fp8_kv) > 0) {
      want = v;
    }
  }
  for (int stages = want; stages >= kMinStages; --stages) {
    const int smem = smem_of(head_dim, stages, fp8_kv);
    if (smem > 0 && smem <= limit) {
      return stages;
    }
  }
  return 0;
}

namespace {

// Programmatic dependent launch on sm_90 (FLASH_HOPPER_DECODE_PDL=0 turns it off, for
// measurements): each kernel starts while the one before it in the stream finishes and waits for
// it in griddepcontrol.wait: a short call's launch gap hides behind the kernel before it
// (bench/PERFLOG.md "the split merge as a kernel of its own").
bool programmatic_launch(int cc_major) {
  const char* env = std::getenv("FLASH_HOPPER_DECODE_PDL");
  return cc_major >= 9 && !(env != nullptr && std::strcmp(env, "0") == 0);
}

constexpr int kSmPerSmBytes = 228 * 1024;
constexpr int kReservedPerCta = 1024;

DecodeParams derive(FhDecodeParams const* p) {
  DecodeParams d{};
  d.q = p->q;
  d.k = p->k;
  d.v = p->v;
  d.o = p->o;
  d.lse = p->lse;
  d.seqlens_k = p->seqlens_k;
  d.leftpad_k = p->leftpad_k;
  d.kv_batch_idx = p->kv_batch_idx;
  d.page_table = p->page_table;
  d.cu_seqlens_q = p->cu_seqlens_q;
  d.sinks = p->sinks;
  d.batch = static_cast<int>(p->batch);
  d.seqlen_q = static_cast<int>(p->seqlen_q);
  d.total_q = p->cu_seqlens_q != nullptr ? static_cast<int>(p->total_q) : 0;
  d.heads_kv = static_cast<int>(p->heads_kv);
  d.group = static_cast<int>(p->heads_q / p->heads_kv);
  d.row_blocks = static_cast<int>(decode::row_blocks(p->seqlen_q, d.group));
  const bool paged = p->page_table != nullptr;
  d.capacity = static_cast<int>(paged ? p->max_pages * p->page_size : p->page_size);
  d.page_size = static_cast<int>(p->page_size);
  d.page_shift = decode::power_of_two_shift(p->page_size);
  d.num_pages = static_cast<int>(p->num_pages);
  d.page_table_stride = p->page_table_stride;
  d.q_batch_stride = p->q_batch_stride;
  d.q_row_stride = p->q_row_stride;
  d.q_head_stride = p->q_head_stride;
  d.k_page_stride = p->k_page_stride;
  d.k_row_stride = p->k_row_stride;
  d.k_head_stride = p->k_head_stride;
  d.v_page_stride = p->v_page_stride;
  d.v_row_stride = p->v_row_stride;
  d.v_head_stride = p->v_head_stride;
  d.o_batch_stride = p->o_batch_stride;
  d.o_row_stride = p->o_row_stride;
  d.o_head_stride = p->o_head_stride;
  d.lse_batch_stride = p->lse_batch_stride;
  d.lse_head_stride = p->lse_head_stride;
  const ScoreTransform score = score_transform(p->softmax_scale, p->softcap);
  d.softcap = score.softcap;
  d.softcap_scale = score.prescale;
  d.scale_log2 = score.scale_log2;
  d.window_left = decode::clamp_window(p->window_left, d.capacity);
  d.window_right = decode::clamp_window(p->window_right, d.seqlen_q);
  d.splits = p->num_splits;
  const float* descales[3] = {p->q_descale, p->k_descale, p->v_descale};
  const int64_t strides[3][2] = {{p->q_descale_batch_stride, p->q_descale_head_stride},
                                 {p->k_descale_batch_stride, p->k_descale_head_stride},
                                 {p->v_descale_batch_stride, p->v_descale_head_stride}};
  for (int i = 0; i < 3; ++i) {
    d.descales[i] = descales[i];
    d.descale_strides[i][0] = strides[i][0];
    d.descale_strides[i][1] = strides[i][1];
  }
  if (p->num_splits > 1) {
    const int64_t blocks = p->batch * p->heads_kv * d.row_blocks;
    const decode::DecodeWorkspace w =
        decode::decode_workspace(blocks, p->num_splits, static_cast<int>(p->head_dim));
    char* base = static_cast<char*>(p->workspace);
    d.lse_partial = reinterpret_cast<float*>(base + w.lse);
    d.o_partial = reinterpret_cast<float*>(base + w.partial);
  }
  return d;
}

// What a launch takes besides the kernel's parameters.
struct LaunchArgs {
  int max_smem_per_block;
  bool programmatic;  // programmatic dependent launch (programmatic_launch)
  int num_sms;        // the combine grid's bound (decode_plan.h, combine_row_groups)
  int row_tiles;      // row blocks per CTA (decode_row_tiles)
  cudaStream_t stream;
};

// The decode kernel of a form (keys as M, row blocks per CTA): its shared memory opted in, then
// launched over (splits, KV heads x the CTAs of a head's row blocks, batch).
template <class Input, int kHeadDim, int kStages, bool kKeysAsM, int kRowTiles>
cudaError_t launch_form(DecodeParams const& d, LaunchArgs const& a) {
  constexpr bool kFp8Kv = decode::DecodeTypes<Input>::kFp8Kv;
  constexpr int kSmem = decode::DecodeConfig<kHeadDim, kStages, kFp8Kv, kRowTiles>::kSmemBytes;
  auto kernel = decode::decode_kernel<Input, kHeadDim, kStages, kKeysAsM, kRowTiles>;
  const cudaError_t err =
      opt_in_dynamic_smem<decode::decode_kernel<Input, kHeadDim, kStages, kKeysAsM, kRowTiles>>(
          kSmem);
  if (err != cudaSuccess) {
    return err;
  }
  const dim3 grid(d.splits, d.heads_kv * (d.row_blocks / kRowTiles), d.batch);
  return launch_programmatic(kernel, grid, dim3(decode::kThreads), kSmem, a.stream,
                             a.programmatic, d);
}

template <class Input, int kHeadDim, int kStages>
LaunchResult launch(DecodeParams const& d, LaunchArgs const& a) {
  using Types = decode::DecodeTypes<Input>;
  constexpr int kSmem = smem_bytes<kHeadDim, kStages, Types::kFp8Kv>();
  if constexpr (kSmem > kMaxSmemPerBlock) {
    return LaunchResult::no_tile_fits(kSmem);
  } else {
    if (kSmem > a.max_smem_per_block) {
      return LaunchResult::no_tile_fits(kSmem);
    }
    cudaError_t err = cudaSuccess;
    // the rows of a tile: seqlen_q x group; FP8 tiles of at most kKeysAsMRows rows take the
    // keys-as-M form, pairs of row blocks (decode_row_tiles) one CTA where the pair's larger Q
    // buffer fits too
    constexpr int kPairSmem =
        decode::DecodeConfig<kHeadDim, kStages, Types::kFp8Kv, 2>::kSmemBytes;
    if (Types::kFp8Kv && d.seqlen_q * d.group <= decode::kKeysAsMRows) {
      if constexpr (Types::kFp8Kv) {
        err = launch_form<Input, kHeadDim, kStages, true, 1>(d, a);
      }
    } else if (a.row_tiles == 2 && kPairSmem <= a.max_smem_per_block) {
      if constexpr (kHeadDim <= decode::kMaxPairedHeadDim && kPairSmem <= kMaxSmemPerBlock) {
        err = launch_form<Input, kHeadDim, kStages, false, 2>(d, a);
      } else {
        return LaunchResult::internal("decode: two row blocks per CTA past kMaxPairedHeadDim");
      }
    } else {
      err = launch_form<Input, kHeadDim, kStages, false, 1>(d, a);
    }
    if (err == cudaSuccess && d.splits > 1) {
      // a row block's rows: seqlen_q x group of the longest sequence
      const int64_t row_blocks = int64_t{d.batch} * d.heads_kv * d.row_blocks;
      const int groups = decode::combine_row_groups(
          d.seqlen_q * d.group, decode::combine_rows_per_cta<kHeadDim>(), row_blocks, a.num_sms);
      const dim3 blocks(static_cast<unsigned>(row_blocks), static_cast<unsigned>(groups));
      // the partials are O's values (v_descale applied): the combine kernel of the output type
      err = launch_programmatic(decode::combine_kernel<typename Types::Out, kHeadDim>, blocks,
                                dim3(decode::kThreads), 0, a.stream, a.programmatic, d);
    }
    return LaunchResult::cuda(err);
  }
}

template <class Input, int kHeadDim>
LaunchResult launch_stages(DecodeParams const& d, LaunchArgs const& a) {
  constexpr bool kFp8Kv = decode::DecodeTypes<Input>::kFp8Kv;
  const int stages = decode_stages(kHeadDim, a.max_smem_per_block, kFp8Kv);
#define FH_DECODE_LAUNCH(s)                      \
  if constexpr (compiled<kHeadDim, s, kFp8Kv>()) { \
    if (stages == s) {                             \
      return launch<Input, kHeadDim, s>(d, a);     \
    }                                              \
  }
  FH_DECODE_STAGE_COUNTS(FH_DECODE_LAUNCH)
#undef FH_DECODE_LAUNCH
  return LaunchResult::no_tile_fits(smem_bytes<kHeadDim, kMinStages, kFp8Kv>());
}

template <class Input>
LaunchResult launch_dtype(DecodeParams const& d, int64_t head_dim, LaunchArgs const& a) {
#define FH_DECODE_LAUNCH_HEAD_DIM(hd, tuned, fp8_tuned) \
  if (head_dim == hd) {                                 \
    return launch_stages<Input, hd>(d, a);              \
  }
  FH_DECODE_TABLE(FH_DECODE_LAUNCH_HEAD_DIM)
#undef FH_DECODE_LAUNCH_HEAD_DIM
  return LaunchResult::internal("decode head_dim outside the decode table");
}

}  // namespace

int decode_row_tiles(const FhDecodeParams* p, int num_sms) {
  const char* env = std::getenv("FLASH_HOPPER_DECODE_PAIR");
  if (env != nullptr && std::strcmp(env, "0") == 0) {
    return 1;
  }
  const int64_t blocks = decode::row_blocks(p->seqlen_q, p->heads_q / p->heads_kv);
  const int tiles = decode::row_tiles_per_cta(blocks, p->head_dim);
  // An FP8 cache's pair does twice a CTA's MMAs and exponentials on keys widened once: less work
  // in all, measured faster where a CTA per row block already fills every slot without splits,
  // slower below that, where more CTAs (more splits) are what the call needs (bench/PERFLOG.md
  // "two row blocks per CTA").
  const bool fp8_kv = decode_fp8_kv(decode_kv_dtype(p));
  if (tiles > 1 && fp8_kv &&
      p->batch * p->heads_kv * blocks < int64_t{num_sms} * decode_ctas_per_sm(p->head_dim, true)) {
    return 1;
  }
  return tiles;
}

int decode_ctas_per_sm(int64_t head_dim, bool fp8_kv) {
  const int smem =
      smem_of(head_dim, decode_stages(head_dim, kMaxSmemPerBlock, fp8_kv), fp8_kv);
  if (smem <= 0) {
    return 1;
  }
  const int n = kSmPerSmBytes / (smem + kReservedPerCta);
  return n < 1 ? 1 : (n > 4 ? 4 : n);
}

LaunchResult launch_decode(FhDecodeParams const* p, int max_smem_per_block, int cc_major,
                           int num_sms, cudaStream_t stream, unsigned long long* timeline,
                           int64_t timeline_bytes) {
  DecodeParams d = derive(p);
  const LaunchArgs args{max_smem_per_block, programmatic_launch(cc_major), num_sms,
                        decode_row_tiles(p, num_sms), stream};
  d.timeline = timeline;
  d.timeline_ctas =
      timeline_bytes / int64_t(sizeof(unsigned long long) * decode::DecodeMarks::kSlots);
  const int32_t kv_dtype = decode_kv_dtype(p);
#define FH_DECODE_LAUNCH_DTYPE(q_value, kv_value, name)                                         \
  if (p->dtype == q_value && kv_dtype == kv_value) {                                            \
    return launch_dtype<typename DecodeInput<q_value, kv_value>::Type>(d, p->head_dim, args); \
  }
  FH_DECODE_DTYPES(FH_DECODE_LAUNCH_DTYPE)
#undef FH_DECODE_LAUNCH_DTYPE
  return LaunchResult::internal("decode dtype outside the decode table");
}

}  // namespace flash_hopper
