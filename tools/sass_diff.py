"""Compare the SASS of two builds of libflash_hopper.so kernel by kernel.

    python tools/sass_diff.py OLD.so NEW.so [--arch sm_90a] [--show 5]

A structural change (files split, policy types, comments moved) must leave every kernel's
instructions as they were: this lists the kernels only one build has and, for each kernel both
have, whether its instruction stream is identical once addresses, encodings and source-line
annotations are dropped (those change with any edit above a line). Exits 1 on any difference, 0
when every kernel of both builds is the same instruction for instruction. Needs cuobjdump (the
CUDA toolkit's, or the nvidia-cuda-cuobjdump wheel's nvidia/cu13/bin).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

_FUNCTION = re.compile(r"^\s+Function : (\S+)")
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_ARCH = re.compile(r"arch = (sm_\w+)")
# An anonymous namespace's mangled name hashes the source file's path: the same kernel built in
# another checkout gets another name.
_ANONYMOUS = re.compile(r"_GLOBAL__N__[0-9a-f]{8}_")


def _cuobjdump() -> str:
    exe = shutil.which("cuobjdump")
    if exe is None:
        wheel = Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump")
        exe = next((str(p) for p in wheel), None)
    if exe is None:
        sys.exit("sass_diff: cuobjdump not found (CUDA toolkit or pip install "
                 "nvidia-cuda-cuobjdump)")
    return exe


def kernels(library: Path, arch: str | None) -> dict[tuple[str, str], list[str]]:
    """{(arch, mangled name): instructions}: each instruction's text without its address, its
    encoding or a trailing comment; branch targets as offsets are kept (they move only when the
    code before them changes)."""
    text = subprocess.run([_cuobjdump(), "-sass", str(library)], capture_output=True, text=True,
                          check=True).stdout
    out: dict[tuple[str, str], list[str]] = {}
    current: list[str] | None = None
    where = "?"
    for line in text.splitlines():
        m = _ARCH.search(line)
        if m:
            where = m.group(1)
            continue
        m = _FUNCTION.match(line)
        if m:
            name = _ANONYMOUS.sub("_GLOBAL__N__path_", m.group(1))
            current = out.setdefault((where, name), []) if arch in (None, where) else None
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            current.append(" ".join(m.group(1).split()))
    return out


def _opcode(instruction: str) -> str:
    """The opcode, past a guard predicate (@P0, @!UP1)."""
    words = instruction.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--arch", default=None, help="only this arch (e.g. sm_90a, sm_80)")
    ap.add_argument("--show", type=int, default=5, help="differing kernels to detail")
    args = ap.parse_args(argv)
    old, new = kernels(args.old, args.arch), kernels(args.new, args.arch)
    only_old = sorted(set(old) - set(new))
    only_new = sorted(set(new) - set(old))
    differ = [k for k in sorted(set(old) & set(new)) if old[k] != new[k]]
    same = len(set(old) & set(new)) - len(differ)
    print(f"{same} kernels identical, {len(differ)} differ, {len(only_old)} only in {args.old}, "
          f"{len(only_new)} only in {args.new}")
    for arch, name in only_old:
        print(f"  only old: {arch} {name}")
    for arch, name in only_new:
        print(f"  only new: {arch} {name}")
    for key in differ[:args.show]:
        a = collections.Counter(_opcode(i) for i in old[key])
        b = collections.Counter(_opcode(i) for i in new[key])
        delta = {op: b[op] - a[op] for op in sorted(set(a) | set(b)) if a[op] != b[op]}
        print(f"  differs: {key[0]} {key[1]}: {len(old[key])} -> {len(new[key])} instructions; "
              f"opcode count changes {delta or 'none (order or operands)'}")
    return 1 if differ or only_old or only_new else 0


if __name__ == "__main__":
    sys.exit(main())
