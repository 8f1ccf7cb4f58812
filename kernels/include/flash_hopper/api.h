// flash-hopper C ABI.
//
// The one boundary between the kernels and any host language. Plain C: no torch, no CUTLASS,
// no C++ types. Python loads the shared library with ctypes, fills FhFwdParams once per call
// signature and reuses it with new data pointers (python/flash_hopper/_lib.py mirrors this struct
// and the enums; keep both in the same order, tests/test_lib.py checks them).
//
// Conventions
// - Every shape, stride and offset is int64_t and counted in elements, not bytes.
// - Tensors use FA3's layout: q (batch, seqlen_q, heads_q, head_dim), k/v (batch, seqlen_k,
//   heads_kv, head_dim), o like q; the head_dim axis must be contiguous (stride 1).
// - lse is fp32 (batch, heads_q, seqlen_q) with its own batch/head strides, row stride 1.
// - Fields reserved for later features (FhBwdParams' chunk and sinks) are part of the
//   struct now so the ABI does not change when they land; until then a non-null / non-zero value in
//   them is rejected with FH_ERROR_UNSUPPORTED, never silently ignored.
// - Functions return FhStatus; on error fh_last_error() returns a message naming the argument,
//   what was expected and what was given (thread-local, valid until the next call on that thread).
//   Nothing is launched on any error.
// - The library reads FhFwdParams during the call only and keeps no pointer to it: one struct
//   may be filled once per problem shape and reused with new data pointers, from any thread.
#ifndef FLASH_HOPPER_API_H
#define FLASH_HOPPER_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define FH_EXPORT __declspec(dllexport)
#else
#define FH_EXPORT __attribute__((visibility("default")))
#endif

// Bumped whenever FhFwdParams, FhBwdParams or a function signature changes; Python refuses a
// mismatch. 3: the backward (FhBwdParams, fh_bwd*). 4: the FP8 forward (per-tensor descale
// strides and fp8_accumulation in FhFwdParams). 5: the mixed mode (FhFwdParams::kv_dtype,
// FH_DTYPE_E5M2). 6: varlen (FhFwdParams::seqused_q, max_seqlen_*, workspace;
// fh_fwd_workspace_size). 7: KV-cache fields (FhFwdParams::kv_batch_idx, leftpad_k, batch_k).
// 8: the decode kernel (FhDecodeParams, fh_decode, fh_decode_plan). 9: FhDecodeParams without
// the merge counters (a combine kernel merges the splits). 11: the decode kernel in the policy
// (FH_BACKEND_DECODE, FhFwdParams::decode_route, fh_decode_select_backend); FhFwdParams without
// the reserved paged / split-KV fields (the decode kernel serves both: FhDecodeParams). 12: FP8
// caches in the decode kernel (FhDecodeParams::kv_dtype and its descales).
#define FH_ABI_VERSION 12

// The library's own status; the message (fh_last_error) tells the cases of one status apart.
typedef enum FhStatus {
  FH_SUCCESS = 0,
  // A field is wrong: abi_version, dtype, a shape, stride, pointer, alignment, scale, window,
  // backend or variant. The message names the field, the expected and the given value.
  FH_ERROR_INVALID_ARGUMENT = 1,
  // A valid request this build or this GPU cannot serve: no kernel for the dtype / head dim /
  // variant (the message names the FH_* build variables to change), a compute capability the path
  // does not run on, no tile config that fits the GPU's shared memory, a layout the path cannot
  // load (TMA strides), or a reserved feature that is not implemented yet.
  FH_ERROR_UNSUPPORTED = 2,
  // A CUDA runtime call failed; the message has the CUDA error's name and string. Only the CUDA
  // runtime's own failures map here, never one of the decisions above.
  FH_ERROR_CUDA = 3,
  FH_ERROR_INTERNAL = 4,  // a bug in flash-hopper
} FhStatus;

