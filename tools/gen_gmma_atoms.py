#!/usr/bin/env python3
"""Writes kernels/sm90/common/gmma_atoms.h: the WGMMA atoms of the widths the FA-3 path's tiles
need that CuTe's base headers lack, and the selectors that hand them out.

CuTe declares WGMMA atoms of N = 8 / 16 / 32 / 64 / 96 / 128 / 192 / 256 in its base headers; every
other multiple of 8 lives in its extended headers (CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED), which
with the sparse ones they bring are most of a forward unit's front-end time (bench/PERFLOG.md
has the measurement). The tiles use five of those widths (WIDTHS below). This script
writes those atoms (smem x smem operands, fp32 accumulators, the instruction PTX's wgmma.mma_async
with the same operands in the same order as CuTe's own atoms, so the SASS is the same) with their
MMA_Traits, and ss_op_selector / rs_op_selector, which return them for those widths and CuTe's base
selectors' answer for every other.

A tile that needs another width fails the kernel traits' "one atom spans the tile" static_assert:
add the width here and run `python3 tools/gen_gmma_atoms.py` (tests/test_gmma_atoms.py checks that
the checked-in header is this script's output).
"""

from __future__ import annotations

import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "kernels" / "sm90" / "common" / "gmma_atoms.h"

# (PTX type, CuTe element type, atom K, whether the instruction takes transpose immediates):
# 16-bit operands may be MN-major (tnspA / tnspB); FP8 operands are K-major only.
TYPES = {
    "F16F16": ("f16", "cutlass::half_t", 16, True),
    "BF16BF16": ("bf16", "cutlass::bfloat16_t", 16, True),
    "E4M3E4M3": ("e4m3", "cutlass::float_e4m3_t", 32, False),
}
# The widths CuTe's base headers lack that the tiles use, per operand type
# (kernels/sm90/fwd/tile_config.h, kernels/sm90/bwd/tile_config.h).
WIDTHS = {
    "F16F16": (80, 112, 176),
    "BF16BF16": (80, 112, 176),
    "E4M3E4M3": (160, 224),
}


def atom_name(types: str, n: int) -> str:
    _, _, k, _ = TYPES[types]
    return f"SS_64x{n}x{k}_F32{types}"


def operand_list(names: list[str], per_line: int, indent: str) -> str:
    lines = [", ".join(names[i:i + per_line]) for i in range(0, len(names), per_line)]
    return (",\n" + indent).join(lines)


def atom(types: str, n: int) -> str:
    ptx, _, k, transposes = TYPES[types]
    regs = n // 2  # fp32 accumulators per thread: 64 x n over 128 threads
    name = atom_name(types, n)
    d_params = operand_list([f"float& d{i}" for i in range(regs)], 6, " " * 6)
    d_ops = operand_list([f'"+f"(d{i})' for i in range(regs)], 6, " " * 10)
    d_refs = operand_list([f"%{i}" for i in range(regs)], 12, "")
    a, b, scale_d = regs, regs + 1, regs + 2
    imms = [f"%{scale_d + 1 + i}" for i in range(4 if transposes else 2)]
    imm_ops = ['"n"(int32_t(scaleA))', '"n"(int32_t(scaleB))']
    if transposes:
        imm_ops += ['"n"(int32_t(tnspA))', '"n"(int32_t(tnspB))']
        tparams = ("template <GMMA::Major tnspA, GMMA::Major tnspB,\n"
                   "          GMMA::ScaleIn scaleA = GMMA::ScaleIn::One,\n"
                   "          GMMA::ScaleIn scaleB = GMMA::ScaleIn::One>")
    else:
        tparams = ("template <GMMA::ScaleIn scaleA = GMMA::ScaleIn::One,\n"
                   "          GMMA::ScaleIn scaleB = GMMA::ScaleIn::One>")
    asm_regs = "\\n\"\n        \"".join(d_refs.split("\n"))
    return f"""// 64 x {n} x {k}, fp32 += {ptx} x {ptx}, A and B from shared memory.
{tparams}
struct {name} {{
  using DRegisters = void;
  using ARegisters = uint64_t[1];
  using BRegisters = uint64_t[1];
  using CRegisters = float[{regs}];

  CUTE_HOST_DEVICE static void fma(
      uint64_t const& desc_a, uint64_t const& desc_b,
      {d_params},
      GMMA::ScaleOut const scale_d = GMMA::ScaleOut::One) {{
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
    asm volatile(
        "{{\\n"
        ".reg .pred p;\\n"
        "setp.ne.b32 p, %{scale_d}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ptx}.{ptx} {{"
        "{asm_regs}}}, "
        "%{a}, %{b}, p, {", ".join(imms)};\\n"
        "}}\\n"
        : {d_ops}
        : "l"(desc_a), "l"(desc_b), "r"(int32_t(scale_d)),
          {", ".join(imm_ops)});
#else
    CUTE_INVALID_CONTROL_PATH("{name} needs sm_90a");
#endif
  }}
}};
"""


