"""Per-kernel SASS facts of a built libflash_hopper.so: registers, spills, instruction counts.

    python bench/sass_check.py build/dev/libflash_hopper.so [--json OUT.json]

Needs cuobjdump (CUDA toolkit, or the nvidia-cuda-cuobjdump wheel). Reports, for every kernel:
REG / STACK / LOCAL / SHARED from `cuobjdump -res-usage`, and counts of HGMMA (WGMMA; QGMMA for
FP8), HMMA
(mma.sync), UTMALDG (TMA loads), USETMAXREG, LDL / STL (local-memory spills) and WARPGROUP.ARRIVE
from `cuobjdump -sass`. Exits 1 if an sm90 main kernel has no HGMMA, an sm90 kernel touches local memory, or has its
wgmmas serialized: ptxas does that to a whole kernel when it cannot keep a wgmma in flight
(C7512 / C7515 in its output: too few registers, a wgmma behind a run-time branch or in flight
across a loop's back edge), and then fences every HGMMA with its own WARPGROUP.ARRIVE (one per
HGMMA, instead of one per batch of K/16; bench/PERFLOG.md "sass_check.py catches serialized
wgmmas": it cost the backward much of its speed).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

_COUNTED = ("HGMMA", "QGMMA", "HMMA", "UTMALDG", "UTMASTG", "USETMAXREG", "LDL", "STL",
            "WARPGROUP.ARRIVE")


def _demangle(names: list[str]) -> dict[str, str]:
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                             check=True).stdout.splitlines()
        return dict(zip(names, out))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def _per_function(text: str, header: str):
    """(arch, function, line) for each line of cuobjdump output after a function header."""
    arch, name = "?", None
    for line in text.splitlines():
        m = re.search(r"arch = (sm_\w+)", line)
        if m:
            arch = m.group(1)
        m = re.match(header, line)
        if m:
            name = m.group(1)
            continue
        if name:
            yield arch, name, line


def kernel_facts(lib: str) -> list[dict]:
    def dump(flag: str) -> str:
        return subprocess.run(["cuobjdump", flag, lib], capture_output=True, text=True,
                              check=True).stdout

    facts: dict[tuple[str, str], dict] = {}
    for arch, name, line in _per_function(dump("-res-usage"), r"\s*Function (\S+):"):
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and (arch, name) not in facts:
            facts[(arch, name)] = {"arch": arch, "kernel": name, "registers": int(m.group(1)),
                                   "stack": int(m.group(2)), "static_shared": int(m.group(3)),
                                   "local": int(m.group(4))}
    for arch, name, line in _per_function(dump("-sass"), r"\s*Function : (\S+)"):
        f = facts.get((arch, name))
        if f is not None:
            for op in _COUNTED:
                if re.search(rf"\b{re.escape(op)}[\s.;]", line):
                    f[op] = f.get(op, 0) + 1
    names = _demangle([f["kernel"] for f in facts.values()])
    out = []
    for f in facts.values():
        f["kernel"] = names.get(f["kernel"], f["kernel"])
        for op in _COUNTED:
            f.setdefault(op, 0)
        out.append(f)
    return sorted(out, key=lambda f: (f["arch"], f["kernel"]))


def wgmmas(f: dict) -> int:
    """WGMMA instructions: HGMMA (16-bit inputs) and QGMMA (FP8)."""
    return f["HGMMA"] + f["QGMMA"]


def serialized(f: dict) -> bool:
    """Every WGMMA fenced on its own: the kernel's wgmmas were serialized by ptxas."""
    return wgmmas(f) > 0 and f["WARPGROUP.ARRIVE"] >= wgmmas(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lib")
    ap.add_argument("--json", help="write the facts here")
    args = ap.parse_args()
    facts = kernel_facts(args.lib)
    bad = 0
    for f in facts:
        sm90 = f["arch"].startswith("sm_90")
        spills = f["LDL"] + f["STL"] + f["local"]
        flag = ""
        # The main kernels must run on WGMMA; the backward's postprocess is plain CUDA.
        main_kernel = re.search(r"sm90::(fwd|bwd)_kernel<", f["kernel"]) is not None
        if sm90 and "sm90" in f["kernel"] and (
                (main_kernel and wgmmas(f) == 0) or spills or serialized(f)):
            flag = "  <-- FAIL"
            bad += 1
        short = re.sub(r"flash_hopper::|cutlass::|, ?", lambda m: "," if "," in m.group(0) else "",
                       f["kernel"])[:90]
        print(f"{f['arch']:7} reg {f['registers']:3} stack {f['stack']:4} local {f['local']:4} "
              f"HGMMA {f['HGMMA']:4} QGMMA {f['QGMMA']:3} HMMA {f['HMMA']:4} TMA {f['UTMALDG']:3} "
              f"SETMAXREG {f['USETMAXREG']} LDL/STL {f['LDL']}/{f['STL']} "
              f"ARRIVE {f['WARPGROUP.ARRIVE']:3}  {short}{flag}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(facts, fh, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