typedef enum FhDtype {
  FH_DTYPE_FP16 = 0,
  FH_DTYPE_BF16 = 1,
  FH_DTYPE_E4M3 = 2,  // FP8 e4m3 q / k / v: the FA-3 path's forward (o in fp16 or bf16)
  FH_DTYPE_FP32 = 3,
  FH_DTYPE_E5M2 = 4,  // FP8 e5m2 k / v of the mixed mode only (kv_dtype)
} FhDtype;

typedef enum FhBackend {
  FH_BACKEND_AUTO = 0,  // FA-3 path on cc 9.0 when built, else FA-2 path
  FH_BACKEND_FA2 = 1,   // sm80 kernels (cp.async + mma.sync); runs on any cc >= 8.0
  FH_BACKEND_FA3 = 2,   // sm90a kernels (TMA + WGMMA, warp specialized)
  // The decode kernel (fh_decode, FhDecodeParams): an answer of the policy, never a request
  // (fh_fwd_select_backend for decode_route calls, fh_decode_select_backend).
  FH_BACKEND_DECODE = 3,
} FhBackend;

// Each bit switches one FA-3 optimization off (the FA3 paper's ablation, Table 2). A variant is
// a set of these bits; its backend name is "fa3" plus "-<flag>" per set bit in bit order
// ("fa3-no-pingpong-no-overlap"), kernels/src/tables.cmake lists them.
typedef enum FhVariantFlag {
  // Consumer warpgroups not ordered by named barriers: a runtime switch of the tuned kernel.
  FH_VARIANT_FLAG_NO_PINGPONG = 1,
  // No intra-warpgroup softmax / PV GEMM overlap: a template parameter, so a kernel of its own
  // (built for FH_FA3_ABLATION_DTYPES x FH_FA3_ABLATION_HEAD_DIMS only).
  FH_VARIANT_FLAG_NO_OVERLAP = 2,
} FhVariantFlag;

// Variants of the FA-3 path; 0 is the tuned kernel. Values are fixed by the ABI and the names
// of recorded benchmarks: a new flag adds values, it never renumbers these.
// How the FP8 forward accumulates P V (FhFwdParams::fp8_accumulation).
typedef enum FhFp8Accumulation {
  // Each key block's PV GEMM starts from zero and is added into an fp32 O in registers: the FP8
  // tensor core's accumulator never carries the long sum (accurate at long context).
  FH_FP8_ACCUM_TWO_LEVEL = 0,
  // One WGMMA accumulator over every key block, as the 16-bit path does: the ablation.
  FH_FP8_ACCUM_SINGLE_LEVEL = 1,
} FhFp8Accumulation;

typedef enum FhVariant {
  FH_VARIANT_TUNED = 0,
  FH_VARIANT_NO_PINGPONG = FH_VARIANT_FLAG_NO_PINGPONG,
  FH_VARIANT_NO_OVERLAP = FH_VARIANT_FLAG_NO_OVERLAP,
  FH_VARIANT_NO_PINGPONG_NO_OVERLAP = FH_VARIANT_FLAG_NO_PINGPONG | FH_VARIANT_FLAG_NO_OVERLAP,
} FhVariant;

