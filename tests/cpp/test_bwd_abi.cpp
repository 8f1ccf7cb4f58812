// Host test of the backward's C ABI (api.h, ABI 3) against the built libflash_hopper, without a
// GPU: the workspace size against api.h's documented layout (recomputed here, independently of
// kernels/src/validate_bwd.cu), one validation rule per case with its exact status and the
// field, expected and given value in the message, the backend policy over mocked compute
// capabilities, fh_has_bwd_kernel against build_info's kernel list, and batch == 0. tests/test_bwd_abi_cpp.py compiles and links
// it. Nothing here may reach a kernel launch: every fh_bwd call below fails validation, has
// batch == 0, or is built to fail in the backend policy on any machine (see workspace_exact).
// Prints "OK" and exits 0 on success.
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "flash_hopper/api.h"

#include "host_check.h"

// A fake, 256-byte aligned device address: validation only looks at its value.
static void* const kAddr = reinterpret_cast<void*>(uintptr_t(0x10000));

static bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Params that pass every check: bf16, contiguous FA-layout tensors, fake pointers and a workspace
// of exactly the documented size.
struct Problem {
  int64_t b = 2, sq = 128, sk = 128, hq = 8, hkv = 2, d = 64;
};

static int64_t bucket_of(int64_t d) {
  for (int64_t bucket : {64, 96, 128, 192, 256}) {
    if (d <= bucket) {
      return bucket;
    }
  }
  return -1;
}

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// api.h: dq_accum fp32 (b, hq, sq_r, bucket), lse_log2 and dpsum fp32 (b, hq, sq_r), semaphores
// int32 (b, hq, sq_r / 64); sq_r = round_up(sq, 128); each region starts 256-byte aligned.
struct Layout {
  int64_t starts[5];
  int64_t bytes;
};

static Layout documented_layout(int64_t b, int64_t sq, int64_t hq, int64_t d) {
  const int64_t sq_r = round_up(round_up(sq, 80), 128);
  const int64_t rows = b * hq * sq_r;
  const int64_t sizes[5] = {4 * rows * bucket_of(d), 4 * rows, 4 * rows, 4 * (rows / 64),
                            rows > 0 ? 4 : 0};  // the last: the tile counter
  Layout l{};
  int64_t end = 0;
  for (int i = 0; i < 5; ++i) {
    l.starts[i] = round_up(end, 256);
    end = l.starts[i] + sizes[i];
  }
  l.bytes = end;
  return l;
}

static FhBwdParams valid_params(Problem const& s = Problem()) {
  FhBwdParams p;
  std::memset(&p, 0, sizeof(p));
  p.abi_version = FH_ABI_VERSION;
  p.q = p.k = p.v = p.o = p.dout = kAddr;
  p.dq = p.dk = p.dv = p.workspace = kAddr;
  p.lse = static_cast<const float*>(kAddr);
  p.dtype = FH_DTYPE_BF16;
  p.batch = s.b;
  p.seqlen_q = s.sq;
  p.seqlen_k = s.sk;
  p.heads_q = s.hq;
  p.heads_kv = s.hkv;
  p.head_dim = p.head_dim_v = s.d;
  const int64_t q_row = s.hq * s.d, k_row = s.hkv * s.d;
  p.q_batch_stride = p.o_batch_stride = p.dout_batch_stride = p.dq_batch_stride = s.sq * q_row;
  p.q_row_stride = p.o_row_stride = p.dout_row_stride = p.dq_row_stride = q_row;
  p.q_head_stride = p.o_head_stride = p.dout_head_stride = p.dq_head_stride = s.d;
  p.k_batch_stride = p.v_batch_stride = p.dk_batch_stride = p.dv_batch_stride = s.sk * k_row;
  p.k_row_stride = p.v_row_stride = p.dk_row_stride = p.dv_row_stride = k_row;
  p.k_head_stride = p.v_head_stride = p.dk_head_stride = p.dv_head_stride = s.d;
  p.lse_batch_stride = p.dlse_batch_stride = s.hq * s.sq;
  p.lse_head_stride = p.dlse_head_stride = s.sq;
  p.softmax_scale = 0.125f;
  p.window_left = p.window_right = -1;
  p.backend = FH_BACKEND_AUTO;
  p.workspace_bytes = documented_layout(s.b, s.sq, s.hq, s.d).bytes;
  return p;
}

