// Host test of flash_hopper::sequence_span (varlen.h), the one place a varlen call's sequence
// spans come from (the prepare kernel copies them into the tile records both paths walk): FA3's
// offsets rules, the KV-cache extras (a cache entry per sequence, left padding), and the clamps
// that keep unvalidated offsets inside the tensors.
#include <cstdio>
#include <vector>

#include "flash_hopper/varlen.h"

using flash_hopper::KvIndex;
using flash_hopper::SequenceSpan;
using flash_hopper::sequence_span;

#include "host_check.h"

static void expect(SequenceSpan s, int q_start, int seqlen_q, int k_start, int seqlen_k,
                   const char* what) {
  CHECK(s.q_start == q_start && s.seqlen_q == seqlen_q && s.k_start == k_start &&
            s.seqlen_k == seqlen_k,
        "%s: got q [%d, +%d) k [%d, +%d), want q [%d, +%d) k [%d, +%d)", what, s.q_start,
        s.seqlen_q, s.k_start, s.seqlen_k, q_start, seqlen_q, k_start, seqlen_k);
}

int main() {
  // Plain varlen: spans from the offsets, seqused as the used prefix.
  const std::vector<int32_t> cu_q = {0, 3, 3, 10};
  const std::vector<int32_t> cu_k = {0, 50, 80, 200};
  const std::vector<int32_t> used_k = {20, 30, 500};
  expect(sequence_span(cu_q.data(), cu_k.data(), nullptr, nullptr, 0, 10, 200), 0, 3, 0, 50,
         "spans");
  expect(sequence_span(cu_q.data(), cu_k.data(), nullptr, used_k.data(), 2, 10, 200), 3, 7, 80,
         120, "seqused past its span clamps to the span");

  // A dense cache of 4 entries of 64 rows (cu_k = 64 * i), as flash_attn_with_kvcache passes it:
  // sequence b reads entry idx[b], its keys [leftpad[b], cache_seqlens[b]).
  const std::vector<int32_t> cache_cu = {0, 64, 128, 192, 256};
  const std::vector<int32_t> q1 = {0, 1, 2, 3};
  const std::vector<int32_t> lengths = {10, 64, 0};
  const std::vector<int32_t> idx = {3, 0, 1};
  const std::vector<int32_t> pad = {4, 64, 0};
  KvIndex kv{idx.data(), nullptr, 4};
  expect(sequence_span(q1.data(), cache_cu.data(), nullptr, lengths.data(), 0, 3, 256, kv), 0, 1,
         192, 10, "entry 3");
  expect(sequence_span(q1.data(), cache_cu.data(), nullptr, lengths.data(), 1, 3, 256, kv), 1, 1,
         0, 64, "entry 0, full");
  kv.leftpad = pad.data();
  expect(sequence_span(q1.data(), cache_cu.data(), nullptr, lengths.data(), 0, 3, 256, kv), 0, 1,
         196, 6, "entry 3, left padding 4");
  expect(sequence_span(q1.data(), cache_cu.data(), nullptr, lengths.data(), 1, 3, 256, kv), 1, 1,
         64, 0, "left padding of every key: none left");
  expect(sequence_span(q1.data(), cache_cu.data(), nullptr, lengths.data(), 2, 3, 256, kv), 2, 1,
         64, 0, "no keys");
  // Left padding alone (no entry index): entry b.
  KvIndex pad_only{nullptr, pad.data(), 0};
  expect(sequence_span(q1.data(), cache_cu.data(), nullptr, lengths.data(), 0, 3, 256, pad_only),
         0, 1, 4, 6, "left padding, entry b");

  // Unvalidated values stay inside the tensors: entry indices clamp to [0, batch_k), left
  // padding to the used keys (negative: none), lengths to the span.
  const std::vector<int32_t> bad_idx = {-7, 99, 2};
  const std::vector<int32_t> bad_pad = {-5, 1000, 3};
  const std::vector<int32_t> long_len = {1000, 1000, 1000};
  KvIndex bad{bad_idx.data(), bad_pad.data(), 4};
  expect(sequence_span(q1.data(), cache_cu.data(), nullptr, long_len.data(), 0, 3, 256, bad), 0,
         1, 0, 64, "index -7 reads entry 0, negative padding none");
  expect(sequence_span(q1.data(), cache_cu.data(), nullptr, long_len.data(), 1, 3, 256, bad), 1,
         1, 256, 0, "index 99 reads entry 3, padding past the keys leaves none");
  expect(sequence_span(q1.data(), cache_cu.data(), nullptr, long_len.data(), 2, 3, 200, bad), 2,
         1, 131, 61, "entry 2: length clamped to its span, then padding 3");
  for (int b = 0; b < 3; ++b) {
    const SequenceSpan s =
        sequence_span(q1.data(), cache_cu.data(), nullptr, long_len.data(), b, 3, 200, bad);
    CHECK(s.k_start >= 0 && s.seqlen_k >= 0 && s.k_start + s.seqlen_k <= 200,
          "sequence %d: keys [%d, +%d) outside the 200-row tensor", b, s.k_start, s.seqlen_k);
  }
  return host_check_exit();
}