typedef struct FhFwdParams {
  int32_t abi_version;  // must be FH_ABI_VERSION

  // --- data -------------------------------------------------------------------------------
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // may be null when the caller does not need it

  int32_t dtype;      // FhDtype of q (and of k/v but in the mixed mode)
  int32_t out_dtype;  // FhDtype of o: == dtype for fp16/bf16; fp16 or bf16 for e4m3
  // FhDtype of k/v: 0 (a zero-initialized struct) or == dtype: k/v are in dtype. Else the mixed
  // mode (the FA-3 path's forward): dtype fp16 / bf16 with kv_dtype FH_DTYPE_E4M3 or
  // FH_DTYPE_E5M2, an FP8 K/V cache converted to q's dtype in shared memory; k_descale /
  // v_descale apply (q_descale stays null), out_dtype == dtype, head_dim and the k/v strides
  // multiples of 16 elements.
  int32_t kv_dtype;

  // --- shapes -----------------------------------------------------------------------------
  int64_t batch;
  int64_t seqlen_q;
  int64_t seqlen_k;
  int64_t heads_q;
  int64_t heads_kv;  // heads_q % heads_kv == 0 (GQA / MQA)
  int64_t head_dim;  // of q and k
  int64_t head_dim_v;  // of v and o: head_dim, or a pair with a kernel of its own (fh_build_info
                       // "head_dim_v_kernels"; the policy names the pairs)

  // --- strides (elements); the head_dim stride is 1 and not stored ---------------------
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;

  // --- score transform and mask -----------------------------------------------------------
  float softmax_scale;  // applied to q.k before softcap
  float softcap;        // 0 = off; else score = softcap * tanh(score / softcap)
  // Bottom-right aligned: query i sees key j iff
  //   i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right,
  // a negative bound meaning unbounded on that side. Causal is window_right = 0.
  int64_t window_left;
  int64_t window_right;

  // --- varlen: sequences of different lengths packed along one token axis ------------------
  // cu_seqlens_q non-null makes the call varlen (FA3's flash_attn_varlen_func): q / o are
  // (total_q, heads_q, head_dim), k / v (total_k, heads_kv, head_dim), lse (heads_q, total_q);
  // batch is the number of sequences, seqlen_q / seqlen_k are total_q / total_k, and every
  // *_batch_stride is 0. Sequence b has the tokens [cu_seqlens[b], cu_seqlens[b + 1]) (int32
  // device arrays of batch + 1 non-decreasing offsets, cu_seqlens[batch] <= total), of which the
  // first seqused[b] are used when seqused_q / seqused_k is given (int32 device arrays of batch
  // entries, each <= its span; null: the whole span). Masks (causal, windows) apply per sequence,
  // bottom-right aligned on its own lengths. Rows of o / lse outside every used span are not
  // written. The library reads these arrays on the device only (no host synchronization, CUDA
  // graph safe) and clamps offsets to the tensors, so offsets that break the rules above give
  // wrong results but never touch memory outside q, k, v, o, lse: callers validate them
  // (Python does, outside graph capture). Both paths; FP8 (e4m3) on the FA-3 path; not with
  // mixed-mode inputs yet.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  const int32_t* seqused_k;
  const int32_t* seqused_q;
  int64_t max_seqlen_q;  // hints (0 = unknown); the kernels never rely on them
  int64_t max_seqlen_k;
  // Varlen: device scratch of >= fh_fwd_workspace_size bytes, 16-byte aligned (the call's work
  // list, written and read on the stream; nothing needs initialising).
  // Dense calls: optional. fh_fwd_workspace_size bytes (4, 4-byte aligned; 0 for calls without a
  // mask) hold a tile counter that fh_fwd zeroes on the stream before the kernel: masked calls
  // on the FA-3 path then claim their tiles at run time, so the SMs finish together. Null / 0:
  // tiles are walked in a static order (the same results, bit for bit).
  void* workspace;
  int64_t workspace_bytes;
  // --- KV cache (flash_attn_with_kvcache's cache_batch_idx / cache_leftpad; varlen only) ----
  // kv_batch_idx (int32, batch entries; null: b): sequence b reads the K / V span of entry
  // kv_batch_idx[b] of cu_seqlens_k, which then holds batch_k + 1 offsets (batch_k >= 1: the
  // cache's entries; 0 without kv_batch_idx: batch). seqused_k[b] stays sequence b's. leftpad_k
  // (int32, batch entries; null: 0): the first leftpad_k[b] of sequence b's used keys are not
  // attended; its masks align on the rest. Clamped on the device like the offsets (an entry
  // index outside [0, batch_k) reads the nearest entry, a leftpad past the used keys leaves none).
  const int32_t* kv_batch_idx;
  const int32_t* leftpad_k;
  int64_t batch_k;
  // --- FP8 (dtype FH_DTYPE_E4M3; k/v descales also in the mixed mode; null / 0 otherwise) --
  // Descales: fp32 (batch, heads_kv) at ptr[b * batch_stride + h_kv * head_stride], the factor
  // that turns the stored e4m3 values back into the real ones (score = q_descale * k_descale *
  // q.k, o scaled by v_descale); strides may be 0 (a broadcast scalar, an expand()ed tensor);
  // null = 1.0. head_dim % 16 == 0 and q/k/v strides multiples of 16 elements (16 bytes).
  const float* q_descale;
  const float* k_descale;
  const float* v_descale;
  int64_t q_descale_batch_stride, q_descale_head_stride;
  int64_t k_descale_batch_stride, k_descale_head_stride;
  int64_t v_descale_batch_stride, v_descale_head_stride;
  int32_t fp8_accumulation;  // FhFp8Accumulation; 0 = two-level

  // --- dispatch ---------------------------------------------------------------------------
  int32_t backend;  // FhBackend: AUTO, FA2 or FA3
  int32_t variant;  // FhVariant: 0 = tuned kernel; other values need backend FH_BACKEND_FA3
  int32_t num_sms;  // 0 = query the device; else a cap (min with the device's SM count)
  // 1: the caller runs the calls the decode kernel serves on it (fh_decode with k / v as a cache
  // of one full entry per sequence, varlen's packed keys as one entry with each sequence's span;
  // a varlen call's max_seqlen_q must then bound its sequences' queries), so that with backend
  // FH_BACKEND_AUTO the policy answers FH_BACKEND_DECODE for them; fh_fwd refuses those
  // (FH_ERROR_UNSUPPORTED). 0: the FA paths only.
  int32_t decode_route;
} FhFwdParams;