// One validation rule: fh_bwd (and, for rules that do not read data, fh_bwd_workspace_size and
// fh_bwd_select_backend too) fails with `status` and a message holding every part.
template <class Mutate>
static void expect_rejected(const char* what, FhStatus status, std::vector<std::string> parts,
                            Mutate mutate, bool data_rule = false) {
  FhBwdParams p = valid_params();
  mutate(p);
  auto check_call = [&](const char* fn, FhStatus got) {
    const std::string msg = fh_last_error();
    CHECK(got == status, "%s: %s returned %d, expected %d (%s)", what, fn, int(got), int(status),
          msg.c_str());
    for (const std::string& part : parts) {
      CHECK(contains(msg, part), "%s: %s message lacks '%s': %s", what, fn, part.c_str(),
            msg.c_str());
    }
  };
  check_call("fh_bwd", fh_bwd(&p, nullptr));
  int64_t bytes = -1;
  int32_t backend = -1;
  const FhStatus size_status = fh_bwd_workspace_size(&p, &bytes);
  const FhStatus select_status = fh_bwd_select_backend(&p, 9, 0, &backend, nullptr, 0);
  if (data_rule) {  // the size and the policy do not read data pointers or the workspace
    CHECK(size_status == FH_SUCCESS, "%s: fh_bwd_workspace_size returned %d (%s)", what,
          int(size_status), fh_last_error());
    CHECK(select_status == FH_SUCCESS || select_status == FH_ERROR_UNSUPPORTED,
          "%s: fh_bwd_select_backend returned %d (%s)", what, int(select_status),
          fh_last_error());
  } else {
    check_call("fh_bwd_workspace_size", fh_bwd_workspace_size(&p, &bytes));
    check_call("fh_bwd_select_backend", fh_bwd_select_backend(&p, 9, 0, &backend, nullptr, 0));
    CHECK(bytes == -1 && backend == -1, "%s: an output was written on failure", what);
  }
}

static void test_abi_version() {
  CHECK(fh_abi_version() == 12, "fh_abi_version() = %d, expected 12", int(fh_abi_version()));
  CHECK(fh_abi_version() == FH_ABI_VERSION, "library and header disagree on FH_ABI_VERSION");
}

static void test_workspace_size() {
  struct Shape {
    int64_t b, sq, hq, d;
  } shapes[] = {
      {1, 1, 1, 64},   {2, 128, 8, 64},  {3, 129, 5, 72},    {2, 1000, 16, 128}, {1, 127, 1, 200},
      {4, 4096, 32, 256}, {7, 333, 3, 96}, {1, 0, 4, 64},     {0, 128, 4, 64},    {16, 8192, 64, 192},
  };
  for (const Shape& s : shapes) {
    Problem pr;
    pr.b = s.b;
    pr.sq = s.sq;
    pr.hq = s.hq;
    pr.hkv = 1;
    pr.d = s.d;
    FhBwdParams p = valid_params(pr);
    // The size reads neither data pointers nor the workspace.
    p.q = p.k = p.v = p.o = p.dout = p.dq = p.dk = p.dv = p.workspace = nullptr;
    p.lse = nullptr;
    p.workspace_bytes = 0;
    int64_t bytes = -1;
    const FhStatus st = fh_bwd_workspace_size(&p, &bytes);
    const Layout l = documented_layout(s.b, s.sq, s.hq, s.d);
    CHECK(st == FH_SUCCESS, "workspace size b=%" PRId64 " sq=%" PRId64 ": status %d (%s)", s.b,
          s.sq, int(st), fh_last_error());
    CHECK(bytes == l.bytes,
          "workspace size b=%" PRId64 " sq=%" PRId64 " hq=%" PRId64 " d=%" PRId64 ": %" PRId64
          ", documented layout %" PRId64,
          s.b, s.sq, s.hq, s.d, bytes, l.bytes);
    for (int i = 0; i < 5; ++i) {
      CHECK(l.starts[i] % 256 == 0 && l.starts[i] <= l.bytes, "region %d start %" PRId64, i,
            l.starts[i]);
    }
    if (s.b == 0 || s.sq == 0) {
      CHECK(bytes == 0, "empty problem: workspace %" PRId64 " bytes, expected 0", bytes);
    }
  }
  // The head-dim bucket decides dq_accum's width: every d of a bucket needs the same bytes.
  Problem a, b;
  a.d = 72;
  b.d = 96;
  int64_t bytes_a = 0, bytes_b = 0;
  FhBwdParams pa = valid_params(a), pb = valid_params(b);
  fh_bwd_workspace_size(&pa, &bytes_a);
  fh_bwd_workspace_size(&pb, &bytes_b);
  CHECK(bytes_a == bytes_b && bytes_a > 0, "d 72 and 96 share bucket 96: %" PRId64 " vs %" PRId64,
        bytes_a, bytes_b);
  FhBwdParams p = valid_params();
  CHECK(fh_bwd_workspace_size(&p, nullptr) == FH_ERROR_INVALID_ARGUMENT &&
            contains(fh_last_error(), "bytes: expected a non-null pointer"),
        "workspace size with bytes null: %s", fh_last_error());
}

