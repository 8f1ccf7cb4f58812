// The FA-2 backward's spelled-out register-fragment layouts (sm80/bwd_fragment_layouts.h) against
// CuTe's own derivation: for every head dim of bwd_tile_config, its tuned and fallback traits,
// bf16 and fp16, each of the ten operands' fragment (mma_fragment, what the kernel declares) must
// be the very type thr_mma.partition_fragment_A/B(sX) returns on the kernel's swizzled view; and
// every default head dim must have an entry (else the kernel silently derives it, at ~0.3 GB of
// compiler memory per view). The types are checked by static_assert: this TU does not compile
// when an entry drifts from the tile config or from CuTe. A type this compiler proves equal also
// proves the register mapping and the code (the fragments are owning register arrays; identical
// SASS of the backward kernels was confirmed when the table was introduced).
//
// With -DFH_PRINT_TABLE it prints the table's entries instead (to regenerate the header after a
// tile config change: the same code derives them).
#include <cstdio>
#include <string>
#include <type_traits>

#include "sm80/bwd_kernel_traits.h"
#include "host_check.h"

using namespace cute;
using namespace flash_hopper::sm80;

namespace {

template <class X>
std::string type_text(X, const char* head) {
  if constexpr (is_tuple<X>::value) {
    std::string r;
    for_each(X{}, [&](auto e) { r += (r.empty() ? "" : ", ") + type_text(e, head); });
    return std::string(head) + "<" + r + ">";
  } else {
    static_assert(is_static<X>::value, "a fragment layout is static");
    return "Int<" + std::to_string(int(X::value)) + ">";
  }
}

template <class L>
std::string layout_text(L const& l) {
  return "Layout<" + type_text(l.shape(), "Shape") + ", " + type_text(l.stride(), "Stride") + ">";
}

// One operand: the derived fragment (partition_fragment_A/B on the swizzled view), the table's.
template <class Frag, bool kA, class Mma, class SmemLayout, class Element>
void check_operand(char const* what, int hd, bool print_only) {
  Mma mma;
  auto thr = mma.get_thread_slice(0);
  Tensor s = make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)), SmemLayout{});
  using Derived = std::conditional_t<kA, decltype(thr.partition_fragment_A(s)),
                                     decltype(thr.partition_fragment_B(s))>;
  if (print_only) {
    std::printf("  using %s = %s;\n", what, layout_text(Derived{}.layout()).c_str());
    return;
  }
  static_assert(!std::is_void_v<Frag>, "a default head dim without a fragment table entry");
  using Table = decltype(mma_fragment<Frag, kA>(thr, s));
  static_assert(std::is_same_v<Table, Derived>, "fragment table entry != CuTe's derivation");
  CHECK(int(size(Table{})) == int(size(Derived{})), "hd %d %s size", hd, what);
}

template <class Element, int kHeadDim, bool kFallback>
void check_traits(bool print_only) {
  using Tr = typename BwdTraitsFor<Element, kHeadDim, kFallback>::type;
  using F = typename Tr::FragmentLayouts;
  if (print_only) {
    constexpr BwdTileConfig c = BwdTraitsFor<Element, kHeadDim, kFallback>::kConfig;
    std::printf("template <>\nstruct BwdFragmentLayouts<%d, %d, %d, %d, %d, %d, %d> {\n",
                kHeadDim, c.block_m, c.block_n, c.warps, c.atom_m_sdp, c.atom_n_dkv, c.atom_m_dq);
  }
  using SdP = typename Tr::TiledMmaSdP;
  using dKV = typename Tr::TiledMmadKV;
  using dQ = typename Tr::TiledMmadQ;
  check_operand<typename F::SdpA, true, SdP, typename Tr::SmemLayoutQ, Element>("SdpA", kHeadDim, print_only);
  check_operand<typename F::SdpB, false, SdP, typename Tr::SmemLayoutKV, Element>("SdpB", kHeadDim, print_only);
  check_operand<typename F::DkvA, true, dKV, typename Tr::SmemLayoutPdSt, Element>("DkvA", kHeadDim, print_only);
  check_operand<typename F::DkvB, false, dKV, typename Tr::SmemLayoutQt, Element>("DkvB", kHeadDim, print_only);
  check_operand<typename F::DqA, true, dQ, typename Tr::SmemLayoutPdS, Element>("DqA", kHeadDim, print_only);
  check_operand<typename F::DqB, false, dQ, typename Tr::SmemLayoutKt, Element>("DqB", kHeadDim, print_only);
  if (print_only) {
    std::printf("};\n\n");
    return;
  }
  // The accumulators (BwdTraits::AccLayout*, spelled out by formula).
  using AccSdP = decltype(partition_fragment_C(SdP{}, Shape<Int<Tr::kBlockM>, Int<Tr::kBlockN>>{}));
  using AccdKV = decltype(partition_fragment_C(dKV{}, Shape<Int<Tr::kBlockN>, Int<kHeadDim>>{}));
  using AccdQ = decltype(partition_fragment_C(dQ{}, Shape<Int<Tr::kBlockM>, Int<kHeadDim>>{}));
  static_assert(std::is_same_v<AccSdP, decltype(make_tensor<float>(typename Tr::AccLayoutSdP{}))>);
  static_assert(std::is_same_v<AccdKV, decltype(make_tensor<float>(typename Tr::AccLayoutdKV{}))>);
  static_assert(std::is_same_v<AccdQ, decltype(make_tensor<float>(typename Tr::AccLayoutdQ{}))>);
}

template <int kHeadDim>
void check_head_dim(bool print_only) {
  check_traits<cutlass::bfloat16_t, kHeadDim, false>(print_only);
  if (print_only) return;
  check_traits<cutlass::bfloat16_t, kHeadDim, true>(false);
  check_traits<cutlass::half_t, kHeadDim, false>(false);
  check_traits<cutlass::half_t, kHeadDim, true>(false);
}

}  // namespace

int main() {
#ifdef FH_PRINT_TABLE
  constexpr bool kPrint = true;
#else
  constexpr bool kPrint = false;
#endif
  check_head_dim<64>(kPrint);
  check_head_dim<96>(kPrint);
  check_head_dim<128>(kPrint);
  check_head_dim<192>(kPrint);
  check_head_dim<256>(kPrint);
  if (kPrint) return 0;
  std::printf("fragment tables of d 64 / 96 / 128 / 192 / 256 (bf16, fp16, tuned and fallback) "
              "equal CuTe's derivation\n");
  return host_check_exit();
}