// Forward attention on `stream` (a cudaStream_t; null = legacy default stream) on the current
// device: validate, choose the backend (the policy of fh_fwd_select_backend on this device's
// compute capability), launch. A call the policy sends to the decode kernel (decode_route) is
// refused: fh_decode runs it.
FH_EXPORT FhStatus fh_fwd(const FhFwdParams* params, void* stream);

// The backend policy alone, for a GPU of compute capability cc_major.cc_minor: touches no GPU,
// so it answers on machines without one and for hypothetical GPUs. Validates params like fh_fwd
// except the data pointers, which it does not read (they may be null). On success writes the
// FhBackend fh_fwd would run (FH_BACKEND_DECODE: the decode kernel, for a decode_route call it
// serves, whatever FA kernels the build holds) into *backend_out and, when reason is not null, why
// (e.g. "cc 9.0 and fa3 kernel built for bf16 hdim 128 -> fa3"), NUL-terminated and cut to
// reason_len bytes. A question about a GPU that is not here takes the opt-in shared memory per
// block of CUDA's tables for its capability (the decode kernel's fit).
// When nothing can serve the request it returns FH_ERROR_UNSUPPORTED and fh_last_error() says
// why and what to rebuild or change.
FH_EXPORT FhStatus fh_fwd_select_backend(const FhFwdParams* params, int32_t cc_major,
                                         int32_t cc_minor, int32_t* backend_out, char* reason,
                                         size_t reason_len);

// Bytes of workspace fh_fwd needs for params (0 for a dense call): pure host arithmetic on the
// shapes (total_q and batch for varlen); pointers are not read.
FH_EXPORT FhStatus fh_fwd_workspace_size(const FhFwdParams* params, int64_t* bytes);

// Message of the last failing call on this thread ("" if none).
FH_EXPORT const char* fh_last_error(void);

FH_EXPORT int32_t fh_abi_version(void);

