// flash-hopper C ABI.
//
// The one boundary between the kernels and any host language. Plain C: no torch, no CUTLASS,
// no C++ types. Python loads the shared library with ctypes and fills FhFwdParams field by field
// (python/flash_hopper/_lib.py mirrors this struct; keep both in the same order).
//
// Conventions
// - Every shape, stride and offset is int64_t and counted in elements, not bytes.
// - Tensors use FA3's layout: q (batch, seqlen_q, heads_q, head_dim), k/v (batch, seqlen_k,
//   heads_kv, head_dim), o like q; the head_dim axis must be contiguous (stride 1).
// - lse is fp32 (batch, heads_q, seqlen_q) with its own batch/head strides, row stride 1.
// - Fields reserved for later features (varlen, paged KV, FP8 descales, split-KV) are part of the
//   struct now so the ABI does not change when they land; until then a non-null / non-zero value in
//   them is rejected with FH_ERROR_UNSUPPORTED, never silently ignored.
// - Functions return FhStatus; on error fh_last_error() returns a message naming the argument,
//   what was expected and what was given (thread-local, valid until the next call on that thread).
#ifndef FLASH_HOPPER_API_H
#define FLASH_HOPPER_API_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define FH_EXPORT __declspec(dllexport)
#else
#define FH_EXPORT __attribute__((visibility("default")))
#endif

// Bumped whenever FhFwdParams or a function signature changes; Python refuses a mismatch.
#define FH_ABI_VERSION 1

typedef enum FhStatus {
  FH_SUCCESS = 0,
  FH_ERROR_INVALID_ARGUMENT = 1,  // a shape, stride, pointer or flag is wrong
  FH_ERROR_UNSUPPORTED = 2,       // valid request, but no kernel in this build serves it
  FH_ERROR_CUDA = 3,              // a CUDA runtime call failed (message has the CUDA error string)
  FH_ERROR_INTERNAL = 4,
} FhStatus;

typedef enum FhDtype {
  FH_DTYPE_FP16 = 0,
  FH_DTYPE_BF16 = 1,
  FH_DTYPE_E4M3 = 2,  // reserved for the FP8 forward
  FH_DTYPE_FP32 = 3,
} FhDtype;

typedef enum FhBackend {
  FH_BACKEND_AUTO = 0,  // FA-3 path on cc 9.0 when built, else FA-2 path
  FH_BACKEND_FA2 = 1,   // sm80 kernels (cp.async + mma.sync); runs on any cc >= 8.0
  FH_BACKEND_FA3 = 2,   // sm90a kernels (TMA + WGMMA, warp specialized)
} FhBackend;

// Ablation variants of the FA-3 path (the FA3 paper's Table 2): 0 is the tuned kernel.
typedef enum FhVariant {
  FH_VARIANT_TUNED = 0,
  FH_VARIANT_NO_PINGPONG = 1,               // consumer warpgroups not ordered by named barriers
  FH_VARIANT_NO_OVERLAP = 2,                // no intra-warpgroup softmax / PV GEMM overlap
  FH_VARIANT_NO_PINGPONG_NO_OVERLAP = 3,
} FhVariant;

typedef struct FhFwdParams {
  int32_t abi_version;  // must be FH_ABI_VERSION

  // --- data -------------------------------------------------------------------------------
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // may be null when the caller does not need it

  int32_t dtype;      // FhDtype of q/k/v
  int32_t out_dtype;  // FhDtype of o (== dtype for fp16/bf16)

  // --- shapes -----------------------------------------------------------------------------
  int64_t batch;
  int64_t seqlen_q;
  int64_t seqlen_k;
  int64_t heads_q;
  int64_t heads_kv;  // heads_q % heads_kv == 0 (GQA / MQA)
  int64_t head_dim;  // of q and k
  int64_t head_dim_v;  // of v and o; == head_dim until asymmetric head dims land

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

  // --- reserved: varlen (later issue) -----------------------------------------------------
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  const int32_t* seqused_k;
  // --- reserved: paged KV (later issue) ---------------------------------------------------
  const int32_t* page_table;
  int64_t page_table_batch_stride;
  int64_t page_size;
  // --- reserved: FP8 descales (later issue) -----------------------------------------------
  const float* q_descale;
  const float* k_descale;
  const float* v_descale;
  int64_t descale_batch_stride, descale_head_stride;
  // --- reserved: split-KV (later issue) ---------------------------------------------------
  int32_t num_splits;  // 0 or 1 = no split
  float* o_accum;
  float* lse_accum;

  // --- dispatch ---------------------------------------------------------------------------
  int32_t backend;  // FhBackend
  int32_t variant;  // FhVariant: 0 = tuned kernel; ablation variants of the FA-3 path
  int32_t num_sms;  // 0 = query the device
} FhFwdParams;

// Forward attention on `stream` (a cudaStream_t; null = legacy default stream).
FH_EXPORT FhStatus fh_fwd(const FhFwdParams* params, void* stream);

// Which backend fh_fwd would run for these params on the current device, without launching:
// writes FhBackend into *backend_out. Errors like fh_fwd for unservable params.
FH_EXPORT FhStatus fh_fwd_select_backend(const FhFwdParams* params, int32_t* backend_out);

// Message of the last failing call on this thread ("" if none).
FH_EXPORT const char* fh_last_error(void);

FH_EXPORT int32_t fh_abi_version(void);

// JSON object describing the build: version, commit, archs, head-dim buckets, dtypes, variants.
FH_EXPORT const char* fh_build_info(void);

// 1 if this build holds a forward kernel for (backend, dtype, head-dim bucket of head_dim).
FH_EXPORT int32_t fh_has_fwd_kernel(int32_t backend, int32_t dtype, int64_t head_dim);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // FLASH_HOPPER_API_H