static void test_validation() {
  using S = std::vector<std::string>;
  const FhStatus INVALID = FH_ERROR_INVALID_ARGUMENT, UNSUPPORTED = FH_ERROR_UNSUPPORTED;
  CHECK(fh_bwd(nullptr, nullptr) == INVALID && contains(fh_last_error(), "params: expected"),
        "null params: %s", fh_last_error());
  expect_rejected("abi_version", INVALID, S{"abi_version: expected 12", "got 2"},
                  [](FhBwdParams& p) { p.abi_version = 2; });
  expect_rejected("dtype e4m3", INVALID, S{"dtype: expected", "FH_DTYPE_BF16", "the backward has no FP8", "got 2"},
                  [](FhBwdParams& p) { p.dtype = FH_DTYPE_E4M3; });
  expect_rejected("deterministic", INVALID, S{"deterministic: expected 0 or 1", "got 2"},
                  [](FhBwdParams& p) { p.deterministic = 2; });
  expect_rejected("heads_kv", INVALID, S{"heads_kv: expected a divisor of heads_q (8)", "got 3"},
                  [](FhBwdParams& p) { p.heads_kv = 3; });
  expect_rejected("head_dim_v", INVALID, S{"head_dim_v: expected 64", "got 128"},
                  [](FhBwdParams& p) { p.head_dim_v = 128; });
  expect_rejected("head_dim", INVALID, S{"head_dim: expected a multiple of 8", "got 60"},
                  [](FhBwdParams& p) { p.head_dim = p.head_dim_v = 60; });
  expect_rejected("seqlen_q int32", INVALID, S{"seqlen_q: expected 0..2147483392", "got 2147483600"},
                  [](FhBwdParams& p) { p.seqlen_q = 2147483600; });
  expect_rejected("softmax_scale", INVALID, S{"softmax_scale: expected a finite positive", "got 0"},
                  [](FhBwdParams& p) { p.softmax_scale = 0.f; });
  expect_rejected("window_left", INVALID, S{"window_left: expected -1", "got -2"},
                  [](FhBwdParams& p) { p.window_left = -2; });
  expect_rejected("q_row_stride", INVALID, S{"q_row_stride: expected a multiple of 8", "got 65"},
                  [](FhBwdParams& p) { p.q_row_stride = 65; });
  expect_rejected("dout_head_stride", INVALID,
                  S{"dout_head_stride: expected a multiple of 8", "got 12"},
                  [](FhBwdParams& p) { p.dout_head_stride = 12; });
  expect_rejected("dq_batch_stride", INVALID, S{"dq_batch_stride: expected a multiple of 8", "got 4"},
                  [](FhBwdParams& p) { p.dq_batch_stride = 4; });
  expect_rejected("dk_row_stride", INVALID, S{"dk_row_stride: expected a multiple of 8", "got 129"},
                  [](FhBwdParams& p) { p.dk_row_stride = 129; });
  expect_rejected("dv_head_stride", INVALID, S{"dv_head_stride: expected a multiple of 8", "got 1"},
                  [](FhBwdParams& p) { p.dv_head_stride = 1; });
  expect_rejected("variant", INVALID,
                  S{"variant: expected 0 (FA-3 ablation variants have no backward", "got 1"},
                  [](FhBwdParams& p) { p.variant = 1; });
  expect_rejected("backend", INVALID, S{"backend: expected FH_BACKEND_AUTO (0)", "got 7"},
                  [](FhBwdParams& p) { p.backend = 7; });
  expect_rejected("num_sms", INVALID, S{"num_sms: expected 0", "got -1"},
                  [](FhBwdParams& p) { p.num_sms = -1; });
  // Reserved fields: a valid request this build cannot serve yet, each named.
  static int32_t cu_seqlens[3] = {0, 1, 2};
  static float sinks[8];
  // Varlen (api.h): both offsets arrays, packed tensors, seqused and bounds only with them.
  expect_rejected("cu_seqlens_q alone", INVALID,
                  S{"cu_seqlens_q / cu_seqlens_k: expected both", "cu_seqlens_k null"},
                  [](FhBwdParams& p) { p.cu_seqlens_q = cu_seqlens; });
  expect_rejected("varlen batch stride", INVALID,
                  S{"q_batch_stride: expected 0 in a varlen call", "got 65536"},
                  [](FhBwdParams& p) { p.cu_seqlens_q = p.cu_seqlens_k = cu_seqlens; });
  expect_rejected("seqused_k", INVALID, S{"seqused_q / seqused_k: expected null in a dense call"},
                  [](FhBwdParams& p) { p.seqused_k = cu_seqlens; });
  expect_rejected("max_seqlen_k", INVALID,
                  S{"max_seqlen_q / max_seqlen_k: expected 0 in a dense call", "got 0 / 5"},
                  [](FhBwdParams& p) { p.max_seqlen_k = 5; });
  expect_rejected("attention_chunk", UNSUPPORTED, S{"attention_chunk: expected 0", "got 128"},
                  [](FhBwdParams& p) { p.attention_chunk = 128; });
  expect_rejected("dsinks", UNSUPPORTED, S{"dsinks: expected null"},
                  [](FhBwdParams& p) { p.dsinks = sinks; });
  // Data pointers and the workspace: fh_bwd only.
  const int64_t need = valid_params().workspace_bytes;
  const std::string need_s = std::to_string(need), short_s = std::to_string(need - 1);
  expect_rejected("workspace_bytes", INVALID,
                  S{"workspace_bytes: expected >= " + need_s + " bytes", "fh_bwd_workspace_size",
                    "got " + short_s},
                  [](FhBwdParams& p) { p.workspace_bytes -= 1; }, /*data_rule=*/true);
  expect_rejected("workspace null", INVALID,
                  S{"workspace: expected a device pointer to " + need_s + " bytes", "got null"},
                  [](FhBwdParams& p) { p.workspace = nullptr; }, true);
  expect_rejected("workspace aligned", INVALID, S{"workspace: expected a 256-byte aligned"},
                  [](FhBwdParams& p) { p.workspace = static_cast<char*>(kAddr) + 128; }, true);
  expect_rejected("dout null", INVALID, S{"dout: expected a device pointer, got null"},
                  [](FhBwdParams& p) { p.dout = nullptr; }, true);
  expect_rejected("dq aligned", INVALID, S{"dq: expected a 16-byte aligned pointer"},
                  [](FhBwdParams& p) { p.dq = static_cast<char*>(kAddr) + 8; }, true);
  expect_rejected("dv null", INVALID, S{"dv: expected a device pointer, got null"},
                  [](FhBwdParams& p) { p.dv = nullptr; }, true);
  expect_rejected("lse null", INVALID, S{"lse: expected a device pointer", "got null"},
                  [](FhBwdParams& p) { p.lse = nullptr; }, true);
  expect_rejected("dlse aligned", INVALID, S{"dlse: expected a 4-byte aligned pointer"},
                  [](FhBwdParams& p) {
                    p.dlse = reinterpret_cast<const float*>(static_cast<char*>(kAddr) + 2);
                  },
                  true);
  // seqlen_q == 0: the main kernel still writes dk, dv (they must be valid), nothing of the
  // query side is read and the workspace is empty.
  expect_rejected("seqlen_q 0, dk null", INVALID, S{"dk: expected a device pointer, got null"},
                  [](FhBwdParams& p) {
                    p.seqlen_q = 0;
                    p.q = p.o = p.dout = p.dq = p.workspace = nullptr;
                    p.lse = nullptr;
                    p.workspace_bytes = 0;
                    p.dk = nullptr;
                  },
                  true);
}