// JSON object describing the build: version, commit, cuda; archs, head_dims and dtypes built;
// head_dim_buckets (all buckets); variants (every FA-3 variant name -> FhVariant value);
// fa3_variants (the ablation names some kernel serves); kernels (one {backend, dtype, head_dim,
// variants} entry per compiled (path, dtype, bucket), variants as FhVariant values).
FH_EXPORT const char* fh_build_info(void);

// 1 if this build holds a forward kernel for (backend, dtype, head-dim bucket of head_dim).
FH_EXPORT int32_t fh_has_fwd_kernel(int32_t backend, int32_t dtype, int64_t head_dim);

// Debug: the device buffer the FA-3 forward records its event timeline into (the first CTAs'
// waits, GEMM issues and softmax ends with clock64 stamps; layout in kernels/sm90/fwd/timeline.h,
// reader bench/timeline.py), for later fh_fwd calls on this thread; null turns it off. Only
// libraries built with FH_TIMELINE=ON record: others return FH_ERROR_UNSUPPORTED. bytes must
// hold the whole layout.
FH_EXPORT FhStatus fh_debug_set_timeline(void* device_buffer, int64_t bytes);

// ---------------------------------------------------------------------------------------------
// Backward (ABI 3)
// ---------------------------------------------------------------------------------------------
//
// dq, dk, dv of attention by recomputation from the forward's LSE (FlashAttention-2/3):
//   P = exp(score - lse)   dV = P^T dO   dP = dO V^T   D = rowsum(dO * O) - dlse
//   dS = P * (dP - D) (* (1 - tanh^2) with softcap)   dQ = dS K * scale   dK = dS^T Q * scale
// with the forward's mask, softcap and GQA grouping (dk/dv summed over the query heads of a kv
// head). Three launches on `stream`, no host synchronization: a preprocess (D, the LSE in base 2,
// clearing the fp32 dQ accumulator, the semaphores and the tile counter), the main kernel (dk,
// dv written; dq accumulated in fp32), a postprocess (dq = scale * accumulator in the input
// dtype).
//
// The caller allocates the workspace: fh_bwd_workspace_size gives its size for a problem. Its
// layout (each region 256-byte aligned, rows padded to seqlen_q_rounded =
// round_up(round_up(seqlen_q, 80), 128), head_dim padded to the kernel's bucket):
//   dq_accum   fp32 (batch, heads_q, seqlen_q_rounded, bucket); inside each query block the
//              order is the path's own (its postprocess reads it back)
//   lse_log2   fp32 (batch, heads_q, seqlen_q_rounded)
//   dpsum (D)  fp32 (batch, heads_q, seqlen_q_rounded)
//   semaphores int32 (batch, heads_q, seqlen_q_rounded / 64)   (deterministic mode)
//   tile_counter int32, one   (the FA-3 path's tiles claimed at run time)
// Nothing in it needs initialising: the preprocess writes every byte the kernels read.
//
// deterministic = 1 makes dq bitwise reproducible (dk and dv always are): the contributions of
// the key blocks to each dq block are added in a fixed order (semaphores in the workspace).
typedef struct FhBwdParams {
  int32_t abi_version;  // must be FH_ABI_VERSION

  // --- data -------------------------------------------------------------------------------
  const void* q;  // forward inputs, layouts as in FhFwdParams
  const void* k;
  const void* v;
  const void* o;       // forward output, like q
  const float* lse;    // forward LSE, fp32 (batch, heads_q, seqlen_q), natural log
  const void* dout;    // dL/dout, like o
  const float* dlse;   // dL/dlse, like lse; null = 0 (only return_attn_probs users need it)
  void* dq;            // outputs, like q / k / v (written, never read)
  void* dk;
  void* dv;
  void* workspace;          // >= fh_bwd_workspace_size bytes, 256-byte aligned
  int64_t workspace_bytes;  // its size

  int32_t dtype;          // FhDtype of q/k/v/o/dout/dq/dk/dv (fp16 or bf16)
  int32_t deterministic;  // 0 or 1 (see above)

  // --- shapes (as FhFwdParams) --------------------------------------------------------------
  int64_t batch;
  int64_t seqlen_q;
  int64_t seqlen_k;
  int64_t heads_q;
  int64_t heads_kv;
  int64_t head_dim;
  int64_t head_dim_v;  // == head_dim (the backward has no V head dim of its own)

  // --- strides (elements); the head_dim stride is 1 and not stored ---------------------
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t dout_batch_stride, dout_row_stride, dout_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int64_t lse_batch_stride, lse_head_stride;    // row stride 1
  int64_t dlse_batch_stride, dlse_head_stride;  // row stride 1

  // --- score transform and mask: exactly the forward's ------------------------------------
  float softmax_scale;
  float softcap;
  int64_t window_left;
  int64_t window_right;

  // --- varlen: as FhFwdParams' (packed q / k / v / o / dout / dq / dk / dv, lse and dlse
  // (heads_q, total_q), seqlen_q / seqlen_k the totals, every *_batch_stride 0); the FA-3 path
  // only (cc 9.0). One call over every sequence: the offsets are read on the device (no host
  // synchronization, CUDA-graph safe) and clamped to the tensors. max_seqlen_q / max_seqlen_k
  // bound the sequences' lengths (0: the totals do, at the cost of idle tiles): a sequence
  // longer than its bound has only the gradients of its first max_seqlen tokens (its other rows
  // get 0, as do the rows of dq / dk / dv outside every used span). Rows of q / k / v / dout
  // past a used span must hold finite values (they are read as the neighbours of the span's
  // last block, with zero weight).
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  const int32_t* seqused_q;
  const int32_t* seqused_k;
  int64_t max_seqlen_q;
  int64_t max_seqlen_k;
  // --- reserved: chunked-local attention, sinks (rejected by name until they land) ---------
  int64_t attention_chunk;
  const float* sinks;
  float* dsinks;

  // --- dispatch ---------------------------------------------------------------------------
  int32_t backend;  // FhBackend
  int32_t variant;  // 0 (FA-3 ablation variants have no backward of their own)
  int32_t num_sms;  // 0 = query the device; else a cap (min with the device's SM count)
} FhBwdParams;