def traits(types: str, n: int) -> str:
    _, element, k, transposes = TYPES[types]
    name = atom_name(types, n)
    if transposes:
        tparams = ("template <GMMA::Major tnspA, GMMA::Major tnspB, GMMA::ScaleIn scaleA, "
                   "GMMA::ScaleIn scaleB>")
        args = "tnspA, tnspB, scaleA, scaleB"
        frg_a, frg_b = "GMMA::smem_desc<tnspA>", "GMMA::smem_desc<tnspB>"
    else:
        tparams = "template <GMMA::ScaleIn scaleA, GMMA::ScaleIn scaleB>"
        args = "scaleA, scaleB"
        frg_a = frg_b = "GMMA::smem_desc<GMMA::Major::K>"
    return f"""{tparams}
struct MMA_Traits<flash_hopper::sm90::gmma::{name}<{args}>> {{
  using ValTypeD = float;
  using ValTypeA = {element};
  using ValTypeB = {element};
  using ValTypeC = float;
  using FrgTypeA = {frg_a};
  using FrgTypeB = {frg_b};
  using Shape_MNK = Shape<_64, Int<{n}>, Int<{k}>>;
  using ThrID = Layout<_128>;
  using ALayout = GMMA::ABLayout<64, {k}>;
  using BLayout = GMMA::ABLayout<{n}, {k}>;
  using CLayout = GMMA::CLayout_64xN<{n}>;
  GMMA::ScaleOut accumulate_ = GMMA::ScaleOut::One;
}};
"""


def selector() -> str:
    cases = []
    for types, (_, element, _, transposes) in TYPES.items():
        for n in WIDTHS[types]:
            args = "MajorA, MajorB" if transposes else ""
            check = ("" if transposes else
                     "\n      static_assert(MajorA == GMMA::Major::K && MajorB == GMMA::Major::K,"
                     "\n                    \"FP8 operands are K-major\");")
            cases.append(
                f"    }} else if constexpr (is_same_v<ElementA, {element}> && kN == {n}) {{"
                f"{check}\n"
                f"      return {atom_name(types, n)}<{args}>{{}};")
    body = "\n".join(cases)
    return f"""// GMMA::ss_op_selector's answer with the atoms above: the one atom of a tile's width where
// this header has it, CuTe's base selector's otherwise.
template <class ElementA, class ElementB, class ElementC, class TileShape,
          GMMA::Major MajorA = GMMA::Major::K, GMMA::Major MajorB = GMMA::Major::K>
CUTE_HOST_DEVICE constexpr auto ss_op_selector() {{
  constexpr int kN = decltype(cute::size<1>(TileShape{{}}))::value;
  if constexpr (!is_same_v<ElementA, ElementB> || !is_same_v<ElementC, float>) {{
    return GMMA::ss_op_selector<ElementA, ElementB, ElementC, TileShape, MajorA, MajorB>();
{body}
  }} else {{
    return GMMA::ss_op_selector<ElementA, ElementB, ElementC, TileShape, MajorA, MajorB>();
  }}
}}

// GMMA::rs_op_selector: A from registers. No width of this header is needed with it, so CuTe's
// base selector's answer (a width it lacks fails the traits' "one atom spans the tile" check).
template <class ElementA, class ElementB, class ElementC, class TileShape,
          GMMA::Major MajorA = GMMA::Major::K, GMMA::Major MajorB = GMMA::Major::K>
CUTE_HOST_DEVICE constexpr auto rs_op_selector() {{
  return GMMA::rs_op_selector<ElementA, ElementB, ElementC, TileShape, MajorA, MajorB>();
}}
"""


def header() -> str:
    atoms = "\n".join(atom(t, n) for t in TYPES for n in WIDTHS[t])
    trait_defs = "\n".join(traits(t, n) for t in TYPES for n in WIDTHS[t])
    widths = "; ".join(f"{t} {' / '.join(map(str, WIDTHS[t]))}" for t in TYPES)
    return f"""// Generated by tools/gen_gmma_atoms.py (run it to change this file; its docstring says why).
// WGMMA atoms of the widths CuTe's base headers lack that the FA-3 path's tiles use, smem x smem,
// fp32 accumulators ({widths}),
// and the op selectors the kernel traits take their atoms from.
#pragma once

#include <cstdint>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

namespace flash_hopper {{
namespace sm90 {{
namespace gmma {{

namespace GMMA = cute::SM90::GMMA;
using cute::is_same_v;
// The GMMA mma_unpack (C aliases D, descriptors for shared-memory operands), found through these
// atoms' namespace as it is through CuTe's own.
using cute::SM90::GMMA::mma_unpack;

{atoms}
{selector()}
}}  // namespace gmma
}}  // namespace sm90
}}  // namespace flash_hopper

namespace cute {{

{trait_defs}
}}  // namespace cute
"""


def main() -> int:
    text = header()
    if "--check" in sys.argv:
        return 0 if OUT.read_text() == text else 1
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