// The exact documented size passes validation: fh_bwd then needs the device (no GPU here:
// FH_ERROR_CUDA) and, on a GPU, stops at the policy (backend fa3 has no backward kernel: nothing
// launched either way). One byte less was rejected above.
static void test_workspace_exact() {
  FhBwdParams p = valid_params();
  p.backend = FH_BACKEND_FA3;
  const FhStatus st = fh_bwd(&p, nullptr);
  CHECK(st == FH_ERROR_CUDA || st == FH_ERROR_UNSUPPORTED,
        "exact workspace: fh_bwd returned %d (%s), expected a device or policy failure", int(st),
        fh_last_error());
}

// build_info's kernel list, as CMake writes it (fixed key order, no spaces).
static bool listed_bwd(const char* backend, const char* dtype, int64_t bucket) {
  char entry[160];
  std::snprintf(entry, sizeof(entry),
                "{\"direction\":\"bwd\",\"backend\":\"%s\",\"dtype\":\"%s\",\"head_dim\":%" PRId64
                ",\"variants\":[0]}",
                backend, dtype, bucket);
  return contains(fh_build_info(), entry);
}

static int count(const std::string& text, const std::string& part) {
  int n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) {
    ++n;
  }
  return n;
}

struct Built {
  bool any_fa2 = false, any_fa3 = false;
  int32_t dtype = FH_DTYPE_BF16;  // of one built fa2 backward kernel (if any)
  int64_t head_dim = 64;
};

