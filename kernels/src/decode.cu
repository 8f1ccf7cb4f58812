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
// 70 KiB, d256: 138 KiB); where not even those fit (d256 on 99 KiB), the kernel does not serve
// the device (fh_decode_stages answers 0 and the library's policy sends the call elsewhere, before
// the caller touches any cache). Every stage count of the table that fits 227 KiB is compiled, so
// that FLASH_HOPPER_DECODE_STAGES can measure the others without a rebuild.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "decode/decode_kernel.h"
#include "fh_decode_table.inc"
#include "src/decode.h"
#include "src/score_transform.h"
#include "src/programmatic_launch.h"

namespace flash_hopper {
namespace {

using decode::DecodeConfig;
using decode::DecodeParams;

// The tuned stage count per head dim; FLASH_HOPPER_DECODE_STAGES (a count of the table, read per
// call) overrides it for measurements (bench/PERFLOG.md). Either gives way to fewer stages where
// it does not fit.
constexpr int kMinStages = FH_DECODE_MIN_STAGES;
constexpr int kMaxSmemPerBlock = 227 * 1024;

// The kernel's element type of a table dtype.
template <int32_t kDtype>
struct DecodeElement;
template <>
struct DecodeElement<FH_DTYPE_FP16> {
  using Type = __half;
};
template <>
struct DecodeElement<FH_DTYPE_BF16> {
  using Type = __nv_bfloat16;
};

// The table's head dims with their tuned stages.
struct TunedStages {
  int64_t head_dim;
  int stages;
};
#define FH_DECODE_TUNED(hd, stages) {hd, stages},
constexpr TunedStages kTunedStages[] = {FH_DECODE_TABLE(FH_DECODE_TUNED)};
#undef FH_DECODE_TUNED

int default_stages(int64_t head_dim) {
  for (const TunedStages& t : kTunedStages) {
    if (t.head_dim == head_dim) {
      return t.stages;
    }
  }
  return 0;
}

template <int kHeadDim, int kStages>
constexpr int smem_bytes() {
  return DecodeConfig<kHeadDim, kStages>::kSmemBytes;
}

// The shared memory of a stage count of the table at kHeadDim; 0 for a count it does not list.
template <int kHeadDim>
int smem_for(int stages) {
#define FH_DECODE_SMEM(s)              \
  if (stages == s) {                   \
    return smem_bytes<kHeadDim, s>(); \
  }
  FH_DECODE_STAGE_COUNTS(FH_DECODE_SMEM)
#undef FH_DECODE_SMEM
  return 0;
}

// The same for a head dim of the table; 0 for one it does not list.
int smem_of(int64_t head_dim, int stages) {
#define FH_DECODE_SMEM_OF(hd, tuned) \
  if (head_dim == hd) {              \
    return smem_for<hd>(stages);     \
  }
  FH_DECODE_TABLE(FH_DECODE_SMEM_OF)
#undef FH_DECODE_SMEM_OF
  return 0;
}

}  // namespace

int decode_stages(int64_t head_dim, int max_smem_per_block) {
  const int tuned = default_stages(head_dim);
  if (tuned == 0) {
    return 0;  // not a decode head dim
  }
  const int limit = max_smem_per_block < kMaxSmemPerBlock ? max_smem_per_block : kMaxSmemPerBlock;
  int want = tuned;
  if (const char* env = std::getenv("FLASH_HOPPER_DECODE_STAGES")) {
    const int v = std::atoi(env);
    if (smem_of(head_dim, v) > 0) {
      want = v;
    }
  }
  for (int stages = want; stages >= kMinStages; --stages) {
    const int smem = smem_of(head_dim, stages);
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

template <class Element, int kHeadDim, int kStages>
LaunchResult launch(DecodeParams const& d, int max_smem_per_block, bool programmatic,
                    cudaStream_t stream) {
  constexpr int kSmem = smem_bytes<kHeadDim, kStages>();
  if constexpr (kSmem > kMaxSmemPerBlock) {
    return LaunchResult::no_tile_fits(kSmem);
  } else {
    if (kSmem > max_smem_per_block) {
      return LaunchResult::no_tile_fits(kSmem);
    }
    auto kernel = decode::decode_kernel<Element, kHeadDim, kStages>;
    cudaError_t err = opt_in_dynamic_smem<decode::decode_kernel<Element, kHeadDim, kStages>>(kSmem);
    if (err != cudaSuccess) {
      return LaunchResult::cuda(err);
    }
    const dim3 grid(d.splits, d.heads_kv * d.row_blocks, d.batch);
    const dim3 block(decode::kThreads);
    err = launch_programmatic(kernel, grid, block, kSmem, stream, programmatic, d);
    if (err == cudaSuccess && d.splits > 1) {
      const dim3 blocks(static_cast<unsigned>(int64_t{d.batch} * d.heads_kv * d.row_blocks));
      err = launch_programmatic(decode::combine_kernel<Element, kHeadDim>, blocks, block, 0,
                                stream, programmatic, d);
    }
    return LaunchResult::cuda(err);
  }
}

template <class Element, int kHeadDim>
LaunchResult launch_stages(DecodeParams const& d, int max_smem_per_block, bool programmatic,
                           cudaStream_t stream) {
  const int stages = decode_stages(kHeadDim, max_smem_per_block);
#define FH_DECODE_LAUNCH(s)                                                    \
  if (stages == s) {                                                           \
    return launch<Element, kHeadDim, s>(d, max_smem_per_block, programmatic, stream); \
  }
  FH_DECODE_STAGE_COUNTS(FH_DECODE_LAUNCH)
#undef FH_DECODE_LAUNCH
  return LaunchResult::no_tile_fits(smem_bytes<kHeadDim, kMinStages>());
}

template <class Element>
LaunchResult launch_dtype(DecodeParams const& d, int64_t head_dim, int max_smem_per_block,
                          bool programmatic, cudaStream_t stream) {
#define FH_DECODE_LAUNCH_HEAD_DIM(hd, tuned)                                          \
  if (head_dim == hd) {                                                               \
    return launch_stages<Element, hd>(d, max_smem_per_block, programmatic, stream); \
  }
  FH_DECODE_TABLE(FH_DECODE_LAUNCH_HEAD_DIM)
#undef FH_DECODE_LAUNCH_HEAD_DIM
  return LaunchResult::internal("decode head_dim outside the decode table");
}

}  // namespace

int decode_ctas_per_sm(int64_t head_dim) {
  const int smem = smem_of(head_dim, decode_stages(head_dim, kMaxSmemPerBlock));
  if (smem <= 0) {
    return 1;
  }
  const int n = kSmPerSmBytes / (smem + kReservedPerCta);
  return n < 1 ? 1 : (n > 4 ? 4 : n);
}

LaunchResult launch_decode(FhDecodeParams const* p, int max_smem_per_block, int cc_major,
                           cudaStream_t stream, unsigned long long* timeline,
                           int64_t timeline_bytes) {
  DecodeParams d = derive(p);
  const bool programmatic = programmatic_launch(cc_major);
  d.timeline = timeline;
  d.timeline_ctas =
      timeline_bytes / int64_t(sizeof(unsigned long long) * decode::DecodeMarks::kSlots);
#define FH_DECODE_LAUNCH_DTYPE(value, name)                                            \
  if (p->dtype == value) {                                                             \
    return launch_dtype<typename DecodeElement<value>::Type>(d, p->head_dim,           \
                                                             max_smem_per_block,       \
                                                             programmatic, stream);    \
  }
  FH_DECODE_DTYPES(FH_DECODE_LAUNCH_DTYPE)
#undef FH_DECODE_LAUNCH_DTYPE
  return LaunchResult::internal("decode dtype outside the decode table");
}

}  // namespace flash_hopper
