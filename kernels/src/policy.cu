// The backend policy (policy.h): the kernel paths' rules, each direction's data, and the one
// ladder that weighs them for a call.
#include "src/policy.h"

#include <string>
#include <utility>

#include "flash_hopper/decode_plan.h"
#include "src/decode.h"
#include "src/device.h"
#include "src/errors.h"
#include "src/validate.h"

namespace flash_hopper {
namespace {

// --- the kernel paths ------------------------------------------------------------------------

// A kernel path as the policy weighs it, whichever the direction.
struct PathRules {
  int32_t backend;
  const char* name;   // as requests and messages spell it: "fa3"
  const char* title;  // "FA-3 path"
  bool (*runs)(int cc_major, int cc_minor);
  const char* needs;  // the compute capability `runs` asks for, as messages say it
  bool loads_with_tma;
  // What to use when the path cannot serve a request for it, and when only a rebuild would give
  // it the kernel (null: nothing to suggest, the path is the last resort).
  const char* instead;
  const char* instead_of_rebuild;
};

// sm90a SASS runs on exactly cc 9.0; sm80 code runs on every cc >= 8.0 (SASS for 8.x and 9.0,
// PTX JIT-compiled on later GPUs).
bool runs_sm90a(int cc_major, int cc_minor) { return cc_major == 9 && cc_minor == 0; }
bool runs_sm80(int cc_major, int /*cc_minor*/) { return cc_major >= 8; }

constexpr PathRules kFa3 = {/*backend=*/FH_BACKEND_FA3,
                            /*name=*/"fa3",
                            /*title=*/"FA-3 path",
                            /*runs=*/runs_sm90a,
                            /*needs=*/"9.0 (H100/H200: sm90a code runs on 9.0 only)",
                            /*loads_with_tma=*/true,
                            /*instead=*/"backend='fa2' or 'auto'",
                            /*instead_of_rebuild=*/"backend='auto'"};
constexpr PathRules kFa2 = {/*backend=*/FH_BACKEND_FA2,
                            /*name=*/"fa2",
                            /*title=*/"FA-2 path",
                            /*runs=*/runs_sm80,
                            /*needs=*/">= 8.0 (sm80 code)",
                            /*loads_with_tma=*/false,
                            /*instead=*/nullptr,
                            /*instead_of_rebuild=*/nullptr};

// auto's preference: the FA-3 path where it runs, is built and can load the tensors; else the
// FA-2 path. Request::paths follows this order.
constexpr const PathRules* kPaths[] = {&kFa3, &kFa2};
constexpr int kNumPaths = sizeof(kPaths) / sizeof(kPaths[0]);
static_assert(kPaths[0] == &kFa3 && kPaths[1] == &kFa2, "select_auto reads paths[0] as fa3's");

// --- each direction's data -------------------------------------------------------------------

struct DirectionRules {
  const char* name;         // "backward"
  const char* kernel;       // what a path builds for the direction: "backward kernel"
  const char* tma_tensors;  // what its FA-3 path loads with TMA
  bool backward;            // its kernels also need FH_DIRECTIONS bwd
  // Whether the source tree has the path's kernel for the bucket, whatever this build compiled
  // (false: "not implemented" rather than a build to redo), and the buckets it has.
  bool (*written)(int32_t backend, int64_t head_dim);
  std::string (*written_buckets)(int32_t backend);
};

bool every_bucket(int32_t /*backend*/, int64_t /*head_dim*/) { return true; }
std::string no_buckets(int32_t /*backend*/) { return std::string(); }

// The FA-3 path's backward has tiles for some buckets so far; a fa3 backward plugs in by
// registration alone.
bool bwd_written(int32_t backend, int64_t head_dim) {
  return backend != FH_BACKEND_FA3 || fa3_bwd_covers(head_dim);
}
std::string bwd_buckets(int32_t /*backend*/) { return fa3_bwd_buckets(); }

constexpr DirectionRules kForward = {/*name=*/"forward",
                                     /*kernel=*/"kernel",
                                     /*tma_tensors=*/kFwdTmaTensors,
                                     /*backward=*/false,
                                     /*written=*/every_bucket,
                                     /*written_buckets=*/no_buckets};
constexpr DirectionRules kBackward = {/*name=*/"backward",
                                      /*kernel=*/"backward kernel",
                                      /*tma_tensors=*/kBwdTmaTensors,
                                      /*backward=*/true,
                                      /*written=*/bwd_written,
                                      /*written_buckets=*/bwd_buckets};

// Inputs that only the FA-3 path's tuned forward serves, in buckets of their own. The phrases
// follow the inputs' FH_DTYPES name in messages ("e4m3" + " inputs run").
struct Fa3OnlyInputs {
  const char* run;      // "... on the FA-3 path's tuned kernel only"
  const char* kernels;  // "the FA-2 path and the FA-3 ablation variants have no ... kernels"
  const char* need;     // "... a GPU of compute capability 9.0"
  const char* because;  // "(...), this GPU is"
  const char* have;     // "head_dim: ... kernels for head-dim buckets"
  const char* label;    // the reason of a choice: "...: cc 9.0 and fa3 kernel built"
  bool (*covers)(int64_t head_dim);
  std::string (*buckets)();
};

constexpr Fa3OnlyInputs kFp8Inputs = {/*run=*/" inputs run",
                                      /*kernels=*/"FP8",
                                      /*need=*/" inputs need",
                                      /*because=*/"the FA-3 path's FP8 WGMMA",
                                      /*have=*/"e4m3 inputs have",
                                      /*label=*/" inputs",
                                      /*covers=*/fp8_covers,
                                      /*buckets=*/fp8_buckets};
constexpr Fa3OnlyInputs kMixedInputs = {
    /*run=*/" (fp16 / bf16 q against FP8 k / v, the mixed mode) runs",
    /*kernels=*/"mixed-mode",
    /*need=*/" (the mixed mode) needs",
    /*because=*/"the FA-3 path",
    /*have=*/"the mixed mode (fp16 / bf16 q, FP8 k / v) has",
    /*label=*/" (mixed mode)",
    /*covers=*/mixed_covers,
    /*buckets=*/mixed_buckets};

constexpr Fa3OnlyInputs kVarlenBackward = {
    /*run=*/" varlen backward (cu_seqlens_q) runs",
    /*kernels=*/"varlen backward",
    /*need=*/" varlen backward (cu_seqlens_q) needs",
    /*because=*/"the FA-3 path's backward",
    /*have=*/"the varlen backward has",
    /*label=*/" varlen",
    /*covers=*/fa3_bwd_covers,
    /*buckets=*/fa3_bwd_buckets};

// --- layouts the FA-3 path cannot load -------------------------------------------------------

// The fa3 path loads q, k and v (the backward also dout) with TMA, whose descriptors need a
// positive stride on every dimension that is stepped along; a broadcast (expand()ed) tensor has
// stride 0 there and runs on fa2, which reads through pointers. Dims are those of the FA layout
// (batch, seqlen, heads, d).
struct LayoutProblem {
  const char* tensor;
  int dim;
  const char* field;
  int64_t stride;
  int64_t extent;
};

template <size_t N>
bool first_layout_problem(const LayoutProblem (&checks)[N], LayoutProblem* problem) {
  for (const LayoutProblem& c : checks) {
    if (c.extent > 1 && c.stride <= 0) {
      *problem = c;
      return true;
    }
  }
  return false;
}

// q, k and v: what both directions load with TMA (same field names in both structs).
// batch: the extent of the batch dimension as TMA sees it (1 for varlen's packed tensors).
template <class Params>
bool qkv_layout_problem(const Params* p, LayoutProblem* problem, int64_t batch) {
  const LayoutProblem checks[] = {
      {"q", 0, "q_batch_stride", p->q_batch_stride, batch},
      {"q", 1, "q_row_stride", p->q_row_stride, p->seqlen_q},
      {"q", 2, "q_head_stride", p->q_head_stride, p->heads_q},
      {"k", 0, "k_batch_stride", p->k_batch_stride, batch},
      {"k", 1, "k_row_stride", p->k_row_stride, p->seqlen_k},
      {"k", 2, "k_head_stride", p->k_head_stride, p->heads_kv},
      {"v", 0, "v_batch_stride", p->v_batch_stride, batch},
      {"v", 1, "v_row_stride", p->v_row_stride, p->seqlen_k},
      {"v", 2, "v_head_stride", p->v_head_stride, p->heads_kv},
  };
  return first_layout_problem(checks, problem);
}

bool fa3_layout_problem(const FhFwdParams* p, LayoutProblem* problem) {
  return qkv_layout_problem(p, problem, is_varlen(p) ? 1 : p->batch);
}

bool fa3_layout_problem(const FhBwdParams* p, LayoutProblem* problem) {
  // Varlen: packed tensors, one batch entry (their batch strides are 0).
  const int64_t batch = p->cu_seqlens_q != nullptr ? 1 : p->batch;
  const LayoutProblem dout[] = {
      {"dout", 0, "dout_batch_stride", p->dout_batch_stride, batch},
      {"dout", 1, "dout_row_stride", p->dout_row_stride, p->seqlen_q},
      {"dout", 2, "dout_head_stride", p->dout_head_stride, p->heads_q},
  };
  return qkv_layout_problem(p, problem, batch) || first_layout_problem(dout, problem);
}

// Names the tensor dimension (as Python users see it) and the field (as C callers see it);
// `tensors`: what the path loads with TMA.
std::string describe(LayoutProblem const& l, const char* tensors) {
  return format("%s: stride(%d) is %lld on a dimension of size %lld (%s: the fa3 path loads "
                "%s with TMA, which needs a positive stride on every dimension of size > 1; "
                "an expand()ed tensor has 0 there)",
                l.tensor, l.dim, (long long)l.stride, (long long)l.extent, l.field, tensors);
}

// --- one call, as the ladder sees it ---------------------------------------------------------

// A path for this call: whether the source tree has its kernel and whether this build does.
struct Candidate {
  bool written = true;
  bool built = false;
};

struct Request {
  const DirectionRules* dir = nullptr;
  const Fa3OnlyInputs* fa3_only = nullptr;  // inputs only the FA-3 tuned forward serves
  int32_t backend = FH_BACKEND_AUTO;        // FhBackend asked for
  int32_t variant = FH_VARIANT_TUNED;       // FhVariant asked for
  bool tuned_built = false;  // this build has the FA-3 path's tuned kernel (variant messages)
  const char* name = "";     // the request as Python spells it: "auto", "fa3-no-pingpong"
  const char* dtype = "";    // its FH_DTYPES name: "bf16", "bf16+e4m3"
  int64_t head_dim = 0;
  std::string what;            // the request as messages name it: "bf16 hdim 72 (bucket 96)"
  Candidate paths[kNumPaths];  // kPaths' order
  bool layout_bad = false;     // the FA-3 path cannot load the tensors with TMA
  LayoutProblem layout{};
};

// "bf16 hdim 72 (bucket 96)"; "bf16+e4m3 hdim 72" (with_bucket false).
std::string request_what(const char* dtype, int64_t head_dim, bool with_bucket = true) {
  const int64_t bucket = head_dim_bucket(head_dim);
  std::string what = format("%s hdim %lld", dtype, (long long)head_dim);
  if (with_bucket && bucket != head_dim) {
    what += format(" (bucket %lld)", (long long)bucket);
  }
  return what;
}

// The FH_* build variables that add the path's kernel for the request.
std::string rebuild_hint(const Request& r, int32_t backend) {
  return format("rebuild with %sFH_ARCHS including %s, FH_HEAD_DIMS including %lld and FH_DTYPES "
                "including %s",
                r.dir->backward ? "FH_DIRECTIONS including bwd, " : "", build_arch(backend),
                (long long)head_dim_bucket(r.head_dim), r.dtype);
}

// The advice that ends a message: "; use backend='auto'" (sep "; use ") or nothing.
std::string advise(const char* sep, const char* instead) {
  return instead != nullptr ? std::string(sep) + instead : std::string();
}

FhStatus fail_not_built(const Request& r, const PathRules& path, const char* instead) {
  return fail(FH_ERROR_UNSUPPORTED, "backend='%s': this build has no %s %s for %s; %s%s", r.name,
              path.name, r.dir->kernel, r.what.c_str(), rebuild_hint(r, path.backend).c_str(),
              advise(", or use ", instead).c_str());
}

FhStatus fail_layout(const Request& r, const char* instead) {
  return fail(FH_ERROR_UNSUPPORTED, "backend='%s': %s; call %s.contiguous()%s", r.name,
              describe(r.layout, r.dir->tma_tensors).c_str(), r.layout.tensor,
              advise(", or use ", instead).c_str());
}

FhStatus choose(int32_t backend, std::string reason, int32_t* out, std::string* why) {
  *out = backend;
  if (why != nullptr) {
    *why = std::move(reason);
  }
  return FH_SUCCESS;
}

// --- the ladder --------------------------------------------------------------------------------

// Inputs only the FA-3 path's tuned forward serves: that kernel or nothing.
FhStatus select_fa3_only(const Request& r, int cc_major, int cc_minor, int32_t* out,
                         std::string* why) {
  const Fa3OnlyInputs& in = *r.fa3_only;
  if (r.backend == FH_BACKEND_FA2 || r.variant != FH_VARIANT_TUNED) {
    return fail(FH_ERROR_UNSUPPORTED,
                "backend='%s': %s%s on the FA-3 path's tuned kernel only (backend 'fa3' or "
                "'auto'); the FA-2 path and the FA-3 ablation variants have no %s kernels",
                r.name, r.dtype, in.run, in.kernels);
  }
  if (!kFa3.runs(cc_major, cc_minor)) {
    return fail(FH_ERROR_UNSUPPORTED,
                "backend='%s': %s%s a GPU of compute capability 9.0 (%s), this GPU is cc %d.%d",
                r.name, r.dtype, in.need, in.because, cc_major, cc_minor);
  }
  if (!in.covers(r.head_dim)) {
    return fail(FH_ERROR_UNSUPPORTED, "head_dim: %s kernels for head-dim buckets %s, got %s",
                in.have, in.buckets().c_str(), r.what.c_str());
  }
  if (!r.paths[0].built) {
    return fail_not_built(r, kFa3, nullptr);
  }
  if (r.layout_bad) {
    return fail_layout(r, nullptr);
  }
  return choose(FH_BACKEND_FA3,
                why ? format("%s%s: cc %d.%d and fa3 kernel built for %s -> fa3", r.dtype,
                             in.label, cc_major, cc_minor, r.what.c_str())
                    : std::string(),
                out, why);
}

// A path asked for by name: that path or an error that says what would make it serve.
FhStatus select_requested(const Request& r, const PathRules& path, const Candidate& c,
                          int cc_major, int cc_minor, int32_t* out, std::string* why) {
  if (!c.built && !c.written) {  // whatever the GPU: no build has one
    return fail(FH_ERROR_UNSUPPORTED,
                "backend='%s': this build has no %s %s for %s (the %s's %s has tiles for "
                "head_dim buckets %s only so far)%s",
                r.name, path.name, r.dir->kernel, r.what.c_str(), path.title, r.dir->name,
                r.dir->written_buckets(path.backend).c_str(),
                advise("; use ", path.instead).c_str());
  }
  if (!path.runs(cc_major, cc_minor)) {
    return fail(FH_ERROR_UNSUPPORTED,
                "backend='%s' needs a GPU of compute capability %s, this GPU is cc %d.%d%s",
                r.name, path.needs, cc_major, cc_minor, advise("; use ", path.instead).c_str());
  }
  if (!c.built) {
    if (r.variant != FH_VARIANT_TUNED && r.tuned_built) {
      return fail(FH_ERROR_UNSUPPORTED,
                  "backend='%s': this build has no %s kernel for %s; rebuild with "
                  "FH_FA3_ABLATION_DTYPES including %s and FH_FA3_ABLATION_HEAD_DIMS "
                  "including %lld",
                  r.name, r.name, r.what.c_str(), r.dtype, (long long)head_dim_bucket(r.head_dim));
    }
    return fail_not_built(r, path, path.instead_of_rebuild);
  }
  if (path.loads_with_tma && r.layout_bad) {
    return fail_layout(r, path.instead);
  }
  return choose(path.backend,
                why ? format("%s requested; cc %d.%d and %s %s built for %s", r.name, cc_major,
                             cc_minor, r.name, r.dir->kernel, r.what.c_str())
                    : std::string(),
                out, why);
}

// auto: the first path of kPaths that runs, is built and can load the tensors.
FhStatus select_auto(const Request& r, int cc_major, int cc_minor, int32_t* out,
                     std::string* why) {
  const Candidate& fa3 = r.paths[0];
  const Candidate& fa2 = r.paths[1];
  const bool fa3_runs = kFa3.runs(cc_major, cc_minor);
  const char* kernel = r.dir->kernel;
  const char* what = r.what.c_str();
  if (fa3_runs && fa3.built && !r.layout_bad) {
    return choose(FH_BACKEND_FA3,
                  why ? format("cc %d.%d and fa3 %s built for %s -> fa3", cc_major, cc_minor,
                               kernel, what)
                      : std::string(),
                  out, why);
  }
  if (!kFa2.runs(cc_major, cc_minor)) {
    return fail(FH_ERROR_UNSUPPORTED,
                "flash-hopper needs a GPU of compute capability >= 8.0 (FA-2 path) or 9.0 (FA-3 "
                "path), this GPU is cc %d.%d",
                cc_major, cc_minor);
  }
  if (!fa2.built) {
    if (fa3_runs && fa3.built) {  // only the layout keeps fa3 out
      return fail(FH_ERROR_UNSUPPORTED,
                  "%s; this build has no fa2 %s for %s to run it instead (%s)",
                  describe(r.layout, r.dir->tma_tensors).c_str(), kernel, what,
                  rebuild_hint(r, FH_BACKEND_FA2).c_str());
    }
    const bool fa3_possible = fa3_runs && fa3.written;
    return fail(FH_ERROR_UNSUPPORTED, "cc %d.%d: this build has no %s %s for %s; %s", cc_major,
                cc_minor, fa3_possible ? "fa3 or fa2" : "fa2", kernel, what,
                rebuild_hint(r, fa3_possible ? FH_BACKEND_FA3 : FH_BACKEND_FA2).c_str());
  }
  if (why == nullptr) {
    return choose(FH_BACKEND_FA2, std::string(), out, why);
  }
  std::string reason;
  if (fa3_runs && fa3.built) {
    reason = format("cc %d.%d but %s -> fa2", cc_major, cc_minor,
                    describe(r.layout, r.dir->tma_tensors).c_str());
  } else if (fa3_runs && !fa3.written) {
    reason = format("cc %d.%d but the %s's %s has no tile for %s yet (buckets %s) -> fa2",
                    cc_major, cc_minor, kFa3.title, r.dir->name, what,
                    r.dir->written_buckets(FH_BACKEND_FA3).c_str());
  } else if (fa3_runs) {
    reason = format("cc %d.%d but this build has no fa3 %s for %s -> fa2", cc_major, cc_minor,
                    kernel, what);
  } else {
    reason = format("cc %d.%d: fa3 needs cc 9.0 (sm90a) -> fa2", cc_major, cc_minor);
  }
  return choose(FH_BACKEND_FA2, std::move(reason), out, why);
}

FhStatus select_path(const Request& r, int cc_major, int cc_minor, int32_t* out,
                     std::string* why) {
  if (r.fa3_only != nullptr) {
    return select_fa3_only(r, cc_major, cc_minor, out, why);
  }
  for (int i = 0; i < kNumPaths; ++i) {
    if (r.backend == kPaths[i]->backend) {
      return select_requested(r, *kPaths[i], r.paths[i], cc_major, cc_minor, out, why);
    }
  }
  return select_auto(r, cc_major, cc_minor, out, why);
}

// What the caller asked for, as Python spells it: "auto", "fa2", "fa3", "fa3-no-pingpong", ...
const char* request_name(int32_t backend, int32_t variant) {
  return backend == FH_BACKEND_FA3 ? kVariantNames[variant] : backend_name(backend);
}

// Completes a direction's request with what both take from their params (same field names), runs
// the ladder and answers with the chosen path's launcher, fa3's or fa2's.
template <class Params, class Entry>
FhStatus select_for(Request& r, const Params* p, const Entry* fa3, const Entry* fa2, int cc_major,
                    int cc_minor, PathChoice<Entry>* out, std::string* why) {
  r.backend = p->backend;
  r.variant = p->variant;
  r.name = request_name(p->backend, p->variant);
  r.head_dim = p->head_dim;
  const Entry* kernels[kNumPaths] = {fa3, fa2};  // kPaths' order
  for (int i = 0; i < kNumPaths; ++i) {
    r.paths[i].written = r.dir->written(kPaths[i]->backend, p->head_dim);
    r.paths[i].built = kernels[i] != nullptr;
  }
  r.layout_bad = fa3_layout_problem(p, &r.layout);
  int32_t backend = FH_BACKEND_AUTO;
  FH_TRY(select_path(r, cc_major, cc_minor, &backend, why));
  out->backend = backend;
  out->kernel = kernels[backend == FH_BACKEND_FA3 ? 0 : 1];
  return FH_SUCCESS;
}

// A V head dim of its own (head_dim_v != head_dim): the FA-3 path's kernels of the (head_dim,
// head_dim_v) pairs in tables.cmake's FH_HEAD_DIM_V_TABLE, 16-bit inputs, the tuned kernel (its
// ping-pong switch included), or an error naming what is missing. Callers with other pairs pad
// (python/flash_hopper/_dv.py).
FhStatus select_own_head_dim_v(const FhFwdParams* p, int cc_major, int cc_minor, Choice* out,
                               std::string* why) {
  const char* name = request_name(p->backend, p->variant);
  const char* dtype = is_mixed(p) ? mixed_name(p->dtype, p->kv_dtype) : dtype_name(p->dtype);
  if (p->dtype == FH_DTYPE_E4M3 || is_mixed(p)) {
    return fail(FH_ERROR_UNSUPPORTED,
                "head_dim_v: a V head dim of its own (%lld, head_dim %lld) has fp16 / bf16 "
                "kernels only, got %s inputs",
                (long long)p->head_dim_v, (long long)p->head_dim, dtype);
  }
  if (!own_head_dim_v_covers(p->head_dim, p->head_dim_v)) {
    return fail(FH_ERROR_UNSUPPORTED,
                "head_dim_v: expected %lld (== head_dim) or a (head_dim, head_dim_v) pair with a "
                "kernel of its own: %s; got (%lld, %lld)",
                (long long)p->head_dim, own_head_dim_v_pairs().c_str(), (long long)p->head_dim,
                (long long)p->head_dim_v);
  }
  if (p->backend == FH_BACKEND_FA2 ||
      (p->variant & FH_VARIANT_FLAG_NO_OVERLAP) != 0) {
    return fail(FH_ERROR_UNSUPPORTED,
                "backend='%s': a V head dim of its own (head_dim %lld, head_dim_v %lld) runs on "
                "the FA-3 path's tuned kernel only (backend 'fa3', 'fa3-no-pingpong' or 'auto')",
                name, (long long)p->head_dim, (long long)p->head_dim_v);
  }
  if (!kFa3.runs(cc_major, cc_minor)) {
    return fail(FH_ERROR_UNSUPPORTED,
                "backend='%s': a V head dim of its own (head_dim %lld, head_dim_v %lld) needs a "
                "GPU of compute capability 9.0 (the FA-3 path), this GPU is cc %d.%d",
                name, (long long)p->head_dim, (long long)p->head_dim_v, cc_major, cc_minor);
  }
  const RegistryEntry* kernel =
      find_kernel(FH_BACKEND_FA3, p->dtype, p->head_dim, p->variant, -1, p->head_dim_v);
  if (kernel == nullptr) {
    return fail(FH_ERROR_UNSUPPORTED,
                "backend='%s': this build has no fa3 kernel for %s head_dim %lld / head_dim_v "
                "%lld; rebuild with FH_DTYPES including %s and FH_HEAD_DIMS including %lld "
                "(FH_ARCHS including 90a, FH_DIRECTIONS including fwd)",
                name, dtype, (long long)p->head_dim, (long long)p->head_dim_v, dtype,
                (long long)head_dim_bucket(p->head_dim));
  }
  LayoutProblem layout{};
  if (fa3_layout_problem(p, &layout)) {
    Request r;
    r.dir = &kForward;
    r.name = name;
    r.layout_bad = true;
    r.layout = layout;
    return fail_layout(r, nullptr);
  }
  out->backend = FH_BACKEND_FA3;
  out->kernel = kernel;
  if (why != nullptr) {
    *why = format("%s head_dim %lld / head_dim_v %lld: cc %d.%d and the fa3 kernel with V's own "
                  "head dim built -> fa3",
                  dtype, (long long)p->head_dim, (long long)p->head_dim_v, cc_major, cc_minor);
  }
  return FH_SUCCESS;
}

// --- the decode kernel -------------------------------------------------------------------------

// A call as the decode kernel's rules weigh it, from either parameter struct.
struct DecodeRequest {
  int32_t dtype = FH_DTYPE_FP16;
  int32_t kv_dtype = FH_DTYPE_FP16;  // K / V's: dtype's, or an FP8 cache's
  const char* other = nullptr;  // what the decode route does not take in this call, or null
  int64_t head_dim = 0;
  int64_t group = 1;            // query heads per KV head
  int64_t tokens = 0;           // query tokens per sequence (a varlen call's bound; 0: unknown)
  int64_t keys = 0;             // the call's keys (a cache's capacity)
  int64_t page_size = 0;        // paged: keys per page; 0: dense
};

// The decode kernel's rules, in the order a refusal names them: the GPU, the decode table's dtype
// and head dim, what else the route does not take, the packed rows and keys, and whether the
// kernel's fewest stages fit the GPU's shared memory (decode.cu: fh_decode_stages). true with the
// reason in *why (if not null); false with what it lacks in *no.
bool decode_serves(const DecodeRequest& r, int cc_major, int cc_minor, std::string* why,
                   std::string* no) {
  const int64_t rows = r.tokens * r.group;
  const int smem = smem_limit(capability_device(cc_major, cc_minor));
  if (cc_major < 8) {
    *no = format("the decode kernel needs a GPU of compute capability >= 8.0, this GPU is "
                 "cc %d.%d",
                 cc_major, cc_minor);
  } else if (!decode_has_dtype(r.dtype, r.kv_dtype)) {
    const char* name =
        r.kv_dtype == r.dtype ? dtype_name(r.dtype) : mixed_name(r.dtype, r.kv_dtype);
    *no = format("dtype: the decode kernel takes %s (q, k and v in one dtype, or 16-bit q + "
                 "FP8 k / v), got %s",
                 decode_dtype_names().c_str(), name != nullptr ? name : "another dtype");
  } else if (!decode_has_head_dim(r.head_dim)) {
    *no = format("head_dim: the decode kernel takes head_dim %s, got %lld",
                 decode_head_dim_choices().c_str(), (long long)r.head_dim);
  } else if (r.other != nullptr) {
    *no = format("the decode route does not take %s", r.other);
  } else if (r.tokens <= 0) {
    *no = "seqlen_q / max_seqlen_q: the decode route sizes its grid by the query tokens of the "
          "longest sequence, got 0 (unknown)";
  } else if (rows > FH_DECODE_MAX_ROWS) {
    *no = format("seqlen_q: the decode kernel takes at most %d packed rows (query tokens x query "
                 "heads per KV head), got %lld x %lld",
                 FH_DECODE_MAX_ROWS, (long long)r.tokens, (long long)r.group);
  } else if (r.keys <= 0) {
    *no = "seqlen_k: the decode kernel needs keys to attend, got 0";
  } else if (decode_stages(r.head_dim, smem, decode_fp8_kv(r.kv_dtype)) == 0) {
    *no = format("the decode kernel at head_dim %lld does not fit the %d bytes of shared memory "
                 "per block of cc %d.%d",
                 (long long)r.head_dim, smem, cc_major, cc_minor);
  } else {
    if (why != nullptr) {
      *why = format("the decode kernel (cc %d.%d): %lld query heads per KV head x %lld tokens "
                    "packed into %d-row tiles, keys split across SMs (the splits merged by a "
                    "combine kernel launched behind it), K / V read in place",
                    cc_major, cc_minor, (long long)r.group, (long long)r.tokens,
                    decode::kRowsPerCta);
      if (r.page_size > 0) {
        *why += format(" through the page table (page size %lld)", (long long)r.page_size);
      }
      if (decode_fp8_kv(r.kv_dtype)) {
        *why += format(", in %s and widened to 16 bits in registers",
                       kv_dtype_name(r.kv_dtype));
      }
    }
    return true;
  }
  return false;
}

// An FA forward call as the decode kernel would take it (k / v as one cache entry per sequence,
// varlen's packed keys as one entry with each sequence's span): q, k and v in one dtype, no
// KV-cache fields and no seqused_q (the route computes spans from cu_seqlens_k and seqused_k).
DecodeRequest decode_request(const FhFwdParams* p) {
  DecodeRequest r;
  r.dtype = p->dtype;
  r.kv_dtype = p->dtype;
  r.head_dim = p->head_dim;
  r.group = p->heads_q / p->heads_kv;
  r.keys = p->seqlen_k;
  const bool varlen = is_varlen(p);
  r.tokens = varlen ? p->max_seqlen_q : p->seqlen_q;
  if (p->head_dim_v != p->head_dim) {
    r.other = "a V head dim of its own (head_dim_v != head_dim)";
  } else if (is_mixed(p)) {
    r.other = "FP8 k / v (the mixed mode)";
  } else if (p->dtype == FH_DTYPE_E4M3) {
    r.other = "FP8 inputs (flash_attn_with_kvcache's decode route takes FP8 caches)";
  } else if (p->kv_batch_idx != nullptr || p->leftpad_k != nullptr) {
    r.other = "kv_batch_idx / leftpad_k (flash_attn_with_kvcache asks with FhDecodeParams)";
  } else if (p->seqused_q != nullptr) {
    r.other = "seqused_q";
  }
  return r;
}

}  // namespace

FhStatus select_backend(const FhFwdParams* p, int cc_major, int cc_minor, Choice* out,
                        std::string* why) {
  // The decode kernel above the FA paths, for a caller that can run it (decode_route) and lets
  // the library choose: it serves the short queries whatever FA kernels this build holds.
  std::string no;
  if (p->decode_route != 0 && p->backend == FH_BACKEND_AUTO &&
      decode_serves(decode_request(p), cc_major, cc_minor, why, &no)) {
    out->backend = FH_BACKEND_DECODE;
    out->kernel = nullptr;
    return FH_SUCCESS;
  }
  if (p->head_dim_v != p->head_dim) {
    return select_own_head_dim_v(p, cc_major, cc_minor, out, why);
  }
  const bool mixed = is_mixed(p);
  Request r;
  r.dir = &kForward;
  r.fa3_only = mixed ? &kMixedInputs : (p->dtype == FH_DTYPE_E4M3 ? &kFp8Inputs : nullptr);
  r.dtype = mixed ? mixed_name(p->dtype, p->kv_dtype) : dtype_name(p->dtype);
  // The mixed mode's messages name the head dim as given, without its bucket.
  r.what = request_what(r.dtype, p->head_dim, /*with_bucket=*/!mixed);
  r.tuned_built = find_kernel(FH_BACKEND_FA3, p->dtype, p->head_dim, FH_VARIANT_TUNED) != nullptr;
  return select_for(r, p,
                    find_kernel(FH_BACKEND_FA3, p->dtype, p->head_dim, p->variant,
                                mixed ? p->kv_dtype : -1),
                    find_kernel(FH_BACKEND_FA2, p->dtype, p->head_dim, FH_VARIANT_TUNED),
                    cc_major, cc_minor, out, why);
}

FhStatus select_backend(const FhBwdParams* p, int cc_major, int cc_minor, BwdChoice* out,
                        std::string* why) {
  const BwdRegistryEntry* fa3 = find_bwd_kernel(FH_BACKEND_FA3, p->dtype, p->head_dim);
  Request r;
  r.dir = &kBackward;
  r.dtype = dtype_name(p->dtype);
  r.what = request_what(r.dtype, p->head_dim);
  r.tuned_built = fa3 != nullptr;  // one kernel per bucket: the backward has no variants
  r.fa3_only = p->cu_seqlens_q != nullptr ? &kVarlenBackward : nullptr;
  return select_for(r, p, fa3, find_bwd_kernel(FH_BACKEND_FA2, p->dtype, p->head_dim), cc_major,
                    cc_minor, out, why);
}

FhStatus select_backend(const FhDecodeParams* p, int cc_major, int cc_minor, DecodeChoice* out,
                        std::string* why) {
  DecodeRequest r;
  r.dtype = p->dtype;
  r.kv_dtype = decode_kv_dtype(p);
  r.head_dim = p->head_dim;
  r.group = p->heads_q / p->heads_kv;
  r.tokens = p->seqlen_q;
  const bool paged = p->page_table != nullptr;
  r.keys = paged ? p->max_pages * p->page_size : p->page_size;
  r.page_size = paged ? p->page_size : 0;
  std::string no;
  if (!decode_serves(r, cc_major, cc_minor, why, &no)) {
    return fail(FH_ERROR_UNSUPPORTED, "%s", no.c_str());
  }
  out->backend = FH_BACKEND_DECODE;
  return FH_SUCCESS;
}

}  // namespace flash_hopper