static Built test_has_bwd_kernel() {
  Built built;
  const struct {
    int32_t value;
    const char* name;
  } backends[] = {{FH_BACKEND_FA2, "fa2"}, {FH_BACKEND_FA3, "fa3"}},
    dtypes[] = {{FH_DTYPE_FP16, "fp16"}, {FH_DTYPE_BF16, "bf16"}};
  int listed = 0;
  for (const auto& be : backends) {
    for (const auto& dt : dtypes) {
      for (int64_t d = 8; d <= 256; d += 8) {
        const bool expected = listed_bwd(be.name, dt.name, bucket_of(d));
        CHECK(fh_has_bwd_kernel(be.value, dt.value, d) == (expected ? 1 : 0),
              "fh_has_bwd_kernel(%s, %s, %" PRId64 ") = %d, build_info lists it: %d", be.name,
              dt.name, d, int(fh_has_bwd_kernel(be.value, dt.value, d)), int(expected));
        if (expected && d == bucket_of(d)) {
          ++listed;
          if (be.value == FH_BACKEND_FA2) {
            built.any_fa2 = true;
            built.dtype = dt.value;
            built.head_dim = d;
          } else {
            built.any_fa3 = true;
          }
        }
      }
    }
  }
  CHECK(fh_has_bwd_kernel(FH_BACKEND_FA2, FH_DTYPE_E4M3, 64) == 0, "e4m3 backward kernel");
  CHECK(fh_has_bwd_kernel(FH_BACKEND_FA2, FH_DTYPE_BF16, 264) == 0, "head_dim 264");
  CHECK(fh_has_bwd_kernel(FH_BACKEND_AUTO, FH_DTYPE_BF16, 64) == 0, "backend auto is no path");
  const std::string info = fh_build_info();
  CHECK(count(info, "\"direction\":\"bwd\"") == listed,
        "build_info lists %d backward kernels, fh_has_bwd_kernel found %d",
        count(info, "\"direction\":\"bwd\""), listed);
  const bool backward = listed > 0;
  CHECK(contains(info, backward ? "\"backward\":true" : "\"backward\":false"),
        "build_info's backward flag disagrees with its kernel list: %s", info.c_str());
  CHECK(contains(info, "\"directions\":["), "build_info lacks directions: %s", info.c_str());
  if (backward) {
    CHECK(contains(info, "\"bwd\"]"), "backward kernels but no bwd direction: %s", info.c_str());
  }
  return built;
}