// Backward on `stream` on the current device: validate, choose the backend
// (fh_bwd_select_backend's policy on this device), launch the three kernels. batch == 0 returns
// at once; seqlen_q == 0 writes dk = dv = 0; seqlen_k == 0 writes dq = 0.
FH_EXPORT FhStatus fh_bwd(const FhBwdParams* params, void* stream);

// Bytes of workspace fh_bwd needs for params (data pointers, workspace and backend not read:
// the size does not depend on them). Pure host arithmetic.
FH_EXPORT FhStatus fh_bwd_workspace_size(const FhBwdParams* params, int64_t* bytes);

// The backward's backend policy for a GPU of compute capability cc_major.cc_minor, as
// fh_fwd_select_backend for the forward.
FH_EXPORT FhStatus fh_bwd_select_backend(const FhBwdParams* params, int32_t cc_major,
                                         int32_t cc_minor, int32_t* backend_out, char* reason,
                                         size_t reason_len);

// 1 if this build holds a backward kernel for (backend, dtype, head-dim bucket of head_dim).
FH_EXPORT int32_t fh_has_bwd_kernel(int32_t backend, int32_t dtype, int64_t head_dim);

// ---------------------------------------------------------------------------------------------
// Decode (ABI 10): few query rows against a KV cache, paged or dense
// ---------------------------------------------------------------------------------------------
//
// flash_attn_with_kvcache's kernel for short queries (decode, speculative decoding): the query
// heads of a KV head packed as the rows of one tile (each K / V tile read once per KV head), the
// keys optionally split across CTAs (split-KV: a batch of one still fills the GPU) and merged by
// their LSEs in a combine kernel the call launches right behind the decode kernel, K / V loaded
// row by row through the page table (cp.async: any page size, any strides, vLLM's interleaved
// K / V views included). The dtypes and head dims of the decode table (kernels/src/tables.cmake;
// fh_build_info's "decode"): 16-bit q / k / v, e4m3 q / k / v (FA3's FP8 convention, bf16 o), or
// 16-bit q against an e4m3 / e5m2 cache (kv_dtype); an FP8 cache is read as FP8 and widened to 16
// bits in shared memory, the MMAs stay 16-bit. sm_80 and up, where the kernel's shared memory fits
// (fh_decode_stages).
//
// Keys: sequence b attends keys [leftpad_k[b], seqlens_k[b]) of its cache, both clamped to the
// cache's capacity (dense: page_size; paged: max_pages * page_size); masks (causal, windows)
// aligned bottom-right on them as in FhFwdParams. Rows without keys: o = 0, lse = -inf (with
// sinks: lse = the sink, o = 0).
//
// Memory safety holds for any values in the index arrays: cu_seqlens_q is clamped to
// [0, total_q], a sequence's query count to seqlen_q (a varlen sequence longer than seqlen_q has
// only its first seqlen_q tokens written), kv_batch_idx to the cache's entries, page ids to the
// pool. Nothing outside q, k, v, o, lse and the workspace is read or written.
typedef struct FhDecodeParams {
  int32_t abi_version;  // must be FH_ABI_VERSION
  // FhDtype of q, and of k / v unless kv_dtype says otherwise: a row of the decode table
  // (fh_build_info's decode "dtypes"). o is in q's dtype, bf16 for FH_DTYPE_E4M3 q (FA3's).
  int32_t dtype;

  // --- data -------------------------------------------------------------------------------
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;                     // null: not written
  const int32_t* seqlens_k;       // (batch,) keys of each sequence (required)
  const int32_t* leftpad_k;       // (batch,) first attended key; null: 0
  const int32_t* kv_batch_idx;    // (batch,) cache entry (dense) / page-table row (paged); null: b
  const int32_t* page_table;      // (rows, max_pages) page ids; null: a dense cache
  const int32_t* cu_seqlens_q;    // (batch + 1,) varlen q / o / lse offsets; null: dense q
  const float* sinks;             // (heads_q,) fp32 sink logits; null: none
  // When num_splits > 1: fh_decode_plan's workspace_bytes of device scratch, 256-byte aligned
  // (the splits' partial outputs and LSEs, merged by a combine kernel the call launches behind
  // the decode kernel; nothing to initialise). Null otherwise.
  void* workspace;
  int64_t workspace_bytes;

  // --- shapes -----------------------------------------------------------------------------
  int64_t batch;
  int64_t seqlen_q;     // tokens per sequence (varlen: the maximum, max_seqlen_q)
  int64_t total_q;      // varlen: rows of q / o / lse (cu_seqlens_q clamped to them); else 0
  int64_t heads_q;
  int64_t heads_kv;     // heads_q % heads_kv == 0
  int64_t head_dim;
  int64_t page_size;    // paged: keys per page (>= 1); dense: the cache's keys per entry
  int64_t num_pages;    // paged: pages in the pool; dense: the cache's entries
  int64_t max_pages;    // paged: the page table's columns; dense: 1
  int64_t page_table_stride;  // paged: elements between page-table rows

  // --- strides (elements); head_dim contiguous -------------------------------------------
  // q / o: (batch, seqlen_q, heads, head_dim), varlen (total_q, heads, head_dim) with batch
  // strides unused. k / v: per page (dense: per entry), per key within it, per head.
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_page_stride, k_row_stride, k_head_stride;
  int64_t v_page_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  // lse: (batch, heads_q, seqlen_q), varlen (heads_q, total_q) with the batch stride unused
  int64_t lse_batch_stride, lse_head_stride;

  // --- score transform and mask (as FhFwdParams) ------------------------------------------
  float softmax_scale;
  float softcap;
  int64_t window_left;
  int64_t window_right;

  // --- FP8 caches -------------------------------------------------------------------------
  // Descales as FhFwdParams': fp32 (batch, heads_kv) at ptr[b * batch_stride + h_kv *
  // head_stride] (b the sequence), strides >= 0 (0 broadcasts), null = 1.0. The scores are
  // q_descale * k_descale * q.k (the softcap's argument with softcap), o is scaled by v_descale.
  // q_descale with e4m3 q only; k_descale / v_descale with an FP8 cache only. FP8 tensors' strides
  // and head_dim are multiples of 16 elements (16-byte rows).
  const float *q_descale, *k_descale, *v_descale;
  int64_t q_descale_batch_stride, q_descale_head_stride, k_descale_batch_stride,
      k_descale_head_stride, v_descale_batch_stride, v_descale_head_stride;

  // --- schedule ---------------------------------------------------------------------------
  int32_t num_splits;  // >= 1: key splits per row block (fh_decode_plan chooses for 0)
  // FhDtype of k / v: 0 (a zero-initialized struct) or == dtype: k / v in dtype. Else an FP8
  // cache (FH_DTYPE_E4M3 or FH_DTYPE_E5M2) under fp16 / bf16 q (the mixed mode's rows of the
  // decode table): read in FP8, widened to q's dtype in shared memory.
  int32_t kv_dtype;
} FhDecodeParams;

