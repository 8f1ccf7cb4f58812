// Variable-length batches (docs/host.md "Varlen", docs/fwd_sm90.md "Varlen"): the packed
// layout's per-sequence spans and the work list both forward paths walk.
//
// A varlen call packs the sequences of a batch along one token axis: q (total_q, heads, d), k / v
// (total_k, heads_kv, d), sequence b at tokens [cu_seqlens[b], cu_seqlens[b + 1]); seqused[b],
// when given, is the used prefix of that span (FA3's SeqlenInfo: the rest of the span is padding
// that nothing reads into a result and nothing writes). Spans are clamped to the tensors, so even
// offsets the host did not validate (CUDA-graph capture skips the host check) never address
// memory outside q, k, v or o.
//
// The prepare kernel (kernels/src/varlen.cu) lists every (sequence, query block) pair that has
// query rows, costliest first (cost: the key blocks the tile's mask visits), with each
// sequence's span and the tile's key-block range copied into the pair, so a kernel loads one
// 48-byte record per tile. The FA-3
// path's persistent CTAs walk the list in the static scheduler's snake order
// (sm90/fwd/tile_scheduler.h: FwdTileOrder), the FA-2 path launches one CTA per (pair, head).
// Workspace (caller-allocated, fh_fwd_workspace_size): a 32-byte header {num_pairs, overflow,
// ...}, then VarlenPair[capacity] (48 bytes each); capacity = total_q / 64 + batch bounds the pairs of any
// monotone cu_seqlens for every kernel tile (block_m >= 64); an overflow (only for offsets that
// are not monotone) drops pairs and sets the flag, it never writes past the workspace.
// Plain C++: the host tests compile it with g++.
#pragma once

#include <cstdint>

#include "flash_hopper/host_device.h"

namespace flash_hopper {

struct SequenceSpan {
  int q_start;
  int k_start;
  int seqlen_q;
  int seqlen_k;
};

// One tile of the list: the sequence, its query block, the sequence's span, and the block's key
// range under the sequence's mask with its unmasked split for the kernel's tile (mask.h): the
// FA-3 consumers take them as they are (computing them per tile cost the d64 kernel spills).
struct VarlenPair {
  int batch;
  int m_block;
  int q_start;
  int k_start;
  int seqlen_q;
  int seqlen_k;
  int n_min;  // KeyBlockRange
  int n_max;
  int n_left;  // KeyBlockSplit
  int n_right;
  int cost;
  int m_blocks;  // the sequence's query blocks (its pairs are adjacent in unmasked lists)
};
static_assert(sizeof(VarlenPair) == 48, "one pair is three 16-byte loads");

struct VarlenHeader {
  int num_pairs;
  int overflow;      // 1 when pairs were dropped (offsets that are not monotone)
  int tile_counter;  // 0 from the prepare kernel: masked calls claim their tiles from it
  int reserved[5];
};
static_assert(sizeof(VarlenHeader) == 32, "pairs start 16-byte aligned");

// The smallest query tile of any forward kernel: the capacity bound holds for every tile >= it.
inline constexpr int kVarlenMinBlockM = 64;

FH_HOST_DEVICE int64_t varlen_capacity(int64_t total_q, int64_t batch) {
  return total_q / kVarlenMinBlockM + batch;
}

FH_HOST_DEVICE int64_t varlen_workspace_bytes(int64_t total_q, int64_t batch) {
  return int64_t(sizeof(VarlenHeader)) + varlen_capacity(total_q, batch) * sizeof(VarlenPair);
}

namespace detail {
FH_HOST_DEVICE int clamp_int(int x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : x; }
}  // namespace detail

// A KV-cache call's extras (api.h: kv_batch_idx, leftpad_k, batch_k); all null / 0 otherwise.
struct KvIndex {
  const int32_t* batch_idx = nullptr;  // sequence b reads entry batch_idx[b] of cu_k
  const int32_t* leftpad = nullptr;    // keys skipped at the start of sequence b's used keys
  int batch_k = 0;                     // entries of cu_k (batch_k + 1 offsets) with batch_idx
};

// Sequence b's span under FA3's rule, clamped to the tensors (total_q / total_k tokens):
// start = cu[b], length = seqused[b] if given else cu[b + 1] - cu[b]. KV cache (kv): the keys
// come from entry kv.batch_idx[b] of cu_k (clamped to [0, batch_k)), and the first
// kv.leftpad[b] used keys (clamped to them) are dropped from the span.
FH_HOST_DEVICE SequenceSpan sequence_span(const int32_t* cu_q, const int32_t* cu_k,
                                                 const int32_t* used_q, const int32_t* used_k,
                                                 int b, int total_q, int total_k,
                                                 KvIndex const& kv = KvIndex{}) {
  SequenceSpan s;
  s.q_start = detail::clamp_int(cu_q[b], 0, total_q);
  s.seqlen_q = detail::clamp_int(cu_q[b + 1], s.q_start, total_q) - s.q_start;
  if (used_q != nullptr) {
    s.seqlen_q = detail::clamp_int(used_q[b], 0, s.seqlen_q);
  }
  const int entry =
      kv.batch_idx != nullptr ? detail::clamp_int(kv.batch_idx[b], 0, kv.batch_k - 1) : b;
  s.k_start = detail::clamp_int(cu_k[entry], 0, total_k);
  s.seqlen_k = detail::clamp_int(cu_k[entry + 1], s.k_start, total_k) - s.k_start;
  if (used_k != nullptr) {
    s.seqlen_k = detail::clamp_int(used_k[b], 0, s.seqlen_k);
  }
  if (kv.leftpad != nullptr) {
    const int skip = detail::clamp_int(kv.leftpad[b], 0, s.seqlen_k);
    s.k_start += skip;
    s.seqlen_k -= skip;
  }
  return s;
}

}  // namespace flash_hopper