static void test_select_backend(Built const& built) {
  Problem pr;
  FhBwdParams p = valid_params(pr);
  p.dtype = built.dtype;
  p.head_dim = p.head_dim_v = built.head_dim;
  char reason[256];
  int32_t backend = -1;
  const char* dt = built.dtype == FH_DTYPE_FP16 ? "fp16" : "bf16";
  const int ccs[][2] = {{8, 0}, {8, 6}, {8, 9}, {9, 0}, {12, 0}};
  // The FA-3 path's backward has tiles for these buckets (CMakeLists.txt FH_SM90_BWD_HEAD_DIMS).
  auto fa3_tile = [](int64_t d) {
    return d == 64 || d == 96 || d == 128 || d == 192 || d == 256;
  };
  const bool fa3_here = fh_has_bwd_kernel(FH_BACKEND_FA3, built.dtype, built.head_dim) != 0;
  for (const auto& cc : ccs) {
    backend = -1;
    reason[0] = '\0';
    const FhStatus st = fh_bwd_select_backend(&p, cc[0], cc[1], &backend, reason, sizeof(reason));
    const bool hopper = cc[0] == 9 && cc[1] == 0;
    if (built.any_fa2 && hopper && fa3_here) {
      CHECK(st == FH_SUCCESS && backend == FH_BACKEND_FA3 && contains(reason, "-> fa3"),
            "auto on cc 9.0 with an fa3 kernel: status %d backend %d reason '%s' (%s)", int(st),
            int(backend), reason, fh_last_error());
    } else if (built.any_fa2) {
      CHECK(st == FH_SUCCESS && backend == FH_BACKEND_FA2,
            "auto on cc %d.%d: status %d backend %d (%s)", cc[0], cc[1], int(st), int(backend),
            fh_last_error());
      CHECK(contains(reason, "-> fa2"), "auto on cc %d.%d: reason '%s'", cc[0], cc[1], reason);
      if (hopper && !fa3_tile(built.head_dim)) {
        CHECK(contains(reason, "cc 9.0 but the FA-3 path's backward has no tile for ") &&
                  contains(reason, "(buckets 64, 96, 128, 192, 256) -> fa2"),
              "auto on cc 9.0: reason '%s'", reason);
      }
    } else if (!built.any_fa2 && !built.any_fa3) {
      CHECK(st == FH_ERROR_UNSUPPORTED &&
                contains(fh_last_error(), "rebuild with FH_DIRECTIONS including bwd"),
            "auto on cc %d.%d without backward kernels: status %d (%s)", cc[0], cc[1], int(st),
            fh_last_error());
    }
  }
  // Explicit fa2.
  p.backend = FH_BACKEND_FA2;
  FhStatus st = fh_bwd_select_backend(&p, 8, 0, &backend, reason, sizeof(reason));
  if (built.any_fa2) {
    CHECK(st == FH_SUCCESS && backend == FH_BACKEND_FA2 && contains(reason, "fa2 requested"),
          "fa2 on cc 8.0: %d (%s) '%s'", int(st), fh_last_error(), reason);
  }
  // Truncated reason, NUL-terminated.
  if (built.any_fa2) {
    char small[8];
    std::memset(small, 'x', sizeof(small));
    st = fh_bwd_select_backend(&p, 8, 0, &backend, small, sizeof(small));
    CHECK(st == FH_SUCCESS && std::strlen(small) == sizeof(small) - 1,
          "reason cut to reason_len: '%.8s'", small);
  }
  // Explicit fa3 on a bucket without an FA-3 backward tile: refused on any GPU, naming the
  // covered buckets; on a covered bucket with its kernel built: fa3 on cc 9.0 only.
  p.backend = FH_BACKEND_FA3;
  for (int64_t d : {64, 96, 128, 192, 256}) {
    p.head_dim = p.head_dim_v = d;
    for (int major : {8, 9, 10}) {
      st = fh_bwd_select_backend(&p, major, 0, &backend, reason, sizeof(reason));
      if (!fa3_tile(d)) {
        const std::string expected = std::string("backend='fa3': this build has no fa3 "
                                                 "backward kernel for ") +
                                     dt + " hdim " + std::to_string(d) +
                                     " (the FA-3 path's backward has tiles for head_dim buckets "
                                     "64, 96, 128, 192, 256 only so far); use backend='fa2' or "
                                     "'auto'";
        CHECK(st == FH_ERROR_UNSUPPORTED && fh_last_error() == expected,
              "fa3 d%d on cc %d.0: status %d, message '%s'", int(d), major, int(st),
              fh_last_error());
      } else if (fh_has_bwd_kernel(FH_BACKEND_FA3, built.dtype, d)) {
        const bool ok = major == 9;
        CHECK((st == FH_SUCCESS && backend == FH_BACKEND_FA3) == ok,
              "fa3 d%d on cc %d.0: status %d backend %d (%s)", int(d), major, int(st),
              int(backend), fh_last_error());
        if (!ok) {
          CHECK(contains(fh_last_error(), "compute capability 9.0"), "fa3 on cc %d.0: '%s'",
                major, fh_last_error());
        }
      }
    }
  }
  p.head_dim = p.head_dim_v = built.head_dim;
  // A GPU below the FA-2 path's floor.
  for (int32_t b : {int32_t(FH_BACKEND_AUTO), int32_t(FH_BACKEND_FA2)}) {
    p.backend = b;
    st = fh_bwd_select_backend(&p, 7, 5, &backend, reason, sizeof(reason));
    CHECK(st == FH_ERROR_UNSUPPORTED && contains(fh_last_error(), "cc 7.5") &&
              contains(fh_last_error(), "8.0"),
          "backend %d on cc 7.5: status %d (%s)", int(b), int(st), fh_last_error());
  }
  // A head dim / dtype without a backward kernel names the build variables to change.
  p.backend = FH_BACKEND_FA2;
  for (int32_t dtype : {int32_t(FH_DTYPE_FP16), int32_t(FH_DTYPE_BF16)}) {
    for (int64_t d : {64, 96, 128, 192, 256}) {
      if (fh_has_bwd_kernel(FH_BACKEND_FA2, dtype, d)) {
        continue;
      }
      p.dtype = dtype;
      p.head_dim = p.head_dim_v = d;
      st = fh_bwd_select_backend(&p, 8, 0, &backend, reason, sizeof(reason));
      CHECK(st == FH_ERROR_UNSUPPORTED &&
                contains(fh_last_error(), "this build has no fa2 backward kernel") &&
                contains(fh_last_error(), "FH_DIRECTIONS including bwd") &&
                contains(fh_last_error(), "FH_HEAD_DIMS including " + std::to_string(d)),
            "unbuilt fa2 dtype %d d %" PRId64 ": status %d (%s)", int(dtype), d, int(st),
            fh_last_error());
    }
  }
  // Argument checks of fh_fwd_select_backend.
  p = valid_params();
  CHECK(fh_bwd_select_backend(&p, 9, 0, nullptr, nullptr, 0) == FH_ERROR_INVALID_ARGUMENT &&
            contains(fh_last_error(), "backend_out: expected a non-null pointer"),
        "backend_out null: %s", fh_last_error());
  CHECK(fh_bwd_select_backend(&p, -1, 0, &backend, nullptr, 0) == FH_ERROR_INVALID_ARGUMENT &&
            contains(fh_last_error(), "cc_major/cc_minor"),
        "cc -1: %s", fh_last_error());
}