// The split count and workspace bytes of a decode call: params->num_splits when > 0 (capped at
// 128), else the library's choice for num_sms SMs (0: the current device's) from the shapes alone
// (batch, heads, seqlen_q, the cache's capacity), so the plan of a captured CUDA graph holds for
// every replay with the same shapes. Data pointers are not read.
FH_EXPORT FhStatus fh_decode_plan(const FhDecodeParams* params, int32_t num_sms,
                                  int32_t* num_splits_out, int64_t* workspace_bytes_out);

// Decode attention on `stream` on the current device. batch == 0 returns at once.
FH_EXPORT FhStatus fh_decode(const FhDecodeParams* params, void* stream);

// The policy's question for a decode call on a GPU of compute capability cc_major.cc_minor (with
// the opt-in shared memory per block of CUDA's tables for it): touches no GPU, reads no data
// pointer. FH_SUCCESS with FH_BACKEND_DECODE in *backend_out and, when reason is not null, why,
// when the decode kernel serves the call there (its dtype and head dim in the decode table, at
// most fh_build_info's decode max_rows packed rows, its stages fitting the shared memory);
// FH_ERROR_UNSUPPORTED with fh_last_error() naming what it lacks otherwise,
// FH_ERROR_INVALID_ARGUMENT for shapes fh_decode_plan refuses too. flash_attn_with_kvcache's route
// asks it first.
FH_EXPORT FhStatus fh_decode_select_backend(const FhDecodeParams* params, int32_t cc_major,
                                            int32_t cc_minor, int32_t* backend_out, char* reason,
                                            size_t reason_len);

// The key-ring stages the decode kernel runs at head_dim with a 16-bit cache (an FP8 cache's
// kernels have stages of their own: fh_build_info's decode "fp8_stages") on a device that allows
// max_smem_per_block bytes of shared memory per block (its opt-in limit; 0: the current device's,
// lowered by FLASH_HOPPER_DEBUG_SMEM_LIMIT as for every launch): the tuned count where it fits,
// else the largest that fits; 0 where none fits or head_dim is not one of the decode table's (the
// decode kernel does not serve that device). Pure host arithmetic for max_smem_per_block > 0.
FH_EXPORT int32_t fh_decode_stages(int64_t head_dim, int32_t max_smem_per_block);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // FLASH_HOPPER_API_H