// A varlen request (api.h): its workspace holds one batch entry of round_up(total_q + 128 *
// batch, 128) rows per query head; the FA-3 path serves it (cc 9.0), the FA-2 path does not.
static void test_varlen() {
  static int32_t cu[4] = {0, 100, 100, 300};
  Problem pr;
  pr.b = 3;
  pr.sq = pr.sk = 300;  // the packed tokens
  FhBwdParams p = valid_params(pr);
  p.cu_seqlens_q = p.cu_seqlens_k = cu;
  p.max_seqlen_q = p.max_seqlen_k = 200;
  p.q_batch_stride = p.o_batch_stride = p.dout_batch_stride = p.dq_batch_stride = 0;
  p.k_batch_stride = p.v_batch_stride = p.dk_batch_stride = p.dv_batch_stride = 0;
  p.lse_batch_stride = p.dlse_batch_stride = 0;
  const Layout want = documented_layout(1, 300 + 128 * 3, pr.hq, pr.d);
  int64_t bytes = -1;
  CHECK(fh_bwd_workspace_size(&p, &bytes) == FH_SUCCESS && bytes == want.bytes,
        "varlen workspace: %lld bytes, expected %lld (%s)", (long long)bytes,
        (long long)want.bytes, fh_last_error());
  int32_t backend = -1;
  char reason[256];
  // The packed tensors' batch strides are 0: no layout problem for the FA-3 path's TMA.
  const FhStatus sm90 = fh_bwd_select_backend(&p, 9, 0, &backend, reason, sizeof(reason));
  const bool fa3_built = fh_has_bwd_kernel(FH_BACKEND_FA3, FH_DTYPE_BF16, pr.d) != 0;
  CHECK(fa3_built ? sm90 == FH_SUCCESS && backend == FH_BACKEND_FA3
                  : sm90 == FH_ERROR_UNSUPPORTED,
        "varlen on cc 9.0 (fa3 d%lld built: %d): status %d backend %d (%s)", (long long)pr.d,
        int(fa3_built), int(sm90), int(backend), fh_last_error());
  backend = -1;
  CHECK(fh_bwd_select_backend(&p, 8, 0, &backend, reason, sizeof(reason)) ==
                FH_ERROR_UNSUPPORTED &&
            contains(fh_last_error(), "varlen backward (cu_seqlens_q) needs a GPU of compute "
                                      "capability 9.0") &&
            backend == -1,
        "varlen on cc 8.0: %s", fh_last_error());
  p.backend = FH_BACKEND_FA2;
  CHECK(fh_bwd_select_backend(&p, 9, 0, &backend, reason, sizeof(reason)) ==
                FH_ERROR_UNSUPPORTED &&
            contains(fh_last_error(), "varlen backward (cu_seqlens_q) runs on the FA-3 path"),
        "varlen with backend fa2: %s", fh_last_error());
  p.backend = FH_BACKEND_AUTO;
  p.max_seqlen_q = -1;
  CHECK(fh_bwd_workspace_size(&p, &bytes) == FH_ERROR_INVALID_ARGUMENT &&
            contains(fh_last_error(), "max_seqlen_q / max_seqlen_k: expected >= 0"),
        "negative max_seqlen_q: %s", fh_last_error());
}

static void test_empty_batch() {
  Problem pr;
  pr.b = 0;
  FhBwdParams p = valid_params(pr);
  p.q = p.k = p.v = p.o = p.dout = p.dq = p.dk = p.dv = p.workspace = nullptr;
  p.lse = nullptr;
  p.workspace_bytes = 0;
  const FhStatus st = fh_bwd(&p, nullptr);
  CHECK(st == FH_SUCCESS && fh_last_error()[0] == '\0', "batch 0: status %d (%s)", int(st),
        fh_last_error());
}

int main() {
  test_abi_version();
  test_workspace_size();
  test_validation();
  test_workspace_exact();
  const Built built = test_has_bwd_kernel();
  test_select_backend(built);
  test_varlen();
  test_empty_batch();
  return host_check_exit();
}
